"""The report of ``spectra sharpness``: the top eigenvalue(s) of every checkpoint of a training
run — its settings (:class:`SharpnessRunSettings`), the mini-batch measurement of a checkpoint
(:func:`minibatch_record`), the report (:class:`SharpnessReport`, written to
``sharpness.json`` by :class:`spectra.analysis.trajectory.SharpnessRun`), what a recorded
checkpoint's bound proves (:func:`entry_certified`) and its figure
(:func:`sharpness_figures`).

The measurement itself is :func:`spectra.analysis.trajectory.measure_sharpness`; the run's
threshold comes from :mod:`spectra.reports.thresholds` and its x axes from
:mod:`spectra.reports.sharpness_axes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spectra._format import count_text
from spectra.analysis.minibatch import minibatch_sharpness
from spectra.analysis.stability import StabilityThreshold
from spectra.analysis.trajectory import SharpnessSettings
from spectra.operators.registry import CURVATURES, DEFAULT_CURVATURE
from spectra.reports.base import (
    DEFAULT_FAILURE_PROBABILITY,
    CommandReport,
    EstimateSettings,
    bound_holds,
)
from spectra.reports.figures import (
    DrawnFigure,
    FigureOptions,
    describe_data,
    describe_matrix,
    finish_figure,
)
from spectra.reports.sharpness_axes import x_positions

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from scipy.sparse.linalg import LinearOperator

    from spectra.analysis.trajectory import SharpnessMeasurement
    from spectra.io.datasets import Data

__all__ = [
    "SharpnessReport",
    "SharpnessRunSettings",
    "entry_certified",
    "entry_failure_probability",
    "minibatch_quantiles",
    "minibatch_record",
    "sharpness_figures",
    "side_of_threshold",
]


@dataclass(frozen=True, kw_only=True)
class SharpnessRunSettings(EstimateSettings):
    """What ``spectra sharpness`` measures at each checkpoint, as its options of the same
    names (defaults as there): the estimates of :class:`EstimateSettings` (``top_k`` 1), each
    eigensolve started from the previous checkpoint's eigenvectors with ``warm_start``;
    with ``per_batch`` also λ₁ on that many mini-batches of ``per_batch_size``
    examples; with ``preconditioned`` the matrix P⁻¹H of each checkpoint's optimizer state.
    ``lr`` overrides the recorded learning rate of the threshold; ``steps`` are the
    checkpoints' training steps (None: the numbers in their names); ``x_axis`` and
    ``steps_per_epoch`` choose the figure's x axis
    (:func:`spectra.reports.sharpness_axes.x_axes`).
    """

    warm_start: bool = True
    per_batch: int | None = None
    per_batch_size: int | None = None
    preconditioned: bool = False
    lr: float | None = None
    steps: list[int] | None = None
    x_axis: str | None = None
    steps_per_epoch: int | None = None

    @property
    def matrix(self) -> str:
        """The Hessian's title, and with ``preconditioned`` "preconditioned Hessian P⁻¹H"."""
        title = CURVATURES[DEFAULT_CURVATURE].title
        return f"preconditioned {title} P⁻¹H" if self.preconditioned else title

    def measurement(self) -> SharpnessSettings:
        """The settings of each checkpoint's measurement (the estimates', with
        ``warm_start`` and the mini-batches'), checked (``ValueError`` naming the
        setting)."""
        return dataclasses.replace(
            super().measurement(),
            warm_start=self.warm_start,
            per_batch=self.per_batch or 0,
            per_batch_size=self.per_batch_size,
        )

    def record(self) -> dict[str, Any]:
        """Every setting that decides the numbers, as ``sharpness.json`` records them (a
        resumed run must match them)."""
        return self.estimate_record()

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> SharpnessRunSettings:
        """The settings a ``sharpness.json`` record holds (:meth:`from_record` of its
        ``settings``; the matrix it names says whether it was preconditioned, its
        ``warm_start`` how the eigensolves started)."""
        record = report.get("settings") or {}
        return cls.from_record(
            record,
            preconditioned=record.get("matrix") == cls(preconditioned=True).matrix,
            warm_start=bool(report.get("warm_start", True)),
        )


