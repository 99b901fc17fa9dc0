"""Tests of spectra.estimators.stochastic_trace.

Cases of the trace and Frobenius-norm estimators that mutation testing showed no other test
reached: the documented rank threshold of XTrace's sketch, the fallbacks of its variance
(a non-finite interaction sum, a negative variance estimate), results scaled back from
products far from 1, and the messages that name the result float64 cannot hold.

Overflow cases use operators whose every product is finite while one result (an estimate,
or only its standard error) is above 1.8e308 in the operator's units; the seeds were picked
so that the other results stay finite, and each test asserts that it does not depend on
that choice silently (the exact message, or the exact value).

XTrace when the sketch Y = AΩ is numerically rank deficient: because A has rank < s,
because the test vectors Ω are singular (Rademacher vectors in small dimensions: two equal
or opposite columns, or another integer dependency), or both.

The truths: a direct implementation of the definition with dense projectors onto the column
spaces of each Y₋K (from an SVD), the exact trace, and coverage over many seeds.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from _matrices import (
    MatvecOnly,
    assert_symmetry_checked_unless_disabled,
    low_rank_plus_noise,
    progress_lines,
    random_symmetric,
    single_blas_thread,
    timed_with_defaults,
    trace_errors,
    with_spectrum,
)

from spectra.estimators import stochastic_trace
from spectra.estimators._products import as_symmetric_operator
from spectra.estimators.stochastic_trace import (
    _interaction,
    _xtrace_estimates,
    frobenius_norm,
    hutchinson_trace,
    hutchpp_trace,
    numerical_rank,
    trace,
    xtrace,
)


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with single_blas_thread():
        yield


SEEDS = range(200)


def errors_and_stderrs(matrix, method, num_products, seeds=SEEDS):
    return trace_errors(matrix, method, num_products, seeds)


def rms(values):
    return float(np.sqrt(np.mean(np.square(values))))


def test_hutchinson_error_shrinks_like_inverse_sqrt_and_stderr_covers():
    a = random_symmetric(100, seed=1) + np.eye(100)
    seeds = range(600)
    errors_small, _ = errors_and_stderrs(a, "hutchinson", 16, seeds)
    errors_large, stderrs = errors_and_stderrs(a, "hutchinson", 64, seeds)
    # RMS error ratio for 4x the probes: 2. Over 600 near-Gaussian errors an RMS has a
    # relative standard deviation of 2.9%, the ratio (the runs share their first 16
    # probes) about 3.5%: [1.6, 2.5] is more than 6 of them away.
    assert 1.6 < rms(errors_small) / rms(errors_large) < 2.5
    # theoretical stderr: sqrt(2 (||A||_F^2 - sum a_ii^2) / m); ±20% is 7 standard
    # deviations of the RMS.
    theory = np.sqrt(2 * (np.sum(a**2) - np.sum(np.diag(a) ** 2)) / 64)
    assert 0.8 < rms(errors_large) / theory < 1.2
    # ±2σ coverage 0.952 (t with 63 degrees of freedom) with a binomial standard deviation
    # of 0.87 points: [0.915, 0.985] is 4.2 and 3.8 of them away (false alarm < 1e-4).
    coverage = np.mean(np.abs(errors_large) <= 2 * stderrs)
    assert 0.915 <= coverage <= 0.985


def test_hutchpp_beats_hutchinson_and_xtrace_at_least_as_good_on_low_rank():
    a = low_rank_plus_noise(200, rank=15, noise=0.01, seed=2)
    seeds = range(60)
    hutchinson_errors, _ = errors_and_stderrs(a, "hutchinson", 60, seeds)
    hutchpp_errors, hutchpp_stderrs = errors_and_stderrs(a, "hutch++", 60, seeds)
    xtrace_errors, xtrace_stderrs = errors_and_stderrs(a, "xtrace", 60, seeds)
    # Measured ratios (these 60 seeds): Hutch++/Hutchinson 0.002, XTrace/Hutch++ 0.06; the
    # bounds are far from them (no false alarm in practice).
    assert rms(hutchpp_errors) < 0.2 * rms(hutchinson_errors)
    assert rms(xtrace_errors) <= 1.1 * rms(hutchpp_errors)
    # the error estimates are within a factor of the true RMS error (a factor 3 is many
    # standard deviations of a 60-seed RMS; calibration is tested in test_calibration.py)
    assert 1 / 3 < np.mean(xtrace_stderrs) / rms(xtrace_errors) < 3
    assert 1 / 3 < np.mean(hutchpp_stderrs) / rms(hutchpp_errors) < 3


def test_xtrace_exact_for_low_rank_and_call_count():
    spectrum = np.zeros(120)
    spectrum[:4] = [3.0, -2.0, 1.0, 0.5]
    a = with_spectrum(spectrum, seed=3)
    result = xtrace(a, num_products=40)
    assert result.estimate == pytest.approx(2.5, abs=1e-10)
    assert result.stderr < 1e-10
    assert result.num_operator_calls == 2  # two sketches (the symmetry check is free)
    assert result.num_products <= 40


def test_xtrace_rademacher_and_full_rank_small_matrix():
    a = random_symmetric(30, seed=4)
    for distribution in ("sphere", "rademacher"):
        result = xtrace(a, num_products=60, distribution=distribution)
        assert result.estimate == pytest.approx(np.trace(a), abs=1e-9)


def test_rtol_stopping_records_reason():
    a = random_symmetric(150, seed=5) + 3 * np.eye(150)
    stopped = hutchinson_trace(a, num_products=5000, rtol=0.02, seed=0)
    assert stopped.stopped == "rtol"
    assert stopped.stderr <= 0.02 * abs(stopped.estimate)
    assert stopped.num_products < 5000
    # |t| > 4 with hundreds of degrees of freedom: 6e-5 (the data-dependent stop makes the
    # error bar slightly optimistic, not by a factor that matters here).
    assert abs(stopped.estimate - np.trace(a)) < 4 * stopped.stderr
    budget = hutchinson_trace(a, num_products=40, rtol=1e-6, seed=0)
    assert budget.stopped == "budget" and budget.num_products == 40
    plain = trace(a, num_products=40)
    assert plain.stopped == "budget"
    pp = hutchpp_trace(low_rank_plus_noise(150, 10, 0.01), num_products=3000, rtol=1e-3)
    assert pp.stopped == "rtol" and pp.num_products < 3000


def test_blocks_and_operator_calls():
    a = random_symmetric(50, seed=6)
    result = hutchinson_trace(MatvecOnly(a), num_products=50, block_size=20)
    assert result.num_products == 50
    assert result.num_operator_calls == 3  # blocks 20, 20, 10
    pp = hutchpp_trace(a, num_products=30, block_size=100)
    assert pp.num_operator_calls == 2  # sketch, then [Q, deflated probes]
    assert pp.num_products == 30


def test_reproducible_and_seed_dependent():
    a = random_symmetric(60, seed=7)
    for method in ("hutchinson", "hutch++", "xtrace"):
        first = trace(a, method=method, num_products=30, seed=3)
        again = trace(a, method=method, num_products=30, seed=3)
        other = trace(a, method=method, num_products=30, seed=4)
        assert first.estimate == again.estimate and first.stderr == again.stderr
        assert first.estimate != other.estimate
        json.dumps(first.to_dict())


def test_frobenius_norm():
    a = random_symmetric(100, seed=8)
    truth = np.linalg.norm(a)
    result = frobenius_norm(a, num_products=200, seed=1)
    # |t| > 4 with 199 degrees of freedom: 9e-5 (seed fixed).
    assert abs(result.estimate - truth) < 4 * result.stderr
    assert result.stderr < 0.05 * truth
    assert result.squared_estimate == pytest.approx(result.estimate**2)
    covered = [
        abs(frobenius_norm(a, num_products=40, seed=s, check_symmetry=False).estimate - truth)
        <= 2 * frobenius_norm(a, num_products=40, seed=s, check_symmetry=False).stderr
        for s in range(60)
    ]
    # Binomial(60, 0.95) below 48: probability < 1e-5.
    assert 0.8 <= np.mean(covered) <= 1.0
    assert frobenius_norm(np.zeros((5, 5))).estimate == 0.0


def test_invalid_arguments():
    a = random_symmetric(10)
    with pytest.raises(ValueError, match="'hutchinson', 'hutch\\+\\+', 'xtrace'"):
        trace(a, method="girard")
    with pytest.raises(ValueError, match="rtol is supported"):
        trace(a, method="xtrace", rtol=0.1)
    with pytest.raises(ValueError, match="num_products"):
        trace(a, num_products=1)
    with pytest.raises(ValueError, match="num_products"):
        trace(a, method="hutch++", num_products=3)
    with pytest.raises(ValueError, match="rtol"):
        trace(a, rtol=-1.0)
    with pytest.raises(ValueError, match="block_size"):
        trace(a, block_size=0)
    with pytest.raises(ValueError, match=r"square, got shape \(4, 5\)"):
        trace(np.ones((4, 5)))
    with pytest.raises(ValueError, match="operator is not symmetric"):
        trace(np.triu(np.ones((10, 10))))


# -- contracts that mutation testing (make mutate) found untested -------------------------
def test_frobenius_norm_defaults_settings_time_and_messages(capsys):
    a = random_symmetric(30, seed=9)
    result = timed_with_defaults(frobenius_norm, a)
    assert result.num_products == 100 and result.num_operator_calls == 7  # 6 × 16 + 4
    assert result.settings == {
        "num_products": 100,
        "block_size": 16,
        "seed": 0,
        "check_symmetry": True,
    }
    # The delta method: stderr(F) = stderr(F²) / (2F), whatever the scale of A.
    small = frobenius_norm(1e-3 * a, num_products=2)
    assert small.num_products == 2 and small.squared_stderr > 0
    assert small.stderr == pytest.approx(small.squared_stderr / (2 * small.estimate))
    zero = frobenius_norm(np.zeros((5, 5)), num_products=4)
    assert zero.estimate == 0.0 and zero.stderr == 0.0
    with pytest.raises(ValueError, match=r"^num_products must be an integer >= 2, got 1$"):
        frobenius_norm(a, num_products=1)
    with pytest.raises(ValueError, match=r"^block_size must be an integer >= 1, got 0$"):
        frobenius_norm(a, block_size=0)
    assert_symmetry_checked_unless_disabled(frobenius_norm, num_products=4)
    frobenius_norm(a, num_products=8, progress=True)
    first = progress_lines(capsys)[0]
    assert first.startswith("frobenius norm: ") and "0/8" in first


@pytest.mark.parametrize("scale", [1e-8, 1.0, 1e8])
def test_xtrace_low_rank_is_exact_at_every_scale(scale):
    # The numerical rank of the sketch is relative to its largest singular value: a low-rank
    # matrix is recognized as such (and its trace is exact) whatever its norm.
    spectrum = np.zeros(60)
    spectrum[:3] = [2.0, -1.0, 0.5]
    a = scale * with_spectrum(spectrum, seed=10)
    result = xtrace(a, num_products=20)
    assert result.estimate == pytest.approx(1.5 * scale, rel=1e-9)
    assert result.stderr <= 1e-9 * scale
    assert result.num_products == 10 + 3  # the second call multiplies rank(AΩ) columns


def test_xtrace_rank_one_is_recognized():
    # The rank threshold is relative to the largest singular value of the sketch, not the
    # second (which is at rounding level here).
    v = np.random.default_rng(11).standard_normal(40)
    result = xtrace(3.0 * np.outer(v, v), num_products=20)
    assert result.estimate == pytest.approx(3.0 * v @ v, rel=1e-10)
    assert result.num_products == 10 + 1


def _deflated_estimate(a, test, image, keep, i):
    """tr(PA) + γ·((I − P)ωᵢ)ᵀ A (I − P)ωᵢ, P the projector onto the columns ``keep`` of
    AΩ, γ = (n − |keep|)/‖(I − P)ωᵢ‖²: the XTrace definition, with dense projectors."""
    n = a.shape[0]
    basis = np.linalg.qr(image[:, keep])[0]
    projector = basis @ basis.T
    deflated = test[:, i] - projector @ test[:, i]
    gamma = (n - len(keep)) / (deflated @ deflated)
    return np.trace(projector @ a) + gamma * deflated @ a @ deflated


def test_xtrace_leave_one_and_two_out_estimates_match_their_dense_definition():
    # The error bar rests on the leave-two-out differences Δᵢⱼ = tᵢ − tᵢ⁽⁻ʲ⁾; both the tᵢ
    # and Σ_{i≠j} ΔᵢⱼΔⱼᵢ are checked against explicit projectors.
    rng = np.random.default_rng(12)
    n, s = 14, 5
    a = random_symmetric(n, seed=12) + np.diag(np.linspace(0.0, 3.0, n))
    test = rng.standard_normal((n, s))
    image = a @ test
    estimates, interaction = _xtrace_estimates(test, image, as_symmetric_operator(a, "t", True))
    others = [[j for j in range(s) if j != i] for i in range(s)]
    truth = [_deflated_estimate(a, test, image, others[i], i) for i in range(s)]
    np.testing.assert_allclose(estimates, truth, rtol=1e-10, atol=1e-10)
    delta = np.zeros((s, s))
    for i in range(s):
        for j in range(s):
            if i != j:
                keep = [k for k in others[i] if k != j]
                delta[i, j] = truth[i] - _deflated_estimate(a, test, image, keep, i)
    assert abs(interaction) > 1e-3 * np.sum(delta**2)  # not a negligible term here
    assert interaction == pytest.approx(np.sum(delta * delta.T), rel=1e-8, abs=1e-10)


def test_hutchpp_defaults_settings_time_and_messages(capsys):
    a = random_symmetric(60, seed=13)
    result = timed_with_defaults(hutchpp_trace, a)
    assert result.method == "hutch++" and result.num_products == 100
    # s = 100 // 3 = 33 sketch columns, then 100 - 2·33 = 34 probes in blocks of 16.
    assert result.settings == {
        "num_products": 100,
        "rtol": None,
        "block_size": 16,
        "sketch_size": 33,
        "num_probes": 34,
        "seed": 0,
        "check_symmetry": True,
    }
    assert hutchpp_trace(a, num_products=40, block_size=5).settings["block_size"] == 5
    assert hutchpp_trace(a, num_products=4).settings["sketch_size"] == 1
    with pytest.raises(ValueError, match=r"^num_products must be an integer >= 4, got 3$"):
        hutchpp_trace(a, num_products=3)
    with pytest.raises(ValueError, match=r"^block_size must be an integer >= 1, got 0$"):
        hutchpp_trace(a, block_size=0)
    assert_symmetry_checked_unless_disabled(hutchpp_trace, num_products=6)
    hutchpp_trace(a, num_products=9, progress=True)
    first = progress_lines(capsys)[0]
    assert first.startswith("trace (hutch++): ") and "0/9" in first


def test_xtrace_defaults_settings_time_and_messages(capsys):
    a = random_symmetric(60, seed=14)
    result = timed_with_defaults(xtrace, a)
    assert result.method == "xtrace" and result.num_products == 100
    assert result.settings == {
        "num_products": 100,
        "num_test_vectors": 50,
        "distribution": "sphere",
        "seed": 0,
        "check_symmetry": True,
    }
    smallest = xtrace(a, num_products=4)  # two test vectors: the smallest with an error bar
    assert smallest.settings["num_test_vectors"] == 2 and np.isfinite(smallest.stderr)
    one = xtrace(np.array([[2.5]]), num_products=4)  # n = 1: one test vector, no error bar
    assert one.estimate == pytest.approx(2.5) and np.isnan(one.stderr)
    with pytest.raises(ValueError, match=r"^num_products must be an integer >= 4, got 3$"):
        xtrace(a, num_products=3)
    with pytest.raises(ValueError, match=r"^distribution must be one of .*, got 'gaussian'$"):
        xtrace(a, distribution="gaussian")
    assert_symmetry_checked_unless_disabled(xtrace, num_products=6)
    xtrace(a, num_products=20, progress=True)
    first = progress_lines(capsys)[0]
    assert first.startswith("trace (xtrace): ") and "0/20" in first


def test_trace_dispatches_every_argument_and_hutchinson_records_its_settings(capsys):
    a = random_symmetric(40, seed=15)
    default = timed_with_defaults(trace, a)
    assert timed_with_defaults(hutchinson_trace, a).estimate == default.estimate
    assert default.method == "hutchinson" and default.num_products == 100
    assert default.estimate == hutchinson_trace(a, seed=0).estimate
    assert default.settings == {
        "num_products": 100,
        "rtol": None,
        "block_size": 16,
        "num_probes": 100,
        "seed": 0,
        "check_symmetry": True,
    }
    direct = {"hutchinson": hutchinson_trace, "hutch++": hutchpp_trace, "xtrace": xtrace}
    for method, estimator in direct.items():
        result = trace(a, method=method, num_products=12, progress=True)
        first = progress_lines(capsys)[0]
        assert first.startswith(f"trace ({method}): "), (method, first)
        assert result.method == method
        assert result.estimate == estimator(a, num_products=12, seed=0).estimate
        assert_symmetry_checked_unless_disabled(trace, method=method, num_products=6)
    for method in ("hutchinson", "hutch++"):
        passed = trace(a, method=method, num_products=300, rtol=0.5, block_size=5, seed=2)
        alone = direct[method](a, num_products=300, rtol=0.5, block_size=5, seed=2)
        assert passed.settings == alone.settings and passed.settings["rtol"] == 0.5
        assert passed.settings["block_size"] == 5 and passed.estimate == alone.estimate
    assert hutchinson_trace(a, num_products=2).num_products == 2
    with pytest.raises(ValueError, match=r"^num_products must be an integer >= 2, got 1$"):
        hutchinson_trace(a, num_products=1)
    with pytest.raises(ValueError, match=r"^rtol must be a positive finite number, got -1"):
        hutchinson_trace(a, rtol=-1.0)
    with pytest.raises(ValueError, match=r"^method must be one of 'hutchinson', .*, got 'girard'$"):
        trace(a, method="girard")
    message = r"^rtol is supported by method='hutchinson' and 'hutch\+\+', not 'xtrace'$"
    with pytest.raises(ValueError, match=message):
        trace(a, method="xtrace", rtol=0.1)


def test_rtol_is_relative_to_the_estimate_itself():
    # tr(A) = 0.01 and each sample has a standard deviation of 0.01·sqrt(2): rtol = 0.1 needs
    # stderr <= 0.1·|estimate|, about 200 samples. Stopping at the first possible check
    # (3 blocks, 48 samples, stderr 0.002) would need an estimate 5 standard errors too high
    # (probability < 1e-6; seed fixed); a stop relative to 1 + estimate would stop there.
    rng = np.random.default_rng(16)
    noise = rng.standard_normal((50, 50))
    noise = noise + noise.T
    np.fill_diagonal(noise, 0.0)
    a = 0.01 / 50 * np.eye(50) + 0.01 * noise / np.linalg.norm(noise)
    result = hutchinson_trace(a, num_products=1000, rtol=0.1, seed=3)
    assert result.stopped == "rtol" and 48 < result.num_products < 1000, result.num_products
    assert result.stderr <= 0.1 * abs(result.estimate)
    assert abs(result.estimate - 0.01) < 4 * result.stderr


@pytest.mark.parametrize("block_size, first_stop", [(5, 15), (2, 10)])
def test_rtol_stops_at_the_first_allowed_check(block_size, first_stop):
    # The first check is after 3 blocks and 10 samples: 3 blocks of 5, or 5 blocks of 2. A
    # trace of 1000 with unit noise meets rtol = 0.5 at once.
    a = 1000.0 / 30 * np.eye(30) + random_symmetric(30, seed=17) / 30
    result = hutchinson_trace(a, num_products=500, rtol=0.5, block_size=block_size)
    assert result.stopped == "rtol" and result.num_products == first_stop


def test_hutchpp_rtol_is_relative_to_the_whole_estimate():
    # An eigenvalue 10 that the sketch captures and -10/199 on the other 199 directions:
    # tr(A) = 0, so stopping (stderr <= 0.05·|estimate|) would need an estimate 20 standard
    # errors from the truth (seed fixed; probability < 1e-80), and the budget is used up.
    # A rule relative to |exact part - Hutchinson part| (about 20) would stop at once.
    rng = np.random.default_rng(18)
    spike = np.linalg.qr(rng.standard_normal((200, 1)))[0]
    a = (10.0 + 10.0 / 199) * (spike @ spike.T) - 10.0 / 199 * np.eye(200)
    assert np.trace(a) == pytest.approx(0.0, abs=1e-9)
    result = hutchpp_trace(a, num_products=150, rtol=0.05, seed=4)
    assert result.stopped == "budget" and result.num_products == 150


def test_xtrace_error_bar_combines_the_spread_and_the_interaction():
    # stderr² = (Σ(tᵢ − t̄)² + Σ_{i≠j} ΔᵢⱼΔⱼᵢ) / (s(s − 1)), from the same test vectors
    # (Gaussian directions drawn from the seed; XTrace ignores their lengths).
    a = random_symmetric(40, seed=19) + np.diag(np.linspace(0.0, 4.0, 40))
    s = 6
    test = np.random.default_rng(5).standard_normal((40, s))
    counter = as_symmetric_operator(a, "t", True)
    estimates, interaction = _xtrace_estimates(test, a @ test, counter)
    spread = np.sum((estimates - estimates.mean()) ** 2)
    assert abs(interaction) > 0.05 * spread  # both terms matter here
    expected = np.sqrt((spread + interaction) / (s * (s - 1)))
    result = xtrace(a, num_products=2 * s, seed=5)
    assert result.stopped == "budget"
    assert result.estimate == pytest.approx(estimates.mean(), rel=1e-10)
    assert result.stderr == pytest.approx(expected, rel=1e-8)
    # The same at any scale (here a variance below 1).
    small = xtrace(1e-3 * a, num_products=2 * s, seed=5)
    assert small.stderr == pytest.approx(1e-3 * expected, rel=1e-8)


EPS = 2.0**-52


_TAIL = "scale the operator down (e.g. by a power of two) and the result up"


# Diagonal sign patterns (A = c · diag(signs)) whose trace estimate stays finite while its
# standard error overflows, for the seeds used below.
_HUTCHPP_SIGNS = [-1, -1, 1, -1, 1, -1, 1, -1, -1, -1, -1, 1]


_HUTCHPP_SIGNS += [-1, 1, 1, -1, -1, 1, 1, 1, -1, 1, -1, 1]


_XTRACE_SIGNS = [-1, 1, -1, -1, -1, 1, -1, -1, -1, -1, -1, -1]


_XTRACE_SIGNS += [-1, 1, 1, -1, 1, 1, 1, -1, -1, 1, -1, 1]


def _overflow(label: str, what: str, exponent: int) -> str:
    return f"{label}: {what} overflows float64 (it is about 2^{exponent}, above 1.8e308): {_TAIL}"


# --- numerical_rank: singular values above 10·max(s, 10)·eps·σ₁ count -----------------


def test_numerical_rank_threshold_is_ten_times_max_columns_ten_eps_sigma_one():
    # s = 2 columns: the threshold is 10 · 10 · eps · σ₁ = 100 eps (σ₁ = 1)
    assert numerical_rank(np.diag([1.0, 0.99 * 100 * EPS]), EPS) == 1
    assert numerical_rank(np.diag([1.0, 1.01 * 100 * EPS]), EPS) == 2
    # s = 20 columns: 10 · 20 · eps = 200 eps; σ₁ = 4 scales it to 800 eps
    twenty = np.diag([4.0] * 19 + [0.99 * 800 * EPS])
    assert numerical_rank(twenty, EPS) == 19
    twenty[-1, -1] = 1.01 * 800 * EPS
    assert numerical_rank(twenty, EPS) == 20


def test_numerical_rank_of_a_zero_or_empty_sketch_is_zero():
    # a zero σ is not above a zero threshold
    assert numerical_rank(np.zeros((3, 3)), EPS) == 0
    assert numerical_rank(np.zeros((0, 0)), EPS) == 0


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


def _spd_5x5() -> np.ndarray:
    """The issue's matrix: a fixed 5 × 5 SPD matrix with eigenvalues down to about 1e-2."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 5))
    return a @ a.T + np.diag([10, 1, 0.1, 0.01, 0.001])


