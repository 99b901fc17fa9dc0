"""The loss landscape figures: :func:`plot_loss_landscape_1d` (loss along directions) and
:func:`plot_loss_landscape_2d` (filled contours over a plane)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from spectra.plotting.layout import (
    SERIES_GID,
    add_grid,
    one_dimensional,
    refresh_legend,
    series_color,
    with_figure_style,
)
from spectra.plotting.style import (
    STYLES,
    FigureFont,
    active_font,
    active_style,
    new_axes,
    new_figure,
    scaled_size,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# The tallest 2-D landscape axes (inches): on a page the square axes leave room at the sides.
_MAX_SQUARE_SIDE = 3.6


def _checked_curve(name: str, values: ArrayLike, alphas: np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.shape != alphas.shape:
        raise ValueError(
            f"{name} must have one value per alpha ({alphas.size}), got shape {array.shape}"
        )
    return np.where(np.isfinite(array), array, np.nan)


@with_figure_style
def plot_loss_landscape_1d(
    alphas: ArrayLike,
    losses: Mapping[str, ArrayLike] | ArrayLike,
    ax: Axes | None = None,
    *,
    xlabel: str = "Step size α along direction",
    references: Mapping[str, tuple[str, ArrayLike]] | None = None,
    legend: bool = True,
    style: str | None = None,
    font: str | FigureFont | None = None,
) -> Axes:
    """Loss along directions through the current parameters, L(θ + α d).

    ``losses`` maps a direction label (e.g. "top eigenvector v₁", "random
    direction") to the losses at ``alphas``; one line each, with a marker at
    α = 0 (the current parameters). A plain array draws one unlabelled line.
    ``references`` maps legend labels to ``(direction label, curve)``: curves
    at the same ``alphas`` drawn thin and dashed in the color of that
    direction's line (e.g. its quadratic model L + α gᵀv + λα²/2). Few points
    (≤ 5) get markers. ``legend=False`` draws no legend; ``style`` and ``font`` draw for
    print (:func:`figure_style`).
    """
    alpha_array = one_dimensional("alphas", alphas)
    if alpha_array.size == 0:
        raise ValueError("alphas is empty")
    curves = dict(losses) if isinstance(losses, Mapping) else {None: losses}
    if not curves:
        raise ValueError("losses is empty: give at least one direction")
    checked = {
        name: _checked_curve(f"losses[{name!r}]", curve, alpha_array)
        for name, curve in curves.items()
    }
    extra = {}
    for label, pair in dict(references or {}).items():
        if not (isinstance(pair, tuple) and len(pair) == 2 and pair[0] in checked):
            raise ValueError(
                f"references[{label!r}] must be (label of one of the losses, curve), got {pair!r}"
            )
        extra[label] = (pair[0], _checked_curve(f"references[{label!r}]", pair[1], alpha_array))

    if ax is None:
        ax = new_axes()
    order = np.argsort(alpha_array, kind="stable")
    sorted_alphas = alpha_array[order]
    marker = "o" if alpha_array.size <= 5 else None
    colors = {}
    for name, curve in checked.items():
        color = colors[name] = series_color(ax)
        (line,) = ax.plot(
            sorted_alphas,
            curve[order],
            color=color,
            linewidth=scaled_size(1.5),
            marker=marker,
            label=name,
        )
        line.set_gid(SERIES_GID)
        known = np.isfinite(curve[order])
        if sorted_alphas[known].size and sorted_alphas[known][0] <= 0 <= sorted_alphas[known][-1]:
            at_zero = float(np.interp(0.0, sorted_alphas[known], curve[order][known]))
            ax.plot(
                [0.0],
                [at_zero],
                marker="o",
                markersize=scaled_size(7),
                color="0.15",
                markeredgecolor="white",
                markeredgewidth=scaled_size(1.2),
                linestyle="none",
                zorder=3,
            )
    for name, (owner, curve) in extra.items():
        ax.plot(
            sorted_alphas,
            curve[order],
            color=colors[owner],
            linewidth=scaled_size(1.0),
            linestyle="--",
            label=name,
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("Loss")
    add_grid(ax)
    refresh_legend(ax, outside=active_style() is not None, shown=legend)
    return ax


@with_figure_style
def plot_loss_landscape_2d(
    alphas: ArrayLike,
    betas: ArrayLike,
    losses: ArrayLike,
    ax: Axes | None = None,
    *,
    labels: tuple[str, str] = ("v₁", "v₂"),
    levels: int | Sequence[float] = 30,
    style: str | None = None,
    font: str | FigureFont | None = None,
) -> Axes:
    """Filled contours of the loss surface L(θ + α d₁ + β d₂).

    ``losses[i, j]`` is the loss at ``(alphas[i], betas[j])``; α runs along
    the x axis and β along the y axis. Adds a colorbar labelled "Loss" and a
    marker at the origin (the current parameters). Non-finite losses are left
    blank. ``style`` and ``font`` draw for print (:func:`figure_style`).
    """
    alpha_array = one_dimensional("alphas", alphas)
    beta_array = one_dimensional("betas", betas)
    if alpha_array.size < 2 or beta_array.size < 2:
        raise ValueError(
            f"alphas and betas need at least 2 points each, got {alpha_array.size} "
            f"and {beta_array.size}"
        )
    loss_array = np.asarray(losses, dtype=np.float64)
    expected = (alpha_array.size, beta_array.size)
    if loss_array.shape != expected:
        raise ValueError(
            f"losses must have shape (len(alphas), len(betas)) = {expected}, got {loss_array.shape}"
        )
    surface = np.ma.masked_invalid(loss_array)
    if surface.count() == 0:
        raise ValueError("losses has no finite values")
    if len(labels) != 2:
        raise ValueError(f"labels must name the two directions, got {labels!r}")

    if ax is None:
        name = active_style()
        # Equal scales on α and β (a sharp direction must look sharp): axes about as tall
        # as wide, beside the colorbar (about 1 in with its label) and the y label.
        aspect = None
        if name is not None:
            side = STYLES[name].width - 1.3
            span = _finite_span(alpha_array)
            ratio = _finite_span(beta_array) / span if span > 0 else 1.0
            height = min(side * ratio, _MAX_SQUARE_SIDE) + 0.55
            aspect = height / STYLES[name].width
        _, ax = new_figure(name, aspect=aspect, font=active_font())
    filled = ax.contourf(alpha_array, beta_array, surface.T, levels=levels, cmap="viridis")
    ax.contour(
        alpha_array,
        beta_array,
        surface.T,
        levels=filled.levels,
        colors="white",
        linewidths=scaled_size(0.3),
        alpha=0.35,
    )
    # The colorbar in an inset of ``ax`` (axes coordinates), so that it keeps the height of
    # the equal-aspect axes and never reaches the caption above them.
    ax.set_aspect("equal", adjustable="box")
    bar_axes = ax.inset_axes((1.04, 0.0, 0.05, 1.0))
    colorbar = ax.figure.colorbar(filled, cax=bar_axes)
    colorbar.set_label("Loss")
    if alpha_array.min() <= 0 <= alpha_array.max() and beta_array.min() <= 0 <= beta_array.max():
        ax.plot(
            [0.0],
            [0.0],
            marker="*",
            markersize=scaled_size(12),
            color="white",
            markeredgecolor="black",
            markeredgewidth=scaled_size(0.8),
            linestyle="none",
            zorder=3,
        )
    ax.set_xlabel(f"α along {labels[0]}")
    ax.set_ylabel(f"β along {labels[1]}")
    ax.set_aspect("equal", adjustable="box")
    return ax


def _finite_span(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.max() - finite.min()) if finite.size else 0.0
