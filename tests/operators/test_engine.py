"""The model's own checks run: assertions and check_numerics inside ``model(x)`` are kept
in every compiled part (split and cached, streaming, the recomputing fallback,
``loss()``/``gradient()``, GGN and Fisher), fail with their message and the batch, and
do not break the split on valid data."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra import FisherOperator, GGNOperator, HessianOperator, eigenvalues
from spectra.operators.engine import SPLIT_ENVIRONMENT_VARIABLE
from tests._dense import dense_hessian

F64 = "float64"
N = 30


class NonNegative(keras.layers.Layer):
    """Asserts its input is non-negative (its result unused, as models usually do)."""

    def call(self, t):
        tf.debugging.assert_non_negative(t, message="inputs must be non-negative")
        return t


class FiniteLog(keras.layers.Layer):
    """Checks log(1 + t) for NaN without using the checked tensor."""

    def call(self, t):
        tf.debugging.check_numerics(tf.math.log(1.0 + t), "log(1 + inputs)")
        return t


def _model(check: type[keras.layers.Layer]) -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((4,), dtype=F64),
            check(dtype=F64),
            keras.layers.Dense(3, activation="tanh", dtype=F64),
            keras.layers.Dense(1, dtype=F64),
        ]
    )


@pytest.fixture(scope="module")
def checked():
    """The asserting model, valid data, the same data with one negative entry in batch 2
    (of batches of 10), and the dense Hessian of the mean squared error on the valid data."""
    model = _model(NonNegative)
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=(N, 4)))
    y = rng.normal(size=(N, 1))
    bad = x.copy()
    bad[23, 1] = -0.5

    def mean() -> tf.Tensor:
        return tf.reduce_mean((y - model(x)) ** 2)

    truth = dense_hessian(mean, model.trainable_variables)
    return model, x, y, bad, truth


def test_the_model_itself_refuses_the_bad_data(checked):
    model, x, _, bad, _ = checked
    model.predict(x, verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-negative"):
        model.predict(bad, verbose=0)


@pytest.mark.parametrize("split", [True, False], ids=["split", "recompute"])
def test_valid_data_give_the_dense_hessian(checked, monkeypatch, split):
    model, x, y, _, truth = checked
    if not split:
        monkeypatch.setenv(SPLIT_ENVIRONMENT_VARIABLE, "0")
    op = HessianOperator.from_keras(model, "mse", (x, y), batch_size=10)
    assert op.product_path == ("split" if split else "recompute")
    dense = op @ np.eye(op.shape[0])
    assert np.max(np.abs(dense - truth)) <= 1e-10 * np.max(np.abs(truth))


@pytest.mark.parametrize("split", [True, False], ids=["split", "recompute"])
@pytest.mark.parametrize("cache", [True, False], ids=["cached", "streaming"])
def test_a_failing_assertion_fails_with_its_batch(checked, monkeypatch, split, cache):
    model, _, y, bad, _ = checked
    if not split:
        monkeypatch.setenv(SPLIT_ENVIRONMENT_VARIABLE, "0")
    op = HessianOperator.from_keras(model, "mse", (bad, y), batch_size=10, cache=cache)
    first_line = r"^batch 2: assertion failed: .*inputs must be non-negative"
    for use in (op.loss, op.gradient, lambda: op.matvec(np.ones(op.shape[0]))):
        with pytest.raises(tf.errors.InvalidArgumentError, match=first_line):
            use()
    with pytest.raises(tf.errors.InvalidArgumentError, match=first_line):
        eigenvalues(op, k=1)


def test_a_failing_assertion_on_a_dataset_names_its_batch(checked):
    model, x, y, bad, _ = checked
    dataset = tf.data.Dataset.from_tensor_slices((bad, y)).batch(10)
    op = HessianOperator.from_keras(model, "mse", dataset)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"^batch 2: assertion failed"):
        op.loss()
    valid = HessianOperator.from_keras(
        model, "mse", tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    )
    assert valid.product_path == "split"
    assert np.isfinite(valid.loss())


def test_ggn_and_fisher_run_the_assertions(checked):
    model, x, y, bad, _ = checked
    assert np.isfinite(GGNOperator.from_keras(model, "mse", (x, y)).loss())
    for build in (GGNOperator.from_keras, FisherOperator.from_keras):
        op = build(model, "mse", (bad, y), batch_size=10)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"^batch 2: assertion failed"):
            op.matvec(np.ones(op.shape[0]))


def test_check_numerics_runs():
    model = _model(FiniteLog)
    rng = np.random.default_rng(1)
    x = np.abs(rng.normal(size=(N, 4)))
    y = rng.normal(size=(N, 1))
    op = HessianOperator.from_keras(model, "mse", (x, y), batch_size=10)
    assert op.product_path == "split"
    assert np.isfinite(op.loss())
    x[4, 0] = -2.0  # log(1 + t) is NaN in batch 0
    op = HessianOperator.from_keras(model, "mse", (x, y), batch_size=10)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"^batch 0: log\(1 \+ inputs\)"):
        op.loss()


class CheckedCell(keras.layers.Layer):
    """A recurrent cell that asserts each step's input is non-negative (inside the loop)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state_size = 3

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3))
        self.recurrent = self.add_weight(shape=(3, 3))

    def call(self, x, states):
        tf.debugging.assert_non_negative(x, message="step input must be non-negative")
        h = tf.tanh(x @ self.kernel + states[0] @ self.recurrent)
        return h, [h]


