"""The reference products the JAX engine is checked against
(``tests/jax_engine/make_reference.py``, whose functions compute them here) are still what
TensorFlow's operators compute from the stored ``.keras`` files: the reference cannot
drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import keras
import numpy as np
import pytest

from spectra import GGNOperator, HessianOperator

_SCRIPT = Path(__file__).resolve().parents[1] / "jax_engine" / "make_reference.py"
_SPEC = importlib.util.spec_from_file_location("make_reference", _SCRIPT)
assert _SPEC is not None and _SPEC.loader is not None
reference_script = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(reference_script)

TOLERANCE = {np.float32: 1e-6, np.float64: 1e-12}


@pytest.mark.parametrize("name", reference_script.NAMES)
def test_tensorflow_still_gives_the_stored_products(name):
    stored = np.load(reference_script.REFERENCE)
    model = keras.saving.load_model(reference_script.model_path(name))
    x, y, vectors = (stored[f"{name}_{part}"] for part in ("x", "y", "v"))
    assert np.array_equal((x, y)[0], reference_script.data(name)[0])
    for label, operator_class in (("hessian", HessianOperator), ("ggn", GGNOperator)):
        for dtype in (np.float32, np.float64):
            got = reference_script.products(name, model, x, y, vectors, operator_class, dtype)
            want = stored[f"{name}_{label}_{np.dtype(dtype).name}"]
            error = np.abs(got - want).max() / np.abs(want).max()
            assert error < TOLERANCE[dtype], (name, label, np.dtype(dtype).name, error)
