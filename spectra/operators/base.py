"""The common base of curvature operators: snapshot, batches, caching, replicas, counters.

A curvature operator is a symmetric matrix C = Σ_b (n_b/N) C_b of a dataset loss
L(θ) = Σ_b (n_b/N) L_b(θ) with respect to the flattened parameters θ (the given variables,
concatenated in order, each flattened row-major), as a SciPy ``LinearOperator``. What
C_b is comes from a :class:`~spectra.operators.curvature.Curvature` (the Hessian in
:mod:`spectra.operators.hessian`); this module owns everything else:

* **snapshot**: an operator is the matrix at the weights it was built with. The values
  (or, for a ``loss_fn`` reading ``tf.Variable`` objects, copies of the variables) are taken at
  construction and fed to the compiled functions as inputs; training on, loading other
  weights or building another operator on the same model changes nothing in it, in
  every cache mode and dtype;
* **caching**: per batch, the vector-independent part of the product (forward pass,
  gradient, ...) is computed once and kept within a memory budget, so each further
  product costs only its vector-dependent arithmetic; without room, batches stream;
* **blocks**: ``matmat`` multiplies k vectors in one pass over the data, in one compiled
  graph per batch;
* **replicas**: under a ``tf.distribute`` strategy each replica computes its share of the
  batches, the local replicas concurrently (one host thread each), and the sums are
  all-reduced; with several workers each reads only its shard of a dataset
  (:mod:`spectra.operators.batching`), and every pass ends on all workers together, failed or not
  (:mod:`spectra.operators.replicas`);
* **checks**: non-finite weights, batch losses or gradients and products are refused
  with the variable or batch named; so are vectors that do not fit the operator's dtype.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar

import numpy as np
import tensorflow as tf
from scipy.sparse.linalg import LinearOperator

from spectra._validation import MAX_SEED, check_bool, check_int, check_seed
from spectra.operators import keras_models
from spectra.operators.batching import Batches
from spectra.operators.curvature import Curvature, FunctionProgram, variable_name
from spectra.operators.data_checks import check_keras_data, graph_errors
from spectra.operators.engine import BatchCache, Engine, cached_engine, spec_key
from spectra.operators.layout import ParameterLayout
from spectra.operators.memory import (
    PARALLEL_VECTORS,
    cache_share,
    default_memory_budget,
    format_bytes,
    sub_block_size,
)
from spectra.operators.operator_core import OperatorCore
from spectra.operators.replicas import Replicas

__all__ = ["CurvatureOperator", "block_size_for"]

_Operator = TypeVar("_Operator", bound="CurvatureOperator")


class _Default(enum.Enum):
    """The default of ``from_keras``'s ``seed``: the class's ``default_seed``."""

    SEED = "default_seed"

    def __repr__(self) -> str:
        return "<the class's default_seed>"


_DEFAULT = _Default.SEED

_BLOCK_BYTES = 512 * 1024**2


def block_size_for(num_parameters: int, itemsize: int, budget_bytes: int = _BLOCK_BYTES) -> int:
    """The largest power-of-two block (≤ 64 vectors) whose (k, n) arrays fit the budget."""
    return sub_block_size(0, budget_bytes, per_row=num_parameters * itemsize)


def _check_seed(seed: Any) -> int | None:
    """None or a non-negative int (a numpy Generator gives one draw)."""
    seed = check_seed("seed", seed, below=MAX_SEED)
    if isinstance(seed, np.random.Generator):
        return int(seed.integers(MAX_SEED))
    return seed


def _as_tf_variable(variable: Any) -> tf.Variable:
    """The ``tf.Variable`` behind a Keras 3 variable (or the variable itself)."""
    if isinstance(variable, tf.Variable):
        return variable
    inner = getattr(variable, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    raise TypeError(
        f"variables must be tf.Variable or keras.Variable objects; got {type(variable).__name__}."
    )


def _outside_strategy(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` outside any ``tf.distribute`` scope (scopes are thread-local)."""
    if not tf.distribute.has_strategy():
        return fn()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


def _graph_errors(what: str) -> contextlib.AbstractContextManager[None]:
    """Re-raise a TensorFlow graph error with where it happened (``what``) and its root
    cause on the first line ("batch 3: assertion failed: ..."); the original is chained."""
    return graph_errors(what)


