"""The report of ``spectra landscape``: the loss along the top eigenvector(s) of the Hessian
and a random direction — its settings (:class:`LandscapeSettings`), its computation from a
model and its operator (:func:`compute_landscape`), the report (:class:`LandscapeReport`,
written to ``landscape.json``) and its figures (:func:`landscape_figures`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.results import EigenResult
from spectra.reports.base import (
    CommandReport,
    EigensolverSettings,
    InputError,
    compile_with_loss_weights,
    input_problems,
    seed_generator_states,
)
from spectra.reports.figures import (
    DrawnFigure,
    FigureOptions,
    describe_data,
    describe_eigensolver,
    describe_matrix,
    describe_model,
    finish_figure,
)

if TYPE_CHECKING:
    from scipy.sparse.linalg import LinearOperator

    from spectra.analysis.landscape_result import LandscapeResult
    from spectra.io.datasets import Data

__all__ = [
    "LANDSCAPE_MAX_EVALUATIONS",
    "LANDSCAPE_POINTS",
    "LandscapeReport",
    "LandscapeSettings",
    "compute_landscape",
    "default_radius",
    "landscape_figures",
    "planned_evaluations",
    "step_grid",
]

# The landscape's α grid when --points is not given: enough points in the quadratic region.
LANDSCAPE_POINTS = 41
# The most loss evaluations (data passes) ``spectra landscape`` runs without --force: 2,000
# is 2 curves of 1,000 points, or a 2-D surface of 44² points (the default 41 points give
# 2·41 + 1 = 83 evaluations in 1-D and 41² + 2·41 + 1 = 1,764 with --directions 2).
LANDSCAPE_MAX_EVALUATIONS = 2000
# The default radius is this many times √(2L/λ₁), where the quadratic model along v₁ raises
# the loss L by L (doubles it); at the radius it raises it by (2²)·L.
_RADIUS_MULTIPLE = 2.0
_FALLBACK_RADIUS = 1.0


@dataclass(frozen=True, kw_only=True)
class LandscapeSettings(EigensolverSettings):
    """What ``spectra landscape`` computes, as its options of the same names (defaults as
    there): the loss along the top ``directions`` eigenvectors (1 or 2, with the surface of
    the plane of two) found by ``method`` to relative tolerance ``tol``, and along a random
    direction, at ``points`` steps over [-``radius``, ``radius``] (None: scaled to the
    curvature, :func:`default_radius`). The inputs are :class:`InputSettings`', the
    eigensolver's :class:`EigensolverSettings`'.
    """

    directions: int = 1
    radius: float | None = None
    points: int = LANDSCAPE_POINTS

    def record(self, radius: float, points: int, dtype: str) -> dict[str, Any]:
        """The settings as ``landscape.json`` records them, with the ``radius`` and the
        number of ``points`` used and the products' ``dtype``."""
        return {
            "loss": self.loss,
            "loss_weights": self.loss_weights,
            "directions": self.directions,
            "radius": radius,
            "points": points,
            "method": self.method,
            "tol": self.tol,
            "batch_size": self.batch_size,
            "max_examples": self.max_examples,
            "float64": self.float64,
            "training": self.training,
            "seed": self.seed,
            "builder": self.builder,
            "matrix": self.matrix,
            "dtype": dtype,
        }


@dataclass
class LandscapeReport(CommandReport):
    """What ``spectra landscape`` computed, as written to ``landscape.json``."""

    model: dict[str, Any]
    eigenvalues: EigenResult
    radius: dict[str, Any]
    directions: dict[str, str]
    curves: Any
    surface: Any
    files: dict[str, Any]
    figures: dict[str, Any] | None = None
    """How the figures were drawn and each one's title and full caption
    (:func:`spectra.reports.figures.figure_record`)."""


