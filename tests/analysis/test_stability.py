"""Stability thresholds: the formulas, and Keras' own optimizers on a quadratic."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra.analysis.stability import (
    gradient_descent_threshold,
    stability_threshold,
    stability_threshold_of,
    threshold_matrix,
)


def test_formulas_by_name():
    assert stability_threshold("sgd", 0.1) == pytest.approx(20.0)
    assert stability_threshold("SGD", 0.1, momentum=0.9) == pytest.approx(38.0)
    assert stability_threshold("sgd", 0.1, momentum=0.9, nesterov=True) == pytest.approx(
        3.8 / 2.8 / 0.1
    )
    assert stability_threshold("sgd", 0.1, nesterov=True) == pytest.approx(20.0)
    assert stability_threshold("adam", 0.01) == pytest.approx(3800.0)  # 38/η
    assert stability_threshold("AdamW", 0.01, beta_1=0.5) == pytest.approx(600.0)
    assert stability_threshold("rmsprop", 0.1) == pytest.approx(20.0)
    assert stability_threshold("rmsprop", 0.1, momentum=0.5) == pytest.approx(30.0)
    assert stability_threshold("adagrad", 0.1) == pytest.approx(20.0)
    # Keras hyperparameters that do not move the threshold are accepted.
    assert stability_threshold("adam", 0.01, beta_2=0.99, epsilon=1e-8) == pytest.approx(3800.0)
    assert threshold_matrix("sgd") == "hessian"
    for name in ("adam", "adamw", "rmsprop", "adagrad"):
        assert threshold_matrix(name) == "preconditioned"


def test_formulas_from_optimizers_and_schedules():
    assert stability_threshold(keras.optimizers.SGD(0.05, momentum=0.5)) == pytest.approx(60.0)
    assert stability_threshold(keras.optimizers.Adam(0.001, beta_1=0.8)) == pytest.approx(18000.0)
    wrapped = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
    assert stability_threshold(wrapped) == pytest.approx(3800.0)
    assert threshold_matrix(wrapped) == "preconditioned"
    # Overrides: a rate of one's choosing, or another momentum.
    assert stability_threshold(keras.optimizers.SGD(0.05), 0.1) == pytest.approx(20.0)
    assert stability_threshold(keras.optimizers.SGD(0.05), momentum=0.5) == pytest.approx(60.0)
    # A schedule is read at the optimizer's current iteration.
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    optimizer = keras.optimizers.SGD(schedule)
    variable = keras.Variable(np.ones(2))
    for _ in range(3):
        optimizer.apply([tf.zeros(2)], [variable])
    assert stability_threshold(optimizer) == pytest.approx(2 / (0.1 * 0.5**3), rel=1e-6)


def _distances(optimizer, curvature: float, steps: int = 300, start: float = 1e-8):
    """(final, largest) |θ_t|/|θ_0| for Keras' ``optimizer`` on f(θ) = curvature·θ²/2.

    100 zero-gradient steps first let bias corrections reach 1 without moving θ; a
    tiny start keeps the gradients far below ε = 1, so an adaptive P stays ≈ 1 and the
    optimizer is the linear recurrence the threshold is derived for. (Once θ has grown
    enough for P to grow, adaptive methods stabilize themselves: hence the largest
    distance as the sign of instability.)
    """
    variable = keras.Variable(np.array([start]), dtype="float64")

    @tf.function
    def step(scale):
        optimizer.apply([scale * curvature * variable.value], [variable])

    for _ in range(100):
        step(tf.constant(0.0, tf.float64))
    largest = 0.0
    for _ in range(steps):
        step(tf.constant(1.0, tf.float64))
        largest = max(largest, abs(float(variable.numpy()[0])) / start)
    return abs(float(variable.numpy()[0])) / start, largest


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "heavy_ball": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.1, beta_2=0.5, epsilon=1.0),
    "adamw": lambda: keras.optimizers.AdamW(0.1, beta_2=0.5, epsilon=1.0, weight_decay=0.0),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.1, momentum=0.5, epsilon=1.0),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1, epsilon=1.0, initial_accumulator_value=0.0),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_keras_optimizers_turn_unstable_at_the_threshold(name):
    threshold = stability_threshold(OPTIMIZERS[name]())
    # Deterministic: 5 % below the threshold θ shrinks, 5 % above it grows.
    assert _distances(OPTIMIZERS[name](), 0.95 * threshold)[0] < 1.0
    assert _distances(OPTIMIZERS[name](), 1.05 * threshold)[1] > 100.0


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="no stability threshold for optimizer 'lion'"):
        stability_threshold("lion", 0.1)
    with pytest.raises(ValueError, match="no stability threshold"):
        stability_threshold(keras.optimizers.Nadam())
    with pytest.raises(ValueError, match="learning_rate is required"):
        stability_threshold("sgd")
    for rate in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            stability_threshold("sgd", rate)
    with pytest.raises(ValueError, match="positive number"):
        stability_threshold("sgd", "fast")
    # a bool is not a learning rate (True used to give 2.0)
    for flag in (True, False, np.bool_(True)):
        with pytest.raises(
            TypeError, match="^learning_rate must be a positive number, got the bool"
        ):
            stability_threshold("sgd", flag)
    # a rate whose threshold overflows (1e-320 used to give inf)
    for name, rate in (("sgd", 1e-320), ("adam", 1e-307), ("rmsprop", 5e-324)):
        with pytest.raises(ValueError, match=f"^learning_rate .* is too small: the {name}"):
            stability_threshold(name, rate)
    assert stability_threshold("sgd", 1e-300) == pytest.approx(2e300)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
        stability_threshold("sgd", 0.1, momentum=1.0)
    with pytest.raises(ValueError, match=r"beta_1 must be in \[0, 1\)"):
        stability_threshold("adam", 0.1, beta_1=-0.1)
    with pytest.raises(ValueError, match=r"unknown hyperparameter\(s\) \['beta_1'\] for sgd"):
        stability_threshold("sgd", 0.1, beta_1=0.9)


# --------------------------------------------------------------------------- described thresholds


def test_described_thresholds_name_their_formula_and_matrix():
    adam = stability_threshold_of(keras.optimizers.Adam(1e-3, beta_1=0.9))
    assert adam.value == pytest.approx(38 / 1e-3, rel=1e-6)  # Keras keeps η in float32
    assert adam.formula == "(2+2β₁)/((1−β₁)η)" and adam.preconditioned
    assert "Cohen" in adam.reference
    assert adam.label.startswith("Adam (η = 0.001, β₁ = 0.9): (2+2β₁)/((1−β₁)η) = 3.8e+04")
    assert adam.label.endswith("(for λ_max(P⁻¹H))")
    nesterov = stability_threshold_of(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True))
    assert nesterov.optimizer == "SGD with Nesterov momentum" and not nesterov.preconditioned
    assert nesterov.formula == "(2+2β)/((1+2β)η)" and nesterov.parameters == {
        "β": pytest.approx(0.9)
    }
    assert stability_threshold_of("rmsprop", 0.1).formula == "2/η"
    assert gradient_descent_threshold(0.2).label == "gradient descent (η = 0.2): 2/η = 10"
    assert gradient_descent_threshold(0.2).to_dict()["value"] == pytest.approx(10.0)


def test_optimizers_as_stored_in_a_keras_file():
    stored = keras.optimizers.serialize(keras.optimizers.SGD(0.05, momentum=0.5))
    described = stability_threshold_of(stored)
    assert described.value == pytest.approx(3.0 / 0.05)
    assert described.optimizer == "SGD with momentum"
    config = keras.optimizers.Adam(1e-2).get_config()  # named "adam", "adam_1", ...
    assert stability_threshold_of(config).value == pytest.approx(38 / 1e-2)
    # The learning rate can be overridden (a command line's --lr).
    overridden = stability_threshold_of(stored, learning_rate=0.1)
    assert overridden.value == pytest.approx(30.0) and overridden.learning_rate == 0.1
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    with pytest.raises(ValueError, match="schedule"):
        stability_threshold_of(keras.optimizers.serialize(keras.optimizers.SGD(schedule)))
    with pytest.raises(ValueError, match="no stability threshold"):
        stability_threshold_of({"class_name": "Lion", "config": {"learning_rate": 0.1}})
    with pytest.raises(ValueError, match="needs a 'name'"):
        stability_threshold_of({"learning_rate": 0.1})
