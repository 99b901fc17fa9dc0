"""A quiet library: ``import spectra`` and the first use of an operator print no TensorFlow
C++ log lines, with nothing called by the user, whatever ``TF_CPP_MIN_LOG_LEVEL`` says (a
user's higher level stays, a lower one is raised to 3); ``quiet_tensorflow(verbose=True)``
gives the user's own level back and shows every line it allows; what a failing import wrote
is not lost. Each case runs in a fresh interpreter (TensorFlow's start-up lines are printed
once per process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spectra._console import native_stderr_captured

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, *, level: str | None = None, path: Path | None = None):
    """``python -c code`` from the checkout, with ``TF_CPP_MIN_LOG_LEVEL`` unset (the test
    session sets it) or set to ``level``, and ``path`` first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_operator_and_a_product_print_only_the_result():
    # Importing spectra and TensorFlow (through keras), building an operator and a product:
    # nothing on stderr, only what the script prints.
    done = _run(
        """
        import numpy as np
        import spectra  # first: keras imports TensorFlow, and an import before spectra's is loud
        import keras

        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        x = np.random.default_rng(0).random((8, 3)).astype("float32")
        y = np.arange(8) % 2
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        op = spectra.HessianOperator.from_keras(model, loss, (x, y))
        print(op.shape, np.isfinite(op.matvec(np.ones(op.shape[0]))).all())
        """
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("(8, 8) True\n", "")


_STATE = """
    import os, sys
    import spectra
    from spectra import _console
    print(os.environ.get("TF_CPP_MIN_LOG_LEVEL"), _console._State.hook in sys.meta_path)
    """


def test_start_up_is_quiet_when_the_user_set_a_log_level():
    # The review's case: TF_CPP_MIN_LOG_LEVEL=3 set by the user let TensorFlow's start-up
    # lines (written while its libraries load, before the level is read) through. A lower
    # level is raised to 3 (next test), so this holds for every level.
    done = _run("import spectra; spectra.HessianOperator", level="3")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


@pytest.mark.parametrize(
    ("level", "seen"), [("0", "3"), ("2", "3"), ("3", "3"), ("5", "5"), ("verbose", "3")]
)
def test_a_lower_level_is_raised_and_a_higher_one_kept(level, seen):
    done = _run(_STATE, level=level)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{seen} True\n", "")


def test_verbose_gives_the_users_own_level_back():
    # What quiet_tensorflow(verbose=True) runs before importing TensorFlow (not imported here).
    code = textwrap.dedent(_STATE) + (
        "_console._show_tensorflow_logs()\n"
        "print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'), _console._State.hook in sys.meta_path)\n"
    )
    done = _run(code, level="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "3 True\n1 False\n"


def test_verbose_undoes_the_default_before_importing_tensorflow(fake_tensorflow):
    # Unset: spectra sets 3 and hooks the import; verbose removes both before importing, so
    # TensorFlow's start-up line (here a stand-in package's, written to descriptor 2 as the
    # C++ code writes it) is shown.
    code = textwrap.dedent(_STATE) + (
        "spectra.quiet_tensorflow(verbose=True)\n"
        "print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'), _console._State.hook in sys.meta_path)\n"
    )
    done = _run(code, path=fake_tensorflow)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "3 True\nNone False\n"
    assert done.stderr == "I0000 native start-up line\n"


@pytest.fixture
def fake_tensorflow(tmp_path):
    """A ``tensorflow`` package that writes to descriptor 2 as TensorFlow's C++ code does, and
    fails to import when ``FAIL`` is set."""
    package = tmp_path / "tensorflow"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import os\n"
        "os.write(2, b'I0000 native start-up line\\n')\n"
        "if os.environ.get('FAIL'):\n"
        "    raise ImportError('no libtensorflow here')\n"
    )
    return tmp_path


def test_the_hook_captures_the_import_and_gives_back_what_a_failure_wrote(fake_tensorflow):
    # A look-up first (as libraries do to test for TensorFlow) does not use the hook up.
    done = _run(
        "import importlib.util, spectra; importlib.util.find_spec('tensorflow'); "
        "import tensorflow; print(tensorflow.__name__)",
        path=fake_tensorflow,
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("tensorflow\n", "")
    failing = _run(
        "import os; os.environ['FAIL'] = '1'; import spectra, tensorflow", path=fake_tensorflow
    )
    assert failing.returncode == 1
    assert "I0000 native start-up line" in failing.stderr
    assert "ImportError: no libtensorflow here" in failing.stderr
    # Imported before spectra: the line is TensorFlow's own and nothing hides it.
    first = _run("import tensorflow, spectra", path=fake_tensorflow)
    assert first.stderr == "I0000 native start-up line\n"


def test_native_stderr_is_dropped_or_given_back_on_failure(capfd):
    with native_stderr_captured():
        os.write(2, b"dropped\n")
    assert capfd.readouterr().err == ""
    with pytest.raises(RuntimeError, match="boom"), native_stderr_captured():
        os.write(2, b"kept\n")
        raise RuntimeError("boom")
    assert capfd.readouterr().err == "kept\n"
