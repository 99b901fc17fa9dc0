"""``spectra plot``: a run's figures redrawn from its JSON without TensorFlow, and
``spectra.load`` on the JSON ``spectra analyze`` writes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _cli_helpers import DATA, LOSS, PNG_SIGNATURE, ROOT

from spectra.cli import main
from spectra.estimators.results import EigenResult, SpectralDensity, SpectralMass, TraceResult

# Runs `spectra plot` in a fresh interpreter and says whether TensorFlow got imported.
_PLOT_WITHOUT_TF = (
    "import sys\n"
    "from spectra.cli import main\n"
    "status = main(sys.argv[1:])\n"
    "print('TENSORFLOW', 'tensorflow' in sys.modules)\n"
    "sys.exit(status)\n"
)


def _plot(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, "-c", _PLOT_WITHOUT_TF, "plot", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


@pytest.fixture(scope="module")
def analyze_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("analyze")
    args = ["analyze", str(DATA / "digits_mlp.keras"), "--data", str(DATA / "digits.npz")]
    args += ["--loss", LOSS, "--max-examples", "300", "--top-k", "2", "--trace", "--density"]
    args += ["--trace-products", "10", "--density-steps", "15", "--density-probes", "2"]
    assert main([*args, "--out", str(out), "--no-progress", "--quiet"]) == 0
    return out


@pytest.mark.slow
def test_analyze_results_reload_as_their_classes(analyze_run):
    import spectra

    path = analyze_run / "results.json"
    written = json.loads(path.read_text())
    report = spectra.load(path)
    assert type(report).__name__ == "AnalysisReport"
    assert isinstance(report.eigenvalues, EigenResult)
    assert isinstance(report.trace, TraceResult)
    assert isinstance(report.density, SpectralDensity)
    assert isinstance(report.negative_mass, SpectralMass)
    eig = report.eigenvalues
    assert eig.eigenvalues.dtype == np.float64 and eig.converged.dtype == np.bool_
    np.testing.assert_array_equal(eig.eigenvalues, written["eigenvalues"]["eigenvalues"])
    np.testing.assert_array_equal(report.density.nodes, written["density"]["nodes"])
    assert report.density.nodes.shape == (2, 15)
    assert report.density.steps_taken.dtype == np.int64
    assert report.trace.estimate == written["trace"]["estimate"]
    assert report.settings == written["settings"] and report.files == written["files"]
    # What it reloads is what it wrote.
    assert json.loads(report.to_json(include_vectors=False)) == written


@pytest.mark.slow
def test_plot_redraws_an_analyze_run_without_tensorflow(analyze_run, capsys):
    done = _plot([str(analyze_run / "results.json"), "--format", "png,svg"])
    assert done.returncode == 0, done.stderr
    assert "TENSORFLOW False" in done.stdout
    replot = analyze_run / "replot"
    for stem in ("eigenvalues", "density"):
        assert (replot / f"{stem}.png").read_bytes()[:8] == PNG_SIGNATURE
        assert (replot / f"{stem}.svg").stat().st_size > 0
        # The same figure as the run drew: same size in pixels.
        assert (replot / f"{stem}.png").read_bytes()[16:24] == (
            analyze_run / f"{stem}.png"
        ).read_bytes()[16:24]
    assert "figures:" in done.stdout
    # The output directory is claimed: a second plot into it needs --restart (in this
    # process: what TensorFlow it imports no longer matters).
    assert main(["plot", str(analyze_run / "results.json")]) == 2
    assert capsys.readouterr().err.startswith("spectra: error: ")
    assert main(["plot", str(analyze_run / "results.json"), "--restart"]) == 0


@pytest.mark.slow
def test_plot_redraws_a_sharpness_run(tmp_path):
    out = tmp_path / "sharpness"
    glob = str(DATA / "gd_trajectory" / "step_00[02]0.keras")
    args = ["sharpness", glob, "--data", str(DATA / "digits.npz"), "--loss", LOSS]
    assert main([*args, "--max-examples", "200", "--out", str(out), "--no-progress"]) == 0
    figures = tmp_path / "figures"
    done = _plot([str(out / "sharpness.json"), "--out", str(figures)])
    assert done.returncode == 0, done.stderr
    assert "TENSORFLOW False" in done.stdout
    assert (figures / "sharpness.png").read_bytes()[:8] == PNG_SIGNATURE
    assert not (out / "replot").exists()


def test_plot_refuses_a_file_that_is_not_a_result(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"type": "Nonsense"}')
    done = _plot([str(path)])
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"spectra: error: {path}: unknown result type")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_plot_redraws_a_landscape_run_and_load_rebuilds_its_curves(tmp_path):
    from spectra import LandscapeResult, load

    out = tmp_path / "landscape"
    args = ["landscape", str(DATA / "digits_mlp.keras"), "--data", str(DATA / "digits.npz")]
    args += ["--loss", LOSS, "--max-examples", "100", "--points", "5", "--no-progress"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    report = load(out / "landscape.json")
    assert isinstance(report.curves, LandscapeResult) and report.surface is None
    written = json.loads((out / "landscape.json").read_text())
    np.testing.assert_array_equal(report.curves.alphas, written["curves"]["alphas"])
    np.testing.assert_array_equal(report.curves.losses["v1"], written["curves"]["losses"]["v1"])
    done = _plot([str(out / "landscape.json")])
    assert done.returncode == 0, done.stderr
    assert "TENSORFLOW False" in done.stdout
    assert (out / "replot" / "landscape_1d.png").read_bytes() == (
        out / "landscape_1d.png"
    ).read_bytes()


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


def test_plot_of_a_missing_file_or_a_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    wanted = "a run's results.json, sharpness.json or landscape.json"
    assert _error(["plot", "nothere.json"]) == f"no file 'nothere.json': give {wanted}"
    (tmp_path / "run").mkdir()
    assert _error(["plot", "run"]) == f"'run' is a directory: give {wanted} in it"
