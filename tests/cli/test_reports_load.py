"""``spectra.load`` of ``sharpness.json`` (a :class:`SharpnessReport`) and of
``landscape.json``, both without TensorFlow."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spectra import load
from spectra.analysis.landscape_result import LandscapeResult
from spectra.cli import main
from spectra.estimators.results import EigenResult
from spectra.reports import LandscapeReport, SharpnessReport

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"

# Loads a file in a fresh interpreter and says whether TensorFlow got imported.
_LOAD_WITHOUT_TF = (
    "import sys\n"
    "import spectra\n"
    "report = spectra.load(sys.argv[1])\n"
    "curves = getattr(report, 'curves', None)\n"
    "print(type(report).__name__, type(curves).__name__, 'tensorflow' in sys.modules)\n"
)


def _load_in_fresh_interpreter(path: Path) -> str:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_TF, str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


ENTRY = {
    "file": "step_0020.keras",
    "step": 20,
    "sha256": "0" * 64,
    "path": "run/step_0020.keras",
    "status": "done",
    "error": None,
    "loss": 0.5,
    "eigenvalues": [4.0, 2.0],
    "error_bounds": [1e-8, 2e-8],
    "residual_norms": [1e-6, 2e-6],
    "converged": [True, True],
    "trace": 30.0,
    "trace_stderr": math.nan,
    "eigenvector_overlap": 0.9,
}


def _report(checkpoints) -> SharpnessReport:
    return SharpnessReport(
        command="spectra sharpness run --data digits --out out",
        versions={"spectra": "0"},
        settings={"top_k": 2},
        data={"name": "digits", "num_examples": 200},
        format="spectra-sharpness/2",
        checkpoints_source="run",
        step_source="file names",
        step_unit="step",
        learning_rate=0.2,
        learning_rate_source="--lr",
        threshold=None,
        warm_start=True,
        plan=[{"file": entry["file"], "step": entry["step"]} for entry in checkpoints],
        summary={"checkpoints": len(checkpoints), "done": 1, "failed": 1, "pending": 0},
        checkpoints=checkpoints,
    )


def test_sharpness_report_round_trip_restores_nan(tmp_path):
    failed = {**dict.fromkeys(ENTRY), "file": "step_0000.keras", "step": 0}
    failed.update(sha256="1" * 64, path="run/step_0000.keras", status="failed", error="bad")
    report = _report([failed, ENTRY])
    path = tmp_path / "sharpness.json"
    report.to_json(path)
    assert json.loads(path.read_text())["null_values"]  # NaN written as null, explained
    loaded = load(path)
    assert isinstance(loaded, SharpnessReport)
    assert math.isnan(loaded.checkpoints[1]["trace_stderr"])
    assert loaded.model is None and loaded.learning_rate == 0.2
    assert [entry["file"] for entry in loaded.done] == ["step_0020.keras"]
    np.testing.assert_array_equal(loaded.steps, [20])
    np.testing.assert_array_equal(loaded.eigenvalues, [[4.0, 2.0]])
    np.testing.assert_array_equal(loaded.error_bounds, [[1e-8, 2e-8]])
    assert loaded.to_json() == report.to_json()


@pytest.fixture(scope="module")
def sharpness_json(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharpness")
    args = ["sharpness", str(DATA / "gd_trajectory" / "step_00[02]0.keras")]
    args += ["--data", str(DATA / "digits.npz"), "--loss", "sparse_categorical_crossentropy"]
    args += ["--max-examples", "200", "--top-k", "2", "--out", str(out)]
    assert main([*args, "--no-progress", "--quiet"]) == 0
    return out / "sharpness.json"


def test_a_sharpness_run_loads_as_its_report(sharpness_json):
    written = json.loads(sharpness_json.read_text())
    report = load(sharpness_json)
    assert isinstance(report, SharpnessReport)
    assert report.settings == written["settings"] and report.model == written["model"]
    np.testing.assert_array_equal(report.steps, [0, 20])
    np.testing.assert_array_equal(
        report.eigenvalues, [entry["eigenvalues"] for entry in written["checkpoints"]]
    )
    assert report.eigenvalues.shape == (2, 2)
    assert report.threshold == written["threshold"]
    # What it reloads is what the run wrote.
    assert json.loads(report.to_json()) == written
    assert SharpnessReport.from_json(sharpness_json).to_dict() == report.to_dict()


def test_sharpness_json_loads_without_tensorflow(sharpness_json):
    assert _load_in_fresh_interpreter(sharpness_json) == "SharpnessReport NoneType False"


def test_landscape_json_loads_without_tensorflow(tmp_path):
    curves = LandscapeResult(
        alphas=np.linspace(-1.0, 1.0, 3),
        betas=None,
        labels=["v1"],
        losses={"v1": np.array([1.5, 0.5, 1.25])},
        losses_2d=None,
        base_loss=0.5,
        direction_norms={"v1": 1.0},
        num_examples=100,
        num_evaluations=3,
        wall_time=0.1,
    )
    eigen = EigenResult(
        eigenvalues=np.array([2.0]),
        eigenvectors=None,
        residual_norms=np.array([1e-7]),
        error_bounds=np.array([1e-9]),
        converged=np.array([True]),
        which="LA",
        method="lanczos",
        num_products=10,
        num_operator_calls=10,
        wall_time=0.1,
    )
    report = LandscapeReport(
        command="spectra landscape m.keras --data d.npz --out o",
        versions={},
        settings={},
        data={"name": "d", "num_examples": 100},
        model={"name": "m", "num_parameters": 10},
        eigenvalues=eigen,
        radius={"slope_along_v1": 0.0},
        directions={"v1": "top eigenvector"},
        curves=curves,
        surface=None,
        files={},
    )
    path = tmp_path / "landscape.json"
    report.to_json(path)
    assert _load_in_fresh_interpreter(path) == "LandscapeReport LandscapeResult False"
    loaded = load(path)
    np.testing.assert_array_equal(loaded.curves.losses["v1"], [1.5, 0.5, 1.25])
