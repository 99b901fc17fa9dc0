"""Extreme eigenvalues of a symmetric operator.

Three methods, all driven through ``matvec``/``matmat`` only:

* ``"lanczos"`` (default): Krylov–Schur restarted Lanczos (Stewart 2001; for
  symmetric A equivalent to thick-restart Lanczos, Wu & Simon 2000) with full
  reorthogonalization, stopping on the eigenvalue error bound
  ``min(r, r²/gap)`` of each Ritz pair (Parlett 1998, §11.7; Saad, "Numerical
  Methods for Large Eigenvalue Problems", 2nd ed., §4.3 and §6), where
  ``r = |β · s_m|`` is the residual norm of the Ritz pair and ``gap`` the
  distance to the nearest other Ritz value. Because the eigenvalue error is
  quadratic in the residual, this stops much earlier than ARPACK (``eigsh``),
  whose tolerance is on the residual.
* ``"power"``: power iteration with deflation, as in PyHessian (Yao et al. 2020).
  Stops on the residual ``‖Av − λv‖ <= tol·|λ|``. Its convergence factor per
  product is |λ₂/λ₁| instead of Lanczos' Chebyshev-accelerated rate, so it
  needs many more products; it is here for parity with published numbers.
* ``"lobpcg"``: scipy's LOBPCG (Knyazev 2001) on a block of k + extra vectors,
  so each data pass multiplies a whole block.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import numpy as np
from scipy.sparse.linalg import LinearOperator, lobpcg

from spectra._operators import (
    SeedLike,
    _as_symmetric_operator,
    _check_choice,
    _check_int,
    _orthogonalize,
    _ProductCounter,
    _progress,
    _rng,
)
from spectra.results import EigenResult

__all__ = ["eigenvalue_ratio", "eigenvalues"]

_WHICH = ("largest", "smallest", "magnitude")
_METHODS = ("lanczos", "power", "lobpcg")
# Breakdown of a Lanczos step when β <= factor · eps · ‖A‖ (estimate).
_BREAKDOWN_FACTOR = 100.0
# Eigenvalue errors below factor · eps · ‖A‖ count as converged whatever ``tol``.
_FLOOR_FACTOR = 10.0


def _order(values: np.ndarray, which: str) -> np.ndarray:
    """Indices sorting ``values`` best-first for ``which`` (stable: ties keep order)."""
    if which == "largest":
        key = -values
    elif which == "smallest":
        key = values
    else:
        key = -np.abs(values)
    return np.argsort(key, kind="stable")


def _key(value: float, which: str) -> float:
    if which == "largest":
        return -value
    if which == "smallest":
        return value
    return -abs(value)


def _gaps(values: np.ndarray, others: np.ndarray, other_residuals: np.ndarray) -> np.ndarray:
    """Safeguarded gap from each value to the rest of the spectrum.

    For each value, ``min_j (|θ − θ_j| − r_j)`` over the other Ritz values θ_j
    (with residuals r_j), floored at 0: a neighbour is trusted only as far as
    its own residual localizes it. Each value's own entry in ``others`` is
    skipped once (an equal second value gives gap 0). A lone value gives inf.
    """
    if values.size == 0:
        return np.zeros(0)
    if others.size < 2:
        return np.full(values.shape, np.inf)
    distances = np.abs(values[:, None] - others[None, :]) - other_residuals[None, :]
    for row, value in enumerate(values):
        own = np.flatnonzero(others == value)
        if own.size:
            distances[row, own[0]] = np.inf
    return np.maximum(distances.min(axis=1), 0.0)


def _error_bounds(
    values: np.ndarray,
    residuals: np.ndarray,
    others: np.ndarray,
    other_residuals: np.ndarray,
) -> np.ndarray:
    """Eigenvalue error bounds ``min(r, r²/gap)`` (Parlett 1998, §11.7).

    Without a finite positive gap (a single Ritz value, or an unresolved
    neighbour) the bound is the residual r itself.
    """
    gap = _gaps(values, others, other_residuals)
    usable = np.isfinite(gap) & (gap > 0)
    quadratic = np.full(values.shape, np.inf)
    quadratic[usable] = residuals[usable] ** 2 / gap[usable]
    return np.minimum(residuals, quadratic)


def _targets(values: np.ndarray, tol: float, floor: float) -> np.ndarray:
    return np.maximum(tol * np.abs(values), floor)


class _KrylovSchur:
    """Krylov–Schur restarted Lanczos with locking and multiplicity checks.

    Maintains ``A Vᵀ = Vᵀ H + f bᵀ`` for the active orthonormal rows V (j of them),
    the symmetric projected matrix H (the Rayleigh quotient V A Vᵀ) and the unit
    residual direction f; each step multiplies f once and fully reorthogonalizes
    against V and the locked vectors (two classical Gram–Schmidt passes). After
    every step the Ritz pairs of H are checked; when the active space is full,
    the best Ritz vectors are kept and H becomes diagonal plus the coupling b
    (thick restart). On breakdown (β ≈ 0: V spans an invariant subspace) the
    Ritz pairs are exact and the space is extended by a random direction.

    A single-vector Krylov space contains one vector of each eigenspace, so a
    repeated eigenvalue shows up once. For k > 1, when all wanted pairs have
    converged they are locked and a new run starts from a random vector
    orthogonal to them; a second copy of a wanted eigenvalue then appears as
    that run's best Ritz value and is locked in turn. The process ends when a
    converged verification run finds nothing better than the k-th locked value.
    This costs about one more single-eigenvalue convergence per check.
    """

    def __init__(
        self,
        counter: _ProductCounter,
        k: int,
        which: str,
        tol: float,
        budget: int,
        start: np.ndarray,
        rng: np.random.Generator,
        ncv: int,
        progress_bar: Any,
    ):
        self.counter = counter
        self.n = counter.n
        self.k = k
        self.which = which
        self.tol = tol
        self.budget = budget
        self.rng = rng
        self.ncv = ncv
        self.bar = progress_bar
        self.anorm = counter.norm_estimate or 0.0
        self.locked = np.zeros((0, self.n))
        self.locked_values = np.zeros(0)
        self.locked_bounds = np.zeros(0)
        self.basis = np.zeros((ncv, self.n))
        self.projected = np.zeros((ncv, ncv))
        self.coupling = np.zeros(ncv)
        self.size = 0
        self.residual_direction = start / np.linalg.norm(start)
        self.exhausted = False
        self.verifying = False
        self.spent = 0
        self.theta = np.zeros(0)
        self.ritz_vectors = np.zeros((0, 0))
        self.ritz_residuals = np.zeros(0)

    # -- building blocks -------------------------------------------------
    def _fresh_direction(self) -> bool:
        """Random unit vector orthogonal to locked and active vectors; False if none left."""
        if self.locked.shape[0] + self.size >= self.n:
            return False
        vector = self.rng.standard_normal(self.n)
        vector = _orthogonalize(vector, self.locked)
        vector = _orthogonalize(vector, self.basis[: self.size])
        norm = float(np.linalg.norm(vector))
        if not norm > 1e-8 * math.sqrt(self.n):
            return False
        self.residual_direction = vector / norm
        return True

    def _extend(self) -> None:
        j = self.size
        q = self.residual_direction
        self.basis[j] = q
        w = self.counter.matvec(q)
        self.spent += 1
        if self.bar is not None:
            self.bar.update(1)
        self.anorm = max(self.anorm, float(np.linalg.norm(w)))
        active = self.basis[: j + 1]
        column = np.zeros(j + 1)
        for _ in range(2):
            correction = active @ w
            w -= active.T @ correction
            column += correction
            if self.locked.shape[0]:
                w -= self.locked.T @ (self.locked @ w)
        self.projected[: j + 1, j] = column
        self.projected[j, : j + 1] = column
        beta = float(np.linalg.norm(w))
        self.size = j + 1
        self.coupling[: self.size] = 0.0
        full = self.locked.shape[0] + self.size >= self.n
        if full or beta <= _BREAKDOWN_FACTOR * self.counter.eps * self.anorm:
            if not self._fresh_direction():
                self.exhausted = True
        else:
            self.coupling[j] = beta
            self.residual_direction = w / beta

    def _rayleigh_ritz(self) -> None:
        j = self.size
        if j == 0:
            self.theta = np.zeros(0)
            self.ritz_vectors = np.zeros((0, 0))
            self.ritz_residuals = np.zeros(0)
            return
        theta, vectors = np.linalg.eigh(self.projected[:j, :j])
        self.theta = theta
        self.ritz_vectors = vectors
        self.ritz_residuals = np.abs(self.coupling[:j] @ vectors)
        if theta.size:
            self.anorm = max(self.anorm, float(np.abs(theta).max()))

    def _candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """Values and error bounds of locked (first) and active Ritz pairs."""
        values = np.concatenate([self.locked_values, self.theta])
        residuals = np.concatenate([self.locked_bounds, self.ritz_residuals])
        active_bounds = _error_bounds(self.theta, self.ritz_residuals, values, residuals)
        return values, np.concatenate([self.locked_bounds, active_bounds])

    def _floor(self) -> float:
        return _FLOOR_FACTOR * self.counter.eps * self.anorm

    def _lock(self, active_indices: np.ndarray, bounds: np.ndarray) -> None:
        vectors = self.ritz_vectors[:, active_indices].T @ self.basis[: self.size]
        self.locked = np.vstack([self.locked, vectors])
        self.locked_values = np.concatenate([self.locked_values, self.theta[active_indices]])
        self.locked_bounds = np.concatenate([self.locked_bounds, bounds])

    def _restart(self, must_converge: np.ndarray) -> None:
        j = self.size
        order = _order(self.theta, self.which)
        needed = int(must_converge.size)
        keep_count = min(j - 1, max(needed + (j - needed) // 2, 1))
        keep = order[:keep_count]
        vectors = self.ritz_vectors[:, keep]
        self.basis[:keep_count] = vectors.T @ self.basis[:j]
        self.projected[:] = 0.0
        self.projected[np.arange(keep_count), np.arange(keep_count)] = self.theta[keep]
        new_coupling = self.coupling[:j] @ vectors
        self.coupling[:] = 0.0
        self.coupling[:keep_count] = new_coupling
        self.size = keep_count

    # -- main loop -----------------------------------------------------------
    def run(self) -> None:
        k, which = self.k, self.which
        while True:
            if self.spent >= self.budget:
                return
            capacity = min(self.ncv, self.n - self.locked.shape[0])
            if self.size >= capacity:
                self._restart(self._must_converge())
            self._extend()
            self._rayleigh_ritz()
            if self.exhausted:
                return
            values, bounds = self._candidates()
            if values.size < k:
                continue
            must = self._must_converge()
            converged = bounds <= _targets(values, self.tol, self._floor())
            if not np.all(converged[must]):
                continue
            num_locked = self.locked.shape[0]
            wanted = _order(values, which)[:k]
            active_wanted = wanted[wanted >= num_locked] - num_locked
            if k == 1:
                return
            if self.verifying:
                best = int(_order(self.theta, which)[0])
                kth_locked = self.locked_values[_order(self.locked_values, which)[k - 1]]
                margin = float(
                    _targets(np.array([kth_locked]), self.tol, self._floor())[0]
                ) + float(bounds[num_locked + best])
                if _key(self.theta[best], which) >= _key(kth_locked, which) - margin:
                    return
            self._lock(active_wanted, bounds[num_locked + active_wanted])
            self.verifying = True
            self.size = 0
            self.theta = np.zeros(0)
            if not self._fresh_direction():
                self.exhausted = True
                self._rayleigh_ritz()
                return

    def _must_converge(self) -> np.ndarray:
        """Candidate indices whose convergence is required before deciding."""
        values = np.concatenate([self.locked_values, self.theta])
        wanted = _order(values, self.which)[: self.k]
        if self.verifying and self.theta.size:
            best = self.locked.shape[0] + int(_order(self.theta, self.which)[0])
            wanted = np.union1d(wanted, [best])
        return wanted

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(values, vectors as n × k columns, error bounds, converged) for the k best."""
        values, bounds = self._candidates()
        wanted = _order(values, self.which)[: self.k]
        num_locked = self.locked.shape[0]
        vectors = np.empty((self.n, wanted.size))
        for column, index in enumerate(wanted):
            if index < num_locked:
                vectors[:, column] = self.locked[index]
            else:
                vectors[:, column] = (
                    self.ritz_vectors[:, index - num_locked] @ self.basis[: self.size]
                )
        converged = bounds[wanted] <= _targets(values[wanted], self.tol, self._floor())
        return values[wanted], vectors, bounds[wanted], converged


