"""Figure titles and captions (spectra.plotting.captions)."""

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from spectra.plotting import (
    add_title,
    figure_caption,
    plot_sharpness,
)

STEPS = np.arange(0, 201, 20)

SHARPNESS = np.array([1.18, 1.64, 5.82, 9.24, 10.21, 10.47, 10.69, 9.51, 9.36, 9.26, 9.11])


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_title_and_caption():
    caption = figure_caption(
        "mlp, 1,234 parameters", None, "digits, 100 examples", "", "Hessian", "Lanczos, k = 3"
    )
    assert caption == "mlp, 1,234 parameters · digits, 100 examples · Hessian · Lanczos, k = 3"
    ax = plot_sharpness(STEPS, SHARPNESS)
    figure = add_title(ax, "Sharpness along training", caption + " · " + "x" * 150)
    assert figure._suptitle.get_text() == "Sharpness along training"
    lines = ax.get_title().split("\n")
    # Wrapped to the figure width, between the parts where possible.
    assert len(lines) >= 2 and lines[0].startswith("mlp, 1,234 parameters · digits")
    assert all(len(line) <= 120 for line in lines)
