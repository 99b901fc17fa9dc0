"""``spectra analyze --repeats R [--subsample F]``: the repeats in results.json, reloaded with
spectra.load, each repeat equal to a direct Python call on its subset, and bad values
refused in one line."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

import spectra
from spectra._format import plus_minus
from spectra.analysis.repeats import SUBSET_RULE, subsample_indices
from spectra.cli import main
from spectra.io.checkpoints import load_model
from spectra.io.datasets import load_data

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "data" / "digits_mlp.keras")
DIGITS = str(ROOT / "data" / "digits.npz")
LOSS = "sparse_categorical_crossentropy"
BASE = [
    "analyze", MLP, "--data", DIGITS, "--loss", LOSS, "--max-examples", "60", "--float64",
    "--top-k", "2", "--no-progress", "--seed", "3",
]  # fmt: skip


_FRACTION = "--subsample must be a fraction of the data in (0, 1]"


def _run(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(args)
    return status, out.getvalue()


@pytest.fixture(scope="module")
def subsample_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("repeats") / "out"
    args = [*BASE, "--trace", "--trace-products", "6", "--repeats", "3", "--subsample", "0.5"]
    status, printed = _run([*args, "--out", str(out)])
    assert status == 0, printed
    return out, printed


@pytest.mark.slow
def test_results_json_holds_the_repeats(subsample_run: tuple[Path, str]) -> None:
    out, printed = subsample_run
    raw = json.loads((out / "results.json").read_text(encoding="utf-8"))["repeats"]
    assert raw["type"] == "RepeatResult" and raw["kind"] == "subsets"
    assert raw["names"] == ["λ1", "λ2", "trace"]
    assert raw["seeds"] == [3, 4, 5] and raw["subset_sizes"] == [30, 30, 30]
    assert raw["subsample"] == 0.5 and raw["num_examples"] == 60
    assert raw["subset_rule"] == SUBSET_RULE and raw["level"] == 0.95
    for name in ("values", "bounds"):
        assert np.shape(raw[name]) == (3, 3)
    for name in ("mean", "sd", "sem", "ci_low", "ci_high"):
        assert len(raw[name]) == 3
    report = spectra.load(out / "results.json")
    repeats = report.repeats
    assert isinstance(repeats, spectra.RepeatResult)
    np.testing.assert_array_equal(repeats.values, np.array(raw["values"]))
    assert repeats.sd[0] == pytest.approx(np.std(repeats.values[:, 0], ddof=1), rel=1e-12)
    # The subsets' numbers are named for what they are, beside their shift from this run's.
    np.testing.assert_allclose(repeats.full_values[:2], report.eigenvalues.eigenvalues)
    assert repeats.full_values[2] == report.trace.estimate
    shift = (repeats.mean - repeats.full_values) / repeats.sd
    np.testing.assert_allclose(repeats.shift, shift, rtol=1e-12)
    line = next(text for text in printed.splitlines() if text.strip().startswith("λ1 ="))
    difference = repeats.mean[0] - repeats.full_values[0]
    assert "(bound)" in line
    assert (
        f"λ1 of subsets of 30 examples: {plus_minus(repeats.mean[0], repeats.sd[0])} (sd over 3)"
        in (line)
    )
    rounded = plus_minus(difference, repeats.sd[0]).split(" ± ")[0]
    sign = "" if rounded.startswith("-") else "+"
    assert f"mean − this run's value = {sign}{rounded} ({shift[0]:+.1f} sd)" in line
    half = repeats.ci_high[0] - repeats.mean[0]
    assert (
        f"95% CI of the mean over subsets of 30 examples: {plus_minus(repeats.mean[0], half)}"
        in line
    )
    # Counts read as a number and its noun each, never "3 30-example subsets".
    assert "-example" not in printed
    assert "across 3 subsets" not in printed
    assert "λ_max of a smaller sample is larger on average" in printed


@pytest.mark.slow
def test_each_repeat_equals_a_direct_call_on_its_subset(subsample_run: tuple[Path, str]) -> None:
    """Repeat i: the Hessian of the loss on the examples subsample_indices(60, 0.5, 3, i) of
    the 60 the run used, eigenvalues and trace with seed 3 + i, to 1e-12 in float64."""
    out, _ = subsample_run
    repeats = spectra.load(out / "results.json").repeats
    data = load_data(DIGITS, 60, 3)
    model = load_model(MLP, compile=False)
    for i in (0, 2):
        index = subsample_indices(60, 0.5, 3, i)
        op = spectra.HessianOperator.from_keras(
            model, LOSS, (data.x[index], data.y[index]), seed=3, dtype=np.float64
        )
        eig = spectra.eigenvalues(op, k=2, seed=3 + i)
        trace = spectra.trace(op, num_products=6, seed=3 + i)
        direct = np.array([*eig.eigenvalues, trace.estimate])
        np.testing.assert_allclose(repeats.values[i], direct, rtol=1e-12, atol=0)
        np.testing.assert_allclose(repeats.bounds[i, :2], eig.error_bounds, rtol=1e-9)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--repeats", "3", "--subsample", "0"], f"{_FRACTION}, got 0:"),
        (["--repeats", "3", "--subsample", "1.5"], f"{_FRACTION}, got 1.5:"),
        (["--subsample", "0.5"], "--subsample 0.5 needs --repeats R"),
        (["--repeats", "1"], "--repeats must be at least 2"),
    ],
)
def test_bad_values_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main([*BASE, *extra, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"spectra: error: {err[0].removeprefix('spectra: error: ')}"]
    assert err[0].startswith(f"spectra: error: {message}")
    assert not (tmp_path / "out" / "results.json").exists()


def test_subsets_without_an_example_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*BASE, "--repeats", "2", "--subsample", "0.01", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spectra: error: --subsample: subsample = 0.01 of 60 examples leaves ")
    assert "\n" not in err


@pytest.mark.slow
def test_repeats_across_seeds_start_with_the_runs_own_estimate(tmp_path: Path) -> None:
    """Without --subsample only the seeds change: repeat 0 is the run's own estimate (same
    matrix, seed --seed), the eigenvalues' spread is rounding, no subsets are recorded."""
    status, printed = _run([*BASE, "--repeats", "2", "--out", str(tmp_path / "out")])
    assert status == 0, printed
    report = spectra.load(tmp_path / "out" / "results.json")
    repeats = report.repeats
    assert repeats.kind == "seeds" and repeats.subsample is None and repeats.subset_rule is None
    np.testing.assert_array_equal(repeats.seeds, [3, 4])
    assert repeats.subset_sizes.size == 0
    np.testing.assert_allclose(repeats.values[0], report.eigenvalues.eigenvalues, rtol=1e-12)
    assert np.all(repeats.sd <= 1e-8 * repeats.mean)
    assert "across 2 seeds:" in printed and "the estimators' randomness only" in printed


