"""``spectra sharpness --tensorboard DIR``: each checkpoint's values as TensorBoard scalars at
its step, read back with TensorFlow's event reader and compared with sharpness.json; a resumed
run leaves one value per step."""

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _events import event_files, expected_scalars, read_scalars

from spectra.cli import main

DATA = Path(__file__).resolve().parents[2] / "data"
TRAJECTORY = DATA / "gd_trajectory"
ARGS = [
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


def _run(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["sharpness", *args, *ARGS])
    return status, out.getvalue(), err.getvalue()


def _expected(report: dict) -> dict:
    done = [entry for entry in report["checkpoints"] if entry["status"] == "done"]
    threshold = report["threshold"]["value"]  # SGD's 2/η: it bounds H, which is measured
    return expected_scalars(done, [entry["step"] for entry in done], threshold=lambda _: threshold)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("tb")
    status, printed, err = _run(
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


def test_each_checkpoint_is_written_at_its_step(two_checkpoints):
    base, report = two_checkpoints
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
    status, _, _ = _run([*args, "--skip-bad"])
    assert status == 1
    run = tmp_path / "spectra"
    first = json.loads((tmp_path / "out" / "sharpness.json").read_text())
    assert read_scalars(run) == _expected(first)
    assert [step for step, _ in read_scalars(run)["sharpness/lambda_1"]] == [0]
    # A file a killed run left (the same values again) is replaced too.
    shutil.copy(event_files(run)[0], run / (event_files(run)[0].name + "x.spectra-sharpness"))
    # Resumed with the checkpoint repaired: step 20 is measured, step 0 kept.
    shutil.copy(TRAJECTORY / "step_0020.keras", checkpoints)
    status, printed, err = _run(args)
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
    status = main([*args, *ARGS, "--tensorboard", str(target)])
    assert status == 2
    message = capsys.readouterr().err.strip()
    assert message == (
        f"spectra: error: --tensorboard: log_dir '{target}': '{tmp_path / 'FILE'}' is a file, "
        "not a directory: give the TensorBoard log directory (it is created if missing)."
    )
    assert not (tmp_path / "out").exists()  # refused before anything was written
