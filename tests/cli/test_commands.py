"""The ``spectra`` command line on the committed assets in data/ (small subsets, few steps)."""

import contextlib
import csv
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from spectra import HessianOperator, eigenvalues
from spectra._format import plus_minus
from spectra.cli import main
from spectra.io.checkpoints import load_model
from spectra.io.datasets import load_data

ROOT = Path(__file__).resolve().parents[2]
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
    mass = results["negative_mass"]
    assert mass["tau"] == 0.01 and mass["threshold"] == pytest.approx(-0.01 * eig["eigenvalues"][0])
    assert 0 <= mass["lower"] <= mass["estimate"] <= mass["upper"] <= 1
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
    top, bound = results["eigenvalues"]["eigenvalues"][0], results["eigenvalues"]["error_bounds"][0]
    assert f"λ1 = {plus_minus(top, bound)}   residual" in printed
    assert "λ1/λ3 = " in printed
    trace = results["trace"]
    printed_trace = plus_minus(trace["estimate"], trace["stderr"])
    assert f"trace (hutchinson) = {printed_trace} (standard error)" in printed
    assert "spectral mass below -0.01·λ1" in printed
    assert str(out / "results.json") in printed and str(out / "density.png") in printed


@pytest.mark.parametrize(
    ("value", "error", "text"),
    [
        (20.9152, 0.87, "20.92 ± 0.87"),
        (3.7447885, 4.5e-6, "3.7447885 ± 4.5e-06"),
        (2.77259e-05, 3.2e-05, "2.8e-05 ± 3.2e-05"),
        (10.4721, 0.59, "10.47 ± 0.59"),
        (1.6441033, 2e-6, "1.6441033 ± 2.0e-06"),
        (-0.0374, 0.002, "-0.0374 ± 0.0020"),
        (1.5, None, "1.5"),
        (1.5, float("nan"), "1.5 ± nan"),
        (None, 0.1, "n/a"),
    ],
)
def test_plus_minus_rounds_the_value_to_its_uncertainty(value, error, text):
    assert plus_minus(value, error) == text


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
    # The cost announced first is the number of evaluations run: 3·5 + 1 on the curves,
    # 5² + 1 on the surface.
    assert curves["num_evaluations"] + surface["num_evaluations"] == 42
    assert "landscape: 42 loss evaluations (one pass over 200 examples each)" in printed


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
        expected = "needs class indices in [0, 10) for a model with 10 outputs, but y[0] = 12"
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


# --------------------------------------------------------------------------- more errors


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.startswith("spectra: error: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.mark.parametrize(
    "case",
    [
        "empty npz",
        "scalar npz",
        "top-k above the parameters",
        "hutch++ with 2 products",
        "out is a file",
        "missing option",
        "bad format",
        "surface of one point",
    ],
)
def test_more_errors_are_one_line_before_any_computation(case, tmp_path, capsys):
    out = tmp_path / "out"
    data, extra, command = DIGITS, [], "analyze"
    if case == "empty npz":
        data = _npz(tmp_path / "empty.npz", x=np.zeros((0, 64)), y=np.zeros(0, np.int64))
        expected = "holds no examples"
    elif case == "scalar npz":
        data = _npz(tmp_path / "scalar.npz", x=np.float32(1.0), y=np.int64(0))
        expected = "'x' in"
    elif case == "top-k above the parameters":
        tiny = tmp_path / "tiny.keras"
        keras = pytest.importorskip("keras")
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1, use_bias=False)])
        model.save(tiny)
        data = _npz(tmp_path / "d.npz", x=np.ones((4, 64), np.float32), y=np.ones((4, 1)))
        extra = ["--top-k", "65"]
        expected = "--top-k 65 is more than the 64 trainable parameters"
    elif case == "hutch++ with 2 products":
        extra = ["--trace", "--trace-method", "hutch++", "--trace-products", "2"]
        expected = "trace_products 2 does not suit trace method 'hutch++'"
    elif case == "out is a file":
        out.write_text("a file")
        expected = "is a file, not a directory"
    elif case == "missing option":
        expected = "the following arguments are required: --data"
    elif case == "bad format":
        extra = ["--format", "png,docx"]
        expected = "unknown figure format"
    else:
        command, extra = "landscape", ["--directions", "2", "--points", "1"]
        expected = "needs --points 3 or more"
    model = str(tmp_path / "tiny.keras") if case == "top-k above the parameters" else MLP
    loss = ["--loss", "mse" if "top-k" in case else LOSS]
    data_option = [] if case == "missing option" else ["--data", data]
    args = [command, model, *data_option, *loss, "--out", str(out), "--no-progress", *extra]
    if case in ("missing option", "bad format"):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        status = exit_info.value.code
    else:
        status = main(args)
    assert status == 2
    assert expected in _one_line_error(capsys)
    assert not (out / "results.json").exists() if out.is_dir() else True


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(Exception, match="No data file"):
        main(
            [
                "analyze",
                MLP,
                "--data",
                str(tmp_path / "x.npz"),
                "--loss",
                LOSS,
                "--out",
                str(tmp_path / "out"),
                "--debug",
            ]
        )


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