def _start_vectors(n: int, columns: int, v0: np.ndarray | None, rng: np.random.Generator):
    """``columns`` start vectors: those of ``v0`` first, random Gaussian ones after."""
    given = np.zeros((n, 0)) if v0 is None else v0[:, :columns]
    extra = rng.standard_normal((n, columns - given.shape[1]))
    return np.concatenate([given, extra], axis=1)


def _lanczos_method(counter, k, which, tol, budget, rng, bar, v0):
    n = counter.n
    ncv = min(n, max(2 * k + 1, 20))
    # A single Krylov start: the sum of the given unit vectors contains each of them.
    start = rng.standard_normal(n) if v0 is None else v0.sum(axis=1)
    solver = _KrylovSchur(counter, k, which, tol, budget, start, rng, ncv, bar)
    solver.run()
    values, vectors, bounds, converged = solver.result()
    return values, vectors, bounds, converged, {"ncv": ncv}


def _power_method(counter, k, which, tol, budget, rng, bar, v0):
    """Power iteration with deflation; "smallest" runs on −A.

    For "largest" (and "smallest") an indefinite spectrum whose dominant
    eigenvalue has the wrong sign is handled by a shift: once an iteration
    converges to a negative dominant value μ, the operator becomes A + |μ| I
    (positive semidefinite on the remaining space), whose dominant eigenvalue
    is λ_max + |μ|. The shift slows convergence (ratio (λ₂+|μ|)/(λ₁+|μ|)).
    """
    n = counter.n
    sign = -1.0 if which == "smallest" else 1.0
    use_shift = which in ("largest", "smallest")
    shift = 0.0
    found = np.zeros((0, n))
    values, bounds, converged = [], [], []
    spent = 0
    anorm = counter.norm_estimate or 0.0
    starts = _start_vectors(n, k, v0, rng)
    for index in range(k):
        allowance = budget - spent - (k - index - 1)
        vector = _orthogonalize(starts[:, index], found)
        vector /= np.linalg.norm(vector)
        value, residual, done = 0.0, np.inf, False
        used = 0
        while used < allowance:
            image = sign * counter.matvec(vector)
            used += 1
            if bar is not None:
                bar.update(1)
            anorm = max(anorm, float(np.linalg.norm(image)))
            image = _orthogonalize(image + shift * vector, found)
            shifted_value = float(vector @ image)
            residual = float(np.linalg.norm(image - shifted_value * vector))
            value = shifted_value - shift
            done = residual <= max(tol * abs(value), _FLOOR_FACTOR * counter.eps * anorm)
            if done and use_shift and shift == 0.0 and value < 0 and found.shape[0] < n - 1:
                shift = abs(value)
                vector = _orthogonalize(rng.standard_normal(n), found)
                vector /= np.linalg.norm(vector)
                done = False
                continue
            if done:
                break
            norm = float(np.linalg.norm(image))
            if norm == 0.0:
                break
            vector = image / norm
        spent += used
        found = np.vstack([found, vector])
        values.append(sign * value)
        bounds.append(residual)
        converged.append(done)
    return (
        np.array(values),
        found.T.copy(),
        np.array(bounds),
        np.array(converged, dtype=bool),
        {"shift": sign * shift},
    )