class _Snapshot:
    """An operator's own engine inputs: captured values and state, one set per replica.

    ``seed_positions`` are the state entries holding Keras seed generator states: for
    batch b they get ``base + [b, 0]``, so each batch has its own random draws (Dropout
    masks in training mode), the same in every product.
    """

    def __init__(
        self,
        captures: list[list[Any]],
        state: list[list[tf.Tensor]],
        seed: int,
        seed_positions: Sequence[int] = (),
        seed_bases: dict[int, np.ndarray] | None = None,
        keep_alive: Sequence[Any] = (),
    ) -> None:
        self.captures = captures
        self.state = state
        self.seed = seed
        self.seed_positions = list(seed_positions)
        self.seed_bases = seed_bases or {}
        self._keep_alive = list(keep_alive)

    def inputs(
        self, replica: int, batch_index: int, num_examples: int, flat_batch: list[tf.Tensor]
    ) -> list[Any]:
        state = self.state[replica]
        if self.seed_positions:
            state = list(state)
            for position in self.seed_positions:
                base = self.seed_bases[position]
                value = base + np.array([batch_index, 0], dtype=base.dtype)
                state[position] = tf.constant(value, dtype=state[position].dtype)
        seed = tf.constant([self.seed, batch_index], tf.int64)
        count = tf.constant(num_examples, tf.int64)
        return [*self.captures[replica], *state, seed, count, *flat_batch]


