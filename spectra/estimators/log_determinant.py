"""``log det(C + λI)`` by stochastic Lanczos quadrature (SLQ).

``log det(A) = tr log(A)`` for a symmetric positive definite A = C + λI. For a unit probe
q, m Lanczos steps on C give the tridiagonal T_m = S diag(θ) Sᵀ, and the Gauss rule
``qᵀ log(A) q ≈ Σ_i (S_1i)² log(θ_i + λ)`` (Lanczos is shift-invariant: the Ritz values
of C + λI are θ_i + λ with the same weights). With q a normalized Rademacher vector,
``n·qᵀ log(A) q`` is Hutchinson's unbiased estimate of tr log(A) (up to the quadrature
error); the mean over probes is the estimate and their spread its standard error
(Ubaru, Chen & Saad, SIAM J. Matrix Anal. Appl. 38 (2017); Han, Malioutov & Shin 2015).

Quadrature bias: log is analytic on [λ_min, λ_max] of A, and the m-point Gauss rule's
error decays like ``((√κ − 1)/(√κ + 1))^{2m}`` (κ = λ_max/λ_min; Ubaru, Chen & Saad 2017,
Theorem 4.2 gives the constant): ``num_steps`` of about ``(√κ/4)·ln(κ/ε)`` keep it below
ε per probe. It is not in ``stderr``; the result's ``min_ritz_value`` and the largest node
show the κ the run saw (a lower bound of the true κ).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from spectra._validation import check_choice, check_int
from spectra.estimators._preamble import check_damping, start_estimator
from spectra.estimators._products import SeedLike
from spectra.estimators.density import SLQ_DISTRIBUTIONS, probe_recurrences
from spectra.estimators.results import LogDetResult

__all__ = ["logdet"]

# A Ritz value of C + λI within this times eps·max|θ| of 0 is rounding (numerically singular),
# eps the resolution of the operator's products (its dtype's unit roundoff: 1.2e-7 for
# float32); the damping advised for a singular C is this many times that level, so that
# following it lifts every node above it.
_ROUNDING = 100.0
_ADVISED_DAMPING = 10.0


def logdet(
    op: Any,
    damping: float = 0.0,
    num_probes: int = 30,
    num_steps: int = 40,
    seed: SeedLike = 0,
    distribution: str = "rademacher",
    progress: bool | None = None,
    check_symmetry: bool = True,
) -> LogDetResult:
    """``log det(C + λI)`` with a standard error, by SLQ with ``num_probes`` probes of
    ``num_steps`` Lanczos steps.

    Parameters
    ----------
    op
        a symmetric C: LinearOperator (a curvature operator), dense array or sparse matrix.
    damping
        λ >= 0; C + λI must be positive definite.
    num_probes
        probes (>= 2 for a standard error).
    num_steps
        Lanczos steps per probe (see the module docstring for the quadrature bias).
    seed
        the probes' seed (int, None or a numpy Generator).
    distribution
        "rademacher" (normalized ±1 entries, the smaller variance) or "gaussian".
    progress : None, True or False
        None (default): a bar on a terminal for runs longer than ~2 s; True: at once;
        False: none.
    check_symmetry
        test C's symmetry on the first products (no extra product).

    Returns
    -------
    LogDetResult
        ``estimate`` ± ``stderr`` (the probes' sampling error; the quadrature bias is
        not included), with the per-probe values, products and settings.

    Raises
    ------
    ValueError
        a Ritz value of C + λI is below 0 beyond rounding: Ritz values lie within the
        spectrum, so C + λI is then not positive definite (its log det is not real); the
        message gives the value and the damping that would lift it. A Ritz value within
        ``100·eps·max|θ|`` of 0 (or below it): C + λI is singular (or numerically so), its
        log det is −∞ for a positive semidefinite C (or dominated by rounding); the message
        suggests a damping of ``max(1e-8, 1000·eps)·λ_max`` (eps of the operator's dtype),
        which lifts every node above that level. Also bad argument values.
    TypeError
        an argument of the wrong type.

    Notes
    -----
    Cost: num_probes · min(num_steps, n) products in min(num_steps, n) ``matmat`` calls
    (the probes run in lock-step), memory num_probes · num_steps · n float64 numbers.
    All Ritz values positive does not prove C + λI positive definite (an eigenvalue <= 0
    that no probe's Krylov space saw); it is the estimate's assumption.
    """
    started = time.perf_counter()
    damping = check_damping(damping)
    num_probes = check_int("num_probes", num_probes)
    num_steps = check_int("num_steps", num_steps)
    distribution = check_choice("distribution", distribution, SLQ_DISTRIBUTIONS)
    run = start_estimator(op, "logdet", seed, check_symmetry, progress, started)
    slq = probe_recurrences(run, "log-determinant", num_steps, num_probes, distribution)
    counter = run.counter
    n = counter.n
    per_probe = np.empty(num_probes)
    smallest = math.inf
    rules = slq.rules()
    # Ritz values carry absolute errors of order eps·‖C‖ (≈ eps·max|θ|), eps that of the
    # operator's products (float32: 1.2e-7): a node of C + λI within _ROUNDING·eps·max|θ|
    # of 0 is rounding, not a spectrum value.
    top = max(float(np.abs(theta).max()) if theta.size else 0.0 for theta, _ in rules)
    rounding = _ROUNDING * counter.eps * max(top, damping)
    for probe, (theta, weights) in enumerate(rules):
        nodes = theta + damping
        used = nodes[weights > 0] if np.any(weights > 0) else nodes
        lowest = float(used.min())
        smallest = min(smallest, lowest)
        if not lowest > rounding:
            if abs(lowest) <= rounding:
                advised = max(1e-8 * top, _ADVISED_DAMPING * rounding) + max(damping, 0.0)
                raise ValueError(
                    f"logdet: C + λI is singular (or numerically so): it has a Ritz value "
                    f"{lowest:.3g}, at the rounding level {rounding:.3g} of λ_max ≈ {top:.3g} "
                    f"in {counter.boundary_dtype} (damping {damping:g}), so log det(C + λI) is "
                    f"−∞ for a positive semidefinite C: use a damping ≳ {advised:.3g}"
                )
            raise ValueError(
                f"logdet: C + λI is not positive definite: it has a Ritz value {lowest:.6g} "
                f"<= 0 (damping {damping:g}; Ritz values lie within the spectrum), so its log "
                f"det is not real: use a damping above {damping - lowest:.6g}"
            )
        per_probe[probe] = n * float(weights @ np.log(nodes))
    estimate = float(per_probe.mean())
    if num_probes > 1:
        stderr = float(per_probe.std(ddof=1) / math.sqrt(num_probes))
    else:
        stderr = float("nan")
    return LogDetResult(
        estimate=estimate,
        stderr=stderr,
        damping=damping,
        dimension=n,
        num_probes=num_probes,
        min_ritz_value=smallest,
        per_probe=per_probe,
        steps_taken=slq.steps_taken,
        **slq.result_fields(),
    )