def _column_space_projector(columns: np.ndarray) -> tuple[np.ndarray, int]:
    """The orthogonal projector onto the column space of ``columns`` and its rank (singular
    values above 1e-9 times the largest count)."""
    n = columns.shape[0]
    if columns.shape[1] == 0:
        return np.zeros((n, n)), 0
    left, singular, _ = np.linalg.svd(columns, full_matrices=False)
    rank = int(np.sum(singular > 1e-9 * singular[0])) if singular[0] > 0 else 0
    return left[:, :rank] @ left[:, :rank].T, rank


def _definition(a: np.ndarray, test: np.ndarray, left_out: tuple[int, ...], i: int) -> float:
    """tr(PA) + γ ((I − P)ωᵢ)ᵀ A (I − P)ωᵢ, P onto span(Y₋K) (K = ``left_out``) of rank r_K,
    γ = (n − r_K)/‖(I − P)ωᵢ‖²: XTrace's estimate from its definition, densely."""
    n, s = test.shape
    keep = [k for k in range(s) if k not in left_out]
    projector, rank = _column_space_projector(a @ test[:, keep])
    deflated = test[:, i] - projector @ test[:, i]
    return float(
        np.trace(projector @ a) + (n - rank) / (deflated @ deflated) * (deflated @ a @ deflated)
    )


