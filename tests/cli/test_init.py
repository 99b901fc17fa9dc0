"""Tests of spectra.cli (``main``): ``spectra --help`` and ``--version``, one-line errors with
exit status 2 before any computation, ``--debug``, and TensorFlow imported only when needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _cli_helpers import DATA, DIGITS, LOSS, MLP, ROOT

from spectra.cli import main


def _spectra_process(args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "MPLBACKEND": "Agg"}
    return subprocess.Popen(
        [sys.executable, "-m", "spectra", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_python_m_spectra_help():
    process = _spectra_process(["--help"])
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    for command in ("analyze", "sharpness", "landscape"):
        assert command in stdout


@pytest.mark.parametrize("command", ["analyze", "sharpness", "landscape"])
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: spectra {command}" in text
    for option in ("--data", "--loss", "--out", "--max-examples", "--float64", "--seed"):
        assert option in text


def test_version(capsys):
    import spectra

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"spectra {spectra.__version__}"


def _npz(path: Path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize(
    "case",
    ["missing model", "missing data", "unknown loss", "shape mismatch", "bad labels", "no ckpt"],
)
def test_user_errors_exit_2_with_one_line(case, tmp_path, capsys):
    rng = np.random.default_rng(0)
    model, data, loss, command = MLP, DIGITS, LOSS, "analyze"
    if case == "missing model":
        model = str(tmp_path / "nothing.keras")
        expected = "No model file"
    elif case == "missing data":
        data = str(tmp_path / "nothing.npz")
        expected = "No data file"
    elif case == "unknown loss":
        loss = "not_a_loss"
        expected = "unknown Keras loss"
    elif case == "shape mismatch":
        data = _npz(tmp_path / "wide.npz", x=rng.random((20, 10)), y=np.zeros(20, np.int64))
        expected = "do not fit the model's input"
    elif case == "bad labels":
        x = rng.random((20, 64)).astype(np.float32)
        data = _npz(tmp_path / "labels.npz", x=x, y=np.full(20, 12))
        expected = "needs class indices in [0, 10) for a model with 10 outputs, but y[0] = 12"
    else:
        command, model = "sharpness", str(tmp_path)
        expected = "No checkpoints match"
    status = main([command, model, "--data", data, "--loss", loss, "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.startswith("spectra: error: ")
    assert captured.err.count("\n") == 1, captured.err
    assert expected in captured.err
    assert not (tmp_path / "out" / "results.json").exists()


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.startswith("spectra: error: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.mark.parametrize(
    "case",
    [
        "empty npz",
        "scalar npz",
        "top-k above the parameters",
        "hutch++ with 2 products",
        "out is a file",
        "missing option",
        "bad format",
        "surface of one point",
    ],
)
def test_more_errors_are_one_line_before_any_computation(case, tmp_path, capsys):
    out = tmp_path / "out"
    data, extra, command = DIGITS, [], "analyze"
    if case == "empty npz":
        data = _npz(tmp_path / "empty.npz", x=np.zeros((0, 64)), y=np.zeros(0, np.int64))
        expected = "holds no examples"
    elif case == "scalar npz":
        data = _npz(tmp_path / "scalar.npz", x=np.float32(1.0), y=np.int64(0))
        expected = "'x' in"
    elif case == "top-k above the parameters":
        tiny = tmp_path / "tiny.keras"
        keras = pytest.importorskip("keras")
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1, use_bias=False)])
        model.save(tiny)
        data = _npz(tmp_path / "d.npz", x=np.ones((4, 64), np.float32), y=np.ones((4, 1)))
        extra = ["--top-k", "65"]
        expected = "--top-k 65 is more than the 64 trainable parameters"
    elif case == "hutch++ with 2 products":
        extra = ["--trace", "--trace-method", "hutch++", "--trace-products", "2"]
        expected = "trace_products 2 does not suit trace method 'hutch++'"
    elif case == "out is a file":
        out.write_text("a file")
        expected = "is a file, not a directory"
    elif case == "missing option":
        expected = "the following arguments are required: --data"
    elif case == "bad format":
        extra = ["--format", "png,docx"]
        expected = "unknown figure format"
    else:
        command, extra = "landscape", ["--directions", "2", "--points", "1"]
        expected = "needs --points 3 or more"
    model = str(tmp_path / "tiny.keras") if case == "top-k above the parameters" else MLP
    loss = ["--loss", "mse" if "top-k" in case else LOSS]
    data_option = [] if case == "missing option" else ["--data", data]
    args = [command, model, *data_option, *loss, "--out", str(out), "--no-progress", *extra]
    if case in ("missing option", "bad format"):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        status = exit_info.value.code
    else:
        status = main(args)
    assert status == 2
    assert expected in _one_line_error(capsys)
    assert not (out / "results.json").exists() if out.is_dir() else True


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(Exception, match="No data file"):
        main(
            [
                "analyze",
                MLP,
                "--data",
                str(tmp_path / "x.npz"),
                "--loss",
                LOSS,
                "--out",
                str(tmp_path / "out"),
                "--debug",
            ]
        )


def test_help_and_numpy_estimators_do_not_import_tensorflow():
    code = (
        "import sys, numpy as np, spectra, spectra.cli\n"
        "from spectra.cli._parser import build_parser\n"
        "build_parser().format_help()\n"
        "spectra.eigenvalues(np.diag([3.0, 2.0, 1.0]), k=1)\n"
        "assert isinstance(spectra.plotting.plot_sharpness, object)\n"
        "assert callable(spectra.trace) and callable(spectra.eigenvalues)\n"
        "import spectra.estimators.stochastic_trace, spectra.estimators.eigensolvers\n"
        "assert callable(spectra.trace) and callable(spectra.eigenvalues)\n"
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


COMMON = ["--data", DIGITS, "--loss", LOSS, "--max-examples", "50", "--no-progress"]


# --------------------------------------------------------------------------- a real process


def test_one_line_error_from_a_process(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "MPLBACKEND": "Agg"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = ["landscape", MLP, *COMMON, "--radius", "0", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "spectra", *command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("spectra: error: argument --radius: must be a positive number")
    assert done.stderr.count("\n") == 1
    assert not out.exists()


# Every error in what a user gives the command line is one line ``spectra: error: ...``
# with exit status 2, found before anything is measured and before any result is written.
#
# In-process through ``spectra.cli.main`` (fast), plus one run of ``python -m spectra``.


def _status(args: list[str]) -> int:
    """``main(args)``'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(args)
    except SystemExit as exit_info:
        return int(exit_info.code)