# --------------------------------------------------------------------------- resume


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


# --------------------------------------------------------------------------- thresholds, units


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


# --------------------------------------------------------------------------- analyze, landscape


def test_strict_json_with_one_density_probe(tmp_path, capsys):
    out = tmp_path / "out"
    args = _small(
        "analyze",
        MLP,
        out,
        *("--top-k", "1", "--density", "--density-probes", "1", "--density-steps", "8"),
        *("--format", "png,svg,pdf"),
    )
    assert main(args) == 0

    def refuse(token):
        raise AssertionError(f"non-JSON token {token}")

    results = json.loads((out / "results.json").read_text(), parse_constant=refuse)
    assert results["density_moments"]["stderr"] == [None] * 5
    reasons = results["null_values"]
    assert reasons["density_moments.stderr[0]"].startswith("NaN: a standard error needs")
    for stem in ("eigenvalues", "density"):
        for fmt in ("png", "svg", "pdf"):
            assert (out / f"{stem}.{fmt}").stat().st_size > 1000
    assert results["files"]["density_figure"] == [
        str(out / f"density.{f}") for f in ("png", "svg", "pdf")
    ]


def test_landscape_with_one_point_evaluates_alpha_zero(tmp_path):
    out = tmp_path / "out"
    args = _small("landscape", MLP, out, "--points", "1")
    status, printed = _run(args)
    assert status == 0
    report = json.loads((out / "landscape.json").read_text())
    assert report["curves"]["alphas"] == [0.0]
    base = report["curves"]["base_loss"]
    assert report["curves"]["losses"]["v1"] == [pytest.approx(base, rel=1e-6)]
    assert "loss at α = 0: " in printed and "±" not in printed.split("radius")[1]


def test_landscape_default_radius_follows_the_curvature(tmp_path):
    out = tmp_path / "out"
    args = _small("landscape", MLP, out, "--points", "5")
    assert main(args) == 0
    report = json.loads((out / "landscape.json").read_text())
    loss, top = report["curves"]["base_loss"], report["eigenvalues"]["eigenvalues"][0]
    radius = 2 * math.sqrt(2 * loss / top)
    assert report["radius"]["value"] == pytest.approx(radius)
    np.testing.assert_allclose(report["curves"]["alphas"], np.linspace(-radius, radius, 5))