def _brute_force(a: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, float]:
    """The tᵢ and Σ_{i≠j} ΔᵢⱼΔⱼᵢ (Δᵢⱼ = tᵢ − tᵢ⁽⁻ʲ⁾) from :func:`_definition`."""
    s = test.shape[1]
    estimates = np.array([_definition(a, test, (i,), i) for i in range(s)])
    delta = np.zeros((s, s))
    for i in range(s):
        for j in range(s):
            if i != j:
                delta[i, j] = estimates[i] - _definition(a, test, (i, j), i)
    return estimates, float(np.sum(delta * delta.T))


def _check_against_definition(a: np.ndarray, test: np.ndarray) -> None:
    estimates, interaction = _xtrace_estimates(test, a @ test, as_symmetric_operator(a, "t", True))
    truth, truth_interaction = _brute_force(a, test)
    np.testing.assert_allclose(estimates, truth, rtol=1e-10, atol=1e-10)
    scale = max(1.0, abs(truth_interaction))
    assert abs(interaction - truth_interaction) <= 1e-9 * scale, (interaction, truth_interaction)


def _is_rank_deficient(a: np.ndarray, test: np.ndarray) -> bool:
    triangular = np.linalg.qr(a @ test, mode="r")
    return numerical_rank(triangular, np.finfo(float).eps) < test.shape[1]


