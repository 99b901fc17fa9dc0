"""Helpers and data the figure tests of tests/plotting share: a sharpness run's steps, λ₁
and traces, and what a figure's legend and series say."""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes

STEPS = np.arange(0, 201, 20)

SHARPNESS = np.array([1.18, 1.64, 5.82, 9.24, 10.21, 10.47, 10.69, 9.51, 9.36, 9.26, 9.11])

TRACES = np.array([30.0, 42, 88, 130, 150, 158, 163, 150, 147, 145, 143])


def _series_lines(ax: Axes):
    return [line for line in ax.get_lines() if line.get_gid() == "spectra-series"]


def _legend_texts(ax: Axes) -> list[str]:
    """The texts of the axes' legend, or of the figure legend drawn for it."""
    legends = [ax.get_legend(), *ax.figure.legends]
    return [
        text.get_text() for legend in legends if legend is not None for text in legend.get_texts()
    ]