def default_radius(loss: float, top_eigenvalue: float) -> tuple[float, str]:
    """The α range scaled to the curvature, R = 2·√(2L/λ₁), and how it was chosen.

    Along the top eigenvector the quadratic model raises the loss by λ₁α²/2, which equals
    the loss L itself at α = √(2L/λ₁): the curve doubles there, and at α = R the model predicts
    a rise of 4L, far enough to show where the quadratic region ends. Falls back to
    R = 1 when L or λ₁ is not positive.
    """
    if loss > 0 and top_eigenvalue > 0 and math.isfinite(loss) and math.isfinite(top_eigenvalue):
        radius = _RADIUS_MULTIPLE * math.sqrt(2.0 * loss / top_eigenvalue)
        return radius, f"R = 2·√(2L/λ₁) = {radius:.3g} (L = {loss:.4g}, λ₁ = {top_eigenvalue:.4g})"
    return _FALLBACK_RADIUS, (
        f"R = {_FALLBACK_RADIUS:g} (the curvature rule 2·√(2L/λ₁) needs L > 0 and λ₁ > 0)"
    )


def step_grid(radius: float, points: int) -> np.ndarray:
    """α values: one point is α = 0; otherwise an odd number of points evenly over [-R, R]."""
    if points == 1:
        return np.zeros(1)
    half = points // 2
    return np.linspace(-radius, radius, 2 * half + 1)


