"""The command line under ``KERAS_BACKEND=jax`` without TensorFlow: ``spectra analyze`` of a
saved, compiled ``.keras`` model against the dense float64 Hessian of the model written again in
``jax.numpy`` (:mod:`_jax_models`), and ``results.json`` saying which backend computed it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
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

DATA = Path(__file__).resolve().parents[2] / "data"


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


def test_sharpness_under_jax_matches_the_committed_run_s_independent_float64_values(tmp_path):
    """data/gd_trajectory (a softmax output read through its logits, as on TensorFlow):
    λ₁ of every checkpoint within its bound plus 1e-8·λ₁ of the sharpness make_examples.py
    computed in float64 (the tolerance of tests/truths/test_independent_truths.py)."""
    record = json.loads((DATA / "gd_trajectory" / "trajectory.json").read_text())
    out = tmp_path / "sharpness"
    args = ["sharpness", str(DATA / "gd_trajectory"), "--data", str(DATA / "digits.npz")]
    args += ["--loss", record["loss"], "--float64", "--quiet", "--out", str(out)]
    assert main(args) == 0
    entries = json.loads((out / "sharpness.json").read_text())["checkpoints"]
    references = record["checkpoints"]
    assert [e["step"] for e in entries] == [c["step"] for c in references]
    for entry, reference in zip(entries, references, strict=True):
        value, bound = entry["eigenvalues"][0], entry["error_bounds"][0]
        sharpness = reference["sharpness"]
        assert abs(value - sharpness) <= bound + 1e-8 * abs(sharpness), reference["step"]
        assert 0 < bound <= 1e-8 * abs(value)
        assert entry["loss"] == pytest.approx(reference["loss"], rel=1e-6)


def test_landscape_under_jax_runs_and_its_curves_pass_through_the_loss(tmp_path, capsys):
    """spectra landscape of the example checkpoint (its loss values against the dense
    truth: tests/jax_engine/test_jax_landscape.py): every curve passes through the
    checkpoint's loss at α = 0 and rises along v1."""
    out = tmp_path / "out"
    args = ["landscape", str(DATA / "digits_mlp.keras"), "--data", str(DATA / "digits.npz")]
    args += ["--loss", "sparse_categorical_crossentropy", "--points", "5", "--quiet"]
    assert main([*args, "--out", str(out)]) == 0
    capsys.readouterr()
    report = json.loads((out / "landscape.json").read_text())
    curves, base = report["curves"], report["curves"]["base_loss"]
    assert base == pytest.approx(0.020626, rel=1e-4)  # the loss make run prints
    middle = len(curves["alphas"]) // 2
    assert curves["alphas"][middle] == 0.0
    for label, losses in curves["losses"].items():
        assert losses[middle] == pytest.approx(base, rel=1e-6), label
    assert min(curves["losses"]["v1"][0], curves["losses"]["v1"][-1]) > 2 * base
    assert (out / "landscape_1d.png").exists()
