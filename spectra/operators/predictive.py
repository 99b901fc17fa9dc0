"""The predictive distribution behind a Keras loss, which the Monte Carlo Fisher samples.

A loss ℓ = κ·(−log p(y | z)) is the negative log-likelihood of a distribution over labels
given the model's output z, up to a constant κ: sparse and one-hot categorical
cross-entropy (categorical p, κ = 1), binary cross-entropy (independent Bernoulli labels,
one per output entry, κ = 1/d since Keras averages over the d entries of the last axis)
and mean squared error (N(z, I), κ = 2/d). The Fisher of ℓ is then κ·Fisher(p) =
E_ŷ~p[∇ℓ(ŷ) ∇ℓ(ŷ)ᵀ]/κ (Martens, "New insights and perspectives on the natural gradient
method", JMLR 21, 2020).

Backend-neutral: both engines' Fisher operators and K-FAC read the family here and draw
the labels with their own generators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras

from spectra.operators.keras_data import keras_loss_function

__all__ = ["PredictiveFamily", "predictive_family"]


@dataclass(frozen=True)
class PredictiveFamily:
    """The predictive distribution p(y | z) behind a Keras loss ℓ = κ·(−log p(y | z)).

    ``family``: ``"categorical"`` (cross-entropy; ``one_hot`` labels or integer ones),
    ``"bernoulli"`` (binary cross-entropy, one independent label per output entry) or
    ``"gaussian"`` (MSE: N(z, I)); ``from_logits``: whether the loss reads logits.
    """

    family: str
    from_logits: bool
    one_hot: bool = False

    def scale(self, last_axis: int | None) -> float:
        """κ for outputs whose last axis has ``last_axis`` entries (1 for a scalar
        output, None where it is unknown: a ``ValueError`` unless κ does not depend on it)."""
        if self.family == "categorical":
            return 1.0
        if last_axis is None:
            raise ValueError(
                "the Monte Carlo Fisher of a binary cross-entropy or MSE needs the size of "
                "the output's last axis, which is unknown here."
            )
        return (2.0 if self.family == "gaussian" else 1.0) / int(last_axis)


def _families() -> dict[Any, tuple[str, bool]]:
    """Keras per-example loss functions with a predictive distribution: family, one-hot."""
    return {
        keras.losses.sparse_categorical_crossentropy: ("categorical", False),
        keras.losses.categorical_crossentropy: ("categorical", True),
        keras.losses.binary_crossentropy: ("bernoulli", False),
        keras.losses.mean_squared_error: ("gaussian", False),
    }


def predictive_family(loss: Any) -> PredictiveFamily:
    """The predictive distribution behind a Keras loss spec item (a ``ValueError`` for a
    loss without one: sampling labels needs to know what the model predicts)."""
    found = keras_loss_function(loss)
    families = _families()
    if found is None or found[0] not in families:
        name = found[2] if found is not None else getattr(loss, "__name__", type(loss).__name__)
        raise ValueError(
            f"kind='mc' samples labels from the model's predictive distribution, which the "
            f"loss {name!r} does not define. Supported: sparse or one-hot categorical "
            "cross-entropy, binary cross-entropy (from logits or probabilities) and mean "
            "squared error (a Gaussian of unit variance). For other losses use "
            "kind='empirical' or GGNOperator."
        )
    fn, kwargs, name = found
    if kwargs.get("label_smoothing"):
        raise ValueError(
            f"kind='mc': the loss {name!r} has label_smoothing={kwargs['label_smoothing']}, "
            "so it is not the negative log-likelihood of a predictive distribution. Use a "
            "loss without label smoothing (the Fisher of the model), or kind='empirical'."
        )
    if kwargs.get("axis", -1) != -1 or kwargs.get("ignore_class") is not None:
        raise ValueError(
            f"kind='mc' needs the loss {name!r} with classes on the last axis and no "
            f"ignore_class; got axis={kwargs.get('axis', -1)}, "
            f"ignore_class={kwargs.get('ignore_class')}."
        )
    family, one_hot = families[fn]
    return PredictiveFamily(family, bool(kwargs.get("from_logits", False)), one_hot)
