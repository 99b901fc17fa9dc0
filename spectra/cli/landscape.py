"""``spectra landscape MODEL``: the loss along the top eigenvector(s) and a random direction."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from spectra.cli._common import (
    CommandReport,
    Console,
    UserError,
    apply_loss_weights,
    bound_note,
    check_builder_use,
    data_description,
    describe_data,
    describe_eigensolver,
    describe_matrix,
    describe_model,
    figure_font,
    figure_names,
    figure_record,
    finish_figure,
    finish_outputs,
    load_data,
    load_operator,
    locked_output,
    matrix_title,
    model_description,
    operator_loss,
    seed_generator_states,
    user_errors,
    versions,
    write_outputs,
)
from spectra.cli._parser import _positive_float, _positive_int, common_options, eigen_options
from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.results import EigenResult

# The landscape's α grid when --points is not given: enough points in the quadratic region.
LANDSCAPE_POINTS = 41
# The most loss evaluations (data passes) ``spectra landscape`` runs without --force: 2,000
# is 2 curves of 1,000 points, or a 2-D surface of 44² points (the default 41 points give
# 2·41 + 1 = 83 evaluations in 1-D and 41² + 2·41 + 1 = 1,764 with --directions 2).
LANDSCAPE_MAX_EVALUATIONS = 2000
_RESULTS = "landscape.json"
_FIGURES = ("landscape_1d", "landscape_2d")
# The default radius is this many times √(2L/λ₁), where the quadratic model along v₁ raises
# the loss L by L (doubles it); at the radius it raises it by (2²)·L.
_RADIUS_MULTIPLE = 2.0
_FALLBACK_RADIUS = 1.0


@dataclass
class LandscapeReport(CommandReport):
    """What ``spectra landscape`` computed, as written to ``landscape.json``."""

    model: dict[str, Any]
    eigenvalues: EigenResult
    radius: dict[str, Any]
    directions: dict[str, str]
    curves: Any
    surface: Any
    files: dict[str, Any]
    figures: dict[str, Any] | None = None
    """How the figures were drawn and each one's title and full caption
    (:func:`spectra.cli._common.figure_record`)."""


def default_radius(loss: float, top_eigenvalue: float) -> tuple[float, str]:
    """The α range scaled to the curvature, R = 2·√(2L/λ₁), and how it was chosen.

    Along the top eigenvector the quadratic model raises the loss by λ₁α²/2, which equals
    the loss L itself at α = √(2L/λ₁): the curve doubles there, and at α = R the model predicts
    a rise of 4L, far enough to show where the quadratic region ends. Falls back to
    R = 1 when L or λ₁ is not positive.
    """
    if loss > 0 and top_eigenvalue > 0 and math.isfinite(loss) and math.isfinite(top_eigenvalue):
        radius = _RADIUS_MULTIPLE * math.sqrt(2.0 * loss / top_eigenvalue)
        return radius, f"R = 2·√(2L/λ₁) = {radius:.3g} (L = {loss:.4g}, λ₁ = {top_eigenvalue:.4g})"
    return _FALLBACK_RADIUS, (
        f"R = {_FALLBACK_RADIUS:g} (the curvature rule 2·√(2L/λ₁) needs L > 0 and λ₁ > 0)"
    )


def step_grid(radius: float, points: int) -> np.ndarray:
    """α values: one point is α = 0; otherwise an odd number of points evenly over [-R, R]."""
    if points == 1:
        return np.zeros(1)
    half = points // 2
    return np.linspace(-radius, radius, 2 * half + 1)


def planned_evaluations(directions: int, points: int) -> int:
    """Loss evaluations (one data pass each) of a landscape of ``points`` per direction.

    The curves along v₁ (and v₂) and the random direction take N points each plus one at
    the weights themselves; with two directions the surface adds N² + 1, where N is
    ``points`` raised to odd (:func:`step_grid`). The eigenvectors, the loss and the
    gradient at the weights cost a few passes more.
    """
    size = 1 if points == 1 else 2 * (points // 2) + 1
    count = (directions + 1) * size + 1
    if directions == 2:
        count += size * size + 1
    return count


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
        type=_positive_float,
        metavar="R",
        help="α runs over [-R, R], a distance in parameter space (default: scaled to the "
        "curvature, R = 2·√(2L/λ₁), where the quadratic model along v₁ raises the loss L by 4L)",
    )
    landscape.add_argument(
        "--points",
        type=_positive_int,
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
    with locked_output(args, [_RESULTS, *figure_names(_FIGURES, args.format)]) as out:
        report, figures = _compute(args, console)
        report.figures = figure_record(args, figures)
        write_outputs(out, report, _RESULTS, figures, args.format)
        _print(args, report, console)
        finish_outputs(out)
    return 0


def _compute(
    args: argparse.Namespace, console: Console
) -> tuple[LandscapeReport, list[tuple[str, str, Any]]]:
    data = load_data(args)
    model, size, op = load_operator(args, data)
    from spectra.analysis.landscape import loss_landscape, random_direction

    base_loss = op.loss()
    eig = eigenvalues(
        op,
        k=args.directions,
        method=args.method,
        tol=args.tol,
        seed=args.seed,
        progress=console.progress,
        return_eigenvectors=True,
    )
    assert eig.eigenvectors is not None
    top = float(eig.eigenvalues[0])
    if args.radius is None:
        radius, rule = default_radius(base_loss, top)
    else:
        radius, rule = args.radius, f"R = {args.radius:g} (--radius)"
    _check_radius(model, op, radius, rule)
    alphas = step_grid(radius, args.points)
    random = random_direction(op, args.seed, normalization="filter")
    random /= np.linalg.norm(random)
    directions = {f"v{i + 1}": eig.eigenvectors[:, i] for i in range(args.directions)}
    directions["random"] = random
    common = {
        "batch_size": args.batch_size,
        "training": args.training,
        "dtype": np.float64 if args.float64 else None,
    }
    evaluated = model
    if args.training and args.float64:
        evaluated = _seeded_float64_copy(model, args.seed)
        apply_loss_weights(evaluated, args, like=model)
        common["dtype"] = None
    loss = operator_loss(args)
    _announce_cost(args, console, evaluated, data, common)
    with user_errors():
        curves = loss_landscape(evaluated, loss, data.as_tuple(), directions, alphas, **common)
    surface = None
    if args.directions == 2:
        plane = {label: directions[label] for label in ("v1", "v2")}
        with user_errors():
            surface = loss_landscape(
                evaluated, loss, data.as_tuple(), plane, alphas, betas=alphas, **common
            )
    _check_finite(curves, surface, radius, rule, base_loss, top)
    slope = float(op.gradient().astype(np.float64) @ directions["v1"])
    report = LandscapeReport(
        command=args.command_line,
        versions=versions(),
        settings={
            "loss": args.loss,
            "loss_weights": args.loss_weights,
            "directions": args.directions,
            "radius": radius,
            "points": int(alphas.size),
            "method": args.method,
            "tol": args.tol,
            "batch_size": args.batch_size,
            "max_examples": args.max_examples,
            "float64": args.float64,
            "training": args.training,
            "seed": args.seed,
            "builder": args.builder,
            "matrix": matrix_title(args),
            "dtype": str(op.dtype),
        },
        model=model_description(args.model, model, size),
        data=data_description(args, data),
        eigenvalues=eig,
        radius={"value": radius, "rule": rule, "slope_along_v1": slope},
        directions={
            **{
                f"v{i + 1}": f"unit eigenvector of λ{i + 1} (sign as returned)"
                for i in range(args.directions)
            },
            "random": "Gaussian, filter-normalized (Li et al. 2018), scaled to unit norm",
        },
        curves=curves,
        surface=surface,
        files={},
    )
    return report, _figures(args, report, alphas, base_loss, slope)


def _seeded_float64_copy(model: Any, seed: int) -> Any:
    """The float64 copy of ``model`` that ``loss_landscape(dtype=np.float64)`` would make,
    with its seed generator states set from ``seed``: a copy rebuilt from the config gets
    fresh random states, which in training mode would give other Dropout masks in every
    process."""
    from spectra.operators import keras_calls

    with user_errors():
        copy = keras_calls.model_in_dtype(model, "float64")
    seed_generator_states(copy, seed)
    return copy


def _check_radius(model: Any, op: Any, radius: float, rule: str) -> None:
    """Refuse a radius that takes some weight beyond the largest number of the products'
    dtype: at θ + α d with |α| ≤ R and a unit d, no weight exceeds max|θ| + R."""
    largest = max(float(np.max(np.abs(v.numpy()), initial=0.0)) for v in model.trainable_weights)
    limit = float(np.finfo(op.dtype).max)
    if not largest + radius < limit:
        raise UserError(
            f"the radius {rule} takes the weights to {largest + radius:.3g}, beyond the "
            f"largest {np.dtype(op.dtype).name} number {limit:.3g}: give a smaller --radius "
            "(without it the radius is scaled to the curvature)."
        )


def _check_finite(
    curves: Any, surface: Any, radius: float, rule: str, base_loss: float, top: float
) -> None:
    """Refuse a landscape with a NaN or infinite loss, naming the point nearest the weights
    where it is (before anything is written): such a radius leaves where the model's
    arithmetic holds."""
    if not math.isfinite(base_loss):
        raise UserError(f"the loss at the model's weights is {base_loss}, not finite.")
    found = [
        (label, float(alpha), float(value))
        for label in curves.labels
        for alpha, value in zip(curves.alphas, curves.losses[label])
        if not math.isfinite(value)
    ]
    if surface is not None and not found:
        bad = np.argwhere(~np.isfinite(surface.losses_2d))
        if bad.size:
            i, j = bad[0]
            found = [("the v₁-v₂ plane", float(surface.alphas[i]), float(surface.losses_2d[i, j]))]
    if found:
        label, alpha, value = max(found, key=lambda item: -abs(item[1]))
        suggested, _ = default_radius(base_loss, top)
        raise UserError(
            f"the loss is {value} at α = {alpha:.3g} along {label} ({len(found)} points not "
            f"finite): the radius {rule} leaves the region where the model's arithmetic "
            f"holds; give a smaller --radius (the curvature-scaled default here is "
            f"{suggested:.3g})."
        )


def _announce_cost(
    args: argparse.Namespace, console: Console, model: Any, data: Any, common: dict[str, Any]
) -> None:
    """Print the planned loss evaluations and an estimate of their time.

    The estimate is the time per evaluation of a probe of 11 evaluations at the weights,
    timed after a first, untimed probe that pays TensorFlow's one-off start-up; the
    probe's own tracing is included, so the estimate errs high.
    """
    from spectra.analysis.landscape import loss_landscape

    count = planned_evaluations(args.directions, args.points)
    zero = {"probe": np.zeros(sum(int(np.prod(v.shape)) for v in model.trainable_weights))}
    with user_errors():
        for n in (1, 10):
            probe = loss_landscape(
                model, operator_loss(args), data.as_tuple(), zero, np.zeros(n), **common
            )
    per_pass = probe.wall_time / probe.num_evaluations
    console.info(
        f"landscape: {count:,} loss evaluations (one pass over {data.num_examples:,} examples "
        f"each), about {count * per_pass:.2g} s or less ({per_pass:.2g} s per pass)"
    )


def _figures(
    args: argparse.Namespace,
    report: LandscapeReport,
    alphas: np.ndarray,
    base_loss: float,
    slope: float,
) -> list[tuple[str, str, Any]]:
    """The figures as ``(files key, file stem, figure)``, not yet saved, in ``--style``
    with the title and caption ``--no-title`` and ``--caption`` ask for."""
    from spectra.plotting import format_value, plot_loss_landscape_1d, plot_loss_landscape_2d

    eig, curves = report.eigenvalues, report.curves
    bounds = list(np.ravel(eig.error_bounds)) if eig.error_bounds is not None else []
    names = {}
    for i, (symbol, value) in enumerate(zip(("v₁", "v₂"), eig.eigenvalues)):
        bound = float(bounds[i]) if i < len(bounds) else None
        names[f"v{i + 1}"] = f"{symbol} (λ{symbol[1:]} = {format_value(float(value), bound)})"
    names["random"] = "random direction"
    top = float(eig.eigenvalues[0])
    quadratic = base_loss + slope * alphas + 0.5 * top * alphas**2
    where = (
        describe_model(report.model),
        describe_data(report.data),
        describe_matrix(args, report.model),
    )
    solver = describe_eigensolver(args, args.directions, report.settings["dtype"])
    style = getattr(args, "style", None)
    font = figure_font(args)
    ax = plot_loss_landscape_1d(
        alphas,
        {names[label]: curves.losses[label] for label in curves.labels},
        xlabel="Distance α in parameter space",
        references={"quadratic model of v₁: L + α gᵀv₁ + λ₁α²/2": (names["v1"], quadratic)},
        legend=not getattr(args, "no_legend", False),
        style=style,
        font=font,
    )
    figure = finish_figure(
        ax,
        args,
        "Loss along the top Hessian eigenvector"
        + ("s" if args.directions == 2 else "")
        + " and a random direction",
        (*where[:2], solver),
        (report.radius["rule"], f"{alphas.size} points"),
        matrix=where[2],
    )
    figures: list[tuple[str, str, Any]] = [("curves_figure", "landscape_1d", figure)]
    if report.surface is not None:
        ax = plot_loss_landscape_2d(
            alphas,
            alphas,
            report.surface.losses_2d,
            labels=("v₁", "v₂"),
            style=style,
            font=font,
        )
        figure = finish_figure(
            ax,
            args,
            "Loss surface in the plane of the top two Hessian eigenvectors",
            (*where[:2], solver),
            (report.radius["rule"], f"{alphas.size}² points"),
            matrix=where[2],
        )
        figures.append(("surface_figure", "landscape_2d", figure))
    return figures


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
