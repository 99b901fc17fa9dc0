"""Stochastic trace and Frobenius-norm estimation from operator products.

* Hutchinson (1989): ``tr(A) ≈ (1/m) Σ z_iᵀ A z_i`` with Rademacher z_i;
  variance ``2(‖A‖_F² − Σ a_ii²)/m``, so the error falls like 1/sqrt(m).
* Hutch++ (Meyer, Musco, Musco & Woodruff, SOSA 2021): spend a third of the
  products on a sketch Q = orth(A S), take ``tr(QᵀAQ)`` exactly and apply
  Hutchinson to the deflated ``(I − QQᵀ) A (I − QQᵀ)``; error O(1/m) for
  matrices with decaying spectra (e.g. Hessians).
* XTrace (Epperly, Tropp & Webber, SIMAX 2024): an exchangeable estimator that
  uses every test vector both for the low-rank sketch and for the residual
  trace, by leaving each vector out in turn.

Every ``stderr`` is calibrated. Over 1000 seeds at 100 products on 200 × 200 matrices
with flat, decaying (1/i) and low-rank-plus-noise spectra, (estimate − tr A)/stderr fell
within ±1 in 66–68% (Hutchinson), 66–68% (Hutch++), 67–68% (XTrace) of the runs and
within ±2 in 95–96%, 93–95%, 93–95%; the Frobenius norm's in 68–70% and 95–96%
(tests/truths/test_calibration.py checks the bands 60–76% and 90–98%). Fewer probes widen the
tails (a Student t with m − 1 degrees of freedom for Hutchinson).

Cost, for a budget of m products: Hutchinson multiplies its probes in blocks of 16 per
``matmat`` call (one data pass of a Hessian each; with ``rtol`` it stops early, never
before 3 blocks); Hutch++ spends m/3 products on the sketch A S (one call), m/3 on A Q
in one call with the first block of the remaining deflated probes, then blocks of the
rest, with O(n m) host memory; XTrace
spends m/2 on Y = AΩ and m/2 on A Q, two calls in all, with O(n m) host memory and
O(n m² + m³) host flops (:func:`xtrace`). The Frobenius norm ‖A‖_F² = E‖Az‖² costs
one product per probe, in blocks like Hutchinson's.

The estimators work on products scaled by a power of two when they are far from 1
(exact; see ``spectra.estimators._products.ProductCounter``) and scale their results back,
so an operator scaled by s from 1e-300 to 1e300 gives s times the estimate and the
standard error at scale 1 (same seed), and a result float64 cannot hold is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
from scipy.linalg import solve_triangular

from spectra._validation import check_choice, check_float, check_int
from spectra.estimators._preamble import EstimatorRun, check_block_size, start_estimator
from spectra.estimators._products import (
    ProductCounter,
    ProductProgress,
    RunningMoments,
    SeedLike,
    one_blas_thread,
    rademacher_vectors,
    tall_qr,
)
from spectra.estimators.results import FrobeniusResult, TraceResult

__all__ = ["frobenius_norm", "hutchinson_trace", "hutchpp_trace", "trace", "xtrace"]

_METHODS = ("hutchinson", "hutch++", "xtrace")
# What XTrace's and XDiag's leave-one-out algebra returns (see exchangeable_estimates).
_Estimates = TypeVar("_Estimates")
# With rtol, the stopping rule is checked only after this many blocks (and at
# least this many samples), so that the sample standard error is not itself
# too noisy to trust.
_MIN_BLOCKS = 3
_MIN_SAMPLES = 10


def _check_rtol(rtol: Any) -> float | None:
    return None if rtol is None else check_float("rtol", rtol)


def adaptive_mean(
    draw_block: Callable[[int], np.ndarray],
    budget: int,
    block_size: int,
    rtol: float | None,
    offset: float,
    bar: ProductProgress,
    shape: tuple[int, ...] = (),
) -> tuple[RunningMoments, str]:
    """Average samples from ``draw_block(width)`` (``width`` samples of ``shape`` stacked
    along axis 0) until ``budget`` samples are drawn or, with ``rtol`` (scalar samples),
    until ``stderr <= rtol·|offset + mean|`` (after a few blocks). Returns the running
    moments and why it stopped ("rtol" or "budget")."""
    moments = RunningMoments(shape)
    blocks = 0
    while moments.count < budget:
        width = min(block_size, budget - moments.count)
        moments.update(draw_block(width))
        blocks += 1
        bar.update()
        if (
            rtol is not None
            and blocks >= _MIN_BLOCKS
            and moments.count >= _MIN_SAMPLES
            and float(moments.stderr()) <= rtol * abs(offset + float(moments.mean))
        ):
            return moments, "rtol"
    return moments, "budget"


def _trace_result(
    run: EstimatorRun, method: str, estimate: float, stderr: float, stopped: str, **settings: Any
) -> TraceResult:
    """A :class:`TraceResult` from the estimate and its standard error in the counter's
    scaled units (multiplied back here: exact, or a ``ValueError`` if float64 cannot hold
    them), with the counts, timing and settings every trace method reports."""
    counter = run.counter
    return TraceResult(
        estimate=float(counter.unscale(estimate, "the trace estimate")),
        stderr=float(counter.unscale(stderr, "the trace's standard error")),
        method=method,
        stopped=stopped,
        **run.result_fields(**settings),
    )


def hutchinson_trace(
    op: Any,
    num_products: int = 100,
    rtol: float | None = None,
    block_size: int | None = None,
    seed: SeedLike = 0,
    progress: bool | None = None,
    check_symmetry: bool = True,
) -> TraceResult:
    """Hutchinson's estimator ``tr(A) ≈ mean_i z_iᵀ A z_i`` with Rademacher z_i.

    Probes are drawn in blocks of ``block_size`` (default min(16, num_products))
    and multiplied with one ``matmat`` per block. ``stderr`` is the sample
    standard deviation of ``z_iᵀ A z_i`` (divisor m − 1) over sqrt(m): the
    estimate is a mean of m independent samples, so its standardized error is close
    to a Student t with m − 1 degrees of freedom (calibration: see the module
    docstring). With ``rtol``, blocks are drawn until ``stderr <= rtol·|estimate|``
    (checked from the third block on, with at least 10 samples) or the budget of
    ``num_products`` ends; ``stopped`` records which (a data-dependent stop makes
    the error bar slightly optimistic). Cost: at most num_products products in
    ceil(num_products / block_size) calls; the symmetry check uses them (no extra
    product). Reference: Hutchinson, Comm. Stat. Simul. Comput. 18 (1989).

    Parameters
    ----------
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s (none when stderr is
        not a terminal); True: a bar at once, terminal or not; False: no bar.
    """
    started = time.perf_counter()
    num_products = check_int("num_products", num_products, minimum=2)
    rtol = _check_rtol(rtol)
    block_size = check_block_size(block_size, num_products)
    run = start_estimator(op, "trace (hutchinson)", seed, check_symmetry, progress, started)
    rng, counter = run.rng, run.counter

    def draw(width: int) -> np.ndarray:
        probes = rademacher_vectors(rng, (counter.n, width))
        return np.einsum("ij,ij->j", probes, counter.matmat(probes))

    with run.products(num_products, "trace (hutchinson)") as bar:
        moments, stopped = adaptive_mean(draw, num_products, block_size, rtol, 0.0, bar)
    return _trace_result(
        run,
        "hutchinson",
        float(moments.mean),
        float(moments.stderr()),
        stopped,
        num_products=num_products,
        rtol=rtol,
        block_size=block_size,
        num_probes=moments.count,
    )


def hutchpp_trace(
    op: Any,
    num_products: int = 100,
    rtol: float | None = None,
    block_size: int | None = None,
    seed: SeedLike = 0,
    progress: bool | None = None,
    check_symmetry: bool = True,
) -> TraceResult:
    """Hutch++: exact trace on a sketched range plus Hutchinson on the rest.

    With s = min(num_products // 3, n) Rademacher columns S: Q = orth(A S) (s products,
    one call), then ``tr(A) ≈ tr(QᵀAQ) + mean_i g_iᵀ(I−QQᵀ)A(I−QQᵀ)g_i`` with the
    remaining num_products − 2s Rademacher probes g_i. The products A Q and the
    first block of deflated probes share one ``matmat``. Given Q the sketched part is
    exact and the probes g_i are independent of Q, so the estimate is unbiased and
    ``stderr`` — the standard error of the Hutchinson part over its independent
    probes — is its honest error bar (calibrated as stated in the module docstring).
    With ``rtol``, the Hutchinson part stops early once ``stderr <= rtol·|estimate|``.
    Needs num_products >= 4. Reference: Meyer, Musco, Musco & Woodruff, "Hutch++:
    Optimal stochastic trace estimation", SOSA 2021.

    Parameters
    ----------
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s (none when stderr is
        not a terminal); True: a bar at once, terminal or not; False: no bar.
    """
    started = time.perf_counter()
    num_products = check_int("num_products", num_products, minimum=4)
    rtol = _check_rtol(rtol)
    if block_size is not None:
        block_size = check_int("block_size", block_size)
    run = start_estimator(op, "trace (hutch++)", seed, check_symmetry, progress, started)
    rng, counter = run.rng, run.counter
    n = counter.n
    sketch_size = min(num_products // 3, n)
    remaining = num_products - 2 * sketch_size
    block_size = check_block_size(block_size, remaining)

    with one_blas_thread(), run.products(num_products, "trace (hutch++)") as bar:
        sketch = counter.matmat(rademacher_vectors(rng, (n, sketch_size)))
        bar.update()
        basis, _ = tall_qr(sketch)
        rank = basis.shape[1]
        first_width = min(block_size, remaining)
        first_probes = rademacher_vectors(rng, (n, first_width))
        first_probes -= basis @ (basis.T @ first_probes)
        images = counter.matmat(np.hstack([basis, first_probes]))
        bar.update()
        exact_part = float(np.einsum("ij,ij->", basis, images[:, :rank]))
        pending = [np.einsum("ij,ij->j", first_probes, images[:, rank:])]

        def draw(width: int) -> np.ndarray:
            if pending:
                return pending.pop()
            probes = rademacher_vectors(rng, (n, width))
            probes -= basis @ (basis.T @ probes)
            return np.einsum("ij,ij->j", probes, counter.matmat(probes))

        moments, stopped = adaptive_mean(draw, remaining, first_width, rtol, exact_part, bar)
    return _trace_result(
        run,
        "hutch++",
        exact_part + float(moments.mean),
        float(moments.stderr()),
        stopped,
        num_products=num_products,
        rtol=rtol,
        block_size=first_width,
        sketch_size=sketch_size,
        num_probes=moments.count,
    )


class _XTraceSketch(NamedTuple):
    """The inner products XTrace reads its leave-one-out and leave-two-out estimates from.

    The letters are those of Epperly, Tropp & Webber (2024) and their reference code:
    Ω = [ω₁ … ω_s] the test vectors, Y = AΩ = QR (thin QR), H = QᵀAQ, W = QᵀΩ =
    [w₁ … w_s] the test vectors' coordinates in the sketch, S = [s₁ … s_s] the columns
    of R⁻ᵀ scaled to unit norm (s_i spans what leaving ω_i out removes from span(Y));
    r_i and y_i are the columns of R and Y (Qᵀy_i = r_i). When Y has numerical rank
    r < s, Q has r columns, R = QᵀY is r × s and S holds the columns of the
    pseudo-inverse's transpose (see :func:`_xtrace_rank_deficient`). The fields hold the products
    among them, named by their letters (``WtHS`` = WᵀHS); matrices are indexed [i, j],
    vectors by i.
    """

    n: int  # dimension of A
    rank: int  # dim span(Y), the number of columns of Q (s when Y has full rank)
    trace_H: float  # tr H, the trace of A on span(Y)
    StHS: np.ndarray  # [i, j] = s_iᵀ H s_j
    WtHS: np.ndarray  # [i, j] = w_iᵀ H s_j
    RtS: np.ndarray  # [i, j] = r_iᵀ s_j
    WtS: np.ndarray  # [i, j] = w_iᵀ s_j
    StS: np.ndarray  # [i, j] = s_iᵀ s_j, the cosine between s_i and s_j; 0 on the diagonal
    wHw: np.ndarray  # w_iᵀ H w_i
    ww: np.ndarray  # ‖w_i‖²
    omega_omega: np.ndarray  # ‖ω_i‖²
    omega_y: np.ndarray  # ω_iᵀ y_i
    rw: np.ndarray  # r_iᵀ w_i

    @property
    def s(self) -> int:
        """The number of test vectors."""
        return self.StHS.shape[0]

    def diagonal(self, matrix: np.ndarray) -> np.ndarray:
        """[i, i] of one of the matrices."""
        indices = np.arange(self.s)
        return matrix[indices, indices]


def numerical_rank(triangular: np.ndarray, eps: float) -> int:
    """Numerical rank of R (hence of Y = QR): singular values above
    10·max(s, 10)·eps·σ₁, with eps the products' precision."""
    columns = triangular.shape[1]
    singular = np.linalg.svd(triangular, compute_uv=False)
    threshold = 10.0 * max(columns, 10) * eps * (singular[0] if singular.size else 0.0)
    return int(np.sum(singular > threshold))


