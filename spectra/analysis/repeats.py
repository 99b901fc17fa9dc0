"""Uncertainty across seeds and data: an estimate rerun R times.

Three uncertainties, each answering another question:

* the **numerical bound** of one run (an eigenvalue's error bound, a trace's standard
  error across probes): how far this estimate is from the exact value *for this matrix*
  (this model, this data);
* the **spread across seeds** (:func:`repeat_estimate` with an ``operator``): how much the
  estimator's own randomness moves the number, the matrix fixed. Zero for converged
  Lanczos eigenvalues apart from rounding; the sampling error of a stochastic trace or
  density;
* the **spread across data subsets** (``subsample=f``): how much the quantity changes when
  the matrix is built on another random fraction f of the data. This is the one to report
  when asking whether λ₁ is a property of the model or of the batch of data.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spectra._validation import check_float, check_int, check_seed
from spectra.estimators._products import make_progress_bar
from spectra.estimators.results import EigenResult, Result, SpectralDensity, TraceResult

__all__ = ["RepeatResult", "repeat_estimate", "subsample_indices"]

# How repeat i draws its subset, recorded in every result so that a run can be redone.
SUBSET_RULE = (
    "numpy.sort(numpy.random.default_rng([seed, i]).choice(n, m, replace=False)) with "
    "m = floor(subsample * n), for repeat i = 0..R-1"
)
_DEFAULT_LEVEL = 0.95
# The moments of a spectral density reported per repeat: trace(A^p)/n for these p.
_DENSITY_ORDERS = (1, 2)


@dataclass
class RepeatResult(Result):
    """One estimate rerun ``R`` times, over seeds or over random data subsets.

    ``values[i, j]`` is quantity ``names[j]`` in repeat i (seed ``seeds[i]``, on a subset of
    ``subset_sizes[i]`` examples) and ``bounds[i, j]`` that run's own numerical bound
    (``bound_kinds[j]`` says which: an eigenvalue's error bound, a standard error across
    probes; NaN when the estimate has none). Across repeats, per quantity:

    * ``mean`` = (1/R) Σᵢ valuesᵢ; ``sd`` the sample standard deviation (ddof = 1);
    * ``sem`` = sd/√R, the standard error of the mean;
    * ``ci_low``, ``ci_high`` = mean ∓ t₍₁₊level₎/₂,R−1 · sem, the Student-t confidence
      interval at ``level`` for the mean over seeds (``kind == "seeds"``) or over subsets
      of this fraction of the data (``kind == "subsets"``), assuming the repeats are
      independent and their values roughly normal.

    ``subsample`` is the fraction f (None across seeds), ``num_examples`` the n the subsets
    are drawn from and ``subset_rule`` how (see :func:`subsample_indices`); ``subset_sizes``
    is empty across seeds. ``num_products`` and ``num_operator_calls`` add up those the
    repeats' results report (0 for an estimate returning plain numbers).

    ``full_values[j]`` is quantity j of the same estimate on the whole data (None when it
    was not given, see ``full`` in :func:`repeat_estimate`) and ``shift[j]`` =
    (mean − full value)/sd, the subsets' offset from it in units of their spread. Across
    subsets the mean and its interval are those of the quantity *at the subset size*
    floor(f·n), not of the full-data value: λ_max of a smaller sample is larger on average
    (a sample Hessian is the full one plus noise of variance ∝ 1/m, and the largest
    eigenvalue of a noisier matrix is biased upward), so a shift of several sd is that
    bias, not disagreement.
    """

    kind: str
    names: list[str]
    bound_kinds: list[str]
    values: np.ndarray
    bounds: np.ndarray
    mean: np.ndarray
    sd: np.ndarray
    sem: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    level: float
    seeds: np.ndarray
    subset_sizes: np.ndarray
    subsample: float | None
    num_examples: int | None
    subset_rule: str | None
    num_products: int
    num_operator_calls: int
    wall_time: float
    settings: dict[str, Any] = field(default_factory=dict)
    full_values: np.ndarray | None = None
    shift: np.ndarray | None = None

    @property
    def repeats(self) -> int:
        """R, the number of repeats."""
        return int(self.values.shape[0])

    def quantity(self, name: str) -> int:
        """The column of ``values`` holding quantity ``name`` (``ValueError`` naming the known
        ones if there is none)."""
        if name not in self.names:
            raise ValueError(f"no quantity {name!r}; the repeats hold {', '.join(self.names)}")
        return self.names.index(name)


def subsample_indices(num_examples: int, subsample: float, seed: int, repeat: int) -> np.ndarray:
    """The sorted indices of the examples in repeat ``repeat``'s subset.

    ``m = floor(subsample · num_examples)`` examples drawn without replacement by
    ``numpy.random.default_rng([seed, repeat])``: reproducible from the seed, independent
    across repeats, the examples kept in their original order. Cost: O(n).

    Raises
    ------
    TypeError
        a non-integer ``num_examples``, ``seed`` or ``repeat``, a non-number ``subsample``.
    ValueError
        ``subsample`` outside (0, 1], or fewer than one example per subset.
    """
    n = check_int("num_examples", num_examples)
    fraction = _check_subsample(subsample, n)
    seed = int(check_seed("seed", seed, allow_none=False, allow_generator=False))  # type: ignore[arg-type]
    repeat = check_int("repeat", repeat, minimum=0)
    size = math.floor(fraction * n)
    rng = np.random.default_rng([seed, repeat])
    return np.sort(rng.choice(n, size, replace=False))


def _check_subsample(subsample: Any, num_examples: int) -> float:
    fraction = check_float("subsample", subsample)
    if fraction > 1:
        raise ValueError(f"subsample must be a fraction of the data in (0, 1], got {subsample!r}")
    if math.floor(fraction * num_examples) < 1:
        raise ValueError(
            f"subsample = {fraction:g} of {num_examples} examples leaves no example per subset "
            f"(at least 1/{num_examples} = {1 / num_examples:.3g} is needed): use a larger "
            "fraction or more data"
        )
    return fraction


def _take(arrays: Any, index: np.ndarray) -> Any:
    """The rows ``index`` of every array in ``arrays`` (an array, or a tuple, list or dict of
    them, nested: the labels of a model with several outputs), structure kept; None stays."""
    if arrays is None:
        return None
    if isinstance(arrays, dict):
        return {key: _take(value, index) for key, value in arrays.items()}
    if isinstance(arrays, (tuple, list)):
        return type(arrays)(_take(value, index) for value in arrays)
    return np.asarray(arrays)[index]


def _num_examples(arrays: Any) -> int:
    """The common number of rows of the arrays in ``data`` (``ValueError`` if they differ)."""
    lengths: list[int] = []

    def visit(item: Any) -> None:
        if item is None:
            return
        if isinstance(item, dict):
            for value in item.values():
                visit(value)
        elif isinstance(item, (tuple, list)):
            for value in item:
                visit(value)
        else:
            shape = np.shape(item)
            if not shape:
                raise ValueError("data must hold arrays with one row per example, got a scalar")
            lengths.append(int(shape[0]))

    visit(arrays)
    if not lengths:
        raise ValueError("data holds no arrays to draw subsets from")
    if len(set(lengths)) > 1:
        raise ValueError(
            f"the arrays of data have different numbers of examples ({sorted(set(lengths))})"
        )
    return lengths[0]


def _cost(result: Any) -> tuple[int, int]:
    """The products and operator calls a result (or a dict of them) reports."""
    if isinstance(result, dict):
        costs = [_cost(item) for item in result.values()]
        return sum(c[0] for c in costs), sum(c[1] for c in costs)
    return int(getattr(result, "num_products", 0)), int(getattr(result, "num_operator_calls", 0))


def _quantities(result: Any, name: str | None = None) -> list[tuple[str, float, float, str]]:
    """``(name, value, numerical bound, what the bound is)`` of each number in ``result``."""
    if isinstance(result, dict):
        rows = []
        for key, item in result.items():
            rows += _quantities(item, str(key))
        return rows
    if isinstance(result, EigenResult):
        return [
            (f"λ{i}", float(value), float(bound), "error bound")
            for i, (value, bound) in enumerate(zip(result.eigenvalues, result.error_bounds), 1)
        ]
    if isinstance(result, TraceResult):
        return [(name or "trace", float(result.estimate), float(result.stderr), "standard error")]
    if isinstance(result, SpectralDensity):
        moments = result.moments(max(_DENSITY_ORDERS))
        return [
            (
                f"trace(A^{p})/n",
                float(moments.estimate[p]),
                float(moments.stderr[p]),
                "standard error",
            )
            for p in _DENSITY_ORDERS
        ]
    if isinstance(result, (int, float, np.integer, np.floating)) and not isinstance(result, bool):
        return [(name or "value", float(result), math.nan, "none")]
    if isinstance(result, np.ndarray) and result.ndim == 1 and result.dtype.kind in "iuf":
        base = name or "value"
        return [(f"{base}[{i}]", float(v), math.nan, "none") for i, v in enumerate(result)]
    raise TypeError(
        "estimate must return an EigenResult, TraceResult, SpectralDensity, a number, a 1-D "
        f"array of numbers or a dict of these, got {type(result).__name__}"
    )


def repeat_estimate(
    estimate: Callable[[Any, int], Any],
    operator: Any = None,
    *,
    repeats: int,
    data: Any = None,
    build: Callable[[Any], Any] | None = None,
    subsample: float | None = None,
    seed: int = 0,
    level: float = _DEFAULT_LEVEL,
    progress: bool | None = None,
    full: Any = None,
) -> RepeatResult:
    """Rerun ``estimate`` R times and report the mean and spread beside each run's bound.

    Across seeds (``operator`` given): repeat i returns ``estimate(operator, seed + i)``,
    only the estimator's randomness changes. Across data subsets (``data``, ``build`` and
    ``subsample = f``): repeat i builds ``build(subset_i)`` on the examples
    :func:`subsample_indices` ``(n, f, seed, i)`` of ``data`` (floor(f·n) of them, without
    replacement, reproducible from ``seed``) and returns ``estimate(that operator, seed + i)``.

    ``estimate(operator, seed)`` returns an :class:`~spectra.EigenResult` (quantities λ1..λk,
    bound: the error bound), a :class:`~spectra.TraceResult` (the trace, bound: its standard
    error), a :class:`~spectra.SpectralDensity` (trace(A)/n and trace(A²)/n, bound: their
    standard errors across probes), a number or 1-D array (no bound), or a dict of these.

    Statistics over the R values of each quantity: mean, sample standard deviation sd
    (ddof = 1), standard error of the mean sem = sd/√R and the Student-t interval
    mean ± t₍₁₊level₎/₂,R−1 · sem for the mean over seeds or over subsets.

    Which uncertainty is which: the numerical bound says how far one run is from the exact
    value for its matrix; the spread across seeds is the estimator's randomness (zero apart
    from rounding for converged Lanczos eigenvalues); the spread across subsets says how
    much the quantity depends on the data, the one to report when asking whether λ1 is a
    property of the model or of the batch.

    Cost: R times the estimate's products; with ``subsample``, also R operator builds,
    each over floor(f·n) examples (so each product costs about f times a full one).

    Parameters
    ----------
    estimate
        ``(operator, seed) -> result``, e.g. ``lambda op, s: spectra.eigenvalues(op, k=3,
        seed=s)``.
    operator
        the matrix across seeds; not with ``subsample``.
    repeats
        R ≥ 2.
    data
        the examples across subsets: an array or a tuple/list/dict (nested) of arrays with
        one row per example, e.g. ``(x, y)``; each subset keeps this structure.
    build
        ``subset -> operator``, e.g. ``lambda d: spectra.HessianOperator.from_keras(model,
        loss, d)``.
    subsample
        the fraction f in (0, 1] of the examples in each subset (f = 1: the whole data
        rebuilt R times, only the estimator's seed changes).
    seed
        seeds ``seed..seed+R-1`` for the estimate, and the subsets' seed.
    level
        the confidence level of the interval, in (0, 1).
    progress
        one bar across the repeats: None on a terminal after about 2 s, True always,
        False never (pass ``progress=False`` to the estimator inside ``estimate``).
    full
        optional: what ``estimate`` returned on the whole data (the run the repeats are
        compared with); its quantities become ``full_values`` and
        ``shift = (mean − full)/sd``, the subsets' bias in units of their spread.

    Returns
    -------
    RepeatResult

    Raises
    ------
    TypeError
        ``estimate`` or ``build`` not callable, a non-integer ``repeats`` or ``seed``, an
        estimate of another type (see above).
    ValueError
        ``repeats < 2``; ``subsample`` outside (0, 1] or leaving no example per subset;
        ``operator`` together with ``subsample``, or ``subsample`` without ``data`` and
        ``build``; repeats returning different quantities, or ``full`` other ones.
    """
    if not callable(estimate):
        raise TypeError(f"estimate must be callable (operator, seed) -> result, got {estimate!r}")
    repeats = check_int("repeats", repeats, minimum=2)
    seed = int(check_seed("seed", seed, allow_none=False, allow_generator=False))  # type: ignore[arg-type]
    level = check_float("level", level, below=1.0)
    if subsample is None:
        if operator is None:
            raise ValueError(
                "repeat_estimate needs an operator (across seeds) or data, build and "
                "subsample (across data subsets)"
            )
        if data is not None or build is not None:
            raise ValueError("data and build are for subsets: give subsample too, or neither")
        num_examples = None
    else:
        if operator is not None:
            raise ValueError(
                "with subsample the operator is rebuilt on each subset by build(subset): give "
                "data and build instead of an operator"
            )
        if data is None or build is None:
            raise ValueError("subsample needs data (the examples) and build (subset -> operator)")
        if not callable(build):
            raise TypeError(f"build must be callable (subset) -> operator, got {build!r}")
        num_examples = _num_examples(data)
        subsample = _check_subsample(subsample, num_examples)

    started = time.perf_counter()
    seeds = np.arange(seed, seed + repeats, dtype=np.int64)
    sizes = np.full(repeats, num_examples or 0, dtype=np.int64)
    rows: list[list[tuple[str, float, float, str]]] = []
    products = calls = 0
    what = "subsets" if subsample is not None else "seeds"
    with make_progress_bar(repeats, f"repeats across {what}", "repeat", progress) as bar:
        for i in range(repeats):
            target = operator
            if subsample is not None:
                assert num_examples is not None and build is not None
                index = subsample_indices(num_examples, subsample, seed, i)
                sizes[i] = index.size
                target = build(_take(data, index))
            result = estimate(target, int(seeds[i]))
            rows.append(_quantities(result))
            cost = _cost(result)
            products, calls = products + cost[0], calls + cost[1]
            if [row[0] for row in rows[-1]] != [row[0] for row in rows[0]]:
                raise ValueError(
                    f"repeat {i} returned the quantities {[r[0] for r in rows[-1]]}, repeat 0 "
                    f"{[r[0] for r in rows[0]]}: every repeat must estimate the same ones"
                )
            bar.update(1)
    values = np.array([[row[1] for row in r] for r in rows], dtype=np.float64)
    bounds = np.array([[row[2] for row in r] for r in rows], dtype=np.float64)
    mean, sd, sem, low, high = _statistics(values, level)
    full_values = shift = None
    if full is not None:
        reference = _quantities(full)
        if [row[0] for row in reference] != [row[0] for row in rows[0]]:
            raise ValueError(
                f"full holds the quantities {[row[0] for row in reference]}, the repeats "
                f"{[row[0] for row in rows[0]]}: give what estimate returns on the whole data"
            )
        full_values = np.array([row[1] for row in reference], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            shift = np.where(sd > 0, (mean - full_values) / np.where(sd > 0, sd, 1.0), np.nan)
    return RepeatResult(
        kind=what,
        names=[row[0] for row in rows[0]],
        bound_kinds=[row[3] for row in rows[0]],
        values=values,
        bounds=bounds,
        mean=mean,
        sd=sd,
        sem=sem,
        ci_low=low,
        ci_high=high,
        level=level,
        seeds=seeds,
        subset_sizes=sizes if subsample is not None else np.zeros(0, dtype=np.int64),
        subsample=subsample,
        num_examples=num_examples,
        subset_rule=SUBSET_RULE if subsample is not None else None,
        num_products=products,
        num_operator_calls=calls,
        wall_time=time.perf_counter() - started,
        settings={"repeats": repeats, "seed": seed},
        full_values=full_values,
        shift=shift,
    )


def _statistics(values: np.ndarray, level: float) -> tuple[np.ndarray, ...]:
    """Mean, sd (ddof = 1), sem = sd/√R and the Student-t interval of the columns of the
    R × q array ``values``."""
    from scipy.stats import t as student_t

    count = values.shape[0]
    mean = values.mean(axis=0)
    sd = values.std(axis=0, ddof=1)
    sem = sd / math.sqrt(count)
    half = float(student_t.ppf(0.5 + level / 2, count - 1)) * sem
    return mean, sd, sem, mean - half, mean + half