class CurvatureOperator(OperatorCore):
    """A curvature matrix of a loss as a symmetric ``LinearOperator`` (see subclasses).

    A subclass names its :class:`~spectra.operators.curvature.Curvature` in
    :attr:`curvature_class` and is built with :meth:`from_keras` (a Keras model and its
    loss; the curvature declares its own keywords there) or, when the matrix needs no
    split at the model's output, from a ``loss_fn`` of variables through
    :meth:`_init_from_function` (``HessianOperator(loss_fn, variables, data)``).
    Everything documented here is common to all of them.

    The operator is the matrix **at the weights it was built with**: construction
    snapshots the parameter values (and every other state the loss reads: BatchNorm
    statistics, seed generator states, other variables a ``loss_fn`` reads), and
    ``loss()``, ``gradient()`` and every product use the snapshot, cached or streaming,
    in every dtype. To follow training, build a new operator (cheap: operators on the
    same model, loss and data shapes share their compiled functions).

    Counters: ``num_hvps`` (vectors multiplied) and ``num_data_passes`` (passes over the
    batches or their caches; the first pass that fills the cache counts too);
    ``num_examples_read`` and ``num_bytes_read`` (what this process took from the data,
    its shard with several workers, the counting pass included).

    **Distributed.** ``strategy`` (or the one the model was built under) spreads the
    batches over the replicas; ``data`` may then be a dataset function
    ``lambda input_context: dataset`` that builds each worker's shard (see
    :mod:`spectra.operators.batching`). Under a multi-worker strategy every worker must build the
    operator and call the same methods in the same order (SPMD); the data are counted
    across workers at construction.
    """

    #: The matrix this class computes; its ``for_keras`` declares the curvature-specific
    #: keywords of :meth:`from_keras`.
    curvature_class: ClassVar[type[Curvature]]
    #: The ``seed`` of :meth:`from_keras` when none is given.
    default_seed: ClassVar[int | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Matrices split at the model's output have no loss_fn constructor.
        own = "".join(f", {name}=..." for name in type(self)._curvature_keywords())
        name = type(self).__name__
        raise TypeError(
            f"build a {name} with {name}.from_keras(model, loss, data{own}): the "
            f"{self.curvature_class.title} matrix is split at the model's outputs, which a "
            "loss_fn of variables does not expose. For the Hessian of a loss_fn use "
            "HessianOperator(loss_fn, variables, data)."
        )

    # -- construction -----------------------------------------------------------------
    def _init_from_function(
        self,
        curvature: Curvature,
        loss_fn: Callable[..., Any],
        variables: Sequence[Any],
        data: Any,
        *,
        batch_size: int | None = None,
        cache: bool | str = "auto",
        cache_bytes: int | None = None,
        max_block_size: int | None = None,
        memory_budget: int | None = None,
        allow_unused: bool = False,
        strategy: tf.distribute.Strategy | None = None,
    ) -> None:
        """Set up ``self`` as the ``curvature`` matrix of ``loss_fn(batch)`` with respect to
        ``variables`` (the keywords as in :class:`~spectra.operators.HessianOperator`)."""
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}.")
        if curvature.needs_model_outputs:
            raise TypeError(
                f"the {curvature.name} matrix needs the model's outputs; build it with "
                "from_keras(model, loss, data)."
            )
        allow_unused = check_bool("allow_unused", allow_unused)
        user_variables = list(variables)
        if not user_variables:
            raise ValueError("variables is empty: there are no parameters to differentiate.")
        tf_variables = [_as_tf_variable(v) for v in user_variables]
        _check_distinct(user_variables, tf_variables)
        _check_variable_dtypes(user_variables, tf_variables)
        replicas = Replicas(strategy)
        batches = Batches(
            data, batch_size, replicas=replicas, purpose=f"The {curvature.title} operator"
        )
        spec = batches.element_spec
        key = (
            curvature.key,
            "loss_fn",
            id(loss_fn),
            tuple(id(v) for v in tf_variables),
            spec_key(spec),
            allow_unused,
        )

        def build() -> Engine:
            program = FunctionProgram(loss_fn, tf_variables)
            program.takes_batch = batches.has_data
            return Engine(curvature, program, spec, allow_unused=allow_unused)

        engine = cached_engine(key, (loss_fn, *tf_variables), build)
        captures, keep_alive = _capture_snapshots(engine, replicas.devices)
        snapshot = _Snapshot(captures, [[] for _ in replicas.devices], 0, keep_alive=keep_alive)
        self._setup(
            engine,
            batches,
            user_variables,
            snapshot,
            replicas,
            cache,
            cache_bytes,
            max_block_size,
            memory_budget,
        )

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
        strategy: tf.distribute.Strategy | None = None,
        **curvature_options: Any,
    ) -> _Operator:
        """The matrix of a Keras model's dataset loss at its current weights.

        The keywords below are those of every matrix; ``curvature_options`` are the
        matrix's own, declared by its curvature (:meth:`Curvature.for_keras
        <spectra.operators.curvature.Curvature.for_keras>`): ``kind`` and
        ``num_samples`` for :class:`~spectra.operators.FisherOperator`, none for the
        Hessian and the GGN. Another keyword is a ``TypeError`` naming it.

        ``loss``: a Keras loss name (``"sparse_categorical_crossentropy"``), a
        ``keras.losses.Loss`` object, a callable ``(y_true, y_pred) -> scalar`` mean loss,
        or for a model with several outputs a list (one per output) or a dict by output
        name, as in ``compile``. ``None`` (default) is the loss the model was compiled
        with, its ``loss_weights`` included. ``data``: ``(x, y)`` or ``(x, y,
        sample_weight)`` arrays (``x`` may be a dict or list for multi-input models, ``y``
        a list or dict for multi-output models), a ``tf.data.Dataset`` of such batches,
        or a dataset function ``input_context -> tf.data.Dataset`` (each worker's shard).
        ``variables`` defaults to ``model.trainable_variables``; a subset gives the
        block of the matrix for those variables (e.g. one layer's kernel); a Keras weight
        may be given as its ``tf.Variable`` (``kernel.value``), but each weight only once.

        **The dataset loss, per Keras reduction** (of each output's loss object; never
        dependent on ``batch_size`` or on how a dataset is batched). With per-example
        losses ℓ_i, sample weights w_i (1 without) and N examples:

        * ``"sum_over_batch_size"`` (Keras' default), ``"mean"``: the mean
          L = (1/N) Σ_i w_i ℓ_i (ℓ_i averaged over its entries); batch b contributes
          (n_b/N) L_b with L_b Keras' batch mean. Names, per-example loss functions and
          callables ``(y_true, y_pred) -> scalar`` are taken as this batch mean.
        * ``"sum"``: the sum over the whole dataset L = Σ_i w_i ℓ_i, so H = Σ_b H_b (each
          batch sum is scaled by N/n_b before the n_b/N weighting).
        * ``"none"`` or ``None`` (unreduced): the mean of the values the loss returns, as
          for ``"sum_over_batch_size"``.
        * ``"mean_with_sample_weight"``: the mean without sample weights; with sample
          weights it is refused (``ValueError``), since it divides each batch by that
          batch's own total weight.

        With several outputs L = Σ_o λ_o L_o with the ``loss_weights`` λ_o, each L_o by its
        own reduction.

        The model is called as Keras calls it, ``model(x, training=training)``; a
        ``call`` without a ``training`` argument is called without it. Sequential,
        functional and subclassed models work, with recurrent layers (LSTM, GRU,
        SimpleRNN, Bidirectional), ``tf.while_loop``/``keras.ops.scan``, ``tf.cond``,
        masking, attention, BatchNorm, custom layers and ``tf.custom_gradient`` (whose
        gradient functions must themselves be differentiable for exact second
        derivatives).

        ``training=False`` (default) runs layers in inference mode: BatchNorm uses its
        moving statistics, Dropout is off. With ``training=True`` BatchNorm uses batch
        statistics and Dropout draws its mask once per batch: from the model's seed
        generator states at construction plus ``[batch index, 0]``, or, with ``seed``,
        from ``[seed, 2²⁰·j]`` plus ``[batch index, 0]`` for the j-th seed generator. The
        masks are the same in every product and pass (cached or streaming), so the
        operator is a fixed symmetric matrix: the matrix of the loss with those masks.
        Either way the model's state is never updated. ``include_regularization`` adds
        ``model.losses`` (weight and activity regularizers, ``add_loss`` terms) to each
        batch loss.

        ``seed``: None or an int ≥ 0 (below 2⁶²). The default is the class's
        :attr:`default_seed`: None (the model's own seed states) for the Hessian and the
        GGN, 0 for the Fisher, which also seeds its sampled labels with it.

        ``batch_size``, ``cache``, ``cache_bytes``, ``max_block_size``, ``memory_budget``,
        ``allow_unused`` and ``strategy`` are as in :class:`~spectra.operators.HessianOperator`;
        ``strategy`` defaults to the ``tf.distribute`` strategy the model was built under
        (or the one in scope).

        ``dtype=np.float64`` computes the products in float64 on a float64 clone of the
        model fed with the weights cast to float64 (the model itself is not changed); the
        default is the variables' dtype. A model under a mixed-precision policy
        (``mixed_float16``, ``mixed_bfloat16``) gets its products from a clone that
        computes in the variables' dtype (float32), so the matrix is not rounded to half
        precision. Supported: float32, float64.

        The operator snapshots the model's values (trainable and non-trainable, seed
        states included) here; see the class docstring. Cost: tracing and splitting the
        graph once per model, loss and data shapes (shared by later operators), no pass
        over the data until the first product, ``loss()`` or ``gradient()``.
        """
        if getattr(cls, "curvature_class", None) is None:
            raise TypeError(
                f"{cls.__name__} names no curvature_class: build one of its subclasses "
                "(HessianOperator, GGNOperator, FisherOperator, ...)."
            )
        unknown = [name for name in curvature_options if name not in cls._curvature_keywords()]
        if unknown:
            raise TypeError(
                f"{cls.__name__}.from_keras() got an unexpected keyword argument "
                f"{unknown[0]!r}; {cls._keywords_note()}"
            )
        keras_models.check_model(model)
        curvature = cls.curvature_class.for_keras(model, loss, **curvature_options)
        if seed is _DEFAULT:
            seed = cls.default_seed
        training = check_bool("training", training)
        include_regularization = check_bool("include_regularization", include_regularization)
        allow_unused = check_bool("allow_unused", allow_unused)
        seed = _check_seed(seed)
        if data is None:
            raise ValueError(
                "data is required: (x, y) or (x, y, sample_weight) arrays, or a tf.data.Dataset "
                "of such batches."
            )
        if strategy is None:
            strategy = keras_models.model_strategy(model)
        variables, positions, target = keras_models.resolve_variables_and_dtype(
            model, variables, dtype
        )
        if loss is None:
            loss, loss_weights = keras_models.compiled_loss(model)
        else:
            loss_weights = None
        structured = keras_models.StructuredLoss(loss, loss_weights, target)
        replicas = Replicas(strategy)
        batches = Batches(
            data,
            batch_size,
            cast_floats_to=target,
            replicas=replicas,
            purpose=f"The {cls.curvature_class.title} operator",
        )
        check_keras_data(model, loss, batches)
        spec = batches.element_spec
        loss_id, loss_owners = keras_models.loss_key((loss, loss_weights))
        key = (
            curvature.key,
            "keras",
            id(model),
            loss_id,
            training,
            include_regularization,
            target.name,
            tuple(positions),
            spec_key(spec),
            allow_unused,
        )

        def build() -> Engine:
            run_model = keras_models.model_in_dtype(model, target)
            program = keras_models.KerasProgram(
                run_model,
                structured,
                dtype=target,
                training=training,
                include_regularization=include_regularization,
                positions=positions,
            )
            return Engine(curvature, program, spec, allow_unused=allow_unused)

        engine = cached_engine(key, (model, *loss_owners), build)
        program = engine.program
        _check_no_clone_reads(engine, model, program.model)  # type: ignore[attr-defined]
        state = keras_models.snapshot_state(model, program.model, replicas.devices)  # type: ignore[attr-defined]
        seed_positions = list(program.seed_indices)  # type: ignore[attr-defined]
        seed_bases = {}
        for j, position in enumerate(seed_positions):
            base = state[0][position].numpy()
            if seed is not None:
                base = np.array([seed, j * 2**20], dtype=base.dtype)
            seed_bases[position] = base
        captures, keep_alive = _capture_snapshots(engine, replicas.devices)
        snapshot = _Snapshot(
            captures,
            state,
            0 if seed is None else seed,
            seed_positions,
            seed_bases,
            keep_alive=keep_alive,
        )
        # Not through __init__, which is the loss_fn constructor of the classes that have
        # one (HessianOperator) and refuses a call elsewhere.
        operator = cls.__new__(cls)
        operator._setup(
            engine,
            batches,
            variables,
            snapshot,
            replicas,
            cache,
            cache_bytes,
            max_block_size,
            memory_budget,
        )
        return operator

    @classmethod
    def _curvature_keywords(cls) -> list[str]:
        """The curvature-specific keywords of :meth:`from_keras` (those of
        ``curvature_class.for_keras``)."""
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
        snapshot: _Snapshot,
        replicas: Replicas,
        cache: bool | str,
        cache_bytes: int | None,
        max_block_size: int | None,
        memory_budget: int | None = None,
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
        self._replicas = replicas
        self._snapshot = snapshot
        self.variables = variables
        self._cache_policy = cache
        self.memory_budget = default_memory_budget() if memory_budget is None else memory_budget
        self._snapshot_bytes = engine.size * engine.dtype.size * len(replicas.devices)
        # Without an explicit cache_bytes, the caches' room is set on the first pass from
        # its first batch (memory.cache_share); half the budget less the snapshot until then.
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
        # One vector's tangents, measured on the first product (None until then, or
        # where the device keeps no allocator statistics). Replicas running in threads
        # share the statistics of their allocators, so only one local replica measures.
        self._tangent_bytes: int | None = None
        self._tangents_to_measure = replicas.num_local == 1
        # The growth of the peak while a batch's cache is computed, measured once.
        self._cache_transient = 0
        self._transient_to_measure = replicas.num_local == 1
        self._loss: float | None = None
        self._gradient: np.ndarray | None = None
        n = engine.size
        dtype = np.dtype(engine.dtype.as_numpy_dtype)
        #: The flat vector's layout (:class:`~spectra.operators.layout.ParameterLayout`).
        self.layout = ParameterLayout(engine.shapes, engine.names, dtype)
        LinearOperator.__init__(self, dtype=dtype, shape=(n, n))
        if replicas.num_workers > 1:
            # The count all-reduce now, while every worker is here (SPMD construction):
            # later uses (num_examples, repr) must not start a collective on one worker.
            batches.synchronize()

    # -- memory -----------------------------------------------------------------------
    def _parallel_vectors(self) -> int:
        """How many vectors of a large block have their tangents alive at once."""
        return self._engine.vectors_in_flight(self._batch_bytes, PARALLEL_VECTORS)

    # -- flat vectors and variables -------------------------------------------------
    @property
    def product_path(self) -> str:
        """``"split"`` (cached vector-independent part) or ``"recompute"`` (fallback)."""
        return "split" if self._engine.split else "recompute"

    @property
    def fallback_reason(self) -> str | None:
        """Why products recompute everything per call (None when the graph is split)."""
        return self._engine.fallback_reason

    # -- loss, gradient, caching ----------------------------------------------------
    @property
    def cache_nbytes(self) -> int:
        """Bytes held by the kept batch caches (0 when every batch streams)."""
        return sum(entry.cache.nbytes for entry in self._caches or [])

    def _inputs(self, index: int, batch: Any, replica: int) -> list[Any]:
        draw = self._batches.draw_index(index)
        return self._snapshot.inputs(
            replica, draw, self._batches.num_examples, self._engine.flat_batch(batch)
        )

    def _run_pass(self, tasks: Iterator[tuple[int, Callable[[], None]]]) -> Exception | None:
        """Run a pass's tasks on the local replicas.

        With one worker an error is raised at once. With several it is returned: the
        worker still joins the pass's all-reduces (contributing NaN, so every worker sees
        a non-finite sum) and raises after them (:meth:`_end_pass`), so none waits forever.
        """
        try:
            self._replicas.run(tasks)
        except Exception as err:
            if self._replicas.num_workers == 1:
                raise
            return err
        return None

    def _end_pass(self, error: Exception | None, finite: bool, what: str) -> None:
        """After a pass's all-reduces (``finite``: whether all its sums are): if a sum is
        not finite, learn whether a worker failed (one small all-reduce, on every worker
        alike) and raise its error there, :class:`~spectra.operators.replicas.WorkerFailed`
        elsewhere. A pass that went well costs no extra collective."""
        if error is not None or not finite:
            self._replicas.agree(error, what)

    def _prepare(self) -> None:
        """First pass over the data: loss, gradient, and the caches when they fit."""
        if self._loss is not None:
            return
        dtype = self._engine.dtype
        fill = _CacheFill(self._cache_policy, self.cache_bytes, self._batches.num_examples)
        losses = self._replicas.accumulator(dtype)
        grads = self._replicas.accumulator(dtype)

        def step(index: int, batch: Any, weight: float, replica: int) -> None:
            inputs = self._inputs(index, batch, replica)
            where = self._batches.describe(index)
            with _graph_errors(where):
                if fill.wants(index):
                    cache = self._cache(inputs)
                    if self._share_from_first_batch:
                        fill.set_budget_once(self._default_cache_share(cache.nbytes))
                    batch_loss, batch_grad = cache.loss, cache.gradient
                    fill.offer(_CachedBatch(cache, weight, replica, index))
                else:
                    batch_loss, batch_grad = self._engine.loss_and_gradient(inputs)
                    fill.count()
            _check_batch_finite(where, weight, self._batches, batch_loss, batch_grad)
            losses.add(replica, _weighted(batch_loss, weight))
            grads.add(replica, _weighted(batch_grad, weight))

        tasks = (
            (replica, functools.partial(step, index, batch, weight, replica))
            for index, batch, weight, replica in self._batches.assigned()
        )
        error = self._run_pass(tasks)
        failed = error is not None
        loss = self._replicas.sum(losses, (), poisoned=failed).numpy()
        gradient = self._replicas.sum(grads, (self.shape[0],), poisoned=failed).numpy()
        finite = bool(np.isfinite(loss) and np.all(np.isfinite(gradient)))
        self._end_pass(error, finite, "the first pass over the data")
        if not finite:
            # Every batch's loss and gradient were finite: the sum overflowed.
            raise ValueError(
                f"the loss or gradient summed over the batches is not finite ({loss}) "
                f"although every batch's is: it overflows {self.dtype}. Build the operator "
                "with dtype=np.float64."
            )
        self.num_data_passes += 1
        self._loss = float(loss)
        self._gradient = gradient
        self._caches = fill.caches()
        self._cached_index = {entry.batch_index: entry for entry in self._caches}
        self._num_streamed = fill.num_batches - len(self._caches)
        self._batch_bytes = fill.largest
        self.cache_bytes = fill.budget
        plan = self.memory_plan()
        if self._cache_policy is True and plan.peak > self.memory_budget:
            warnings.warn(
                f"cache=True keeps all {len(self._caches)} batch caches "
                f"({format_bytes(self.cache_nbytes)}), so the estimated peak "
                f"{format_bytes(plan.peak)} exceeds memory_budget="
                f"{self.memory_budget} ({format_bytes(self.memory_budget)}); products run "
                f"in sub-blocks of {plan.block_size} vectors (the room the budget leaves "
                "beside the caches' share, cache_bytes, at least 1). Use cache='auto' to "
                "stay within the budget, or raise memory_budget.",
                UserWarning,
                stacklevel=2,
            )

    # -- products -------------------------------------------------------------------
    def _matmat(self, X: np.ndarray) -> np.ndarray:
        k = X.shape[1]
        if k == 0:
            return np.zeros((self.shape[0], 0), self.dtype)
        self._prepare()
        # The vectors as rows, converted and transposed in one pass over the block.
        rows = np.array(np.asarray(X).T, dtype=self.dtype, order="C")
        blocks = [
            tf.constant(rows[i : i + self.max_block_size]) for i in range(0, k, self.max_block_size)
        ]
        dtype = self._engine.dtype
        sums = [self._replicas.accumulator(dtype) for _ in blocks]
        on_device: dict[int, list[tf.Tensor]] = {}

        def product(cache: BatchCache, weight: float, replica: int, index: int) -> None:
            if replica not in on_device:  # one copy per replica (its own thread)
                on_device[replica] = [tf.identity(block) for block in blocks]
            where = f"the product on {self._batches.describe(index)}"
            with _graph_errors(where):
                for block, total in zip(on_device[replica], sums):
                    total.add(replica, _weighted(self._apply(cache, block), weight))

        def cached(entries: list[_CachedBatch]) -> None:
            for entry in entries:
                product(entry.cache, entry.weight, entry.replica, entry.batch_index)

        def streamed(index: int, batch: Any, weight: float, replica: int) -> None:
            inputs = self._inputs(index, batch, replica)
            with _graph_errors(self._batches.describe(index)):
                cache = self._cache(inputs)
            product(cache, weight, replica, index)

        if self._caches is not None and self._num_streamed == 0:
            per_replica: dict[int, list[_CachedBatch]] = {}
            for entry in self._caches:
                per_replica.setdefault(entry.replica, []).append(entry)
            tasks: Iterator[tuple[int, Callable[[], None]]] = iter(
                [(r, functools.partial(cached, entries)) for r, entries in per_replica.items()]
            )
        else:
            # In batch order, the kept caches reused and the other batches recomputed, so
            # the sums add in the same order whatever is kept.
            kept = self._cached_index
            tasks = (
                (replica, functools.partial(cached, [kept[index]]))
                if index in kept
                else (replica, functools.partial(streamed, index, batch, weight, replica))
                for index, batch, weight, replica in self._batches.assigned()
            )
        error = self._run_pass(tasks)
        n = self.shape[0]
        parts = [
            self._replicas.sum(total, (int(block.shape[0]), n), poisoned=error is not None).numpy()
            for block, total in zip(blocks, sums)
        ]
        out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        finite = bool(np.all(np.isfinite(out)))
        self._end_pass(error, finite, "a product pass")
        self.num_hvps += k
        self.num_data_passes += 1
        if not finite:
            self._raise_non_finite_product(out, blocks)
        return np.ascontiguousarray(out.T)

    def _default_cache_share(self, cache_per_batch: int) -> int:
        """The caches' room from a batch's cache (:func:`~spectra.operators.memory.
        cache_share`), once its computation's transient is measured."""
        return cache_share(
            self.memory_budget,
            self._snapshot_bytes,
            cache_per_batch,
            self._cache_transient,
            self._per_row_bytes(),
        )

    def _cache(self, inputs: list[Any]) -> BatchCache:
        """The engine's cache of one batch; the first one measures the growth of the peak
        while it is computed (:meth:`Engine.measured_cache`), for the memory plan."""
        if not self._transient_to_measure:
            return self._engine.cache(inputs)
        self._transient_to_measure = False
        cache, transient = self._engine.measured_cache(inputs)
        if transient is not None:
            self._cache_transient = transient
        return cache

    def _apply(self, cache: BatchCache, block: tf.Tensor) -> tf.Tensor:
        """The engine's product on one batch; the first one measures the memory of one
        vector's tangents (:meth:`Engine.measured_apply`), which then sizes the
        sub-blocks and the memory plan."""
        if not self._tangents_to_measure:
            return self._engine.apply(cache, block)
        self._tangents_to_measure = False
        result, tangent_bytes = self._engine.measured_apply(cache, block)
        if tangent_bytes is not None:
            self._tangent_bytes = tangent_bytes
        return result

    def _iterate_caches(self) -> Iterator[_CachedBatch]:
        """This process's batch caches, one after another (computed now for the batches
        that stream)."""
        if self._caches is not None and self._num_streamed == 0:
            yield from self._caches
            return
        for index, batch, weight, replica in self._batches.assigned():
            if index in self._cached_index:
                yield self._cached_index[index]
                continue
            inputs = self._inputs(index, batch, replica)
            with self._replicas.device(replica), _graph_errors(self._batches.describe(index)):
                cache = self._engine.cache(inputs)
            yield _CachedBatch(cache, weight, replica, index)

    def _raise_non_finite_product(self, out: np.ndarray, blocks: list[tf.Tensor]) -> None:
        """Name the batches whose products are not finite (one more pass, on failure only)."""
        bad_batches = []
        for cache, _, replica, index in self._iterate_caches():
            with self._replicas.device(replica):
                for block in blocks:
                    part = self._engine.apply(cache, block)
                    if not bool(tf.reduce_all(tf.math.is_finite(part))):
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


