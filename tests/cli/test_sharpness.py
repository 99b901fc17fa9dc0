"""Tests of ``spectra sharpness`` (spectra.cli.sharpness).

``spectra sharpness --x steps|epochs`` (and ``spectra plot --x``): each checkpoint at its
training step (``--steps``, the optimizer's iteration counter saved in the checkpoint, or
the file names) or epoch (the file names, or steps / ``--steps-per-epoch``), the axis
label naming the source, both axes recorded in sharpness.json; one-line errors when the
unit cannot be known; the optimizer named when its threshold is not drawn.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import keras
import matplotlib
import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest
from _cli_helpers import DATA, DIGITS, LOSS, ROOT, _assert_png, _run
from _events import event_files, expected_scalars, read_scalars
from scipy.sparse.linalg import eigsh

import spectra
import spectra.cli.analyze
import spectra.cli.sharpness
from spectra import HessianOperator, eigenvalues
from spectra.analysis.minibatch import draw_minibatches
from spectra.analysis.trajectory import plan_checkpoints
from spectra.cli import main
from spectra.cli._common import UserError
from spectra.io.checkpoints import find_checkpoints, load_model, stored_iterations
from spectra.io.datasets import load_data
from spectra.reports.base import InputError
from spectra.reports.sharpness_axes import x_axes

matplotlib.use("Agg")


# Four checkpoints of the GD trajectory: steps 0, 20, 40, 60.
TRAJECTORY_GLOB = str(DATA / "gd_trajectory" / "step_00[0-6]0.keras")


SHARPNESS_ARGS = [
    "sharpness",
    TRAJECTORY_GLOB,
    "--data",
    DIGITS,
    "--loss",
    LOSS,
    "--max-examples",
    "200",
    "--float64",
    "--trace",
    "--trace-products",
    "10",
    "--no-progress",
]


def _spectra_process(args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "MPLBACKEND": "Agg"}
    return subprocess.Popen(
        [sys.executable, "-m", "spectra", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


@pytest.fixture(scope="module")
def sharpness_run(tmp_path_factory):
    """An uninterrupted sharpness run over four checkpoints."""
    out = tmp_path_factory.mktemp("sharpness")
    status, printed = _run([*SHARPNESS_ARGS, "--out", str(out)])
    assert status == 0
    return out, json.loads((out / "sharpness.json").read_text()), printed


def test_sharpness_json_csv_and_figure(sharpness_run):
    out, report, printed = sharpness_run
    entries = report["checkpoints"]
    steps = [entry["step"] for entry in entries]
    assert steps == [0, 20, 40, 60]
    assert [entry["file"] for entry in entries] == [f"step_{s:04d}.keras" for s in steps]
    assert report["learning_rate"] == 0.2
    assert report["learning_rate_source"].endswith("trajectory.json")
    assert report["threshold"]["value"] == pytest.approx(10.0)
    assert report["threshold"]["formula"] == "2/η" and report["threshold"]["optimizer"] == "SGD"
    assert report["step_unit"] == "step" and report["step_source"] == "file names"
    assert "SGD (η = 0.2): 2/η = 10" in printed
    for entry in entries:
        for key in ("eigenvalues", "error_bounds", "residual_norms", "trace", "trace_stderr"):
            assert entry[key] is not None, key
        assert entry["num_products"] > 0 and entry["wall_time"] > 0 and entry["loss"] > 0
        assert entry["status"] == "done" and len(entry["sha256"]) == 64
    # One model for the four checkpoints; each eigensolve after the first starts warm.
    assert [entry["warm_start"] for entry in entries] == [False, True, True, True]
    # How far the top eigenvector turned since the previous checkpoint: ⟨v_t, v_{t−1}⟩².
    assert entries[0]["eigenvector_overlap"] is None
    assert all(0 < entry["eigenvector_overlap"] <= 1 for entry in entries[1:])
    # progressive sharpening at the start of the run
    sharpness = [entry["eigenvalues"][0] for entry in entries]
    assert sharpness == sorted(sharpness)
    # Lanczos certifies its bounds at the default level: recorded, and no caveat printed.
    assert all(0 <= entry["failure_probability"] <= 1e-4 for entry in entries)
    assert "not proven" not in printed and "not certified" not in printed

    with open(out / "sharpness.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert [int(row["step"]) for row in rows] == steps
    assert all(row["status"] == "done" for row in rows)
    for row, entry in zip(rows, entries, strict=True):
        assert row["file"] == entry["file"]
        assert float(row["eigenvalue_1"]) == entry["eigenvalues"][0]
        assert float(row["error_bound_1"]) == entry["error_bounds"][0]
        assert float(row["trace"]) == entry["trace"]
        assert float(row["loss"]) == entry["loss"]
        overlap = entry["eigenvector_overlap"]
        assert row["eigenvector_overlap"] == ("" if overlap is None else repr(overlap))
    _assert_png(out / "sharpness.png")


@pytest.mark.slow
def test_sharpness_resumes_after_being_killed(tmp_path, sharpness_run):
    _, uninterrupted, _ = sharpness_run
    out = tmp_path / "resumed"
    args = [*SHARPNESS_ARGS, "--out", str(out)]
    process = _spectra_process(args, start_new_session=True)
    json_path = out / "sharpness.json"
    done_at_kill = 0
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if json_path.exists():
                done_at_kill = len(json.loads(json_path.read_text())["checkpoints"])
                if done_at_kill >= 1:
                    break
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    assert 1 <= done_at_kill < 4, "the run was not interrupted part way"

    status, printed = _run(args)
    assert status == 0
    assert f"resuming: {done_at_kill} of 4 checkpoints already done" in printed
    assert sum(line.startswith("step ") for line in printed.splitlines()) == 4 - done_at_kill
    resumed = json.loads(json_path.read_text())
    assert [e["step"] for e in resumed["checkpoints"]] == [0, 20, 40, 60]
    for got, want in zip(resumed["checkpoints"], uninterrupted["checkpoints"], strict=True):
        # The first checkpoint after the resume starts from the eigenvectors the killed run
        # kept (warm_start.npz), as the uninterrupted run did: every number is the same, bit
        # for bit (values, bounds, overlaps, traces), all but the wall time.
        for key in set(want) - {"wall_time", "path"}:
            assert got[key] == want[key], key
    with open(out / "sharpness.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert [int(row["step"]) for row in rows] == [0, 20, 40, 60]
    # Nothing of the killed run is left: no temporary files, no lock.
    assert sorted(p.name for p in out.iterdir()) == [
        ".spectra-manifest.json",
        "sharpness.csv",
        "sharpness.json",
        "sharpness.png",
        "warm_start.npz",
    ]


def test_sharpness_refuses_changed_settings_and_restarts(tmp_path, capsys):
    out = tmp_path / "one"
    first = [
        "sharpness",
        str(DATA / "gd_trajectory" / "step_0000.keras"),
        "--data",
        DIGITS,
        "--loss",
        LOSS,
        "--max-examples",
        "100",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(first) == 0
    before = (out / "sharpness.json").read_text()
    capsys.readouterr()

    assert main([*first, "--top-k", "2"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("spectra: error: ") and error.count("\n") == 1
    assert "top_k: 1 -> 2" in error and "--restart" in error
    assert (out / "sharpness.json").read_text() == before

    assert main([*first, "--top-k", "2", "--restart"]) == 0
    report = json.loads((out / "sharpness.json").read_text())
    assert report["settings"]["top_k"] == 2
    assert len(report["checkpoints"][0]["eigenvalues"]) == 2

    assert main([*first, "--top-k", "2"]) == 0
    assert "resuming: 1 of 1 checkpoints already done" in capsys.readouterr().out
    # Nothing was loaded this time; the model's description is kept from the first run.
    report = json.loads((out / "sharpness.json").read_text())
    assert report["model"]["name"] == "digits_gd_mlp"
    assert report["model"]["num_parameters"] == 3466


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.startswith("spectra: error: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


def _unwritable_directory(tmp_path: Path) -> Path:
    """An existing directory this process cannot write in."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return locked
    # root writes anywhere but on a read-only file system such as sysfs.
    for candidate in (Path("/sys/kernel"), Path("/sys")):
        try:
            tempfile.TemporaryFile(dir=candidate).close()
        except OSError:
            return candidate
    pytest.skip("no unwritable directory for root on this machine")


