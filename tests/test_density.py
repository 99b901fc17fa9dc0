import json

import numpy as np
import pytest
from _matrices import BlockOperator, random_symmetric, single_blas_thread, with_spectrum

from spectra.density import negative_mass_fraction, spectral_density
from spectra.results import _gaussian_kernel_sums


@pytest.fixture(autouse=True, scope="module")
def _one_blas_thread():
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
        assert abs(moments.estimate[order] - truth) <= 4 * moments.stderr[order]
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


def test_negative_mass(density, spectrum):
    truth = np.mean(spectrum < 0)
    estimate, stderr = negative_mass_fraction(density)
    assert estimate == density.negative_mass()
    assert abs(estimate - truth) <= 4 * stderr + 0.01
    assert density.negative_mass(eps=100.0) == 0.0
    with pytest.raises(ValueError, match="eps"):
        density.negative_mass(eps=-1.0)


def test_probes_share_one_matmat_per_step(matrix):
    operator = BlockOperator(matrix)
    result = spectral_density(operator, num_steps=20, num_probes=6, seed=2)
    assert operator.matvec_calls == 0
    assert result.num_operator_calls == 1 + 20
    assert result.num_products == 2 + 6 * 20 == operator.columns
    assert result.nodes.shape == result.weights.shape == (6, 20)


def test_breakdown_on_low_rank_matrix():
    spectrum = np.zeros(100)
    spectrum[:3] = [3.0, -2.0, 1.0]
    result = spectral_density(with_spectrum(spectrum, seed=3), num_steps=30, num_probes=5)
    # range(A) plus the probe's null-space part: 4 steps, sometimes one more
    # round-off direction (inside the null space) before beta falls below the threshold
    assert np.all((result.steps_taken >= 4) & (result.steps_taken <= 5))
    assert result.num_products == 2 + result.steps_taken.sum()
    assert np.all(np.isfinite(result.nodes)) and np.all(np.isfinite(result.weights))
    np.testing.assert_allclose(result.weights.sum(axis=1), 1.0, atol=1e-12)
    nodes = np.unique(np.round(result.nodes[result.weights > 1e-14], 10))
    np.testing.assert_allclose(nodes, [-2.0, 0.0, 1.0, 3.0], atol=1e-9)
    assert result.negative_mass(eps=1e-8) > 0
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
