"""Turning a Keras model, a loss and its data into ``loss_fn(batch) -> scalar``.

Private to :mod:`spectra.operator`. Conventions (see the operator's docstring):

* the model runs through ``Layer.stateless_call``: the variables' current values are
  read, and every state update (BatchNorm moving statistics in training mode, dropout
  seed counters) is discarded, so computing Hessians never changes the user's model;
* the batch loss is Keras' ``sum_over_batch_size`` reduction, Σ_i w_i l_i / n_b, plus the
  model's regularization losses when asked for;
* float64 (or float32 for a mixed-precision model) runs on a clone of the model in that
  dtype and a copy of the loss in that dtype, leaving the user's model as it is.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

LossCallable = Callable[..., Any]


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
    model: keras.Model, variables: Any, dtype: Any
) -> tuple[list[Any], list[int], tf.DType]:
    """The chosen variables, their positions in ``model.weights``, and the compute dtype.

    ``variables`` defaults to the trainable variables (a subset gives a Hessian block);
    positions identify the same weights in a clone of the model. ``dtype`` defaults to
    the variables' dtype and must be float32 or float64.
    """
    all_weights = list(model.weights)
    chosen = list(model.trainable_variables) if variables is None else list(variables)
    if not chosen:
        raise ValueError(f"model {model.name!r} has no trainable variables.")
    positions = []
    for v in chosen:
        matches = [i for i, w in enumerate(all_weights) if w is v]
        if not matches:
            raise ValueError(
                f"variable {getattr(v, 'path', v)!r} is not a weight of model {model.name!r}."
            )
        positions.append(matches[0])
    target = tf.as_dtype(chosen[0].dtype if dtype is None else dtype)
    if not target.is_floating or target.size < 4:
        raise TypeError(
            f"dtype must be float32 or float64; got {target.name}. Hessian products in "
            "half precision lose most of their digits."
        )
    return chosen, positions, target


def model_in_dtype(model: keras.Model, dtype: tf.DType) -> keras.Model:
    """``model`` itself if it computes in ``dtype``, else a clone that does (float64
    products of a float32 model, float32 products of a mixed-precision model)."""
    return model if computes_in(model, dtype) else clone_in_dtype(model, dtype)


def model_strategy(model: keras.Model) -> tf.distribute.Strategy | None:
    """The ``tf.distribute`` strategy in scope when ``model`` was built, or the current one.

    None when neither is a real (multi-replica) strategy.
    """
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    if strategy is None or strategy.num_replicas_in_sync == 1:
        return None
    return strategy


def _loss_from_name(name: str) -> Any:
    try:
        found = keras.losses.get(name)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"unknown Keras loss {name!r}. Use a name such as 'sparse_categorical_crossentropy', "
            "'categorical_crossentropy', 'binary_crossentropy' or 'mse', a keras.losses.Loss "
            "object, or a callable (y_true, y_pred) -> scalar."
        ) from err
    if found is None:
        raise ValueError(f"unknown Keras loss {name!r}.")
    return found


def resolve_loss(loss: Any, dtype: tf.DType) -> tuple[LossCallable, bool]:
    """Return ``(loss_callable, takes_sample_weight)`` computing the mean loss in ``dtype``.

    ``loss`` is a Keras loss name, a ``keras.losses.Loss`` object, a Keras per-example loss
    function, or a callable ``(y_true, y_pred) -> scalar``. Keras loss objects cast
    predictions to their own dtype (float32 by default); they are rebuilt with ``dtype``
    so that float64 products are not rounded to float32.
    """
    from keras.src.losses.losses import LossFunctionWrapper

    if isinstance(loss, str):
        loss = _loss_from_name(loss)
    if isinstance(loss, keras.losses.Loss):
        config = loss.get_config()
        try:
            rebuilt = type(loss).from_config({**config, "dtype": dtype.name})
        except (TypeError, ValueError):
            rebuilt = loss
        if rebuilt.dtype != dtype.name:
            if dtype != tf.float32:
                raise TypeError(
                    f"the loss object {type(loss).__name__} cannot be rebuilt to compute in "
                    f"{dtype.name}; pass its name, or a callable (y_true, y_pred) -> scalar."
                )
        return rebuilt, True
    if callable(loss):
        module = getattr(loss, "__module__", "") or ""
        if module.startswith("keras"):
            # A Keras per-example loss function (e.g. keras.losses.mean_squared_error).
            return LossFunctionWrapper(loss, dtype=dtype.name), True
        return loss, False
    raise TypeError(
        f"loss must be a Keras loss name, a keras.losses.Loss, or a callable "
        f"(y_true, y_pred) -> scalar; got {type(loss).__name__}."
    )


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


def keras_loss_fn(
    model: keras.Model,
    loss: Any,
    *,
    dtype: tf.DType,
    training: bool,
    include_regularization: bool,
) -> Callable[[Any], tf.Tensor]:
    """``loss_fn(batch)``: the mean loss of ``model`` on ``(x, y[, sample_weight])``."""
    loss_callable, takes_sample_weight = resolve_loss(loss, dtype)

    def loss_fn(batch: Any) -> tf.Tensor:
        x, y, sample_weight = unpack_batch(batch)
        y_pred, _, extra_losses = model.stateless_call(
            model.trainable_variables,
            model.non_trainable_variables,
            x,
            training=training,
            return_losses=True,
        )
        if isinstance(y_pred, (list, tuple, dict)):
            raise ValueError(
                "models with several outputs need a loss_fn: use "
                "HessianOperator(loss_fn, variables, data) with your own combination of losses."
            )
        if y_pred.dtype != dtype:
            y_pred = tf.cast(y_pred, dtype)
        if takes_sample_weight:
            value = loss_callable(y, y_pred, sample_weight=sample_weight)
            # Keras loss objects divide by the number of replicas of the strategy in scope
            # (ready for summing gradients across replicas); this loss is the batch mean.
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            if replicas > 1:
                value = value * tf.cast(replicas, value.dtype)
        else:
            if sample_weight is not None:
                raise ValueError(
                    "sample weights need a Keras loss (a name or a keras.losses.Loss): a "
                    "plain callable (y_true, y_pred) -> scalar cannot weight examples."
                )
            value = loss_callable(y, y_pred)
        value = tf.convert_to_tensor(value)
        if value.shape.rank != 0:
            raise ValueError(
                f"the loss returned shape {value.shape}, not a scalar. A callable loss must "
                "return the mean over the batch; for per-example losses pass a Keras loss."
            )
        value = tf.cast(value, dtype)
        if include_regularization and extra_losses:
            value = value + tf.add_n([tf.cast(term, dtype) for term in extra_losses])
        return value

    return loss_fn


_FLOAT_POLICIES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "mixed_float16", "mixed_bfloat16"}
)


def _with_float_dtypes(config: Any, dtype: str) -> Any:
    """Copy of a serialized Keras config with every floating dtype (policy) set to ``dtype``."""
    if isinstance(config, list):
        return [_with_float_dtypes(item, dtype) for item in config]
    if not isinstance(config, dict):
        return config
    out = {}
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
            out[key] = _with_float_dtypes(value, dtype)
    return out


def computes_in(model: keras.Model, dtype: tf.DType) -> bool:
    """True when every layer of ``model`` keeps and computes its floats in ``dtype``."""
    for layer in model._flatten_layers(include_self=False, recursive=True):
        policy = getattr(layer, "dtype_policy", None)
        if policy is None or isinstance(layer, (keras.Model, keras.layers.InputLayer)):
            continue  # containers and inputs compute nothing themselves
        for name in (policy.compute_dtype, policy.variable_dtype):
            if name is not None and tf.as_dtype(name).is_floating and name != dtype.name:
                return False
    return True


def clone_in_dtype(model: keras.Model, dtype: tf.DType) -> keras.Model:
    """A copy of ``model`` whose layers keep and compute floats in ``dtype``.

    Rebuilt from the model's serialized config with every floating dtype policy replaced
    (nested models included; a mixed policy such as ``mixed_float16`` becomes plain
    ``dtype``), then given the model's current weights. The user's model is not touched.
    """
    # Rebuilding layers draws default initializer seeds from Python's global RNG; keep
    # the caller's random streams (e.g. a training run's) where they were.
    python_state, numpy_state = random.getstate(), np.random.get_state()  # noqa: NPY002
    try:
        config = _with_float_dtypes(keras.saving.serialize_keras_object(model), dtype.name)
        clone = keras.saving.deserialize_keras_object(config)
    except (TypeError, ValueError, NotImplementedError, KeyError) as err:
        raise TypeError(
            f"computing the Hessian in {dtype.name} needs a copy of the model in that dtype, "
            "rebuilt from its config (Sequential, functional, or a registered subclass with "
            f"get_config); rebuilding {model.name!r} failed: {err}. Build the model in "
            f"{dtype.name} yourself and pass it with dtype=None."
        ) from err
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)  # noqa: NPY002
    if not clone.built:
        build_config = model.get_build_config()
        if build_config:
            clone.build_from_config(build_config)
    if len(clone.weights) != len(model.weights):
        raise TypeError(
            f"the {dtype.name} copy of {model.name!r} has {len(clone.weights)} weights, the "
            f"model {len(model.weights)}; build the model in {dtype.name} yourself instead."
        )
    copy_weights(model, clone)
    return clone


def copy_weights(source: keras.Model, target: keras.Model) -> None:
    """Assign the current weights of ``source`` to ``target`` (casting dtypes)."""
    for src, dst in zip(source.weights, target.weights):
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"weight {src.path} has shape {tuple(src.shape)} but its clone {tuple(dst.shape)}."
            )
        dst.assign(tf.cast(src.value, dst.dtype))