def test_rademacher_on_the_5x5_matrix_matches_the_definition_singular_or_not():
    a = _spd_5x5()
    singular = regular = 0
    for seed in range(60):
        test = np.random.default_rng(seed).choice([-1.0, 1.0], size=(5, 5))
        if _is_rank_deficient(a, test):
            singular += 1
        else:
            regular += 1
        _check_against_definition(a, test)
    assert singular >= 20 and regular >= 10  # both paths are exercised


def test_constructed_dependencies_match_the_definition():
    rng = np.random.default_rng(5)
    b = rng.standard_normal((8, 8))
    a = b @ b.T + np.eye(8)
    test = rng.choice([-1.0, 1.0], size=(8, 6))
    # ω₁ = −ω₀ (one null direction: rows n₀ ∥ n₁, the other rows 0) ...
    test[:, 1] = -test[:, 0]
    _check_against_definition(a, test)
    # ... and ω₃ = ω₂ too (two null directions, rows pairwise parallel or orthogonal) ...
    test[:, 3] = test[:, 2]
    _check_against_definition(a, test)
    # ... and ω₅ = ω₀ + ω₂ − ω₄ scaled: one null vector with four nonzero entries.
    test[:, 5] = 0.5 * (test[:, 0] + test[:, 2] - test[:, 4])
    assert _is_rank_deficient(a, test)
    _check_against_definition(a, test)
    # Low rank A and a duplicate column; a test vector in the null space of A (y₅ = 0).
    spectrum = np.zeros(8)
    spectrum[:4] = [3.0, -1.0, 0.5, 0.2]
    low = with_spectrum(spectrum, seed=6)
    test = rng.choice([-1.0, 1.0], size=(8, 6))
    test[:, 2] = test[:, 1]
    _check_against_definition(low, test)
    eigenvectors = np.linalg.eigh(low)[1]
    test[:, 5] = eigenvectors[:, np.argmin(np.abs(np.linalg.eigvalsh(low)))] * np.sqrt(8)
    _check_against_definition(low, test)


