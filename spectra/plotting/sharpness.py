"""The sharpness figure: :func:`plot_sharpness`, λ₁ (or the top k eigenvalues) along
training with the stability threshold, the loss on a twin axis, mini-batch bands, and the
trace and eigenvector overlap in a panel below."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike

from spectra.plotting.captions import threshold_text
from spectra.plotting.layout import (
    SERIES_GID,
    add_grid,
    hidden_bars_note,
    one_dimensional,
    palette_color_after,
    refresh_legend,
    series_color,
    with_figure_style,
)
from spectra.plotting.style import (
    STYLE_ATTRIBUTE,
    FigureFont,
    new_axes,
    root_figure,
    scaled_size,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.lines import Line2D
    from matplotlib.typing import ColorType

_REFERENCE_COLOR = "0.35"
# The loss's color when the trace is drawn too (then both are grey, the loss lighter).
_SECOND_REFERENCE_COLOR = "0.45"
# More points than this are drawn without markers.
_MAX_MARKED_POINTS = 50
_TRACE_LABEL = "Trace of H"
_LOSS_LABEL = "Loss"
_OVERLAP_LABEL = "Overlap"
# The lower panel of a sharpness figure (trace, overlap): its height as a fraction of the
# upper one's, and the attribute of the upper axes that holds it.
_LOWER_PANEL_RATIO = 0.6
_LOWER_PANEL_ATTRIBUTE = "_spectra_lower_panel"
# Overlaps are squared cosines in [0, 1]; computed ones may exceed 1 by rounding. Their
# axis ends a little above 1 so that a line at 1 stays visible.
_OVERLAP_ROUNDING = 1e-9
_OVERLAP_TOP = 1.05
# A threshold more than this many times above the data is named, not drawn.
_OFF_SCALE_FACTOR = 3.0
# A loss spanning more than this factor goes on a log axis (two decades or more get
# labelled ticks).
_LOG_LOSS_SPAN = 100.0
_SUBSCRIPTS = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


@runtime_checkable
class LabelledThreshold(Protocol):
    """A threshold with its legend text, such as
    :class:`spectra.analysis.stability.StabilityThreshold`."""

    @property
    def value(self) -> float: ...

    @property
    def label(self) -> str: ...


# What plot_sharpness's ``threshold`` takes: a labelled threshold, (value, legend text),
# or a value.
Threshold: TypeAlias = LabelledThreshold | tuple[float, str] | float


def _subscript_digits(index: int) -> str:
    return str(index).translate(_SUBSCRIPTS)


def _check_errors(name: str, errors: ArrayLike, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(errors, dtype=np.float64)
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {shape} like the values, got {array.shape}")
    if np.any(array[np.isfinite(array)] < 0):
        raise ValueError(f"{name} must be non-negative")
    return np.where(np.isfinite(array), array, 0.0)


def _line_with_errors(
    ax: Axes,
    x: np.ndarray,
    y: np.ndarray,
    errors: np.ndarray | None,
    *,
    color: ColorType,
    marker: str | None,
    label: str,
    linestyle: str = "-",
) -> Line2D:
    """A labelled line with optional unlabelled error bars; returns the line.

    Drawn as a line plus a separate error-bar artist so that the legend lists
    entries in drawing order (matplotlib puts error-bar containers last).
    """
    (line,) = ax.plot(
        x,
        y,
        color=color,
        marker=marker,
        markersize=scaled_size(4),
        linewidth=scaled_size(1.4),
        linestyle=linestyle,
        label=label,
    )
    if errors is not None:
        ax.errorbar(
            x, y, yerr=errors, fmt="none", ecolor=color, capsize=scaled_size(2), elinewidth=0.9
        )
    return line


def _find_twin(ax: Axes, ylabel: str) -> Axes | None:
    """A twin of ``ax`` made earlier by :func:`plot_sharpness` with this y label."""
    for other in ax.get_shared_x_axes().get_siblings(ax):
        if other is not ax and other.get_ylabel() == ylabel:
            return other
    return None


def _twin(ax: Axes, ylabel: str) -> Axes:
    """The twin y axis (on the right) labelled ``ylabel``, made if needed: a panel has at
    most two y axes, so ``ax`` must not have another twin already."""
    found = _find_twin(ax, ylabel)
    if found is not None:
        return found
    existing = [other for other in ax.get_shared_x_axes().get_siblings(ax) if other is not ax]
    twins = [other for other in existing if other.get_subplotspec() == ax.get_subplotspec()]
    if twins:
        raise ValueError(
            f"the axes already have a second y axis ({twins[0].get_ylabel()!r}): "
            f"no room for {ylabel!r} beside it"
        )
    twin = ax.twinx()
    twin.set_ylabel(ylabel)
    twin.grid(False)
    return twin


def _lower_panel(ax: Axes) -> Axes:
    """The panel under ``ax`` sharing its x axis (trace and overlap of a sharpness figure),
    made by splitting ``ax``'s place in its grid (``ax`` keeps the upper part); a figure
    spectra made in a print style grows by the new panel's height, so ``ax`` keeps its
    size."""
    found = getattr(ax, _LOWER_PANEL_ATTRIBUTE, None)
    if found is not None:
        return found
    spec = ax.get_subplotspec()
    if spec is None:
        raise ValueError(
            "traces and overlaps go in a panel under the sharpness axes: give axes made "
            "by plt.subplots or add_subplot (a grid position to split), or ax=None"
        )
    figure = root_figure(ax)
    twins = [
        other
        for other in ax.get_shared_x_axes().get_siblings(ax)
        if other is not ax and other.get_subplotspec() == spec
    ]
    grid = spec.subgridspec(2, 1, height_ratios=[1.0, _LOWER_PANEL_RATIO], hspace=0.05)
    for panel in (ax, *twins):
        panel.set_subplotspec(grid[0])
    lower = figure.add_subplot(grid[1], sharex=ax)
    ax.tick_params(axis="x", labelbottom=False)
    ax.xaxis.label.set_visible(False)
    if getattr(figure, STYLE_ATTRIBUTE, None) is not None:
        figure.set_figheight(figure.get_figheight() * (1.0 + _LOWER_PANEL_RATIO))
    setattr(ax, _LOWER_PANEL_ATTRIBUTE, lower)
    add_grid(lower)
    return lower


def _color_y_axis(ax: Axes, color: ColorType) -> None:
    """The y label and ticks of ``ax`` in the color of its series."""
    ax.yaxis.label.set_color(color)
    ax.tick_params(axis="y", which="both", colors=color)


def _per_step(name: str, values: ArrayLike, size: int) -> np.ndarray:
    """``values`` as a 1-D array of one value per step."""
    array = one_dimensional(name, values)
    if array.size != size:
        raise ValueError(
            f"steps and {name} must have the same length: {size} steps but {array.size} {name}"
        )
    return array


def _threshold_of(lr: float | None, threshold: Threshold | None) -> tuple[float, str] | None:
    """(value, legend text) of the stability threshold, from ``lr`` or ``threshold``."""
    if lr is not None and threshold is not None:
        raise ValueError("give lr (gradient descent's 2/η) or threshold, not both")
    if lr is not None:
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a positive finite step size, got {lr}")
        return 2.0 / lr, f"2/η = {2.0 / lr:.4g} (GD stability threshold)"
    if threshold is None:
        return None
    if isinstance(threshold, LabelledThreshold):
        value, text = float(threshold.value), str(threshold.label)
    elif isinstance(threshold, tuple) and len(threshold) == 2:
        value, text = float(threshold[0]), str(threshold[1])
    else:
        value = float(threshold)
        text = f"stability threshold = {value:.4g}"
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"the threshold must be a positive finite number, got {value}")
    return value, threshold_text(text)


@dataclasses.dataclass
class _SharpnessSeries:
    """The checked inputs of :func:`plot_sharpness`, one row per step."""

    steps: np.ndarray
    columns: np.ndarray  # (steps, k): one column per eigenvalue line
    single: bool  # ``values`` was one series (shape (steps,))
    errors: np.ndarray | None  # shape of ``columns``
    threshold: tuple[float, str] | None
    traces: np.ndarray | None
    trace_errors: np.ndarray | None
    losses: np.ndarray | None
    overlaps: np.ndarray | None


def _sharpness_series(
    steps: ArrayLike,
    values: ArrayLike,
    lr: float | None,
    threshold: Threshold | None,
    errors: ArrayLike | None,
    traces: ArrayLike | None,
    trace_errors: ArrayLike | None,
    losses: ArrayLike | None,
    overlaps: ArrayLike | None,
) -> _SharpnessSeries:
    """Check :func:`plot_sharpness`'s arguments (a ``ValueError`` naming the first bad one)."""
    step_array = one_dimensional("steps", steps)
    value_array = np.asarray(values, dtype=np.float64)
    if value_array.ndim not in (1, 2):
        raise ValueError(
            f"values must have shape (steps,) or (steps, k), got shape {value_array.shape}"
        )
    if value_array.shape[0] != step_array.size:
        raise ValueError(
            f"steps and values must have the same length: {step_array.size} steps "
            f"but {value_array.shape[0]} rows of values"
        )
    if step_array.size == 0:
        raise ValueError("steps is empty")
    line_threshold = _threshold_of(lr, threshold)
    error_array = None if errors is None else _check_errors("errors", errors, value_array.shape)
    trace_array = None if traces is None else _per_step("traces", traces, step_array.size)
    trace_error_array = None
    if trace_errors is not None:
        if trace_array is None:
            raise ValueError("trace_errors given without traces")
        trace_error_array = _check_errors("trace_errors", trace_errors, trace_array.shape)
    loss_array = None if losses is None else _per_step("losses", losses, step_array.size)
    overlap_array = None
    if overlaps is not None:
        overlap_array = _per_step("overlaps", overlaps, step_array.size)
        shown = overlap_array[np.isfinite(overlap_array)]
        if np.any((shown < 0) | (shown > 1 + _OVERLAP_ROUNDING)):
            raise ValueError("overlaps must lie in [0, 1] (NaN for steps without one)")
    columns = value_array.reshape(step_array.size, -1)
    return _SharpnessSeries(
        steps=step_array,
        columns=columns,
        single=value_array.ndim == 1,
        errors=None if error_array is None else error_array.reshape(columns.shape),
        threshold=line_threshold,
        traces=trace_array,
        trace_errors=trace_error_array,
        losses=loss_array,
        overlaps=overlap_array,
    )


