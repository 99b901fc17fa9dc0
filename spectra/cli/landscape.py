"""``spectra landscape MODEL``: the loss along the top eigenvector(s) and a random direction.

The options become a :class:`spectra.reports.landscape.LandscapeSettings`; the landscape,
its report and figures are :mod:`spectra.reports.landscape`'s; this module loads the inputs,
prints and saves.
"""

from __future__ import annotations

import argparse

import numpy as np

from spectra.cli._common import (
    Console,
    UserError,
    bound_note,
    check_builder_use,
    data_description,
    drawing_options,
    figure_font,
    figure_names,
    finish_outputs,
    input_settings,
    load_data,
    load_operator,
    locked_output,
    model_description,
    report_errors,
    versions,
    write_outputs,
)
from spectra.cli._parser import common_options, eigen_options, positive_float, positive_int
from spectra.reports.figures import DrawnFigure, FigureOptions, figure_record
from spectra.reports.landscape import (
    LANDSCAPE_MAX_EVALUATIONS,
    LANDSCAPE_POINTS,
    LandscapeReport,
    LandscapeSettings,
    compute_landscape,
    landscape_figures,
    planned_evaluations,
)

_RESULTS = "landscape.json"
_FIGURES = ("landscape_1d", "landscape_2d")


def check_cost(args: argparse.Namespace) -> int:
    """The planned number of loss evaluations, refused above
    :data:`LANDSCAPE_MAX_EVALUATIONS` without ``--force`` (before anything is loaded)."""
    count = planned_evaluations(args.directions, args.points)
    if count > LANDSCAPE_MAX_EVALUATIONS and not args.force:
        surface = " (a --directions 2 surface grows as N²)" if args.directions == 2 else ""
        raise UserError(
            f"--points {args.points} means {count:,} loss evaluations, one pass over the data "
            f"each{surface}, more than the {LANDSCAPE_MAX_EVALUATIONS:,} run without --force: "
            f"give fewer --points (the default {LANDSCAPE_POINTS} takes "
            f"{planned_evaluations(args.directions, LANDSCAPE_POINTS):,}), or --force to run "
            "it anyway."
        )
    return count


def add_arguments(commands: argparse._SubParsersAction) -> None:
    """Register ``spectra landscape`` and its options with the subcommand parsers ``commands``."""
    landscape = commands.add_parser(
        "landscape",
        parents=[common_options(), eigen_options()],
        help="loss along the top eigenvector(s) and a random direction",
        description="The loss L(θ + α d) for d the top Hessian eigenvector v₁ (and v₂), and a "
        "random direction (filter-normalized as in Li et al. 2018, then scaled to unit norm), "
        "so that α is the Euclidean distance in parameter space for every curve; the quadratic "
        "model along v₁ is drawn for comparison. Writes DIR/landscape.json, "
        "DIR/landscape_1d.png and, with --directions 2, the surface L(θ + α v₁ + β v₂) in "
        "DIR/landscape_2d.png.",
    )
    landscape.add_argument(
        "model",
        metavar="MODEL",
        help="a .keras file, or a .weights.h5 file or tf.train.Checkpoint with --builder",
    )
    landscape.add_argument(
        "--directions",
        type=int,
        choices=(1, 2),
        default=1,
        help="eigenvectors to follow: 1 (v₁) or 2 (v₁, v₂ and the 2-D surface) (default 1)",
    )
    landscape.add_argument(
        "--radius",
        type=positive_float,
        metavar="R",
        help="α runs over [-R, R], a distance in parameter space (default: scaled to the "
        "curvature, R = 2·√(2L/λ₁), where the quadratic model along v₁ raises the loss L by 4L)",
    )
    landscape.add_argument(
        "--points",
        type=positive_int,
        default=LANDSCAPE_POINTS,
        metavar="N",
        help=f"points per direction; an even N is raised by one so that α = 0 is included, "
        f"N = 1 evaluates α = 0 only (default {LANDSCAPE_POINTS}). Each point costs one pass "
        f"over the data: 1-D curves take (directions + 1)·N + 1 passes, --directions 2 adds "
        f"N² + 1; runs of more than {LANDSCAPE_MAX_EVALUATIONS:,} passes are refused without "
        "--force",
    )
    landscape.add_argument(
        "--force",
        action="store_true",
        help=f"run a landscape of more than {LANDSCAPE_MAX_EVALUATIONS:,} loss evaluations "
        "(the estimate of its cost is printed first)",
    )
    landscape.add_argument(
        "--restart",
        action="store_true",
        help="remove the files of the previous spectra run in DIR (those its "
        ".spectra-manifest.json lists, nothing else) before writing; without it a DIR "
        "holding another run's files is refused",
    )
    landscape.set_defaults(command_module="landscape")


