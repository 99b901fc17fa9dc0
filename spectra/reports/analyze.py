"""The report of ``spectra analyze``: the top eigenvalues, optionally the trace, the spectral
density, the per-layer spectra and their spread across repeats, of one model's Hessian (or
another curvature matrix) — its settings (:class:`AnalysisSettings`), its computation from
an operator (:func:`compute_analysis`), the report (:class:`AnalysisReport`, written to
``results.json``) and its figures (:func:`analysis_figures`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spectra._format import plus_minus
from spectra.analysis.per_layer import LayerwiseResult, layerwise
from spectra.analysis.repeats import RepeatResult, repeat_estimate, subsample_indices
from spectra.estimators.density import spectral_density, spectral_mass_below
from spectra.estimators.eigensolvers import eigenvalue_ratio, eigenvalues
from spectra.estimators.results import (
    EigenResult,
    SpectralDensity,
    SpectralMass,
    SpectralMoments,
    TraceResult,
)
from spectra.estimators.stochastic_trace import trace
from spectra.operators.registry import CURVATURES, DEFAULT_CURVATURE
from spectra.reports.base import CommandReport, EstimateSettings, input_problems
from spectra.reports.figures import (
    DrawnFigure,
    FigureOptions,
    describe_data,
    describe_eigensolver,
    describe_matrix,
    describe_model,
    finish_figure,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from scipy.sparse.linalg import LinearOperator

    from spectra.io.datasets import Data

__all__ = [
    "AnalysisReport",
    "AnalysisSettings",
    "analysis_figures",
    "compute_analysis",
    "layers_figure",
]

# The spectral mass below −τ·λ₁: the mass just below 0 cannot be resolved by Lanczos
# quadrature (the near-zero bulk of a trained network straddles 0), see
# spectra.estimators.density.spectral_mass_below.
_NEGATIVE_MASS_TAU = 0.01


@dataclass(frozen=True, kw_only=True)
class AnalysisSettings(EstimateSettings):
    """What ``spectra analyze`` computes, as its options of the same names (defaults as
    there): the estimates of :class:`EstimateSettings` (``top_k`` 5 here); with
    ``density`` the spectral density from ``density_probes`` probes of ``density_steps``
    Lanczos steps; with ``layers`` each layer's diagonal block; with ``repeats`` (at least
    2) every requested estimate rerun that many times, each on a random ``subsample``
    fraction of the data when given. ``curvature``: the registered matrix
    (:data:`spectra.operators.registry.CURVATURES`).
    """

    top_k: int = 5
    density: bool = False
    density_steps: int = 80
    density_probes: int = 10
    layers: bool = False
    curvature: str = DEFAULT_CURVATURE
    repeats: int | None = None
    subsample: float | None = None

    @property
    def matrix(self) -> str:
        """The title of the ``curvature`` matrix ("Hessian")."""
        return CURVATURES[self.curvature or DEFAULT_CURVATURE].title

    def record(self, dtype: str) -> dict[str, Any]:
        """The settings as ``results.json`` records them, with the products' ``dtype``:
        every option that decides the numbers."""
        return {
            **self.estimate_record(),
            "density": self.density,
            "density_steps": self.density_steps if self.density else None,
            "density_probes": self.density_probes if self.density else None,
            "layers": self.layers,
            "curvature": self.curvature,
            "dtype": dtype,
            "repeats": self.repeats,
            "subsample": self.subsample,
        }


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
    (:func:`spectra.reports.figures.figure_record`)."""


# --------------------------------------------------------------------------- computation


