"""The compiled engine of every curvature operator: traced once, split, extracted.

For one batch, a :class:`~spectra.operators.curvature.Curvature` builds the loss, its
gradient and the product ``v -> C_b v``. The engine traces this once into one graph
whose inputs are the *state* (parameter values, or variable handles), a per-batch seed,
the batch and one vector v, and splits it by a dependency analysis:

* the **cache** part: every op that depends on neither v nor V — the forward pass, the
  gradient, and whatever of the second backward is vector independent. Its results at
  the boundary with the vector-dependent part (activations, masks, back-propagated
  signals, loop accumulators of recurrent layers) are the *frontier*: what a persistent
  ``GradientTape`` would keep alive.
* the **apply** part: the ops that depend on v, fed by the frontier. A block
  V = [v_1 … v_k] is a compiled ``tf.map_fn`` of it over the rows of V (at most
  ``PARALLEL_VECTORS`` at once), made at the first block: the product is traced once, and
  a block's columns are bitwise its vectors' ``matvec`` results. Tracing the product a
  second time inside the loop cost a quarter of an engine's build and first products
  on small models.

Each part is extracted from the traced graph as its own compiled function, with a fixed
signature that never retraces: the GraphDef of its ops is imported
(``tf.graph_util.import_graph_def``) into a ``tf.function`` whose arguments replace the
part's inputs. Functional control flow (``While`` for Keras RNNs, ``tf.while_loop``,
``keras.ops.scan``; ``If`` for ``tf.cond``) is split around: a loop or branch op is
atomic, so its vector-dependent instances (the loops of the second backward) are in the
apply part and the forward loops with their accumulators in the cache part. A product
with a cached frontier costs only the vector-dependent arithmetic; cheap ops whose inputs
are already at the frontier (zeros, shapes, reshapes) are recomputed in the apply part
rather than stored.

**Fallback.** If a graph cannot be split (extraction fails), or when the split is turned
off (environment variable ``SPECTRA_GRAPH_SPLIT=0``, read when an engine is built), the
product is one compiled function of (state, batch, vectors), traced with the block
product inside ``tf.map_fn``, that recomputes the forward pass and the gradient on every
call — exact, and slower. **Its cost** is stated once, in
the user guide ("What a product costs", ``docs/guide/operator.md``), from
``benchmarks/zoo_speed.py`` (the ratio of its ``fallback`` column to ``matvec``; re-run it
for your model and device). That is the ratio for one vector (``matvec``); in a block the
recomputed forward pass and gradient are shared by the block's vectors. The engine warns
once when it falls back, with the reason. Forward-over-reverse products
(``tf.autodiff.ForwardAccumulator`` around the gradient) were measured as the
alternative fallback: no faster than the recomputed reverse-over-reverse product on the
digits MLP (2.24x against 2.18x a gradient per vector, and a block cannot share its
forward pass) and failing inside Keras RNN loops (TensorFlow 2.21, a ``variant``
dtype error), so they are not used.

**State is never in the engine.** Engines are cached and shared by operators built on
the same model, loss and data shapes; each operator feeds its own snapshot (parameter
values, handles of its own copies of variables) as inputs, so an engine never hands one
operator's state to another.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from spectra import _tf_compat
from spectra.operators.curvature import BatchProblem, Curvature, Program
from spectra.operators.memory import LOOP_BLOCK_BYTES, PARALLEL_VECTORS

__all__ = [
    "BatchCache",
    "Engine",
    "cached_engine",
    "clear_engine_cache",
    "register_compiled_cache",
    "spec_key",
]

SPLIT_ENVIRONMENT_VARIABLE = "SPECTRA_GRAPH_SPLIT"

# Ops cheap enough to recompute in the apply part when their inputs are available there
# anyway: storing their outputs would only cost memory and function arguments.
_CHEAP_OPS = frozenset(
    {
        "ZerosLike",
        "OnesLike",
        "Shape",
        "ShapeN",
        "Size",
        "Rank",
        "Fill",
        "Range",
        "Reshape",
        "ExpandDims",
        "Squeeze",
        "Identity",
        "Pack",
        "StridedSlice",
        "BroadcastGradientArgs",
        "Cast",
    }
)
_SMALL_INTEGER_ELEMENTS = 64
# The model's own checks: ops run for their effect (failing), whose outputs the loss
# need not read. Every compiled part runs those it can compute (see _GraphParts.checks).
# In a graph, ``tf.debugging.assert_*`` is an ``If`` ("AssertGuard") whose branch holds
# the ``Assert``.
_CHECK_OPS = frozenset({"Assert", "CheckNumerics", "CheckNumericsV2"})
_BRANCH_OPS = frozenset({"If", "StatelessIf", "Case", "StatelessCase"})


def split_enabled() -> bool:
    """Whether new engines split their graphs (``SPECTRA_GRAPH_SPLIT`` is not ``0``)."""
    return os.environ.get(SPLIT_ENVIRONMENT_VARIABLE, "1").strip() not in ("0", "false", "no")


@dataclass
class BatchCache:
    """The vector-independent state of one batch.

    ``tensors`` are the stored frontier tensors, ``inputs`` the engine inputs the batch
    was computed from (snapshot, seed, batch; None for batch leaves the products do not
    read), which the apply part reads directly when the frontier includes them.
    """

    tensors: tuple[tf.Tensor, ...]
    inputs: tuple[tf.Tensor | None, ...]
    loss: tf.Tensor
    gradient: tf.Tensor
    nbytes: int


class _ExtractionError(RuntimeError):
    """A part of the traced graph cannot be made into its own function."""


class Engine:
    """Compiled curvature products of one program, one curvature kind, one batch spec.

    Parameters
    ----------
    curvature:
        What is differentiated (:class:`~spectra.operators.curvature.Curvature`).
    program:
        The batch loss as a function of state values and the batch.
    batch_spec:
        Nested ``tf.TensorSpec`` of one batch (an unknown batch dimension is allowed), or
        ``()`` for a loss without data.
    allow_unused:
        Parameters that do not affect the loss give zero rows and columns (warned)
        instead of a ``ValueError``.
    split:
        Split the graph (default: :func:`split_enabled`). False computes every product
        with the recomputing fallback.

    Notes
    -----
    Inputs of every compiled part, in order: the values of the traced graph's captured
    tensors (variable handles of a ``loss_fn``; see :attr:`captures`), the state, the
    per-batch seed (int64, shape (2,)), the batch leaves — then the vector or block.

    Cost: building traces and extracts the graph once (about a second for an MLP, a few
    for an LSTM). ``cache`` costs a forward pass, a gradient and the vector-independent
    part of the products; ``apply`` the vector-dependent part only.
    """

    def __init__(
        self,
        curvature: Curvature,
        program: Program,
        batch_spec: Any = (),
        *,
        allow_unused: bool = False,
        split: bool | None = None,
    ) -> None:
        self.curvature = curvature
        self.program = program
        self.batch_spec = batch_spec
        self.dtype: tf.DType = tf.as_dtype(program.dtype)
        if not self.dtype.is_floating:
            raise TypeError(
                f"the parameters have dtype {self.dtype.name}; curvature needs floating-point "
                "parameters."
            )
        self.shapes = [tuple(s) for s in program.parameter_shapes()]
        self.names = program.parameter_names()
        for name, shape in zip(self.names, self.shapes):
            if any(d is None for d in shape):
                raise ValueError(f"variable {name!r} has an undefined shape {shape}.")
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.size = int(sum(self.sizes))
        if self.size == 0:
            raise ValueError("the parameters have no entries: there is nothing to differentiate.")
        self.state_specs = list(program.state_specs)
        self.num_batch_leaves = len(tf.nest.flatten(batch_spec))
        self._allow_unused = allow_unused
        self.captures: list[Any] = []
        self.split = False
        self.fallback_reason: str | None = None
        requested = split_enabled() if split is None else bool(split)
        if tf.distribute.has_strategy():
            # Distributed variables cannot be watched by a tape in the cross-replica
            # context of a strategy scope; the scope is thread-local, so trace in a
            # thread outside it.
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                pool.submit(self._build, requested).result()
        else:
            self._build(requested)

    # -- tracing --------------------------------------------------------------------
    @property
    def input_signature(self) -> list[tf.TensorSpec]:
        return [
            *self.state_specs,
            tf.TensorSpec([2], tf.int64, name="seed"),
            tf.TensorSpec([], tf.int64, name="num_examples"),
            *tf.nest.flatten(self.batch_spec),
        ]

    def _traced(self, *flat: tf.Tensor, with_block: bool) -> tuple[tf.Tensor, ...]:
        num_state = len(self.state_specs)
        state = list(flat[:num_state])
        seed, num_examples = flat[num_state], flat[num_state + 1]
        leaves = list(flat[num_state + 2 : num_state + 2 + self.num_batch_leaves])
        batch = tf.nest.pack_sequence_as(self.batch_spec, leaves) if leaves else ()
        vector = flat[num_state + 2 + self.num_batch_leaves]
        problem = BatchProblem(
            self.program,
            state,
            batch,
            seed,
            num_examples=num_examples,
            allow_unused=self._allow_unused,
        )
        parts = self.curvature.build(problem)
        loss = problem.check_loss(parts.loss)
        gradient = tf.convert_to_tensor(parts.gradient)
        if gradient.shape.as_list() != [self.size]:
            raise ValueError(
                f"the {self.curvature.name} hook returned a gradient of shape "
                f"{gradient.shape}; expected the flat ({self.size},)."
            )
        # The single-vector path takes and returns a (1, n) block, so that a ``matvec``
        # needs no slicing or stacking op around the compiled call.
        single = tf.ensure_shape(parts.product(tf.reshape(vector, [self.size])), [self.size])
        single = tf.reshape(single, [1, self.size])
        if not with_block:
            return loss, gradient, single
        # The recomputing fallback's block: its vectors share one forward pass and
        # gradient. At most PARALLEL_VECTORS products run at once: their tangents are
        # what a block holds beyond its (k, n) arrays (spectra.operators.memory). The
        # product is traced as it is, like the single one: map_fn would otherwise run it
        # through AutoGraph, which changes nothing in the graph and costs time.
        products = tf.map_fn(
            tf.autograph.experimental.do_not_convert(parts.product),
            flat[-1],
            fn_output_signature=self.dtype,
            parallel_iterations=PARALLEL_VECTORS,
        )
        return loss, gradient, single, products

    def _trace(self, with_block: bool) -> _Trace:
        """The program traced into one graph: loss, gradient, the single-vector product
        and, ``with_block``, the block product (for the fallback)."""
        signature = [
            *self.input_signature,
            tf.TensorSpec([1, self.size], self.dtype, name="vector"),
        ]
        if with_block:
            signature.append(tf.TensorSpec([None, self.size], self.dtype, name="vectors"))
        graph, inputs, outputs = _tf_compat.trace_graph(
            functools.partial(self._traced, with_block=with_block), signature
        )
        captures = _tf_compat.graph_captures(graph)
        self.captures = [external for external, _ in captures]
        self.captured_variables = list(getattr(graph, "variables", ()) or ())
        num_engine_inputs = len(self.input_signature)
        engine_inputs = [internal for _, internal in captures] + list(inputs[:num_engine_inputs])
        vector_inputs = list(inputs[num_engine_inputs : len(signature)])
        parts = _GraphParts(graph)
        if not self.curvature.needs_model_outputs:
            _refuse_inexact_second_derivatives(parts.graph_def, self.curvature.title)
        first_batch_input = len(engine_inputs) - self.num_batch_leaves
        self._batch_input_positions = range(first_batch_input, len(engine_inputs))
        outputs = list(outputs[: 2 + len(vector_inputs)])  # loss, gradient, products
        return _Trace(parts, engine_inputs, vector_inputs, outputs)

    def _build(self, split: bool) -> None:
        if split:
            # Errors of the program itself (the model, the loss, the data) surface here,
            # before any split is tried.
            trace = self._trace(with_block=False)
            try:
                self._build_split(trace)
                self.split = True
                return
            except (_ExtractionError, ValueError, TypeError, KeyError) as err:
                reason = f"{type(err).__name__}: {err}"
                self.fallback_reason = reason
                warnings.warn(
                    f"spectra could not split the {self.curvature.name} product graph into a "
                    f"cached and a per-vector part ({reason}). Products are exact but "
                    "recompute the forward pass and the gradient on every call, which is "
                    "slower; see spectra.operators.engine.",
                    RuntimeWarning,
                    stacklevel=4,
                )
        else:
            self.fallback_reason = f"graph splitting disabled ({SPLIT_ENVIRONMENT_VARIABLE}=0)"
        trace = self._trace(with_block=True)
        parts, engine_inputs = trace.parts, trace.engine_inputs
        vector_input, block_input = trace.vector_inputs
        loss, gradient, single, products = trace.outputs
        independent = parts.checks_without([vector_input, block_input])
        self._cache_fn = parts.function(
            engine_inputs, [loss, gradient], "loss_and_gradient", independent
        )
        self._loss_and_gradient_fn = self._cache_fn
        self._recompute_single = parts.function(
            [*engine_inputs, vector_input],
            [single],
            "hv",
            parts.checks_without([block_input]),
        )
        self._recompute_block = parts.function(
            [*engine_inputs, block_input],
            [products],
            "hvs",
            parts.checks_without([vector_input]),
        )
        self._stored_batch_inputs = list(self._batch_input_positions)

    def _build_split(self, trace: _Trace) -> None:
        """The cache part, the single-vector apply part extracted from the traced graph,
        and the block apply part: a ``tf.map_fn`` of the single one over the block's rows
        (the product is traced once; each vector of a block gets the arithmetic of a
        ``matvec``)."""
        parts, engine_inputs = trace.parts, trace.engine_inputs
        (vector_input,) = trace.vector_inputs
        loss, gradient, single = trace.outputs
        # The model's checks: those independent of the vector run with the cache (once
        # per batch), the others in the product that computes them.
        independent = parts.checks_without([vector_input])
        single_checks = parts.checks_of(vector_input)
        single_frontier = _frontier(
            vector_input, [single.op, *single_checks], parts.control_outputs
        )
        input_index = {t.name: i for i, t in enumerate(engine_inputs)}
        stored: list[tf.Tensor] = []
        stored_index: dict[str, int] = {}

        def source(t: tf.Tensor) -> _Source:
            if t.name in input_index:
                return _Source(from_cache=False, position=input_index[t.name])
            if t.name not in stored_index:
                stored_index[t.name] = len(stored)
                stored.append(t)
            return _Source(from_cache=True, position=stored_index[t.name])

        self._single_sources = [source(t) for t in single_frontier]
        used_inputs = {origin.position for origin in self._single_sources if not origin.from_cache}
        self._stored_batch_inputs = [i for i in self._batch_input_positions if i in used_inputs]
        self._cache_fn = parts.function(
            engine_inputs, [*stored, loss, gradient], "cache", independent
        )
        self._single_fn = parts.function(
            [*single_frontier, vector_input], [single], "apply", single_checks
        )
        # Compiled at the first block that needs it (:meth:`_block_function`): an
        # operator used only through ``matvec`` never pays for it.
        self._single_frontier_specs = [tf.TensorSpec(t.shape, t.dtype) for t in single_frontier]
        self._block_fn: Any = None
        self._block_lock = threading.Lock()
        self._loss_and_gradient_fn = parts.function(
            engine_inputs, [loss, gradient], "loss_and_gradient", independent
        )

    # -- running ------------------------------------------------------------------
    def flat_batch(self, batch: Any) -> list[tf.Tensor]:
        """The leaves of ``batch`` as tensors of the batch spec's dtypes."""
        flat = tf.nest.flatten(batch)
        specs = tf.nest.flatten(self.batch_spec)
        if len(flat) != len(specs):
            raise ValueError(
                f"batch has {len(flat)} components but the engine was built for {len(specs)}."
            )
        return [tf.convert_to_tensor(t, dtype=s.dtype) for t, s in zip(flat, specs)]

    def cache(self, inputs: Sequence[tf.Tensor]) -> BatchCache:
        """The vector-independent state of one batch (one forward and backward pass).

        ``inputs``: the engine inputs (captured values, state, seed, N, batch leaves).
        """
        inputs = tuple(inputs)
        *tensors, loss, gradient = _tf_compat.call_flat(self._cache_fn, inputs)
        # Keep only the batch leaves the products read (the snapshot is shared anyway).
        kept = tuple(
            None if i in self._batch_input_positions and i not in self._stored_batch_inputs else t
            for i, t in enumerate(inputs)
        )
        held = [inputs[i] for i in self._stored_batch_inputs]
        nbytes = _nbytes([*tensors, *held], self.dtype.size)
        return BatchCache(tuple(tensors), kept, loss, gradient, nbytes)

    def loops_blocks(self, cache_bytes: int) -> bool:
        """Whether a block's vectors run one at a time through the single-vector product
        on a batch whose cache holds ``cache_bytes`` (:data:`~spectra.operators.memory.
        LOOP_BLOCK_BYTES`): the same arithmetic, bitwise the same results, one vector's
        tangents alive instead of several. Never in the fallback, whose block shares one
        recomputed forward pass."""
        return self.split and cache_bytes >= LOOP_BLOCK_BYTES

    def vectors_in_flight(self, cache_bytes: int, k: int) -> int:
        """How many of a block's k vectors have their tangents alive at once."""
        if k <= 1 or self.loops_blocks(cache_bytes):
            return min(k, 1)
        return min(k, PARALLEL_VECTORS)

    def apply(self, cache: BatchCache, vectors: tf.Tensor) -> tf.Tensor:
        """``C_b V`` for a cached batch; ``vectors`` and the result have shape ``(k, n)``."""
        k = vectors.shape[0]
        if not self.split:
            function = self._recompute_single if k == 1 else self._recompute_block
            return _tf_compat.call_flat(function, [*cache.inputs, vectors])[0]
        if k == 1 or self.loops_blocks(cache.nbytes):
            args = [_pick(cache, s) for s in self._single_sources]
            if k == 1:
                return _tf_compat.call_flat(self._single_fn, [*args, vectors])[0]
            rows = [
                _tf_compat.call_flat(self._single_fn, [*args, vectors[i : i + 1]])[0]
                for i in range(k)
            ]
            return tf.concat(rows, axis=0)
        args = [_pick(cache, s) for s in self._single_sources]
        return _tf_compat.call_flat(self._block_function(), [*args, vectors])[0]

    def _block_function(self) -> Any:
        """The compiled block product of the split engine (:func:`_mapped`), made once."""
        with self._block_lock:
            if self._block_fn is None:
                self._block_fn = _mapped(
                    self._single_fn, self._single_frontier_specs, self.size, self.dtype
                )
            return self._block_fn

    def measured_apply(self, cache: BatchCache, vectors: tf.Tensor) -> tuple[tf.Tensor, int | None]:
        """:meth:`apply`, and the memory one vector's tangents took in it: the growth of
        TensorFlow's peak allocation on the device over the memory in use before the
        call, per vector in flight (:meth:`vectors_in_flight`); None where the device
        keeps no allocator statistics. Resets the device's peak statistic."""
        with _PeakGrowth(_statistics_device([cache.gradient])) as growth:
            result = self.apply(cache, vectors)
        if growth.bytes is None:
            return result, None
        in_flight = max(1, self.vectors_in_flight(cache.nbytes, int(vectors.shape[0])))
        return result, growth.bytes // in_flight

    def measured_cache(self, inputs: Sequence[tf.Tensor]) -> tuple[BatchCache, int | None]:
        """:meth:`cache`, and the growth of TensorFlow's peak allocation while it ran (the
        forward pass and gradient's transients and the cache they leave); None where the
        device keeps no allocator statistics. Resets the device's peak statistic."""
        with _PeakGrowth(_statistics_device(inputs)) as growth:
            cache = self.cache(inputs)
        return cache, growth.bytes

    def loss_and_gradient(self, inputs: Sequence[tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
        """The batch loss and its flat gradient, without keeping a cache."""
        loss, gradient = _tf_compat.call_flat(self._loss_and_gradient_fn, list(inputs))
        return loss, gradient


class _Trace(NamedTuple):
    """One trace of the program: its graph's parts, the engine inputs (captured values,
    state, seed, N, batch leaves), the vector inputs (the single vector, and the block
    when traced with one) and the outputs (loss, gradient, products)."""

    parts: _GraphParts
    engine_inputs: list[tf.Tensor]
    vector_inputs: list[tf.Tensor]
    outputs: list[tf.Tensor]


def _mapped(
    single_fn: Any, frontier_specs: Sequence[tf.TensorSpec], size: int, dtype: tf.DType
) -> Any:
    """The block product ``(frontier, V) -> [C v_1 … C v_k]`` as a compiled ``tf.map_fn``
    of the compiled single-vector product over the rows of V, at most PARALLEL_VECTORS at
    once (their tangents are what a block holds beyond its arrays; see
    :mod:`spectra.operators.memory`)."""
    specs = list(frontier_specs)
    specs.append(tf.TensorSpec([None, size], dtype, name="vectors"))

    def block(*args: tf.Tensor) -> list[tf.Tensor]:
        values, vectors = args[:-1], args[-1]

        def one(vector: tf.Tensor) -> tf.Tensor:
            return tf.reshape(single_fn(*values, tf.reshape(vector, [1, size]))[0], [size])

        products = tf.map_fn(
            one, vectors, fn_output_signature=dtype, parallel_iterations=PARALLEL_VECTORS
        )
        return [products]  # a list, as the extracted parts return

    try:
        return tf.function(block, input_signature=specs, autograph=False).get_concrete_function()
    except (ValueError, TypeError, tf.errors.OpError) as err:
        raise _ExtractionError(f"the block product could not be compiled: {err}") from err


class _Source(NamedTuple):
    """Where an apply part's argument comes from: the batch cache's stored frontier
    tensors (``from_cache``) or the engine inputs the cache was computed from, at
    ``position``."""

    from_cache: bool
    position: int


def _refuse_inexact_second_derivatives(graph_def: Any, title: str) -> None:
    """Refuse a second derivative through an op TensorFlow differentiates wrongly, left in
    a traced graph (see :func:`spectra._tf_compat.inexact_second_derivative_ops`)."""
    found = _tf_compat.inexact_second_derivative_ops(graph_def)
    if found:
        scope, what = found[0]
        raise ValueError(
            f"{scope!r} computes {what}, and spectra could not substitute an exact one: "
            f"the {title} would be wrong. Use curvature 'ggn' (no second derivative of the "
            "model), or report the TensorFlow and Keras versions."
        )


def _statistics_device(tensors: Sequence[Any]) -> str:
    """The device of the first placed tensor as ``tf.config.experimental`` names it
    (``"CPU:0"``, ``"GPU:1"``); ``"CPU:0"`` when none says."""
    for t in tensors:
        name = getattr(t, "device", "") or ""
        if name:
            spec = tf.DeviceSpec.from_string(name)
            if spec.device_type:
                return f"{spec.device_type}:{spec.device_index or 0}"
    return "CPU:0"


class _PeakGrowth:
    """Context: ``bytes``, the growth of TensorFlow's peak allocation on ``device`` over
    the memory in use on entry (``tf.config.experimental.reset_memory_stats`` then
    ``get_memory_info``, which count a CPU's allocations as well as a GPU's); None where
    the device keeps no statistics or the block raised."""

    _ERRORS = (ValueError, RuntimeError, KeyError, TypeError, tf.errors.OpError)

    def __init__(self, device: str) -> None:
        self.device = device
        self.bytes: int | None = None
        self._before: int | None = None

    def __enter__(self) -> _PeakGrowth:
        try:
            tf.config.experimental.reset_memory_stats(self.device)
            self._before = int(tf.config.experimental.get_memory_info(self.device)["current"])
        except self._ERRORS:
            self._before = None
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if self._before is None or kind is not None:
            return
        try:
            peak = int(tf.config.experimental.get_memory_info(self.device)["peak"])
        except self._ERRORS:
            return
        self.bytes = max(0, peak - self._before)


def _pick(cache: BatchCache, source: _Source) -> tf.Tensor:
    if source.from_cache:
        return cache.tensors[source.position]
    value = cache.inputs[source.position]
    assert value is not None, "an input the products read was not kept in the cache"
    return value


def _nbytes(tensors: Sequence[tf.Tensor], itemsize: int) -> int:
    """Memory held by tensors; TensorLists (accumulators of loops) by their elements,
    counted at ``itemsize`` bytes each."""
    total = 0
    for t in tensors:
        if t.dtype == tf.variant:
            total += _tensor_list_nbytes(t, itemsize)
        elif t.dtype != tf.resource:
            total += int(t.shape.num_elements() or 0) * t.dtype.size
    return total


def _tensor_list_nbytes(t: tf.Tensor, itemsize: int) -> int:
    """Bytes held by a scalar TensorList of known element shape (else 0, undercounted)."""
    if t.shape.rank != 0:
        return 0
    try:
        length = int(tf.raw_ops.TensorListLength(input_handle=t))
        shape = tf.raw_ops.TensorListElementShape(input_handle=t, shape_type=tf.int64).numpy()
    except (tf.errors.OpError, TypeError, ValueError):
        return 0
    if shape.ndim != 1 or np.any(shape < 0):
        return 0
    return length * int(np.prod(shape, dtype=np.int64)) * itemsize


class _GraphParts:
    """Extracts parts of a traced graph as compiled functions of chosen input tensors."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.graph_def = graph.as_graph_def()
        self.nodes = {node.name: node for node in self.graph_def.node}
        self.order = {node.name: i for i, node in enumerate(self.graph_def.node)}
        self.control_outputs: dict[str, list[tf.Operation]] = collections.defaultdict(list)
        for op in graph.get_operations():
            for control in op.control_inputs:
                self.control_outputs[control.name].append(op)
        #: The model's checks (``tf.debugging.assert_*``, ``check_numerics``) in the graph:
        #: ops that matter for their failure, which no fetched value needs to depend on.
        asserting = {
            function.signature.name
            for function in self.graph_def.library.function
            if any(node.op in _CHECK_OPS for node in function.node_def)
        }
        self.checks = [op for op in graph.get_operations() if _is_check(op, asserting)]

    def _downstream(self, sources: Sequence[tf.Tensor]) -> set[tf.Operation]:
        """Every op depending on ``sources`` through data or control edges."""
        seen: set[tf.Operation] = set()
        stack = [t.op for t in sources]
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            for output in op.outputs:
                stack.extend(output.consumers())
            stack.extend(self.control_outputs.get(op.name, ()))
        return seen

    def checks_of(self, source: tf.Tensor) -> list[tf.Operation]:
        """The checks that depend on ``source`` (run in the part that computes them)."""
        dependent = self._downstream([source])
        return [op for op in self.checks if op in dependent]

    def checks_without(self, sources: Sequence[tf.Tensor]) -> list[tf.Operation]:
        """The checks that depend on none of ``sources``."""
        dependent = self._downstream(sources)
        return [op for op in self.checks if op not in dependent]

    def function(
        self,
        feeds: Sequence[tf.Tensor],
        fetches: Sequence[tf.Tensor],
        name: str,
        checks: Sequence[tf.Operation] = (),
    ) -> Any:
        """A concrete function computing ``fetches`` from values of ``feeds``.

        The part is every op ``fetches`` and ``checks`` need through data edges, stopping
        at ``feeds``; the ``checks`` (the model's assertions) run before any result is
        returned, so a failing one fails the call with its message. Control edges between
        ops of the part are kept; those from outside the part are dropped (the ops they
        order ran in an earlier part, or have no effect on values). A placeholder the
        part needs but is not given raises :class:`_ExtractionError`.
        """
        feed_names = {t.name for t in feeds}
        keep: set[str] = set()
        stack = [t.op for t in fetches if t.name not in feed_names] + list(checks)
        while stack:
            op = stack.pop()
            if op.name in keep:
                continue
            keep.add(op.name)
            for t in op.inputs:
                if t.name not in feed_names:
                    stack.append(t.op)
        unfed = sorted(n for n in keep if self.nodes[n].op == "Placeholder")
        if unfed:
            raise _ExtractionError(f"part {name!r} needs inputs it is not given: {unfed[:5]}")
        sub = tf.compat.v1.GraphDef()
        sub.versions.CopyFrom(self.graph_def.versions)
        sub.library.CopyFrom(self.graph_def.library)
        used: set[str] = set()
        for node_name in sorted(keep, key=self.order.__getitem__):
            node = sub.node.add()
            node.CopyFrom(self.nodes[node_name])
            for attr in [a for a in node.attr if a.startswith("_class")]:
                del node.attr[attr]
            inputs = list(node.input)
            del node.input[:]
            for item in inputs:
                if item.startswith("^"):
                    if item[1:] in keep:
                        node.input.append(item)
                    continue
                node.input.append(item)
                used.add(item if ":" in item else f"{item}:0")
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in feeds]
        feed_list = list(feeds)
        return_names = [t.name for t in fetches]
        passthrough = {i: feed_list.index(t) for i, t in enumerate(fetches) if t.name in feed_names}

        check_names = [op.name for op in checks]

        def body(*args: tf.Tensor) -> list[tf.Tensor]:
            input_map = {t.name: a for t, a in zip(feed_list, args) if t.name in used}
            computed = [n for i, n in enumerate(return_names) if i not in passthrough]
            wanted = computed + check_names
            imported = (
                tf.graph_util.import_graph_def(
                    sub, input_map=input_map, return_elements=wanted, name=name
                )
                if wanted
                else []
            )
            values, ran = imported[: len(computed)], imported[len(computed) :]
            # A check with outputs (a guarded assertion's If, check_numerics) runs only
            # when its outputs are read: a control edge to the op alone would let the
            # runtime prune the branch that asserts. Read them.
            ran = [tf.identity(op.outputs[0]).op if op.outputs else op for op in ran]
            results, it = [], iter(values)
            with tf.control_dependencies(ran):
                for i in range(len(return_names)):
                    value = args[passthrough[i]] if i in passthrough else next(it)
                    results.append(tf.identity(value) if ran or i in passthrough else value)
            return results

        try:
            compiled = tf.function(body, input_signature=specs, autograph=False)
            return compiled.get_concrete_function()
        except (ValueError, TypeError, tf.errors.OpError) as err:
            raise _ExtractionError(f"part {name!r} could not be compiled: {err}") from err


def _is_check(op: tf.Operation, asserting: set[str]) -> bool:
    """Whether ``op`` is one of the model's checks: an assertion or ``check_numerics``, or a
    branch op (a guarded assertion) one of whose branches (in ``asserting``) holds one."""
    if op.type in _CHECK_OPS:
        return True
    if op.type not in _BRANCH_OPS:
        return False
    branches = []
    for attr in ("then_branch", "else_branch"):
        if attr in op.node_def.attr:
            branches.append(op.node_def.attr[attr].func.name)
    if "branches" in op.node_def.attr:
        branches.extend(f.name for f in op.node_def.attr["branches"].list.func)
    return any(name in asserting for name in branches)


def _frontier(
    source: tf.Tensor,
    targets: Sequence[tf.Operation],
    control_outputs: dict[str, list[tf.Operation]],
) -> list[tf.Tensor]:
    """Tensors not depending on ``source`` that feed ops computing ``targets`` from it.

    Walks the graph forward from ``source`` to mark dependent ops, keeps only those that
    ``targets`` need, and returns their inputs that are independent of ``source``.
    Constants are left to the extracted function; cheap ops whose inputs are already at
    the frontier (or small integer tensors) are moved to the dependent side so that their
    outputs are recomputed rather than stored.
    """
    dependent: set[tf.Operation] = set()
    stack = [source.op]
    while stack:
        op = stack.pop()
        if op in dependent:
            continue
        dependent.add(op)
        for output in op.outputs:
            stack.extend(output.consumers())
        stack.extend(control_outputs.get(op.name, ()))
    needed: set[tf.Operation] = set()
    stack = list(targets)
    while stack:
        op = stack.pop()
        if op in needed or op not in dependent:
            continue
        needed.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    apply_ops = needed

    def boundary() -> list[tf.Tensor]:
        seen: set[str] = set()
        tensors = []
        for op in apply_ops:
            for t in op.inputs:
                if t.op in apply_ops or t.op.type == "Const":
                    continue
                if t.name not in seen:
                    seen.add(t.name)
                    tensors.append(t)
        return tensors

    def available(t: tf.Tensor, frontier_names: set[str]) -> bool:
        if t.op.type == "Const" or t.name in frontier_names or t.op in apply_ops:
            return True
        n = t.shape.num_elements()
        return t.dtype.is_integer and n is not None and n <= _SMALL_INTEGER_ELEMENTS

    frontier = boundary()
    changed = True
    while changed:
        changed = False
        names = {t.name for t in frontier}
        for t in frontier:
            op = t.op
            if op.type not in _CHEAP_OPS or op.control_inputs:
                continue
            if all(available(i, names) for i in op.inputs):
                apply_ops = apply_ops | {op}
                changed = True
        if changed:
            frontier = boundary()
    return sorted(frontier, key=lambda t: t.name)


# -- a small cache of engines, so that operators built again on the same model and data
# shapes (a training callback does this every few steps) reuse the compiled functions.
_ENGINE_CACHE_SIZE = 8


class _CachedEngine(NamedTuple):
    """An engine of the cache, with the objects its key refers to by identity."""

    owners: tuple[Any, ...]
    engine: Engine


_engine_cache: collections.OrderedDict[Hashable, _CachedEngine] = collections.OrderedDict()
_engine_cache_lock = threading.Lock()


def cached_engine(key: Hashable, owners: tuple[Any, ...], factory: Callable[[], Engine]) -> Engine:
    """Return the engine stored under ``key``, or build one with ``factory``.

    ``owners`` are the objects the key refers to by identity (model, loss, variables):
    the entry keeps them alive, so their ids stay valid while it is cached, and a hit
    is checked against them. At most a few engines are kept (least recently used go).
    Whether graphs are split (:func:`split_enabled`) is part of every key.
    """
    key = (key, split_enabled())
    with _engine_cache_lock:
        entry = _engine_cache.get(key)
        if (
            entry is not None
            and len(entry.owners) == len(owners)
            and all(a is b for a, b in zip(entry.owners, owners))
        ):
            _engine_cache.move_to_end(key)
            return entry.engine
    engine = factory()
    with _engine_cache_lock:
        _engine_cache[key] = _CachedEngine(owners, engine)
        _engine_cache.move_to_end(key)
        while len(_engine_cache) > _ENGINE_CACHE_SIZE:
            _engine_cache.popitem(last=False)
    return engine


#: Other caches of compiled functions that hold models (K-FAC's passes): cleared with the
#: engines' (:func:`register_compiled_cache`).
_other_caches: list[Callable[[], None]] = []


def register_compiled_cache(clear: Callable[[], None]) -> None:
    """Have :func:`clear_engine_cache` also call ``clear`` (another module's cache of
    compiled functions, such as K-FAC's data passes)."""
    _other_caches.append(clear)


def clear_engine_cache() -> None:
    """Forget all compiled engines and other registered compiled functions (frees the
    models and graphs they hold)."""
    with _engine_cache_lock:
        _engine_cache.clear()
    for clear in _other_caches:
        clear()


def spec_key(spec: Any) -> Hashable:
    """A hashable description of a nested TensorSpec structure."""
    leaves = tuple(
        (tuple(s.shape.as_list()) if s.shape.rank is not None else None, s.dtype.name)
        for s in tf.nest.flatten(spec)
    )
    structure = repr(tf.nest.map_structure(lambda _: 0, spec))
    return (structure, leaves)
