"""``spectra.load`` of ``sharpness.json`` (a :class:`SharpnessReport`) and of
``landscape.json``, both without TensorFlow.

``spectra.load`` and ``spectra plot`` on edited or damaged JSON: a corpus of hostile files
(cut short, not UTF-8, nested thousands deep, wrong types, missing keys, lengths that
disagree, NaN where a number is required), each refused in one line that names the path, the
field and what was expected; ``spectra plot`` prints it as ``spectra: error: ...`` and exits
with status 2. No TensorFlow: the reports are built here.
"""

import copy
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spectra import load
from spectra.analysis.landscape_result import LandscapeResult
from spectra.analysis.per_layer import LayerwiseResult
from spectra.analysis.stability import gradient_descent_threshold
from spectra.cli import main
from spectra.estimators.results import EigenResult, SpectralDensity, TraceResult
from spectra.io.files import MAX_JSON_DEPTH, read_json
from spectra.io.result_validation import FieldError
from spectra.reports import AnalysisReport, LandscapeReport, SharpnessReport

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


DAMAGED = "the file was edited or is damaged"


def _eigen(values=(4.0, 2.0)) -> EigenResult:
    k = len(values)
    return EigenResult(
        eigenvalues=np.array(values),
        residual_norms=np.full(k, 1e-7),
        error_bounds=np.full(k, 1e-6),
        converged=np.ones(k, dtype=bool),
        which="largest",
        method="lanczos",
        num_products=20,
        num_operator_calls=20,
        wall_time=0.1,
        failure_probability=7.5e-5,
    )


def _analysis() -> dict[str, Any]:
    layers = LayerwiseResult(
        groups=["dense/kernel", "dense/bias"],
        group_sizes=[640, 10],
        eigenvalues=[np.array([3.0, 1.0]), np.array([0.5, 0.25])],
        residual_norms=[np.full(2, 1e-7), np.full(2, 1e-7)],
        error_bounds=[np.full(2, 1e-6), np.full(2, 1e-6)],
        converged=[np.ones(2, dtype=bool), np.ones(2, dtype=bool)],
        num_steps=[20, 12],
        traces=np.array([12.0, 1.0]),
        trace_stderr=np.array([0.5, 0.1]),
        num_products=64,
        num_operator_calls=20,
        wall_time=0.5,
        failure_probability=7.5e-5,
    )
    report = AnalysisReport(
        command="spectra analyze m.keras --data d.npz --out out --top-k 2 --trace --density "
        "--layers",
        versions={"spectra": "0"},
        settings={"dtype": "float32", "top_k": 2},
        data={"name": "digits", "num_examples": 300},
        model={"name": "mlp", "num_parameters": 650},
        loss=0.5,
        eigenvalues=_eigen(),
        eigenvalue_ratio=2.0,
        trace=TraceResult(
            estimate=13.0,
            stderr=0.5,
            method="hutchinson",
            stopped="budget",
            num_products=100,
            num_operator_calls=7,
            wall_time=0.2,
        ),
        density=SpectralDensity(
            nodes=np.array([[-0.5, 1.0, 4.0], [-0.25, 0.5, 4.0]]),
            weights=np.array([[0.3, 0.5, 0.2], [0.4, 0.4, 0.2]]),
            steps_taken=np.array([3, 3]),
            dimension=650,
            num_products=6,
            num_operator_calls=3,
            wall_time=0.1,
            settings={"num_steps": 3},
        ),
        density_moments=None,
        negative_mass=None,
        layers=layers,
        layer_table=layers.rows(),
        num_products=190,
        num_data_passes=50,
        wall_times={"total": 1.0},
        files={},
    )
    return json.loads(report.to_json(include_vectors=False))


