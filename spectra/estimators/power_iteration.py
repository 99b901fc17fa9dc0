"""Power iteration with deflation: the ``"power"`` method of
:func:`~spectra.estimators.eigensolvers.eigenvalues` (:func:`power_method`), as in PyHessian
(Yao et al. 2020).

Its convergence factor per product is ``|λ₂/λ₁|`` instead of Lanczos'
Chebyshev-accelerated rate, so it needs many more products; it is here for parity
with published numbers. Its bounds: :func:`power_method`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from spectra.estimators._products import ProductProgress, orthogonalize
from spectra.estimators.eigenpairs import MethodOutput, MethodRequest, Pairs, unit_columns
from spectra.estimators.eigenvalue_bounds import log_inverse_delta, rounding_floor

__all__ = ["power_method"]

# exp(709) is finite, exp(710) overflows (log of the largest float64 is 709.78): the
# power method's bound U = exp(·) is capped there.
_LOG_LARGEST_FLOAT = 709.0


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
    """The state :func:`power_method` carries from one pair to the next: the vectors
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
        are spent (see :func:`power_method`)."""
        counter, n = self.counter, self.counter.n
        use_shift = self.which in ("largest", "smallest")
        dimension = n - self.found.shape[0]
        log_inverse = log_inverse_delta(dimension, share, warm)
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
                    log_inverse = log_inverse_delta(dimension, share, False)
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


def power_method(request: MethodRequest) -> MethodOutput:
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
    (:func:`log_inverse_delta`). So with probability at least 1 − share

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
    counter, k, which, tol, budget, rng, bar, v0, failure_probability = request
    n = counter.n
    sign = -1.0 if which == "smallest" else 1.0
    share = failure_probability / k
    iteration = _PowerIteration(
        counter, which, tol, rng, bar, sign, np.zeros((0, n)), counter.norm_estimate
    )
    starts, warm_starts = unit_columns(v0, k, n, rng)
    pairs: list[_PowerPair] = []
    spent = 0
    for index in range(k):
        allowance = budget - spent - (k - index - 1)  # leave one product per later pair
        pair = iteration.pair(starts[:, index], bool(warm_starts[index]), share, allowance)
        spent += pair.products
        iteration.found = np.vstack([iteration.found, pair.vector])
        pairs.append(pair)
    found = Pairs(
        np.array([sign * pair.value for pair in pairs]),
        iteration.found.T.copy(),
        np.array([pair.bound for pair in pairs]),
        np.array([pair.residual for pair in pairs]),
        np.array([pair.converged for pair in pairs], dtype=bool),
    )
    return MethodOutput(found, min(1.0, share * k), {"shift": sign * iteration.shift})
