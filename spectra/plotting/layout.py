"""What the figures of every kind share: the palette and the color of each new series,
the grid, legends (inside the axes or under them, labels wrapped at print size), the
error-bar note, and :func:`with_figure_style`, which runs a plotting function in its
``style`` and ``font`` and then fits the tick labels and y labels to the print size."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, cast

import numpy as np
from numpy.typing import ArrayLike

from spectra.plotting.captions import print_text
from spectra.plotting.style import (
    STYLE_ATTRIBUTE,
    STYLES,
    FigureFont,
    active_style,
    annotation_fontsize,
    check_style,
    figure_font,
    figure_style,
    resolve_font,
    root_figure,
)

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.typing import ColorType

_Params = ParamSpec("_Params")

# Okabe & Ito (2008) colors without the yellow, which is too light on white.
_PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
# Marks the main data artists drawn here, so that repeated calls on one axes
# take the next palette color.
SERIES_GID = "spectra-series"
# The light line at zero (λ = 0 of a density, the bars' origin of a per-layer figure).
ZERO_LINE_COLOR = "0.75"
# Error bars shorter than this fraction of the plotted range hide under the markers.
_VISIBLE_ERROR_FRACTION = 0.01
# On a log axis the bars' length is relative: below this relative error (a marker spans
# about 5 % of a decade on a default figure) they hide under the markers.
_VISIBLE_LOG_ERROR = 0.05


def _fix_tick_fonts(ax: Axes, sized: bool = True, font: FigureFont | None = None) -> None:
    """Ticks are made when drawn, after the style's context is gone: their sizes (with
    ``sized``: a style's sizes, at least 7 pt) and ``font`` are set now on ``ax`` and its
    twins, and on every axes of a figure spectra made (its colorbar's too); other axes of
    a user's figure are left. With ``font`` the axis labels and titles of those axes,
    made with the axes, take it too."""
    import matplotlib as mpl

    figure = root_figure(ax)
    if getattr(figure, STYLE_ATTRIBUTE, None) is not None or figure_font(figure) is not None:
        chosen = list(figure.axes)
    else:
        chosen = list(ax.get_shared_x_axes().get_siblings(ax))
    for axes in chosen:
        if sized:
            axes.tick_params(axis="x", which="both", labelsize=mpl.rcParams["xtick.labelsize"])
            axes.tick_params(axis="y", which="both", labelsize=mpl.rcParams["ytick.labelsize"])
            for axis in (axes.xaxis, axes.yaxis):
                formatter = axis.get_major_formatter()
                if hasattr(formatter, "set_useOffset"):
                    formatter.set_useOffset(False)
        if font is not None:
            axes.tick_params(axis="both", which="both", labelfontfamily=list(font.families))
            for text in (axes.xaxis.label, axes.yaxis.label, axes.title):
                text.set_fontfamily(list(font.families))
                text.set_math_fontfamily(font.math)


def with_figure_style(function: Callable[_Params, Axes]) -> Callable[_Params, Axes]:
    """Run a plotting function inside :func:`figure_style` of its ``style`` and ``font``
    keywords."""

    @functools.wraps(function)
    def wrapper(*args: _Params.args, **kwargs: _Params.kwargs) -> Axes:
        style = check_style(kwargs.get("style"))
        font = resolve_font(cast("str | FigureFont | None", kwargs.get("font")))
        if font is not None:
            kwargs["font"] = font
        with figure_style(style, font=font):
            result = function(*args, **kwargs)
            if style is not None or font is not None:
                _fix_tick_fonts(result, sized=style is not None, font=font)
            if style is not None:
                _fit_y_labels(result)
        return result

    return wrapper


# Room kept between a y label's ends and the axes' ends, in inches.
_Y_LABEL_SLACK = 0.05


def _fit_y_labels(ax: Axes) -> None:
    """On a figure spectra made in a print style, grow its height until every axes is at
    least as tall as its y labels (left and right), so that no label runs past the canvas:
    the width stays the preset's. Cost: a layout pass of the figure (no rasterizing) per
    growth (at most 3)."""
    figure = root_figure(ax)
    if getattr(figure, STYLE_ATTRIBUTE, None) is None:
        return
    for _ in range(3):
        figure.draw_without_rendering()  # the layout and text extents, no rasterizing
        missing = 0.0
        for axes in figure.axes:
            label = axes.yaxis.label
            if not (label.get_visible() and label.get_text()):
                continue
            tall = label.get_window_extent().height / figure.dpi
            high = axes.get_window_extent().height / figure.dpi
            share = high / figure.get_figheight()
            missing = max(missing, (tall + 2 * _Y_LABEL_SLACK - high) / max(share, 0.2))
        if missing <= 0:
            return
        figure.set_figheight(figure.get_figheight() + missing)


def series_color(ax: Axes, color: ColorType | None = None) -> ColorType:
    """``color`` if given, else the next palette color not yet used on ``ax``."""
    if color is not None:
        return color
    used = sum(1 for artist in ax.get_children() if artist.get_gid() == SERIES_GID)
    return _PALETTE[used % len(_PALETTE)]


def add_grid(ax: Axes) -> None:
    """A light grid at the major ticks of ``ax``, behind the data."""
    ax.grid(True, which="major", color="0.88", linewidth=0.6)
    ax.set_axisbelow(True)


def refresh_legend(
    *axes: Axes, always: bool = False, outside: bool = False, shown: bool = True
) -> None:
    """Legend over all ``axes`` when they hold > 1 labelled artist (or any, with ``always``);
    none without ``shown`` (the legends drawn before on them are removed either way).

    The legend goes on the last axes (the one drawn on top, e.g. a twin), so
    that no line of the others can cover it; with ``outside`` (and a
    constrained layout, and no other panel in the figure) it goes under the
    axes instead, where it covers no data. Labels starting with "_" are
    matplotlib's hidden ones.
    """
    handles: list[Artist] = []
    labels: list[str] = []
    for holder in axes:
        more_handles, more_labels = holder.get_legend_handles_labels()
        handles += more_handles
        labels += more_labels
        previous = holder.get_legend()
        if previous is not None:
            previous.remove()
    figure = axes[0].figure
    # A figure legend speaks for the whole figure: only for a figure of these axes alone
    # (another panel beside them gets a legend of its own axes instead).
    alone = all(any(other is mine for mine in axes) for other in figure.axes)
    if alone:
        for legend in list(figure.legends):
            if legend.get_gid() == SERIES_GID:
                legend.remove()
    if not shown or not (len(handles) > 1 or (always and handles)):
        return
    engine = figure.get_layout_engine()
    constrained = engine is not None and type(engine).__name__ == "ConstrainedLayoutEngine"
    width = root_figure(axes[0]).get_figwidth()
    if outside and alone and constrained:
        columns = min(len(handles), 1 if active_style() == "column" else 2)
        labels = wrap_legend_labels(labels, width / columns)
        legend = figure.legend(
            handles,
            labels,
            loc="outside lower center",
            fontsize=annotation_fontsize(),
            frameon=False,
            ncols=columns,
        )
        legend.set_gid(SERIES_GID)
    else:
        labels = wrap_legend_labels(labels, width)
        axes[-1].legend(handles, labels, framealpha=0.9, fontsize=annotation_fontsize())


def wrap_legend_labels(labels: list[str], width: float) -> list[str]:
    """In a print style, legend labels wrapped to fit a figure ``width`` inches wide."""
    import textwrap

    if active_style() is None:
        return labels
    size = float(STYLES[active_style() or "column"].rc["legend.fontsize"])
    # About 0.55 em per character, and room for the legend's handle and padding.
    characters = max(24, int((width * 72.0 - 40.0) / (0.55 * size)))
    return [
        label
        if _drawn_length(label) <= characters
        else "\n".join(textwrap.wrap(label, characters, break_on_hyphens=False)) or label
        for label in labels
    ]


_MATH = re.compile(r"\$[^$]*\$")
_MATH_COMMAND = re.compile(r"\\[A-Za-z]+")


def _drawn_length(label: str) -> int:
    """About how many characters wide ``label`` is drawn: its mathtext (``$H_{\\ell\\ell}$``)
    counted by the symbols it shows (3), not by its source."""

    def symbols(found: re.Match[str]) -> str:
        shown = _MATH_COMMAND.sub("x", found.group())
        return "x" * len(re.sub(r"[${}_^ ]", "", shown))

    return len(_MATH.sub(symbols, label))


def one_dimensional(name: str, values: ArrayLike) -> np.ndarray:
    """``values`` as a 1-D float array (a ``ValueError`` naming ``name`` for another shape)."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def hidden_bars_note(values: np.ndarray, errors: np.ndarray | None, log_scale: bool) -> str:
    """ "; bars smaller than the markers, at most ±e" when the bars cannot be seen, else ""."""
    if errors is None or errors.size == 0:
        return ""
    finite = np.isfinite(values)
    if not finite.any():
        return ""
    largest = float(np.max(errors[finite]))
    if log_scale:
        positive = finite & (values > 0)
        relative = errors[positive] / values[positive] if positive.any() else np.zeros(0)
        hidden = relative.size == 0 or float(relative.max()) < _VISIBLE_LOG_ERROR
    else:
        shown = values[finite]
        span = float(shown.max() - shown.min()) or float(np.abs(shown).max()) or 1.0
        hidden = largest < _VISIBLE_ERROR_FRACTION * span
    if not hidden:
        return ""
    return f"; bars smaller than the markers, at most ±{print_text(f'{largest:.1e}')}"


def palette_color_after(color: ColorType) -> str:
    """The palette color after ``color``."""
    return _PALETTE[(_PALETTE.index(color) + 1) % len(_PALETTE)]
