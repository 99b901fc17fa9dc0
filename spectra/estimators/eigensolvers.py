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

What a result can and cannot promise (the certified and probabilistic bounds, the stopping
rule, what ``converged`` means for each method) is derived in
:mod:`~spectra.estimators.eigenvalue_bounds`, with the rounding floor no bound goes below.
Where the rest is:

* :mod:`~spectra.estimators.krylov_schur` — ``"lanczos"`` (and the verification run of
  ``"lobpcg"``);
* :mod:`~spectra.estimators.power_iteration` — ``"power"``;
* :mod:`~spectra.estimators.block_eigensolver` — ``"lobpcg"``;
* :mod:`~spectra.estimators.eigenpairs` — the pairs a method hands back, the best-first
  order and the start vectors;
* this module — the public :func:`eigenvalues` and :func:`eigenvalue_ratio`: the argument
  checks, the method table, the rounding floor applied to every method's bounds and the
  result (``converged`` and the reason when not).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from spectra._validation import check_choice, check_float, check_int
from spectra.estimators._products import (
    ProductProgress,
    SeedLike,
    as_symmetric_operator,
    one_blas_thread,
    seed_setting,
    seeded_rng,
)
from spectra.estimators.block_eigensolver import lobpcg_method
from spectra.estimators.eigenpairs import MethodOutput, MethodRequest
from spectra.estimators.eigenvalue_bounds import rounding_floor
from spectra.estimators.krylov_schur import lanczos_method
from spectra.estimators.power_iteration import power_method
from spectra.estimators.results import EigenResult

__all__ = ["eigenvalue_ratio", "eigenvalues"]

_WHICH = ("largest", "smallest", "magnitude")
_METHODS = ("lanczos", "power", "lobpcg")
DEFAULT_FAILURE_PROBABILITY = 1e-4
# A single Lanczos run plans for about this many products per wanted value (progress bar).
_PLANNED_PRODUCTS_PER_VALUE = 20
# The achieved failure probability may exceed the requested one by this relative amount
# (the rounding of a sum of shares) and still count as meeting it.
_PROBABILITY_ROUNDING = 1e-12


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


_SOLVERS = {"lanczos": lanczos_method, "power": power_method, "lobpcg": lobpcg_method}


class _Reported(NamedTuple):
    """The pairs as :func:`eigenvalues` reports them, in the operator's units."""

    values: np.ndarray
    vectors: np.ndarray
    error_bounds: np.ndarray
    targets: np.ndarray
    residuals: np.ndarray
    converged: np.ndarray


def _report(
    output: MethodOutput, counter: Any, tol: float, failure_probability: float
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
    failure_probability: float = DEFAULT_FAILURE_PROBABILITY,
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
            MethodRequest(counter, k, which, tol, max_products, rng, bar, v0, failure_probability)
        )
        counter.finish()
    reported = _report(output, counter, tol, failure_probability)
    probability, info = output.probability, output.info
    reason = _not_converged_reason(
        method, reported, probability, failure_probability, counter.num_products, max_products
    )
    unresolved = unresolved_zero(counter)
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


def unresolved_zero(counter: Any) -> str | None:
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