def test_help_and_numpy_estimators_do_not_import_tensorflow():
    code = (
        "import sys, numpy as np, spectra, spectra.cli\n"
        "from spectra.cli._parser import build_parser\n"
        "build_parser().format_help()\n"
        "spectra.eigenvalues(np.diag([3.0, 2.0, 1.0]), k=1)\n"
        "assert isinstance(spectra.plotting.plot_sharpness, object)\n"
        "assert callable(spectra.trace) and callable(spectra.eigenvalues)\n"
        "import spectra.estimators.stochastic_trace, spectra.estimators.eigensolvers\n"
        "assert callable(spectra.trace) and callable(spectra.eigenvalues)\n"
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --------------------------------------------------------------------------- compiled checkpoints


def _adam_run(
    directory: Path, name: str, x: np.ndarray, y: np.ndarray, layers: list, dense_steps=(2, 4)
) -> tuple:
    """A float64 classifier compiled with its loss and Adam (η = 0.05), saved before
    training (step 0, no optimizer state) and after 2 and 4 full-batch steps, with the
    dense Hessian H and D = P^{-1/2} of the live optimizer at the ``dense_steps``."""
    import keras
    import tensorflow as tf
    from _dense import dense_hessian

    from spectra.analysis.preconditioning import preconditioner_diagonal

    run = directory / "run"
    run.mkdir()
    data = _npz(directory / "data.npz", x=x, y=y)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(layers, name=name)
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    def loss():
        logits = model(x, training=False)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    model.save(run / "step_0000.keras")
    truth = {}
    for step in (2, 4):
        model.fit(x, y, batch_size=len(x), epochs=2, shuffle=False, verbose=0)
        model.save(run / f"step_{step:04d}.keras")
        if step not in dense_steps:
            continue
        variables = model.trainable_variables
        diagonal = preconditioner_diagonal(model.optimizer, variables)
        truth[step] = {
            "H": dense_hessian(loss, variables),
            "D": 1.0 / np.sqrt(diagonal),
            "loss": float(loss()),
        }
    return run, data, truth


@pytest.fixture(scope="module")
def adam_lstm_run(tmp_path_factory):
    """Embedding → LSTM → Dense on token sequences (61 parameters)."""
    import keras

    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, size=(24, 5)).astype(np.int32)
    y = rng.integers(0, 3, size=24)
    layers = [
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(6, 2, mask_zero=True, dtype="float64", name="embedding"),
        keras.layers.LSTM(2, dtype="float64", name="lstm"),
        keras.layers.Dense(3, dtype="float64", name="logits"),
    ]
    directory = tmp_path_factory.mktemp("lstm")
    return _adam_run(directory, "lstm_classifier", x, y, layers, dense_steps=(4,))


@pytest.fixture(scope="module")
def adam_mlp_run(tmp_path_factory):
    """A 4-5-3 tanh MLP (43 parameters)."""
    import keras

    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 4))
    y = rng.integers(0, 3, size=30)
    layers = [
        keras.Input((4,), dtype="float64"),
        keras.layers.Dense(5, activation="tanh", dtype="float64"),
        keras.layers.Dense(3, dtype="float64"),
    ]
    return _adam_run(tmp_path_factory.mktemp("mlp"), "adam_mlp", x, y, layers)


