"""A Keras model, its loss and its data as a differentiable program of parameter values.

Private to :mod:`spectra.operators`. Conventions (see
:meth:`~spectra.operators.base.CurvatureOperator.from_keras`):

* the model is called as Keras calls it, ``model(x, training=...)`` (``training`` reaches
  only the ``call`` methods that accept it), inside a ``keras.StatelessScope`` that maps
  every model variable to a *value* given as an input of the traced graph. The model's
  variables are never read and every state update (BatchNorm moving statistics in
  training mode, seed generator counters) is discarded: an operator computes with the
  values it snapshotted when it was built, and never changes the user's model;
* the batch loss L_b is, per output, the loss object's reduction made a share of the
  dataset loss (:func:`reduction_of`): a mean-type reduction gives Σ_i w_i l_i / n_b,
  ``"sum"`` gives (N/n_b) Σ_i w_i l_i and ``"none"`` the mean of the unreduced values,
  so that Σ_b (n_b/N) L_b is the mean (or for ``"sum"`` the sum) over the dataset
  whatever the batching; weighted by ``loss_weights`` and summed over the outputs as
  ``compile`` does, plus the model's ``losses`` (weight and activity regularizers,
  ``add_loss`` terms) when asked for;
* float64 (or float32 for a mixed-precision model) runs on a clone of the model in that
  dtype, fed with the user's values cast to it, and a copy of the loss in that dtype.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import keras
import numpy as np
import tensorflow as tf

from spectra import _tf_compat
from spectra._validation import check_float_dtype, loss_name

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
    the variables' dtype, float32 for float16 or bfloat16 variables (half precision is
    too coarse for curvature: products on a float32 copy of the model), and must be
    float32 or float64. A variable listed twice is an error (it would count its block of
    the Hessian twice).
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
        # A Keras weight given as its tf.Variable (``kernel.value``) is that weight.
        matches = [j for j, w in enumerate(all_weights) if w is v or _backing(w) is v]
        if not matches:
            raise ValueError(
                f"variables[{i}] ({_describe_variable(v)}) is not a weight of model "
                f"{model.name!r}. Pass weights of this model, e.g. from "
                "model.trainable_variables or model.layers[k].trainable_variables."
            )
        if matches[0] in positions:
            first = positions.index(matches[0])
            raise ValueError(
                f"variables[{i}] ({_describe_variable(v)}) is listed twice: it is the model "
                f"weight {all_weights[matches[0]].path!r}, already given as "
                f"variables[{first}] (a Keras weight and its tf.Variable, .value, are the "
                "same weight); list each weight once."
            )
        positions.append(matches[0])
    chosen = [all_weights[j] for j in positions]
    if dtype is None:
        dtype = chosen[0].dtype
        if tf.as_dtype(dtype) in _HALF_DTYPES:
            # Half-precision weights (a float16 or bfloat16 model): products in float32 on
            # a float32 copy, as a mixed-precision model gets them.
            dtype = tf.float32
    target = tf.as_dtype(check_float_dtype("dtype", dtype, allow_none=False))
    return chosen, positions, target


_HALF_DTYPES = (tf.float16, tf.bfloat16)


def _backing(weight: Any) -> Any:
    """The ``tf.Variable`` behind a Keras weight (its ``value``; None when there is none)."""
    inner = getattr(weight, "value", None)
    return inner if isinstance(inner, tf.Variable) else None


def _describe_variable(variable: Any) -> str:
    """A variable as errors name it: its name, type and shape, never its values."""
    name = getattr(variable, "path", None) or getattr(variable, "name", None)
    shape = getattr(variable, "shape", None)
    shape_text = f", shape {tuple(shape)}" if shape is not None else ""
    named = f"{name!r}, " if name else ""
    return f"{named}a {type(variable).__name__}{shape_text}"


def model_in_dtype(model: keras.Model, dtype: tf.DType) -> keras.Model:
    """``model`` itself if it computes in ``dtype``, else a clone that does (float64
    products of a float32 model, float32 products of a mixed-precision model)."""
    return model if computes_in(model, dtype) else clone_in_dtype(model, dtype)


def model_strategy(model: keras.Model) -> tf.distribute.Strategy | None:
    """The ``tf.distribute`` strategy in scope when ``model`` was built, or the current one.

    None when neither is a real (multi-replica) strategy.
    """
    strategy = _tf_compat.model_distribute_strategy(model)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    if strategy is None or strategy.num_replicas_in_sync == 1:
        return None
    return strategy


# -- losses -------------------------------------------------------------------------------
class _PerExampleLoss(keras.losses.Loss):
    """A Keras per-example loss function as a ``keras.losses.Loss`` (reduction, masks,
    sample weights and dtype handled by Keras)."""

    def __init__(self, fn: LossCallable, dtype: str) -> None:
        super().__init__(name=getattr(fn, "__name__", "loss"), dtype=dtype)
        self.fn = fn

    def call(self, y_true: Any, y_pred: Any) -> Any:
        return self.fn(y_true, y_pred)


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


class ResolvedLoss(NamedTuple):
    """A loss as it is evaluated: ``call(y_true, y_pred[, sample_weight])`` gives the mean
    loss; ``takes_sample_weight`` says whether it takes the third argument."""

    call: LossCallable
    takes_sample_weight: bool


def resolve_loss(loss: Any, dtype: tf.DType) -> ResolvedLoss:
    """The :class:`ResolvedLoss` computing the mean loss in ``dtype``.

    ``loss`` is a Keras loss name, a ``keras.losses.Loss`` object, a Keras per-example loss
    function, or a callable ``(y_true, y_pred) -> scalar``. Keras loss objects cast
    predictions to their own dtype (float32 by default); they are rebuilt with ``dtype``
    so that float64 products are not rounded to float32.
    """
    if isinstance(loss, str):
        loss = _loss_from_name(loss)
    if isinstance(loss, keras.losses.Loss):
        config = loss.get_config()
        try:
            rebuilt = type(loss).from_config({**config, "dtype": dtype.name})
        except (TypeError, ValueError, NotImplementedError):
            rebuilt = loss
        if rebuilt.dtype != dtype.name:
            if dtype != tf.float32:
                raise TypeError(
                    f"the loss object {type(loss).__name__} cannot be rebuilt to compute in "
                    f"{dtype.name}; pass its name, or a callable (y_true, y_pred) -> scalar."
                )
        return ResolvedLoss(rebuilt, True)
    if callable(loss):
        module = getattr(loss, "__module__", "") or ""
        if module.startswith("keras"):
            # A Keras per-example loss function (e.g. keras.losses.mean_squared_error).
            return ResolvedLoss(_PerExampleLoss(loss, dtype.name), True)
        return ResolvedLoss(loss, False)
    raise TypeError(
        f"loss must be a Keras loss name, a keras.losses.Loss, or a callable "
        f"(y_true, y_pred) -> scalar; got {type(loss).__name__}."
    )


#: Keras reductions that divide the batch sum by the batch's size (mean-type).
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def reduction_of(loss_callable: Any) -> str:
    """How a resolved loss reduces its per-example values, as spectra treats it.

    ``"mean"`` for Keras' ``"sum_over_batch_size"``, ``"mean"`` and
    ``"mean_with_sample_weight"`` and for plain callables (which return the batch mean);
    ``"sum"`` for ``"sum"``; ``"none"`` for ``"none"`` and ``None`` (unreduced values,
    averaged by spectra).
    """
    if not isinstance(loss_callable, keras.losses.Loss):
        return "mean"
    reduction = getattr(loss_callable, "reduction", "sum_over_batch_size")
    if reduction in MEAN_REDUCTIONS:
        return "mean"
    if reduction == "sum":
        return "sum"
    if reduction is None or reduction == "none":
        return "none"
    raise ValueError(
        f"the loss {loss_name(loss_callable)} has reduction={reduction!r}, which spectra "
        f"does not know; use one of {[*MEAN_REDUCTIONS, 'sum', 'none']}."
    )


def compiled_loss(model: keras.Model) -> tuple[Any, Any]:
    """The loss and loss weights ``model`` was compiled with (``loss=None``)."""
    loss = getattr(model, "loss", None)
    if loss is None:
        raise ValueError(
            f"loss=None means the loss model {model.name!r} was compiled with, but it was "
            "not compiled with one. Pass loss=... (a Keras loss name, a keras.losses.Loss, "
            "a callable (y_true, y_pred) -> scalar, or a list/dict of them per output)."
        )
    weights = None
    try:
        config = model.get_compile_config() or {}
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        config = {}
    if isinstance(config, dict):
        weights = config.get("loss_weights")
    return loss, weights


def loss_key(loss: Any) -> tuple[Hashable, list[Any]]:
    """A hashable key of a (nested) loss spec, and the objects it refers to by identity."""
    owners: list[Any] = []

    def key(item: Any) -> Hashable:
        if isinstance(item, (str, int, float)) or item is None:
            return item
        if isinstance(item, dict):
            return ("dict", tuple((k, key(v)) for k, v in sorted(item.items(), key=str)))
        if isinstance(item, (list, tuple)):
            return (type(item).__name__, tuple(key(v) for v in item))
        owners.append(item)
        return ("object", id(item))

    return key(loss), owners


def _output_entries(model: Any, outputs: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` for each model output, in Keras' output order.

    That is the order Keras flattens the outputs in (``keras.tree.flatten``): a list or
    tuple in its own order, a dict by sorted key, which is also ``model.output_names`` of
    a functional model with dict outputs.
    """
    names = list(getattr(model, "output_names", None) or [])
    if isinstance(outputs, dict):
        keys = [n for n in names if n in outputs] if set(names) == set(outputs) else sorted(outputs)
        return [(str(k), outputs[k]) for k in keys]
    if isinstance(outputs, (list, tuple)):
        if len(names) != len(outputs):
            names = [str(i) for i in range(len(outputs))]
        return list(zip(names, outputs))
    return [(names[0] if len(names) == 1 else "output", outputs)]