def _sharpness() -> dict[str, Any]:
    entries = []
    for step, top in ((0, 1.2), (20, 1.7)):
        entries.append(
            {
                "file": f"step_{step:04d}.keras",
                "step": step,
                "sha256": "0" * 64,
                "path": f"run/step_{step:04d}.keras",
                "status": "done",
                "error": None,
                "loss": 2.0,
                "eigenvalues": [top, 0.8],
                "error_bounds": [1e-6, 1e-6],
                "residual_norms": [1e-8, 1e-7],
                "converged": [True, True],
                "trace": None,
                "trace_stderr": None,
                "eigenvector_overlap": None,
                "failure_probability": 7.5e-5,
            }
        )
    report = SharpnessReport(
        command="spectra sharpness 'run/*.keras' --data d.npz --out out --top-k 2",
        versions={"spectra": "0"},
        settings={"top_k": 2},
        data={"name": "digits", "num_examples": 200},
        format="spectra-sharpness/2",
        checkpoints_source="run/*.keras",
        step_source="file names",
        step_unit="step",
        learning_rate=0.2,
        learning_rate_source="--lr",
        threshold=gradient_descent_threshold(0.2).to_dict(),
        warm_start=True,
        plan=[{"file": entry["file"], "step": entry["step"]} for entry in entries],
        summary={"checkpoints": 2, "done": 2, "failed": 0, "pending": 0},
        checkpoints=entries,
        model={"name": "mlp", "num_parameters": 650},
    )
    return json.loads(report.to_json())


def _landscape() -> dict[str, Any]:
    curves = LandscapeResult(
        alphas=np.linspace(-1.0, 1.0, 3),
        betas=None,
        labels=["v1", "random"],
        losses={"v1": np.array([1.5, 0.5, 1.25]), "random": np.array([0.6, 0.5, 0.6])},
        losses_2d=None,
        base_loss=0.5,
        direction_norms={"v1": 1.0, "random": 1.0},
        num_examples=100,
        num_evaluations=7,
        wall_time=0.1,
    )
    report = LandscapeReport(
        command="spectra landscape m.keras --data d.npz --out out",
        versions={},
        settings={"dtype": "float32"},
        data={"name": "digits", "num_examples": 100},
        model={"name": "mlp", "num_parameters": 650},
        eigenvalues=_eigen((2.0,)),
        radius={"slope_along_v1": 0.0, "rule": "R = 1"},
        directions={"v1": "top eigenvector", "random": "random direction"},
        curves=curves,
        surface=None,
        files={},
    )
    return json.loads(report.to_json())


BASES: dict[str, Callable[[], dict[str, Any]]] = {
    "analysis": _analysis,
    "sharpness": _sharpness,
    "landscape": _landscape,
}


RERUN = {
    "analysis": "rerun the analysis (spectra analyze)",
    "sharpness": "rerun spectra sharpness with --restart",
    "landscape": "rerun spectra landscape",
}


def _edit(base: str, change: Callable[[dict[str, Any]], None]) -> Callable[[], str]:
    def text() -> str:
        payload = copy.deepcopy(BASES[base]())
        change(payload)
        return json.dumps(payload)

    return text


def _set(*path_and_value: Any) -> Callable[[dict[str, Any]], None]:
    *path, value = path_and_value

    def change(payload: dict[str, Any]) -> None:
        holder = payload
        for key in path[:-1]:
            holder = holder[key]
        holder[path[-1]] = value

    return change


def _drop(*path: Any) -> Callable[[dict[str, Any]], None]:
    def change(payload: dict[str, Any]) -> None:
        holder = payload
        for key in path[:-1]:
            holder = holder[key]
        del holder[path[-1]]

    return change