def _lobpcg_method(counter, k, which, tol, budget, rng, bar, v0):
    """scipy LOBPCG on a block of k + extra vectors, restarted with a tighter
    residual tolerance until the eigenvalue bounds meet ``tol``.

    "magnitude" runs LOBPCG on A² (two products per column) and recovers signed
    eigenvalues by a final Rayleigh–Ritz step with A. For n < 5·block the
    dense matrix is formed with one n-column ``matmat`` and diagonalized.
    LOBPCG works in whole blocks, so it may exceed ``budget`` by up to one block.
    """
    n = counter.n
    block = min(n, k + max(2, k // 2))
    info: dict[str, Any] = {"block_size": block}
    if n < 5 * block:
        dense = counter.matmat(np.eye(n))
        if bar is not None:
            bar.update(n)
        theta, vectors = np.linalg.eigh(0.5 * (dense + dense.T))
        order = _order(theta, which)[:k]
        info["dense"] = True
        return theta[order], vectors[:, order], np.zeros(k), np.ones(k, dtype=bool), info

    squared = which == "magnitude"
    calls_per_apply = 2 if squared else 1

    def apply(x: np.ndarray) -> np.ndarray:
        x = x.reshape(n, -1)
        out = counter.matmat(x)
        if squared:
            out = counter.matmat(out)
        if bar is not None:
            bar.update(calls_per_apply * x.shape[1])
        return out

    operator = LinearOperator((n, n), matvec=apply, matmat=apply, dtype=np.float64)
    x = _start_vectors(n, block, v0, rng)
    spent_before = counter.num_products
    anorm = counter.norm_estimate or 0.0
    residual_tol = None
    values = bounds = converged = np.zeros(0)
    vectors = x
    rounds = 0
    previous_worst = np.inf
    while True:
        if residual_tol is None:
            if anorm == 0.0:
                image = counter.matmat(x)
                anorm = float(np.linalg.norm(image, axis=0).max())
            residual_tol = math.sqrt(tol) * max(anorm, np.finfo(float).tiny)
            if squared:
                residual_tol *= anorm
        remaining = budget - (counter.num_products - spent_before)
        per_iteration = calls_per_apply * block
        # scipy's LOBPCG spends about (maxiter + 3) block products; our
        # Rayleigh–Ritz check of the block comes on top
        max_iterations = (remaining - 3 * per_iteration - block) // per_iteration
        if max_iterations >= 1:
            with warnings.catch_warnings():
                # Non-convergence is reported through the ``converged`` flags below.
                warnings.filterwarnings("ignore", message=".*not reaching the requested tol.*")
                warnings.filterwarnings("ignore", message=".*Exited.*")
                _, x = lobpcg(
                    operator,
                    x,
                    tol=residual_tol,
                    maxiter=max_iterations,
                    largest=which != "smallest",
                )
        elif rounds > 0:
            break
        rounds += 1
        # Rayleigh–Ritz with A on the block (resolves ± pairs for "magnitude").
        x, _ = np.linalg.qr(x)
        image = counter.matmat(x)
        theta, rotation = np.linalg.eigh(0.5 * (x.T @ image + image.T @ x))
        x, image = x @ rotation, image @ rotation
        residuals = np.linalg.norm(image - x * theta, axis=0)
        anorm = max(anorm, float(np.abs(theta).max()))
        all_bounds = _error_bounds(theta, residuals, theta, residuals)
        all_gaps = _gaps(theta, theta, residuals)
        order = _order(theta, which)[:k]
        floor = _FLOOR_FACTOR * counter.eps * anorm
        values, vectors, bounds = theta[order], x[:, order], all_bounds[order]
        targets = _targets(values, tol, floor)
        converged = bounds <= targets
        ratios = np.where(bounds <= targets, 0.0, bounds / np.maximum(targets, 1e-300))
        worst = float(ratios.max())
        if converged.all() or max_iterations < 1 or rounds >= 10 or worst >= previous_worst:
            break
        previous_worst = worst
        # residual needed for min(r, r²/gap) <= target, given the current gaps
        needed = np.maximum(targets, np.sqrt(targets * all_gaps[order]))[~converged]
        residual_tol = 0.1 * float(needed.min()) * (anorm if squared else 1.0)
    info["rounds"] = rounds
    return values, vectors, bounds, converged, info


def eigenvalues(
    op: Any,
    k: int = 1,
    which: str = "largest",
    method: str = "lanczos",
    tol: float = 1e-8,
    max_products: int | None = None,
    return_eigenvectors: bool = False,
    seed: SeedLike = 0,
    progress: bool | None = None,
    check_symmetry: bool = True,
    v0: np.ndarray | None = None,
) -> EigenResult:
    """The k extreme eigenvalues of a symmetric operator.

    Parameters
    ----------
    op : LinearOperator, dense array or sparse matrix, symmetric, n × n.
    k : number of eigenvalues, 1 <= k <= n.
    which : "largest" (algebraic, largest first), "smallest" (most negative
        first) or "magnitude" (by decreasing |λ|).
    method : "lanczos" (default), "power" or "lobpcg" (see the module docstring).
    tol : for "lanczos" and "lobpcg" the relative eigenvalue error:
        ``min(r, r²/gap) <= tol·max(|λ|, 10·eps·‖A‖)``; for "power" the relative
        residual ``‖Av − λv‖ <= tol·|λ|``. With a float32 operator, eigenvalues
        are accurate to about 1e-7·‖A‖ whatever ``tol``.
    max_products : cap on the products spent by the iteration (default
        1000 + 100·k). When it is hit the current estimates are returned with
        ``converged=False``. The symmetry check (2 products) and the final
        residual check (k products) come on top and are included in
        ``num_products``.
    return_eigenvectors : include the unit-norm eigenvectors (n × k).
    v0 : optional start, shape (n,) or (n, j): e.g. the eigenvectors of a nearby
        operator (the previous checkpoint of a training run), which cuts the
        products needed. "lanczos" starts its Krylov space from the sum of the
        (normalized) columns; "power" and "lobpcg" use the columns as their first
        start vectors and fill up with random ones.

    Cost: "lanczos" one ``matvec`` per product; "power" one per iteration;
    "lobpcg" one ``matmat`` of up to k + max(2, k//2) columns per iteration.

    With a single-vector Krylov space ("lanczos") an exactly repeated eigenvalue
    is seen once per run; for k > 1 the method verifies with a restart from a
    random vector orthogonal to the converged eigenvectors, which finds further
    copies (see ``_KrylovSchur``). "lobpcg" sees multiplicities up to its block
    size directly.
    """
    started = time.perf_counter()
    k = _check_int("k", k)
    which = _check_choice("which", which, _WHICH)
    method = _check_choice("method", method, _METHODS)
    if not (isinstance(tol, (int, float)) and tol > 0 and math.isfinite(tol)):
        raise ValueError(f"tol must be a positive finite number, got {tol!r}")
    if max_products is None:
        max_products = 1000 + 100 * k
    max_products = _check_int("max_products", max_products)
    counter = _as_symmetric_operator(op, check_symmetry=check_symmetry)
    n = counter.n
    if k > n:
        raise ValueError(f"k must be <= n = {n}, got k = {k}")
    if max_products < k:
        raise ValueError(f"max_products must be >= k = {k}, got {max_products}")
    if v0 is not None:
        v0 = np.asarray(v0, dtype=np.float64)
        v0 = v0.reshape(-1, 1) if v0.ndim == 1 else v0
        if v0.ndim != 2 or v0.shape[0] != n or v0.shape[1] < 1:
            raise ValueError(f"v0 must have shape ({n},) or ({n}, j), got {v0.shape}")
        norms = np.linalg.norm(v0, axis=0)
        if not np.all(np.isfinite(v0)) or not np.all(norms > 0):
            raise ValueError("v0 must hold finite, nonzero vectors")
        v0 = v0 / norms
    rng = _rng(seed)
    solvers = {"lanczos": _lanczos_method, "power": _power_method, "lobpcg": _lobpcg_method}
    with _progress(max_products, f"eigenvalues ({method})", progress) as bar:
        values, vectors, bounds, converged, info = solvers[method](
            counter, k, which, float(tol), max_products, rng, bar, v0
        )
    vectors = vectors / np.linalg.norm(vectors, axis=0)
    images = counter.matmat(vectors)
    residual_norms = np.linalg.norm(images - vectors * values, axis=0)
    # The operator's own rounding limits every eigenvalue to about eps·‖A‖ (float32
    # Hessian products: ~1e-7·λ₁), however small the method's bound.
    scale = max(float(np.max(np.abs(values), initial=0.0)), counter.norm_estimate or 0.0)
    error_bounds = np.maximum(np.asarray(bounds, dtype=np.float64), counter.eps * scale)
    return EigenResult(
        eigenvalues=np.asarray(values, dtype=np.float64),
        residual_norms=residual_norms,
        error_bounds=error_bounds,
        converged=np.asarray(converged, dtype=bool),
        which=which,
        method=method,
        num_products=counter.num_products,
        num_operator_calls=counter.num_operator_calls,
        wall_time=time.perf_counter() - started,
        settings={
            "k": k,
            "tol": float(tol),
            "max_products": max_products,
            "seed": seed if isinstance(seed, (int, type(None))) else "generator",
            "check_symmetry": bool(check_symmetry),
            "dimension": n,
            "v0_given": v0 is not None,
            **info,
        },
        eigenvectors=vectors if return_eigenvectors else None,
    )


def eigenvalue_ratio(result: EigenResult, numerator: int = 0, denominator: int = -1) -> float:
    """Ratio λ_numerator / λ_denominator of an :class:`EigenResult` (default λ₁/λ_k).

    With ``which="largest"`` and k eigenvalues this is the condition-like
    ratio of the top of the spectrum that papers cite (e.g. λ₁/λ₅).
    """
    values = np.asarray(result.eigenvalues, dtype=np.float64)
    try:
        top, bottom = values[numerator], values[denominator]
    except IndexError as error:
        raise ValueError(
            f"indices {numerator}, {denominator} out of range for {values.size} eigenvalues"
        ) from error
    if bottom == 0:
        raise ValueError("the denominator eigenvalue is zero")
    return float(top / bottom)
