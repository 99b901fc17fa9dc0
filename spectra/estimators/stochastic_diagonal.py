"""Stochastic estimation of the diagonal of a symmetric operator.

Bekas, Kokiopoulou & Saad, "An estimator for the diagonal of a matrix",
Appl. Numer. Math. 57 (2007): ``diag(A) ≈ (Σ_k z_k ⊙ A z_k) ⊘ (Σ_k z_k ⊙ z_k)``.
With Rademacher probes z_k ⊙ z_k = 1, so the estimate is the mean of the
samples z_k ⊙ A z_k, each unbiased: E[z_i (Az)_i] = a_ii, with variance
Σ_{j≠i} a_ij² per probe.

Cost: m probes are m products, multiplied in blocks of 16 per ``matmat`` call (one data
pass of a Hessian each), and O(n) host memory for the running mean and variance of the
n entries; the standard error of each entry falls like 1/sqrt(m).

XDiag (Epperly, Tropp & Webber, "XTrace: Making the most of every sample in stochastic
trace estimation", SIAM J. Matrix Anal. Appl. 45, 2024, the XDiag section), :func:`xdiag`:
the exchangeable leave-one-out estimator of :func:`spectra.xtrace` applied to the
diagonal. Each test vector is used both for a low-rank sketch and for a Hutchinson-style
estimate of the diagonal of what the sketch misses, so for matrices with a decaying
spectrum the error falls much faster than 1/sqrt(m), and it is exact (to rounding) for
rank < m/2. Cost: m products in two ``matmat`` calls, O(n m) host memory and
O(n m² + m³) host flops.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import numpy as np
from scipy.linalg import solve_triangular

from spectra._validation import check_int
from spectra.estimators._preamble import check_block_size, start_estimator
from spectra.estimators._products import (
    ProductCounter,
    SeedLike,
    rademacher_vectors,
    tall_qr,
)
from spectra.estimators.results import DiagonalResult
from spectra.estimators.stochastic_trace import (
    SPAN_TOL,
    adaptive_mean,
    exchangeable_estimates,
    numerical_rank,
    sketch_span,
)

__all__ = ["diagonal", "xdiag"]

# Rows per chunk of :func:`_pair_sum`: its monomials (a few chunk × s float64 arrays) stay
# in the cache for s up to about 50.
_PAIR_SUM_ROWS = 2048


def diagonal(
    op: Any,
    num_products: int = 100,
    seed: SeedLike = 0,
    block_size: int | None = None,
    progress: bool | None = None,
    check_symmetry: bool = True,
) -> DiagonalResult:
    """Estimate diag(A) as the mean of z ⊙ Az over Rademacher probes z.

    ``stderr`` is the per-entry sample standard deviation of z ⊙ Az (divisor m − 1)
    over sqrt(m), m = num_products. Each entry's estimate is a mean of m independent
    samples, so (estimate − a_ii)/stderr is close to a Student t with m − 1 degrees
    of freedom: over 200 seeds × all 200 entries of matrices with flat, decaying and
    low-rank-plus-noise spectra (tests/truths/test_calibration.py, m = 100) the ±1 stderr
    interval covered a_ii in 68% and ±2 stderr in 95% of the cases.
    Probes go through ``matmat`` in blocks of ``block_size`` (default
    min(16, num_products)): num_products products in
    ceil(num_products / block_size) calls; the symmetry check uses them (no extra one).
    Products far from 1 are scaled by a power of two (exact; see ``ProductCounter``),
    so operators from 1e-300 to 1e300 give the same relative accuracy.

    Parameters
    ----------
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s (none when stderr is
        not a terminal); True: a bar at once, terminal or not; False: no bar.
    """
    started = time.perf_counter()
    num_products = check_int("num_products", num_products, minimum=2)
    block_size = check_block_size(block_size, num_products)
    run = start_estimator(op, "diagonal", seed, check_symmetry, progress, started)
    counter = run.counter

    def draw(width: int) -> np.ndarray:
        probes = rademacher_vectors(run.rng, (counter.n, width))
        return (probes * counter.matmat(probes)).T

    with run.products(num_products, "diagonal") as bar:
        moments, _ = adaptive_mean(
            draw, num_products, block_size, None, 0.0, bar, shape=(counter.n,)
        )
    # back from the counter's scaled products (a power of two: exact)
    return DiagonalResult(
        estimate=counter.unscale(moments.mean, "the diagonal estimate"),
        stderr=counter.unscale(moments.stderr(), "the diagonal's standard error"),
        **run.result_fields(num_products=num_products, block_size=block_size),
    )


def _row_dots(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Σ_a left[k, a] right[k, a] for each row k: diag(left rightᵀ) in O(n s)."""
    return np.einsum("ka,ka->k", left, right)


