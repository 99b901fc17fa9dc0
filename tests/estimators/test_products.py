"""Tests of spectra.estimators._products: the progress bars, and operators whose products
underflow their dtype.

When the estimators' progress bars show: ``progress=None`` (the default) on a terminal
once a run has lasted ``_PROGRESS_DELAY_S`` seconds, never when stderr is not a terminal;
``progress=True`` always and at once; ``progress=False`` never. The CLI's ``Console.bar``
follows the same rule, off with ``--quiet`` or ``--no-progress``.

Operators whose products underflow their dtype: right within the bound, refused in one
line, or reported unconverged, never a certified wrong value (before: a float32 Hessian of
a loss scaled by 1e-38 gave λ₁ = 0.0 ± 0.0 "converged", truth 5.8e-39, and at 1e-36 it was
refused as "not symmetric"). Also: float32 rounding is not blamed on asymmetry.
"""

from __future__ import annotations

import argparse
import sys
import time

import keras
import numpy as np
import pytest
from _matrices import random_symmetric, single_blas_thread
from scipy.sparse.linalg import LinearOperator, aslinearoperator

from spectra.cli._common import Console
from spectra.estimators import _products
from spectra.estimators.density import spectral_density
from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.stochastic_diagonal import diagonal
from spectra.estimators.stochastic_trace import (
    trace,
)


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with single_blas_thread():
        yield


def test_progress_bars_count_the_planned_work_and_end_at_100_percent(capsys):
    a = random_symmetric(200, seed=6)
    result = eigenvalues(a, k=2, progress=True)
    err = capsys.readouterr().err
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    # the last state before the bar is cleared: all of the work done, none left
    assert "100%" in final and f"{result.num_products}/{result.num_products}" in final
    assert "data passes" in final
    for run in (
        lambda: trace(a, num_products=50, rtol=0.5, progress=True),
        lambda: spectral_density(a, num_steps=10, num_probes=3, progress=True),
        lambda: diagonal(a, num_products=20, progress=True),
    ):
        run()
        final = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
        assert "100%" in final and "data passes" in final


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


SCALES = [10.0**-e for e in range(30, 46)]


UNDERFLOW = r"products underflow float32: .* build the operator in float64, or scale the loss up"


def _answer_or_refusal(op, truth):
    """λ₁ of ``op``: within its bound of ``truth`` when converged, else not certified; a
    refusal must name underflow. Returns the outcome's kind."""
    try:
        result = eigenvalues(op, tol=1e-6, seed=1)
    except ValueError as error:
        assert __import__("re").search(UNDERFLOW, str(error)), str(error)
        return "refused"
    if result.converged[0]:
        assert abs(result.eigenvalues[0] - truth) <= result.error_bounds[0], (result, truth)
        return "right"
    assert result.settings["not_converged_reason"], result
    return "unconverged"


@pytest.fixture(scope="module")
def matrix():
    return random_symmetric(30, seed=0).astype(np.float32)


def test_a_float32_matrix_scaled_from_1e_30_to_1e_45(matrix):
    """The stored float32 matrix s·A (its entries subnormal below 1.2e-38): truth = eigh of
    that matrix in float64."""
    kinds = []
    for scale in SCALES:
        stored = (matrix.astype(np.float64) * scale).astype(np.float32)
        truth = np.linalg.eigvalsh(stored.astype(np.float64))[-1]
        kinds.append(_answer_or_refusal(aslinearoperator(stored), truth))
    # Right while the products resolve (gradual underflow of the last sums is measured by
    # the check and floors the bound), refused once they lose more than 1e-3.
    assert kinds[:9] == ["right"] * 9, kinds
    assert "refused" in kinds[9:], kinds


def test_a_float32_operator_times_a_scale(matrix):
    """scipy's ``aslinearoperator(A) * s`` multiplies in float32: the products' last step
    underflows. Truth: s·λ₁(A)."""
    top = np.linalg.eigvalsh(matrix.astype(np.float64))[-1]
    kinds = [
        _answer_or_refusal(aslinearoperator(matrix) * np.float32(scale), scale * top)
        for scale in SCALES[:-1]  # 1e-45 as float32 is 1.4e-45, not the scale
    ]
    assert kinds[0] == "right" and "refused" in kinds, kinds


class _Flushed(LinearOperator):
    """A nonzero float32 operator whose products flush to zero at unit scale (as
    TensorFlow's do on CPU) but not at larger vectors: detected by the scaled twin."""

    def __init__(self, matrix):
        self.matrix = matrix
        super().__init__(dtype=np.float32, shape=matrix.shape)

    def _matmat(self, block):
        out = (self.matrix.astype(np.float64) @ block.astype(np.float64)).astype(np.float32)
        out[np.abs(out) < np.finfo(np.float32).tiny] = 0.0  # flush to zero
        return out

    def _matvec(self, v):
        return self._matmat(v.reshape(-1, 1))[:, 0]


