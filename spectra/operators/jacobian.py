"""The Jacobian of a Keras model's outputs over a dataset, and its transpose, as
``LinearOperator`` objects.

With θ the flat parameter vector (the layout of
:class:`~spectra.operators.HessianOperator`: the variables in order, each flattened
row-major) and z_i = f(x_i; θ) ∈ ℝ^C the outputs of example i (every output of the model,
each flattened row-major, concatenated in the model's output order), the Jacobian over
the N examples of the data is the (N·C) × n matrix

    J = ∂(z_1, …, z_N)/∂θ,     row i·C + c = ∂z_{i,c}/∂θ

(example-major). It is the plain Jacobian: no 1/N or n_b/N factor. The generalized
Gauss-Newton matrix of a mean-reduced loss L(θ) = (1/N) Σ_i ℓ_i(z_i) is then

    G = Jᵀ H_z J,     H_z = ∇²_z L = blockdiag_i( (1/N) ∇²_{z_i} ℓ_i )

(:class:`~spectra.operators.GGNOperator`, split at the model's outputs), and J Jᵀ is
the empirical neural tangent kernel of the outputs (an N·C × N·C Gram matrix).
:class:`JacobianOperator` multiplies by J, its transpose
:class:`TransposedJacobianOperator` (``J.T``) by Jᵀ; both take blocks of vectors in one
pass over the data. Unlike the curvature operators they recompute the forward pass of a
batch in each product (one compiled ``tf.function`` per direction, no graph split and no
cache).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from scipy.sparse.linalg import LinearOperator

from spectra._validation import check_bool
from spectra.operators import keras_models
from spectra.operators.batching import Batches
from spectra.operators.data_checks import check_input_dtypes, check_input_shapes, graph_errors
from spectra.operators.engine import spec_key
from spectra.operators.jacobian_core import JacobianCore, TransposedJacobianCore
from spectra.operators.layout import ParameterLayout

__all__ = ["JacobianOperator", "TransposedJacobianOperator"]


def _inputs_of(batch: Any) -> Any:
    """The model inputs x of a batch, as Keras' ``fit`` reads data: a tuple of one to
    three parts is ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``; anything else (an
    array, a list of arrays, a dict) is x itself."""
    if isinstance(batch, tuple):
        if not 1 <= len(batch) <= 3:
            raise ValueError(
                f"data is a tuple of {len(batch)} parts; a tuple is (x,), (x, y) or (x, y, "
                "sample_weight), as in Keras' fit. Pass the inputs of a model with several "
                "inputs as a list or dict: (x_list, y)."
            )
        return batch[0]
    return batch


class _Functions(NamedTuple):
    """The compiled functions of one model, parameter choice, dtype and input spec."""

    run_model: Any
    state_variables: list[Any]
    parameter_indices: list[int]
    outputs: Callable[..., tf.Tensor]
    jvp: Callable[..., tf.Tensor]
    vjp: Callable[..., tf.Tensor]
    output_names: list[str]
    output_shapes: list[tuple[int, ...]]


_CACHE_SIZE = 8
_cache: collections.OrderedDict[Hashable, tuple[tuple[Any, ...], _Functions]] = (
    collections.OrderedDict()
)
_cache_lock = threading.Lock()


def _cached(key: Hashable, owners: tuple[Any, ...], build: Callable[[], _Functions]) -> _Functions:
    """The functions stored under ``key`` (checked against the objects it names by
    identity, which the entry keeps alive), or new ones; a few are kept, least recently
    used go first."""
    with _cache_lock:
        entry = _cache.get(key)
        if entry is not None and all(a is b for a, b in zip(entry[0], owners)):
            _cache.move_to_end(key)
            return entry[1]
    functions = build()
    with _cache_lock:
        _cache[key] = (owners, functions)
        _cache.move_to_end(key)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return functions


def _build_functions(
    model: Any, positions: Sequence[int], dtype: tf.DType, x_spec: Any
) -> _Functions:
    """Trace the forward pass, J V and Jᵀ U of ``model`` (or its clone computing in
    ``dtype``) on batches of ``x_spec``, differentiating the weights at ``positions``."""
    run_model = keras_models.model_in_dtype(model, dtype)
    trainable, others = keras_models._state_keys(run_model)
    state_variables = [*trainable, *others]
    run_weights = list(run_model.weights)
    parameter_indices = [
        next(i for i, v in enumerate(state_variables) if v is run_weights[p]) for p in positions
    ]
    state_specs = [tf.TensorSpec(v.shape, v.dtype) for v in state_variables]
    shapes = [tuple(state_variables[i].shape) for i in parameter_indices]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    n = sum(sizes)
    described: dict[str, Any] = {}

    def flat_outputs(state: Sequence[tf.Tensor], x: Any) -> tf.Tensor:
        """The outputs of the batch as an (n_b, C) matrix (model output order)."""
        outputs, _ = keras_models.stateless_forward(
            run_model, state_variables, state, x, training=False
        )
        entries = keras_models._output_entries(run_model, outputs)
        count = tf.shape(tf.nest.flatten(x)[0])[0]
        parts, names, per_example = [], [], []
        for name, output in entries:
            output = tf.convert_to_tensor(output)
            if not output.dtype.is_floating:
                raise TypeError(
                    f"model output {name!r} has dtype {output.dtype.name}: integer (or "
                    "boolean) outputs have no Jacobian. Return floating-point outputs (e.g. "
                    "the logits) from the model."
                )
            if output.shape.rank == 0:
                raise ValueError(
                    f"model output {name!r} is a scalar: the Jacobian needs outputs with a "
                    "leading example dimension."
                )
            entry_shape = tuple(output.shape[1:])
            if any(d is None for d in entry_shape):
                raise ValueError(
                    f"model output {name!r} has per-example shape {entry_shape} with an "
                    "unknown dimension: the Jacobian needs a fixed number of output entries "
                    "per example."
                )
            tf.debugging.assert_equal(
                tf.shape(output)[0],
                count,
                message=f"model output {name!r} does not have one row per example of x",
            )
            output = tf.cast(output, dtype) if output.dtype != dtype else output
            parts.append(tf.reshape(output, [count, -1]))
            names.append(str(name))
            per_example.append(tuple(int(d) for d in entry_shape))
        described["names"], described["shapes"] = names, per_example
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)

    def unflatten(vector: tf.Tensor) -> list[tf.Tensor]:
        return [tf.reshape(p, s) for p, s in zip(tf.split(vector, sizes), shapes)]

    def flatten(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
        return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)

    # autograph=False: the model is traced as Keras calls it, as the curvature engine
    # traces it (no conversion of Python control flow in the functions below).
    @tf.function(input_signature=[state_specs, x_spec], autograph=False)
    def outputs(state: list[tf.Tensor], x: Any) -> tf.Tensor:
        return flat_outputs(state, x)

    @tf.function(
        input_signature=[state_specs, x_spec, tf.TensorSpec([None, n], dtype)], autograph=False
    )
    def jvp(state: list[tf.Tensor], x: Any, vectors: tf.Tensor) -> tf.Tensor:
        # J v by the double-VJP trick: u ↦ Jᵀu is linear in u, so its VJP with
        # cotangent v is J v (for any point u; the zeros are never used as values).
        z = flat_outputs(state, x)
        parameters = [state[i] for i in parameter_indices]
        dummy = tf.zeros_like(z)
        # Dense (an Embedding's gradient is IndexedSlices, which cannot be differentiated
        # as a list of outputs).
        transposed = [
            tf.convert_to_tensor(g)
            for g in tf.gradients(
                z, parameters, grad_ys=dummy, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
        ]

        def one(vector: tf.Tensor) -> tf.Tensor:
            return tf.convert_to_tensor(
                tf.gradients(
                    transposed,
                    dummy,
                    grad_ys=unflatten(vector),
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )[0]
            )

        return tf.map_fn(one, vectors, fn_output_signature=tf.TensorSpec(z.shape, dtype))

    @tf.function(
        input_signature=[state_specs, x_spec, tf.TensorSpec([None, None, None], dtype)],
        autograph=False,
    )
    def vjp(state: list[tf.Tensor], x: Any, cotangents: tf.Tensor) -> tf.Tensor:
        z = flat_outputs(state, x)
        parameters = [state[i] for i in parameter_indices]

        def one(cotangent: tf.Tensor) -> tf.Tensor:
            grads = tf.gradients(
                z,
                parameters,
                grad_ys=tf.reshape(cotangent, tf.shape(z)),
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            return flatten([tf.convert_to_tensor(g) for g in grads])

        return tf.map_fn(one, cotangents, fn_output_signature=tf.TensorSpec([n], dtype))

    outputs.get_concrete_function()  # traced now: names and shapes of the outputs
    return _Functions(
        run_model,
        state_variables,
        parameter_indices,
        outputs,
        jvp,
        vjp,
        described["names"],
        described["shapes"],
    )


def _check_finite_inputs(batch: Any, where: str | None) -> None:
    """Refuse NaN or Inf in the floating-point inputs x of a batch."""
    for leaf in tf.nest.flatten(_inputs_of(batch)):
        if leaf.dtype.is_floating and not bool(tf.reduce_all(tf.math.is_finite(leaf))):
            bad = int(tf.size(leaf)) - int(tf.math.count_nonzero(tf.math.is_finite(leaf)))
            at = "" if where is None else f" in {where}"
            raise ValueError(
                f"the inputs x hold {bad} NaN/Inf entries{at}: the model's outputs and "
                "their Jacobian are undefined there. Clean the data first."
            )


class JacobianOperator(JacobianCore):
    """J = ∂z/∂θ, the Jacobian of a Keras model's outputs over a dataset, an (N·C) × n
    ``LinearOperator``.

    **Rows** (the output space, length N·C): example-major. Row i·C + c is entry c of
    example i's outputs, where the C entries of an example are each model output
    flattened row-major (an output of per-example shape (h, w, k) gives h·w·k entries),
    the outputs concatenated in the model's output order (``model.output_names``; a dict
    of outputs in that order). :attr:`output_names` and :attr:`output_shapes` describe
    them; :meth:`unflatten_outputs` splits an output-space vector into one (N, …) array
    per output, :meth:`flatten_outputs` is its inverse. Examples are in the order of the
    data (batches in order).

    **Columns** (the parameter space, length n): the flat parameter vector of
    :class:`~spectra.operators.HessianOperator` built on the same model and variables,
    with the same :meth:`flatten`, :meth:`unflatten` and :attr:`variable_names`.

    **Weighting.** J is the plain Jacobian: no 1/N or n_b/N factor, and sample weights
    and labels in the data are ignored. For a loss L = (1/N) Σ_i ℓ_i(z_i) (Keras' mean
    reduction), the generalized Gauss-Newton matrix split at the model's outputs is
    G = Jᵀ H_z J with H_z = blockdiag_i((1/N) ∇²_{z_i} ℓ_i), the Hessian of L in all the
    outputs. (Keras' cross-entropies of a softmax or sigmoid output read the logits
    behind it, where :class:`~spectra.operators.GGNOperator` splits; for that G use a
    model that returns the logits.) J Jᵀ is the empirical neural tangent kernel.

    **Products.** ``J @ v`` / :meth:`matvec` / :meth:`matmat` map parameter vectors to
    the outputs' directional derivatives; ``J.T`` (a :class:`TransposedJacobianOperator`,
    also :meth:`rmatvec` / :meth:`rmatmat`) maps output-space vectors u to Jᵀu =
    Σ_i J_iᵀ u_i. A block of k vectors is one pass over the data. Cost per batch and
    block: for J V one forward pass and k VJPs of the VJP u ↦ Jᵀu (the double-VJP trick:
    the arithmetic of k forward-mode passes of tangents; the VJP itself is only
    differentiated, never evaluated), for Jᵀ U one forward pass and k backward passes.
    Nothing is cached between products: each recomputes its batches' forward passes (a
    compiled ``tf.function`` per direction, shared by operators on the same model,
    variables, dtype and input shapes; the curvature operators' graph split is not used).
    The vectors of a block and one batch's (k, n_b, C) product are held at once.
    Measured on the digits MLP (85k parameters, 1797 examples, one batch; 2-core CPU
    under load, so only roughly): J v 1.5-1.6x the time of a compiled gradient, Jᵀu
    0.7-1.3x; per vector in blocks of 16, 0.5-0.8x for J and 0.75-1.0x for Jᵀ.

    **Snapshot.** The operator is J at the weights it was built with: the model's values
    are copied at construction and fed to the compiled functions, so training on or
    loading other weights changes nothing in it. The model is evaluated in inference
    mode (``training=False``: BatchNorm's moving statistics, Dropout off); training mode
    is refused, since its Jacobian would depend on batch statistics and random masks.
    Products run on the default device of this process (no ``tf.distribute`` strategy).

    Counters: ``num_products`` (vectors multiplied, either direction) and
    ``num_data_passes``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "build a JacobianOperator with JacobianOperator.from_keras(model, data, "
            "batch_size=..., dtype=...)."
        )

    @classmethod
    def from_keras(
        cls,
        model: Any,
        data: Any,
        *,
        variables: Sequence[Any] | None = None,
        batch_size: int | None = None,
        dtype: Any = None,
        training: bool = False,
    ) -> JacobianOperator:
        """The Jacobian of ``model``'s outputs on ``data`` at its current weights.

        Parameters
        ----------
        model:
            A built ``keras.Model`` with floating-point outputs, each with a leading
            example dimension.
        data:
            The inputs, as Keras' ``fit`` takes them: ``x`` (an array, a list or dict of
            arrays for several inputs), or a tuple ``(x,)``, ``(x, y)`` or ``(x, y,
            sample_weight)`` whose ``y`` and ``sample_weight`` are ignored; or a finite
            ``tf.data.Dataset`` of such batches, read in order (it must yield the same
            batches on every pass, which is checked). A tuple is never several inputs:
            pass those as a list or dict.
        variables:
            The parameters θ (default ``model.trainable_variables``); a subset gives the
            columns of J for those variables.
        batch_size:
            Split array data into batches of this many examples (default: one batch); not
            for a dataset, which is taken batched as it is. J does not depend on it.
        dtype:
            ``np.float32`` or ``np.float64`` (default: the variables' dtype). float64
            runs on a float64 clone of the model fed with the weights cast to float64.
        training:
            Must be False: the Jacobian of training-mode outputs (batch statistics,
            random Dropout masks) is not supported.

        Returns
        -------
        JacobianOperator
            Shape (N·C, n), in ``dtype``.

        Raises
        ------
        TypeError
            ``model`` is not a built Keras model, an output is not floating-point,
            ``training`` is not a bool, or the data cannot be read.
        ValueError
            ``training=True``, no data, an empty or infinite dataset, inputs that do not
            fit the model or hold NaN/Inf, non-finite weights, or an unsupported dtype.
        """
        keras_models.check_model(model)
        training = check_bool("training", training)
        if training:
            raise ValueError(
                "training=True is not supported by JacobianOperator: J is the Jacobian of "
                "the model's inference-mode outputs (BatchNorm moving statistics, Dropout "
                "off). Build it with training=False (the default)."
            )
        if data is None:
            raise ValueError(
                "data is required: the inputs x (arrays, or a tuple (x,), (x, y) or (x, y, "
                "sample_weight)), or a tf.data.Dataset of such batches."
            )
        chosen, positions, target = keras_models.resolve_variables_and_dtype(
            model, variables, dtype
        )
        batches = Batches(data, batch_size, cast_floats_to=target, purpose="The Jacobian operator")
        x_spec = _inputs_of(batches.element_spec)
        check_input_dtypes(model, x_spec)
        check_input_shapes(model, x_spec)
        batches.check_values(_check_finite_inputs)
        key = ("jacobian", id(model), target.name, tuple(positions), spec_key(x_spec))
        with graph_errors("tracing the model's outputs"):
            functions = _cached(
                key, (model,), lambda: _build_functions(model, positions, target, x_spec)
            )
        state = keras_models.snapshot_state(model, functions.run_model, [None])[0]
        operator = cls.__new__(cls)
        operator._setup(batches, chosen, functions, state, target)
        return operator

    def _setup(
        self,
        batches: Batches,
        variables: list[Any],
        functions: _Functions,
        state: list[tf.Tensor],
        dtype: tf.DType,
    ) -> None:
        parameter_indices = functions.parameter_indices
        self._batches = batches
        self._functions = functions
        self._state = state
        self.variables = variables
        #: The flat parameter vector's layout (the columns).
        self.layout = ParameterLayout(
            [state[i].shape for i in parameter_indices],
            [str(functions.state_variables[i].path) for i in parameter_indices],
            dtype.as_numpy_dtype,
        )
        self._output_names = list(functions.output_names)
        self._output_shapes = list(functions.output_shapes)
        self.num_outputs = sum(int(np.prod(s, dtype=np.int64)) for s in self._output_shapes)
        self.num_products = 0
        self.num_data_passes = 0
        n = self.layout.size
        rows = batches.num_examples * self.num_outputs
        LinearOperator.__init__(self, dtype=np.dtype(dtype.as_numpy_dtype), shape=(rows, n))

    # -- layouts --------------------------------------------------------------------
    # -- the data pass ----------------------------------------------------------------
    def _batches_in_order(self) -> Any:
        """``(index, x, n_b, first row)`` for each batch, in the data's order."""
        start = 0
        for index, (batch, _) in enumerate(self._batches):
            x = _inputs_of(batch)
            count = int(tf.nest.flatten(x)[0].shape[0])
            yield index, x, count, start
            start += count * self.num_outputs

    def _checked(self, value: tf.Tensor, index: int, what: str) -> np.ndarray:
        out = value.numpy()
        if not np.all(np.isfinite(out)):
            bad = int(out.size - np.count_nonzero(np.isfinite(out)))
            raise ValueError(
                f"{what} on {self._batches.describe(index)} is not finite ({bad} NaN/Inf "
                f"entries) although the weights, the inputs and the vector are: it overflows "
                f"{self.dtype}. Scale the vector down (products are linear) or build the "
                "operator with dtype=np.float64."
            )
        return out

    def outputs(self) -> np.ndarray:
        """The model's outputs z over the data, flat in the row order of J (length N·C)."""
        rows = []
        for index, x, _, _ in self._batches_in_order():
            with graph_errors(self._batches.describe(index)):
                value = self._functions.outputs(self._state, x)
            rows.append(self._checked(value, index, "the model's outputs").reshape(-1))
        self.num_data_passes += 1
        return np.concatenate(rows)

    # -- products ---------------------------------------------------------------------
    def _matmat(self, X: np.ndarray) -> np.ndarray:
        k = X.shape[1]
        if k == 0:
            return np.zeros((self.shape[0], 0), self.dtype)
        vectors = tf.constant(np.ascontiguousarray(np.asarray(X, dtype=self.dtype).T))
        out = np.empty((self.shape[0], k), self.dtype)
        for index, x, count, start in self._batches_in_order():
            with graph_errors(f"the Jacobian product on {self._batches.describe(index)}"):
                value = self._functions.jvp(self._state, x, vectors)
            block = self._checked(value, index, "the Jacobian product")  # (k, n_b, C)
            out[start : start + count * self.num_outputs] = block.reshape(k, -1).T
        self.num_products += k
        self.num_data_passes += 1
        return out

    def _rmatmat(self, U: np.ndarray) -> np.ndarray:
        k = U.shape[1]
        if k == 0:
            return np.zeros((self.shape[1], 0), self.dtype)
        U = np.asarray(U, dtype=self.dtype)
        total = np.zeros((k, self.shape[1]), np.float64)
        for index, x, count, start in self._batches_in_order():
            rows = U[start : start + count * self.num_outputs]
            cotangents = np.ascontiguousarray(rows.T).reshape(k, count, self.num_outputs)
            with graph_errors(
                f"the transposed Jacobian product on {self._batches.describe(index)}"
            ):
                value = self._functions.vjp(self._state, x, tf.constant(cotangents))
            total += self._checked(value, index, "the transposed Jacobian product")
        if not np.all(np.isfinite(total)):
            raise ValueError(
                "the transposed Jacobian product summed over the batches is not finite "
                "although every batch's is: it overflows. Scale the vector down."
            )
        self.num_products += k
        self.num_data_passes += 1
        return np.ascontiguousarray(total.T).astype(self.dtype, copy=False)


class TransposedJacobianOperator(TransposedJacobianCore):
    """Jᵀ, an n × (N·C) ``LinearOperator``: ``J.T`` of a :class:`JacobianOperator`
    (:class:`~spectra.operators.jacobian_core.TransposedJacobianCore`)."""

    _ENGINE_TAG = ""
    _JACOBIAN = JacobianOperator


JacobianOperator._TRANSPOSE = TransposedJacobianOperator
