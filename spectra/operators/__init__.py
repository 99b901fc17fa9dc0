"""Curvature matrices of a loss as SciPy ``LinearOperator``s.

:class:`CurvatureOperator` (``base``) owns the snapshot of the weights, batches, caching,
blocks, replicas, counters and flattening; each matrix is one module supplying a
:class:`Curvature` (``problem``): what is differentiated. :class:`HessianOperator`
(``hessian``) is the loss Hessian, :class:`GGNOperator` (``ggn``) the generalized
Gauss-Newton matrix and :class:`FisherOperator` (``fisher``) the Monte Carlo and
empirical Fisher matrices. The compiled machinery is in ``engine``.
"""

from spectra.operators.base import CurvatureOperator, block_size_for
from spectra.operators.curvature import BatchProblem, Curvature, CurvatureParts
from spectra.operators.fisher import EmpiricalFisher, FisherOperator, MonteCarloFisher
from spectra.operators.ggn import GGN, GGNOperator
from spectra.operators.hessian import Hessian, HessianOperator

__all__ = [
    "GGN",
    "BatchProblem",
    "Curvature",
    "CurvatureOperator",
    "CurvatureParts",
    "EmpiricalFisher",
    "FisherOperator",
    "GGNOperator",
    "Hessian",
    "HessianOperator",
    "MonteCarloFisher",
    "block_size_for",
]