def positional_labels_error(names: Sequence[str], what: str = "labels") -> ValueError:
    """The one-line refusal of ``what`` given by position (a list, ``y0, y1`` in a
    ``.npz`` file) to a model whose outputs are a dict: which array goes to which output
    would depend on an order the user never wrote down."""
    listed = ", ".join(names)
    by_name = ", ".join(f"{n!r}: ..." for n in names)
    return ValueError(
        f"the model's outputs are a dict ({listed}), so {what} given by position (a list, "
        f"or y0, y1, ... in a .npz file) could go to the wrong output: give them by output "
        f"name, as a dict {{{by_name}}} (in a .npz file "
        f"{', '.join('y_' + n for n in names)})."
    )


def _per_output(
    value: Any, names: list[str], what: str, *, broadcast: bool, by_name_only: bool = False
) -> list[Any]:
    """One entry per output from a single value, a list (positional) or a dict (by name).

    ``by_name_only`` (labels and sample weights of a model with dict outputs) refuses a
    list of several entries (:func:`positional_labels_error`).
    """
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(
                f"{what} has keys {sorted(value)} but the model's outputs are named {names}; "
                f"unknown: {unknown}."
            )
        return [value.get(name) for name in names]
    if isinstance(value, (list, tuple)):
        if by_name_only and len(names) > 1:
            raise positional_labels_error(names, what)
        if len(value) != len(names):
            raise ValueError(
                f"{what} has {len(value)} entries but the model has {len(names)} output(s) "
                f"{names}; give one entry per output (or a dict by output name)."
            )
        return list(value)
    if not broadcast and len(names) > 1:
        raise ValueError(
            f"the model has {len(names)} outputs {names} but {what} is a single value; "
            "give a list (one per output) or a dict by output name."
        )
    return [value] * len(names)