def _one_line_error_status(capsys, status: int) -> str:
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.err.startswith("spectra: error: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    return captured.err


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Two checkpoints of the committed gradient-descent run, without trajectory.json."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("step_0000.keras", "step_0020.keras"):
        shutil.copyfile(DATA / "gd_trajectory" / name, run / name)
    return run


def _nothing_written(out: Path) -> bool:
    return not out.exists() or not any(
        p.name.startswith(("sharpness", "landscape", "results")) for p in out.iterdir()
    )


# --------------------------------------------------------------------------- trajectory.json


@pytest.mark.parametrize(
    "content, expected",
    [
        ("{not json", "as JSON"),
        ('{"learning_rate": -0.2}', "has learning_rate -0.2, not a positive number"),
        ('{"learning_rate": "0.2"}', "has learning_rate '0.2', not a positive number"),
        ('{"learning_rate": 0}', "has learning_rate 0, not a positive number"),
    ],
    ids=["not json", "negative rate", "string rate", "zero rate"],
)
def test_a_bad_trajectory_json_is_one_line(content, expected, run_dir, tmp_path, capsys):
    (run_dir / "trajectory.json").write_text(content)
    out = tmp_path / "out"
    status = _status(["sharpness", str(run_dir), *COMMON, "--out", str(out)])
    error = _one_line_error_status(capsys, status)
    assert expected in error and "trajectory.json" in error and "--lr" in error
    assert _nothing_written(out)


# --------------------------------------------------------------------------- sharpness.json


@pytest.mark.parametrize(
    "content, expected",
    [
        ("{corrupt", "is not a sharpness record of spectra (not JSON: "),
        ("[1, 2, 3]", "is not a sharpness record of spectra (TypeError"),
        ('{"format": "other", "settings": {}, "plan": [], "checkpoints": []}', "in the format"),
        ('{"settings": {}}', "is not a sharpness record of spectra (KeyError"),
    ],
    ids=["truncated", "a list", "another format", "missing keys"],
)
def test_a_corrupt_sharpness_json_is_refused_in_one_line(
    content, expected, run_dir, tmp_path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sharpness.json").write_text(content)
    status = _status(["sharpness", str(run_dir), *COMMON, "--lr", "0.2", "--out", str(out)])
    error = _one_line_error_status(capsys, status)
    assert expected in error and "--restart" in error
    # The stored file is left as it was for the user to look at.
    assert (out / "sharpness.json").read_text() == content


# --------------------------------------------------------------------------- steps and files


@pytest.mark.parametrize(
    "case, expected",
    [
        ("more steps than files", "Got 3 steps for 2 checkpoint files"),
        ("fewer steps than files", "Got 1 steps for 2 checkpoint files"),
        ("a repeated step", "Several checkpoints share a step: {5:"),
        ("names without steps", "No step number in the file name(s)"),
        ("two copies of one step", "Several checkpoints share a step: {0:"),
        ("no checkpoints", "No checkpoints match"),
        ("a step that is not a number", "argument --steps: invalid int value"),
    ],
)
def test_step_and_file_conflicts_are_one_line(case, expected, run_dir, tmp_path, capsys):
    steps: list[str] = []
    spec = str(run_dir)
    if case == "more steps than files":
        steps = ["--steps", "0", "10", "20"]
    elif case == "fewer steps than files":
        steps = ["--steps", "0"]
    elif case == "a repeated step":
        steps = ["--steps", "5", "5"]
    elif case == "names without steps":
        for name, new in (("step_0000.keras", "first.keras"), ("step_0020.keras", "last.keras")):
            (run_dir / name).rename(run_dir / new)
    elif case == "two copies of one step":
        shutil.copyfile(run_dir / "step_0000.keras", run_dir / "copy_0.keras")
    elif case == "no checkpoints":
        spec = str(run_dir / "*.weights.h5")
    else:
        steps = ["--steps", "0", "twenty"]
    out = tmp_path / "out"
    status = _status(["sharpness", spec, *COMMON, "--lr", "0.2", *steps, "--out", str(out)])
    assert expected in _one_line_error_status(capsys, status)
    assert _nothing_written(out)


# --------------------------------------------------------------------------- the cases


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict[str, Path]:
    """A 6-4-3 classifier as .keras, .weights.h5 and compiled with Lion (saved before and
    after one step), a Lambda-layer model, their data, and builders."""
    import keras

    directory = tmp_path_factory.mktemp("small")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=32)
    np.savez(directory / "data.npz", x=x, y=y)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)]
    )
    model.save(directory / "model.keras")
    model.save_weights(directory / "model.weights.h5")
    model.compile(optimizer=keras.optimizers.Lion(1e-3), loss=LOSS)
    lion = directory / "lion"
    lion.mkdir()
    model.save(lion / "step_0.keras")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.save(lion / "step_1.keras")
    lambda_model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Lambda(lambda t: 2.0 * t), keras.layers.Dense(3)]
    )
    lambda_model.save(directory / "lambda.keras")
    (directory / "builders.py").write_text(
        "import keras\n\n"
        "def broken():\n"
        "    raise RuntimeError('no GPU here')\n\n"
        "def doubled():\n"
        "    return keras.Sequential([keras.Input((6,)), keras.layers.Lambda(lambda t: 2.0 * t),"
        " keras.layers.Dense(3)])\n"
    )
    return {
        "dir": directory,
        "data": directory / "data.npz",
        "keras": directory / "model.keras",
        "weights": directory / "model.weights.h5",
        "lion": lion,
        "lambda": directory / "lambda.keras",
        "builders": directory / "builders.py",
    }