@dataclass
class SharpnessReport(CommandReport):
    """A ``spectra sharpness`` run as written to ``sharpness.json``
    (:meth:`spectra.analysis.trajectory.SharpnessRun.report`), reloaded by :func:`spectra.load`.

    ``checkpoints`` holds one entry per checkpoint recorded so far, in step order: ``file``,
    ``step``, ``sha256``, ``path``, ``status`` (``"done"`` or ``"failed"``), ``error`` and
    the measurement (``eigenvalues`` largest first, ``error_bounds``, ``residual_norms``,
    ``converged``, ``trace``, ``trace_stderr``, ``loss``, ``eigenvector_overlap``,
    ``num_products``, ``wall_time``, …; None for a failed one), NaN where the file wrote
    null and said so. ``settings`` are the values a resume must match, ``plan`` every
    checkpoint of the run, ``summary`` the counts, ``threshold`` the stability threshold
    (:meth:`spectra.analysis.stability.StabilityThreshold.to_dict`) or None, ``model`` the
    model's description (None before the first measurement). :attr:`done`, :attr:`steps`,
    :attr:`eigenvalues` and :attr:`error_bounds` give the measured checkpoints as arrays.
    """

    format: str
    checkpoints_source: str
    step_source: str
    step_unit: str
    learning_rate: float | None
    learning_rate_source: str | None
    threshold: dict[str, Any] | None
    warm_start: bool
    plan: list[dict[str, Any]]
    summary: dict[str, int]
    checkpoints: list[dict[str, Any]]
    model: dict[str, Any] | None = None
    learning_rate_stored: float | None = None
    """The learning rate as the first checkpoint's optimizer stores it (a float32 read back,
    0.009999999776482582), None when no checkpoint records one; ``learning_rate`` is then
    the shortest decimal with the same float32 value (0.01), the threshold's η."""
    x_axis: str | None = None
    """``--x``: ``"steps"``, ``"epochs"``, or None for the file names' own numbers
    (``step_unit`` says what they count)."""
    x_axes: dict[str, Any] | None = None
    """Every x axis the run could place its checkpoints on (``"steps"``, ``"epochs"``), each
    ``{"source", "label", "values": {file: position}}``, so that ``spectra plot --x`` can
    switch between them; ``source`` is ``"--steps"``, ``"optimizer iterations"`` (the
    counter saved in each checkpoint), ``"file names"`` or, for epochs, the steps' source
    divided by ``--steps-per-epoch``."""
    dropped_threshold: dict[str, Any] | None = None
    """The recorded optimizer's threshold when it bounds the other matrix and is not drawn
    (:meth:`spectra.analysis.stability.StabilityThreshold.to_dict`; e.g. Adam's, which
    bounds λ_max(P⁻¹H), on a run measuring λ_max(H)), so that the figure can name it."""
    figures: dict[str, Any] | None = None
    """How the figure was drawn and its title and full caption, which the compact figure
    does not draw by default (:func:`spectra.reports.figures.figure_record`); None before a
    checkpoint is measured."""

    @property
    def done(self) -> list[dict[str, Any]]:
        """The entries of the checkpoints measured, in step order."""
        return [entry for entry in self.checkpoints if entry.get("status") == "done"]

    @property
    def steps(self) -> np.ndarray:
        """The steps (in :attr:`step_unit`) of the measured checkpoints, int64."""
        return np.array([entry["step"] for entry in self.done], dtype=np.int64)

    @property
    def eigenvalues(self) -> np.ndarray:
        """The eigenvalues of the measured checkpoints, shape (checkpoints, top_k), float64."""
        return self._matrix("eigenvalues")

    @property
    def error_bounds(self) -> np.ndarray:
        """Their error bounds, shape (checkpoints, top_k), float64."""
        return self._matrix("error_bounds")

    def _matrix(self, name: str) -> np.ndarray:
        k = int(self.settings.get("top_k", 1))
        rows = [entry[name] for entry in self.done]
        return np.array(rows, dtype=np.float64).reshape(len(rows), k)


# --------------------------------------------------------------------------- measurement


def minibatch_record(
    model: Any,
    data: Data,
    settings: SharpnessRunSettings,
    measurement: SharpnessMeasurement,
    threshold: StabilityThreshold | None,
    build: Callable[[Data], LinearOperator],
) -> dict[str, Any]:
    """λ₁ (and with ``settings.trace`` the trace) of the run's matrix on each of
    ``settings.per_batch`` mini-batches of ``model`` at the checkpoint's weights, with the
    full-batch λ₁ of ``measurement`` and the threshold when it bounds that matrix, as
    ``sharpness.json`` records it; ``build`` gives the matrix's operator on a mini-batch (a
    :class:`spectra.io.datasets.Data`). A ``ValueError`` of the measurement passes."""
    measured = settings.measurement()
    batch_size = measured.per_batch_size
    if batch_size is None:
        raise ValueError("per_batch_size is required: the examples in each mini-batch")

    def batch_operator(batch: tuple[np.ndarray, ...]) -> LinearOperator:
        x, y, *weight = batch
        subset = dataclasses.replace(
            data,
            x=x,
            y=y,
            sample_weight=weight[0] if weight else None,
            num_examples=batch_size,
        )
        return build(subset)

    result = minibatch_sharpness(
        model,
        data.as_tuple(),
        batch_size=batch_size,
        num_batches=measured.per_batch,
        seed=measured.seed,
        tol=measured.tol,
        method=measured.method,
        trace=measured.trace,
        trace_products=measured.trace_products,
        build=batch_operator,
        progress=False,
    )
    result.full_batch = measurement.eigenvalues[0]
    if threshold is not None and threshold.preconditioned == bool(settings.preconditioned):
        result.threshold = threshold.value
    return result.to_dict()


