"""What the figure tests of tests/plotting share: a diagonal test matrix (a bulk near zero
and 3 outliers), its SLQ density and top eigenvalues, and every figure closed after each
test. (tests/plotting/test_figures_print.py draws its own results.)"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest

from spectra.estimators.density import spectral_density
from spectra.estimators.eigensolvers import eigenvalues


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
