"""Fisher matrices of a Keras model's loss on JAX: Monte Carlo and empirical.

The matrices of :class:`spectra.operators.FisherOperator` (whose docstring states them
with their weights c_i = λ·w_i/n_b, the predictive distributions and κ), computed like
the generalized Gauss-Newton product (:mod:`spectra.operators.jax.ggn`): J v from the
cached linearization of the model's outputs, a small operation on the outputs, and Jᵀ(·)
by its transpose, without ever forming a per-example gradient in parameter space:

* ``kind="mc"``: F_b = Σ_i c_i J_iᵀ [(1/S) Σ_s ∇ℓ_i(ŷ_is) ∇ℓ_i(ŷ_is)ᵀ / κ] J_i with S =
  ``num_samples`` labels ŷ_is drawn from the model's predictive distribution p(y | z_i)
  once per batch (JAX's generator, keyed by the seed, the batch's index and the output's
  position), so the operator is a fixed symmetric PSD matrix; per product, the
  directional derivatives ∇ℓ(ŷ)ᵀ J v of every draw weight the cached output gradients;
* ``kind="empirical"``: E_b = Σ_i c_i g_i g_iᵀ with g_i = J_iᵀ ∇_zℓ_i(y_i) at the true
  labels; per product, the per-example directional derivatives g_iᵀ v (from J v on the
  outputs) weight the cached output gradients, and one transposed product maps them back.

References: J. Martens, "New insights and perspectives on the natural gradient method",
JMLR 21 (2020; arXiv:1412.1193). F. Kunstner, P. Hennig, L. Balles, "Limitations of the
empirical Fisher approximation for natural gradient descent", NeurIPS 2019.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from spectra._validation import check_int
from spectra.operators.jax.base import CurvatureOperator
from spectra.operators.jax.curvature import BatchProblem, Curvature, Static
from spectra.operators.jax.ggn import OutputSplit, with_regularization
from spectra.operators.keras_calls import unpack_batch
from spectra.operators.losses import check_fisher_reduction, compiled_loss
from spectra.operators.predictive import PredictiveFamily, predictive_family

__all__ = [
    "EmpiricalFisher",
    "FisherCurvature",
    "FisherOperator",
    "MonteCarloFisher",
    "predictive_distribution",
]

KINDS = ("mc", "empirical")


@dataclass(frozen=True)
class Predictive(PredictiveFamily):
    """A :class:`~spectra.operators.predictive.PredictiveFamily` with this engine's
    sampler."""

    def sample(self, output: Any, logits: Any, num_samples: int, key: Any) -> Any:
        """S = ``num_samples`` label sets drawn from p(y | z), stacked along the batch axis
        (draw s of example i at row s·B + i), as the loss takes labels. ``logits``: the
        logits behind a softmax or sigmoid output the loss reads (None otherwise)."""
        dtype = output.dtype
        if logits is None and self.from_logits:
            logits = output
        if self.family == "categorical":
            if logits is None:  # probabilities: Keras normalizes them, so does the draw
                logits = jnp.log(jnp.maximum(output, jnp.finfo(dtype).tiny))
            draws = jax.random.categorical(
                key, logits, axis=-1, shape=(num_samples, *logits.shape[:-1])
            )
            index = draws.reshape(num_samples * logits.shape[0], *logits.shape[1:-1])
            labels = jax.nn.one_hot(index, logits.shape[-1], dtype=dtype) if self.one_hot else index
        else:
            shape = (num_samples, *output.shape)
            if self.family == "bernoulli":
                p = jax.nn.sigmoid(logits) if logits is not None else output
                draws = (jax.random.uniform(key, shape, dtype) < p[None]).astype(dtype)
            else:
                draws = output[None] + jax.random.normal(key, shape, dtype)
            labels = draws.reshape(num_samples * output.shape[0], *output.shape[1:])
        return jax.lax.stop_gradient(labels)


def predictive_distribution(loss: Any) -> Predictive:
    """The predictive distribution behind a Keras loss spec item, with this engine's
    sampler (:func:`spectra.operators.predictive.predictive_family`: a ``ValueError`` for
    a loss without one)."""
    return Predictive(**dataclasses.asdict(predictive_family(loss)))


def _spec_items(spec: Any) -> list[Any]:
    if isinstance(spec, dict):
        return [v for v in spec.values() if v is not None]
    if isinstance(spec, (list, tuple)):
        return [v for v in spec if v is not None]
    return [spec]


def _stacked(array: Any, copies: int) -> Any:
    """``copies`` copies of ``array`` stacked along its first (batch) axis."""
    return jnp.tile(array, (copies,) + (1,) * (array.ndim - 1))


class FisherCurvature(Curvature):
    """What the Fisher matrices share; :meth:`for_keras` declares the Fisher's keywords of
    ``from_keras`` and chooses :class:`MonteCarloFisher` or :class:`EmpiricalFisher`."""

    title = "Fisher"
    needs_model_outputs = True

    @classmethod
    def for_keras(
        cls, model: Any, loss: Any, *, kind: str = "mc", num_samples: int = 1
    ) -> FisherCurvature:
        """The Fisher of ``kind`` (``"mc"``, default, or ``"empirical"``) for ``model``
        and the loss spec ``loss`` (None: the compiled loss). ``num_samples``: labels drawn
        per example for ``kind="mc"``. The loss must be a mean over examples, and for
        ``kind="mc"`` the negative log-likelihood of a predictive distribution
        (:func:`predictive_distribution`); else a ``ValueError``."""
        if not isinstance(kind, str) or kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got {kind!r}.")
        num_samples = check_int("num_samples", num_samples, minimum=1)
        if kind == "empirical" and num_samples != 1:
            raise ValueError(
                "num_samples is for kind='mc'; the empirical Fisher uses the true labels."
            )
        spec = loss if loss is not None else compiled_loss(model)[0]
        for item in _spec_items(spec):
            check_fisher_reduction(item)
            if kind == "mc":
                predictive_distribution(item)
        if kind == "mc":
            return MonteCarloFisher(num_samples)
        return EmpiricalFisher()


class MonteCarloFisher(FisherCurvature):
    """F_b = Σ_r c_r J_rᵀ ((1/S) Σ_s ∇ℓ_r(ŷ_s) ∇ℓ_r(ŷ_s)ᵀ / κ) J_r, with ŷ_s ~ p(y | z_r)
    drawn once per batch from the batch's key."""

    name = "fisher-mc"
    title = "Monte Carlo Fisher"

    def __init__(self, num_samples: int = 1) -> None:
        self.num_samples = num_samples

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.num_samples)

    def prepare(self, problem: BatchProblem) -> tuple[Any, list[Any], Any]:
        split = OutputSplit(problem)
        structured = problem.program.loss
        model = problem.program.model
        _, labels, sample_weight = unpack_batch(problem.batch)
        outputs, pointed = split.outputs_at(split.points)
        terms = structured.terms(model, labels, outputs, sample_weight)
        samples = self.num_samples
        weighted, unit, static = [], [], []
        for position, term in enumerate(terms):
            index = next((i for i, o in enumerate(pointed) if o is term.output), None)
            if index is None:
                continue
            point = split.points[index]
            activation = split.activation(index)
            distribution = predictive_distribution(term.loss)
            key = jax.random.fold_in(problem.key, position)
            drawn = distribution.sample(
                term.output, None if activation is None else point, samples, key
            )
            weights = term.sample_weight
            if weights is not None:
                weights = _stacked(jnp.asarray(weights), samples)
            loss_object: Any = structured.resolved(term)  # a keras.losses.Loss here

            def output_of(stacked: Any, activation: Any = activation) -> Any:
                return stacked if activation is None else OutputSplit.activate(activation, stacked)

            def value(
                stacked: Any, term: Any = term, drawn: Any = drawn, weights: Any = weights
            ) -> Any:
                # All S draws in one evaluation, as a batch S times as large: its mean is
                # (1/S) Σ_s L_b(ŷ_s), so its gradient at draw s is ∇L_b(ŷ_s)/S.
                replaced = dataclasses.replace(term, output=output_of(stacked))
                return structured.value(replaced, drawn, weights)

            def per_example(
                stacked: Any, drawn: Any = drawn, loss_object: Any = loss_object
            ) -> Any:
                return jnp.sum(loss_object.call(drawn, output_of(stacked)))

            stacked_point = _stacked(point, samples)
            weighted.append(jax.grad(value)(stacked_point))
            unit.append(jax.grad(per_example)(stacked_point))
            last_axis = term.output.shape[-1] if term.output.ndim else 1
            static.append((index, distribution.scale(last_axis)))
        if not static:
            raise ValueError(
                "the loss does not depend on the model's outputs when evaluated on sampled "
                "labels; it cannot define a Monte Carlo Fisher."
            )
        cache = (
            split.linearized,
            weighted,
            unit,
            split.regularization,
            Static((samples, tuple(static))),
        )
        return split.loss, split.gradient, cache

    def apply(self, cache: Any, vector: list[Any]) -> list[Any]:
        linearized, weighted, unit, regularization, static = cache
        samples, factors = static.value
        tangents = OutputSplit.jvp(linearized, vector)
        cotangents = [jnp.zeros_like(t) for t in tangents]
        for (index, scale), w, u in zip(factors, weighted, unit):
            tangent = _stacked(tangents[index], samples)
            inner = jnp.sum(u * tangent, axis=-1, keepdims=True)
            per_draw = (w * inner).reshape(samples, -1, *tangent.shape[1:])
            cotangents[index] = cotangents[index] + jnp.sum(per_draw, axis=0) / scale
        product = OutputSplit.vjp(linearized, cotangents, vector)
        return with_regularization(regularization, product, vector)


