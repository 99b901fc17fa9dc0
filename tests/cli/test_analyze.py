"""Tests of ``spectra analyze`` (spectra.cli.analyze).

``spectra analyze --repeats R [--subsample F]``: the repeats in results.json, reloaded with
spectra.load, each repeat equal to a direct Python call on its subset, and bad values
refused in one line.

Checkpoints the command line opens beyond plain ``.keras`` files: a subclassed model's
``.keras`` file with ``--custom-objects``, and a compiled, trained model's ``.weights.h5``
(optimizer state included) with ``--builder``. Each eigenvalue is checked against the
dense Hessian of the same model and data (float64, ``numpy.linalg.eigh``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _cli_helpers import DATA, DIGITS, LOSS, MLP, _assert_png, _run

import spectra
from spectra import HessianOperator, eigenvalues
from spectra._format import plus_minus
from spectra.analysis.repeats import SUBSET_RULE, subsample_indices
from spectra.cli import main
from spectra.io.checkpoints import load_model
from spectra.io.datasets import load_data


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    out = tmp_path_factory.mktemp("analyze")
    args = [
        "analyze",
        MLP,
        "--data",
        DIGITS,
        "--loss",
        LOSS,
        "--max-examples",
        "200",
        "--seed",
        "3",
        "--top-k",
        "3",
        "--trace",
        "--trace-products",
        "20",
        "--density",
        "--density-steps",
        "15",
        "--density-probes",
        "2",
        "--float64",
        "--no-progress",
        "--out",
        str(out),
    ]
    status, printed = _run(args)
    assert status == 0
    return out, json.loads((out / "results.json").read_text()), printed


def test_analyze_results_json(analyzed):
    out, results, _ = analyzed
    for key in (
        "command",
        "versions",
        "settings",
        "model",
        "data",
        "loss",
        "eigenvalues",
        "eigenvalue_ratio",
        "trace",
        "density",
        "density_moments",
        "negative_mass",
        "num_products",
        "num_data_passes",
        "wall_times",
        "files",
    ):
        assert key in results, key
    assert set(results["versions"]) >= {"spectra", "tensorflow", "keras", "numpy", "scipy"}
    assert results["command"].startswith("spectra analyze ")
    assert results["settings"]["seed"] == 3 and results["settings"]["dtype"] == "float64"
    assert results["model"]["num_parameters"] == 85002
    assert results["data"]["num_examples"] == 200
    eig = results["eigenvalues"]
    assert len(eig["eigenvalues"]) == 3
    assert len(eig["residual_norms"]) == 3 and len(eig["error_bounds"]) == 3
    assert "eigenvectors" not in eig
    assert eig["eigenvalues"] == sorted(eig["eigenvalues"], reverse=True)
    assert results["eigenvalue_ratio"] == pytest.approx(
        eig["eigenvalues"][0] / eig["eigenvalues"][2]
    )
    assert results["trace"]["stderr"] > 0 and results["trace"]["num_products"] >= 20
    density = results["density"]
    assert np.array(density["nodes"]).shape == (2, 15)
    np.testing.assert_allclose(np.array(density["weights"]).sum(axis=1), 1.0)
    assert len(results["density_moments"]["estimate"]) == 5
    mass = results["negative_mass"]
    assert mass["tau"] == 0.01 and mass["threshold"] == pytest.approx(-0.01 * eig["eigenvalues"][0])
    assert 0 <= mass["lower"] <= mass["estimate"] <= mass["upper"] <= 1
    assert results["num_products"] >= (
        eig["num_products"] + results["trace"]["num_products"] + density["num_products"]
    )
    assert results["wall_times"]["total"] > 0
    assert Path(results["files"]["results"]) == out / "results.json"


def test_analyze_top_eigenvalue_matches_the_library(analyzed):
    _, results, _ = analyzed
    model = load_model(MLP)
    data = load_data(DIGITS, max_examples=200, seed=3)
    op = HessianOperator.from_keras(model, LOSS, data.as_tuple(), dtype=np.float64)
    expected = eigenvalues(op, k=1).eigenvalues[0]
    assert results["eigenvalues"]["eigenvalues"][0] == pytest.approx(expected, rel=1e-6)
    assert results["loss"] == pytest.approx(op.loss(), rel=1e-12)


def test_analyze_figures_and_summary(analyzed):
    out, results, printed = analyzed
    _assert_png(out / "eigenvalues.png")
    _assert_png(out / "density.png")
    top, bound = results["eigenvalues"]["eigenvalues"][0], results["eigenvalues"]["error_bounds"][0]
    assert f"λ1 = {plus_minus(top, bound)}   residual" in printed
    assert "λ1/λ3 = " in printed
    trace = results["trace"]
    printed_trace = plus_minus(trace["estimate"], trace["stderr"])
    assert f"trace (hutchinson) = {printed_trace} (standard error)" in printed
    assert "spectral mass below -0.01·λ1" in printed
    assert str(out / "results.json") in printed and str(out / "density.png") in printed


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.startswith("spectra: error: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


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


def test_strict_json_with_one_density_probe(tmp_path, capsys):
    out = tmp_path / "out"
    args = _small(
        "analyze",
        MLP,
        out,
        *("--top-k", "1", "--density", "--density-probes", "1", "--density-steps", "8"),
        *("--format", "png,svg,pdf"),
    )
    assert main(args) == 0

    def refuse(token):
        raise AssertionError(f"non-JSON token {token}")

    results = json.loads((out / "results.json").read_text(), parse_constant=refuse)
    assert results["density_moments"]["stderr"] == [None] * 5
    reasons = results["null_values"]
    assert reasons["density_moments.stderr[0]"].startswith("NaN: a standard error needs")
    for stem in ("eigenvalues", "density"):
        for fmt in ("png", "svg", "pdf"):
            assert (out / f"{stem}.{fmt}").stat().st_size > 1000
    assert results["files"]["density_figure"] == [
        str(out / f"density.{f}") for f in ("png", "svg", "pdf")
    ]


def _eigh_descending(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values, vectors = np.linalg.eigh(matrix)
    return values[::-1], vectors[:, ::-1]


@pytest.mark.slow
@pytest.mark.long  # a compiled checkpoint without --loss is covered on the MLP too
def test_analyze_a_compiled_lstm_checkpoint_without_loss(adam_lstm_run, tmp_path):
    """No --loss: the compiled loss; λ and the per-layer table against dense eigh (1e-8)."""
    run, data, truth = adam_lstm_run
    out = tmp_path / "out"
    checkpoint = run / "step_0004.keras"
    args = ["analyze", str(checkpoint), "--data", data, "--top-k", "2", "--tol", "1e-10"]
    args += ["--layers", "--trace", "--trace-products", "10", "--no-progress", "--out", str(out)]
    status, printed = _run(args)
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    assert settings["loss"] is None and settings["curvature"] == "hessian"
    assert settings["matrix"] == "Hessian" and settings["layers"] is True
    # Compiled with from_logits=True (the fixture): the record says so.
    assert results["model"]["compiled_loss"] == "sparse_categorical_crossentropy(from_logits=True)"
    assert results["model"]["compiled_loss_config"]["config"]["from_logits"] is True
    H = truth[4]["H"]
    dense, _ = _eigh_descending(H)
    np.testing.assert_allclose(results["eigenvalues"]["eigenvalues"], dense[:2], rtol=1e-8)
    # The compiled loss is the mean cross-entropy on logits the dense Hessian differentiates.
    assert results["loss"] == pytest.approx(truth[4]["loss"], rel=1e-12)

    # Per layer: the diagonal blocks of the dense Hessian.
    layers = results["layers"]
    assert layers["groups"] == ["embedding", "lstm/lstm_cell", "logits"]
    bounds = np.cumsum([0, 12, 40, 9])
    assert layers["group_sizes"] == [12, 40, 9]
    for index in range(3):
        block = H[bounds[index] : bounds[index + 1], bounds[index] : bounds[index + 1]]
        top, _ = _eigh_descending(block)
        np.testing.assert_allclose(layers["eigenvalues"][index], top[:2], rtol=1e-8)
        # Hutchinson with 10 Rademacher probes: (estimate − trace)/s.e. is roughly t with 9
        # degrees of freedom; |t| > 6 has probability about 2e-4.
        error = abs(layers["traces"][index] - np.trace(block))
        assert error <= 6 * layers["trace_stderr"][index]
    table = results["layer_table"]
    assert [row["group"] for row in table] == layers["groups"]
    for row, values, trace_value in zip(table, layers["eigenvalues"], layers["traces"]):
        assert row["eigenvalues"] == values and row["trace"] == trace_value
    assert "per layer (3 layers" in printed and "lstm/lstm_cell" in printed
    _assert_png(out / "layers.png")
    assert results["files"]["layers_figure"] == [str(out / "layers.png")]


def _compiled_sgd_checkpoint(tmp_path: Path) -> Path:
    """The digits GD model compiled with SGD, after one step."""
    import keras

    model = keras.models.load_model(DATA / "gd_trajectory" / "step_0000.keras", compile=False)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    digits = load_data(DIGITS, max_examples=60)
    model.fit(digits.x, digits.y, batch_size=60, epochs=1, verbose=0)
    path = tmp_path / "sgd_0001.keras"
    model.save(path)
    return path


@pytest.mark.parametrize(
    "case",
    [
        "no compiled loss",
        "no optimizer state",
        "optimizer without preconditioner",
        "matrix missing from this build",
        "unknown curvature",
    ],
)
def test_curvature_and_preconditioner_errors_are_one_line(case, tmp_path, capsys, monkeypatch):
    import spectra

    out = tmp_path / "out"
    command, target, extra = "analyze", MLP, ["--loss", LOSS]
    if case == "no compiled loss":
        extra = []
        expected = "digits_mlp.keras carries no compiled loss"
    elif case == "no optimizer state":
        # A copy without the trajectory.json beside it (whose SGD line would be warned about).
        command, target = "sharpness", tmp_path / "step_0000.keras"
        target.write_bytes((DATA / "gd_trajectory" / "step_0000.keras").read_bytes())
        extra += ["--preconditioned"]
        expected = "step_0000.keras: no optimizer state (saved without compile"
    elif case == "optimizer without preconditioner":
        command, extra = "sharpness", ["--preconditioned"]
        target = _compiled_sgd_checkpoint(tmp_path)
        expected = "sgd_0001.keras is SGD, which has no preconditioner (P = I)"
    elif case == "matrix missing from this build":
        # As if this build had no GGNOperator (whether or not it has one).
        import spectra.operators

        monkeypatch.delitem(spectra.operators._SOURCE, "GGNOperator", raising=False)
        monkeypatch.delattr(spectra.operators, "GGNOperator", raising=False)
        extra += ["--curvature", "ggn"]
        expected = "--curvature ggn needs spectra.GGNOperator, which this build"
    else:
        extra += ["--curvature", "hessain"]
        expected = "argument --curvature: invalid choice: 'hessain'"
    args = [command, str(target), "--data", DIGITS, "--max-examples", "60", *extra]
    args += ["--no-progress", "--out", str(out)]
    try:
        status = main(args)
    except SystemExit as exit_info:
        status = exit_info.code
    assert status == 2
    assert expected in _one_line_error(capsys)
    assert not (out / "results.json").exists()


def _checkpoint_truths(checkpoint: Path, data: str) -> dict[str, np.ndarray]:
    """Dense G = (1/N) Σ Jᵢᵀ (diag pᵢ − pᵢpᵢᵀ) Jᵢ and empirical Fisher (1/N) Σ gᵢgᵢᵀ of a
    float64 classifier whose last layer gives logits, by TensorFlow Jacobians: of all the
    examples' logits at once (the summed loss's Hessian in them is block diagonal, one
    block per example) and one gradient per example."""
    import keras
    import tensorflow as tf
    from _gauss_newton import dense_ggn, per_example_gradients

    model = keras.models.load_model(checkpoint, compile=False)
    arrays = np.load(data)
    x, y = arrays["x"], arrays["y"]
    n = len(x)
    variables = model.trainable_variables

    def softmax_cross_entropy(points, label):
        return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(label, points[0]))

    G = dense_ggn(
        [(lambda: [model(x)], lambda points: softmax_cross_entropy(points, y), 1 / n)], variables
    )
    gradients = per_example_gradients(
        [lambda i=i: softmax_cross_entropy([model(x[i : i + 1])], y[i : i + 1]) for i in range(n)],
        variables,
    )
    return {"ggn": G, "fisher-empirical": gradients.T @ gradients / n}


@pytest.mark.parametrize("curvature", ["ggn", "fisher-empirical", "fisher-mc"])
def test_analyze_curvature_matrices_against_dense_truths(curvature, adam_mlp_run, tmp_path):
    """--curvature: the GGN and the empirical Fisher against dense matrices from per-example
    Jacobians (1e-8); the Monte Carlo Fisher (random labels) against the library operator
    built with the command's seed, and its top eigenvalue below the GGN's trace."""
    import keras

    from spectra import FisherOperator

    run, data, _ = adam_mlp_run
    checkpoint = run / "step_0004.keras"
    out = tmp_path / "out"
    args = ["analyze", str(checkpoint), "--data", data, "--curvature", curvature, "--top-k", "2"]
    args += ["--tol", "1e-10", "--seed", "5", "--trace", "--trace-products", "10"]
    status, printed = _run([*args, "--no-progress", "--out", str(out)])
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["curvature"] == curvature
    found = np.array(results["eigenvalues"]["eigenvalues"])
    if curvature == "fisher-mc":
        model = keras.models.load_model(checkpoint, compile=False)
        arrays = np.load(data)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        op = FisherOperator.from_keras(model, loss, (arrays["x"], arrays["y"]), kind="mc", seed=5)
        matrix = op @ np.eye(op.shape[0])
        assert "Monte Carlo Fisher" in printed
    else:
        matrix = _checkpoint_truths(checkpoint, data)[curvature]
    dense, _ = _eigh_descending((matrix + matrix.T) / 2)
    np.testing.assert_allclose(found, dense[:2], rtol=1e-8)
    assert np.all(np.abs(found - dense[:2]) <= np.array(results["eigenvalues"]["error_bounds"]))
    # Hutchinson, 10 Rademacher probes: |t| > 6 has probability about 2e-4 (t, 9 dof).
    assert abs(results["trace"]["estimate"] - np.trace(matrix)) <= 6 * results["trace"]["stderr"]


BASE = [
    "analyze", MLP, "--data", DIGITS, "--loss", LOSS, "--max-examples", "60", "--float64",
    "--top-k", "2", "--no-progress", "--seed", "3",
]  # fmt: skip


_FRACTION = "--subsample must be a fraction of the data in (0, 1]"


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


MODULE = textwrap.dedent(
    """
    import keras

    @keras.saving.register_keras_serializable(package="spectra_test_formats")
    class SubNet(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(4, activation="tanh")
            self.out = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            return self.out(self.hidden(x))

    def build():
        return keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(4, activation="tanh"),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
    """
)


REGISTERED = "spectra_test_formats>SubNet"


def _status(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exit_info:
        return int(exit_info.code)


def _dense_top(model, x, y) -> float:
    """Largest eigenvalue of the explicit float64 Hessian of the mean cross-entropy."""
    import keras
    import tensorflow as tf

    variables = [tf.Variable(tf.cast(v, tf.float64)) for v in model.trainable_variables]
    sizes = [int(np.prod(v.shape)) for v in variables]

    def loss_of(theta):
        parts = tf.split(theta, sizes)
        w1, b1, w2, b2 = (tf.reshape(p, v.shape) for p, v in zip(parts, variables, strict=True))
        probabilities = tf.nn.softmax(tf.tanh(x @ w1 + b1) @ w2 + b2)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, probabilities))

    theta = tf.concat([tf.reshape(v, [-1]) for v in variables], 0)
    with tf.GradientTape() as outer:
        outer.watch(theta)
        with tf.GradientTape() as inner:
            inner.watch(theta)
            value = loss_of(theta)
        grad = inner.gradient(value, theta)
    hessian = outer.jacobian(grad, theta).numpy()
    return float(np.linalg.eigvalsh(hessian)[-1])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The module file, the data, a subclassed model's .keras file and a compiled, trained
    Sequential model's .weights.h5, with the dense top eigenvalue of each."""
    import keras

    tmp = tmp_path_factory.mktemp("formats")
    module_file = tmp / "mymodels.py"
    module_file.write_text(MODULE)
    spec = importlib.util.spec_from_file_location("_spectra_test_formats_save", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    np.savez(tmp / "data.npz", x=x, y=y)

    keras.utils.set_random_seed(1)
    subnet = module.SubNet()
    subnet(x[:2])
    subnet.save(tmp / "sub.keras")
    keras.saving.get_custom_objects().pop(REGISTERED, None)

    keras.utils.set_random_seed(2)
    trained = module.build()
    trained.compile(optimizer=keras.optimizers.Adam(0.05), loss=LOSS)
    trained.fit(x, y, epochs=1, batch_size=40, verbose=0)
    trained.save_weights(tmp / "trained.weights.h5")
    x64, y64 = x.astype(np.float64), y
    return {
        "dir": tmp,
        "module": module_file,
        "data": str(tmp / "data.npz"),
        "sub_top": _dense_top(subnet, x64, y64),
        "trained_top": _dense_top(trained, x64, y64),
    }


@pytest.fixture
def unregistered(files):
    """SubNet unknown to Keras (as in a fresh process), and the module not yet imported."""
    import keras

    registry = keras.saving.get_custom_objects()
    saved = registry.pop(REGISTERED, None)
    cached = {k: m for k, m in sys.modules.items() if k.startswith("_spectra_builder_")}
    for key in cached:
        del sys.modules[key]
    yield
    sys.modules.update(cached)
    if saved is not None:
        registry.setdefault(REGISTERED, saved)


def _analyze(files, out: Path, model: str, *extra: str) -> int:
    return _status(
        [
            "analyze",
            model,
            "--data",
            files["data"],
            "--out",
            str(out),
            "--top-k",
            "1",
            "--no-progress",
            "--quiet",
            *extra,
        ]
    )


def test_subclassed_keras_with_custom_objects(files, unregistered, tmp_path):
    status = _analyze(
        files,
        tmp_path / "out",
        str(files["dir"] / "sub.keras"),
        "--loss",
        LOSS,
        "--custom-objects",
        str(files["module"]),
    )
    assert status == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    top = results["eigenvalues"]["eigenvalues"][0]
    # float32 products: ~1e-6 relative.
    assert top == pytest.approx(files["sub_top"], rel=2e-5)


def test_subclassed_keras_in_float64(files, unregistered, tmp_path):
    """The float64 copy of a subclassed model whose layers are created in ``__init__``
    without a dtype: rebuilt under a float64 policy, it matches the dense Hessian."""
    status = _analyze(
        files,
        tmp_path / "out",
        str(files["dir"] / "sub.keras"),
        "--loss",
        LOSS,
        "--custom-objects",
        str(files["module"]),
        "--float64",
    )
    assert status == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["eigenvalues"]["eigenvalues"][0] == pytest.approx(files["sub_top"], rel=1e-9)


def test_subclassed_keras_without_custom_objects(files, unregistered, tmp_path, capsys):
    status = _analyze(files, tmp_path / "out", str(files["dir"] / "sub.keras"), "--loss", LOSS)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("spectra: error: ") and err.count("\n") == 1, err
    assert "'SubNet'" in err and "--custom-objects" in err


def test_custom_objects_errors(files, tmp_path, capsys):
    missing = str(files["dir"] / "nowhere.py")
    status = _analyze(
        files,
        tmp_path / "a",
        str(files["dir"] / "sub.keras"),
        "--loss",
        LOSS,
        "--custom-objects",
        missing,
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "nowhere.py" in err, err
    status = _analyze(
        files,
        tmp_path / "b",
        str(files["dir"] / "sub.keras"),
        "--loss",
        LOSS,
        "--custom-objects",
        f"{files['module']}:nothing",
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "has no 'nothing'" in err, err


def test_trained_weights_with_builder(files, tmp_path, capsys):
    status = _analyze(
        files,
        tmp_path / "out",
        str(files["dir"] / "trained.weights.h5"),
        "--loss",
        LOSS,
        "--builder",
        f"{files['module']}:build",
        "--float64",
    )
    assert status == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["eigenvalues"]["eigenvalues"][0] == pytest.approx(files["trained_top"], rel=1e-6)
    # Adam after one step: iterations, learning rate and two moments for each of 4 weights.
    assert results["model"]["ignored_optimizer_weights"] == 10


def test_mismatched_weights_still_refused(files, tmp_path, capsys):
    (tmp_path / "small.py").write_text(
        "import keras\n"
        "def build():\n"
        "    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])\n"
    )
    status = _analyze(
        files,
        tmp_path / "out",
        str(files["dir"] / "trained.weights.h5"),
        "--loss",
        LOSS,
        "--builder",
        f"{tmp_path / 'small.py'}:build",
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "holds 4 weight arrays of the model" in err and "only 2 weights" in err, err


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    """A functional model with outputs 'cls' (softmax, cross-entropy) and 'reg' (linear,
    MSE) saved compiled with both losses, its data, and the top eigenvalue of the explicit
    float64 Hessian of mean CE + mean MSE."""
    import keras
    import tensorflow as tf

    tmp = tmp_path_factory.mktemp("two_outputs")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(inputs)
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(hidden)
    reg = keras.layers.Dense(1, name="reg")(hidden)
    model = keras.Model(inputs, [cls, reg])
    model.compile(optimizer="sgd", loss={"cls": LOSS, "reg": "mse"})
    model.save(tmp / "two.keras")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 5)).astype(np.float32)
    y_cls = rng.integers(0, 3, 30)
    y_reg = rng.normal(size=(30, 1)).astype(np.float32)
    np.savez(tmp / "named.npz", x=x, y_cls=y_cls, y_reg=y_reg)
    np.savez(tmp / "ordered.npz", x=x, y0=y_cls, y1=y_reg)
    np.savez(tmp / "missing.npz", x=x, y_cls=y_cls)
    np.savez(tmp / "extra.npz", x=x, y_cls=y_cls, y_reg=y_reg, y_aux=y_reg)
    np.savez(tmp / "single.npz", x=x, y=y_cls)

    shapes = [tuple(v.shape) for v in model.trainable_variables]
    sizes = [int(np.prod(s)) for s in shapes]
    x64 = x.astype(np.float64)

    def loss_of(theta):
        w1, b1, wc, bc, wr, br = (
            tf.reshape(p, s) for p, s in zip(tf.split(theta, sizes), shapes, strict=True)
        )
        h = tf.tanh(x64 @ w1 + b1)
        ce = keras.losses.sparse_categorical_crossentropy(y_cls, tf.nn.softmax(h @ wc + bc))
        mse = tf.reduce_mean((h @ wr + br - y_reg.astype(np.float64)) ** 2, axis=-1)
        return tf.reduce_mean(ce) + tf.reduce_mean(mse)

    names = [v.path for v in model.trainable_variables]
    assert [n.split("/")[0] for n in names] == ["hidden", "hidden", "cls", "cls", "reg", "reg"]
    theta = tf.constant(
        np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables]), tf.float64
    )
    with tf.GradientTape() as outer:
        outer.watch(theta)
        with tf.GradientTape() as inner:
            inner.watch(theta)
            value = loss_of(theta)
        grad = inner.gradient(value, theta)
    hessian = outer.jacobian(grad, theta).numpy()
    return {"dir": tmp, "top": float(np.linalg.eigvalsh(hessian)[-1])}


def _analyze_two(two_outputs, out: Path, data: str, *extra: str) -> int:
    directory = two_outputs["dir"]
    return _status(
        [
            "analyze",
            str(directory / "two.keras"),
            "--data",
            str(directory / data),
            "--out",
            str(out),
            "--top-k",
            "1",
            "--float64",
            "--no-progress",
            "--quiet",
            *extra,
        ]
    )


@pytest.mark.parametrize("data", ["named.npz", "ordered.npz"])
def test_two_output_labels(two_outputs, data, tmp_path, capsys):
    status = _analyze_two(two_outputs, tmp_path / "out", data)
    assert status == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["eigenvalues"]["eigenvalues"][0] == pytest.approx(two_outputs["top"], rel=1e-7)
    shapes = results["data"]["y_shape"]
    assert shapes == ({"cls": [30], "reg": [30, 1]} if data == "named.npz" else [[30], [30, 1]])
    # Outputs in a list: positions follow the list; results.json says which array went where.
    labels = {"cls": "y_cls", "reg": "y_reg"} if data == "named.npz" else {"cls": "y0", "reg": "y1"}
    assert results["data"]["labels"] == labels


@pytest.mark.parametrize(
    "data, message",
    [
        ("missing.npz", "do not match the model's outputs (cls, reg): no labels for reg."),
        ("extra.npz", "do not match the model's outputs (cls, reg): labels y_aux match no output"),
        ("single.npz", "the model has 2 outputs (cls, reg) but the data has one label array y"),
    ],
)
def test_two_output_labels_that_do_not_match(two_outputs, data, message, tmp_path, capsys):
    status = _analyze_two(two_outputs, tmp_path / "out", data)
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("spectra: error: ") and err.count("\n") == 1, err
    assert message in err and "y_cls, y_reg" in err, err


def test_one_loss_for_two_outputs_checks_each(two_outputs, tmp_path, capsys):
    status = _analyze_two(two_outputs, tmp_path / "out", "named.npz", "--loss", "mse")
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "labels of the model's output 'cls': the loss mse needs y_cls shaped like" in err
