"""Eigenvalue figures (spectra.plotting.eigenvalues) from real estimator results: scales, error
bars, unconverged values, input checks."""

import dataclasses

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")


from _figure_helpers import _legend_texts

from spectra.plotting import (
    plot_eigenvalues,
)


def test_eigenvalues_against_index(eigen):
    ax = plot_eigenvalues(eigen)
    assert ax.get_xlabel() == "Eigenvalue index i"
    assert ax.get_ylabel() == "Eigenvalue λᵢ"
    (container,) = ax.containers
    x, y = container.lines[0].get_data()
    np.testing.assert_array_equal(x, [1, 2, 3])
    np.testing.assert_allclose(y, [12.0, 7.0, 4.0], rtol=1e-8)
    ticks = [tick for tick in ax.get_xticks() if ax.get_xlim()[0] <= tick <= ax.get_xlim()[1]]
    assert ticks and all(float(tick).is_integer() for tick in ticks)
    # The bars (bounds ~1e-13 of λ) are invisible: the legend says so, with their size.
    (text,) = _legend_texts(ax)
    largest = float(np.max(eigen.error_bounds))
    assert text == f"λᵢ ± error bound; bars smaller than the markers, at most ±{largest:.1e}"
    # Each value is written beside its marker, to the 6 significant digits a label holds at
    # most (bounds ~1e-13 would allow more), trailing zeros kept.
    assert [t.get_text() for t in ax.texts] == ["12.0000", "7.00000", "4.00000"]


def test_eigenvalues_log_scale(eigen):
    ax = plot_eigenvalues(eigen, log_scale=True)
    assert ax.get_yscale() == "log"
    assert ax.get_ylabel() == "Eigenvalue λᵢ (log scale)"
    negative = dataclasses.replace(eigen, eigenvalues=np.array([3.0, 0.5, -2.0]))
    assert plot_eigenvalues(negative, log_scale=True).get_yscale() == "symlog"


def test_eigenvalues_error_bars_and_unconverged_hollow(eigen):
    result = dataclasses.replace(
        eigen,
        converged=np.array([True, True, False]),
        error_bounds=np.array([0.5, np.nan, 1.5]),
        residual_norms=np.array([0.1, 0.25, 0.2]),
    )
    ax = plot_eigenvalues(result, label="top-3")
    filled, hollow = ax.containers
    assert filled.lines[0].get_markerfacecolor() != "none"
    assert hollow.lines[0].get_markerfacecolor() == "none"
    filled_bars = filled.lines[2][0].get_segments()
    half_heights = [abs(seg[1][1] - seg[0][1]) / 2 for seg in filled_bars]
    # The missing bound of the second eigenvalue falls back to its residual norm.
    np.testing.assert_allclose(half_heights, [0.5, 0.25])
    (hollow_bar,) = hollow.lines[2][0].get_segments()
    assert abs(hollow_bar[1][1] - hollow_bar[0][1]) / 2 == pytest.approx(1.5)
    # Visible bars: no note.
    assert _legend_texts(ax) == [
        "top-3: λᵢ ± error bound (converged)",
        "top-3: λᵢ ± error bound (not converged)",
    ]


def test_eigenvalues_all_unconverged_still_explained(eigen):
    result = dataclasses.replace(eigen, converged=np.zeros(3, dtype=bool))
    ax = plot_eigenvalues(result)
    (text,) = _legend_texts(ax)
    assert text.startswith("λᵢ ± error bound (not converged); bars smaller than the markers")
    assert ax.containers[0].lines[0].get_markerfacecolor() == "none"


def test_eigenvalues_rejects_other_results(density):
    with pytest.raises(TypeError, match="EigenResult"):
        plot_eigenvalues(density)