@dataclass
class LossTerm:
    """One output's part of a :class:`StructuredLoss`: ``weight · loss(labels, output,
    sample_weight)``, with ``output`` as the model returned it and ``loss`` the item of
    the loss spec (a name, a ``keras.losses.Loss`` or a callable)."""

    name: str
    output: Any
    loss: Any
    weight: float | None
    labels: Any
    sample_weight: Any


class StructuredLoss:
    """The data loss of a (multi-output) model as ``compile`` defines it.

    ``loss`` is one loss for every output, a list (one per output, in Keras' output
    order, :func:`_output_entries`) or a dict keyed by output name (``None`` entries skip
    an output); ``loss_weights`` likewise (default 1). ``y`` and ``sample_weight`` are a
    single array for a single output, or a dict by output name or (for a model whose
    outputs are a list) a list per output; a list for a model with dict outputs is
    refused (:func:`positional_labels_error`). One ``sample_weight`` array applies to
    every output. The
    value is Σ_o w_o L_o(y_o, ŷ_o), each L_o the batch's share of the dataset loss under
    the loss's reduction (:func:`reduction_of`): the batch mean for mean-type reductions
    and ``"none"``, the batch sum times ``sum_scale`` = N/n_b for ``"sum"``.
    """

    def __init__(self, loss: Any, loss_weights: Any, dtype: tf.DType) -> None:
        self.loss = loss
        self.loss_weights = loss_weights
        self.dtype = dtype
        self._resolved: dict[int, ResolvedLoss] = {}
        for item in self._leaves(loss):
            self._resolved[id(item)] = resolve_loss(item, dtype)

    @staticmethod
    def _leaves(loss: Any) -> list[Any]:
        if isinstance(loss, dict):
            return [v for v in loss.values() if v is not None]
        if isinstance(loss, (list, tuple)):
            return [v for v in loss if v is not None]
        return [loss]

    def terms(self, model: Any, y: Any, outputs: Any, sample_weight: Any) -> list[LossTerm]:
        """One :class:`LossTerm` per output that has a loss, in the model's output order."""
        entries = _output_entries(model, outputs)
        names = [name for name, _ in entries]
        losses = _per_output(self.loss, names, "loss", broadcast=True)
        weights: list[Any]
        if isinstance(self.loss_weights, (int, float)):
            weights = [float(self.loss_weights)] * len(names)
        elif self.loss_weights is None:
            weights = [None] * len(names)
        else:
            weights = _per_output(self.loss_weights, names, "loss_weights", broadcast=False)
        if len(names) == 1 and isinstance(y, (list, tuple)) and len(y) == 1:
            y = y[0]
        if len(names) == 1 and isinstance(y, dict) and len(y) == 1:
            y = next(iter(y.values()))
        by_name = isinstance(outputs, dict)
        labels = _per_output(y, names, "y (the labels)", broadcast=False, by_name_only=by_name)
        if isinstance(sample_weight, (list, tuple, dict)):
            sample_weights = _per_output(
                sample_weight, names, "sample_weight", broadcast=False, by_name_only=by_name
            )
        else:
            sample_weights = [sample_weight] * len(names)
        terms = [
            LossTerm(name, pred, loss, weight, y_o, sw)
            for (name, pred), loss, weight, y_o, sw in zip(
                entries, losses, weights, labels, sample_weights
            )
            if loss is not None
        ]
        if not terms:
            raise ValueError("every output's loss is None: there is no loss to differentiate.")
        return terms

    def value(
        self, term: LossTerm, labels: Any, sample_weight: Any, sum_scale: Any = None
    ) -> tf.Tensor:
        """``weight · L(labels, term.output, sample_weight)``: one output's share of the loss.

        ``sum_scale`` (N/n_b, a scalar tensor) multiplies the batch sum of a loss with
        ``reduction="sum"``; such a loss without it is an error.
        """
        value = self._one(term.name, term.loss, labels, term.output, sample_weight, sum_scale)
        if term.weight is None:
            return value
        # tf.constant, not tf.cast: a Python float cast would pass through float32.
        return value * tf.constant(term.weight, self.dtype)

    def resolved(self, term: LossTerm) -> LossCallable:
        """The loss callable of ``term`` as it is evaluated (in this loss's dtype)."""
        return self._resolved[id(term.loss)].call

    def __call__(
        self, model: Any, y: Any, outputs: Any, sample_weight: Any, sum_scale: Any = None
    ) -> tf.Tensor:
        values = [
            self.value(term, term.labels, term.sample_weight, sum_scale)
            for term in self.terms(model, y, outputs, sample_weight)
        ]
        return tf.add_n(values) if len(values) > 1 else values[0]

    def _one(
        self, name: str, loss: Any, y: Any, pred: Any, sample_weight: Any, sum_scale: Any
    ) -> tf.Tensor:
        pred = tf.convert_to_tensor(pred)
        if not pred.dtype.is_floating:
            raise TypeError(
                f"model output {name!r} has dtype {pred.dtype.name}: a loss of integer (or "
                "boolean) outputs has no derivative with respect to the weights. Return the "
                "floating-point logits or probabilities from the model."
            )
        if pred.dtype != self.dtype:
            pred = tf.cast(pred, self.dtype)
        if y is None:
            raise ValueError(f"no labels were given for model output {name!r}.")
        resolved = self._resolved[id(loss)]
        loss_callable, takes_sample_weight = resolved.call, resolved.takes_sample_weight
        reduction = reduction_of(loss_callable)
        if (
            getattr(loss_callable, "reduction", None) == "mean_with_sample_weight"
            and sample_weight is not None
        ):
            raise ValueError(
                f"the loss {loss_name(loss)} of output {name!r} has "
                "reduction='mean_with_sample_weight' and the data have sample weights: it "
                "divides each batch by that batch's total weight, so its Hessian would "
                "depend on how the data are batched. Use reduction='sum_over_batch_size' "
                "(Σ w_i l_i / N over the dataset) or 'sum', or normalize the weights yourself."
            )
        try:
            if takes_sample_weight:
                value = loss_callable(y, pred, sample_weight=sample_weight)
                # Keras loss objects with a mean-type reduction divide by the number of
                # replicas of the strategy in scope (ready for summing gradients across
                # replicas); this is the mean.
                replicas = tf.distribute.get_strategy().num_replicas_in_sync
                if replicas > 1 and reduction == "mean":
                    value = value * tf.cast(replicas, value.dtype)
            else:
                if sample_weight is not None:
                    raise ValueError(
                        "sample weights need a Keras loss (a name or a keras.losses.Loss): a "
                        "plain callable (y_true, y_pred) -> scalar cannot weight examples."
                    )
                value = loss_callable(y, pred)
        except (ValueError, TypeError, tf.errors.InvalidArgumentError) as err:
            if "sample weights need a Keras loss" in str(err):
                raise
            y_shape = getattr(y, "shape", None)
            raise ValueError(
                f"the loss {loss_name(loss)} does not fit model output {name!r}: labels of "
                f"shape {y_shape} and dtype {getattr(y, 'dtype', type(y).__name__)} against "
                f"predictions of shape {pred.shape}. {err}"
            ) from err
        value = tf.convert_to_tensor(value)
        if reduction == "none":
            # Unreduced values (w_i l_i per example, or per element): their mean, like
            # sum_over_batch_size.
            value = tf.reduce_mean(value)
        elif reduction == "sum":
            if sum_scale is None:
                raise ValueError(
                    f"the loss {loss_name(loss)} has reduction='sum': its batch sums need "
                    "the number of examples of the dataset, which this evaluation lacks."
                )
            value = value * tf.cast(sum_scale, value.dtype)
        if value.shape.rank != 0:
            raise ValueError(
                f"the loss returned shape {value.shape}, not a scalar. A callable loss must "
                "return the mean over the batch; for per-example losses pass a Keras loss."
            )
        return tf.cast(value, self.dtype)


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


