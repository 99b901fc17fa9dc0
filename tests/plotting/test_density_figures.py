"""Spectral density figures (spectra.plotting.density) from real estimator results: scales,
bands, overlays, input checks."""

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from _figure_helpers import _legend_texts, _series_lines
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection

from spectra.plotting import (
    plot_spectral_density,
)


def test_density_log_scale_band_and_zero_line(density):
    ax = plot_spectral_density(density)
    assert isinstance(ax, Axes)
    assert ax.get_xlabel() == "Eigenvalue λ"
    assert ax.get_ylabel() == "Density, ∫ = 1 (log scale)"
    assert ax.get_yscale() == "log"
    curve = density.density()
    peak = curve.upper.max()
    bottom, top = ax.get_ylim()
    assert bottom == pytest.approx(1e-6 * peak)
    assert top > peak
    assert len(_series_lines(ax)) == 1
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1
    assert np.any(curve.upper - curve.lower > 1e-3 * curve.values.max())
    zero_lines = [line for line in ax.get_lines() if list(line.get_xdata()) == [0.0, 0.0]]
    assert len(zero_lines) == 1
    sigma = density.default_sigma()
    assert _legend_texts(ax) == [f"SLQ density, σ = {sigma:.2g}", "±2 s.e. across 6 probes"]
    assert ax.get_title() == ""


def test_density_tails_clipped_at_floor(density):
    ax = plot_spectral_density(density, sigma=0.05)
    (line,) = _series_lines(ax)
    bottom = ax.get_ylim()[0]
    shown = np.asarray(line.get_ydata())
    # Tails below the floor are drawn just under the axis, never as tiny values
    # that would stretch a log axis.
    assert shown.min() >= 0.1 * bottom * (1 - 1e-12)
    assert np.any(shown < bottom)


def test_density_linear_without_band(density):
    ax = plot_spectral_density(density, log_scale=False, band=False, color="k")
    assert ax.get_yscale() == "linear"
    assert ax.get_ylabel() == "Density, ∫ = 1"
    assert ax.get_ylim()[0] == 0.0
    assert not [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert _series_lines(ax)[0].get_color() == "k"


def test_density_overlay_gets_legend_and_distinct_colors(density):
    ax = plot_spectral_density(density, label="default", band=False)
    sigma = density.default_sigma()
    assert _legend_texts(ax) == [f"default, σ = {sigma:.2g}"]
    plot_spectral_density(density, ax=ax, sigma=0.05, label="narrow", band=False)
    assert _legend_texts(ax) == [f"default, σ = {sigma:.2g}", "narrow, σ = 0.05"]
    first, second = _series_lines(ax)
    assert first.get_color() != second.get_color()


def test_density_rejects_bad_sigma(density):
    with pytest.raises(ValueError, match="sigma"):
        plot_spectral_density(density, sigma=0.0)
