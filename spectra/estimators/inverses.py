"""Damped inverse-curvature products ``(C + λI)⁻¹ b`` by iterative solvers.

:func:`inverse` wraps any symmetric ``LinearOperator`` C (a Hessian, GGN or Fisher
operator, a dense array) and a damping λ >= 0 into an :class:`InverseOperator`, itself a
``LinearOperator`` whose products are solves of ``(C + λI) x = b``: influence functions
``(H + λI)⁻¹ g``, natural-gradient steps ``(F + λI)⁻¹ g``, Laplace posteriors.

Four solvers, all matrix-free (one product with C per iteration, LSMR two):

* ``"cg"`` — conjugate gradients (Hestenes & Stiefel 1952); needs C + λI positive definite.
  Error in the A-norm after k iterations <= 2((√κ − 1)/(√κ + 1))^k: about
  ½·√κ·ln(2/tol) products for κ = cond(C + λI). A direction p with pᵀ(C + λI)p < 0 beyond
  rounding proves C + λI is not positive definite; one with ``|pᵀ(C + λI)p| <=
  100·eps·‖C + λI‖·‖p‖²`` shows it singular (or numerically so): the solve stops and says
  which.
* ``"minres"`` — MINRES (Paige & Saunders 1975) for symmetric indefinite C + λI (a Hessian
  away from a minimum); the residual decreases monotonically, at about the rate of CG with
  κ = max|μ|/min|μ| over the eigenvalues μ of C + λI (slower when they straddle 0). On a
  singular C + λI it stops at a least-squares iterate (SciPy's stopping rules) and says so.
* ``"lsmr"`` — LSMR (Fong & Saunders 2011, ``scipy.sparse.linalg.lsmr``) on the square
  system: MINRES applied to the normal equations, so robust for any nonsingular C + λI but
  converging like CG on (C + λI)², about κ·ln(1/tol) iterations of two products each.
* ``"neumann"`` — the Neumann series ``(C + λI)⁻¹ = α Σ_k (I − α(C + λI))^k`` (Richardson
  iteration ``x ← x + α(b − (C + λI)x)``), which converges when C + λI is positive definite
  and 0 < α < 2/λ_max(C + λI): the residual shrinks by ``ρ = max|1 − αμ|`` per product, so
  with α = 1/λ_max it needs about κ·ln(1/tol) products. α is the user's ``scale`` or
  ``1/(λ₁ + bound + λ)`` from a certified top eigenvalue bound of C
  (:func:`spectra.eigenvalues` with Lanczos, products counted in ``setup_products``).

Never silently unconverged: every application ends by computing its true residual
``‖(C + λI)x − b‖`` with one more product (the recurrences' residuals drift in floating
point), restarts from it while iterations remain, and records, per right-hand side,
whether ``‖(C + λI)x − b‖ <= tol·‖b‖`` holds, the iterations, the products and the
relative residual (an :class:`~spectra.estimators.results.InverseSolve`, in
``InverseOperator.last`` and ``InverseOperator.history``). One that does not meet ``tol``
raises :class:`ConvergenceError` (default ``on_failure="raise"``), or, with
``on_failure="warn"``, warns (:class:`ConvergenceWarning`) and returns its iterate: the
best one by true residual it has seen (x = 0, residual ‖b‖, is the first), never one a
restart made worse. The
relative residual bounds the error: ``‖x − x*‖/‖x*‖ <= κ·‖r‖/‖b‖``.

``matmat`` solves the columns in lock-step (CG, MINRES, Neumann): one ``matmat`` of the
still unconverged columns per iteration, so k right-hand sides take the data passes of
the slowest one; LSMR loops over the columns.

Floating point: C's products come through the estimators' counter (finite or refused,
symmetry tested on the first products, scaled by a power of two when far from 1), so an
operator from 1e-300 to 1e300 gives the same relative residuals. A float32 operator's
products carry relative errors near 1e-7·κ: ask for ``tol`` above that.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from typing import Any

import numpy as np
from scipy.sparse.linalg import LinearOperator, lsmr

from spectra._symmetric import SymmetricProducts
from spectra._validation import check_choice, check_float, check_int, check_seed
from spectra.estimators._preamble import check_damping
from spectra.estimators._products import (
    ProductCounter,
    ProductProgress,
    SeedLike,
    as_symmetric_operator,
    check_progress,
    one_blas_thread,
    seed_setting,
)
from spectra.estimators.results import InverseSolve

__all__ = ["ConvergenceError", "ConvergenceWarning", "InverseOperator", "inverse"]

METHODS = ("cg", "minres", "lsmr", "neumann")
# Default cap on the iterations of one application: min(10·n, _DEFAULT_MAXITER).
_DEFAULT_MAXITER = 1000
# A restart from the true residual that does not shrink it by this factor is stagnation
# (the rounding of the products is reached).
_STAGNATION = 0.5
# The Neumann series diverges when the residual grows beyond this times its minimum.
_DIVERGENCE = 2.0
# Relative accuracy of the top eigenvalue behind the default Neumann scale.
_SCALE_TOL = 1e-3
# LSMR runs in restarted chunks of 20, 40, 80, 80, … iterations (see InverseOperator._lsmr).
_LSMR_CHUNK = 80


class ConvergenceError(RuntimeError):
    """An inverse application did not meet its tolerance (the message says why and what to
    do; the record is in the operator's ``last``)."""


class ConvergenceWarning(UserWarning):
    """An inverse application did not meet its tolerance and ``on_failure="warn"``."""


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside spectra and scipy (the user's line
    ``inverse(H, λ) @ g``), counted from the caller of this function."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("spectra.") or name.startswith("scipy.")):
            break
        frame = frame.f_back
        level += 1
    return level


def _norms(block: np.ndarray) -> np.ndarray:
    return np.linalg.norm(block, axis=0)


class _Shifted:
    """``M = (C/s + (λ/s)·I)/t`` on the counter's scaled products (s = counter.scale, fixed
    at the first nonzero product; t = 2^e, 1 unless λ/s exceeds 2^64, e.g. a damping of
    1e200, whose squares would overflow), so that ``M y = b`` gives ``x = y/(s·t)``.
    ``method``, ``maxiter`` and ``tol`` are the solve's, for the advice of its messages."""

    def __init__(
        self,
        counter: ProductCounter,
        damping: float,
        method: str = "cg",
        maxiter: int = _DEFAULT_MAXITER,
        tol: float = 1e-5,
    ):
        self.counter = counter
        self.damping = damping
        self.method = method
        self.maxiter = maxiter
        self.tol = tol
        self._exponent: int | None = None
        self.bar: ProductProgress | None = None  # updated after each product (see _solve)

    @property
    def scale(self) -> float:
        """s·t: M times this is C + λI (a power of two)."""
        return math.ldexp(self.counter.scale, self._exponent or 0)

    def __call__(self, block: np.ndarray) -> np.ndarray:
        product = self.counter.matmat(block)  # sets counter.scale on the first nonzero one
        if self.bar is not None:
            self.bar.update()
        shift = self.damping / self.counter.scale
        if self._exponent is None:
            # 2^e at or below λ/s when that is beyond 2^64 (exact, as the counter's scale)
            large = math.isfinite(shift) and shift > 2.0**64
            self._exponent = int(np.frexp(shift)[1]) - 1 if large else 0
        if not self._exponent:
            return product + shift * block
        return np.ldexp(product, -self._exponent) + math.ldexp(shift, -self._exponent) * block

    def unscale(self, solution: np.ndarray) -> np.ndarray:
        """x = y/(s·t), refused by the counter if it overflows float64."""
        return np.ldexp(
            self.counter.unscale(solution, "the solution", power=-1), -(self._exponent or 0)
        )


def _advised_damping(apply: _Shifted) -> str:
    """A damping that makes a singular C + λI solvable by ``apply``'s method within its
    maxiter and tol: λ' with κ = (λ_max + λ')/λ' at most the condition number the method
    solves in half of maxiter (CG, MINRES: ½·√κ·ln(2/tol) iterations; LSMR, Neumann:
    κ·ln(1/tol)) and whose rounding κ·eps stays below tol/10, and at least 1000 times the
    rounding of the products (eps·λ_max), so
    that no direction of C's null space is at its rounding level. λ_max is estimated by
    the largest ‖Cp‖/‖p‖ seen by the product counter."""
    top = apply.counter.norm_estimate * apply.counter.scale  # ‖C‖ from C's own products
    if apply.method in ("cg", "minres"):
        kappa = (apply.maxiter / math.log(2.0 / apply.tol)) ** 2
    else:
        kappa = 0.5 * apply.maxiter / math.log(1.0 / apply.tol)
    # and κ·eps (the relative residual the products' rounding allows) within tol/10
    kappa = max(min(kappa, 0.1 * apply.tol / apply.counter.eps), 2.0)
    advised = max(top / (kappa - 1.0), 1e3 * apply.counter.eps * top, np.finfo(float).tiny)
    return (
        f"add a damping ≳ {advised:.3g} (damping is now {apply.damping:g}; then κ <= "
        f"{(top + advised) / advised:.3g}, which {apply.method} solves within "
        f"maxiter={apply.maxiter}; a smaller damping needs a larger maxiter)"
    )


def _singular_reason(apply: _Shifted, norm_estimate: float, what: str) -> str:
    """The message for a numerically singular C + λI: ``what`` happened at the rounding
    level of ‖C + λI‖ (≈ ``norm_estimate`` on M's units)."""
    size = norm_estimate * apply.scale
    if apply.method == "cg":
        # CG's residual grows from its first step on an inconsistent singular system: its
        # best iterate is x = 0, no answer.
        alternative = "or use method='lsmr' with on_failure='warn' for a least-squares answer"
    else:
        alternative = "or take the best iterate with on_failure='warn' (a least-squares answer)"
    return (
        f"C + λI is singular (or numerically so): {what}, at the rounding level of "
        f"‖C + λI‖ ≈ {size:.3g}; a singular C has no inverse: "
        f"{_advised_damping(apply)}, {alternative}"
    )


def _stagnation_reason(apply: _Shifted, relative_residual: float) -> str:
    return (
        f"the residual stagnates at {relative_residual:.3g}·‖b‖ (the rounding of the "
        "products is reached: a float32 operator, or C + λI nearly singular): use a larger "
        f"tol, or {_advised_damping(apply)}"
    )


# |pᵀMp| at most this times eps·‖M‖·‖p‖² is rounding, not curvature (CG), and a MINRES
# rotation γ at most this times eps·‖T_k‖ is a singular tridiagonal.
_ROUNDING = 100.0
# MINRES's least-squares stop: ‖M r‖ <= 1000·eps·‖M‖·‖r‖ (r in M's numerical null space,
# at the rounding level of the products, eps theirs); a nonsingular M with κ(M) below
# 1/(1000·eps) (4.5e12 in float64) never meets it.
_LEAST_SQUARES_FACTOR = 1e3
_LEAST_SQUARES = _LEAST_SQUARES_FACTOR * np.finfo(float).eps  # LSMR's (float64 arithmetic)


def _cg(
    apply: _Shifted, rhs: np.ndarray, targets: np.ndarray, budget: int
) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """Conjugate gradients from 0 on the columns of ``rhs`` in lock-step, each until its
    recurrence residual is at most its target or ``budget`` iterations. A column whose
    direction has pᵀMp <= 0 stops with a reason: numerically singular when
    ``|pᵀMp| <= 100·eps·‖M‖·‖p‖²`` (‖M‖ estimated by the running max of ‖Mp‖/‖p‖),
    else indefinite (pᵀMp/pᵀp < 0 is then an upper bound on λ_min(M))."""
    n, k = rhs.shape
    x = np.zeros((n, k))
    r = rhs.copy()
    p = r.copy()
    rs = np.einsum("ij,ij->j", r, r)
    iterations = np.zeros(k, dtype=np.int64)
    reasons: list[str | None] = [None] * k
    norm_estimate = np.zeros(k)
    eps = apply.counter.eps  # the products' resolution (float32: 1.2e-7)
    active = np.sqrt(rs) > targets
    # The iterate with the smallest recurrence residual so far (x = 0 first): what a
    # column that stops short of its target returns.
    best_x = x.copy()
    best_rs = rs.copy()
    for _ in range(budget):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        mp = apply(p[:, idx])
        curvature = np.einsum("ij,ij->j", p[:, idx], mp)
        pp = np.einsum("ij,ij->j", p[:, idx], p[:, idx])
        norm_estimate[idx] = np.maximum(
            norm_estimate[idx], _norms(mp) / np.sqrt(np.where(pp > 0, pp, 1.0))
        )
        iterations[idx] += 1
        rounding = _ROUNDING * eps * norm_estimate[idx] * pp
        bad = ~(curvature > rounding)
        for j, c, p2, level in zip(idx[bad], curvature[bad], pp[bad], rounding[bad]):
            # The Rayleigh quotient of p bounds λ_min(C + λI) from above.
            quotient = float(c / p2) * apply.scale
            if abs(c) <= level:
                reasons[j] = _singular_reason(
                    apply,
                    float(norm_estimate[j]),
                    f"a direction p has pᵀ(C + λI)p/pᵀp = {quotient:.3g} at iteration "
                    f"{iterations[j]}",
                )
            else:
                reasons[j] = (
                    f"negative curvature: a direction p has pᵀ(C + λI)p/pᵀp = {quotient:.3g} "
                    f"< 0 at iteration {iterations[j]}, so C + λI is not positive definite (a "
                    "Hessian is often indefinite): use method='minres', or a damping above "
                    f"{apply.damping - quotient:.6g} (at least; the most "
                    "negative eigenvalue of C may lie further down)"
                )
            active[j] = False
        good = ~bad
        idx, mp, curvature = idx[good], mp[:, good], curvature[good]
        step = rs[idx] / curvature
        x[:, idx] += step * p[:, idx]
        r[:, idx] -= step * mp
        new = np.einsum("ij,ij->j", r[:, idx], r[:, idx])
        p[:, idx] = r[:, idx] + (new / rs[idx]) * p[:, idx]
        rs[idx] = new
        active[idx] = np.sqrt(new) > targets[idx]
        improved = idx[new < best_rs[idx]]
        best_x[:, improved] = x[:, improved]
        best_rs[improved] = rs[improved]
    # A column that met its target ends at its last iterate; the others at their best.
    met = np.sqrt(rs) <= targets
    return np.where(met, x, best_x), iterations, reasons


def _minres(
    apply: _Shifted, rhs: np.ndarray, targets: np.ndarray, budget: int
) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """MINRES from 0 (Paige & Saunders 1975) on the columns of ``rhs`` in lock-step, each
    until its residual estimate φ̄ is at most its target, its Krylov space is invariant,
    or ``budget``.

    Singular stops (SciPy's rules, on the running estimate ‖T_k‖_F of the Lanczos
    tridiagonal's norm, which bounds ‖M‖ from below): the rotation's γ_k <= 100·eps·‖T_k‖
    (T_k singular: the step would divide by rounding), cond(T_k) ≈ max γ/min γ >= 0.1/eps,
    or the least-squares test ‖M r_{k−1}‖/(‖T_k‖·‖r_{k−1}‖) <= 1000·eps (r_{k−1} lies in
    M's numerical null space: no Krylov iterate reduces it). The column then keeps its
    previous iterate and a reason naming C + λI singular."""
    n, k = rhs.shape
    x = np.zeros((n, k))
    beta = _norms(rhs)
    iterations = np.zeros(k, dtype=np.int64)
    reasons: list[str | None] = [None] * k
    active = beta > targets
    safe = np.where(beta > 0, beta, 1.0)
    r1 = rhs.copy()
    r2 = rhs.copy()
    w = np.zeros((n, k))
    w2 = np.zeros((n, k))
    old_beta = np.zeros(k)
    dbar = np.zeros(k)
    epsilon = np.zeros(k)
    phibar = beta.copy()
    cs = -np.ones(k)
    sn = np.zeros(k)
    tnorm2 = np.zeros(k)
    gmax = np.zeros(k)
    gmin = np.full(k, np.inf)
    eps = apply.counter.eps  # the products' resolution (float32: 1.2e-7)
    least_squares = _LEAST_SQUARES_FACTOR * eps
    tiny = np.finfo(float).tiny
    beta = safe
    for _ in range(budget):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        v = r2[:, idx] / beta[idx]
        y = apply(v)
        iterations[idx] += 1
        first = iterations[idx] == 1
        y -= np.where(first, 0.0, beta[idx] / np.where(first, 1.0, old_beta[idx])) * r1[:, idx]
        alpha = np.einsum("ij,ij->j", v, y)
        y -= (alpha / beta[idx]) * r2[:, idx]
        new_beta = _norms(y)
        # ‖T_k‖_F² grows by this step's column: α_k² + β_k² + β_{k+1}².
        tnorm2[idx] += alpha**2 + np.where(first, 0.0, beta[idx]) ** 2 + new_beta**2
        anorm = np.sqrt(tnorm2[idx])
        delta = cs[idx] * dbar[idx] + sn[idx] * alpha
        gbar = sn[idx] * dbar[idx] - cs[idx] * alpha
        new_dbar = -cs[idx] * new_beta
        # ‖M r_{k−1}‖/‖r_{k−1}‖ of the previous iterate (SciPy's test2 numerator).
        root = np.hypot(gbar, new_dbar)
        gamma = np.hypot(gbar, new_beta)
        level = _ROUNDING * eps * anorm
        cond = np.maximum(gmax[idx], gamma) / np.maximum(np.minimum(gmin[idx], gamma), tiny)
        singular = (gamma <= level) | (cond >= 0.1 / eps) | (root <= least_squares * anorm)
        singular &= anorm > 0
        for position in np.flatnonzero(singular):
            j = idx[position]
            if root[position] <= least_squares * anorm[position]:
                what = (
                    f"the residual ‖r‖ = {phibar[j]:.3g}·‖b‖ lies in its numerical null space "
                    f"(‖(C + λI)r‖/(‖C + λI‖·‖r‖) = {root[position] / anorm[position]:.3g}, "
                    "a least-squares solution)"
                )
            else:
                what = (
                    f"the Lanczos tridiagonal's condition number reached "
                    f"{max(cond[position], anorm[position] / max(gamma[position], tiny)):.3g}"
                )
            reasons[j] = _singular_reason(apply, float(anorm[position]), what)
        active[idx[singular]] = False
        ok = ~singular
        idx, alpha, new_beta, delta, gbar = idx[ok], alpha[ok], new_beta[ok], delta[ok], gbar[ok]
        gamma, anorm, new_dbar, y, v = gamma[ok], anorm[ok], new_dbar[ok], y[:, ok], v[:, ok]
        r1[:, idx] = r2[:, idx]
        r2[:, idx] = y
        old_beta[idx] = beta[idx]
        old_epsilon = epsilon[idx]
        epsilon[idx] = sn[idx] * new_beta
        dbar[idx] = new_dbar
        gmax[idx] = np.maximum(gmax[idx], gamma)
        gmin[idx] = np.minimum(gmin[idx], gamma)
        cs[idx] = gbar / gamma
        sn[idx] = new_beta / gamma
        phi = cs[idx] * phibar[idx]
        phibar[idx] = sn[idx] * phibar[idx]
        w1 = w2[:, idx]
        w2[:, idx] = w[:, idx]
        w[:, idx] = (v - old_epsilon * w1 - delta * w2[:, idx]) / gamma
        # The step φ·w reduces the residual by ‖M φw‖ = |φ| (M W_k = V_{k+1} T̄_k R_k⁻¹),
        # so M acts on the direction w like an eigenvalue 1/‖w‖: at most 100·eps·‖M‖, w
        # runs along M's numerical null space (a near-zero γ of a singular M), and the step
        # would add a huge null-space component that barely moves the residual (MINRES
        # on an inconsistent singular system): the column stops at its previous iterate,
        # a least-squares-like answer of moderate norm.
        w_norms = _norms(w[:, idx])
        blown = (w_norms * _ROUNDING * eps * anorm >= 1.0) & (anorm > 0)
        for position in np.flatnonzero(blown):
            j = idx[position]
            reasons[j] = _singular_reason(
                apply,
                float(anorm[position]),
                f"a MINRES direction w has ‖(C + λI)w‖/‖w‖ ≈ "
                f"{apply.scale / w_norms[position]:.3g} at iteration {iterations[j]}",
            )
        keep = ~blown
        x[:, idx[keep]] += phi[keep] * w[:, idx[keep]]
        invariant = new_beta <= _ROUNDING * eps * anorm
        beta[idx] = np.where(invariant, 1.0, new_beta)
        active[idx] = (phibar[idx] > targets[idx]) & ~invariant & keep
    return x, iterations, reasons


def _neumann(
    apply: _Shifted, rhs: np.ndarray, targets: np.ndarray, budget: int, alpha: float
) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """Neumann partial sums ``x_{k+1} = x_k + α r_k``, ``r_{k+1} = r_k − α M r_k`` (one
    product each) on the columns in lock-step, each until ‖r‖ <= target, ``budget``, or a
    residual above twice its minimum (divergence)."""
    n, k = rhs.shape
    x = np.zeros((n, k))
    r = rhs.copy()
    norms = _norms(r)
    lowest = norms.copy()
    iterations = np.zeros(k, dtype=np.int64)
    reasons: list[str | None] = [None] * k
    active = norms > targets
    for _ in range(budget):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        mr = apply(r[:, idx])
        # α is for C + λI; the products are of M = (C + λI)/s, so α·s is M's scale.
        scaled_alpha = alpha * apply.scale
        iterations[idx] += 1
        x[:, idx] += scaled_alpha * r[:, idx]
        r[:, idx] -= scaled_alpha * mr
        norms[idx] = _norms(r[:, idx])
        lowest[idx] = np.minimum(lowest[idx], norms[idx])
        diverging = ~(norms[idx] <= _DIVERGENCE * lowest[idx])
        for j in idx[diverging]:
            reasons[j] = (
                f"the Neumann series diverges (the residual grew to {norms[j] / lowest[j]:.3g} "
                f"times its minimum at iteration {iterations[j]}): C + λI is not positive "
                f"definite, or scale={alpha:.6g} is above 2/λ_max(C + λI); use method='minres' "
                "for an indefinite C + λI, or a smaller scale"
            )
        active[idx] = (norms[idx] > targets[idx]) & ~diverging
    return x, iterations, reasons


class InverseOperator(SymmetricProducts, LinearOperator):
    """``(C + λI)⁻¹`` as a symmetric ``LinearOperator`` whose products are iterative solves
    (see :func:`inverse`, which builds it, and the module docstring).

    Attributes
    ----------
    last : InverseSolve or None
        the record of the latest application (per column: converged, iterations,
        relative residual; its products, data passes and wall time).
    history : list of InverseSolve
        the records of every application, oldest first.
    num_products : int
        products with C over all applications, ``setup_products`` (the Neumann scale's
        eigenvalue run) included.
    scale : float or None
        the Neumann scale α (None for the other methods).
    """

    def __init__(
        self,
        counter: ProductCounter,
        damping: float,
        method: str,
        tol: float,
        maxiter: int,
        on_failure: str,
        scale: float | None,
        setup_products: int,
        settings: dict[str, Any],
        progress: bool | None = None,
    ):
        self.counter = counter
        self.damping = damping
        self.method = method
        self.tol = tol
        self.maxiter = maxiter
        self.on_failure = on_failure
        self.scale = scale
        self.setup_products = setup_products
        self.settings = settings
        self.progress = progress
        self.last: InverseSolve | None = None
        self.history: list[InverseSolve] = []
        super().__init__(dtype=np.float64, shape=(counter.n, counter.n))

    @property
    def num_products(self) -> int:
        return self.setup_products + self.counter.num_products

    def _inner(
        self, apply: _Shifted, rhs: np.ndarray, targets: np.ndarray, budget: int
    ) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
        if self.method == "cg":
            return _cg(apply, rhs, targets, budget)
        if self.method == "minres":
            return _minres(apply, rhs, targets, budget)
        if self.method == "neumann":
            assert self.scale is not None
            return _neumann(apply, rhs, targets, budget, self.scale)
        return self._lsmr(apply, rhs, targets, budget)

    @staticmethod
    def _lsmr(
        apply: _Shifted, rhs: np.ndarray, targets: np.ndarray, budget: int
    ) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
        """scipy's LSMR per column (two products per iteration), stopping at
        ‖r‖ <= target (atol = 0, no condition limit).

        LSMR exposes no iterates, so it runs in chunks of 20, 40, then 80 iterations, each
        restarted from the last iterate (also when LSMR's estimate meets the target), with
        one product for the true residual after each: a chunk that neither halves the true
        residual nor keeps LSMR's own residual estimate within a factor 2 of it has reached
        the rounding of the products (stagnation, as CG and MINRES detect it at their
        restarts); one whose ‖Mᵀr‖ estimate is at most 1000·eps·‖M‖·‖r‖ (LSMR's Frobenius
        estimate of ‖M‖) has reached a least-squares solution of a singular M."""
        n, k = rhs.shape
        x = np.zeros((n, k))
        iterations = np.zeros(k, dtype=np.int64)
        reasons: list[str | None] = [None] * k

        def product(vector: np.ndarray) -> np.ndarray:
            return apply(np.asarray(vector, dtype=np.float64).reshape(n, 1))[:, 0]

        system = LinearOperator((n, n), matvec=product, rmatvec=product, dtype=np.float64)
        for j in range(k):
            norm = float(np.linalg.norm(rhs[:, j]))
            if not norm > targets[j]:
                continue
            btol = min(targets[j] / norm, 0.5)
            true = norm
            chunk = 20
            while iterations[j] < budget:
                steps = min(chunk, budget - int(iterations[j]))
                solution = lsmr(
                    system,
                    rhs[:, j],
                    atol=0.0,
                    btol=btol,
                    conlim=0.0,
                    maxiter=steps,
                    x0=x[:, j] if iterations[j] else None,
                )
                x[:, j] = solution[0]
                iterations[j] += int(solution[2])
                previous, true = true, float(np.linalg.norm(rhs[:, j] - product(x[:, j])))
                if true <= targets[j]:
                    break
                if true > _STAGNATION * previous and float(solution[3]) < true / 2:
                    reasons[j] = _stagnation_reason(apply, true / norm)
                    break
                # ‖Mᵀr‖ <= 1000·eps·‖M‖·‖r‖: r in M's numerical null space, as in MINRES.
                normar, norma = float(solution[4]), float(solution[5])
                if normar <= _LEAST_SQUARES * norma * float(solution[3]):
                    reasons[j] = _singular_reason(
                        apply,
                        norma,
                        f"the residual ‖r‖ = {true / norm:.3g}·‖b‖ lies in its numerical "
                        "null space (a least-squares solution)",
                    )
                    break
                chunk = min(2 * chunk, _LSMR_CHUNK)
        return x, iterations, reasons

    def _solve(self, block: np.ndarray) -> np.ndarray:
        """Solve (C + λI) X = B for the (n, k) block B, with the restarts, the check of the
        true residuals and the record described in :func:`inverse`."""
        started = time.perf_counter()
        products_before = self.counter.num_products
        calls_before = self.counter.num_operator_calls
        block = np.asarray(block, dtype=np.float64)
        if block.ndim != 2 or block.shape[0] != self.shape[0]:
            raise ValueError(
                f"the inverse of an n = {self.shape[0]} operator multiplies vectors of length "
                f"{self.shape[0]}, got shape {block.shape}"
            )
        if not np.all(np.isfinite(block)):
            raise ValueError(
                "the right-hand side b of (C + λI)x = b must be finite, got NaN or Inf entries"
            )
        n, k = block.shape
        norms = _norms(block)
        # Unit right-hand sides: solve M y = b/‖b‖ with M = (C + λI)/s, then x = y·‖b‖/s.
        rhs = block / np.where(norms > 0, norms, 1.0)
        apply = _Shifted(self.counter, self.damping, self.method, self.maxiter, self.tol)
        # The bar plans maxiter iterations per column (LSMR: two products each), and ends
        # at the products made.
        per_iteration = 2 if self.method == "lsmr" else 1
        bar = ProductProgress(
            self.counter,
            per_iteration * self.maxiter * k,
            f"inverse ({self.method})",
            self.progress,
        )
        apply.bar = bar
        targets = np.full(k, self.tol)
        y = np.zeros((n, k))
        residual = rhs.copy()
        residual_norms = _norms(residual)
        iterations = np.zeros(k, dtype=np.int64)
        reasons: list[str | None] = [None] * k
        pending = (norms > 0) & (residual_norms > targets)
        # The best iterate so far by true residual (y = 0 has residual 1): a solve never
        # returns an iterate worse than one it has seen.
        best_y = y.copy()
        best_residual = residual.copy()
        best_norms = residual_norms.copy()
        with one_blas_thread(), bar:
            while np.any(pending):
                idx = np.flatnonzero(pending)
                budget = self.maxiter - int(iterations[idx].max())
                if budget <= 0:
                    break
                correction, taken, inner_reasons = self._inner(
                    apply, residual[:, idx], targets[idx], budget
                )
                iterations[idx] += taken
                y[:, idx] += correction
                residual[:, idx] = rhs[:, idx] - apply(y[:, idx])
                new_norms = _norms(residual[:, idx])
                for position, j in enumerate(idx):
                    if inner_reasons[position] is not None:
                        reasons[j] = inner_reasons[position]
                    elif (
                        taken[position] < budget
                        and new_norms[position] > targets[j]
                        and new_norms[position] > _STAGNATION * residual_norms[j]
                        and new_norms[position] <= best_norms[j]
                        and iterations[j] < self.maxiter
                    ):
                        reasons[j] = _stagnation_reason(apply, float(new_norms[position]))
                worse = new_norms > best_norms[idx]
                for spot in np.flatnonzero(worse):
                    column = idx[spot]
                    if new_norms[spot] <= _DIVERGENCE * best_norms[column]:
                        if reasons[column] is None:
                            reasons[column] = _stagnation_reason(apply, float(best_norms[column]))
                    elif reasons[column] is None:
                        reasons[column] = (
                            "C + λI is singular (or numerically so): the true residual grew "
                            f"to {new_norms[spot]:.3g}·‖b‖, above the best iterate's "
                            f"{best_norms[column]:.3g}·‖b‖ (returned instead): "
                            + _advised_damping(apply)
                        )
                better, revert = idx[~worse], idx[worse]
                best_y[:, better] = y[:, better]
                best_residual[:, better] = residual[:, better]
                best_norms[better] = new_norms[~worse]
                y[:, revert] = best_y[:, revert]
                residual[:, revert] = best_residual[:, revert]
                new_norms = best_norms[idx]
                residual_norms[idx] = new_norms
                pending = (
                    (norms > 0)
                    & (residual_norms > targets)
                    & (iterations < self.maxiter)
                    & np.array([reason is None for reason in reasons])
                )
        converged = (norms == 0) | (residual_norms <= targets)
        for j in np.flatnonzero(converged):
            reasons[j] = None  # met tol (e.g. at the iterate before a breakdown)
        for j in np.flatnonzero(~converged):
            if reasons[j] is None:
                reasons[j] = (
                    f"maxiter={self.maxiter} iterations reached with a relative residual "
                    f"{residual_norms[j]:.3g} > tol={self.tol:g}: raise maxiter or damping "
                    f"(the method needs {self._cost_note()})"
                )
        solution = apply.unscale(y) * np.where(norms > 0, norms, 0.0)
        if not np.all(np.isfinite(solution)):
            raise ValueError(
                "inverse: the solution overflows float64 (C + λI is nearly singular at this "
                "scale): use a larger damping"
            )
        reason = next((r for r in reasons if r is not None), None)
        record = InverseSolve(
            method=self.method,
            converged=converged,
            iterations=iterations,
            relative_residuals=np.where(norms > 0, residual_norms, 0.0),
            tol=self.tol,
            damping=self.damping,
            num_products=self.counter.num_products - products_before,
            num_operator_calls=self.counter.num_operator_calls - calls_before,
            wall_time=time.perf_counter() - started,
            reason=reason,
            settings=dict(self.settings),
        )
        self.last = record
        self.history.append(record)
        if reason is not None:
            bad = int(np.count_nonzero(~converged))
            message = (
                f"inverse ({self.method}): {bad} of {k} right-hand side(s) not solved to "
                f"tol={self.tol:g}: {reason}"
            )
            if self.on_failure == "raise":
                raise ConvergenceError(message)
            warnings.warn(message, ConvergenceWarning, stacklevel=_caller_level())
        return solution

    def _cost_note(self) -> str:
        return {
            "cg": "about ½·√κ·ln(2/tol) iterations",
            "minres": "about ½·√κ·ln(2/tol) iterations for κ = max|μ|/min|μ|",
            "lsmr": "about κ·ln(1/tol) iterations",
            "neumann": "about κ·ln(1/tol) iterations with scale = 1/λ_max",
        }[self.method]

    def _matmat(self, block: np.ndarray) -> np.ndarray:
        return self._solve(np.asarray(block))


def inverse(
    op: Any,
    damping: float,
    method: str = "cg",
    tol: float = 1e-5,
    maxiter: int | None = None,
    on_failure: str = "raise",
    scale: float | None = None,
    seed: SeedLike = 0,
    check_symmetry: bool = True,
    progress: bool | None = None,
) -> InverseOperator:
    """``(C + λI)⁻¹`` as a ``LinearOperator``: ``inverse(H, 1e-3) @ g`` solves
    ``(H + 10⁻³I) x = g`` iteratively, and tells when it could not.

    Parameters
    ----------
    op
        a symmetric C: LinearOperator (a curvature operator), dense array or sparse matrix.
    damping
        λ >= 0, added to C's diagonal.
    method
        "cg" (C + λI positive definite: a GGN, a Fisher, a Hessian damped above its most
        negative eigenvalue), "minres" (any nonsingular symmetric C + λI), "lsmr" or
        "neumann" (positive definite, see ``scale``); the module docstring gives each one's
        rate.
    tol
        each application meets ``‖(C + λI)x − b‖ <= tol·‖b‖`` for every column b, checked
        on the true residual (one extra product per restart), which bounds the error by
        ``‖x − x*‖ <= κ·tol·‖x*‖``.
    maxiter
        cap on the iterations of one application (per column; LSMR counts two products per
        iteration). Default min(10·n, 1000).
    on_failure
        "raise" (default): an application that does not meet ``tol`` raises
        :class:`ConvergenceError`; "warn": it warns (:class:`ConvergenceWarning`) and
        returns its iterate. Either way the record is in the operator's ``last``.
    scale
        the Neumann scale α, 0 < α < 2/λ_max(C + λI) (method "neumann" only). Default:
        ``1/(λ₁ + bound + λ)`` from :func:`spectra.eigenvalues` (Lanczos, tol 1e-3, the
        given ``seed``), whose bound holds with probability 1 − 1e-4; an α above 2/λ_max
        makes the series diverge, which is detected and reported.
    seed
        seed of that eigenvalue run.
    check_symmetry
        test C's symmetry on its first products (no extra product).
    progress : None, True or False
        a bar over the products of each application (and of the Neumann scale's eigenvalue
        run): None (default) on a terminal for applications longer than ~2 s; True: at
        once; False: none.

    Returns
    -------
    InverseOperator
        a float64 n × n ``LinearOperator``; ``matvec``/``matmat``/``@`` solve, and each
        application's :class:`~spectra.estimators.results.InverseSolve` record is in
        ``last`` and ``history``.

    Raises
    ------
    TypeError
        an argument of the wrong type.
    ValueError
        a value out of range (a negative damping, a scale with another method, an
        unknown method), a non-square operator, or a Neumann default scale for a C + λI
        whose top eigenvalue is not positive.

    Notes
    -----
    Cost per application and right-hand side, in products with C: CG about
    ½·√κ·ln(2/tol), MINRES similar with κ = max|μ|/min|μ|, LSMR and Neumann about
    κ·ln(1/tol) (LSMR's iterations cost two), plus one per restart for the true residual.
    Memory: a few n × k blocks (k right-hand sides).
    """
    damping = check_damping(damping)
    method = check_choice("method", method, METHODS)
    tol = check_float("tol", tol, below=1.0)
    maxiter = check_int("maxiter", maxiter, allow_none=True)
    on_failure = check_choice("on_failure", on_failure, ("raise", "warn"))
    scale = check_float("scale", scale, allow_none=True)
    check_seed("seed", seed)
    progress = check_progress(progress)
    if scale is not None and method != "neumann":
        raise ValueError(
            f"scale is the Neumann series' step, for method='neumann' only, got method={method!r}"
        )
    counter = as_symmetric_operator(op, "inverse", check_symmetry)
    n = counter.n
    if maxiter is None:
        maxiter = min(10 * n, _DEFAULT_MAXITER)
    setup_products = 0
    top = None
    if method == "neumann" and scale is None:
        from spectra.estimators.eigensolvers import eigenvalues

        result = eigenvalues(
            op,
            k=1,
            which="largest",
            tol=_SCALE_TOL,
            seed=seed,
            check_symmetry=check_symmetry,
            progress=progress,
        )
        setup_products = result.num_products
        top = float(result.eigenvalues[0] + result.error_bounds[0]) + damping
        if not (math.isfinite(top) and top > 0):
            raise ValueError(
                f"inverse: the top eigenvalue of C + λI is about {top:.3g} <= 0, so C + λI is "
                "not positive definite and the Neumann series cannot converge: use "
                "method='minres'"
            )
        scale = 1.0 / top
    settings = {
        "method": method,
        "damping": damping,
        "tol": tol,
        "maxiter": maxiter,
        "on_failure": on_failure,
        "scale": scale,
        "lambda_max_bound": top,
        "seed": seed_setting(seed),
        "dimension": n,
    }
    return InverseOperator(
        counter,
        damping,
        method,
        tol,
        maxiter,
        on_failure,
        scale,
        setup_products,
        settings,
        progress,
    )
