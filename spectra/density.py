"""Spectral density by stochastic Lanczos quadrature (SLQ).

For a unit probe q, m Lanczos steps give T_m = S diag(θ) Sᵀ and the m-point
Gauss quadrature ``qᵀ f(A) q ≈ Σ_i (S_1i)² f(θ_i)``, exact for polynomials of
degree < 2m. With q uniform on the sphere or a normalized Rademacher vector,
E[q qᵀ] = I/n, so the nodes θ_i and weights (S_1i)² approximate the spectral
measure (1/n) Σ_j δ(t − λ_j). Averaging over probes and smoothing with a
Gaussian gives the density. References: Lin, Saad & Yang, SIAM Review 58
(2016); Ghorbani, Krishnan & Xiao, ICML 2019; Papyan, ICML 2019.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from spectra._operators import (
    SeedLike,
    _as_symmetric_operator,
    _check_choice,
    _check_int,
    _progress,
    _rademacher,
    _rng,
)
from spectra.lanczos import _batched_lanczos, tridiagonal_eigh
from spectra.results import SpectralDensity

__all__ = ["negative_mass_fraction", "spectral_density"]


def spectral_density(
    op: Any,
    num_steps: int = 80,
    num_probes: int = 10,
    seed: SeedLike = 0,
    progress: bool | None = None,
    distribution: str = "rademacher",
    check_symmetry: bool = True,
) -> SpectralDensity:
    """SLQ spectral density with ``num_probes`` probes of ``num_steps`` Lanczos steps.

    The probes' Lanczos recurrences run in lock-step: each step multiplies the
    current vectors of all probes in one ``matmat`` call, and each probe is
    fully reorthogonalized against its own basis (batched matrix products).
    A probe that breaks down (its Krylov space is invariant, e.g. for a
    low-rank A) stops early; its quadrature is then exact and its weights
    still sum to 1. ``distribution`` is "rademacher" (normalized ±1 entries) or
    "gaussian" (normalized, i.e. uniform on the sphere).

    Cost: num_probes · min(num_steps, n) products in min(num_steps, n) calls
    (fewer after breakdowns), plus 2 for the symmetry check; memory
    num_probes · num_steps · n float64 numbers for the bases.
    """
    started = time.perf_counter()
    num_steps = _check_int("num_steps", num_steps)
    num_probes = _check_int("num_probes", num_probes)
    distribution = _check_choice("distribution", distribution, ("rademacher", "gaussian"))
    counter = _as_symmetric_operator(op, check_symmetry=check_symmetry)
    n = counter.n
    rng = _rng(seed)
    if distribution == "rademacher":
        starts = _rademacher(rng, (n, num_probes))
    else:
        starts = rng.standard_normal((n, num_probes))
    steps = min(num_steps, n)
    with _progress(num_probes * steps, "spectral density", progress) as bar:
        alpha, beta, steps_taken = _batched_lanczos(counter, starts, steps, bar)
    width = int(steps_taken.max())
    nodes = np.zeros((num_probes, width))
    weights = np.zeros((num_probes, width))
    for probe in range(num_probes):
        m = int(steps_taken[probe])
        theta, vectors = tridiagonal_eigh(alpha[probe, :m], beta[probe, : m - 1])
        nodes[probe, :m] = theta
        nodes[probe, m:] = theta[-1]
        weights[probe, :m] = vectors[0] ** 2
    return SpectralDensity(
        nodes=nodes,
        weights=weights,
        steps_taken=steps_taken,
        dimension=n,
        num_products=counter.num_products,
        num_operator_calls=counter.num_operator_calls,
        wall_time=time.perf_counter() - started,
        settings={
            "num_steps": num_steps,
            "num_probes": num_probes,
            "distribution": distribution,
            "seed": seed if isinstance(seed, (int, type(None))) else "generator",
            "check_symmetry": bool(check_symmetry),
        },
    )


def negative_mass_fraction(density: SpectralDensity, eps: float = 0.0) -> tuple[float, float]:
    """Fraction of the spectrum below ``−eps`` and its standard error across probes.

    Read from the quadrature nodes (no smoothing): the mass of Ritz values
    below −eps, averaged over probes. ``eps > 0`` ignores tiny negative values
    from round-off or float32 products. Used in saddle-point studies (e.g.
    Ghorbani et al. 2019).
    """
    per_probe = density.negative_mass_per_probe(eps)
    stderr = (
        float(per_probe.std(ddof=1) / math.sqrt(per_probe.size))
        if per_probe.size > 1
        else float("nan")
    )
    return float(per_probe.mean()), stderr