def _draw_eigenvalue_lines(
    ax: Axes,
    series: _SharpnessSeries,
    quantity: str,
    label: str | None,
    log_scale: bool,
    marker: str | None,
) -> list[ColorType]:
    """One line per column (λ₁, or λ₁ … λₖ), the first named with its error bars; returns
    their colors."""
    columns, column_errors = series.columns, series.errors
    note = hidden_bars_note(
        columns.ravel(), None if column_errors is None else column_errors.ravel(), log_scale
    )
    colors = []
    for column in range(columns.shape[1]):
        color = series_color(ax)
        colors.append(color)
        name = quantity if series.single else f"λ{_subscript_digits(column + 1)}"
        if label:
            name = label if series.single else f"{label}, {name}"
        if column_errors is not None and column == 0:
            name += " ± error bound" + note
        _line_with_errors(
            ax,
            series.steps,
            columns[:, column],
            None if column_errors is None else column_errors[:, column],
            color=color,
            marker=marker,
            label=name,
        ).set_gid(SERIES_GID)
    return colors


def _draw_minibatch_band(
    ax: Axes, steps: np.ndarray, minibatch: ArrayLike, color: ColorType, label: str | None
) -> None:
    """Mini-batch λ₁ per step: the median (thin dashed) in a band between two quantiles."""
    quantiles = np.asarray(minibatch, dtype=np.float64)
    if quantiles.shape != (steps.size, 3):
        raise ValueError(
            f"minibatch must have shape ({steps.size}, 3): a low quantile, the median and a "
            f"high quantile per step; got {quantiles.shape}."
        )
    name = label or "mini-batch λ₁: median (dashed), 5–95 % (band)"
    ax.fill_between(
        steps, quantiles[:, 0], quantiles[:, 2], color=color, alpha=0.18, linewidth=0, label=name
    )
    ax.plot(steps, quantiles[:, 1], color=color, linestyle="--", linewidth=0.8)


