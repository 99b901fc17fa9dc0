"""Files no one else can redirect, one run per directory, clear write errors (spectra.io.files,
Result.to_json, the sharpness record on a full disk). No TensorFlow: each test is milliseconds.

The threat: an output directory others can write in. Whatever they plant at a name spectra
writes (a symbolic link, a hard link, a directory) must leave the file it points to untouched.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from spectra.analysis.trajectory import (
    WARM_START_NAME,
    PlannedCheckpoint,
    SharpnessMeasurement,
    SharpnessRun,
)
from spectra.estimators.results import Result
from spectra.io.files import (
    MANIFEST_NAME,
    DirectoryLock,
    NotWritten,
    OutputInUse,
    UnsafeOutput,
    atomic_write,
    atomic_write_text,
    check_outputs,
    claim_outputs,
    prepare_directory,
    read_manifest,
)

SECRET = "the runner's own file\n"


@pytest.fixture
def victim(tmp_path):
    """A file outside the output directory that a planted link points to."""
    path = tmp_path / "victim.txt"
    path.write_text(SECRET)
    return path


@pytest.fixture
def out(tmp_path):
    directory = tmp_path / "out"
    directory.mkdir()
    return directory


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and "[Errno" not in text, text
    return text


# --------------------------------------------------------------------------- the lock


def test_a_symlinked_lock_is_refused_and_its_target_untouched(out, victim):
    (out / ".spectra.lock").symlink_to(victim)
    with pytest.raises(UnsafeOutput) as refused:
        DirectoryLock(out).acquire()
    text = _one_line(refused.value)
    assert f"'{out / '.spectra.lock'}' is a symbolic link (to '{victim}')" in text
    assert "--out" in text
    assert victim.read_text() == SECRET
    assert (out / ".spectra.lock").is_symlink()  # left for its owner to look at


def test_a_hard_linked_lock_is_refused_and_its_target_untouched(out, victim):
    os.link(victim, out / ".spectra.lock")
    with pytest.raises(UnsafeOutput, match="has other hard links"):
        DirectoryLock(out).acquire()
    assert victim.read_text() == SECRET


def test_a_lock_that_is_a_directory_is_refused(out):
    (out / ".spectra.lock").mkdir()
    with pytest.raises(UnsafeOutput, match="is a directory"):
        DirectoryLock(out).acquire()


def test_the_lock_still_works(out):
    with DirectoryLock(out) as lock:
        pid = (out / ".spectra.lock").read_text().split()[0]
        assert pid == str(os.getpid()) and lock.path.is_file()
    assert not (out / ".spectra.lock").exists()


# ---------------------------------------------------------------- results and temporaries


def test_a_symlinked_result_is_replaced_not_followed(out, victim):
    target = out / "results.json"
    target.symlink_to(victim)
    atomic_write_text(target, "{}\n")
    assert victim.read_text() == SECRET
    assert not target.is_symlink() and target.read_text() == "{}\n"
    # A new file gets the usual permissions, not the link target's.
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_planted_temporary_name_is_never_written_through(out, victim, monkeypatch):
    # The attacker guessed the first temporary name: O_EXCL refuses it and mkstemp moves on.
    planted = out / ".results.json.planted.tmp"
    planted.symlink_to(victim)
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: iter(["planted", "fresh"]))
    atomic_write_text(out / "results.json", "{}\n")
    assert victim.read_text() == SECRET
    assert (out / "results.json").read_text() == "{}\n"
    assert planted.is_symlink()


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "directory"])
def test_check_outputs_refuses_what_is_not_a_regular_file(out, victim, kind):
    target = out / "eigenvalues.png"
    if kind == "symlink":
        target.symlink_to(victim)
    elif kind == "dangling symlink":
        target.symlink_to(out / "nowhere.png")
    else:
        target.mkdir()
    with pytest.raises(UnsafeOutput) as refused:
        check_outputs(out, ["results.json", "eigenvalues.png"])
    text = _one_line(refused.value)
    assert f"'{target}'" in text and "eigenvalues.png" in text
    if kind == "dangling symlink":
        assert "which does not exist" in text
    assert victim.read_text() == SECRET


@dataclass
class _Small(Result):
    value: float


def test_to_json_onto_a_directory_names_the_path(out):
    with pytest.raises(IsADirectoryError) as refused:
        _Small(1.0).to_json(out)
    text = _one_line(refused.value)
    assert text.startswith(f"cannot write '{out}': it is a directory")
    assert sorted(p.name for p in out.iterdir()) == []


def test_to_json_below_a_file_names_the_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(NotADirectoryError) as refused:
        _Small(1.0).to_json(tmp_path / "notes.txt" / "deeper" / "r.json")
    text = _one_line(refused.value)
    assert f"'{tmp_path / 'notes.txt'}' is a file, not a directory" in text
    assert (tmp_path / "notes.txt").read_text() == "x"


def test_a_full_disk_names_the_file_and_keeps_the_old_one(out):
    target = out / "results.json"
    target.write_text("old\n")

    def full(temp_name: str) -> None:
        with open(temp_name, "w") as stream:
            stream.write("partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as failed:
        atomic_write(target, full)
    assert failed.value.errno == errno.ENOSPC
    assert _one_line(failed.value) == f"cannot write '{target}': No space left on device."
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]


# --------------------------------------------------------------------------- directories


def test_prepare_directory_refuses_empty_links_and_files(tmp_path, victim):
    with pytest.raises(ValueError, match="is empty"):
        prepare_directory("")
    dangling = tmp_path / "gone"
    dangling.symlink_to(tmp_path / "missing")
    with pytest.raises(UnsafeOutput) as refused:
        prepare_directory(dangling)
    text = _one_line(refused.value)
    assert (
        f"'{dangling}' is a symbolic link (to '{tmp_path / 'missing'}', which does not exist)"
        in text
    )
    assert "is a file" not in text and not (tmp_path / "missing").exists()
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "out", target_is_directory=True)
    (tmp_path / "out").mkdir()
    with pytest.raises(UnsafeOutput, match="is a symbolic link"):
        prepare_directory(linked)
    with pytest.raises(NotADirectoryError) as refused:
        prepare_directory(victim / "below")
    assert f"'{victim}' is a file" in _one_line(refused.value)


# --------------------------------------------------------------------------- one run per directory


def test_a_second_run_is_refused_and_restart_removes_only_the_listed_files(out):
    claim, previous = claim_outputs(out, "analyze", ["results.json", "density.png"])
    assert previous is None
    for name in ("results.json", "density.png"):
        claim.attempt(name, lambda path: path.write_text("first"))
    claim.finish()
    (out / "notes.txt").write_text("mine")
    manifest = read_manifest(out)
    assert manifest["files"] == ["results.json", "density.png"] and manifest["status"] == "done"

    with pytest.raises(OutputInUse) as refused:
        claim_outputs(out, "analyze", ["results.json", "eigenvalues.png"])
    text = _one_line(refused.value)
    assert "holds the files of another spectra run" in text
    assert "results.json, density.png" in text and "--restart" in text and "--out" in text

    claim, previous = claim_outputs(out, "analyze", ["results.json"], restart=True)
    assert previous["files"] == ["results.json", "density.png"]
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, "notes.txt"]
    assert read_manifest(out)["status"] == "running"


def test_the_same_command_again_replaces_its_own_run(out):
    """``make run`` twice: the same command line into the same directory restarts its run
    (its files are removed, then written again); another command line is refused."""
    line = "spectra analyze m.keras --density --out o"
    claim, _ = claim_outputs(out, "analyze", ["results.json", "density.png"], command_line=line)
    for name in ("results.json", "density.png"):
        claim.attempt(name, lambda path: path.write_text("first"))
    claim.finish()
    with pytest.raises(OutputInUse, match="holds the files of another spectra run"):
        claim_outputs(out, "analyze", ["results.json"], command_line=line + " --top-k 2")
    claim, previous = claim_outputs(out, "analyze", ["results.json"], command_line=line)
    assert previous["command_line"] == line
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME]


def test_unknown_files_at_the_names_written_are_refused_even_with_restart(out):
    (out / "results.json").write_text("someone else's")
    for restart in (False, True):
        with pytest.raises(OutputInUse, match="no spectra manifest there lists"):
            claim_outputs(out, "analyze", ["results.json"], restart=restart)
    assert (out / "results.json").read_text() == "someone else's"
    # Other files are left alone and are no obstacle.
    claim_outputs(out, "analyze", ["eigenvalues.png"])


def test_a_manifest_naming_files_elsewhere_is_refused(tmp_path, out, victim):
    (out / MANIFEST_NAME).write_text(
        json.dumps({"format": "spectra-manifest/1", "command": "x", "files": ["../victim.txt"]})
    )
    with pytest.raises(OutputInUse, match="not a spectra manifest"):
        claim_outputs(out, "analyze", ["results.json"], restart=True)
    assert victim.read_text() == SECRET


def test_a_full_disk_writes_what_fits_and_says_what_did_not(out):
    claim, _ = claim_outputs(out, "analyze", ["results.json", "eigenvalues.png"])
    assert claim.attempt("results.json", lambda path: atomic_write_text(path, "{}\n"))

    def full(path: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    assert not claim.attempt("eigenvalues.png", full)
    with pytest.raises(NotWritten) as failed:
        claim.finish()
    assert _one_line(failed.value) == (
        f"not written in '{out}': eigenvalues.png (No space left on device); written: results.json."
    )
    manifest = read_manifest(out)
    assert manifest["status"] == "incomplete" and manifest["files"] == ["results.json"]
    assert manifest["not_written"] == {"eigenvalues.png": "No space left on device"}


# --------------------------------------------------------------------------- the sharpness record


def _planned(tmp_path: Path, count: int) -> list[PlannedCheckpoint]:
    plan = []
    for step in range(count):
        path = tmp_path / f"step_{step}.keras"
        path.write_bytes(bytes([step]))
        plan.append(PlannedCheckpoint(path.name, step, f"{step:064d}", path))
    return plan


def _measurement(value: float, vectors: np.ndarray) -> SharpnessMeasurement:
    return SharpnessMeasurement(
        loss=1.0,
        eigenvalues=[value],
        error_bounds=[1e-9],
        residual_norms=[1e-9],
        converged=[True],
        trace=None,
        trace_stderr=None,
        num_parameters=vectors.shape[0],
        num_products=3,
        num_data_passes=3,
        wall_time=0.0,
        seed=0,
        warm_start=False,
        eigenvectors=vectors,
    )


def test_sharpness_keeps_the_warm_start_of_the_entry_it_belongs_to(tmp_path):
    plan = _planned(tmp_path, 3)
    vectors = np.random.default_rng(0).standard_normal((5, 1))
    with SharpnessRun(tmp_path / "out") as run:
        run.start(plan, {"top_k": 1})
        run.record(plan[0], _measurement(1.0, vectors))
    with SharpnessRun(tmp_path / "out") as run:
        run.start(plan, {"top_k": 1})
        assert run.warm_start(plan[0]) is None  # the first checkpoint starts cold
        np.testing.assert_array_equal(run.warm_start(plan[1]), vectors)  # bit for bit
        assert run.warm_start(plan[2]) is None  # its predecessor was not measured
        run.record(plan[1], error="ValueError: broken")
    with SharpnessRun(tmp_path / "out") as run:
        run.start(plan, {"top_k": 1})
        assert run.warm_start(plan[2]) is None  # the predecessor failed
        (tmp_path / "out" / WARM_START_NAME).write_bytes(b"not an npz")
        assert run.warm_start(plan[1]) is None
        assert "cannot be read" in run.warm_start_problem


def test_sharpness_on_a_full_disk_keeps_the_json(tmp_path, monkeypatch):
    plan = _planned(tmp_path, 2)
    vectors = np.ones((4, 1))
    out = tmp_path / "out"
    with SharpnessRun(out) as run:
        run.start(plan, {"top_k": 1})
        run.record(plan[0], _measurement(1.0, vectors))

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        # The CSV and the warm start do not fit; the JSON alone does.
        monkeypatch.setattr("spectra.analysis.trajectory.atomic_write_files", full)
        with pytest.raises(NotWritten) as failed:
            run.record(plan[1], _measurement(2.0, vectors))
        text = _one_line(failed.value)
        assert "warm_start.npz and sharpness.csv not written" in text
        assert "No space left on device" in text and "holds all 2 results" in text
        stored = json.loads((out / "sharpness.json").read_text())
        assert [e["eigenvalues"] for e in stored["checkpoints"]] == [[1.0], [2.0]]
        # Nothing fits: the message says what is lost and what is kept.
        monkeypatch.setattr("spectra.analysis.trajectory.atomic_write_text", full)
        with pytest.raises(NotWritten) as failed:
            run.record(plan[1], _measurement(3.0, vectors))
        assert "the result of step_1.keras is lost" in _one_line(failed.value)
    stored = json.loads((out / "sharpness.json").read_text())
    assert [e["eigenvalues"] for e in stored["checkpoints"]] == [[1.0], [2.0]]
