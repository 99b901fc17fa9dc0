"""``spectra analyze MODEL``: eigenvalues, trace, spectral density and per-layer spectra of one
model's Hessian (or another ``--curvature`` matrix)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from spectra._format import count_text, plus_minus
from spectra.analysis.per_layer import LayerwiseResult, layerwise
from spectra.analysis.repeats import RepeatResult, repeat_estimate, subsample_indices
from spectra.cli._common import (
    DEFAULT_FAILURE_PROBABILITY,
    CommandReport,
    Console,
    UserError,
    bound_holds,
    bound_note,
    check_builder_use,
    data_description,
    describe_data,
    describe_eigensolver,
    describe_matrix,
    describe_model,
    examples_note,
    figure_font,
    figure_names,
    figure_record,
    finish_figure,
    finish_outputs,
    load_data,
    load_operator,
    locked_output,
    make_operator,
    matrix_title,
    measurement_settings,
    model_description,
    number_settings,
    user_errors,
    versions,
    write_outputs,
)
from spectra.cli._curvature import CURVATURES, DEFAULT_CURVATURE, curvature_choice
from spectra.cli._parser import _positive_int, common_options, eigen_options, trace_options
from spectra.estimators.density import spectral_density, spectral_mass_below
from spectra.estimators.eigensolvers import eigenvalue_ratio, eigenvalues
from spectra.estimators.eigenvalue_bounds import FLOOR_FACTOR
from spectra.estimators.results import (
    EigenResult,
    SpectralDensity,
    SpectralMass,
    SpectralMoments,
    TraceResult,
)
from spectra.estimators.stochastic_trace import trace

# The spectral mass below −τ·λ₁: the mass just below 0 cannot be resolved by Lanczos
# quadrature (the near-zero bulk of a trained network straddles 0), see
# spectra.estimators.density.spectral_mass_below.
_NEGATIVE_MASS_TAU = 0.01
_RESULTS = "results.json"
_FIGURES = ("eigenvalues", "density", "layers")


@dataclass
class AnalysisReport(CommandReport):
    """Everything ``spectra analyze`` computed, as written to ``results.json``.

    With ``--layers``: ``layers`` is the :class:`spectra.LayerwiseResult` (one list entry
    per layer in each field) and ``layer_table`` the same as one row per layer (name,
    size, eigenvalues, error bounds, converged, and with ``--trace`` trace and its
    standard error)."""

    model: dict[str, Any]
    loss: float
    eigenvalues: EigenResult
    eigenvalue_ratio: float | None
    trace: TraceResult | None
    density: SpectralDensity | None
    density_moments: SpectralMoments | None
    negative_mass: SpectralMass | None
    layers: LayerwiseResult | None
    layer_table: list[dict[str, Any]] | None
    num_products: int
    num_data_passes: int
    wall_times: dict[str, float]
    files: dict[str, Any]
    """The paths written (``results``, ``*_figure`` lists), and ``not_written`` (file name
    to reason) when some could not be (a full disk)."""
    repeats: RepeatResult | None = None
    """With ``--repeats R``: every requested estimate rerun R times (seeds ``--seed`` ..
    ``--seed + R - 1``; with ``--subsample f`` each on a random subset of the data, drawn as
    ``repeats.subset_rule`` says), see :class:`spectra.RepeatResult`."""
    figures: dict[str, Any] | None = None
    """How the figures were drawn (``settings``: style, font, title, caption, legend,
    labels) and each one's title and full caption, as its file's metadata holds them
    (:func:`spectra.cli._common.figure_record`)."""


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
        "--top-k", type=_positive_int, default=5, metavar="K", help="eigenvalues (default 5)"
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
        type=_positive_int,
        default=80,
        metavar="M",
        help="Lanczos steps per probe (default 80)",
    )
    group.add_argument(
        "--density-probes",
        type=_positive_int,
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
    settings = measurement_settings(args)
    check_builder_use(args, [args.model])
    with locked_output(args, [_RESULTS, *figure_names(_FIGURES, args.format)]) as out:
        data = load_data(args)
        model, size, op = load_operator(args, data)
        loss = op.loss()
        loaded = time.perf_counter()
        report = _compute(args, console, settings, op, loss, model=model, data=data)
        report.model = model_description(args.model, model, size)
        report.data = data_description(args, data, model)
        report.wall_times["load"] = loaded - started
        figures = _figures(args, report)
        report.figures = figure_record(args, figures)
        report.wall_times["total"] = time.perf_counter() - started
        write_outputs(out, report, _RESULTS, figures, args.format)
        _print(report, console)
        finish_outputs(out)
    return 0


def _check_repeats(args: argparse.Namespace) -> None:
    """``--repeats`` at least 2, ``--subsample`` a fraction in (0, 1] and only with
    ``--repeats`` (one line, exit status 2); whether a subset keeps an example is checked
    once the data is loaded."""
    repeats, subsample = getattr(args, "repeats", None), getattr(args, "subsample", None)
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


def _repeat_estimates(
    args: argparse.Namespace,
    console: Console,
    op: Any,
    model: Any,
    data: Any,
    full: dict[str, Any] | None = None,
) -> RepeatResult:
    """Every requested estimate rerun ``--repeats`` times, as one :class:`RepeatResult`
    (quantities λ1..λk, then trace, then the density's trace(A)/n and trace(A²)/n); across
    subsets compared with ``full``, this run's results on all the data (the same keys as
    ``estimate`` returns), which gives the result's ``full_values`` and ``shift``."""
    from spectra.io.datasets import Data

    def estimate(matrix: Any, seed: int) -> dict[str, Any]:
        results: dict[str, Any] = {
            "eigenvalues": eigenvalues(
                matrix, k=args.top_k, method=args.method, tol=args.tol, seed=seed, progress=False
            )
        }
        if args.trace:
            results["trace"] = trace(
                matrix,
                method=args.trace_method,
                num_products=args.trace_products,
                seed=seed,
                progress=False,
            )
        if args.density:
            results["density"] = spectral_density(
                matrix,
                num_steps=args.density_steps,
                num_probes=args.density_probes,
                seed=seed,
                progress=False,
            )
        return results

    if args.subsample is None:
        return repeat_estimate(
            estimate, op, repeats=args.repeats, seed=args.seed, progress=console.progress
        )

    def build(arrays: tuple[Any, ...]) -> Any:
        subset = Data(
            x=arrays[0],
            y=arrays[1],
            sample_weight=arrays[2] if len(arrays) > 2 else None,
            name=data.name,
            num_examples=len(arrays[0]),
            description=data.description,
        )
        return make_operator(model, args, subset)

    with user_errors("--subsample"):
        subsample_indices(data.num_examples, args.subsample, args.seed, 0)
    return repeat_estimate(
        estimate,
        data=data.as_tuple(),
        build=build,
        subsample=args.subsample,
        repeats=args.repeats,
        seed=args.seed,
        progress=console.progress,
        full=full,
    )


