"""Tests of ``spectra landscape`` (spectra.cli.landscape). (Not ``test_landscape.py``: that
basename is taken by tests/analysis/test_landscape.py, and the test folders are not packages.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from _cli_helpers import DIGITS, LOSS, MLP, _assert_png, _run

from spectra import HessianOperator
from spectra.cli import main
from spectra.io.checkpoints import load_model
from spectra.io.datasets import load_data


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


COMMON = ["--data", DIGITS, "--loss", LOSS, "--max-examples", "50", "--no-progress"]


def _status(args: list[str]) -> int:
    """``main(args)``'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(args)
    except SystemExit as exit_info:
        return int(exit_info.code)


def _one_line_error(capsys, status: int) -> str:
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.err.startswith("spectra: error: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    return captured.err


def _nothing_written(out: Path) -> bool:
    return not out.exists() or not any(
        p.name.startswith(("sharpness", "landscape", "results")) for p in out.iterdir()
    )


# --------------------------------------------------------------------------- landscape


@pytest.mark.parametrize(
    "options, expected",
    [
        (["--radius", "0"], "argument --radius: must be a positive number, got 0"),
        (["--radius", "-1"], "argument --radius: must be a positive number, got -1"),
        (["--radius", "nan"], "argument --radius: must be a positive number, got nan"),
        (["--radius", "inf"], "argument --radius: must be a positive number, got inf"),
        (["--radius", "wide"], "argument --radius: must be a positive number, got 'wide'"),
        (["--directions", "3"], "argument --directions: invalid choice: 3"),
        (["--directions", "0"], "argument --directions: invalid choice: 0"),
        (["--directions", "v1"], "argument --directions: invalid int value: 'v1'"),
        (["--directions", "2", "--points", "1"], "needs --points 3 or more"),
        (["--points", "0"], "argument --points: must be a positive integer, got 0"),
        (["--trace"], "unrecognized arguments: --trace"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_landscape_errors_are_one_line(options, expected, tmp_path, capsys):
    out = tmp_path / "out"
    status = _status(["landscape", MLP, *COMMON, *options, "--out", str(out)])
    error = _one_line_error(capsys, status)
    assert expected in error, error
    assert _nothing_written(out)


def test_landscape_refuses_100000_points_with_their_cost(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["landscape", MLP, *COMMON, "--points", "100000", "--out", str(out)]
    error = _one_line_error(capsys, _status(args))
    assert "--points 100000 means 200,003 loss evaluations, one pass over the data each" in error
    assert "more than the 2,000 run without --force" in error and "--force" in error
    assert not out.exists()


def test_landscape_cost_counts_the_evaluations_run():
    from spectra.reports.landscape import planned_evaluations, step_grid

    for directions, points in ((1, 1), (1, 4), (1, 41), (2, 3), (2, 41)):
        size = step_grid(1.0, points).size
        curves = (directions + 1) * size + 1
        assert planned_evaluations(directions, points) == curves + (
            size * size + 1 if directions == 2 else 0
        )


def test_landscape_refuses_a_radius_that_gives_nan_losses(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["landscape", MLP, *COMMON, "--radius", "1e30", "--out", str(out)]
    error = _one_line_error(capsys, _status(args))
    assert "the loss is nan at α =" in error and "R = 1e+30 (--radius)" in error, error
    assert "give a smaller --radius (the curvature-scaled default here is" in error
    assert _nothing_written(out)


def test_landscape_refuses_a_radius_beyond_the_dtype(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["landscape", MLP, *COMMON, "--radius", "1e39", "--out", str(out)]
    error = _one_line_error(capsys, _status(args))
    assert "beyond the largest float32 number 3.4e+38: give a smaller --radius" in error
    assert _nothing_written(out)