class _CachedBatch(NamedTuple):
    """One batch's cached state: its :class:`BatchCache`, its weight n_b/N in the sums,
    the local replica that holds it and the batch's index."""

    cache: BatchCache
    weight: float
    replica: int
    batch_index: int


class _CacheFill:
    """The batch caches of the first pass, kept while they fit the budget (thread-safe:
    the local replicas fill it concurrently).

    ``True`` keeps every cache; ``False`` keeps none (one batch is still computed with its
    cache, to measure a batch's cache for the memory plan); ``"auto"`` keeps what fits
    the budget and streams the rest. When the kept caches exceed the budget, the one worth
    least per byte is dropped: a batch's recomputation costs in proportion to its examples,
    so the value of keeping it is its examples per byte of cache (ties: the later batch is
    dropped).
    """

    def __init__(self, policy: bool | str, budget: int, num_examples: int) -> None:
        self._policy = policy
        self._budget = budget
        self._budget_set = False
        self._num_examples = max(num_examples, 1)
        self._used = 0
        self._kept: list[_CachedBatch] = []
        self._measuring: int | None = None
        self.largest = 0
        self.num_batches = 0
        self._lock = threading.Lock()

    @property
    def budget(self) -> int:
        """The room of the kept caches."""
        return self._budget

    def set_budget_once(self, budget: int) -> None:
        """Set the caches' room from the first batch (later calls change nothing)."""
        with self._lock:
            if not self._budget_set:
                self._budget_set = True
                self._budget = budget

    def wants(self, index: int) -> bool:
        """Whether batch ``index`` should be computed with its cache."""
        if self._policy is not False:
            return True
        with self._lock:
            if self._measuring is None:
                self._measuring = index
            return self._measuring == index

    def count(self) -> None:
        """A batch computed without its cache."""
        with self._lock:
            self.num_batches += 1

    def offer(self, entry: _CachedBatch) -> None:
        with self._lock:
            self.num_batches += 1
            self.largest = max(self.largest, entry.cache.nbytes)
            if self._policy is False:
                return
            self._kept.append(entry)
            self._used += entry.cache.nbytes
            if self._policy is True:
                return
            while self._used > self._budget and self._kept:
                worst = min(range(len(self._kept)), key=lambda i: self._value(self._kept[i]))
                self._used -= self._kept.pop(worst).cache.nbytes

    def _value(self, entry: _CachedBatch) -> tuple[float, int]:
        """Examples per byte (then earlier batches first): the order of keeping."""
        examples = entry.weight * self._num_examples
        return (examples / max(entry.cache.nbytes, 1), -entry.batch_index)

    def caches(self) -> list[_CachedBatch]:
        """The kept caches in batch order."""
        return sorted(self._kept, key=lambda entry: entry.batch_index)


