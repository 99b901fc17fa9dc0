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
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["stability_threshold", "threshold_matrix"]

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
            return (2.0 + 2.0 * beta) / ((1.0 + 2.0 * beta) * eta)
        return (2.0 + 2.0 * beta) / eta
    if kind in ("adam", "adamw"):
        beta_1 = _check_fraction("beta_1", values["beta_1"])
        return (2.0 + 2.0 * beta_1) / ((1.0 - beta_1) * eta)
    if kind == "rmsprop":
        return (2.0 + 2.0 * _check_fraction("momentum", values["momentum"])) / eta
    return 2.0 / eta
