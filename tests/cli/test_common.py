"""Tests of spectra.cli._common, the behaviour the commands share: bound notes, one rounding
rule for printed uncertainties, and run directories.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import spectra.cli.analyze
import spectra.cli.sharpness
from spectra._format import plus_minus
from spectra.cli import main
from spectra.cli._common import bound_note
from spectra.reports.base import DEFAULT_FAILURE_PROBABILITY, bound_holds
from spectra.reports.sharpness import entry_certified, entry_failure_probability


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


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("value", "error", "printed"),
    [
        (1.6991200, 7.5e-06, "1.6991200 ± 7.5e-06"),  # trailing zeros kept
        (79.193, 7.0, "79.2 ± 7.0"),  # the value to the error's second digit
        (15.4089, 0.61, "15.41 ± 0.61"),
        (10.691818, 1.3e-05, "10.691818 ± 1.3e-05"),
        (3800.0, 50.0, "3800 ± 50"),  # no bare trailing point
        (0.000309, 4.8e-05, "0.000309 ± 4.8e-05"),
    ],
)
def test_one_rounding_rule_with_trailing_zeros(value, error, printed) -> None:
    assert plus_minus(value, error) == printed


@pytest.mark.parametrize(
    "converged, probability, expected",
    [
        (True, 1e-4, ""),
        (True, 1e-9, ""),
        (True, 0.0, ""),
        (True, None, "(not certified: holds for some eigenvalue, maybe not this one)"),
        (True, 1.0, "(not certified: failure probability 1)"),
        (True, 0.5, "(not certified: failure probability 0.5)"),
        (True, 0.01, "(failure probability 0.01, not 0.0001)"),
        (True, 2e-4, "(failure probability 0.0002, not 0.0001)"),
        (False, 1e-4, "(not converged: stalled)"),
        (False, 1.0, "(not converged: stalled)  (not certified: failure probability 1)"),
    ],
)
def test_bound_note(converged, probability, expected):
    assert bound_note(converged, probability, reason="stalled") == expected
    holds = converged and probability is not None and probability <= 1e-4
    assert bound_holds(converged, probability) is holds
    assert (expected == "") is holds


def test_bound_note_explains_a_bound_above_the_tolerance():
    note = bound_note(False, 1e-5, value=9.5, bound=0.84, tol=0.01)
    assert note == "(not converged: error bound 0.84 > tol·|λ| = 0.095)"


def test_entries_recorded_without_a_failure_probability():
    """Entries of an earlier sharpness.json: what their method certifies."""
    entry = {"converged": [True]}
    assert entry_failure_probability(entry, "lanczos") == DEFAULT_FAILURE_PROBABILITY
    assert entry_certified(entry, "lanczos")
    assert entry_failure_probability(entry, "power") == 1.0
    assert not entry_certified(entry, "power")
    assert entry_failure_probability(entry, "lobpcg") is None
    assert not entry_certified({"converged": [True], "failure_probability": None}, "lanczos")
    assert not entry_certified({"converged": [False], "failure_probability": 0.0}, "lanczos")


ROOT = Path(__file__).resolve().parents[2]


DATA = ROOT / "data"


TRAJECTORY = DATA / "gd_trajectory"


DIGITS = str(DATA / "digits.npz")


LOSS = "sparse_categorical_crossentropy"


SECRET = "the runner's own file\n"


MANIFEST = ".spectra-manifest.json"


def _analyze(model: str, out: Path | str, *extra: str) -> list[str]:
    """``spectra analyze`` on a checkpoint of the GD run, 60 examples, few products."""
    return [
        "analyze",
        str(TRAJECTORY / model),
        "--data",
        DIGITS,
        "--loss",
        LOSS,
        "--max-examples",
        "60",
        "--density-steps",
        "12",
        "--density-probes",
        "2",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]


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


def _error(capsys) -> str:
    """The one line a refused command printed."""
    err = capsys.readouterr().err
    assert err.startswith("spectra: error: ") and err.count("\n") == 1, err
    return err.strip()


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text(SECRET)
    return path


def _must_not_compute(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("data was loaded before --out was checked")

    # (The commands' modules are imported above: one imported here would bind ``refuse``.)
    monkeypatch.setattr(spectra.cli.analyze, "load_data", refuse)
    monkeypatch.setattr(spectra.cli.sharpness, "load_data", refuse)


# --------------------------------------------------------------------------- links


@pytest.mark.parametrize("command", ["analyze", "sharpness"])
def test_a_symlinked_lock_is_refused_and_its_target_untouched(
    command, tmp_path, victim, capsys, monkeypatch
):
    _must_not_compute(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".spectra.lock").symlink_to(victim)
    args = (
        _analyze("step_0100.keras", out)
        if command == "analyze"
        else _sharpness("step_00[0-4]0.keras", out)
    )
    assert main(args) == 2
    error = _error(capsys)
    assert f"'{out / '.spectra.lock'}' is a symbolic link (to '{victim}')" in error
    assert victim.read_text() == SECRET
    assert sorted(p.name for p in out.iterdir()) == [".spectra.lock"]


@pytest.mark.parametrize("name", ["results.json", "eigenvalues.png", MANIFEST])
def test_a_symlink_where_analyze_writes_is_refused(name, tmp_path, victim, capsys, monkeypatch):
    _must_not_compute(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(victim)
    assert main(_analyze("step_0100.keras", out)) == 2
    error = _error(capsys)
    assert f"'{out / name}' is a symbolic link (to '{victim}') where spectra writes {name}" in error
    assert victim.read_text() == SECRET
    assert sorted(p.name for p in out.iterdir()) == [name]


def test_a_symlinked_sharpness_csv_is_refused(tmp_path, victim, capsys, monkeypatch):
    _must_not_compute(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "sharpness.csv").symlink_to(victim)
    assert main(_sharpness("step_00[0-4]0.keras", out)) == 2
    assert "where spectra writes sharpness.csv" in _error(capsys)
    assert victim.read_text() == SECRET


@pytest.mark.parametrize("kind", ["to a directory", "dangling"])
def test_a_symlinked_out_is_refused(kind, tmp_path, capsys, monkeypatch):
    _must_not_compute(monkeypatch)
    target = tmp_path / "elsewhere"
    if kind == "to a directory":
        target.mkdir()
    link = tmp_path / "out"
    link.symlink_to(target)
    assert main(_analyze("step_0100.keras", link)) == 2
    error = _error(capsys)
    assert f"--out: the output directory '{link}' is a symbolic link (to '{target}'" in error
    assert "a part of the path is a file" not in error
    if kind == "dangling":
        assert "which does not exist" in error and not target.exists()
    else:
        assert list(target.iterdir()) == []


@pytest.mark.parametrize("command", ["analyze", "sharpness"])
def test_an_empty_out_is_refused(command, tmp_path, capsys, monkeypatch):
    _must_not_compute(monkeypatch)
    monkeypatch.chdir(tmp_path)
    args = (
        _analyze("step_0100.keras", "")
        if command == "analyze"
        else _sharpness("step_00[0-4]0.keras", "")
    )
    assert main(args) == 2
    assert _error(capsys).startswith("spectra: error: --out is empty")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- one run per directory


def test_a_second_analyze_is_refused_and_restart_leaves_only_its_files(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(_analyze("step_0100.keras", out, "--density", "--layers")) == 0
    first = sorted(p.name for p in out.iterdir())
    assert first == [MANIFEST, "density.png", "eigenvalues.png", "layers.png", "results.json"]
    (out / "notes.txt").write_text("mine")
    before = (out / "results.json").read_text()
    capsys.readouterr()

    assert main(_analyze("step_0020.keras", out, "--top-k", "1")) == 2
    error = _error(capsys)
    assert f"'{out}' holds the files of another spectra run (spectra analyze" in error
    for name in ("results.json", "eigenvalues.png", "density.png", "layers.png"):
        assert name in error
    assert "choose another --out, or give --restart" in error
    assert (out / "results.json").read_text() == before

    assert main(_analyze("step_0020.keras", out, "--top-k", "1", "--restart")) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        MANIFEST,
        "eigenvalues.png",
        "notes.txt",
        "results.json",
    ]
    report = json.loads((out / "results.json").read_text())
    assert report["model"]["path"].endswith("step_0020.keras")
    assert len(report["eigenvalues"]["eigenvalues"]) == 1
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["command"] == "analyze" and manifest["status"] == "done"
    assert manifest["files"] == ["results.json", "eigenvalues.png"]
    assert "--restart" in manifest["command_line"]


def test_sharpness_refuses_a_directory_of_analyze(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / MANIFEST).write_text(
        json.dumps(
            {
                "format": "spectra-manifest/1",
                "command": "analyze",
                "command_line": "spectra analyze m.keras",
                "files": ["results.json"],
            }
        )
    )
    (out / "results.json").write_text("{}")
    assert main(_sharpness("step_0000.keras", out)) == 2
    error = _error(capsys)
    assert "holds the files of another spectra run (spectra analyze m.keras): results.json" in error


def test_a_full_disk_keeps_the_results_and_says_what_was_not_written(tmp_path, capsys, monkeypatch):
    def full(path, write):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # The figures do not fit; the results JSON (written first) does.
    monkeypatch.setattr("spectra.plotting.saving.atomic_write", full)
    out = tmp_path / "o"
    assert main(_analyze("step_0100.keras", out, "--top-k", "1", "--format", "png,pdf")) == 2
    captured = capsys.readouterr()
    assert "λ1 = " in captured.out  # the numbers are printed
    error = captured.err.strip()
    assert error == (
        f"spectra: error: not written in '{out}': eigenvalues.png, eigenvalues.pdf (No space "
        "left on device); written: results.json."
    )
    report = json.loads((out / "results.json").read_text())
    assert report["files"]["eigenvalues_figure"] == []
    assert report["files"]["not_written"] == {
        "eigenvalues.png": "No space left on device",
        "eigenvalues.pdf": "No space left on device",
    }
    assert report["eigenvalues"]["eigenvalues"][0] > 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["status"] == "incomplete" and manifest["files"] == ["results.json"]
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "results.json"]