def planned_evaluations(directions: int, points: int) -> int:
    """Loss evaluations (one data pass each) of a landscape of ``points`` per direction.

    The curves along v₁ (and v₂) and the random direction take N points each plus one at
    the weights themselves; with two directions the surface adds N² + 1, where N is
    ``points`` raised to odd (:func:`step_grid`). The eigenvectors, the loss and the
    gradient at the weights cost a few passes more.
    """
    size = 1 if points == 1 else 2 * (points // 2) + 1
    count = (directions + 1) * size + 1
    if directions == 2:
        count += size * size + 1
    return count


# --------------------------------------------------------------------------- computation


def compute_landscape(
    model: Any,
    op: LinearOperator,
    data: Data,
    settings: LandscapeSettings,
    *,
    command: str = "",
    announce: Callable[[str], None] | None = None,
    progress: bool | None = None,
) -> LandscapeReport:
    """The landscape ``settings`` ask for of the Keras ``model`` on ``data`` (a
    :class:`spectra.io.datasets.Data`), with ``op`` the operator of its Hessian there (its
    eigenvectors give the directions), as a :class:`LandscapeReport`.

    ``command``: the command line recorded. ``announce`` is given the planned number of
    loss evaluations and their estimated time, from a probe of 11 evaluations at the
    weights (run either way); ``progress`` as the estimators take it. The report's
    ``versions``, ``model``, ``data`` and ``files`` are left empty for the caller to record.

    Raises
    ------
    InputError
        a radius that takes the weights beyond the products' dtype, or gives a loss that
        is not finite; an evaluation of the loss that fails.
    """
    from spectra.analysis.landscape import loss_landscape, random_direction

    base_loss = op.loss()
    eig = eigenvalues(
        op,
        k=settings.directions,
        method=settings.method,
        tol=settings.tol,
        seed=settings.seed,
        progress=progress,
        return_eigenvectors=True,
    )
    assert eig.eigenvectors is not None
    top = float(eig.eigenvalues[0])
    if settings.radius is None:
        radius, rule = default_radius(base_loss, top)
    else:
        radius, rule = settings.radius, f"R = {settings.radius:g} (--radius)"
    _check_radius(model, op, radius, rule)
    alphas = step_grid(radius, settings.points)
    random = random_direction(op, settings.seed, normalization="filter")
    random /= np.linalg.norm(random)
    directions = {f"v{i + 1}": eig.eigenvectors[:, i] for i in range(settings.directions)}
    directions["random"] = random
    common: dict[str, Any] = {
        "batch_size": settings.batch_size,
        "training": settings.training,
        "dtype": np.float64 if settings.float64 else None,
    }
    evaluated = model
    if settings.training and settings.float64:
        evaluated = _seeded_float64_copy(model, settings.seed)
        compile_with_loss_weights(evaluated, settings.loss, settings.loss_weights, like=model)
        common["dtype"] = None
    loss = settings.operator_loss
    _announce_cost(settings, announce, evaluated, loss, data, common)
    with input_problems():
        curves = loss_landscape(evaluated, loss, data.as_tuple(), directions, alphas, **common)
    surface = None
    if settings.directions == 2:
        plane = {label: directions[label] for label in ("v1", "v2")}
        with input_problems():
            surface = loss_landscape(
                evaluated, loss, data.as_tuple(), plane, alphas, betas=alphas, **common
            )
    _check_finite(curves, surface, radius, rule, base_loss, top)
    slope = float(op.gradient().astype(np.float64) @ directions["v1"])
    return LandscapeReport(
        command=command,
        versions={},
        settings=settings.record(radius, int(alphas.size), str(op.dtype)),
        model={},
        data={},
        eigenvalues=eig,
        radius={"value": radius, "rule": rule, "slope_along_v1": slope},
        directions={
            **{
                f"v{i + 1}": f"unit eigenvector of λ{i + 1} (sign as returned)"
                for i in range(settings.directions)
            },
            "random": "Gaussian, filter-normalized (Li et al. 2018), scaled to unit norm",
        },
        curves=curves,
        surface=surface,
        files={},
    )


def _seeded_float64_copy(model: Any, seed: int) -> Any:
    """The float64 copy of ``model`` that ``loss_landscape(dtype=np.float64)`` would make,
    with its seed generator states set from ``seed``: a copy rebuilt from the config gets
    fresh random states, which in training mode would give other Dropout masks in every
    process."""
    from spectra.operators import keras_calls

    with input_problems():
        copy = keras_calls.model_in_dtype(model, "float64")
    seed_generator_states(copy, seed)
    return copy


def _check_radius(model: Any, op: LinearOperator, radius: float, rule: str) -> None:
    """Refuse a radius that takes some weight beyond the largest number of the products'
    dtype: at θ + α d with |α| ≤ R and a unit d, no weight exceeds max|θ| + R."""
    largest = max(float(np.max(np.abs(v.numpy()), initial=0.0)) for v in model.trainable_weights)
    limit = float(np.finfo(op.dtype).max)
    if not largest + radius < limit:
        raise InputError(
            f"the radius {rule} takes the weights to {largest + radius:.3g}, beyond the "
            f"largest {np.dtype(op.dtype).name} number {limit:.3g}: give a smaller --radius "
            "(without it the radius is scaled to the curvature)."
        )


def _check_finite(
    curves: LandscapeResult,
    surface: LandscapeResult | None,
    radius: float,
    rule: str,
    base_loss: float,
    top: float,
) -> None:
    """Refuse a landscape with a NaN or infinite loss, naming the point nearest the weights
    where it is (before anything is written): such a radius leaves where the model's
    arithmetic holds."""
    if not math.isfinite(base_loss):
        raise InputError(f"the loss at the model's weights is {base_loss}, not finite.")
    found = [
        (label, float(alpha), float(value))
        for label in curves.labels
        for alpha, value in zip(curves.alphas, curves.losses[label])
        if not math.isfinite(value)
    ]
    plane = None if surface is None else surface.losses_2d
    if surface is not None and plane is not None and not found:
        bad = np.argwhere(~np.isfinite(plane))
        if bad.size:
            i, j = bad[0]
            found = [("the v₁-v₂ plane", float(surface.alphas[i]), float(plane[i, j]))]
    if found:
        label, alpha, value = max(found, key=lambda item: -abs(item[1]))
        suggested, _ = default_radius(base_loss, top)
        raise InputError(
            f"the loss is {value} at α = {alpha:.3g} along {label} ({len(found)} points not "
            f"finite): the radius {rule} leaves the region where the model's arithmetic "
            f"holds; give a smaller --radius (the curvature-scaled default here is "
            f"{suggested:.3g})."
        )


def _announce_cost(
    settings: LandscapeSettings,
    announce: Callable[[str], None] | None,
    model: Any,
    loss: Any,
    data: Data,
    common: dict[str, Any],
) -> None:
    """Say the planned loss evaluations and an estimate of their time.

    The estimate is the time per evaluation of a probe of 11 evaluations at the weights,
    timed after a first, untimed probe that pays TensorFlow's one-off start-up; the
    probe's own tracing is included, so the estimate errs high.
    """
    from spectra.analysis.landscape import loss_landscape

    count = planned_evaluations(settings.directions, settings.points)
    zero = {"probe": np.zeros(sum(int(np.prod(v.shape)) for v in model.trainable_weights))}
    with input_problems():
        for n in (1, 10):
            probe = loss_landscape(model, loss, data.as_tuple(), zero, np.zeros(n), **common)
    per_pass = probe.wall_time / probe.num_evaluations
    if announce is not None:
        announce(
            f"landscape: {count:,} loss evaluations (one pass over {data.num_examples:,} "
            f"examples each), about {count * per_pass:.2g} s or less ({per_pass:.2g} s per pass)"
        )


# --------------------------------------------------------------------------- figures


def landscape_figures(
    report: LandscapeReport, options: FigureOptions, *, base_loss: float | None = None
) -> list[DrawnFigure]:
    """The figures of ``report``, not yet saved: the curves (with the quadratic model along
    v₁ from ``base_loss``, default the curves' own loss at the weights) and, with two
    directions, the surface, drawn as ``options`` ask."""
    from spectra.plotting import format_value, plot_loss_landscape_1d, plot_loss_landscape_2d

    settings = LandscapeSettings.from_record(report.settings)
    eig, curves = report.eigenvalues, report.curves
    alphas = curves.alphas
    base_loss = curves.base_loss if base_loss is None else base_loss
    slope = float(report.radius["slope_along_v1"])
    bounds = list(np.ravel(eig.error_bounds)) if eig.error_bounds is not None else []
    names = {}
    for i, (symbol, value) in enumerate(zip(("v₁", "v₂"), eig.eigenvalues)):
        bound = float(bounds[i]) if i < len(bounds) else None
        names[f"v{i + 1}"] = f"{symbol} (λ{symbol[1:]} = {format_value(float(value), bound)})"
    names["random"] = "random direction"
    top = float(eig.eigenvalues[0])
    quadratic = base_loss + slope * alphas + 0.5 * top * alphas**2
    where = (
        describe_model(report.model),
        describe_data(report.data),
        describe_matrix(settings, report.model),
    )
    solver = describe_eigensolver(
        settings.method, settings.tol, settings.directions, report.settings["dtype"]
    )
    style = options.style
    font = options.resolved_font()
    ax = plot_loss_landscape_1d(
        alphas,
        {names[label]: curves.losses[label] for label in curves.labels},
        xlabel="Distance α in parameter space",
        references={"quadratic model of v₁: L + α gᵀv₁ + λ₁α²/2": (names["v1"], quadratic)},
        legend=options.legend,
        style=style,
        font=font,
    )
    figure = finish_figure(
        ax,
        options,
        "Loss along the top Hessian eigenvector"
        + ("s" if settings.directions == 2 else "")
        + " and a random direction",
        (*where[:2], solver),
        (report.radius["rule"], f"{alphas.size} points"),
        matrix=where[2],
        seed=settings.seed,
    )
    figures = [DrawnFigure("curves_figure", "landscape_1d", figure)]
    if report.surface is not None:
        ax = plot_loss_landscape_2d(
            alphas,
            alphas,
            report.surface.losses_2d,
            labels=("v₁", "v₂"),
            style=style,
            font=font,
        )
        figure = finish_figure(
            ax,
            options,
            "Loss surface in the plane of the top two Hessian eigenvectors",
            (*where[:2], solver),
            (report.radius["rule"], f"{alphas.size}² points"),
            matrix=where[2],
            seed=settings.seed,
        )
        figures.append(DrawnFigure("surface_figure", "landscape_2d", figure))
    return figures
