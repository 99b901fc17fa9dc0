"""Publication figures for spectra results (matplotlib).

Every plotting function draws into a given ``Axes`` (or a new figure when
``ax`` is None) and returns the ``Axes``; nothing is shown and no global
matplotlib setting is changed. Default colors are the Okabe–Ito palette
(safe for the common forms of color blindness). Legends say what each mark
means: error bars and confidence bands are named in them (with a note when the
bars are smaller than the markers), and single unexplained series get none.
:func:`add_title` puts a title and a caption-like line (model, data, matrix,
estimator settings; see :func:`figure_caption`) on a figure, and
:func:`save_figure` writes it atomically in any format matplotlib knows
(png, pdf, svg, …).

Matplotlib is imported on first use (inside the functions), not with the module.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
import pathlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from spectra._format import count_text, format_value, value_digits
from spectra.estimators.results import EigenResult, SpectralDensity
from spectra.io.files import atomic_write

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from spectra.analysis.repeats import RepeatResult

__all__ = [
    "FONTS",
    "STYLES",
    "FigureFont",
    "add_title",
    "figure_caption",
    "figure_metadata",
    "figure_size",
    "figure_style",
    "format_value",
    "new_figure",
    "plot_eigenvalues",
    "plot_layerwise",
    "plot_loss_landscape_1d",
    "plot_loss_landscape_2d",
    "plot_sharpness",
    "plot_spectral_density",
    "repeats_description",
    "resolve_font",
    "save_figure",
    "value_digits",
]

# Okabe & Ito (2008) colors without the yellow, which is too light on white.
_PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
# Marks the main data artists drawn here, so that repeated calls on one axes
# take the next palette color.
_SERIES_GID = "spectra-series"
_REFERENCE_COLOR = "0.35"
_ZERO_LINE_COLOR = "0.75"
# The loss's color when the trace is drawn too (then both are grey, the loss lighter).
_SECOND_REFERENCE_COLOR = "0.45"
# Lower end of the log-scale density axis, relative to the highest density; its upper
# end leaves a factor 2 (a third of a decade) above the band's peak; values under the
# floor are drawn at a tenth of it, just below the visible range.
_LOG_FLOOR = 1e-6
_LOG_HEADROOM = 2.0
_BELOW_FLOOR = 0.1
# More points than this are drawn without markers.
_MAX_MARKED_POINTS = 50
# The tallest 2-D landscape axes (inches): on a page the square axes leave room at the sides.
_MAX_SQUARE_SIDE = 3.6
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
# Error bars shorter than this fraction of the plotted range hide under the markers.
_VISIBLE_ERROR_FRACTION = 0.01
# On a log axis the bars' length is relative: below this relative error (a marker spans
# about 5 % of a decade on a default figure) they hide under the markers.
_VISIBLE_LOG_ERROR = 0.05
# The linear eigenvalue axis spans at least this fraction of the largest |λ|.
_MIN_RELATIVE_SPAN = 0.1
# In a print style the index axis of annotated eigenvalues ends this much further right
# (in index units, per eigenvalue and in all), so that the last value label fits.
_LABEL_ROOM_PER_INDEX = 0.15
_LABEL_ROOM = 0.35
# Up to this many eigenvalues get a tick at every index.
_MAX_TICKED_INDICES = 12
# A threshold more than this many times above the data is named, not drawn.
_OFF_SCALE_FACTOR = 3.0
_CAPTION_FONTSIZE = 8
# A loss spanning more than this factor goes on a log axis (two decades or more get
# labelled ticks).
_LOG_LOSS_SPAN = 100.0
# Up to this many eigenvalues get their value written beside the marker.
_MAX_ANNOTATED = 10
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
# The repeats' values of eigenvalue i are drawn at i - _REPEAT_OFFSET (left of the run's
# marker, whose value label is on its right).
_REPEAT_OFFSET = 0.3
_SUBSCRIPTS = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


# Print presets: the figure's width in inches (one column of a two-column paper, or the
# whole page), its height as a fraction of the width, the font sizes in points at that
# width (none below _MIN_FONT_SIZE, the smallest most journals accept), the scale of
# line widths and marker sizes, and the PNG resolution.
_MIN_FONT_SIZE = 7.0


class _Style(NamedTuple):
    width: float
    aspect: float
    scale: float
    rc: dict[str, Any]


_BASE_RC: dict[str, Any] = {
    "font.size": 8.0,
    "axes.labelsize": 8.0,
    "axes.titlesize": 8.0,
    "figure.titlesize": 9.0,
    "xtick.labelsize": 7.0,
    "ytick.labelsize": 7.0,
    "legend.fontsize": 7.0,
    "axes.linewidth": 0.6,
    "xtick.major.width": 0.6,
    "ytick.major.width": 0.6,
    "xtick.minor.width": 0.4,
    "ytick.minor.width": 0.4,
    "xtick.major.size": 3.0,
    "ytick.major.size": 3.0,
    "legend.handlelength": 1.6,
    "legend.borderaxespad": 0.4,
    "axes.formatter.useoffset": False,
    "savefig.dpi": 300,
}
STYLES: dict[str, _Style] = {
    "column": _Style(width=3.25, aspect=0.78, scale=0.7, rc=_BASE_RC),
    "page": _Style(width=6.75, aspect=0.45, scale=0.85, rc=_BASE_RC),
}
# Fonts kept as fonts in every file: TrueType (Type 42) in PDF and PostScript, which
# journals accept (Type 3 bitmaps they often reject), and <text> elements in SVG.
_FONT_RC = {"pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "none"}
_ACTIVE_STYLE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "spectra_plotting_style", default=None
)
_ACTIVE_FONT: contextvars.ContextVar[FigureFont | None] = contextvars.ContextVar(
    "spectra_plotting_font", default=None
)
# Attributes spectra sets on the figures it styles or describes.
_STYLE_ATTRIBUTE = "_spectra_style"
_FONT_ATTRIBUTE = "_spectra_font"
_METADATA_ATTRIBUTE = "_spectra_metadata"
_CAPTION_ATTRIBUTE = "_spectra_caption"


# The fonts a figure can ask for by kind (any other name is a font family matplotlib must
# find). "serif": the first Times-like family found, then STIX (Times-like, shipped with
# matplotlib, so always found) and DejaVu Serif for the glyphs they lack (matplotlib falls
# back glyph by glyph along the list), with math in Computer Modern (mathtext; no TeX
# needed). "sans": DejaVu Sans, matplotlib's default, with its own math.
FONTS = ("sans", "serif")
_TIMES_LIKE = (
    "Times New Roman",
    "Times",
    "Nimbus Roman",
    "Nimbus Roman No9 L",
    "TeX Gyre Termes",
    "Liberation Serif",
    "STIXGeneral",
)
_SERIF_FALLBACK = "DejaVu Serif"
_SANS = "DejaVu Sans"
# Families of matplotlib's own math and symbol fonts, left out of the list of families an
# unknown --font name is answered with.
_NOT_TEXT_FAMILIES = re.compile(
    r"^(cm[a-z]+\d*|STIX(NonUnicode|Size.*)|Last Resort.*|DejaVu Math.*)$"
)
_LISTED_FAMILIES = 12
# The width of a bold character of the Times-like serif, in em (DejaVu Sans Bold: 0.62).
_SERIF_BOLD_EM = 0.52


@dataclasses.dataclass(frozen=True)
class FigureFont:
    """The font of a figure: ``name`` as asked (``"serif"``, ``"sans"`` or a family),
    ``families`` the families matplotlib found, in the order it falls back along them for
    a missing glyph, and ``math`` the mathtext font set (``"cm"``: Computer Modern)."""

    name: str
    families: tuple[str, ...]
    math: str

    def rc(self) -> dict[str, Any]:
        """The matplotlib settings that draw in this font."""
        return {"font.family": list(self.families), "mathtext.fontset": self.math}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "families": list(self.families), "math": self.math}

    def describe(self) -> str:
        """``"serif (Liberation Serif, STIXGeneral, DejaVu Serif; math cm)"``."""
        return f"{self.name} ({', '.join(self.families)}; math {self.math})"


def _known_families() -> dict[str, str]:
    """The font families matplotlib finds, by lower-case name."""
    from matplotlib import font_manager

    return {entry.name.lower(): entry.name for entry in font_manager.fontManager.ttflist}


def resolve_font(font: str | FigureFont | None) -> FigureFont | None:
    """The :class:`FigureFont` of ``font``: ``"serif"`` (Times-like, math in Computer
    Modern), ``"sans"`` (DejaVu Sans, matplotlib's default) or the name of a font family
    matplotlib finds (case does not matter; DejaVu Sans covers the glyphs it lacks);
    None for None (matplotlib's settings unchanged).

    A family matplotlib does not find is a one-line ``ValueError`` listing some it does
    and how to add one. Cost: a look-up in matplotlib's font list (built once per
    installation)."""
    if font is None or isinstance(font, FigureFont):
        return font
    if not isinstance(font, str):
        raise TypeError(f"font must be a str or None, got {type(font).__name__}")
    name = font.strip()
    known = _known_families()
    if name.lower() in ("sans", "sans-serif"):
        return FigureFont("sans", (_SANS,), "dejavusans")
    if name.lower() == "serif":
        found = [known[family.lower()] for family in _TIMES_LIKE if family.lower() in known]
        chain = [*found[:1], "STIXGeneral", _SERIF_FALLBACK]
        return FigureFont(
            "serif", tuple(f for f in dict.fromkeys(chain) if f.lower() in known), "cm"
        )
    family = known.get(name.lower())
    if family is None:
        listed = sorted({f for f in known.values() if not _NOT_TEXT_FAMILIES.match(f)})
        shown = ", ".join(listed[:_LISTED_FAMILIES]) + (
            ", ..." if len(listed) > _LISTED_FAMILIES else ""
        )
        raise ValueError(
            f"matplotlib finds no font family {name!r}; 'serif' and 'sans' always work, and "
            f"these families are installed: {shown}. To use another, install its .ttf file "
            "(e.g. in ~/.fonts) and remove matplotlib's font cache (fontlist-*.json in "
            "matplotlib.get_cachedir())."
        )
    return FigureFont(family, tuple(dict.fromkeys([family, _SANS])), "dejavusans")


def _check_style(style: Any) -> str | None:
    if style is None:
        return None
    if not isinstance(style, str):
        raise TypeError(f"style must be a str or None, got {type(style).__name__}")
    if style not in STYLES:
        raise ValueError(
            f"style must be one of {', '.join(map(repr, STYLES))} or None, got {style!r}"
        )
    return style


@contextlib.contextmanager
def figure_style(style: str | None, *, font: str | FigureFont | None = None) -> Iterator[None]:
    """Context in which spectra draws for print: the preset's font sizes, line widths and
    no axis offsets (matplotlib's ``rc_context``, so the user's rcParams are restored on
    exit). ``style`` is ``"column"`` (3.25 in wide), ``"page"`` (6.75 in) or None
    (matplotlib's defaults, nothing changed). ``font`` is ``"serif"`` (Times-like, math in
    Computer Modern), ``"sans"`` (DejaVu Sans), a font family matplotlib finds, or None
    (the rcParams' font): see :func:`resolve_font`; it applies with or without a style.
    The plotting functions' ``style=`` and ``font=`` enter it."""
    import matplotlib as mpl

    name = _check_style(style)
    chosen = resolve_font(font)
    settings: Any = {} if name is None else dict(STYLES[name].rc)
    if chosen is not None:
        settings.update(chosen.rc())
    with mpl.rc_context(settings):
        style_token = _ACTIVE_STYLE.set(name)
        font_token = _ACTIVE_FONT.set(chosen)
        try:
            yield
        finally:
            _ACTIVE_FONT.reset(font_token)
            _ACTIVE_STYLE.reset(style_token)


def figure_size(style: str, aspect: float | None = None) -> tuple[float, float]:
    """(width, height) in inches of a figure in ``style``: the preset's width and its
    height as ``aspect`` (height / width; default the preset's)."""
    preset = STYLES[_check_style(style) or "column"]
    return preset.width, preset.width * (preset.aspect if aspect is None else aspect)


def new_figure(
    style: str | None = None,
    *,
    aspect: float | None = None,
    nrows: int = 1,
    ncols: int = 1,
    font: str | FigureFont | None = None,
) -> tuple[Figure, Any]:
    """A figure with ``nrows`` × ``ncols`` axes (an array of axes for more than one) and a
    constrained layout, sized by ``style`` (:func:`figure_size`; matplotlib's default
    size for None), its texts in ``font`` (:func:`resolve_font`; kept for the title,
    caption and tick labels drawn later)."""
    import matplotlib.pyplot as plt

    name = _check_style(style)
    chosen = resolve_font(font)
    size = None if name is None else figure_size(name, aspect)
    with figure_style(name, font=chosen):
        figure, axes = plt.subplots(nrows, ncols, figsize=size, layout="constrained")
    setattr(figure, _STYLE_ATTRIBUTE, name)
    setattr(figure, _FONT_ATTRIBUTE, chosen)
    return figure, axes


def _new_axes() -> Axes:
    _, ax = new_figure(_ACTIVE_STYLE.get(), font=_ACTIVE_FONT.get())
    return ax


def _figure_font(figure: Figure) -> FigureFont | None:
    """The font a figure was made in (:func:`new_figure`), None for matplotlib's."""
    font = getattr(figure, _FONT_ATTRIBUTE, None)
    return font if isinstance(font, FigureFont) else None


def _font_keywords(font: FigureFont | None) -> dict[str, Any]:
    """Keywords of a matplotlib ``Text`` that draw it in ``font`` (none for None)."""
    if font is None:
        return {}
    return {"fontfamily": list(font.families), "math_fontfamily": font.math}


def _w(width: float) -> float:
    """A line width or marker size scaled to the active style's width."""
    name = _ACTIVE_STYLE.get()
    return width if name is None else width * STYLES[name].scale


def _small() -> Any:
    """The font size of legends and annotations: "small", at least 7 pt in a style."""
    if _ACTIVE_STYLE.get() is None:
        return "small"
    return STYLES[_ACTIVE_STYLE.get() or "column"].rc["legend.fontsize"]


def _fix_tick_fonts(ax: Axes, sized: bool = True, font: FigureFont | None = None) -> None:
    """Ticks are made when drawn, after the style's context is gone: their sizes (with
    ``sized``: a style's sizes, at least 7 pt) and ``font`` are set now on ``ax`` and its
    twins, and on every axes of a figure spectra made (its colorbar's too); other axes of
    a user's figure are left. With ``font`` the axis labels and titles of those axes,
    made with the axes, take it too."""
    import matplotlib as mpl

    figure = _root_figure(ax)
    if getattr(figure, _STYLE_ATTRIBUTE, None) is not None or _figure_font(figure) is not None:
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


def _styled(function: Any) -> Any:
    """Run a plotting function inside :func:`figure_style` of its ``style`` and ``font``
    keywords."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        style = _check_style(kwargs.get("style"))
        font = resolve_font(kwargs.get("font"))
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
    the width stays the preset's. Cost: a draw of the figure per growth (at most 3)."""
    figure = _root_figure(ax)
    if getattr(figure, _STYLE_ATTRIBUTE, None) is None:
        return
    for _ in range(3):
        figure.canvas.draw()
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


def _next_color(ax: Axes, color: Any = None) -> Any:
    """``color`` if given, else the next palette color not yet used on ``ax``."""
    if color is not None:
        return color
    used = sum(1 for artist in ax.get_children() if artist.get_gid() == _SERIES_GID)
    return _PALETTE[used % len(_PALETTE)]


def _style_axes(ax: Axes) -> None:
    ax.grid(True, which="major", color="0.88", linewidth=0.6)
    ax.set_axisbelow(True)


def _refresh_legend(
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
    handles: list[Any] = []
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
            if legend.get_gid() == _SERIES_GID:
                legend.remove()
    if not shown or not (len(handles) > 1 or (always and handles)):
        return
    engine = figure.get_layout_engine()
    constrained = engine is not None and type(engine).__name__ == "ConstrainedLayoutEngine"
    width = _root_figure(axes[0]).get_figwidth()
    if outside and alone and constrained:
        columns = min(len(handles), 1 if _ACTIVE_STYLE.get() == "column" else 2)
        labels = _fit_labels(labels, width / columns)
        legend = figure.legend(
            handles,
            labels,
            loc="outside lower center",
            fontsize=_small(),
            frameon=False,
            ncols=columns,
        )
        legend.set_gid(_SERIES_GID)
    else:
        labels = _fit_labels(labels, width)
        axes[-1].legend(handles, labels, framealpha=0.9, fontsize=_small())


def _fit_labels(labels: list[str], width: float) -> list[str]:
    """In a print style, legend labels wrapped to fit a figure ``width`` inches wide."""
    import textwrap

    if _ACTIVE_STYLE.get() is None:
        return labels
    size = float(STYLES[_ACTIVE_STYLE.get() or "column"].rc["legend.fontsize"])
    # About 0.55 em per character, and room for the legend's handle and padding.
    characters = max(24, int((width * 72.0 - 40.0) / (0.55 * size)))
    return [
        label
        if _shown_length(label) <= characters
        else "\n".join(textwrap.wrap(label, characters, break_on_hyphens=False)) or label
        for label in labels
    ]


_MATH = re.compile(r"\$[^$]*\$")
_MATH_COMMAND = re.compile(r"\\[A-Za-z]+")


def _shown_length(label: str) -> int:
    """About how many characters wide ``label`` is drawn: its mathtext (``$H_{\\ell\\ell}$``)
    counted by the symbols it shows (3), not by its source."""

    def symbols(found: re.Match[str]) -> str:
        shown = _MATH_COMMAND.sub("x", found.group())
        return "x" * len(re.sub(r"[${}_^ ]", "", shown))

    return len(_MATH.sub(symbols, label))


def _subscript(index: int) -> str:
    return str(index).translate(_SUBSCRIPTS)


def _as_1d(name: str, values: Any) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def _check_errors(name: str, errors: Any, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(errors, dtype=np.float64)
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {shape} like the values, got {array.shape}")
    if np.any(array[np.isfinite(array)] < 0):
        raise ValueError(f"{name} must be non-negative")
    return np.where(np.isfinite(array), array, 0.0)


@_styled
def plot_spectral_density(
    density: SpectralDensity,
    ax: Axes | None = None,
    *,
    grid: np.ndarray | None = None,
    sigma: float | None = None,
    log_scale: bool = True,
    band: bool = True,
    label: str | None = None,
    color: Any = None,
    negative: bool = True,
    legend: bool = True,
    style: str | None = None,
    font: str | FigureFont | None = None,
) -> Axes:
    """Gaussian-smoothed SLQ spectral density with its confidence band.

    Draws ``density.density(grid, sigma)``: the mean over probes as a line and
    mean ∓ 2 standard errors across probes as a shaded band, with a light
    vertical line at λ = 0. With ``log_scale`` the y axis is logarithmic and
    clipped at 1e-6 of the highest density, so that the bulk near zero and the
    outliers both show while the Gaussian tails stay out of the way, as in
    Ghorbani, Krishnan & Xiao (ICML 2019), Fig. 1.

    The legend names the line (``label``, else "SLQ density") with the kernel
    width σ, and the band as "±2 s.e. across P probes" (no band for one probe); no
    legend without ``legend``.

    The λ axis of a positive semidefinite density (``density.positive_semidefinite``: a
    GGN, a Fisher, any operator with ``is_positive_semidefinite``) starts at λ = 0: there
    is no mass below. ``negative=False`` draws any density on λ ≥ 0 only (the default
    grid cut at 0), e.g. a Hessian's positive side; the mass below 0 is then not drawn.
    ``style`` and ``font`` draw for print (:func:`figure_style`).
    """
    if not isinstance(density, SpectralDensity):
        raise TypeError(f"density must be a SpectralDensity, got {type(density).__name__}")
    from_zero = bool(density.positive_semidefinite) or not negative
    curve = density.density(grid, sigma)
    if from_zero and grid is None and curve.grid.min() < 0:
        top = float(curve.grid.max())
        if top <= 0:
            raise ValueError("negative=False draws λ ≥ 0 only, but the density has no node above 0")
        points = max(1000, int(np.sum(curve.grid >= 0)))
        curve = density.density(np.linspace(0.0, top, points), curve.sigma)
    if ax is None:
        ax = _new_axes()
    reused_axes = ax.has_data()
    previous_left = ax.get_xlim()[0]
    color = _next_color(ax, color)
    peak = float(np.max(curve.upper))
    if not np.isfinite(peak) or peak <= 0:
        raise ValueError("the smoothed density is zero everywhere on the grid")
    reused_log_axes = ax.has_data() and ax.get_yscale() == "log"
    previous_limits = ax.get_ylim()
    bottom, top = _LOG_FLOOR * peak, _LOG_HEADROOM * peak
    if reused_log_axes:
        bottom, top = min(bottom, previous_limits[0]), max(top, previous_limits[1])
    # Values under the axis floor are drawn just below the visible range, so
    # that the log axis neither masks them (gaps) nor stretches down to them.
    shown_floor = _BELOW_FLOOR * bottom if log_scale else 0.0
    values = np.maximum(curve.values, shown_floor)

    name = label if label else "SLQ density"
    (line,) = ax.plot(
        curve.grid,
        values,
        color=color,
        linewidth=_w(1.4),
        label=f"{name}, σ = {curve.sigma:.2g}",
    )
    line.set_gid(_SERIES_GID)
    if band and density.num_probes > 1:
        ax.fill_between(
            curve.grid,
            np.maximum(curve.lower, shown_floor),
            np.maximum(curve.upper, shown_floor),
            color=color,
            alpha=0.25,
            linewidth=0,
            label=f"±2 s.e. across {density.num_probes} probes",
        )
    if curve.grid.min() < 0.0 <= curve.grid.max():
        ax.axvline(0.0, color=_ZERO_LINE_COLOR, linewidth=_w(0.8), zorder=0.5)
    if from_zero and curve.grid.min() >= 0.0:
        # The axis starts at λ = 0, the curve's first point: no margin at negative λ.
        ax.set_xlim(left=min(previous_left, 0.0) if reused_axes else 0.0)

    if log_scale:
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.set_ylabel("Density, ∫ = 1 (log scale)")
    else:
        ax.set_ylim(bottom=0.0)
        ax.set_ylabel("Density, ∫ = 1")
    ax.set_xlabel("Eigenvalue λ")
    _style_axes(ax)
    _refresh_legend(ax, always=True, outside=_ACTIVE_STYLE.get() is not None, shown=legend)
    return ax


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


def _hidden_bars_note(values: np.ndarray, errors: np.ndarray | None, log_scale: bool) -> str:
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


def _draw_eigenvalue_markers(
    ax: Axes,
    indices: np.ndarray,
    values: np.ndarray,
    errors: np.ndarray,
    converged: np.ndarray,
    color: Any,
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
            markersize=_w(6),
            capsize=_w(4),
            elinewidth=_w(1.2),
            label=filled_label + note,
        )
        filled.lines[0].set_gid(_SERIES_GID)
    if some_unconverged:
        hollow = ax.errorbar(
            indices[~converged],
            values[~converged],
            yerr=errors[~converged],
            fmt="o",
            color=color,
            markerfacecolor="none",
            markeredgewidth=_w(1.4),
            markersize=_w(6),
            capsize=_w(4),
            elinewidth=_w(1.2),
            label=f"{name} (not converged)" + ("" if converged.any() else note),
        )
        if not converged.any():
            hollow.lines[0].set_gid(_SERIES_GID)


def repeats_description(repeats: RepeatResult) -> str:
    """``"5 subsets of 50% of the data"`` or ``"5 seeds"``: what a :class:`spectra.RepeatResult`
    varied."""
    if repeats.subsample is not None:
        return f"{repeats.repeats} subsets of {100 * repeats.subsample:.3g}% of the data"
    return f"{repeats.repeats} seeds"


def _draw_repeats(ax: Axes, repeats: RepeatResult, count: int, color: Any) -> None:
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
        markersize=_w(2.5),
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
            markersize=_w(4),
            markerfacecolor="white",
            markeredgewidth=_w(1.2),
            capsize=_w(3),
            elinewidth=_w(1.0),
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
    range symmetric about its index, so the point sits in the middle. Cost: up to 3 draws."""
    figure = _root_figure(ax)
    for _ in range(3):
        figure.canvas.draw()
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


@_styled
def plot_eigenvalues(
    result: EigenResult,
    ax: Axes | None = None,
    *,
    label: str | None = None,
    color: Any = None,
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
        ax = _new_axes()
    reused = ax.has_data()
    previous_limits = ax.get_xlim()
    color = _next_color(ax, color)
    bound = "numerical bound of this run" if repeats is not None else "error bound"
    name = f"{label}: λᵢ ± {bound}" if label else f"λᵢ ± {bound}"
    note = _hidden_bars_note(values, errors, log_scale)

    _draw_eigenvalue_markers(ax, indices, values, errors, converged, color, name, note)
    if repeats is not None:
        _draw_repeats(ax, repeats, values.size, _after(color))
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
                fontsize=_small(),
                color=color,
            )

    _index_axis_and_scale(ax, values, reused, previous_limits, log_scale)
    if annotate and _ACTIVE_STYLE.get() is not None:
        # Room for the last label (up to 7 characters at 7 pt beside its marker): at print
        # size an index step is about half an inch on a column for k = 5.
        left, right = ax.get_xlim()
        ax.set_xlim(left, right + _LABEL_ROOM_PER_INDEX * values.size + _LABEL_ROOM)
    ax.set_xlabel("Eigenvalue index i")
    ax.set_ylabel("Eigenvalue λᵢ" + (" (log scale)" if log_scale else ""))
    _style_axes(ax)
    # In a print style the legend goes under the axes: at that size it would cover markers.
    _refresh_legend(ax, always=True, outside=_ACTIVE_STYLE.get() is not None, shown=legend)
    if annotate or (values.size == 1 and not reused):
        _keep_annotations_inside(ax, centre=values.size == 1 and not reused)
    return ax


def _line_with_errors(
    ax: Axes,
    x: np.ndarray,
    y: np.ndarray,
    errors: np.ndarray | None,
    *,
    color: Any,
    marker: str | None,
    label: str,
    linestyle: str = "-",
) -> Any:
    """A labelled line with optional unlabelled error bars; returns the line.

    Drawn as a line plus a separate error-bar artist so that the legend lists
    entries in drawing order (matplotlib puts error-bar containers last).
    """
    (line,) = ax.plot(
        x,
        y,
        color=color,
        marker=marker,
        markersize=_w(4),
        linewidth=_w(1.4),
        linestyle=linestyle,
        label=label,
    )
    if errors is not None:
        ax.errorbar(x, y, yerr=errors, fmt="none", ecolor=color, capsize=_w(2), elinewidth=0.9)
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
    figure = _root_figure(ax)
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
    if getattr(figure, _STYLE_ATTRIBUTE, None) is not None:
        figure.set_figheight(figure.get_figheight() * (1.0 + _LOWER_PANEL_RATIO))
    setattr(ax, _LOWER_PANEL_ATTRIBUTE, lower)
    _style_axes(lower)
    return lower


def _color_y_axis(ax: Axes, color: Any) -> None:
    """The y label and ticks of ``ax`` in the color of its series."""
    ax.yaxis.label.set_color(color)
    ax.tick_params(axis="y", which="both", colors=color)


def _per_step(name: str, values: Any, size: int) -> np.ndarray:
    """``values`` as a 1-D array of one value per step."""
    array = _as_1d(name, values)
    if array.size != size:
        raise ValueError(
            f"steps and {name} must have the same length: {size} steps but {array.size} {name}"
        )
    return array


def _threshold_of(lr: float | None, threshold: Any) -> tuple[float, str] | None:
    """(value, legend text) of the stability threshold, from ``lr`` or ``threshold``."""
    if lr is not None and threshold is not None:
        raise ValueError("give lr (gradient descent's 2/η) or threshold, not both")
    if lr is not None:
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a positive finite step size, got {lr}")
        return 2.0 / lr, f"2/η = {2.0 / lr:.4g} (GD stability threshold)"
    if threshold is None:
        return None
    if hasattr(threshold, "value") and hasattr(threshold, "label"):
        value, text = float(threshold.value), str(threshold.label)
    elif isinstance(threshold, tuple) and len(threshold) == 2:
        value, text = float(threshold[0]), str(threshold[1])
    else:
        value = float(threshold)
        text = f"stability threshold = {value:.4g}"
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"the threshold must be a positive finite number, got {value}")
    return value, threshold_text(text)


def threshold_text(text: str) -> str:
    """A stability threshold's legend text (e.g. a
    :attr:`spectra.analysis.stability.StabilityThreshold.label`) in the figures' notation,
    λ₁ for the top eigenvalue as on the axis (not λ_max), saying that it is a threshold:
    "SGD (η = 0.2): 2/η = 10 (stability threshold)", "Adam (…): (2+2β₁)/((1−β₁)η) = 38
    (stability threshold for λ₁(P⁻¹H))".

    Not a bound: λ₁ rises to it and hovers around and above it at the edge of stability
    (Cohen et al. 2021); it is where gradient descent on a quadratic stops converging."""
    text = text.replace("(for λ_max", "(stability threshold for λ_max").replace("λ_max", "λ₁")
    return text if "threshold" in text else f"{text} (stability threshold)"


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
    steps: Any,
    values: Any,
    lr: float | None,
    threshold: Any,
    errors: Any,
    traces: Any,
    trace_errors: Any,
    losses: Any,
    overlaps: Any,
) -> _SharpnessSeries:
    """Check :func:`plot_sharpness`'s arguments (a ``ValueError`` naming the first bad one)."""
    step_array = _as_1d("steps", steps)
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
) -> list[Any]:
    """One line per column (λ₁, or λ₁ … λₖ), the first named with its error bars; returns
    their colors."""
    columns, column_errors = series.columns, series.errors
    note = _hidden_bars_note(
        columns.ravel(), None if column_errors is None else column_errors.ravel(), log_scale
    )
    colors = []
    for column in range(columns.shape[1]):
        color = _next_color(ax)
        colors.append(color)
        name = quantity if series.single else f"λ{_subscript(column + 1)}"
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
        ).set_gid(_SERIES_GID)
    return colors


def _draw_minibatch_band(
    ax: Axes, steps: np.ndarray, minibatch: Any, color: Any, label: str | None
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
            linewidth=_w(1.2),
            label=f"{text}, above the plotted range",
        )
        return None
    ax.axhline(value, color=_REFERENCE_COLOR, linestyle="--", linewidth=_w(1.2), label=text)
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
        linewidth=_w(1.4),
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
    lower: Axes, series: _SharpnessSeries, color: Any, marker: str | None, label: str | None
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
    lower: Axes, series: _SharpnessSeries, color: Any, marker: str | None, label: str | None
) -> Axes:
    """The overlaps of consecutive top eigenvectors in the lower panel, from 0 to 1."""
    assert series.overlaps is not None
    overlap_ax = _panel_axis(lower, _OVERLAP_LABEL)
    overlap_ax.plot(
        series.steps,
        series.overlaps,
        color=color,
        linestyle="--",
        linewidth=_w(1.2),
        marker="^" if marker else None,
        markersize=_w(4),
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


def _after(color: Any) -> Any:
    """The palette color after ``color``."""
    return _PALETTE[(_PALETTE.index(color) + 1) % len(_PALETTE)]


@_styled
def plot_sharpness(
    steps: Any,
    values: Any,
    *,
    lr: float | None = None,
    threshold: Any = None,
    errors: Any = None,
    traces: Any = None,
    trace_errors: Any = None,
    losses: Any = None,
    overlaps: Any = None,
    minibatch: Any = None,
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
        ax = _new_axes()
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
    _style_axes(ax)

    # Twin axes: this call's, or those an earlier call on ``ax`` made (one legend for all).
    # At most two y axes per panel: sharpness and loss above, trace and overlap in a
    # panel below sharing the x axis.
    twins = []
    trace_color = _after(colors[-1])
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
        _draw_overlaps(lower, series, _after(trace_color), marker, label)
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
    _refresh_legend(ax, *twins, always=series.errors is not None, outside=True, shown=legend)
    return ax


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
    font = _ACTIVE_FONT.get()
    if "$" not in text or font is None or font.math != "cm":
        return text
    return _SUBSCRIPTED_LAMBDA.sub(
        lambda found: f"$\\lambda_{{{''.join(_SUBSCRIPT_LETTERS[c] for c in found.group(1))}}}$",
        text,
    )


def _group_bars(result: Any, quantity: str, symbol: str) -> _GroupBars:
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


def _hatch_unconverged(bars: Any, unconverged: np.ndarray, color: Any) -> list[Any]:
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


def _draw_further_eigenvalues(ax: Axes, result: Any, rows: np.ndarray, symbol: str) -> None:
    """λ₂ … λₖ of each group as dots on its row."""
    xs = [float(x) for v in result.eigenvalues for x in np.asarray(v)[1:]]
    ys = [row for row, v in zip(rows, result.eigenvalues) for _ in np.asarray(v)[1:]]
    ax.plot(
        xs,
        ys,
        linestyle="none",
        marker="o",
        markersize=_w(4),
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
            fontsize=_small(),
        )
    low, high = ax.get_xlim()
    room = _ANNOTATION_ROOM if _ACTIVE_STYLE.get() is None else _STYLED_ANNOTATION_ROOM
    ax.set_xlim(
        low - _NEGATIVE_ANNOTATION_ROOM * (high - low) * (low < 0),
        high + room * (high - low),
    )


def _legend_under_bars(ax: Axes, extra: list[Any], shown: bool = True) -> None:
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
    width = ax.get_position().width * _root_figure(ax).get_figwidth()
    labels = _fit_labels(labels, width + 0.4)
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
        fontsize=_small(),
        frameon=False,
        ncols=1,
    )


@_styled
def plot_layerwise(
    result: Any,
    ax: Axes | None = None,
    *,
    quantity: str = "eigenvalue",
    symbol: str = "H",
    color: Any = None,
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
        ax = _new_axes()
    color = _next_color(ax, color)
    note = _hidden_bars_note(data.values, data.errors, False).replace(
        "bars smaller than the markers", "error bars too small to see"
    )
    bars = ax.barh(
        rows,
        data.values,
        xerr=data.errors,
        height=0.6,
        color=color,
        alpha=0.85,
        error_kw={"ecolor": "0.2", "capsize": _w(3), "elinewidth": _w(1.0)},
        label=data.legend + note,
    )
    bars.patches[0].set_gid(_SERIES_GID)
    extra = _hatch_unconverged(bars, data.unconverged, color)
    if quantity == "eigenvalue" and any(v.size > 1 for v in result.eigenvalues):
        _draw_further_eigenvalues(ax, result, rows, symbol)
    if annotate is None:
        annotate = len(names) <= _MAX_ANNOTATED_GROUPS
    if annotate:
        _annotate_bars(ax, rows, data.values, data.errors)
    ax.axvline(0.0, color=_ZERO_LINE_COLOR, linewidth=0.8)
    ax.set_yticks(rows, names)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel(data.xlabel)
    ax.set_ylabel("Layer (parameter group)")
    _style_axes(ax)
    ax.grid(False, axis="y")
    _legend_under_bars(ax, extra, shown=legend)
    return ax


def _curve(name: str, values: Any, alphas: np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.shape != alphas.shape:
        raise ValueError(
            f"{name} must have one value per alpha ({alphas.size}), got shape {array.shape}"
        )
    return np.where(np.isfinite(array), array, np.nan)


@_styled
def plot_loss_landscape_1d(
    alphas: Any,
    losses: Mapping[str, Any] | Any,
    ax: Axes | None = None,
    *,
    xlabel: str = "Step size α along direction",
    references: Mapping[str, tuple[str, Any]] | None = None,
    legend: bool = True,
    style: str | None = None,
    font: str | FigureFont | None = None,
) -> Axes:
    """Loss along directions through the current parameters, L(θ + α d).

    ``losses`` maps a direction label (e.g. "top eigenvector v₁", "random
    direction") to the losses at ``alphas``; one line each, with a marker at
    α = 0 (the current parameters). A plain array draws one unlabelled line.
    ``references`` maps legend labels to ``(direction label, curve)``: curves
    at the same ``alphas`` drawn thin and dashed in the color of that
    direction's line (e.g. its quadratic model L + α gᵀv + λα²/2). Few points
    (≤ 5) get markers. ``legend=False`` draws no legend; ``style`` and ``font`` draw for
    print (:func:`figure_style`).
    """
    alpha_array = _as_1d("alphas", alphas)
    if alpha_array.size == 0:
        raise ValueError("alphas is empty")
    curves = dict(losses) if isinstance(losses, Mapping) else {None: losses}
    if not curves:
        raise ValueError("losses is empty: give at least one direction")
    checked = {
        name: _curve(f"losses[{name!r}]", curve, alpha_array) for name, curve in curves.items()
    }
    extra = {}
    for label, pair in dict(references or {}).items():
        if not (isinstance(pair, tuple) and len(pair) == 2 and pair[0] in checked):
            raise ValueError(
                f"references[{label!r}] must be (label of one of the losses, curve), got {pair!r}"
            )
        extra[label] = (pair[0], _curve(f"references[{label!r}]", pair[1], alpha_array))

    if ax is None:
        ax = _new_axes()
    order = np.argsort(alpha_array, kind="stable")
    sorted_alphas = alpha_array[order]
    marker = "o" if alpha_array.size <= 5 else None
    colors = {}
    for name, curve in checked.items():
        color = colors[name] = _next_color(ax)
        (line,) = ax.plot(
            sorted_alphas, curve[order], color=color, linewidth=_w(1.5), marker=marker, label=name
        )
        line.set_gid(_SERIES_GID)
        known = np.isfinite(curve[order])
        if sorted_alphas[known].size and sorted_alphas[known][0] <= 0 <= sorted_alphas[known][-1]:
            at_zero = float(np.interp(0.0, sorted_alphas[known], curve[order][known]))
            ax.plot(
                [0.0],
                [at_zero],
                marker="o",
                markersize=_w(7),
                color="0.15",
                markeredgecolor="white",
                markeredgewidth=_w(1.2),
                linestyle="none",
                zorder=3,
            )
    for name, (owner, curve) in extra.items():
        ax.plot(
            sorted_alphas,
            curve[order],
            color=colors[owner],
            linewidth=_w(1.0),
            linestyle="--",
            label=name,
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("Loss")
    _style_axes(ax)
    _refresh_legend(ax, outside=_ACTIVE_STYLE.get() is not None, shown=legend)
    return ax


@_styled
def plot_loss_landscape_2d(
    alphas: Any,
    betas: Any,
    losses: Any,
    ax: Axes | None = None,
    *,
    labels: tuple[str, str] = ("v₁", "v₂"),
    levels: int | Sequence[float] = 30,
    style: str | None = None,
    font: str | FigureFont | None = None,
) -> Axes:
    """Filled contours of the loss surface L(θ + α d₁ + β d₂).

    ``losses[i, j]`` is the loss at ``(alphas[i], betas[j])``; α runs along
    the x axis and β along the y axis. Adds a colorbar labelled "Loss" and a
    marker at the origin (the current parameters). Non-finite losses are left
    blank. ``style`` and ``font`` draw for print (:func:`figure_style`).
    """
    alpha_array = _as_1d("alphas", alphas)
    beta_array = _as_1d("betas", betas)
    if alpha_array.size < 2 or beta_array.size < 2:
        raise ValueError(
            f"alphas and betas need at least 2 points each, got {alpha_array.size} "
            f"and {beta_array.size}"
        )
    loss_array = np.asarray(losses, dtype=np.float64)
    expected = (alpha_array.size, beta_array.size)
    if loss_array.shape != expected:
        raise ValueError(
            f"losses must have shape (len(alphas), len(betas)) = {expected}, got {loss_array.shape}"
        )
    surface = np.ma.masked_invalid(loss_array)
    if surface.count() == 0:
        raise ValueError("losses has no finite values")
    if len(labels) != 2:
        raise ValueError(f"labels must name the two directions, got {labels!r}")

    if ax is None:
        name = _ACTIVE_STYLE.get()
        # Equal scales on α and β (a sharp direction must look sharp): axes about as tall
        # as wide, beside the colorbar (about 1 in with its label) and the y label.
        aspect = None
        if name is not None:
            side = STYLES[name].width - 1.3
            span = _span(alpha_array)
            ratio = _span(beta_array) / span if span > 0 else 1.0
            height = min(side * ratio, _MAX_SQUARE_SIDE) + 0.55
            aspect = height / STYLES[name].width
        _, ax = new_figure(name, aspect=aspect, font=_ACTIVE_FONT.get())
    filled = ax.contourf(alpha_array, beta_array, surface.T, levels=levels, cmap="viridis")
    ax.contour(
        alpha_array,
        beta_array,
        surface.T,
        levels=filled.levels,
        colors="white",
        linewidths=_w(0.3),
        alpha=0.35,
    )
    # The colorbar in an inset of ``ax`` (axes coordinates), so that it keeps the height of
    # the equal-aspect axes and never reaches the caption above them.
    ax.set_aspect("equal", adjustable="box")
    bar_axes = ax.inset_axes((1.04, 0.0, 0.05, 1.0))
    colorbar = ax.figure.colorbar(filled, cax=bar_axes)
    colorbar.set_label("Loss")
    if alpha_array.min() <= 0 <= alpha_array.max() and beta_array.min() <= 0 <= beta_array.max():
        ax.plot(
            [0.0],
            [0.0],
            marker="*",
            markersize=_w(12),
            color="white",
            markeredgecolor="black",
            markeredgewidth=_w(0.8),
            linestyle="none",
            zorder=3,
        )
    ax.set_xlabel(f"α along {labels[0]}")
    ax.set_ylabel(f"β along {labels[1]}")
    ax.set_aspect("equal", adjustable="box")
    return ax


def _span(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.max() - finite.min()) if finite.size else 0.0


def _root_figure(fig_or_ax: Any) -> Figure:
    from matplotlib.artist import Artist
    from matplotlib.figure import Figure, SubFigure

    if isinstance(fig_or_ax, Figure):
        return fig_or_ax
    if isinstance(fig_or_ax, Artist):
        figure: Figure | SubFigure | None
        try:
            figure = fig_or_ax.get_figure(root=True)
        except TypeError:  # matplotlib < 3.10
            figure = fig_or_ax.get_figure()
            while figure is not None and not isinstance(figure, Figure):
                figure = figure.get_figure()
        if isinstance(figure, Figure):
            return figure
    raise TypeError(f"expected a matplotlib Figure or Axes, got {type(fig_or_ax).__name__}")


def figure_caption(*parts: Any) -> str:
    """One caption line from its parts, joined by " · " (empty and None parts left out).

    E.g. ``figure_caption("digits_mlp, 85,002 parameters", "digits, 1,797 examples",
    "Hessian", "Lanczos, k = 5, tol = 1e-08")``.
    """
    return " · ".join(str(part) for part in parts if part not in (None, ""))


# A number in exponent notation with a padded exponent ("1e-08", "2.5e+03").
_PADDED_EXPONENT = re.compile(r"(\d)e([+-]?)0*(\d+)\b")
# Groups kept on one line of a caption: "10 probes × 80 steps", "mean ± sd", "k = 5".
_NO_BREAK = re.compile(
    r"(?<=\d) (?=probes|steps|examples?\b|subsets?\b|seeds?\b|checkpoints|products)"
    r"| (?=[×±=] )|(?<= [×±=]) "
)


def print_text(text: str) -> str:
    """``text`` as a figure writes it: exponents without padding ("tol = 1e-8", not
    "1e-08"; "3e+04" as "3e4") and no line break inside "10 probes × 80 steps",
    "mean ± sd" or "k = 5" (non-breaking spaces)."""
    text = _PADDED_EXPONENT.sub(
        lambda m: f"{m.group(1)}e{'-' if m.group(2) == '-' else ''}{m.group(3)}", text
    )
    return _NO_BREAK.sub("\u00a0", text)


def _wrap_caption(caption: str, width: int) -> str:
    """Lines of at most ``width`` characters, broken between the " · " parts when possible
    (and never inside the groups :func:`print_text` keeps together)."""
    import textwrap

    caption = print_text(caption)
    lines: list[str] = []
    for part in caption.split(" · "):
        if lines and len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " · " + part
        else:
            lines.extend(textwrap.wrap(part, width=width, break_on_hyphens=False) or [""])
    return "\n".join(lines)


def _describe(figure: Figure, title: str | None, description: str | None) -> None:
    """Record the figure's title and settings for :func:`save_figure`'s metadata."""
    recorded = dict(getattr(figure, _METADATA_ATTRIBUTE, None) or {})
    if title:
        recorded["Title"] = title
    if description:
        recorded["Description"] = description
    setattr(figure, _METADATA_ATTRIBUTE, recorded)


def add_title(
    fig_or_ax: Any,
    title: str | None,
    caption: str | None = None,
    *,
    metadata: str | Mapping[str, str] | None = None,
) -> Figure:
    """Put a ``title`` above the figure and a small ``caption`` under it (either None: none).

    The caption (model, data, matrix, estimator settings: :func:`figure_caption`) is
    wrapped to the figure's width and set as the title of the first axes, so that the
    layout keeps it clear of the title above and of the legend or labels below. On a
    figure made in a print style (:func:`new_figure`, or a plotting function's ``style=``)
    the figure grows by the height of these lines, so the axes keep their size, and
    the fonts keep the style's sizes (title 9 pt, caption 7 pt). ``metadata`` (default: the
    caption) is the description :func:`save_figure` writes into the file's metadata with
    the title, whether or not they are drawn; a mapping gives both ("Title",
    "Description"), e.g. the title of a figure drawn without one. Returns the figure.
    """
    import matplotlib as mpl

    figure = _root_figure(fig_or_ax)
    if isinstance(metadata, Mapping):
        _describe(figure, metadata.get("Title") or title, metadata.get("Description"))
    else:
        _describe(figure, title, metadata if metadata is not None else caption)
    font = _figure_font(figure)
    settings: Any = {} if font is None else font.rc()
    with mpl.rc_context(settings):
        _draw_title(figure, fig_or_ax, title, caption)
    return figure


def _draw_title(figure: Figure, fig_or_ax: Any, title: str | None, caption: str | None) -> None:
    """The title and caption of :func:`add_title`, in the figure's font."""
    font = _font_keywords(_figure_font(figure))
    styled = getattr(figure, _STYLE_ATTRIBUTE, None) is not None
    title_size = STYLES["column"].rc["figure.titlesize"] if styled else 12
    caption_size = _MIN_FONT_SIZE if styled else _CAPTION_FONTSIZE
    added_points = 0.0
    if title:
        shown = title
        if styled:
            # Bold characters are about 0.62 em wide (0.52 em in a Times-like serif).
            import textwrap

            em = _SERIF_BOLD_EM if _figure_font(figure) == resolve_font("serif") else 0.62
            characters = int(0.85 * figure.get_figwidth() * 72.0 / (em * title_size))
            shown = "\n".join(textwrap.wrap(title, max(20, characters), break_on_hyphens=False))
        figure.suptitle(shown, fontsize=title_size, fontweight="bold", **font)
        added_points += 1.3 * title_size * (shown.count("\n") + 1) + 0.2 * title_size
    if caption:
        axes = fig_or_ax if not isinstance(fig_or_ax, type(figure)) else None
        if axes is None and figure.axes:
            axes = figure.axes[0]
        # Characters per line: about 0.52 em each; in a print style the caption is centred
        # on the axes, which leave about a fifth of the width to the y label.
        usable = 0.8 * figure.get_figwidth() if styled else figure.get_figwidth()
        width = max(40, int(usable * 72.0 / ((0.56 if styled else 0.52) * caption_size)))
        text = _wrap_caption(caption, width)
        pad = 6 if styled else 8
        if axes is None:
            figure.supxlabel(text, fontsize=caption_size, color="0.3", **font)
        elif _side_by_side(axes):
            _caption_across(figure, axes, text, caption_size, pad)
        else:
            axes.set_title(text, fontsize=caption_size, color="0.3", pad=pad, **font)
            _centre_title_on(figure, axes)
        added_points += 1.25 * caption_size * (text.count("\n") + 1) + 6
    if styled and added_points:
        figure.set_figheight(figure.get_figheight() + added_points / 72.0)


def _side_by_side(axes: Axes) -> bool:
    """Whether ``axes`` is a panel of a grid with more than one column."""
    spec = axes.get_subplotspec()
    return spec is not None and spec.get_gridspec().ncols > 1


def _caption_across(figure: Figure, axes: Axes, text: str, fontsize: float, pad: float) -> None:
    """The caption of side-by-side panels, centred on the figure on the line of the title of
    ``axes`` (the first panel).

    The constrained layout counts an axes' title as a box one pixel wide at its centre: a
    title centred on the figure sits at the boundary of the first column, right of its
    panel, and each pass of the layout widens that panel's margin by as much as the panel
    moves, until the axes collapse ("constrained_layout not applied", the title then drawn
    over the axes and the caption off the figure). So the first panel's title holds blank
    lines as tall as the caption, which the layout keeps clear of the figure's title and of
    the axes, and the caption is a figure text left out of the layout on that line.
    """
    from matplotlib.transforms import ScaledTranslation, blended_transform_factory

    blank = "\n".join(" " for _ in text.split("\n"))
    font = _font_keywords(_figure_font(figure))
    axes.set_title(blank, fontsize=fontsize, pad=pad, **font)
    line = blended_transform_factory(figure.transSubfigure, axes.transAxes)
    caption = figure.text(
        0.5,
        1.0,
        text,
        # Raised by the title's padding, as set_title raises the title.
        transform=line + ScaledTranslation(0.0, pad / 72.0, figure.dpi_scale_trans),
        ha="center",
        va="baseline",
        fontsize=fontsize,
        color="0.3",
        **font,
    )
    caption.set_in_layout(False)
    setattr(figure, _CAPTION_ATTRIBUTE, caption)


def _caption_text(figure: Figure) -> Any:
    """The matplotlib ``Text`` of the caption :func:`add_title` drew on ``figure`` (the
    first panel's title, or a figure text over side-by-side panels), None without one."""
    across = getattr(figure, _CAPTION_ATTRIBUTE, None)
    if across is not None:
        return across
    below = getattr(figure, "_supxlabel", None)
    if below is not None and below.get_text():
        return below
    for axes in figure.axes:
        if axes.get_title():
            return axes.title
    return None


def _centre_title_on(figure: Figure, axes: Axes) -> None:
    """Centre the figure's title over ``axes``, the figure's only column of panels, on the
    line of its caption (the title of ``axes``)."""
    from matplotlib.transforms import blended_transform_factory

    title = getattr(figure, "_suptitle", None)
    if title is not None and axes.get_subplotspec() is not None:
        title.set_transform(blended_transform_factory(axes.transAxes, figure.transSubfigure))
        title.set_x(0.5)


def figure_metadata(fig_or_ax: Any) -> dict[str, str]:
    """What :func:`save_figure` writes into a figure's file metadata: ``"Title"`` and
    ``"Description"`` (recorded by :func:`add_title`: the title, drawn or not, and the full
    caption) and ``"Keywords"``, the figure's print settings (``"style column; font serif
    (STIXGeneral, DejaVu Serif; math cm)"``) when it was made in a style or a font."""
    figure = _root_figure(fig_or_ax)
    recorded = dict(getattr(figure, _METADATA_ATTRIBUTE, None) or {})
    if "Keywords" not in recorded:
        settings = []
        style = getattr(figure, _STYLE_ATTRIBUTE, None)
        if style is not None:
            settings.append(f"style {style}")
        font = _figure_font(figure)
        if font is not None:
            settings.append(f"font {font.describe()}")
        if settings:
            recorded["Keywords"] = "; ".join(settings)
    return recorded


def _file_metadata(file_format: str, recorded: Mapping[str, str]) -> dict[str, Any] | None:
    """The metadata matplotlib writes for ``file_format``: PDF Title/Subject/Keywords, PNG
    text chunks, SVG <metadata> (dc:title, dc:description); None for formats without."""
    title, description = recorded.get("Title"), recorded.get("Description")
    keywords = recorded.get("Keywords")
    if file_format == "pdf":
        fields = {"Title": title, "Subject": description, "Keywords": keywords}
    elif file_format == "png":
        fields = {"Title": title, "Description": description, "Keywords": keywords}
    elif file_format == "svg":
        fields = {"Title": title, "Description": description, "Keywords": keywords}
    else:
        return None
    fields = {key: value for key, value in fields.items() if value}
    fields["Creator" if file_format != "png" else "Software"] = "spectra"
    return fields


def save_figure(
    fig_or_ax: Any,
    path: str | os.PathLike,
    *,
    dpi: float | None = None,
    metadata: Mapping[str, str] | None = None,
) -> pathlib.Path:
    """Save a figure (or an Axes' figure) atomically: a figure made in a print style at
    its exact size (the preset's width), any other with tight bounds.

    The format comes from the suffix of ``path`` (.png, .pdf, .svg, …). Fonts stay
    fonts: TrueType (Type 42) in PDF and PostScript, ``<text>`` in SVG (set for this
    save only). The title and description that :func:`add_title` recorded, updated by
    ``metadata`` (keys "Title", "Description", "Keywords"; :func:`figure_metadata`), go
    into the file's metadata:
    PDF Title/Subject/Keywords, PNG text chunks, SVG ``<metadata>``. ``dpi`` (raster
    formats) defaults to 300 for a figure in a print style, else 150. The file is written
    to a temporary file in the same directory and moved into place with ``os.replace``, so
    readers never see a partial file; missing parent directories are created. The figure
    is not closed. Returns the path.
    """
    import matplotlib as mpl

    figure = _root_figure(fig_or_ax)
    target = pathlib.Path(path)
    file_format = target.suffix.lstrip(".").lower()
    supported = figure.canvas.get_supported_filetypes()
    if not file_format:
        raise ValueError(f"cannot infer the format of {str(target)!r}: give a suffix like .png")
    if file_format not in supported:
        raise ValueError(
            f"unsupported figure format {file_format!r}; supported: {', '.join(sorted(supported))}"
        )
    styled = getattr(figure, _STYLE_ATTRIBUTE, None) is not None
    if dpi is None:
        dpi = STYLES["column"].rc["savefig.dpi"] if styled else 150
    if not dpi > 0:
        raise ValueError(f"dpi must be positive, got {dpi}")
    recorded = figure_metadata(figure)
    for key, value in dict(metadata or {}).items():
        if key not in ("Title", "Description", "Keywords") or not isinstance(value, str):
            raise ValueError(
                f"metadata takes str values for 'Title', 'Description', 'Keywords', got {key!r}"
            )
        recorded[key] = value
    fields = _file_metadata(file_format, recorded)

    font = _figure_font(figure)

    def write(temp_name: str) -> None:
        # Texts made while saving (tick labels of a redrawn axis) take the figure's font.
        fonts: Any = {**_FONT_RC, **({} if font is None else font.rc())}
        with mpl.rc_context(fonts):
            figure.savefig(
                temp_name,
                format=file_format,
                dpi=dpi,
                bbox_inches=None if styled else "tight",
                metadata=fields,
            )

    return atomic_write(target, write)