@pytest.mark.parametrize("split", [True, False], ids=["split", "recompute"])
def test_an_assertion_inside_a_recurrent_loop(monkeypatch, split):
    if not split:
        monkeypatch.setenv(SPLIT_ENVIRONMENT_VARIABLE, "0")
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((5, 2), dtype=F64),
            keras.layers.RNN(CheckedCell(dtype=F64), dtype=F64),
            keras.layers.Dense(1, dtype=F64),
        ]
    )
    rng = np.random.default_rng(2)
    x = np.abs(rng.normal(size=(12, 5, 2)))
    y = rng.normal(size=(12, 1))
    op = HessianOperator.from_keras(model, "mse", (x, y), batch_size=4)
    assert op.product_path == ("split" if split else "recompute")
    truth = dense_hessian(lambda: tf.reduce_mean((y - model(x)) ** 2), model.trainable_variables)
    dense = op @ np.eye(op.shape[0])
    assert np.max(np.abs(dense - truth)) <= 1e-10 * np.max(np.abs(truth))
    x[9, 3, 0] = -1.0  # batch 2
    op = HessianOperator.from_keras(model, "mse", (x, y), batch_size=4)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"^batch 2: assertion failed: \[step input must"
    ):
        op.loss()


def test_an_error_of_the_program_is_raised_once_without_a_fallback_warning():
    """A loss that is not a scalar fails while the program is traced: that error is the
    user's to fix, raised as it is, not a reason to try the recomputing fallback (which
    would warn, trace again and fail the same way)."""
    import warnings

    keras.utils.set_random_seed(0)
    w = tf.Variable(np.ones(3), dtype=F64)

    def per_example_loss() -> tf.Tensor:
        return tf.square(w)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="scalar"):
            HessianOperator(per_example_loss, [w])
    assert not [w for w in caught if "could not split" in str(w.message)]


def test_a_block_is_its_vectors_matvecs_bitwise(checked):
    """The product is traced once: a block maps the compiled single-vector product over
    its rows, so each column of ``matmat`` is bitwise that vector's ``matvec``."""
    model, x, y, _, _ = checked
    op = HessianOperator.from_keras(model, "mse", (x, y), batch_size=10)
    V = np.random.default_rng(1).normal(size=(op.shape[0], 5))
    block = op.matmat(V)
    for j in range(V.shape[1]):
        assert np.array_equal(block[:, j], op.matvec(V[:, j]))
