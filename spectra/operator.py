"""The loss Hessian of a TensorFlow/Keras model as a SciPy ``LinearOperator``.

The operator is the exact Hessian of the dataset loss
``L(θ) = Σ_b (n_b/N) L_b(θ)`` with respect to the flattened parameters θ (the given
variables, concatenated in order, each flattened row-major). It is never formed: each
product is computed by automatic differentiation (:mod:`spectra.hvp`), and

* **cached**: per batch, the forward pass, the gradient and the vector-independent part
  of the second backward are computed once and kept (within a memory budget), so each
  further product costs only its vector-dependent arithmetic;
* **blocked**: ``matmat`` multiplies k vectors in one pass over the data, vectorized in
  one compiled graph per batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from scipy.sparse.linalg import LinearOperator

from spectra import _keras
from spectra._replicas import Replicas
from spectra.data import Batches
from spectra.hvp import BatchCache, HVPEngine, cached_engine, spec_key

__all__ = ["HessianOperator"]

_LARGEST_BLOCK = 64
_BLOCK_BYTES = 512 * 1024**2
# Arrays of shape (k, n) alive during a block product: the input block, the product of a
# batch, the running sum per replica, and the host copy.
_BLOCK_COPIES = 4


def block_size_for(num_parameters: int, itemsize: int, budget_bytes: int = _BLOCK_BYTES) -> int:
    """The largest power-of-two block (≤ 64 vectors) whose (k, n) arrays fit the budget."""
    per_vector = _BLOCK_COPIES * num_parameters * itemsize
    fits = max(1, min(_LARGEST_BLOCK, budget_bytes // max(per_vector, 1)))
    return 1 << (int(fits).bit_length() - 1)


def _default_cache_bytes() -> int:
    """2 GiB, or a quarter of physical memory if that is less."""
    limit = 2 * 1024**3
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return limit
    return int(min(limit, physical // 4))


class HessianOperator(LinearOperator):
    """Hessian of a loss with respect to ``variables``, as a symmetric ``LinearOperator``.

    ``H v = Σ_b (n_b/N) ∇²L_b(θ) v`` computed by reverse-over-reverse autodiff.

    Parameters
    ----------
    loss_fn:
        ``loss_fn(batch) -> scalar``: the mean loss of one batch, where ``batch`` has the
        structure of ``data`` (e.g. ``(x, y)``) with tensors as leaves; ``loss_fn()`` with
        no argument when ``data`` is None. It is traced into a graph once.
    variables:
        ``tf.Variable`` or ``keras.Variable`` objects, all of one floating dtype. The
        operator has shape (n, n) with n their total number of entries.
    data:
        None, a nested structure of arrays/tensors sharing a leading example dimension,
        or a ``tf.data.Dataset`` of such batches (see :class:`spectra.data.Batches`).
    batch_size:
        Batch size for array data (default: one batch of everything).
    cache:
        ``"auto"`` (default): keep each batch's vector-independent state if all of it fits
        in ``cache_bytes``, else stream the batches (recomputing the forward pass and the
        gradient once per batch per ``matmat``). ``True``/``False`` force either.
    cache_bytes:
        Memory budget for the cache (default: 2 GiB or a quarter of physical memory).
    max_block_size:
        At most this many vectors go through one compiled product (larger ``matmat``
        blocks are split; all splits share one data pass). Default: chosen from a memory
        budget of 512 MiB for the (k, n) arrays of a block, at most 64 — so a model with
        n = 10⁶ float32 parameters gets blocks of 32, one with 10⁸ blocks of 1.
    allow_unused:
        Keep variables that do not affect the loss as zero rows (warned) instead of
        raising a ``ValueError``.
    strategy:
        A ``tf.distribute`` strategy (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``):
        each replica computes the products of its share of the batches on its device,
        and the sums are all-reduced, so every process gets the exact dataset Hessian
        product. With several workers, every worker runs the same code on the same data
        (SPMD): same estimator, same seed.

    The operator represents the Hessian at the parameter values of the first product
    (or ``gradient()``/``loss()``) call. If the variables change afterwards, call
    :meth:`reset_cache` (a new operator on the same model reuses the compiled functions,
    so building one per training step is cheap).

    Counters: ``num_hvps`` (vectors multiplied) and ``num_data_passes`` (passes over the
    batches or their caches; the first pass that fills the cache counts too).
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        variables: Sequence[Any],
        data: Any = None,
        *,
        batch_size: int | None = None,
        cache: bool | str = "auto",
        cache_bytes: int | None = None,
        max_block_size: int | None = None,
        allow_unused: bool = False,
        strategy: tf.distribute.Strategy | None = None,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}.")
        variables = list(variables)
        batches = Batches(data, batch_size)
        spec = batches.element_spec
        key = (
            "loss_fn",
            id(loss_fn),
            tuple(id(v) for v in variables),
            spec_key(spec),
            allow_unused,
        )
        engine = cached_engine(
            key,
            (loss_fn, *variables),
            lambda: HVPEngine(loss_fn, variables, spec, allow_unused=allow_unused),
        )
        self._setup(engine, batches, variables, cache, cache_bytes, max_block_size, strategy)

    def _setup(
        self,
        engine: HVPEngine,
        batches: Batches,
        variables: list[Any],
        cache: bool | str,
        cache_bytes: int | None,
        max_block_size: int | None,
        strategy: tf.distribute.Strategy | None,
    ) -> None:
        if cache not in ("auto", True, False):
            raise ValueError(f"cache must be 'auto', True or False; got {cache!r}.")
        if max_block_size is None:
            max_block_size = block_size_for(engine.size, engine.dtype.size)
        if int(max_block_size) < 1:
            raise ValueError(f"max_block_size must be >= 1; got {max_block_size}.")
        self._engine = engine
        self._batches = batches
        self._replicas = Replicas(strategy, engine.dtype)
        self.variables = variables
        self._cache_policy = cache
        self.cache_bytes = _default_cache_bytes() if cache_bytes is None else int(cache_bytes)
        self.max_block_size = int(max_block_size)
        self.num_hvps = 0
        self.num_data_passes = 0
        self._caches: list[tuple[BatchCache, float, int]] | None = None
        self._streaming = False
        self._loss: float | None = None
        self._gradient: np.ndarray | None = None
        n = engine.size
        super().__init__(dtype=np.dtype(engine.dtype.as_numpy_dtype), shape=(n, n))

    # -- construction from Keras --------------------------------------------------
    @classmethod
    def from_keras(
        cls,
        model: Any,
        loss: Any,
        data: Any,
        *,
        variables: Sequence[Any] | None = None,
        batch_size: int | None = None,
        training: bool = False,
        include_regularization: bool = True,
        dtype: Any = None,
        cache: bool | str = "auto",
        cache_bytes: int | None = None,
        max_block_size: int | None = None,
        allow_unused: bool = False,
        strategy: tf.distribute.Strategy | None = None,
    ) -> HessianOperator:
        """The Hessian of a Keras model's dataset loss.

        ``loss``: a Keras loss name (``"sparse_categorical_crossentropy"``), a
        ``keras.losses.Loss`` object, or a callable ``(y_true, y_pred) -> scalar`` mean
        loss. ``data``: ``(x, y)`` or ``(x, y, sample_weight)`` arrays (``x`` may be a
        dict or list for multi-input models) or a ``tf.data.Dataset`` of such batches.
        ``variables`` defaults to ``model.trainable_variables``; a subset gives the
        Hessian block of those variables (e.g. one layer's kernel).

        ``training=False`` (default) runs layers in inference mode: BatchNorm uses its
        moving statistics, Dropout is off. With ``training=True`` BatchNorm uses batch
        statistics and Dropout draws one fixed mask per batch; either way the model's
        state is never updated. ``include_regularization`` adds ``model.losses``
        (weight and activity regularizers) to each batch loss.

        ``strategy`` defaults to the ``tf.distribute`` strategy the model was built under
        (or the one in scope); see the class docstring.

        ``dtype=np.float64`` computes the products in float64 on a float64 clone of the
        model (the model itself is not changed); the default is the variables' dtype.
        A model under a mixed-precision policy (``mixed_float16``, ``mixed_bfloat16``) gets
        its products from a clone that computes in the variables' dtype (float32), so
        the Hessian is not rounded to half precision.
        """
        _keras.check_model(model)
        if strategy is None:
            strategy = _keras.model_strategy(model)
        variables, positions, target = _keras.resolve_variables_and_dtype(model, variables, dtype)
        batches = Batches(data, batch_size, cast_floats_to=target)
        spec = batches.element_spec
        loss_key = loss if isinstance(loss, str) else id(loss)
        key = (
            "keras",
            id(model),
            loss_key,
            bool(training),
            bool(include_regularization),
            target.name,
            tuple(positions),
            spec_key(spec),
            allow_unused,
        )
        owners = (model, loss)

        def build() -> HVPEngine:
            run_model = _keras.model_in_dtype(model, target)
            loss_fn = _keras.keras_loss_fn(
                run_model,
                loss,
                dtype=target,
                training=training,
                include_regularization=include_regularization,
            )
            engine_vars = [run_model.weights[i] for i in positions]
            engine = HVPEngine(loss_fn, engine_vars, spec, allow_unused=allow_unused)
            engine.keras_model = run_model  # type: ignore[attr-defined]
            return engine

        engine = cached_engine(key, owners, build)
        run_model = engine.keras_model  # type: ignore[attr-defined]
        if run_model is not model:
            _keras.copy_weights(model, run_model)
        operator = cls.__new__(cls)
        operator._setup(engine, batches, variables, cache, cache_bytes, max_block_size, strategy)
        return operator

    # -- flat vectors and variables -------------------------------------------------
    @property
    def num_examples(self) -> int:
        """Number of examples N the loss is averaged over."""
        return self._batches.num_examples

    @property
    def variable_shapes(self) -> list[tuple[int, ...]]:
        return list(self._engine.shapes)

    def flatten(self, tensors: Sequence[Any]) -> np.ndarray:
        """Concatenate per-variable arrays (row-major) into one vector of length n."""
        tensors = list(tensors)
        if len(tensors) != len(self._engine.shapes):
            raise ValueError(
                f"expected {len(self._engine.shapes)} arrays (one per variable), got "
                f"{len(tensors)}."
            )
        parts = []
        for i, (t, shape) in enumerate(zip(tensors, self._engine.shapes)):
            a = np.asarray(t)
            if a.shape != shape:
                raise ValueError(f"array {i} has shape {a.shape}; variable {i} has {shape}.")
            parts.append(a.reshape(-1))
        return np.concatenate(parts).astype(self.dtype, copy=False)

    def unflatten(self, vector: Any) -> list[np.ndarray]:
        """Split a vector of length n into arrays shaped like the variables."""
        v = np.asarray(vector)
        if v.shape != (self.shape[0],):
            raise ValueError(f"expected a vector of shape ({self.shape[0]},), got {v.shape}.")
        pieces = np.split(v, np.cumsum(self._engine.sizes)[:-1])
        return [p.reshape(s) for p, s in zip(pieces, self._engine.shapes)]

    # -- loss, gradient, caching ----------------------------------------------------
    def reset_cache(self) -> None:
        """Drop cached batch state (call after the variables changed)."""
        self._caches = None
        self._streaming = False
        self._loss = None
        self._gradient = None

    @property
    def is_cached(self) -> bool:
        """True when every batch's vector-independent state is held in memory."""
        return self._caches is not None

    @property
    def cache_nbytes(self) -> int:
        """Bytes held by the batch caches (0 when streaming)."""
        return sum(c.nbytes for c, _, _ in self._caches or [])

    def _prepare(self) -> None:
        """First pass over the data: loss, gradient, and the caches when they fit."""
        if self._loss is not None:
            return
        keep = self._cache_policy is not False
        caches: list[tuple[BatchCache, float, int]] = []
        used = 0
        losses = self._replicas.accumulator()
        grads = self._replicas.accumulator()
        for batch, weight, replica in self._owned_batches():
            with self._replicas.device(replica):
                if keep:
                    cache = self._engine.cache(batch)
                    batch_loss, batch_grad = cache.loss, cache.gradient
                    used += cache.nbytes
                    if self._cache_policy == "auto" and used > self.cache_bytes:
                        keep = False
                        caches = []
                    else:
                        caches.append((cache, weight, replica))
                else:
                    batch_loss, batch_grad = self._engine.loss_and_gradient(batch)
                w = tf.constant(weight, self._engine.dtype)
                losses.add(replica, batch_loss * w)
                grads.add(replica, batch_grad * w)
        self.num_data_passes += 1
        self._loss = float(self._replicas.sum(losses, ()).numpy())
        self._gradient = self._replicas.sum(grads, (self.shape[0],)).numpy()
        self._caches = caches if keep else None
        self._streaming = not keep

    def _owned_batches(self):
        """``(batch, weight, local replica)`` for the batches this process computes."""
        for index, (batch, weight) in enumerate(self._batches):
            replica = self._replicas.owner(index)
            if replica is not None:
                yield batch, weight, replica

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
    def _validated_block(self, x: Any, name: str) -> np.ndarray:
        a = np.asarray(x)
        n = self.shape[0]
        if a.ndim == 1:
            if a.shape[0] != n:
                raise ValueError(
                    f"{name}: expected a vector of length {n}, got length {a.shape[0]}."
                )
        elif a.ndim == 2:
            if a.shape[0] != n:
                raise ValueError(f"{name}: expected an array of shape ({n}, k), got {a.shape}.")
        else:
            raise ValueError(f"{name}: expected a 1-D or 2-D array, got {a.ndim} dimensions.")
        if not np.issubdtype(a.dtype, np.number) or np.iscomplexobj(a):
            raise TypeError(f"{name}: expected real numbers, got dtype {a.dtype}.")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name}: the input contains NaN or Inf.")
        return a

    def matvec(self, x: Any) -> np.ndarray:
        """H x for a vector x of shape (n,) (or (n, 1))."""
        return super().matvec(self._validated_block(x, "matvec"))

    def matmat(self, X: Any) -> np.ndarray:
        """H X for X of shape (n, k): k products in one pass over the data."""
        X = self._validated_block(X, "matmat")
        if X.ndim != 2:
            raise ValueError(f"matmat: expected a 2-D array of shape ({self.shape[0]}, k).")
        return super().matmat(X)

    def rmatvec(self, x: Any) -> np.ndarray:
        """Hᵀ x = H x (the Hessian is symmetric)."""
        return self.matvec(x)

    def rmatmat(self, X: Any) -> np.ndarray:
        """Hᵀ X = H X (the Hessian is symmetric)."""
        return self.matmat(X)

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._matmat(np.reshape(x, (-1, 1))).reshape(-1)

    def _rmatvec(self, x: np.ndarray) -> np.ndarray:
        return self._matvec(x)

    def _rmatmat(self, X: np.ndarray) -> np.ndarray:
        return self._matmat(X)

    def _adjoint(self) -> HessianOperator:
        return self

    def _transpose(self) -> HessianOperator:
        return self

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        k = X.shape[1]
        if k == 0:
            return np.zeros((self.shape[0], 0), self.dtype)
        self._prepare()
        rows = np.ascontiguousarray(np.asarray(X, dtype=self.dtype).T)
        blocks = [
            tf.constant(rows[i : i + self.max_block_size]) for i in range(0, k, self.max_block_size)
        ]
        sums = [self._replicas.accumulator() for _ in blocks]
        for cache, weight, replica in self._iterate_caches():
            with self._replicas.device(replica):
                w = tf.constant(weight, self._engine.dtype)
                for block, total in zip(blocks, sums):
                    total.add(replica, self._engine.apply(cache, block) * w)
        self.num_hvps += k
        self.num_data_passes += 1
        n = self.shape[0]
        out = np.concatenate(
            [
                self._replicas.sum(total, (int(block.shape[0]), n)).numpy()
                for block, total in zip(blocks, sums)
            ],
            axis=0,
        )
        return np.ascontiguousarray(out.T)

    def _iterate_caches(self):
        if self._caches is not None:
            yield from self._caches
            return
        for batch, weight, replica in self._owned_batches():
            with self._replicas.device(replica):
                cache = self._engine.cache(batch)
            yield cache, weight, replica

    def __repr__(self) -> str:
        mode = (
            "cached"
            if self._caches is not None
            else ("streaming" if self._streaming else "not yet evaluated")
        )
        return (
            f"<HessianOperator n={self.shape[0]} dtype={self.dtype} "
            f"variables={len(self._engine.shapes)} examples={self._batches.num_examples} "
            f"{mode}; {self.num_hvps} products, {self.num_data_passes} data passes>"
        )
