"""Figures from real estimator results: labels, artists, scales, input checks, atomic saving."""

import dataclasses
import os

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.contour import ContourSet

from spectra.analysis.per_layer import layerwise
from spectra.analysis.stability import stability_threshold_of
from spectra.estimators.density import spectral_density
from spectra.estimators.eigensolvers import eigenvalues
from spectra.plotting import (
    add_title,
    figure_caption,
    plot_eigenvalues,
    plot_layerwise,
    plot_loss_landscape_1d,
    plot_loss_landscape_2d,
    plot_sharpness,
    plot_spectral_density,
    save_figure,
    threshold_text,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
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


def _series_lines(ax: Axes):
    return [line for line in ax.get_lines() if line.get_gid() == "spectra-series"]


def _legend_texts(ax: Axes) -> list[str]:
    """The texts of the axes' legend, or of the figure legend drawn for it."""
    legends = [ax.get_legend(), *ax.figure.legends]
    return [
        text.get_text() for legend in legends if legend is not None for text in legend.get_texts()
    ]


# --- spectral density ---------------------------------------------------------


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


# --- eigenvalues --------------------------------------------------------------


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


# --- sharpness ----------------------------------------------------------------


def test_sharpness_with_threshold_trace_and_loss():
    lr = 0.2
    losses = np.geomspace(2.3, 0.01, STEPS.size)
    ax = plot_sharpness(
        STEPS,
        SHARPNESS,
        lr=lr,
        errors=0.02 * SHARPNESS,
        traces=TRACES,
        trace_errors=TRACES / 20,
        losses=losses,
        xlabel="Epoch",
    )
    assert ax.get_xlabel() == "Epoch"
    assert ax.get_ylabel() == "Sharpness λ₁"
    (threshold,) = [line for line in ax.get_lines() if line.get_label().startswith("2/η")]
    assert list(threshold.get_ydata()) == [2 / lr, 2 / lr]
    assert threshold.get_linestyle() == "--"
    # The legend calls 2/η a threshold, not a bound: λ₁ hovers around and above it.
    assert threshold.get_label() == "2/η = 10 (GD stability threshold)"
    assert ax.get_ylim()[1] > 2 / lr
    assert any(isinstance(c, LineCollection) for c in ax.collections)  # error bars
    # Loss on the sharpness panel's second y axis; the trace in a panel of its own under
    # it, sharing x (never a third y axis in one panel).
    others = {other.get_ylabel(): other for other in ax.figure.axes if other is not ax}
    assert sorted(others) == ["Loss", "Trace of H"]
    loss_ax, trace_ax = others["Loss"], others["Trace of H"]
    assert loss_ax.get_position().bounds == ax.get_position().bounds
    assert trace_ax.get_position().y1 <= ax.get_position().y0
    assert trace_ax.get_shared_x_axes().joined(ax, trace_ax)
    assert trace_ax.get_xlabel() == "Epoch"
    assert loss_ax.get_yscale() == "log"  # the loss spans more than two decades
    np.testing.assert_array_equal(loss_ax.get_lines()[0].get_ydata(), losses)
    (trace_line,) = [
        line for line in trace_ax.get_lines() if line.get_label() == "Trace of H ± s.e."
    ]
    np.testing.assert_array_equal(trace_line.get_ydata(), TRACES)
    assert trace_line.get_color() != _series_lines(ax)[0].get_color()
    # 2 % error bars are visible: no note.
    assert _legend_texts(ax) == [
        "Sharpness λ₁ ± error bound",
        "2/η = 10 (GD stability threshold)",
        "Loss",
        "Trace of H ± s.e.",
    ]


def test_sharpness_threshold_of_an_optimizer_far_above_the_data():
    adam = stability_threshold_of({"class_name": "Adam", "config": {"learning_rate": 1e-3}})
    ax = plot_sharpness(STEPS, SHARPNESS, threshold=adam)
    # 38000 would flatten the curve: it is named, not drawn.
    assert ax.get_ylim()[1] < 20
    texts = _legend_texts(ax)
    assert texts[1] == f"{threshold_text(adam.label)}, above the plotted range"
    assert "(2+2β₁)/((1−β₁)η) = 3.8e+04" in texts[1]
    assert "(stability threshold for λ₁(P⁻¹H))" in texts[1]
    momentum = stability_threshold_of(
        {"class_name": "SGD", "config": {"learning_rate": 0.2, "momentum": 0.9}}
    )
    ax = plot_sharpness(STEPS, SHARPNESS, threshold=momentum)
    (line,) = [line for line in ax.get_lines() if line.get_label().startswith(momentum.label)]
    assert list(line.get_ydata()) == [pytest.approx(19.0)] * 2
    with pytest.raises(ValueError, match="not both"):
        plot_sharpness(STEPS, SHARPNESS, lr=0.1, threshold=momentum)


def test_sharpness_top_k_lines_without_legend_clutter():
    values = np.stack([SHARPNESS, 0.7 * SHARPNESS, 0.5 * SHARPNESS], axis=1)
    ax = plot_sharpness(STEPS, values)
    lines = _series_lines(ax)
    assert [line.get_label() for line in lines] == ["λ₁", "λ₂", "λ₃"]
    assert len({line.get_color() for line in lines}) == 3
    assert len(ax.figure.axes) == 1
    assert _legend_texts(ax) == ["λ₁", "λ₂", "λ₃"]


def test_sharpness_single_series_has_no_legend():
    ax = plot_sharpness(STEPS, SHARPNESS)
    assert _legend_texts(ax) == []
    assert not [line for line in ax.get_lines() if line.get_label().startswith("2/η")]


def test_sharpness_reuses_twin_axes():
    ax = plot_sharpness(STEPS, SHARPNESS, lr=0.2, traces=TRACES, label="η = 0.2")
    plot_sharpness(STEPS, SHARPNESS / 2, lr=0.4, traces=TRACES / 2, ax=ax, label="η = 0.4")
    assert len(ax.figure.axes) == 2
    assert len(ax.figure.legends) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": STEPS[:-1]}, "same length"),
        ({"lr": 0.0}, "lr must be a positive"),
        ({"lr": -0.1}, "lr must be a positive"),
        ({"lr": float("nan")}, "lr must be a positive"),
        ({"values": np.zeros((11, 2, 2))}, "shape"),
        ({"errors": np.ones(10)}, "errors must have shape"),
        ({"errors": -np.ones(11)}, "non-negative"),
        ({"traces": TRACES[:-2]}, "traces"),
        ({"trace_errors": np.ones(11)}, "without traces"),
    ],
)
def test_sharpness_rejects_bad_input(kwargs, message):
    arguments = {"steps": STEPS, "values": SHARPNESS, **kwargs}
    with pytest.raises(ValueError, match=message):
        plot_sharpness(arguments.pop("steps"), arguments.pop("values"), **arguments)