def _draw_threshold(ax: Axes, threshold: tuple[float, str], columns: np.ndarray) -> float | None:
    """The stability threshold as a dashed line, or only named in the legend when it is
    more than ``_OFF_SCALE_FACTOR`` times above the data (drawn, it would squash them);
    returns the value of the line drawn (None for the legend entry alone)."""
    value, text = threshold
    shown = columns[np.isfinite(columns)]
    top = float(shown.max()) if shown.size else value
    if top > 0 and value > _OFF_SCALE_FACTOR * top:
        # A proxy entry: the line itself would squash the data to the bottom.
        ax.plot(
            [],
            [],
            color=_REFERENCE_COLOR,
            linestyle="--",
            linewidth=scaled_size(1.2),
            label=f"{text}, above the plotted range",
        )
        return None
    ax.axhline(
        value, color=_REFERENCE_COLOR, linestyle="--", linewidth=scaled_size(1.2), label=text
    )
    return value


# The loss curve keeps this fraction of the axes' height away from the threshold line.
_THRESHOLD_CLEARANCE = 0.08


def _keep_clear_of(ax: Axes, loss_ax: Axes, threshold: float, losses: np.ndarray) -> None:
    """Limits of the loss axis that put the whole loss curve below the threshold line
    (above it when the line is in the lower third), ``_THRESHOLD_CLEARANCE`` away."""
    shown = losses[np.isfinite(losses)]
    if loss_ax.get_yscale() == "log":
        shown = shown[shown > 0]
    if not shown.size:
        return
    low, high = ax.get_ylim()
    if ax.get_yscale() == "log":
        at = (math.log10(threshold) - math.log10(low)) / (math.log10(high) - math.log10(low))
    else:
        at = (threshold - low) / (high - low)
    log = loss_ax.get_yscale() == "log"
    lowest, highest = float(shown.min()), float(shown.max())
    if log:
        lowest, highest = math.log10(lowest), math.log10(highest)
    if highest == lowest:
        highest, lowest = highest + 0.5 * abs(highest or 1.0), lowest - 0.5 * abs(lowest or 1.0)
    if at - _THRESHOLD_CLEARANCE >= 0.35:
        bottom_at, top_at = 0.03, at - _THRESHOLD_CLEARANCE
    else:
        bottom_at, top_at = min(at + _THRESHOLD_CLEARANCE, 0.6), 0.97
    span = (highest - lowest) / (top_at - bottom_at)
    bottom = lowest - bottom_at * span
    limits = (bottom, bottom + span)
    if log:
        limits = (10.0 ** limits[0], 10.0 ** limits[1])
    loss_ax.set_ylim(*limits)


