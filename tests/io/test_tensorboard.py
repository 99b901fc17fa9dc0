"""spectra.io.tensorboard: which scalars a measurement gives, and event files written, flushed,
closed and rewritten (read back with TensorFlow's event reader)."""

import math

import numpy as np
import pytest
from _events import event_files, read_scalars

from spectra.io.tensorboard import SharpnessEvents, check_log_dir, sharpness_scalars

RECORD = {
    "step": 7,
    "eigenvalues": [3.25, 1.5],
    "error_bounds": [1e-9, 2e-9],
    "threshold": 20.0,
    "threshold_matrix": "hessian",
    "trace": 11.0,
    "trace_stderr": math.nan,
    "loss": 0.75,
    "eigenvector_overlap": None,
    "gradient_overlap": 0.5,
}


def test_scalars_of_a_record():
    assert sharpness_scalars(RECORD) == {
        "sharpness/lambda_1": 3.25,
        "sharpness/lambda_2": 1.5,
        "sharpness/error_bound_1": 1e-9,
        "sharpness/error_bound_2": 2e-9,
        "sharpness/threshold": 20.0,
        "sharpness/trace": 11.0,
        "sharpness/trace_stderr": pytest.approx(math.nan, nan_ok=True),
        "sharpness/loss": 0.75,
        "sharpness/gradient_overlap": 0.5,
    }


def test_the_threshold_only_for_the_matrix_it_bounds():
    preconditioned = sharpness_scalars(RECORD, preconditioned=True)
    assert "preconditioned_sharpness/threshold" not in preconditioned
    assert preconditioned["preconditioned_sharpness/lambda_1"] == 3.25
    adam = {**RECORD, "threshold_matrix": "preconditioned"}
    assert "sharpness/threshold" not in sharpness_scalars(adam)
    assert sharpness_scalars(adam, preconditioned=True)["preconditioned_sharpness/threshold"] == 20
    assert "sharpness/threshold" not in sharpness_scalars({**RECORD, "threshold_matrix": None})


def test_written_lazily_flushed_and_closed(tmp_path):
    events = SharpnessEvents(tmp_path / "logs")
    assert not (tmp_path / "logs").exists()  # nothing before the first write
    events.write(7, sharpness_scalars(RECORD))
    # Flushed: readable while the file is still open.
    written = read_scalars(tmp_path / "logs" / "spectra")
    assert written["sharpness/lambda_1"] == [(7, np.float32(3.25))]
    assert written["sharpness/error_bound_1"] == [(7, np.float32(1e-9))]
    assert np.isnan(written["sharpness/trace_stderr"][0][1])  # NaN stays NaN
    events.write(9, {"sharpness/lambda_1": 1 / 3})
    events.close()
    events.close()
    written = read_scalars(tmp_path / "logs" / "spectra")
    assert written["sharpness/lambda_1"] == [(7, np.float32(3.25)), (9, np.float32(1 / 3))]
    assert len(event_files(tmp_path / "logs" / "spectra")) == 1


def test_rewrite_replaces_only_its_own_files(tmp_path):
    run = tmp_path / "spectra"
    other = SharpnessEvents(tmp_path, suffix=".spectra-preconditioned-sharpness")
    other.write(1, {"preconditioned_sharpness/lambda_1": 5.0})
    other.close()
    events = SharpnessEvents(tmp_path, suffix=".spectra-sharpness")
    for step in (0, 10):
        events.write(step, {"sharpness/lambda_1": float(step)})
    events.close()
    events.write(10, {"sharpness/lambda_1": 10.0})  # a duplicate in a second file
    assert len(event_files(run)) == 3
    kept = events.rewrite([(0, {"sharpness/lambda_1": 0.5}), (10, {"sharpness/lambda_1": 10.5})])
    assert events.event_files() == [kept]
    assert sorted(path.name for path in run.iterdir()) == sorted(
        path.name for path in [kept, *other.event_files()]
    )  # no temporary directory left
    written = read_scalars(run)
    assert written["sharpness/lambda_1"] == [(0, np.float32(0.5)), (10, np.float32(10.5))]
    assert written["preconditioned_sharpness/lambda_1"] == [(1, np.float32(5.0))]


def test_check_log_dir(tmp_path):
    assert check_log_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    with pytest.raises(TypeError, match="log_dir must be a directory path .* got list"):
        check_log_dir(["logs"])
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "spectra").write_text("")
    with pytest.raises(ValueError, match="spectra' is a file, not a directory"):
        check_log_dir(tmp_path / "logs")
