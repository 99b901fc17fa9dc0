"""Runs over checkpoints (spectra.analysis.trajectory): the measurement against dense truth, warm
starts, one model and one traced engine per architecture, and the resume bookkeeping."""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import dense_hessian

from spectra.analysis.trajectory import (
    ResumeRefused,
    SharpnessMeasurement,
    SharpnessRun,
    SharpnessSettings,
    measure_sharpness,
    plan_checkpoints,
)
from spectra.estimators.stochastic_trace import trace
from spectra.io.checkpoints import CheckpointLoader, find_checkpoints, load_model
from spectra.io.datasets import load_data
from spectra.io.files import DirectoryLocked
from spectra.operators import HessianOperator

ROOT = Path(__file__).resolve().parents[2]
TRAJECTORY = ROOT / "data" / "gd_trajectory"
LOSS = "sparse_categorical_crossentropy"


def _tiny_model(seed: int = 0, dtype: str = "float32") -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5, activation="tanh", dtype=dtype),
            keras.layers.Dense(3, activation="softmax", dtype=dtype),
        ]
    )


@pytest.fixture(scope="module")
def tiny_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(30, 4)), rng.integers(0, 3, 30)


# --------------------------------------------------------------------------- measurement


def test_measurement_against_the_dense_hessian(tiny_data):
    model = _tiny_model(dtype="float64")
    x, y = tiny_data
    op = HessianOperator.from_keras(model, LOSS, (x, y))
    assert op.dtype == np.float64
    settings = SharpnessSettings(top_k=3, tol=1e-10, trace=True, trace_products=20, seed=4)
    measured = measure_sharpness(op, settings)

    loss_object = keras.losses.SparseCategoricalCrossentropy(dtype="float64")
    variables = model.trainable_variables

    def loss() -> tf.Tensor:
        outputs = model.stateless_call([v.value for v in variables], [], tf.constant(x))[0]
        return loss_object(y, outputs)

    truth = np.sort(np.linalg.eigvalsh(dense_hessian(loss, variables)))[::-1][:3]
    # Each eigenvalue lies within its error bound of the true one.
    errors = np.abs(np.array(measured.eigenvalues) - truth)
    assert np.all(errors <= np.array(measured.error_bounds) + 1e-12 * truth[0]), errors
    assert measured.loss == pytest.approx(float(loss()), rel=1e-12)
    # The trace is spectra.trace with the same seed.
    expected = trace(op, num_products=20, seed=4)
    assert measured.trace == expected.estimate and measured.trace_stderr == expected.stderr
    assert measured.num_parameters == op.shape[0] == 4 * 5 + 5 + 5 * 3 + 3
    assert measured.num_products >= 20 + 3 and measured.num_data_passes > 0
    assert measured.eigenvectors.shape == (op.shape[0], 3) and not measured.warm_start
    assert "eigenvectors" not in measured.record()


def test_measurement_refuses_what_it_cannot_measure(tiny_data):
    model = _tiny_model()
    op = HessianOperator.from_keras(model, LOSS, tiny_data)
    with pytest.raises(ValueError, match="more than the 43 parameters"):
        measure_sharpness(op, SharpnessSettings(top_k=44))
    model.layers[0].kernel.assign(np.full((4, 5), np.nan, np.float32))
    with pytest.raises(ValueError, match="(?i)nan|not finite"):
        measure_sharpness(HessianOperator.from_keras(model, LOSS, tiny_data), SharpnessSettings())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 0}, "top_k must be an integer >= 1"),
        ({"tol": 0.0}, "tol must be a positive"),
        ({"method": "arnoldi"}, "method must be one of"),
        ({"trace": True, "trace_method": "hutch++", "trace_products": 2}, "does not suit"),
        ({"trace": True, "trace_method": "xtrace", "trace_products": 3}, "does not suit"),
    ],
)
def test_settings_are_checked_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SharpnessSettings(**kwargs)


def _trajectory_measurements(warm: bool) -> list[SharpnessMeasurement]:
    data = load_data(ROOT / "data" / "digits.npz", max_examples=400, seed=0).as_tuple()
    loader = CheckpointLoader()
    # k = 2: for k = 1 a warm start cannot save products. The eigensolver stops only when
    # a random start's probabilistic bound rules out a larger eigenvalue, and the steps
    # that takes depend on the spectrum, not on how good the start is (spectra.eigenvalues).
    settings = SharpnessSettings(top_k=2, tol=1e-9, warm_start=warm)
    results: list[SharpnessMeasurement] = []
    for ref in find_checkpoints(TRAJECTORY)[3:]:
        op = HessianOperator.from_keras(loader.load(ref.path), LOSS, data, dtype=np.float64)
        previous = results[-1].eigenvectors if results else None
        results.append(measure_sharpness(op, settings, v0=previous))
    return results