def test_duplicates_on_an_ill_conditioned_matrix_match_the_definition():
    # The null space of R is computed to about eps·cond(R): at cond A = 1e6 its zero rows
    # stay far below the decision threshold (1e-8) and the estimates match to ~1e-11.
    a = with_spectrum(np.geomspace(1.0, 1e-6, 8), seed=3)
    for seed in range(5):
        test = np.random.default_rng(seed).choice([-1.0, 1.0], size=(8, 6))
        test[:, 1] = -test[:, 0]
        test[:, 4] = test[:, 3]
        _check_against_definition(a, test)


def test_sphere_vectors_on_a_low_rank_matrix_match_the_definition():
    spectrum = np.zeros(10)
    spectrum[:3] = [2.0, -1.0, 0.5]
    a = with_spectrum(spectrum, seed=7)
    test = np.random.default_rng(8).standard_normal((10, 5))
    assert _is_rank_deficient(a, test)
    _check_against_definition(a, test)


def test_rademacher_on_the_5x5_matrix_is_unbiased_and_its_error_bars_cover():
    """The issue's case: 2000 seeds, s = n = 5 Rademacher test vectors, so Ω is singular
    in about two runs of three. The old shortcut was 16 standard errors off with 50%/69%
    coverage; now the mean error is within 3 standard errors of 0 (false alarm 0.3% for
    an unbiased estimator, deterministic under these seeds; measured 0.6) and ±1σ/±2σ
    cover within the calibration bands [60%, 76%] and [90%, 98%] (measured 72%/94%)."""
    a = _spd_5x5()
    truth = np.trace(a)
    with single_blas_thread():
        runs = [
            xtrace(a, num_products=10, distribution="rademacher", seed=s, check_symmetry=False)
            for s in range(2000)
        ]
    errors = np.array([r.estimate - truth for r in runs])
    stderrs = np.array([r.stderr for r in runs])
    assert np.all(np.isfinite(errors)) and np.all(np.isfinite(stderrs))
    mean_stderr = errors.std(ddof=1) / np.sqrt(errors.size)
    assert abs(errors.mean()) <= 3 * mean_stderr, (errors.mean(), mean_stderr)
    z = np.abs(errors) / stderrs
    assert 0.60 <= np.mean(z <= 1) <= 0.76
    assert 0.90 <= np.mean(z <= 2) <= 0.98


