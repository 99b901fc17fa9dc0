"""Publication figures for spectra results (matplotlib).

Every plotting function draws into a given ``Axes`` (or a new figure when
``ax`` is None) and returns the ``Axes``; nothing is shown and no global
matplotlib setting is changed. Default colors are the Okabe–Ito palette
(safe for the common forms of color blindness); legends appear only when an
axes holds more than one labelled artist; no titles are set (captions carry
them in papers). :func:`save_figure` writes a figure file atomically.

Matplotlib is imported on first use (inside the functions), not with the module.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from spectra._files import atomic_write
from spectra.results import EigenResult, SpectralDensity

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "plot_eigenvalues",
    "plot_loss_landscape_1d",
    "plot_loss_landscape_2d",
    "plot_sharpness",
    "plot_spectral_density",
    "save_figure",
]

# Okabe & Ito (2008) colors without the yellow, which is too light on white.
_PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
# Marks the main data artists drawn here, so that repeated calls on one axes
# take the next palette color.
_SERIES_GID = "spectra-series"
_REFERENCE_COLOR = "0.35"
_ZERO_LINE_COLOR = "0.75"
# Lower end of the log-scale density axis, relative to the highest density.
_LOG_FLOOR = 1e-6
# More points than this are drawn without markers.
_MAX_MARKED_POINTS = 50
_TRACE_LABEL = "Trace of H"
_SUBSCRIPTS = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def _new_axes() -> Axes:
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(layout="constrained")
    return ax


def _next_color(ax: Axes, color: Any = None) -> Any:
    """``color`` if given, else the next palette color not yet used on ``ax``."""
    if color is not None:
        return color
    used = sum(1 for artist in ax.get_children() if artist.get_gid() == _SERIES_GID)
    return _PALETTE[used % len(_PALETTE)]


def _style_axes(ax: Axes) -> None:
    ax.grid(True, which="major", color="0.88", linewidth=0.6)
    ax.set_axisbelow(True)


def _refresh_legend(*axes: Axes) -> None:
    """Legend over all ``axes`` when they hold > 1 labelled artist.

    The legend goes on the last axes (the one drawn on top, e.g. a twin), so
    that no line of the others can cover it.
    """
    handles: list[Any] = []
    labels: list[str] = []
    for holder in axes:
        more_handles, more_labels = holder.get_legend_handles_labels()
        handles += more_handles
        labels += more_labels
        if holder.get_legend() is not None:
            holder.get_legend().remove()
    if len(handles) > 1:
        axes[-1].legend(handles, labels, framealpha=0.9)


def _subscript(index: int) -> str:
    return str(index).translate(_SUBSCRIPTS)


def _as_1d(name: str, values: Any) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def _check_errors(name: str, errors: Any, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(errors, dtype=np.float64)
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {shape} like the values, got {array.shape}")
    if np.any(array[np.isfinite(array)] < 0):
        raise ValueError(f"{name} must be non-negative")
    return np.where(np.isfinite(array), array, 0.0)


def plot_spectral_density(
    density: SpectralDensity,
    ax: Axes | None = None,
    *,
    grid: np.ndarray | None = None,
    sigma: float | None = None,
    log_scale: bool = True,
    band: bool = True,
    label: str | None = None,
    color: Any = None,
) -> Axes:
    """Gaussian-smoothed SLQ spectral density with its confidence band.

    Draws ``density.density(grid, sigma)``: the mean over probes as a line and
    mean ∓ 2 standard errors across probes as a shaded band, with a light
    vertical line at λ = 0. With ``log_scale`` the y axis is logarithmic and
    clipped at 1e-6 of the highest density, so that the bulk near zero and the
    outliers both show while the Gaussian tails stay out of the way, as in
    Ghorbani, Krishnan & Xiao (ICML 2019), Fig. 1.
    """
    if not isinstance(density, SpectralDensity):
        raise TypeError(f"density must be a SpectralDensity, got {type(density).__name__}")
    curve = density.density(grid, sigma)
    if ax is None:
        ax = _new_axes()
    color = _next_color(ax, color)
    peak = float(np.max(curve.upper))
    if not np.isfinite(peak) or peak <= 0:
        raise ValueError("the smoothed density is zero everywhere on the grid")
    reused_log_axes = ax.has_data() and ax.get_yscale() == "log"
    previous_limits = ax.get_ylim()
    bottom, top = _LOG_FLOOR * peak, 2.0 * peak
    if reused_log_axes:
        bottom, top = min(bottom, previous_limits[0]), max(top, previous_limits[1])
    # Values under the axis floor are drawn just below the visible range, so
    # that the log axis neither masks them (gaps) nor stretches down to them.
    shown_floor = 0.1 * bottom if log_scale else 0.0
    values = np.maximum(curve.values, shown_floor)

    if band:
        ax.fill_between(
            curve.grid,
            np.maximum(curve.lower, shown_floor),
            np.maximum(curve.upper, shown_floor),
            color=color,
            alpha=0.25,
            linewidth=0,
        )
    (line,) = ax.plot(curve.grid, values, color=color, linewidth=1.4, label=label)
    line.set_gid(_SERIES_GID)
    if curve.grid.min() <= 0.0 <= curve.grid.max():
        ax.axvline(0.0, color=_ZERO_LINE_COLOR, linewidth=0.8, zorder=0.5)

    if log_scale:
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.set_ylabel("Density (log scale)")
    else:
        ax.set_ylim(bottom=0.0)
        ax.set_ylabel("Density")
    ax.set_xlabel("Eigenvalue λ")
    _style_axes(ax)
    _refresh_legend(ax)
    return ax


def _eigen_errors(result: EigenResult) -> np.ndarray:
    """Per-eigenvalue error bars: the error bounds, else the residual norms, else 0."""
    size = np.asarray(result.eigenvalues).size
    errors = np.full(size, np.nan)
    for source in (result.error_bounds, result.residual_norms):
        if source is None:
            continue
        candidate = np.asarray(source, dtype=np.float64).ravel()
        if candidate.size == size:
            errors = np.where(np.isfinite(errors), errors, candidate)
    return np.where(np.isfinite(errors) & (errors >= 0), errors, 0.0)


def plot_eigenvalues(
    result: EigenResult,
    ax: Axes | None = None,
    *,
    label: str | None = None,
    color: Any = None,
) -> Axes:
    """The computed eigenvalues against their index i = 1, 2, … with error bars.

    Error bars are ``result.error_bounds`` (the residual norms where no bound
    is available). Eigenpairs that did not converge are drawn as hollow
    markers and named "not converged" in the legend.
    """
    if not isinstance(result, EigenResult):
        raise TypeError(f"result must be an EigenResult, got {type(result).__name__}")
    values = np.asarray(result.eigenvalues, dtype=np.float64).ravel()
    if values.size == 0:
        raise ValueError("result holds no eigenvalues")
    converged = np.asarray(result.converged, dtype=bool).ravel()
    if converged.size != values.size:
        converged = np.full(values.size, bool(np.all(converged)))
    errors = _eigen_errors(result)
    indices = np.arange(1, values.size + 1)
    if ax is None:
        ax = _new_axes()
    reused = ax.has_data()
    previous_limits = ax.get_xlim()
    color = _next_color(ax, color)

    some_unconverged = not converged.all()
    if converged.any():
        if some_unconverged:
            filled_label = f"{label} (converged)" if label else "converged"
        else:
            filled_label = label
        filled = ax.errorbar(
            indices[converged],
            values[converged],
            yerr=errors[converged],
            fmt="o",
            color=color,
            markersize=6,
            capsize=3,
            elinewidth=1.0,
            label=filled_label,
        )
        filled.lines[0].set_gid(_SERIES_GID)
    if some_unconverged:
        hollow = ax.errorbar(
            indices[~converged],
            values[~converged],
            yerr=errors[~converged],
            fmt="o",
            color=color,
            markerfacecolor="none",
            markeredgewidth=1.4,
            markersize=6,
            capsize=3,
            elinewidth=1.0,
            label=f"{label} (not converged)" if label else "not converged",
        )
        if not converged.any():
            hollow.lines[0].set_gid(_SERIES_GID)

    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    left, right = 0.5, values.size + 0.5
    if reused:
        left, right = min(left, previous_limits[0]), max(right, previous_limits[1])
    ax.set_xlim(left, right)
    ax.set_xlabel("Index i")
    ax.set_ylabel("Eigenvalue λᵢ")
    _style_axes(ax)
    _refresh_legend(ax)
    if some_unconverged and ax.get_legend() is None:
        # Hollow markers always need their note, even as the only entry.
        ax.legend(framealpha=0.9)
    return ax


def _line_with_errors(
    ax: Axes,
    x: np.ndarray,
    y: np.ndarray,
    errors: np.ndarray | None,
    *,
    color: Any,
    marker: str | None,
    label: str,
    linestyle: str = "-",
) -> Any:
    """A labelled line with optional unlabelled error bars; returns the line.

    Drawn as a line plus a separate error-bar artist so that the legend lists
    entries in drawing order (matplotlib puts error-bar containers last).
    """
    (line,) = ax.plot(
        x,
        y,
        color=color,
        marker=marker,
        markersize=4,
        linewidth=1.4,
        linestyle=linestyle,
        label=label,
    )
    if errors is not None:
        ax.errorbar(x, y, yerr=errors, fmt="none", ecolor=color, capsize=2, elinewidth=0.9)
    return line


def _find_trace_axes(ax: Axes) -> Axes | None:
    """A twin of ``ax`` made earlier by :func:`plot_sharpness` for the trace."""
    for other in ax.get_shared_x_axes().get_siblings(ax):
        if other is not ax and other.get_ylabel() == _TRACE_LABEL:
            return other
    return None


def plot_sharpness(
    steps: Any,
    values: Any,
    *,
    lr: float | None = None,
    errors: Any = None,
    traces: Any = None,
    trace_errors: Any = None,
    ax: Axes | None = None,
    label: str | None = None,
) -> Axes:
    """Sharpness (top Hessian eigenvalue λ₁) against training step.

    ``values`` of shape (steps,) draws λ₁; of shape (steps, k) draws the top k
    eigenvalues as k lines. With ``lr`` = η the edge-of-stability threshold
    2/η is drawn as a dashed line: under full-batch gradient descent the
    sharpness rises to about 2/η and hovers there (Cohen, Kaur, Li, Kolter &
    Talwalkar, ICLR 2021). ``errors`` (shape of ``values``) adds error bars.
    ``traces`` (and ``trace_errors``) draw the Hessian trace on a twin y axis.
    Returns the primary (sharpness) axes.
    """
    step_array = _as_1d("steps", steps)
    value_array = np.asarray(values, dtype=np.float64)
    if value_array.ndim not in (1, 2):
        raise ValueError(
            f"values must have shape (steps,) or (steps, k), got shape {value_array.shape}"
        )
    if value_array.shape[0] != step_array.size:
        raise ValueError(
            f"steps and values must have the same length: {step_array.size} steps "
            f"but {value_array.shape[0]} rows of values"
        )
    if step_array.size == 0:
        raise ValueError("steps is empty")
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive finite step size, got {lr}")
    error_array = None if errors is None else _check_errors("errors", errors, value_array.shape)
    trace_array = None
    trace_error_array = None
    if traces is not None:
        trace_array = _as_1d("traces", traces)
        if trace_array.size != step_array.size:
            raise ValueError(
                f"steps and traces must have the same length: {step_array.size} steps "
                f"but {trace_array.size} traces"
            )
        if trace_errors is not None:
            trace_error_array = _check_errors("trace_errors", trace_errors, trace_array.shape)
    elif trace_errors is not None:
        raise ValueError("trace_errors given without traces")

    if ax is None:
        ax = _new_axes()
    columns = value_array.reshape(step_array.size, -1)
    column_errors = None if error_array is None else error_array.reshape(columns.shape)
    marker = "o" if step_array.size <= _MAX_MARKED_POINTS else None
    colors = []
    for column in range(columns.shape[1]):
        color = _next_color(ax)
        colors.append(color)
        name = "Sharpness λ₁" if value_array.ndim == 1 else f"λ{_subscript(column + 1)}"
        if label:
            name = label if value_array.ndim == 1 else f"{label}, {name}"
        _line_with_errors(
            ax,
            step_array,
            columns[:, column],
            None if column_errors is None else column_errors[:, column],
            color=color,
            marker=marker,
            label=name,
        ).set_gid(_SERIES_GID)

    if lr is not None:
        threshold = 2.0 / lr
        ax.axhline(
            threshold,
            color=_REFERENCE_COLOR,
            linestyle="--",
            linewidth=1.2,
            label=f"2/η = {threshold:.4g}",
        )
    ax.set_xlabel("Training step")
    ax.set_ylabel("Sharpness λ₁" if value_array.ndim == 1 else "Top Hessian eigenvalues")
    _style_axes(ax)

    trace_ax = _find_trace_axes(ax)
    if trace_array is not None:
        if trace_ax is None:
            trace_ax = ax.twinx()
        trace_color = _PALETTE[(_PALETTE.index(colors[-1]) + 1) % len(_PALETTE)]
        _line_with_errors(
            trace_ax,
            step_array,
            trace_array,
            trace_error_array,
            color=trace_color,
            marker="s" if marker else None,
            linestyle="-.",
            label=_TRACE_LABEL if not label else f"{label}, trace",
        )
        trace_ax.set_ylabel(_TRACE_LABEL, color=trace_color)
        trace_ax.tick_params(axis="y", colors=trace_color)
        trace_ax.grid(False)
        if value_array.ndim == 1 and len(colors) == 1:
            ax.yaxis.label.set_color(colors[0])
            ax.tick_params(axis="y", colors=colors[0])
    if trace_ax is None:
        _refresh_legend(ax)
    else:
        _refresh_legend(ax, trace_ax)
    return ax


def plot_loss_landscape_1d(
    alphas: Any,
    losses: Mapping[str, Any] | Any,
    ax: Axes | None = None,
    *,
    xlabel: str = "Step size α along direction",
) -> Axes:
    """Loss along directions through the current parameters, L(θ + α d).

    ``losses`` maps a direction label (e.g. "top eigenvector v₁", "random
    direction") to the losses at ``alphas``; one line each, with a marker at
    α = 0 (the current parameters). A plain array draws one unlabelled line.
    """
    alpha_array = _as_1d("alphas", alphas)
    if alpha_array.size == 0:
        raise ValueError("alphas is empty")
    curves = dict(losses) if isinstance(losses, Mapping) else {None: losses}
    if not curves:
        raise ValueError("losses is empty: give at least one direction")
    checked = {}
    for name, curve in curves.items():
        array = np.asarray(curve, dtype=np.float64)
        if array.shape != alpha_array.shape:
            raise ValueError(
                f"losses[{name!r}] must have one value per alpha ({alpha_array.size}), "
                f"got shape {array.shape}"
            )
        checked[name] = np.where(np.isfinite(array), array, np.nan)

    if ax is None:
        ax = _new_axes()
    order = np.argsort(alpha_array, kind="stable")
    sorted_alphas = alpha_array[order]
    for name, curve in checked.items():
        color = _next_color(ax)
        (line,) = ax.plot(sorted_alphas, curve[order], color=color, linewidth=1.5, label=name)
        line.set_gid(_SERIES_GID)
        known = np.isfinite(curve[order])
        if sorted_alphas[known].size and sorted_alphas[known][0] <= 0 <= sorted_alphas[known][-1]:
            at_zero = float(np.interp(0.0, sorted_alphas[known], curve[order][known]))
            ax.plot(
                [0.0],
                [at_zero],
                marker="o",
                markersize=7,
                color="0.15",
                markeredgecolor="white",
                markeredgewidth=1.2,
                linestyle="none",
                zorder=3,
            )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("Loss")
    _style_axes(ax)
    _refresh_legend(ax)
    return ax


def plot_loss_landscape_2d(
    alphas: Any,
    betas: Any,
    losses: Any,
    ax: Axes | None = None,
    *,
    labels: tuple[str, str] = ("v₁", "v₂"),
    levels: int | Sequence[float] = 30,
) -> Axes:
    """Filled contours of the loss surface L(θ + α d₁ + β d₂).

    ``losses[i, j]`` is the loss at ``(alphas[i], betas[j])``; α runs along
    the x axis and β along the y axis. Adds a colorbar labelled "Loss" and a
    marker at the origin (the current parameters). Non-finite losses are left
    blank.
    """
    alpha_array = _as_1d("alphas", alphas)
    beta_array = _as_1d("betas", betas)
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
        ax = _new_axes()
    filled = ax.contourf(alpha_array, beta_array, surface.T, levels=levels, cmap="viridis")
    ax.contour(
        alpha_array,
        beta_array,
        surface.T,
        levels=filled.levels,
        colors="white",
        linewidths=0.3,
        alpha=0.35,
    )
    colorbar = ax.figure.colorbar(filled, ax=ax)
    colorbar.set_label("Loss")
    if alpha_array.min() <= 0 <= alpha_array.max() and beta_array.min() <= 0 <= beta_array.max():
        ax.plot(
            [0.0],
            [0.0],
            marker="*",
            markersize=12,
            color="white",
            markeredgecolor="black",
            markeredgewidth=0.8,
            linestyle="none",
            zorder=3,
        )
    ax.set_xlabel(f"α along {labels[0]}")
    ax.set_ylabel(f"β along {labels[1]}")
    return ax


def _root_figure(fig_or_ax: Any) -> Figure:
    from matplotlib.artist import Artist
    from matplotlib.figure import Figure

    if isinstance(fig_or_ax, Figure):
        return fig_or_ax
    if isinstance(fig_or_ax, Artist):
        try:
            figure = fig_or_ax.get_figure(root=True)
        except TypeError:  # matplotlib < 3.10
            figure = fig_or_ax.get_figure()
            while figure is not None and not isinstance(figure, Figure):
                figure = figure.get_figure()
        if isinstance(figure, Figure):
            return figure
    raise TypeError(f"expected a matplotlib Figure or Axes, got {type(fig_or_ax).__name__}")


def save_figure(fig_or_ax: Any, path: str | os.PathLike, *, dpi: float = 150) -> pathlib.Path:
    """Save a figure (or an Axes' figure) with tight bounds, atomically.

    The format comes from the suffix of ``path`` (.png, .pdf, .svg, …). The
    file is written to a temporary file in the same directory and moved into
    place with ``os.replace``, so readers never see a partial file; missing
    parent directories are created. The figure is not closed. Returns the path.
    """
    figure = _root_figure(fig_or_ax)
    target = pathlib.Path(path)
    file_format = target.suffix.lstrip(".").lower()
    supported = figure.canvas.get_supported_filetypes()
    if not file_format:
        raise ValueError(f"cannot infer the format of {str(target)!r}: give a suffix like .png")
    if file_format not in supported:
        raise ValueError(
            f"unsupported figure format {file_format!r}; supported: {', '.join(sorted(supported))}"
        )
    if not dpi > 0:
        raise ValueError(f"dpi must be positive, got {dpi}")
    return atomic_write(
        target,
        lambda temp_name: figure.savefig(
            temp_name, format=file_format, dpi=dpi, bbox_inches="tight"
        ),
    )
