"""The console and error defects a reviewer found running every command, each with the
reviewer's inputs: a failed sharpness run that measured nothing does not block the
corrected rerun, --preconditioned on an SGD run is refused up front, --top-k k prints all k,
every number with an uncertainty is rounded by one rule (trailing zeros kept), and the
errors of --custom-objects and ``spectra plot`` name the cause in one line.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from spectra._format import plus_minus
from spectra.cli import main

ROOT = Path(__file__).resolve().parents[2]


DIGITS = str(ROOT / "data" / "digits.npz")


MLP = str(ROOT / "data" / "digits_mlp.keras")


TRAJECTORY = str(ROOT / "data" / "gd_trajectory")


LOSS = "sparse_categorical_crossentropy"


def _run(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(args)
        except SystemExit as exit_info:
            status = int(exit_info.code)
    return status, out.getvalue(), err.getvalue()


def _error(args: list[str]) -> str:
    """The one-line error of a run that must fail with status 2."""
    status, _, err = _run(args)
    assert status == 2, err
    assert err.startswith("spectra: error: ") and err.count("\n") == 1, err
    return err.removeprefix("spectra: error: ").rstrip("\n")


# --------------------------------------------------------------------------- sharpness


@pytest.mark.slow
def test_a_failed_run_does_not_block_the_corrected_rerun(tmp_path, monkeypatch) -> None:
    """The reviewer's run without --loss fails on its first checkpoint; the rerun with the
    loss (and --top-k 3 --trace) replaces it, prints all three eigenvalues and the trace
    by the one rounding rule; a rerun with other settings over a run that measured
    checkpoints is refused in the command line's words."""
    monkeypatch.chdir(tmp_path)
    base = ["sharpness", TRAJECTORY, "--data", DIGITS, "--out", "f1", "--max-examples", "300"]
    error = _error([*base, "--no-progress"])
    assert "carries no compiled loss" in error and "give --loss" in error
    assert (tmp_path / "f1" / "sharpness.json").is_file()  # written, nothing measured

    extra = ["--loss", LOSS, "--top-k", "3", "--trace", "--trace-products", "4"]
    status, printed, err = _run([*base, *extra, "--no-progress"])
    assert status == 0, err
    assert "replacing f1/sharpness.json: its run measured no checkpoint" in printed
    report = json.loads((tmp_path / "f1" / "sharpness.json").read_text(encoding="utf-8"))
    done = [entry for entry in report["checkpoints"] if entry["status"] == "done"]
    assert len(done) == 11 and report["settings"]["loss"] == LOSS
    assert "data digits.npz" not in printed and "(1,797 examples)" in printed
    for entry in done:
        values, bounds = entry["eigenvalues"], entry["error_bounds"]
        rest = ", ".join(plus_minus(v, b).split(" ± ")[0] for v, b in zip(values[1:], bounds[1:]))
        line = next(
            text for text in printed.splitlines() if text.startswith(f"step {entry['step']:>6}")
        )
        assert f"λ1 = {plus_minus(values[0], bounds[0])}  λ2..3 = {rest}" in line
        assert f"trace = {plus_minus(entry['trace'], entry['trace_stderr'])}" in line
    top = max(done, key=lambda entry: entry["eigenvalues"][0])
    largest = plus_minus(top["eigenvalues"][0], top["error_bounds"][0])
    assert f"largest λ1 = {largest} at step {top['step']} (threshold 10)" in printed
    assert re.search(r"^figures: f1/sharpness\.png", printed, flags=re.M)

    # A run with measured checkpoints is kept: the refusal names what differs in words.
    error = _error([*base[:-1], "200", *extra, "--no-progress"])
    assert "holds results computed with other settings" in error
    assert "max_examples: 300 -> 200" in error
    assert re.search(r"data: other examples \(sha256 [0-9a-f]{12}… -> [0-9a-f]{12}…\)", error)
    assert "rerun with --restart to discard them" in error
    assert "restart=True" not in error and not re.search(r"[0-9a-f]{20}", error)

    # spectra plot of the CSV says which files it redraws.
    error = _error(["plot", "f1/sharpness.csv"])
    assert error.startswith("f1/sharpness.csv: not JSON")
    assert error.endswith(
        "spectra plot redraws a run's results.json, sharpness.json or landscape.json"
    )


def test_preconditioned_on_an_sgd_run_is_refused_up_front(tmp_path) -> None:
    out = tmp_path / "p1"
    error = _error(
        ["sharpness", TRAJECTORY, "--data", DIGITS, "--out", str(out), "--preconditioned"]
    )
    assert error == (
        f"the optimizer recorded in {TRAJECTORY}/trajectory.json is SGD, which has no "
        "preconditioner (P = I): measure λ_max(H) without --preconditioned."
    )
    assert not (out / "sharpness.json").exists()


# --------------------------------------------------------------------------- errors


def test_custom_objects_errors_name_the_option(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodels.py").write_text(
        "import keras\n"
        '@keras.saving.register_keras_serializable(package="rev")\n'
        "class Scale(keras.layers.Layer):\n"
        "    def call(self, x):\n"
        "        return x * 2.0\n",
        encoding="utf-8",
    )
    args = ["analyze", MLP, "--data", DIGITS, "--out", "e1", "--custom-objects"]
    assert _error([*args, "nothere.py"]) == "--custom-objects: no file 'nothere.py'"
    error = _error([*args, "mymodels.py:nothing"])
    assert error == (
        "--custom-objects: Module 'mymodels.py' has no 'nothing' (custom objects "
        "'mymodels.py:nothing'); it defines ['Scale']"
    )


# --------------------------------------------------------------------------- analyze


@pytest.mark.slow
def test_analyze_says_all_examples_and_top_eigenvalue(tmp_path) -> None:
    out = tmp_path / "a1"
    args = [
        "analyze",
        MLP,
        "--data",
        DIGITS,
        "--loss",
        LOSS,
        "--max-examples",
        "5000",
        "--top-k",
        "1",
    ]
    status, printed, err = _run([*args, "--no-progress", "--out", str(out)])
    assert status == 0, err
    lines = printed.splitlines()
    assert lines[0].startswith(
        "digits_mlp (85,002 parameters, float32) on digits (all 1,797 examples "
        "(--max-examples 5000 is more)): loss "
    )
    assert lines[1] == "top eigenvalue (lanczos, ± error bound):"
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    eig = results["eigenvalues"]
    value = plus_minus(eig["eigenvalues"][0], eig["error_bounds"][0])
    assert any(line.startswith(f"  λ1 = {value}   residual") for line in lines)
    assert "all 1,797 examples (--max-examples 5000 is more)" in results["data"]["description"]
    assert lines[-1].startswith("figures: ")
