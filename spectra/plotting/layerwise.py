"""The per-layer figure: :func:`plot_layerwise`, one bar per parameter group (top
eigenvalue or trace of its diagonal block), and :func:`block_symbol`."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from spectra._format import format_value
from spectra.plotting.layout import (
    SERIES_GID,
    ZERO_LINE_COLOR,
    add_grid,
    hidden_bars_note,
    series_color,
    with_figure_style,
    wrap_legend_labels,
)
from spectra.plotting.style import (
    FigureFont,
    active_font,
    active_style,
    annotation_fontsize,
    new_axes,
    root_figure,
    scaled_size,
)

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.container import BarContainer
    from matplotlib.typing import ColorType

    from spectra.analysis.per_layer import LayerwiseResult

# Up to this many groups get their value written at their bar (plot_layerwise), whose
# x range then grows by these fractions of its width to hold the text.
_MAX_ANNOTATED_GROUPS = 30
_ANNOTATION_ROOM = 0.15
# In a print style the labels are larger against the axes' width.
_STYLED_ANNOTATION_ROOM = 0.24
# The legend under the bars starts this many points under the axes (tick labels and the
# axis label: about 2.6 lines of text at 8-10 pt).
_LEGEND_DROP_POINTS = 30.0
_NEGATIVE_ANNOTATION_ROOM = 0.08


class _GroupBars(NamedTuple):
    """What :func:`plot_layerwise` draws per group: bar lengths, error bars, which bars are
    hatched, and the legend and axis texts."""

    values: np.ndarray
    errors: np.ndarray  # non-negative, 0 where not finite
    unconverged: np.ndarray
    legend: str
    xlabel: str


def block_symbol(symbol: str) -> str:
    """The diagonal block ℓℓ of the matrix ``symbol`` ("H") in mathtext, ``$H_{\\ell\\ell}$``:
    unicode subscript letters (ₗ) are unreadable at print size; a combining tilde ("F̃")
    is written ``\\tilde{F}``."""
    if symbol.endswith("\u0303"):
        symbol = f"\\tilde{{{symbol[:-1]}}}"
    return f"${symbol}_{{\\ell\\ell}}$"


_SUBSCRIPT_LETTERS = {
    **{chr(0x2080 + digit): str(digit) for digit in range(10)},
    "ₖ": "k",
    "ᵢ": "i",
    "ₗ": "l",
}
_SUBSCRIPTED_LAMBDA = re.compile(f"λ([{''.join(_SUBSCRIPT_LETTERS)}]+)")


def _with_math(text: str) -> str:
    """A label that holds mathtext (``$...$``) as the active font can draw it: mathtext
    draws the rest of such a label in its own text font, which in Computer Modern (the
    serif font's math) lacks unicode subscripts, so there λ₁ is written ``$\\lambda_1$``."""
    font = active_font()
    if "$" not in text or font is None or font.math != "cm":
        return text
    return _SUBSCRIPTED_LAMBDA.sub(
        lambda found: f"$\\lambda_{{{''.join(_SUBSCRIPT_LETTERS[c] for c in found.group(1))}}}$",
        text,
    )


def _group_bars(result: LayerwiseResult, quantity: str, symbol: str) -> _GroupBars:
    """The top eigenvalue of each group with its bound, or its trace ± standard error."""
    names = list(result.groups)
    if quantity == "trace":
        if result.traces is None or result.trace_stderr is None:
            raise ValueError("result holds no traces: compute it with layerwise(..., trace=True)")
        values = np.asarray(result.traces, dtype=np.float64)
        errors = np.asarray(result.trace_stderr, dtype=np.float64)
        unconverged = np.zeros(len(names), dtype=bool)
        legend = _with_math(f"trace of {block_symbol(symbol)} ± standard error")
        xlabel = "Trace of the diagonal block"
    else:
        values = np.array([float(v[0]) for v in result.eigenvalues])
        errors = np.array([float(e[0]) for e in result.error_bounds])
        unconverged = np.array([not bool(np.all(c)) for c in result.converged])
        legend = _with_math(f"λ₁ of {block_symbol(symbol)} ± error bound")
        xlabel = "Top eigenvalue of the diagonal block"
    errors = np.where(np.isfinite(errors) & (errors >= 0), errors, 0.0)
    return _GroupBars(values, errors, unconverged, legend, xlabel)


def _hatch_unconverged(
    bars: BarContainer, unconverged: np.ndarray, color: ColorType
) -> list[Artist]:
    """Hatch the bars of unconverged groups; returns the legend patch naming them (or
    nothing when all converged)."""
    if not unconverged.any():
        return []
    for patch, flag in zip(bars.patches, unconverged):
        if flag:
            patch.set_hatch("//")
            patch.set_facecolor("white")
            patch.set_edgecolor(color)
    from matplotlib.patches import Patch

    return [Patch(facecolor="white", edgecolor=color, hatch="//", label="not converged")]


def _draw_further_eigenvalues(
    ax: Axes, result: LayerwiseResult, rows: np.ndarray, symbol: str
) -> None:
    """λ₂ … λₖ of each group as dots on its row."""
    xs = [float(x) for v in result.eigenvalues for x in np.asarray(v)[1:]]
    ys = [row for row, v in zip(rows, result.eigenvalues) for _ in np.asarray(v)[1:]]
    ax.plot(
        xs,
        ys,
        linestyle="none",
        marker="o",
        markersize=scaled_size(4),
        color="0.15",
        label=_with_math(f"λ₂ … λₖ of {block_symbol(symbol)}"),
    )


def _annotate_bars(ax: Axes, rows: np.ndarray, values: np.ndarray, errors: np.ndarray) -> None:
    """Each value written beyond the end of its error bar, and the x range widened by
    ``_ANNOTATION_ROOM`` (and ``_NEGATIVE_ANNOTATION_ROOM`` on the left when bars go
    negative) of its width to hold the text."""
    for row, value, error in zip(rows, values, errors):
        ax.annotate(
            format_value(float(value), float(error)),
            (value + (error if value >= 0 else -error), row),
            xytext=(4 if value >= 0 else -4, 0),
            textcoords="offset points",
            va="center",
            ha="left" if value >= 0 else "right",
            fontsize=annotation_fontsize(),
        )
    low, high = ax.get_xlim()
    room = _ANNOTATION_ROOM if active_style() is None else _STYLED_ANNOTATION_ROOM
    ax.set_xlim(
        low - _NEGATIVE_ANNOTATION_ROOM * (high - low) * (low < 0),
        high + room * (high - low),
    )


def _legend_under_bars(ax: Axes, extra: list[Artist], shown: bool = True) -> None:
    """The legend under the axes, bars first (matplotlib lists lines before containers),
    then ``extra`` handles, with labels wrapped to the axes' width in a print style; none
    without ``shown``."""
    if not shown:
        return
    handles, labels = ax.get_legend_handles_labels()
    handles += extra
    labels += [handle.get_label() for handle in extra]
    first = ("λ₁", "trace", "$\\lambda_{1}$")
    order = sorted(range(len(handles)), key=lambda i: not labels[i].startswith(first))
    width = ax.get_position().width * root_figure(ax).get_figwidth()
    labels = wrap_legend_labels(labels, width + 0.4)
    from matplotlib.transforms import ScaledTranslation

    # A fixed distance under the axes (below the tick labels and the axis label), so that
    # the constrained layout, which moves the axes, finds the legend where it left it.
    under = ax.transAxes + ScaledTranslation(
        0.0, -_LEGEND_DROP_POINTS / 72.0, ax.figure.dpi_scale_trans
    )
    ax.legend(
        [handles[i] for i in order],
        [labels[i] for i in order],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        bbox_transform=under,
        fontsize=annotation_fontsize(),
        frameon=False,
        ncols=1,
    )


@with_figure_style
def plot_layerwise(
    result: LayerwiseResult,
    ax: Axes | None = None,
    *,
    quantity: str = "eigenvalue",
    symbol: str = "H",
    color: ColorType | None = None,
    annotate: bool | None = None,
    legend: bool = True,
    style: str | None = None,
    font: str | FigureFont | None = None,
) -> Axes:
    """Per-layer bars of a :class:`spectra.LayerwiseResult`, one row per group, first at top.

    ``quantity="eigenvalue"``: the top eigenvalue λ₁ of each diagonal block H_ll as a bar
    with its error bound, and the further top-k eigenvalues as dots on the same row;
    ``quantity="trace"``: the Hutchinson trace of each block ± one standard error (needs a
    result computed with ``trace=True``). Groups whose eigenvalues did not converge get a
    hatched bar, named in the legend. ``symbol`` is the matrix' letter in the legend ("G"
    for a Gauss-Newton matrix). ``annotate`` writes each value at its bar (default: up to
    30 groups). The legend goes under the axes, clear of the bars (none with
    ``legend=False``); ``style`` and ``font`` draw for print (:func:`figure_style`).
    Returns the axes.
    """
    from spectra.analysis.per_layer import LayerwiseResult

    if not isinstance(result, LayerwiseResult):
        raise TypeError(f"result must be a LayerwiseResult, got {type(result).__name__}")
    if quantity not in ("eigenvalue", "trace"):
        raise ValueError(f"quantity must be 'eigenvalue' or 'trace', got {quantity!r}")
    names = list(result.groups)
    if not names:
        raise ValueError("result holds no groups")
    rows = np.arange(len(names))
    data = _group_bars(result, quantity, symbol)
    if ax is None:
        ax = new_axes()
    color = series_color(ax, color)
    note = hidden_bars_note(data.values, data.errors, False).replace(
        "bars smaller than the markers", "error bars too small to see"
    )
    bars = ax.barh(
        rows,
        data.values,
        xerr=data.errors,
        height=0.6,
        color=color,
        alpha=0.85,
        error_kw={"ecolor": "0.2", "capsize": scaled_size(3), "elinewidth": scaled_size(1.0)},
        label=data.legend + note,
    )
    bars.patches[0].set_gid(SERIES_GID)
    extra = _hatch_unconverged(bars, data.unconverged, color)
    if quantity == "eigenvalue" and any(v.size > 1 for v in result.eigenvalues):
        _draw_further_eigenvalues(ax, result, rows, symbol)
    if annotate is None:
        annotate = len(names) <= _MAX_ANNOTATED_GROUPS
    if annotate:
        _annotate_bars(ax, rows, data.values, data.errors)
    ax.axvline(0.0, color=ZERO_LINE_COLOR, linewidth=0.8)
    ax.set_yticks(rows, names)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel(data.xlabel)
    ax.set_ylabel("Layer (parameter group)")
    add_grid(ax)
    ax.grid(False, axis="y")
    _legend_under_bars(ax, extra, shown=legend)
    return ax
