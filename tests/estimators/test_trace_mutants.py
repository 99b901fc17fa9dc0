"""Cases of the trace and Frobenius-norm estimators that mutation testing showed no other test
reached: the documented rank threshold of XTrace's sketch, the fallbacks of its variance
(a non-finite interaction sum, a negative variance estimate), results scaled back from
products far from 1, and the messages that name the result float64 cannot hold.

Overflow cases use operators whose every product is finite while one result (an estimate,
or only its standard error) is above 1.8e308 in the operator's units; the seeds were picked
so that the other results stay finite, and each test asserts that it does not depend on
that choice silently (the exact message, or the exact value).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _matrices import random_symmetric, single_blas_thread

from spectra.estimators import stochastic_trace
from spectra.estimators.stochastic_trace import (
    _interaction,
    _numerical_rank,
    frobenius_norm,
    hutchinson_trace,
    hutchpp_trace,
    xtrace,
)

EPS = 2.0**-52
_TAIL = "scale the operator down (e.g. by a power of two) and the result up"

# Diagonal sign patterns (A = c · diag(signs)) whose trace estimate stays finite while its
# standard error overflows, for the seeds used below.
_HUTCHPP_SIGNS = [-1, -1, 1, -1, 1, -1, 1, -1, -1, -1, -1, 1]
_HUTCHPP_SIGNS += [-1, 1, 1, -1, -1, 1, 1, 1, -1, 1, -1, 1]
_XTRACE_SIGNS = [-1, 1, -1, -1, -1, 1, -1, -1, -1, -1, -1, -1]
_XTRACE_SIGNS += [-1, 1, 1, -1, 1, 1, 1, -1, -1, 1, -1, 1]


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with single_blas_thread():
        yield


def _overflow(label: str, what: str, exponent: int) -> str:
    return f"{label}: {what} overflows float64 (it is about 2^{exponent}, above 1.8e308): {_TAIL}"


# --- _numerical_rank: singular values above 10·max(s, 10)·eps·σ₁ count -----------------


def test_numerical_rank_threshold_is_ten_times_max_columns_ten_eps_sigma_one():
    # s = 2 columns: the threshold is 10 · 10 · eps · σ₁ = 100 eps (σ₁ = 1)
    assert _numerical_rank(np.diag([1.0, 0.99 * 100 * EPS]), EPS) == 1
    assert _numerical_rank(np.diag([1.0, 1.01 * 100 * EPS]), EPS) == 2
    # s = 20 columns: 10 · 20 · eps = 200 eps; σ₁ = 4 scales it to 800 eps
    twenty = np.diag([4.0] * 19 + [0.99 * 800 * EPS])
    assert _numerical_rank(twenty, EPS) == 19
    twenty[-1, -1] = 1.01 * 800 * EPS
    assert _numerical_rank(twenty, EPS) == 20


def test_numerical_rank_of_a_zero_or_empty_sketch_is_zero():
    # a zero σ is not above a zero threshold
    assert _numerical_rank(np.zeros((3, 3)), EPS) == 0
    assert _numerical_rank(np.zeros((0, 0)), EPS) == 0


def test_xtrace_of_the_zero_operator_is_zero_with_zero_stderr():
    result = xtrace(np.zeros((5, 5)), num_products=6, progress=False)
    assert result.estimate == 0.0
    assert result.stderr == 0.0


# --- the variance: Σ_{i≠j} Δ_ij Δ_ji and its fallbacks ----------------------------------


def test_interaction_sums_the_off_diagonal_products_and_is_zero_when_not_finite():
    estimates = np.array([1.0, 2.0, 4.0])
    leave_two = np.array([[9.0, 0.5, 3.0], [1.0, 9.0, 2.5], [7.0, 5.0, 9.0]])
    # Δ = t_i − leave_two[i, j] off the diagonal: Δ01 = 0.5, Δ10 = 1, Δ02 = −2, Δ20 = −3,
    # Δ12 = −0.5, Δ21 = −1: Σ_{i≠j} Δ_ij Δ_ji = 2 (0.5 + 6 + 0.5) = 14
    assert _interaction(estimates, leave_two) == 14.0
    leave_two[0, 1] = np.inf
    assert _interaction(estimates, leave_two) == 0.0
    leave_two[0, 1] = np.nan
    assert _interaction(estimates, leave_two) == 0.0


def test_xtrace_falls_back_to_the_spread_when_the_variance_estimate_is_negative(monkeypatch):
    seen = []
    original = stochastic_trace._xtrace_estimates

    def recording(*args):
        seen.append(original(*args))
        return seen[-1]

    monkeypatch.setattr(stochastic_trace, "_xtrace_estimates", recording)
    result = xtrace(np.diag([3.0, -1.0, 2.0, -2.0, 1.0]), num_products=6, seed=0, progress=False)
    (estimates, interaction), s = seen[0], 3
    assert result.settings["num_test_vectors"] == s
    spread = float(np.sum((estimates - estimates.mean()) ** 2))
    assert spread > 1.0 and spread + interaction < 0  # 2.05 and −2.85 for this seed
    assert result.stderr == pytest.approx(math.sqrt(spread / (s * (s - 1))), rel=1e-12)
    assert result.estimate == pytest.approx(float(estimates.mean()), rel=1e-12)


# --- results scaled back from products far from 1 ---------------------------------------


def test_frobenius_norm_of_a_power_of_two_multiple_scales_every_field_exactly():
    base_matrix = random_symmetric(8, seed=3)
    base = frobenius_norm(base_matrix, num_products=8, seed=5, progress=False)
    scaled = frobenius_norm(2.0**300 * base_matrix, num_products=8, seed=5, progress=False)
    assert scaled.estimate == pytest.approx(2.0**300 * base.estimate, rel=1e-14)
    assert scaled.stderr == pytest.approx(2.0**300 * base.stderr, rel=1e-14)
    assert scaled.squared_estimate == pytest.approx(2.0**600 * base.squared_estimate, rel=1e-14)
    assert scaled.squared_stderr == pytest.approx(2.0**600 * base.squared_stderr, rel=1e-14)
    assert base.squared_stderr > 0


# --- results float64 cannot hold: the message names which ------------------------------


def test_frobenius_norm_names_the_norm_when_the_norm_itself_overflows():
    # ‖A‖_F = 4e308 while every product A z (entries ±1e308) is finite
    with pytest.raises(ValueError) as raised:
        frobenius_norm(1e308 * np.eye(16), num_products=2, progress=False)
    assert str(raised.value) == _overflow("frobenius_norm", "the Frobenius norm", 1026)


def test_frobenius_norm_refuses_a_square_that_overflows_with_the_whole_advice():
    # ‖Az‖² = Σ a_ii² for Rademacher z: ‖A‖_F = sqrt(1e600 + 1e598 + 1) = 1.00499e300
    with pytest.raises(ValueError) as raised:
        frobenius_norm(np.diag([1e300, 1e299, 1.0]), num_products=2, progress=False)
    assert str(raised.value) == (
        "frobenius_norm: ‖A‖_F² overflows float64 (‖A‖_F ≈ 1.00499e+300): the result "
        "cannot hold its squared_estimate; scale the operator down by a power of two "
        "(e.g. 2**-600) and the norm up by it"
    )


def test_hutchinson_names_the_standard_error_when_only_it_overflows():
    # z_iᵀAz_i = ±2e308 (finite products): seed 0 draws one of each sign, mean 0,
    # standard error 2e308
    matrix = 1e308 * np.array([[0.0, 1.0], [1.0, 0.0]])
    with pytest.raises(ValueError) as raised:
        hutchinson_trace(matrix, num_products=2, seed=0, progress=False)
    assert str(raised.value) == _overflow("trace (hutchinson)", "the trace's standard error", 1025)


def test_hutchpp_names_the_estimate_or_the_standard_error_that_overflows():
    with pytest.raises(ValueError) as raised:
        hutchpp_trace(1e308 * np.eye(4), num_products=4, seed=0, progress=False)
    assert str(raised.value) == _overflow("trace (hutch++)", "the trace estimate", 1025)
    # tr A = 0: the estimate is −4.3e307 (finite) and its standard error 3.1e308
    matrix = 2.0**1022 * np.diag(_HUTCHPP_SIGNS).astype(float)
    with pytest.raises(ValueError) as raised:
        hutchpp_trace(matrix, num_products=6, seed=27, progress=False)
    assert str(raised.value) == _overflow("trace (hutch++)", "the trace's standard error", 1025)


def test_xtrace_names_the_estimate_or_the_standard_error_that_overflows():
    # tr A = 16 · 2^1021 = 2^1025; the test vectors' entries (below 8) keep AΩ finite
    with pytest.raises(ValueError) as raised:
        xtrace(2.0**1021 * np.eye(16), num_products=4, seed=0, progress=False)
    assert str(raised.value) == _overflow("trace (xtrace)", "the trace estimate", 1026)
    # tr A = −4 · 2^1021: the estimate is −1.4e308 (finite) and its standard error 2.6e308
    matrix = 2.0**1021 * np.diag(_XTRACE_SIGNS).astype(float)
    with pytest.raises(ValueError) as raised:
        xtrace(matrix, num_products=4, seed=1, progress=False)
    assert str(raised.value) == _overflow("trace (xtrace)", "the trace's standard error", 1025)