def _compute(
    args: argparse.Namespace,
    console: Console,
    settings: Any,
    op: Any,
    loss: float,
    *,
    model: Any = None,
    data: Any = None,
) -> AnalysisReport:
    eig = eigenvalues(
        op,
        k=args.top_k,
        method=args.method,
        tol=args.tol,
        seed=args.seed,
        progress=console.progress,
    )
    ratio = eigenvalue_ratio(eig) if args.top_k > 1 and eig.eigenvalues[-1] != 0 else None
    wall_times = {"eigenvalues": eig.wall_time}
    trace_result = None
    if args.trace:
        trace_result = trace(
            op,
            method=args.trace_method,
            num_products=args.trace_products,
            seed=args.seed,
            progress=console.progress,
        )
        wall_times["trace"] = trace_result.wall_time
    density = moments = negative = None
    if args.density:
        density = spectral_density(
            op,
            num_steps=args.density_steps,
            num_probes=args.density_probes,
            seed=args.seed,
            progress=console.progress,
        )
        moments = density.moments()
        negative = spectral_mass_below(
            density, tau=_NEGATIVE_MASS_TAU, lambda_max=float(eig.eigenvalues[0])
        )
        wall_times["density"] = density.wall_time
    layers = None
    if args.layers:
        layers = layerwise(
            op,
            k=args.top_k,
            trace=args.trace,
            tol=args.tol,
            num_probes=args.trace_products,
            seed=args.seed,
        )
        wall_times["layers"] = layers.wall_time
    repeats = None
    if getattr(args, "repeats", None) is not None:
        full = {"eigenvalues": eig, "trace": trace_result, "density": density}
        full = {key: value for key, value in full.items() if value is not None}
        repeats = _repeat_estimates(args, console, op, model, data, full)
        wall_times["repeats"] = repeats.wall_time
    return AnalysisReport(
        command=args.command_line,
        versions=versions(),
        settings={
            **number_settings(args, settings),
            "density": args.density,
            "density_steps": args.density_steps if args.density else None,
            "density_probes": args.density_probes if args.density else None,
            "layers": args.layers,
            "curvature": args.curvature,
            "dtype": str(op.dtype),
            "repeats": getattr(args, "repeats", None),
            "subsample": getattr(args, "subsample", None),
        },
        data={},
        model={},
        loss=loss,
        eigenvalues=eig,
        eigenvalue_ratio=ratio,
        trace=trace_result,
        density=density,
        density_moments=moments,
        negative_mass=negative,
        layers=layers,
        layer_table=None if layers is None else layers.rows(),
        num_products=op.num_hvps,
        num_data_passes=op.num_data_passes,
        wall_times=wall_times,
        files={},
        repeats=repeats,
    )