class EmpiricalFisher(FisherCurvature):
    """E_b = Σ_i c_i g_i g_iᵀ with g_i = J_iᵀ ∇ℓ_i at the true labels."""

    name = "fisher-empirical"
    title = "empirical Fisher"

    def prepare(self, problem: BatchProblem) -> tuple[Any, list[Any], Any]:
        split = OutputSplit(problem)
        _, _, sample_weight = unpack_batch(problem.batch)
        weighted = split.output_gradients
        if sample_weight is None:
            unit = weighted
        else:
            if isinstance(sample_weight, (list, tuple, dict)):
                raise ValueError(
                    "kind='empirical' weights each example as a whole: give one sample_weight "
                    "array for all outputs, not one per output."
                )
            unit = jax.grad(lambda points: split.output_loss(points, sample_weights=False))(
                split.points
            )
        examples = int(split.points[0].shape[0])
        cache = (split.linearized, weighted, list(unit), split.regularization, Static(examples))
        return split.loss, split.gradient, cache

    def apply(self, cache: Any, vector: list[Any]) -> list[Any]:
        linearized, weighted, unit, regularization, static = cache
        examples = static.value
        tangents = OutputSplit.jvp(linearized, vector)
        # g_iᵀ v / n_b for every example i: the directional derivatives, summed over outputs.
        directional = sum(
            jnp.sum((u * t).reshape(t.shape[0], -1), axis=1) for u, t in zip(unit, tangents)
        )
        cotangents = [
            examples * w * directional.reshape((-1,) + (1,) * (w.ndim - 1)) for w in weighted
        ]
        product = OutputSplit.vjp(linearized, cotangents, vector)
        return with_regularization(regularization, product, vector)


class FisherOperator(CurvatureOperator):
    """A Fisher matrix of a Keras model's loss on JAX, a symmetric PSD ``LinearOperator``.

    ``FisherOperator.from_keras(model, loss, data, kind="mc" | "empirical",
    num_samples=1, seed=0, ...)``: the matrices of
    :class:`spectra.operators.FisherOperator` (its docstring states them), computed as
    the module docstring says. ``seed`` (default 0) keys the sampled labels and, with
    ``training=True``, the Dropout masks; the labels are JAX's draws, so a Monte Carlo
    Fisher is not TensorFlow's matrix draw for draw (both estimate the same Fisher).

    **Cost.** Like a GGN product: J v, a small operation on the outputs (per draw for
    ``kind="mc"``), Jᵀ(·); the sampled labels and the output gradients are cached per
    batch.
    """

    curvature_class = FisherCurvature
    is_positive_semidefinite = True  # sums of outer products (read by spectral_density)
    #: The sampled labels need a seed; it also fixes the Dropout masks in training mode.
    default_seed = 0

    @property
    def kind(self) -> str:
        """``"mc"`` or ``"empirical"``."""
        return "mc" if self.curvature == MonteCarloFisher.name else "empirical"
