"""Stability thresholds of optimizers on a quadratic: the "edge of stability".

On the quadratic ``f(θ) = ½ θᵀ A θ`` an optimizer with a fixed step size η (and a
fixed diagonal preconditioner P, for the adaptive ones) is a linear recurrence; it
diverges along an eigenvector of the relevant matrix as soon as that eigenvalue
exceeds a threshold. Under full-batch training, the sharpness rises to about that
threshold and hovers there (Cohen, Kaur, Li, Kolter & Talwalkar, ICLR 2021, "Gradient
descent on neural networks typically occurs at the edge of stability"; for adaptive
methods: Cohen, Ghorbani, Krishnan, Agarwal, Medapati, Badura, Suo, Cardoze, Nado,
Dahl & Gilmer 2022, "Adaptive gradient methods at the edge of stability").

Thresholds, with η the learning rate (Keras' conventions):

========================  ==================================  ===================
optimizer                 threshold                           for the matrix
========================  ==================================  ===================
SGD                       2/η                                 H
SGD, momentum β           (2 + 2β)/η                          H
SGD, Nesterov β           (2 + 2β)/((1 + 2β)η)                H
Adam, AdamW (β₁)          (2 + 2β₁)/((1 − β₁)η)  (38/η)       P⁻¹H
RMSprop, momentum μ       (2 + 2μ)/η  (2/η without)           P⁻¹H
Adagrad                   2/η                                 P⁻¹H
========================  ==================================  ===================

H is the loss Hessian (measure ``spectra.eigenvalues(op)``); P⁻¹H is the
preconditioned Hessian, whose eigenvalues are those of the symmetric P^{-1/2} H P^{-1/2}
(measure ``spectra.eigenvalues(spectra.preconditioned(op, optimizer))``);
:func:`threshold_matrix` says which one a threshold is for.

Derivations (one eigen-direction with eigenvalue λ, a = ηλ):

* Keras SGD with momentum is heavy ball: ``m ← βm − η g; θ ← θ + m``, i.e.
  θ_{t+1} = θ_t − η g_t + β(θ_t − θ_{t−1}); characteristic polynomial
  z² − (1 + β − a) z + β, stable for 0 <= β < 1 iff a < 2 + 2β (Polyak 1964).
* Keras Nesterov: ``m ← βm − η g; θ ← θ + βm − η g``; its polynomial is
  z² − (1 − a)(1 + β) z + (1 − a)β, stable iff 0 < a < (2 + 2β)/(1 + 2β)
  (Jury criterion at z = −1).
* Adam with P frozen: ``m ← β₁m + (1 − β₁)g; θ ← θ − η P⁻¹ m``, so on an eigenvector
  of P⁻¹H with eigenvalue λ: z² − (1 + β₁ − (1 − β₁)a) z + β₁, stable iff
  a < (2 + 2β₁)/(1 − β₁) (Cohen et al. 2022). This is the long-run threshold: the bias
  correction 1/(1 − β₁^t) of the first moment makes early steps larger.
* RMSprop with momentum: ``mom ← μ mom + η P⁻¹ g; θ ← θ − mom`` (heavy ball on P⁻¹H);
  Adagrad is gradient descent on P⁻¹H (its P only grows, so the threshold applies to
  the current P).

Decoupled weight decay (AdamW) shrinks θ by η·wd per step, outside the preconditioner;
it moves the threshold of P⁻¹H by O(wd), which the formulas above neglect.

Learning-rate schedules: for an optimizer object, η is the optimizer's current learning
rate (``optimizer.learning_rate``, which evaluates a schedule at
``optimizer.iterations``: the rate of the next step).

:func:`stability_threshold_of` gives the threshold with what a figure or a report needs:
its formula, the optimizer, η, the momentum terms, the matrix it bounds and a legend text
(:class:`StabilityThreshold`). It also reads an optimizer as a compiled ``.keras`` file
stores it (``{"class_name": "SGD", "config": {...}}``) or its ``get_config()``
dictionary. This module does not import TensorFlow.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "StabilityThreshold",
    "gradient_descent_threshold",
    "stability_threshold",
    "stability_threshold_of",
    "threshold_matrix",
]

# Hyperparameters each optimizer's threshold depends on, with Keras' defaults.
_RELEVANT = {
    "sgd": {"momentum": 0.0, "nesterov": False},
    "adam": {"beta_1": 0.9},
    "adamw": {"beta_1": 0.9},
    "rmsprop": {"momentum": 0.0},
    "adagrad": {},
}
# Keras hyperparameters that change the preconditioner but not the threshold formula:
# accepted (so that a Keras optimizer config can be passed) and ignored.
_IRRELEVANT = {
    "sgd": set(),
    "adam": {"beta_2", "epsilon", "amsgrad"},
    "adamw": {"beta_2", "epsilon", "amsgrad", "weight_decay"},
    "rmsprop": {"rho", "epsilon", "centered"},
    "adagrad": {"epsilon", "initial_accumulator_value"},
}
_MATRIX = {
    "sgd": "hessian",
    "adam": "preconditioned",
    "adamw": "preconditioned",
    "rmsprop": "preconditioned",
    "adagrad": "preconditioned",
}


def _kind_of(optimizer_or_name: Any) -> str:
    """The lower-case Keras class name of an optimizer, or of an optimizer name."""
    if isinstance(optimizer_or_name, str):
        kind = optimizer_or_name.lower()
    else:
        optimizer = getattr(optimizer_or_name, "inner_optimizer", optimizer_or_name)
        kind = type(optimizer).__name__.lower()
    if kind not in _RELEVANT:
        raise ValueError(
            f"no stability threshold for optimizer {optimizer_or_name!r}; supported: "
            f"{', '.join(sorted(_RELEVANT))} (Keras optimizers or their names)"
        )
    return kind


def threshold_matrix(optimizer_or_name: Any) -> str:
    """Which matrix :func:`stability_threshold` is for: ``"hessian"`` (SGD: compare with
    the top eigenvalue of H) or ``"preconditioned"`` (Adam, AdamW, RMSprop, Adagrad:
    compare with the top eigenvalue of P⁻¹H, see :func:`spectra.preconditioned`)."""
    return _MATRIX[_kind_of(optimizer_or_name)]


def _optimizer_hyperparameters(optimizer: Any, kind: str) -> tuple[float, dict[str, Any]]:
    """Current learning rate and the relevant hyperparameters of a Keras optimizer."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    learning_rate = float(optimizer.learning_rate)
    hyper = {name: getattr(optimizer, name) for name in _RELEVANT[kind]}
    return learning_rate, hyper


