import json
import time

import numpy as np
import pytest
from _matrices import (
    BlockOperator,
    assert_symmetry_checked_unless_disabled,
    progress_lines,
    random_symmetric,
    single_blas_thread,
    timed_with_defaults,
    with_spectrum,
)
from scipy.sparse.linalg import LinearOperator

from spectra.estimators.density import spectral_density, spectral_mass_below
from spectra.estimators.krylov import lanczos
from spectra.estimators.results import SpectralDensity, _gaussian_kernel_sums
from spectra.estimators.tridiagonal import gauss_quadrature


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with single_blas_thread():
        yield


@pytest.fixture(scope="module")
def spectrum():
    rng = np.random.default_rng(0)
    return np.concatenate([rng.normal(0.0, 1.0, 295), [10.0, 8.0, 7.0, 6.0, 5.0]])


@pytest.fixture(scope="module")
def matrix(spectrum):
    return with_spectrum(spectrum, seed=1)


@pytest.fixture(scope="module")
def density(matrix):
    return spectral_density(matrix, num_steps=80, num_probes=10, seed=0)


def test_quadrature_rows_and_moments(density, matrix, spectrum):
    np.testing.assert_allclose(density.weights.sum(axis=1), 1.0, atol=1e-12)
    moments = density.moments(max_order=2)
    assert moments.estimate[0] == pytest.approx(1.0)
    n = matrix.shape[0]
    for order, truth in ((1, np.trace(matrix) / n), (2, np.trace(matrix @ matrix) / n)):
        # A mean of 10 probes: |error|/stderr is a Student t with 9 degrees of freedom,
        # P(|t| > 6) = 2e-4, so false alarm < 5e-4 over both moments (seed fixed).
        assert abs(moments.estimate[order] - truth) <= 6 * moments.stderr[order]
        assert moments.stderr[order] < 0.1 * np.mean(np.abs(spectrum) ** order)


def test_smoothed_density_close_to_exact_and_normalized(density, spectrum):
    curve = density.density()
    assert curve.sigma == pytest.approx(density.default_sigma())
    assert curve.grid.size >= 1000
    assert np.trapezoid(curve.values, curve.grid) == pytest.approx(1.0, abs=1e-6)
    exact = _gaussian_kernel_sums(
        curve.grid, spectrum[None, :], np.full((1, spectrum.size), 1 / spectrum.size), curve.sigma
    )[0]
    assert np.trapezoid(np.abs(curve.values - exact), curve.grid) < 0.1
    assert np.all(curve.lower <= curve.values) and np.all(curve.values <= curve.upper)
    assert np.all(curve.lower >= 0)
    # a custom grid and wider kernel
    grid = np.linspace(-20, 20, 4001)
    wide = density.density(grid=grid, sigma=1.0)
    assert np.trapezoid(wide.values, grid) == pytest.approx(1.0, abs=1e-6)


def _exact_probe_mass(matrix, probe, threshold):
    """μ_q((−∞, t)) = Σ_j (q·u_j)² [λ_j < t] for the unit probe q."""
    values, vectors = np.linalg.eigh(matrix)
    weights = (vectors.T @ (probe / np.linalg.norm(probe))) ** 2
    return float(weights[values < threshold].sum())


def test_mass_below_brackets_each_probe_measure(matrix, spectrum):
    """Chebyshev–Markov–Stieltjes: the m-node Gauss rule of a probe brackets its own
    spectral measure's mass below any threshold (deterministic, no false alarm)."""
    rng = np.random.default_rng(3)
    probes = rng.choice([-1.0, 1.0], size=(matrix.shape[0], 4))
    for steps in (5, 12, 30):
        rows = [lanczos(matrix, steps, v0=probes[:, p]) for p in range(4)]
        quadratures = [gauss_quadrature(r.alpha, r.beta) for r in rows]
        density = SpectralDensity(
            nodes=np.array([q[0] for q in quadratures]),
            weights=np.array([q[1] for q in quadratures]),
            steps_taken=np.full(4, steps),
            dimension=matrix.shape[0],
            num_products=0,
            num_operator_calls=0,
            wall_time=0.0,
            settings={"num_steps": steps},
        )
        for threshold in (-2.0, -0.5, 0.0, 0.3, 1.7, 6.5):
            mass = density.mass_below(threshold)
            truth = np.mean([_exact_probe_mass(matrix, probes[:, p], threshold) for p in range(4)])
            assert abs(mass.estimate - truth) <= mass.resolution + 1e-12, (steps, threshold)
            assert mass.error >= mass.resolution


