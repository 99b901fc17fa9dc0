"""A Keras model, its loss and its data as a differentiable program of parameter values.

Private to :mod:`spectra.operators`: the TensorFlow engine's evaluation of what
:mod:`spectra.operators.losses` (which loss, per output, with which reduction) and
:mod:`spectra.operators.keras_calls` (which weights, the compute-dtype copy, the stateless
call) decide for both engines. Conventions (see
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
from collections.abc import Sequence
from typing import Any, Protocol

import keras
import tensorflow as tf

from spectra import _keras_compat, _tf_compat
from spectra.operators import keras_calls, losses
from spectra.operators.keras_calls import (
    ComputeCopyError,
    check_model,
    clone_in_dtype,
    copy_weights,
    model_in_dtype,
    unpack_batch,
)
from spectra.operators.keras_calls import keras_call_cause as _keras_call_cause
from spectra.operators.keras_calls import state_keys as _state_keys
from spectra.operators.losses import (
    MEAN_REDUCTIONS,
    LossCallable,
    LossTerm,
    ResolvedLoss,
    compiled_loss,
    loss_key,
    positional_labels_error,
    reduction_of,
)

# Read here by the TensorFlow engine's modules (jacobian, data_checks).
from spectra.operators.losses import output_entries as _output_entries  # noqa: F401

__all__ = [
    "MEAN_REDUCTIONS",
    "BatchLoss",
    "ComputeCopyError",
    "KerasProgram",
    "LossCallable",
    "LossTerm",
    "ResolvedLoss",
    "StructuredLoss",
    "check_finite",
    "check_model",
    "clone_in_dtype",
    "compiled_loss",
    "computes_in",
    "copy_tensor",
    "copy_weights",
    "keras_loss_fn",
    "loss_key",
    "model_in_dtype",
    "model_strategy",
    "positional_labels_error",
    "reduction_of",
    "resolve_loss",
    "resolve_variables_and_dtype",
    "snapshot_state",
    "stateless_forward",
    "sum_scale",
    "unpack_batch",
]


def resolve_variables_and_dtype(
    model: keras.Model, variables: Any, dtype: Any
) -> tuple[list[Any], list[int], tf.DType]:
    """:func:`spectra.operators.keras_calls.resolve_variables_and_dtype` with a Keras
    weight's ``tf.Variable`` (``kernel.value``) naming the weight, and the compute dtype
    as a ``tf.DType``."""
    chosen, positions, target = keras_calls.resolve_variables_and_dtype(
        model, variables, dtype, backing=_backing
    )
    return chosen, positions, tf.as_dtype(target)


def _backing(weight: Any) -> Any:
    """The ``tf.Variable`` behind a Keras weight (its ``value``; None when there is none)."""
    inner = getattr(weight, "value", None)
    return inner if isinstance(inner, tf.Variable) else None


def computes_in(model: keras.Model, dtype: tf.DType) -> bool:
    """True when every layer of ``model`` keeps and computes its floats in ``dtype``."""
    return keras_calls.computes_in(model, dtype)


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
def resolve_loss(loss: Any, dtype: tf.DType) -> ResolvedLoss:
    """The :class:`ResolvedLoss` computing the mean loss in ``dtype``
    (:func:`spectra.operators.losses.resolve_loss`)."""
    return losses.resolve_loss(loss, tf.as_dtype(dtype).name)


class StructuredLoss(losses.StructuredLoss):
    """The data loss of a (multi-output) model as ``compile`` defines it, evaluated with
    TensorFlow (:class:`spectra.operators.losses.StructuredLoss` decides the terms).

    The value is Σ_o w_o L_o(y_o, ŷ_o), each L_o the batch's share of the dataset loss
    under the loss's reduction (:func:`reduction_of`): the batch mean for mean-type
    reductions and ``"none"``, the batch sum times ``sum_scale`` = N/n_b for ``"sum"``.
    """

    def __init__(self, loss: Any, loss_weights: Any, dtype: tf.DType) -> None:
        super().__init__(loss, loss_weights, tf.as_dtype(dtype))

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
            raise losses.integer_output_error(name, pred.dtype)
        if pred.dtype != self.dtype:
            pred = tf.cast(pred, self.dtype)
        if y is None:
            raise ValueError(f"no labels were given for model output {name!r}.")
        resolved = self.resolved_loss(loss)
        loss_callable, takes_sample_weight = resolved.call, resolved.takes_sample_weight
        reduction = reduction_of(loss_callable)
        losses.check_reduction_with_weights(loss_callable, loss, name, sample_weight)
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
                    raise losses.unweighted_callable_error()
                value = loss_callable(y, pred)
        except (ValueError, TypeError, tf.errors.InvalidArgumentError) as err:
            if losses.UNWEIGHTED_CALLABLE in str(err):
                raise
            raise losses.misfit_error(loss, name, y, pred.shape, err) from err
        value = tf.convert_to_tensor(value)
        if reduction == "none":
            # Unreduced values (w_i l_i per example, or per element): their mean, like
            # sum_over_batch_size.
            value = tf.reduce_mean(value)
        elif reduction == "sum":
            if sum_scale is None:
                raise losses.sum_without_count_error(loss)
            value = value * tf.cast(sum_scale, value.dtype)
        if value.shape.rank != 0:
            raise losses.non_scalar_error(value.shape)
        return tf.cast(value, self.dtype)


def stateless_forward(
    model: Any,
    keys: Sequence[Any],
    values: Sequence[Any],
    x: Any,
    *,
    training: bool,
) -> tuple[Any, list[tf.Tensor]]:
    """``model(x, training=...)`` with each variable in ``keys`` replaced by its value
    (:func:`spectra.operators.keras_calls.stateless_forward`).

    Returns the outputs and the model's losses (regularizers, ``add_loss``) computed from
    the values. Every state update is discarded.
    """
    try:
        return keras_calls.stateless_forward(model, keys, values, x, training=training)
    except tf.errors.OpError as err:
        # An op error inside a layer, raised by an eager call (an index outside an
        # Embedding's table in a subclassed model, which the data checks cannot see):
        # Keras' call context off, so that ``data_checks.graph_errors`` finds the root
        # cause. (Traced graphs raise theirs when they run, not here.)
        cause = _keras_call_cause(err.message)
        if cause is None:
            raise
        raise type(err)(err.node_def, err.op, cause) from err


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
        seeds = _keras_compat.seed_state_variables(model)
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
    raise keras_calls.non_finite_error(
        name, bad, nans, int(tf.size(value)), inputs=inputs, where=where
    )


def copy_tensor(value: tf.Tensor, dtype: tf.DType, device: str | None) -> tf.Tensor:
    """A copy of ``value`` in ``dtype`` on ``device`` that shares no buffer with it."""
    with tf.device(device) if device is not None else contextlib.nullcontext():
        if value.dtype != dtype:
            return tf.cast(value, dtype)
        return tf.raw_ops.DeepCopy(x=value)
