"""Tests of spectra.cli (``main``): ``spectra --help`` and ``--version``, one-line errors with
exit status 2 before any computation, ``--debug``, and TensorFlow imported only when needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spectra.cli import main

ROOT = Path(__file__).resolve().parents[2]


DATA = ROOT / "data"


MLP = str(DATA / "digits_mlp.keras")


DIGITS = str(DATA / "digits.npz")


LOSS = "sparse_categorical_crossentropy"


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
