"""spectra.logdet (SLQ log-determinant) and spectra.log_spectral_density (the SLQ density of
log10|λ + shift|), against dense eigenvalues. The coverage of logdet's error bar over many
seeds is in tests/truths/test_log_determinant_coverage.py."""

from __future__ import annotations

import numpy as np
import pytest
from _matrices import random_symmetric, with_spectrum
from scipy.sparse.linalg import LinearOperator

import spectra
from spectra.estimators.density import log_spectral_density, spectral_density
from spectra.estimators.log_determinant import logdet
from spectra.estimators.results import LogDetResult, LogSpectralDensity, load

N = 100


@pytest.fixture(scope="module")
def spd():
    """Eigenvalues uniform in [0.5, 5] (κ = 10: 15 Lanczos steps make the quadrature
    bias ((√κ − 1)/(√κ + 1))^30 ≈ 3e-9, negligible)."""
    eigenvalues = np.random.default_rng(1).uniform(0.5, 5.0, N)
    return with_spectrum(eigenvalues, seed=3), eigenvalues


@pytest.fixture(scope="module")
def decades():
    """120 eigenvalues log-uniform over six decades, 1e-4 to 1e2."""
    eigenvalues = 10 ** np.random.default_rng(5).uniform(-4.0, 2.0, 120)
    return with_spectrum(eigenvalues, seed=6), eigenvalues


def test_logdet_against_the_dense_truth(spd):
    matrix, eigenvalues = spd
    for damping in (0.0, 0.3):
        truth = float(np.sum(np.log(eigenvalues + damping)))
        result = logdet(matrix, damping=damping, num_probes=40, num_steps=15, seed=2)
        # 4 standard errors: a false alarm below 1e-4 for a calibrated error bar.
        assert abs(result.estimate - truth) <= 4 * result.stderr, (damping, result, truth)
        assert result.stderr <= 0.02 * abs(truth)  # an error bar that could catch a bug
        assert result.num_products == 40 * 15 and result.num_operator_calls == 15
        assert result.damping == damping and result.dimension == N
        assert result.min_ritz_value >= eigenvalues.min() + damping - 1e-9
        np.testing.assert_allclose(result.per_probe.mean(), result.estimate)
        assert result.settings["seed"] == 2 and result.settings["num_steps"] == 15


def test_logdet_damping_is_a_shift_of_the_nodes(spd):
    matrix, _ = spd
    shifted = logdet(matrix + 0.3 * np.eye(N), num_probes=5, num_steps=15, seed=4)
    damped = logdet(matrix, damping=0.3, num_probes=5, num_steps=15, seed=4)
    np.testing.assert_allclose(damped.per_probe, shifted.per_probe, rtol=1e-10)


def test_logdet_of_the_identity_and_at_both_ends_of_floating_point(spd):
    exact = logdet(np.eye(7), num_probes=2, num_steps=3)
    assert exact.estimate == pytest.approx(0.0, abs=1e-12) and exact.stderr == 0.0
    matrix, _ = spd
    base = logdet(matrix, num_probes=4, num_steps=10, seed=1)
    for factor in (2.0**-900, 2.0**900):
        scaled = logdet(matrix * factor, num_probes=4, num_steps=10, seed=1)
        # log det(sA) = n log s + log det A
        assert scaled.estimate == pytest.approx(base.estimate + N * np.log(factor), rel=1e-12)


def test_logdet_refuses_a_matrix_that_is_not_positive_definite(spd):
    matrix, eigenvalues = spd
    indefinite = random_symmetric(N, seed=2)
    with pytest.raises(
        ValueError,
        match=r"logdet: C \+ λI is not positive definite: it has a Ritz value -1\.\d+ <= 0 "
        r"\(damping 0\.05; Ritz values lie within the spectrum\), so its log det is not "
        r"real: use a damping above 1\.\d+",
    ):
        logdet(indefinite, damping=0.05, num_steps=20)
    # Shifted just below its smallest eigenvalue an SPD matrix is refused too.
    with pytest.raises(ValueError, match="not positive definite"):
        logdet(matrix - (eigenvalues.min() + 0.01) * np.eye(N), num_steps=N, num_probes=2)


