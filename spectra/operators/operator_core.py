"""What every curvature operator is, whichever engine computes its products.

:class:`OperatorCore` is the backend-neutral half of
:class:`spectra.operators.CurvatureOperator` (TensorFlow, :mod:`spectra.operators.base`)
and of its JAX counterpart (:mod:`spectra.operators.jax.base`): the SciPy
``LinearOperator`` protocol of a symmetric matrix with checked NumPy blocks, the flat
parameter layout, the dataset loss and gradient of the first pass, the kept and streamed
batch caches, and the memory plan that sizes a product's sub-blocks
(:mod:`spectra.operators.memory`). It imports NumPy and SciPy only.

An engine's operator sets, when it is built:

* ``layout`` (:class:`~spectra.operators.layout.ParameterLayout`), ``memory_budget`` and
  ``cache_bytes`` (public), ``num_hvps``, ``num_data_passes``;
* ``_batches`` (``num_examples``, ``examples_read``, ``bytes_read``), ``_engine`` (whose
  ``curvature.name`` names the matrix);
* ``_caches`` (None before the first pass, then the kept batches), ``_cached_index``,
  ``_num_streamed``, ``_loss``, ``_gradient`` (set by the first pass), ``_batch_bytes``
  (the largest batch cache), ``_snapshot_bytes``, ``_cache_policy`` (the ``cache``
  argument), ``_block_size_override``, ``_tangent_bytes`` (one vector's tangents when
  measured, else None) and ``_cache_transient`` (bytes; 0 where not measured);

and implements the abstract ``_prepare()`` (the first pass: loss, gradient, caches),
``_matmat`` (the products), ``_parallel_vectors()`` (vectors whose tangents are alive at
once) and ``cache_nbytes``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.sparse.linalg import LinearOperator

from spectra._symmetric import SymmetricProducts
from spectra._validation import check_int
from spectra.operators.layout import ParameterLayout, validated_block, validated_matrix
from spectra.operators.memory import TANGENT_FACTOR, MemoryPlan, format_bytes, sub_block_size

__all__ = ["OperatorCore"]


class OperatorCore(SymmetricProducts, LinearOperator):
    """A symmetric curvature matrix C of a dataset loss as a SciPy ``LinearOperator``: the
    engine-independent attributes and the product protocol (see the module docstring for
    what an engine's subclass provides)."""

    #: Shown after the class name by ``repr`` (" (JAX)" for the JAX engine's operators).
    _ENGINE_TAG = ""
    #: The products run in TensorFlow or XLA, which flush subnormal numbers to zero on a
    #: CPU: a product near the bottom of the dtype's range may lose terms of up to tiny
    #: each (read by the estimators' underflow check, see ``ProductCounter``).
    flushes_subnormals = True

    layout: ParameterLayout
    memory_budget: int
    cache_bytes: int
    num_hvps: int
    num_data_passes: int
    _batches: Any
    _engine: Any
    _caches: list[Any] | None
    _cached_index: dict[int, Any]
    _num_streamed: int
    _loss: float | None
    _gradient: np.ndarray | None
    _batch_bytes: int
    _snapshot_bytes: int
    _cache_policy: Any
    _block_size_override: int | None
    _tangent_bytes: int | None
    _cache_transient: int

    # -- memory -----------------------------------------------------------------------
    @property
    def max_block_size(self) -> int:
        """Vectors per sub-block of a ``matmat`` (larger blocks are split; all sub-blocks
        share one pass over the data).

        An explicit ``max_block_size`` is used as given. Otherwise the largest power of two
        k ≤ 64 whose product memory (the tangents of the vectors in flight and the block's
        (k, n) arrays, see :mod:`spectra.operators.memory`) fits memory_budget − snapshot −
        kept caches − one streamed batch cache (with ``cache=True``, the kept caches count
        at most their share ``cache_bytes``: beyond it they are over the budget, which the
        first pass warns about); before the first pass, with no batch measured, only the
        block's arrays are counted.
        """
        if self._block_size_override is not None:
            return self._block_size_override
        return sub_block_size(
            self._per_vector_bytes(),
            self._block_room(),
            per_row=self._per_row_bytes(),
            parallel=self._parallel_vectors(),
        )

    @max_block_size.setter
    def max_block_size(self, value: int) -> None:
        self._block_size_override = check_int("max_block_size", value)

    @abc.abstractmethod
    def _parallel_vectors(self) -> int:
        """How many vectors of a large block have their tangents alive at once."""

    def _per_vector_bytes(self) -> int:
        """The tangents of one vector in flight in a product: measured on the first
        product where the engine can, else estimated from the largest batch cache."""
        if self._tangent_bytes is not None:
            return self._tangent_bytes
        return int(TANGENT_FACTOR * self._batch_bytes)

    def _per_row_bytes(self) -> int:
        """One row of a block product's (k, n) arrays."""
        return self.shape[0] * np.dtype(self.dtype).itemsize

    def _block_room(self) -> int:
        streamed = self._batch_bytes if self._num_streamed else 0
        cached = self.cache_nbytes
        if self._cache_policy is True:
            # Caches kept on request beyond their share (cache_bytes) are over the budget
            # anyway (a warning says so): the products keep the room beside that share.
            cached = min(cached, self.cache_bytes)
        return self.memory_budget - self._snapshot_bytes - cached - streamed

    def memory_plan(self, block: int | None = None) -> MemoryPlan:
        """What this operator holds and will use, in bytes (a :class:`MemoryPlan`).

        ``block``: the number of vectors of the product to plan for (default: a whole
        sub-block, :attr:`max_block_size`); a larger block runs in sub-blocks. Before the
        first pass over the data (``loss()``, ``gradient()`` or a product) the batch figures
        are not known yet (``measured`` is False); afterwards they are the caches measured
        on that pass. ``peak`` estimates the most the operator and a product add to the
        memory the model itself holds. Costs nothing (no pass over the data).
        """
        block = self.max_block_size if block is None else check_int("block", block)
        return MemoryPlan(
            budget=self.memory_budget,
            snapshot=self._snapshot_bytes,
            cache_per_batch=self._batch_bytes,
            cached=self.cache_nbytes,
            cached_batches=len(self._caches or ()),
            streamed_batches=self._num_streamed,
            per_vector=self._per_vector_bytes(),
            per_row=self._per_row_bytes(),
            block_size=min(block, self.max_block_size),
            measured=self._loss is not None,
            parallel=self._parallel_vectors(),
            per_vector_measured=self._tangent_bytes is not None,
            cache_transient=self._cache_transient,
        )

    # -- flat vectors and variables -----------------------------------------------------
    @property
    def num_examples(self) -> int:
        """Number of examples N the loss is averaged over (all workers together)."""
        return self._batches.num_examples

    @property
    def num_examples_read(self) -> int:
        """Examples this process has read from the data so far, over all passes."""
        return self._batches.examples_read

    @property
    def num_bytes_read(self) -> int:
        """Bytes of batches this process has read from the data so far, over all passes."""
        return self._batches.bytes_read

    @property
    def variable_shapes(self) -> list[tuple[int, ...]]:
        return list(self.layout.shapes)

    @property
    def variable_names(self) -> list[str]:
        """Names (Keras paths) of the parameter blocks, in the flat vector's order."""
        return list(self.layout.names)

    @property
    def curvature(self) -> str:
        """The kind of matrix (``"hessian"``, ``"ggn"``, ``"fisher-mc"``, ...)."""
        return self._engine.curvature.name

    def flatten(self, tensors: Sequence[Any]) -> np.ndarray:
        """Concatenate per-variable arrays (row-major) into one vector of length n."""
        return self.layout.flatten(tensors)

    def unflatten(self, vector: Any) -> list[np.ndarray]:
        """Split a vector of length n into arrays shaped like the variables."""
        return self.layout.unflatten(vector)

    # -- loss, gradient, caching ------------------------------------------------------
    @abc.abstractmethod
    def _prepare(self) -> None:
        """The first pass over the data: the loss, the gradient and the kept caches."""

    def reset_cache(self) -> None:
        """Drop the cached batch state to free its memory.

        The operator keeps its snapshot: the next use recomputes the same state.
        """
        self._caches = None
        self._cached_index = {}
        self._num_streamed = 0
        self._loss = None
        self._gradient = None

    @property
    def is_cached(self) -> bool:
        """True when every batch's vector-independent state is held in memory."""
        return self._caches is not None and self._num_streamed == 0

    @property
    def num_cached_batches(self) -> int:
        """Batches (of this process) whose caches are kept (0 before the first pass)."""
        return len(self._caches or ())

    @property
    def num_streamed_batches(self) -> int:
        """Batches (of this process) recomputed in every pass (0 before the first pass)."""
        return self._num_streamed

    @property
    @abc.abstractmethod
    def cache_nbytes(self) -> int:
        """Bytes held by the kept batch caches (0 when every batch streams)."""

    def loss(self) -> float:
        """The dataset loss L(θ) at the operator's parameters."""
        self._prepare()
        assert self._loss is not None
        return self._loss

    def gradient(self) -> np.ndarray:
        """The flat gradient ∇L(θ), shape (n,), in the operator's dtype."""
        self._prepare()
        assert self._gradient is not None
        return self._gradient.copy()

    # -- products -------------------------------------------------------------------
    def matvec(self, x: Any) -> np.ndarray:
        """C x for a vector x of shape (n,) (or (n, 1))."""
        return super().matvec(validated_block(x, self.shape[0], self.dtype, "matvec"))

    def matmat(self, X: Any) -> np.ndarray:
        """C X for X of shape (n, k): k products in one pass over the data."""
        return super().matmat(validated_matrix(X, self.shape[0], self.dtype, "matmat"))

    def rmatvec(self, x: Any) -> np.ndarray:
        """Cᵀ x = C x (the matrix is symmetric)."""
        return self.matvec(x)

    def rmatmat(self, X: Any) -> np.ndarray:
        """Cᵀ X = C X (the matrix is symmetric)."""
        return self.matmat(X)

    def __repr__(self) -> str:
        if self._caches is None:
            mode = "not yet evaluated"
        elif not self._caches:
            mode = "streaming"
        else:
            total = len(self._caches) + self._num_streamed
            held = format_bytes(self.cache_nbytes)
            mode = f"cached {len(self._caches)} of {total} batches ({held})"
            if self._num_streamed:
                mode += f", streaming {self._num_streamed}"
        return (
            f"<{type(self).__name__}{self._ENGINE_TAG} n={self.shape[0]} dtype={self.dtype} "
            f"variables={len(self.layout)} examples={self._batches.num_examples} "
            f"{mode}; {self.num_hvps} products, {self.num_data_passes} data passes>"
        )