def _weighted(value: tf.Tensor, weight: float) -> tf.Tensor:
    """``weight · value``; a weight of 1 (one batch holding all N examples) costs no op."""
    if weight == 1.0:
        return value
    return value * tf.constant(weight, value.dtype)


def _check_batch_finite(
    where: str, weight: float, batches: Batches, loss: tf.Tensor, gradient: tf.Tensor
) -> None:
    """Refuse a batch whose loss or gradient is NaN/Inf, naming it.

    Checked explicitly: fused CPU kernels (oneDNN matmul + ReLU) can turn a NaN into a
    finite number, so a finite loss alone proves nothing about the gradient.
    """
    loss_value = float(loss)
    finite = tf.math.count_nonzero(tf.math.is_finite(gradient))
    bad = int(tf.size(gradient)) - int(finite)
    if np.isfinite(loss_value) and bad == 0:
        return
    examples = round(weight * batches.num_examples)
    problems = []
    if not np.isfinite(loss_value):
        problems.append(f"loss {loss_value}")
    if bad:
        problems.append(f"{bad} of {int(tf.size(gradient))} gradient entries NaN/Inf")
    raise ValueError(
        f"{where} ({examples} examples) gives a non-finite loss or gradient "
        f"({', '.join(problems)}). The weights are finite, so look at the data of this batch "
        "(NaN/Inf inputs or sample weights, labels out of range) or at an overflow in the "
        "model."
    )


