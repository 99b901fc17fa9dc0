"""The error bounds of :func:`~spectra.estimators.eigensolvers.eigenvalues`: the certified
bounds of Ritz values (:func:`certified_bounds`), the probabilistic bound on a larger
eigenvalue from a random start (:func:`log_inverse_delta`, :func:`miss_probability`,
:func:`polynomial_bound`) and the rounding floor no bound goes below (:func:`rounding_floor`).

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
from its norm on the spectrum to about ``sqrt(2n/π)/failure_probability`` (14.7 in log
for n = 85,002 and the first run's share 15/16 of 1e-4 when k = 1) between the top Ritz
value and ``(1 + tol)·θ``, and a looser tol only moves that point closer. On the trained
digits MLP (float32) λ₁ costs 9, 11, 12 and 15 products at tol 1e-1, 1e-2, 1e-3 and 1e-6
(its polynomial at 1.001·θ: −11.2 after one product, 1.4 after four, then about 2.2 more
per product, 14.0 after eleven and 16.5 after twelve), and
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
the operator B it iterates (see :func:`~spectra.estimators.power_iteration.power_method`):
its reported bound is the larger of the residual and the probabilistic one at the requested
failure probability, and it iterates until that meets ``tol``. The probabilistic part
shrinks only like ``|λ|·log(1/failure_probability)/products``, so power iteration converges at loose
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

import math

import numpy as np

__all__ = [
    "FLOOR_FACTOR",
    "WARM_NORM_SPREAD",
    "WARM_NORM_TAIL",
    "certified_bounds",
    "log_inverse_delta",
    "miss_probability",
    "polynomial_bound",
    "rounding_floor",
]

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


# A warm start q = v + g/sqrt(d) (v a unit vector, g Gaussian) has ‖q‖ <= 1 + ‖g‖/sqrt(d)
# and ‖g‖ <= sqrt(d) + s except with probability e^{−s²/2} (Gaussian concentration of
# the 1-Lipschitz norm), so ‖q‖ <= 2 + s/sqrt(d). :func:`miss_probability` takes
# s = 5.26 >= sqrt(2·ln(1e6)) = 5.2565, so that the norm exceeds its bound with
# probability e^{−5.26²/2} = 9.8e-7 <= WARM_NORM_TAIL = 1e-6, which it adds to the
# probability of the projection being small.
WARM_NORM_SPREAD = 5.26
WARM_NORM_TAIL = 1e-6
# Newton's method for the probabilistic bound (:func:`polynomial_bound`), on y = log x:
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


def certified_bounds(
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


def log_inverse_delta(dimension: int, probability: float, warm: bool) -> float:
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


def miss_probability(log_delta: float, dimension: int, warm: bool) -> float:
    """P(|uᵀq| < δ·‖q‖) for a start as in :func:`log_inverse_delta`, given log δ."""
    if dimension <= 1:
        return 0.0
    if not warm:
        factor = max(1.0, math.sqrt(2.0 * (dimension - 1) / math.pi))
        return math.exp(min(log_delta + math.log(factor), 0.0))
    # ‖q‖ <= 2 + spread/sqrt(d) except with probability WARM_NORM_TAIL (see there).
    factor = (2.0 + WARM_NORM_SPREAD / math.sqrt(dimension)) * math.sqrt(2.0 * dimension / math.pi)
    return min(1.0, math.exp(min(log_delta + math.log(factor), 0.0)) + WARM_NORM_TAIL)


def polynomial_bound(
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
