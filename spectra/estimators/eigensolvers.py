"""Extreme eigenvalues of a symmetric operator, with error bounds that hold.

Three methods, all driven through ``matvec``/``matmat`` only:

* ``"lanczos"`` (default): Krylov–Schur restarted Lanczos (Stewart 2001; for
  symmetric A equivalent to thick-restart Lanczos, Wu & Simon 2000) with full
  reorthogonalization.
* ``"power"``: power iteration with deflation, as in PyHessian (Yao et al. 2020).
  Its convergence factor per product is ``|λ₂/λ₁|`` instead of Lanczos'
  Chebyshev-accelerated rate, so it needs many more products; it is here for parity
  with published numbers.
* ``"lobpcg"``: scipy's LOBPCG (Knyazev 2001) on a block of k + extra vectors,
  so each data pass multiplies a whole block.

What a result can and cannot promise
------------------------------------
From products alone one can certify that *some* eigenvalue lies near a Ritz value θ
with residual r = ‖Av − θv‖: within r, and within r²/δ (Kato–Temple; Parlett, "The
Symmetric Eigenvalue Problem", §10.2 and §11.7) when no other eigenvalue is closer than
δ. The Ritz values give such a gap ``δ = |θ − θ'| − r − r'`` for the nearest other Ritz
value θ' (both localized by their residuals); it holds unless an eigenvalue that the
Krylov space has not seen at all lies inside it.

That the Ritz value belongs to the *largest* eigenvalue (and not to a smaller one that
happens to have a small residual) cannot be certified: a start vector orthogonal to
the top eigenvector never sees it. It can be made improbable. For a start q drawn
uniformly on the sphere, m Lanczos steps satisfy, for every eigenvalue λ_j with
eigenvector u_j, ``|u_jᵀq| · |p_m(λ_j)| <= 1`` where p_m = χ_m/(β₁⋯β_m) is the
normalized Lanczos polynomial (χ_m the characteristic polynomial of the tridiagonal
T_m; the identity ‖p_m(A)q‖ = ‖q_{m+1}‖ = 1). Since ``P(|u_1ᵀq| < δ) <= δ·sqrt(2(n−1)/π)``,
with probability at least 1 − δ·sqrt(2(n−1)/π)

    λ_max <= U,  the root above θ_max of  Π_i (U − θ_i) = β₁⋯β_m / δ,

a bound that only tightens as m grows (the event does not depend on m). This is the a
posteriori form of the Kuczyński–Woźniakowski (1992) analysis of Lanczos from a random
start (see also van Dorsselaer, Hochstenbach & van der Vorst, SIAM J. Matrix Anal.
Appl. 22, 2000). Thick restarts keep it: the restarted space is a Krylov space of a
polynomial filter of q (Sorensen 1992; Morgan 1996), the polynomial's roots are all
Ritz values ever computed in the run (discarded and current) and its normalization the
product of all β's. For k > 1 the wanted pairs are locked and a new run from a random
start orthogonal to them bounds the rest of the spectrum the same way (Courant–Fischer:
at most k eigenvalues of A exceed the bound of the compressed operator); it also finds
further copies of a repeated eigenvalue, which a single Krylov space cannot.

Stopping rule: "lanczos" checks both bounds after every product (the Ritz pairs of the
small projected matrix and the root of the polynomial equation cost microseconds) and
stops at the first product where, for each wanted value, both the certified bound and
the probabilistic bound meet the tolerance, i.e. once the Krylov space makes a larger
eigenvalue beyond ``tol`` improbable at the requested ``failure_probability``. The
restart size (``_MIN_KRYLOV_DIMENSION``) is not a minimum number of products. The count
therefore follows both ``tol`` and ``failure_probability``: the polynomial must grow
from its norm on the spectrum to about ``sqrt(2n/π)/failure_probability`` (15.4 in log
for n = 85,002 and the first run's share 5e-5 of 1e-4) between the top Ritz value and
``(1 + tol)·θ``, and a looser tol only moves that point closer. On the trained digits
MLP (float32) λ₁ costs 10, 11, 12 and 15 products at tol 1e-1, 1e-2, 1e-3 and 1e-6, and
its actual error is about 1e-7 at each: once the probabilistic bound is met the residual
bound is far below it (on a 2000 × 2000 matrix with ten outliers above a bulk near zero,
tol 0.1, the certified bound alone is met after 5 products and the probabilistic one
after 10). Top-5 on the digits MLP: 21–23, 25, 26 and 27–28 products. A PyHessian-style
power iteration stopping on a relative change below 1e-3 takes 9–15 products there for
an error of about 5e-4 and no bound. Stopping on the certified bound alone once reported
λ₁ = 6.81 ± 0.53 as "converged" after 5 products on a model whose λ₁ was 10.47. A better
polynomial of the same Krylov space would save a product rarely: the best one (the
Christoffel function Σ_j p_j(λ)² of the orthonormal Lanczos polynomials p_j) exceeds
p_m(λ)² by the factor Σ_j (p_j(λ)/p_m(λ))², at most 4/3 where the polynomials grow by 2
or more per product: 0.14 in the log against at least 0.69 per product.

What ``converged`` means, for every method: the pair's error bound is at most
``max(tol·|λ|, 10·(eps + √n·eps₆₄)·‖A‖)`` *and* that bound holds for the true i-th eigenvalue with
probability at least 1 − ``failure_probability`` (the requested one, default 1e-4)
over the random start. Otherwise ``converged`` is False, and
``settings["not_converged_reason"]`` says why in one line (None when all converged).

"power" bounds a larger eigenvalue the same way, from ``‖B^m q‖ >= |u_1ᵀq|·ρ(B)^m`` for
the operator B it iterates (see :func:`_power_method`): its reported bound is the larger
of the residual and the probabilistic one at the requested failure probability, and it
iterates until that meets ``tol``. The probabilistic part shrinks only like
``|λ|·log(1/failure_probability)/products``, so power iteration converges at loose
tolerances (0.1: about 150 products) and reports ``converged=False`` at tight ones
(without this rule, ``spectra analyze --method power --tol 0.1`` on the digits MLP
printed λ₁ = 9.52 ± 0.84 "converged" after a few products, truth 10.47, with failure
probability 1).

"lobpcg" finds the pairs with scipy's LOBPCG, whose iterates carry no usable
probabilistic statement of their own; its wanted pairs are then locked and verified by
a Lanczos run from a random start orthogonal to them (the verification run of the
"lanczos" method: Courant–Fischer, at most k eigenvalues of A exceed the bound of the
compressed operator), which gives the failure probability and the gaps of the bounds.
It costs the products of that run (6 to 66 on 200 × 200 matrices with decaying,
clustered and flat spectra, k = 1 and 3: the flatter the spectrum, the more).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Any, NamedTuple

import numpy as np
from scipy.linalg import blas as _blas
from scipy.sparse.linalg import LinearOperator, lobpcg

from spectra._validation import check_choice, check_float, check_int
from spectra.estimators._products import (
    ProductProgress,
    SeedLike,
    as_symmetric_operator,
    one_blas_thread,
    orthogonalize,
    seed_setting,
    seeded_rng,
)
from spectra.estimators.results import EigenResult

__all__ = ["eigenvalue_ratio", "eigenvalues"]

_WHICH = ("largest", "smallest", "magnitude")
_METHODS = ("lanczos", "power", "lobpcg")
# Breakdown of a Lanczos step when β <= factor · eps · ‖A‖ (estimate).
_BREAKDOWN_FACTOR = 100.0
# Eigenvalue errors below factor · eps · ‖A‖ count as converged whatever ``tol``.
FLOOR_FACTOR = 10.0
_EPS64 = float(np.finfo(np.float64).eps)


def rounding_floor(eps: float, norm: float, n: int) -> float:
    """The smallest error bound any method reports: FLOOR_FACTOR · (eps + √n · eps₆₄) · ‖A‖.

    Two roundings limit every computed eigenvalue whatever the residuals say: the
    operator's products (relative error about ``eps`` of their dtype along the top
    eigenvectors: 0.6–1.0·eps·λ₁ measured on the digits MLPs' Hessians), and the methods'
    own float64 arithmetic on n-vectors (inner products, orthogonalization, Rayleigh–Ritz;
    a NumPy matrix's products too), whose errors accumulate like √n · eps₆₄: measured up to
    49·eps₆₄·‖A‖ (n = 200) and 33 (n = 400) over 200 float64 runs of the three methods,
    where a floor of 10·eps·‖A‖ alone was exceeded. For a float32 operator the first term
    dominates for any n that fits in memory.
    """
    return FLOOR_FACTOR * (eps + math.sqrt(max(n, 1)) * _EPS64) * norm


_DEFAULT_FAILURE_PROBABILITY = 1e-4
# A pair is locked only once its residual is at most this fraction of its target: a
# locked vector is frozen, and its residual also enters the residuals of the vectors
# found after it (they are orthogonal to it, not to its error).
_LOCK_RESIDUAL_FRACTION = 0.5
# A Gram–Schmidt pass that shrinks a vector below this fraction of its norm is repeated
# (Daniel, Gragg, Kaufman & Stewart 1976).
_REORTHOGONALIZATION_RATIO = 1.0 / math.sqrt(2.0)
# A warm start q = v + g/sqrt(d) (v a unit vector, g Gaussian) has ‖q‖ <= 1 + ‖g‖/sqrt(d)
# and ‖g‖ <= sqrt(d) + s except with probability e^{−s²/2} (Gaussian concentration of
# the 1-Lipschitz norm), so ‖q‖ <= 2 + s/sqrt(d). :func:`_miss_probability` takes
# s = 5.26 >= sqrt(2·ln(1e6)) = 5.2565, so that the norm exceeds its bound with
# probability e^{−5.26²/2} = 9.8e-7 <= _WARM_NORM_TAIL = 1e-6, which it adds to the
# probability of the projection being small.
_WARM_NORM_SPREAD = 5.26
_WARM_NORM_TAIL = 1e-6
# A single Lanczos run plans for about this many products per wanted value (progress bar).
_PLANNED_PRODUCTS_PER_VALUE = 20
# The Krylov–Schur space keeps max(2k + 1, _MIN_KRYLOV_DIMENSION) vectors before a restart.
_MIN_KRYLOV_DIMENSION = 20
# The achieved failure probability may exceed the requested one by this relative amount
# (the rounding of a sum of shares) and still count as meeting it.
_PROBABILITY_ROUNDING = 1e-12
# exp(709) is finite, exp(710) overflows (log of the largest float64 is 709.78): the
# power method's bound U = exp(·) is capped there.
_LOG_LARGEST_FLOAT = 709.0
# LOBPCG: restart at most this many times, each with the residual tolerance tightened
# to this fraction of the smallest target not met; targets are guarded by a tiny
# positive number before they divide (a zero operator has zero targets).
_LOBPCG_MAX_ROUNDS = 10
_LOBPCG_TIGHTENING = 0.1
_TINY_TARGET = 1e-300
# Below this many blocks' worth of columns (n < 5·block), forming the dense matrix with
# one n-column product costs little more than a LOBPCG round and is exact.
_DENSE_BLOCKS = 5
# Newton's method for the probabilistic bound (:func:`_polynomial_bound`), on y = log x:
# a start is grown by this factor until it lies right of the root (no further than
# 1e300); it stops when the equation holds to 1e-12 relative to max(1, |target|), when
# a step is below 1e-14 in log x (a relative change of 1e-14 in x, near float64's
# resolution), when x falls below e^−700 (near the smallest normal float64, e^−708), or
# after 100 iterations (the convergence is monotone and usually takes a few).
_NEWTON_START_GROWTH = 4.0
_NEWTON_LARGEST_START = 1e300
_NEWTON_RESIDUAL = 1e-12
_NEWTON_STEP = 1e-14
_NEWTON_SMALLEST_LOG = -700
_NEWTON_MAX_ITERATIONS = 100
# A Gaussian vector (norm about sqrt(n)) orthogonalized against the locked vectors that
# keeps less than this fraction of sqrt(n) shows that they span the space (numerically):
# no run is left to start.
_EXHAUSTED_FRACTION = 1e-8


class _Pairs(NamedTuple):
    """The k best eigenpairs of a run, best first, in the counter's scaled units."""

    values: np.ndarray
    vectors: np.ndarray  # n × k, unit columns
    bounds: np.ndarray  # error bounds (certified part and probabilistic part)
    residuals: np.ndarray  # ‖A y − θ y‖
    converged: np.ndarray  # bool: bound <= target


class _MethodOutput(NamedTuple):
    """What a method (``_lanczos_method``, ...) hands to :func:`eigenvalues`."""

    pairs: _Pairs
    # P(some eigenvalue lies beyond the reported bounds) over the random starts; None
    # when the method cannot say.
    probability: float | None
    info: dict[str, Any]  # method-specific settings for the result


def _order(values: np.ndarray, which: str) -> np.ndarray:
    """Indices sorting ``values`` best-first for ``which`` (stable: ties keep order)."""
    if which == "largest":
        key = -values
    elif which == "smallest":
        key = values
    else:
        key = -np.abs(values)
    return np.argsort(key, kind="stable")


def _certified_bounds(
    values: np.ndarray,
    residuals: np.ndarray,
    rest: tuple[float, float] | None = None,
) -> np.ndarray:
    """Eigenvalue error bounds for candidate values θ with residuals r = ‖Ay − θy‖
    (orthonormal vectors y).

    Each θ certifies an eigenvalue in [θ − r, θ + r]. Candidates whose intervals
    overlap form a cluster; for a cluster of c values Kahan's theorem (Parlett 1998,
    Thm 11.5.2) gives c eigenvalues (with multiplicity) within ‖R‖₂ <= sqrt(Σ r²) of
    them. A value alone in its interval gets Kato–Temple's ``min(r, r²/δ)`` (Parlett
    1998, §10.2), δ the distance from its interval to the nearest other interval and to
    ``rest``, the interval that holds every eigenvalue the candidates do not account
    for (from the probabilistic bound). Without ``rest`` the gap is read off the
    candidates alone, which holds unless an eigenvalue they have not seen lies in it.
    """
    if values.size == 0:
        return np.zeros(0)
    low, high = values - residuals, values + residuals
    # Intervals by their lower ends: a new cluster starts where an interval begins above
    # the reach of all those before it (sorting by θ would miss an interval with a larger
    # residual that reaches back into an earlier cluster).
    order = np.argsort(low, kind="stable")
    separate = low[order][1:] > np.maximum.accumulate(high[order])[:-1]
    cluster = np.empty(values.size, dtype=int)
    cluster[order] = np.concatenate([[0], np.cumsum(separate)])
    joint = np.sqrt(np.bincount(cluster, weights=residuals**2))
    alone = np.bincount(cluster)[cluster] == 1
    bounds = np.where(alone, residuals, joint[cluster])
    if not alone.any():
        return bounds
    # distances[i, l] = |θ_l − θ_i| − r_l − r_i: the gap between the two intervals.
    distances = np.abs(values[None, :] - values[:, None]) - residuals[None, :] - residuals[:, None]
    np.fill_diagonal(distances, np.inf)
    gaps = distances.min(axis=1)
    if rest is not None:
        lower, upper = rest
        with np.errstate(invalid="ignore"):
            above = np.minimum(gaps, values - residuals - upper)
            below = np.minimum(gaps, lower - values - residuals)
        gaps = np.where(values > upper, above, np.where(values < lower, below, 0.0))
    usable = alone & (gaps > 0) & (gaps < np.inf)
    bounds[usable] = np.minimum(residuals[usable], residuals[usable] ** 2 / gaps[usable])
    return bounds


def _log_inverse_delta(dimension: int, probability: float, warm: bool) -> float:
    """log(1/δ) such that P(|uᵀq| < δ·‖q‖) <= ``probability`` for any fixed unit u.

    Cold start: q Gaussian in a space of the given dimension d (uniform direction):
    P(|uᵀq|/‖q‖ < δ) <= δ·max(1, sqrt(2(d−1)/π)) (the density of one coordinate of a
    uniform unit vector is at most Γ(d/2)/(sqrt(π)Γ((d−1)/2)) <= sqrt((d−1)/(2π))).
    Warm start: q = v + g/sqrt(d) with v a given unit vector and g Gaussian: by
    Anderson's inequality P(|uᵀq| < t) <= t·sqrt(2d/π), and ‖q‖ <= 2 + s/sqrt(d)
    except with probability e^{−s²/2}; half of ``probability`` goes to each.
    """
    if dimension <= 1:
        return 0.0
    if not warm:
        return math.log(max(1.0, math.sqrt(2.0 * (dimension - 1) / math.pi)) / probability)
    spread = math.sqrt(2.0 * math.log(2.0 / probability))
    norm_bound = 2.0 + spread / math.sqrt(dimension)
    return math.log(2.0 * norm_bound * math.sqrt(2.0 * dimension / math.pi) / probability)


def _miss_probability(log_delta: float, dimension: int, warm: bool) -> float:
    """P(|uᵀq| < δ·‖q‖) for a start as in :func:`_log_inverse_delta`, given log δ."""
    if dimension <= 1:
        return 0.0
    if not warm:
        factor = max(1.0, math.sqrt(2.0 * (dimension - 1) / math.pi))
        return math.exp(min(log_delta + math.log(factor), 0.0))
    # ‖q‖ <= 2 + spread/sqrt(d) except with probability _WARM_NORM_TAIL (see there).
    factor = (2.0 + _WARM_NORM_SPREAD / math.sqrt(dimension)) * math.sqrt(2.0 * dimension / math.pi)
    return min(1.0, math.exp(min(log_delta + math.log(factor), 0.0)) + _WARM_NORM_TAIL)


def _polynomial_bound(
    nodes: np.ndarray, log_scale: float, log_level: float, side: int, guess: float = 0.0
) -> float:
    """The t beyond the extreme node on ``side`` (+1: above, −1: below) where
    ``Σ_ν log|t − ν| − log_scale = log_level``; the extreme node itself if the scale is 0.

    The left side increases with the distance x from the extreme node, and is convex
    in log x, so Newton's method on y = log x started to the right of the root
    converges monotonically (to a t that errs outwards). ``guess``: a distance to try
    as the start first (the previous step's root, a few iterations from the new one).
    """
    extreme = float(nodes.max() if side > 0 else nodes.min())
    if log_scale == -math.inf:
        return extreme
    distances = side * (extreme - nodes)  # >= 0, one of them 0
    target = log_scale + log_level

    def excess(x: float) -> tuple[float, float]:
        shifted = distances + x
        return float(np.sum(np.log(shifted))) - target, float(np.sum(x / shifted))

    if guess > 0 and excess(guess)[0] >= 0:
        x = guess
    else:
        x = max(float(np.abs(nodes).max()), float(distances.max()), guess, np.finfo(float).tiny)
        while excess(x)[0] < 0 and x < _NEWTON_LARGEST_START:
            x *= _NEWTON_START_GROWTH
    y = math.log(x)
    for _ in range(_NEWTON_MAX_ITERATIONS):
        value, slope = excess(math.exp(y))
        if value <= _NEWTON_RESIDUAL * max(1.0, abs(target)) or slope <= 0:
            break
        step = value / slope
        y -= step
        if step < _NEWTON_STEP or y < _NEWTON_SMALLEST_LOG:
            break
    return extreme + side * math.exp(y)


class _Segment:
    """One Krylov run from one random start and its probabilistic bound.

    The current residual direction is p(A)q/C for the start q, with p the monic
    polynomial whose roots are every Ritz value of the run (``discarded`` at restarts
    plus the current ones) and C the product of every β of the run (``log_scale``):
    see the module docstring. ``exact`` (breakdown: the space is invariant) makes C 0.
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
        bound = _polynomial_bound(nodes, log_scale, self.log_level, side, self._distance[side])
        extreme = float(nodes.max() if side > 0 else nodes.min())
        self._distance[side] = side * (bound - extreme)
        return bound


class _Evaluation(NamedTuple):
    """Where a :class:`_KrylovSchur` state stands after a step: the candidates (locked
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


class _KrylovSchur:
    """Krylov–Schur restarted Lanczos with locking, stopping on certified and
    probabilistic bounds (see the module docstring), fed one product at a time.

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
    the requested total. The state finishes when done, when no new run can start, or
    after ``budget`` products.
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
        share = self.failure_probability * 0.5 ** (len(self.segments) + 1)
        dimension = self.n - self.locked.shape[0]
        self.segments.append(
            _Segment(_log_inverse_delta(dimension, share / self.events, warm), share)
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
        order = _order(self.theta, self.which)
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
        certified = _certified_bounds(values, residuals)
        wanted = _order(values, self.which)[: self.k]
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
        rigorous = _certified_bounds(values, residuals, rest)[wanted]
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

    def result(self) -> _Pairs:
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
        return _Pairs(
            state.values[wanted],
            vectors,
            state.bounds,
            state.residuals[wanted],
            converged,
        )


def _unit_columns(v0: np.ndarray | None, columns: int, n: int, rng: np.random.Generator):
    """``columns`` unit start vectors and whether each is warm: the columns of ``v0``
    first, each mixed with a Gaussian vector of the same norm (so that a start that
    misses an eigenvector still sees it), then Gaussian ones."""
    starts = rng.standard_normal((n, columns))
    warm = np.zeros(columns, dtype=bool)
    if v0 is not None:
        given = min(columns, v0.shape[1])
        starts[:, :given] = v0[:, :given] + starts[:, :given] / math.sqrt(n)
        warm[:given] = True
    return starts / np.linalg.norm(starts, axis=0), warm


def _krylov_dimension(n: int, k: int) -> int:
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


def _drive(solver: _KrylovSchur, counter: Any, bar: ProductProgress, plan: bool) -> None:
    """Feed ``solver`` one product at a time until it is finished (``plan``: update the
    progress bar's expected total after each)."""
    while not solver.finished:
        solver.absorb(counter.matvec(solver.next_vector()))
        bar.update()
        if plan:
            bar.plan(solver.expected_products())


def _runs_probability(solver: _KrylovSchur) -> float:
    """Failure probability of a Krylov–Schur state: the sum of its runs' shares."""
    return min(1.0, sum(segment.probability for segment in solver.segments))


def _lanczos_method(
    counter, k, which, tol, budget, rng, bar, v0, failure_probability
) -> _MethodOutput:
    """Krylov–Schur restarted Lanczos from one start (see :class:`_KrylovSchur`)."""
    n = counter.n
    ncv = _krylov_dimension(n, k)
    start, warm = _lanczos_start(v0, n, rng)
    solver = _KrylovSchur(
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
    _drive(solver, counter, bar, plan=True)
    info = {"ncv": ncv, "runs": len(solver.segments), "norm_estimate": solver.anorm}
    return _MethodOutput(solver.result(), _runs_probability(solver), info)


def _power_can_meet(
    log_total: float, iterations: int, level: float, target: float, left: int
) -> bool:
    """Whether power iteration, its value converged at ``level`` (of the iterated
    operator B), can bring its probabilistic bound U − level below ``target`` within
    ``left`` more products: each further iteration adds about log(level) to
    ``log_total`` = Σ log ν_i + log(1/δ), and U = exp(log_total / m), so it needs
    m' >= (log_total − m·log(level + target)) / log(1 + target/level) more."""
    if not level > 0:
        return False
    goal = math.log(level + target)
    gain = math.log1p(target / level)
    return gain > 0 and log_total - iterations * goal <= left * gain


class _PowerPair(NamedTuple):
    """One pair found by power iteration, in the units of sign·A."""

    vector: np.ndarray
    value: float
    residual: float
    bound: float  # max(residual, probabilistic bound)
    converged: bool
    products: int


@dataclasses.dataclass
class _PowerIteration:
    """The state :func:`_power_method` carries from one pair to the next: the vectors
    found (rows), the shift of the iterated operator B = sign·A + shift·I and the norm
    estimate of A."""

    counter: Any
    which: str
    tol: float
    rng: np.random.Generator
    bar: ProductProgress
    sign: float
    found: np.ndarray
    anorm: float
    shift: float = 0.0

    def pair(self, start: np.ndarray, warm: bool, share: float, allowance: int) -> _PowerPair:
        """Iterate B on the complement of the vectors found, from ``start``, until the
        pair's bound meets its target, it cannot within ``allowance`` products, or they
        are spent (see :func:`_power_method`)."""
        counter, n = self.counter, self.counter.n
        use_shift = self.which in ("largest", "smallest")
        dimension = n - self.found.shape[0]
        log_inverse = _log_inverse_delta(dimension, share, warm)
        vector = self._unit_in_complement(start)
        value, residual, bound, done = 0.0, np.inf, np.inf, False
        log_norms, iterations, used = 0.0, 0, 0
        while used < allowance:
            image = self.sign * counter.matvec(vector)
            used += 1
            self.bar.update()
            self.anorm = max(self.anorm, float(np.linalg.norm(image)))
            image, _ = orthogonalize(image + self.shift * vector, self.found)
            shifted_value = float(vector @ image)
            residual = float(np.linalg.norm(image - shifted_value * vector))
            value = shifted_value - self.shift
            target = max(self.tol * abs(value), rounding_floor(counter.eps, self.anorm, n))
            if residual <= target and use_shift and self.shift == 0.0 and value < 0:
                if self.found.shape[0] < n - 1:
                    # The dominant value is negative: restart on B + |μ| I.
                    self.shift = abs(value)
                    vector = self._unit_in_complement(self.rng.standard_normal(n))
                    log_norms, iterations = 0.0, 0
                    log_inverse = _log_inverse_delta(dimension, share, False)
                    continue
            norm = float(np.linalg.norm(image))
            log_norms += math.log(norm) if norm > 0 else -math.inf
            iterations += 1
            # ρ(B) <= U except with probability ``share``; an exact zero product (B = 0
            # on the complement of the found vectors, or a start in its null space,
            # which has probability 0) gives U = 0.
            top = math.exp(min((log_norms + log_inverse) / iterations, _LOG_LARGEST_FLOAT))
            level = abs(value) if self.which == "magnitude" else value + self.shift
            bound = max(residual, top - level)
            done = bound <= target
            if done or norm == 0.0 or used >= allowance:
                break
            if residual <= target and not _power_can_meet(
                log_norms + log_inverse, iterations, level, target, allowance - used
            ):
                break  # leave the products to the other pairs (converged=False)
            vector = image / norm
        return _PowerPair(vector, value, residual, bound, done, used)

    def _unit_in_complement(self, vector: np.ndarray) -> np.ndarray:
        vector, _ = orthogonalize(vector, self.found)
        vector /= np.linalg.norm(vector)
        return vector


def _power_method(
    counter, k, which, tol, budget, rng, bar, v0, failure_probability
) -> _MethodOutput:
    """Power iteration with deflation; "smallest" runs on −A.

    For "largest" (and "smallest") an indefinite spectrum whose dominant
    eigenvalue has the wrong sign is handled by a shift: once an iteration
    converges to a negative dominant value μ, the operator becomes A + |μ| I
    (positive semidefinite on the remaining space), whose dominant eigenvalue
    is λ_max + |μ|. The shift slows convergence (ratio (λ₂+|μ|)/(λ₁+|μ|)).

    Bounds. The residual r certifies *some* eigenvalue within r of the value θ. That
    no larger one hides rests on the random start q (Kuczyński & Woźniakowski 1992, for
    the power method as for Lanczos): for the iterated operator B (sign·A plus the
    shift, on the complement of the vectors found before) and its dominant
    eigenvector u₁, ``‖B^m q‖ = Π ν_i >= |u₁ᵀq|·ρ(B)^m`` (ν_i the norms of the
    iterates' images), and ``|u₁ᵀq| >= δ`` except with probability ``share``
    (:func:`_log_inverse_delta`). So with probability at least 1 − share

        λ_max(sign·A on the complement) + shift <= ρ(B) <= U = (Π ν_i / δ)^{1/m},

    and the reported bound is ``max(r, U − shift − θ)`` (for "magnitude",
    ``max(r, U − |θ|)``); by Courant–Fischer the maximum over the complement of the j
    vectors found bounds the (j+1)-th eigenvalue. The iteration runs until that bound
    meets the tolerance: U − θ shrinks only like θ·log(1/δ)/m, so at tol 0.1 it takes
    about 10·log(1/δ) ≈ 150 products, and a tolerance like 1e-6 is out of reach (the
    pair is then reported with ``converged=False`` and the bound it has; once its
    residual has converged, a pair that cannot meet the tolerance within its products
    stops and leaves them to the next pairs). Each of the k
    values gets ``failure_probability / k``; the result's probability is their sum.
    """
    n = counter.n
    sign = -1.0 if which == "smallest" else 1.0
    share = failure_probability / k
    iteration = _PowerIteration(
        counter, which, tol, rng, bar, sign, np.zeros((0, n)), counter.norm_estimate
    )
    starts, warm_starts = _unit_columns(v0, k, n, rng)
    pairs: list[_PowerPair] = []
    spent = 0
    for index in range(k):
        allowance = budget - spent - (k - index - 1)  # leave one product per later pair
        pair = iteration.pair(starts[:, index], bool(warm_starts[index]), share, allowance)
        spent += pair.products
        iteration.found = np.vstack([iteration.found, pair.vector])
        pairs.append(pair)
    found = _Pairs(
        np.array([sign * pair.value for pair in pairs]),
        iteration.found.T.copy(),
        np.array([pair.bound for pair in pairs]),
        np.array([pair.residual for pair in pairs]),
        np.array([pair.converged for pair in pairs], dtype=bool),
    )
    return _MethodOutput(found, min(1.0, share * k), {"shift": sign * iteration.shift})


def _dense_pairs(counter, k: int, which: str, bar: ProductProgress, info: dict) -> _MethodOutput:
    """The exact k pairs of a small operator: one n-column ``matmat`` and ``eigh``."""
    n = counter.n
    dense = counter.matmat(np.eye(n))
    bar.update()
    theta, vectors = np.linalg.eigh(0.5 * (dense + dense.T))
    order = _order(theta, which)[:k]
    info["dense"] = True
    zeros = np.zeros(k)
    pairs = _Pairs(theta[order], vectors[:, order], zeros, zeros, np.ones(k, dtype=bool))
    return _MethodOutput(pairs, 0.0, info)


class _BlockFit(NamedTuple):
    """LOBPCG's block after its last Rayleigh–Ritz step with A: A·x = image, and the
    Ritz values theta, best first by ``which`` after :func:`_order`."""

    x: np.ndarray
    image: np.ndarray
    theta: np.ndarray
    anorm: float
    rounds: int


def _block_operator(counter, squared: bool, bar: ProductProgress) -> LinearOperator:
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
    counter, x: np.ndarray, tol: float, anorm: float, squared: bool
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
    counter, x: np.ndarray, bar: ProductProgress
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


def _lobpcg_rounds(counter, x, k, which, tol, budget, bar) -> _BlockFit:
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
        order = _order(theta, which)[:k]
        bounds = _certified_bounds(theta, residuals, rest=(-np.inf, np.inf))[order]
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
    counter, fit: _BlockFit, k, which, tol, budget, rng, bar, failure_probability, info
) -> _MethodOutput:
    """Lock the block's k wanted pairs in a :class:`_KrylovSchur` state and run Lanczos
    from a random start orthogonal to them, within ``budget`` products: its
    probabilistic bound covers the rest of the spectrum (Courant–Fischer)."""
    n = counter.n
    order = _order(fit.theta, which)[:k]
    residual_vectors = (fit.image - fit.x * fit.theta)[:, order]
    solver = _KrylovSchur(
        n,
        k,
        which,
        tol,
        counter.eps,
        budget,
        rng.standard_normal(n),
        False,
        rng,
        _krylov_dimension(n, k),
        failure_probability,
        fit.anorm,
    )
    solver.verify(fit.x[:, order], fit.theta[order], residual_vectors)
    _drive(solver, counter, bar, plan=False)
    info["verification_products"] = solver.spent
    info["norm_estimate"] = solver.anorm
    return _MethodOutput(solver.result(), _runs_probability(solver), info)


def _lobpcg_method(
    counter, k, which, tol, budget, rng, bar, v0, failure_probability
) -> _MethodOutput:
    """scipy LOBPCG on a block of k + extra vectors, restarted with a tighter
    residual tolerance until the eigenvalue bounds meet ``tol``.

    "magnitude" runs LOBPCG on A² (two products per column) and recovers signed
    eigenvalues by a final Rayleigh–Ritz step with A. For n < 5·block the
    dense matrix is formed with one n-column ``matmat`` and diagonalized.
    LOBPCG works in whole blocks, so it may exceed ``budget`` by up to two blocks (the
    norm estimate of the first round and the closing Rayleigh–Ritz step).
    The block's residual bounds (a block's few Ritz values certify no Kato–Temple gap)
    decide when LOBPCG stops; the wanted pairs are then locked in a
    :class:`_KrylovSchur` state whose run from a random start orthogonal to them
    bounds the rest of the spectrum (:meth:`_KrylovSchur.verify`), within what is left
    of ``budget``: the reported bounds, convergence and failure probability are that
    state's. The dense path is exact (failure probability 0).
    """
    n = counter.n
    block = min(n, k + max(2, k // 2))
    info: dict[str, Any] = {"block_size": block}
    if n < _DENSE_BLOCKS * block:
        return _dense_pairs(counter, k, which, bar, info)
    x, _ = _unit_columns(v0, block, n, rng)
    spent_before = counter.num_products
    fit = _lobpcg_rounds(counter, x, k, which, tol, budget, bar)
    info["rounds"] = fit.rounds
    left = budget - (counter.num_products - spent_before)
    return _verify_block(counter, fit, k, which, tol, left, rng, bar, failure_probability, info)


def _unit_starts(v0: Any, n: int) -> np.ndarray | None:
    """``v0`` as an n × j array of unit columns (a vector is one column); None stays None."""
    if v0 is None:
        return None
    v0 = np.asarray(v0, dtype=np.float64)
    v0 = v0.reshape(-1, 1) if v0.ndim == 1 else v0
    if v0.ndim != 2 or v0.shape[0] != n or v0.shape[1] < 1:
        raise ValueError(f"v0 must have shape ({n},) or ({n}, j), got {v0.shape}")
    norms = np.linalg.norm(v0, axis=0)
    if not np.all(np.isfinite(v0)) or not np.all(norms > 0):
        raise ValueError("v0 must hold finite, nonzero vectors")
    return v0 / norms


_SOLVERS = {"lanczos": _lanczos_method, "power": _power_method, "lobpcg": _lobpcg_method}


class _Reported(NamedTuple):
    """The pairs as :func:`eigenvalues` reports them, in the operator's units."""

    values: np.ndarray
    vectors: np.ndarray
    error_bounds: np.ndarray
    targets: np.ndarray
    residuals: np.ndarray
    converged: np.ndarray


def _report(
    output: _MethodOutput, counter: Any, tol: float, failure_probability: float
) -> _Reported:
    """Floor the method's bounds at the operator's rounding, decide convergence against
    ``tol`` and the requested failure probability, and scale back to the operator's units.

    The operator's own rounding limits every eigenvalue, however small the method's
    bound: float32 Hessian products carry relative errors of about eps along the top
    eigenvectors (eigenvalue errors of 0.6–1.0·eps·λ₁ measured on the digits MLPs), and
    the methods' float64 arithmetic adds about √n·eps₆₄: no bound goes below
    :func:`rounding_floor` (‖A‖ estimated by the largest |Ritz value| and product norm
    seen). Everything before is in the units of the counter's scaled
    products (A / scale, scale a power of two): exact to multiply back.
    """
    pairs, probability, info = output
    vectors = pairs.vectors / np.linalg.norm(pairs.vectors, axis=0)
    norm = max(
        float(np.max(np.abs(pairs.values), initial=0.0)),
        counter.norm_estimate,
        float(info.pop("norm_estimate", 0.0)),
    )
    floor = rounding_floor(counter.eps, norm, counter.shape[0])
    error_bounds = np.maximum(np.asarray(pairs.bounds, dtype=np.float64), floor)
    values = np.asarray(pairs.values, dtype=np.float64)
    targets = np.maximum(tol * np.abs(values), floor)
    converged = np.asarray(pairs.converged, dtype=bool) & (error_bounds <= targets)
    if not _meets(probability, failure_probability):
        converged[:] = False
    scale = counter.scale
    try:
        values = counter.unscale(values, "an eigenvalue")
    except ValueError as error:
        raise ValueError(
            f"{error} (the operator's products are finite, its spectrum is not)"
        ) from None
    with np.errstate(over="ignore"):  # a bound that overflows is inf: not converged
        error_bounds, targets = error_bounds * scale, targets * scale
        residuals = np.asarray(pairs.residuals, dtype=np.float64) * scale
    if "shift" in info:
        info["shift"] *= scale
    converged &= np.isfinite(error_bounds)
    return _Reported(values, vectors, error_bounds, targets, residuals, converged)


def _meets(probability: float | None, requested: float) -> bool:
    """Whether a failure probability is known and at most the requested one (up to the
    rounding of a sum of shares)."""
    return not (probability is None or probability > requested * (1.0 + _PROBABILITY_ROUNDING))


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
    failure_probability: float = _DEFAULT_FAILURE_PROBABILITY,
) -> EigenResult:
    """The k extreme eigenvalues of a symmetric operator, with bounds that hold.

    Parameters
    ----------
    op
        LinearOperator, dense array or sparse matrix, symmetric, n × n.
    k
        number of eigenvalues, 1 <= k <= n.
    which
        "largest" (algebraic, largest first), "smallest" (most negative
        first) or "magnitude" (by decreasing ``|λ|``).
    method
        "lanczos" (default), "power" or "lobpcg" (see the module docstring).
    tol
        relative accuracy: pair i is converged when its error bound is at most
        ``max(tol·|λ_i|, 10·(eps + √n·eps₆₄)·‖A‖)`` (:func:`rounding_floor`). With a float32
        operator the bounds never go below about 10·eps·‖A‖ ≈ 1.2e-6·‖A‖ whatever ``tol``
        (the products' rounding).
    max_products
        cap on the products (default 1000 + 100·k). When it is hit the
        current estimates are returned with ``converged=False``. No product is spent
        outside the iteration (residuals come from the iteration; the symmetry check
        uses its first products, and makes a second one when the cap is 1). "lobpcg"
        works in whole blocks and may go beyond the cap by up to two blocks (its norm
        estimate and its closing Rayleigh–Ritz step).
    return_eigenvectors
        include the unit-norm eigenvectors (n × k).
    v0
        optional start, shape (n,) or (n, j): e.g. the eigenvectors of a nearby
        operator (the previous checkpoint of a training run). "lanczos" starts from
        the normalized sum of the columns plus a Gaussian vector of the same norm;
        "power" and "lobpcg" use the columns (plus the same noise for "power") as
        their first start vectors and fill up with random ones. The noise keeps the
        probabilistic statement valid; a warm start then saves the products of
        converging, not those of ruling out a larger eigenvalue elsewhere, so it pays
        mostly for k > 1.
    failure_probability
        every method runs until, with at least this probability over
        its random start, no eigenvalue lies beyond the reported ones by more than the
        error bounds (default 1e-4; see the module docstring); a pair that does not get
        there within ``max_products`` has ``converged=False``. Smaller values cost a
        few steps more (the bound depends on log(1/failure_probability)); for "power"
        many more (see the module docstring).
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s (none when stderr is
        not a terminal); True: a bar at once, terminal or not; False: no bar.

    Returns
    -------
    EigenResult
        Its ``error_bounds`` are certified for some eigenvalue and hold for the true i-th
        one with probability at least ``1 − result.failure_probability``.
        ``converged[i]``: that bound meets ``tol`` and ``result.failure_probability`` is
        at most the requested one; when a pair is not converged,
        ``settings["not_converged_reason"]`` is a one-line reason (else None).

    Notes
    -----
    Floating point: the products are scaled by a power of two (exact) when they are
    far from 1 (see :class:`spectra.estimators._products.ProductCounter`), so operators
    from 1e-300 to 1e300 give the same relative accuracy; an eigenvalue that overflows
    float64 is refused with a ``ValueError``.

    Cost: "lanczos" one ``matvec`` per product; "power" one per iteration;
    "lobpcg" one ``matmat`` of up to k + max(2, k//2) columns per iteration.
    With a single-vector Krylov space ("lanczos") an exactly repeated eigenvalue
    is seen once per run; for k > 1 the verification run from a random vector
    orthogonal to the converged eigenvectors finds further copies. "lobpcg" sees
    multiplicities up to its block size directly.
    """
    started = time.perf_counter()
    k = check_int("k", k)
    which = check_choice("which", which, _WHICH)
    method = check_choice("method", method, _METHODS)
    tol = check_float("tol", tol)
    failure_probability = check_float("failure_probability", failure_probability, below=1.0)
    if max_products is None:
        max_products = 1000 + 100 * k
    max_products = check_int("max_products", max_products)
    rng = seeded_rng(seed)
    counter = as_symmetric_operator(op, f"eigenvalues ({method})", check_symmetry)
    n = counter.n
    if k > n:
        raise ValueError(f"k must be <= n = {n}, got k = {k}")
    if max_products < k:
        raise ValueError(f"max_products must be >= k = {k}, got {max_products}")
    v0 = _unit_starts(v0, n)
    planned = (
        min(max_products, _PLANNED_PRODUCTS_PER_VALUE * k) if method == "lanczos" else max_products
    )
    with (
        one_blas_thread(),
        ProductProgress(counter, planned, f"eigenvalues ({method})", progress) as bar,
    ):
        output = _SOLVERS[method](
            counter, k, which, tol, max_products, rng, bar, v0, failure_probability
        )
        counter.finish()
    reported = _report(output, counter, tol, failure_probability)
    probability, info = output.probability, output.info
    reason = _not_converged_reason(
        method, reported, probability, failure_probability, counter.num_products, max_products
    )
    unresolved = _unresolved_zero(counter)
    if unresolved is not None:
        reported = reported._replace(
            error_bounds=np.full_like(reported.error_bounds, np.inf),
            converged=np.zeros_like(reported.converged),
        )
        reason = unresolved
    return EigenResult(
        eigenvalues=reported.values,
        residual_norms=reported.residuals,
        error_bounds=reported.error_bounds,
        converged=reported.converged,
        which=which,
        method=method,
        num_products=counter.num_products,
        num_operator_calls=counter.num_operator_calls,
        wall_time=time.perf_counter() - started,
        failure_probability=None if probability is None else float(probability),
        settings={
            "k": k,
            "tol": tol,
            "max_products": max_products,
            "seed": seed_setting(seed),
            "check_symmetry": bool(check_symmetry),
            "dimension": n,
            "v0_given": v0 is not None,
            "failure_probability": failure_probability,
            **info,
            "not_converged_reason": reason,
        },
        eigenvectors=reported.vectors if return_eigenvectors else None,
    )


def _unresolved_zero(counter: Any) -> str | None:
    """Why the zeros of a lower-precision operator whose every product was exactly 0 are
    not certified (None otherwise): float32 cannot tell the zero operator from one whose
    products flush to zero (a float32 loss scaled by 1e-38 has a nonzero Hessian whose
    TensorFlow products are exact zeros on CPU, at any scale of the vector). A float64
    zero is the zero operator (its range ends at 1e-308): its zeros are certified."""
    if counter.saw_nonzero or counter.boundary_dtype == np.dtype(np.float64):
        return None
    return (
        f"every product was exactly 0 in {counter.boundary_dtype}: the zero operator, or one "
        f"whose products underflow {counter.boundary_dtype} (flushed to zero, e.g. a loss "
        "scaled below about 1e-37): build the operator in float64 to tell"
    )


def _not_converged_reason(
    method: str,
    reported: _Reported,
    probability: float | None,
    requested: float,
    spent: int,
    max_products: int,
) -> str | None:
    """One line saying why pairs are not converged (None when all are): the first
    unconverged pair's bound against its target, and what would help."""
    values, bounds, targets = reported.values, reported.error_bounds, reported.targets
    converged = reported.converged
    if converged.all():
        return None
    index = int(np.flatnonzero(~converged)[0])
    count = int((~converged).sum())
    head = f"{count} of {converged.size} eigenvalue(s) not converged"
    if not _meets(probability, requested):
        shown = "none" if probability is None else f"{probability:.3g}"
        return (
            f"{head}: {method}'s bounds hold with failure probability {shown}, above the "
            f"requested {requested:g}"
        )
    stop = f"after {spent} products (max_products = {max_products})"
    detail = (
        f"{head} {stop}: the bound of eigenvalue {index} ({values[index]:.6g}) is "
        f"{bounds[index]:.3g} > the target {targets[index]:.3g} (tol·|λ|), at failure "
        f"probability {requested:g}"
    )
    if method == "power":
        return (
            f"{detail}; power iteration rules out a larger eigenvalue only slowly (its "
            "bound falls like |λ|·log(1/failure_probability)/products): use "
            "method='lanczos', a larger tol or more max_products"
        )
    return f"{detail}; raise max_products or tol"


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
