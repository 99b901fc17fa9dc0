"""The flat parameter vector: what every operator shares, any backend.

NumPy only (no TensorFlow, no JAX), so that every engine and every operator over model
parameters uses one definition:

* :class:`ParameterLayout` — the parameter vector θ is the concatenation of the chosen
  variables in the given order, each flattened in row-major order; ``flatten`` and
  ``unflatten`` are inverse maps between per-variable arrays and θ-shaped vectors;
* :func:`validated_block` — the check every ``matvec``/``matmat`` input passes (shape,
  real and finite, representable in the operator's dtype).

The ``LinearOperator`` plumbing of a symmetric matrix, which operators and estimators
share, is :class:`spectra._symmetric.SymmetricProducts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ParameterLayout", "validated_block"]


class ParameterLayout:
    """Shapes, names and offsets of the variables that make up the flat vector θ.

    ``shapes[i]`` is variable i's shape, ``names[i]`` how errors name it (its Keras path),
    ``dtype`` the flat vector's NumPy dtype. ``offsets[i]:offsets[i + 1]`` is variable i's
    slice of θ.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], names: Sequence[str], dtype: Any) -> None:
        self.shapes: list[tuple[int, ...]] = [tuple(int(d) for d in s) for s in shapes]
        self.names: list[str] = [str(n) for n in names]
        if len(self.names) != len(self.shapes):
            raise ValueError(f"{len(self.shapes)} shapes but {len(self.names)} names.")
        self.dtype = np.dtype(dtype)
        self.sizes: list[int] = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets: np.ndarray = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])

    @property
    def size(self) -> int:
        """n, the length of θ."""
        return int(self.offsets[-1])

    def __len__(self) -> int:
        return len(self.shapes)

    def slice(self, index: int) -> slice:
        """Variable ``index``'s slice of θ."""
        return slice(int(self.offsets[index]), int(self.offsets[index + 1]))

    def flatten(self, arrays: Sequence[Any]) -> np.ndarray:
        """Concatenate per-variable arrays (row-major) into one vector of length n, in
        :attr:`dtype`; a one-line ``ValueError`` naming the variable whose array does not
        fit."""
        arrays = list(arrays)
        if len(arrays) != len(self.shapes):
            raise ValueError(
                f"expected {len(self.shapes)} arrays (one per variable), got {len(arrays)}."
            )
        parts = []
        for i, (array, shape) in enumerate(zip(arrays, self.shapes)):
            a = np.asarray(array)
            if a.shape != shape:
                raise ValueError(
                    f"array {i} has shape {a.shape}; variable {i} ({self.names[i]!r}) has {shape}."
                )
            parts.append(a.reshape(-1))
        if not parts:
            return np.zeros(0, self.dtype)
        return np.concatenate(parts).astype(self.dtype, copy=False)

    def unflatten(self, vector: Any) -> list[np.ndarray]:
        """Split a vector of length n into arrays shaped like the variables (views)."""
        v = np.asarray(vector)
        if v.shape != (self.size,):
            raise ValueError(f"expected a vector of shape ({self.size},), got {v.shape}.")
        return [v[self.slice(i)].reshape(s) for i, s in enumerate(self.shapes)]

    def unflatten_block(self, block: Any) -> list[np.ndarray]:
        """Split a block (n, k) into arrays of shape ``(k, *shape)``, one per variable."""
        b = np.asarray(block)
        if b.ndim != 2 or b.shape[0] != self.size:
            raise ValueError(f"expected a block of shape ({self.size}, k), got {b.shape}.")
        k = b.shape[1]
        return [b[self.slice(i)].T.reshape(k, *s) for i, s in enumerate(self.shapes)]

    def flatten_block(self, arrays: Sequence[Any]) -> np.ndarray:
        """The inverse of :meth:`unflatten_block`: arrays ``(k, *shape)`` into (n, k)."""
        arrays = [np.asarray(a) for a in arrays]
        if len(arrays) != len(self.shapes):
            raise ValueError(
                f"expected {len(self.shapes)} arrays (one per variable), got {len(arrays)}."
            )
        k = arrays[0].shape[0] if arrays else 0
        for i, (a, shape) in enumerate(zip(arrays, self.shapes)):
            if a.shape != (k, *shape):
                raise ValueError(
                    f"array {i} has shape {a.shape}; expected {(k, *shape)} for variable "
                    f"{i} ({self.names[i]!r})."
                )
        if not arrays:
            return np.zeros((0, 0), self.dtype)
        return np.concatenate([a.reshape(k, -1) for a in arrays], axis=1).T.astype(
            self.dtype, copy=False
        )


def validated_block(x: Any, size: int, dtype: Any, name: str) -> np.ndarray:
    """``x`` as a vector (size,) or block (size, k) of finite reals that fit ``dtype``; a
    one-line ``ValueError``/``TypeError`` naming ``name`` (the method) otherwise."""
    a = np.asarray(x)
    n = size
    if a.ndim == 1:
        if a.shape[0] != n:
            raise ValueError(f"{name}: expected a vector of length {n}, got length {a.shape[0]}.")
    elif a.ndim == 2:
        if a.shape[0] != n:
            raise ValueError(f"{name}: expected an array of shape ({n}, k), got {a.shape}.")
    else:
        raise ValueError(f"{name}: expected a 1-D or 2-D array, got {a.ndim} dimensions.")
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.number) or np.iscomplexobj(a):
        raise TypeError(f"{name}: expected real numbers, got dtype {a.dtype}.")
    # One pass over the input: the largest magnitude is NaN or Inf exactly when an
    # entry is (np.max propagates NaN).
    largest = float(np.max(np.abs(a))) if a.size else 0.0
    if not np.isfinite(largest):
        raise ValueError(f"{name}: the input contains NaN or Inf.")
    limit = float(np.finfo(dtype).max)
    if largest > limit:
        raise ValueError(
            f"{name}: the input has entries up to {largest:.3g}, beyond the largest "
            f"{np.dtype(dtype)} ({limit:.3g}) the operator computes in; scale the vector down "
            "(products are linear) or build the operator with dtype=np.float64."
        )
    return a


def validated_matrix(x: Any, size: int, dtype: Any, name: str) -> np.ndarray:
    """:func:`validated_block` for a block only: ``x`` of shape (size, k), a one-line
    ``ValueError`` for a vector."""
    a = validated_block(x, size, dtype, name)
    if a.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array of shape ({size}, k).")
    return a