def _xdiag_rank_deficient(
    test: np.ndarray,
    image: np.ndarray,
    triangular: np.ndarray,
    basis: np.ndarray,
    rank: int,
    counter: ProductCounter,
) -> tuple[np.ndarray, np.ndarray]:
    """The s XDiag estimates d_i (columns of an n × s array) and, per entry, the
    interaction sum Σ_{i≠j} Δ_ij ⊙ Δ_ji when Y = AΩ = QR has numerical rank r < s, whatever
    the cause: rank A < s, Ω singular (Rademacher vectors in small dimensions: two equal
    or opposite columns, or another integer dependency), or both.

    The definition is that of :func:`_xdiag_estimates`: P_K is the orthogonal projector
    onto span(Y₋K) (the columns K of Y left out) and d = diag(P_K A) + ω_i ⊙ (I − P_K)Aω_i,
    K = {i} for d_i and K = {i, j} for d_i⁽⁻ʲ⁾, unbiased since ω_i is independent of P_K.
    Which directions leaving K out removes from span(Y) comes from the null space N of
    C = QᵀY (Q the r leading left singular vectors of R, one SVD:
    :func:`spectra.estimators.stochastic_trace._sketch_span`, as in XTrace's
    :func:`spectra.estimators.stochastic_trace._xtrace_rank_deficient`), with s_k the
    columns of (C⁺)ᵀ scaled to unit norm and n_k the rows of N:

    * K = {i}: s_i if n_i = 0 (ω_i is needed to span Y), nothing otherwise
      (span(Y₋ᵢ) = span(Y): the usual case when rank A < s, where d_i is diag(QQᵀA)
      plus a numerically zero residual, exact to rounding);
    * K = {i, j}: span(s_i, s_j) if n_i = n_j = 0, so leaving ω_j out as well removes
      u = (s_j − c s_i)/sqrt(1 − c²), c = s_iᵀs_j, as in the full-rank path; if neither
      row is 0 and they are parallel (for example ω_i = ±ω_j with A invertible), the one
      direction u ∝ ‖n_j‖g_i − σ‖n_i‖g_j (g_k = (C⁺)ᵀe_k, σ = sign n_iᵀn_j), removed from
      both d_i and d_j; otherwise nothing, or (one of n_i, n_j zero) only on one side,
      so that Δ_ij ⊙ Δ_ji = 0.

    In every case the added direction u is orthogonal to what K = {i} removed, so
    Δ_ij = d_i − d_i⁽⁻ʲ⁾ = (Qu) ⊙ (Zu − (uᵀt_i) ω_i) (Z = AQ, t_i = Zᵀω_i) and the variance
    is that of :func:`xdiag` (:func:`_pair_sum` with u = (own·s_i + other·s_j)/‖·‖). Zero
    and parallel rows are decided at ``SPAN_TOL``. Costs one ``matmat`` (A Q, r
    products), one SVD of R and O(n s² + s³) host flops.
    """
    s = test.shape[1]
    span = sketch_span(basis, triangular, rank)
    basis = span.basis
    needed = span.needed
    directions = span.S * needed  # u_i (columns), 0 where ω_i is not needed
    projected_image = counter.matmat(basis)  # Z = AQ
    T = projected_image.T @ test  # t_i = QᵀAω_i (= Zᵀω_i for symmetric A)
    base = _row_dots(basis, projected_image)[:, None] + test * (image - basis @ T)
    own = np.einsum("ai,ai->i", directions, T)  # u_iᵀ t_i
    estimates = base - (basis @ directions) * (projected_image @ directions - own * test)

    # Pairs of nonzero rows n_i, n_j: parallel (one direction leaves) or independent.
    unit_rows = span.null / np.where(needed, 1.0, span.row_norms)[:, None]
    row_cosines = unit_rows @ unit_rows.T
    parallel = np.zeros((s, s), dtype=bool)
    for i in np.flatnonzero(~needed):
        rejected = unit_rows - row_cosines[:, i : i + 1] * unit_rows[i]
        parallel[i] = np.linalg.norm(rejected, axis=1) <= SPAN_TOL
    parallel &= ~needed[:, None] & ~needed[None, :]
    both = needed[:, None] & needed[None, :]
    pairs = (both | parallel) & ~np.eye(s, dtype=bool)
    if not np.any(pairs):
        return estimates, np.zeros(test.shape[0])
    S = span.S
    cosines = S.T @ S
    lengths = span.lengths
    sign = np.where(row_cosines < 0, -1.0, 1.0)
    # u_ij = (own[i, j] s_i + other[i, j] s_j)/‖·‖; pairs that do not enter get s_j.
    own_coefficient = np.where(
        both, -cosines, np.where(parallel, span.row_norms[None, :] * lengths[:, None], 0.0)
    )
    other_coefficient = np.where(parallel, -sign * span.row_norms[:, None] * lengths[None, :], 1.0)
    own_coefficient[~pairs] = 0.0
    other_coefficient[~pairs] = 1.0
    norm2 = (
        own_coefficient**2
        + other_coefficient**2
        + 2.0 * own_coefficient * other_coefficient * cosines
    )
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        weight = np.where(pairs, 1.0 / np.maximum(norm2 * norm2.T, np.finfo(float).tiny), 0.0)
    StT = S.T @ T  # [j, i] = s_jᵀ t_i
    h = own_coefficient * np.diagonal(StT)[:, None] + other_coefficient * StT.T  # ‖u‖ uᵀt_i
    factors = [
        [(own_coefficient, "a", ""), (other_coefficient, "", "a")],  # ‖u_ij‖ Qu_ij
        [(own_coefficient, "b", ""), (other_coefficient, "", "b"), (-h, "w", "")],
        [(own_coefficient.T, "", "a"), (other_coefficient.T, "a", "")],  # ‖u_ji‖ Qu_ji
        [(own_coefficient.T, "", "b"), (other_coefficient.T, "b", ""), (-h.T, "", "w")],
    ]
    arrays = {"a": basis @ S, "b": projected_image @ S, "w": test}
    return estimates, _pair_sum(arrays, factors, weight)