# (name, base, the file's text, the message after "<path>: ", what refuses it: "read" the
# file is not JSON spectra wrote; "damage" the right kind of file with fields that are not
# what its class holds, refused by spectra.load; "figure" a field the figures read is
# missing, refused by spectra plot only (spectra.load gives the report).
CORPUS: list[tuple[str, str, Callable[[], str], str, str]] = [
    (
        "cut short",
        "analysis",
        lambda: json.dumps(_analysis())[:500],
        "not JSON: it ends in the middle of a value",
        "read",
    ),
    (
        "cut short after a value",
        "analysis",
        lambda: json.dumps(_analysis())[:-1],
        "not JSON: it ends in the middle of a value",
        "read",
    ),
    ("empty", "analysis", lambda: "", "the file is empty, not JSON", "read"),
    (
        "not UTF-8",
        "analysis",
        lambda: json.dumps(_analysis()).replace('"mlp"', '"ml\udcffp"'),
        "not UTF-8 text (byte 0xff at offset",
        "read",
    ),
    (
        "nested arrays",
        "analysis",
        lambda: '{"type": "AnalysisReport", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
        f"JSON nested more than {MAX_JSON_DEPTH} levels deep (line 1), deeper than any file "
        "spectra writes",
        "read",
    ),
    (
        "nested arrays alone",
        "analysis",
        lambda: "[" * 5_000 + "]" * 5_000,
        f"JSON nested more than {MAX_JSON_DEPTH} levels deep",
        "read",
    ),
    (
        "eigenvalues of length 1, bounds of length 2",
        "analysis",
        _edit("analysis", _set("eigenvalues", "eigenvalues", [4.0])),
        '"eigenvalues.eigenvalues" has 1 value but "eigenvalues.error_bounds" has 2 values; '
        f"{DAMAGED} — rerun the analysis (spectra analyze)",
        "damage",
    ),
    (
        "eigenvalues as text",
        "analysis",
        _edit("analysis", _set("eigenvalues", "eigenvalues", "4.0, 2.0")),
        "\"eigenvalues.eigenvalues\" must be a list of numbers, got the text '4.0, 2.0'",
        "damage",
    ),
    (
        "eigenvalue NaN (written as null, explained)",
        "analysis",
        _edit(
            "analysis",
            lambda d: (
                d["eigenvalues"]["eigenvalues"].__setitem__(0, None),
                d.__setitem__("null_values", {"eigenvalues.eigenvalues[0]": "NaN"}),
            ),
        ),
        '"eigenvalues.eigenvalues" holds NaN (entry 0) where a number is required',
        "damage",
    ),
    (
        "eigenvalue NaN token",
        "analysis",
        lambda: json.dumps(_analysis()).replace("[4.0, 2.0]", "[NaN, 2.0]", 1),
        '"eigenvalues.eigenvalues" holds NaN (entry 0) where a number is required',
        "damage",
    ),
    (
        "loss NaN",
        "analysis",
        lambda: json.dumps(_analysis()).replace('"loss": 0.5', '"loss": NaN'),
        '"loss" is nan where a finite number is required',
        "damage",
    ),
    (
        "loss as text",
        "analysis",
        _edit("analysis", _set("loss", "0.5")),
        "\"loss\" is the text '0.5', not a number",
        "damage",
    ),
    (
        "negative error bound",
        "analysis",
        _edit("analysis", _set("eigenvalues", "error_bounds", [1e-6, -1.0])),
        '"eigenvalues.error_bounds" holds a negative bound (entry 1)',
        "damage",
    ),
    (
        "converged as numbers",
        "analysis",
        _edit("analysis", _set("eigenvalues", "converged", [1.0, 1.0])),
        '"eigenvalues.converged" must hold true/false values, got float64',
        "damage",
    ),
    (
        "missing eigenvalues",
        "analysis",
        _edit("analysis", _drop("eigenvalues")),
        '"eigenvalues" is missing: an AnalysisReport needs it',
        "damage",
    ),
    (
        "missing error bounds",
        "analysis",
        _edit("analysis", _drop("eigenvalues", "error_bounds")),
        '"eigenvalues.error_bounds" is missing: an EigenResult needs it',
        "damage",
    ),
    (
        "nested result without its type",
        "analysis",
        _edit("analysis", _drop("eigenvalues", "type")),
        '"eigenvalues" is a dictionary, not an EigenResult (a dictionary with "type": '
        '"EigenResult")',
        "damage",
    ),
    (
        "settings as a list",
        "analysis",
        _edit("analysis", _set("settings", [1])),
        '"settings" is a list of 1, not a dictionary',
        "damage",
    ),
    (
        "model without its name",
        "analysis",
        _edit("analysis", _drop("model", "name")),
        '"model" has no "name"',
        "figure",
    ),
    (
        "density weights short of a probe",
        "analysis",
        _edit("analysis", lambda d: d["density"]["weights"].pop()),
        '"density.nodes" has 2 rows but "density.weights" has 1 row',
        "damage",
    ),
    (
        "density nodes ragged",
        "analysis",
        _edit("analysis", lambda d: d["density"]["nodes"][0].pop()),
        '"density.nodes" must be a rectangular list of numbers',
        "damage",
    ),
    (
        "a layer's eigenvalues missing",
        "analysis",
        _edit("analysis", lambda d: d["layers"]["eigenvalues"].pop()),
        '"layers.groups" has 2 values but "layers.eigenvalues" has 1 value',
        "damage",
    ),
    (
        "a layer's bounds of another length",
        "analysis",
        _edit("analysis", lambda d: d["layers"]["error_bounds"][1].pop()),
        '"layers.eigenvalues[1]" has 2 values but "layers.error_bounds[1]" has 1 value',
        "damage",
    ),
    (
        "an unknown field",
        "analysis",
        _edit("analysis", _set("eigenvalues", "colour", "red")),
        '"eigenvalues.colour" is not a field of an EigenResult',
        "damage",
    ),
    (
        "checkpoint eigenvalues of length 1, bounds of length 2",
        "sharpness",
        _edit("sharpness", _set("checkpoints", 1, "eigenvalues", [1.7])),
        '"checkpoints[1].eigenvalues" has 1 value but "checkpoints[1].error_bounds" has 2 '
        f"values; {DAMAGED} — rerun spectra sharpness with --restart",
        "damage",
    ),
    (
        "checkpoints of different lengths",
        "sharpness",
        _edit(
            "sharpness",
            lambda d: [d["checkpoints"][1][key].pop() for key in _PER_EIGENVALUE],
        ),
        '"checkpoints[0].eigenvalues" has 2 values but "checkpoints[1].eigenvalues" has 1',
        "damage",
    ),
    (
        "checkpoints of another top_k",
        "sharpness",
        _edit("sharpness", _set("settings", "top_k", 3)),
        '"checkpoints[0].eigenvalues" has 2 values but "settings.top_k" is 3',
        "damage",
    ),
    (
        "checkpoint without eigenvalues",
        "sharpness",
        _edit("sharpness", _drop("checkpoints", 1, "eigenvalues")),
        '"checkpoints[1]" is done but has no "eigenvalues"',
        "damage",
    ),
    (
        "checkpoint step as text",
        "sharpness",
        _edit("sharpness", _set("checkpoints", 1, "step", "twenty")),
        "\"checkpoints[1].step\" is the text 'twenty', not an integer or a number",
        "damage",
    ),
    (
        "checkpoint as text",
        "sharpness",
        _edit("sharpness", _set("checkpoints", 0, "done")),
        "\"checkpoints[0]\" is the text 'done', not a dictionary",
        "damage",
    ),
    (
        "checkpoint eigenvalue NaN",
        "sharpness",
        lambda: json.dumps(_sharpness()).replace("1.7,", "NaN,"),
        '"checkpoints[1].eigenvalues" holds NaN (entry 0) where a number is required',
        "damage",
    ),
    (
        "threshold without its value",
        "sharpness",
        _edit("sharpness", _drop("threshold", "value")),
        '"threshold" has no "value"',
        "damage",
    ),
    (
        "threshold NaN",
        "sharpness",
        _edit(
            "sharpness",
            lambda d: (
                d["threshold"].__setitem__("value", None),
                d.__setitem__("null_values", {"threshold.value": "NaN"}),
            ),
        ),
        '"threshold.value" is nan where a finite number is required',
        "damage",
    ),
    (
        "threshold as text",
        "sharpness",
        _edit("sharpness", _set("threshold", "2/η")),
        "\"threshold\" is the text '2/η', not a dictionary or null",
        "damage",
    ),
    (
        "an x axis without its values",
        "sharpness",
        _edit("sharpness", _set("x_axes", {"steps": {"label": "Step"}})),
        '"x_axes.steps" has no "values"',
        "figure",
    ),
    (
        "alphas short of a point",
        "landscape",
        _edit("landscape", lambda d: d["curves"]["alphas"].pop()),
        '"curves.alphas" has 2 values but "curves.losses.v1" has 3 values',
        "damage",
    ),
    (
        "radius without its slope",
        "landscape",
        _edit("landscape", _drop("radius", "slope_along_v1")),
        '"radius" has no "slope_along_v1"',
        "figure",
    ),
    (
        "losses as text",
        "landscape",
        _edit("landscape", _set("curves", "losses", "x")),
        "\"curves.losses\" is the text 'x', not a dictionary",
        "damage",
    ),
    (
        "base loss NaN",
        "landscape",
        lambda: json.dumps(_landscape()).replace('"base_loss": 0.5', '"base_loss": NaN'),
        '"curves.base_loss" is nan where a finite number is required',
        "damage",
    ),
    (
        "a curve the eigenvalues do not name",
        "landscape",
        _edit("landscape", _set("curves", "labels", ["v1", "v2"])),
        "\"curves.labels[1]\" is 'v2', not one of random, v1",
        "figure",
    ),
]