def test_warm_starts_use_fewer_products_for_the_same_eigenvalues():
    cold, warm = _trajectory_measurements(False), _trajectory_measurements(True)
    assert [m.warm_start for m in warm] == [False] + [True] * (len(warm) - 1)
    assert not any(m.warm_start for m in cold)
    for a, b in zip(cold, warm):
        # Both lie within their bounds of the true eigenvalues, so within the sum of each other.
        slack = np.array(a.error_bounds) + np.array(b.error_bounds)
        assert np.all(np.abs(np.array(a.eigenvalues) - np.array(b.eigenvalues)) <= slack)
    cold_products = [m.num_products for m in cold[1:]]
    warm_products = [m.num_products for m in warm[1:]]
    # Measured: 170 against 183 products over these 7 checkpoints.
    assert sum(warm_products) < sum(cold_products), (warm_products, cold_products)
    fewer = sum(w < c for w, c in zip(warm_products, cold_products))
    assert fewer >= len(cold_products) // 2, (warm_products, cold_products)


class _MatrixWithGradient:
    """A symmetric matrix as an operator with a gradient (what measure_sharpness reads)."""

    def __init__(self, matrix: np.ndarray, gradient: np.ndarray) -> None:
        self.matrix, self._gradient = matrix, gradient
        self.shape, self.dtype = matrix.shape, matrix.dtype

    def matvec(self, v):
        return self.matrix @ v

    def matmat(self, block):
        return self.matrix @ block

    def gradient(self) -> np.ndarray:
        return self._gradient


