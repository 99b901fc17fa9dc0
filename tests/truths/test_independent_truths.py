"""What the command line and the callback report, against truths computed without spectra.

The truths (tests/_relu_mlp.py) are NumPy float64 computations that share no code with
spectra or TensorFlow: exact Hessian-vector products of a ReLU MLP by a hand-written
R-operator (dense Hessians and ``eigh`` for small models), and the exact trace in closed
form. For the committed gradient-descent run the truth is the float64 sharpness that
data/make_examples.py computed independently (nested tapes over a re-implementation of
the MLP, ``scipy.sparse.linalg.eigsh``) and stored in data/gd_trajectory/trajectory.json.

Statistical assertions state their false-alarm probability (over seeds; the seeds here are
fixed, so each assertion is deterministic).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import keras
import numpy as np
import pytest
from _dense import FD_TRUTH_RTOL, dense_hessian
from _relu_mlp import ReluMLP

from spectra.callback import SharpnessCallback
from spectra.cli import main
from spectra.io.checkpoints import load_model

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
LOSS = "sparse_categorical_crossentropy"
# The reference sharpness of trajectory.json: ARPACK (eigsh, k=1, which="LA") stops when a
# Ritz value θ has residual ≤ tol·|θ| with tol = 1e-8, so θ lies within 1e-8·|θ| of an
# eigenvalue (float64 products add ~1e-15 relative); that it is the largest was checked
# against dense Hessians at steps 0, 100 and 200 (data/README.md).
REFERENCE_TOL = 1e-8
# The dense float64 truths carry their own rounding: products summed over examples and
# eigh (backward stable) err by a few eps·‖H‖; 100·eps·‖H‖ covers it. The reported bounds
# of float64 runs go down to 10·eps·‖H‖, so without this slack the comparison would test
# the truth's rounding, not spectra's.
TRUTH_ROUNDING = 100 * np.finfo(np.float64).eps
# Hutchinson with 100 Rademacher probes: |error|/stderr is close to a Student t with 99
# degrees of freedom, and P(|t| > 5) = 2.4e-6 per check.
TRACE_SIGMAS = 5.0


def _run(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main([*args, "--no-progress"])
    assert status == 0, out.getvalue()
    return out.getvalue()


def _relu_model(sizes=(6, 10, 8, 4), seed=0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((sizes[0],))]
    layers += [keras.layers.Dense(units, activation="relu") for units in sizes[1:-1]]
    layers.append(keras.layers.Dense(sizes[-1], activation="softmax"))
    return keras.Sequential(layers)


def _teacher_data(num_examples=60, features=6, classes=4, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_examples, features)).astype(np.float32)
    scores = x @ rng.standard_normal((features, classes)) + rng.standard_normal(
        (num_examples, classes)
    )
    return x, np.argmax(scores, axis=1).astype(np.int64)


def _within_bounds(values, bounds, spectrum):
    """|λ_i − λ_i(true)| <= bound_i (+ the truth's rounding) for the largest eigenvalues
    of ``spectrum``, in the reported order."""
    values, bounds = np.asarray(values, np.float64), np.asarray(bounds, np.float64)
    truth = np.sort(spectrum)[::-1][: values.size]
    slack = TRUTH_ROUNDING * np.abs(spectrum).max()
    return np.abs(values - truth) <= bounds + slack


# --------------------------------------------------------------------------- the reference


def test_the_numpy_reference_is_the_hessian():
    """The NumPy R-operator and closed-form trace against TensorFlow's dense Hessian."""
    model = _relu_model()
    x, y = _teacher_data()
    truth = ReluMLP.from_keras(model, x, y)
    weights = [w.astype(np.float64) for w in model.get_weights()]
    model64 = keras.Sequential(
        [keras.Input((6,), dtype="float64")]
        + [
            keras.layers.Dense(layer.units, activation=layer.activation, dtype="float64")
            for layer in model.layers
        ]
    )
    model64.set_weights(weights)
    loss = keras.losses.SparseCategoricalCrossentropy(dtype="float64")
    H = dense_hessian(lambda: loss(y, model64(x.astype(np.float64))), model64.trainable_variables)
    dense = truth.dense()
    # H is the finite-difference truth (~1e-11·‖H‖ per entry, FD_TRUTH_RTOL).
    assert np.abs(dense - H).max() <= FD_TRUTH_RTOL * np.abs(H).max()
    assert truth.trace() == pytest.approx(np.trace(H), rel=FD_TRUTH_RTOL)
    assert truth.loss() == pytest.approx(float(loss(y, model64(x.astype(np.float64)))), rel=1e-12)


# --------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A ReLU MLP 6-10-8-4 (194 parameters) and 60 examples, on disk, with its truth."""
    root = tmp_path_factory.mktemp("tiny")
    model = _relu_model()
    model.save(root / "tiny.keras")
    x, y = _teacher_data()
    np.savez(root / "tiny.npz", x=x, y=y)
    truth = ReluMLP.from_keras(model, x, y)
    hessian = truth.dense()
    return root, truth, hessian, np.linalg.eigvalsh(hessian)


def test_analyze_reports_the_dense_truth(tiny):
    root, truth, hessian, spectrum = tiny
    out = root / "analyze"
    _run(
        [
            "analyze", str(root / "tiny.keras"), "--data", str(root / "tiny.npz"),
            "--loss", LOSS, "--float64", "--top-k", "3", "--tol", "1e-10",
            "--trace", "--trace-products", "100",
            "--density", "--density-steps", "12", "--density-probes", "20",
            "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert results["loss"] == pytest.approx(truth.loss(), rel=1e-12)

    # Eigenvalues: each within its reported bound of the true i-th largest (the requested
    # failure probability is the default 1e-4 per run, at a fixed seed).
    eig = results["eigenvalues"]
    assert all(eig["converged"])
    assert np.all(_within_bounds(eig["eigenvalues"], eig["error_bounds"], spectrum)), eig
    assert np.all(np.asarray(eig["error_bounds"]) <= 1e-9 * spectrum[-1])

    # Trace: Hutchinson, 100 probes (false alarm 2.4e-6, see TRACE_SIGMAS).
    exact_trace = np.trace(hessian)
    trace = results["trace"]
    assert abs(trace["estimate"] - exact_trace) <= TRACE_SIGMAS * trace["stderr"]
    assert 0 < trace["stderr"] <= 0.2 * abs(exact_trace)

    # Density moments: mean over 20 probes of exact quadratures of qᵀH^p q (12 Lanczos
    # steps are exact up to p = 23), so |error|/stderr is a Student t with 19 degrees of
    # freedom: P(|t| > 6) = 9e-6 per moment, 4e-5 for p = 1..4.
    moments = results["density_moments"]
    n = truth.n
    assert moments["estimate"][0] == pytest.approx(1.0, abs=1e-12)
    for p in range(1, 5):
        exact = float(np.sum(spectrum**p)) / n
        error = abs(moments["estimate"][p] - exact)
        assert error <= 6 * moments["stderr"][p] + 1e-10 * abs(spectrum).max() ** p, p

    # Spectral mass below −0.01·λ₁: the true fraction lies within the quadrature resolution
    # plus 6 standard errors of the estimate (mean of 20 probe fractions, t with 19 degrees
    # of freedom: false alarm ≈ 9e-6).
    mass = results["negative_mass"]
    fraction = float(np.mean(spectrum < mass["threshold"]))
    assert mass["threshold"] == pytest.approx(-0.01 * eig["eigenvalues"][0])
    assert abs(mass["estimate"] - fraction) <= mass["resolution"] + 6 * mass["stderr"]


def test_landscape_curves_are_the_loss_along_the_true_eigenvector(tiny):
    root, truth, hessian, _ = tiny
    out = root / "landscape"
    _run(
        [
            "landscape", str(root / "tiny.keras"), "--data", str(root / "tiny.npz"),
            "--loss", LOSS, "--float64", "--points", "5", "--radius", "0.5",
            "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    report = json.loads((out / "landscape.json").read_text())
    alphas = np.asarray(report["curves"]["alphas"])
    values, vectors = np.linalg.eigh(hessian)
    assert values[-1] - values[-2] > 1e-3 * values[-1]  # v₁ is well defined
    v1 = vectors[:, -1]
    weights = [w.astype(np.float64) for w in load_model(root / "tiny.keras").get_weights()]
    theta = np.concatenate([w.reshape(-1) for w in weights])

    def loss_at(point):
        pieces = np.split(point, np.cumsum([w.size for w in weights])[:-1])
        shaped = [piece.reshape(w.shape) for piece, w in zip(pieces, weights)]
        return ReluMLP(shaped, truth.x, truth.y).loss()

    curve = np.asarray(report["curves"]["losses"]["v1"])
    # The reported eigenvector's sign is arbitrary: one orientation matches.
    expected = [np.array([loss_at(theta + s * a * v1) for a in alphas]) for s in (1, -1)]
    errors = [np.abs(curve - e).max() for e in expected]
    assert min(errors) <= 1e-8 * truth.loss(), errors
    assert report["curves"]["base_loss"] == pytest.approx(truth.loss(), rel=1e-12)


@pytest.mark.slow
def test_sharpness_of_the_committed_run_matches_its_independent_float64_values(tmp_path):
    """Every checkpoint of data/gd_trajectory: spectra's λ₁ (command line, float64)
    within its reported bound plus the reference's own tolerance of the independent
    sharpness, and the trace within 5 standard errors of the exact trace."""
    record = json.loads((DATA / "gd_trajectory" / "trajectory.json").read_text())
    out = tmp_path / "sharpness"
    _run(
        [
            "sharpness", str(DATA / "gd_trajectory"), "--data", str(DATA / "digits.npz"),
            "--loss", record["loss"], "--float64", "--trace", "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    entries = json.loads((out / "sharpness.json").read_text())["checkpoints"]
    references = record["checkpoints"]
    assert [e["step"] for e in entries] == [c["step"] for c in references]
    with np.load(DATA / "digits.npz") as data:
        x, y = data["x"], data["y"]
    for entry, reference in zip(entries, references, strict=True):
        assert entry["status"] == "done" and entry["file"] == reference["file"]
        value, bound = entry["eigenvalues"][0], entry["error_bounds"][0]
        sharpness = reference["sharpness"]
        # 11 checkpoints, each a deterministic run; the bound is certified for an
        # eigenvalue and, with failure probability 1e-4 per run, for the largest.
        assert abs(value - sharpness) <= bound + REFERENCE_TOL * abs(sharpness), (
            reference["step"],
            value,
            sharpness,
            bound,
        )
        assert 0 < bound <= 1e-8 * abs(value)
        assert entry["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        # Trace: 11 checks at 2.4e-6 each, false alarm < 3e-5.
        model = load_model(DATA / "gd_trajectory" / reference["file"])
        exact = ReluMLP.from_keras(model, x, y).trace()
        assert abs(entry["trace"] - exact) <= TRACE_SIGMAS * entry["trace_stderr"], (
            reference["step"],
            entry["trace"],
            entry["trace_stderr"],
            exact,
        )


# --------------------------------------------------------------------------- the callback


class _WeightRecorder(keras.callbacks.Callback):
    """The weights at the start of training and after every epoch, by epochs completed."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: dict[int, list[np.ndarray]] = {}

    def on_train_begin(self, logs=None):
        self.weights[0] = [w.copy() for w in self.model.get_weights()]

    def on_epoch_end(self, epoch, logs=None):
        self.weights[epoch + 1] = [w.copy() for w in self.model.get_weights()]


def test_callback_records_the_truth_at_every_point():
    model = _relu_model(seed=2)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=LOSS)
    x, y = _teacher_data(seed=3)
    recorder = _WeightRecorder()
    callback = SharpnessCallback(
        (x, y), top_k=2, dtype=np.float64, tol=1e-10, trace=True, trace_products=100
    )
    model.fit(x, y, batch_size=len(x), epochs=3, verbose=0, callbacks=[recorder, callback])
    assert [r["epoch"] for r in callback.history] == [0, 1, 2, 3]
    traces = []
    for record in callback.history:
        truth = ReluMLP(recorder.weights[record["epoch"]], x, y)
        hessian = truth.dense()
        spectrum = np.linalg.eigvalsh(hessian)
        assert record["loss"] == pytest.approx(truth.loss(), rel=1e-12)
        assert np.all(_within_bounds(record["eigenvalues"], record["error_bounds"], spectrum)), (
            record["epoch"],
            record["eigenvalues"],
            spectrum[-2:],
        )
        # 4 points, false alarm 4 · 2.4e-6 (TRACE_SIGMAS).
        error = abs(record["trace"] - np.trace(hessian))
        assert error <= TRACE_SIGMAS * record["trace_stderr"], record["epoch"]
        traces.append(np.trace(hessian))
    # Training moved the weights: the points are different matrices.
    assert len(set(np.round(traces, 12))) == 4
