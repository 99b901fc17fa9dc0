"""How every engine calls a Keras model: checks, chosen weights, compute dtype, stateless calls.

Backend-neutral (Keras and NumPy only), shared by the TensorFlow engine
(:mod:`spectra.operators.keras_models`) and the JAX engine
(:mod:`spectra.operators.jax.models`):

* :func:`check_model` — a built ``keras.Model``, or a one-line refusal;
* :func:`resolve_variables_and_dtype` — the chosen weights (default: the trainable ones),
  their positions in ``model.weights`` (which identify them in a copy of the model) and
  the compute dtype: the variables' own, float32 for a half-precision model;
* :func:`model_in_dtype` — the model itself when it computes in that dtype, else a copy
  rebuilt from its config with every floating dtype policy replaced (float64 products of
  a float32 model, float32 products of a mixed-precision one);
* :func:`stateless_forward` — ``model(x, training=...)`` inside a ``keras.StatelessScope``
  that maps every variable to a given value, so that the model's variables are never read
  and every state update is discarded; the model's losses (regularizers, ``add_loss``)
  are collected from the same values;
* :func:`unpack_batch`, :func:`state_keys` and the refusal of layers whose training-mode
  gradient is not the derivative of what they compute
  (:func:`refuse_surrogate_gradients`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from spectra import _keras_compat
from spectra._validation import check_float_dtype
from spectra.operators.losses import dtype_name

__all__ = [
    "ComputeCopyError",
    "check_model",
    "clone_in_dtype",
    "computes_in",
    "copy_weights",
    "describe_variable",
    "keras_call_cause",
    "model_in_dtype",
    "non_finite_error",
    "refuse_surrogate_gradients",
    "resolve_variables_and_dtype",
    "state_keys",
    "stateless_forward",
    "unpack_batch",
]

#: Floating dtypes too coarse for curvature: a model in them gets float32 products.
HALF_DTYPES = ("float16", "bfloat16")


def check_model(model: Any) -> None:
    """Raise a clear error for objects that are not built Keras models."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"model must be a keras.Model (Keras 3); got {type(model).__name__}. For other "
            "callables use HessianOperator(loss_fn, variables, data)."
        )
    if not model.built or not model.weights:
        raise ValueError(
            f"model {model.name!r} is not built: it has no weights yet. Build it first, "
            "e.g. model.build(input_shape) or call it once on a batch of inputs."
        )


def resolve_variables_and_dtype(
    model: Any,
    variables: Any,
    dtype: Any,
    backing: Callable[[Any], Any] | None = None,
) -> tuple[list[Any], list[int], np.dtype]:
    """The chosen variables, their positions in ``model.weights``, and the compute dtype.

    ``variables`` defaults to the trainable variables (a subset gives a Hessian block);
    positions identify the same weights in a clone of the model. ``dtype`` defaults to
    the variables' dtype, float32 for float16 or bfloat16 variables (half precision is
    too coarse for curvature: products on a float32 copy of the model), and must be
    float32 or float64. A variable listed twice is an error (it would count its block of
    the Hessian twice). ``backing(weight)``: the engine's variable behind a Keras weight
    (TensorFlow's ``tf.Variable``), which names the same weight; None where there is none.
    """
    all_weights = list(model.weights)
    if variables is None:
        chosen = list(model.trainable_variables)
        if not chosen:
            raise ValueError(f"model {model.name!r} has no trainable variables.")
    else:
        if isinstance(variables, (str, bytes)) or not hasattr(variables, "__iter__"):
            raise TypeError(
                "variables must be a list of the model's weights (e.g. "
                f"model.layers[0].trainable_variables); got {type(variables).__name__}."
            )
        chosen = list(variables)
        if not chosen:
            raise ValueError(
                "variables is empty: pass None (all trainable variables) or a list of the "
                "model's weights."
            )
    positions: list[int] = []
    for i, v in enumerate(chosen):
        matches = [
            j
            for j, w in enumerate(all_weights)
            if w is v or (backing is not None and backing(w) is v)
        ]
        if not matches:
            raise ValueError(
                f"variables[{i}] ({describe_variable(v)}) is not a weight of model "
                f"{model.name!r}. Pass weights of this model, e.g. from "
                "model.trainable_variables or model.layers[k].trainable_variables."
            )
        if matches[0] in positions:
            first = positions.index(matches[0])
            raise ValueError(
                f"variables[{i}] ({describe_variable(v)}) is listed twice: it is the model "
                f"weight {all_weights[matches[0]].path!r}, already given as "
                f"variables[{first}] (a Keras weight and its tf.Variable, .value, are the "
                "same weight); list each weight once."
            )
        positions.append(matches[0])
    chosen = [all_weights[j] for j in positions]
    if dtype is None:
        dtype = chosen[0].dtype
        if dtype_name(dtype) in HALF_DTYPES:
            # Half-precision weights (a float16 or bfloat16 model): products in float32 on
            # a float32 copy, as a mixed-precision model gets them.
            dtype = "float32"
    target = check_float_dtype("dtype", dtype, allow_none=False)
    assert target is not None
    return chosen, positions, target


