"""Errors of the operator API name their cause in one line (regression tests of the
reported inputs): data that do not fit the model, variables that are not the model's,
datasets that fail while producing a batch, and a landscape whose graph raises."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra import HessianOperator
from spectra.analysis.landscape import loss_landscape

N = 30


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "Graph execution error" not in text
    assert "function_node" not in text
    assert "numpy=" not in text
    return text.splitlines()[0]


@pytest.fixture(scope="module")
def mlp():
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
    )
    rng = np.random.default_rng(4)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    return model, x, y


def test_a_feature_count_that_does_not_fit_the_model(mlp):
    model, _, y = mlp
    x5 = np.ones((N, 5), "float32")
    with pytest.raises(ValueError) as info:
        HessianOperator.from_keras(model, "mse", (x5, y))
    assert _one_line(info.value).startswith(
        "x has examples of shape (5,) but the model's input expects (4,)"
    )
    assert len(str(info.value).splitlines()) == 1


def test_a_feature_count_that_does_not_fit_a_subclassed_model(mlp):
    _, _, y = mlp

    class Regressor(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    model = Regressor()
    model(np.ones((2, 4), "float32"))
    with pytest.raises(ValueError) as info:
        HessianOperator.from_keras(model, "mse", (np.ones((N, 5), "float32"), y))
    first = _one_line(info.value)
    assert len(str(info.value).splitlines()) == 1
    assert first.startswith("calling model 'regressor' on a batch of x failed: Input 0")
    assert "expected axis -1 of input shape to have value 4" in first
    assert "\x1b" not in first


def test_a_variable_that_is_not_the_models(mlp):
    model, x, y = mlp
    with pytest.raises(ValueError) as info:
        HessianOperator.from_keras(
            model, "mse", (x, y), variables=[tf.Variable(np.ones(3, "float32"))]
        )
    first = _one_line(info.value)
    assert first.startswith("variables[0] ('Variable:0', a ResourceVariable, shape (3,))")
    assert "is not a weight of model" in first


def test_a_weight_given_twice_through_its_tf_variable(mlp):
    model, x, y = mlp
    k = model.layers[0].kernel
    with pytest.raises(ValueError) as info:
        HessianOperator.from_keras(model, "mse", (x, y), variables=[k, k.value])
    first = _one_line(info.value)
    assert "variables[1]" in first and "already given as variables[0]" in first
    # k.value alone is k: the same block of the Hessian.
    by_value = HessianOperator.from_keras(model, "mse", (x, y), variables=[k.value])
    by_weight = HessianOperator.from_keras(model, "mse", (x, y), variables=[k])
    np.testing.assert_array_equal(by_value @ np.eye(12), by_weight @ np.eye(12))


def test_a_dataset_of_x_only(mlp):
    model, x, _ = mlp
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(10)
    with pytest.raises(ValueError) as info:
        HessianOperator.from_keras(model, "mse", dataset)
    assert _one_line(info.value).startswith(
        "data is a tf.data.Dataset whose elements are a single tensor of shape (None, 4); "
        "for a Keras model it must be (x, y) or (x, y, sample_weight) (a dataset must "
        "yield such tuples)."
    )


def test_a_failing_assertion_in_a_dataset_map(mlp):
    model, x, y = mlp
    x = x.copy()
    x[:20, 0] = np.minimum(x[:20, 0], 0.5)
    x[25, 0] = 3.0  # batch 2

    def checked(features, labels):
        tf.debugging.assert_less(features[:, 0], 1.0)
        return features, labels

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10).map(checked)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        HessianOperator.from_keras(model, "mse", dataset).loss()
    first = _one_line(info.value)
    assert first.startswith("batch 2 of the dataset: ")
    assert "assertion failed: [Condition x < y did not hold element-wise:]" in first


def test_a_raising_generator(mlp):
    model, x, y = mlp

    def generate():
        yield x[:10], y[:10]
        raise RuntimeError("the source file is truncated")

    spec = (tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None, 1), tf.float32))
    dataset = tf.data.Dataset.from_generator(generate, output_signature=spec)
    with pytest.raises(tf.errors.OpError) as info:
        HessianOperator.from_keras(model, "mse", dataset).loss()
    assert (
        _one_line(info.value)
        == "batch 1 of the dataset: RuntimeError: the source file is truncated"
    )


def test_loss_landscape_on_a_model_whose_graph_raises(mlp):
    _, x, y = mlp

    class NonNegative(keras.layers.Layer):
        def call(self, t):
            tf.debugging.assert_non_negative(t)
            return t

    model = keras.Sequential([keras.Input((4,)), NonNegative(), keras.layers.Dense(1)])
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        loss_landscape(model, "mse", (x, y), {"d": np.ones(5)}, [0.0, 1.0], batch_size=10)
    first = _one_line(info.value)
    assert first.startswith("batch 0: assertion failed: [] [Condition x >= 0 did not hold")
    assert len(str(info.value).splitlines()) <= 2