def test_exact_zeros_from_a_nonzero_operator_are_refused(matrix):
    flushed = _Flushed(matrix * np.float32(1e-40))
    with pytest.raises(ValueError, match=r"^eigenvalues \(lanczos\): .*exactly zero product"):
        eigenvalues(flushed)
    with pytest.raises(ValueError, match=r"^trace \(hutchinson\): .*exactly zero product"):
        trace(flushed, num_products=4)


def test_a_zero_operator_still_gives_zeros():
    # float64: the zero operator, certified (one extra product checks it at scale 2^512).
    zero = eigenvalues(np.zeros((20, 20)))
    assert zero.all_converged and zero.eigenvalues[0] == 0.0 and zero.error_bounds[0] == 0.0
    # float32: zeros, but not certified: float32 cannot tell it from a flushed operator.
    zero32 = eigenvalues(np.zeros((20, 20), dtype=np.float32))
    assert zero32.eigenvalues[0] == 0.0 and not zero32.converged[0]
    assert zero32.error_bounds[0] == np.inf
    assert "every product was exactly 0 in float32" in zero32.settings["not_converged_reason"]


def test_a_keras_hessian_of_a_scaled_loss():
    """A linear model with a mean squared error: H = (2/N)·XᵀX exactly, times the scale
    (truth by numpy). TensorFlow flushes float32 subnormals: below about 1e-36 every
    product is an exact zero, which is reported unconverged."""
    from spectra.operators import HessianOperator

    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 5)).astype(np.float32)
    y = rng.standard_normal((32, 1)).astype(np.float32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1, use_bias=False)])
    top = np.linalg.eigvalsh(2.0 * x.T.astype(np.float64) @ x / len(x))[-1]

    def operator(scale):
        def loss(batch):
            inputs, targets = batch
            return keras.ops.mean((model(inputs) - targets) ** 2) * scale

        return HessianOperator(loss, model.trainable_variables, (x, y))

    kinds = {}
    for scale in (1e-30, 1e-33, 1e-34, 1e-36, 1e-38, 1e-40, 1e-45):
        kinds[scale] = _answer_or_refusal(operator(scale), scale * top)
    assert kinds[1e-30] == "right", kinds
    assert kinds[1e-38] != "right" and kinds[1e-45] != "right", kinds
    assert "refused" in kinds.values(), kinds
    # The refusal's advice works: the loss scaled up by the 2^k it names.
    refused = next(scale for scale, kind in kinds.items() if kind == "refused")
    with pytest.raises(ValueError, match=UNDERFLOW) as info:
        eigenvalues(operator(refused))
    lift = 2.0 ** int(str(info.value).split("scale the loss up (e.g. by 2^")[1].split(")")[0])
    result = eigenvalues(operator(refused * lift), tol=1e-6, seed=1)
    assert result.all_converged
    assert abs(result.eigenvalues[0] / lift - refused * top) <= result.error_bounds[0] / lift


class _Cancelling(LinearOperator):
    """S v computed as (C + S)v − C v in float32: symmetric, but its products carry rounding
    errors of about eps·‖C v‖, far above eps·‖S v‖."""

    def __init__(self, factor, n=40):
        self.big = (random_symmetric(n, seed=1) + factor * random_symmetric(n, seed=2)).astype(
            np.float32
        )
        self.cancel = (factor * random_symmetric(n, seed=2)).astype(np.float32)
        super().__init__(dtype=np.float32, shape=(n, n))

    def _matvec(self, v):
        v = v.astype(np.float32)
        return self.big @ v - self.cancel @ v


def test_float32_rounding_is_named_as_the_likely_cause():
    # ‖C‖ = 1e5·‖S‖: |u·Av − v·Au| = 1.8e-3 against 1e-3 × 0.38 (before: "not
    # symmetric"); it is 63 times the rounding of products of that norm
    with pytest.raises(ValueError, match="fails the symmetry test.*likely rounding") as info:
        eigenvalues(_Cancelling(1e5))
    assert "check_symmetry=False" in str(info.value) and "float64" in str(info.value)
    # ‖C‖ = 1e6·‖S‖: beyond what the products' norms explain, still said possible
    with pytest.raises(ValueError, match="not symmetric.*float32 rounding exceeds eps"):
        eigenvalues(_Cancelling(1e6))
    # a truly asymmetric float64 matrix is still called not symmetric
    asymmetric = random_symmetric(40, seed=1) + 1e-3 * np.random.default_rng(0).standard_normal(
        (40, 40)
    )
    with pytest.raises(ValueError, match="the operator is not symmetric"):
        eigenvalues(asymmetric)
