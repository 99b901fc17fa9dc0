"""Half-precision and mixed-precision models: curvature in float32 (or float64), never a
dtype error.

The review's case: a model built under the ``float16`` or ``bfloat16`` policy (weights in
half precision) gave "dtype must be one of float32, float64, got float16" through the API
and "unexpected TypeError ... please report it" (exit 1) on the command line. Its
products now come from a float32 copy of the model, as a mixed-precision model's do; the
top eigenvalue is checked against the Hessian computed here by central finite differences
of the float64 gradient of a hand-written copy of the model (weights as stored, cast to
float64, which is exact).
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import central_difference_hessian

from spectra import HessianOperator, eigenvalues
from spectra.cli import main

POLICIES = ["float16", "bfloat16", "mixed_float16"]


def _model(policy: str) -> keras.Model:
    keras.config.set_dtype_policy(policy)
    try:
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(5, activation="tanh"),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
    finally:
        keras.config.set_dtype_policy("float32")
    model.compile(loss="sparse_categorical_crossentropy")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(20, 4)).astype(np.float32), rng.integers(0, 3, 20)


def _finite_difference_top(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    """λ_max of the Hessian of the mean cross-entropy, by central differences (step 1e-5)
    of the float64 gradient of the same network written out by hand."""
    weights = [np.asarray(w, np.float64) for w in model.get_weights()]
    shapes = [w.shape for w in weights]
    sizes = [w.size for w in weights]
    x64, onehot = x.astype(np.float64), np.eye(3)[y]

    def gradient(theta: np.ndarray) -> np.ndarray:
        t = tf.constant(theta)
        with tf.GradientTape() as tape:
            tape.watch(t)
            w1, b1, w2, b2 = (tf.reshape(p, s) for p, s in zip(tf.split(t, sizes), shapes))
            logits = tf.tanh(x64 @ w1 + b1) @ w2 + b2
            value = -tf.reduce_mean(tf.reduce_sum(onehot * tf.nn.log_softmax(logits), -1))
        return tape.gradient(value, t).numpy()

    theta = np.concatenate([w.ravel() for w in weights])
    return float(np.linalg.eigvalsh(central_difference_hessian(gradient, theta))[-1])


@pytest.mark.parametrize("policy", POLICIES)
def test_half_precision_models_get_float32_or_float64_products(policy):
    model = _model(policy)
    x, y = _data()
    truth = _finite_difference_top(model, x, y)
    op32 = HessianOperator.from_keras(model, None, (x, y))
    assert op32.dtype == np.float32
    top32 = eigenvalues(op32, k=1, seed=0).eigenvalues[0]
    # float32 products: relative errors of order 1e-6 (half precision would give 1e-3).
    assert top32 == pytest.approx(truth, rel=2e-5)
    op64 = HessianOperator.from_keras(model, None, (x, y), dtype=np.float64)
    assert eigenvalues(op64, k=1, tol=1e-10, seed=0).eigenvalues[0] == pytest.approx(
        truth, rel=1e-7
    )
    assert model.layers[0].variable_dtype == keras.DTypePolicy(policy).variable_dtype


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_asking_for_half_precision_products_says_what_to_ask_for(dtype):
    x, y = _data()
    with pytest.raises(TypeError) as raised:
        HessianOperator.from_keras(_model("float16"), None, (x, y), dtype=dtype)
    assert str(raised.value) == (
        f"dtype must be one of float32, float64, got {dtype} (half precision is too coarse "
        "for curvature: pass dtype='float32', which a half-precision model gets by default, "
        "or dtype='float64')"
    )


@pytest.mark.parametrize("policy", ["float16", "bfloat16"])
def test_the_command_line_analyzes_half_precision_models(policy, tmp_path, capsys):
    model = _model(policy)
    x, y = _data()
    model.save(tmp_path / "model.keras")
    np.savez(tmp_path / "data.npz", x=x, y=y)
    truth = _finite_difference_top(model, x, y)
    for extra, rel in (([], 2e-5), (["--float64", "--tol", "1e-10"], 1e-7)):
        out = tmp_path / f"out{len(extra)}"
        arguments = ["analyze", str(tmp_path / "model.keras"), "--data", str(tmp_path / "data.npz")]
        try:
            status = main([*arguments, "--out", str(out), "--top-k", "1", "--quiet", *extra])
        except SystemExit as exit_info:
            status = int(exit_info.code)
        assert status == 0, capsys.readouterr().err
        results = json.loads((out / "results.json").read_text())
        assert results["settings"]["dtype"] == ("float64" if extra else "float32")
        assert results["eigenvalues"]["eigenvalues"][0] == pytest.approx(truth, rel=rel)
