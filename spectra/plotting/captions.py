"""Titles, captions and the texts figures write: :func:`add_title` (a title and a caption
line, recorded for the file's metadata), :func:`figure_caption`, :func:`print_text` (numbers
as a figure writes them), and the legend texts of stability thresholds
(:func:`threshold_text`) and repeated estimates (:func:`repeats_description`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from spectra.plotting.style import (
    METADATA_ATTRIBUTE,
    MIN_FONT_SIZE,
    STYLE_ATTRIBUTE,
    STYLES,
    FigureFont,
    figure_font,
    resolve_font,
    root_figure,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    from spectra.analysis.repeats import RepeatResult

_CAPTION_FONTSIZE = 8
# Attributes of a figure holding the texts add_title drew: the title (the figure's
# suptitle) and a caption drawn as a figure text (over side-by-side panels, or under a
# figure without axes); a caption over one column of panels is the first axes' title.
_TITLE_ATTRIBUTE = "_spectra_title"
_CAPTION_ATTRIBUTE = "_spectra_caption"
# The width of a bold character of the Times-like serif, in em (DejaVu Sans Bold: 0.62).
_SERIF_BOLD_EM = 0.52


def _font_keywords(font: FigureFont | None) -> dict[str, Any]:
    """Keywords of a matplotlib ``Text`` that draw it in ``font`` (none for None)."""
    if font is None:
        return {}
    return {"fontfamily": list(font.families), "math_fontfamily": font.math}


def repeats_description(repeats: RepeatResult) -> str:
    """``"5 subsets of 50% of the data"`` or ``"5 seeds"``: what a :class:`spectra.RepeatResult`
    varied."""
    if repeats.subsample is not None:
        return f"{repeats.repeats} subsets of {100 * repeats.subsample:.3g}% of the data"
    return f"{repeats.repeats} seeds"


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


def figure_caption(*parts: object) -> str:
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
    recorded = dict(getattr(figure, METADATA_ATTRIBUTE, None) or {})
    if title:
        recorded["Title"] = title
    if description:
        recorded["Description"] = description
    setattr(figure, METADATA_ATTRIBUTE, recorded)


def add_title(
    fig_or_ax: Figure | Axes,
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

    figure = root_figure(fig_or_ax)
    if isinstance(metadata, Mapping):
        _describe(figure, metadata.get("Title") or title, metadata.get("Description"))
    else:
        _describe(figure, title, metadata if metadata is not None else caption)
    font = figure_font(figure)
    settings: Any = {} if font is None else font.rc()
    with mpl.rc_context(settings):
        _draw_title(figure, fig_or_ax, title, caption)
    return figure


def _draw_title(
    figure: Figure, fig_or_ax: Figure | Axes, title: str | None, caption: str | None
) -> None:
    """The title and caption of :func:`add_title`, in the figure's font."""
    import matplotlib.axes

    font = _font_keywords(figure_font(figure))
    styled = getattr(figure, STYLE_ATTRIBUTE, None) is not None
    title_size = STYLES["column"].rc["figure.titlesize"] if styled else 12
    caption_size = MIN_FONT_SIZE if styled else _CAPTION_FONTSIZE
    added_points = 0.0
    if title:
        shown = title
        if styled:
            # Bold characters are about 0.62 em wide (0.52 em in a Times-like serif).
            import textwrap

            em = _SERIF_BOLD_EM if figure_font(figure) == resolve_font("serif") else 0.62
            characters = int(0.85 * figure.get_figwidth() * 72.0 / (em * title_size))
            shown = "\n".join(textwrap.wrap(title, max(20, characters), break_on_hyphens=False))
        drawn = figure.suptitle(shown, fontsize=title_size, fontweight="bold", **font)
        setattr(figure, _TITLE_ATTRIBUTE, drawn)
        added_points += 1.3 * title_size * (shown.count("\n") + 1) + 0.2 * title_size
    if caption:
        axes = fig_or_ax if isinstance(fig_or_ax, matplotlib.axes.Axes) else None
        if axes is None and figure.axes:
            axes = figure.axes[0]
        # Characters per line: about 0.52 em each; in a print style the caption is centred
        # on the axes, which leave about a fifth of the width to the y label.
        usable = 0.8 * figure.get_figwidth() if styled else figure.get_figwidth()
        width = max(40, int(usable * 72.0 / ((0.56 if styled else 0.52) * caption_size)))
        text = _wrap_caption(caption, width)
        pad = 6 if styled else 8
        if axes is None:
            below = figure.supxlabel(text, fontsize=caption_size, color="0.3", **font)
            setattr(figure, _CAPTION_ATTRIBUTE, below)
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
    font = _font_keywords(figure_font(figure))
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


def caption_artist(figure: Figure) -> Text | None:
    """The matplotlib ``Text`` of the caption :func:`add_title` drew on ``figure`` (the
    first panel's title, or a figure text over side-by-side panels), None without one."""
    drawn = getattr(figure, _CAPTION_ATTRIBUTE, None)
    if drawn is not None:
        return drawn
    for axes in figure.axes:
        if axes.get_title():
            return axes.title
    return None


def _centre_title_on(figure: Figure, axes: Axes) -> None:
    """Centre the figure's title over ``axes``, the figure's only column of panels, on the
    line of its caption (the title of ``axes``)."""
    from matplotlib.transforms import blended_transform_factory

    title = _figure_title(figure)
    if title is not None and axes.get_subplotspec() is not None:
        title.set_transform(blended_transform_factory(axes.transAxes, figure.transSubfigure))
        title.set_x(0.5)


def _figure_title(figure: Figure) -> Text | None:
    """The matplotlib ``Text`` of the figure's title: the one :func:`add_title` drew, else
    one set by ``figure.suptitle`` (found among the figure's texts by the text that
    ``figure.get_suptitle`` returns, matplotlib >= 3.8); None without a title."""
    drawn = getattr(figure, _TITLE_ATTRIBUTE, None)
    if drawn is not None:
        return drawn
    get_suptitle = getattr(figure, "get_suptitle", None)
    title = get_suptitle() if get_suptitle is not None else ""
    if not title:
        return None
    return next((text for text in figure.texts if text.get_text() == title), None)
