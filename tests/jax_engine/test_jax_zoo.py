"""The test zoo on JAX: the architectures of ``tests/_zoo.py`` made of Keras layers
(dense, convolution, batch/layer/group normalization in inference and training mode,
attention, a transformer block, LSTM with masking, GRU, a bidirectional LSTM, two inputs
and two compiled outputs with loss weights), each saved under TensorFlow as a ``.keras``
file with the finite-difference float64 Hessian products of its dataset loss
(``make_zoo_reference.py``). The JAX engine's float64 products of the same file, with
the compiled loss and the entry's batches and mode, must equal that truth to 1e-8
relative (the truth is accurate to about 1e-11); its gradient and loss too."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _jax_models import relative_error
from make_zoo_reference import NAMES, REFERENCE, model_path

from spectra.operators.jax import HessianOperator

#: The batches and mode of each entry (``tests/_zoo.py``'s ZOO, which imports TensorFlow).
BATCH_SIZE = {"mlp": 5, "batchnorm": 5, "layernorm": 5, "batchnorm-training-batches": 4}
TRAINING = {"batchnorm-training", "batchnorm-training-batches"}
#: Keras 3.15 on JAX computes MultiHeadAttention's softmax in float32 (a cast, its max and a
#: reshape, in a vmap): float64 is refused in one line naming them, and float32 products
#: are checked against the truth to float32 accuracy instead.
FLOAT32_ONLY = {"attention", "transformer"}


@pytest.fixture(scope="module")
def reference():
    with np.load(REFERENCE) as stored:
        return dict(stored)


def _tree(reference: dict, prefix: str):
    keys = [k for k in reference if k == prefix or k.startswith(prefix + ".")]
    if keys == [prefix]:
        return reference[prefix]
    return {k.partition(".")[2]: reference[k] for k in keys}


def _operator(reference: dict, name: str, dtype: type) -> HessianOperator:
    model = keras.saving.load_model(model_path(name))
    x, y = _tree(reference, f"{name}/x"), _tree(reference, f"{name}/y")
    return HessianOperator.from_keras(
        model,
        None,
        (x, y),
        batch_size=BATCH_SIZE.get(name),
        training=name in TRAINING,
        dtype=dtype,
    )


@pytest.mark.parametrize("name", [n for n in NAMES if n not in FLOAT32_ONLY])
def test_float64_products_equal_the_finite_difference_truth(reference, name):
    op = _operator(reference, name, np.float64)
    vectors, truth = reference[f"{name}/v"], reference[f"{name}/hv"]
    assert op.shape == (vectors.shape[0],) * 2
    assert relative_error(op.matmat(vectors), truth) < 1e-8, name
    assert relative_error(op.gradient(), reference[f"{name}/gradient"]) < 1e-10, name
    assert op.loss() == pytest.approx(float(reference[f"{name}/loss"]), rel=1e-12)


@pytest.mark.parametrize("name", sorted(FLOAT32_ONLY))
def test_attention_is_refused_in_float64_and_right_in_float32(reference, name):
    vectors, truth = reference[f"{name}/v"], reference[f"{name}/hv"]
    with pytest.raises(TypeError, match="multi_head_attention.*fewer than 64 bits"):
        _operator(reference, name, np.float64).matmat(vectors)
    op = _operator(reference, name, np.float32)
    products = op.matmat(vectors.astype(np.float32)).astype(np.float64)
    assert relative_error(products, truth) < 1e-4, name
