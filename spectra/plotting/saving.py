"""Saving figures: :func:`save_figure` (atomic, fonts kept as fonts, print size for a
styled figure) and the file metadata it writes (:func:`figure_metadata`)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from spectra.io.files import atomic_write
from spectra.plotting.style import (
    METADATA_ATTRIBUTE,
    STYLE_ATTRIBUTE,
    STYLES,
    figure_font,
    root_figure,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Fonts kept as fonts in every file: TrueType (Type 42) in PDF and PostScript, which
# journals accept (Type 3 bitmaps they often reject), and <text> elements in SVG.
_FONT_RC = {"pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "none"}


def figure_metadata(fig_or_ax: Figure | Axes) -> dict[str, str]:
    """What :func:`save_figure` writes into a figure's file metadata: ``"Title"`` and
    ``"Description"`` (recorded by :func:`add_title`: the title, drawn or not, and the full
    caption) and ``"Keywords"``, the figure's print settings (``"style column; font serif
    (STIXGeneral, DejaVu Serif; math cm)"``) when it was made in a style or a font."""
    figure = root_figure(fig_or_ax)
    recorded = dict(getattr(figure, METADATA_ATTRIBUTE, None) or {})
    if "Keywords" not in recorded:
        settings = []
        style = getattr(figure, STYLE_ATTRIBUTE, None)
        if style is not None:
            settings.append(f"style {style}")
        font = figure_font(figure)
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
    fig_or_ax: Figure | Axes,
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

    figure = root_figure(fig_or_ax)
    target = pathlib.Path(path)
    file_format = target.suffix.lstrip(".").lower()
    supported = figure.canvas.get_supported_filetypes()
    if not file_format:
        raise ValueError(f"cannot infer the format of {str(target)!r}: give a suffix like .png")
    if file_format not in supported:
        raise ValueError(
            f"unsupported figure format {file_format!r}; supported: {', '.join(sorted(supported))}"
        )
    styled = getattr(figure, STYLE_ATTRIBUTE, None) is not None
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

    font = figure_font(figure)

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