def _check_fraction(name: str, value: Any) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}") from error
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return value


def stability_threshold(
    optimizer_or_name: Any, learning_rate: float | None = None, **hyper: Any
) -> float:
    """The sharpness above which the optimizer is unstable on a quadratic.

    ``optimizer_or_name`` is a Keras optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, or a
    ``LossScaleOptimizer`` around one) or its name (case-insensitive: ``"sgd"``,
    ``"adam"``, ...). With an optimizer, η is its current learning rate (a schedule is
    evaluated at ``optimizer.iterations``) and its momentum, Nesterov flag or β₁ are read
    from it; ``learning_rate`` and ``hyper`` override them. With a name,
    ``learning_rate`` is required and ``hyper`` gives ``momentum``/``nesterov`` (SGD),
    ``beta_1`` (Adam, AdamW) or ``momentum`` (RMSprop), Keras' defaults otherwise; the
    other Keras hyperparameters of that optimizer (``beta_2``, ``epsilon``, ...) are
    accepted and do not change the threshold.

    Returns, with the formulas of the module docstring: 2/η (SGD), (2 + 2β)/η (SGD with
    heavy-ball momentum β), (2 + 2β)/((1 + 2β)η) (SGD with Nesterov momentum),
    (2 + 2β₁)/((1 − β₁)η) (Adam, AdamW; Cohen et al. 2022), (2 + 2μ)/η (RMSprop with
    momentum μ) and 2/η (Adagrad). The SGD thresholds are for the Hessian H, the others
    for the preconditioned Hessian P⁻¹H (:func:`threshold_matrix`).
    """
    kind = _kind_of(optimizer_or_name)
    if isinstance(optimizer_or_name, str):
        if learning_rate is None:
            raise ValueError(
                f"learning_rate is required with the optimizer name {optimizer_or_name!r}"
            )
        values = dict(_RELEVANT[kind])
    else:
        optimizer_rate, values = _optimizer_hyperparameters(optimizer_or_name, kind)
        if learning_rate is None:
            learning_rate = optimizer_rate
    unknown = set(hyper) - set(_RELEVANT[kind]) - _IRRELEVANT[kind]
    if unknown:
        valid = sorted(set(_RELEVANT[kind]) | _IRRELEVANT[kind])
        raise ValueError(f"unknown hyperparameter(s) {sorted(unknown)} for {kind}; valid: {valid}")
    values.update({name: value for name, value in hyper.items() if name in _RELEVANT[kind]})
    if isinstance(learning_rate, (bool, np.bool_)):
        raise TypeError(f"learning_rate must be a positive number, got the bool {learning_rate!r}")
    try:
        eta = float(learning_rate)
    except (TypeError, ValueError) as error:
        message = f"learning_rate must be a positive number, got {learning_rate!r}"
        raise ValueError(message) from error
    if not (eta > 0 and math.isfinite(eta)):
        raise ValueError(f"learning_rate must be a positive finite number, got {eta}")
    if kind == "sgd":
        beta = _check_fraction("momentum", values["momentum"])
        if bool(values["nesterov"]):
            threshold = (2.0 + 2.0 * beta) / ((1.0 + 2.0 * beta) * eta)
        else:
            threshold = (2.0 + 2.0 * beta) / eta
    elif kind in ("adam", "adamw"):
        beta_1 = _check_fraction("beta_1", values["beta_1"])
        threshold = (2.0 + 2.0 * beta_1) / ((1.0 - beta_1) * eta)
    elif kind == "rmsprop":
        threshold = (2.0 + 2.0 * _check_fraction("momentum", values["momentum"])) / eta
    else:
        threshold = 2.0 / eta
    if not math.isfinite(threshold):
        raise ValueError(
            f"learning_rate {eta:.3g} is too small: the {kind} stability threshold "
            "overflows float64 (it is a few units over η); give a larger learning rate"
        )
    return threshold


