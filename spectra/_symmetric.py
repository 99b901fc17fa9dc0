"""The ``LinearOperator`` plumbing of a symmetric matrix, shared by every layer.

SciPy's :class:`~scipy.sparse.linalg.LinearOperator` asks a subclass for products with C
and with Cᵀ, and for its adjoint and transpose. For a symmetric C = Cᵀ (the curvature
operators, their K-FAC approximations and preconditioned forms, the inverses the
estimators build, the estimators' product counter) these are all the product with C:
:class:`SymmetricProducts` says so once. NumPy only, below the operators and the
estimators alike (``tests/test_layers.py``).
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

__all__ = ["SymmetricProducts"]


class SymmetricProducts(abc.ABC):
    """``LinearOperator`` plumbing of a symmetric matrix C = Cᵀ, mixed in before
    ``LinearOperator``: products with Cᵀ are products with C, the adjoint and transpose are
    the operator itself, and ``matvec`` is a one-column ``matmat`` (so that a subclass
    implements ``_matmat`` only; a class that does not cannot be instantiated)."""

    @abc.abstractmethod
    def _matmat(self, X: np.ndarray) -> np.ndarray:
        """C X for a checked block X of shape (n, k)."""

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._matmat(np.reshape(x, (-1, 1))).reshape(-1)

    def _rmatvec(self, x: np.ndarray) -> np.ndarray:
        return self._matvec(x)

    def _rmatmat(self, X: np.ndarray) -> np.ndarray:
        return self._matmat(X)

    def _adjoint(self) -> Any:
        return self

    def _transpose(self) -> Any:
        return self
