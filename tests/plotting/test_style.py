"""The figure style (spectra.plotting.style): no global style change, readable fonts."""

import matplotlib
import numpy as np

matplotlib.use("Agg")


from _figure_helpers import SHARPNESS, STEPS, TRACES

from spectra.plotting import (
    plot_eigenvalues,
    plot_loss_landscape_1d,
    plot_loss_landscape_2d,
    plot_sharpness,
    plot_spectral_density,
)


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
