"""The eigenvalue figure: :func:`plot_eigenvalues`, the top eigenvalues against their index
with error bars, value labels, and the spread of repeated estimates beside them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from spectra._format import count_text, format_value
from spectra.estimators.results import EigenResult
from spectra.plotting.layout import (
    SERIES_GID,
    add_grid,
    hidden_bars_note,
    palette_color_after,
    refresh_legend,
    series_color,
    with_figure_style,
)
from spectra.plotting.style import (
    FigureFont,
    active_style,
    annotation_fontsize,
    new_axes,
    root_figure,
    scaled_size,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.typing import ColorType

    from spectra.analysis.repeats import RepeatResult

# The linear eigenvalue axis spans at least this fraction of the largest |λ|.
_MIN_RELATIVE_SPAN = 0.1
# In a print style the index axis of annotated eigenvalues ends this much further right
# (in index units, per eigenvalue and in all), so that the last value label fits.
_LABEL_ROOM_PER_INDEX = 0.15
_LABEL_ROOM = 0.35
# Up to this many eigenvalues get a tick at every index.
_MAX_TICKED_INDICES = 12
# Up to this many eigenvalues get their value written beside the marker.
_MAX_ANNOTATED = 10
# The repeats' values of eigenvalue i are drawn at i - _REPEAT_OFFSET (left of the run's
# marker, whose value label is on its right).
_REPEAT_OFFSET = 0.3


def _eigen_errors(result: EigenResult) -> np.ndarray:
    """Per-eigenvalue error bars: the error bounds, else the residual norms, else 0."""
    size = np.asarray(result.eigenvalues).size
    errors = np.full(size, np.nan)
    for source in (result.error_bounds, result.residual_norms):
        if source is None:
            continue
        candidate = np.asarray(source, dtype=np.float64).ravel()
        if candidate.size == size:
            errors = np.where(np.isfinite(errors), errors, candidate)
    return np.where(np.isfinite(errors) & (errors >= 0), errors, 0.0)


def _draw_eigenvalue_markers(
    ax: Axes,
    indices: np.ndarray,
    values: np.ndarray,
    errors: np.ndarray,
    converged: np.ndarray,
    color: ColorType,
    name: str,
    note: str,
) -> None:
    """Filled markers with error bars for converged eigenvalues, hollow ones for the rest
    (named "not converged" in the legend); the note on hidden bars goes on the first."""
    some_unconverged = not converged.all()
    if converged.any():
        filled_label = f"{name} (converged)" if some_unconverged else name
        filled = ax.errorbar(
            indices[converged],
            values[converged],
            yerr=errors[converged],
            fmt="o",
            color=color,
            markersize=scaled_size(6),
            capsize=scaled_size(4),
            elinewidth=scaled_size(1.2),
            label=filled_label + note,
        )
        filled.lines[0].set_gid(SERIES_GID)
    if some_unconverged:
        hollow = ax.errorbar(
            indices[~converged],
            values[~converged],
            yerr=errors[~converged],
            fmt="o",
            color=color,
            markerfacecolor="none",
            markeredgewidth=scaled_size(1.4),
            markersize=scaled_size(6),
            capsize=scaled_size(4),
            elinewidth=scaled_size(1.2),
            label=f"{name} (not converged)" + ("" if converged.any() else note),
        )
        if not converged.any():
            hollow.lines[0].set_gid(SERIES_GID)


def _draw_repeats(ax: Axes, repeats: RepeatResult, count: int, color: ColorType) -> None:
    """Eigenvalue i of each repeat as a small dot at i - ``_REPEAT_OFFSET``, and the repeats'
    mean ± sd there as a diamond with bars (only the eigenvalues the repeats hold)."""
    from spectra.analysis.repeats import RepeatResult

    if not isinstance(repeats, RepeatResult):
        raise TypeError(f"repeats must be a RepeatResult or None, got {type(repeats).__name__}")
    columns = [
        repeats.names.index(f"λ{i}") for i in range(1, count + 1) if f"λ{i}" in repeats.names
    ]
    if not columns:
        raise ValueError(
            f"repeats hold no eigenvalue (its quantities are {', '.join(repeats.names)}); "
            "give the RepeatResult of an eigenvalue estimate, or repeats=None"
        )
    where = np.arange(1, len(columns) + 1, dtype=np.float64) - _REPEAT_OFFSET
    values = np.asarray(repeats.values, dtype=np.float64)[:, columns]
    mean = np.asarray(repeats.mean, dtype=np.float64)[columns]
    sd = np.asarray(repeats.sd, dtype=np.float64)[columns]
    finite = np.isfinite(values)
    xs = np.broadcast_to(where, values.shape)
    what, many = _repeat_unit(repeats)
    # An error-bar container without bars, so that the legend lists it in drawing order.
    ax.errorbar(
        xs[finite],
        values[finite],
        fmt="o",
        markersize=scaled_size(2.5),
        color=color,
        alpha=0.55,
        label=f"λᵢ of each {what}",
    )
    shown = np.isfinite(mean) & np.isfinite(sd)
    if shown.any():
        ax.errorbar(
            where[shown],
            mean[shown],
            yerr=sd[shown],
            fmt="D",
            color=color,
            markersize=scaled_size(4),
            markerfacecolor="white",
            markeredgewidth=scaled_size(1.2),
            capsize=scaled_size(3),
            elinewidth=scaled_size(1.0),
            label=f"λᵢ of {repeats.repeats} {many} (mean\u00a0±\u00a0sd)",
        )


def _repeat_unit(repeats: RepeatResult) -> tuple[str, str]:
    """What one repeat is, and several: ("subset of 150 examples", "subsets of 150
    examples") from ``subset_sizes`` (the fraction when the sizes differ), or ("seed",
    "seeds")."""
    if repeats.subsample is None:
        return "seed", "seeds"
    sizes = np.asarray(repeats.subset_sizes).ravel()
    if sizes.size and np.all(sizes == sizes[0]) and sizes[0] > 0:
        examples = count_text(int(sizes[0]), "example")
        return f"subset of {examples}", f"subsets of {examples}"
    share = f"{100 * repeats.subsample:.3g}% of the data"
    return f"subset of {share}", f"subsets of {share}"


def _index_axis_and_scale(
    ax: Axes,
    values: np.ndarray,
    reused: bool,
    previous_limits: tuple[float, float],
    log_scale: bool,
) -> None:
    """Integer ticks on the index axis, which covers earlier results drawn on ``ax``; a log
    y scale (symmetric-log, linear below the smallest |λ| ≠ 0, when some λ <= 0)."""
    from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator

    left, right = 0.5, values.size + 0.5
    if reused:
        left, right = min(left, previous_limits[0]), max(right, previous_limits[1])
    ax.set_xlim(left, right)
    last = round(right - 0.5)
    if last <= _MAX_TICKED_INDICES:
        # Every index, and none past the last eigenvalue (the axis may leave room after it).
        ax.xaxis.set_major_locator(FixedLocator([float(index) for index in range(1, last + 1)]))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.xaxis.set_minor_locator(NullLocator())
    if log_scale:
        if np.all(values > 0):
            ax.set_yscale("log")
            _decimal_log_ticks(ax, values)
        else:
            scale = float(np.min(np.abs(values[values != 0]), initial=1.0))
            ax.set_yscale("symlog", linthresh=scale)
    else:
        _keep_value_range(ax, values)


# A log axis spanning fewer decades than this gets plain decimal ticks (0.6, 1, 2, 3, …).
_DECIMAL_LOG_DECADES = 2.0


def _decimal_log_ticks(ax: Axes, values: np.ndarray) -> None:
    """On a log axis over less than ``_DECIMAL_LOG_DECADES`` decades: ticks at 1, 2, 3, 4, 6
    times a power of ten (also 1.5, 5, 8 within one decade), written as plain decimals
    ("0.6", "2"), not "6 × 10⁻¹"; wider ranges keep matplotlib's decades."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    low, high = float(values.min()), float(values.max())
    decades = math.log10(high / low)
    if decades >= _DECIMAL_LOG_DECADES:
        return
    mantissas = (1.0, 2.0, 3.0, 4.0, 6.0) if decades > 1 else (1, 1.5, 2, 3, 4, 5, 6, 8)
    first, last = math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1
    ticks = [m * 10.0**e for e in range(first, last + 1) for m in mantissas]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.6g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _keep_annotations_inside(ax: Axes, centre: bool) -> None:
    """Widen the x range of ``ax`` until the value labels written beside the markers end
    inside the axes (off the right spine), and with ``centre`` (one eigenvalue) make the
    range symmetric about its index, so the point sits in the middle. Cost: up to 3 layout
    passes (no rasterizing)."""
    figure = root_figure(ax)
    for _ in range(3):
        figure.draw_without_rendering()  # the layout and text extents, no rasterizing
        frame = ax.get_window_extent()
        right_edge = max((label.get_window_extent().x1 for label in ax.texts), default=frame.x0)
        over = right_edge + 4.0 - frame.x1
        left, right = ax.get_xlim()
        if over > 0:
            right += 1.15 * over * (right - left) / frame.width
        if centre:
            half = max(1.0 - left, right - 1.0)
            left, right = 1.0 - half, 1.0 + half
        if (left, right) == ax.get_xlim():
            return
        ax.set_xlim(left, right)


