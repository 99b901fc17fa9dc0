"""The curvature matrices ``spectra analyze --curvature`` can measure.

They are the registered matrices of :mod:`spectra.operators.registry` (one line each,
read by the API as well): a :class:`CurvatureChoice` names the operator class (imported
when a command runs, so that the parser imports nothing heavy), the extra keywords of its
``from_keras`` and how figures and reports name the matrix. To add a matrix, add its line
there.
"""

from __future__ import annotations

from spectra.operators.registry import CURVATURES, DEFAULT_CURVATURE
from spectra.operators.registry import CurvatureEntry as CurvatureChoice

__all__ = ["CURVATURES", "DEFAULT_CURVATURE", "CurvatureChoice", "curvature_choice"]


def curvature_choice(name: str | None) -> CurvatureChoice:
    """The registered choice ``name`` (the default, the Hessian, for None)."""
    return CURVATURES[name or DEFAULT_CURVATURE]