def test_sharpness_overlaps_on_their_own_axis_and_a_named_quantity():
    overlaps = np.r_[np.nan, np.linspace(0.5, 0.99, STEPS.size - 1)]
    name = "Preconditioned sharpness λ₁(P⁻¹H)"
    ax = plot_sharpness(
        STEPS, SHARPNESS, losses=np.ones(STEPS.size), overlaps=overlaps, ylabel=name
    )
    assert ax.get_ylabel() == name
    assert _series_lines(ax)[0].get_label() == name
    twins = {other.get_ylabel(): other for other in ax.figure.axes if other is not ax}
    overlap_ax = twins["Overlap"]
    assert overlap_ax.get_position().y1 <= ax.get_position().y0  # the panel below
    assert overlap_ax.get_ylim() == (0.0, 1.05)
    (line,) = overlap_ax.get_lines()
    np.testing.assert_array_equal(line.get_ydata(), overlaps)  # NaN: a gap, not a zero
    assert "Overlap $\\langle v_t, v_{t-1}\\rangle^2$" in _legend_texts(ax)
    ax = plot_sharpness(STEPS, np.stack([SHARPNESS, SHARPNESS / 2], 1), overlaps=overlaps)
    assert "Top-k subspace overlap" in _legend_texts(ax)
    with pytest.raises(ValueError, match=r"overlaps must lie in \[0, 1\]"):
        plot_sharpness(STEPS, SHARPNESS, overlaps=np.full(STEPS.size, 1.5))
    with pytest.raises(ValueError, match="11 steps but 3 overlaps"):
        plot_sharpness(STEPS, SHARPNESS, overlaps=[0.5, 0.6, 0.7])