def _state_keys(model: Any) -> tuple[list[Any], list[Any]]:
    """The model's variables in ``stateless_call`` order: trainable, then the others.

    Read through ``model.variables`` so that a stand-in delegating attribute access to a
    model (whose ``trainable_variables`` hold values) gives the model's own variables.
    """
    variables = list(model.variables)
    if not model.trainable:
        return [], variables
    return [v for v in variables if v.trainable], [v for v in variables if not v.trainable]


def stateless_forward(
    model: Any,
    keys: Sequence[Any],
    values: Sequence[Any],
    x: Any,
    *,
    training: bool,
) -> tuple[Any, list[tf.Tensor]]:
    """``model(x, training=...)`` with each variable in ``keys`` replaced by its value.

    Returns the outputs and the model's losses (regularizers, ``add_loss``) computed from
    the values. Every state update is discarded.
    """
    if training:
        _refuse_surrogate_gradients(model)
    mapping = list(zip(keys, values))
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
        # ``model.__call__`` rather than ``model(...)``: a stand-in that forwards attribute
        # access to a model is not callable itself.
        try:
            outputs = model.__call__(x, training=training)
        except (ValueError, TypeError) as err:
            cause = _keras_call_cause(str(err))
            if cause is None:
                raise
            raise type(err)(
                f"calling model {model.name!r} on a batch of x failed: {cause} Check that x "
                "fits the model's inputs (number of features, shape, dtype)."
            ) from err
        except tf.errors.OpError as err:
            # An op error inside a layer, raised by an eager call (an index outside an
            # Embedding's table in a subclassed model, which the data checks cannot see):
            # Keras' call context off, so that ``data_checks.graph_errors`` finds the root
            # cause. (Traced graphs raise theirs when they run, not here.)
            cause = _keras_call_cause(err.message)
            if cause is None:
                raise
            raise type(err)(err.node_def, err.op, cause) from err
        extra = list(model.losses)
    return outputs, extra