# --------------------------------------------------------------------------- described thresholds

_REFERENCE_GD = "Cohen, Kaur, Li, Kolter & Talwalkar, ICLR 2021"
_REFERENCE_ADAPTIVE = "Cohen et al., Adaptive gradient methods at the edge of stability, 2022"
_NAMES = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "rmsprop": "RMSprop",
    "adagrad": "Adagrad",
}
_SYMBOLS = {("sgd", "momentum"): "β", ("rmsprop", "momentum"): "μ", ("adam", "beta_1"): "β₁"}


@dataclass(frozen=True)
class StabilityThreshold:
    """A stability threshold with what it was computed from.

    ``value`` is the threshold, ``formula`` its expression (``"2/η"``), ``optimizer`` the
    optimizer's name, ``learning_rate`` the η used, ``parameters`` the momentum terms
    (``{"β": 0.9}``, ``{"β₁": 0.9}``), ``preconditioned`` whether it bounds the
    preconditioned sharpness λ_max(P⁻¹H) rather than λ_max(H) (:func:`threshold_matrix`),
    ``reference`` the paper. :attr:`label` is a legend text.
    """

    value: float
    formula: str
    optimizer: str
    learning_rate: float
    parameters: dict[str, float]
    preconditioned: bool
    reference: str

    @property
    def label(self) -> str:
        """E.g. ``"SGD with momentum (η = 0.1, β = 0.9): (2+2β)/η = 38"``."""
        settings = [f"η = {self.learning_rate:g}"]
        settings += [f"{name} = {value:g}" for name, value in self.parameters.items()]
        text = f"{self.optimizer} ({', '.join(settings)}): {self.formula} = {self.value:.4g}"
        if self.preconditioned:
            text += " (for λ_max(P⁻¹H))"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "label": self.label}


