"""The loss of a Keras model as ``compile`` defines it, for every engine.

Backend-neutral (Keras and NumPy only): what both engines mean by a model's loss. The
TensorFlow engine (:mod:`spectra.operators.keras_models`) and the JAX engine
(:mod:`spectra.operators.jax.models`) evaluate it each with their own arithmetic;
everything that decides *which* loss is evaluated lives here once:

* :func:`resolve_loss` — a loss name, ``keras.losses.Loss``, Keras per-example function or
  callable ``(y_true, y_pred) -> scalar`` as what is called, rebuilt in the compute dtype
  (Keras loss objects cast predictions to their own dtype);
* :func:`reduction_of` — how a loss reduces its per-example values, as spectra treats it:
  a mean-type reduction gives the batch's share Σ_i w_i l_i / n_b of the dataset mean,
  ``"sum"`` the batch sum times N/n_b, ``"none"`` the mean of the unreduced values, so
  that Σ_b (n_b/N) L_b is the dataset loss whatever the batching;
* :class:`StructuredLoss` — one loss per output of a multi-output model (a list, or a
  dict by output name), ``loss_weights``, labels and sample weights matched to the
  outputs in Keras' output order (:func:`output_entries`);
* :func:`compiled_loss` and :func:`loss_key` — the loss a model was compiled with, and a
  hashable key of a loss spec for caches of compiled functions;
* the one-line refusals the engines raise when a loss cannot be evaluated
  (:func:`misfit_error`, :func:`check_reduction_with_weights`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import keras

from spectra._validation import loss_name

__all__ = [
    "MEAN_REDUCTIONS",
    "LossTerm",
    "ResolvedLoss",
    "StructuredLoss",
    "check_reduction_with_weights",
    "compiled_loss",
    "dtype_name",
    "integer_output_error",
    "loss_key",
    "misfit_error",
    "non_scalar_error",
    "output_entries",
    "positional_labels_error",
    "reduction_of",
    "resolve_loss",
    "sum_without_count_error",
    "unweighted_callable_error",
]

LossCallable = Callable[..., Any]


def dtype_name(dtype: Any) -> str:
    """``"float32"``, ``"int64"``, ``"string"``, ...: the name of a dtype of any engine (a
    TensorFlow ``DType``, a NumPy or JAX dtype, a Keras dtype name). NumPy string and
    object dtypes are ``"string"``, as TensorFlow calls them."""
    if isinstance(dtype, str):
        return dtype
    name = getattr(dtype, "name", None)
    kind = getattr(dtype, "kind", None)
    if kind in ("U", "S", "O"):
        return "string"
    if isinstance(name, str):
        return name
    import numpy as np

    found = np.dtype(dtype)
    return "string" if found.kind in ("U", "S", "O") else found.name


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


def resolve_loss(loss: Any, dtype: str) -> ResolvedLoss:
    """The :class:`ResolvedLoss` computing the mean loss in the dtype named ``dtype``.

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
            rebuilt = type(loss).from_config({**config, "dtype": dtype})
        except (TypeError, ValueError, NotImplementedError):
            rebuilt = loss
        if rebuilt.dtype != dtype and dtype != "float32":
            raise TypeError(
                f"the loss object {type(loss).__name__} cannot be rebuilt to compute in "
                f"{dtype}; pass its name, or a callable (y_true, y_pred) -> scalar."
            )
        return ResolvedLoss(rebuilt, True)
    if callable(loss):
        module = getattr(loss, "__module__", "") or ""
        if module.startswith("keras"):
            # A Keras per-example loss function (e.g. keras.losses.mean_squared_error).
            return ResolvedLoss(_PerExampleLoss(loss, dtype), True)
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


def check_fisher_reduction(loss: Any) -> None:
    """Refuse a loss with ``reduction="sum"`` for a Fisher matrix (and K-FAC of one): the
    Fisher weights each example's outer product by its weight in the batch mean.
    ``"none"`` is averaged like the mean."""
    if isinstance(loss, keras.losses.Loss) and reduction_of(loss) == "sum":
        raise ValueError(
            f"a Fisher matrix needs the batch loss as a mean over examples; the loss "
            f"{loss_name(loss)!r} has reduction='sum'. Use the default reduction "
            "'sum_over_batch_size' (the Fisher of the sum is N times it), or GGNOperator, "
            "which takes the sum."
        )


def compiled_loss(model: Any) -> tuple[Any, Any]:
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


def output_entries(model: Any, outputs: Any) -> list[tuple[str, Any]]:
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


