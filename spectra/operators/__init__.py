"""Curvature matrices of a loss as SciPy ``LinearOperator``s.

:class:`CurvatureOperator` (``base``) owns the snapshot of the weights, batches, caching,
blocks, replicas, counters and flattening; each matrix is one module supplying a
:class:`Curvature` (``problem``): what is differentiated. :class:`HessianOperator`
(``hessian``) is the loss Hessian. The compiled machinery is in ``engine``.
"""

from spectra.operators.base import CurvatureOperator, block_size_for
from spectra.operators.hessian import Hessian, HessianOperator
from spectra.operators.problem import BatchProblem, Curvature, CurvatureParts

__all__ = [
    "BatchProblem",
    "Curvature",
    "CurvatureOperator",
    "CurvatureParts",
    "Hessian",
    "HessianOperator",
    "block_size_for",
]
