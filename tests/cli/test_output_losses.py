"""One loss per output and loss weights on the command line, against the Python API.

A functional model with two outputs (``out1``: a regression, ``out2``: 3 classes) saved
without compile: ``--loss out1=mse --loss out2=sparse_categorical_crossentropy
--loss-weight out1=1.0 --loss-weight out2=0.5`` must give the matrix of
mean MSE(out1) + 0.5 · mean CE(out2), which the API computes from the model compiled with
that loss and those weights (``loss=None``), in ``analyze``, ``sharpness`` and
``landscape``; output names the model lacks, or a loss missing for an output, are refused in
one line naming the model's outputs.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import spectra
from spectra import HessianOperator, eigenvalues
from spectra.cli import main
from spectra.cli._parser import build_parser

LOSSES = {"out1": "mse", "out2": "sparse_categorical_crossentropy"}
WEIGHTS = {"out1": 1.0, "out2": 0.5}
OPTIONS = [
    "--loss",
    "out1=mse",
    "--loss",
    "out2=sparse_categorical_crossentropy",
    "--loss-weight",
    "out1=1.0",
    "--loss-weight",
    "out2=0.5",
]


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh", name="hidden")(inputs)
    out1 = keras.layers.Dense(2, name="out1")(hidden)
    out2 = keras.layers.Dense(3, activation="softmax", name="out2")(hidden)
    return keras.Model(inputs, {"out1": out1, "out2": out2})


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    """The model saved uncompiled (and a second checkpoint), its data by output name, and
    the API's top 2 eigenvalues and loss with and without the weights."""
    tmp = tmp_path_factory.mktemp("two_outputs")
    model = _model(5)
    (tmp / "run").mkdir()
    model.save(tmp / "run" / "step_1.keras")
    _model(6).save(tmp / "run" / "step_2.keras")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = {
        "out1": rng.normal(size=(32, 2)).astype(np.float32),
        "out2": rng.integers(0, 3, size=32).astype(np.int64),
    }
    np.savez(tmp / "data.npz", x=x, y_out1=y["out1"], y_out2=y["out2"])

    api = {}
    for name, weights in (("weighted", WEIGHTS), ("unweighted", None)):
        copy = keras.saving.load_model(tmp / "run" / "step_1.keras", compile=False)
        copy.compile(loss=dict(LOSSES), loss_weights=weights)
        op = HessianOperator.from_keras(copy, None, (x, y), dtype=np.float64)
        top = eigenvalues(op, k=2, tol=1e-10, seed=0).eigenvalues
        api[name] = {"top": top, "loss": op.loss()}
    return {"dir": tmp, "x": x, "y": y, "api": api}


def _main(args: list[str]) -> int:
    try:
        return main([*args, "--no-progress", "--quiet"])
    except SystemExit as exit_info:
        return int(exit_info.code)


def test_the_parser_gathers_losses_and_weights_by_output():
    parser = build_parser()
    words = ["analyze", "m.keras", "--data", "d.npz", "--out", "o"]
    args = parser.parse_args([*words, *OPTIONS])
    assert args.loss == LOSSES and args.loss_weights == WEIGHTS
    assert parser.parse_args([*words, "--loss", "mse"]).loss == "mse"
    assert parser.parse_args([*words, "--loss", "a=mse", "--loss", "b=none"]).loss == {
        "a": "mse",
        "b": None,
    }


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--loss", "mse", "--loss", "out2=mse"], "give one loss for all outputs or one per"),
        (["--loss", "out1=mse", "--loss", "out1=mae"], "output 'out1' given twice"),
        (["--loss-weight", "0.5"], "give OUTPUT=VALUE"),
        (["--loss-weight", "out2=heavy"], "out2=heavy: must be a number"),
        (["--loss-weight", "out2=-1"], "must be a finite number >= 0"),
    ],
)
def test_malformed_options_are_one_line(extra, message, capsys):
    status = _main(["analyze", "m.keras", "--data", "d.npz", "--out", "o", *extra])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert message in err, err