def per_output(
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
    order, :func:`output_entries`) or a dict keyed by output name (``None`` entries skip
    an output); ``loss_weights`` likewise (default 1). ``y`` and ``sample_weight`` are a
    single array for a single output, or a dict by output name or (for a model whose
    outputs are a list) a list per output; a list for a model with dict outputs is
    refused (:func:`positional_labels_error`). One ``sample_weight`` array applies to
    every output. The value is Σ_o w_o L_o(y_o, ŷ_o), each L_o the batch's share of the
    dataset loss under the loss's reduction (:func:`reduction_of`): the batch mean for
    mean-type reductions and ``"none"``, the batch sum times ``sum_scale`` = N/n_b for
    ``"sum"``.

    This class decides the terms (:meth:`terms`) and resolves each loss in ``dtype`` (a
    dtype of any engine); each engine's subclass evaluates them with its own arithmetic
    (``value`` and ``__call__``).
    """

    def __init__(self, loss: Any, loss_weights: Any, dtype: Any) -> None:
        self.loss = loss
        self.loss_weights = loss_weights
        self.dtype = dtype
        self.dtype_name = dtype_name(dtype)
        self._resolved: dict[int, ResolvedLoss] = {}
        for item in self._leaves(loss):
            self._resolved[id(item)] = resolve_loss(item, self.dtype_name)

    @staticmethod
    def _leaves(loss: Any) -> list[Any]:
        if isinstance(loss, dict):
            return [v for v in loss.values() if v is not None]
        if isinstance(loss, (list, tuple)):
            return [v for v in loss if v is not None]
        return [loss]

    def terms(self, model: Any, y: Any, outputs: Any, sample_weight: Any) -> list[LossTerm]:
        """One :class:`LossTerm` per output that has a loss, in the model's output order."""
        entries = output_entries(model, outputs)
        names = [name for name, _ in entries]
        losses = per_output(self.loss, names, "loss", broadcast=True)
        weights: list[Any]
        if isinstance(self.loss_weights, (int, float)):
            weights = [float(self.loss_weights)] * len(names)
        elif self.loss_weights is None:
            weights = [None] * len(names)
        else:
            weights = per_output(self.loss_weights, names, "loss_weights", broadcast=False)
        if len(names) == 1 and isinstance(y, (list, tuple)) and len(y) == 1:
            y = y[0]
        if len(names) == 1 and isinstance(y, dict) and len(y) == 1:
            y = next(iter(y.values()))
        by_name = isinstance(outputs, dict)
        labels = per_output(y, names, "y (the labels)", broadcast=False, by_name_only=by_name)
        if isinstance(sample_weight, (list, tuple, dict)):
            sample_weights = per_output(
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

    def resolved(self, term: LossTerm) -> LossCallable:
        """The loss callable of ``term`` as it is evaluated (in this loss's dtype)."""
        return self._resolved[id(term.loss)].call

    def resolved_loss(self, loss: Any) -> ResolvedLoss:
        """The :class:`ResolvedLoss` of an item of the loss spec."""
        return self._resolved[id(loss)]


# -- the refusals every engine raises while it evaluates a loss ---------------------------
def integer_output_error(name: str, dtype: Any) -> TypeError:
    """A model output of integer (or boolean) dtype, which a loss cannot differentiate."""
    return TypeError(
        f"model output {name!r} has dtype {dtype_name(dtype)}: a loss of integer (or "
        "boolean) outputs has no derivative with respect to the weights. Return the "
        "floating-point logits or probabilities from the model."
    )


def check_reduction_with_weights(
    loss_callable: Any, loss: Any, name: str, sample_weight: Any
) -> None:
    """Refuse ``reduction="mean_with_sample_weight"`` with sample weights: it divides each
    batch by that batch's total weight, so the curvature would depend on the batching."""
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


#: The start of :func:`unweighted_callable_error`'s message (engines re-raise it as is).
UNWEIGHTED_CALLABLE = "sample weights need a Keras loss"


def unweighted_callable_error() -> ValueError:
    """Sample weights given to a plain callable loss, which cannot weight examples."""
    return ValueError(
        f"{UNWEIGHTED_CALLABLE} (a name or a keras.losses.Loss): a plain callable "
        "(y_true, y_pred) -> scalar cannot weight examples."
    )


def misfit_error(loss: Any, name: str, y: Any, pred_shape: Any, err: Exception) -> ValueError:
    """The loss raised ``err`` on labels ``y`` against the predictions of output ``name``
    (of shape ``pred_shape``): say what was compared."""
    y_shape = getattr(y, "shape", None)
    return ValueError(
        f"the loss {loss_name(loss)} does not fit model output {name!r}: labels of "
        f"shape {y_shape} and dtype {getattr(y, 'dtype', type(y).__name__)} against "
        f"predictions of shape {pred_shape}. {err}"
    )


def sum_without_count_error(loss: Any) -> ValueError:
    """A ``reduction="sum"`` loss evaluated without the number of examples N."""
    return ValueError(
        f"the loss {loss_name(loss)} has reduction='sum': its batch sums need "
        "the number of examples of the dataset, which this evaluation lacks."
    )


def non_scalar_error(shape: Any) -> ValueError:
    """A loss that returned more than a scalar."""
    return ValueError(
        f"the loss returned shape {shape}, not a scalar. A callable loss must "
        "return the mean over the batch; for per-example losses pass a Keras loss."
    )
