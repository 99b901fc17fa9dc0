"""Property-based tests of the estimators over generated symmetric matrices.

Sizes 1–60 with spread, clustered, exactly repeated, indefinite, low-rank and zero
spectra, at scales 1e-3 to 1e3. The "ci" profile (the default) runs a small,
derandomized set of examples so that the suite stays fast and deterministic;
``HYPOTHESIS_PROFILE=dev`` explores many more.
"""

from __future__ import annotations

import os

import numpy as np
from _matrices import in_which_order, with_spectrum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spectra.estimators.density import spectral_density
from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.krylov import lanczos
from spectra.estimators.tridiagonal import gauss_quadrature

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=500, deadline=None, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

KINDS = ("spread", "clustered", "repeated", "indefinite", "low-rank", "zero")
# Requested failure probability of the eigenvalue statements in these tests: a false
# alarm of the bound property needs a 1e-9 event in one of at most 500 examples.
FAILURE_PROBABILITY = 1e-9


def spectrum_of(kind: str, n: int, seed: int, scale: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "spread":
        values = rng.uniform(-1.0, 1.0, n)
    elif kind == "clustered":
        centers = rng.uniform(-1.0, 1.0, max(1, n // 8))
        values = rng.choice(centers, n) + rng.uniform(-1e-7, 1e-7, n)
    elif kind == "repeated":
        values = rng.choice(rng.uniform(-1.0, 1.0, max(1, n // 5)), n)
    elif kind == "indefinite":
        values = np.concatenate([[1.0, -0.9], rng.normal(0.0, 0.1, n)])[:n]
    elif kind == "low-rank":
        values = np.zeros(n)
        values[: min(n, 3)] = rng.uniform(-1.0, 1.0, min(n, 3))
    else:
        values = np.zeros(n)
    return scale * values


matrices = st.builds(
    lambda kind, n, seed, scale: (kind, spectrum_of(kind, n, seed, scale), seed),
    st.sampled_from(KINDS),
    st.integers(1, 60),
    st.integers(0, 2**16),
    st.sampled_from([1e-3, 1.0, 1e3]),
)


@given(matrices, st.sampled_from(["largest", "smallest", "magnitude"]), st.integers(1, 3))
def test_eigenvalues_match_eigh_within_their_bounds(case, which, k):
    kind, spectrum, seed = case
    matrix = with_spectrum(spectrum, seed)
    k = min(k, spectrum.size)
    result = eigenvalues(
        matrix, k=k, which=which, tol=1e-6, seed=seed, failure_probability=FAILURE_PROBABILITY
    )
    assert result.all_converged, (kind, which)
    truth = in_which_order(np.linalg.eigvalsh(matrix), which)[:k]
    slack = 1e-12 * max(1.0, float(np.abs(spectrum).max(initial=0.0)))
    if which == "magnitude":
        errors = np.abs(np.abs(result.eigenvalues) - np.abs(truth))
    else:
        errors = np.abs(result.eigenvalues - truth)
    assert np.all(errors <= result.error_bounds + slack), (kind, which, errors)
    nearest = np.min(np.abs(np.linalg.eigvalsh(matrix)[None, :] - result.eigenvalues[:, None]), 1)
    assert np.all(nearest <= result.error_bounds + slack)
    assert result.failure_probability <= FAILURE_PROBABILITY
    # LOBPCG's bounds hold for some eigenvalue (it makes no claim about which).
    block = eigenvalues(matrix, k=k, which=which, tol=1e-6, method="lobpcg", seed=seed)
    nearest = np.min(np.abs(np.linalg.eigvalsh(matrix)[None, :] - block.eigenvalues[:, None]), 1)
    assert np.all(nearest[block.converged] <= block.error_bounds[block.converged] + slack)


@given(matrices, st.integers(1, 40))
def test_lanczos_basis_is_orthonormal_and_reduces_the_matrix(case, steps):
    _, spectrum, seed = case
    matrix = with_spectrum(spectrum, seed)
    result = lanczos(matrix, steps, return_basis=True, seed=seed)
    q = result.basis
    m = result.num_steps_taken
    assert q.shape == (spectrum.size, m) and m <= min(steps, spectrum.size)
    assert np.abs(q.T @ q - np.eye(m)).max() < 1e-10
    scale = max(float(np.abs(spectrum).max(initial=0.0)), 1e-300)
    assert np.abs(q.T @ matrix @ q - result.tridiagonal()).max() <= 1e-10 * scale


@given(matrices, st.integers(1, 12))
def test_gauss_quadrature_reproduces_the_probe_moments(case, steps):
    """m Lanczos steps from q give Σ w θ^p = qᵀA^p q for every p < 2m (exactly, up to
    rounding), the identity that makes SLQ moments estimates of tr(A^p)/n."""
    _, spectrum, seed = case
    matrix = with_spectrum(spectrum, seed)
    probe = np.random.default_rng(seed).choice([-1.0, 1.0], spectrum.size)
    probe /= np.linalg.norm(probe)
    result = lanczos(matrix, steps, v0=probe)
    nodes, weights = gauss_quadrature(result.alpha, result.beta)
    scale = max(float(np.abs(spectrum).max(initial=0.0)), 1e-300)
    power = probe.copy()
    exact = result.breakdown or result.num_steps_taken == spectrum.size
    for p in range(2 * result.num_steps_taken if not exact else 8):
        expected = float(probe @ power)
        estimate = float(np.sum(weights * nodes**p))
        assert abs(estimate - expected) <= 1e-9 * scale**p * max(1, p), p
        power = matrix @ power


@given(matrices)
def test_slq_moments_estimate_traces_of_powers(case):
    kind, spectrum, seed = case
    matrix = with_spectrum(spectrum, seed)
    density = spectral_density(matrix, num_steps=10, num_probes=30, seed=seed)
    moments = density.moments(max_order=4)
    n = spectrum.size
    scale = max(float(np.abs(spectrum).max(initial=0.0)), 1e-300)
    for p in range(5):
        truth = float(np.sum(np.linalg.eigvalsh(matrix) ** p)) / n
        # Mean of 30 independent probe estimates: |t| > 6 has probability below 1e-6
        # (t with 29 degrees of freedom), far below 1e-3 over 500 examples.
        tolerance = 6 * moments.stderr[p] + 1e-9 * scale**p
        assert abs(moments.estimate[p] - truth) <= tolerance, (kind, p)
