"""The Hessian-vector-product engine: compiled, cached, blocked products in TensorFlow.

For a scalar batch loss L(θ) the product with a vector v is reverse-over-reverse
automatic differentiation:

    g = ∇L(θ)                       (first backward, recorded by an outer tape)
    H v = ∇_θ (g · v)               (second backward)

A naive implementation redoes the forward pass and the gradient for every vector. This
engine traces the whole computation once into one graph — the forward pass, the gradient,
the product with a single vector v, and the products with a block V = [v_1 … v_k] (a
``tf.map_fn`` loop over the rows, whose iterations TensorFlow runs concurrently) — and
splits it by a dependency analysis:

* the **cache** part: every op that depends on neither v nor V — the forward pass, the
  gradient, and whatever of the second backward is vector independent. Its results at
  the boundary with the vector-dependent part (activations, masks, back-propagated
  signals, weights as read) are the *frontier*: what a persistent ``GradientTape`` would
  keep alive.
* the **apply** parts: the ops that depend on v (or V), fed by the frontier.

All parts are pruned from the one traced graph (``tf.compat.v1.wrap_function(...).prune``),
so each is a compiled function with a fixed signature that never retraces, and the user's
loss is traced once. A product with a cached frontier costs only the vector-dependent
arithmetic (about 2 gradients per vector on an MLP, against 3 for a recomputed product);
a batch that is not cached costs one cache pass plus the apply. Cheap ops whose inputs are
already at the frontier (zeros, shapes, reshapes) are recomputed in the apply part instead
of being stored.

This is the public-API version of keeping persistent tapes around (the "seed trick":
reusing the inner gradient of nested tapes) without the tape's memory growth: a frontier
is a fixed set of tensors per batch, and products allocate nothing that outlives the call.
Vectorizing the block with ``tf.vectorized_map`` instead of a loop was measured slower on
CPU for MLPs and CNNs (and convolutions with a varying filter have no vectorization rule).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["BatchCache", "HVPEngine"]

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


@dataclass
class BatchCache:
    """The vector-independent state of one batch: frontier tensors, loss and gradient."""

    tensors: tuple[tf.Tensor, ...]
    loss: tf.Tensor
    gradient: tf.Tensor

    @property
    def nbytes(self) -> int:
        """Memory held by the frontier tensors, in bytes."""
        return int(sum(t.shape.num_elements() * t.dtype.size for t in self.tensors))


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


def _variable_name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "<unnamed>"))


class HVPEngine:
    """Compiled Hessian-vector products of ``loss_fn`` with respect to ``variables``.

    Parameters
    ----------
    loss_fn:
        ``loss_fn(batch) -> scalar`` (the mean loss of the batch), or ``loss_fn()`` when
        ``batch_spec`` is ``()`` (no data). Called once, while tracing.
    variables:
        The parameters θ, flattened and concatenated in this order (row-major each).
    batch_spec:
        Nested ``tf.TensorSpec`` of one batch (an unknown batch dimension is allowed).
    allow_unused:
        If False (default), a variable that does not affect the loss raises a
        ``ValueError`` naming it; if True its rows and columns of H are zero (warned).

    Cost: building traces and prunes the graph once (about a second for an MLP).
    ``cache(batch)`` costs a forward pass, a gradient and the vector-independent part of
    the second backward; ``apply(cache, V)`` costs the vector-dependent part only.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        variables: Sequence[Any],
        batch_spec: Any = (),
        *,
        allow_unused: bool = False,
    ) -> None:
        if len(variables) == 0:
            raise ValueError("variables is empty: there are no parameters to differentiate.")
        self._user_variables = list(variables)
        self.variables = [_as_tf_variable(v) for v in variables]
        for user_var, var in zip(self._user_variables, self.variables):
            if not var.dtype.is_floating:
                raise TypeError(
                    f"variable {_variable_name(user_var)!r} has dtype {var.dtype.name}; "
                    "Hessians need floating-point variables."
                )
        dtypes = {v.dtype.base_dtype for v in self.variables}
        if len(dtypes) != 1:
            names = sorted(d.name for d in dtypes)
            raise TypeError(
                f"all variables must share one dtype to form one parameter vector; got {names}."
            )
        self.dtype: tf.DType = dtypes.pop()
        self.shapes = [tuple(v.shape.as_list()) for v in self.variables]
        for user_var, shape in zip(self._user_variables, self.shapes):
            if any(d is None for d in shape):
                raise ValueError(
                    f"variable {_variable_name(user_var)!r} has an undefined shape {shape}."
                )
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.size = int(sum(self.sizes))
        self.batch_spec = batch_spec
        self._loss_fn = loss_fn
        self._allow_unused = allow_unused
        self.num_traces = 0
        self._build()

    # -- graph construction ---------------------------------------------------------
    def _traced(self, *flat: tf.Tensor) -> tuple[tf.Tensor, ...]:
        self.num_traces += 1
        num_batch = len(flat) - 2
        batch = tf.nest.pack_sequence_as(self.batch_spec, list(flat[:num_batch]))
        vector, block = flat[num_batch], flat[num_batch + 1]
        with tf.GradientTape(persistent=True, watch_accessed_variables=False) as outer:
            outer.watch(self.variables)
            with tf.GradientTape(watch_accessed_variables=False) as inner:
                inner.watch(self.variables)
                loss = self._loss_fn(batch) if num_batch else self._loss_fn()
            loss = self._check_loss(loss)
            grads = self._check_gradients(inner.gradient(loss, self.variables))
        flat_grad = tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)

        def product(v: tf.Tensor) -> tf.Tensor:
            parts = tf.split(v, self.sizes)
            tangents = [tf.reshape(p, s) for p, s in zip(parts, self.shapes)]
            hv = outer.gradient(
                grads,
                self.variables,
                output_gradients=tangents,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            return tf.concat([tf.reshape(tf.convert_to_tensor(h), [-1]) for h in hv], 0)

        single = product(vector)
        products = tf.map_fn(product, block, fn_output_signature=self.dtype)
        return loss, flat_grad, single, products

    def _check_loss(self, loss: Any) -> tf.Tensor:
        if loss is None:
            raise ValueError("loss_fn returned None; it must return the scalar mean loss.")
        loss = tf.convert_to_tensor(loss)
        if loss.shape.rank != 0:
            raise ValueError(
                f"loss_fn must return a scalar (the mean loss of the batch); got shape "
                f"{loss.shape}. Reduce it, e.g. tf.reduce_mean(per_example_losses)."
            )
        if not loss.dtype.is_floating:
            raise TypeError(f"loss_fn must return a floating-point scalar; got {loss.dtype.name}.")
        if loss.dtype != self.dtype:
            raise TypeError(
                f"loss_fn returned a {loss.dtype.name} loss but the variables are "
                f"{self.dtype.name}; compute the loss in {self.dtype.name}."
            )
        return loss

    def _check_gradients(self, grads: list[Any]) -> list[tf.Tensor]:
        unused = [_variable_name(v) for v, g in zip(self._user_variables, grads) if g is None]
        if unused and not self._allow_unused:
            raise ValueError(
                f"these variables do not affect the loss: {unused}. Pass variables without "
                "them (e.g. only the layers the loss uses), or allow_unused=True to keep "
                "them as zero rows and columns of the Hessian."
            )
        if unused:
            warnings.warn(
                f"variables {unused} do not affect the loss; their Hessian rows and "
                "columns are zero.",
                stacklevel=5,
            )
        return [
            tf.zeros(s, self.dtype) if g is None else tf.convert_to_tensor(g)
            for g, s in zip(grads, self.shapes)
        ]

    def _build(self) -> None:
        if tf.distribute.has_strategy():
            # Distributed variables cannot be watched by a tape in the cross-replica
            # context of a strategy scope; the scope is thread-local, so trace in a
            # thread outside it. The graph reads the variables' in-sync values.
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                pool.submit(self._build_graph).result()
        else:
            self._build_graph()

    def _build_graph(self) -> None:
        signature = [
            *tf.nest.flatten(self.batch_spec),
            tf.TensorSpec([self.size], self.dtype, name="vector"),
            tf.TensorSpec([None, self.size], self.dtype, name="vectors"),
        ]
        wrapped = tf.compat.v1.wrap_function(self._traced, signature)
        inputs = list(wrapped.inputs[: len(signature)])
        batch_inputs, vector_input, block_input = inputs[:-2], inputs[-2], inputs[-1]
        loss, flat_grad, single, products = wrapped.outputs[:4]
        single_frontier = _frontier(vector_input, single)
        block_frontier = _frontier(block_input, products)
        tensors: list[tf.Tensor] = []
        index: dict[Any, int] = {}
        for t in [*single_frontier, *block_frontier]:
            if t.ref() not in index:
                index[t.ref()] = len(tensors)
                tensors.append(t)
        self._single_positions = [index[t.ref()] for t in single_frontier]
        self._block_positions = [index[t.ref()] for t in block_frontier]
        self.num_frontier_tensors = len(tensors)
        self._cache_fn = wrapped.prune(feeds=batch_inputs, fetches=[*tensors, loss, flat_grad])
        self._single_fn = wrapped.prune(feeds=[*single_frontier, vector_input], fetches=single)
        self._block_fn = wrapped.prune(feeds=[*block_frontier, block_input], fetches=products)
        self._loss_and_gradient_fn = wrapped.prune(feeds=batch_inputs, fetches=[loss, flat_grad])

    # -- running ------------------------------------------------------------------
    def _flat_batch(self, batch: Any) -> list[tf.Tensor]:
        flat = tf.nest.flatten(batch)
        specs = tf.nest.flatten(self.batch_spec)
        if len(flat) != len(specs):
            raise ValueError(
                f"batch has {len(flat)} components but the engine was built for {len(specs)}."
            )
        return [tf.convert_to_tensor(t, dtype=s.dtype) for t, s in zip(flat, specs)]

    def cache(self, batch: Any) -> BatchCache:
        """The vector-independent state of ``batch`` (one forward and backward pass)."""
        *tensors, loss, gradient = _call(self._cache_fn, self._flat_batch(batch))
        return BatchCache(tuple(tensors), loss, gradient)

    def apply(self, cache: BatchCache, vectors: tf.Tensor) -> tf.Tensor:
        """``H_b V`` for a cached batch; ``vectors`` and the result have shape ``(k, n)``."""
        if vectors.shape[0] == 1:
            args = [cache.tensors[i] for i in self._single_positions]
            return _call(self._single_fn, [*args, vectors[0]])[None]
        args = [cache.tensors[i] for i in self._block_positions]
        return _call(self._block_fn, [*args, vectors])

    def loss_and_gradient(self, batch: Any) -> tuple[tf.Tensor, tf.Tensor]:
        """The batch loss and its flat gradient, without keeping a cache."""
        loss, gradient = _call(self._loss_and_gradient_fn, self._flat_batch(batch))
        return loss, gradient


def _call(function: Any, args: list[tf.Tensor]) -> Any:
    """Call a pruned function with its flat list of tensors.

    The ordinary call path first tries to bind the arguments to a structured signature,
    which pruned functions do not have; the failed attempt formats every argument into
    an error message (tens of milliseconds per call for large tensors) before falling
    back to the flat signature. Calling the flat signature directly skips that.
    """
    call_flat = getattr(function, "_call_flat", None)
    if call_flat is None:  # a TensorFlow without the flat call path
        return function(*args)
    result = call_flat(args, function.captured_inputs)
    return result


def _frontier(source: tf.Tensor, target: tf.Tensor) -> list[tf.Tensor]:
    """Tensors not depending on ``source`` that feed ops computing ``target`` from it.

    Walks the graph forward from ``source`` to mark dependent ops, keeps only those that
    ``target`` needs, and returns their inputs that are independent of ``source``.
    Constants and resource handles are left to the pruned function; cheap ops whose
    inputs are already at the frontier (or small integer tensors) are moved to the
    dependent side so that their outputs are recomputed rather than stored.
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
        stack.extend(op._control_outputs)
    # Restrict to ops that the target actually needs.
    needed: set[tf.Operation] = set()
    stack = [target.op]
    while stack:
        op = stack.pop()
        if op in needed or op not in dependent:
            continue
        needed.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    apply_ops = needed

    def boundary() -> list[tf.Tensor]:
        seen: set[Any] = set()
        tensors = []
        for op in apply_ops:
            for t in op.inputs:
                if t.op in apply_ops or t.op.type == "Const" or t.dtype == tf.resource:
                    continue
                if t.ref() not in seen:
                    seen.add(t.ref())
                    tensors.append(t)
        return tensors

    def available(t: tf.Tensor, frontier_refs: set[Any]) -> bool:
        if t.op.type == "Const" or t.ref() in frontier_refs or t.op in apply_ops:
            return True
        n = t.shape.num_elements()
        return t.dtype.is_integer and n is not None and n <= _SMALL_INTEGER_ELEMENTS

    frontier = boundary()
    changed = True
    while changed:
        changed = False
        refs = {t.ref() for t in frontier}
        for t in frontier:
            op = t.op
            if op.type not in _CHEAP_OPS or op.control_inputs:
                continue
            if all(available(i, refs) for i in op.inputs):
                apply_ops = apply_ops | {op}
                changed = True
        if changed:
            frontier = boundary()
    for op in apply_ops:
        for ctrl in op.control_inputs:
            if ctrl not in apply_ops:
                raise RuntimeError(
                    f"cannot split the Hessian product graph: op {op.name!r} has a control "
                    f"dependency on {ctrl.name!r}, which does not depend on the vectors."
                )
    return sorted(frontier, key=lambda t: t.name)


# -- a small cache of engines, so that operators built again on the same model and data
# shapes (a training callback does this every few steps) reuse the traced functions.
_ENGINE_CACHE_SIZE = 8
_engine_cache: collections.OrderedDict[Hashable, tuple[tuple[Any, ...], HVPEngine]] = (
    collections.OrderedDict()
)
_engine_cache_lock = threading.Lock()


def cached_engine(
    key: Hashable, owners: tuple[Any, ...], factory: Callable[[], HVPEngine]
) -> HVPEngine:
    """Return the engine stored under ``key``, or build one with ``factory``.

    ``owners`` are the objects the key refers to by identity (model, loss, variables):
    the entry keeps them alive, so their ids stay valid while it is cached, and a hit
    is checked against them. At most a few engines are kept (least recently used go).
    """
    with _engine_cache_lock:
        entry = _engine_cache.get(key)
        if (
            entry is not None
            and len(entry[0]) == len(owners)
            and all(a is b for a, b in zip(entry[0], owners))
        ):
            _engine_cache.move_to_end(key)
            return entry[1]
    engine = factory()
    with _engine_cache_lock:
        _engine_cache[key] = (owners, engine)
        _engine_cache.move_to_end(key)
        while len(_engine_cache) > _ENGINE_CACHE_SIZE:
            _engine_cache.popitem(last=False)
    return engine


def clear_engine_cache() -> None:
    """Forget all compiled engines (frees the models and graphs they hold)."""
    with _engine_cache_lock:
        _engine_cache.clear()


def spec_key(spec: Any) -> Hashable:
    """A hashable description of a nested TensorSpec structure."""
    leaves = tuple(
        (tuple(s.shape.as_list()) if s.shape.rank is not None else None, s.dtype.name)
        for s in tf.nest.flatten(spec)
    )
    structure = repr(tf.nest.map_structure(lambda _: 0, spec))
    return (structure, leaves)
