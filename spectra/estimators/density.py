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

import time
from typing import Any, NamedTuple

import numpy as np

from spectra._validation import check_choice, check_float, check_int
from spectra.estimators._preamble import EstimatorRun, start_estimator
from spectra.estimators._products import (
    ProductCounter,
    SeedLike,
    one_blas_thread,
    rademacher_vectors,
)
from spectra.estimators.krylov import batched_lanczos
from spectra.estimators.results import LogSpectralDensity, SpectralDensity, SpectralMass
from spectra.estimators.tridiagonal import gauss_quadrature

__all__ = ["log_spectral_density", "spectral_density", "spectral_mass_below"]

# Default τ of spectral_mass_below: the mass below −1% of λ_max.
_DEFAULT_TAU = 0.01
# A node of a PSD operator within this times eps·max|θ| below 0 is rounding (raised to 0).
_PSD_ROUNDING = 100.0
# The probes of stochastic Lanczos quadrature (densities, log-determinants).
SLQ_DISTRIBUTIONS = ("rademacher", "gaussian")


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

    The recurrences run on products scaled by a power of two when they are far from 1
    (exact; see ``ProductCounter``): nodes are right for operators from 1e-300 to 1e300,
    and a zero operator gives one node at 0 per probe (its Krylov space breaks down).

    An operator with ``is_positive_semidefinite = True`` (GGN, Fisher, K-FAC) gets a PSD
    density (``positive_semidefinite``): nodes within rounding below 0 (100·eps·max|θ|,
    eps of the operator's dtype) are raised to 0, the smoothing is reflected at 0 and the
    mass below any threshold <= 0 is 0. Clipping moves a node by at most that rounding,
    so the moments change by rounding only. A node further below 0 disproves the claim:
    the density is then left as computed, with the reason in
    ``settings["positive_semidefinite_note"]``.

    Cost: num_probes · min(num_steps, n) products in min(num_steps, n) calls
    (fewer after breakdowns); the symmetry check uses the first products (no extra
    one); memory num_probes · num_steps · n float64 numbers for the bases.

    Parameters
    ----------
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s (none when stderr is
        not a terminal); True: a bar at once, terminal or not; False: no bar.
    """
    started = time.perf_counter()
    num_steps = check_int("num_steps", num_steps)
    num_probes = check_int("num_probes", num_probes)
    distribution = check_choice("distribution", distribution, SLQ_DISTRIBUTIONS)
    run = start_estimator(op, "spectral_density", seed, check_symmetry, progress, started)
    slq = probe_recurrences(run, "spectral density", num_steps, num_probes, distribution)
    steps_taken = slq.steps_taken
    width = int(steps_taken.max())
    nodes = np.zeros((num_probes, width))
    weights = np.zeros((num_probes, width))
    for probe, (theta, probe_weights) in enumerate(slq.rules()):
        m = len(theta)
        nodes[probe, :m] = theta
        nodes[probe, m:] = theta[-1]
        weights[probe, :m] = probe_weights
    claimed = getattr(op, "is_positive_semidefinite", False) is True
    psd, note = (
        _positive_semidefinite(nodes, weights, run.counter.eps) if claimed else (False, None)
    )
    if psd:
        nodes = np.maximum(nodes, 0.0)
    fields = slq.result_fields()
    if claimed:
        fields["settings"].update(
            positive_semidefinite_claimed=True, positive_semidefinite_note=note
        )
    return SpectralDensity(
        nodes=nodes,
        weights=weights,
        steps_taken=steps_taken,
        dimension=run.counter.n,
        **fields,
        positive_semidefinite=psd,
    )


def _positive_semidefinite(
    nodes: np.ndarray, weights: np.ndarray, eps: float
) -> tuple[bool, str | None]:
    """Whether the nodes of an operator that says it is PSD agree: Ritz values lie in
    [λ_min, λ_max], so a node below −100·eps·max|θ| (beyond the rounding of products whose
    relative accuracy is ``eps``) proves a negative eigenvalue. Returns (agree, a one-line
    note when they do not)."""
    used = nodes[weights > 0]
    rounding = _PSD_ROUNDING * eps * float(np.abs(used).max(initial=0.0))
    lowest = float(used.min(initial=0.0))
    if lowest >= -rounding:
        return True, None
    return False, (
        f"the operator says it is positive semidefinite, but a Ritz value {lowest:.6g} lies "
        f"below its rounding level −{rounding:.3g}: it has a negative eigenvalue, so the "
        "density is left unclipped"
    )


def spectral_mass_below(
    density: SpectralDensity, tau: float = _DEFAULT_TAU, lambda_max: float | None = None
) -> SpectralMass:
    """Spectral mass below −τ·λ_max: ``(1/n)·#{i: λ_i < −τ·λ_max}``, with an error bar.

    The negative part of a Hessian spectrum, measured where SLQ can see it. Near 0 a
    Hessian's bulk is so dense that no affordable number of Lanczos nodes resolves
    the mass just below 0 (a "fraction of negative eigenvalues" moves with the step
    count far beyond its probe spread); a threshold τ·λ_max away from 0 is resolved,
    and :meth:`SpectralDensity.mass_below` bounds what is not: the error bar
    ``error = resolution + 2·stderr`` covers the Gauss quadrature's resolution (a
    deterministic bracket from the Chebyshev–Markov–Stieltjes inequalities) and the
    probe spread. Increase ``num_steps`` to shrink ``resolution``, ``num_probes`` to
    shrink ``stderr``.

    ``lambda_max`` defaults to the largest quadrature node (a Ritz value, so at most
    the true λ_max; pass an eigenvalue estimate to pin the threshold). The default
    τ = 0.01 puts the threshold at 1% of λ_max below 0.
    """
    tau = check_float("tau", tau)
    if lambda_max is None:
        used = density.nodes[density.weights > 0]
        lambda_max = float(used.max())
    else:
        lambda_max = check_float("lambda_max", lambda_max)
    if not lambda_max > 0:
        raise ValueError(
            f"the mass below −τ·λ_max needs λ_max > 0; the largest node is {lambda_max:.3g}"
        )
    mass = density.mass_below(-tau * lambda_max)
    mass.tau = tau
    mass.lambda_max = lambda_max
    return mass


def log_spectral_density(
    op: Any,
    num_steps: int = 80,
    num_probes: int = 10,
    seed: SeedLike = 0,
    shift: float = 0.0,
    floor: float | None = None,
    progress: bool | None = None,
    distribution: str = "rademacher",
    check_symmetry: bool = True,
) -> LogSpectralDensity:
    """SLQ density of ``t = log10|λ + shift|``, for spectra spanning many decades.

    The same Lanczos run as :func:`spectral_density` (same products, nodes and weights);
    each node θ becomes ``log10(max(|θ + shift|, floor))`` with its Gauss weight. For
    f(t) smooth, ``Σ_i w_i f(log10|θ_i + shift|)`` is the probe's Gauss quadrature of
    ``qᵀ f(log10|A + shift·I|) q``, so the result's ``density()`` smooths the measure
    ``(1/n) Σ_j δ(t − log10|λ_j + shift|)`` on a log axis and ``moments(p)`` estimate
    ``(1/n)·tr(log10|A + shift·I|^p)``, unbiased over probes up to the quadrature error
    (larger than for powers of λ: log is not a polynomial, and nodes near 0 weigh much).

    With ``shift`` making the spectrum positive (λ + shift > 0 for every node) the
    transform is monotone and ``mass_below`` keeps its bracket; otherwise the density
    folds both signs (``folded`` is True) and ``mass_below`` is refused.

    Parameters
    ----------
    op
        LinearOperator, dense array or sparse matrix, symmetric.
    num_steps, num_probes, seed, distribution, check_symmetry
        as for :func:`spectral_density`.
    shift
        added to every eigenvalue before the logarithm (e.g. a damping, or ``−λ_min``
        plus a margin to make a Hessian's spectrum positive).
    floor
        magnitudes ``|θ + shift|`` below it are raised to it (a node at 0 has no logarithm);
        default ``1e-12`` times the largest ``|θ + shift|``. ``floored_mass`` reports the mean
        weight so raised.
    progress : None, True or False
        as for :func:`spectral_density`.

    Returns
    -------
    LogSpectralDensity
        a :class:`~spectra.estimators.results.SpectralDensity` over t, with ``shift``,
        ``floor``, ``floored_mass`` and ``folded``.

    Raises
    ------
    ValueError
        bad argument values, or every node is 0 (a zero operator with shift 0).
    TypeError
        an argument of the wrong type.

    Notes
    -----
    Cost: that of :func:`spectral_density` plus O(num_probes·num_steps) host work.
    """
    shift = check_float("shift", shift, positive=False)
    floor = check_float("floor", floor, allow_none=True)
    base = spectral_density(
        op,
        num_steps=num_steps,
        num_probes=num_probes,
        seed=seed,
        progress=progress,
        distribution=distribution,
        check_symmetry=check_symmetry,
    )
    shifted = np.abs(base.nodes + shift)
    used = base.weights > 0
    largest = float(shifted[used].max()) if np.any(used) else 0.0
    if floor is None:
        if not largest > 0:
            raise ValueError(
                "log_spectral_density: every node λ + shift is 0 (a zero operator?): "
                "there is no logarithm to take; pass a shift or a floor"
            )
        floor = 1e-12 * largest
    floored = used & (shifted < floor)
    folded = bool(np.any(used & (base.nodes + shift < 0)))
    nodes = np.log10(np.maximum(shifted, floor))
    weights = base.weights.copy()
    for probe in range(base.num_probes):
        m = int(base.steps_taken[probe])
        order = np.argsort(nodes[probe, :m], kind="stable")
        nodes[probe, :m] = nodes[probe, :m][order]
        weights[probe, :m] = weights[probe, :m][order]
        nodes[probe, m:] = nodes[probe, m - 1]
    settings = dict(base.settings, shift=shift, floor=floor, transform="log10|λ + shift|")
    return LogSpectralDensity(
        nodes=nodes,
        weights=weights,
        steps_taken=base.steps_taken,
        dimension=base.dimension,
        num_products=base.num_products,
        num_operator_calls=base.num_operator_calls,
        wall_time=base.wall_time,
        settings=settings,
        shift=shift,
        floor=floor,
        floored_mass=float((base.weights * floored).sum(axis=1).mean()),
        folded=folded,
    )


class _ProbeRecurrences(NamedTuple):
    """The Lanczos recurrences of stochastic Lanczos quadrature: the estimator's run, its
    settings and, per probe, the coefficients α (num_probes × steps), β and the steps
    taken."""

    run: EstimatorRun
    num_steps: int
    num_probes: int
    distribution: str
    alpha: np.ndarray
    beta: np.ndarray
    steps_taken: np.ndarray

    @property
    def counter(self) -> ProductCounter:
        """The run's product counter."""
        return self.run.counter

    def result_fields(self) -> dict[str, Any]:
        """The counts, wall time and settings (steps, probes, distribution, seed,
        check_symmetry) of an SLQ result: :meth:`EstimatorRun.result_fields`."""
        return self.run.result_fields(
            num_steps=self.num_steps, num_probes=self.num_probes, distribution=self.distribution
        )

    def rules(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per probe, its Gauss quadrature rule (nodes θ, weights), the nodes back from the
        counter's scaled products (a power of two: exact)."""
        rules = []
        for probe, steps in enumerate(self.steps_taken):
            m = int(steps)
            theta, weights = gauss_quadrature(self.alpha[probe, :m], self.beta[probe, : m - 1])
            rules.append((self.counter.unscale(theta, "a quadrature node (Ritz value)"), weights))
        return rules


def probe_recurrences(
    run: EstimatorRun, description: str, num_steps: int, num_probes: int, distribution: str
) -> _ProbeRecurrences:
    """``num_probes`` Lanczos recurrences of at most ``num_steps`` steps (and n) from
    Rademacher or Gaussian starts (``distribution``, checked by the caller) drawn from the
    run's generator, run in lock-step (one ``matmat`` a step): the data every SLQ estimate
    (densities, log-determinants) is computed from. ``description`` names the progress
    bar."""
    counter, rng = run.counter, run.rng
    n = counter.n
    if distribution == "rademacher":
        starts = rademacher_vectors(rng, (n, num_probes))
    else:
        starts = rng.standard_normal((n, num_probes))
    steps = min(num_steps, n)
    with one_blas_thread(), run.products(num_probes * steps, description) as bar:
        alpha, beta, steps_taken = batched_lanczos(counter, starts, steps, bar)
    return _ProbeRecurrences(run, num_steps, num_probes, distribution, alpha, beta, steps_taken)