def _draw_losses(ax: Axes, series: _SharpnessSeries, marker: str | None, label: str | None) -> Axes:
    """The loss on its twin axis, on a log scale when it spans more than
    ``_LOG_LOSS_SPAN``; returns the twin."""
    assert series.losses is not None
    loss_ax = _twin(ax, _LOSS_LABEL)
    loss_color = _REFERENCE_COLOR if series.traces is None else _SECOND_REFERENCE_COLOR
    loss_ax.plot(
        series.steps,
        series.losses,
        color=loss_color,
        linestyle=":",
        linewidth=scaled_size(1.4),
        marker="." if marker else None,
        label=_LOSS_LABEL if not label else f"{label}, loss",
    )
    positive = series.losses[np.isfinite(series.losses) & (series.losses > 0)]
    if positive.size and positive.max() / positive.min() > _LOG_LOSS_SPAN:
        from matplotlib.ticker import NullFormatter

        loss_ax.set_yscale("log")
        # Labelled decades only: a twin axis has no room for minor-tick labels.
        loss_ax.yaxis.set_minor_formatter(NullFormatter())
    _color_y_axis(loss_ax, loss_color)
    return loss_ax


def _panel_axis(lower: Axes, ylabel: str) -> Axes:
    """The axis of the lower panel for ``ylabel``: its left one when free (or already
    this quantity's), else its twin on the right."""
    if lower.get_ylabel() in ("", ylabel):
        lower.set_ylabel(ylabel)
        return lower
    return _twin(lower, ylabel)


