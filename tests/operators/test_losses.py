"""One loss definition whatever the Keras reduction, independent of the batching.

``reduction="sum"`` is the sum of the per-example losses over the whole dataset (so
H = Σ_b H_b), mean-type reductions and ``"none"`` the mean over the dataset; each is
checked at several batch sizes against the dense float64 Hessian (or GGN) of that
definition, for a loss given by the user, per output in a list, and compiled into the
model with loss weights.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra import FisherOperator, GGNOperator, HessianOperator
from spectra.analysis.landscape import loss_landscape
from tests._dense import dense_hessian
from tests._gauss_newton import dense_ggn

F64 = "float64"
N = 30
BATCH_SIZES = (None, 10, 7)


def _dense(op) -> np.ndarray:
    return op @ np.eye(op.shape[0])


def _close(a: np.ndarray, b: np.ndarray, tol: float = 1e-10) -> None:
    scale = max(float(np.max(np.abs(b))), 1e-300)
    assert float(np.max(np.abs(a - b))) <= tol * scale, float(np.max(np.abs(a - b))) / scale


@pytest.fixture(scope="module")
def regression():
    """A float64 regression MLP, its data, and the dense Hessian of Σ_i (y_i − f(x_i))²."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype=F64),
            keras.layers.Dense(3, activation="tanh", dtype=F64),
            keras.layers.Dense(1, dtype=F64),
        ]
    )
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, 4))
    y = rng.normal(size=(N, 1))

    def total() -> tf.Tensor:
        return tf.reduce_sum((y - model(x)) ** 2)

    truth = dense_hessian(total, model.trainable_variables)
    return model, x, y, truth


def test_sum_reduction_is_the_dataset_sum_at_every_batch_size(regression):
    model, x, y, truth = regression
    loss = keras.losses.MeanSquaredError(reduction="sum")
    losses = []
    for batch_size in BATCH_SIZES:
        op = HessianOperator.from_keras(model, loss, (x, y), batch_size=batch_size)
        _close(_dense(op), truth)
        losses.append(op.loss())
    expected = float(np.sum((y - model(x).numpy()) ** 2))
    np.testing.assert_allclose(losses, expected, rtol=1e-12)


def test_mean_and_none_reductions_are_the_dataset_mean(regression):
    model, x, y, truth = regression
    for reduction in ("sum_over_batch_size", "none", None):
        loss = keras.losses.MeanSquaredError(reduction=reduction)
        for batch_size in (None, 7):
            op = HessianOperator.from_keras(model, loss, (x, y), batch_size=batch_size)
            _close(_dense(op), truth / N)


def test_mean_with_sample_weight_without_weights_is_the_mean(regression):
    model, x, y, truth = regression
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    op = HessianOperator.from_keras(model, loss, (x, y), batch_size=7)
    _close(_dense(op), truth / N)


def test_mean_with_sample_weight_and_weights_is_refused(regression):
    model, x, y, _ = regression
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    weights = np.linspace(0.5, 2.0, N)
    with pytest.raises(ValueError, match=r"reduction='mean_with_sample_weight'.*batched"):
        HessianOperator.from_keras(model, loss, (x, y, weights), batch_size=7).loss()


def test_sum_reduction_with_sample_weights(regression):
    model, x, y, _ = regression
    weights = np.linspace(0.5, 2.0, N)

    def total() -> tf.Tensor:
        return tf.reduce_sum(weights[:, None] * (y - model(x)) ** 2)

    truth = dense_hessian(total, model.trainable_variables)
    loss = keras.losses.MeanSquaredError(reduction="sum")
    for batch_size in (None, 7):
        op = HessianOperator.from_keras(model, loss, (x, y, weights), batch_size=batch_size)
        _close(_dense(op), truth)


def test_ggn_of_a_sum_reduction_is_batch_independent(regression):
    model, x, y, _ = regression
    truth = dense_ggn(
        [(lambda: [model(x)], lambda p: tf.reduce_sum((y - p[0]) ** 2), 1.0)],
        model.trainable_variables,
    )
    loss = keras.losses.MeanSquaredError(reduction="sum")
    for batch_size in BATCH_SIZES:
        op = GGNOperator.from_keras(model, loss, (x, y), batch_size=batch_size)
        _close(_dense(op), truth)


