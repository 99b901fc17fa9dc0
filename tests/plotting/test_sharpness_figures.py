"""Sharpness figures (spectra.plotting.sharpness): thresholds, traces, losses, overlaps,
panels, input checks."""

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from _figure_helpers import SHARPNESS, STEPS, TRACES, _legend_texts, _series_lines
from matplotlib.collections import LineCollection

from spectra.analysis.stability import stability_threshold_of
from spectra.plotting import (
    plot_sharpness,
    threshold_text,
)


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