def test_unwritable_out_is_refused_before_anything_is_computed(tmp_path, monkeypatch, capsys):
    out = _unwritable_directory(tmp_path)
    before = sorted(p.name for p in out.iterdir())

    def must_not_run(*args, **kwargs):
        raise AssertionError("a checkpoint was measured")

    monkeypatch.setattr("spectra.analysis.trajectory.measure_sharpness", must_not_run)
    monkeypatch.setattr("spectra.cli.sharpness.measure_sharpness", must_not_run)
    assert main([*SHARPNESS_ARGS, "--out", str(out)]) == 2
    error = _one_line_error(capsys)
    assert error.startswith(f"spectra: error: --out: cannot write to the output directory '{out}'")
    assert sorted(p.name for p in out.iterdir()) == before


def test_a_second_run_on_the_same_out_refuses_at_once(tmp_path):
    from spectra.analysis.trajectory import SharpnessRun

    out = tmp_path / "out"
    with SharpnessRun(out):
        process = _spectra_process([*SHARPNESS_ARGS, "--out", str(out)])
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    assert f"another spectra run (pid {os.getpid()}) is writing to" in stderr
    assert stderr.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == []


def _small(command: str, target: str | Path, out: Path, *extra: str) -> list[str]:
    """A command on 60 examples of the digits, without progress bars."""
    return [
        command,
        str(target),
        "--data",
        DIGITS,
        "--loss",
        LOSS,
        "--max-examples",
        "60",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]