def gradient_descent_threshold(learning_rate: float) -> StabilityThreshold:
    """2/η, the threshold of plain gradient descent with step size η (Cohen et al. 2021)."""
    value = stability_threshold("sgd", learning_rate)
    rate = float(learning_rate)
    return StabilityThreshold(value, "2/η", "gradient descent", rate, {}, False, _REFERENCE_GD)


def stability_threshold_of(
    optimizer: Any, learning_rate: float | None = None
) -> StabilityThreshold:
    """:func:`stability_threshold` with its formula, parameters and matrix.

    ``optimizer`` is what :func:`stability_threshold` takes (a Keras optimizer or a name
    with ``learning_rate``), or an optimizer as a dictionary: its ``get_config()`` or the
    serialized ``{"class_name": ..., "config": ...}`` a compiled ``.keras`` file stores.
    ``learning_rate`` overrides the optimizer's η.

    Raises
    ------
    ValueError
        an optimizer without a known threshold, or a dictionary with a
        learning-rate schedule (no single η) and no ``learning_rate``.
    """
    if isinstance(optimizer, Mapping):
        name, config = _name_and_config(optimizer)
        kind = _kind_of(re.sub(r"_\d+$", "", name.lower()))
        if learning_rate is None:
            learning_rate = _configured_rate(config)
        hyper = {
            key: config[key] for key in _RELEVANT[kind] if key in config and config[key] is not None
        }
        value = stability_threshold(kind, learning_rate, **hyper)
        values = {**_RELEVANT[kind], **hyper}
    else:
        kind = _kind_of(optimizer)
        value = stability_threshold(optimizer, learning_rate)
        if isinstance(optimizer, str):
            values = dict(_RELEVANT[kind])
        else:
            rate, values = _optimizer_hyperparameters(optimizer, kind)
            learning_rate = rate if learning_rate is None else learning_rate
    # stability_threshold has refused a name without a learning rate.
    assert learning_rate is not None
    rate = float(learning_rate)
    momentum = float(values.get("momentum", 0.0) or 0.0)
    parameters: dict[str, float] = {}
    name = _NAMES[kind]
    if kind == "sgd" and momentum > 0:
        parameters[_SYMBOLS["sgd", "momentum"]] = momentum
        if values.get("nesterov"):
            name, formula = "SGD with Nesterov momentum", "(2+2β)/((1+2β)η)"
        else:
            name, formula = "SGD with momentum", "(2+2β)/η"
    elif kind in ("adam", "adamw"):
        parameters[_SYMBOLS["adam", "beta_1"]] = float(values["beta_1"])
        formula = "(2+2β₁)/((1−β₁)η)"
    elif kind == "rmsprop" and momentum > 0:
        parameters[_SYMBOLS["rmsprop", "momentum"]] = momentum
        formula = "(2+2μ)/η"
    else:
        formula = "2/η"
    preconditioned = _MATRIX[kind] == "preconditioned"
    reference = _REFERENCE_ADAPTIVE if preconditioned else _REFERENCE_GD
    return StabilityThreshold(value, formula, name, rate, parameters, preconditioned, reference)


def _name_and_config(optimizer: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    if "class_name" in optimizer and isinstance(optimizer.get("config"), Mapping):
        return str(optimizer["class_name"]), optimizer["config"]
    if "name" in optimizer:
        # A get_config() dictionary carries the instance name ("adam", "adam_1", "SGD").
        return str(optimizer["name"]), optimizer
    raise ValueError(
        "an optimizer dictionary needs a 'name' (a get_config() dictionary) or "
        "'class_name' and 'config' (a serialized optimizer)."
    )


def _configured_rate(config: Mapping[str, Any]) -> Any:
    rate = config.get("learning_rate")
    if isinstance(rate, Mapping):
        raise ValueError(
            "the optimizer uses a learning-rate schedule "
            f"({rate.get('class_name', 'schedule')}), so there is no single threshold; give "
            "the learning rate explicitly."
        )
    if rate is None:
        raise ValueError("the optimizer's configuration has no learning_rate.")
    return rate