def _keep_value_range(ax: Axes, values: np.ndarray) -> None:
    """A linear value axis at least ``_MIN_RELATIVE_SPAN`` of the largest |value| tall, so
    that error bars far smaller than the values (one eigenvalue, or a few close ones) do
    not stretch to fill the axis; the values' own digits are shown, with no offset."""
    finite = values[np.isfinite(values)]
    if not finite.size:
        return
    low, high = ax.get_ylim()
    needed = _MIN_RELATIVE_SPAN * float(np.max(np.abs(finite)))
    if high - low < needed:
        middle = 0.5 * (float(finite.min()) + float(finite.max()))
        ax.set_ylim(middle - needed / 2, middle + needed / 2)
    formatter = ax.yaxis.get_major_formatter()
    if hasattr(formatter, "set_useOffset"):
        formatter.set_useOffset(False)


@with_figure_style
def plot_eigenvalues(
    result: EigenResult,
    ax: Axes | None = None,
    *,
    label: str | None = None,
    color: ColorType | None = None,
    log_scale: bool = False,
    annotate: bool | None = None,
    repeats: RepeatResult | None = None,
    legend: bool = True,
    style: str | None = None,
    font: str | FigureFont | None = None,
) -> Axes:
    """The computed eigenvalues against their index i = 1, 2, … with error bars.

    Error bars are ``result.error_bounds`` (the residual norms where no bound
    is available); the legend names them, and says when they are smaller than
    the markers (with the largest bound), which is the usual case for
    converged eigenvalues. Eigenpairs that did not converge are drawn as hollow
    markers and named "not converged" in the legend. ``log_scale`` draws the
    y axis logarithmically (symmetric-log when some eigenvalues are ≤ 0).
    ``annotate`` writes each value beside its marker (default: for up to 10
    eigenvalues, and not with ``repeats``, whose spread the labels would cover).

    ``repeats``, a :class:`spectra.RepeatResult` holding λ1, λ2, … (``spectra analyze
    --repeats``), adds the spread across its R runs beside each eigenvalue, just left of
    the run's marker: each run's value as a small dot and their mean ± sd (the sample
    standard deviation, ddof = 1) as a diamond with bars. The legend then names the two
    uncertainties apart: "numerical bound of this run" for the run's error bars, "λᵢ of R
    subsets of 150 examples (mean ± sd)" (the size from ``repeats.subset_sizes``; "R seeds"
    without subsets) for the repeats' spread, which is not an error bar. ``legend=False``
    draws no legend; ``style`` and ``font`` draw for print (:func:`figure_style`).

    On a log axis spanning under two decades the ticks are plain decimals (0.6, 1, 2, 3,
    4, 6); the x range widens until the value labels end inside the axes, and a single
    eigenvalue is centred on its axis (costs a few draws of the figure).
    """
    if not isinstance(result, EigenResult):
        raise TypeError(f"result must be an EigenResult, got {type(result).__name__}")
    values = np.asarray(result.eigenvalues, dtype=np.float64).ravel()
    if values.size == 0:
        raise ValueError("result holds no eigenvalues")
    converged = np.asarray(result.converged, dtype=bool).ravel()
    if converged.size != values.size:
        converged = np.full(values.size, bool(np.all(converged)))
    errors = _eigen_errors(result)
    indices = np.arange(1, values.size + 1)
    if ax is None:
        ax = new_axes()
    reused = ax.has_data()
    previous_limits = ax.get_xlim()
    color = series_color(ax, color)
    bound = "numerical bound of this run" if repeats is not None else "error bound"
    name = f"{label}: λᵢ ± {bound}" if label else f"λᵢ ± {bound}"
    note = hidden_bars_note(values, errors, log_scale)

    _draw_eigenvalue_markers(ax, indices, values, errors, converged, color, name, note)
    if repeats is not None:
        _draw_repeats(ax, repeats, values.size, palette_color_after(color))
    if annotate is None:
        # With repeats a value label would run into the next index's spread: left out.
        annotate = values.size <= _MAX_ANNOTATED and repeats is None
    if annotate:
        for index, value, error in zip(indices, values, errors):
            ax.annotate(
                format_value(float(value), float(error)),
                (index, value),
                xytext=(7, 0),
                textcoords="offset points",
                va="center",
                fontsize=annotation_fontsize(),
                color=color,
            )

    _index_axis_and_scale(ax, values, reused, previous_limits, log_scale)
    if annotate and active_style() is not None:
        # Room for the last label (up to 7 characters at 7 pt beside its marker): at print
        # size an index step is about half an inch on a column for k = 5.
        left, right = ax.get_xlim()
        ax.set_xlim(left, right + _LABEL_ROOM_PER_INDEX * values.size + _LABEL_ROOM)
    ax.set_xlabel("Eigenvalue index i")
    ax.set_ylabel("Eigenvalue λᵢ" + (" (log scale)" if log_scale else ""))
    add_grid(ax)
    # In a print style the legend goes under the axes: at that size it would cover markers.
    refresh_legend(ax, always=True, outside=active_style() is not None, shown=legend)
    if annotate or (values.size == 1 and not reused):
        _keep_annotations_inside(ax, centre=values.size == 1 and not reused)
    return ax
