"""The commands' reports, below the command line: what ``spectra analyze``, ``spectra
sharpness`` and ``spectra landscape`` compute, record and draw, with typed settings instead
of command-line options.

* :mod:`spectra.reports.base` — :class:`CommandReport`, the inputs' settings
  (:class:`InputSettings`) and the estimates' shared by the commands
  (:class:`EigensolverSettings`, :class:`EstimateSettings`), the inputs' errors
  (:class:`InputError`);
* :mod:`spectra.reports.figures` — :class:`FigureOptions`, titles, captions and the record
  of a report's figures;
* :mod:`spectra.reports.analyze` — :class:`AnalysisSettings`, :func:`compute_analysis`,
  :class:`AnalysisReport`, :func:`analysis_figures`;
* :mod:`spectra.reports.landscape` — :class:`LandscapeSettings`, :func:`compute_landscape`,
  :class:`LandscapeReport`, :func:`landscape_figures`;
* :mod:`spectra.reports.sharpness` — :class:`SharpnessRunSettings`,
  :class:`SharpnessReport`, :func:`sharpness_figures`, with
  :mod:`spectra.reports.thresholds` (the run's stability threshold) and
  :mod:`spectra.reports.sharpness_axes` (its x axes);
* :mod:`spectra.reports.loading` — :func:`load` (:func:`spectra.load`), which knows every
  result and report type.

The layer sits above :mod:`spectra.analysis`, :mod:`spectra.estimators`,
:mod:`spectra.operators` and :mod:`spectra.io` and below :mod:`spectra.cli`; it imports no
TensorFlow (a computation gets its operator and model from the caller) and no matplotlib
until a figure is drawn (:mod:`spectra.plotting`).
"""

from __future__ import annotations

from spectra.reports.analyze import (
    AnalysisReport,
    AnalysisSettings,
    analysis_figures,
    compute_analysis,
)
from spectra.reports.base import (
    CommandReport,
    EigensolverSettings,
    EstimateSettings,
    InputError,
    InputSettings,
    SettingConflict,
)
from spectra.reports.figures import DrawnFigure, FigureOptions, figure_record
from spectra.reports.landscape import (
    LandscapeReport,
    LandscapeSettings,
    compute_landscape,
    landscape_figures,
)
from spectra.reports.loading import load
from spectra.reports.sharpness import SharpnessReport, SharpnessRunSettings, sharpness_figures

__all__ = [
    "AnalysisReport",
    "AnalysisSettings",
    "CommandReport",
    "DrawnFigure",
    "EigensolverSettings",
    "EstimateSettings",
    "FigureOptions",
    "InputError",
    "InputSettings",
    "LandscapeReport",
    "LandscapeSettings",
    "SettingConflict",
    "SharpnessReport",
    "SharpnessRunSettings",
    "analysis_figures",
    "compute_analysis",
    "compute_landscape",
    "figure_record",
    "landscape_figures",
    "load",
    "sharpness_figures",
]