def _small_analyze(model: Path | str, data: Path | str, out: Path, *extra: str) -> list[str]:
    return [
        "analyze",
        str(model),
        "--data",
        str(data),
        "--loss",
        LOSS,
        "--top-k",
        "1",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]


def test_string_labels_are_named_with_what_to_do(small, tmp_path, capsys):
    with np.load(small["data"]) as arrays:
        x, y = arrays["x"], arrays["y"]
    data = tmp_path / "strings.npz"
    labels = np.array(["cat", "dog", "owl"])[y]
    np.savez(data, x=x, y=labels)
    out = tmp_path / "out"
    error = _one_line_error_status(capsys, _status(_small_analyze(small["keras"], data, out)))
    assert "--data: y in" in error and f"holds strings (e.g. '{labels[0]}')" in error, error
    assert "np.unique(y, return_inverse=True)" in error and "unexpected" not in error
    assert _nothing_written(out)


def test_nan_inputs_are_named_with_the_first_example(small, tmp_path, capsys):
    with np.load(small["data"]) as arrays:
        x, y = arrays["x"].copy(), arrays["y"]
    x[5, 2] = np.nan
    x[9, 0] = np.inf
    data = tmp_path / "nan.npz"
    np.savez(data, x=x, y=y)
    out = tmp_path / "out"
    error = _one_line_error_status(capsys, _status(_small_analyze(small["keras"], data, out)))
    assert "--data: x in" in error and "holds NaN or infinite values (2 in 2 of 32" in error
    assert "the first at index 5" in error and "unexpected" not in error
    assert _nothing_written(out)


