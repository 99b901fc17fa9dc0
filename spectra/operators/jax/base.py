"""The common base of the JAX curvature operators: snapshot, batches, caching, counters.

A curvature operator is a symmetric matrix C = Σ_b (n_b/N) C_b of a dataset loss
L(θ) = Σ_b (n_b/N) L_b(θ) with respect to the flattened parameters θ (the chosen
variables, concatenated in order, each flattened row-major: a
:class:`~spectra.operators.layout.ParameterLayout`), as a SciPy ``LinearOperator``. What
C_b is comes from a :class:`~spectra.operators.jax.curvature.Curvature`; this module owns
the rest, with the semantics of the TensorFlow operators
(:class:`spectra.operators.base.CurvatureOperator`, whose ``from_keras`` docstring is the
reference):

* **snapshot**: the operator is the matrix at the weights it was built with. The values
  of the model's variables (trainable and not, seed generator states included) are copied
  at construction, cast to the compute dtype, and passed to the compiled functions as
  arguments; training on, loading other weights or building another operator on the same
  model changes nothing in it, cached or streaming, float32 or float64;
* **caching**: per batch, the cache of :meth:`Curvature.prepare
  <spectra.operators.jax.curvature.Curvature.prepare>` (the residuals of the
  linearization) is computed on the first pass and kept within the memory budget
  (``cache="auto"``: the batches worth most examples per byte), so a product costs one
  evaluation of the linearized function; the other batches stream (their cache is
  recomputed once per ``matmat``);
* **blocks**: ``matmat`` multiplies k vectors in one pass over the data, in sub-blocks of
  at most :attr:`~CurvatureOperator.max_block_size` vectors (whose tangents alone are
  alive at once);
* **checks**: non-finite weights, batch losses or gradients and products are refused with
  the variable or batch named; so are vectors that do not fit the operator's dtype
  (:func:`~spectra.operators.layout.validated_block`).

**float64** runs within :func:`spectra._jax_compat.float64_scope` (64-bit types in the
calling thread for the duration of each call; ``jax_enable_x64`` is not set for the
process) on a float64 copy of the model, traced under
:func:`~spectra._jax_compat.exact_float64`; a computation that still holds fewer than 64
bits is refused in one line naming the layer. **Devices**: one, ``jax.devices()[0]``;
``strategy`` (``tf.distribute``) and JAX sharding are not supported.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar

import jax
import numpy as np
from scipy.sparse.linalg import LinearOperator

from spectra import _jax_compat
from spectra._validation import MAX_SEED, check_bool, check_int, check_seed
from spectra.operators import keras_calls, losses
from spectra.operators.jax.curvature import Curvature
from spectra.operators.jax.data import Batches
from spectra.operators.jax.engine import Compiled, Engine, cached_engine, nbytes
from spectra.operators.jax.models import ModelProgram
from spectra.operators.keras_data import check_keras_data, describe_inputs
from spectra.operators.layout import ParameterLayout, validated_block
from spectra.operators.memory import (
    cache_share,
    default_memory_budget,
    format_bytes,
)
from spectra.operators.operator_core import OperatorCore

__all__ = ["CurvatureOperator"]

_Operator = TypeVar("_Operator", bound="CurvatureOperator")


class _Default(enum.Enum):
    """The default of ``from_keras``'s ``seed``: the class's ``default_seed``."""

    SEED = "default_seed"

    def __repr__(self) -> str:
        return "<the class's default_seed>"


_DEFAULT = _Default.SEED

#: Seeds of the sampled labels and of the Dropout masks: (seed, batch index) hashed to a
#: JAX key (two uint32 words).
_KEY_WORDS = 2


def batch_key(seed: int, index: int) -> np.ndarray:
    """The key data (2 uint32) of batch ``index`` under ``seed``."""
    words = np.random.SeedSequence([seed, index]).generate_state(_KEY_WORDS, dtype=np.uint32)
    return np.asarray(words, np.uint32)


def scope(dtype: np.dtype) -> contextlib.AbstractContextManager[Any]:
    """The context every JAX call of an operator in ``dtype`` runs in."""
    if dtype == np.float64:
        return _jax_compat.float64_scope()
    return contextlib.nullcontext()


def check_seed_value(seed: Any) -> int | None:
    """None or a non-negative int (a numpy Generator gives one draw)."""
    seed = check_seed("seed", seed, below=MAX_SEED)
    if isinstance(seed, np.random.Generator):
        return int(seed.integers(MAX_SEED))
    return seed


def snapshot_values(model: Any, run_model: Any, dtype: np.dtype) -> list[Any]:
    """Copies of ``model``'s state values in ``run_model``'s state order, floating ones
    cast to ``dtype``, as device arrays; NaN or Inf in a floating weight is refused,
    naming it."""
    source_t, source_n = keras_calls.state_keys(model)
    target_t, target_n = keras_calls.state_keys(run_model)
    sources, targets = [*source_t, *source_n], [*target_t, *target_n]
    if len(sources) != len(targets):
        raise keras_calls.ComputeCopyError(
            f"the compute copy of {model.name!r} has {len(targets)} state variables, the "
            f"model {len(sources)}; build the model in the compute dtype yourself instead."
        )
    values = []
    for src, dst in zip(sources, targets):
        value = np.array(src.value)  # a copy: the model may change later
        if tuple(value.shape) != tuple(dst.shape):
            raise ValueError(
                f"weight {src.path} has shape {tuple(value.shape)} but its copy {tuple(dst.shape)}."
            )
        if value.dtype.kind == "f" or losses.dtype_name(value.dtype) == "bfloat16":
            finite = np.isfinite(value.astype(np.float64))
            if not finite.all():
                bad = int(finite.size - finite.sum())
                nans = int(np.isnan(value.astype(np.float64)).sum())
                raise keras_calls.non_finite_error(str(src.path), bad, nans, value.size)
            value = value.astype(dtype)
        values.append(jax.device_put(value))
    return values


class _CachedBatch(NamedTuple):
    """One batch's cache, its weight n_b/N in the sums, and its index."""

    cache: Any
    weight: float
    batch_index: int
    nbytes: int