def _small_sharpness(directory: Path, out: Path, *extra: str) -> list[str]:
    return _small("sharpness", directory, out, *extra)


@pytest.fixture
def two_checkpoints(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("step_0000.keras", "step_0020.keras"):
        (run / name).write_bytes((DATA / "gd_trajectory" / name).read_bytes())
    return run


def test_resume_refuses_changed_steps_and_another_run(tmp_path, two_checkpoints, capsys):
    out = tmp_path / "out"
    assert main(_small_sharpness(two_checkpoints, out)) == 0
    before = (out / "sharpness.json").read_text()
    capsys.readouterr()
    assert main(_small_sharpness(two_checkpoints, out, "--steps", "0", "40")) == 2
    assert "steps changed: step_0020.keras 20 -> 40" in _one_line_error(capsys)
    # Another run whose checkpoints have the same names.
    other = tmp_path / "other"
    other.mkdir()
    for source, name in (("0100", "0000"), ("0120", "0020")):
        (other / f"step_{name}.keras").write_bytes(
            (DATA / "gd_trajectory" / f"step_{source}.keras").read_bytes()
        )
    assert main(_small_sharpness(other, out)) == 2
    assert "checkpoint contents changed: step_0000.keras" in _one_line_error(capsys)
    assert (out / "sharpness.json").read_text() == before
    assert main(_small_sharpness(other, out, "--restart")) == 0
    report = json.loads((out / "sharpness.json").read_text())
    assert len(report["checkpoints"]) == 2


def test_skip_bad_records_a_corrupt_checkpoint_and_goes_on(tmp_path, two_checkpoints, capsys):
    broken = two_checkpoints / "step_0010.keras"
    broken.write_bytes((DATA / "gd_trajectory" / "step_0040.keras").read_bytes()[:500])
    out = tmp_path / "out"
    assert main(_small_sharpness(two_checkpoints, out)) == 2
    error = _one_line_error(capsys)
    assert "step_0010.keras" in error and "--skip-bad" in error

    assert main(_small_sharpness(two_checkpoints, out, "--skip-bad")) == 1
    captured = capsys.readouterr()
    assert "1 of 3 checkpoints failed" in captured.err
    report = json.loads((out / "sharpness.json").read_text())
    statuses = {entry["file"]: entry["status"] for entry in report["checkpoints"]}
    assert statuses == {
        "step_0000.keras": "done",
        "step_0010.keras": "failed",
        "step_0020.keras": "done",
    }
    (failed,) = [e for e in report["checkpoints"] if e["status"] == "failed"]
    assert (
        failed["error"].startswith("ValueError: ")
        and "not a valid .keras archive" in failed["error"]
    )
    assert failed["eigenvalues"] is None
    # The failed one is tried again by the next run.
    assert main(_small_sharpness(two_checkpoints, out, "--skip-bad")) == 1
    assert "retrying 1 checkpoints that failed before" in capsys.readouterr().out
    # Repaired (a new content is no conflict for a checkpoint without a result), it is measured.
    broken.write_bytes((DATA / "gd_trajectory" / "step_0040.keras").read_bytes())
    assert main(_small_sharpness(two_checkpoints, out)) == 0
    assert "resuming: 2 of 3 checkpoints already done" in capsys.readouterr().out
    report = json.loads((out / "sharpness.json").read_text())
    assert [e["status"] for e in report["checkpoints"]] == ["done"] * 3


def test_recorded_optimizer_threshold_and_epoch_unit(tmp_path, capsys):
    import keras

    run = tmp_path / "run"
    run.mkdir()
    model = keras.models.load_model(DATA / "gd_trajectory" / "step_0000.keras", compile=False)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=LOSS)
    for epoch in (1, 2):
        model.save(run / f"epoch_{epoch:03d}.keras")
    out = tmp_path / "out"
    assert main(_small_sharpness(run, out, "--lr", "0.002")) == 0
    captured = capsys.readouterr()
    assert "--lr 0.002 differs from the learning rate 0.001" in captured.err
    # Adam's threshold bounds λ_max(P⁻¹H), not the λ_max(H) measured: not drawn, printed
    # or recorded as this run's threshold (the learning rate is).
    assert "no threshold: Adam's threshold (2+2β₁)/((1−β₁)η) bounds" in captured.err
    assert "× threshold" not in captured.out and "(threshold" not in captured.out
    report = json.loads((out / "sharpness.json").read_text())
    assert report["threshold"] is None and report["learning_rate"] == 0.002
    assert report["step_unit"] == "epoch"
    assert "epoch      2  λ1 = " in captured.out


