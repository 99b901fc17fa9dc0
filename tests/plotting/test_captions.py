"""Figure titles and captions (spectra.plotting.captions)."""

import matplotlib

matplotlib.use("Agg")


from _figure_helpers import SHARPNESS, STEPS

from spectra.plotting import (
    add_title,
    figure_caption,
    plot_sharpness,
)


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
