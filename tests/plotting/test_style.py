"""The figure style (spectra.plotting.style): no global style change, readable fonts."""

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from spectra.estimators.density import spectral_density
from spectra.estimators.eigensolvers import eigenvalues
from spectra.plotting import (
    plot_eigenvalues,
    plot_loss_landscape_1d,
    plot_loss_landscape_2d,
    plot_sharpness,
    plot_spectral_density,
)

STEPS = np.arange(0, 201, 20)

SHARPNESS = np.array([1.18, 1.64, 5.82, 9.24, 10.21, 10.47, 10.69, 9.51, 9.36, 9.26, 9.11])

TRACES = np.array([30.0, 42, 88, 130, 150, 158, 163, 150, 147, 145, 143])


@pytest.fixture(scope="module")
def matrix() -> np.ndarray:
    """Diagonal: a bulk near zero (a few negative values) and 3 outliers."""
    rng = np.random.default_rng(0)
    bulk = rng.normal(0.05, 0.05, 197)
    return np.diag(np.concatenate([[12.0, 7.0, 4.0], bulk]))


@pytest.fixture(scope="module")
def density(matrix):
    # Gaussian probes: with Rademacher probes every probe of a diagonal matrix
    # sees the same spectral measure, and the band would have zero width.
    return spectral_density(matrix, num_steps=30, num_probes=6, seed=0, distribution="gaussian")


@pytest.fixture(scope="module")
def eigen(matrix):
    return eigenvalues(matrix, k=3)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_no_global_style_change_and_readable_fonts(density, eigen):
    before = dict(matplotlib.rcParams)
    axes = [
        plot_spectral_density(density),
        plot_eigenvalues(eigen),
        plot_sharpness(STEPS, SHARPNESS, lr=0.2, traces=TRACES),
        plot_loss_landscape_1d(np.linspace(-1, 1, 5), {"v": np.arange(5.0)}),
        plot_loss_landscape_2d(np.arange(3.0) - 1, np.arange(4.0) - 1, np.ones((3, 4))),
    ]
    assert dict(matplotlib.rcParams) == before
    for ax in axes:
        ax.figure.draw_without_rendering()
        labels = [ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()]
        assert all(text.get_fontsize() >= 9 for text in labels)
