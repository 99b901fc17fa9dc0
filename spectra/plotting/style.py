"""Print styles and fonts: the presets (:data:`STYLES`: a column or a page of a paper), the
fonts a figure asks for by kind or family (:class:`FigureFont`, :func:`resolve_font`), the
:func:`figure_style` context the plotting functions draw in, new figures in a style
(:func:`new_figure`), and the line widths and font sizes that follow the active style."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Print presets: the figure's width in inches (one column of a two-column paper, or the
# whole page), its height as a fraction of the width, the font sizes in points at that
# width (none below MIN_FONT_SIZE, the smallest most journals accept), the scale of
# line widths and marker sizes, and the PNG resolution.
MIN_FONT_SIZE = 7.0


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
_ACTIVE_STYLE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "spectra_plotting_style", default=None
)
_ACTIVE_FONT: contextvars.ContextVar[FigureFont | None] = contextvars.ContextVar(
    "spectra_plotting_font", default=None
)
# Attributes spectra sets on the figures it styles or describes.
STYLE_ATTRIBUTE = "_spectra_style"
_FONT_ATTRIBUTE = "_spectra_font"
METADATA_ATTRIBUTE = "_spectra_metadata"


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


def check_style(style: object) -> str | None:
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

    name = check_style(style)
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


def active_style() -> str | None:
    """The style of the :func:`figure_style` context drawn in now (None outside one, or in
    matplotlib's defaults)."""
    return _ACTIVE_STYLE.get()


def active_font() -> FigureFont | None:
    """The font of the :func:`figure_style` context drawn in now (None: the rcParams')."""
    return _ACTIVE_FONT.get()


def figure_size(style: str, aspect: float | None = None) -> tuple[float, float]:
    """(width, height) in inches of a figure in ``style``: the preset's width and its
    height as ``aspect`` (height / width; default the preset's)."""
    preset = STYLES[check_style(style) or "column"]
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

    name = check_style(style)
    chosen = resolve_font(font)
    size = None if name is None else figure_size(name, aspect)
    with figure_style(name, font=chosen):
        figure, axes = plt.subplots(nrows, ncols, figsize=size, layout="constrained")
    setattr(figure, STYLE_ATTRIBUTE, name)
    setattr(figure, _FONT_ATTRIBUTE, chosen)
    return figure, axes


def new_axes() -> Axes:
    """The axes of a new figure in the active style and font (a plotting function's
    ``ax=None``)."""
    _, ax = new_figure(active_style(), font=active_font())
    return ax


def figure_font(figure: Figure) -> FigureFont | None:
    """The font a figure was made in (:func:`new_figure`), None for matplotlib's."""
    font = getattr(figure, _FONT_ATTRIBUTE, None)
    return font if isinstance(font, FigureFont) else None


def scaled_size(width: float) -> float:
    """A line width or marker size scaled to the active style's width."""
    name = active_style()
    return width if name is None else width * STYLES[name].scale


def annotation_fontsize() -> float | str:
    """The font size of legends and annotations: "small", at least 7 pt in a style."""
    if active_style() is None:
        return "small"
    return STYLES[active_style() or "column"].rc["legend.fontsize"]


def root_figure(fig_or_ax: Artist) -> Figure:
    """The top-level figure of a figure, subfigure or axes (a ``TypeError`` for anything
    else)."""
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