def _xdiag_estimates(
    test: np.ndarray, image: np.ndarray, counter: ProductCounter
) -> tuple[np.ndarray, np.ndarray]:
    """The s leave-one-out XDiag estimates d_i (columns of an n × s array) and, per entry,
    the interaction sum Σ_{i≠j} Δ_ij ⊙ Δ_ji for their variance.

    Names as in :class:`spectra.estimators.stochastic_trace._XTraceSketch`: Ω the test
    vectors, Y = AΩ = QR, Z = AQ (one more call, s products), T = ZᵀΩ, and s_i the
    columns of R⁻ᵀ scaled to unit norm, so that span(Y₋ₖ) (the sketch without the
    columns K) has the projector P = Q(I − UUᵀ)Qᵀ with U an orthonormal basis of the
    s_k, k ∈ K. With ω_i independent of P,

        d = diag(PA) + ω_i ⊙ (I − P)Aω_i
          = diag(QZᵀ) + ω_i ⊙ y_i − ω_i ⊙ Qt_i − Σ_{u ∈ U} (Qu) ⊙ (Zu − (uᵀt_i) ω_i)

    is unbiased for diag(A) (E[ω ⊙ Bω] = diag B for Rademacher ω). K = {i}, U = s_i
    gives XDiag's d_i; K = {i, j} adds u = (s_j − c s_i)/sqrt(1 − c²), c = s_iᵀs_j, so
    the leave-two-out difference is Δ_ij = d_i − d_i⁽⁻ʲ⁾ = (Qu) ⊙ (Zu − (uᵀt_i) ω_i).
    O(n s²) host flops and O(n s) memory (the Δ's: :func:`_interaction_plan`). If Y is
    numerically rank deficient, the same definition with the projectors onto the column
    spaces of Y₋K: :func:`_xdiag_rank_deficient`.
    """
    s = test.shape[1]
    basis, triangular = tall_qr(image)
    rank = numerical_rank(triangular, counter.eps)
    if rank < s:
        return _xdiag_rank_deficient(test, image, triangular, basis, rank, counter)
    projected_image = counter.matmat(basis)  # Z = AQ
    T = projected_image.T @ test  # T = ZᵀΩ (= QᵀY = R in exact arithmetic)
    inverse_transpose = solve_triangular(triangular, np.eye(s), trans="T")  # R⁻ᵀ
    S = inverse_transpose / np.linalg.norm(inverse_transpose, axis=0)
    StT = S.T @ T  # [j, i] = s_jᵀ t_i
    own = np.diagonal(StT)  # s_iᵀ t_i
    cosines = S.T @ S
    np.fill_diagonal(cosines, 0.0)  # (the pairs i = j do not enter)
    interaction_plan = _interaction_plan(cosines, StT)
    n = test.shape[0]
    estimates = np.empty((n, s))
    interaction = np.empty(n)
    # Row by row the same arithmetic as on whole columns, in chunks that stay in cache.
    for begin in range(0, n, _PAIR_SUM_ROWS):
        rows = slice(begin, min(begin + _PAIR_SUM_ROWS, n))
        Q, Z, W = basis[rows], projected_image[rows], test[rows]
        QS = Q @ S
        ZS = Z @ S
        base = _row_dots(Q, Z)[:, None] + W * (image[rows] - Q @ T)
        estimates[rows] = base - QS * (ZS - own * W)
        interaction[rows] = interaction_plan.rows({"a": QS, "b": ZS, "w": W})
    return estimates, interaction