def _negative_tail_spectrum(n=400, seed=0):
    """Three outliers, a bulk near 0 and a wide negative tail (about 8% below −0.01·λ₁)."""
    rng = np.random.default_rng(seed)
    bulk = np.concatenate([rng.gamma(0.5, 0.5, n - 3 - n // 4), -rng.gamma(0.5, 0.3, n // 4)])
    return np.concatenate([[20.0, 12.0, 8.0], bulk])


def test_spectral_mass_below_holds_still_when_the_steps_change():
    """A past failure: the negative mass moved far beyond its error bar when the
    Lanczos steps changed. The mass below −τ·λ_max does not: over 20–120 steps (same
    probes) each value moves less than its error bar, and every error bar covers the
    exact spectral mass."""
    spectrum = _negative_tail_spectrum()
    matrix = with_spectrum(spectrum, seed=4)
    tau, lambda_max = 0.01, 20.0
    truth = np.mean(spectrum < -tau * lambda_max)
    assert 0.05 < truth < 0.15
    masses = {}
    for steps in (20, 40, 60, 80, 100, 120):
        density = spectral_density(matrix, num_steps=steps, num_probes=20, seed=7)
        mass = spectral_mass_below(density, tau=tau, lambda_max=lambda_max)
        assert mass.threshold == pytest.approx(-0.2) and mass.tau == tau
        assert mass.error == pytest.approx(mass.resolution + 2 * mass.stderr)
        # Statistical: 20 probes, t with 19 degrees of freedom: P(|t| > 5) < 1e-4 per
        # step count, false alarm < 1e-3 over the six (the resolution part is exact).
        assert abs(mass.estimate - truth) <= mass.resolution + 5 * mass.stderr, steps
        masses[steps] = mass
    for first, a in masses.items():
        for second, b in masses.items():
            # Same probes: both brackets hold the same probe average (deterministic).
            assert abs(a.estimate - b.estimate) <= a.resolution + b.resolution + 1e-12
            if first < second:
                # A value moves less than the error bar of the coarser one.
                assert abs(a.estimate - b.estimate) < a.error, (first, second)
    # More steps resolve more: the quadrature's part of the error bar shrinks.
    assert masses[120].resolution < 0.25 * masses[20].resolution
    # The mass just below 0 is not resolvable by 120 nodes, and the error bar says so.
    density = spectral_density(matrix, num_steps=120, num_probes=20, seed=7)
    at_zero = density.mass_below(0.0)
    assert at_zero.resolution > 5 * at_zero.stderr
    assert abs(at_zero.estimate - np.mean(spectrum < 0)) <= at_zero.error


def test_spectral_mass_below_arguments(density, spectrum):
    mass = spectral_mass_below(density)
    assert mass.tau == 0.01 and mass.lambda_max == pytest.approx(density.nodes.max())
    assert mass.lower <= mass.estimate <= mass.upper
    json.dumps(mass.to_dict())
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="^tau must be"):
            spectral_mass_below(density, tau=bad)
    with pytest.raises(TypeError, match="^tau must be a number"):
        spectral_mass_below(density, tau=True)
    with pytest.raises(ValueError, match="lambda_max"):
        spectral_mass_below(density, lambda_max=-1.0)
    below = density.mass_below(-0.5)
    truth = np.mean(spectrum < -0.5)
    assert abs(below.estimate - truth) <= below.resolution + 5 * below.stderr


def test_probes_share_one_matmat_per_step(matrix):
    operator = BlockOperator(matrix)
    result = spectral_density(operator, num_steps=20, num_probes=6, seed=2)
    assert operator.matvec_calls == 0
    assert result.num_operator_calls == 20
    assert result.num_products == 6 * 20 == operator.columns
    assert result.nodes.shape == result.weights.shape == (6, 20)


def test_breakdown_on_low_rank_matrix():
    spectrum = np.zeros(100)
    spectrum[:3] = [3.0, -2.0, 1.0]
    result = spectral_density(with_spectrum(spectrum, seed=3), num_steps=30, num_probes=5)
    # range(A) plus the probe's null-space part: 4 steps, sometimes one more
    # round-off direction (inside the null space) before beta falls below the threshold
    assert np.all((result.steps_taken >= 4) & (result.steps_taken <= 5))
    assert result.num_products == result.steps_taken.sum()
    assert np.all(np.isfinite(result.nodes)) and np.all(np.isfinite(result.weights))
    np.testing.assert_allclose(result.weights.sum(axis=1), 1.0, atol=1e-12)
    nodes = np.unique(np.round(result.nodes[result.weights > 1e-14], 10))
    np.testing.assert_allclose(nodes, [-2.0, 0.0, 1.0, 3.0], atol=1e-9)
    # exact quadrature (invariant Krylov spaces): the mass below 0 is exact, 1/100
    exact = result.mass_below(-1e-8)
    assert exact.resolution == 0.0
    assert 0 < exact.estimate <= exact.upper
    zero = spectral_density(np.zeros((20, 20)), num_steps=5, num_probes=3)
    assert np.all(zero.steps_taken == 1)
    curve = zero.density()
    assert np.trapezoid(curve.values, curve.grid) == pytest.approx(1.0, abs=1e-6)


def test_reproducibility_and_options(matrix):
    first = spectral_density(matrix, num_steps=15, num_probes=3, seed=5)
    again = spectral_density(matrix, num_steps=15, num_probes=3, seed=5)
    other = spectral_density(matrix, num_steps=15, num_probes=3, seed=6)
    np.testing.assert_array_equal(first.nodes, again.nodes)
    np.testing.assert_array_equal(first.weights, again.weights)
    assert not np.array_equal(first.nodes, other.nodes)
    gaussian = spectral_density(matrix, num_steps=15, num_probes=3, distribution="gaussian")
    np.testing.assert_allclose(gaussian.weights.sum(axis=1), 1.0, atol=1e-12)
    single = spectral_density(random_symmetric(30), num_steps=10, num_probes=1)
    curve = single.density()
    np.testing.assert_array_equal(curve.lower, curve.values)
    text = json.dumps(first.to_dict())
    assert json.loads(text)["settings"]["num_probes"] == 3


def test_invalid_arguments(matrix):
    with pytest.raises(ValueError, match="num_steps"):
        spectral_density(matrix, num_steps=0)
    with pytest.raises(ValueError, match="num_probes"):
        spectral_density(matrix, num_probes=0)
    with pytest.raises(ValueError, match="'rademacher', 'gaussian'"):
        spectral_density(matrix, distribution="uniform")
    with pytest.raises(ValueError, match="operator is not symmetric"):
        spectral_density(np.triu(np.ones((8, 8))))
    density = spectral_density(matrix, num_steps=5, num_probes=2)
    with pytest.raises(ValueError, match="sigma"):
        density.density(sigma=0.0)
    with pytest.raises(ValueError, match="max_order"):
        density.moments(max_order=-1)


# -- contracts that mutation testing (make mutate) found untested -------------------------
def test_defaults_settings_time_and_messages(matrix):
    small = random_symmetric(90, seed=15)
    result = timed_with_defaults(spectral_density, small, num_probes=2)
    assert result.nodes.shape == (2, 80)  # the default of 80 steps
    assert result.settings == {
        "num_steps": 80,
        "num_probes": 2,
        "distribution": "rademacher",
        "seed": 0,
        "check_symmetry": True,
    }
    with pytest.raises(ValueError, match=r"^num_steps must be an integer >= 1, got 0$"):
        spectral_density(matrix, num_steps=0)
    with pytest.raises(ValueError, match=r"^num_probes must be an integer >= 1, got 0$"):
        spectral_density(matrix, num_probes=0)
    with pytest.raises(ValueError, match=r"^distribution must be one of .*, got 'uniform'$"):
        spectral_density(matrix, distribution="uniform")
    assert_symmetry_checked_unless_disabled(spectral_density, num_steps=3, num_probes=2)


class _SlowOperator(BlockOperator):
    """Products that take long enough for the progress bar to show every step."""

    def _matmat(self, x):
        time.sleep(0.12)
        return super()._matmat(x)


def test_progress_bar_names_the_estimator_and_counts_every_step(capsys):
    spectral_density(_SlowOperator(random_symmetric(20, seed=16)), 3, 2, progress=True)
    lines = progress_lines(capsys)
    assert lines[0].startswith("spectral density: ") and "0/6" in lines[0]
    # The bar advances with the steps (2 products each), not only at the end.
    assert any("2/6" in line or "4/6" in line for line in lines), lines


def test_mass_below_needs_a_positive_lambda_max():
    zero = spectral_density(np.zeros((10, 10)), num_steps=3, num_probes=2)
    with pytest.raises(ValueError, match=r"needs λ_max > 0; the largest node is 0"):
        spectral_mass_below(zero)
    # λ_max below 1 is fine: the rule is about its sign, not its size.
    small = spectral_density(0.5 * np.diag([1.0, -1.0, 0.2, 0.1]), num_steps=4, num_probes=3)
    mass = spectral_mass_below(small, tau=0.5)
    assert mass.lambda_max == pytest.approx(0.5) and mass.threshold == pytest.approx(-0.25)
    assert mass.estimate == pytest.approx(0.25)  # exactly one of four eigenvalues, -0.5
    with pytest.raises(ValueError, match=r"^tau must be a positive finite number, got 0"):
        spectral_mass_below(small, tau=0.0)
    with pytest.raises(ValueError, match=r"^lambda_max must be a positive finite number"):
        spectral_mass_below(small, lambda_max=-1.0)


class _ClaimsPSD(LinearOperator):
    """A float32 Gauss-Newton-like Jᵀ(J v) (rank 20 of 60: singular) that says it is PSD,
    as GGNOperator, FisherOperator and K-FAC do."""

    is_positive_semidefinite = True

    def __init__(self, matrix):
        self.matrix = matrix.astype(np.float32)
        super().__init__(dtype=np.float32, shape=matrix.shape)

    def _matvec(self, v):
        return self.matrix @ v.astype(np.float32)

    def _matmat(self, block):
        return self.matrix @ block.astype(np.float32)


def _singular_gauss_newton():
    jacobian = np.random.default_rng(0).standard_normal((20, 60))
    return jacobian.T @ jacobian / 20


def test_a_psd_operator_gets_a_psd_density():
    """Before: the same density as for any matrix: the smoothed curve put 0.30 of its mass
    below 0 and spectral_mass_below gave 0.31 ± 0.36 for a PSD matrix (the bracket puts
    up to the null space's weight 2/3 below any negative threshold). Truth: 0."""
    matrix = _singular_gauss_newton()
    plain = spectral_density(matrix.astype(np.float32), num_steps=10, num_probes=6, seed=1)
    assert not plain.positive_semidefinite
    assert spectral_mass_below(plain).estimate > 0.1  # the bracket cannot see PSD
    density = spectral_density(_ClaimsPSD(matrix), num_steps=10, num_probes=6, seed=1)
    assert density.positive_semidefinite and density.settings["positive_semidefinite_claimed"]
    assert density.nodes.min() >= 0.0
    # clipping moved nodes by rounding only: the same nodes as the plain run, to float32
    np.testing.assert_allclose(density.nodes, np.maximum(plain.nodes, 0), atol=1e-4)
    mass = spectral_mass_below(density)
    assert (mass.estimate, mass.error, mass.upper) == (0.0, 0.0, 0.0)
    assert density.mass_below(0.0).estimate == 0.0
    # above 0 the bracket still works: the null space's weight 2/3 sits at 0
    half = density.mass_below(0.01 * np.linalg.eigvalsh(matrix)[-1])
    assert abs(half.estimate - 40 / 60) <= half.error
    curve = density.density()
    assert curve.grid.min() >= 0.0
    below = density.density(grid=np.linspace(-1.0, -1e-9, 50))
    np.testing.assert_array_equal(below.values, 0.0)
    # reflected, not truncated: the curve still integrates to 1 on [0, ∞)
    assert np.trapezoid(curve.values, curve.grid) == pytest.approx(1.0, abs=2e-3)
    restored = type(density).from_dict(density.to_dict())
    assert restored.positive_semidefinite


def test_a_psd_claim_contradicted_by_a_negative_ritz_value_is_not_applied():
    matrix = _singular_gauss_newton() - 0.5 * np.eye(60)
    density = spectral_density(_ClaimsPSD(matrix), num_steps=30, num_probes=4, seed=1)
    assert not density.positive_semidefinite and density.nodes.min() < -0.4
    assert "negative eigenvalue" in density.settings["positive_semidefinite_note"]


def test_a_singular_ggn_operator_gets_a_psd_density():
    """A GGN of 3 examples (rank 6 of 31 parameters): GGNOperator and FisherOperator say
    ``is_positive_semidefinite``, so the density has no mass below 0 (truth: none)."""
    keras = pytest.importorskip("keras")
    from spectra.operators import FisherOperator, GGNOperator

    assert GGNOperator.is_positive_semidefinite and FisherOperator.is_positive_semidefinite
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    data = (rng.standard_normal((3, 3)).astype("float32"), rng.integers(0, 3, 3))
    op = GGNOperator.from_keras(model, "sparse_categorical_crossentropy", data)
    density = spectral_density(op, num_steps=4, num_probes=4, seed=0)
    assert density.positive_semidefinite and density.nodes.min() >= 0.0
    mass = spectral_mass_below(density)
    assert (mass.estimate, mass.error) == (0.0, 0.0)
