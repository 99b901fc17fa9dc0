"""Lanczos tridiagonalization of a symmetric operator.

Lanczos (1950) builds an orthonormal basis Q of the Krylov space
span{q₁, A q₁, …, A^{m−1} q₁} and the tridiagonal T = Qᵀ A Q with
``A Q = Q T + β_m q_{m+1} e_mᵀ``. In floating point the basis loses
orthogonality as Ritz values converge (Paige 1971); full reorthogonalization
(two passes of classical Gram–Schmidt against the stored basis) keeps it at
working precision for O(n m) extra work per step and n m stored numbers.
See Parlett, "The Symmetric Eigenvalue Problem" (1998), ch. 13, and
Golub & Van Loan, "Matrix Computations", §10.1.

Holds :func:`lanczos` (one start vector: m steps cost m products in m ``matvec`` calls,
i.e. m data passes of a Hessian, O(n m²) host flops and n m stored numbers) and
``batched_lanczos`` (P start vectors in lock-step, as :func:`spectra.spectral_density`
runs them: P products per step in ONE ``matmat`` call, so m data passes for P·m products,
and P n m stored numbers). The tridiagonal T is turned into eigenvalues, Ritz vectors and
quadrature nodes by :mod:`spectra.estimators.tridiagonal`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from spectra._validation import check_int
from spectra.estimators._products import (
    ProductCounter,
    ProductProgress,
    SeedLike,
    as_symmetric_operator,
    one_blas_thread,
    orthogonalize,
    seed_setting,
    seeded_rng,
)
from spectra.estimators.results import LanczosResult
from spectra.estimators.tridiagonal import tridiagonal_eigh

__all__ = ["lanczos", "tridiagonal_eigh"]

# Breakdown (invariant subspace) when β_j <= _BREAKDOWN_FACTOR · eps · ‖T‖.
_BREAKDOWN_FACTOR = 100.0


def _breakdown_threshold(counter: ProductCounter, scale: float) -> float:
    return _BREAKDOWN_FACTOR * counter.eps * scale


def _lanczos_recurrence(
    counter: ProductCounter,
    start: np.ndarray,
    num_steps: int,
    reorthogonalize: bool,
    keep_basis: bool,
    progress_bar: Any = None,
) -> tuple[np.ndarray, np.ndarray, float, bool, np.ndarray | None]:
    """Run up to ``num_steps`` Lanczos steps from ``start`` (one matvec per step).

    Returns (alpha, beta_offdiagonal, residual_norm, breakdown, basis rows or None).
    """
    n = counter.n
    store = reorthogonalize or keep_basis
    basis = np.empty((num_steps, n)) if store else None
    alphas: list[float] = []
    betas: list[float] = []
    q = start / np.linalg.norm(start)
    q_previous = np.zeros(n)
    beta_previous = 0.0
    scale = 0.0
    breakdown = False
    for step in range(num_steps):
        if basis is not None:
            basis[step] = q
        w = counter.matvec(q)
        if progress_bar is not None:
            progress_bar.update()
        alpha = float(q @ w)
        w -= alpha * q + beta_previous * q_previous
        if reorthogonalize:
            assert basis is not None  # stored whenever reorthogonalizing
            w, _ = orthogonalize(w, basis[: step + 1])
        beta = float(np.linalg.norm(w))
        alphas.append(alpha)
        betas.append(beta)
        scale = max(scale, abs(alpha) + beta + beta_previous)
        if beta <= _breakdown_threshold(counter, scale):
            breakdown = step + 1 < num_steps
            break
        q_previous, q = q, w / beta
        beta_previous = beta
    m = len(alphas)
    rows = basis[:m] if basis is not None and keep_basis else None
    return np.array(alphas), np.array(betas[:-1]), betas[-1], breakdown, rows


def lanczos(
    op: Any,
    num_steps: int,
    v0: np.ndarray | None = None,
    reorthogonalize: bool = True,
    return_basis: bool = False,
    seed: SeedLike = 0,
    check_symmetry: bool = True,
    progress: bool | None = None,
) -> LanczosResult:
    """Lanczos tridiagonalization with optional full reorthogonalization.

    Starting from ``v0`` (or a Gaussian vector from ``seed``), builds T (m × m,
    m <= min(num_steps, n)) with ``Qᵀ A Q = T``. Stops early on breakdown
    (β_j <= 100·eps·‖T‖: Q spans an invariant subspace, e.g. after rank(A) steps
    for a low-rank A), returning the shorter T; the eigenvalues of T are then
    exact eigenvalues of A.

    Cost: m products in m ``matvec`` calls, O(n m²) host flops and n m stored
    numbers with reorthogonalization. The recurrence runs on products scaled by a power
    of two when they are far from 1 (exact; see ``ProductCounter``), so T is right for
    operators from 1e-300 to 1e300 (refused if it overflows). Without it, only three
    vectors are kept
    (unless ``return_basis``), and T shows the well-known spurious copies of
    converged Ritz values. The symmetry check uses the first two products (no
    extra one unless m = 1). ``progress``: None (default) a bar on a terminal for runs
    longer than ~2 s; True at once; False none.
    """
    started = time.perf_counter()
    num_steps = check_int("num_steps", num_steps)
    counter = as_symmetric_operator(op, "lanczos", check_symmetry)
    n = counter.n
    rng = seeded_rng(seed)
    if v0 is None:
        start = rng.standard_normal(n)
    else:
        start = np.asarray(v0, dtype=np.float64).reshape(-1)
        if start.shape[0] != n:
            raise ValueError(f"v0 must have length {n}, got {start.shape[0]}")
        if not np.linalg.norm(start) > 0 or not np.all(np.isfinite(start)):
            raise ValueError("v0 must be a finite, nonzero vector")
    with (
        one_blas_thread(),
        ProductProgress(counter, min(num_steps, n), "lanczos", progress) as bar,
    ):
        alpha, beta, residual_norm, breakdown, rows = _lanczos_recurrence(
            counter, start, min(num_steps, n), reorthogonalize, return_basis, bar
        )
        counter.finish()
    # The recurrence ran on the counter's scaled products (A / scale, a power of two).
    alpha = counter.unscale(alpha, "the tridiagonal T (alpha)")
    beta = counter.unscale(beta, "the tridiagonal T (beta)")
    residual_norm = counter.unscale(residual_norm, "the residual norm")
    return LanczosResult(
        alpha=alpha,
        beta=beta,
        residual_norm=float(residual_norm),
        breakdown=bool(breakdown),
        num_products=counter.num_products,
        num_operator_calls=counter.num_operator_calls,
        wall_time=time.perf_counter() - started,
        settings={
            "num_steps": num_steps,
            "reorthogonalize": bool(reorthogonalize),
            "seed": seed_setting(seed),
            "v0_given": v0 is not None,
            "dimension": n,
        },
        basis=None if rows is None else np.ascontiguousarray(rows.T),
    )


def batched_lanczos(
    counter: ProductCounter,
    starts: np.ndarray,
    num_steps: int,
    progress_bar: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Independent Lanczos recurrences for P start vectors, run in lock-step.

    ``starts`` has shape (n, P). Each step multiplies the current vectors of all
    still-active probes in one ``matmat`` call; each probe keeps its own basis and
    is fully reorthogonalized against it (batched matrix products). A probe
    that breaks down stops: it takes no further products and its later steps
    are absent. Returns alpha (P, m), beta (P, m) (beta[:, j] couples steps j and
    j+1) and steps_taken (P,).
    """
    n, num_probes = starts.shape
    num_steps = min(num_steps, n)
    basis = np.zeros((num_probes, num_steps, n))
    alpha = np.zeros((num_probes, num_steps))
    beta = np.zeros((num_probes, num_steps))
    steps_taken = np.zeros(num_probes, dtype=np.int64)
    scale = np.zeros(num_probes)
    current = (starts / np.linalg.norm(starts, axis=0)).T.copy()  # (P, n)
    previous = np.zeros_like(current)
    active = np.ones(num_probes, dtype=bool)
    for step in range(num_steps):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        basis[idx, step] = current[idx]
        w = counter.matmat(current[idx].T).T  # (a, n)
        a = np.einsum("pn,pn->p", current[idx], w)
        beta_previous = beta[idx, step - 1] if step > 0 else np.zeros(idx.size)
        w -= a[:, None] * current[idx] + beta_previous[:, None] * previous[idx]
        # A view when every probe is active (the common case): fancy indexing would
        # copy the whole stored basis at every step.
        if idx.size == num_probes:
            stored = basis[:, : step + 1]  # (P, j, n), no copy
        else:
            stored = basis[idx, : step + 1]  # (a, j, n)
        w, _ = orthogonalize(w, stored)
        b = np.linalg.norm(w, axis=1)
        alpha[idx, step] = a
        beta[idx, step] = b
        steps_taken[idx] = step + 1
        scale[idx] = np.maximum(scale[idx], np.abs(a) + b + beta_previous)
        broke = b <= _breakdown_threshold(counter, 1.0) * scale[idx]
        still = idx[~broke]
        active[idx[broke]] = False
        previous[still] = current[still]
        current[still] = w[~broke] / b[~broke, None]
        if progress_bar is not None:
            progress_bar.update()
    return alpha, beta, steps_taken
