"""Mini-batch sharpness: the distribution of λ₁ over a seeded set of mini-batches.

The sharpness of the edge-of-stability literature is the largest eigenvalue λ₁(H) of the
Hessian of the *full-batch* loss L = (1/N) Σ_i ℓ_i (Cohen, Kaur, Li, Kolter & Talwalkar,
ICLR 2021), the quantity :func:`spectra.analysis.trajectory.measure_sharpness` measures. A
model trained with SGD takes each step on a mini-batch loss L_B = (1/b) Σ_{i∈B} ℓ_i, whose
Hessian H_B varies from batch to batch; researchers who train with SGD look at the
distribution of λ₁(H_B) over mini-batches (Jastrzębski, Szymczak, Fort, Arpit, Tabor, Cho &
Geras, "The break-even point on optimization trajectories of deep neural networks", ICLR
2020), beside the full-batch λ₁(H) and the step size's threshold 2/η.

The two are related: when the mini-batches partition the data into batches of equal size, H
is their mean, and since λ_max is convex, the mean of λ₁(H_B) is at least λ₁(H) (it is
larger the less the batches' top eigenvectors agree); smaller batches spread wider.

:func:`minibatch_sharpness` draws ``num_batches`` batches of ``batch_size`` examples as SGD
does (the batches of a seeded random permutation of the examples, a new permutation when one
is used up, the last partial batch of each dropped), measures λ₁ (and optionally the trace)
of each batch's Hessian with :func:`~spectra.analysis.trajectory.measure_sharpness` (its
eigensolver started from the previous batch's eigenvector), and returns a
:class:`MinibatchSharpness` with the values and their mean, spread and quantiles.

This module imports no TensorFlow: the operator is built by the active backend's
:class:`spectra.HessianOperator`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spectra._validation import check_float, check_int, check_seed
from spectra.analysis.trajectory import SharpnessSettings, measure_sharpness
from spectra.estimators._products import make_progress_bar

__all__ = ["QUANTILES", "MinibatchSharpness", "draw_minibatches", "minibatch_sharpness"]

#: The quantiles reported for the distribution over mini-batches.
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def draw_minibatches(
    num_examples: int, batch_size: int, num_batches: int, seed: int = 0
) -> list[np.ndarray]:
    """The example indices of ``num_batches`` mini-batches, drawn as SGD draws them.

    Batch k is the k-th run of ``batch_size`` indices of a random permutation of
    ``range(num_examples)`` (``numpy.random.default_rng(seed)``); when a permutation has no
    full batch left, a new one is drawn from the same generator (the next epoch), so the
    batches of one permutation are disjoint and every example is used before any is used
    twice. Each batch's indices are sorted.

    Raises
    ------
    ValueError
        ``batch_size`` larger than ``num_examples``, or a count below 1.
    """
    num_examples = check_int("num_examples", num_examples)
    batch_size = check_int("batch_size", batch_size)
    num_batches = check_int("num_batches", num_batches)
    check_seed("seed", seed, allow_none=False, allow_generator=False)
    if batch_size > num_examples:
        raise ValueError(
            f"batch_size {batch_size} is larger than the {num_examples} examples: give a "
            f"batch size of at most {num_examples}."
        )
    rng = np.random.default_rng(seed)
    per_permutation = num_examples // batch_size
    batches: list[np.ndarray] = []
    while len(batches) < num_batches:
        order = rng.permutation(num_examples)
        for k in range(min(per_permutation, num_batches - len(batches))):
            batches.append(np.sort(order[k * batch_size : (k + 1) * batch_size]))
    return batches


@dataclass
class MinibatchSharpness:
    """λ₁ of the Hessians of a set of mini-batch losses, and their distribution.

    ``sharpness[b]`` is λ₁(H_B) of batch b with its ``error_bounds[b]`` and ``converged[b]``
    (:func:`spectra.eigenvalues`); with a trace, ``traces[b]`` ± ``trace_stderrs[b]``
    (Hutchinson, :func:`spectra.trace`), else None. ``batch_size``, ``num_batches`` and
    ``seed`` say how the batches were drawn (:func:`draw_minibatches`; ``seed`` None for
    batches given by the caller); ``num_products`` and ``wall_time`` are the work over all
    batches. ``full_batch`` (λ₁ of the full-batch Hessian) and ``threshold`` (the step size's
    stability threshold, e.g. 2/η) are set by the caller that knows them, for comparison.
    """

    batch_size: int
    num_batches: int
    seed: int | None
    sharpness: list[float]
    error_bounds: list[float]
    converged: list[bool]
    traces: list[float] | None = None
    trace_stderrs: list[float] | None = None
    num_products: int = 0
    wall_time: float = 0.0
    full_batch: float | None = None
    threshold: float | None = None
    eigenvectors: np.ndarray | None = field(default=None, repr=False)

    @property
    def mean(self) -> float:
        """Mean of the batches' λ₁."""
        return float(np.mean(self.sharpness))

    @property
    def std(self) -> float:
        """Standard deviation of the batches' λ₁ (ddof = 1; NaN for one batch)."""
        if len(self.sharpness) < 2:
            return math.nan
        return float(np.std(self.sharpness, ddof=1))

    @property
    def stderr(self) -> float:
        """Standard error of :attr:`mean`, std/√(number of batches) (NaN for one batch)."""
        return self.std / math.sqrt(len(self.sharpness))

    def quantiles(self) -> dict[str, float]:
        """The :data:`QUANTILES` of the batches' λ₁ (``numpy.quantile``, linear), keyed
        ``"q05"``, ``"q25"``, ``"q50"``, ``"q75"``, ``"q95"``."""
        values = np.quantile(np.asarray(self.sharpness, dtype=float), QUANTILES)
        return {_quantile_key(q): float(v) for q, v in zip(QUANTILES, values, strict=True)}

    def summary(self) -> dict[str, Any]:
        """The distribution in a few numbers: mean, std, stderr, min, max, the quantiles,
        and the fraction of batches whose λ₁ exceeds the threshold (None without one)."""
        values = np.asarray(self.sharpness, dtype=float)
        above = None
        if self.threshold is not None:
            above = float(np.mean(values > self.threshold))
        return {
            "mean": self.mean,
            "std": self.std,
            "stderr": self.stderr,
            "min": float(values.min()),
            "max": float(values.max()),
            **self.quantiles(),
            "fraction_above_threshold": above,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields: the settings, the per-batch values and :meth:`summary` (NaN
        kept as float NaN: write with a strict JSON writer that records why)."""
        return {
            "batch_size": self.batch_size,
            "num_batches": self.num_batches,
            "seed": self.seed,
            "sharpness": list(self.sharpness),
            "error_bounds": list(self.error_bounds),
            "converged": list(self.converged),
            "traces": None if self.traces is None else list(self.traces),
            "trace_stderrs": None if self.trace_stderrs is None else list(self.trace_stderrs),
            "num_products": self.num_products,
            "wall_time": self.wall_time,
            "full_batch": self.full_batch,
            "threshold": self.threshold,
            "summary": self.summary(),
        }


def _quantile_key(q: float) -> str:
    return f"q{round(100 * q):02d}"


def _map_arrays(function: Callable[[Any], Any], tree: Any) -> Any:
    """``function`` applied to every array of a nest of dicts, lists and tuples (no Keras
    import: this module must not start TensorFlow)."""
    if isinstance(tree, Mapping):
        return {key: _map_arrays(function, value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_map_arrays(function, value) for value in tree)
    return function(tree)


def _take_examples(data: Sequence[Any], index: np.ndarray) -> tuple[Any, ...]:
    """The examples ``index`` of ``(x, y[, sample_weight])``, each a (nested) array."""
    return tuple(_map_arrays(lambda array: np.asarray(array)[index], part) for part in data)


def _num_examples(data: Sequence[Any]) -> int:
    lengths: set[int] = set()
    _map_arrays(lambda array: lengths.add(len(np.asarray(array))), data[0])
    if len(lengths) != 1:
        raise ValueError(f"the inputs x have different lengths {sorted(lengths)}.")
    return lengths.pop()


def _check_arrays(data: Any) -> tuple[Any, ...]:
    if not isinstance(data, tuple | list) or len(data) not in (2, 3):
        raise TypeError(
            "minibatch_sharpness draws its mini-batches from arrays: data must be (x, y) or "
            f"(x, y, sample_weight), not {type(data).__name__}. For a tf.data.Dataset or "
            "batches of your own, pass them as batches=[(x, y), ...] (e.g. "
            "list(dataset.take(10).as_numpy_iterator()))."
        )
    return tuple(data)


def minibatch_sharpness(
    model: Any,
    data: Any = None,
    loss: Any = None,
    *,
    batch_size: int | None = None,
    num_batches: int = 10,
    seed: int = 0,
    batches: Iterable[Any] | None = None,
    tol: float = 1e-6,
    method: str = "lanczos",
    trace: bool = False,
    trace_products: int = 100,
    variables: Sequence[Any] | None = None,
    dtype: Any = None,
    build: Callable[[Any], Any] | None = None,
    progress: bool | None = None,
) -> MinibatchSharpness:
    """λ₁ of the Hessian of each of ``num_batches`` mini-batch losses, and their distribution.

    For each mini-batch B (drawn from ``data`` by :func:`draw_minibatches` with ``seed``, or
    taken from ``batches``), the Hessian H_B of the mini-batch loss
    L_B = (1/b) Σ_{i∈B} ℓ_i in inference mode (:meth:`spectra.HessianOperator.from_keras`)
    and its λ₁ to relative tolerance ``tol`` (with its certified error bound), and with
    ``trace=True`` a Hutchinson trace of ``trace_products`` products; batch b's random
    start and probes are seeded ``seed + b``, and its eigensolver starts from the previous
    batch's eigenvector. See the module docstring for how this relates to the full-batch
    sharpness (Cohen et al. 2021; Jastrzębski et al. 2020).

    Cost: per batch, the eigensolver's products on b examples (tens for λ₁ to 1e-6) plus
    ``trace_products`` with a trace: about ``num_batches`` · b / N times the work of one
    full-batch measurement.

    Parameters
    ----------
    model:
        a built Keras model, measured at its current weights.
    data:
        ``(x, y)`` or ``(x, y, sample_weight)`` arrays (x and y may be nested dicts/lists
        of arrays) to draw the batches from; or None with ``batches``.
    loss:
        a Keras loss name, ``keras.losses.Loss`` or callable; None takes the model's
        compiled loss.
    batch_size, num_batches, seed:
        how many examples per batch (required with ``data``), how many batches, and the
        seed of the draw and of the estimators.
    batches:
        instead of ``data``: the mini-batches themselves, each ``(x, y)`` or
        ``(x, y, sample_weight)`` (e.g. ``dataset.take(10)``), measured in order.
    tol, method, trace, trace_products:
        as :func:`spectra.analysis.trajectory.measure_sharpness`'s settings.
    variables, dtype:
        passed to :meth:`spectra.HessianOperator.from_keras`.
    build:
        ``build(batch) -> operator`` to measure another matrix per batch (e.g. a
        preconditioned Hessian); default the Hessian as above.
    progress:
        None: a bar over the batches on a terminal for runs over ~2 s; True / False.

    Raises
    ------
    ValueError
        both or neither of ``data`` and ``batches``, ``batch_size`` missing or larger
        than the data, a batch count below 1, or a batch whose λ₁ is not finite.
    TypeError
        ``data`` that is not a tuple of arrays (a ``tf.data.Dataset``: use ``batches``).
    """
    if (data is None) == (batches is None):
        raise ValueError(
            "give either data=(x, y) to draw the mini-batches from (with batch_size) or "
            "batches=[(x, y), ...], not both and not neither."
        )
    tol = check_float("tol", tol)
    settings = SharpnessSettings(
        top_k=1,
        method=method,
        tol=float(tol),
        trace=bool(trace),
        trace_products=int(trace_products),
        seed=int(seed),
    )
    drawn_seed: int | None
    if data is not None:
        arrays = _check_arrays(data)
        if batch_size is None:
            raise ValueError(
                "batch_size is required with data: the number of examples per mini-batch "
                "(the batch size the model is trained with)."
            )
        indices = draw_minibatches(_num_examples(arrays), batch_size, num_batches, seed)
        chosen: list[Any] = [_take_examples(arrays, index) for index in indices]
        drawn_seed = int(seed)
        size = int(batch_size)
    else:
        assert batches is not None
        chosen = [tuple(batch) for batch in batches]
        if not chosen:
            raise ValueError("batches is empty: give at least one (x, y) mini-batch.")
        drawn_seed = None
        size = _num_examples(chosen[0])
    if build is None:
        build = _hessian_builder(model, loss, variables=variables, dtype=dtype)
    return _measure_batches(chosen, build, settings, size, drawn_seed, progress)


def _hessian_builder(
    model: Any, loss: Any, *, variables: Sequence[Any] | None, dtype: Any
) -> Callable[[Any], Any]:
    from spectra.operators import HessianOperator

    if loss is None:
        loss = getattr(model, "loss", None)
        if loss is None or isinstance(loss, list | tuple | dict):
            raise ValueError(
                "minibatch_sharpness needs one loss: pass loss=... (a Keras loss name, a "
                "keras.losses.Loss or a callable (y_true, y_pred) -> scalar), or compile the "
                "model with a single loss."
            )

    def build(batch: Any) -> Any:
        return HessianOperator.from_keras(model, loss, batch, variables=variables, dtype=dtype)

    return build


def _measure_batches(
    chosen: Sequence[Any],
    build: Callable[[Any], Any],
    settings: SharpnessSettings,
    batch_size: int,
    seed: int | None,
    progress: bool | None,
) -> MinibatchSharpness:
    started = time.perf_counter()
    sharpness: list[float] = []
    bounds: list[float] = []
    converged: list[bool] = []
    traces: list[float] = []
    stderrs: list[float] = []
    products = 0
    vectors: np.ndarray | None = None
    with make_progress_bar(len(chosen), "mini-batch sharpness", "batch", progress) as bar:
        for b, batch in enumerate(chosen):
            measured = measure_sharpness(
                build(batch), settings, seed=settings.seed + b, v0=vectors, progress=False
            )
            vectors = measured.eigenvectors
            sharpness.append(measured.eigenvalues[0])
            bounds.append(measured.error_bounds[0])
            converged.append(measured.converged[0])
            if measured.trace is not None:
                traces.append(measured.trace)
                stderrs.append(float(measured.trace_stderr or math.nan))
            products += measured.num_products
            bar.update(1)
    return MinibatchSharpness(
        batch_size=batch_size,
        num_batches=len(chosen),
        seed=seed,
        sharpness=sharpness,
        error_bounds=bounds,
        converged=converged,
        traces=traces if settings.trace else None,
        trace_stderrs=stderrs if settings.trace else None,
        num_products=products,
        wall_time=time.perf_counter() - started,
        eigenvectors=vectors,
    )


def summary_scalars(summary: Mapping[str, Any], prefix: str = "sharpness") -> dict[str, float]:
    """TensorBoard scalars of a :meth:`MinibatchSharpness.summary`:
    ``<prefix>/minibatch_lambda_1_{mean,std,q05,...,q95}`` (values that are None or NaN left
    out)."""
    scalars = {}
    for name in ("mean", "std", *(_quantile_key(q) for q in QUANTILES)):
        value = summary.get(name)
        if value is not None and math.isfinite(value):
            scalars[f"{prefix}/minibatch_lambda_1_{name}"] = float(value)
    return scalars
