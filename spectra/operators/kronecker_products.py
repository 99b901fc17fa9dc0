"""Products with a block-diagonal matrix of Kronecker-factored blocks, in TensorFlow.

K-FAC, EKFAC and their damped inverses (:mod:`spectra.operators.kfac`) are block
diagonal over layers: a layer with parameters W (d_a × d_out, the bias as W's last row)
has the block A ⊗ G (K-FAC) or (Q_A ⊗ Q_G) diag(s) (Q_A ⊗ Q_G)ᵀ (EKFAC, and any function
of K-FAC applied through its eigendecomposition, such as (K + δI)⁻¹), and the rest of the
parameters a diagonal. With spectra's row-major flattening, vec(W) ↦ vec(A W G) is the
product with A ⊗ G (G symmetric), and vec(W) ↦ vec(Q_A [(Q_Aᵀ W Q_G) ∘ S] Q_Gᵀ) the
product with the eigen-form block. Cost per vector: 2 d_a d_out (d_a + d_out) flops per
block (twice that in eigen form), no pass over the data.

:class:`KroneckerProducts` runs all blocks of a (P, k) block of vectors in one compiled
TensorFlow function, so that the products run where TensorFlow places them (a GPU when
there is one) with the factors kept there, as batched matrix products (k vectors at once),
and without a Python loop over layers per call. It is traced once per dtype (the number
of vectors is a free dimension).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["KroneckerBlock", "KroneckerProducts"]


@dataclasses.dataclass(frozen=True)
class KroneckerBlock:
    """One layer's block and where its parameters lie in the flat vector.

    ``kernel_slice`` (d_in · d_out entries, row-major d_in × d_out) and ``bias_slice``
    (d_out entries), either may be None; ``d_out`` the block's output width. Factors:
    ``A`` (d_a × d_a) and ``G`` (d_out × d_out) for the Kronecker form A ⊗ G; or
    ``QA``, ``QG`` (orthogonal) and ``scalings`` (d_a × d_out) for the eigen form
    (Q_A ⊗ Q_G) diag(vec(scalings)) (Q_A ⊗ Q_G)ᵀ. d_a = d_in + (1 if a bias slice).
    """

    kernel_slice: slice | None
    bias_slice: slice | None
    d_out: int
    A: np.ndarray | None = None
    G: np.ndarray | None = None
    QA: np.ndarray | None = None
    QG: np.ndarray | None = None
    scalings: np.ndarray | None = None

    @property
    def eigen_form(self) -> bool:
        return self.scalings is not None

    def factors(self) -> tuple[np.ndarray, ...]:
        if self.eigen_form:
            assert self.QA is not None and self.QG is not None and self.scalings is not None
            return (self.QA, self.QG, self.scalings)
        assert self.A is not None and self.G is not None
        return (self.A, self.G)


class KroneckerProducts:
    """K X for K block diagonal: :class:`KroneckerBlock` s and a diagonal on the other
    parameters (``other_slices`` with ``other_diagonal``), as one compiled TensorFlow
    function over blocks X of shape (P, k) in ``dtype``.

    The factors are copied to TensorFlow once (``nbytes``: their size there); the
    function is traced on the first call. ``__call__`` takes and returns NumPy arrays.
    """

    def __init__(
        self,
        size: int,
        blocks: Sequence[KroneckerBlock],
        other_slices: Sequence[slice],
        other_diagonal: np.ndarray,
        dtype: Any,
    ) -> None:
        self.size = int(size)
        self.dtype = np.dtype(dtype)
        self._blocks = list(blocks)
        self._other_slices = list(other_slices)
        tf_dtype = tf.as_dtype(self.dtype)
        self._factors = [
            tuple(tf.constant(np.asarray(f, self.dtype), dtype=tf_dtype) for f in b.factors())
            for b in self._blocks
        ]
        self._other_diagonal = [
            tf.constant(np.asarray(other_diagonal[_offsets(self._other_slices, i)], self.dtype))
            for i in range(len(self._other_slices))
        ]
        self.nbytes = sum(
            int(np.prod(t.shape)) * self.dtype.itemsize for f in self._factors for t in f
        )
        self.nbytes += sum(int(t.shape[0]) * self.dtype.itemsize for t in self._other_diagonal)
        self._function = tf.function(
            self._apply,
            input_signature=[tf.TensorSpec([self.size, None], tf_dtype)],
            autograph=False,
            reduce_retracing=True,
        )
        #: Traces of the compiled function (1 after the first call, for any k).
        self.num_traces = 0

    def __call__(self, X: np.ndarray) -> np.ndarray:
        """K X for X of shape (P, k), in the dtype given at construction."""
        result = self._function(tf.constant(np.asarray(X, self.dtype)))
        return result.numpy()

    def peak_bytes(self, k: int) -> int:
        """The memory one product of k vectors adds (beyond the factors): the block in,
        its transpose, the result and its transpose, and the largest block's two
        intermediate (k, d_a, d_out) arrays."""
        widest = max(
            (
                (b.kernel_slice.stop - b.kernel_slice.start if b.kernel_slice else 0)
                + (b.d_out if b.bias_slice else 0)
                for b in self._blocks
            ),
            default=0,
        )
        return (4 * self.size + 2 * widest) * k * self.dtype.itemsize

    def _apply(self, X: tf.Tensor) -> tf.Tensor:
        self.num_traces += 1
        rows = tf.transpose(X)  # (k, P): each block's slices are contiguous columns
        k = tf.shape(rows)[0]
        pieces: list[tuple[int, tf.Tensor]] = []
        for block, factors in zip(self._blocks, self._factors):
            parts = []
            d_out = block.d_out
            if block.kernel_slice is not None:
                s = block.kernel_slice
                parts.append(tf.reshape(rows[:, s.start : s.stop], (k, -1, d_out)))
            if block.bias_slice is not None:
                s = block.bias_slice
                parts.append(tf.reshape(rows[:, s.start : s.stop], (k, 1, d_out)))
            M = parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)
            out = _block_product(M, factors, block.eigen_form)
            d_in = 0
            if block.kernel_slice is not None:
                d_in = (block.kernel_slice.stop - block.kernel_slice.start) // d_out
                pieces.append((block.kernel_slice.start, tf.reshape(out[:, :d_in], (k, -1))))
            if block.bias_slice is not None:
                pieces.append((block.bias_slice.start, out[:, d_in]))
        for s, diagonal in zip(self._other_slices, self._other_diagonal):
            pieces.append((s.start, rows[:, s.start : s.stop] * diagonal[None, :]))
        pieces.sort(key=lambda piece: piece[0])
        if not pieces:
            return tf.zeros_like(X)
        return tf.transpose(tf.concat([piece for _, piece in pieces], axis=1))


def _block_product(M: tf.Tensor, factors: Sequence[tf.Tensor], eigen_form: bool) -> tf.Tensor:
    """One block on M (k, d_a, d_out): A M G, or Q_A [(Q_Aᵀ M Q_G) ∘ S] Q_Gᵀ."""
    if not eigen_form:
        A, G = factors
        return tf.matmul(A, _times_right(M, G))
    QA, QG, scalings = factors
    rotated = tf.matmul(QA, _times_right(M, QG), transpose_a=True) * scalings[None]
    return tf.matmul(QA, _times_right(rotated, QG, transpose=True))


def _times_right(M: tf.Tensor, right: tf.Tensor, transpose: bool = False) -> tf.Tensor:
    """M[j] @ right (or rightᵀ) for every j, as one (k·d_a × d_out) matrix product."""
    shape = tf.shape(M)
    flat = tf.reshape(M, (-1, shape[2]))
    product = tf.matmul(flat, right, transpose_b=transpose)
    return tf.reshape(product, (shape[0], shape[1], -1))


def _offsets(slices: Sequence[slice], index: int) -> slice:
    """Where ``slices[index]`` lies in the concatenation of all of them."""
    start = sum(s.stop - s.start for s in slices[:index])
    return slice(start, start + slices[index].stop - slices[index].start)