def test_gradient_descent_line_with_lr_alone(tmp_path, two_checkpoints, capsys):
    out = tmp_path / "out"
    assert main(_small_sharpness(two_checkpoints, out, "--lr", "0.5", "--quiet")) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    report = json.loads((out / "sharpness.json").read_text())
    assert report["threshold"]["optimizer"] == "gradient descent"
    assert report["threshold"]["value"] == pytest.approx(4.0)


def _eigh_descending(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values, vectors = np.linalg.eigh(matrix)
    return values[::-1], vectors[:, ::-1]


def test_sharpness_preconditioned_on_adam_checkpoints(adam_mlp_run, tmp_path, capsys):
    """λ_max(P⁻¹H) from the optimizer state each checkpoint carries, against the dense
    D H D at save time and the library on the loaded checkpoint; the checkpoint saved
    before the first step has no state."""
    import spectra

    run, data, truth = adam_mlp_run
    out = tmp_path / "out"
    args = ["sharpness", str(run), "--data", data, "--preconditioned", "--tol", "1e-10"]
    args += ["--plot-overlap", "--no-progress", "--out", str(out)]
    assert main(args) == 2
    error = _one_line_error(capsys)
    assert "step_0000.keras: no optimizer state yet" in error and "--skip-bad" in error

    assert main([*args, "--skip-bad"]) == 1
    captured = capsys.readouterr()
    assert "bounds the preconditioned sharpness" not in captured.err
    report = json.loads((out / "sharpness.json").read_text())
    assert report["settings"]["matrix"] == "preconditioned Hessian P⁻¹H"
    assert report["settings"]["loss"] is None
    threshold = report["threshold"]
    assert threshold["optimizer"] == "Adam" and threshold["preconditioned"] is True
    assert threshold["value"] == pytest.approx(38 / 0.05)
    # η read back from Adam's float32 variable is 0.05 again; the stored value is recorded.
    assert report["learning_rate"] == threshold["learning_rate"] == 0.05
    assert report["learning_rate_stored"] == float(np.float32(0.05)) != 0.05
    assert "(threshold 760)" in captured.out
    failed, *done = report["checkpoints"]
    assert failed["status"] == "failed" and "no optimizer state yet" in failed["error"]
    vectors = {}
    for entry in done:
        dense = truth[entry["step"]]
        D = dense["D"]
        values, vectors[entry["step"]] = _eigh_descending(D[:, None] * dense["H"] * D[None, :])
        assert entry["eigenvalues"][0] == pytest.approx(values[0], rel=1e-8)
        assert entry["num_data_passes"] > 0  # counted through the preconditioned operator
        model = load_model(run / entry["file"], compile=True)
        op = HessianOperator.from_keras(model, None, load_data(data).as_tuple())
        library = eigenvalues(spectra.preconditioned(op, model.optimizer), k=1, tol=1e-10)
        assert entry["eigenvalues"][0] == pytest.approx(library.eigenvalues[0], rel=1e-10)
    # Overlap only between neighbours: step 2 follows a failed checkpoint.
    assert done[0]["eigenvector_overlap"] is None
    expected = float(vectors[2][:, 0] @ vectors[4][:, 0]) ** 2
    assert done[1]["eigenvector_overlap"] == pytest.approx(expected, abs=1e-6)
    _assert_png(out / "sharpness.png")


# 64 examples in batches of 16: 4 optimizer steps per epoch.
STEPS_PER_EPOCH = 4


@pytest.fixture(scope="module")
def adam_epochs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epoch-named .keras checkpoints of a compiled MLP trained with Adam: the
    optimizer's iteration counter is 4 after epoch 1 and 8 after epoch 2."""
    import keras

    run = tmp_path_factory.mktemp("adam") / "run"
    run.mkdir()
    digits = np.load(DIGITS)
    x, y = digits["x"][:64], digits["y"][:64]
    model = keras.models.load_model(DATA / "gd_trajectory" / "step_0000.keras", compile=False)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=LOSS)
    for epoch in (1, 2):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        model.save(run / f"epoch_{epoch:03d}.keras")
    return run


def _copies(tmp_path: Path, names: list[str], source: str = "step_0000.keras") -> Path:
    """Uncompiled checkpoints (no optimizer state) under other names."""
    run = tmp_path / "named"
    run.mkdir()
    for name in names:
        shutil.copyfile(DATA / "gd_trajectory" / source, run / name)
    return run


def _axes(directory: Path, *, x: str | None, per_epoch: int | None = None, steps=None):
    plan = plan_checkpoints(find_checkpoints(directory, steps=steps))
    return x_axes(plan, x_axis=x, steps_per_epoch=per_epoch, steps=steps)


def _figure(path: Path, x: str | None = None):
    from spectra.cli.plot import _drawing, _read

    options = argparse.Namespace(style="column", no_title=False, caption="full", x_axis=x)
    draw, _ = _drawing(path, _read(path), options)
    ((_, _, figure),) = draw()
    return figure