def _figures(args: argparse.Namespace, report: AnalysisReport) -> list[tuple[str, str, Any]]:
    """The figures of the report as ``(files key, file stem, figure)``, not yet saved, in
    ``--style`` with the title and caption ``--no-title`` and ``--caption`` ask for."""
    from spectra.plotting import plot_eigenvalues, plot_spectral_density, repeats_description

    eig = report.eigenvalues
    repeats = report.repeats
    if repeats is not None and not any(name.startswith("λ") for name in repeats.names):
        repeats = None
    dtype = report.settings["dtype"]
    matrix = matrix_title(args)
    style = getattr(args, "style", None)
    font = figure_font(args)
    legend = not getattr(args, "no_legend", False)
    annotate = False if getattr(args, "no_labels", False) else None
    where = (
        describe_model(report.model),
        describe_data(report.data),
        describe_matrix(args, report.model),
    )
    known_trace = (
        None
        if report.trace is None
        else f"trace {plus_minus(report.trace.estimate, report.trace.stderr)}"
    )
    bars = "bars: eigenvalue error bounds"
    if repeats is not None:
        spread = f"spread across {repeats_description(repeats)}"
        bars = f"bars: eigenvalue error bounds of this run, and the {spread} (sd)"
        if known_trace is not None and "trace" in repeats.names:
            j = repeats.quantity("trace")
            across = plus_minus(float(repeats.mean[j]), float(repeats.sd[j]))
            known_trace += (
                f" (this run; s.e. across probes), {across} across "
                f"{repeats_description(repeats)} (mean ± sd)"
            )
    ax = plot_eigenvalues(
        eig,
        log_scale=args.log_scale,
        repeats=repeats,
        annotate=annotate,
        legend=legend,
        style=style,
        font=font,
    )
    count = eig.eigenvalues.size
    figure = finish_figure(
        ax,
        args,
        f"Top eigenvalue of the {matrix}"
        if count == 1
        else f"Top {count} eigenvalues of the {matrix}",
        (*where[:2], describe_eigensolver(args, count, dtype)),
        (f"{eig.num_products} products", bars, known_trace),
        matrix=where[2],
    )
    figures: list[tuple[str, str, Any]] = [("eigenvalues_figure", "eigenvalues", figure)]
    if report.density is not None:
        density = report.density
        negative = getattr(args, "density_negative", True)
        ax = plot_spectral_density(
            density,
            log_scale=getattr(args, "density_log", True),
            negative=negative,
            legend=legend,
            style=style,
            font=font,
        )
        sigma = density.default_sigma()
        side = None
        if density.positive_semidefinite:
            side = "positive semidefinite: drawn on λ ≥ 0"
        elif not negative:
            side = "λ < 0 not drawn (--no-density-negative)"
        band = None
        if density.num_probes > 1:
            band = "band: ±2 standard errors across probes"
            if repeats is not None:
                # The repeats' spread is not drawn on the density: say whose band it is.
                band = (
                    "band: this run's ±2 standard errors across its probes, not the "
                    f"spread across {repeats_description(repeats)}"
                )
        figure = finish_figure(
            ax,
            args,
            f"Spectral density of the {matrix}",
            (
                *where[:2],
                f"stochastic Lanczos quadrature, {density.num_probes} probes × "
                f"{args.density_steps} steps, Gaussian σ = {sigma:.2g}",
                band if repeats is not None else None,
            ),
            (
                f"{density.num_products} products",
                None if repeats is not None else band,
                side,
                known_trace,
            ),
            matrix=where[2],
        )
        figures.append(("density_figure", "density", figure))
    if report.layers is not None:
        figure = _layers_figure(args, report.layers, matrix, where)
        figures.append(("layers_figure", "layers", figure))
    return figures