def describe_variable(variable: Any) -> str:
    """A variable as errors name it: its name, type and shape, never its values."""
    name = getattr(variable, "path", None) or getattr(variable, "name", None)
    shape = getattr(variable, "shape", None)
    shape_text = f", shape {tuple(shape)}" if shape is not None else ""
    named = f"{name!r}, " if name else ""
    return f"{named}a {type(variable).__name__}{shape_text}"


def non_finite_error(
    name: str, bad: int, nans: int, total: int, *, inputs: Any = None, where: str = ""
) -> ValueError:
    """The refusal of ``bad`` NaN/Inf entries (``nans`` of them NaN) out of ``total`` in a
    floating-point value named ``name``.

    ``name`` is a weight's path by default: the fix is finite weights. With ``inputs`` (the
    batch's x) it is something computed from finite weights (a batch loss): the message
    blames the data and names the first NaN/Inf entry of x, or its entry of largest
    magnitude (a finite input can overflow inside the model); ``where`` (e.g. "batch 3")
    says which batch.
    """
    counts = f"{bad} non-finite entries ({nans} NaN, {bad - nans} Inf) out of {total}"
    if inputs is not None:
        from spectra.operators.keras_data import describe_inputs

        look = describe_inputs(inputs)
        at = f" of {where}" if where else ""
        return ValueError(
            f"{name}{at} has {counts} although the weights are finite: the data are the "
            f"cause{f' ({look})' if look else ''}. Remove or rescale those examples."
        )
    return ValueError(
        f"variable {name!r} has {counts}: the loss and its Hessian are undefined there. Load "
        "finite weights (e.g. an earlier checkpoint) before computing curvature."
    )


# -- compute-dtype clones ---------------------------------------------------------------
class ComputeCopyError(TypeError):
    """A model that cannot be copied into the compute dtype (float64 products, or float32
    products of a half-precision or mixed-precision model): the message says to build the
    model in that dtype. A ``TypeError``; the command line reports it in one line."""


_FLOAT_POLICIES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "mixed_float16", "mixed_bfloat16"}
)


def _is_float_name(name: str) -> bool:
    return name.startswith(("float", "bfloat"))


def with_float_dtypes(config: Any, dtype: str) -> Any:
    """Copy of a serialized Keras config with every floating dtype (policy) set to ``dtype``."""
    if isinstance(config, list):
        return [with_float_dtypes(item, dtype) for item in config]
    if not isinstance(config, dict):
        return config
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key == "dtype" and isinstance(value, str) and value in _FLOAT_POLICIES:
            out[key] = dtype
        elif (
            key == "dtype"
            and isinstance(value, dict)
            and value.get("config", {}).get("name") in _FLOAT_POLICIES
        ):
            out[key] = {**value, "class_name": "DTypePolicy", "config": {"name": dtype}}
        else:
            out[key] = with_float_dtypes(value, dtype)
    return out