def entry_failure_probability(entry: Mapping[str, Any], method: str) -> float | None:
    """The failure probability of an entry's bounds; for an entry recorded without one
    (by an earlier version), what its method certifies: "lanczos" the default level, "power"
    nothing (1), "lobpcg" no statement (None)."""
    if "failure_probability" in entry:
        return entry["failure_probability"]
    return {"lanczos": DEFAULT_FAILURE_PROBABILITY, "power": 1.0}.get(method)


def entry_certified(entry: Mapping[str, Any], method: str) -> bool:
    """Whether the top eigenvalue's bound of an entry is proven at the default level."""
    return bound_holds(entry["converged"][0], entry_failure_probability(entry, method))


def side_of_threshold(entry: Mapping[str, Any], threshold: StabilityThreshold, method: str) -> str:
    """Where the bound puts λ1 against the threshold: ``"above"`` or ``"below"`` when the
    whole interval λ1 ± bound is on that side, ``"within"`` when the threshold lies inside
    it, ``"unproven"`` when the bound is not certified."""
    if not entry_certified(entry, method):
        return "unproven"
    value, bound = entry["eigenvalues"][0], entry["error_bounds"][0]
    if value - bound > threshold.value:
        return "above"
    if value + bound < threshold.value:
        return "below"
    return "within"


# --------------------------------------------------------------------------- the figure


def minibatch_quantiles(
    done: Sequence[Mapping[str, Any]],
) -> tuple[np.ndarray | None, str | None]:
    """The (5 %, median, 95 %) of the entries' mini-batch λ₁ (NaN where not measured) and
    their legend text, or (None, None) without any."""
    measured = [entry.get("minibatch") for entry in done]
    first = next((m for m in measured if m), None)
    if first is None:
        return None, None
    rows = [
        [m["summary"][q] for q in ("q05", "q50", "q95")] if m else [np.nan] * 3 for m in measured
    ]
    batches = count_text(first["num_batches"], "mini-batch", "mini-batches")
    examples = count_text(first["batch_size"], "example")
    label = f"λ₁ of {batches} of {examples}: median (dashed), 5–95 % (band)"
    return np.array(rows, dtype=np.float64), label


def _stability_threshold(recorded: Mapping[str, Any] | None) -> StabilityThreshold | None:
    """The :class:`StabilityThreshold` a record holds (its ``to_dict``), or None."""
    if recorded is None:
        return None
    names = [spec.name for spec in dataclasses.fields(StabilityThreshold)]
    return StabilityThreshold(**{name: recorded[name] for name in names})


def sharpness_figures(
    report: SharpnessReport | Mapping[str, Any], options: FigureOptions
) -> list[DrawnFigure]:
    """The figure of a run's measured checkpoints (none before the first), not yet saved:
    λ₁ (or the top k) along training with its bounds, the threshold when it bounds the
    measured matrix, the loss and what ``options`` add, named by the settings the record
    holds (:meth:`SharpnessRunSettings.from_report`). ``report`` is a
    :class:`SharpnessReport` or its record as ``sharpness.json`` holds it (NaN restored).

    Raises
    ------
    InputError
        ``options.x_axis`` names an axis the run did not record.
    """
    record = report.to_dict() if isinstance(report, SharpnessReport) else report
    done = [entry for entry in record.get("checkpoints") or [] if entry.get("status") == "done"]
    if not done:
        return []
    settings = SharpnessRunSettings.from_report(record)
    threshold = _stability_threshold(record.get("threshold"))
    unit, source = str(record.get("step_unit", "step")), str(record.get("step_source", ""))
    x_axis = options.x_axis if options.x_axis is not None else record.get("x_axis")
    figure = _sharpness_figure(record, done, settings, options, threshold, x_axis, unit, source)
    return [DrawnFigure("sharpness_figure", "sharpness", figure)]


