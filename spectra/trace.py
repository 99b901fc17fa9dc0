"""Stochastic trace and Frobenius-norm estimation from operator products.

* Hutchinson (1989): ``tr(A) ≈ (1/m) Σ z_iᵀ A z_i`` with Rademacher z_i;
  variance ``2(‖A‖_F² − Σ a_ii²)/m``, so the error falls like 1/sqrt(m).
* Hutch++ (Meyer, Musco, Musco & Woodruff, SOSA 2021): spend a third of the
  products on a sketch Q = orth(A S), take ``tr(QᵀAQ)`` exactly and apply
  Hutchinson to the deflated ``(I − QQᵀ) A (I − QQᵀ)``; error O(1/m) for
  matrices with decaying spectra (e.g. Hessians).
* XTrace (Epperly, Tropp & Webber, SIMAX 2024): an exchangeable estimator that
  uses every test vector both for the low-rank sketch and for the residual
  trace, by leaving each vector out in turn, with a built-in error estimate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy.linalg import qr, solve_triangular

from spectra._operators import (
    SeedLike,
    _as_symmetric_operator,
    _check_choice,
    _check_int,
    _ProductCounter,
    _progress,
    _rademacher,
    _rng,
    _RunningMoments,
)
from spectra.results import FrobeniusResult, TraceResult

__all__ = ["frobenius_norm", "hutchinson_trace", "hutchpp_trace", "trace", "xtrace"]

_METHODS = ("hutchinson", "hutch++", "xtrace")
_DEFAULT_BLOCK_SIZE = 16
# With rtol, the stopping rule is checked only after this many blocks (and at
# least this many samples), so that the sample standard error is not itself
# too noisy to trust.
_MIN_BLOCKS = 3
_MIN_SAMPLES = 10


def _seed_setting(seed: SeedLike) -> Any:
    return seed if isinstance(seed, (int, type(None))) else "generator"


def _check_rtol(rtol: float | None) -> float | None:
    if rtol is None:
        return None
    if not (isinstance(rtol, (int, float)) and rtol > 0 and math.isfinite(rtol)):
        raise ValueError(f"rtol must be a positive finite number or None, got {rtol!r}")
    return float(rtol)


def _block_size(block_size: int | None, budget: int) -> int:
    if block_size is None:
        return min(_DEFAULT_BLOCK_SIZE, budget)
    return _check_int("block_size", block_size)


def _adaptive_mean(
    draw_block: Callable[[int], np.ndarray],
    budget: int,
    block_size: int,
    rtol: float | None,
    offset: float,
    bar: Any,
) -> tuple[_RunningMoments, str]:
    """Average samples from ``draw_block(width)`` until ``budget`` samples are drawn
    or, with ``rtol``, until ``stderr <= rtol·|offset + mean|`` (after a few blocks).
    Returns the running moments and why it stopped ("rtol" or "budget")."""
    moments = _RunningMoments()
    blocks = 0
    while moments.count < budget:
        width = min(block_size, budget - moments.count)
        moments.update(draw_block(width))
        blocks += 1
        bar.update(width)
        if (
            rtol is not None
            and blocks >= _MIN_BLOCKS
            and moments.count >= _MIN_SAMPLES
            and float(moments.stderr()) <= rtol * abs(offset + float(moments.mean))
        ):
            return moments, "rtol"
    return moments, "budget"


def _trace_result(
    method: str,
    estimate: float,
    stderr: float,
    stopped: str,
    counter: _ProductCounter,
    started: float,
    seed: SeedLike,
    check_symmetry: bool,
    **settings: Any,
) -> TraceResult:
    """A :class:`TraceResult` with the counts and timing every trace method reports."""
    return TraceResult(
        estimate=float(estimate),
        stderr=float(stderr),
        method=method,
        stopped=stopped,
        num_products=counter.num_products,
        num_operator_calls=counter.num_operator_calls,
        wall_time=time.perf_counter() - started,
        settings={
            **settings,
            "seed": _seed_setting(seed),
            "check_symmetry": bool(check_symmetry),
        },
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
    standard deviation of ``z_iᵀ A z_i`` over sqrt(m). With ``rtol``, blocks are
    drawn until ``stderr <= rtol·|estimate|`` (checked from the third block on,
    with at least 10 samples) or the budget of ``num_products`` ends;
    ``stopped`` records which. Cost: at most num_products products in
    ceil(num_products / block_size) calls (plus 2 in one call for the symmetry
    check). Reference: Hutchinson, Comm. Stat. Simul. Comput. 18 (1989).
    """
    started = time.perf_counter()
    num_products = _check_int("num_products", num_products, minimum=2)
    rtol = _check_rtol(rtol)
    block_size = _block_size(block_size, num_products)
    counter = _as_symmetric_operator(op, check_symmetry=check_symmetry)
    rng = _rng(seed)

    def draw(width: int) -> np.ndarray:
        probes = _rademacher(rng, (counter.n, width))
        return np.einsum("ij,ij->j", probes, counter.matmat(probes))

    with _progress(num_products, "trace (hutchinson)", progress) as bar:
        moments, stopped = _adaptive_mean(draw, num_products, block_size, rtol, 0.0, bar)
    return _trace_result(
        "hutchinson",
        moments.mean,
        moments.stderr(),
        stopped,
        counter,
        started,
        seed,
        check_symmetry,
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
    first block of deflated probes share one ``matmat``. ``stderr`` is the
    standard error of the Hutchinson part only (the sketched part is exact for a
    given Q). With ``rtol``, the Hutchinson part stops early once
    ``stderr <= rtol·|estimate|``. Needs num_products >= 4. Reference: Meyer,
    Musco, Musco & Woodruff, "Hutch++: Optimal stochastic trace estimation",
    SOSA 2021.
    """
    started = time.perf_counter()
    num_products = _check_int("num_products", num_products, minimum=4)
    rtol = _check_rtol(rtol)
    counter = _as_symmetric_operator(op, check_symmetry=check_symmetry)
    n = counter.n
    sketch_size = min(num_products // 3, n)
    remaining = num_products - 2 * sketch_size
    block_size = _block_size(block_size, remaining)
    rng = _rng(seed)

    with _progress(num_products, "trace (hutch++)", progress) as bar:
        sketch = counter.matmat(_rademacher(rng, (n, sketch_size)))
        bar.update(sketch_size)
        basis, _ = np.linalg.qr(sketch)
        rank = basis.shape[1]
        first_width = min(block_size, remaining)
        first_probes = _rademacher(rng, (n, first_width))
        first_probes -= basis @ (basis.T @ first_probes)
        images = counter.matmat(np.hstack([basis, first_probes]))
        bar.update(rank)
        exact_part = float(np.einsum("ij,ij->", basis, images[:, :rank]))
        pending = [np.einsum("ij,ij->j", first_probes, images[:, rank:])]

        def draw(width: int) -> np.ndarray:
            if pending:
                return pending.pop()
            probes = _rademacher(rng, (n, width))
            probes -= basis @ (basis.T @ probes)
            return np.einsum("ij,ij->j", probes, counter.matmat(probes))

        moments, stopped = _adaptive_mean(draw, remaining, first_width, rtol, exact_part, bar)
    return _trace_result(
        "hutch++",
        exact_part + float(moments.mean),
        moments.stderr(),
        stopped,
        counter,
        started,
        seed,
        check_symmetry,
        num_products=num_products,
        rtol=rtol,
        block_size=first_width,
        sketch_size=sketch_size,
        num_probes=moments.count,
    )


def _xtrace_estimates(test: np.ndarray, image: np.ndarray, counter: _ProductCounter) -> np.ndarray:
    """The s leave-one-out XTrace estimates from test vectors Ω and Y = AΩ.

    Y = QR. Leaving column i out, span(Y₋ᵢ) has projector ``QQᵀ − (Qsᵢ)(Qsᵢ)ᵀ``
    with sᵢ the normalized i-th column of R⁻ᵀ. With W = QᵀΩ, H = QᵀAQ,
    cᵢ = sᵢᵀwᵢ and vᵢ = wᵢ − cᵢsᵢ (so (I − Pᵢ)ωᵢ = ωᵢ − Qvᵢ):

        tᵢ = tr H − sᵢᵀHsᵢ + γᵢ (ωᵢᵀyᵢ − 2 rᵢᵀvᵢ + vᵢᵀHvᵢ),

    using Qᵀyᵢ = rᵢ (i-th column of R) and A symmetric. γᵢ is the normalization
    of the "improved" estimator: the deflated probe is rescaled to squared norm
    n − s + 1, the dimension of the space it lives in:
    γᵢ = (n − s + 1)/‖(I − Pᵢ)ωᵢ‖² with ‖(I − Pᵢ)ωᵢ‖² = ‖ωᵢ‖² − ‖wᵢ‖² + cᵢ².
    Costs one more ``matmat`` (A Q, s products) and O(n s² + s³) host flops.

    If Y is numerically rank deficient (rank A < s), span(Y) already contains
    range(A) and removing one column does not change it: all estimates reduce
    to tr(QᵀAQ) plus the (numerically zero) residual term.
    """
    n, s = test.shape
    basis, triangular = qr(image, mode="economic")
    singular = np.linalg.svd(triangular, compute_uv=False)
    threshold = 10.0 * max(s, 10) * counter.eps * (singular[0] if singular.size else 0.0)
    rank = int(np.sum(singular > threshold))
    if rank < s:
        left, _, _ = np.linalg.svd(triangular)
        basis = basis @ left[:, :rank]
        projected_image = counter.matmat(basis)
        projected = basis.T @ projected_image
        coordinates = basis.T @ test
        deflated = test - basis @ coordinates
        # A(I − QQᵀ)Ω = Y − (AQ)(QᵀΩ): no further products needed.
        residual_terms = np.einsum("ij,ij->j", deflated, image - projected_image @ coordinates)
        return np.trace(projected) + residual_terms
    projected_image = counter.matmat(basis)  # Z = A Q
    projected = basis.T @ projected_image  # H
    projected = 0.5 * (projected + projected.T)
    coordinates = basis.T @ test  # W
    inverse_transpose = solve_triangular(triangular, np.eye(s), trans="T")
    directions = inverse_transpose / np.linalg.norm(inverse_transpose, axis=0)  # S
    overlap = np.einsum("ij,ij->j", directions, coordinates)  # c
    reduced = coordinates - directions * overlap  # V
    h_directions = projected @ directions
    h_reduced = projected @ reduced
    sketched = np.trace(projected) - np.einsum("ij,ij->j", directions, h_directions)
    residual = (
        np.einsum("ij,ij->j", test, image)
        - 2.0 * np.einsum("ij,ij->j", triangular, reduced)
        + np.einsum("ij,ij->j", reduced, h_reduced)
    )
    deflated_norms = (
        np.einsum("ij,ij->j", test, test)
        - np.einsum("ij,ij->j", coordinates, coordinates)
        + overlap**2
    )
    scale = (n - s + 1) / np.maximum(deflated_norms, np.finfo(float).tiny)
    return sketched + scale * residual


def xtrace(
    op: Any,
    num_products: int = 100,
    seed: SeedLike = 0,
    progress: bool | None = None,
    check_symmetry: bool = True,
    distribution: str = "sphere",
) -> TraceResult:
    """XTrace: exchangeable leave-one-out trace estimator with error estimate.

    Draws s = num_products // 2 test vectors ω_i (uniform on the sphere of
    radius sqrt(n) by default, or Rademacher), forms Y = AΩ = QR (one call, s
    products) and A Q (one call, s products). For each i, the low-rank
    approximation from the other s − 1 vectors gives an exact trace on their
    range, and ω_i, independent of it, estimates the trace of the deflated
    remainder (normalized variant, see ``_xtrace_estimates``). The estimate is
    the mean of the s leave-one-out estimates and ``stderr`` their standard
    deviation over sqrt(s), the paper's error estimate. Extra host work is
    O(n s² + s³), never n × n. Needs num_products >= 4. Reference: Epperly,
    Tropp & Webber, "XTrace: Making the most of every sample in stochastic
    trace estimation", SIAM J. Matrix Anal. Appl. 45 (2024).
    The second call multiplies only rank(AΩ) columns when A has rank < s.
    """
    started = time.perf_counter()
    num_products = _check_int("num_products", num_products, minimum=4)
    distribution = _check_choice("distribution", distribution, ("sphere", "rademacher"))
    counter = _as_symmetric_operator(op, check_symmetry=check_symmetry)
    n = counter.n
    rng = _rng(seed)
    s = min(num_products // 2, n)
    if distribution == "sphere":
        test = rng.standard_normal((n, s))
        test *= math.sqrt(n) / np.linalg.norm(test, axis=0)
    else:
        test = _rademacher(rng, (n, s))
    with _progress(2 * s, "trace (xtrace)", progress) as bar:
        image = counter.matmat(test)
        bar.update(s)
        estimates = _xtrace_estimates(test, image, counter)
        bar.update(s)
    return _trace_result(
        "xtrace",
        estimates.mean(),
        estimates.std(ddof=1) / math.sqrt(s) if s > 1 else float("nan"),
        "budget",
        counter,
        started,
        seed,
        check_symmetry,
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
    rejects ``rtol``. ``num_products`` is the estimator's budget; the result's
    ``num_products`` also counts the 2 products of the symmetry check.
    """
    method = _check_choice("method", method, _METHODS)
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

    ``squared_estimate`` is the mean of ‖Az_i‖² with its standard error;
    ``estimate = sqrt(squared_estimate)`` with stderr by the delta method,
    ``stderr(F²)/(2F)``. Cost: num_products products in blocks of
    ``block_size`` (default 16) per call.
    """
    started = time.perf_counter()
    num_products = _check_int("num_products", num_products, minimum=2)
    block_size = _block_size(block_size, num_products)
    counter = _as_symmetric_operator(op, check_symmetry=check_symmetry)
    rng = _rng(seed)

    def draw(width: int) -> np.ndarray:
        images = counter.matmat(_rademacher(rng, (counter.n, width)))
        return np.einsum("ij,ij->j", images, images)

    with _progress(num_products, "frobenius norm", progress) as bar:
        moments, _ = _adaptive_mean(draw, num_products, block_size, None, 0.0, bar)
    squared = max(float(moments.mean), 0.0)
    squared_stderr = float(moments.stderr())
    norm = math.sqrt(squared)
    return FrobeniusResult(
        estimate=norm,
        stderr=squared_stderr / (2.0 * norm) if norm > 0 else 0.0,
        squared_estimate=squared,
        squared_stderr=squared_stderr,
        num_products=counter.num_products,
        num_operator_calls=counter.num_operator_calls,
        wall_time=time.perf_counter() - started,
        settings={
            "num_products": num_products,
            "block_size": block_size,
            "seed": _seed_setting(seed),
            "check_symmetry": bool(check_symmetry),
        },
    )
