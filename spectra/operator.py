"""Import path kept for existing code: :class:`HessianOperator` lives in
:mod:`spectra.operators.hessian` (``spectra.operators`` holds all curvature operators)."""

from spectra.operators.base import block_size_for
from spectra.operators.hessian import HessianOperator

__all__ = ["HessianOperator", "block_size_for"]