@pytest.mark.slow  # shares the analyze run of subsample_run
def test_eigenvalue_figure_shows_the_spread_and_replots(
    subsample_run: tuple[Path, str], tmp_path: Path
) -> None:
    """The eigenvalue figure of a run with --repeats: each subset's λᵢ as dots, their mean
    ± sd, the run's own bounds, a legend naming both, the trace's spread in the caption;
    the same through ``spectra plot`` of the results.json, at column size."""
    import matplotlib.pyplot as plt

    from spectra._format import plus_minus
    from spectra.cli._common import UserError
    from spectra.cli.plot import _drawing

    out, _ = subsample_run
    assert (out / "eigenvalues.png").is_file()
    path = out / "results.json"
    report = spectra.load(path)
    options = argparse.Namespace(style="column", no_title=False, caption="full")
    draw, stems = _drawing(path, report, options)
    assert stems == ("eigenvalues",)
    (_, _, figure), *_ = draw()
    ax = figure.axes[0]
    texts = [text.get_text().replace("\n", " ") for text in figure.legends[0].get_texts()]
    repeats = report.repeats
    size = f"{int(repeats.subset_sizes[0]):,} examples"
    assert texts[0].startswith("λᵢ ± numerical bound of this run")
    assert texts[1] == f"λᵢ of each subset of {size}"
    assert texts[2] == f"λᵢ of 3 subsets of {size} (mean\u00a0±\u00a0sd)"
    # The dots: every repeat's λ1 and λ2, left of the run's markers.
    dots = [
        line
        for line in ax.get_lines()
        if line.get_marker() == "o" and len(line.get_xdata()) == repeats.values[:, :2].size
    ]
    assert len(dots) == 1
    np.testing.assert_allclose(
        np.sort(dots[0].get_ydata()), np.sort(repeats.values[:, :2].ravel()), rtol=0, atol=0
    )
    assert set(np.round(dots[0].get_xdata(), 6)) == {0.7, 1.7}
    diamonds = [line for line in ax.get_lines() if line.get_marker() == "D"]
    assert len(diamonds) == 1
    np.testing.assert_allclose(diamonds[0].get_ydata(), repeats.mean[:2], rtol=1e-12)
    description = figure._spectra_metadata["Description"]
    assert "error bounds of this run, and the spread across 3 subsets" in description
    j = repeats.quantity("trace")
    spread = plus_minus(float(repeats.mean[j]), float(repeats.sd[j]))
    assert f"{spread} across 3 subsets of 50% of the data (mean ± sd)" in description
    plt.close(figure)
    # --x is for a sharpness.json's training axis only.
    with pytest.raises(UserError, match=r"--x steps: only the figure of a sharpness.json"):
        _drawing(path, report, argparse.Namespace(**vars(options), x_axis="steps"))
    # Through the command: the replot is written.
    status, printed = _run(["plot", str(path), "--out", str(tmp_path / "replot")])
    assert status == 0 and (tmp_path / "replot" / "eigenvalues.png").is_file(), printed