def _rotated_pair(rng: np.random.Generator, n: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """Two symmetric matrices with separated top eigenvalues, the second a rotation of the
    first by a small random orthogonal matrix (exp of a skew matrix)."""
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    first = q @ np.diag(np.r_[10.0, 7.0, 5.0, np.linspace(0.0, 2.0, n - 3)]) @ q.T
    skew = rng.standard_normal((n, n)) * 0.15
    import scipy.linalg

    rotation = scipy.linalg.expm(skew - skew.T)
    return first, rotation @ first @ rotation.T


@pytest.mark.parametrize("k", [1, 2])
def test_eigenvector_and_gradient_overlaps_against_eigh(k):
    rng = np.random.default_rng(3)
    first, second = _rotated_pair(rng)
    gradient = rng.standard_normal(first.shape[0])
    settings = SharpnessSettings(top_k=k, tol=1e-12)
    a = measure_sharpness(_MatrixWithGradient(first, gradient), settings)
    b = measure_sharpness(
        _MatrixWithGradient(second, gradient),
        settings,
        v0=a.eigenvectors,
        previous=a.eigenvectors,
        gradient_overlap=True,
    )
    old = np.linalg.eigh(first)[1][:, ::-1][:, :k]
    new = np.linalg.eigh(second)[1][:, ::-1][:, :k]
    # Mean over the new eigenvectors of their fraction in the old span; ⟨v, v'⟩² for k = 1.
    expected = np.mean(np.sum((old.T @ new) ** 2, axis=0))
    assert 0.05 < expected < 0.99  # the rotation is neither negligible nor total
    assert a.eigenvector_overlap is None and a.gradient_overlap is None
    assert b.eigenvector_overlap == pytest.approx(expected, abs=1e-9)
    fraction = np.sum((new.T @ gradient) ** 2) / (gradient @ gradient)
    assert b.gradient_overlap == pytest.approx(fraction, abs=1e-9)
    assert b.record()["eigenvector_overlap"] == b.eigenvector_overlap
    # Eigenvectors of another size (another architecture) give no overlap.
    other = measure_sharpness(
        _MatrixWithGradient(second, gradient), settings, previous=np.ones((7, k))
    )
    assert other.eigenvector_overlap is None


def test_gradient_overlap_needs_a_gradient_and_is_none_for_zero():
    first, _ = _rotated_pair(np.random.default_rng(0))
    settings = SharpnessSettings(top_k=1)
    zero = _MatrixWithGradient(first, np.zeros(first.shape[0]))
    assert measure_sharpness(zero, settings, gradient_overlap=True).gradient_overlap is None
    with pytest.raises(ValueError, match="has no gradient"):
        measure_sharpness(first, settings, gradient_overlap=True)
    nan = _MatrixWithGradient(first, np.full(first.shape[0], np.nan))
    with pytest.raises(ValueError, match="the gradient is not finite"):
        measure_sharpness(nan, settings, gradient_overlap=True)


def test_compiled_loader_restores_the_optimizer_state_of_each_checkpoint(tmp_path, tiny_data):
    """Keras restores Adam's moments from a compiled .keras file, and load_weights of a
    further checkpoint into the shared model restores that one's (a checkpoint saved before
    the first step loads with iterations 0, silently)."""
    x, y = tiny_data
    model = _tiny_model()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
    model.save(tmp_path / "step_0.keras")
    saved = {}
    for step in (1, 3):
        model.fit(x, y, batch_size=30, epochs=2 if step == 3 else 1, verbose=0)
        model.save(tmp_path / f"step_{step}.keras")
        saved[step] = [v.numpy() for v in model.optimizer.variables]
    loader = CheckpointLoader(compile=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Skipping variable loading for optimizer")
        first = loader.load(tmp_path / "step_0.keras")
    assert int(first.optimizer.iterations.numpy()) == 0 and first.loss is not None
    for step in (1, 3):
        loaded = loader.load(tmp_path / f"step_{step}.keras")
        assert loaded is first and int(loaded.optimizer.iterations.numpy()) == step
        for a, b in zip(loaded.optimizer.variables, saved[step]):
            np.testing.assert_array_equal(a.numpy(), b)
    assert loader.num_models_built == 1
    assert getattr(CheckpointLoader().load(tmp_path / "step_3.keras"), "optimizer", None) is None


# --------------------------------------------------------------------------- reuse


class CountingDense(keras.layers.Dense):
    """A Dense layer that counts the Python calls of ``call`` (eager calls and traces)."""

    calls = 0

    def call(self, inputs):
        CountingDense.calls += 1
        return super().call(inputs)


def _counting_model() -> keras.Model:
    return keras.Sequential(
        [keras.Input((4,)), CountingDense(5, activation="tanh"), keras.layers.Dense(3)]
    )


def test_one_model_and_no_retrace_across_checkpoints(tmp_path, tiny_data):
    paths = []
    for step in range(4):
        model = _counting_model()
        keras.utils.set_random_seed(step)
        model.set_weights([np.random.default_rng(step).normal(size=w.shape) for w in model.weights])
        paths.append(tmp_path / f"step_{step}.weights.h5")
        model.save_weights(paths[-1])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loader = CheckpointLoader(builder=_counting_model)
    settings = SharpnessSettings(top_k=1, tol=1e-6)
    calls, models, values = [], set(), []
    for path in paths:
        model = loader.load(path)
        models.add(id(model))
        op = HessianOperator.from_keras(model, loss, tiny_data)
        values.append(measure_sharpness(op, settings).eigenvalues[0])
        calls.append(CountingDense.calls)
    assert len(models) == 1 and loader.num_models_built == 1
    # The layer's Python code ran while the first checkpoint was traced, never again.
    assert calls[0] > 0 and calls[1:] == [calls[0]] * 3
    # The weights are those of each checkpoint: a fresh model gives the same sharpness.
    fresh = load_model(paths[2], builder=_counting_model)
    expected = measure_sharpness(HessianOperator.from_keras(fresh, loss, tiny_data), settings)
    assert values[2] == pytest.approx(expected.eigenvalues[0], rel=1e-5)
    assert len(set(np.round(values, 6))) == 4


def test_keras_checkpoints_share_one_model_with_the_right_weights():
    loader = CheckpointLoader()
    refs = find_checkpoints(TRAJECTORY)[:3]
    models = [loader.load(ref.path) for ref in refs]
    assert models[0] is models[1] is models[2] and loader.num_models_built == 1
    for ref in refs:
        shared = loader.load(ref.path)
        for a, b in zip(shared.get_weights(), load_model(ref.path).get_weights()):
            np.testing.assert_array_equal(a, b)


def test_a_failed_load_gets_a_fresh_model(tmp_path):
    loader = CheckpointLoader()
    first = loader.load(TRAJECTORY / "step_0000.keras")
    # Refused before any weight was touched: the model is kept.
    (tmp_path / "broken.keras").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a valid .keras archive"):
        loader.load(tmp_path / "broken.keras")
    assert loader.load(TRAJECTORY / "step_0020.keras") is first
    # Failed while loading weights (the archive's weights are damaged): a fresh model next.
    with (
        zipfile.ZipFile(TRAJECTORY / "step_0040.keras") as source,
        zipfile.ZipFile(tmp_path / "damaged.keras", "w") as target,
    ):
        for name in source.namelist():
            data = source.read(name)
            target.writestr(name, data[: len(data) // 2] if name.endswith(".h5") else data)
    with pytest.raises(ValueError, match="damaged.keras"):
        loader.load(tmp_path / "damaged.keras")
    again = loader.load(TRAJECTORY / "step_0060.keras")
    assert again is not first and loader.num_models_built == 2


# --------------------------------------------------------------------------- bookkeeping


def _measurement(value: float, stderr: float = 0.1) -> SharpnessMeasurement:
    return SharpnessMeasurement(
        loss=1.0,
        eigenvalues=[value],
        error_bounds=[1e-6],
        residual_norms=[1e-5],
        converged=[True],
        trace=10.0,
        trace_stderr=stderr,
        num_parameters=5,
        num_products=12,
        num_data_passes=12,
        wall_time=0.1,
        seed=0,
        warm_start=False,
    )


SETTINGS = {"top_k": 1, "tol": 1e-8, "loss": LOSS}


@pytest.fixture
def run_files(tmp_path):
    """Three checkpoints of the GD run copied into tmp_path/run."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("step_0000.keras", "step_0020.keras", "step_0040.keras"):
        shutil.copy(TRAJECTORY / name, run / name)
    return run


def _plan(directory: Path, steps=None):
    return plan_checkpoints(find_checkpoints(directory, steps=steps))


def _start(out: Path, plan, settings=SETTINGS, **kwargs):
    """An open run (locked: close it with ``run.__exit__``) and what it resumed."""
    run = SharpnessRun(out)
    run.__enter__()
    try:
        state = run.start(plan, settings, {"command": "test"}, **kwargs)
    except BaseException:
        run.__exit__(None, None, None)
        raise
    return run, state


def test_entries_keyed_by_file_step_and_content_never_duplicated(tmp_path, run_files):
    plan = _plan(run_files)
    run, state = _start(tmp_path / "out", plan)
    assert (state.done, state.failed) == (0, 0)
    assert [item.file for item in run.pending()] == [p.file for p in plan]
    run.record(plan[0], _measurement(1.0))
    run.record(plan[0], _measurement(1.5))  # measured again: replaces, never duplicates
    run.record(plan[1], error="ValueError: broken")
    run.__exit__(None, None, None)
    report = json.loads((tmp_path / "out" / "sharpness.json").read_text())
    entries = report["checkpoints"]
    assert [(e["file"], e["status"]) for e in entries] == [
        ("step_0000.keras", "done"),
        ("step_0020.keras", "failed"),
    ]
    assert entries[0]["eigenvalues"] == [1.5]
    assert entries[0]["sha256"] == plan[0].sha256 and entries[0]["step"] == 0
    assert entries[1]["error"] == "ValueError: broken" and entries[1]["eigenvalues"] is None
    assert report["summary"] == {"checkpoints": 3, "done": 1, "failed": 1, "pending": 1}

    # Resumed: the done one is kept, the failed one and the rest are pending.
    run, state = _start(tmp_path / "out", plan)
    assert (state.done, state.failed) == (1, 1)
    assert [item.file for item in run.pending()] == ["step_0020.keras", "step_0040.keras"]
    run.__exit__(None, None, None)


@pytest.mark.parametrize("change", ["steps", "content", "another run", "settings", "set"])
def test_resume_refuses_what_changed(tmp_path, run_files, change):
    plan = _plan(run_files)
    run, _ = _start(tmp_path / "out", plan)
    run.record(plan[0], _measurement(1.0))
    run.record(plan[1], _measurement(2.0))
    run.__exit__(None, None, None)
    before = (tmp_path / "out" / "sharpness.json").read_text()
    settings = SETTINGS
    if change == "steps":
        new_plan, expected = (
            _plan(run_files, steps=[0, 25, 40]),
            "steps changed: step_0020.keras 20 -> 25",
        )
    elif change == "content":
        shutil.copy(TRAJECTORY / "step_0200.keras", run_files / "step_0020.keras")
        new_plan, expected = _plan(run_files), "checkpoint contents changed: step_0020.keras"
    elif change == "another run":
        other = tmp_path / "other"
        other.mkdir()
        for source, name in zip(("0100", "0120", "0140"), ("0000", "0020", "0040")):
            shutil.copy(TRAJECTORY / f"step_{source}.keras", other / f"step_{name}.keras")
        new_plan, expected = _plan(other), "contents changed: step_0000.keras"
    elif change == "settings":
        new_plan, settings, expected = plan, {**SETTINGS, "tol": 1e-6}, "tol: 1e-08 -> 1e-06"
    else:
        (run_files / "step_0040.keras").unlink()
        new_plan, expected = _plan(run_files), "stored checkpoints no longer given: step_0040"
    with pytest.raises(ResumeRefused, match="--restart") as refused:
        _start(tmp_path / "out", new_plan, settings)
    assert expected in str(refused.value)
    assert (tmp_path / "out" / "sharpness.json").read_text() == before
    # --restart starts over.
    run, state = _start(tmp_path / "out", new_plan, settings, restart=True)
    assert state.done == 0 and len(run.pending()) == len(new_plan)
    run.__exit__(None, None, None)


def test_a_failed_checkpoint_may_be_replaced(tmp_path, run_files):
    plan = _plan(run_files)
    run, _ = _start(tmp_path / "out", plan)
    run.record(plan[0], _measurement(1.0))
    run.record(plan[1], error="ValueError: truncated")
    run.__exit__(None, None, None)
    shutil.copy(TRAJECTORY / "step_0200.keras", run_files / "step_0020.keras")  # repaired
    run, state = _start(tmp_path / "out", _plan(run_files))
    assert (state.done, state.failed) == (1, 0)
    assert [item.file for item in run.pending()] == ["step_0020.keras", "step_0040.keras"]
    run.__exit__(None, None, None)


def test_one_process_at_a_time_and_stale_locks_are_taken_over(tmp_path, run_files):
    out = tmp_path / "out"
    first = SharpnessRun(out).__enter__()
    with pytest.raises(DirectoryLocked, match=f"pid {os.getpid()}"):
        SharpnessRun(out).__enter__()
    first.__exit__(None, None, None)
    assert not (out / ".spectra.lock").exists()
    # A lock file left by a process that died (no flock held on it): taken over.
    (out / ".spectra.lock").write_text("999999999 somehost 0\n")
    with SharpnessRun(out) as run:
        run.start(_plan(run_files), SETTINGS)


def test_temporaries_removed_and_csv_rebuilt_from_the_json(tmp_path, run_files):
    plan = _plan(run_files)
    out = tmp_path / "out"
    run, _ = _start(out, plan)
    run.record(plan[0], _measurement(1.0))
    run.__exit__(None, None, None)
    # What a killed run can leave: temporaries, and a CSV one row ahead of the JSON.
    leftovers = [out / ".sharpness.json.k2j4h5l6.tmp", out / ".sharpness.png.x1y2z3w4.tmp"]
    for path in leftovers:
        path.write_text("partial")
    (out / ".unrelated.tmp").write_text("not ours")
    (out / "sharpness.csv").write_text("step,file\n0,a\n20,b\n")
    run, state = _start(out, plan, extra_outputs=["sharpness.png"])
    run.__exit__(None, None, None)
    assert state.removed_temporaries == 2
    assert not any(path.exists() for path in leftovers)
    assert (out / ".unrelated.tmp").exists()
    rows = (out / "sharpness.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].startswith("0,step_0000.keras,done,1.0,1.0,")


def test_strict_json_with_reasons(tmp_path, run_files):
    plan = _plan(run_files)
    run, _ = _start(tmp_path / "out", plan)
    run.record(plan[0], _measurement(1.0, stderr=math.nan))
    run.__exit__(None, None, None)
    text = (tmp_path / "out" / "sharpness.json").read_text()

    def refuse(token):
        raise AssertionError(f"non-JSON token {token}")

    report = json.loads(text, parse_constant=refuse)
    assert report["checkpoints"][0]["trace_stderr"] is None
    reason = report["null_values"]["checkpoints[0].trace_stderr"]
    assert reason.startswith("NaN: a standard error needs at least two probes")
    csv_row = (tmp_path / "out" / "sharpness.csv").read_text().splitlines()[1].split(",")
    assert "nan" not in [value.lower() for value in csv_row]


@pytest.mark.parametrize(
    ("content", "cause"),
    [
        (b"\xff\xfe not text", "not UTF-8"),
        (b"[" * 10_000, "nested more than"),
        (b'{"format": "spectra-sharpness', "cut short"),
    ],
    ids=["binary", "deeply-nested", "truncated"],
)
def test_resume_refuses_a_damaged_record_in_one_line(tmp_path, run_files, content, cause):
    plan = _plan(run_files)
    run, _ = _start(tmp_path / "out", plan)
    run.record(plan[0], _measurement(1.0))
    run.__exit__(None, None, None)
    (tmp_path / "out" / "sharpness.json").write_bytes(content)
    with pytest.raises(ResumeRefused, match="not a sharpness record") as refused:
        _start(tmp_path / "out", plan)
    message = str(refused.value)
    assert cause in message and "sharpness.json" in message and "\n" not in message
