"""The spectral density figure: :func:`plot_spectral_density`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from spectra.estimators.results import SpectralDensity
from spectra.plotting.layout import (
    SERIES_GID,
    ZERO_LINE_COLOR,
    add_grid,
    refresh_legend,
    series_color,
    with_figure_style,
)
from spectra.plotting.style import FigureFont, active_style, new_axes, scaled_size

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.typing import ColorType

# Lower end of the log-scale density axis, relative to the highest density; its upper
# end leaves a factor 2 (a third of a decade) above the band's peak; values under the
# floor are drawn at a tenth of it, just below the visible range.
_LOG_FLOOR = 1e-6
_LOG_HEADROOM = 2.0
_BELOW_FLOOR = 0.1


@with_figure_style
def plot_spectral_density(
    density: SpectralDensity,
    ax: Axes | None = None,
    *,
    grid: np.ndarray | None = None,
    sigma: float | None = None,
    log_scale: bool = True,
    band: bool = True,
    label: str | None = None,
    color: ColorType | None = None,
    negative: bool = True,
    legend: bool = True,
    style: str | None = None,
    font: str | FigureFont | None = None,
) -> Axes:
    """Gaussian-smoothed SLQ spectral density with its confidence band.

    Draws ``density.density(grid, sigma)``: the mean over probes as a line and
    mean ∓ 2 standard errors across probes as a shaded band, with a light
    vertical line at λ = 0. With ``log_scale`` the y axis is logarithmic and
    clipped at 1e-6 of the highest density, so that the bulk near zero and the
    outliers both show while the Gaussian tails stay out of the way, as in
    Ghorbani, Krishnan & Xiao (ICML 2019), Fig. 1.

    The legend names the line (``label``, else "SLQ density") with the kernel
    width σ, and the band as "±2 s.e. across P probes" (no band for one probe); no
    legend without ``legend``.

    The λ axis of a positive semidefinite density (``density.positive_semidefinite``: a
    GGN, a Fisher, any operator with ``is_positive_semidefinite``) starts at λ = 0: there
    is no mass below. ``negative=False`` draws any density on λ ≥ 0 only (the default
    grid cut at 0), e.g. a Hessian's positive side; the mass below 0 is then not drawn.
    ``style`` and ``font`` draw for print (:func:`figure_style`).
    """
    if not isinstance(density, SpectralDensity):
        raise TypeError(f"density must be a SpectralDensity, got {type(density).__name__}")
    from_zero = bool(density.positive_semidefinite) or not negative
    curve = density.density(grid, sigma)
    if from_zero and grid is None and curve.grid.min() < 0:
        top = float(curve.grid.max())
        if top <= 0:
            raise ValueError("negative=False draws λ ≥ 0 only, but the density has no node above 0")
        points = max(1000, int(np.sum(curve.grid >= 0)))
        curve = density.density(np.linspace(0.0, top, points), curve.sigma)
    if ax is None:
        ax = new_axes()
    reused_axes = ax.has_data()
    previous_left = ax.get_xlim()[0]
    color = series_color(ax, color)
    peak = float(np.max(curve.upper))
    if not np.isfinite(peak) or peak <= 0:
        raise ValueError("the smoothed density is zero everywhere on the grid")
    reused_log_axes = ax.has_data() and ax.get_yscale() == "log"
    previous_limits = ax.get_ylim()
    bottom, top = _LOG_FLOOR * peak, _LOG_HEADROOM * peak
    if reused_log_axes:
        bottom, top = min(bottom, previous_limits[0]), max(top, previous_limits[1])
    # Values under the axis floor are drawn just below the visible range, so
    # that the log axis neither masks them (gaps) nor stretches down to them.
    shown_floor = _BELOW_FLOOR * bottom if log_scale else 0.0
    values = np.maximum(curve.values, shown_floor)

    name = label if label else "SLQ density"
    (line,) = ax.plot(
        curve.grid,
        values,
        color=color,
        linewidth=scaled_size(1.4),
        label=f"{name}, σ = {curve.sigma:.2g}",
    )
    line.set_gid(SERIES_GID)
    if band and density.num_probes > 1:
        ax.fill_between(
            curve.grid,
            np.maximum(curve.lower, shown_floor),
            np.maximum(curve.upper, shown_floor),
            color=color,
            alpha=0.25,
            linewidth=0,
            label=f"±2 s.e. across {density.num_probes} probes",
        )
    if curve.grid.min() < 0.0 <= curve.grid.max():
        ax.axvline(0.0, color=ZERO_LINE_COLOR, linewidth=scaled_size(0.8), zorder=0.5)
    if from_zero and curve.grid.min() >= 0.0:
        # The axis starts at λ = 0, the curve's first point: no margin at negative λ.
        ax.set_xlim(left=min(previous_left, 0.0) if reused_axes else 0.0)

    if log_scale:
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.set_ylabel("Density, ∫ = 1 (log scale)")
    else:
        ax.set_ylim(bottom=0.0)
        ax.set_ylabel("Density, ∫ = 1")
    ax.set_xlabel("Eigenvalue λ")
    add_grid(ax)
    refresh_legend(ax, always=True, outside=active_style() is not None, shown=legend)
    return ax
