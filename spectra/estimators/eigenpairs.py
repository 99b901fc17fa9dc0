"""What the methods of :func:`~spectra.estimators.eigensolvers.eigenvalues` share: what a
method is asked (:class:`MethodRequest`), the pairs a run finds (:class:`Pairs`), what a
method hands back (:class:`MethodOutput`), the best-first order of ``which``
(:func:`best_first`) and the start vectors drawn around ``v0`` (:func:`unit_columns`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from spectra.estimators._products import ProductProgress

__all__ = ["MethodOutput", "MethodRequest", "Pairs", "best_first", "unit_columns"]


class MethodRequest(NamedTuple):
    """What :func:`eigenvalues` asks of a method (``lanczos_method``, ...): the k best pairs
    by ``which`` of the operator behind ``counter`` (a ``ProductCounter``), to relative
    accuracy ``tol``, within ``budget`` products, from the random generator ``rng`` and the
    optional unit start columns ``v0`` (n × j), with ``bar`` updated as products are made
    and bounds that hold except with probability ``failure_probability``."""

    counter: Any
    k: int
    which: str
    tol: float
    budget: int
    rng: np.random.Generator
    bar: ProductProgress
    v0: np.ndarray | None
    failure_probability: float


class Pairs(NamedTuple):
    """The k best eigenpairs of a run, best first, in the counter's scaled units."""

    values: np.ndarray
    vectors: np.ndarray  # n × k, unit columns
    bounds: np.ndarray  # error bounds (certified part and probabilistic part)
    residuals: np.ndarray  # ‖A y − θ y‖
    converged: np.ndarray  # bool: bound <= target


class MethodOutput(NamedTuple):
    """What a method (``lanczos_method``, ...) hands to :func:`eigenvalues`."""

    pairs: Pairs
    # P(some eigenvalue lies beyond the reported bounds) over the random starts; None
    # when the method cannot say.
    probability: float | None
    info: dict[str, Any]  # method-specific settings for the result


def best_first(values: np.ndarray, which: str) -> np.ndarray:
    """Indices sorting ``values`` best-first for ``which`` (stable: ties keep order)."""
    if which == "largest":
        key = -values
    elif which == "smallest":
        key = values
    else:
        key = -np.abs(values)
    return np.argsort(key, kind="stable")


def unit_columns(
    v0: np.ndarray | None, columns: int, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``columns`` unit start vectors and whether each is warm: the columns of ``v0``
    first, each mixed with a Gaussian vector of the same norm (so that a start that
    misses an eigenvector still sees it), then Gaussian ones."""
    starts = rng.standard_normal((n, columns))
    warm = np.zeros(columns, dtype=bool)
    if v0 is not None:
        given = min(columns, v0.shape[1])
        starts[:, :given] = v0[:, :given] + starts[:, :given] / math.sqrt(n)
        warm[:given] = True
    return starts / np.linalg.norm(starts, axis=0), warm