def _check_no_clone_reads(engine: Engine, model: Any, run_model: Any) -> None:
    """Refuse a compute clone whose own variables the traced graph reads.

    Layers read their variables through ``keras.StatelessScope``, which hands them the
    snapshot values; a layer that reads a variable's ``tf.Variable`` directly would read
    the clone's (stale) weights instead of the snapshot.
    """
    if run_model is model or not engine.captured_variables:
        return
    clone = {id(getattr(v, "value", v)) for v in run_model.variables}
    read = [variable_name(v) for v in engine.captured_variables if id(v) in clone]
    if read:
        raise TypeError(
            f"the model reads {read} directly (not through Keras' stateless scope), so a "
            "copy of it in another dtype cannot be fed the snapshot values. Build the model "
            "in the compute dtype yourself and pass it with dtype=None."
        )


def _check_distinct(user_variables: Sequence[Any], tf_variables: Sequence[tf.Variable]) -> None:
    seen: dict[int, int] = {}
    for i, v in enumerate(tf_variables):
        if id(v) in seen:
            raise ValueError(
                f"variable {variable_name(user_variables[i])!r} is listed twice in variables "
                f"(positions {seen[id(v)]} and {i}); each parameter may appear once."
            )
        seen[id(v)] = i


def _check_variable_dtypes(
    user_variables: Sequence[Any], tf_variables: Sequence[tf.Variable]
) -> None:
    for user_var, var in zip(user_variables, tf_variables):
        if not var.dtype.is_floating:
            raise TypeError(
                f"variable {variable_name(user_var)!r} has dtype {var.dtype.name}; Hessians "
                "need floating-point variables."
            )
    dtypes = {v.dtype.base_dtype for v in tf_variables}
    if len(dtypes) != 1:
        names = sorted(d.name for d in dtypes)
        raise TypeError(
            f"all variables must share one dtype to form one parameter vector; got {names}."
        )


