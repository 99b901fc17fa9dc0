"""A Keras model and its loss as pure JAX functions of the parameter values.

The conventions are the TensorFlow engine's (:mod:`spectra.operators.keras_models`), from
the same backend-neutral code (:mod:`spectra.operators.losses`,
:mod:`spectra.operators.keras_calls`):

* the model is called as Keras calls it, ``model(x, training=...)``, inside a
  ``keras.StatelessScope`` that maps every variable of the model to a value given as an
  argument of the traced function (what ``model.stateless_call`` does, through the
  model's ``__call__``: inputs converted, ``training`` passed to the ``call`` methods that
  take it, masks propagated). The model's variables are never read and every state update
  is discarded;
* the batch loss L_b is, per output, the loss object's reduction made a share of the
  dataset loss (:func:`~spectra.operators.losses.reduction_of`), weighted by
  ``loss_weights`` and summed over the outputs as ``compile`` does, plus the model's
  ``losses`` (weight and activity regularizers, ``add_loss`` terms) when asked for;
* float64 (or float32 for a half-precision or mixed-precision model) runs on a copy of
  the model in that dtype (:func:`~spectra.operators.keras_calls.model_in_dtype`), fed the
  snapshot values cast to it, and a copy of the loss in that dtype. Keras' cross-entropies
  of a softmax or sigmoid output read the logits behind it, as on TensorFlow
  (:func:`spectra._jax_compat.keras_logits`, entered by the engine while it traces).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spectra import _keras_compat
from spectra.operators import keras_calls, losses
from spectra.operators.losses import LossTerm, reduction_of

__all__ = ["ModelProgram", "StructuredLoss", "sum_scale"]


def sum_scale(batch: Any, num_examples: Any, dtype: Any) -> Any:
    """N/n_b: what a batch sum (``reduction="sum"``) is multiplied by, so that the
    weighted sum Σ_b (n_b/N) L_b of the batch losses is the sum over all N examples."""
    if num_examples is None:
        return None
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    count = jax.tree.leaves(x)[0].shape[0]
    return jnp.asarray(num_examples, dtype) / count


class StructuredLoss(losses.StructuredLoss):
    """The data loss of a (multi-output) model as ``compile`` defines it, evaluated with
    ``jax.numpy`` (:class:`spectra.operators.losses.StructuredLoss` decides the terms)."""

    def value(self, term: LossTerm, labels: Any, sample_weight: Any, sum_scale: Any = None) -> Any:
        """``weight · L(labels, term.output, sample_weight)``: one output's share of the
        loss (``sum_scale`` = N/n_b multiplies the batch sum of a ``reduction="sum"`` loss)."""
        value = self._one(term.name, term.loss, labels, term.output, sample_weight, sum_scale)
        if term.weight is None:
            return value
        return value * jnp.asarray(term.weight, self.dtype_name)

    def __call__(
        self, model: Any, y: Any, outputs: Any, sample_weight: Any, sum_scale: Any = None
    ) -> Any:
        values = [
            self.value(term, term.labels, term.sample_weight, sum_scale)
            for term in self.terms(model, y, outputs, sample_weight)
        ]
        total = values[0]
        for value in values[1:]:
            total = total + value
        return total

    def _one(
        self, name: str, loss: Any, y: Any, pred: Any, sample_weight: Any, sum_scale: Any
    ) -> Any:
        dtype = np.dtype(self.dtype_name)
        if not isinstance(pred, jax.Array):
            pred = jnp.asarray(pred)
        if not jnp.issubdtype(pred.dtype, jnp.floating):
            raise losses.integer_output_error(name, pred.dtype)
        if pred.dtype != dtype:
            pred = pred.astype(dtype)
        if y is None:
            raise ValueError(f"no labels were given for model output {name!r}.")
        resolved = self.resolved_loss(loss)
        loss_callable, takes_sample_weight = resolved.call, resolved.takes_sample_weight
        reduction = reduction_of(loss_callable)
        losses.check_reduction_with_weights(loss_callable, loss, name, sample_weight)
        try:
            if takes_sample_weight:
                value = loss_callable(y, pred, sample_weight=sample_weight)
            else:
                if sample_weight is not None:
                    raise losses.unweighted_callable_error()
                value = loss_callable(y, pred)
        except (ValueError, TypeError) as err:
            if losses.UNWEIGHTED_CALLABLE in str(err):
                raise
            raise losses.misfit_error(loss, name, y, tuple(pred.shape), err) from err
        value = jnp.asarray(value)
        if reduction == "none":
            # Unreduced values (w_i l_i per example, or per element): their mean, like
            # sum_over_batch_size.
            value = jnp.mean(value)
        elif reduction == "sum":
            if sum_scale is None:
                raise losses.sum_without_count_error(loss)
            value = value * sum_scale.astype(value.dtype)
        if value.ndim != 0:
            raise losses.non_scalar_error(tuple(value.shape))
        return value.astype(dtype)


class ModelProgram:
    """The loss of a Keras model on one batch, as a function of the model's state values.

    ``state`` is the list of values of ``model.trainable_variables`` followed by
    ``model.non_trainable_variables`` (BatchNorm statistics, seed generator states) of the
    run model (the user's model or its copy in the compute dtype), in its dtypes. The
    parameters θ are the entries at ``parameter_indices``; ``seed_indices`` are the
    entries holding Keras seed generator states.
    """

    def __init__(
        self,
        model: Any,
        loss: Any,
        loss_weights: Any,
        *,
        dtype: np.dtype,
        training: bool,
        include_regularization: bool,
        positions: Sequence[int],
    ) -> None:
        self.model = model
        self.dtype = np.dtype(dtype)
        self.training = training
        self.include_regularization = include_regularization
        self.loss = StructuredLoss(loss, loss_weights, self.dtype.name)
        trainable, others = keras_calls.state_keys(model)
        self.state_variables = [*trainable, *others]
        weights = list(model.weights)
        self.parameter_indices = [
            next(i for i, v in enumerate(self.state_variables) if v is weights[p])
            for p in positions
        ]
        seeds = _keras_compat.seed_state_variables(model)
        self.seed_indices = [
            i for i, v in enumerate(self.state_variables) if any(v is s for s in seeds)
        ]

    def parameter_names(self) -> list[str]:
        return [str(self.state_variables[i].path) for i in self.parameter_indices]

    def parameter_shapes(self) -> list[tuple[int, ...]]:
        variables = [self.state_variables[i] for i in self.parameter_indices]
        return [tuple(int(d) for d in v.shape) for v in variables]

    def values(self, params: Sequence[Any], state: Sequence[Any]) -> list[Any]:
        """The state values with the parameters θ in their places."""
        values = list(state)
        for index, value in zip(self.parameter_indices, params):
            values[index] = value
        return values

    def outputs(self, params: Sequence[Any], state: Sequence[Any], x: Any) -> tuple[Any, Any]:
        """The model's outputs on the inputs ``x`` and the sum of its losses (None when
        excluded or there are none), at the parameters ``params``."""
        outputs, extra = keras_calls.stateless_forward(
            self.model, self.state_variables, self.values(params, state), x, training=self.training
        )
        if not self.include_regularization or not extra:
            return outputs, None
        total = jnp.asarray(extra[0], self.dtype)
        for term in extra[1:]:
            total = total + jnp.asarray(term, self.dtype)
        return outputs, total

    def output_loss(self, batch: Any, outputs: Any, num_examples: Any = None) -> Any:
        """The data loss of ``outputs`` (what the loss receives as ``y_pred``) on the batch;
        a loss with ``reduction="sum"`` needs ``num_examples`` (N)."""
        _, y, sample_weight = keras_calls.unpack_batch(batch)
        scale = sum_scale(batch, num_examples, self.dtype)
        return self.loss(self.model, y, outputs, sample_weight, scale)

    def batch_loss(
        self, params: Sequence[Any], state: Sequence[Any], batch: Any, num_examples: Any = None
    ) -> Any:
        """Data loss plus (optionally) regularization of one batch."""
        x, _, _ = keras_calls.unpack_batch(batch)
        outputs, regularization = self.outputs(params, state, x)
        value = self.output_loss(batch, outputs, num_examples)
        return value if regularization is None else value + regularization