def test_fisher_refuses_a_sum_reduction_and_takes_none_as_the_mean(regression):
    model, x, y, _ = regression
    with pytest.raises(ValueError, match=r"reduction='sum'.*GGNOperator"):
        FisherOperator.from_keras(
            model, keras.losses.MeanSquaredError(reduction="sum"), (x, y), kind="empirical"
        )
    none = FisherOperator.from_keras(
        model,
        keras.losses.MeanSquaredError(reduction="none"),
        (x, y),
        batch_size=7,
        kind="empirical",
    )
    mean = FisherOperator.from_keras(model, "mse", (x, y), kind="empirical")
    _close(_dense(none), _dense(mean))


def test_landscape_uses_the_same_sum(regression):
    model, x, y, _ = regression
    loss = keras.losses.MeanSquaredError(reduction="sum")
    n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    direction = {"d": np.linspace(-1.0, 1.0, n)}
    curves = [
        loss_landscape(model, loss, (x, y), direction, [0.0, 0.1], batch_size=b).losses["d"]
        for b in (None, 7)
    ]
    np.testing.assert_allclose(curves[0], curves[1], rtol=1e-12)
    np.testing.assert_allclose(curves[0][0], np.sum((y - model(x).numpy()) ** 2), rtol=1e-12)


@pytest.fixture(scope="module")
def two_outputs():
    """A float64 model with a classification and a regression output, and its data."""
    keras.utils.set_random_seed(11)
    inputs = keras.Input((4,), dtype=F64)
    hidden = keras.layers.Dense(3, activation="tanh", dtype=F64)(inputs)
    logits = keras.layers.Dense(3, name="cls", dtype=F64)(hidden)
    value = keras.layers.Dense(1, name="reg", dtype=F64)(hidden)
    model = keras.Model(inputs, {"cls": logits, "reg": value})
    rng = np.random.default_rng(5)
    x = rng.normal(size=(N, 4))
    labels = rng.integers(0, 3, N)
    targets = rng.normal(size=(N, 1))

    def total() -> tf.Tensor:
        out = model(x)
        ce = keras.losses.sparse_categorical_crossentropy(labels, out["cls"], from_logits=True)
        return 0.5 * tf.reduce_sum(ce) + 2.0 * tf.reduce_mean((targets - out["reg"]) ** 2)

    truth = dense_hessian(total, model.trainable_variables)
    return model, x, {"cls": labels, "reg": targets}, truth


def test_compiled_sum_loss_with_loss_weights_is_batch_independent(two_outputs):
    model, x, y, truth = two_outputs
    model.compile(
        loss={
            "cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"),
            "reg": "mse",
        },
        loss_weights={"cls": 0.5, "reg": 2.0},
    )
    for batch_size in BATCH_SIZES:
        op = HessianOperator.from_keras(model, None, (x, y), batch_size=batch_size)
        _close(_dense(op), truth)


def test_sum_loss_per_output_in_a_dict_and_a_list(two_outputs):
    model, x, y, _ = two_outputs

    def total() -> tf.Tensor:
        out = model(x)
        ce = keras.losses.sparse_categorical_crossentropy(y["cls"], out["cls"], from_logits=True)
        return tf.reduce_sum(ce) + tf.reduce_mean((y["reg"] - out["reg"]) ** 2)

    truth = dense_hessian(total, model.trainable_variables)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    order = list(model.output_names)
    as_list = [ce if name == "cls" else "mse" for name in order]
    labels = [y[name] for name in order]
    for batch_size in (None, 7):
        by_name = HessianOperator.from_keras(
            model, {"cls": ce, "reg": "mse"}, (x, y), batch_size=batch_size
        )
        _close(_dense(by_name), truth)
        # Losses may be listed in Keras' output order; labels of dict outputs go by name
        # (a list of them is refused: which array goes where would rest on that order).
        listed = HessianOperator.from_keras(model, as_list, (x, y), batch_size=batch_size)
        _close(_dense(listed), truth)
        with pytest.raises(ValueError, match="labels given by position"):
            HessianOperator.from_keras(model, as_list, (x, labels), batch_size=batch_size)