def test_logdet_single_probe_and_round_trip(spd, tmp_path):
    matrix, _ = spd
    single = logdet(matrix, num_probes=1, num_steps=10)
    assert np.isnan(single.stderr)
    path = tmp_path / "logdet.json"
    single.to_json(path)
    loaded = load(path)
    assert isinstance(loaded, LogDetResult) and np.isnan(loaded.stderr)
    assert loaded.estimate == single.estimate
    assert loaded.steps_taken.dtype == np.int64
    assert spectra.logdet is logdet


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"damping": -0.1}, ValueError, r"damping must be >= 0"),
        ({"damping": None}, TypeError, "damping must be a number"),
        ({"num_probes": 0}, ValueError, "num_probes must be an integer >= 1, got 0"),
        ({"num_steps": 2.5}, TypeError, "num_steps must be an integer"),
        ({"distribution": "uniform"}, ValueError, "distribution must be one of"),
        ({"seed": -1}, ValueError, "seed must be a non-negative integer"),
        ({"progress": "yes"}, TypeError, "progress must be None, True or False"),
    ],
)
def test_logdet_arguments_are_checked(spd, kwargs, error, message):
    matrix, _ = spd
    with pytest.raises(error, match=message):
        logdet(matrix, **kwargs)


# -- the log-spectrum ------------------------------------------------------------------
def test_log_moments_match_the_dense_eigenvalues(decades):
    """With n steps each probe's quadrature is exact, so the moments of the log-nodes are
    unbiased estimates of the mean of log10(λ)^p: within 4 standard errors."""
    matrix, eigenvalues = decades
    density = log_spectral_density(matrix, num_steps=120, num_probes=20, seed=0)
    assert isinstance(density, LogSpectralDensity) and not density.folded
    moments = density.moments(3)
    exact = np.array([np.mean(np.log10(eigenvalues) ** p) for p in range(4)])
    assert np.all(np.abs(moments.estimate - exact) <= 4 * moments.stderr + 1e-12), (
        moments.estimate,
        exact,
    )
    assert np.all(moments.stderr[1:] <= 0.1 * np.abs(exact[1:]))
    # The same Lanczos run as spectral_density: its nodes, transformed.
    base = spectral_density(matrix, num_steps=120, num_probes=20, seed=0)
    np.testing.assert_allclose(np.sort(np.log10(base.nodes), axis=1), density.nodes)
    assert density.num_products == base.num_products


def test_log_mass_below_brackets_the_dense_histogram(decades):
    """With fewer steps than n, the cumulative histogram of log10 λ at each threshold lies
    within mass_below's error bar (a monotone transform keeps Gauss's bracket)."""
    matrix, eigenvalues = decades
    density = log_spectral_density(matrix, num_steps=50, num_probes=20, seed=1)
    for threshold in (-3.0, -2.0, -1.0, 0.0, 1.0):
        mass = density.mass_below(threshold)
        exact = float(np.mean(np.log10(eigenvalues) < threshold))
        assert abs(mass.estimate - exact) <= mass.error, (threshold, mass, exact)
    curve = density.density()
    assert abs(np.trapezoid(curve.values, curve.grid) - 1.0) < 1e-3
    assert curve.grid.min() < -3.0 and curve.grid.max() > 2.0


def test_folded_log_spectrum_of_an_indefinite_matrix():
    matrix = random_symmetric(80, seed=2)
    eigenvalues = np.linalg.eigvalsh(matrix)
    density = log_spectral_density(matrix, num_steps=80, num_probes=20, seed=0)
    assert density.folded
    moments = density.moments(2)
    exact = np.array([np.mean(np.log10(np.abs(eigenvalues)) ** p) for p in range(3)])
    assert np.all(np.abs(moments.estimate - exact) <= 4 * moments.stderr + 1e-12)
    with pytest.raises(ValueError, match="has no bracket"):
        density.mass_below(0.0)
    # A shift that makes the spectrum positive unfolds it.
    shifted = log_spectral_density(matrix, num_steps=80, num_probes=4, shift=2.0)
    assert not shifted.folded and shifted.shift == 2.0
    shifted.mass_below(0.0)


