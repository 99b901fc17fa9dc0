"""Stability thresholds: the formulas, checked against Keras' own optimizer updates."""

import keras
import numpy as np
import pytest

from spectra.stability import (
    gradient_descent_threshold,
    stability_threshold,
    stability_threshold_of,
)


def _grows(optimizer: keras.optimizers.Optimizer, curvature: float, steps: int = 120) -> bool:
    """Run ``optimizer`` on L(w) = curvature·w²/2 from w = 1: True when |w| blows up."""
    weight = keras.Variable(np.array([1.0], dtype=np.float64), dtype="float64")
    for _ in range(steps):
        gradient = curvature * weight.value
        optimizer.apply([gradient], [weight])
    return bool(abs(float(weight.numpy()[0])) > 1.0)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: keras.optimizers.SGD(0.1), 2 / 0.1),
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), (2 + 1.8) / 0.1),
        (
            lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
            (2 + 1.8) / ((1 + 1.8) * 0.1),
        ),
    ],
    ids=["gradient descent", "heavy ball", "nesterov"],
)
def test_threshold_separates_stable_from_unstable_keras_updates(make, expected):
    threshold = stability_threshold(make())
    assert threshold == pytest.approx(expected, rel=1e-6)  # Keras keeps η in float32
    # 5 % below the threshold the iteration contracts, 5 % above it diverges.
    assert not _grows(make(), 0.95 * threshold)
    assert _grows(make(), 1.05 * threshold)


def test_adam_threshold_is_for_the_preconditioned_sharpness():
    adam = stability_threshold_of(keras.optimizers.Adam(1e-3, beta_1=0.9))
    assert adam.value == pytest.approx(38 / 1e-3, rel=1e-6)
    assert adam.formula == "(2+2β₁)/((1−β₁)η)" and adam.preconditioned
    assert "Cohen" in adam.reference
    assert "(η = 0.001, β₁ = 0.9)" in adam.label and "P⁻¹H" in adam.label
    adamw = stability_threshold_of(keras.optimizers.AdamW(2e-3, beta_1=0.8))
    assert adamw.value == pytest.approx(3.6 / (0.2 * 2e-3))
    rmsprop = stability_threshold_of(keras.optimizers.RMSprop(0.01))
    assert rmsprop.value == pytest.approx(200.0) and rmsprop.preconditioned


def test_serialized_optimizers_as_stored_in_a_keras_file():
    stored = keras.optimizers.serialize(keras.optimizers.SGD(0.05, momentum=0.5))
    assert stability_threshold(stored) == pytest.approx(3.0 / 0.05)
    config = keras.optimizers.Adam(1e-2).get_config()
    assert stability_threshold(config) == pytest.approx(38 / 1e-2)
    # The learning rate can be overridden (a CLI --lr).
    overridden = stability_threshold_of(stored, learning_rate=0.1)
    assert overridden.value == pytest.approx(30.0) and overridden.learning_rate == 0.1


def test_a_schedule_gives_its_current_value():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    optimizer = keras.optimizers.SGD(schedule)
    weight = keras.Variable(np.zeros(1, dtype=np.float32))
    optimizer.build([weight])
    assert stability_threshold(optimizer) == pytest.approx(20.0)
    optimizer.iterations.assign(2)
    assert stability_threshold(optimizer) == pytest.approx(80.0)
    # Serialized, the schedule has no single value.
    with pytest.raises(ValueError, match="schedule"):
        stability_threshold(keras.optimizers.serialize(optimizer))


def test_unknown_optimizers_and_bad_input():
    with pytest.raises(ValueError, match="no stability threshold is known.*Adagrad"):
        stability_threshold(keras.optimizers.Adagrad(0.1))
    with pytest.raises(ValueError, match="Keras optimizer or its config"):
        stability_threshold(0.1)
    with pytest.raises(ValueError, match="positive"):
        gradient_descent_threshold(0.0)
    assert gradient_descent_threshold(0.2).label == "gradient descent (η = 0.2): 2/η = 10"