def test_analyze_equals_the_api_with_per_output_losses_and_weights(two_outputs, tmp_path):
    directory = two_outputs["dir"]
    args = ["analyze", str(directory / "run" / "step_1.keras"), "--data"]
    args += [str(directory / "data.npz"), "--top-k", "2", "--tol", "1e-10", "--float64"]
    assert _main([*args, *OPTIONS, "--out", str(tmp_path / "weighted")]) == 0
    results = json.loads((tmp_path / "weighted" / "results.json").read_text())
    api = two_outputs["api"]
    np.testing.assert_allclose(
        results["eigenvalues"]["eigenvalues"], api["weighted"]["top"], rtol=1e-8
    )
    assert results["loss"] == pytest.approx(api["weighted"]["loss"], rel=1e-10)
    assert results["settings"]["loss"] == LOSSES
    assert results["settings"]["loss_weights"] == WEIGHTS
    # The weights matter: without them the API's matrix is another one.
    assert abs(api["unweighted"]["top"][0] - api["weighted"]["top"][0]) > 1e-3
    # Per-output losses without weights are the API's dict loss.
    assert _main([*args, *OPTIONS[:4], "--out", str(tmp_path / "plain")]) == 0
    plain = json.loads((tmp_path / "plain" / "results.json").read_text())
    np.testing.assert_allclose(
        plain["eigenvalues"]["eigenvalues"], api["unweighted"]["top"], rtol=1e-8
    )
    assert plain["settings"]["loss_weights"] is None
    # The figures' settings and captions are recorded too.
    figures = results["figures"]
    assert figures["settings"]["font"]["name"] == "sans"
    caption = figures["captions"]["eigenvalues"]["caption"]
    assert "mse (out1) + 0.5·sparse_categorical_crossentropy (out2)" in caption


def test_sharpness_and_landscape_take_them_too(two_outputs, tmp_path):
    directory = two_outputs["dir"]
    data = ["--data", str(directory / "data.npz"), "--float64", *OPTIONS]
    out = tmp_path / "sharpness"
    run = ["sharpness", str(directory / "run"), *data, "--tol", "1e-10", "--lr", "0.1"]
    assert _main([*run, "--out", str(out)]) == 0
    record = json.loads((out / "sharpness.json").read_text())
    first = record["checkpoints"][0]
    assert first["file"] == "step_1.keras"
    assert first["eigenvalues"][0] == pytest.approx(two_outputs["api"]["weighted"]["top"][0])
    assert record["settings"]["loss_weights"] == WEIGHTS
    # The compact figure: the caption is recorded, not drawn.
    figures = record["figures"]
    assert figures["settings"]["caption"] == "none"
    assert "0.5·sparse_categorical_crossentropy" in figures["captions"]["sharpness"]["caption"]
    assert (out / "sharpness.png").is_file()
    assert isinstance(spectra.load(out / "sharpness.json").figures, dict)

    out = tmp_path / "landscape"
    model = str(directory / "run" / "step_1.keras")
    assert _main(["landscape", model, *data, "--points", "3", "--out", str(out)]) == 0
    report = spectra.load(out / "landscape.json")
    assert report.curves.base_loss == pytest.approx(two_outputs["api"]["weighted"]["loss"])
    assert report.settings["loss"] == LOSSES and report.settings["loss_weights"] == WEIGHTS


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--loss", "out3=mse", "--loss", "out2=mse"],
            "--loss out3=...: {model} has no output 'out3'; its outputs are out1, out2.",
        ),
        (
            ["--loss", "out1=mse"],
            "--loss names a loss for out1 but not for out2 of the outputs of {model} "
            "(out1, out2): give --loss out2=NAME (or out2=none to leave it out of the loss).",
        ),
        (
            [*OPTIONS[:4], "--loss-weight", "second=2"],
            "--loss-weight second=...: {model} has no output 'second'; its outputs are out1, out2.",
        ),
    ],
)
def test_unknown_or_missing_outputs_are_refused(two_outputs, options, message, tmp_path, capsys):
    directory = two_outputs["dir"]
    model = str(directory / "run" / "step_1.keras")
    args = ["analyze", model, "--data", str(directory / "data.npz"), *options]
    status = _main([*args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert message.format(model=model) in err, err
    assert not (tmp_path / "out" / "results.json").exists()
