"""Stability thresholds of optimizers: the sharpness at which training turns unstable.

On a quadratic with curvature λ, an optimizer's iteration is stable only while λ stays below a
threshold set by its step size η and momentum. Neural networks trained with these optimizers
drive the curvature up to that threshold and hover there (the *edge of stability*):

* gradient descent and SGD without momentum: **2/η** (Cohen, Kaur, Li, Kolter & Talwalkar,
  "Gradient descent on neural networks typically occurs at the edge of stability", ICLR 2021);
* heavy-ball momentum β (Keras ``SGD(momentum=β)``): **(2 + 2β)/η**;
* Nesterov momentum β (``SGD(momentum=β, nesterov=True)``): **(2 + 2β)/((1 + 2β)η)**
  (Cohen et al. 2021, appendix; the root −1 of the iteration's characteristic polynomial);
* Adam and AdamW with β₁: **(2 + 2β₁)/((1 − β₁)η)**, 38/η for β₁ = 0.9, a threshold for the
  *preconditioned* sharpness, the top eigenvalue of P⁻¹H with P = diag(√v̂ + ε) (Cohen et al.,
  "Adaptive gradient methods at the edge of stability", 2022);
* RMSprop: 2/η (with momentum β, (2 + 2β)/η), also for the preconditioned sharpness.

AdamW's decoupled weight decay and Adam's ε are left out of the formulas. Optimizers are read
by duck typing (a Keras optimizer, or its ``get_config()`` / serialized dictionary as stored in
a compiled ``.keras`` file), so this module does not import TensorFlow.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "StabilityThreshold",
    "gradient_descent_threshold",
    "stability_threshold",
    "stability_threshold_of",
]

_REFERENCE_GD = "Cohen, Kaur, Li, Kolter & Talwalkar, ICLR 2021"
_REFERENCE_ADAPTIVE = "Cohen et al., Adaptive gradient methods at the edge of stability, 2022"


@dataclass(frozen=True)
class StabilityThreshold:
    """A stability threshold with what it was computed from.

    ``value`` is the threshold, ``formula`` its expression (``"2/η"``), ``optimizer`` the
    optimizer's name, ``learning_rate`` the η used, ``parameters`` the momentum terms
    (``{"momentum": 0.9}``, ``{"beta_1": 0.9}``), ``preconditioned`` whether it bounds the
    preconditioned sharpness λ_max(P⁻¹H) rather than λ_max(H), ``label`` a legend text and
    ``reference`` the paper.
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
        """Legend text, e.g. ``"SGD with momentum (η = 0.1, β = 0.9): (2+2β)/η = 38"``."""
        settings = [f"η = {self.learning_rate:g}"]
        settings += [f"{_SYMBOLS.get(k, k)} = {v:g}" for k, v in self.parameters.items()]
        text = f"{self.optimizer} ({', '.join(settings)}): {self.formula} = {self.value:.4g}"
        if self.preconditioned:
            text += " (for λ_max(P⁻¹H))"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "label": self.label}


_SYMBOLS = {"momentum": "β", "beta_1": "β₁"}


def gradient_descent_threshold(learning_rate: float) -> StabilityThreshold:
    """2/η, the threshold of plain gradient descent with step size η."""
    rate = _check_rate(learning_rate)
    return StabilityThreshold(2.0 / rate, "2/η", "gradient descent", rate, {}, False, _REFERENCE_GD)


