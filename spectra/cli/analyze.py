"""``spectra analyze MODEL``: eigenvalues, trace, spectral density and per-layer spectra of one
model's Hessian (or another ``--curvature`` matrix).

The options become an :class:`spectra.reports.analyze.AnalysisSettings`; the analysis, its
report and figures are :mod:`spectra.reports.analyze`'s; this module loads the inputs,
prints and saves.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from spectra._format import count_text, plus_minus
from spectra.analysis.per_layer import LayerwiseResult
from spectra.analysis.repeats import RepeatResult
from spectra.cli._common import (
    Console,
    UserError,
    bound_note,
    check_builder_use,
    data_description,
    drawing_options,
    estimate_settings,
    examples_note,
    figure_font,
    figure_names,
    finish_outputs,
    input_settings,
    load_data,
    load_operator,
    locked_output,
    make_operator,
    model_description,
    report_errors,
    user_errors,
    versions,
    write_outputs,
)
from spectra.cli._parser import common_options, eigen_options, positive_int, trace_options
from spectra.estimators.eigenvalue_bounds import FLOOR_FACTOR
from spectra.operators.registry import CURVATURES, DEFAULT_CURVATURE
from spectra.reports.analyze import (
    AnalysisReport,
    AnalysisSettings,
    analysis_figures,
    compute_analysis,
)
from spectra.reports.base import DEFAULT_FAILURE_PROBABILITY, bound_holds
from spectra.reports.figures import FigureOptions, figure_record

_RESULTS = "results.json"
_FIGURES = ("eigenvalues", "density", "layers")


def add_arguments(commands: argparse._SubParsersAction) -> None:
    """Register ``spectra analyze`` and its options with the subcommand parsers ``commands``."""
    analyze = commands.add_parser(
        "analyze",
        parents=[common_options(value_labels=True), eigen_options(), trace_options()],
        help="eigenvalues, trace, spectral density and per-layer spectra of one model's loss "
        "Hessian (or GGN, Fisher)",
        description="Top eigenvalues (with error bounds), optionally the trace (± standard "
        "error) and the spectral density (stochastic Lanczos quadrature) of the Hessian of a "
        "model's dataset loss (or of another --curvature matrix). Writes DIR/results.json, "
        "DIR/eigenvalues.png, with --density DIR/density.png and with --layers "
        "DIR/layers.png (one file per --format).",
    )
    analyze.add_argument(
        "model",
        metavar="MODEL",
        help="a .keras file, or a .weights.h5 file or tf.train.Checkpoint with --builder",
    )
    analyze.add_argument(
        "--top-k", type=positive_int, default=5, metavar="K", help="eigenvalues (default 5)"
    )
    analyze.add_argument(
        "--log-scale", action="store_true", help="eigenvalue figure on a logarithmic axis"
    )
    analyze.add_argument(
        "--curvature",
        choices=tuple(CURVATURES),
        default=DEFAULT_CURVATURE,
        help="the curvature matrix: the loss Hessian, the generalized Gauss-Newton matrix, "
        "the Monte Carlo Fisher (labels sampled with --seed) or the empirical Fisher "
        f"(default {DEFAULT_CURVATURE})",
    )
    analyze.add_argument(
        "--layers",
        action="store_true",
        help="also the top --top-k eigenvalues of each layer's diagonal block (and, with "
        "--trace, its Hutchinson trace from --trace-products probes per layer), all layers "
        "in one data pass per step; writes DIR/layers.png",
    )
    group = analyze.add_argument_group("spectral density")
    group.add_argument("--density", action="store_true", help="estimate the spectral density")
    group.add_argument(
        "--density-steps",
        type=positive_int,
        default=80,
        metavar="M",
        help="Lanczos steps per probe (default 80)",
    )
    group.add_argument(
        "--density-probes",
        type=positive_int,
        default=10,
        metavar="P",
        help="random probes (default 10; one probe gives no standard error)",
    )
    group.add_argument(
        "--density-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the density figure's density axis on a log scale, clipped at 1e-6 of the "
        "peak, so that the bulk and the outliers both show (default); --no-density-log "
        "draws it linear from 0",
    )
    group.add_argument(
        "--density-negative",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draw the negative side of the spectrum, λ < 0 (default); --no-density-negative "
        "draws λ >= 0 only (the caption says so). A positive semidefinite matrix (--curvature "
        "ggn, fisher-mc, fisher-empirical) is drawn on λ >= 0 either way: it has no mass "
        "below 0",
    )
    group = analyze.add_argument_group("uncertainty across seeds and data")
    group.add_argument(
        "--repeats",
        type=int,
        metavar="R",
        help="rerun every requested estimate (eigenvalues, --trace, --density) R >= 2 times "
        "with seeds --seed..--seed+R-1 and report the mean, standard deviation and a 95%% "
        "confidence interval beside the numerical bound (default: once)",
    )
    group.add_argument(
        "--subsample",
        type=float,
        metavar="F",
        help="with --repeats: rebuild the matrix for each repeat on a random subset of a "
        "fraction 0 < F <= 1 of the examples (drawn from --seed without replacement), so "
        "that the spread says how much the numbers depend on the data",
    )
    analyze.add_argument(
        "--restart",
        action="store_true",
        help="remove the files of the previous spectra run in DIR (those its "
        ".spectra-manifest.json lists, nothing else) before writing; without it a DIR "
        "holding another run's files is refused",
    )
    analyze.set_defaults(command_module="analyze")


def run(args: argparse.Namespace, console: Console) -> int:
    started = time.perf_counter()
    _check_repeats(args)
    figure_font(args)
    settings = _settings(args)
    with user_errors():
        settings.measurement()
    check_builder_use(args, [args.model])
    with locked_output(args, [_RESULTS, *figure_names(_FIGURES, args.format)]) as out:
        data = load_data(args)
        model, size, op = load_operator(args, data)
        loss = op.loss()
        loaded = time.perf_counter()
        with report_errors():
            report = compute_analysis(
                op,
                settings,
                command=args.command_line,
                loss=loss,
                data=data,
                build=lambda subset: make_operator(model, args, subset),
                progress=console.progress,
            )
        report.versions = versions()
        report.model = model_description(args.model, model, size)
        report.data = data_description(args, data, model)
        report.wall_times["load"] = loaded - started
        options = _figure_options(args)
        figures = analysis_figures(report, options)
        report.figures = figure_record(options, figures)
        report.wall_times["total"] = time.perf_counter() - started
        write_outputs(out, report, _RESULTS, figures, args.format)
        _print(report, console)
        finish_outputs(out)
    return 0


def _settings(args: argparse.Namespace) -> AnalysisSettings:
    """The settings of the analysis the options ask for."""
    return AnalysisSettings(
        **input_settings(args),
        **estimate_settings(args),
        density=args.density,
        density_steps=args.density_steps,
        density_probes=args.density_probes,
        layers=args.layers,
        curvature=args.curvature,
        repeats=args.repeats,
        subsample=args.subsample,
    )


def _figure_options(args: argparse.Namespace) -> FigureOptions:
    return drawing_options(
        args,
        labels=not args.no_labels,
        log_scale=args.log_scale,
        density_log=args.density_log,
        density_negative=args.density_negative,
    )


def _check_repeats(args: argparse.Namespace) -> None:
    """``--repeats`` at least 2, ``--subsample`` a fraction in (0, 1] and only with
    ``--repeats`` (one line, exit status 2); whether a subset keeps an example is checked
    once the data is loaded."""
    repeats, subsample = args.repeats, args.subsample
    if repeats is not None and repeats < 2:
        raise UserError(
            f"--repeats must be at least 2 (a spread needs two runs), got {repeats}: leave "
            "it out for a single run."
        )
    if subsample is None:
        return
    if repeats is None:
        raise UserError(
            f"--subsample {subsample:g} needs --repeats R (the number of subsets), e.g. "
            "--repeats 5; for one smaller data set use --max-examples."
        )
    if not (0 < subsample <= 1):
        raise UserError(
            f"--subsample must be a fraction of the data in (0, 1], got {subsample:g}: e.g. "
            "--subsample 0.5 for subsets of half the examples."
        )


def _print(report: AnalysisReport, console: Console) -> None:
    eig = report.eigenvalues
    dtype = report.settings["dtype"]
    examples = examples_note(report.data["num_examples"], report.settings.get("max_examples"))
    console.info(
        f"{report.model['name']} ({report.model['num_parameters']:,} parameters, {dtype}) on "
        f"{report.data['name']} ({examples}): loss {report.loss:.6g}"
    )
    top = (
        "top eigenvalue" if eig.eigenvalues.size == 1 else f"top {eig.eigenvalues.size} eigenvalues"
    )
    console.info(f"{top} ({eig.method}, ± error bound):")
    if dtype != "float64":
        floor = FLOOR_FACTOR * np.finfo(dtype).eps
        console.info(f"  ({dtype} products: bounds no tighter than {floor:.1e}·λ1)")
    which = "" if report.repeats is None else " (bound)"
    for index, (value, bound, residual, converged) in enumerate(
        zip(eig.eigenvalues, eig.error_bounds, eig.residual_norms, eig.converged), start=1
    ):
        note = bound_note(
            bool(converged),
            eig.failure_probability,
            value=float(value),
            bound=float(bound),
            tol=report.settings["tol"],
        )
        note = f"  {note}" if note else ""
        console.info(
            f"  λ{index} = {plus_minus(value, bound)}{which}   residual {residual:.1e}{note}"
            + _repeat_note(report.repeats, f"λ{index}")
        )
    if not all(bound_holds(c, eig.failure_probability) for c in np.atleast_1d(eig.converged)):
        console.warn(
            f"the {eig.method} bounds above are not all certified: use them as estimates "
            "(--method lanczos certifies its bounds with failure probability "
            f"{DEFAULT_FAILURE_PROBABILITY:g})"
        )
    if report.eigenvalue_ratio is not None:
        console.info(f"λ1/λ{eig.eigenvalues.size} = {report.eigenvalue_ratio:.4g}")
    if report.trace is not None:
        console.info(
            f"trace ({report.trace.method}) = "
            f"{plus_minus(report.trace.estimate, report.trace.stderr)} (standard error)"
            + _repeat_note(report.repeats, "trace")
        )
    if report.repeats is not None:
        _print_repeats(report, console)
    if report.layers is not None:
        _print_layers(report.layers, console)
    if report.negative_mass is not None:
        mass = report.negative_mass
        console.info(
            f"spectral mass below -{mass.tau:g}·λ1 = {mass.threshold:.3g}: "
            f"{plus_minus(mass.estimate, mass.error)} (error bar: quadrature resolution "
            "+ 2 standard errors across probes)"
        )
    console.info(
        f"{report.num_products:,} {report.settings['matrix']}-vector products in "
        f"{report.num_data_passes} data passes, {report.wall_times['total']:.1f} s"
    )
    console.detail(
        "wall times: " + ", ".join(f"{k} {v:.2f} s" for k, v in report.wall_times.items())
    )
    console.info(f"results: {report.files['results']}")
    figures = [
        path for key, paths in report.files.items() if key.endswith("_figure") for path in paths
    ]
    console.info(f"figures: {', '.join(figures)}")


def _repeat_note(repeats: RepeatResult | None, name: str) -> str:
    """For the quantity ``name`` of ``--repeats``: across seeds ``"   across 3 seeds:
    10.2 ± 0.6 (sd), mean 10.2 ± 0.7 (95% CI)"``; across subsets what the subset numbers
    are and how far they lie from this run's (full-data) value, ``"   λ1 of subsets of
    150 examples: 7.58 ± 0.25 (sd over 3); mean − this run's value = +1.29 (+5.2 sd); 95%
    CI of the mean over subsets of 150 examples: 7.58 ± 0.63"``; empty without."""
    if repeats is None or name not in repeats.names:
        return ""
    j = repeats.quantity(name)
    mean, sd = float(repeats.mean[j]), float(repeats.sd[j])
    half = float(repeats.ci_high[j]) - mean
    level = f"{100 * repeats.level:.3g}% CI"
    if repeats.subsample is None:
        return (
            f"   across {repeats.repeats} seeds: {plus_minus(mean, sd)} (sd), mean "
            f"{plus_minus(mean, half)} ({level})"
        )
    subsets = f"subsets of {count_text(int(repeats.subset_sizes[0]), 'example')}"
    note = f"   {name} of {subsets}: {plus_minus(mean, sd)} (sd over {repeats.repeats})"
    if repeats.full_values is not None and repeats.shift is not None:
        difference = mean - float(repeats.full_values[j])
        shift = float(repeats.shift[j])
        units = f" ({shift:+.1f} sd)" if np.isfinite(shift) else ""
        rounded = plus_minus(difference, sd).split(" ± ")[0]
        sign = "+" if difference >= 0 and not rounded.startswith("-") else ""
        note += f"; mean − this run's value = {sign}{rounded}{units}"
    return note + f"; {level} of the mean over {subsets}: {plus_minus(mean, half)}"


