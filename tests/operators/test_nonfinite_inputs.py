"""NaN, infinite or huge inputs are named as the cause, never blamed on the weights.

The review's case: NaN (or huge) values in x, with finite weights, reached the user as
"Load finite weights (e.g. an earlier checkpoint)" or as a non-finite batch whose cause
was left to guess. Now the operators built by ``from_keras`` refuse them before any graph
runs, naming the array, the first bad entry and the count; a loss computed from finite
weights that is not finite names the data (``check_finite(..., inputs=x)``).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra import FisherOperator, GGNOperator, HessianOperator
from spectra.operators import data_checks as D
from spectra.operators import keras_models

SCE = "sparse_categorical_crossentropy"


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(20, 4)).astype(np.float32), rng.integers(0, 3, 20)


NAN_MESSAGE = (
    "x holds 1 NaN or infinite values, first x[5, 2] = nan: the model's outputs, the loss "
    "and its derivatives are undefined there. Remove or repair those examples."
)


@pytest.mark.parametrize("operator", [HessianOperator, GGNOperator, FisherOperator])
def test_nan_in_x_is_named_with_its_index(operator):
    x, y = _data()
    x[5, 2] = np.nan
    with pytest.raises(ValueError) as raised:
        operator.from_keras(_model(), SCE, (x, y))
    assert str(raised.value) == NAN_MESSAGE


def test_a_value_that_overflows_the_compute_dtype_is_named():
    x, y = _data()
    x = x.astype(np.float64)
    x[7, 1] = 1e300
    with pytest.raises(ValueError) as raised:
        HessianOperator.from_keras(_model(), SCE, (x, y))
    assert str(raised.value) == (
        "x holds 1 NaN or infinite values, first x[7, 1] = inf (or a value beyond "
        "±3.4e+38, which the float32 the operator computes in cannot hold: rescale x, or "
        "compute in float64): the model's outputs, the loss and its derivatives are "
        "undefined there. Remove or repair those examples."
    )


def test_a_dataset_names_the_batch_and_a_dict_input_its_key():
    x, y = _data()
    x[13, 0] = -np.inf
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with pytest.raises(ValueError, match=r"^x holds 1 NaN or infinite values in batch 1 "):
        # A dataset is checked during its counting pass, before the first batch is used.
        HessianOperator.from_keras(_model(), SCE, dataset).loss()
    inputs = {"a": keras.Input((2,), name="a"), "b": keras.Input((2,), name="b")}
    joined = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(joined))
    with pytest.raises(
        ValueError, match=r"^x\['a'\] holds 1 NaN .* first x\['a'\]\[13, 0\] = -inf"
    ):
        HessianOperator.from_keras(model, SCE, ({"a": x[:, :2], "b": x[:, 2:]}, y))


def test_a_non_finite_loss_from_finite_weights_blames_the_data():
    x, _ = _data()
    x[7, 1] = 3e38
    with pytest.raises(ValueError) as raised:
        keras_models.check_finite(
            tf.constant(np.inf, tf.float32), "the batch loss", inputs=x, where="batch 0"
        )
    assert str(raised.value) == (
        "the batch loss of batch 0 has 1 non-finite entries (0 NaN, 1 Inf) out of 1 although "
        "the weights are finite: the data are the cause (x[7, 1] = 3e+38 is the input of "
        "largest magnitude). Remove or rescale those examples."
    )
    x[2, 3] = np.nan
    assert D.describe_inputs(x) == "x[2, 3] = nan (1 NaN or infinite values in x)"
    # A weight is still a weight.
    with pytest.raises(ValueError, match="^variable 'dense/kernel' has 1 non-finite.*Load finite"):
        keras_models.check_finite(tf.constant([np.nan, 1.0]), "dense/kernel")