def test_stored_iterations_reads_the_optimizer_counter(adam_epochs, tmp_path):
    assert stored_iterations(adam_epochs / "epoch_001.keras") == STEPS_PER_EPOCH
    assert stored_iterations(adam_epochs / "epoch_002.keras") == 2 * STEPS_PER_EPOCH
    # An uncompiled model, a file that is not a checkpoint: no counter.
    assert stored_iterations(DATA / "gd_trajectory" / "step_0020.keras") is None
    (tmp_path / "junk.keras").write_bytes(b"not a zip")
    assert stored_iterations(tmp_path / "junk.keras") is None


def test_weights_file_counter(adam_epochs, tmp_path):
    import keras

    model = keras.models.load_model(adam_epochs / "epoch_002.keras")
    model.save_weights(tmp_path / "w.weights.h5")
    assert stored_iterations(tmp_path / "w.weights.h5") == 2 * STEPS_PER_EPOCH


@pytest.mark.slow  # a sharpness run through TensorFlow (about 6 s)
def test_steps_from_the_optimizer_and_epochs_from_steps_per_epoch(adam_epochs, tmp_path, capsys):
    out = tmp_path / "out"
    status = main(
        [
            "sharpness",
            str(adam_epochs),
            "--data",
            DIGITS,
            "--loss",
            LOSS,
            "--max-examples",
            "60",
            "--no-progress",
            "--out",
            str(out),
            "--x",
            "steps",
            "--steps-per-epoch",
            str(STEPS_PER_EPOCH),
        ]
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    path = out / "sharpness.json"
    report = json.loads(path.read_text())
    assert report["x_axis"] == "steps"
    steps, epochs = report["x_axes"]["steps"], report["x_axes"]["epochs"]
    assert steps["source"] == "optimizer iterations"
    assert steps["values"] == {"epoch_001.keras": 4, "epoch_002.keras": 8}
    assert steps["label"] == "Training step (optimizer iterations)"
    assert epochs["values"] == {"epoch_001.keras": 1.0, "epoch_002.keras": 2.0}
    assert epochs["label"] == "Epoch (optimizer iterations / 4)"
    # The recorded entries keep the file names' numbers (resume matches on them).
    assert [entry["step"] for entry in report["checkpoints"]] == [1, 2]
    # Adam's threshold bounds λ_max(P⁻¹H): dropped, named in the warning and the record.
    assert "no threshold: Adam's threshold (2+2β₁)/((1−β₁)η) bounds" in captured.err
    assert report["threshold"] is None and report["dropped_threshold"]["optimizer"] == "Adam"
    assert isinstance(spectra.load(path), spectra.reports.SharpnessReport)

    # Redrawn from the JSON: the run's axis, then the other one with spectra plot --x.
    figure = _figure(path)
    ax = figure.axes[0]
    assert ax.get_xlabel() == "Training step (optimizer iterations)"
    assert list(ax.get_lines()[0].get_xdata()) == [4, 8]
    texts = [text.get_text().replace("\n", " ") for text in figure.legends[0].get_texts()]
    assert "no threshold: Adam's is for λ₁(P⁻¹H), not λ₁(H)" in texts, texts
    plt.close(figure)
    figure = _figure(path, "epochs")
    ax = figure.axes[0]
    assert ax.get_xlabel() == "Epoch (optimizer iterations / 4)"
    assert list(ax.get_lines()[0].get_xdata()) == [1.0, 2.0]
    plt.close(figure)
    assert main(["plot", str(path), "--x", "epochs", "--quiet"]) == 0
    assert (out / "replot" / "sharpness.png").is_file()


def test_default_and_epochs_from_the_file_names(adam_epochs):
    from spectra.reports.sharpness_axes import x_positions

    axes = _axes(adam_epochs, x="epochs")
    assert axes["epochs"]["label"] == "Epoch (from the file names)"
    assert axes["epochs"]["values"] == {"epoch_001.keras": 1, "epoch_002.keras": 2}
    assert axes["steps"]["source"] == "optimizer iterations"
    done = [{"file": "epoch_001.keras", "step": 1}, {"file": "epoch_002.keras", "step": 2}]
    report = {"x_axes": axes}
    # Without --x: the names' own numbers, labelled with what they count.
    assert x_positions(report, done, None, "epoch", "file names") == (
        [1, 2],
        "Epoch (from the file names)",
    )
    assert x_positions(report, done, "steps", "epoch", "file names") == (
        [4, 8],
        "Training step (optimizer iterations)",
    )


def test_steps_from_the_file_names_and_from_steps(tmp_path):
    run = _copies(tmp_path, ["step_0000.keras", "step_0020.keras"])
    axes = _axes(run, x="steps")
    assert axes["steps"] == {
        "source": "file names",
        "label": "Training step (from the file names)",
        "values": {"step_0000.keras": 0, "step_0020.keras": 20},
    }
    assert "epochs" not in axes
    axes = _axes(run, x="epochs", per_epoch=10, steps=[0, 50])
    assert axes["steps"]["label"] == "Training step (from --steps)"
    assert axes["epochs"]["label"] == "Epoch (--steps / 10)"
    assert axes["epochs"]["values"] == {"step_0000.keras": 0.0, "step_0020.keras": 5.0}
    axes = _axes(run, x="epochs", per_epoch=10)
    assert axes["epochs"]["label"] == "Epoch (steps in the file names / 10)"
    assert axes["epochs"]["source"] == "file names / 10"
    assert axes["epochs"]["values"] == {"step_0000.keras": 0.0, "step_0020.keras": 2.0}


@pytest.mark.parametrize(
    ("names", "x", "per_epoch", "message"),
    [
        (
            ["epoch_001.keras", "epoch_002.keras"],
            "steps",
            None,
            "--x steps: the checkpoints' training steps are not known: the file names count "
            "epochs, not steps (epoch_001.keras, …) and no checkpoint holds an optimizer "
            "iteration counter (a .keras or .weights.h5 saved from a compiled model after "
            "training does); pass --steps STEP [STEP ...] (one per checkpoint file, in "
            "natural name order).",
        ),
        (
            ["step_0000.keras", "step_0020.keras"],
            "epochs",
            None,
            "--x epochs: the checkpoints' epochs are not known (the file names count steps, "
            "not epochs): pass --steps-per-epoch N (the optimizer steps in one epoch) to "
            "plot training step / N.",
        ),
        (
            ["ckpt-1.keras", "ckpt-2.keras"],
            "epochs",
            5,
            "--x epochs: --steps-per-epoch 5 divides the training steps, which are not known: "
            "the file names count checkpoints, not steps (ckpt-1.keras, …) and no checkpoint "
            "holds an optimizer iteration counter",
        ),
        (
            ["step_0000.keras", "step_0020.keras"],
            None,
            5,
            "--steps-per-epoch 5 places the checkpoints at training step / 5 on an epoch "
            "axis: add --x epochs (or leave it out).",
        ),
    ],
)
def test_unknown_units_are_refused(names, x, per_epoch, message, tmp_path):
    run = _copies(tmp_path, names)
    with pytest.raises(InputError) as caught:
        _axes(run, x=x, per_epoch=per_epoch)
    assert str(caught.value).startswith(message), str(caught.value)


def test_some_checkpoints_without_a_counter(adam_epochs, tmp_path):
    run = tmp_path / "mixed"
    run.mkdir()
    shutil.copyfile(adam_epochs / "epoch_001.keras", run / "epoch_001.keras")
    shutil.copyfile(DATA / "gd_trajectory" / "step_0000.keras", run / "epoch_002.keras")
    with pytest.raises(InputError, match=r"1 of 2 checkpoints hold no optimizer iteration "):
        _axes(run, x="steps")
    # Two saves with the same counter are not training steps.
    shutil.copyfile(adam_epochs / "epoch_001.keras", run / "epoch_002.keras")
    with pytest.raises(InputError, match=r"counters repeat \(\[4, 4\]"):
        _axes(run, x="steps")


def test_cli_error_is_one_line_with_status_2(tmp_path, capsys):
    run = _copies(tmp_path, ["epoch_001.keras", "epoch_002.keras"])
    args = [
        "sharpness", str(run), "--data", DIGITS, "--loss", LOSS, "--max-examples", "60",
        "--no-progress", "--out", str(tmp_path / "out"), "--x", "steps",
    ]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("spectra: error: --x steps: the checkpoints' training steps are not")
    assert err.count("\n") == 1


def test_plot_refuses_an_axis_the_run_did_not_record(tmp_path, capsys):
    record = {
        "type": "SharpnessReport",
        "command": f"spectra sharpness run --data {DIGITS} --out o",
        "step_unit": "step",
        "step_source": "file names",
        "checkpoints": [
            {"status": "done", "file": "step_0000.keras", "step": 0},
        ],
        "x_axes": {"steps": {"source": "file names", "label": "x", "values": {}}},
    }
    path = tmp_path / "sharpness.json"
    path.write_text(json.dumps(record))
    from spectra.cli.plot import _drawing

    options = argparse.Namespace(style=None, no_title=False, caption="short", x_axis="epochs")
    with pytest.raises(UserError, match=r"--x epochs: the run records no epochs for its "):
        _drawing(path, record, options)


COMMON = ["--data", DIGITS, "--loss", LOSS, "--max-examples", "50", "--no-progress"]


def _status(args: list[str]) -> int:
    """``main(args)``'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(args)
    except SystemExit as exit_info:
        return int(exit_info.code)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Two checkpoints of the committed gradient-descent run, without trajectory.json."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("step_0000.keras", "step_0020.keras"):
        shutil.copyfile(DATA / "gd_trajectory" / name, run / name)
    return run


def test_the_advice_for_a_bad_trajectory_json_works(run_dir, tmp_path, capsys):
    """The error says 'give --lr'; with --lr the run no longer depends on the file."""
    (run_dir / "trajectory.json").write_text("{not json")
    out = tmp_path / "out"
    args = ["sharpness", str(run_dir), *COMMON, "--lr", "0.2", "--top-k", "1", "--tol", "1e-3"]
    status = _status([*args, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert status == 0, err
    assert "trajectory.json' as JSON" in err and "ignored, η from --lr" in err  # a warning
    assert json.loads((out / "sharpness.json").read_text())["threshold"]["learning_rate"] == 0.2


def test_the_supported_optimizers_are_those_spectra_reads():
    from spectra._keras_compat import OPTIMIZER_SLOTS
    from spectra.reports.thresholds import PRECONDITIONED_OPTIMIZERS

    assert tuple(OPTIMIZER_SLOTS) == PRECONDITIONED_OPTIMIZERS


def test_a_refusal_is_worded_for_the_command_line() -> None:
    from spectra.cli.sharpness import _refusal_in_words

    old, new = "a" * 64, "b" * 64
    text = (
        f"'f1/sharpness.json' holds results computed with other settings (loss: None -> "
        f"'sparse_categorical_crossentropy'; data_sha256: '{old}' -> '{new}'); rerun with "
        "--restart (restart=True) to discard them, or choose another output directory."
    )
    assert _refusal_in_words(text) == (
        "'f1/sharpness.json' holds results computed with other settings (loss: the compiled "
        "loss -> 'sparse_categorical_crossentropy'; data: other examples (sha256 "
        f"{old[:12]}… -> {new[:12]}…)); rerun with --restart to discard them, or choose "
        "another output directory."
    )
    assert "-> the compiled loss" in _refusal_in_words("(loss: 'mse' -> None)")


TRAJECTORY = DATA / "gd_trajectory"


def _sharpness(pattern: str, out: Path | str, *extra: str) -> list[str]:
    return [
        "sharpness",
        str(TRAJECTORY / pattern),
        "--data",
        DIGITS,
        "--loss",
        LOSS,
        "--max-examples",
        "100",
        "--float64",
        "--trace",
        "--trace-products",
        "4",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]


# --------------------------------------------------------------------------- resume


def test_a_resumed_sharpness_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path, monkeypatch):
    command = spectra.cli.sharpness
    pattern = "step_00[0-4]0.keras"  # steps 0, 20, 40
    assert main(_sharpness(pattern, tmp_path / "whole")) == 0

    measure = command.measure_sharpness
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # after the first checkpoint was recorded
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    monkeypatch.setattr(command, "measure_sharpness", interrupted)
    out = tmp_path / "resumed"
    assert main(_sharpness(pattern, out)) == 130
    assert len(json.loads((out / "sharpness.json").read_text())["checkpoints"]) == 1
    monkeypatch.setattr(command, "measure_sharpness", measure)
    assert main(_sharpness(pattern, out)) == 0

    whole = json.loads((tmp_path / "whole" / "sharpness.json").read_text())["checkpoints"]
    resumed = json.loads((out / "sharpness.json").read_text())["checkpoints"]
    assert [entry["step"] for entry in resumed] == [0, 20, 40]
    for got, want in zip(resumed, whole, strict=True):
        # Everything but the wall time, as floats bit for bit: values, bounds, trace, loss,
        # overlaps, products; the first checkpoint after the resume starts warm.
        del got["wall_time"], want["wall_time"], got["path"], want["path"]
        assert got == want
    assert resumed[1]["warm_start"] and resumed[1]["eigenvector_overlap"] is not None


# ``spectra sharpness --per-batch M --per-batch-size B``: λ₁ on M mini-batches at every
# checkpoint, against a direct loop over the same batches (each batch's Hessian built on its
# own and its top eigenvalue found by SciPy's ARPACK, not spectra's eigensolver).

CHECKPOINT = DATA / "gd_trajectory" / "step_0100.keras"
MINIBATCH_ARGS = ["--data", str(DATA / "digits.npz"), "--loss", LOSS, "--max-examples", "200"]
MINIBATCH_ARGS += ["--seed", "3", "--no-progress"]


def _run_minibatch(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["sharpness", *args, *MINIBATCH_ARGS])
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("minibatch") / "out"
    status, printed, err = _run_minibatch(
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
    status, _, err = _run_minibatch(
        [str(CHECKPOINT), "--per-batch", "5", "--per-batch-size", "32", "--out", str(out)]
    )
    assert status != 0 and "per_batch: 4 -> 5" in err
    status, _, err = _run_minibatch(
        [str(CHECKPOINT), "--per-batch", "4", "--out", str(tmp_path / "o")]
    )
    assert status != 0 and "per_batch_size is required" in err


# ``spectra sharpness --tensorboard DIR``: each checkpoint's values as TensorBoard scalars at
# its step, read back with TensorFlow's event reader and compared with sharpness.json; a resumed
# run leaves one value per step.

TENSORBOARD_ARGS = [
    "--data",
    str(DATA / "digits.npz"),
    "--loss",
    "sparse_categorical_crossentropy",
    "--max-examples",
    "200",
    "--trace",
    "--trace-products",
    "4",
    "--no-progress",
]


def _run_tensorboard(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["sharpness", *args, *TENSORBOARD_ARGS])
    return status, out.getvalue(), err.getvalue()


def _expected(report: dict) -> dict:
    done = [entry for entry in report["checkpoints"] if entry["status"] == "done"]
    threshold = report["threshold"]["value"]  # SGD's 2/η: it bounds H, which is measured
    return expected_scalars(done, [entry["step"] for entry in done], threshold=lambda _: threshold)


@pytest.fixture(scope="module")
def tensorboard_checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("tb")
    status, printed, err = _run_tensorboard(
        [
            str(TRAJECTORY / "step_00[02]0.keras"),
            "--out",
            str(base / "out"),
            "--tensorboard",
            str(base / "logs"),
            "--per-batch",
            "2",
            "--per-batch-size",
            "50",
        ]
    )
    assert status == 0, err
    # The console says where the events went.
    (written,) = event_files(base / "logs" / "spectra")
    assert (
        f"TensorBoard: 2 steps in {written} (view with: tensorboard --logdir {base / 'logs'})"
        in printed
    )
    return base, json.loads((base / "out" / "sharpness.json").read_text())


def test_each_checkpoint_is_written_at_its_step(tensorboard_checkpoints):
    base, report = tensorboard_checkpoints
    run = base / "logs" / "spectra"
    assert len(event_files(run)) == 1
    expected = _expected(report)
    assert [step for step, _ in expected["sharpness/lambda_1"]] == [0, 20]
    assert expected["sharpness/threshold"] == [(0, np.float32(10.0)), (20, np.float32(10.0))]
    assert [step for step, _ in expected["sharpness/eigenvector_overlap"]] == [20]
    assert [step for step, _ in expected["sharpness/minibatch_lambda_1_q50"]] == [0, 20]
    assert read_scalars(run) == expected


def test_a_resumed_run_holds_each_step_once(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    shutil.copy(TRAJECTORY / "step_0000.keras", checkpoints)
    shutil.copy(TRAJECTORY / "trajectory.json", checkpoints)
    (checkpoints / "step_0020.keras").write_bytes(b"not a keras file")
    args = [str(checkpoints), "--out", str(tmp_path / "out"), "--tensorboard", str(tmp_path)]
    # First run: step 0 measured, step 20 recorded as failed.
    status, _, _ = _run_tensorboard([*args, "--skip-bad"])
    assert status == 1
    run = tmp_path / "spectra"
    first = json.loads((tmp_path / "out" / "sharpness.json").read_text())
    assert read_scalars(run) == _expected(first)
    assert [step for step, _ in read_scalars(run)["sharpness/lambda_1"]] == [0]
    # A file a killed run left (the same values again) is replaced too.
    shutil.copy(event_files(run)[0], run / (event_files(run)[0].name + "x.spectra-sharpness"))
    # Resumed with the checkpoint repaired: step 20 is measured, step 0 kept.
    shutil.copy(TRAJECTORY / "step_0020.keras", checkpoints)
    status, printed, err = _run_tensorboard(args)
    assert status == 0, err
    assert "resuming: 1 of 2 checkpoints already done" in printed
    report = json.loads((tmp_path / "out" / "sharpness.json").read_text())
    assert len(event_files(run)) == 1
    written = read_scalars(run)
    assert written == _expected(report)
    assert [step for step, _ in written["sharpness/lambda_1"]] == [0, 20]
    # The value at step 0 is the first run's.
    assert written["sharpness/lambda_1"][0] == (
        0,
        np.float32(first["checkpoints"][0]["eigenvalues"][0]),
    )


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_a_tensorboard_path_that_is_not_a_directory_is_refused(tmp_path, capsys, where):
    (tmp_path / "FILE").write_text("not a directory")
    target = tmp_path / "FILE" if where == "file" else tmp_path / "FILE" / "logs"
    args = ["sharpness", str(TRAJECTORY), "--out", str(tmp_path / "out")]
    status = main([*args, *TENSORBOARD_ARGS, "--tensorboard", str(target)])
    assert status == 2
    message = capsys.readouterr().err.strip()
    assert message == (
        f"spectra: error: --tensorboard: log_dir '{target}': '{tmp_path / 'FILE'}' is a file, "
        "not a directory: give the TensorBoard log directory (it is created if missing)."
    )
    assert not (tmp_path / "out").exists()  # refused before anything was written