def _eigh_descending(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values, vectors = np.linalg.eigh(matrix)
    return values[::-1], vectors[:, ::-1]


@pytest.mark.slow
@pytest.mark.long  # a compiled checkpoint without --loss is covered on the MLP too
def test_analyze_a_compiled_lstm_checkpoint_without_loss(adam_lstm_run, tmp_path):
    """No --loss: the compiled loss; λ and the per-layer table against dense eigh (1e-8)."""
    run, data, truth = adam_lstm_run
    out = tmp_path / "out"
    checkpoint = run / "step_0004.keras"
    args = ["analyze", str(checkpoint), "--data", data, "--top-k", "2", "--tol", "1e-10"]
    args += ["--layers", "--trace", "--trace-products", "10", "--no-progress", "--out", str(out)]
    status, printed = _run(args)
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    assert settings["loss"] is None and settings["curvature"] == "hessian"
    assert settings["matrix"] == "Hessian" and settings["layers"] is True
    # Compiled with from_logits=True (the fixture): the record says so.
    assert results["model"]["compiled_loss"] == "sparse_categorical_crossentropy(from_logits=True)"
    assert results["model"]["compiled_loss_config"]["config"]["from_logits"] is True
    H = truth[4]["H"]
    dense, _ = _eigh_descending(H)
    np.testing.assert_allclose(results["eigenvalues"]["eigenvalues"], dense[:2], rtol=1e-8)
    # The compiled loss is the mean cross-entropy on logits the dense Hessian differentiates.
    assert results["loss"] == pytest.approx(truth[4]["loss"], rel=1e-12)

    # Per layer: the diagonal blocks of the dense Hessian.
    layers = results["layers"]
    assert layers["groups"] == ["embedding", "lstm/lstm_cell", "logits"]
    bounds = np.cumsum([0, 12, 40, 9])
    assert layers["group_sizes"] == [12, 40, 9]
    for index in range(3):
        block = H[bounds[index] : bounds[index + 1], bounds[index] : bounds[index + 1]]
        top, _ = _eigh_descending(block)
        np.testing.assert_allclose(layers["eigenvalues"][index], top[:2], rtol=1e-8)
        # Hutchinson with 10 Rademacher probes: (estimate − trace)/s.e. is roughly t with 9
        # degrees of freedom; |t| > 6 has probability about 2e-4.
        error = abs(layers["traces"][index] - np.trace(block))
        assert error <= 6 * layers["trace_stderr"][index]
    table = results["layer_table"]
    assert [row["group"] for row in table] == layers["groups"]
    for row, values, trace_value in zip(table, layers["eigenvalues"], layers["traces"]):
        assert row["eigenvalues"] == values and row["trace"] == trace_value
    assert "per layer (3 layers" in printed and "lstm/lstm_cell" in printed
    _assert_png(out / "layers.png")
    assert results["files"]["layers_figure"] == [str(out / "layers.png")]


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


def test_landscape_of_a_compiled_checkpoint_without_loss(adam_mlp_run, tmp_path):
    run, data, truth = adam_mlp_run
    out = tmp_path / "out"
    args = ["landscape", str(run / "step_0004.keras"), "--data", data, "--points", "3"]
    assert main([*args, "--no-progress", "--out", str(out)]) == 0
    report = json.loads((out / "landscape.json").read_text())
    assert report["curves"]["losses"]["v1"][1] == pytest.approx(truth[4]["loss"], rel=1e-12)
    top = np.linalg.eigvalsh(truth[4]["H"])[-1]
    assert report["eigenvalues"]["eigenvalues"][0] == pytest.approx(top, rel=1e-6)
    assert report["settings"]["loss"] is None


def _compiled_sgd_checkpoint(tmp_path: Path) -> Path:
    """The digits GD model compiled with SGD, after one step."""
    import keras

    model = keras.models.load_model(DATA / "gd_trajectory" / "step_0000.keras", compile=False)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    digits = load_data(DIGITS, max_examples=60)
    model.fit(digits.x, digits.y, batch_size=60, epochs=1, verbose=0)
    path = tmp_path / "sgd_0001.keras"
    model.save(path)
    return path


@pytest.mark.parametrize(
    "case",
    [
        "no compiled loss",
        "no optimizer state",
        "optimizer without preconditioner",
        "matrix missing from this build",
        "unknown curvature",
    ],
)
def test_curvature_and_preconditioner_errors_are_one_line(case, tmp_path, capsys, monkeypatch):
    import spectra

    out = tmp_path / "out"
    command, target, extra = "analyze", MLP, ["--loss", LOSS]
    if case == "no compiled loss":
        extra = []
        expected = "digits_mlp.keras carries no compiled loss"
    elif case == "no optimizer state":
        # A copy without the trajectory.json beside it (whose SGD line would be warned about).
        command, target = "sharpness", tmp_path / "step_0000.keras"
        target.write_bytes((DATA / "gd_trajectory" / "step_0000.keras").read_bytes())
        extra += ["--preconditioned"]
        expected = "step_0000.keras: no optimizer state (saved without compile"
    elif case == "optimizer without preconditioner":
        command, extra = "sharpness", ["--preconditioned"]
        target = _compiled_sgd_checkpoint(tmp_path)
        expected = "sgd_0001.keras is SGD, which has no preconditioner (P = I)"
    elif case == "matrix missing from this build":
        # As if this build had no GGNOperator (whether or not it has one).
        import spectra.operators

        monkeypatch.delitem(spectra.operators._SOURCE, "GGNOperator", raising=False)
        monkeypatch.delattr(spectra.operators, "GGNOperator", raising=False)
        extra += ["--curvature", "ggn"]
        expected = "--curvature ggn needs spectra.GGNOperator, which this build"
    else:
        extra += ["--curvature", "hessain"]
        expected = "argument --curvature: invalid choice: 'hessain'"
    args = [command, str(target), "--data", DIGITS, "--max-examples", "60", *extra]
    args += ["--no-progress", "--out", str(out)]
    try:
        status = main(args)
    except SystemExit as exit_info:
        status = exit_info.code
    assert status == 2
    assert expected in _one_line_error(capsys)
    assert not (out / "results.json").exists()


def _checkpoint_truths(checkpoint: Path, data: str) -> dict[str, np.ndarray]:
    """Dense G = (1/N) Σ Jᵢᵀ (diag pᵢ − pᵢpᵢᵀ) Jᵢ and empirical Fisher (1/N) Σ gᵢgᵢᵀ of a
    float64 classifier whose last layer gives logits, by TensorFlow Jacobians: of all the
    examples' logits at once (the summed loss's Hessian in them is block diagonal, one
    block per example) and one gradient per example."""
    import keras
    import tensorflow as tf
    from _gauss_newton import dense_ggn, per_example_gradients

    model = keras.models.load_model(checkpoint, compile=False)
    arrays = np.load(data)
    x, y = arrays["x"], arrays["y"]
    n = len(x)
    variables = model.trainable_variables

    def softmax_cross_entropy(points, label):
        return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(label, points[0]))

    G = dense_ggn(
        [(lambda: [model(x)], lambda points: softmax_cross_entropy(points, y), 1 / n)], variables
    )
    gradients = per_example_gradients(
        [lambda i=i: softmax_cross_entropy([model(x[i : i + 1])], y[i : i + 1]) for i in range(n)],
        variables,
    )
    return {"ggn": G, "fisher-empirical": gradients.T @ gradients / n}


