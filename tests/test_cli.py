"""The ``spectra`` command line on the committed assets in data/ (small subsets, few steps)."""

import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from spectra import HessianOperator, eigenvalues
from spectra.checkpoints import load_model
from spectra.cli import main
from spectra.datasets import load_data

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
MLP = str(DATA / "digits_mlp.keras")
DIGITS = str(DATA / "digits.npz")
LOSS = "sparse_categorical_crossentropy"
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
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(args: list[str]) -> tuple[int, str]:
    """``main(args)`` in this process; returns the exit status and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(args)
    return status, out.getvalue()


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


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


# --------------------------------------------------------------------------- help


def test_python_m_spectra_help():
    process = _spectra_process(["--help"])
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    for command in ("analyze", "sharpness", "landscape"):
        assert command in stdout


@pytest.mark.parametrize("command", ["analyze", "sharpness", "landscape"])
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: spectra {command}" in text
    for option in ("--data", "--loss", "--out", "--max-examples", "--float64", "--seed"):
        assert option in text


def test_version(capsys):
    import spectra

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"spectra {spectra.__version__}"


# --------------------------------------------------------------------------- analyze


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    out = tmp_path_factory.mktemp("analyze")
    args = [
        "analyze",
        MLP,
        "--data",
        DIGITS,
        "--loss",
        LOSS,
        "--max-examples",
        "200",
        "--seed",
        "3",
        "--top-k",
        "3",
        "--trace",
        "--trace-products",
        "20",
        "--density",
        "--density-steps",
        "15",
        "--density-probes",
        "2",
        "--float64",
        "--no-progress",
        "--out",
        str(out),
    ]
    status, printed = _run(args)
    assert status == 0
    return out, json.loads((out / "results.json").read_text()), printed


def test_analyze_results_json(analyzed):
    out, results, _ = analyzed
    for key in (
        "command",
        "versions",
        "settings",
        "model",
        "data",
        "loss",
        "eigenvalues",
        "eigenvalue_ratio",
        "trace",
        "density",
        "density_moments",
        "negative_mass",
        "num_products",
        "num_data_passes",
        "wall_times",
        "files",
    ):
        assert key in results, key
    assert set(results["versions"]) >= {"spectra", "tensorflow", "keras", "numpy", "scipy"}
    assert results["command"].startswith("spectra analyze ")
    assert results["settings"]["seed"] == 3 and results["settings"]["dtype"] == "float64"
    assert results["model"]["num_parameters"] == 85002
    assert results["data"]["num_examples"] == 200
    eig = results["eigenvalues"]
    assert len(eig["eigenvalues"]) == 3
    assert len(eig["residual_norms"]) == 3 and len(eig["error_bounds"]) == 3
    assert "eigenvectors" not in eig
    assert eig["eigenvalues"] == sorted(eig["eigenvalues"], reverse=True)
    assert results["eigenvalue_ratio"] == pytest.approx(
        eig["eigenvalues"][0] / eig["eigenvalues"][2]
    )
    assert results["trace"]["stderr"] > 0 and results["trace"]["num_products"] >= 20
    density = results["density"]
    assert np.array(density["nodes"]).shape == (2, 15)
    np.testing.assert_allclose(np.array(density["weights"]).sum(axis=1), 1.0)
    assert len(results["density_moments"]["estimate"]) == 5
    assert 0 <= results["negative_mass"]["fraction"] <= 1
    assert results["num_products"] >= (
        eig["num_products"] + results["trace"]["num_products"] + density["num_products"]
    )
    assert results["wall_times"]["total"] > 0
    assert Path(results["files"]["results"]) == out / "results.json"


def test_analyze_top_eigenvalue_matches_the_library(analyzed):
    _, results, _ = analyzed
    model = load_model(MLP)
    data = load_data(DIGITS, max_examples=200, seed=3)
    op = HessianOperator.from_keras(model, LOSS, data.as_tuple(), dtype=np.float64)
    expected = eigenvalues(op, k=1).eigenvalues[0]
    assert results["eigenvalues"]["eigenvalues"][0] == pytest.approx(expected, rel=1e-6)
    assert results["loss"] == pytest.approx(op.loss(), rel=1e-12)


def test_analyze_figures_and_summary(analyzed):
    out, results, printed = analyzed
    _assert_png(out / "eigenvalues.png")
    _assert_png(out / "density.png")
    top = results["eigenvalues"]["eigenvalues"][0]
    assert f"λ1 = {top:.6g} ±" in printed
    assert "λ1/λ3 = " in printed
    assert "trace (hutchinson) = " in printed
    assert "negative mass" in printed
    assert str(out / "results.json") in printed and str(out / "density.png") in printed


# --------------------------------------------------------------------------- sharpness


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
    assert report["edge_of_stability"] == pytest.approx(10.0)
    assert "learning rate 0.2 from" in printed and "2/lr = 10" in printed
    for entry in entries:
        for key in ("eigenvalues", "error_bounds", "residual_norms", "trace", "trace_stderr"):
            assert entry[key] is not None, key
        assert entry["num_products"] > 0 and entry["wall_time"] > 0 and entry["loss"] > 0
    # progressive sharpening at the start of the run
    sharpness = [entry["eigenvalues"][0] for entry in entries]
    assert sharpness == sorted(sharpness)

    with open(out / "sharpness.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert [int(row["step"]) for row in rows] == steps
    for row, entry in zip(rows, entries, strict=True):
        assert row["file"] == entry["file"]
        assert float(row["eigenvalue_1"]) == entry["eigenvalues"][0]
        assert float(row["error_bound_1"]) == entry["error_bounds"][0]
        assert float(row["trace"]) == entry["trace"]
        assert float(row["loss"]) == entry["loss"]
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
    assert printed.count("already done, skipped") == done_at_kill
    resumed = json.loads(json_path.read_text())
    assert [e["step"] for e in resumed["checkpoints"]] == [0, 20, 40, 60]
    for got, want in zip(resumed["checkpoints"], uninterrupted["checkpoints"], strict=True):
        for key in ("eigenvalues", "error_bounds", "trace", "trace_stderr", "loss"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-9, err_msg=key)
    with open(out / "sharpness.csv", newline="") as stream:
        assert len(list(csv.DictReader(stream))) == 4


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
    assert "already done, skipped" in capsys.readouterr().out


# --------------------------------------------------------------------------- landscape


def test_landscape(tmp_path):
    out = tmp_path / "landscape"
    args = [
        "landscape",
        MLP,
        "--data",
        DIGITS,
        "--loss",
        LOSS,
        "--max-examples",
        "200",
        "--directions",
        "2",
        "--points",
        "4",
        "--radius",
        "0.5",
        "--float64",
        "--no-progress",
        "--out",
        str(out),
    ]
    status, printed = _run(args)
    assert status == 0
    report = json.loads((out / "landscape.json").read_text())
    curves, surface = report["curves"], report["surface"]
    np.testing.assert_allclose(curves["alphas"], [-0.5, -0.25, 0.0, 0.25, 0.5])
    assert curves["labels"] == ["v1", "v2", "random"]
    model = load_model(MLP)
    data = load_data(DIGITS, max_examples=200, seed=0)
    expected = HessianOperator.from_keras(model, LOSS, data.as_tuple()).loss()
    for label in curves["labels"]:
        assert curves["losses"][label][2] == pytest.approx(expected, rel=1e-5)
        assert curves["direction_norms"][label] == pytest.approx(1.0)
    assert np.array(surface["losses_2d"]).shape == (5, 5)
    assert surface["losses_2d"][2][2] == pytest.approx(expected, rel=1e-5)
    # the top eigenvector is the steepest of the three directions
    rise = {label: max(curves["losses"][label]) - expected for label in curves["labels"]}
    assert rise["v1"] > rise["random"]
    assert len(report["eigenvalues"]["eigenvalues"]) == 2
    _assert_png(out / "landscape_1d.png")
    _assert_png(out / "landscape_2d.png")
    assert str(out / "landscape_1d.png") in printed


# --------------------------------------------------------------------------- user errors


def _npz(path: Path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize(
    "case",
    ["missing model", "missing data", "unknown loss", "shape mismatch", "bad labels", "no ckpt"],
)
def test_user_errors_exit_2_with_one_line(case, tmp_path, capsys):
    rng = np.random.default_rng(0)
    model, data, loss, command = MLP, DIGITS, LOSS, "analyze"
    if case == "missing model":
        model = str(tmp_path / "nothing.keras")
        expected = "No model file"
    elif case == "missing data":
        data = str(tmp_path / "nothing.npz")
        expected = "No data file"
    elif case == "unknown loss":
        loss = "not_a_loss"
        expected = "unknown Keras loss"
    elif case == "shape mismatch":
        data = _npz(tmp_path / "wide.npz", x=rng.random((20, 10)), y=np.zeros(20, np.int64))
        expected = "do not fit the model's input"
    elif case == "bad labels":
        x = rng.random((20, 64)).astype(np.float32)
        data = _npz(tmp_path / "labels.npz", x=x, y=np.full(20, 12))
        expected = "labels in [0, 10)"
    else:
        command, model = "sharpness", str(tmp_path)
        expected = "No checkpoints match"
    status = main([command, model, "--data", data, "--loss", loss, "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.startswith("spectra: error: ")
    assert captured.err.count("\n") == 1, captured.err
    assert expected in captured.err
    assert not (tmp_path / "out" / "results.json").exists()
