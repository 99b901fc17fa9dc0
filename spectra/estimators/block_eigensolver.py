"""LOBPCG: the ``"lobpcg"`` method of :func:`~spectra.estimators.eigensolvers.eigenvalues`
(:func:`lobpcg_method`).

scipy's LOBPCG (Knyazev 2001) on a block of k + extra vectors, so each data pass
multiplies a whole block. Its wanted pairs are then verified by a Krylov–Schur run from a
random start orthogonal to them (:meth:`~spectra.estimators.krylov_schur.KrylovSchur.verify`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import numpy as np
from scipy.sparse.linalg import LinearOperator, lobpcg

from spectra.estimators._products import ProductCounter, ProductProgress
from spectra.estimators.eigenpairs import (
    MethodOutput,
    MethodRequest,
    Pairs,
    best_first,
    unit_columns,
)
from spectra.estimators.eigenvalue_bounds import certified_bounds, rounding_floor
from spectra.estimators.krylov_schur import (
    KrylovSchur,
    drive,
    krylov_dimension,
    runs_probability,
)

__all__ = ["lobpcg_method"]

# LOBPCG: restart at most this many times, each with the residual tolerance tightened
# to this fraction of the smallest target not met; targets are guarded by a tiny
# positive number before they divide (a zero operator has zero targets).
_LOBPCG_MAX_ROUNDS = 10
_LOBPCG_TIGHTENING = 0.1
_TINY_TARGET = 1e-300
# Below this many blocks' worth of columns (n < 5·block), forming the dense matrix with
# one n-column product costs little more than a LOBPCG round and is exact.
_DENSE_BLOCKS = 5


def _dense_pairs(
    counter: ProductCounter, k: int, which: str, bar: ProductProgress, info: dict
) -> MethodOutput:
    """The exact k pairs of a small operator: one n-column ``matmat`` and ``eigh``."""
    n = counter.n
    dense = counter.matmat(np.eye(n))
    bar.update()
    theta, vectors = np.linalg.eigh(0.5 * (dense + dense.T))
    order = best_first(theta, which)[:k]
    info["dense"] = True
    zeros = np.zeros(k)
    pairs = Pairs(theta[order], vectors[:, order], zeros, zeros, np.ones(k, dtype=bool))
    return MethodOutput(pairs, 0.0, info)


class _BlockFit(NamedTuple):
    """LOBPCG's block after its last Rayleigh–Ritz step with A: A·x = image, and the
    Ritz values theta, best first by ``which`` after :func:`best_first`."""

    x: np.ndarray
    image: np.ndarray
    theta: np.ndarray
    anorm: float
    rounds: int


def _block_operator(counter: ProductCounter, squared: bool, bar: ProductProgress) -> LinearOperator:
    """A (or A², two products per column, for "magnitude") as LOBPCG's operator."""
    n = counter.n

    def apply(x: np.ndarray) -> np.ndarray:
        x = x.reshape(n, -1)
        out = counter.matmat(x)
        if squared:
            out = counter.matmat(out)
        bar.update()
        return out

    return LinearOperator((n, n), matvec=apply, matmat=apply, dtype=np.float64)


def _first_residual_tol(
    counter: ProductCounter, x: np.ndarray, tol: float, anorm: float, squared: bool
) -> tuple[float, float]:
    """LOBPCG's first residual tolerance sqrt(tol)·‖A‖ (times ‖A‖ again on A²) and the
    norm estimate, from one block product when there is none yet."""
    if anorm == 0.0:
        image = counter.matmat(x)
        anorm = float(np.linalg.norm(image, axis=0).max())
    residual_tol = math.sqrt(tol) * max(anorm, np.finfo(float).tiny)
    if squared:
        residual_tol *= anorm
    return residual_tol, anorm


def _run_lobpcg(
    operator: LinearOperator, x: np.ndarray, residual_tol: float, iterations: int, which: str
) -> np.ndarray:
    """scipy's LOBPCG from the block ``x``; returns the new block."""
    with warnings.catch_warnings():
        # Non-convergence is reported through the ``converged`` flags of the caller.
        warnings.filterwarnings("ignore", message=r"(?s).*not reaching the requested tol")
        warnings.filterwarnings("ignore", message=r"(?s).*Exited")
        _, x = lobpcg(
            operator, x, tol=residual_tol, maxiter=iterations, largest=which != "smallest"
        )
    return x