def compute_analysis(
    op: LinearOperator,
    settings: AnalysisSettings,
    *,
    command: str = "",
    loss: float | None = None,
    data: Data | None = None,
    build: Callable[[Data], LinearOperator] | None = None,
    progress: bool | None = None,
) -> AnalysisReport:
    """The analysis ``settings`` ask for of the operator ``op`` (its matrix at the model's
    weights), as an :class:`AnalysisReport`.

    ``loss``: the loss at the weights (default ``op.loss()``); ``command``: the command line
    recorded. With ``settings.subsample``, ``data`` (a :class:`spectra.io.datasets.Data`) is
    the data ``op`` was built on and ``build`` gives the operator of the same matrix on a
    subset of it (a ``Data``). ``progress`` as the estimators take it. The report's
    ``versions``, ``model``, ``data`` and ``files`` are left empty for the caller to record.

    Raises
    ------
    InputError
        a ``subsample`` fraction that leaves a subset without an example.
    """
    loss = op.loss() if loss is None else loss
    eig = eigenvalues(
        op,
        k=settings.top_k,
        method=settings.method,
        tol=settings.tol,
        seed=settings.seed,
        progress=progress,
    )
    ratio = eigenvalue_ratio(eig) if settings.top_k > 1 and eig.eigenvalues[-1] != 0 else None
    wall_times = {"eigenvalues": eig.wall_time}
    trace_result = None
    if settings.trace:
        trace_result = trace(
            op,
            method=settings.trace_method,
            num_products=settings.trace_products,
            seed=settings.seed,
            progress=progress,
        )
        wall_times["trace"] = trace_result.wall_time
    density = moments = negative = None
    if settings.density:
        density = spectral_density(
            op,
            num_steps=settings.density_steps,
            num_probes=settings.density_probes,
            seed=settings.seed,
            progress=progress,
        )
        moments = density.moments()
        negative = spectral_mass_below(
            density, tau=_NEGATIVE_MASS_TAU, lambda_max=float(eig.eigenvalues[0])
        )
        wall_times["density"] = density.wall_time
    layers = None
    if settings.layers:
        layers = layerwise(
            op,
            k=settings.top_k,
            trace=settings.trace,
            tol=settings.tol,
            num_probes=settings.trace_products,
            seed=settings.seed,
        )
        wall_times["layers"] = layers.wall_time
    repeats = None
    if settings.repeats is not None:
        full = {"eigenvalues": eig, "trace": trace_result, "density": density}
        full = {key: value for key, value in full.items() if value is not None}
        repeats = _repeat_estimates(settings, op, data, build, full, progress)
        wall_times["repeats"] = repeats.wall_time
    return AnalysisReport(
        command=command,
        versions={},
        settings=settings.record(str(op.dtype)),
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


def _repeat_estimates(
    settings: AnalysisSettings,
    op: LinearOperator,
    data: Data | None,
    build: Callable[[Data], LinearOperator] | None,
    full: dict[str, Any],
    progress: bool | None,
) -> RepeatResult:
    """Every requested estimate rerun ``settings.repeats`` times, as one
    :class:`RepeatResult` (quantities λ1..λk, then trace, then the density's trace(A)/n
    and trace(A²)/n); across subsets compared with ``full``, this run's results on all the
    data (the same keys as ``estimate`` returns), which gives the result's ``full_values``
    and ``shift``."""
    from spectra.io.datasets import Data

    assert settings.repeats is not None

    def estimate(matrix: Any, seed: int) -> dict[str, Any]:
        results: dict[str, Any] = {
            "eigenvalues": eigenvalues(
                matrix,
                k=settings.top_k,
                method=settings.method,
                tol=settings.tol,
                seed=seed,
                progress=False,
            )
        }
        if settings.trace:
            results["trace"] = trace(
                matrix,
                method=settings.trace_method,
                num_products=settings.trace_products,
                seed=seed,
                progress=False,
            )
        if settings.density:
            results["density"] = spectral_density(
                matrix,
                num_steps=settings.density_steps,
                num_probes=settings.density_probes,
                seed=seed,
                progress=False,
            )
        return results

    if settings.subsample is None:
        return repeat_estimate(
            estimate, op, repeats=settings.repeats, seed=settings.seed, progress=progress
        )
    if data is None or build is None:
        raise ValueError("a subsample needs the data and a build function for its operators")

    def subset_operator(arrays: tuple[np.ndarray, ...]) -> LinearOperator:
        subset = Data(
            x=arrays[0],
            y=arrays[1],
            sample_weight=arrays[2] if len(arrays) > 2 else None,
            name=data.name,
            num_examples=len(arrays[0]),
            description=data.description,
        )
        return build(subset)

    with input_problems("--subsample"):
        subsample_indices(data.num_examples, settings.subsample, settings.seed, 0)
    return repeat_estimate(
        estimate,
        data=data.as_tuple(),
        build=subset_operator,
        subsample=settings.subsample,
        repeats=settings.repeats,
        seed=settings.seed,
        progress=progress,
        full=full,
    )


# --------------------------------------------------------------------------- figures


def analysis_figures(report: AnalysisReport, options: FigureOptions) -> list[DrawnFigure]:
    """The figures of ``report``, not yet saved: the eigenvalues, the spectral density (when
    computed) and the per-layer spectra (when computed), drawn as ``options`` ask, named by
    the settings the report records (:meth:`AnalysisSettings.from_record`)."""
    from spectra.plotting import plot_eigenvalues, plot_spectral_density, repeats_description

    settings = AnalysisSettings.from_record(report.settings)
    eig = report.eigenvalues
    repeats = report.repeats
    if repeats is not None and not any(name.startswith("λ") for name in repeats.names):
        repeats = None
    dtype = report.settings["dtype"]
    matrix = settings.matrix
    style = options.style
    font = options.resolved_font()
    legend = options.legend
    annotate = None if options.labels else False
    where = (
        describe_model(report.model),
        describe_data(report.data),
        describe_matrix(settings, report.model),
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
        log_scale=options.log_scale,
        repeats=repeats,
        annotate=annotate,
        legend=legend,
        style=style,
        font=font,
    )
    count = eig.eigenvalues.size
    figure = finish_figure(
        ax,
        options,
        f"Top eigenvalue of the {matrix}"
        if count == 1
        else f"Top {count} eigenvalues of the {matrix}",
        (*where[:2], describe_eigensolver(settings.method, settings.tol, count, dtype)),
        (f"{eig.num_products} products", bars, known_trace),
        matrix=where[2],
        seed=settings.seed,
    )
    figures = [DrawnFigure("eigenvalues_figure", "eigenvalues", figure)]
    if report.density is not None:
        density = report.density
        negative = options.density_negative
        ax = plot_spectral_density(
            density,
            log_scale=options.density_log,
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
            options,
            f"Spectral density of the {matrix}",
            (
                *where[:2],
                f"stochastic Lanczos quadrature, {density.num_probes} probes × "
                f"{settings.density_steps} steps, Gaussian σ = {sigma:.2g}",
                band if repeats is not None else None,
            ),
            (
                f"{density.num_products} products",
                None if repeats is not None else band,
                side,
                known_trace,
            ),
            matrix=where[2],
            seed=settings.seed,
        )
        figures.append(DrawnFigure("density_figure", "density", figure))
    if report.layers is not None:
        figure = layers_figure(report.layers, settings, options, matrix, where)
        figures.append(DrawnFigure("layers_figure", "layers", figure))
    return figures


def layers_figure(
    layers: LayerwiseResult,
    settings: AnalysisSettings,
    options: FigureOptions,
    matrix: str,
    where: Sequence[str],
) -> Figure:
    """Per-layer top eigenvalues (and traces) as bar charts, one row per layer, side by side
    on one figure of the style's width whose height grows with the number of layers;
    ``where`` describes the model, the data and the matrix (the captions' first phrases)."""
    from spectra.plotting import (
        block_symbol,
        figure_size,
        figure_style,
        new_figure,
        plot_layerwise,
    )

    style = options.style or "column"
    panels = 2 if layers.traces is not None else 1
    width, _ = figure_size(style)
    # Two panels: stacked in a column, side by side on a page. Each panel takes a row per
    # layer (0.2 in: a 7 pt label and its bar) plus its axis label and legend (1.2 in).
    stacked = panels == 2 and style == "column"
    height = (1.2 + 0.2 * len(layers.groups)) * (2 if stacked else 1)
    font = options.resolved_font()
    figure, axes = new_figure(
        style,
        aspect=min(1.6, max(0.45, height / width)),
        nrows=2 if stacked else 1,
        ncols=1 if stacked else panels,
        font=font,
    )
    axes = np.atleast_1d(axes).ravel()
    symbol = CURVATURES[settings.curvature or DEFAULT_CURVATURE].symbol
    shown: Mapping[str, Any] = {
        "legend": options.legend,
        "annotate": None if options.labels else False,
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
        options,
        f"Per-layer spectra of the {matrix}: diagonal blocks {block_symbol(symbol)}",
        (
            *where[:2],
            f"block Lanczos in lock-step, k = {settings.top_k}, tol = {settings.tol:g}",
        ),
        (
            f"trace: Hutchinson, {settings.trace_products} probes per layer"
            if settings.trace
            else None,
            f"{layers.num_products} products in {layers.num_operator_calls} data passes",
        ),
        matrix=where[2],
        seed=settings.seed,
    )