def _xtrace_sketch(
    test: np.ndarray,
    image: np.ndarray,
    basis: np.ndarray,
    triangular: np.ndarray,
    counter: ProductCounter,
) -> _XTraceSketch:
    """The products of :class:`_XTraceSketch` from Ω, Y = QR (R invertible) and one
    ``matmat`` A Q (s products); O(n s² + s³) host flops."""
    s = test.shape[1]
    inverse_transpose = solve_triangular(triangular, np.eye(s), trans="T")  # R⁻ᵀ
    S = inverse_transpose / np.linalg.norm(inverse_transpose, axis=0)
    return _sketch_products(test, image, basis, triangular, S, s, counter)


def _sketch_products(
    test: np.ndarray,
    image: np.ndarray,
    basis: np.ndarray,
    coordinates: np.ndarray,
    S: np.ndarray,
    rank: int,
    counter: ProductCounter,
) -> _XTraceSketch:
    """:class:`_XTraceSketch` from Ω, Y, the orthonormal Q (n × r), R = QᵀY (r × s) and
    the unit (or zero) directions S (r × s), with one ``matmat`` A Q (r products)."""
    n = test.shape[0]
    H = basis.T @ counter.matmat(basis)
    H = 0.5 * (H + H.T)
    W = basis.T @ test
    StS = S.T @ S
    np.fill_diagonal(StS, 0.0)
    HS = H @ S
    return _XTraceSketch(
        n=n,
        rank=rank,
        trace_H=float(np.trace(H)),
        StHS=S.T @ HS,
        WtHS=W.T @ HS,
        RtS=coordinates.T @ S,
        WtS=W.T @ S,
        StS=StS,
        wHw=np.einsum("ij,ij->j", W, H @ W),
        ww=np.einsum("ij,ij->j", W, W),
        omega_omega=np.einsum("ij,ij->j", test, test),
        omega_y=np.einsum("ij,ij->j", test, image),
        rw=np.einsum("ij,ij->j", coordinates, W),
    )