def stability_threshold_of(
    optimizer: Any, learning_rate: float | None = None
) -> StabilityThreshold:
    """The threshold of ``optimizer`` with its formula (see the module docstring).

    ``optimizer`` is a Keras optimizer, its ``get_config()`` dictionary, or the serialized form
    ``{"class_name": "Adam", "config": {...}}``. ``learning_rate`` overrides the optimizer's η.

    Raises:
        ValueError: an optimizer without a known threshold, a learning-rate schedule (no single
            η) when ``learning_rate`` is not given, or a non-positive η.
    """
    name, config = _name_and_config(optimizer)
    # A get_config() dictionary has the instance name ("adam", "adam_1", "SGD").
    key = re.sub(r"_\d+$", "", name.lower())
    rate = _check_rate(
        learning_rate if learning_rate is not None else _learning_rate(optimizer, config)
    )
    if key == "sgd":
        momentum = _number(config, "momentum", 0.0)
        if momentum == 0.0:
            return StabilityThreshold(2.0 / rate, "2/η", "SGD", rate, {}, False, _REFERENCE_GD)
        if config.get("nesterov", False):
            value = (2.0 + 2.0 * momentum) / ((1.0 + 2.0 * momentum) * rate)
            formula, label = "(2+2β)/((1+2β)η)", "SGD with Nesterov momentum"
        else:
            value = (2.0 + 2.0 * momentum) / rate
            formula, label = "(2+2β)/η", "SGD with momentum"
        return StabilityThreshold(
            value, formula, label, rate, {"momentum": momentum}, False, _REFERENCE_GD
        )
    if key in ("adam", "adamw"):
        beta = _number(config, "beta_1", 0.9)
        value = (2.0 + 2.0 * beta) / ((1.0 - beta) * rate)
        return StabilityThreshold(
            value,
            "(2+2β₁)/((1−β₁)η)",
            "Adam" if key == "adam" else "AdamW",
            rate,
            {"beta_1": beta},
            True,
            _REFERENCE_ADAPTIVE,
        )
    if key == "rmsprop":
        momentum = _number(config, "momentum", 0.0)
        if momentum == 0.0:
            return StabilityThreshold(
                2.0 / rate, "2/η", "RMSprop", rate, {}, True, _REFERENCE_ADAPTIVE
            )
        return StabilityThreshold(
            (2.0 + 2.0 * momentum) / rate,
            "(2+2β)/η",
            "RMSprop",
            rate,
            {"momentum": momentum},
            True,
            _REFERENCE_ADAPTIVE,
        )
    raise ValueError(
        f"no stability threshold is known for the optimizer {name!r}; known: SGD (with or "
        "without momentum, Nesterov), Adam, AdamW, RMSprop."
    )


def stability_threshold(optimizer: Any) -> float:
    """The sharpness at which ``optimizer`` turns unstable on a quadratic.

    * SGD without momentum (gradient descent): 2/η (Cohen et al. 2021);
    * SGD with heavy-ball momentum β: (2 + 2β)/η; with Nesterov momentum (2 + 2β)/((1 + 2β)η);
    * Adam, AdamW: (2 + 2β₁)/((1 − β₁)η), for the preconditioned sharpness λ_max(P⁻¹H),
      P = diag(√v̂ + ε) (Cohen et al. 2022); RMSprop: 2/η (momentum β: (2 + 2β)/η), likewise.

    ``optimizer`` is a Keras optimizer or its config dictionary; see
    :func:`stability_threshold_of` for the formula and the errors.
    """
    return stability_threshold_of(optimizer).value


def _name_and_config(optimizer: Any) -> tuple[str, Mapping[str, Any]]:
    if isinstance(optimizer, Mapping):
        if "class_name" in optimizer and isinstance(optimizer.get("config"), Mapping):
            return str(optimizer["class_name"]), optimizer["config"]
        if "name" in optimizer:
            return str(optimizer["name"]), optimizer
        raise ValueError(
            "an optimizer dictionary needs a 'name' (a get_config() dictionary) or "
            "'class_name' and 'config' (a serialized optimizer)."
        )
    get_config = getattr(optimizer, "get_config", None)
    if not callable(get_config):
        raise ValueError(
            f"expected a Keras optimizer or its config dictionary, got {type(optimizer).__name__}"
        )
    return type(optimizer).__name__, get_config()


def _learning_rate(optimizer: Any, config: Mapping[str, Any]) -> float:
    """η: the optimizer's current learning rate (a schedule's value at its current step)."""
    if not isinstance(optimizer, Mapping):
        rate = getattr(optimizer, "learning_rate", None)
        if rate is not None:
            return _as_float(rate, "learning_rate")
    rate = config.get("learning_rate")
    if isinstance(rate, Mapping):
        raise ValueError(
            "the optimizer uses a learning-rate schedule "
            f"({rate.get('class_name', 'schedule')}), so there is no single threshold; give "
            "the learning rate explicitly."
        )
    if rate is None:
        raise ValueError("the optimizer's configuration has no learning_rate.")
    return _as_float(rate, "learning_rate")


def _number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    return default if value is None else _as_float(value, key)


def _as_float(value: Any, name: str) -> float:
    if hasattr(value, "numpy"):
        value = value.numpy()
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the optimizer's {name} is not a number: {value!r}") from err


def _check_rate(rate: float) -> float:
    rate = float(rate)
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"the learning rate must be a positive finite number, got {rate!r}")
    return rate