def _interaction_plan(cosines: np.ndarray, StT: np.ndarray) -> _PairSum:
    """Σ_{i≠j} Δ_ij ⊙ Δ_ji entry by entry, as a few matrix products (a :class:`_PairSum`
    to apply to rows of a = QS, b = ZS and w = Ω).

    With a = QS (columns Qs_j), b = ZS (Zs_j), w = Ω, c = s_iᵀs_j, σ² = 1 − c² and
    h_ij = s_jᵀt_i − c s_iᵀt_i (``StT[j, i]`` = s_jᵀt_i), entry k of Δ_ij ⊙ Δ_ji is

        (a_j − c a_i)(b_j − c b_i − h_ij w_i)(a_i − c a_j)(b_i − c b_j − h_ji w_j) / σ⁴

    (a_i = a[k, i], ...; ``cosines`` has a zero diagonal). Expanded, each of its 36 terms
    is a coefficient of (i, j) times a product of entries of column i times a product of
    entries of column j, so the sum over pairs of the terms with the same products X (of
    columns i) and Y (of columns j) is Σ_ij X[k, i] C[i, j] Y[k, j] = ((X C) ⊙ Y)[k, :]
    summed: 24 distinct (X, Y), one n × s by s × s product each, O(n s²) flops in BLAS
    (5x faster than s passes over n × s arrays) and O(n s) memory. The diagonal i = j is
    excluded by a zero coefficient.
    """
    s = cosines.shape[0]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        weight = (1.0 - np.eye(s)) / np.maximum(1.0 - cosines**2, np.finfo(float).tiny) ** 2
        h = StT.T - cosines * np.diagonal(StT)[:, None]  # [i, j] = h_ij
        one = np.ones((s, s))
        # Each factor as terms (coefficient [i, j], letters of column i, letters of j).
        factors = [
            [(one, "", "a"), (-cosines, "a", "")],  # a_j − c a_i
            [(one, "", "b"), (-cosines, "b", ""), (-h, "w", "")],  # b_j − c b_i − h_ij w_i
            [(one, "a", ""), (-cosines, "", "a")],  # a_i − c a_j
            [(one, "b", ""), (-cosines, "", "b"), (-h.T, "", "w")],  # b_i − c b_j − h_ji w_j
        ]
    return _PairSum(factors, weight)