_PER_EIGENVALUE = ("eigenvalues", "error_bounds", "residual_norms", "converged")


def _write(path: Path, text: str) -> None:
    # Lone surrogates stand for raw bytes (the not-UTF-8 case).
    path.write_bytes(text.encode("utf-8", errors="surrogateescape"))


@pytest.mark.parametrize("base", sorted(BASES))
def test_the_undamaged_bases_load(tmp_path, base):
    path = tmp_path / f"{base}.json"
    _write(path, json.dumps(BASES[base]()))
    assert type(load(path)).__name__.endswith("Report")


@pytest.mark.parametrize(
    ("base", "text", "expected", "refused_by"),
    [case[1:] for case in CORPUS],
    ids=[case[0] for case in CORPUS],
)
def test_a_hostile_file_is_refused_in_one_line(tmp_path, capsys, base, text, expected, refused_by):
    path = tmp_path / "results.json"
    _write(path, text())
    message = f"{path}: {expected}"
    if refused_by == "figure":
        assert type(load(path)).__name__.endswith("Report")
    else:
        with pytest.raises(ValueError) as info:
            load(path)
        message = str(info.value)
        assert message.startswith(f"{path}: {expected}"), message
        assert "\n" not in message and len(message) < 400, message
        assert isinstance(info.value, FieldError) == (refused_by == "damage")
    # spectra plot prints it as its error, exit status 2, and nothing else.
    assert main(["plot", str(path), "--out", str(tmp_path / "figures")]) == 2
    printed = capsys.readouterr().err.strip()
    assert printed.startswith(f"spectra: error: {message}"), printed
    assert "\n" not in printed and "please report" not in printed
    if refused_by != "read":
        assert printed.endswith(f"{DAMAGED} — {RERUN[base]}"), printed
    assert not (tmp_path / "figures").exists()


def test_nesting_is_measured_outside_strings(tmp_path):
    # Brackets inside strings (escaped quotes included) are not nesting.
    path = tmp_path / "strings.json"
    inner = '[\\"' + "[" * 100 + '\\"'
    path.write_text('{"a": "' + inner + '", "b": [[1]]}')
    assert read_json(path) == {"a": inner.replace('\\"', '"'), "b": [[1]]}
    deep = tmp_path / "deep.json"
    deep.write_text("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    assert read_json(deep) is not None
    deep.write_text("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    with pytest.raises(ValueError, match=f"more than {MAX_JSON_DEPTH} levels"):
        read_json(deep)
    assert sys.getrecursionlimit() > 4 * MAX_JSON_DEPTH


def test_an_infinite_error_bound_is_kept(tmp_path):
    # An error bound not found is +inf (written as null, explained): a bound, not damage.
    payload = _analysis()
    payload["eigenvalues"]["error_bounds"] = [1e-6, None]
    payload["null_values"] = {"eigenvalues.error_bounds[1]": "Infinity"}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(payload))
    report = load(path)
    assert report.eigenvalues.error_bounds[1] == math.inf