def test_sharpness_lower_panel_needs_a_grid_position_and_two_axes_per_panel():
    figure = plt.figure()
    ax = figure.add_axes((0.1, 0.1, 0.8, 0.8))
    with pytest.raises(ValueError, match="give axes made by plt.subplots"):
        plot_sharpness(STEPS, SHARPNESS, traces=TRACES, ax=ax)
    assert not ax.get_lines()  # refused before drawing
    plt.close(figure)
    figure, ax = plt.subplots()
    ax.twinx().set_ylabel("mine")
    with pytest.raises(ValueError, match="already have a second y axis \\('mine'\\)"):
        plot_sharpness(STEPS, SHARPNESS, losses=np.ones(STEPS.size), ax=ax)
    plt.close(figure)
    # A second call on the axes draws into the same lower panel.
    ax = plot_sharpness(STEPS, SHARPNESS, traces=TRACES, overlaps=np.full(STEPS.size, 0.5))
    plot_sharpness(STEPS, SHARPNESS / 2, traces=TRACES / 2, ax=ax, label="other")
    assert len(ax.figure.axes) == 3
    plt.close(ax.figure)


def test_sharpness_panels_side_by_side_keep_their_own_legends():
    figure, (left, right) = plt.subplots(1, 2, layout="constrained")
    plot_sharpness(STEPS, SHARPNESS, lr=0.2, losses=np.ones(STEPS.size), ax=left)
    plot_sharpness(STEPS, SHARPNESS / 2, lr=0.1, ax=right)
    assert figure.legends == []
    texts = [
        [text.get_text() for text in axes.get_legend().get_texts()]
        for axes in figure.axes
        if axes.get_legend() is not None
    ]
    assert sorted(texts) == [
        ["Sharpness λ₁", "2/η = 10 (GD stability threshold)", "Loss"],
        ["Sharpness λ₁", "2/η = 20 (GD stability threshold), above the plotted range"],
    ]


# --- per-layer spectra ---------------------------------------------------------


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


# --- loss landscapes ----------------------------------------------------------


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


# --- style and saving ---------------------------------------------------------


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


def test_save_figure_png_atomic_and_creates_directories(tmp_path, density):
    ax = plot_spectral_density(density)
    target = tmp_path / "nested" / "deeper" / "density.png"
    returned = save_figure(ax, target)
    assert returned == target
    data = target.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 1000
    assert os.listdir(target.parent) == ["density.png"]
    assert plt.fignum_exists(ax.figure.number)  # the caller still owns the figure


def test_save_figure_from_figure_pdf_and_overwrite(tmp_path, eigen):
    figure = plot_eigenvalues(eigen).figure
    target = tmp_path / "eigen.pdf"
    target.write_bytes(b"old")
    save_figure(figure, str(target))
    assert target.read_bytes().startswith(b"%PDF")
    assert os.listdir(tmp_path) == ["eigen.pdf"]


def test_save_figure_failure_keeps_old_file_and_no_temp(tmp_path, monkeypatch, eigen):
    figure = plot_eigenvalues(eigen).figure
    target = tmp_path / "eigen.png"
    target.write_bytes(b"previous")

    def broken_savefig(name, **kwargs):
        with open(name, "wb") as stream:
            stream.write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(figure, "savefig", broken_savefig)
    with pytest.raises(RuntimeError, match="disk full"):
        save_figure(figure, target)
    assert target.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["eigen.png"]


def test_save_figure_rejects_bad_targets(tmp_path, eigen):
    ax = plot_eigenvalues(eigen)
    with pytest.raises(ValueError, match="suffix"):
        save_figure(ax, tmp_path / "figure")
    with pytest.raises(ValueError, match="unsupported figure format"):
        save_figure(ax, tmp_path / "figure.docx")
    with pytest.raises(TypeError, match="Figure or Axes"):
        save_figure("not a figure", tmp_path / "figure.png")
    assert os.listdir(tmp_path) == []