class _PairSum:
    """Σ_{i,j} weight[i, j] Π_f (Σ_t coefficient_t[i, j] X_t[k, i] Y_t[k, j]) for rows k.

    ``factors`` lists the factors f, each a list of terms t = (coefficient, letters of
    column i, letters of column j), the letters naming n × s columns of the arrays that
    :meth:`rows` takes (X_t is the product of the named columns i, 1 for ""). Expanded,
    the terms with the same products X (of columns i) and Y (of columns j) sum to
    Σ_ij X[k, i] C[i, j] Y[k, j] = ((X C) ⊙ Y)[k, :] summed: one n × s by s × s product
    per distinct (X, Y), O(n s²) flops in BLAS (see :func:`_interaction_plan`).

    The distinct (X, Y) are cut down here, before any n-sized work: (X, Y) with C and
    (Y, X) with C' are one pair (X, Y) with C + C'ᵀ (Σ_ij Y[k, i] C'[i, j] X[k, j] =
    Σ_ij X[k, j] C'ᵀ[j, i] Y[k, i]); an empty side is a matrix-vector product (1 C is the
    column sums of C); and the pairs that share X multiply one stacked s × (m s) matrix.
    For the XDiag variance that is 9 stacked products and 4 matrix-vector products per
    row instead of 24 products. :meth:`rows` builds each monomial (product of columns)
    from its shorter prefix; callers pass chunks of rows (:func:`_pair_sum`) so that the
    monomials stay in cache and the memory is O(chunk · s) whatever n.
    """

    def __init__(
        self, factors: list[list[tuple[np.ndarray, str, str]]], weight: np.ndarray
    ) -> None:
        self.s = weight.shape[0]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            coefficients: dict[tuple[str, str], np.ndarray] = {}
            for terms in itertools.product(*factors):
                coefficient = weight
                for factor_coefficient, _, _ in terms:
                    coefficient = coefficient * factor_coefficient
                key = (
                    "".join(sorted("".join(term[1] for term in terms))),
                    "".join(sorted("".join(term[2] for term in terms))),
                )
                swapped = (key[1], key[0])
                if swapped != key and swapped in coefficients:
                    coefficients[swapped] = coefficients[swapped] + coefficient.T
                else:
                    coefficients[key] = coefficients.get(key, 0.0) + coefficient
            self.constant = 0.0
            # One side empty: Σ_j (Σ_i C[i, j]) Y[k, j], a matrix-vector product.
            self.vectors: dict[str, np.ndarray] = {}
            paired: dict[str, list[tuple[str, np.ndarray]]] = {}
            for (left, right), coefficient in coefficients.items():
                if not left and not right:
                    self.constant += float(np.sum(coefficient))
                elif not left:
                    self.vectors[right] = self.vectors.get(right, 0.0) + coefficient.sum(axis=0)
                elif not right:
                    self.vectors[left] = self.vectors.get(left, 0.0) + coefficient.sum(axis=1)
                else:
                    paired.setdefault(left, []).append((right, coefficient))
            self.stacked = {
                left: (np.hstack([c for _, c in pairs]), [right for right, _ in pairs])
                for left, pairs in paired.items()
            }

    def rows(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """The sums for the rows of ``arrays`` (each rows × s)."""
        s = self.s
        products: dict[str, np.ndarray] = {}

        def monomial(letters: str) -> np.ndarray:
            if letters not in products:
                if len(letters) == 1:
                    products[letters] = arrays[letters]
                else:
                    products[letters] = monomial(letters[:-1]) * arrays[letters[-1]]
            return products[letters]

        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            total = np.full(next(iter(arrays.values())).shape[0], self.constant)
            for letters, vector in self.vectors.items():
                total += monomial(letters) @ vector
            for left, (matrix, rights) in self.stacked.items():
                image = monomial(left) @ matrix
                for index, right in enumerate(rights):
                    total += _row_dots(image[:, index * s : (index + 1) * s], monomial(right))
        return total


def _pair_sum(
    arrays: dict[str, np.ndarray],
    factors: list[list[tuple[np.ndarray, str, str]]],
    weight: np.ndarray,
) -> np.ndarray:
    """:class:`_PairSum` of ``factors`` and ``weight`` on whole n × s ``arrays``, in chunks
    of :data:`_PAIR_SUM_ROWS` rows."""
    plan = _PairSum(factors, weight)
    n = next(iter(arrays.values())).shape[0]
    total = np.empty(n)
    for begin in range(0, n, _PAIR_SUM_ROWS):
        rows = slice(begin, min(begin + _PAIR_SUM_ROWS, n))
        total[rows] = plan.rows({letter: array[rows] for letter, array in arrays.items()})
    return total


def xdiag(
    op: Any,
    num_products: int = 100,
    seed: SeedLike = 0,
    progress: bool | None = None,
    check_symmetry: bool = True,
) -> DiagonalResult:
    """XDiag: exchangeable leave-one-out estimate of diag(A) with per-entry error bars.

    Draws s = min(num_products // 2, n) Rademacher test vectors ω_i, forms Y = AΩ = QR
    (one call, s products) and AQ (one call, s products). For each i, the projector P_i
    onto the span of the other s − 1 columns of Y gives diag(P_i A) exactly, and ω_i,
    independent of P_i, estimates the diagonal of the remainder: d_i = diag(P_i A) +
    ω_i ⊙ (I − P_i)Aω_i, unbiased. The estimate is the mean d̄ of the s d_i (Epperly,
    Tropp & Webber, SIAM J. Matrix Anal. Appl. 45, 2024, XDiag; formulas in
    :func:`_xdiag_estimates`). If rank A < s it is exact to rounding (the second call
    then multiplies only rank(AΩ) columns: :func:`_xdiag_rank_deficient`; see below for
    its error bar). Against
    :func:`diagonal` at equal products (100, on 200 × 200 matrices) its root-mean-square
    error was 4x smaller for a 1/i spectrum, 180x smaller for 1/i², 120x smaller for rank
    10 plus noise, and 2.2x larger for a flat spectrum (nothing to sketch, and each test
    vector enters the residual estimate once for two products):
    use it when the spectrum decays, as a Hessian's does.

    Error bar, per entry, as for :func:`spectra.xtrace`: the d_i share their sketches, so
    the spread of the d_i underestimates the error; the leave-two-out differences Δ_ij =
    d_i − d_i⁽⁻ʲ⁾ (ω_j also left out of the sketch) give E[e_i e_j] = E[Δ_ij ⊙ Δ_ji] for
    e_i = d_i − diag A, hence the unbiased variance estimate

        stderr² = (Σ_i (d_i − d̄)² + Σ_{i≠j} Δ_ij ⊙ Δ_ji) / (s (s − 1))

    entry by entry (where it comes out negative or not finite, the first sum alone).
    Over 200 seeds × all 200 entries of matrices with flat, decaying and
    low-rank-plus-noise spectra at m = 100 (tests/truths/test_calibration.py) the ±1 and
    ±2 stderr intervals covered a_ii in 68% and 95% of the cases and E[stderr²]/E[error²]
    was 1.00 (0.55 without the Δ term).

    When AΩ is numerically rank deficient (rank A < s, or the test vectors are singular:
    Rademacher vectors in small dimensions, two equal or opposite columns), d_i and
    d_i⁽⁻ʲ⁾ use the projectors onto the column spaces of AΩ without ω_i and without ω_i,
    ω_j (:func:`_xdiag_rank_deficient`), and the error bar is the same estimate: for each
    entry, an estimate of the standard deviation of d̄ over the test vectors, unbiased in
    its square (E[stderr²] = E[error²] up to the fallback above), not a bound. On a 5 × 5
    SPD matrix with s = 5 (AΩ singular in two runs of three), over 2000 seeds × 5 entries,
    ±1 and ±2 stderr covered 68.5% and 89.6% (52% and 79% when the Δ term was left out
    there); with so few test vectors the variance estimate has few degrees of freedom
    (P(−2 ≤ t₄ ≤ 2) = 88% for a Student t with 4 degrees of freedom), and runs where AΩ
    has rank 3 or less cover less (59%/79%). If
    rank A = s − 1 exactly, every d_i is exact but the Δ term, an unbiased estimate of a
    zero variance, is positive on some entries: a conservative bar there. If rank A < s − 1
    (generic vectors) the estimate is exact and the stderr zero to rounding.

    Cost: num_products products (2s) in two ``matmat`` calls; O(n s) host memory and
    O(n s² + s³) host flops. The symmetry check uses the products (no extra one).
    Products far from 1 are scaled by a power of two (exact), so operators from 1e-300
    to 1e300 give the same relative accuracy. Needs num_products >= 4.

    Parameters
    ----------
    op
        symmetric LinearOperator or dense array, n × n.
    num_products
        budget of products, at least 4 (2s with s test vectors).
    seed
        seed of the test vectors (an int, a ``numpy.random.Generator`` or None).
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s (none when stderr is
        not a terminal); True: a bar at once, terminal or not; False: no bar.
    check_symmetry
        check A = Aᵀ on the products (free).

    Returns
    -------
    DiagonalResult
        ``estimate`` and ``stderr`` (length n); ``settings["method"]`` is "xdiag".

    Raises
    ------
    TypeError, ValueError
        for a bad argument or a non-symmetric or non-finite operator.
    """
    started = time.perf_counter()
    num_products = check_int("num_products", num_products, minimum=4)
    run = start_estimator(op, "diagonal (xdiag)", seed, check_symmetry, progress, started)
    counter = run.counter
    n = counter.n
    s = min(num_products // 2, n)
    test = rademacher_vectors(run.rng, (n, s))
    estimates, interaction = exchangeable_estimates(run, test, "diagonal (xdiag)", _xdiag_estimates)
    mean = estimates.mean(axis=1)
    if s > 1:
        spread = np.sum((estimates - mean[:, None]) ** 2, axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            variance = (spread + interaction) / (s * (s - 1))
        fallback = ~(variance > 0) | ~np.isfinite(variance)
        variance[fallback] = spread[fallback] / (s * (s - 1))
        stderr = np.sqrt(variance)
    else:
        stderr = np.full(n, math.nan)
    return DiagonalResult(
        estimate=counter.unscale(mean, "the diagonal estimate"),
        stderr=counter.unscale(stderr, "the diagonal's standard error"),
        **run.result_fields(method="xdiag", num_products=num_products, num_test_vectors=s),
    )
