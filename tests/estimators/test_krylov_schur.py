"""Tests of spectra.estimators.krylov_schur (and of the certified bounds of
spectra.estimators.eigenvalue_bounds that it computes: no test_eigenvalue_bounds.py here, as
that basename is taken by tests/truths/test_eigenvalue_bounds.py).

The fast paths of the Krylov–Schur eigensolver against dense truth.

* Reorthogonalization from the Krylov relation: the coefficients the relation predicts
  are subtracted first, then one Gram–Schmidt pass, and a second one only when a pass
  shrinks the vector (a product off the relation).
* The vectorized certified bounds, against the interval rule written as a loop.
* The state fed one product at a time (what ``layerwise`` drives per group).

(The engine's single-vector product, a (1, n) block in and out, is checked against dense
Hessians by the operator tests, split and recomputing alike.)
"""

from __future__ import annotations

import numpy as np
import pytest
from _matrices import single_blas_thread, with_spectrum

from spectra.estimators.eigenvalue_bounds import certified_bounds
from spectra.estimators.krylov_schur import KrylovSchur

EPS = float(np.finfo(np.float64).eps)


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with single_blas_thread():
        yield


def _state(matrix, k=1, budget=100, ncv=20, seed=0):
    rng = np.random.default_rng(seed)
    n = matrix.shape[0]
    return KrylovSchur(
        n, k, "largest", 1e-12, EPS, budget, rng.standard_normal(n), False, rng, ncv, 1e-4
    )


def test_a_product_off_the_krylov_relation_is_fully_reorthogonalized():
    matrix = with_spectrum(np.linspace(-1.0, 3.0, 40), seed=4)
    state = _state(matrix)
    for step in range(6):
        image = matrix @ state.next_vector()
        if step == 5:
            # Not A's product: a large component along the first basis vector, which the
            # relation does not predict. The first pass removes it and shrinks the vector
            # well below 1/√2 of its norm, so a second pass runs.
            image = image + 5.0 * state.basis[0]
        state.absorb(image)
    active = state.basis[: state.size]
    assert state.size == 6
    assert np.abs(active @ active.T - np.eye(6)).max() < 1e-14
    assert np.abs(active @ state.next_vector()).max() < 1e-14
    # The projected matrix holds the coefficients of the product actually absorbed.
    np.testing.assert_allclose(state.projected[:6, 5], active @ image, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(state.projected[5, :6], state.projected[:6, 5])


def test_state_fed_one_product_at_a_time_matches_dense_truth():
    spectrum = np.concatenate([[5.0, 4.0, 3.9], np.linspace(-2.0, 2.0, 57)])
    matrix = with_spectrum(spectrum, seed=5)
    state = _state(matrix, k=3, ncv=8)  # restarts every few products
    while not state.finished:
        state.absorb(matrix @ state.next_vector())
    values, vectors, bounds, residuals, converged = state.result()
    assert converged.all() and state.spent < 100
    assert np.all(np.abs(values - [5.0, 4.0, 3.9]) <= bounds + 1e-13)
    explicit = np.linalg.norm(matrix @ vectors - vectors * values, axis=0)
    np.testing.assert_allclose(residuals, explicit, rtol=1e-3, atol=1e-12)
    assert 0 < sum(segment.probability for segment in state.segments) <= 1e-4


def test_budget_finishes_the_state_with_an_honest_unconverged_result():
    matrix = with_spectrum(np.linspace(0.0, 1.0, 200), seed=6)  # no gap at the top
    state = _state(matrix, budget=5)
    while not state.finished:
        state.absorb(matrix @ state.next_vector())
    values, _, bounds, _, converged = state.result()
    assert state.spent == 5 and not converged.any()
    assert abs(values[0] - 1.0) <= bounds[0]


def _interval_rule(values, residuals, rest=None):
    """The certified bounds candidate by candidate (see ``certified_bounds``)."""
    bounds = residuals.astype(float).copy()
    for i in range(values.size):
        # Values whose residual intervals overlap this one's, transitively: a cluster.
        members = {i}
        grew = True
        while grew:
            grew = False
            for j in range(values.size):
                if j not in members and any(
                    values[j] - residuals[j] <= values[m] + residuals[m]
                    and values[m] - residuals[m] <= values[j] + residuals[j]
                    for m in members
                ):
                    members.add(j)
                    grew = True
        if len(members) > 1:
            bounds[i] = np.sqrt(sum(residuals[m] ** 2 for m in members))
            continue
        gaps = [
            abs(values[j] - values[i]) - residuals[j] - residuals[i]
            for j in range(values.size)
            if j != i
        ]
        gap = min(gaps, default=np.inf)
        if rest is not None:
            lower, upper = rest
            if values[i] > upper:
                gap = min(gap, values[i] - residuals[i] - upper)
            elif values[i] < lower:
                gap = min(gap, lower - values[i] - residuals[i])
            else:
                gap = 0.0
        if 0 < gap < np.inf:
            bounds[i] = min(residuals[i], residuals[i] ** 2 / gap)
    return bounds


@pytest.mark.parametrize("seed", range(25))
def test_certified_bounds_follow_the_interval_rule(seed):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 12))
    values = np.round(rng.standard_normal(size), 1)  # ties and overlapping intervals
    residuals = rng.choice([0.0, 1e-3, 0.04, 0.3], size=size)
    for rest in (None, (-np.inf, np.inf), (-np.inf, 0.2), (-0.5, np.inf), (-0.3, 0.3)):
        np.testing.assert_allclose(
            certified_bounds(values, residuals, rest),
            _interval_rule(values, residuals, rest),
            rtol=1e-12,
            atol=0.0,
        )


@pytest.mark.parametrize("k, ratio", [(1, 1 / 16), (2, 1 / 2)])
def test_runs_draw_their_shares_of_the_failure_probability(k, ratio):
    # Rank 3 with a double top: a run breaks down once its space is invariant. For k = 1
    # that ends it (its exact pairs bound the rest), so its one run draws 15/16 of the
    # 1e-4; for k = 2 the top is seen once per run, so further runs start orthogonal to
    # what is locked, and run j draws (1 − r)·r^(j−1) with r = 1/2.
    matrix = with_spectrum(np.concatenate([[2.0, 2.0, 1.0], np.zeros(37)]), seed=7)
    state = _state(matrix, k=k)
    while not state.finished:
        state.absorb(matrix @ state.next_vector())
    shares = [segment.probability for segment in state.segments]
    assert len(shares) == k
    expected = 1e-4 * (1.0 - ratio) * ratio ** np.arange(len(shares))
    np.testing.assert_allclose(shares, expected, rtol=1e-12)
    assert sum(shares) <= 1e-4
    values, _, bounds, _, converged = state.result()
    assert converged.all()
    assert np.all(np.abs(values - [2.0, 2.0][:k]) <= bounds + 1e-12)