@pytest.mark.parametrize("curvature", ["ggn", "fisher-empirical", "fisher-mc"])
def test_analyze_curvature_matrices_against_dense_truths(curvature, adam_mlp_run, tmp_path):
    """--curvature: the GGN and the empirical Fisher against dense matrices from per-example
    Jacobians (1e-8); the Monte Carlo Fisher (random labels) against the library operator
    built with the command's seed, and its top eigenvalue below the GGN's trace."""
    import keras

    from spectra import FisherOperator

    run, data, _ = adam_mlp_run
    checkpoint = run / "step_0004.keras"
    out = tmp_path / "out"
    args = ["analyze", str(checkpoint), "--data", data, "--curvature", curvature, "--top-k", "2"]
    args += ["--tol", "1e-10", "--seed", "5", "--trace", "--trace-products", "10"]
    status, printed = _run([*args, "--no-progress", "--out", str(out)])
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["curvature"] == curvature
    found = np.array(results["eigenvalues"]["eigenvalues"])
    if curvature == "fisher-mc":
        model = keras.models.load_model(checkpoint, compile=False)
        arrays = np.load(data)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        op = FisherOperator.from_keras(model, loss, (arrays["x"], arrays["y"]), kind="mc", seed=5)
        matrix = op @ np.eye(op.shape[0])
        assert "Monte Carlo Fisher" in printed
    else:
        matrix = _checkpoint_truths(checkpoint, data)[curvature]
    dense, _ = _eigh_descending((matrix + matrix.T) / 2)
    np.testing.assert_allclose(found, dense[:2], rtol=1e-8)
    assert np.all(np.abs(found - dense[:2]) <= np.array(results["eigenvalues"]["error_bounds"]))
    # Hutchinson, 10 Rademacher probes: |t| > 6 has probability about 2e-4 (t, 9 dof).
    assert abs(results["trace"]["estimate"] - np.trace(matrix)) <= 6 * results["trace"]["stderr"]