def _capture_snapshots(
    engine: Engine, devices: Sequence[str | None]
) -> tuple[list[list[Any]], list[Any]]:
    """Per replica, the values an operator feeds for the engine's captured tensors.

    A captured ``tf.Variable`` handle is replaced by the handle of a copy of the variable
    made now (the snapshot); other captured tensors are fed as they are. Non-finite
    values in the copied variables are refused.
    """
    variables = list(getattr(engine, "captured_variables", None) or [])
    per_device: list[list[Any]] = [[] for _ in devices]
    keep_alive: list[Any] = []
    for external in engine.captures:
        variable = _variable_of_handle(external, variables)
        if variable is None:
            for values in per_device:
                values.append(external)
            continue
        value = tf.convert_to_tensor(variable.read_value())
        keras_models.check_finite(value, variable_name(variable))
        for values, device in zip(per_device, devices):

            def make(device: str | None = device, value: tf.Tensor = value) -> tf.Variable:
                with tf.device(device) if device is not None else contextlib.nullcontext():
                    copy = keras_models.copy_tensor(value, value.dtype, device)
                    return tf.Variable(copy, trainable=False, name="snapshot")

            snapshot = _outside_strategy(make)
            keep_alive.append(snapshot)
            values.append(snapshot.handle)
    return per_device, keep_alive


def _variable_of_handle(external: Any, variables: Sequence[Any]) -> Any:
    if getattr(external, "dtype", None) != tf.resource:
        return None
    for variable in variables:
        handles = [getattr(variable, "handle", None)]
        handles += [getattr(v, "handle", None) for v in getattr(variable, "values", ()) or ()]
        if any(h is external for h in handles):
            return variable
    return None
