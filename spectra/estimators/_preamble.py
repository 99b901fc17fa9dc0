"""What every stochastic estimator does before and after its own work: the checks of the
arguments they share, the counted operator and seeded generator (:func:`start_estimator`),
the block of counted products (:meth:`EstimatorRun.products`) and the fields every result
records (:meth:`EstimatorRun.result_fields`).

Each estimator checks its own arguments first (their order decides which error a call with
several bad arguments gets), then calls :func:`start_estimator`, which checks ``seed``,
``check_symmetry`` and ``op`` in that order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from spectra._validation import check_float, check_int
from spectra.estimators._products import (
    ProductCounter,
    ProductProgress,
    SeedLike,
    as_symmetric_operator,
    seed_setting,
    seeded_rng,
)

__all__ = ["EstimatorRun", "check_block_size", "check_damping", "start_estimator"]

# Probes per ``matmat`` call of the block estimators (Hutchinson, Hutch++, the Frobenius
# norm, the diagonal) when ``block_size`` is not given.
DEFAULT_BLOCK_SIZE = 16


def check_block_size(block_size: Any, budget: int) -> int:
    """``block_size`` as an int >= 1; None gives min(:data:`DEFAULT_BLOCK_SIZE`, budget)."""
    if block_size is None:
        return min(DEFAULT_BLOCK_SIZE, budget)
    return check_int("block_size", block_size)


def check_damping(damping: Any) -> float:
    """``damping`` as a float λ >= 0 (added to C's diagonal), else a ``TypeError`` or
    ``ValueError``."""
    damping = check_float("damping", damping, positive=False)
    if damping < 0:
        raise ValueError(f"damping must be >= 0 (it is added to C's diagonal), got {damping!r}")
    return damping


class EstimatorRun(NamedTuple):
    """An estimator's run once its arguments are checked: the counted operator, the seeded
    generator, and what its progress bar and its result need."""

    counter: ProductCounter
    rng: np.random.Generator
    seed: SeedLike
    check_symmetry: bool
    progress: bool | None
    started: float  # time.perf_counter() when the estimator was called

    @contextlib.contextmanager
    def products(self, total: int, desc: str) -> Iterator[ProductProgress]:
        """The block in which the estimator multiplies: a progress bar (``desc``) over the
        ``total`` products it plans, and, when the block ends without an error, the
        symmetry test's completion (:meth:`ProductCounter.finish`: one extra product only
        if the block multiplied a single vector)."""
        with ProductProgress(self.counter, total, desc, self.progress) as bar:
            yield bar
            self.counter.finish()

    def result_fields(self, **settings: Any) -> dict[str, Any]:
        """The fields every estimator's result has: the products and operator calls
        counted, the wall time since the call, and ``settings`` followed by the seed and
        ``check_symmetry``. No product."""
        return {
            "num_products": self.counter.num_products,
            "num_operator_calls": self.counter.num_operator_calls,
            "wall_time": time.perf_counter() - self.started,
            "settings": {
                **settings,
                "seed": seed_setting(self.seed),
                "check_symmetry": bool(self.check_symmetry),
            },
        }


def start_estimator(
    op: Any,
    label: str,
    seed: SeedLike,
    check_symmetry: bool,
    progress: bool | None,
    started: float,
) -> EstimatorRun:
    """Check ``seed`` (:func:`seeded_rng`), then ``check_symmetry`` and ``op``
    (:func:`as_symmetric_operator`: square, real, wrapped in a :class:`ProductCounter` that
    names the estimator ``label`` in its errors), and return the run. ``progress`` is
    checked when the bar is made (:meth:`EstimatorRun.products`). No product."""
    rng = seeded_rng(seed)
    counter = as_symmetric_operator(op, label, check_symmetry)
    return EstimatorRun(counter, rng, seed, check_symmetry, progress, started)
