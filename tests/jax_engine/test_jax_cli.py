"""The command line under ``KERAS_BACKEND=jax`` without TensorFlow: ``spectra analyze`` of a
saved, compiled ``.keras`` model against the dense float64 Hessian of the model written again in
``jax.numpy`` (:mod:`_jax_models`), and ``results.json`` saying which backend computed it."""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import numpy as np
from _jax_models import (
    SCCE,
    classification_data,
    flat,
    hessian,
    mlp,
    mlp_forward,
    sparse_ce,
    unflatten,
)
from _jax_models import weights as model_weights

from spectra import _jax_compat
from spectra.cli import main


def test_analyze_under_jax_gives_the_dense_hessian_s_eigenvalues_and_trace(tmp_path, capsys):
    _jax_compat.set_random_seed(5)
    model = mlp("tanh")
    model.compile(loss=SCCE)  # the compiled loss: cross-entropy of the logits
    x, y = classification_data(40)
    params = model_weights(model)
    shapes = [p.shape for p in params]
    model.save(tmp_path / "mlp.keras")
    np.savez(tmp_path / "data.npz", x=x, y=y)

    def loss(t):
        return jnp.mean(sparse_ce(mlp_forward(unflatten(t, shapes), x), y))

    truth = np.linalg.eigvalsh(hessian(loss, flat(params)))[::-1]
    out = tmp_path / "out"
    args = ["analyze", str(tmp_path / "mlp.keras"), "--data", str(tmp_path / "data.npz")]
    args += ["--float64", "--batch-size", "16"]
    args += ["--top-k", "3", "--trace", "--trace-products", "200", "--seed", "3"]
    assert main([*args, "--out", str(out)]) == 0
    capsys.readouterr()

    results = json.loads((out / "results.json").read_text())
    eigen = results["eigenvalues"]
    values, bounds = np.array(eigen["eigenvalues"]), np.array(eigen["error_bounds"])
    assert np.all(bounds < 1e-8 * abs(truth[0]))
    assert np.all(np.abs(values - truth[:3]) <= bounds + 1e-12 * abs(truth[0]))
    trace = results["trace"]
    assert abs(trace["estimate"] - truth.sum()) < 4 * trace["stderr"]
    assert trace["stderr"] < 0.2 * abs(truth.sum())
    versions = results["versions"]
    assert versions["backend"] == "jax" and "jax" in versions and "tensorflow" not in versions
    assert "tensorflow" not in sys.modules
