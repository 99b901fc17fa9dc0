"""Krylov–Schur restarted Lanczos: the ``"lanczos"`` method of
:func:`~spectra.estimators.eigensolvers.eigenvalues` (:func:`lanczos_method`), and the
verification run of ``"lobpcg"`` (:meth:`KrylovSchur.verify`).

Krylov–Schur restarted Lanczos (Stewart 2001; for symmetric A equivalent to thick-restart
Lanczos, Wu & Simon 2000) with full reorthogonalization. The certified and probabilistic
bounds it stops on, and why they hold, are derived in the docstring of
:mod:`~spectra.estimators.eigenvalue_bounds`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from scipy.linalg import blas as _blas

from spectra.estimators._products import ProductProgress, orthogonalize
from spectra.estimators.eigenpairs import MethodOutput, MethodRequest, Pairs, best_first
from spectra.estimators.eigenvalue_bounds import (
    certified_bounds,
    log_inverse_delta,
    polynomial_bound,
    rounding_floor,
)

__all__ = ["KrylovSchur", "drive", "krylov_dimension", "lanczos_method", "runs_probability"]

# Breakdown of a Lanczos step when β <= factor · eps · ‖A‖ (estimate).
_BREAKDOWN_FACTOR = 100.0
# A pair is locked only once its residual is at most this fraction of its target: a
# locked vector is frozen, and its residual also enters the residuals of the vectors
# found after it (they are orthogonal to it, not to its error).
_LOCK_RESIDUAL_FRACTION = 0.5
# A Gram–Schmidt pass that shrinks a vector below this fraction of its norm is repeated
# (Daniel, Gragg, Kaufman & Stewart 1976).
_REORTHOGONALIZATION_RATIO = 1.0 / math.sqrt(2.0)
# The Krylov–Schur space keeps max(2k + 1, _MIN_KRYLOV_DIMENSION) vectors before a restart.
_MIN_KRYLOV_DIMENSION = 20
# A Gaussian vector (norm about sqrt(n)) orthogonalized against the locked vectors that
# keeps less than this fraction of sqrt(n) shows that they span the space (numerically):
# no run is left to start.
_EXHAUSTED_FRACTION = 1e-8
# Run j (j = 1, 2, ...) of a state draws the share (1 − r)·r^(j−1) of the failure
# probability (the shares sum to it). For k > 1, r = 1/2: a first run that locks is
# usually followed by a verification run. For k = 1 a later run starts only after a
# breakdown (an invariant space: a small or low-rank operator), so the first run, which
# decides nearly every top-1 call, takes 15/16: its level log(1/δ) is log(16/15) = 0.06
# above that of the whole probability instead of log 2 = 0.69, about a third of a product
# at the growth of 2 per product seen on Hessians (the 810-parameter CNN at tol 1e-3: 16
# products to 15), and a later run pays log(256/15) = 2.8 instead of log 4 = 1.4.
_SHARE_RATIO = 0.5
_SINGLE_VALUE_SHARE_RATIO = 1.0 / 16.0


class _Segment:
    """One Krylov run from one random start and its probabilistic bound.

    The current residual direction is p(A)q/C for the start q, with p the monic
    polynomial whose roots are every Ritz value of the run (``discarded`` at restarts
    plus the current ones) and C the product of every β of the run (``log_scale``):
    see :mod:`~spectra.estimators.eigenvalue_bounds`. ``exact`` (breakdown: the space is
    invariant) makes C 0.
    """

    def __init__(self, log_level: float, probability: float):
        self.log_level = log_level
        self.probability = probability
        self.discarded: list[float] = []
        self.log_scale = 0.0
        self.exact = False
        # The last bounds' distances beyond the extreme nodes, each side: the start of
        # the next solve.
        self._distance = {+1: 0.0, -1: 0.0}

    def bounds(self, theta: np.ndarray, which: str) -> tuple[float, float]:
        """(upper bound on the largest, lower bound on the smallest) eigenvalue of the
        operator the run sees, each failing with probability <= its share."""
        nodes = np.concatenate([np.asarray(self.discarded), theta])
        log_scale = -math.inf if self.exact else self.log_scale
        upper = self._solve(nodes, log_scale, +1) if which != "smallest" else math.inf
        lower = self._solve(nodes, log_scale, -1) if which != "largest" else -math.inf
        return upper, lower

    def _solve(self, nodes: np.ndarray, log_scale: float, side: int) -> float:
        bound = polynomial_bound(nodes, log_scale, self.log_level, side, self._distance[side])
        extreme = float(nodes.max() if side > 0 else nodes.min())
        self._distance[side] = side * (bound - extreme)
        return bound


class _Evaluation(NamedTuple):
    """Where a :class:`KrylovSchur` state stands after a step: the candidates (locked
    values first, then the active Ritz values), which are wanted, and their bounds."""

    values: np.ndarray  # candidates: locked values, then active Ritz values
    residuals: np.ndarray  # their residual norms
    certified: np.ndarray  # bounds from the candidates' residual intervals alone
    wanted: np.ndarray  # indices of the k best candidates, best first
    targets: np.ndarray  # max(tol·|θ|, floor) per wanted value
    bounds: np.ndarray  # reported bounds per wanted value (certified and probabilistic)
    active_wanted: np.ndarray  # wanted indices among the active Ritz values
    all_certified: bool  # every wanted certified bound meets its target
    lockable: bool  # every wanted residual is below _LOCK_RESIDUAL_FRACTION of its target
    done: bool  # k candidates and every bound meets its target
    ratio: float  # max bound/target: the progress measure


class KrylovSchur:
    """Krylov–Schur restarted Lanczos with locking, stopping on certified and
    probabilistic bounds (see :mod:`~spectra.estimators.eigenvalue_bounds`), fed one product at a
    time.

    The caller multiplies :meth:`next_vector` by A and hands the product to
    :meth:`absorb` until :attr:`finished`; :func:`eigenvalues` drives one such state,
    :func:`spectra.layerwise` one per parameter group through a shared ``matmat``.

    Maintains ``P A P Vᵀ = Vᵀ H + f bᵀ`` for the active orthonormal rows V (j of
    them), P the projector onto the complement of the locked vectors, the symmetric
    projected matrix H (the Rayleigh quotient) and the unit residual direction f; each
    step multiplies f once. The relation gives the product's coefficients before any
    inner product: ``V A f = b`` and ``L A f = R_L f`` (L the locked vectors, R_L their
    residual vectors), so they are subtracted first and one pass of classical
    Gram–Schmidt against L and V removes what rounding left, repeated once when it
    shrinks the vector below 1/√2 of its norm (the criterion of Daniel, Gragg, Kaufman
    & Stewart 1976; "twice is enough"). After every step the Ritz pairs of H are
    checked; when the active space is full, the best Ritz vectors are kept and H becomes
    diagonal plus the coupling b (thick restart). Ritz residuals need no product:
    ``‖A y − θ y‖² = (bᵀs)² + ‖R_L y‖²``, the Krylov relation plus the coupling to the
    locked vectors through their residual vectors R_L.

    A run ends in one of three ways: the wanted values meet their bounds (done); the
    wanted values are certified but the run cannot meet the probabilistic bound
    (several wanted values in the active space, or one that is not the k-th: lock them
    and verify with a new run from a random start orthogonal to them); or the space
    is invariant (breakdown: its Ritz pairs are exact, lock them all and go on in the
    complement). Each run draws its share of the failure probability: 1/2, 1/4, ... of
    the requested total, or 15/16, 15/256, ... for k = 1 (a single wanted value needs a
    second run only after a breakdown; see ``_SINGLE_VALUE_SHARE_RATIO``). The state
    finishes when done, when no new run can start, or after ``budget`` products.
    """

    def __init__(
        self,
        n: int,
        k: int,
        which: str,
        tol: float,
        eps: float,
        budget: int,
        start: np.ndarray,
        warm: bool,
        rng: np.random.Generator,
        ncv: int,
        failure_probability: float,
        norm_estimate: float = 0.0,
    ):
        self.n = n
        self.k = k
        self.which = which
        self.tol = tol
        self.eps = eps
        self.budget = budget
        self.rng = rng
        self.ncv = ncv
        self.failure_probability = failure_probability
        self.events = 2 if which == "magnitude" else 1
        self.share_ratio = _SINGLE_VALUE_SHARE_RATIO if k == 1 else _SHARE_RATIO
        self.anorm = norm_estimate
        self.locked = np.zeros((0, self.n))
        self.locked_values = np.zeros(0)
        self.locked_residuals = np.zeros(0)
        # A y − θ y of every locked pair (rows), and their dot products with the active
        # basis: the part of an active Ritz vector's residual along the locked vectors.
        self.locked_residual_vectors = np.zeros((0, self.n))
        self.coupled = np.zeros((0, ncv))
        self.basis = np.zeros((ncv, self.n))
        self.projected = np.zeros((ncv, ncv))
        self.coupling = np.zeros(ncv)
        self.size = 0
        self.spent = 0
        self.finished = budget <= 0
        self.theta = np.zeros(0)
        self.ritz_vectors = np.zeros((0, 0))
        self.ritz_residuals = np.zeros(0)
        self.segments: list[_Segment] = []
        self.state: _Evaluation | None = None
        self.history: list[float] = []
        self.residual_direction = np.empty(self.n)
        self._work = np.empty(self.n)
        self._begin_segment(start / np.linalg.norm(start), warm)

    # -- the product loop ------------------------------------------------------------
    def next_vector(self) -> np.ndarray:
        """The unit vector whose product :meth:`absorb` takes next (the state's own
        array: it changes in the next :meth:`absorb`)."""
        return self.residual_direction

    def absorb(self, image: np.ndarray) -> None:
        """Take ``A · next_vector()``: extend the space, update the Ritz pairs and their
        bounds, then lock, start a new run or finish as the bounds say."""
        capacity = min(self.ncv, self.n - self.locked.shape[0])
        if self.size >= capacity:
            self._restart(int(self.state.active_wanted.size) if self.state else 0)
        self._extend(image)
        self._rayleigh_ritz()
        self.state = state = self._evaluate()
        self.history.append(math.log(max(state.ratio, 1e-300)))
        if state.done:
            self.finished = True
            return
        if self.segments[-1].exact:
            # An invariant subspace: its Ritz pairs are exact eigenpairs.
            self._lock(np.arange(self.size))
        elif state.all_certified and state.lockable and self._must_lock(state):
            self._lock(state.active_wanted)
        else:
            self.finished = self.spent >= self.budget
            return
        self._clear_active()
        if not self._fresh_start() or self.spent >= self.budget:
            self.state = self._evaluate()
            self.finished = True

    def expected_products(self) -> int:
        """Expected total products: extrapolate the decay of log(bound/target)."""
        expected = self.budget
        if len(self.history) >= 4:
            rate = (self.history[-4] - self.history[-1]) / 3.0
            if rate > 0:
                expected = self.spent + math.ceil(max(self.history[-1], 0.0) / rate) + 1
        return min(self.budget, max(expected, self.spent + 1))

    # -- runs ----------------------------------------------------------------------
    def _begin_segment(self, start: np.ndarray, warm: bool) -> None:
        ratio = self.share_ratio
        share = self.failure_probability * (1.0 - ratio) * ratio ** len(self.segments)
        dimension = self.n - self.locked.shape[0]
        self.segments.append(
            _Segment(log_inverse_delta(dimension, share / self.events, warm), share)
        )
        np.copyto(self.residual_direction, start)
        self._clear_active()

    def _clear_active(self) -> None:
        self.size = 0
        self.theta = np.zeros(0)
        self.ritz_vectors = np.zeros((0, 0))
        self.ritz_residuals = np.zeros(0)

    def verify(self, vectors: np.ndarray, values: np.ndarray, residual_vectors: np.ndarray) -> None:
        """Start over from given approximate eigenpairs (columns of ``vectors``, their
        values and residual vectors ``A v − θ v`` as columns), locked, and a run from a
        random start orthogonal to them: the probabilistic bound of that run covers the
        rest of the spectrum (Courant–Fischer), as for the verification runs of the
        Lanczos method itself. The start vector given to the constructor is unused."""
        self.segments = []
        self._set_locked(vectors.T.copy(), np.asarray(values, dtype=np.float64), residual_vectors.T)
        if not self._fresh_start() or self.spent >= self.budget:
            self.state = self._evaluate()
            self.finished = True

    def _fresh_start(self) -> bool:
        """A new run from a random unit vector orthogonal to the locked vectors."""
        if self.locked.shape[0] >= self.n:
            return False
        vector, _ = orthogonalize(self.rng.standard_normal(self.n), self.locked)
        norm = float(np.linalg.norm(vector))
        if not norm > _EXHAUSTED_FRACTION * math.sqrt(self.n):
            return False
        self._begin_segment(vector / norm, warm=False)
        return True

    def _lock(self, active_indices: np.ndarray) -> None:
        """Move Ritz pairs of the active space to the locked set, then refine the whole
        locked set by a Rayleigh–Ritz step that needs no product.

        With L the locked vectors (rows) and R their residual vectors r_l = A l − θ_l l,
        ``L A Lᵀ = diag(θ) + L Rᵀ``; its eigenpairs (Λ, S) give the best values in
        span(L), with residual vectors ``Sᵀ(R − (R Lᵀ) L)``: the part of R outside
        span(L). Close values found in different runs are resolved this way, and when
        L spans the whole space the values are exact.
        """
        j = self.size
        selected = self.ritz_vectors[:, active_indices]
        vectors = selected.T @ self.basis[:j]
        # A y − θ y = f (bᵀs) + Σ_l (r_l·y) l over the earlier locked pairs l.
        residual_vectors = np.outer(self.coupling[:j] @ selected, self.residual_direction)
        residual_vectors += (self.coupled[:, :j] @ selected).T @ self.locked
        self._set_locked(
            np.vstack([self.locked, vectors]),
            np.concatenate([self.locked_values, self.theta[active_indices]]),
            np.vstack([self.locked_residual_vectors, residual_vectors]),
        )

    def _set_locked(self, locked: np.ndarray, values: np.ndarray, residuals: np.ndarray) -> None:
        """Lock the orthonormal rows ``locked`` with their values and residual vectors
        ``A l − θ l`` (rows), after the Rayleigh–Ritz step of :meth:`_lock`."""
        overlaps = residuals @ locked.T  # [i, l] = r_i · l_l
        projected = np.diag(values) + overlaps.T
        values, rotation = np.linalg.eigh(0.5 * (projected + projected.T))
        outside = residuals - overlaps @ locked
        self.locked = rotation.T @ locked
        self.locked_values = values
        self.locked_residual_vectors = rotation.T @ outside
        self.locked_residuals = np.linalg.norm(self.locked_residual_vectors, axis=1)
        self.coupled = np.zeros((self.locked.shape[0], self.ncv))

    # -- building blocks -----------------------------------------------------------
    def _extend(self, image: np.ndarray) -> None:
        # In place on two owned vectors (the product and the next direction): fresh
        # length-n temporaries cost more than the arithmetic at n ~ 10⁵.
        j = self.size
        q = self.residual_direction
        self.basis[j] = q
        w = self._work
        np.copyto(w, np.reshape(image, self.n))
        self.spent += 1
        self.anorm = max(self.anorm, math.sqrt(w @ w))
        # The coefficients the Krylov relation predicts: b along V, R_L q along L, and
        # α = qᵀAq along q itself.
        column = np.zeros(j + 1)
        column[:j] = self.coupling[:j]
        column[j] = alpha = float(q @ w)
        w = _blas.daxpy(q, w, a=-alpha)
        for row in np.flatnonzero(self.coupling[:j]):  # one row, or the kept ones
            w = _blas.daxpy(self.basis[row], w, a=-self.coupling[row])
        if self.locked.shape[0]:
            self.coupled[:, j] = self.locked_residual_vectors @ q
            w = _blas.dgemv(-1.0, self.locked.T, self.coupled[:, j], 1.0, w, overwrite_y=True)
        # Then Gram–Schmidt against the union of locked and active vectors (a pass
        # against the active ones alone would bring back locked components).
        active = self.basis[: j + 1]
        norm = math.sqrt(w @ w)
        for _ in range(2):
            step = active @ w
            w = _blas.dgemv(-1.0, active.T, step, 1.0, w, overwrite_y=True)
            column += step
            if self.locked.shape[0]:
                w = _blas.dgemv(-1.0, self.locked.T, self.locked @ w, 1.0, w, overwrite_y=True)
            shrunk, norm = norm, math.sqrt(w @ w)
            if norm >= _REORTHOGONALIZATION_RATIO * shrunk:
                break
        self.projected[: j + 1, j] = column
        self.projected[j, : j + 1] = column
        beta = norm
        self.size = j + 1
        self.coupling[: self.size] = 0.0
        segment = self.segments[-1]
        full = self.locked.shape[0] + self.size >= self.n
        if full or beta <= _BREAKDOWN_FACTOR * self.eps * self.anorm:
            segment.exact = True
        else:
            self.coupling[j] = beta
            segment.log_scale += math.log(beta)
            np.divide(w, beta, out=self.residual_direction)

    def _rayleigh_ritz(self) -> None:
        j = self.size
        theta, vectors = np.linalg.eigh(self.projected[:j, :j])
        self.theta = theta
        self.ritz_vectors = vectors
        # ‖A y − θ y‖² = (bᵀs)² + ‖R_Lᵀ y‖²: the Krylov relation of the compressed
        # operator plus the coupling to the locked vectors (their residuals R_L).
        self.ritz_residuals = np.hypot(
            self.coupling[:j] @ vectors, np.linalg.norm(self.coupled[:, :j] @ vectors, axis=0)
        )
        if theta.size:
            self.anorm = max(self.anorm, float(np.abs(theta).max()))

    def _restart(self, wanted_active: int) -> None:
        j = self.size
        order = best_first(self.theta, self.which)
        keep_count = min(j - 1, max(wanted_active + (j - wanted_active) // 2, 1))
        keep, drop = order[:keep_count], order[keep_count:]
        self.segments[-1].discarded.extend(self.theta[drop].tolist())
        vectors = self.ritz_vectors[:, keep]
        self.basis[:keep_count] = vectors.T @ self.basis[:j]
        self.coupled[:, :keep_count] = self.coupled[:, :j] @ vectors
        self.projected[:] = 0.0
        self.projected[np.arange(keep_count), np.arange(keep_count)] = self.theta[keep]
        new_coupling = self.coupling[:j] @ vectors
        self.coupling[:] = 0.0
        self.coupling[:keep_count] = new_coupling
        self.size = keep_count

    def _floor(self) -> float:
        return rounding_floor(self.eps, self.anorm, self.n)

    # -- decisions -----------------------------------------------------------------
    def _evaluate(self) -> _Evaluation:
        """Candidates (locked first, then active), the wanted ones and their bounds.

        ``certified`` (used to decide when to lock) reads Kato–Temple gaps off the
        candidates; the reported ``bounds`` take the gaps to the probabilistic bound of
        the rest of the spectrum too, and add the probabilistic part.
        """
        num_locked = self.locked.shape[0]
        values = np.concatenate([self.locked_values, self.theta])
        residuals = np.concatenate([self.locked_residuals, self.ritz_residuals])
        certified = certified_bounds(values, residuals)
        wanted = best_first(values, self.which)[: self.k]
        targets = np.maximum(self.tol * np.abs(values[wanted]), self._floor())
        chosen = values[wanted]
        if num_locked >= self.n:
            rest = None  # the locked pairs are the whole spectrum
            probable = np.zeros(wanted.size)
        elif self.theta.size == 0:
            rest = (-np.inf, np.inf)  # the complement was not explored
            probable = np.full(wanted.size, np.inf)
        else:
            upper, lower = self.segments[-1].bounds(self.theta, self.which)
            rest = (lower, upper)
            if self.which == "largest":
                probable = upper - chosen
            elif self.which == "smallest":
                probable = chosen - lower
            else:
                probable = max(upper, -lower) - np.abs(chosen)
        rigorous = certified_bounds(values, residuals, rest)[wanted]
        bounds = np.maximum(rigorous, np.maximum(probable, 0.0))
        active_wanted = wanted[wanted >= num_locked] - num_locked
        ratio = float(np.max(bounds / np.maximum(targets, np.finfo(float).tiny)))
        return _Evaluation(
            values=values,
            residuals=residuals,
            certified=certified,
            wanted=wanted,
            targets=targets,
            bounds=bounds,
            active_wanted=active_wanted,
            all_certified=bool(np.all(certified[wanted] <= targets)),
            lockable=bool(np.all(residuals[wanted] <= _LOCK_RESIDUAL_FRACTION * targets)),
            done=values.size >= self.k and bool(np.all(bounds <= targets)),
            ratio=ratio,
        )

    def _must_lock(self, state: _Evaluation) -> bool:
        """Whether this run cannot verify the wanted values: its bound lies above its
        best Ritz value, so it can meet the k-th wanted value only if that is the one
        wanted active value. Otherwise the certified active wanted values are locked and
        a new run verifies the rest of the spectrum."""
        active = state.active_wanted
        if active.size == 0:
            return False
        return active.size >= 2 or state.wanted[-1] != self.locked.shape[0] + active[0]

    def result(self) -> Pairs:
        """The k best pairs: values, vectors as n × k columns, bounds, residuals, converged."""
        state = self.state if self.state is not None else self._evaluate()
        wanted = state.wanted
        num_locked = self.locked.shape[0]
        vectors = np.empty((self.n, wanted.size))
        for column, index in enumerate(wanted):
            if index < num_locked:
                vectors[:, column] = self.locked[index]
            else:
                vectors[:, column] = (
                    self.ritz_vectors[:, index - num_locked] @ self.basis[: self.size]
                )
        converged = state.bounds <= state.targets
        return Pairs(
            state.values[wanted],
            vectors,
            state.bounds,
            state.residuals[wanted],
            converged,
        )


def krylov_dimension(n: int, k: int) -> int:
    """Vectors a Krylov–Schur space holds before it restarts: 2k + 1, at least
    ``_MIN_KRYLOV_DIMENSION``, at most n."""
    return min(n, max(2 * k + 1, _MIN_KRYLOV_DIMENSION))


def _lanczos_start(
    v0: np.ndarray | None, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, bool]:
    """One Krylov start and whether it is warm: Gaussian, or the normalized sum of the
    given unit vectors (which contains each of them) plus a Gaussian vector of the same
    norm (which keeps the probabilistic bound valid)."""
    if v0 is None:
        return rng.standard_normal(n), False
    combined = v0.sum(axis=1)
    norm = float(np.linalg.norm(combined))
    combined = combined / norm if norm > 0 else v0[:, 0]
    return combined + rng.standard_normal(n) / math.sqrt(n), True


def drive(solver: KrylovSchur, counter: Any, bar: ProductProgress, plan: bool) -> None:
    """Feed ``solver`` one product at a time until it is finished (``plan``: update the
    progress bar's expected total after each)."""
    while not solver.finished:
        solver.absorb(counter.matvec(solver.next_vector()))
        bar.update()
        if plan:
            bar.plan(solver.expected_products())


def runs_probability(solver: KrylovSchur) -> float:
    """Failure probability of a Krylov–Schur state: the sum of its runs' shares."""
    return min(1.0, sum(segment.probability for segment in solver.segments))


def lanczos_method(request: MethodRequest) -> MethodOutput:
    """Krylov–Schur restarted Lanczos from one start (see :class:`KrylovSchur`)."""
    counter, k, which, tol, budget, rng, bar, v0, failure_probability = request
    n = counter.n
    ncv = krylov_dimension(n, k)
    start, warm = _lanczos_start(v0, n, rng)
    solver = KrylovSchur(
        n,
        k,
        which,
        tol,
        counter.eps,
        budget,
        start,
        warm,
        rng,
        ncv,
        failure_probability,
        counter.norm_estimate,
    )
    drive(solver, counter, bar, plan=True)
    info = {"ncv": ncv, "runs": len(solver.segments), "norm_estimate": solver.anorm}
    return MethodOutput(solver.result(), runs_probability(solver), info)
