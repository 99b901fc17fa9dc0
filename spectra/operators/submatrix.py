"""A submatrix C[rows][:, cols] of any linear operator, as a LinearOperator.

``SubmatrixOperator(C, rows, cols)`` multiplies a vector x of length len(cols) by
embedding it into the operator's input space with zeros elsewhere (z[cols] = x), taking
one product C z and keeping the entries ``rows``: C[rows][:, cols] x = (C z)[rows]. So
every product of the submatrix costs one product of C (a block of k vectors one
``matmat`` of k columns), whatever the number of indices; what it saves is host memory
and the size of the problem the estimators see (the spectrum of one layer's block of a
Hessian, say, with ``rows = cols`` that layer's parameter indices).

NumPy and SciPy only: C may be a :class:`~spectra.CurvatureOperator`, any SciPy
``LinearOperator`` or a dense array.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.sparse.linalg import LinearOperator, aslinearoperator

from spectra._validation import is_bool

__all__ = ["SubmatrixOperator"]


def as_operator(op: Any, owner: str) -> LinearOperator:
    """``op`` as a SciPy ``LinearOperator`` (arrays and sparse matrices wrapped), 2-D with
    positive dimensions; a one-line ``TypeError`` naming ``owner`` otherwise."""
    if isinstance(op, LinearOperator):
        operator = op
    else:
        try:
            operator = aslinearoperator(op)
        except TypeError:
            raise TypeError(
                f"{owner}: op must be a LinearOperator (e.g. a spectra HessianOperator) or a "
                f"2-D array, got {type(op).__name__}"
            ) from None
    shape = tuple(operator.shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"{owner}: op must be 2-D with positive dimensions, got shape {shape}")
    return operator


def index_array(name: str, values: Any, size: int) -> np.ndarray:
    """``values`` as a 1-D int64 array of distinct indices in [0, size).

    Raises ``TypeError`` for a string, a scalar, or entries that are not integers (bools and
    integral floats included) and ``ValueError`` for an empty, multi-dimensional,
    out-of-range or repeating list, each naming ``name``.
    """
    if isinstance(values, (str, bytes)) or np.ndim(values) == 0:
        raise TypeError(
            f"{name} must be a list or 1-D array of integer indices, got {type(values).__name__}"
        )
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} is empty: give at least one index")
    if array.dtype.kind not in "iu":  # bools ("b"), floats, strings, objects
        items = list(values) if isinstance(values, (list, tuple)) else array.tolist()
        bad = next(
            (v for v in items if is_bool(v) or not isinstance(v, (int, np.integer))), items[0]
        )
        raise TypeError(f"{name} must hold integer indices, got {bad!r} ({type(bad).__name__})")
    array = array.astype(np.int64)
    outside = array[(array < 0) | (array >= size)]
    if outside.size:
        raise ValueError(
            f"{name}: index {int(outside[0])} is out of range [0, {size}) (negative "
            "indices are not wrapped)"
        )
    values_seen, counts = np.unique(array, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"{name}: index {int(values_seen[counts > 1][0])} appears twice")
    return array


class SubmatrixOperator(LinearOperator):
    """C[rows][:, cols] as a LinearOperator of shape (len(rows), len(cols)).

    A product embeds x into the input space of C with zeros (z[cols] = x, z = 0 elsewhere),
    multiplies once and keeps the entries ``rows``: cost one product of C per vector, a
    block of k vectors in one ``matmat`` of k columns. The adjoint is C[cols][:, rows]ᵀ
    read the same way through ``C.rmatmat``; with ``cols`` = ``rows`` (the default) and C
    symmetric the submatrix is symmetric, so the estimators (:func:`spectra.eigenvalues`,
    :func:`spectra.trace`, ...) accept it.

    Parameters
    ----------
    op
        the matrix C: a LinearOperator (a :class:`~spectra.HessianOperator`, ...) or a
        2-D array, m × n.
    row_indices
        distinct integer indices in [0, m), in the order the submatrix's rows take.
    col_indices
        distinct integer indices in [0, n); default: ``row_indices``.

    Raises
    ------
    TypeError
        ``op`` is not an operator or array, or the indices are not integers.
    ValueError
        an index list is empty, not 1-D, out of range or repeats an index.
    """

    def __init__(self, op: Any, row_indices: Any, col_indices: Any = None) -> None:
        self.op = as_operator(op, "SubmatrixOperator")
        rows, columns = self.op.shape
        self.row_indices = index_array("row_indices", row_indices, rows)
        self.col_indices = (
            self.row_indices.copy()
            if col_indices is None
            else index_array("col_indices", col_indices, columns)
        )
        super().__init__(
            dtype=np.dtype(self.op.dtype), shape=(self.row_indices.size, self.col_indices.size)
        )

    def _embedded(self, X: np.ndarray, indices: np.ndarray, size: int) -> np.ndarray:
        full = np.zeros((size, X.shape[1]), dtype=np.result_type(X.dtype, self.dtype))
        full[indices] = X
        return full

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X)
        full = self._embedded(X, self.col_indices, self.op.shape[1])
        return np.asarray(self.op.matmat(full))[self.row_indices]

    def _rmatmat(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X)
        full = self._embedded(X, self.row_indices, self.op.shape[0])
        return np.asarray(self.op.rmatmat(full))[self.col_indices]

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._matmat(np.asarray(x).reshape(-1, 1)).reshape(-1)

    def _rmatvec(self, x: np.ndarray) -> np.ndarray:
        return self._rmatmat(np.asarray(x).reshape(-1, 1)).reshape(-1)

    def _adjoint(self) -> SubmatrixOperator:
        return SubmatrixOperator(self.op.H, self.col_indices, self.row_indices)

    def to_dense(self) -> np.ndarray:
        """The dense submatrix, len(rows) × len(cols): len(cols) products of C in one
        ``matmat`` (and that much host memory), for small problems and tests."""
        return self._matmat(np.eye(self.shape[1], dtype=self.dtype))

    def __repr__(self) -> str:
        return (
            f"<{self.shape[0]}x{self.shape[1]} SubmatrixOperator of "
            f"{type(self.op).__name__} {self.op.shape[0]}x{self.op.shape[1]}>"
        )
