"""Loss-landscape figures (spectra.plotting.landscape): 1-D lines and 2-D contours, origin
markers, input checks."""

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from _figure_helpers import _legend_texts, _series_lines
from matplotlib.contour import ContourSet

from spectra.plotting import (
    plot_loss_landscape_1d,
    plot_loss_landscape_2d,
)


def test_landscape_1d_lines_and_origin_markers():
    alphas = np.linspace(-1, 1, 21)
    losses = {"top eigenvector v₁": 0.3 + 5 * alphas**2, "random direction": 0.3 + 0.2 * alphas**2}
    ax = plot_loss_landscape_1d(alphas, losses)
    assert ax.get_xlabel() == "Step size α along direction"
    assert ax.get_ylabel() == "Loss"
    assert [line.get_label() for line in _series_lines(ax)] == list(losses)
    origin = [line for line in ax.get_lines() if list(line.get_xdata()) == [0.0]]
    assert len(origin) == 2
    assert origin[0].get_ydata()[0] == pytest.approx(0.3)
    assert _legend_texts(ax) == list(losses)


def test_landscape_1d_single_direction_and_custom_label():
    alphas = np.linspace(-0.5, 0.5, 11)
    ax = plot_loss_landscape_1d(alphas, {"v₁": alphas**2}, xlabel="α")
    assert ax.get_xlabel() == "α"
    assert ax.get_legend() is None


def test_landscape_1d_rejects_bad_input():
    alphas = np.linspace(-1, 1, 5)
    with pytest.raises(ValueError, match="one value per alpha"):
        plot_loss_landscape_1d(alphas, {"v₁": np.ones(4)})
    with pytest.raises(ValueError, match="empty"):
        plot_loss_landscape_1d(alphas, {})
    with pytest.raises(ValueError, match="label of one of the losses"):
        plot_loss_landscape_1d(alphas, {"v₁": alphas}, references={"q": ("v₂", alphas)})


def test_landscape_1d_reference_curve_in_its_direction_color():
    alphas = np.linspace(-1, 1, 21)
    losses = {"v₁": 0.3 + 5 * alphas**2 + alphas**3, "random": 0.3 + 0.2 * alphas**2}
    quadratic = 0.3 + 5 * alphas**2
    ax = plot_loss_landscape_1d(alphas, losses, references={"quadratic model": ("v₁", quadratic)})
    (reference,) = [line for line in ax.get_lines() if line.get_label() == "quadratic model"]
    assert reference.get_linestyle() == "--"
    assert reference.get_color() == _series_lines(ax)[0].get_color()
    np.testing.assert_allclose(reference.get_ydata(), quadratic)


def test_landscape_1d_single_point_is_visible():
    ax = plot_loss_landscape_1d(np.zeros(1), {"v₁": [0.3]})
    assert _series_lines(ax)[0].get_marker() == "o"


def test_landscape_2d_contours_colorbar_and_origin():
    alphas = np.linspace(-1, 1, 9)
    betas = np.linspace(-2, 2, 13)
    losses = 1 + alphas[:, None] ** 2 + 0.1 * betas[None, :] ** 2
    ax = plot_loss_landscape_2d(alphas, betas, losses, labels=("v₁", "random"), levels=12)
    assert ax.get_xlabel() == "α along v₁"
    assert ax.get_ylabel() == "β along random"
    assert any(isinstance(c, ContourSet) for c in ax.collections)
    assert ax.get_xlim() == (-1.0, 1.0)
    assert ax.get_ylim() == (-2.0, 2.0)
    # The colorbar is an inset of the axes: as tall as the equal-aspect axes, never above
    # them (where the caption goes).
    colorbar_axes = [other for other in ax.figure.axes + ax.child_axes if other is not ax]
    assert len(colorbar_axes) == 1
    assert colorbar_axes[0].get_ylabel() == "Loss"
    ax.figure.draw_without_rendering()
    box, bar = ax.get_window_extent(), colorbar_axes[0].get_window_extent()
    assert abs(bar.y0 - box.y0) < 1 and abs(bar.y1 - box.y1) < 1 and bar.x0 > box.x1
    origin = [line for line in ax.get_lines() if list(line.get_xdata()) == [0.0]]
    assert len(origin) == 1


def test_landscape_2d_rejects_wrong_shape():
    alphas, betas = np.linspace(-1, 1, 4), np.linspace(-1, 1, 6)
    with pytest.raises(ValueError, match=r"\(len\(alphas\), len\(betas\)\) = \(4, 6\)"):
        plot_loss_landscape_2d(alphas, betas, np.zeros((6, 4)))