def _layers_figure(
    args: argparse.Namespace, layers: LayerwiseResult, matrix: str, where: tuple[str, ...]
) -> Any:
    """Per-layer top eigenvalues (and traces) as bar charts, one row per layer, side by side
    on one figure of ``--style``'s width whose height grows with the number of layers."""
    from spectra.plotting import (
        block_symbol,
        figure_size,
        figure_style,
        new_figure,
        plot_layerwise,
    )

    style = getattr(args, "style", None) or "column"
    panels = 2 if layers.traces is not None else 1
    width, _ = figure_size(style)
    # Two panels: stacked in a column, side by side on a page. Each panel takes a row per
    # layer (0.2 in: a 7 pt label and its bar) plus its axis label and legend (1.2 in).
    stacked = panels == 2 and style == "column"
    height = (1.2 + 0.2 * len(layers.groups)) * (2 if stacked else 1)
    font = figure_font(args)
    figure, axes = new_figure(
        style,
        aspect=min(1.6, max(0.45, height / width)),
        nrows=2 if stacked else 1,
        ncols=1 if stacked else panels,
        font=font,
    )
    axes = np.atleast_1d(axes).ravel()
    symbol = curvature_choice(args.curvature).symbol
    shown = {
        "legend": not getattr(args, "no_legend", False),
        "annotate": False if getattr(args, "no_labels", False) else None,
        "style": style,
        "font": font,
    }
    with figure_style(style, font=font):
        plot_layerwise(layers, ax=axes[0], symbol=symbol, **shown)
        if panels == 2:
            plot_layerwise(layers, quantity="trace", symbol=symbol, ax=axes[1], **shown)
            if not stacked:
                axes[1].set_yticklabels([])
                axes[1].set_ylabel("")
    return finish_figure(
        figure,
        args,
        f"Per-layer spectra of the {matrix}: diagonal blocks {block_symbol(symbol)}",
        (*where[:2], f"block Lanczos in lock-step, k = {args.top_k}, tol = {args.tol:g}"),
        (
            f"trace: Hutchinson, {args.trace_products} probes per layer" if args.trace else None,
            f"{layers.num_products} products in {layers.num_operator_calls} data passes",
        ),
        matrix=where[2],
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
