"""Per-layer figures (spectra.plotting.layerwise) from real estimator results: bars, standard
errors, unconverged groups, input checks."""

import dataclasses

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from _figure_helpers import _legend_texts
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection

from spectra.analysis.per_layer import layerwise
from spectra.plotting import (
    plot_layerwise,
)


@pytest.fixture(scope="module")
def blocks():
    """layerwise on a block-diagonal matrix with three groups (the last indefinite)."""
    rng = np.random.default_rng(1)
    sizes = {"dense": 6, "dense_1": 4, "output": 3}
    parts, groups, start = [], {}, 0
    for name, size in sizes.items():
        q, _ = np.linalg.qr(rng.standard_normal((size, size)))
        parts.append(q @ np.diag(np.linspace(-1.0, 3.0, size) * (start + 1)) @ q.T)
        groups[name] = list(range(start, start + size))
        start += size
    matrix = np.zeros((start, start))
    offset = 0
    for part in parts:
        matrix[offset : offset + len(part), offset : offset + len(part)] = part
        offset += len(part)
    return layerwise(matrix, k=2, trace=True, groups=groups, num_probes=20, seed=0)


def _bars(ax: Axes):
    from matplotlib.container import BarContainer

    (bars,) = [c for c in ax.containers if isinstance(c, BarContainer) and c.patches]
    return bars.patches


def test_layerwise_bars_values_and_order(blocks):
    ax = plot_layerwise(blocks)
    widths = [patch.get_width() for patch in _bars(ax)]
    np.testing.assert_allclose(widths, [v[0] for v in blocks.eigenvalues])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["dense", "dense_1", "output"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # the first layer on top
    texts = _legend_texts(ax)
    assert texts[0].startswith("λ₁ of $H_{\\ell\\ell}$ ± error bound")
    assert "error bars too small to see" in texts[0]
    assert texts[1] == "λ₂ … λₖ of $H_{\\ell\\ell}$"
    dots = [line for line in ax.get_lines() if line.get_label() == texts[1]]
    np.testing.assert_allclose(dots[0].get_xdata(), [v[1] for v in blocks.eigenvalues])
    assert ax.get_xlabel() == "Top eigenvalue of the diagonal block"


def test_layerwise_traces_with_standard_errors_and_other_symbol(blocks):
    ax = plot_layerwise(blocks, quantity="trace", symbol="G")
    widths = [patch.get_width() for patch in _bars(ax)]
    np.testing.assert_allclose(widths, blocks.traces)
    (errorbar,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    spans = [abs(seg[1][0] - seg[0][0]) / 2 for seg in errorbar.get_segments()]
    np.testing.assert_allclose(spans, blocks.trace_stderr)
    assert _legend_texts(ax) == ["trace of $G_{\\ell\\ell}$ ± standard error"]


def test_layerwise_unconverged_groups_are_hatched(blocks):
    flags = [np.array([True, True]), np.array([False, True]), np.array([True, True])]
    ax = plot_layerwise(dataclasses.replace(blocks, converged=flags))
    hatches = [patch.get_hatch() for patch in _bars(ax)]
    assert hatches == [None, "//", None]
    assert "not converged" in _legend_texts(ax)


def test_layerwise_rejects_bad_input(blocks, eigen):
    with pytest.raises(TypeError, match="LayerwiseResult"):
        plot_layerwise(eigen)
    with pytest.raises(ValueError, match="quantity must be"):
        plot_layerwise(blocks, quantity="diagonal")
    with pytest.raises(ValueError, match="no traces"):
        plot_layerwise(
            dataclasses.replace(blocks, traces=None, trace_stderr=None), quantity="trace"
        )