def _residual_term(
    sketch: _XTraceSketch,
    removed: int,
    omega_omega: np.ndarray,
    omega_y: np.ndarray,
    vv: np.ndarray,
    rv: np.ndarray,
    vHv: np.ndarray,
) -> np.ndarray:
    """γ (ω_iᵀy_i − 2 r_iᵀv + vᵀHv): the trace of the deflated remainder estimated with
    ω_i, for v = (I − UUᵀ)w_i after ``removed`` = dim U directions are taken out of
    span(Y) (|K| when Y has full rank), with γ = (n − rank P)/‖(I − P)ω_i‖²,
    rank P = r − dim U, and ‖(I − P)ω_i‖² = ‖ω_i‖² − ‖v‖²."""
    deflated_norms = omega_omega - vv
    tiny = np.finfo(float).tiny
    scale = (sketch.n - sketch.rank + removed) / np.maximum(deflated_norms, tiny)
    return scale * (omega_y - 2.0 * rv + vHv)


def _leave_one_out(sketch: _XTraceSketch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The XTrace estimates t_i (K = {i}, U = s_i, v = w_i − (s_iᵀw_i) s_i), with the
    ‖v‖² and r_iᵀv that the leave-two-out estimates start from."""
    ws = sketch.diagonal(sketch.WtS)  # s_iᵀ w_i
    sHs = sketch.diagonal(sketch.StHS)  # s_iᵀ H s_i
    vv = sketch.ww - ws**2
    rv = sketch.rw - ws * sketch.diagonal(sketch.RtS)
    vHv = sketch.wHw - 2 * ws * sketch.diagonal(sketch.WtHS) + ws**2 * sHs
    residual = _residual_term(sketch, 1, sketch.omega_omega, sketch.omega_y, vv, rv, vHv)
    return sketch.trace_H - sHs + residual, vv, rv


def _leave_two_out(sketch: _XTraceSketch, vv: np.ndarray, rv: np.ndarray) -> np.ndarray:
    """[i, j] = t_i⁽⁻ʲ⁾, the estimate from ω_i with both ω_i and ω_j left out of the
    sketch: K = {i, j}, U = [s_i, u] with u = (s_j − c s_i)/sqrt(1 − c²) and
    c = s_iᵀs_j; v = (I − UUᵀ)w_i. Diagonal entries are meaningless (c = 0 there)."""
    ws = sketch.diagonal(sketch.WtS)[:, None]  # s_iᵀ w_i
    sHs = sketch.diagonal(sketch.StHS)  # s_iᵀ H s_i
    rs = sketch.diagonal(sketch.RtS)[:, None]  # r_iᵀ s_i
    wHs = sketch.diagonal(sketch.WtHS)[:, None]  # w_iᵀ H s_i
    cosine = sketch.StS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        sine = np.sqrt(np.maximum(1.0 - cosine**2, np.finfo(float).tiny))
        uw = (sketch.WtS - cosine * ws) / sine  # uᵀw_i
        uHu = (sHs[None, :] - 2 * cosine * sketch.StHS + cosine**2 * sHs[:, None]) / sine**2
        ru = (sketch.RtS - cosine * rs) / sine  # r_iᵀu
        wHu = (sketch.WtHS - cosine * wHs) / sine  # w_iᵀHu
        sHu = (sketch.StHS - cosine * sHs[:, None]) / sine  # s_iᵀHu
        vHv = (
            sketch.wHw[:, None]
            + ws**2 * sHs[:, None]
            + uw**2 * uHu
            - 2 * ws * wHs
            - 2 * uw * wHu
            + 2 * ws * uw * sHu
        )
        residual = _residual_term(
            sketch,
            2,
            sketch.omega_omega[:, None],
            sketch.omega_y[:, None],
            vv[:, None] - uw**2,
            rv[:, None] - uw * ru,
            vHv,
        )
        return sketch.trace_H - sHs[:, None] - uHu + residual


def _one_direction_out(
    sketch: _XTraceSketch, own: np.ndarray | float, other: np.ndarray | float
) -> np.ndarray:
    """[i, j] = the estimate from ω_i with one direction u ∝ own·s_i + other·s_j (the
    coefficients ``own`` and ``other`` are s × s arrays or scalars) taken out of
    span(Y): U = u/‖u‖, ‖u‖² = own² + other² + 2·own·other·s_iᵀs_j, v = (I − UUᵀ)w_i."""
    ws = sketch.diagonal(sketch.WtS)[:, None]  # s_iᵀ w_i
    sHs = sketch.diagonal(sketch.StHS)  # s_iᵀ H s_i
    rs = sketch.diagonal(sketch.RtS)[:, None]  # r_iᵀ s_i
    wHs = sketch.diagonal(sketch.WtHS)[:, None]  # w_iᵀ H s_i
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        norm2 = np.maximum(own**2 + other**2 + 2 * own * other * sketch.StS, np.finfo(float).tiny)
        norm = np.sqrt(norm2)
        uw = (own * ws + other * sketch.WtS) / norm  # uᵀw_i
        uHu = own**2 * sHs[:, None] + other**2 * sHs[None, :] + 2 * own * other * sketch.StHS
        uHu = uHu / norm2
        ru = (own * rs + other * sketch.RtS) / norm  # r_iᵀu
        wHu = (own * wHs + other * sketch.WtHS) / norm  # w_iᵀHu
        vHv = sketch.wHw[:, None] - 2 * uw * wHu + uw**2 * uHu
        residual = _residual_term(
            sketch,
            1,
            sketch.omega_omega[:, None],
            sketch.omega_y[:, None],
            sketch.ww[:, None] - uw**2,
            sketch.rw[:, None] - uw * ru,
            vHv,
        )
        return sketch.trace_H - uHu + residual


# A row of the sketch's null-space basis N (rows of norm in [0, 1]) at most this long is
# zero, and two rows whose directions differ by at most this much are parallel: these
# decide which columns of Y span directions no other column gives (exact integer
# dependencies among Rademacher vectors leave rows ~1e-16·cond(R) from the decision,
# genuine directions leave them O(1/sqrt(s)) away).
SPAN_TOL = 1e-8


class _SketchSpan(NamedTuple):
    """What leaving test vectors out of a numerically rank-deficient sketch Y = QR does to
    span(Y) (see :func:`_xtrace_rank_deficient`): R = UΣVᵀ, V = [V_r N]."""

    basis: np.ndarray  # QU_r, n × r: an orthonormal basis of span(Y)
    coordinates: np.ndarray  # C = U_rᵀR = (QU_r)ᵀY, r × s
    S: np.ndarray  # r × s, the columns g_k of Σ⁻¹V_rᵀ scaled to unit norm (0 where g_k = 0)
    lengths: np.ndarray  # ‖g_k‖
    null: np.ndarray  # N, s × (s − r): a basis of the null space of C
    row_norms: np.ndarray  # ‖n_k‖, the rows of N
    needed: np.ndarray  # n_k = 0: leaving ω_k out removes the direction s_k from span(Y)


def sketch_span(basis: np.ndarray, triangular: np.ndarray, rank: int) -> _SketchSpan:
    """:class:`_SketchSpan` of Y = QR with numerical rank ``rank``: one SVD of R (s × s)
    and O(n s r) flops for QU_r. Leaving ω_i alone out of Y removes s_i from span(Y) if
    ``needed[i]`` and nothing otherwise."""
    left, singular, right_t = np.linalg.svd(triangular)
    raw = right_t[:rank] / singular[:rank, None]  # columns g_k of Σ⁻¹V_rᵀ
    lengths = np.linalg.norm(raw, axis=0)  # ‖g_k‖ (0 when y_k = 0)
    null = right_t[rank:].T
    row_norms = np.linalg.norm(null, axis=1)
    return _SketchSpan(
        basis=basis @ left[:, :rank],
        coordinates=left[:, :rank].T @ triangular,
        S=raw / np.where(lengths > 0, lengths, 1.0),
        lengths=lengths,
        null=null,
        row_norms=row_norms,
        needed=row_norms <= SPAN_TOL,
    )


def _xtrace_rank_deficient(
    test: np.ndarray,
    image: np.ndarray,
    basis: np.ndarray,
    triangular: np.ndarray,
    rank: int,
    counter: ProductCounter,
) -> tuple[np.ndarray, float]:
    """XTrace's t_i and interaction sum when Y = AΩ has numerical rank r < s, whatever
    the cause: rank A < s, Ω singular (two equal or opposite Rademacher columns, or any
    other dependency, likely at small n), or both.

    The definition is unchanged: P_K is the orthogonal projector onto span(Y₋K) (the
    columns K of Y left out), of rank r_K, and

        t = tr(P_K A) + γ ((I − P_K)ω_i)ᵀ A (I − P_K)ω_i,   γ = (n − r_K)/‖(I − P_K)ω_i‖²,

    K = {i} for t_i and {i, j} for t_i⁽⁻ʲ⁾. Since ω_i is independent of P_K the estimate
    is unbiased for sphere vectors (the deflated direction is uniform in range(I − P_K))
    and, for Rademacher vectors, as nearly so as the full-rank path's (see
    :func:`_xtrace_estimates`). When Y has full rank, r_K = s − |K|: the full-rank path's
    γ = (n − s + |K|)/‖·‖².

    Computing P_K stably. R = QᵀY = UΣVᵀ (SVD); Q ← QU_r and C = U_rᵀR (r × s) keep the
    r singular values above the rank threshold; V = [V_r N], N (s × (s − r)) a basis of
    the null space of C, with rows n_k. By rank(C₋K) = r − |K| + rank(N_K) (N_K the rows
    K of N), leaving K out removes from span(C) the space {Σ⁻¹V_rᵀx : x = Σ_{k∈K} a_k e_k
    with Σ_{k∈K} a_k n_k = 0} (x in the row space of C, supported on K), in terms of the
    columns g_k = Σ⁻¹V_rᵀe_k of (C⁺)ᵀ, s_k = g_k/‖g_k‖:

    * K = {i}: s_i if n_i = 0 (column i is needed to span C), nothing otherwise
      (span(Y₋ᵢ) = span(Y): the usual case when rank A < s, exact to rounding);
    * K = {i, j}: span(s_i, s_j) if n_i = n_j = 0; s_i or s_j if only that row is 0;
      if neither is 0, nothing when n_i and n_j are independent and the one direction
      ‖n_j‖g_i − σ‖n_i‖g_j (σ = sign n_iᵀn_j) when they are parallel (for example
      ω_i = ±ω_j with A invertible).

    With U the removed directions P_K = Q(I − UUᵀ)Qᵀ, and t is the formula of
    :func:`_xtrace_estimates` with r for s in γ. The variance's Σ_{i≠j} Δ_ij Δ_ji is then
    as in :func:`xtrace`; a pair where only one of n_i, n_j is 0 contributes 0 (if n_i ≠ 0
    = n_j, leaving ω_i out of Y₋ⱼ changes nothing: t_j⁽⁻ⁱ⁾ = t_j). Zero and parallel are
    decided at ``SPAN_TOL`` (rows of N have norms in [0, 1]). Costs one ``matmat`` (A Q,
    r products), one SVD of R and O(n s r + s²(s − r) + s³) host flops.
    """
    span = sketch_span(basis, triangular, rank)
    sketch = _sketch_products(test, image, span.basis, span.coordinates, span.S, rank, counter)
    null, row_norms, lengths, needed = span.null, span.row_norms, span.lengths, span.needed

    one, vv, rv = _leave_one_out(sketch)  # s_i removed
    kept = sketch.trace_H + _residual_term(
        sketch, 0, sketch.omega_omega, sketch.omega_y, sketch.ww, sketch.rw, sketch.wHw
    )  # nothing removed
    estimates = np.where(needed, one, kept)

    # Pairs of rows n_i, n_j, both nonzero: parallel or independent.
    unit_rows = null / np.where(needed, 1.0, row_norms)[:, None]
    cosines = unit_rows @ unit_rows.T
    parallel = np.zeros((test.shape[1],) * 2, dtype=bool)
    for i in np.flatnonzero(~needed):
        rejected = unit_rows - cosines[:, i : i + 1] * unit_rows[i]
        parallel[i] = np.linalg.norm(rejected, axis=1) <= SPAN_TOL
    parallel &= ~needed[:, None] & ~needed[None, :]
    sign = np.where(cosines < 0, -1.0, 1.0)
    own = np.where(parallel, row_norms[None, :] * lengths[:, None], 1.0)
    other = np.where(parallel, -sign * row_norms[:, None] * lengths[None, :], 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        one_out = _one_direction_out(sketch, own, other)
        two_out = _leave_two_out(sketch, vv, rv)
    both = needed[:, None] & needed[None, :]
    # Where only n_j is 0, t_i⁽⁻ʲ⁾ ≠ t_i but t_j⁽⁻ⁱ⁾ = t_j: Δ_ij Δ_ji = 0, left at t_i.
    leave_two = np.where(both, two_out, np.where(parallel, one_out, estimates[:, None]))
    return estimates, _interaction(estimates, leave_two)


def _interaction(estimates: np.ndarray, leave_two: np.ndarray) -> float:
    """Σ_{i≠j} Δ_ij Δ_ji with Δ_ij = t_i − t_i⁽⁻ʲ⁾ (``leave_two[i, j]`` = t_i⁽⁻ʲ⁾); 0 if
    it is not finite."""
    with np.errstate(invalid="ignore", over="ignore"):
        differences = estimates[:, None] - leave_two
    np.fill_diagonal(differences, 0.0)
    interaction = float(np.sum(differences * differences.T))
    if not math.isfinite(interaction):
        interaction = 0.0
    return interaction


def _xtrace_estimates(
    test: np.ndarray, image: np.ndarray, counter: ProductCounter
) -> tuple[np.ndarray, float]:
    """The s leave-one-out XTrace estimates t_i and the interaction sum for their variance.

    Names as in Epperly, Tropp & Webber (2024; see :class:`_XTraceSketch`). Y = AΩ = QR.
    Leaving the columns K out of Y, span(Y₋K) has the projector ``Q(I − U Uᵀ)Qᵀ`` with U
    an orthonormal basis of the columns K of R⁻ᵀ. With W = QᵀΩ, H = QᵀAQ,
    v = (I − UUᵀ)wᵢ (so (I − P)ωᵢ = ωᵢ − Qv) and A symmetric:

        t = tr H − tr(UᵀHU) + γ (ωᵢᵀyᵢ − 2 rᵢᵀv + vᵀHv),

    using Qᵀyᵢ = rᵢ (column i of R). The deflated probe is rescaled to the dimension
    of the space it lives in (the paper's "improved" estimator):
    γ = (n − s + |K|)/‖(I − P)ωᵢ‖², ‖(I − P)ωᵢ‖² = ‖ωᵢ‖² − ‖v‖². For sphere test
    vectors that keeps each t exactly unbiased (the deflated direction is uniform in
    the complement); for Rademacher vectors it is not exact, but over 1000 seeds on
    flat, decaying, low-rank and diagonally dominant matrices its bias stayed below
    the resolution (1.5 standard errors of the mean) while its error was up to 3x
    smaller than with γ = 1.

    K = {i} gives the XTrace estimates tᵢ (:func:`_leave_one_out`); K = {i, j} the
    leave-two-out estimates tᵢ⁽⁻ʲ⁾ (:func:`_leave_two_out`), whose differences
    Δᵢⱼ = tᵢ − tᵢ⁽⁻ʲ⁾ measure how tᵢ depends on ωⱼ through the sketch. Returns
    (t, Σ_{i≠j} ΔᵢⱼΔⱼᵢ): see :func:`xtrace` for the variance. Costs one more
    ``matmat`` (A Q, s products) and O(n s² + s³) host flops.

    If Y is numerically rank deficient (rank A < s, or Ω singular), the same definition
    with the projectors onto the column spaces: :func:`_xtrace_rank_deficient`.
    """
    basis, triangular = tall_qr(image)
    rank = numerical_rank(triangular, counter.eps)
    if rank < test.shape[1]:
        return _xtrace_rank_deficient(test, image, basis, triangular, rank, counter)
    sketch = _xtrace_sketch(test, image, basis, triangular, counter)
    estimates, vv, rv = _leave_one_out(sketch)
    with np.errstate(invalid="ignore", over="ignore"):
        leave_two = _leave_two_out(sketch, vv, rv)
    return estimates, _interaction(estimates, leave_two)


def exchangeable_estimates(
    run: EstimatorRun,
    test: np.ndarray,
    desc: str,
    estimates_of: Callable[[np.ndarray, np.ndarray, ProductCounter], _Estimates],
) -> _Estimates:
    """The two passes of XTrace and XDiag: Y = AΩ for the s test vectors Ω (one call, s
    products), then ``estimates_of(Ω, Y, counter)`` (one more call of at most s products:
    the leave-one-out estimates and their interaction sum), on one BLAS thread under a
    progress bar ``desc`` over the 2s products."""
    counter = run.counter
    with one_blas_thread(), run.products(2 * test.shape[1], desc) as bar:
        image = counter.matmat(test)
        bar.update()
        return estimates_of(test, image, counter)


def xtrace(
    op: Any,
    num_products: int = 100,
    seed: SeedLike = 0,
    progress: bool | None = None,
    check_symmetry: bool = True,
    distribution: str = "sphere",
) -> TraceResult:
    """XTrace: exchangeable leave-one-out trace estimator with a calibrated error bar.

    Draws s = num_products // 2 test vectors ω_i (uniform on the sphere of
    radius sqrt(n) by default, or Rademacher), forms Y = AΩ = QR (one call, s
    products) and A Q (one call, s products). For each i, the low-rank
    approximation from the other s − 1 vectors gives an exact trace on their
    range, and ω_i, independent of it, estimates the trace of the deflated
    remainder (see :func:`_xtrace_estimates`). The estimate is the mean t̄ of the s
    leave-one-out estimates t_i (Epperly, Tropp & Webber, "XTrace: Making the most
    of every sample in stochastic trace estimation", SIAM J. Matrix Anal. Appl. 45,
    2024).

    Error bar. The t_i share their sketches, so they are correlated and the spread
    of the t_i alone (std/sqrt(s)) underestimates the error, by a factor of up to
    1.5 in our tests. With e_i = t_i − tr A, E[e_i | the other vectors] = 0, so the
    cross terms E[e_i e_j] reduce to the products of the parts of e_i and e_j that
    depend on both ω_i and ω_j, which the leave-two-out differences Δ_ij = t_i −
    t_i⁽⁻ʲ⁾ estimate without bias: E[e_i e_j] = E[Δ_ij Δ_ji]. Hence

        stderr² = (Σ_i (t_i − t̄)² + Σ_{i≠j} Δ_ij Δ_ji) / (s (s − 1)),

    an unbiased estimate of the variance of t̄ (if it comes out negative, which is
    rare, the first sum alone is used). Calibrated as the module docstring states
    for s = 50; with fewer test vectors (s < 20) heavy tails make it less reliable.

    Extra host work is O(n s² + s³), never n × n. Needs num_products >= 4. When AΩ is
    numerically rank deficient, because A has rank < s or because the test vectors are
    singular (Rademacher vectors in small dimensions: two equal or opposite columns), the
    projectors are those onto the column spaces of the sketches without ω_i
    (:func:`_xtrace_rank_deficient`): the estimate stays unbiased with the same error bar
    (on a 5 × 5 matrix with s = 5 Rademacher vectors, singular in 2 runs of 3, over 2000
    seeds: mean error 0.6 standard errors from 0, ±1σ/±2σ coverage 72%/94%), and is
    exact to rounding when every ω_i can be left out without shrinking span(AΩ) (rank A
    < s, generic vectors). The second call then multiplies only rank(AΩ) columns.

    Parameters
    ----------
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s (none when stderr is
        not a terminal); True: a bar at once, terminal or not; False: no bar.
    """
    started = time.perf_counter()
    num_products = check_int("num_products", num_products, minimum=4)
    distribution = check_choice("distribution", distribution, ("sphere", "rademacher"))
    run = start_estimator(op, "trace (xtrace)", seed, check_symmetry, progress, started)
    rng, n = run.rng, run.counter.n
    s = min(num_products // 2, n)
    if distribution == "sphere":
        test = rng.standard_normal((n, s))
        test *= math.sqrt(n) / np.linalg.norm(test, axis=0)
    else:
        test = rademacher_vectors(rng, (n, s))
    estimates, interaction = exchangeable_estimates(run, test, "trace (xtrace)", _xtrace_estimates)
    if s > 1:
        spread = float(np.sum((estimates - estimates.mean()) ** 2))
        variance = (spread + interaction) / (s * (s - 1))
        if not variance > 0:
            variance = spread / (s * (s - 1))
        stderr = math.sqrt(variance)
    else:
        stderr = float("nan")
    return _trace_result(
        run,
        "xtrace",
        float(estimates.mean()),
        stderr,
        "budget",
        num_products=num_products,
        num_test_vectors=s,
        distribution=distribution,
    )


def trace(
    op: Any,
    method: str = "hutchinson",
    num_products: int = 100,
    rtol: float | None = None,
    block_size: int | None = None,
    seed: SeedLike = 0,
    progress: bool | None = None,
    check_symmetry: bool = True,
) -> TraceResult:
    """Estimate tr(A) with ``method`` in "hutchinson", "hutch++", "xtrace".

    Dispatches to :func:`hutchinson_trace`, :func:`hutchpp_trace` or
    :func:`xtrace`. ``rtol`` (early stopping on the standard error) is supported
    by "hutchinson" and "hutch++"; "xtrace" uses its budget in two calls and
    rejects ``rtol``. ``num_products`` is the estimator's budget; the symmetry
    check costs no extra product.

    Parameters
    ----------
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s (none when stderr is
        not a terminal); True: a bar at once, terminal or not; False: no bar.
    """
    method = check_choice("method", method, _METHODS)
    if method == "hutchinson":
        return hutchinson_trace(op, num_products, rtol, block_size, seed, progress, check_symmetry)
    if method == "hutch++":
        return hutchpp_trace(op, num_products, rtol, block_size, seed, progress, check_symmetry)
    if rtol is not None:
        raise ValueError("rtol is supported by method='hutchinson' and 'hutch++', not 'xtrace'")
    return xtrace(op, num_products, seed, progress, check_symmetry)


def frobenius_norm(
    op: Any,
    num_products: int = 100,
    block_size: int | None = None,
    seed: SeedLike = 0,
    progress: bool | None = None,
    check_symmetry: bool = True,
) -> FrobeniusResult:
    """‖A‖_F = sqrt(tr(AᵀA)) from ``E‖Az‖² = ‖A‖_F²`` with Rademacher z.

    ``squared_estimate`` is the mean of ‖Az_i‖² with its standard error (divisor
    m − 1); ``estimate = sqrt(squared_estimate)`` with stderr by the delta method,
    ``stderr(F²)/(2F)``. Both are calibrated like the trace estimators (module
    docstring). Cost: num_products products in blocks of ``block_size`` (default 16)
    per call; the symmetry check uses them. Products far from 1 are scaled by a power of
    two (exact), so ‖A‖_F is right from 1e-300 to 1e300; a ``squared_estimate`` that
    overflows float64 (‖A‖_F above about 1.3e154) is refused with a ``ValueError``, one
    that underflows (‖A‖_F below about 1e-154) is 0 or subnormal while ``estimate`` and
    ``stderr`` stay accurate.

    Parameters
    ----------
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s (none when stderr is
        not a terminal); True: a bar at once, terminal or not; False: no bar.
    """
    started = time.perf_counter()
    num_products = check_int("num_products", num_products, minimum=2)
    block_size = check_block_size(block_size, num_products)
    run = start_estimator(op, "frobenius_norm", seed, check_symmetry, progress, started)
    rng, counter = run.rng, run.counter

    def draw(width: int) -> np.ndarray:
        images = counter.matmat(rademacher_vectors(rng, (counter.n, width)))
        return np.einsum("ij,ij->j", images, images)

    with run.products(num_products, "frobenius norm") as bar:
        moments, _ = adaptive_mean(draw, num_products, block_size, None, 0.0, bar)
    squared = max(float(moments.mean), 0.0)
    squared_stderr = float(moments.stderr())
    norm = math.sqrt(squared)
    stderr = squared_stderr / (2.0 * norm) if norm > 0 else 0.0
    # Back from the counter's scaled products (A / 2^e: norms times 2^e, squares 4^e).
    estimate = counter.unscale(norm, "the Frobenius norm")
    try:
        squared_estimate = counter.unscale(squared, "‖A‖_F²", power=2)
    except ValueError:
        raise ValueError(
            f"frobenius_norm: ‖A‖_F² overflows float64 (‖A‖_F ≈ {estimate:.6g}): the result "
            "cannot hold its squared_estimate; scale the operator down by a power of two "
            "(e.g. 2**-600) and the norm up by it"
        ) from None
    return FrobeniusResult(
        estimate=estimate,
        stderr=counter.unscale(stderr, "the Frobenius norm's standard error"),
        squared_estimate=squared_estimate,
        squared_stderr=counter.unscale(
            squared_stderr, "the squared Frobenius norm's standard error", power=2
        ),
        **run.result_fields(num_products=num_products, block_size=block_size),
    )
