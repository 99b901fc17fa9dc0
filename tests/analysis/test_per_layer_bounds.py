"""``layerwise`` states only what is proven, per group, as ``eigenvalues`` does.

The matrix couples three groups whose diagonal blocks have known, hard spectra (a
clustered top, a small gap, a repeated top); numpy's ``eigvalsh`` of each block is the
truth. Every converged value must lie within its bound of an eigenvalue of its block
(certified) and of the block's i-th largest eigenvalue except with the stated failure
probability (the probabilistic part).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _matrices import (
    clustered_top_spectrum,
    repeated_top_spectrum,
    single_blas_thread,
    small_gap_spectrum,
    with_spectrum,
)

import spectra

# With 12 seeds · 3 tolerances · 2 values of k = 72 runs of 3 groups, the chance that
# any group's bound legitimately fails (a false alarm of this test) is below
# 72 · 1e-6 < 1e-3 (each run's failure probability covers all of its groups). Before
# the groups shared the Krylov–Schur state of ``eigenvalues``, 29 of the 60 top values
# converged at tol 0.1 (k = 1, 20 seeds) were off the true one by more than their bound.
TEST_FAILURE_PROBABILITY = 1e-6
SEEDS = range(12)
TOLERANCES = (0.1, 1e-2, 1e-6)


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with single_blas_thread():
        yield


@pytest.fixture(scope="module")
def coupled_blocks():
    """A 120 × 120 symmetric matrix: three diagonal blocks with known spectra on
    interleaved indices, coupled by a random off-diagonal part the blocks ignore."""
    sizes = (50, 40, 30)
    spectra_ = [
        clustered_top_spectrum(sizes[0], seed=1),
        small_gap_spectrum(sizes[1], seed=2),
        repeated_top_spectrum(sizes[2], seed=3),
    ]
    n = sum(sizes)
    rng = np.random.default_rng(0)
    coupling = rng.standard_normal((n, n))
    matrix = coupling + coupling.T
    order = rng.permutation(n)
    groups, at = {}, 0
    for index, (size, spectrum) in enumerate(zip(sizes, spectra_)):
        part = np.sort(order[at : at + size])
        at += size
        matrix[np.ix_(part, part)] = with_spectrum(spectrum, seed=10 + index)
        groups[f"g{index}"] = part
    return matrix, groups, [np.sort(s)[::-1] for s in spectra_]


@pytest.mark.parametrize("k", [1, 2])
def test_converged_values_lie_within_their_bounds(coupled_blocks, k):
    matrix, groups, truths = coupled_blocks
    converged = within_some = within_ith = 0
    for tol in TOLERANCES:
        for seed in SEEDS:
            result = spectra.layerwise(
                matrix,
                k=k,
                groups=groups,
                tol=tol,
                seed=seed,
                failure_probability=TEST_FAILURE_PROBABILITY,
            )
            assert 0 < result.failure_probability <= TEST_FAILURE_PROBABILITY
            for values, bounds, flags, truth in zip(
                result.eigenvalues, result.error_bounds, result.converged, truths
            ):
                for i in np.flatnonzero(flags):
                    slack = 1e-12 * max(1.0, abs(values[i]))
                    converged += 1
                    within_some += np.min(np.abs(truth - values[i])) <= bounds[i] + slack
                    within_ith += abs(truth[i] - values[i]) <= bounds[i] + slack
    # Every group converges on these spectra.
    assert converged == len(TOLERANCES) * len(SEEDS) * 3 * k
    assert within_some == converged
    assert within_ith == converged


def test_one_group_agrees_with_eigenvalues(coupled_blocks):
    matrix, _, _ = coupled_blocks
    everything = {"all": np.arange(matrix.shape[0])}
    per_group = spectra.layerwise(matrix, k=3, groups=everything, tol=1e-10, seed=4)
    whole = spectra.eigenvalues(matrix, k=3, tol=1e-10, seed=4)
    exact = np.linalg.eigvalsh(matrix)[::-1][:3]
    assert per_group.all_converged and whole.converged.all()
    for values, bounds in (
        (per_group.eigenvalues[0], per_group.error_bounds[0]),
        (whole.eigenvalues, whole.error_bounds),
    ):
        assert np.all(np.abs(values - exact) <= bounds + 1e-12)
    np.testing.assert_allclose(per_group.eigenvalues[0], whole.eigenvalues, rtol=1e-9)


def test_failure_probability_is_reported_and_serialized(coupled_blocks):
    matrix, groups, _ = coupled_blocks
    result = spectra.layerwise(matrix, groups=groups, tol=1e-6, seed=0)
    # Three groups share the default 1e-4; a group that needs no second run uses half
    # of its share.
    assert 0 < result.failure_probability <= 1e-4
    decoded = json.loads(result.to_json())
    assert decoded["failure_probability"] == pytest.approx(result.failure_probability)
    assert decoded["settings"]["failure_probability"] == 1e-4
    with pytest.raises(ValueError, match="failure_probability must be"):
        spectra.layerwise(matrix, groups=groups, failure_probability=1.0)