def test_a_text_file_named_npz_is_not_advised_to_be_unpickled(small, tmp_path, capsys):
    data = tmp_path / "table.npz"
    data.write_text("x,y\n0.5,1\n")
    out = tmp_path / "out"
    error = _one_line_error_status(capsys, _status(_small_analyze(small["keras"], data, out)))
    assert "is not the zip archive np.savez writes (it begins with b'x,y\\n0.5,1\\n'" in error
    assert "pickle" not in error and "np.savez(path, x=x, y=y)" in error


def test_a_negative_seed_is_refused_before_anything_is_loaded(tmp_path, capsys, monkeypatch):
    """``--seed -1`` is refused by the parser: no data or model is loaded."""
    import spectra.cli.analyze as analyze

    def never(*args, **kwargs):
        raise AssertionError("loaded before the arguments were checked")

    monkeypatch.setattr(analyze, "load_data", never)
    monkeypatch.setattr(analyze, "load_operator", never)
    out = tmp_path / "out"
    args = ["analyze", MLP, *COMMON, "--seed", "-1", "--out", str(out)]
    error = _one_line_error_status(capsys, _status(args))
    assert "argument --seed: must be a non-negative integer below 2**62, got -1" in error
    assert not out.exists()


def test_preconditioned_lion_is_refused_before_a_checkpoint_is_blamed(small, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["sharpness", str(small["lion"]), "--data", str(small["data"]), "--preconditioned"]
    error = _one_line_error_status(capsys, _status([*args, "--out", str(out)]))
    assert error.startswith(
        "spectra: error: --preconditioned does not support the optimizer recorded in "
        "step_0.keras, Lion"
    )
    assert "supported: Adam, AdamW, RMSprop, Adagrad" in error
    assert "--skip-bad" not in error and "no optimizer state" not in error
    assert _nothing_written(out)


def test_a_builder_that_raises_is_named_with_its_error(small, tmp_path, capsys):
    builder = f"{small['builders']}:broken"
    out = tmp_path / "out"
    args = _small_analyze(small["weights"], small["data"], out, "--builder", builder)
    error = _one_line_error_status(capsys, _status(args))
    assert f"The builder '{builder}' raised RuntimeError: no GPU here" in error
    assert "unexpected" not in error
    assert _nothing_written(out)


@pytest.mark.parametrize("command", ["analyze", "landscape", "sharpness"])
def test_a_builder_with_a_keras_file_is_refused(command, small, tmp_path, capsys):
    out = tmp_path / "out"
    target = small["lion"] if command == "sharpness" else small["keras"]
    args = [command, str(target), "--data", str(small["data"]), "--loss", LOSS]
    error = _one_line_error_status(
        capsys, _status([*args, "--builder", "any:thing", "--out", str(out)])
    )
    assert "--builder applies to weights files (.weights.h5) and tf.train.Checkpoints" in error
    expected = "step_0.keras, step_1.keras hold" if command == "sharpness" else "model.keras holds"
    assert f"{expected} the whole model" in error
    assert _nothing_written(out)


def test_a_lambda_layer_gets_advice_the_cli_can_follow(small, tmp_path, capsys):
    """The advice (a builder and the archive's model.weights.h5) works; safe_mode, which the
    command line does not have, is not advised."""
    import zipfile

    out = tmp_path / "out"
    error = _one_line_error_status(
        capsys, _status(_small_analyze(small["lambda"], small["data"], out))
    )
    assert "Keras refuses to load" in error and "`Lambda` layer" in error
    assert "unzip 'lambda.keras' model.weights.h5" in error and "--builder" in error
    assert "safe_mode" not in error and "enable_unsafe_deserialization" not in error
    with zipfile.ZipFile(small["lambda"]) as archive:
        archive.extract("model.weights.h5", tmp_path)
    builder = f"{small['builders']}:doubled"
    args = _small_analyze(tmp_path / "model.weights.h5", small["data"], out, "--builder", builder)
    assert _status([*args, "--quiet"]) == 0