def _print_repeats(report: AnalysisReport, console: Console) -> None:
    """The density's moments across repeats, and what the spread means."""
    repeats = report.repeats
    assert repeats is not None
    moments = report.density_moments
    for name in repeats.names:
        if name.startswith("trace(A^") and moments is not None:
            p = int(name[len("trace(A^") :].split(")")[0])
            console.info(
                f"{name} = {plus_minus(moments.estimate[p], moments.stderr[p])} (standard "
                f"error){_repeat_note(repeats, name)}"
            )
    cost = f"{repeats.num_products:,} products in {repeats.num_operator_calls} data passes"
    if repeats.subsample is not None:
        size, total = int(repeats.subset_sizes[0]), int(repeats.num_examples or 0)
        console.info(
            f"(bound: this run's numerical error for its matrix, on all {total:,} examples; "
            f"subsets: {repeats.repeats} random subsets of {size:,} of {total:,} examples, "
            f"seeds {repeats.seeds[0]}..{repeats.seeds[-1]}: sd is how much the numbers "
            f"depend on the data, the mean and CI are those of data sets of {size:,} examples, not "
            f"this run's (λ_max of a smaller sample is larger on average: the shift from this "
            f"run's value is that bias); {cost})"
        )
    else:
        console.info(
            f"(bound: this run's numerical error; sd: spread across seeds "
            f"{repeats.seeds[0]}..{repeats.seeds[-1]}, the estimators' randomness only; {cost})"
        )


def _print_layers(layers: LayerwiseResult, console: Console) -> None:
    rows = layers.rows()
    width = max(len("layer"), *(len(row["group"]) for row in rows))
    header = f"  {'layer':<{width}}  {'parameters':>10}  {'λ1 ± error bound':<24}"
    if layers.traces is not None:
        header += "  trace ± standard error"
    console.info(
        f"per layer ({len(rows)} layers, {layers.num_products:,} products in "
        f"{layers.num_operator_calls} data passes):"
    )
    console.info(header)
    for row in rows:
        top = plus_minus(row["eigenvalues"][0], row["error_bounds"][0])
        line = f"  {row['group']:<{width}}  {row['size']:>10,}  {top:<24}"
        if "trace" in row:
            line += f"  {plus_minus(row['trace'], row['trace_stderr'])}"
        note = bound_note(row["converged"], layers.failure_probability)
        if note:
            line += f"  {note}"
        console.info(line.rstrip())


__all__ = ["AnalysisReport", "UserError", "run"]
