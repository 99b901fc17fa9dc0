"""The Jacobian of a Keras model's outputs over a dataset, and its transpose, on JAX.

The matrices of :class:`spectra.operators.JacobianOperator` (its docstring states the
layouts): with θ the flat parameter vector and z_i ∈ ℝ^C the outputs of example i (every
output of the model, each flattened row-major, concatenated in the model's output order),

    J = ∂(z_1, …, z_N)/∂θ,     row i·C + c = ∂z_{i,c}/∂θ

(example-major; no 1/N or n_b/N factor), an (N·C) × n ``LinearOperator``, and its
transpose Jᵀ (:class:`TransposedJacobianOperator`, ``J.T``). Per batch and block of k
vectors, one compiled call (once per batch shape): for J V, ``jax.linearize`` of the
outputs (one forward pass) and ``jax.vmap`` of the linearized function over the k
vectors (k forward passes of tangents); for Jᵀ U, ``jax.vjp`` of the outputs (one
forward pass) and ``jax.vmap`` of the VJP over the k cotangents (k backward passes).
Nothing is cached between products: each recomputes its batches' forward passes. The
vectors of a block and one batch's (k, n_b, C) product are held at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from scipy.sparse.linalg import LinearOperator

from spectra import _jax_compat
from spectra._validation import check_bool
from spectra.operators import keras_calls
from spectra.operators.jacobian_core import JacobianCore, TransposedJacobianCore
from spectra.operators.jax.base import scope, snapshot_values
from spectra.operators.jax.data import Batches, map_structure
from spectra.operators.jax.engine import Compiled
from spectra.operators.keras_data import check_finite_inputs, check_input_dtypes, check_input_shapes
from spectra.operators.layout import ParameterLayout
from spectra.operators.losses import dtype_name, output_entries

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


class _Functions:
    """The compiled functions of one model, parameter choice and dtype (one compilation
    per input shape each)."""

    def __init__(self, model: Any, positions: Sequence[int], dtype: np.dtype) -> None:
        float64 = dtype == np.float64
        with scope(dtype), jax_exact(float64):
            self.run_model = keras_calls.model_in_dtype(model, dtype)
        trainable, others = keras_calls.state_keys(self.run_model)
        self.state_variables = [*trainable, *others]
        weights = list(self.run_model.weights)
        self.parameter_indices = [
            next(i for i, v in enumerate(self.state_variables) if v is weights[p])
            for p in positions
        ]
        self.dtype = dtype
        self.output_names: list[str] = []
        self.output_shapes: list[tuple[int, ...]] = []
        self.outputs = Compiled(self._outputs, "outputs", float64=float64)
        self.jvp = Compiled(self._jvp, "jvp", float64=float64)
        self.vjp = Compiled(self._vjp, "vjp", float64=float64)

    def flat_outputs(self, params: Sequence[Any], state: Sequence[Any], x: Any) -> Any:
        """The outputs of the batch as an (n_b, C) matrix (model output order)."""
        values = list(state)
        for index, value in zip(self.parameter_indices, params):
            values[index] = value
        outputs, _ = keras_calls.stateless_forward(
            self.run_model, self.state_variables, values, x, training=False
        )
        count = jax.tree.leaves(x)[0].shape[0]
        parts, names, shapes = [], [], []
        for name, output in output_entries(self.run_model, outputs):
            output = jnp.asarray(output)
            if not jnp.issubdtype(output.dtype, jnp.floating):
                raise TypeError(
                    f"model output {name!r} has dtype {dtype_name(output.dtype)}: integer (or "
                    "boolean) outputs have no Jacobian. Return floating-point outputs (e.g. "
                    "the logits) from the model."
                )
            if output.ndim == 0:
                raise ValueError(
                    f"model output {name!r} is a scalar: the Jacobian needs outputs with a "
                    "leading example dimension."
                )
            if output.shape[0] != count:
                raise ValueError(
                    f"model output {name!r} does not have one row per example of x: shape "
                    f"{tuple(output.shape)} for {count} examples."
                )
            parts.append(output.astype(self.dtype).reshape(count, -1))
            names.append(str(name))
            shapes.append(tuple(int(d) for d in output.shape[1:]))
        self.output_names, self.output_shapes = names, shapes
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)

    def _params(self, state: Sequence[Any]) -> list[Any]:
        return [state[i] for i in self.parameter_indices]

    def _outputs(self, state: Any, x: Any) -> Any:
        return self.flat_outputs(self._params(state), state, x)

    def _jvp(self, state: Any, x: Any, vectors: Any) -> Any:
        _, linearized = jax.linearize(lambda p: self.flat_outputs(p, state, x), self._params(state))
        return jax.vmap(lambda v: linearized(list(v)))(list(vectors))

    def _vjp(self, state: Any, x: Any, cotangents: Any) -> Any:
        z, pullback = jax.vjp(lambda p: self.flat_outputs(p, state, x), self._params(state))
        return jax.vmap(lambda u: pullback(u.reshape(z.shape))[0])(cotangents)


def jax_exact(float64: bool) -> contextlib.AbstractContextManager[Any]:
    """:func:`spectra._jax_compat.exact_float64` for float64, else nothing."""
    return _jax_compat.exact_float64() if float64 else contextlib.nullcontext()


_functions: dict[tuple[Any, ...], tuple[Any, _Functions]] = {}


def _cached(key: tuple[Any, ...], model: Any, build: Any) -> _Functions:
    entry = _functions.get(key)
    if entry is not None and entry[0] is model:
        return entry[1]
    functions = build()
    if len(_functions) >= 8:
        _functions.pop(next(iter(_functions)))
    _functions[key] = (model, functions)
    return functions


def _check_finite_inputs(batch: Any, where: str | None) -> None:
    """Refuse NaN or Inf in the floating-point inputs x of a batch."""
    check_finite_inputs(_inputs_of(batch), where=where)


class JacobianOperator(JacobianCore):
    """J = ∂z/∂θ, the Jacobian of a Keras model's outputs over a dataset on JAX, an
    (N·C) × n ``LinearOperator``.

    Built with :meth:`from_keras`; rows, columns, weighting, snapshot and counters
    (``num_products``, ``num_data_passes``) as for :class:`spectra.operators.JacobianOperator`
    (whose docstring states them), products as the module docstring says.
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

        ``data``: the inputs as Keras' ``fit`` takes them — ``x`` (an array, a list or
        dict of arrays), or ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` whose ``y``
        and ``sample_weight`` are ignored — or a ``keras.utils.PyDataset`` or list of such
        batches. ``variables`` (default ``model.trainable_variables``) give the columns,
        ``batch_size`` splits arrays, ``dtype`` is float32 or float64 (default: the
        variables'). ``training`` must be False (``ValueError``): J is the Jacobian of the
        inference-mode outputs. The model's values are copied now (a snapshot).
        """
        keras_calls.check_model(model)
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
                "sample_weight)), or a keras.utils.PyDataset of such batches."
            )
        chosen, positions, target = keras_calls.resolve_variables_and_dtype(model, variables, dtype)
        batches = Batches(data, batch_size, cast_floats_to=target, purpose="The Jacobian operator")
        x_spec = _inputs_of(batches.element_spec)
        check_input_dtypes(model, x_spec)
        check_input_shapes(model, x_spec)
        batches.check_values(_check_finite_inputs)
        key = ("jacobian", id(model), target.name, tuple(positions))
        functions = _cached(key, model, lambda: _Functions(model, positions, target))
        with scope(target), jax_exact(target == np.float64):
            state = snapshot_values(model, functions.run_model, target)
            example = map_structure(
                lambda s: None if s is None else jax.ShapeDtypeStruct((1, *s.shape[1:]), s.dtype),
                x_spec,
            )
            jax.eval_shape(functions._outputs, state, example)  # names and shapes of outputs
        operator = cls.__new__(cls)
        operator._setup(batches, list(chosen), functions, state, target)
        return operator

    def _setup(
        self,
        batches: Batches,
        variables: list[Any],
        functions: _Functions,
        state: list[Any],
        dtype: np.dtype,
    ) -> None:
        self._batches = batches
        self._functions = functions
        self._state = state
        self._output_names = list(functions.output_names)
        self._output_shapes = list(functions.output_shapes)
        self.variables = variables
        indices = functions.parameter_indices
        #: The flat parameter vector's layout (the columns).
        self.layout = ParameterLayout(
            [tuple(state[i].shape) for i in indices], [str(v.path) for v in variables], dtype
        )
        self.num_outputs = sum(int(np.prod(s, dtype=np.int64)) for s in self._output_shapes)
        self.num_products = 0
        self.num_data_passes = 0
        rows = batches.num_examples * self.num_outputs
        LinearOperator.__init__(self, dtype=np.dtype(dtype), shape=(rows, self.layout.size))

    def _scope(self) -> contextlib.AbstractContextManager[Any]:
        return scope(self.dtype)

    # -- layouts --------------------------------------------------------------------
    @property
    def num_compiles(self) -> int:
        """Compilations of the operator's functions (one per function and batch shape)."""
        f = self._functions
        return f.outputs.num_compiles + f.jvp.num_compiles + f.vjp.num_compiles

    # -- the data pass ----------------------------------------------------------------
    def _batches_in_order(self) -> Any:
        """``(index, x, n_b, first row)`` for each batch, in the data's order."""
        start = 0
        for index, batch, count in self._batches:
            yield index, _inputs_of(batch), count, start
            start += count * self.num_outputs

    def _checked(self, value: Any, index: int, what: str) -> np.ndarray:
        out = np.asarray(value)
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
        with self._scope():
            for index, x, _, _ in self._batches_in_order():
                value = self._functions.outputs(self._state, x)
                rows.append(self._checked(value, index, "the model's outputs").reshape(-1))
        self.num_data_passes += 1
        return np.concatenate(rows)

    # -- products ---------------------------------------------------------------------
    def _matmat(self, X: np.ndarray) -> np.ndarray:
        k = X.shape[1]
        if k == 0:
            return np.zeros((self.shape[0], 0), self.dtype)
        vectors = self.layout.unflatten_block(np.asarray(X, dtype=self.dtype))
        out = np.empty((self.shape[0], k), self.dtype)
        with self._scope():
            for index, x, count, start in self._batches_in_order():
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
        total = np.zeros((self.shape[1], k), np.float64)
        with self._scope():
            for index, x, count, start in self._batches_in_order():
                rows = U[start : start + count * self.num_outputs]
                cotangents = np.ascontiguousarray(rows.T).reshape(k, count, self.num_outputs)
                value = self._functions.vjp(self._state, x, cotangents)
                parts = [self._checked(v, index, "the transposed Jacobian product") for v in value]
                total += self.layout.flatten_block(parts)
        if not np.all(np.isfinite(total)):
            raise ValueError(
                "the transposed Jacobian product summed over the batches is not finite "
                "although every batch's is: it overflows. Scale the vector down."
            )
        self.num_products += k
        self.num_data_passes += 1
        return total.astype(self.dtype, copy=False)


class TransposedJacobianOperator(TransposedJacobianCore):
    """Jᵀ of a :class:`JacobianOperator` on JAX
    (:class:`~spectra.operators.jacobian_core.TransposedJacobianCore`)."""

    _ENGINE_TAG = " (JAX)"
    _JACOBIAN = JacobianOperator


JacobianOperator._TRANSPOSE = TransposedJacobianOperator
