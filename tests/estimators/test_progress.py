"""When the estimators' progress bars show: ``progress=None`` (the default) on a terminal
once a run has lasted ``_PROGRESS_DELAY_S`` seconds, never when stderr is not a terminal;
``progress=True`` always and at once; ``progress=False`` never. The CLI's ``Console.bar``
follows the same rule, off with ``--quiet`` or ``--no-progress``."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import pytest
from _matrices import random_symmetric
from scipy.sparse.linalg import LinearOperator

from spectra.cli._common import Console
from spectra.estimators import _products
from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.stochastic_diagonal import diagonal


class _Slow(LinearOperator):
    """A symmetric matrix whose products take 50 ms each."""

    def __init__(self, matrix: np.ndarray) -> None:
        self.matrix = matrix
        super().__init__(dtype=np.float64, shape=matrix.shape)

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        time.sleep(0.05)
        return self.matrix @ x


def _stderr_is_a_terminal(monkeypatch, answer: bool) -> None:
    """The stderr of the test (pytest's capture) says whether it is a terminal. Called in the
    test itself: pytest swaps in its capture stream after the fixtures are set up."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: answer)


@pytest.fixture
def short_delay(monkeypatch):
    """A 0.2 s delay instead of 2 s, so that a 0.5 s run counts as long."""
    monkeypatch.setattr(_products, "_PROGRESS_DELAY_S", 0.2)


def _long_run(progress=None):
    # 10 products of 50 ms: 0.5 s, beyond the short delay.
    return diagonal(
        _Slow(random_symmetric(12, seed=3)), num_products=10, block_size=1, progress=progress
    )


def test_default_shows_a_bar_on_a_terminal_for_a_long_run(monkeypatch, short_delay, capsys):
    _stderr_is_a_terminal(monkeypatch, True)
    _long_run()
    err = capsys.readouterr().err
    assert "diagonal: " in err and "/10" in err and "data passes" in err


def test_default_shows_no_bar_for_a_quick_run_on_a_terminal(monkeypatch, capsys):
    _stderr_is_a_terminal(monkeypatch, True)
    # The real 2 s delay: a run of milliseconds (eigenvalues also re-plans its total and
    # redraws at the end) prints nothing.
    result = eigenvalues(random_symmetric(60, seed=4), k=2)
    assert result.num_products > 10
    assert capsys.readouterr().err == ""


def test_default_shows_no_bar_when_stderr_is_not_a_terminal(monkeypatch, short_delay, capsys):
    _stderr_is_a_terminal(monkeypatch, False)
    _long_run()
    assert capsys.readouterr().err == ""


def test_false_shows_no_bar_even_on_a_terminal(monkeypatch, short_delay, capsys):
    _stderr_is_a_terminal(monkeypatch, True)
    _long_run(progress=False)
    assert capsys.readouterr().err == ""


def test_true_shows_a_bar_at_once_without_a_terminal(monkeypatch, capsys):
    _stderr_is_a_terminal(monkeypatch, False)
    diagonal(random_symmetric(12, seed=3), num_products=4)  # quick: no bar
    assert capsys.readouterr().err == ""
    diagonal(random_symmetric(12, seed=3), num_products=4, progress=True)
    assert "diagonal: " in capsys.readouterr().err


def test_progress_must_be_none_or_a_bool():
    with pytest.raises(TypeError, match=r"progress must be None, True or False, got 1"):
        diagonal(np.eye(3), num_products=4, progress=1)


def _console(**options) -> Console:
    return Console(
        argparse.Namespace(**{"quiet": False, "verbose": False, "no_progress": False, **options})
    )


def test_the_cli_bar_follows_the_same_rule(monkeypatch, short_delay, capsys):
    _stderr_is_a_terminal(monkeypatch, True)
    bar = _console().bar(3, "checkpoints", "checkpoint")
    assert not bar.disable and bar.delay == pytest.approx(0.2)
    for _ in range(3):
        time.sleep(0.1)
        bar.update(1)
    bar.close()
    assert "checkpoints: " in capsys.readouterr().err
    for options in ({"quiet": True}, {"no_progress": True}):
        assert _console(**options).bar(3, "checkpoints", "checkpoint").disable


def test_the_cli_bar_is_off_without_a_terminal(monkeypatch):
    _stderr_is_a_terminal(monkeypatch, False)
    assert _console().bar(3, "checkpoints", "checkpoint").disable


class _WithGradient(LinearOperator):
    """A symmetric matrix with a gradient, as gradient_overlap needs."""

    def __init__(self, matrix: np.ndarray) -> None:
        self.matrix = matrix
        super().__init__(dtype=np.float64, shape=matrix.shape)

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self.matrix @ x

    def gradient(self) -> np.ndarray:
        return np.arange(1.0, self.shape[0] + 1.0)


def _every_estimator_taking_progress():
    """The estimators the guide lists as taking ``progress=``, each on a 12 × 12 matrix,
    called with the given ``progress``."""
    from spectra import gradient_overlap, inverse, lanczos, layerwise

    matrix = random_symmetric(12, seed=3) + 4 * np.eye(12)
    groups = {"a": range(0, 6), "b": range(6, 12)}
    return {
        "layerwise": lambda p: layerwise(matrix, groups=groups, progress=p),
        "inverse (cg)": lambda p: inverse(matrix, 0.1, progress=p) @ np.ones(12),
        "eigenvalues (lanczos)": lambda p: gradient_overlap(_WithGradient(matrix), 2, progress=p),
        "lanczos": lambda p: lanczos(matrix, 6, progress=p),
    }


@pytest.mark.parametrize("label", list(_every_estimator_taking_progress()))
def test_layerwise_inverse_gradient_overlap_and_lanczos_take_progress(monkeypatch, capsys, label):
    """Before: layerwise, inverse and gradient_overlap refused ``progress=`` (TypeError:
    unexpected keyword), although every estimator takes it."""
    run = _every_estimator_taking_progress()[label]
    _stderr_is_a_terminal(monkeypatch, False)
    run(True)
    assert f"{label}: " in capsys.readouterr().err
    run(False)
    _stderr_is_a_terminal(monkeypatch, True)
    run(False)
    assert capsys.readouterr().err == ""
    with pytest.raises(TypeError, match=r"progress must be None, True or False, got 1"):
        run(1)