def computes_in(model: Any, dtype: Any) -> bool:
    """True when every layer of ``model`` keeps and computes its floats in ``dtype``."""
    target = dtype_name(dtype)
    for layer in _keras_compat.flatten_layers(model):
        policy = getattr(layer, "dtype_policy", None)
        if policy is None or isinstance(layer, (keras.Model, keras.layers.InputLayer)):
            continue  # containers and inputs compute nothing themselves
        for name in (policy.compute_dtype, policy.variable_dtype):
            if name is not None and _is_float_name(dtype_name(name)) and name != target:
                return False
    return True


def model_in_dtype(model: Any, dtype: Any) -> Any:
    """``model`` itself if it computes in ``dtype``, else a clone that does (float64
    products of a float32 model, float32 products of a mixed-precision model)."""
    return model if computes_in(model, dtype) else clone_in_dtype(model, dtype)


def clone_in_dtype(model: Any, dtype: Any) -> Any:
    """A copy of ``model`` whose layers keep and compute floats in ``dtype``.

    Rebuilt from the model's serialized config with every floating dtype policy replaced
    (nested models included; a mixed policy such as ``mixed_float16`` becomes plain
    ``dtype``), then given the model's current weights. Operators never read them (they
    feed the clone their snapshot values); the user's model is not touched.
    """
    name = dtype_name(dtype)
    # Rebuilding layers draws default initializer seeds from Python's global RNG; keep
    # the caller's random streams (e.g. a training run's) where they were.
    # A subclassed model creates its layers in ``__init__`` without the dtype its config
    # says: the global dtype policy, set to ``dtype`` while the copy is rebuilt and built,
    # is what they then take.
    python_state, numpy_state = random.getstate(), np.random.get_state()  # noqa: NPY002
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        config = with_float_dtypes(keras.saving.serialize_keras_object(model), name)
        clone = keras.saving.deserialize_keras_object(config)
        if not clone.built:
            build_config = model.get_build_config()
            if build_config:
                clone.build_from_config(build_config)
    except (TypeError, ValueError, NotImplementedError, KeyError) as err:
        raise ComputeCopyError(
            f"computing the Hessian in {name} needs a copy of the model in that dtype, "
            "rebuilt from its config (Sequential, functional, or a registered subclass with "
            f"get_config); rebuilding {model.name!r} failed: {err}. Build the model in "
            f"{name} yourself and pass it with dtype=None."
        ) from err
    finally:
        keras.config.set_dtype_policy(policy)
        random.setstate(python_state)
        np.random.set_state(numpy_state)  # noqa: NPY002
    if len(clone.weights) != len(model.weights):
        raise ComputeCopyError(
            f"the {name} copy of {model.name!r} has {len(clone.weights)} weights, the "
            f"model {len(model.weights)}; build the model in {name} yourself instead."
        )
    other = sorted({str(w.dtype) for w in clone.weights if "float" in str(w.dtype)} - {name})
    if other:
        raise ComputeCopyError(
            f"the {name} copy of {model.name!r} keeps weights in {', '.join(other)} (a "
            f"layer that fixes its own dtype); build the model in {name} yourself and "
            "pass it with dtype=None."
        )
    copy_weights(model, clone)
    return clone


def copy_weights(source: Any, target: Any) -> None:
    """Assign the current weights of ``source`` to ``target`` (casting dtypes)."""
    for src, dst in zip(source.weights, target.weights):
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"weight {src.path} has shape {tuple(src.shape)} but its clone {tuple(dst.shape)}."
            )
        dst.assign(keras.ops.cast(src.value, dst.dtype))