def _draw_traces(
    lower: Axes,
    series: _SharpnessSeries,
    color: ColorType,
    marker: str | None,
    label: str | None,
) -> Axes:
    """The trace (± its standard errors) in the lower panel; returns its axis."""
    assert series.traces is not None
    trace_ax = _panel_axis(lower, _TRACE_LABEL)
    _line_with_errors(
        trace_ax,
        series.steps,
        series.traces,
        series.trace_errors,
        color=color,
        marker="s" if marker else None,
        linestyle="-.",
        label=(_TRACE_LABEL if not label else f"{label}, trace")
        + ("" if series.trace_errors is None else " ± s.e."),
    )
    _color_y_axis(trace_ax, color)
    return trace_ax


def _draw_overlaps(
    lower: Axes,
    series: _SharpnessSeries,
    color: ColorType,
    marker: str | None,
    label: str | None,
) -> Axes:
    """The overlaps of consecutive top eigenvectors in the lower panel, from 0 to 1."""
    assert series.overlaps is not None
    overlap_ax = _panel_axis(lower, _OVERLAP_LABEL)
    overlap_ax.plot(
        series.steps,
        series.overlaps,
        color=color,
        linestyle="--",
        linewidth=scaled_size(1.2),
        marker="^" if marker else None,
        markersize=scaled_size(4),
        label=(
            "Overlap $\\langle v_t, v_{t-1}\\rangle^2$"
            if series.columns.shape[1] == 1
            else "Top-k subspace overlap"
        )
        if not label
        else f"{label}, overlap",
    )
    overlap_ax.set_ylim(0.0, _OVERLAP_TOP)
    _color_y_axis(overlap_ax, color)
    return overlap_ax


