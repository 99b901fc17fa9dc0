"""The output directory of the commands: nothing written through links, one run per
directory (the manifest, ``--restart``), what fits written on a full disk, a resumed
``sharpness`` equal to an uninterrupted one bit for bit."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import spectra.cli.analyze
import spectra.cli.sharpness
from spectra.cli import main

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