# -- calling the model -------------------------------------------------------------------
def unpack_batch(batch: Any) -> tuple[Any, Any, Any]:
    """Split a batch into ``(x, y, sample_weight)``."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        x, y = batch[0], batch[1]
        sample_weight = batch[2] if len(batch) == 3 else None
        return x, y, sample_weight
    raise ValueError(
        "data for a Keras model must be (x, y) or (x, y, sample_weight), as arrays or as "
        "the elements of a tf.data.Dataset; got a "
        f"{type(batch).__name__} with {len(batch) if hasattr(batch, '__len__') else '?'} parts."
    )


def state_keys(model: Any) -> tuple[list[Any], list[Any]]:
    """The model's variables in ``stateless_call`` order: trainable, then the others.

    Read through ``model.variables`` so that a stand-in delegating attribute access to a
    model (whose ``trainable_variables`` hold values) gives the model's own variables.
    """
    variables = list(model.variables)
    if not model.trainable:
        return [], variables
    return [v for v in variables if v.trainable], [v for v in variables if not v.trainable]


_BOLD = re.compile(r"\x1b\[1m((?:(?!\x1b\[1m).)*?)\x1b\[0m", re.DOTALL)


def keras_call_cause(message: str) -> str | None:
    """The innermost cause of Keras' multi-line "Exception encountered when calling
    X.call()" error (the bold part of the deepest layer), on one line; None otherwise."""
    if "Exception encountered when calling" not in message:
        return None
    found = _BOLD.findall(message)
    if not found:
        return None
    cause = " ".join(found[0].split())
    return cause if cause.endswith(".") else cause + "."


def stateless_forward(
    model: Any,
    keys: Sequence[Any],
    values: Sequence[Any],
    x: Any,
    *,
    training: bool,
) -> tuple[Any, list[Any]]:
    """``model(x, training=...)`` with each variable in ``keys`` replaced by its value.

    Returns the outputs and the model's losses (regularizers, ``add_loss``) computed from
    the values. Every state update is discarded. A Keras error from inside a layer's
    call is re-raised (same class) with its innermost cause on one line.
    """
    if training:
        refuse_surrogate_gradients(model)
    mapping = list(zip(keys, values))
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
        # ``model.__call__`` rather than ``model(...)``: a stand-in that forwards attribute
        # access to a model is not callable itself.
        try:
            outputs = model.__call__(x, training=training)
        except (ValueError, TypeError) as err:
            cause = keras_call_cause(str(err))
            if cause is None:
                raise
            raise type(err)(
                f"calling model {model.name!r} on a batch of x failed: {cause} Check that x "
                "fits the model's inputs (number of features, shape, dtype)."
            ) from err
        extra = list(model.losses)
    return outputs, extra


def refuse_surrogate_gradients(model: Any) -> None:
    """Refuse layers whose training-mode gradient is not the derivative of what they
    compute: they back-propagate through ``stop_gradient`` on quantities that depend on
    the parameters, so no curvature of the loss is consistent with their gradient.

    * ``BatchNormalization(renorm=True)``: the corrections r = σ_B/σ and d = (μ_B - μ)/σ
      are held constant (Ioffe 2017, "Batch Renormalization");
    * ``SpectralNormalization``: the power-iteration vectors u, v of σ(W) = uᵀWv are held
      constant after one step from their stored values (Miyato et al. 2018).
    """
    for layer in [model, *_keras_compat.flatten_layers(model)]:
        if isinstance(layer, keras.layers.BatchNormalization) and getattr(layer, "renorm", False):
            what = "BatchNormalization with renorm=True holds its corrections r and d constant"
            fix = "or build the layer with renorm=False"
        elif isinstance(layer, keras.layers.SpectralNormalization):
            what = "SpectralNormalization holds its power-iteration vectors constant"
            fix = "(the stored normalized kernel)"
        else:
            continue
        raise ValueError(
            f"layer {layer.name!r}: in training mode {what} (stop_gradient), so its gradient "
            "is not the derivative of the loss and no curvature matches it; use "
            f"training=False {fix}."
        )