@with_figure_style
def plot_sharpness(
    steps: ArrayLike,
    values: ArrayLike,
    *,
    lr: float | None = None,
    threshold: Threshold | None = None,
    errors: ArrayLike | None = None,
    traces: ArrayLike | None = None,
    trace_errors: ArrayLike | None = None,
    losses: ArrayLike | None = None,
    overlaps: ArrayLike | None = None,
    minibatch: ArrayLike | None = None,
    minibatch_label: str | None = None,
    xlabel: str = "Training step",
    ylabel: str | None = None,
    log_scale: bool = False,
    ax: Axes | None = None,
    label: str | None = None,
    threshold_note: str | None = None,
    legend: bool = True,
    style: str | None = None,
    font: str | FigureFont | None = None,
) -> Axes:
    """Sharpness (top Hessian eigenvalue λ₁) along training.

    ``values`` of shape (steps,) draws λ₁; of shape (steps, k) draws the top k
    eigenvalues as k lines; ``errors`` (shape of ``values``) adds error bars,
    named in the legend with a note when they hide under the markers.

    A stability threshold is drawn as a dashed line: with ``lr`` = η the
    threshold 2/η of gradient descent (Cohen, Kaur, Li, Kolter & Talwalkar,
    ICLR 2021: under full-batch gradient descent the sharpness rises to about
    2/η and hovers there), or ``threshold``, a
    :class:`spectra.analysis.stability.StabilityThreshold` (its ``label`` names the
    optimizer and formula), a ``(value, label)`` pair or a number. A threshold
    more than 3× above the data is named in the legend as off the scale instead
    of flattening the curves.

    ``losses`` (one per step) go on a twin y axis on the right, on a log scale
    when they span more than two decades. A panel has at most two y axes: ``traces``
    (and ``trace_errors``) and ``overlaps`` (one per step in [0, 1], NaN where there is
    none, e.g. the first step; the overlap of consecutive top eigenvectors,
    :func:`spectra.analysis.trajectory.measure_sharpness`) go into a second panel under
    the sharpness, sharing its x axis: the trace on its left axis, the overlap (0 to 1) on
    its right one (or the left, without traces). The panel is made by splitting ``ax``'s
    place in its grid (``ax`` keeps the upper part; a figure spectra makes grows in height
    for it); a ``ValueError`` if ``ax`` has no grid position (made by ``add_axes``).
    ``xlabel`` names the unit of ``steps`` (``"Epoch"``, …); ``ylabel`` names
    the measured quantity (default "Sharpness λ₁", e.g. "Preconditioned
    sharpness λ₁(P⁻¹H)"), also in the legend; ``log_scale`` makes the sharpness
    axis logarithmic. ``minibatch`` (steps × 3: a low quantile, the median and a high
    quantile of λ₁ over mini-batches at each step, NaN where not measured;
    :mod:`spectra.analysis.minibatch`) draws the median as a thin dashed line inside a band
    between the quantiles, in λ₁'s color, named ``minibatch_label`` (default "mini-batch
    λ₁: median (dashed), 5–95 % (band)"). ``threshold_note`` is a legend line without a
    mark saying why no threshold is drawn (e.g. Adam's is for λ_max(P⁻¹H), not the
    λ_max(H) plotted).
    With a threshold line and losses, the loss axis' limits keep the loss curve clear of
    the line (below it, or above it when the line is low); the threshold's legend names it
    a stability threshold, and for which matrix (:func:`threshold_text`). ``legend=False``
    draws no legend; ``style`` and ``font`` draw for print (:func:`figure_style`). Returns
    the primary (sharpness) axes.
    """
    series = _sharpness_series(
        steps, values, lr, threshold, errors, traces, trace_errors, losses, overlaps
    )
    quantity = ylabel or "Sharpness λ₁"
    if ax is None:
        ax = new_axes()
    # The lower panel first: an ``ax`` that cannot be split is refused before drawing.
    lower = getattr(ax, _LOWER_PANEL_ATTRIBUTE, None)
    if series.traces is not None or series.overlaps is not None:
        lower = _lower_panel(ax)
    marker = "o" if series.steps.size <= _MAX_MARKED_POINTS else None
    colors = _draw_eigenvalue_lines(ax, series, quantity, label, log_scale, marker)
    if minibatch is not None:
        _draw_minibatch_band(ax, series.steps, minibatch, colors[0], minibatch_label)
    if log_scale:
        ax.set_yscale("log")
    drawn_threshold = None
    if series.threshold is not None:
        drawn_threshold = _draw_threshold(ax, series.threshold, series.columns)
    if threshold_note:
        ax.plot([], [], linestyle="none", label=threshold_note)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(quantity if series.single else (ylabel or "Top Hessian eigenvalues"))
    add_grid(ax)

    # Twin axes: this call's, or those an earlier call on ``ax`` made (one legend for all).
    # At most two y axes per panel: sharpness and loss above, trace and overlap in a
    # panel below sharing the x axis.
    twins = []
    trace_color = palette_color_after(colors[-1])
    if series.losses is not None:
        twins.append(_draw_losses(ax, series, marker, label))
        if drawn_threshold is not None:
            _keep_clear_of(ax, twins[-1], drawn_threshold, series.losses)
    elif (existing := _find_twin(ax, _LOSS_LABEL)) is not None:
        twins.append(existing)
    if lower is not None:
        lower.set_xlabel(xlabel)
    if series.traces is not None:
        assert lower is not None
        _draw_traces(lower, series, trace_color, marker, label)
    if series.overlaps is not None:
        assert lower is not None
        _draw_overlaps(lower, series, palette_color_after(trace_color), marker, label)
    if lower is not None:
        twins += [
            lower,
            *(
                other
                for other in lower.get_shared_x_axes().get_siblings(lower)
                if other is not lower and other.get_subplotspec() == lower.get_subplotspec()
            ),
        ]
    if twins and series.single and len(colors) == 1:
        _color_y_axis(ax, colors[0])
    refresh_legend(ax, *twins, always=series.errors is not None, outside=True, shown=legend)
    return ax