def test_floor_and_round_trip(tmp_path):
    low_rank = with_spectrum(np.r_[np.ones(3), np.zeros(7)], seed=1)
    density = log_spectral_density(low_rank, num_steps=10, num_probes=3, floor=1e-8)
    assert density.nodes.min() >= -8.0 and density.floor == 1e-8
    # the weight of the null space's node (0.7 on average over probes)
    at_floor = (density.weights * (density.nodes == -8.0)).sum(axis=1).mean()
    assert density.floored_mass == pytest.approx(at_floor) and 0.4 < at_floor < 1.0
    path = tmp_path / "log.json"
    density.to_json(path)
    loaded = load(path)
    assert isinstance(loaded, LogSpectralDensity)
    assert loaded.floored_mass == density.floored_mass and loaded.folded is False
    with pytest.raises(ValueError, match="every node λ \\+ shift is 0"):
        log_spectral_density(np.zeros((4, 4)), num_steps=3, num_probes=2)
    with pytest.raises(ValueError, match="floor must be a positive finite number"):
        log_spectral_density(low_rank, floor=0.0)
    with pytest.raises(TypeError, match="shift must be a number"):
        log_spectral_density(low_rank, shift="1")
    assert spectra.log_spectral_density is log_spectral_density


def test_logdet_names_a_singular_psd_matrix_singular_and_its_damping_works():
    """The reviewer's U Uᵀ/30 (rank 10 of 30): a Ritz value −4.4e-16 is rounding, not
    indefiniteness; the suggested damping (1e-8·λ_max) is then accepted."""
    rng = np.random.default_rng(0)
    u = rng.standard_normal((30, 10))
    matrix = u @ u.T / 30
    with pytest.raises(ValueError, match=r"singular \(or numerically so\)") as info:
        logdet(matrix, 0.0)
    message = str(info.value)
    assert "not positive definite" not in message and "−∞" in message
    top = np.linalg.eigvalsh(matrix)[-1]
    suggested = float(message.split("damping ≳ ")[1])
    assert suggested == pytest.approx(1e-8 * top, rel=1e-2)
    # Before: "use a damping above 4.37e-16", and that damping was refused again.
    result = logdet(matrix, suggested)
    truth = np.sum(np.log(np.clip(np.linalg.eigvalsh(matrix), 0, None) + suggested))
    assert abs(result.estimate - truth) <= 4 * result.stderr
    # A damping at the rounding level of λ_max is refused the same way.
    with pytest.raises(ValueError, match=r"singular \(or numerically so\)"):
        logdet(matrix, 1e-15)


class _Float32GaussNewton(LinearOperator):
    """Jᵀ(J v) computed in float32 for a 20 × 50 J: a GGN of rank 20 in 50 parameters,
    exactly singular, whose products carry float32 rounding."""

    def __init__(self, jacobian: np.ndarray):
        self.jacobian = jacobian.astype(np.float32)
        super().__init__(dtype=np.float32, shape=(jacobian.shape[1],) * 2)

    def _matvec(self, v):
        return self.jacobian.T @ (self.jacobian @ v.astype(np.float32))

    def _matmat(self, block):
        return self.jacobian.T @ (self.jacobian @ block.astype(np.float32))


@pytest.mark.parametrize("num_steps", [10, 40])
def test_logdet_of_a_singular_float32_operator_is_refused_and_the_advice_works(num_steps):
    """Before: −139.2 ± 13.7 (10 steps) for an exactly singular float32 GGN: its smallest
    Ritz value 1.5e-4 was far above float64's rounding (100·eps64·λ_max = 3e-12) but at
    float32's (100·eps32·λ_max = 1.6e-3); with 40 steps a node −2.9e-6 (float32 rounding)
    was called indefinite. Both are now "singular" with a damping that works."""
    jacobian = np.random.default_rng(0).standard_normal((20, 50))
    op = _Float32GaussNewton(jacobian)
    with pytest.raises(ValueError, match=r"singular \(or numerically so\).*float32") as info:
        logdet(op, num_steps=num_steps)
    message = str(info.value)
    assert "not positive definite" not in message and "−∞" in message
    suggested = float(message.split("damping ≳ ")[1])
    matrix = op.jacobian.T.astype(np.float64) @ op.jacobian.astype(np.float64)
    top = np.linalg.eigvalsh(matrix)[-1]
    # above float32's rounding level (100·eps32·λ_max), not float64's 1e-8·λ_max
    assert suggested > 100 * np.finfo(np.float32).eps * top
    result = logdet(op, suggested, num_steps=60, num_probes=30, seed=1)
    truth = np.sum(np.log(np.clip(np.linalg.eigvalsh(matrix), 0, None) + suggested))
    assert abs(result.estimate - truth) <= 4 * result.stderr + 1e-3 * abs(truth)
