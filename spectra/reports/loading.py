""":func:`spectra.load`: any result's JSON, or a command's report, as its class.

The result types register themselves with :mod:`spectra.estimators.results` as their classes
are defined (``Result.__init_subclass__``); importing this module imports every module that
defines one above the estimators (the analysis results, the command reports), so that
:func:`load` knows them all. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import os
from typing import Any

from spectra.analysis import landscape_result, per_layer, repeats, subspaces
from spectra.estimators import results
from spectra.reports import analyze, base, landscape, sharpness

__all__ = ["load"]

# The modules that define the result types above the estimators: each type registers itself
# with spectra.estimators.results when its class is defined.
_DEFINING_MODULES = (
    landscape_result,
    per_layer,
    repeats,
    subspaces,
    base,
    analyze,
    landscape,
    sharpness,
)


def load(path: str | os.PathLike) -> Any:
    """The result (or command report) in the JSON file ``path``, as its class.

    Reads any result's :meth:`spectra.estimators.results.Result.to_json`, ``spectra
    analyze``'s ``results.json`` (:class:`spectra.reports.analyze.AnalysisReport`),
    ``spectra landscape``'s ``landscape.json``
    (:class:`spectra.reports.landscape.LandscapeReport`) and ``spectra sharpness``'s
    ``sharpness.json`` (:class:`spectra.reports.sharpness.SharpnessReport`): the file's
    ``"type"`` field names the class, and
    :meth:`~spectra.estimators.results.Result.from_dict` rebuilds it with numpy arrays, the
    NaN and ±inf written as null restored, after checking every field (types, lengths that
    must agree, NaN where a number is required, the keys the figures read). No TensorFlow
    is imported.

    Raises
    ------
    ValueError
        one line naming ``path`` and the cause: not UTF-8, not JSON, cut short, nested
        too deep (:func:`spectra.io.files.read_json`), no or an unknown ``"type"``; or a
        field that is not what its class holds, named by its path in the file, e.g.
        ``out/results.json: "eigenvalues.eigenvalues" has 1 value but
        "eigenvalues.error_bounds" has 2; the file was edited or is damaged — rerun the
        analysis (spectra analyze)`` (a :class:`spectra.io.result_validation.FieldError`).
    OSError
        the file cannot be read (FileNotFoundError for a missing file).
    """
    return results.load(path)
