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

The names below are importable from here; they are defined in the package's modules:

* ``style`` — print styles and fonts (:data:`STYLES`, :func:`figure_style`,
  :func:`resolve_font`, :func:`new_figure`);
* ``layout`` — what the figure kinds share (palette, grid, legends, the ``style`` and
  ``font`` keywords of the plotting functions);
* ``eigenvalues``, ``density``, ``sharpness``, ``layerwise``, ``landscape`` — one module
  per figure kind (:func:`plot_eigenvalues`, :func:`plot_spectral_density`, …);
* ``captions`` — titles, captions and the texts figures write (:func:`add_title`; the
  number formats :func:`format_value` and :func:`value_digits` come from ``spectra._format``);
* ``saving`` — :func:`save_figure` and the file metadata (:func:`figure_metadata`).
"""

from __future__ import annotations

# The names of __all__, and (as explicit re-exports "x as x") print_text, threshold_text
# and block_symbol, which the command line and the tests import from here.
from spectra._format import format_value, value_digits
from spectra.plotting.captions import add_title, figure_caption, repeats_description
from spectra.plotting.captions import print_text as print_text
from spectra.plotting.captions import threshold_text as threshold_text
from spectra.plotting.density import plot_spectral_density
from spectra.plotting.eigenvalues import plot_eigenvalues
from spectra.plotting.landscape import plot_loss_landscape_1d, plot_loss_landscape_2d
from spectra.plotting.layerwise import block_symbol as block_symbol
from spectra.plotting.layerwise import plot_layerwise
from spectra.plotting.saving import figure_metadata, save_figure
from spectra.plotting.sharpness import plot_sharpness
from spectra.plotting.style import (
    FONTS,
    STYLES,
    FigureFont,
    figure_size,
    figure_style,
    new_figure,
    resolve_font,
)

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