def _sharpness_figure(
    report: Mapping[str, Any],
    done: Sequence[Mapping[str, Any]],
    settings: SharpnessRunSettings,
    options: FigureOptions,
    threshold: StabilityThreshold | None,
    x_axis: str | None,
    unit: str,
    step_source: str,
) -> Figure:
    from spectra.plotting import plot_sharpness, threshold_text

    threshold, missing = _plotted_threshold(settings.preconditioned, report, threshold)
    steps, xlabel = x_positions(report, done, x_axis, unit, step_source)
    values = np.array([entry["eigenvalues"] for entry in done], dtype=np.float64)
    errors = np.array([entry["error_bounds"] for entry in done], dtype=np.float64)
    if settings.top_k == 1:
        values, errors = values[:, 0], errors[:, 0]
    traces = [entry["trace"] for entry in done] if settings.trace else None
    trace_errors = None
    if settings.trace:
        trace_errors = [
            np.nan if entry["trace_stderr"] is None else entry["trace_stderr"] for entry in done
        ]
    overlaps = None
    if options.plot_overlap:
        overlaps = [
            np.nan if entry.get("eigenvector_overlap") is None else entry["eigenvector_overlap"]
            for entry in done
        ]
    minibatch, minibatch_label = minibatch_quantiles(done)
    ax = plot_sharpness(
        steps,
        values,
        threshold=threshold,
        errors=errors,
        traces=traces,
        trace_errors=trace_errors,
        losses=[entry["loss"] for entry in done],
        overlaps=overlaps,
        minibatch=minibatch,
        minibatch_label=minibatch_label,
        xlabel=xlabel,
        ylabel="Preconditioned sharpness λ₁(P⁻¹H)" if settings.preconditioned else None,
        threshold_note=missing,
        legend=options.legend,
        style=options.style,
        font=options.resolved_font(),
    )
    uncertified = [not entry_certified(entry, settings.method) for entry in done]
    if any(uncertified):
        top = values if values.ndim == 1 else values[:, 0]
        picked = np.flatnonzero(uncertified)
        ax.plot(
            np.asarray(steps)[picked],
            top[picked],
            linestyle="none",
            marker="o",
            markersize=7,
            markerfacecolor="white",
            markeredgecolor="black",
            zorder=5,
        )
    model = report.get("model")
    start = "warm starts from the previous eigenvectors" if settings.warm_start else "cold starts"
    short = (
        None if model is None else f"{model['name']}, {model['num_parameters']:,} parameters",
        describe_data(report["data"]),
        f"{settings.method.capitalize()}, k = {settings.top_k}, tol = {settings.tol:g}, {start}",
    )
    full = (
        "P: the optimizer state of each checkpoint" if settings.preconditioned else None,
        f"trace: {settings.trace_method}, {settings.trace_products} products"
        if settings.trace
        else None,
        f"{len(done)} checkpoints",
        "bars: eigenvalue error bounds",
        "hollow markers: bound not certified" if any(uncertified) else None,
        None if threshold is None else f"threshold: {threshold_text(threshold.label)}",
        missing,
    )
    return finish_figure(
        ax,
        options,
        f"Sharpness of the {settings.matrix} along training",
        short,
        full,
        matrix=describe_matrix(settings, model),
        seed=settings.seed,
        compact=True,
    )


def _plotted_threshold(
    preconditioned: bool, report: Mapping[str, Any], threshold: StabilityThreshold | None
) -> tuple[StabilityThreshold | None, str | None]:
    """The threshold to draw: only one that bounds the plotted matrix (λ₁(P⁻¹H) when
    ``preconditioned``, else λ₁(H), written as on the figure's axis); with the reason
    when a known threshold is not drawn (a run of an adaptive optimizer without
    ``--preconditioned``, or a record of an earlier version that kept the threshold of
    the other matrix)."""
    plotted = "λ₁(P⁻¹H)" if preconditioned else "λ₁(H)"
    other = "λ₁(H)" if preconditioned else "λ₁(P⁻¹H)"
    if threshold is not None and bool(threshold.preconditioned) == bool(preconditioned):
        return threshold, None
    dropped = report.get("dropped_threshold")
    if threshold is None and isinstance(dropped, dict) and dropped.get("optimizer"):
        threshold = StabilityThreshold(
            **{name: dropped[name] for name in StabilityThreshold.__dataclass_fields__}
        )
    if threshold is not None:
        return None, f"no threshold: {threshold.optimizer}'s is for {other}, not {plotted}"
    if report.get("learning_rate") is not None:
        return None, f"no threshold: the optimizer's does not bound {plotted}"
    return None, None