def run(args: argparse.Namespace, console: Console) -> int:
    if args.directions == 2 and args.points < 3:
        raise UserError("--directions 2 draws a surface: it needs --points 3 or more.")
    check_cost(args)
    check_builder_use(args, [args.model])
    figure_font(args)
    options = drawing_options(args)
    with locked_output(args, [_RESULTS, *figure_names(_FIGURES, args.format)]) as out:
        report, figures = _compute(args, console, options)
        report.figures = figure_record(options, figures)
        write_outputs(out, report, _RESULTS, figures, args.format)
        _print(args, report, console)
        finish_outputs(out)
    return 0


def _settings(args: argparse.Namespace) -> LandscapeSettings:
    """The settings of the landscape the options ask for."""
    return LandscapeSettings(
        **input_settings(args),
        directions=args.directions,
        radius=args.radius,
        points=args.points,
        method=args.method,
        tol=args.tol,
    )


def _compute(
    args: argparse.Namespace, console: Console, options: FigureOptions
) -> tuple[LandscapeReport, list[DrawnFigure]]:
    data = load_data(args)
    model, size, op = load_operator(args, data)
    with report_errors():
        report = compute_landscape(
            model,
            op,
            data,
            _settings(args),
            command=args.command_line,
            announce=console.info,
            progress=console.progress,
        )
    report.versions = versions()
    report.model = model_description(args.model, model, size)
    report.data = data_description(args, data)
    return report, landscape_figures(report, options, base_loss=op.loss())


def _print(args: argparse.Namespace, report: LandscapeReport, console: Console) -> None:
    curves = report.curves
    console.info(
        f"{report.model['name']} ({report.model['num_parameters']:,} parameters) on "
        f"{report.data['name']} ({report.data['num_examples']} examples): loss "
        f"{curves.base_loss:.6g}"
    )
    console.info(f"radius: {report.radius['rule']}")
    eig = report.eigenvalues
    notes = [
        bound_note(bool(converged), eig.failure_probability)
        for converged in np.atleast_1d(eig.converged)
    ]
    if any(notes):
        console.warn(
            f"the {eig.method} eigenvalues are "
            f"{' '.join(dict.fromkeys(note for note in notes if note))}: v1 may not be the "
            "top eigenvector (--method lanczos certifies it)"
        )
    alphas = curves.alphas
    for label in curves.labels:
        losses = curves.losses[label]
        name = (
            label
            if label == "random"
            else f"{label} (λ = {report.eigenvalues.eigenvalues[int(label[1:]) - 1]:.4g})"
        )
        if alphas.size == 1:
            console.info(f"  {name}: loss at α = 0: {losses[0]:.6g}")
        else:
            console.info(
                f"  {name}: loss at α = {alphas[0]:.3g}: {losses[0]:.4g}, "
                f"at α = {alphas[-1]:.3g}: {losses[-1]:.4g}"
            )
    console.info(f"results: {report.files['results']}")
    figures = [p for key, paths in report.files.items() if key.endswith("_figure") for p in paths]
    console.info(f"figures: {', '.join(figures)}")