def test_low_rank_stays_exact_with_singular_rademacher_vectors():
    # rank A = 3 < s = 8 and ω₁ = ω₀: every Y₋ᵢ still spans range(A), so every tᵢ is tr A.
    spectrum = np.zeros(40)
    spectrum[:3] = [2.0, -1.0, 0.5]
    a = with_spectrum(spectrum, seed=9)
    test = np.random.default_rng(10).choice([-1.0, 1.0], size=(40, 8))
    test[:, 1] = test[:, 0]
    estimates, interaction = _xtrace_estimates(test, a @ test, as_symmetric_operator(a, "t", True))
    np.testing.assert_allclose(estimates, 1.5, rtol=1e-12)
    assert abs(interaction) < 1e-20
    result = xtrace(a, num_products=16, distribution="rademacher", seed=3)
    assert result.estimate == pytest.approx(1.5, rel=1e-12)
    assert result.stderr < 1e-12
    assert result.num_products == 8 + 3  # the second call multiplies rank(AΩ) columns


def test_the_full_rank_path_is_unchanged():
    # Values computed with the code before the rank-deficient branch was rewritten. Equal
    # to a few units of rounding, not bit for bit: OpenBLAS picks its kernels by CPU (AVX2
    # and AVX-512 machines differ in the last bits); a change of the algorithm moves the
    # estimates by far more than 1e-12.
    rng = np.random.default_rng(3)
    b = rng.standard_normal((40, 40))
    a = b + b.T
    sphere = xtrace(a, num_products=30, seed=7)
    np.testing.assert_allclose(
        [sphere.estimate, sphere.stderr], [21.858520374185037, 10.82898052317215], rtol=1e-12
    )
    rademacher = xtrace(a, num_products=30, seed=7, distribution="rademacher")
    np.testing.assert_allclose(
        [rademacher.estimate, rademacher.stderr],
        [1.9672131605181589, 11.418126298515926],
        rtol=1e-12,
    )
