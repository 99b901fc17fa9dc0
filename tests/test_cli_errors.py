"""Every error in what a user gives the command line is one line ``spectra: error: ...``
with exit status 2, found before anything is measured and before any result is written.

In-process through ``spectra.cli.main`` (fast), plus one run of ``python -m spectra``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spectra.cli import main

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
DIGITS = str(DATA / "digits.npz")
MLP = str(DATA / "digits_mlp.keras")
LOSS = "sparse_categorical_crossentropy"
COMMON = ["--data", DIGITS, "--loss", LOSS, "--max-examples", "50", "--no-progress"]


def _status(args: list[str]) -> int:
    """``main(args)``'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(args)
    except SystemExit as exit_info:
        return int(exit_info.code)


def _one_line_error(capsys, status: int) -> str:
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.err.startswith("spectra: error: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    return captured.err


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Two checkpoints of the committed gradient-descent run, without trajectory.json."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("step_0000.keras", "step_0020.keras"):
        shutil.copyfile(DATA / "gd_trajectory" / name, run / name)
    return run


def _nothing_written(out: Path) -> bool:
    return not out.exists() or not any(
        p.name.startswith(("sharpness", "landscape", "results")) for p in out.iterdir()
    )


# --------------------------------------------------------------------------- trajectory.json


@pytest.mark.parametrize(
    "content, expected",
    [
        ("{not json", "as JSON"),
        ('{"learning_rate": -0.2}', "has learning_rate -0.2, not a positive number"),
        ('{"learning_rate": "0.2"}', "has learning_rate '0.2', not a positive number"),
        ('{"learning_rate": 0}', "has learning_rate 0, not a positive number"),
    ],
    ids=["not json", "negative rate", "string rate", "zero rate"],
)
def test_a_bad_trajectory_json_is_one_line(content, expected, run_dir, tmp_path, capsys):
    (run_dir / "trajectory.json").write_text(content)
    out = tmp_path / "out"
    status = _status(["sharpness", str(run_dir), *COMMON, "--out", str(out)])
    error = _one_line_error(capsys, status)
    assert expected in error and "trajectory.json" in error and "--lr" in error
    assert _nothing_written(out)


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


# --------------------------------------------------------------------------- sharpness.json


@pytest.mark.parametrize(
    "content, expected",
    [
        ("{corrupt", "is not a sharpness record of spectra (JSONDecodeError"),
        ("[1, 2, 3]", "is not a sharpness record of spectra (TypeError"),
        ('{"format": "other", "settings": {}, "plan": [], "checkpoints": []}', "in the format"),
        ('{"settings": {}}', "is not a sharpness record of spectra (KeyError"),
    ],
    ids=["truncated", "a list", "another format", "missing keys"],
)
def test_a_corrupt_sharpness_json_is_refused_in_one_line(
    content, expected, run_dir, tmp_path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sharpness.json").write_text(content)
    status = _status(["sharpness", str(run_dir), *COMMON, "--lr", "0.2", "--out", str(out)])
    error = _one_line_error(capsys, status)
    assert expected in error and "--restart" in error
    # The stored file is left as it was for the user to look at.
    assert (out / "sharpness.json").read_text() == content


# --------------------------------------------------------------------------- steps and files


@pytest.mark.parametrize(
    "case, expected",
    [
        ("more steps than files", "Got 3 steps for 2 checkpoint files"),
        ("fewer steps than files", "Got 1 steps for 2 checkpoint files"),
        ("a repeated step", "Several checkpoints share a step: {5:"),
        ("names without steps", "No step number in the file name(s)"),
        ("two copies of one step", "Several checkpoints share a step: {0:"),
        ("no checkpoints", "No checkpoints match"),
        ("a step that is not a number", "argument --steps: invalid int value"),
    ],
)
def test_step_and_file_conflicts_are_one_line(case, expected, run_dir, tmp_path, capsys):
    steps: list[str] = []
    spec = str(run_dir)
    if case == "more steps than files":
        steps = ["--steps", "0", "10", "20"]
    elif case == "fewer steps than files":
        steps = ["--steps", "0"]
    elif case == "a repeated step":
        steps = ["--steps", "5", "5"]
    elif case == "names without steps":
        for name, new in (("step_0000.keras", "first.keras"), ("step_0020.keras", "last.keras")):
            (run_dir / name).rename(run_dir / new)
    elif case == "two copies of one step":
        shutil.copyfile(run_dir / "step_0000.keras", run_dir / "copy_0.keras")
    elif case == "no checkpoints":
        spec = str(run_dir / "*.weights.h5")
    else:
        steps = ["--steps", "0", "twenty"]
    out = tmp_path / "out"
    status = _status(["sharpness", spec, *COMMON, "--lr", "0.2", *steps, "--out", str(out)])
    assert expected in _one_line_error(capsys, status)
    assert _nothing_written(out)


# --------------------------------------------------------------------------- landscape


@pytest.mark.parametrize(
    "options, expected",
    [
        (["--radius", "0"], "argument --radius: must be a positive number, got 0"),
        (["--radius", "-1"], "argument --radius: must be a positive number, got -1"),
        (["--radius", "nan"], "argument --radius: must be a positive number, got nan"),
        (["--radius", "inf"], "argument --radius: must be a positive number, got inf"),
        (["--radius", "wide"], "argument --radius: must be a positive number, got 'wide'"),
        (["--directions", "3"], "argument --directions: invalid choice: 3"),
        (["--directions", "0"], "argument --directions: invalid choice: 0"),
        (["--directions", "v1"], "argument --directions: invalid int value: 'v1'"),
        (["--directions", "2", "--points", "1"], "needs --points 3 or more"),
        (["--points", "0"], "argument --points: must be a positive integer, got 0"),
        (["--trace"], "unrecognized arguments: --trace"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_landscape_errors_are_one_line(options, expected, tmp_path, capsys):
    out = tmp_path / "out"
    status = _status(["landscape", MLP, *COMMON, *options, "--out", str(out)])
    error = _one_line_error(capsys, status)
    assert expected in error, error
    assert _nothing_written(out)


# --------------------------------------------------------------------------- a real process


def test_one_line_error_from_a_process(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "MPLBACKEND": "Agg"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = ["landscape", MLP, *COMMON, "--radius", "0", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "spectra", *command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("spectra: error: argument --radius: must be a positive number")
    assert done.stderr.count("\n") == 1
    assert not out.exists()
