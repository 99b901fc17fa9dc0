"""Stochastic estimation of the diagonal of a symmetric operator.

Bekas, Kokiopoulou & Saad, "An estimator for the diagonal of a matrix",
Appl. Numer. Math. 57 (2007): ``diag(A) ≈ (Σ_k z_k ⊙ A z_k) ⊘ (Σ_k z_k ⊙ z_k)``.
With Rademacher probes z_k ⊙ z_k = 1, so the estimate is the mean of the
samples z_k ⊙ A z_k, each unbiased: E[z_i (Az)_i] = a_ii, with variance
Σ_{j≠i} a_ij² per probe.
"""

from __future__ import annotations

import time
from typing import Any

from spectra._operators import (
    SeedLike,
    _as_symmetric_operator,
    _check_int,
    _progress,
    _rademacher,
    _rng,
    _RunningMoments,
)
from spectra.results import DiagonalResult

__all__ = ["diagonal"]

_DEFAULT_BLOCK_SIZE = 16


def diagonal(
    op: Any,
    num_products: int = 100,
    seed: SeedLike = 0,
    block_size: int | None = None,
    progress: bool | None = None,
    check_symmetry: bool = True,
) -> DiagonalResult:
    """Estimate diag(A) as the mean of z ⊙ Az over Rademacher probes z.

    ``stderr`` is the per-entry sample standard deviation of z ⊙ Az over
    sqrt(num_products). Probes go through ``matmat`` in blocks of
    ``block_size`` (default min(16, num_products)): num_products products in
    ceil(num_products / block_size) calls, plus 2 products for the symmetry check.
    """
    started = time.perf_counter()
    num_products = _check_int("num_products", num_products, minimum=2)
    block_size = (
        min(_DEFAULT_BLOCK_SIZE, num_products)
        if block_size is None
        else _check_int("block_size", block_size)
    )
    counter = _as_symmetric_operator(op, check_symmetry=check_symmetry)
    rng = _rng(seed)
    moments = _RunningMoments((counter.n,))
    with _progress(num_products, "diagonal", progress) as bar:
        while moments.count < num_products:
            width = min(block_size, num_products - moments.count)
            probes = _rademacher(rng, (counter.n, width))
            moments.update((probes * counter.matmat(probes)).T)
            bar.update(width)
    return DiagonalResult(
        estimate=moments.mean,
        stderr=moments.stderr(),
        num_products=counter.num_products,
        num_operator_calls=counter.num_operator_calls,
        wall_time=time.perf_counter() - started,
        settings={
            "num_products": num_products,
            "block_size": block_size,
            "seed": seed if isinstance(seed, (int, type(None))) else "generator",
            "check_symmetry": bool(check_symmetry),
        },
    )
