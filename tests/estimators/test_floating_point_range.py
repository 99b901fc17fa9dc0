"""Estimators at both ends of float64: an operator scaled by s from 1e-300 to 1e300 gives
s times the answer at scale 1 (against the exact answer, and with the same seed for
the stochastic estimators, stderr included), the zero operator gives zeros with honest
bounds, and an answer float64 cannot hold is refused.

The estimators scale the products by a power of two internally (exact), so the results
at scale s differ from s times those at scale 1 only by the rounding of s·A itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from _matrices import in_which_order, with_spectrum

from spectra import (
    diagonal,
    eigenvalues,
    frobenius_norm,
    lanczos,
    preconditioned,
    spectral_density,
    spectral_mass_below,
    trace,
)

SCALES = (1e-300, 1e-200, 1e-100, 1e-10, 1.0, 1e10, 1e100, 1e200, 1e300)
N = 60
SPECTRUM = np.concatenate([[3.0, 2.5, -2.0], np.linspace(-1.0, 1.5, N - 3)])
MATRIX = with_spectrum(SPECTRUM, seed=5)
# Rounding of s·A and of the estimators' own arithmetic on it: results at scale s
# match s times those at scale 1 to this relative accuracy (a real bug, such as an
# overflowed norm or a lost scale factor, is off by far more).
SAME = 1e-9


def _check_products(scale):
    """The counter's underflow check costs one product where ‖Av‖/‖v‖ falls below float64's
    tiny/eps (1.0e-292): at scale 1e-300 here, nowhere else."""
    return int(scale < 1e-290)


def _close(scaled, reference, scale, rtol=SAME):
    np.testing.assert_allclose(np.asarray(scaled) / scale, reference, rtol=rtol, atol=0)


# -- eigenvalues -------------------------------------------------------------------------------
_EIGEN_CASES = [
    (method, which)
    for method in ("lanczos", "power", "lobpcg")
    for which in ("largest", "smallest", "magnitude")
]


@pytest.mark.parametrize("method, which", _EIGEN_CASES)
def test_eigenvalues_across_the_float64_range(method, which):
    k = 1 if method == "power" else 2
    tol = 0.1 if method == "power" else 1e-10
    truth = in_which_order(SPECTRUM, which)[:k]
    base = eigenvalues(MATRIX, k=k, which=which, method=method, tol=tol, seed=2)
    assert base.all_converged
    for scale in SCALES:
        result = eigenvalues(MATRIX * scale, k=k, which=which, method=method, tol=tol, seed=2)
        assert result.all_converged, scale
        assert np.all(np.isfinite(result.error_bounds)) and np.all(result.error_bounds > 0)
        assert result.failure_probability == base.failure_probability
        # the bound holds against the exact answer and meets the tolerance
        errors = np.abs(np.abs(result.eigenvalues) - np.abs(truth) * scale)
        assert np.all(errors <= result.error_bounds * (1 + 1e-9)), scale
        assert np.all(result.error_bounds <= tol * np.abs(result.eigenvalues) * (1 + 1e-12))
        if method != "power":
            _close(result.eigenvalues, truth, scale, rtol=1e-9)
        _close(result.eigenvalues, base.eigenvalues, scale)
        assert result.num_products == base.num_products + _check_products(scale), scale


def test_the_issues_diagonal_with_entries_near_the_top_of_float64():
    matrix = np.diag([1e300, 1e299, 1.0])
    # Before: 3.96e298 "converged" for λ₁ = 1e300.
    result = eigenvalues(matrix)
    assert result.all_converged
    assert result.eigenvalues[0] == pytest.approx(1e300, rel=1e-14)
    assert result.error_bounds[0] <= 1e-8 * 1e300
    full = eigenvalues(matrix, k=3)
    assert full.all_converged
    np.testing.assert_allclose(full.eigenvalues[:2], [1e300, 1e299], rtol=1e-14)
    # λ₃ = 1 is below the operator's rounding (10·eps·‖A‖ ≈ 2e285): within its bound
    assert abs(full.eigenvalues[2] - 1.0) <= full.error_bounds[2] < np.inf
    for method in ("power", "lobpcg"):
        other = eigenvalues(matrix, method=method, tol=0.1)
        assert other.all_converged and np.isfinite(other.error_bounds[0])
        assert abs(other.eigenvalues[0] - 1e300) <= other.error_bounds[0] <= 0.1 * 1e300
    assert trace(matrix, num_products=4).estimate == pytest.approx(1.1e300, rel=1e-14)
    np.testing.assert_allclose(diagonal(matrix).estimate, [1e300, 1e299, 1.0], rtol=1e-14)
    with pytest.raises(ValueError, match=r"^frobenius_norm: ‖A‖_F² overflows float64 \(‖A‖_F"):
        frobenius_norm(matrix)


@pytest.mark.parametrize("scale", [1e155, 1e200, 1e300])
def test_large_diagonals_give_their_eigenvalues_not_a_fraction(scale):
    # Before: λ = 0.048·s with bound inf and converged=True for any s >= 1e155.
    values = np.linspace(0.1, 1.0, 50)
    result = eigenvalues(np.diag(values * scale))
    assert result.all_converged and np.isfinite(result.error_bounds[0])
    assert result.eigenvalues[0] == pytest.approx(scale, rel=1e-12)


# -- lanczos, density ------------------------------------------------------------------------
def test_lanczos_tridiagonal_scales_with_the_operator():
    base = lanczos(MATRIX, 12, seed=1)
    for scale in SCALES:
        result = lanczos(MATRIX * scale, 12, seed=1)
        _close(result.alpha, base.alpha, scale)
        _close(result.beta, base.beta, scale)
        _close(result.residual_norm, base.residual_norm, scale)
        assert not result.breakdown


def test_spectral_density_and_mass_below_scale_with_the_operator():
    base = spectral_density(MATRIX, num_steps=N, num_probes=3, seed=1)
    # N steps: the quadrature is exact, its nodes are the eigenvalues
    np.testing.assert_allclose(base.nodes.max(), SPECTRUM.max(), rtol=1e-10)
    np.testing.assert_allclose(base.nodes.min(), SPECTRUM.min(), rtol=1e-10)
    base_mass = spectral_mass_below(base)
    truth = np.mean(SPECTRUM < -0.01 * SPECTRUM.max())
    assert abs(base_mass.estimate - truth) <= base_mass.error
    short = spectral_density(MATRIX, num_steps=15, num_probes=3, seed=1)
    for scale in SCALES:
        density = spectral_density(MATRIX * scale, num_steps=N, num_probes=3, seed=1)
        _close(density.nodes, base.nodes, scale, rtol=1e-8)
        np.testing.assert_allclose(density.weights, base.weights, rtol=1e-6, atol=1e-12)
        mass = spectral_mass_below(density)
        assert mass.estimate == pytest.approx(base_mass.estimate, abs=1e-12)
        assert mass.error == pytest.approx(base_mass.error, abs=1e-12)
        assert mass.lambda_max == pytest.approx(base_mass.lambda_max * scale, rel=1e-10)
        truncated = spectral_density(MATRIX * scale, num_steps=15, num_probes=3, seed=1)
        _close(truncated.nodes, short.nodes, scale)
        np.testing.assert_array_equal(truncated.steps_taken, short.steps_taken)


# -- stochastic estimators -----------------------------------------------------------------
@pytest.mark.parametrize("method", ["hutchinson", "hutch++", "xtrace"])
def test_trace_scales_with_the_operator_same_seed(method):
    base = trace(MATRIX, method=method, num_products=30, seed=4)
    truth = float(SPECTRUM.sum())
    assert base.stderr > 0 and abs(base.estimate - truth) <= 4 * base.stderr
    for scale in SCALES:
        result = trace(MATRIX * scale, method=method, num_products=30, seed=4)
        _close(result.estimate, base.estimate, scale)
        _close(result.stderr, base.stderr, scale)
        assert np.isfinite(result.stderr)
        assert result.num_products == base.num_products + _check_products(scale)


def test_diagonal_scales_with_the_operator_same_seed():
    base = diagonal(MATRIX, num_products=40, seed=4)
    errors = np.abs(base.estimate - np.diag(MATRIX)) / base.stderr
    assert np.all(base.stderr > 0) and np.mean(errors <= 2) > 0.85
    for scale in SCALES:
        result = diagonal(MATRIX * scale, num_products=40, seed=4)
        _close(result.estimate, base.estimate, scale)
        _close(result.stderr, base.stderr, scale)


def test_frobenius_norm_scales_or_refuses_a_square_that_overflows():
    base = frobenius_norm(MATRIX, num_products=40, seed=4)
    truth = float(np.linalg.norm(SPECTRUM))
    assert abs(base.estimate - truth) <= 4 * base.stderr
    for scale in SCALES:
        if 2 * np.log10(scale * truth) > 308.2:
            with pytest.raises(ValueError, match="‖A‖_F² overflows float64"):
                frobenius_norm(MATRIX * scale, num_products=40, seed=4)
            continue
        result = frobenius_norm(MATRIX * scale, num_products=40, seed=4)
        _close(result.estimate, base.estimate, scale)
        _close(result.stderr, base.stderr, scale)
        if 1e-150 <= scale:  # the square is a normal float64 number
            _close(result.squared_estimate, base.squared_estimate, scale**2)
            _close(result.squared_stderr, base.squared_stderr, scale**2)


# -- preconditioned -------------------------------------------------------------------------
def test_preconditioned_eigenvalues_across_the_range():
    # A past failure: P = 1e-300 gave 5.28e298 for a top eigenvalue of 7.02e299.
    matrix = with_spectrum(np.concatenate([[0.702], np.linspace(0.0, 0.5, 29)]), seed=3)
    result = eigenvalues(preconditioned(matrix, np.full(30, 1e-300)))
    assert result.all_converged
    assert result.eigenvalues[0] == pytest.approx(7.02e299, rel=1e-12)
    rng = np.random.default_rng(0)
    diagonal_of_p = rng.uniform(0.5, 2.0, 30)
    exact = np.linalg.eigvalsh(matrix / np.sqrt(np.outer(diagonal_of_p, diagonal_of_p)))[-1]
    for scale in SCALES:
        op = preconditioned(matrix, diagonal_of_p * scale)
        top = eigenvalues(op)
        assert top.all_converged
        assert top.eigenvalues[0] == pytest.approx(exact / scale, rel=1e-10)


# -- zero and nearly zero ---------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lanczos", "power", "lobpcg"])
def test_the_zero_operator_gives_zeros_with_honest_bounds(method):
    zero = np.zeros((N, N))
    result = eigenvalues(zero, k=2 if method != "power" else 1, method=method)
    assert result.all_converged
    np.testing.assert_array_equal(result.eigenvalues, 0.0)
    np.testing.assert_array_equal(result.error_bounds, 0.0)
    assert result.settings["not_converged_reason"] is None


def test_the_zero_operator_in_every_other_estimator():
    zero = np.zeros((N, N))
    for method in ("hutchinson", "hutch++", "xtrace"):
        result = trace(zero, method=method, num_products=20)
        assert (result.estimate, result.stderr) == (0.0, 0.0)
    result = diagonal(zero, num_products=10)
    np.testing.assert_array_equal(result.estimate, 0.0)
    np.testing.assert_array_equal(result.stderr, 0.0)
    norm = frobenius_norm(zero, num_products=10)
    assert (norm.estimate, norm.stderr, norm.squared_estimate) == (0.0, 0.0, 0.0)
    density = spectral_density(zero, num_steps=10, num_probes=2)
    np.testing.assert_array_equal(density.nodes, 0.0)
    assert np.all(density.steps_taken == 1)
    tridiagonal = lanczos(zero, 5)
    assert tridiagonal.breakdown and tridiagonal.alpha.tolist() == [0.0]
    assert eigenvalues(preconditioned(zero, np.full(N, 1e-300))).eigenvalues[0] == 0.0


def test_a_tiny_diagonal_is_not_refused_as_asymmetric_and_symmetry_is_scale_invariant():
    # Before: 1.6e-300 "converged" for λ₁ = 2e-300, and a diagonal of subnormal numbers
    # (1e-310) refused as "not symmetric" (|u·Av − v·Au| = 2e-323 > 1e-8 × 0).
    tiny = np.diag(np.linspace(1.0, 2.0, N)) * 1e-300
    result = eigenvalues(tiny, k=2)
    np.testing.assert_allclose(result.eigenvalues, [2e-300, 2e-300 * (1 - 1 / (N - 1) / 2)])
    subnormal = eigenvalues(np.diag(np.linspace(1.0, 2.0, N)) * 1e-310)
    assert subnormal.all_converged
    assert abs(subnormal.eigenvalues[0] - 2e-310) <= subnormal.error_bounds[0] <= 1e-8 * 2e-310
    rng = np.random.default_rng(0)
    asymmetric = MATRIX + 1e-3 * rng.standard_normal((N, N))
    for scale in (1e-300, 1.0, 1e300):
        with pytest.raises(ValueError, match="not symmetric"):
            eigenvalues(asymmetric * scale)


def test_answers_float64_cannot_hold_are_refused():
    huge = np.eye(N) * 1e307
    with pytest.raises(ValueError, match=r"^trace \(hutchinson\): the trace estimate overflows"):
        trace(huge, num_products=4)
    # finite products, an eigenvalue (60e307) that is not
    with pytest.raises(ValueError, match=r"^eigenvalues \(lanczos\): an eigenvalue overflows"):
        eigenvalues(np.full((N, N), 1e307))
    # a product that overflows is refused where it happens
    with np.errstate(over="ignore"), pytest.raises(ValueError, match="non-finite"):
        eigenvalues(np.full((N, N), 1e308))


def test_layerwise_blocks_across_the_range():
    from spectra import layerwise

    groups = {"a": range(0, 30), "b": range(30, N)}
    blocks = [MATRIX[np.ix_(list(g), list(g))] for g in groups.values()]
    exact = [np.linalg.eigvalsh(block)[-1] for block in blocks]
    base = layerwise(MATRIX, groups=groups, trace=True, num_probes=4, seed=1)
    for scale in (1e-300, 1e-100, 1e100, 1e300):
        result = layerwise(MATRIX * scale, groups=groups, trace=True, num_probes=4, seed=1)
        assert result.all_converged
        for i in range(2):
            assert result.eigenvalues[i][0] == pytest.approx(exact[i] * scale, rel=1e-9)
            assert np.isfinite(result.error_bounds[i][0])
        _close(result.traces, base.traces, scale)
        _close(result.trace_stderr, base.trace_stderr, scale)