def _refuse_surrogate_gradients(model: Any) -> None:
    """Refuse layers whose training-mode gradient is not the derivative of what they
    compute: they back-propagate through ``stop_gradient`` on quantities that depend on
    the parameters, so no curvature of the loss is consistent with their gradient.

    * ``BatchNormalization(renorm=True)``: the corrections r = σ_B/σ and d = (μ_B - μ)/σ
      are held constant (Ioffe 2017, "Batch Renormalization");
    * ``SpectralNormalization``: the power-iteration vectors u, v of σ(W) = uᵀWv are held
      constant after one step from their stored values (Miyato et al. 2018).
    """
    for layer in [model, *_tf_compat.flatten_layers(model)]:
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


_BOLD = re.compile(r"\x1b\[1m((?:(?!\x1b\[1m).)*?)\x1b\[0m", re.DOTALL)


def _keras_call_cause(message: str) -> str | None:
    """The innermost cause of Keras' multi-line "Exception encountered when calling
    X.call()" error (the bold part of the deepest layer), on one line; None otherwise."""
    if "Exception encountered when calling" not in message:
        return None
    found = _BOLD.findall(message)
    if not found:
        return None
    cause = " ".join(found[0].split())
    return cause if cause.endswith(".") else cause + "."


class KerasProgram:
    """The loss of a Keras model on one batch, as a function of the model's state values.

    ``state`` (the traced inputs) are the values of ``model.trainable_variables`` followed
    by ``model.non_trainable_variables`` (BatchNorm statistics, seed generator states),
    in the dtypes of ``model`` (the run model: the user's model or its clone). The
    parameters θ are the entries at ``parameter_indices``.
    """

    def __init__(
        self,
        model: keras.Model,
        loss: StructuredLoss,
        *,
        dtype: tf.DType,
        training: bool,
        include_regularization: bool,
        positions: Sequence[int],
    ) -> None:
        self.model = model
        self.loss = loss
        self.dtype = dtype
        self.training = training
        self.include_regularization = include_regularization
        trainable, others = _state_keys(model)
        self.state_variables = [*trainable, *others]
        weights = list(model.weights)
        self.parameter_indices = []
        for position in positions:
            target = weights[position]
            self.parameter_indices.append(
                next(i for i, v in enumerate(self.state_variables) if v is target)
            )
        seeds = _tf_compat.seed_state_variables(model)
        self.seed_indices = [
            i for i, v in enumerate(self.state_variables) if any(v is s for s in seeds)
        ]

    @property
    def state_specs(self) -> list[tf.TensorSpec]:
        return [tf.TensorSpec(v.shape, v.dtype) for v in self.state_variables]

    def parameter_names(self) -> list[str]:
        return [str(self.state_variables[i].path) for i in self.parameter_indices]

    def parameter_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(self.state_variables[i].shape) for i in self.parameter_indices]

    def parameters(self, state: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The parameters θ among the state values (what tapes watch)."""
        return [state[i] for i in self.parameter_indices]

    def outputs(self, state: Sequence[tf.Tensor], batch: Any) -> tuple[Any, tf.Tensor | None]:
        """The model's outputs on the batch and the sum of its losses (None when excluded
        or there are none), at the state values."""
        x, _, _ = unpack_batch(batch)
        outputs, extra = stateless_forward(
            self.model, self.state_variables, state, x, training=self.training
        )
        if not self.include_regularization or not extra:
            return outputs, None
        return outputs, tf.add_n([tf.cast(term, self.dtype) for term in extra])

    def output_loss(
        self, batch: Any, outputs: Any, *, num_examples: tf.Tensor | None = None
    ) -> tf.Tensor:
        """The data loss of ``outputs`` (what the loss receives as ``y_pred``); a loss
        with ``reduction="sum"`` needs ``num_examples`` (N, see :func:`sum_scale`)."""
        _, y, sample_weight = unpack_batch(batch)
        scale = sum_scale(batch, num_examples, self.dtype)
        return self.loss(self.model, y, outputs, sample_weight, scale)

    def batch_loss(
        self, state: Sequence[tf.Tensor], batch: Any, *, num_examples: tf.Tensor | None = None
    ) -> tf.Tensor:
        """Data loss plus (optionally) regularization of one batch."""
        outputs, regularization = self.outputs(state, batch)
        value = self.output_loss(batch, outputs, num_examples=num_examples)
        return value if regularization is None else value + regularization


def sum_scale(batch: Any, num_examples: Any, dtype: tf.DType) -> tf.Tensor | None:
    """N/n_b: what a batch sum (``reduction="sum"``) is multiplied by, so that the
    weighted sum Σ_b (n_b/N) L_b of the batch losses is the sum over all N examples.
    n_b is the leading dimension of the batch; None without ``num_examples``."""
    if num_examples is None:
        return None
    leaves = tf.nest.flatten(batch)
    if not leaves:
        return None
    count = tf.shape(leaves[0], out_type=tf.int64)[0]
    return tf.cast(num_examples, dtype) / tf.cast(count, dtype)


class BatchLoss(Protocol):
    """What :func:`keras_loss_fn` returns: ``loss_fn(batch)``, the mean loss of a batch, or
    ``loss_fn(batch, num_examples)`` with N for losses with ``reduction="sum"``."""

    def __call__(self, batch: Any, num_examples: Any = None) -> tf.Tensor: ...


def keras_loss_fn(
    model: Any,
    loss: Any,
    *,
    dtype: tf.DType,
    training: bool,
    include_regularization: bool,
) -> BatchLoss:
    """``loss_fn(batch)``: the mean loss of ``model`` on ``(x, y[, sample_weight])``.

    The model is evaluated at what ``model.trainable_variables`` and
    ``model.non_trainable_variables`` hold when ``loss_fn`` is called (variables, or
    tensors for a stand-in that shifts the values), with the loss definition of
    :class:`KerasProgram`; ``loss_fn(batch, num_examples)`` gives N for losses with
    ``reduction="sum"``.
    """
    if loss is None:
        loss, loss_weights = compiled_loss(model)
    else:
        loss_weights = None
    structured = StructuredLoss(loss, loss_weights, dtype)

    def loss_fn(batch: Any, num_examples: Any = None) -> tf.Tensor:
        x, y, sample_weight = unpack_batch(batch)
        trainable, others = _state_keys(model)
        values = [*model.trainable_variables, *model.non_trainable_variables]
        outputs, extra = stateless_forward(
            model, [*trainable, *others], values, x, training=training
        )
        value = structured(model, y, outputs, sample_weight, sum_scale(batch, num_examples, dtype))
        if include_regularization and extra:
            value = value + tf.add_n([tf.cast(term, dtype) for term in extra])
        return value

    return loss_fn


# -- snapshots ---------------------------------------------------------------------------
def snapshot_state(
    model: keras.Model, run_model: keras.Model, devices: Sequence[str | None]
) -> list[list[tf.Tensor]]:
    """Copies of ``model``'s state values in ``run_model``'s dtypes, one list per device.

    The values are copied (not aliased) when the operator is built, so later training,
    ``load_weights`` or another operator leave them as they are. NaN or Inf in a
    floating-point variable is refused, naming the variable and the count of bad entries.
    """
    source_t, source_n = _state_keys(model)
    target_t, target_n = _state_keys(run_model)
    sources, targets = [*source_t, *source_n], [*target_t, *target_n]
    if len(sources) != len(targets):
        raise ComputeCopyError(
            f"the compute copy of {model.name!r} has {len(targets)} state variables, the model "
            f"{len(sources)}; build the model in the compute dtype yourself instead."
        )
    values = []
    for src, dst in zip(sources, targets):
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"weight {src.path} has shape {tuple(src.shape)} but its clone {tuple(dst.shape)}."
            )
        value = tf.convert_to_tensor(src.value)
        check_finite(value, str(src.path))
        values.append(value)
    return [
        [copy_tensor(value, tf.as_dtype(dst.dtype), device) for value, dst in zip(values, targets)]
        for device in devices
    ]


def check_finite(value: tf.Tensor, name: str, *, inputs: Any = None, where: str = "") -> None:
    """Refuse NaN or Inf in a floating-point tensor, naming it and the count of bad entries.

    ``value`` is a weight (``name`` its path) by default: the fix is finite weights. With
    ``inputs`` (the batch's x) it is something computed from finite weights (a batch
    loss): the message blames the data and names the first NaN/Inf entry of x, or its
    entry of largest magnitude (a finite input can overflow inside the model);
    ``where`` (e.g. "batch 3") says which batch.
    """
    if not value.dtype.is_floating:
        return
    bad = int(tf.size(value)) - int(tf.math.count_nonzero(tf.math.is_finite(value)))
    if not bad:
        return
    nans = int(tf.math.count_nonzero(tf.math.is_nan(value)))
    counts = f"{bad} non-finite entries ({nans} NaN, {bad - nans} Inf) out of {int(tf.size(value))}"
    if inputs is not None:
        from spectra.operators.data_checks import describe_inputs

        look = describe_inputs(inputs)
        at = f" of {where}" if where else ""
        raise ValueError(
            f"{name}{at} has {counts} although the weights are finite: the data are the "
            f"cause{f' ({look})' if look else ''}. Remove or rescale those examples."
        )
    raise ValueError(
        f"variable {name!r} has {counts}: the loss and its Hessian are undefined there. Load "
        "finite weights (e.g. an earlier checkpoint) before computing curvature."
    )


def copy_tensor(value: tf.Tensor, dtype: tf.DType, device: str | None) -> tf.Tensor:
    """A copy of ``value`` in ``dtype`` on ``device`` that shares no buffer with it."""
    with tf.device(device) if device is not None else contextlib.nullcontext():
        if value.dtype != dtype:
            return tf.cast(value, dtype)
        return tf.raw_ops.DeepCopy(x=value)


# -- compute-dtype clones ---------------------------------------------------------------
class ComputeCopyError(TypeError):
    """A model that cannot be copied into the compute dtype (float64 products, or float32
    products of a half-precision or mixed-precision model): the message says to build the
    model in that dtype. A ``TypeError``; the command line reports it in one line."""


_FLOAT_POLICIES = frozenset(
    {"float16", "bfloat16", "float32", "float64", "mixed_float16", "mixed_bfloat16"}
)


def _with_float_dtypes(config: Any, dtype: str) -> Any:
    """Copy of a serialized Keras config with every floating dtype (policy) set to ``dtype``."""
    if isinstance(config, list):
        return [_with_float_dtypes(item, dtype) for item in config]
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
            out[key] = _with_float_dtypes(value, dtype)
    return out


def computes_in(model: keras.Model, dtype: tf.DType) -> bool:
    """True when every layer of ``model`` keeps and computes its floats in ``dtype``."""
    for layer in _tf_compat.flatten_layers(model):
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
    ``dtype``), then given the model's current weights. Operators never read them (they
    feed the clone their snapshot values); the user's model is not touched.
    """
    # Rebuilding layers draws default initializer seeds from Python's global RNG; keep
    # the caller's random streams (e.g. a training run's) where they were.
    # A subclassed model creates its layers in ``__init__`` without the dtype its config
    # says: the global dtype policy, set to ``dtype`` while the copy is rebuilt and built,
    # is what they then take.
    python_state, numpy_state = random.getstate(), np.random.get_state()  # noqa: NPY002
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype.name)
    try:
        config = _with_float_dtypes(keras.saving.serialize_keras_object(model), dtype.name)
        clone = keras.saving.deserialize_keras_object(config)
        if not clone.built:
            build_config = model.get_build_config()
            if build_config:
                clone.build_from_config(build_config)
    except (TypeError, ValueError, NotImplementedError, KeyError) as err:
        raise ComputeCopyError(
            f"computing the Hessian in {dtype.name} needs a copy of the model in that dtype, "
            "rebuilt from its config (Sequential, functional, or a registered subclass with "
            f"get_config); rebuilding {model.name!r} failed: {err}. Build the model in "
            f"{dtype.name} yourself and pass it with dtype=None."
        ) from err
    finally:
        keras.config.set_dtype_policy(policy)
        random.setstate(python_state)
        np.random.set_state(numpy_state)  # noqa: NPY002
    if len(clone.weights) != len(model.weights):
        raise ComputeCopyError(
            f"the {dtype.name} copy of {model.name!r} has {len(clone.weights)} weights, the "
            f"model {len(model.weights)}; build the model in {dtype.name} yourself instead."
        )
    other = sorted({str(w.dtype) for w in clone.weights if "float" in str(w.dtype)} - {dtype.name})
    if other:
        raise ComputeCopyError(
            f"the {dtype.name} copy of {model.name!r} keeps weights in {', '.join(other)} (a "
            f"layer that fixes its own dtype); build the model in {dtype.name} yourself and "
            "pass it with dtype=None."
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