def _rayleigh_ritz(
    counter: ProductCounter, x: np.ndarray, bar: ProductProgress
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rayleigh–Ritz with A on the span of ``x`` (resolves ± pairs for "magnitude"):
    the rotated orthonormal block, its image and the Ritz values. The residuals
    ``image − x·theta`` are exact for the returned vectors, so no final product is
    needed."""
    x, _ = np.linalg.qr(x)
    image = counter.matmat(x)
    bar.update()
    theta, rotation = np.linalg.eigh(0.5 * (x.T @ image + image.T @ x))
    return x @ rotation, image @ rotation, theta


def _lobpcg_rounds(
    counter: ProductCounter,
    x: np.ndarray,
    k: int,
    which: str,
    tol: float,
    budget: int,
    bar: ProductProgress,
) -> _BlockFit:
    """LOBPCG rounds, each followed by a Rayleigh–Ritz step, the residual tolerance
    tightened to ``_LOBPCG_TIGHTENING`` of the smallest unmet target, until the block's
    residual bounds meet ``tol``, the budget is spent, ``_LOBPCG_MAX_ROUNDS`` rounds
    have run or a round no longer improves the worst bound/target ratio."""
    block = x.shape[1]
    squared = which == "magnitude"
    operator = _block_operator(counter, squared, bar)
    spent_before = counter.num_products
    per_iteration = (2 if squared else 1) * block
    anorm = counter.norm_estimate
    residual_tol = None
    rounds = 0
    previous_worst = np.inf
    while True:
        if residual_tol is None:
            residual_tol, anorm = _first_residual_tol(counter, x, tol, anorm, squared)
        remaining = budget - (counter.num_products - spent_before)
        # scipy's LOBPCG spends about (maxiter + 3) block products; our
        # Rayleigh–Ritz check of the block comes on top
        max_iterations = (remaining - 3 * per_iteration - block) // per_iteration
        if max_iterations >= 1:
            x = _run_lobpcg(operator, x, residual_tol, max_iterations, which)
        elif rounds > 0:
            break
        rounds += 1
        x, image, theta = _rayleigh_ritz(counter, x, bar)
        anorm = max(anorm, float(np.abs(theta).max()))
        # A block has too few Ritz values to certify a Kato–Temple gap: residual bounds
        # (joint ones for overlapping residual intervals).
        residuals = np.linalg.norm(image - x * theta, axis=0)
        order = best_first(theta, which)[:k]
        bounds = certified_bounds(theta, residuals, rest=(-np.inf, np.inf))[order]
        floor = rounding_floor(counter.eps, anorm, counter.shape[0])
        targets = np.maximum(tol * np.abs(theta[order]), floor)
        converged = bounds <= targets
        ratios = np.where(converged, 0.0, bounds / np.maximum(targets, _TINY_TARGET))
        worst = float(ratios.max())
        if (
            converged.all()
            or max_iterations < 1
            or rounds >= _LOBPCG_MAX_ROUNDS
            or worst >= previous_worst
        ):
            break
        previous_worst = worst
        unmet = float(targets[~converged].min())
        residual_tol = _LOBPCG_TIGHTENING * unmet * (anorm if squared else 1.0)
    return _BlockFit(x, image, theta, anorm, rounds)


def _verify_block(
    counter: ProductCounter,
    fit: _BlockFit,
    k: int,
    which: str,
    tol: float,
    budget: int,
    rng: np.random.Generator,
    bar: ProductProgress,
    failure_probability: float,
    info: dict,
) -> MethodOutput:
    """Lock the block's k wanted pairs in a :class:`KrylovSchur` state and run Lanczos
    from a random start orthogonal to them, within ``budget`` products: its
    probabilistic bound covers the rest of the spectrum (Courant–Fischer)."""
    n = counter.n
    order = best_first(fit.theta, which)[:k]
    residual_vectors = (fit.image - fit.x * fit.theta)[:, order]
    solver = KrylovSchur(
        n,
        k,
        which,
        tol,
        counter.eps,
        budget,
        rng.standard_normal(n),
        False,
        rng,
        krylov_dimension(n, k),
        failure_probability,
        fit.anorm,
    )
    solver.verify(fit.x[:, order], fit.theta[order], residual_vectors)
    drive(solver, counter, bar, plan=False)
    info["verification_products"] = solver.spent
    info["norm_estimate"] = solver.anorm
    return MethodOutput(solver.result(), runs_probability(solver), info)


def lobpcg_method(request: MethodRequest) -> MethodOutput:
    """scipy LOBPCG on a block of k + extra vectors, restarted with a tighter
    residual tolerance until the eigenvalue bounds meet ``tol``.

    "magnitude" runs LOBPCG on A² (two products per column) and recovers signed
    eigenvalues by a final Rayleigh–Ritz step with A. For n < 5·block the
    dense matrix is formed with one n-column ``matmat`` and diagonalized.
    LOBPCG works in whole blocks, so it may exceed ``budget`` by up to two blocks (the
    norm estimate of the first round and the closing Rayleigh–Ritz step).
    The block's residual bounds (a block's few Ritz values certify no Kato–Temple gap)
    decide when LOBPCG stops; the wanted pairs are then locked in a
    :class:`KrylovSchur` state whose run from a random start orthogonal to them
    bounds the rest of the spectrum (:meth:`KrylovSchur.verify`), within what is left
    of ``budget``: the reported bounds, convergence and failure probability are that
    state's. The dense path is exact (failure probability 0).
    """
    counter, k, which, tol, budget, rng, bar, v0, failure_probability = request
    n = counter.n
    block = min(n, k + max(2, k // 2))
    info: dict[str, Any] = {"block_size": block}
    if n < _DENSE_BLOCKS * block:
        return _dense_pairs(counter, k, which, bar, info)
    x, _ = unit_columns(v0, block, n, rng)
    spent_before = counter.num_products
    fit = _lobpcg_rounds(counter, x, k, which, tol, budget, bar)
    info["rounds"] = fit.rounds
    left = budget - (counter.num_products - spent_before)
    return _verify_block(counter, fit, k, which, tol, left, rng, bar, failure_probability, info)
