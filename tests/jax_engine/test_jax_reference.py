"""The same ``.keras`` file under both backends: the JAX operators' Hessian and GGN
products equal those TensorFlow's operators computed and stored
(``tests/jax_engine/make_reference.py``): an MLP with tanh and LayerNormalization, and a
CNN with a softmax output whose cross-entropy both engines compute from the logits (so the
GGN splits there), with the compiled loss (and for the MLP an uneven last batch)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _jax_models import relative_error
from make_reference import BATCH_SIZE, NAMES, REFERENCE, model_path

from spectra.operators.jax import GGNOperator, HessianOperator

TOLERANCE = {np.float32: 1e-6, np.float64: 1e-12}


@pytest.fixture(scope="module")
def reference():
    return np.load(REFERENCE)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_equal_tensorflow_s(reference, name, dtype):
    model = keras.saving.load_model(model_path(name))
    x, y, vectors = (reference[f"{name}_{part}"] for part in ("x", "y", "v"))
    for label, operator_class in (("hessian", HessianOperator), ("ggn", GGNOperator)):
        operator = operator_class.from_keras(
            model, None, (x, y), batch_size=BATCH_SIZE[name], dtype=dtype
        )
        stored = reference[f"{name}_{label}_{np.dtype(dtype).name}"]
        got = operator.matmat(vectors.astype(dtype))
        assert got.dtype == dtype
        assert relative_error(got, stored) < TOLERANCE[dtype], (name, label)