class CurvatureOperator(OperatorCore):
    """A curvature matrix of a Keras model's loss on JAX, a symmetric ``LinearOperator``.

    Built with :meth:`from_keras`; the public attributes and methods are those of the
    TensorFlow operators (:class:`spectra.operators.base.CurvatureOperator`): ``shape``,
    ``dtype``, ``matvec``/``matmat``/``rmatvec``/``rmatmat``, ``loss()``, ``gradient()``,
    ``flatten``/``unflatten``, ``variables``, ``variable_names``, ``variable_shapes``,
    ``num_examples``, the counters ``num_hvps`` (vectors multiplied) and
    ``num_data_passes`` (passes over the batches or their caches, the first one that
    fills the caches included), the caches (``is_cached``, ``num_cached_batches``,
    ``num_streamed_batches``, ``cache_nbytes``, ``reset_cache()``), ``max_block_size``,
    ``memory_plan()`` and ``curvature``. ``num_compiles`` counts the compilations of the
    engine the operator uses (shared by operators on the same model, loss and options).
    """

    _ENGINE_TAG = " (JAX)"
    #: The matrix this class computes; its ``for_keras`` declares the matrix's keywords.
    curvature_class: ClassVar[type[Curvature]]
    #: The ``seed`` of :meth:`from_keras` when none is given.
    default_seed: ClassVar[int | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        own = "".join(f", {k}=..." for k in type(self)._curvature_keywords())
        raise TypeError(
            f"on Keras' JAX backend build a {name} with {name}.from_keras(model, loss, "
            f"data{own}); the Hessian of a loss_fn of variables runs on TensorFlow."
        )

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_keras(
        cls: type[_Operator],
        model: Any,
        loss: Any = None,
        data: Any = None,
        *,
        variables: Sequence[Any] | None = None,
        batch_size: int | None = None,
        training: bool = False,
        include_regularization: bool = True,
        dtype: Any = None,
        seed: int | _Default | None = _DEFAULT,
        cache: bool | str = "auto",
        cache_bytes: int | None = None,
        max_block_size: int | None = None,
        memory_budget: int | None = None,
        allow_unused: bool = False,
        strategy: Any = None,
        **curvature_options: Any,
    ) -> _Operator:
        """The matrix of a Keras model's dataset loss at its current weights, on JAX.

        The keywords and their meaning are those of the TensorFlow operators'
        :meth:`spectra.operators.base.CurvatureOperator.from_keras` (the dataset loss per
        Keras reduction, sample weights, ``loss_weights``, several inputs and outputs,
        regularization, inference mode by default, ``training=True`` with the random draws
        of each batch fixed, float32 and float64), with these differences:

        * ``data``: ``(x, y)`` or ``(x, y, sample_weight)`` arrays, a
          ``keras.utils.PyDataset``, a list (or re-iterable) of such batches, or a
          ``tf.data.Dataset`` where TensorFlow is installed
          (:mod:`spectra.operators.jax.data`);
        * ``strategy`` must be None: the operator runs on one device (a ``ValueError``
          otherwise);
        * ``training=True``: Dropout draws its mask of batch b from the model's seed
          generator states at construction plus ``[b, 0]``, or, with ``seed``, from a
          hash of (seed, j) plus ``[b, 0]`` for the j-th seed generator (JAX's generator,
          so the masks are not TensorFlow's);
        * ``dtype=np.float64`` computes in 64 bits in the calling thread only (see the
          module docstring).

        Cost: no pass over the data (a source other than arrays gives its first batch,
        for its structure) and no compilation until the first product, ``loss()`` or
        ``gradient()``; then one compilation per function and batch shape, shared by
        later operators on the same model, loss and options.
        """
        if getattr(cls, "curvature_class", None) is None:
            raise TypeError(
                f"{cls.__name__} names no curvature_class: build one of its subclasses "
                "(HessianOperator, GGNOperator, FisherOperator)."
            )
        unknown = [name for name in curvature_options if name not in cls._curvature_keywords()]
        if unknown:
            raise TypeError(
                f"{cls.__name__}.from_keras() got an unexpected keyword argument "
                f"{unknown[0]!r}; {cls._keywords_note()}"
            )
        if strategy is not None:
            raise ValueError(
                "strategy is not supported on Keras' JAX backend (no JAX sharding yet): the "
                "operator runs on jax.devices()[0]. Build it without strategy, or with "
                "KERAS_BACKEND=tensorflow and a tf.distribute strategy."
            )
        keras_calls.check_model(model)
        curvature = cls.curvature_class.for_keras(model, loss, **curvature_options)
        if seed is _DEFAULT:
            seed = cls.default_seed
        training = check_bool("training", training)
        include_regularization = check_bool("include_regularization", include_regularization)
        allow_unused = check_bool("allow_unused", allow_unused)
        seed = check_seed_value(seed)
        if data is None:
            raise ValueError(
                "data is required: (x, y) or (x, y, sample_weight) arrays, a "
                "keras.utils.PyDataset, or a list of such batches."
            )
        variables, positions, target = keras_calls.resolve_variables_and_dtype(
            model, variables, dtype
        )
        if loss is None:
            loss, loss_weights = losses.compiled_loss(model)
        else:
            loss_weights = None
        batches = Batches(
            data,
            batch_size,
            cast_floats_to=target,
            purpose=f"The {cls.curvature_class.title} operator",
        )
        check_keras_data(model, loss, batches)
        loss_id, loss_owners = losses.loss_key((loss, loss_weights))
        key = (
            curvature.key,
            id(model),
            loss_id,
            training,
            include_regularization,
            target.name,
            tuple(positions),
            allow_unused,
        )

        def build() -> Engine:
            with scope(target), _jax_compat.exact_float64():
                run_model = keras_calls.model_in_dtype(model, target)
            program = ModelProgram(
                run_model,
                loss,
                loss_weights,
                dtype=target,
                training=training,
                include_regularization=include_regularization,
                positions=positions,
            )
            names = [str(v.path) for v in variables]
            return Engine(curvature, program, allow_unused=allow_unused, names=names)

        engine = cached_engine(key, (model, *loss_owners), build)
        with scope(target):
            state = snapshot_values(model, engine.program.model, target)
        seed_bases = {}
        for j, position in enumerate(engine.program.seed_indices):
            if seed is None:
                seed_bases[position] = np.asarray(state[position], np.uint32)
            else:
                seed_bases[position] = batch_key(seed, j)
        operator = cls.__new__(cls)
        operator._setup(
            engine,
            batches,
            list(variables),
            state,
            seed_bases,
            0 if seed is None else seed,
            cache,
            cache_bytes,
            max_block_size,
            memory_budget,
        )
        return operator

    @classmethod
    def _curvature_keywords(cls) -> list[str]:
        parameters = inspect.signature(cls.curvature_class.for_keras).parameters.values()
        return [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]

    @classmethod
    def _keywords_note(cls) -> str:
        own = cls._curvature_keywords()
        listed = f"its own are {', '.join(own)}" if own else "it has none of its own"
        return f"see CurvatureOperator.from_keras for the keywords of every matrix ({listed})."

    def _setup(
        self,
        engine: Engine,
        batches: Batches,
        variables: list[Any],
        state: list[Any],
        seed_bases: dict[int, np.ndarray],
        seed: int,
        cache: bool | str,
        cache_bytes: int | None,
        max_block_size: int | None,
        memory_budget: int | None,
    ) -> None:
        if isinstance(cache, (bool, np.bool_)):
            cache = bool(cache)
        elif cache != "auto":
            raise ValueError(f"cache must be 'auto', True or False; got {cache!r}.")
        max_block_size = check_int("max_block_size", max_block_size, allow_none=True)
        cache_bytes = check_int("cache_bytes", cache_bytes, minimum=0, allow_none=True)
        memory_budget = check_int("memory_budget", memory_budget, allow_none=True)
        self._engine = engine
        self._batches = batches
        self._state = state
        self._params = [state[i] for i in engine.program.parameter_indices]
        self._seed_bases = seed_bases
        self._seed = seed
        self.variables = variables
        self._cache_policy = cache
        self.memory_budget = default_memory_budget() if memory_budget is None else memory_budget
        self._snapshot_bytes = nbytes(state)
        self._share_from_first_batch = cache_bytes is None
        if cache_bytes is None:
            cache_bytes = max(0, self.memory_budget // 2 - self._snapshot_bytes)
        self.cache_bytes = int(cache_bytes)
        self._block_size_override = max_block_size
        self.num_hvps = 0
        self.num_data_passes = 0
        self._caches: list[_CachedBatch] | None = None
        self._cached_index: dict[int, _CachedBatch] = {}
        self._num_streamed = 0
        self._batch_bytes = 0
        # One vector's tangents are estimated on JAX (TANGENT_FACTOR × a batch's cache):
        # XLA keeps no allocator statistics on the CPU to measure them.
        self._tangent_bytes: int | None = None
        self._cache_transient = 0
        self._shifted_loss: Any = None  # loss_at's compiled batch loss, made on first use
        self._loss: float | None = None
        self._gradient: np.ndarray | None = None
        dtype = np.dtype(engine.dtype)
        #: The flat vector's layout (:class:`~spectra.operators.layout.ParameterLayout`).
        self.layout = ParameterLayout(engine.shapes, engine.names, dtype)
        LinearOperator.__init__(self, dtype=dtype, shape=(engine.size, engine.size))

    def _scope(self) -> contextlib.AbstractContextManager[Any]:
        return scope(self.dtype)

    # -- memory -----------------------------------------------------------------------
    def _parallel_vectors(self) -> int:
        return 1 if self._engine.block_mode == "loop" else 64

    # -- flat vectors and variables ---------------------------------------------------
    @property
    def product_path(self) -> str:
        """``"split"``: products from the cached linearization of each batch (the only
        path on JAX: every computation JAX can trace linearizes)."""
        return "split"

    @property
    def fallback_reason(self) -> str | None:
        """Always None on JAX (see :attr:`product_path`)."""
        return None

    @property
    def num_compiles(self) -> int:
        """Compilations of the engine's functions so far (one per function and batch shape,
        shared by the operators on the same model, loss and options)."""
        return self._engine.num_compiles

    # -- loss, gradient, caching ------------------------------------------------------
    @property
    def cache_nbytes(self) -> int:
        """Bytes held by the kept batch caches (0 when every batch streams)."""
        return sum(entry.nbytes for entry in self._caches or [])

    def _inputs(self, index: int, batch: Any) -> tuple[Any, ...]:
        """The engine's arguments for batch ``index``: θ, the state (seed generator states
        of this batch), the batch, its key and N."""
        state = self._state
        if self._seed_bases:
            state = list(state)
            for position, base in self._seed_bases.items():
                offset = np.array([index, 0], dtype=np.uint64)
                state[position] = np.asarray((base.astype(np.uint64) + offset) % 2**32, base.dtype)
        count = np.asarray(self._batches.num_examples, self.dtype)
        return (self._params, state, batch, batch_key(self._seed, index), count)

    def _prepare(self) -> None:
        """First pass over the data: loss, gradient, and the caches that fit."""
        if self._loss is not None:
            return
        policy = self._cache_policy
        kept: list[_CachedBatch] = []
        used = 0
        budget = self.cache_bytes
        budget_set = not self._share_from_first_batch
        largest = 0
        count = 0
        loss_total: Any = None
        grad_total: Any = None
        with self._scope():
            for index, batch, n in self._batches:
                weight = n / self._batches.num_examples
                where = self._batches.describe(index)
                inputs = self._inputs(index, batch)
                count += 1
                batch_loss, grads, cache = self._engine.prepare(*inputs)
                size = nbytes(cache)
                largest = max(largest, size)
                if not budget_set:
                    budget_set = True
                    budget = cache_share(
                        self.memory_budget, self._snapshot_bytes, size, 0, self._per_row_bytes()
                    )
                if policy is not False:
                    kept.append(_CachedBatch(cache, weight, index, size))
                    used += size
                    if policy == "auto":
                        while used > budget and kept:
                            worst = min(
                                range(len(kept)),
                                key=lambda i: (kept[i].weight / max(kept[i].nbytes, 1), -i),
                            )
                            used -= kept.pop(worst).nbytes
                del cache
                batch_loss = np.asarray(batch_loss)
                grads = [np.asarray(g) for g in grads]
                self._check_batch(where, n, batch, batch_loss, grads)
                w = np.asarray(weight, self.dtype)
                loss_total = batch_loss * w if loss_total is None else loss_total + batch_loss * w
                grads = [g * w for g in grads]
                grad_total = (
                    grads if grad_total is None else [a + b for a, b in zip(grad_total, grads)]
                )
            loss = float(loss_total)
            gradient = self.layout.flatten(grad_total)
        if not (np.isfinite(loss) and np.all(np.isfinite(gradient))):
            raise ValueError(
                f"the loss or gradient summed over the batches is not finite ({loss}) "
                f"although every batch's is: it overflows {self.dtype}. Build the operator "
                "with dtype=np.float64."
            )
        self.num_data_passes += 1
        self._loss = loss
        self._gradient = gradient
        self._caches = sorted(kept, key=lambda entry: entry.batch_index)
        self._cached_index = {entry.batch_index: entry for entry in self._caches}
        self._num_streamed = count - len(self._caches)
        self._batch_bytes = largest
        self.cache_bytes = budget
        plan = self.memory_plan()
        if policy is True and plan.peak > self.memory_budget:
            warnings.warn(
                f"cache=True keeps all {len(self._caches)} batch caches "
                f"({format_bytes(self.cache_nbytes)}), so the estimated peak "
                f"{format_bytes(plan.peak)} exceeds memory_budget={self.memory_budget} "
                f"({format_bytes(self.memory_budget)}). Use cache='auto' to stay within the "
                "budget, or raise memory_budget.",
                UserWarning,
                stacklevel=3,
            )

    def loss_at(self, delta: Any) -> float:
        """The dataset loss at shifted parameters, L(θ + δ) = Σ_b (n_b/N) L_b(θ + δ), for a
        flat ``delta`` of length n: the loss this operator's matrix is the curvature of,
        with the same batches, reduction, regularization, mode and random draws. The model
        is not changed. Cost: one pass over the data, no caches; one compilation per batch
        shape (the first call). :func:`spectra.loss_landscape` evaluates it on JAX."""
        delta = validated_block(
            np.asarray(delta, dtype=self.dtype), self.shape[0], self.dtype, "delta"
        )
        if delta.ndim != 1:
            raise ValueError(f"loss_at: expected a flat vector of length {self.shape[0]}.")
        shifted = [
            np.asarray(p, self.dtype) + d
            for p, d in zip(self._params, self.layout.unflatten(delta))
        ]
        if self._shifted_loss is None:
            program = self._engine.program

            def batch_loss(params: Any, state: Any, batch: Any, count: Any) -> Any:
                with _jax_compat.keras_logits():
                    return program.batch_loss(params, state, batch, count)

            self._shifted_loss = Compiled(batch_loss, "loss_at", float64=self.dtype == np.float64)
        total = 0.0
        with self._scope():
            for index, batch, n in self._batches:
                _, state, batch, _, count = self._inputs(index, batch)
                value = float(self._shifted_loss(shifted, state, batch, count))
                total += n / self._batches.num_examples * value
        self.num_data_passes += 1
        return total

    def _check_batch(self, where: str, n: int, batch: Any, loss: Any, grads: Any) -> None:
        """Refuse a batch whose loss or gradient is NaN/Inf, naming it and (the weights
        being finite) the data: checked explicitly, since a finite loss proves nothing
        about the gradient."""
        loss_value = float(loss)
        bad = int(sum(g.size - np.count_nonzero(np.isfinite(g)) for g in grads))
        if np.isfinite(loss_value) and bad == 0:
            return
        problems = []
        if not np.isfinite(loss_value):
            problems.append(f"loss {loss_value}")
        if bad:
            problems.append(f"{bad} of {self.shape[0]} gradient entries NaN/Inf")
        look = describe_inputs(batch[0]) if isinstance(batch, (tuple, list)) else ""
        raise ValueError(
            f"{where} ({n} examples) gives a non-finite loss or gradient "
            f"({', '.join(problems)}). The weights are finite, so look at the data of this "
            f"batch{f' ({look})' if look else ''}: NaN/Inf inputs or sample weights, labels "
            "out of range, or an overflow in the model."
        )

    # -- products -----------------------------------------------------------------------
    def _caches_in_order(self) -> Iterator[tuple[int, float, Any]]:
        """``(index, weight, cache)`` of every batch, the kept caches reused and the others
        computed now (in batch order, so the sums add in the same order whatever is kept)."""
        if self._caches is not None and self._num_streamed == 0:
            for entry in self._caches:
                yield entry.batch_index, entry.weight, entry.cache
            return
        for index, batch, n in self._batches:
            kept = self._cached_index.get(index)
            if kept is not None:
                yield index, kept.weight, kept.cache
                continue
            _, _, cache = self._engine.prepare(*self._inputs(index, batch))
            yield index, n / self._batches.num_examples, cache

    def _products(
        self, cache: Any, blocks: list[list[np.ndarray]], weight: Any, totals: Any
    ) -> Any:
        """``totals`` + weight · C_b (each sub-block), from one batch's cache."""
        if self._engine.block_mode == "loop":
            # The compiled product is looked up once per batch, not once per vector.
            first = [part[0] for part in blocks[0]]
            apply = self._engine.apply.executable(cache, first, weight, totals[0][0])
            return [
                [
                    apply(cache, [part[j] for part in block], weight, total)
                    for j, total in enumerate(block_totals)
                ]
                for block, block_totals in zip(blocks, totals)
            ]
        return [
            self._engine.apply_block(cache, block, weight, block_totals)
            for block, block_totals in zip(blocks, totals)
        ]

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        k = X.shape[1]
        if k == 0:
            return np.zeros((self.shape[0], 0), self.dtype)
        with self._scope():
            self._prepare()
            X = np.asarray(X, dtype=self.dtype)
            size = self.max_block_size
            blocks = [self.layout.unflatten_block(X[:, i : i + size]) for i in range(0, k, size)]
            loop = self._engine.block_mode == "loop"
            totals: Any = [
                [
                    [np.zeros(s, self.dtype) for s in self.layout.shapes]
                    for _ in range(block[0].shape[0])
                ]
                if loop
                else [np.zeros(part.shape, self.dtype) for part in block]
                for block in blocks
            ]
            for _, weight, cache in self._caches_in_order():
                totals = self._products(cache, blocks, np.asarray(weight, self.dtype), totals)
            if loop:
                columns = [
                    self.layout.flatten([np.asarray(t) for t in vector])
                    for block_totals in totals
                    for vector in block_totals
                ]
                out = np.stack(columns, axis=1)
            else:
                out = np.concatenate(
                    [
                        self.layout.flatten_block([np.asarray(t) for t in block_totals])
                        for block_totals in totals
                    ],
                    axis=1,
                )
            finite = bool(np.all(np.isfinite(out)))
            if not finite:
                self._raise_non_finite_product(out, blocks)
        self.num_hvps += k
        self.num_data_passes += 1
        return np.ascontiguousarray(out)

    def _raise_non_finite_product(self, out: np.ndarray, blocks: list[list[np.ndarray]]) -> None:
        """Name the batches whose products are not finite (one more pass, on failure only)."""
        bad_batches = []
        for index, _, cache in self._caches_in_order():
            for block in blocks:
                zeros = [np.zeros(s, self.dtype) for s in self.layout.shapes]
                one = np.asarray(1, self.dtype)
                parts = [
                    self._engine.apply(cache, [part[j] for part in block], one, zeros)
                    for j in range(block[0].shape[0])
                ]
                if not all(np.isfinite(np.asarray(p)).all() for vector in parts for p in vector):
                    bad_batches.append(self._batches.describe(index))
                    break
        count = int(np.size(out) - np.count_nonzero(np.isfinite(out)))
        where = ", ".join(bad_batches[:10]) or "the sum over batches (overflow)"
        raise ValueError(
            f"the {self._engine.curvature.title} product is not finite ({count} NaN/Inf "
            f"entries, from {where}) although the weights, the batch losses and gradients "
            f"are finite: the product overflows {self.dtype} for this vector. Scale the "
            "vector down (products are linear) or build the operator with dtype=np.float64."
        )
