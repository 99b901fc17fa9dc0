"""``spectra sharpness --per-batch M --per-batch-size B``: λ₁ on M mini-batches at every
checkpoint, against a direct loop over the same batches (each batch's Hessian built on its
own and its top eigenvalue found by SciPy's ARPACK, not spectra's eigensolver)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
from pathlib import Path

import keras
import numpy as np
import pytest
from scipy.sparse.linalg import eigsh

from spectra.analysis.minibatch import draw_minibatches
from spectra.cli import main
from spectra.io.datasets import load_data
from spectra.operators import HessianOperator

DATA = Path(__file__).resolve().parents[2] / "data"
CHECKPOINT = DATA / "gd_trajectory" / "step_0100.keras"
LOSS = "sparse_categorical_crossentropy"
ARGS = ["--data", str(DATA / "digits.npz"), "--loss", LOSS, "--max-examples", "200"]
ARGS += ["--seed", "3", "--no-progress"]


def _run(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["sharpness", *args, *ARGS])
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("minibatch") / "out"
    status, printed, err = _run(
        [str(CHECKPOINT), "--per-batch", "4", "--per-batch-size", "32", "--out", str(out)]
    )
    assert status == 0, err
    return out, printed, json.loads((out / "sharpness.json").read_text())


def test_each_batch_matches_a_direct_loop_over_the_same_batches(run):
    out, printed, report = run
    (entry,) = report["checkpoints"]
    minibatch = entry["minibatch"]
    assert (minibatch["num_batches"], minibatch["batch_size"], minibatch["seed"]) == (4, 32, 3)
    data = load_data(DATA / "digits.npz", max_examples=200, seed=3)
    model = keras.models.load_model(CHECKPOINT)
    truth = []
    for rows in draw_minibatches(200, 32, 4, seed=3):
        op = HessianOperator.from_keras(model, LOSS, (data.x[rows], data.y[rows]))
        truth.append(eigsh(op, k=1, which="LA", tol=1e-8, return_eigenvectors=False)[0])
    for value, bound, expected in zip(
        minibatch["sharpness"], minibatch["error_bounds"], truth, strict=True
    ):
        assert abs(value - expected) <= bound + 2e-6 * expected
    summary = minibatch["summary"]
    np.testing.assert_allclose(summary["q50"], np.median(truth), rtol=1e-5)
    np.testing.assert_allclose(summary["mean"], np.mean(truth), rtol=1e-5)
    assert minibatch["full_batch"] == entry["eigenvalues"][0]
    assert minibatch["threshold"] == report["threshold"]["value"] == pytest.approx(10.0)
    assert report["settings"]["per_batch"] == 4 and report["settings"]["per_batch_size"] == 32
    # Printed with the checkpoint's line, and in the CSV's last columns.
    assert f"mini-batch λ1 median {summary['q50']:.4g}" in printed
    (row,) = list(csv.DictReader((out / "sharpness.csv").open()))
    assert float(row["minibatch_lambda_1_q95"]) == summary["q95"]


def test_the_figure_draws_the_band_and_names_it(run):
    from spectra.reports.sharpness import minibatch_quantiles

    _, _, report = run
    quantiles, label = minibatch_quantiles(report["checkpoints"])
    summary = report["checkpoints"][0]["minibatch"]["summary"]
    assert quantiles.tolist() == [[summary["q05"], summary["q50"], summary["q95"]]]
    assert label.startswith("λ₁ of 4 mini-batches of 32 examples")


def test_resuming_with_other_batches_is_refused_and_a_size_is_required(run, tmp_path):
    out, _, _ = run
    status, _, err = _run(
        [str(CHECKPOINT), "--per-batch", "5", "--per-batch-size", "32", "--out", str(out)]
    )
    assert status != 0 and "per_batch: 4 -> 5" in err
    status, _, err = _run([str(CHECKPOINT), "--per-batch", "4", "--out", str(tmp_path / "o")])
    assert status != 0 and "per_batch_size is required" in err
