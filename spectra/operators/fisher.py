"""Fisher matrices of a Keras model's loss as ``LinearOperator`` objects: Monte Carlo and empirical.

Both are sums of outer products of gradients, Jᵀ (Σ g gᵀ) J with g a gradient of the loss
in the model's outputs z, and both are computed like the generalized Gauss-Newton
product (:mod:`spectra.operators.ggn`): J v by a double VJP, then a small operation on the
outputs, then one VJP, without ever forming a per-example gradient in parameter space.

* ``kind="mc"``: labels ŷ drawn from the model's predictive distribution p(y | z),
  fixed per batch, and F = E_ŷ[∇ℓ(ŷ) ∇ℓ(ŷ)ᵀ] estimated with ``num_samples`` draws.
* ``kind="empirical"``: the true labels, E = (1/N) Σ_i g_i g_iᵀ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from spectra._validation import check_int
from spectra.operators import keras_models
from spectra.operators.base import CurvatureOperator
from spectra.operators.curvature import BatchProblem, Curvature, CurvatureParts
from spectra.operators.ggn import OutputSplit
from spectra.operators.losses import check_fisher_reduction
from spectra.operators.predictive import PredictiveFamily, predictive_family

__all__ = [
    "EmpiricalFisher",
    "FisherCurvature",
    "FisherOperator",
    "MonteCarloFisher",
    "predictive_distribution",
]

KINDS = ("mc", "empirical")
# Reductions under which the batch loss is a mean of per-example terms (Keras' default);
# the per-example gradients of the empirical Fisher are read off it.


@dataclass(frozen=True)
class _Predictive(PredictiveFamily):
    """A :class:`~spectra.operators.predictive.PredictiveFamily` with this engine's
    sampler."""

    def sample(
        self, output: tf.Tensor, point: tf.Tensor, num_samples: int, seed: tf.Tensor
    ) -> tf.Tensor:
        """S = ``num_samples`` label sets drawn from p(y | z), stacked along the batch axis
        (draw s of example i at row s·B + i), as the loss takes labels.

        ``point`` is where the loss reads the output: the logits behind a softmax or
        sigmoid when it is not ``output`` itself.
        """
        dtype = output.dtype
        logits = point if point is not output else (output if self.from_logits else None)
        if self.family == "categorical":
            if logits is None:  # probabilities: Keras normalizes them, so does the draw
                logits = tf.math.log(tf.maximum(output, np.finfo(dtype.as_numpy_dtype).tiny))
            classes = tf.shape(logits)[-1]
            draws = tf.random.stateless_categorical(
                tf.reshape(logits, [-1, classes]), num_samples, seed, dtype=tf.int64
            )
            index = tf.reshape(
                tf.transpose(draws), _stacked_shape(tf.shape(logits)[:-1], num_samples)
            )
            labels = tf.one_hot(index, classes, dtype=dtype) if self.one_hot else index
        else:
            shape = tf.concat([[num_samples], tf.shape(output)], axis=0)
            if self.family == "bernoulli":
                p = tf.sigmoid(logits) if logits is not None else output
                uniform = tf.random.stateless_uniform(shape, seed, dtype=dtype)
                draws = tf.cast(uniform < p[None], dtype)
            else:
                draws = output[None] + tf.random.stateless_normal(shape, seed, dtype=dtype)
            labels = tf.reshape(draws, _stacked_shape(tf.shape(output), num_samples))
        return tf.stop_gradient(labels)


def _stacked_shape(shape: tf.Tensor, copies: int) -> tf.Tensor:
    """``shape`` with its first (batch) axis ``copies`` times as long."""
    return tf.concat([[copies * shape[0]], shape[1:]], axis=0)


def _stacked(tensor: tf.Tensor, copies: int) -> tf.Tensor:
    """``copies`` copies of ``tensor`` stacked along its first (batch) axis."""
    return tf.tile(tensor, [copies] + [1] * (tensor.shape.rank - 1))


def _stacked_output(
    output: tf.Tensor, point: tf.Tensor, copies: int
) -> tuple[tf.Tensor, tf.Tensor]:
    """Copies of the split point and of the output computed from them, so that the loss
    of all copies reads the stacked point as it reads the point."""
    stacked = _stacked(point, copies)
    if point is output:
        return stacked, stacked
    if output.op.type == "Softmax":
        return stacked, keras.activations.softmax(stacked)
    if output.op.type == "Sigmoid":
        return stacked, keras.activations.sigmoid(stacked)
    raise ValueError(
        f"kind='mc': the loss reads the logits behind the output {output.name!r} (a "
        f"{output.op.type} op), which spectra cannot recompute for sampled labels. End the "
        "model with a softmax over the last axis or a sigmoid, or return the logits and "
        "use a loss with from_logits=True."
    )


def last_axis_size(output: tf.Tensor) -> int | None:
    """The size of ``output``'s last axis (1 for a scalar; None where it is unknown)."""
    return output.shape[-1] if output.shape.rank else 1


def predictive_distribution(loss: Any) -> _Predictive:
    """The predictive distribution behind a Keras loss spec item, with this engine's
    sampler (:func:`spectra.operators.predictive.predictive_family`: a ``ValueError`` for
    a loss without one)."""
    return _Predictive(**dataclasses.asdict(predictive_family(loss)))


class FisherCurvature(Curvature):
    """What the Fisher matrices share: the output split and the loss per output.

    :meth:`for_keras` declares the Fisher's keywords of ``from_keras`` and chooses the
    matrix: :class:`MonteCarloFisher` or :class:`EmpiricalFisher`.
    """

    title = "Fisher"
    needs_model_outputs = True

    def __init__(self, model: Any, loss: Any, loss_weights: Any) -> None:
        self._model = model
        self._loss = loss
        self._loss_weights = loss_weights

    @classmethod
    def for_keras(
        cls, model: Any, loss: Any, *, kind: str = "mc", num_samples: int = 1
    ) -> FisherCurvature:
        """The Fisher of ``kind`` (``"mc"``, default, or ``"empirical"``) for ``model``
        and the loss spec ``loss`` (None: the compiled loss).

        ``num_samples``: labels drawn per example for ``kind="mc"`` (an int ≥ 1; the
        empirical Fisher uses the true labels and must keep the default). The loss must
        be a mean over examples (not ``reduction="sum"``), and for ``kind="mc"`` the
        negative log-likelihood of a predictive distribution (see
        :func:`predictive_distribution`); else a ``ValueError``.
        """
        if not isinstance(kind, str) or kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got {kind!r}.")
        num_samples = check_int("num_samples", num_samples, minimum=1)
        if kind == "empirical" and num_samples != 1:
            raise ValueError(
                "num_samples is for kind='mc'; the empirical Fisher uses the true labels."
            )
        spec, loss_weights = (loss, None) if loss is not None else keras_models.compiled_loss(model)
        for item in tf.nest.flatten(spec):
            if item is None:
                continue
            check_fisher_reduction(item)
            if kind == "mc":
                predictive_distribution(item)
        if kind == "mc":
            return MonteCarloFisher(model, spec, loss_weights, num_samples)
        return EmpiricalFisher(model, spec, loss_weights)

    def _structured(self, problem: BatchProblem) -> keras_models.StructuredLoss:
        return keras_models.StructuredLoss(self._loss, self._loss_weights, problem.dtype)


class _SampledGradients(NamedTuple):
    """One output's part of the Monte Carlo Fisher product, at its split point z.

    ``point`` is the index of z among the split points; ``weighted`` the gradients
    ∂(weighted loss)/∂z at the S stacked label draws, ``unit`` those of the unweighted
    per-example losses (the directional derivatives ∇ℓ(ŷ)ᵀ J v are taken with them); and
    ``scale`` is κ (ℓ = κ·(−log p)).
    """

    point: int
    weighted: tf.Tensor
    unit: tf.Tensor
    scale: float


class MonteCarloFisher(FisherCurvature):
    """F_b = Σ_r c_r J_rᵀ ((1/S) Σ_s ∇ℓ_r(ŷ_s) ∇ℓ_r(ŷ_s)ᵀ / κ) J_r, with ŷ_s ~ p(y | z_r)
    drawn once per batch from :attr:`BatchProblem.seed`."""

    name = "fisher-mc"
    title = "Monte Carlo Fisher"

    def __init__(self, model: Any, loss: Any, loss_weights: Any, num_samples: int) -> None:
        super().__init__(model, loss, loss_weights)
        self.num_samples = num_samples

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.num_samples)

    def build(self, problem: BatchProblem) -> CurvatureParts:
        split = OutputSplit(problem)
        _, labels, sample_weight = keras_models.unpack_batch(problem.batch)
        structured = self._structured(problem)
        terms = structured.terms(self._model, labels, split.outputs, sample_weight)
        samples = self.num_samples
        factors = []
        for position, term in enumerate(terms):
            point = split.point(term.output)
            if point is None:
                continue
            output = tf.convert_to_tensor(term.output)
            distribution = predictive_distribution(term.loss)
            seed = tf.random.experimental.stateless_fold_in(problem.seed, position)
            labels = distribution.sample(output, point, samples, seed)
            # All S draws in one evaluation of the loss, as a batch S times as large: its
            # mean is (1/S) Σ_s L_b(ŷ_s), so its gradient at draw s is ∇L_b(ŷ_s)/S.
            points, outputs = _stacked_output(output, point, samples)
            weights = term.sample_weight
            if weights is not None:
                weights = _stacked(tf.convert_to_tensor(weights), samples)
            stacked_term = dataclasses.replace(term, output=outputs)
            value = structured.value(stacked_term, labels, weights)
            weighted = tf.gradients(value, points)[0]
            loss_object: Any = structured.resolved(term)  # a keras.losses.Loss here
            per_example = loss_object.call(labels, outputs)
            unit = tf.gradients(tf.reduce_sum(per_example), points)[0]
            if weighted is None or unit is None:
                raise ValueError(
                    f"the loss of output {term.name!r} does not depend on the output when "
                    "evaluated on sampled labels; it cannot define a Monte Carlo Fisher."
                )
            index = next(i for i, p in enumerate(split.points) if p is point)
            kappa = distribution.scale(last_axis_size(output))
            factors.append(_SampledGradients(index, weighted, unit, kappa))

        def product(vector: tf.Tensor) -> tf.Tensor:
            tangents = split.jvp(vector)
            cotangents = [tf.zeros_like(p) for p in split.points]
            for factor in factors:
                tangent = _stacked(tangents[factor.point], samples)
                inner = tf.reduce_sum(factor.unit * tangent, axis=-1, keepdims=True)
                per_draw = tf.reshape(
                    factor.weighted * inner,
                    tf.concat([[samples, -1], tf.shape(tangent)[1:]], axis=0),
                )
                cotangents[factor.point] += tf.reduce_sum(per_draw, axis=0) / factor.scale
            return split.with_regularization(split.vjp(cotangents), vector)

        return CurvatureParts(split.loss, split.gradient, product)


class EmpiricalFisher(FisherCurvature):
    """E_b = Σ_i c_i g_i g_iᵀ with g_i = J_iᵀ ∇ℓ_i at the true labels."""

    name = "fisher-empirical"
    title = "empirical Fisher"

    def build(self, problem: BatchProblem) -> CurvatureParts:
        split = OutputSplit(problem)
        _, labels, sample_weight = keras_models.unpack_batch(problem.batch)
        weighted = split.output_gradients
        if sample_weight is None:
            unit = weighted
        else:
            if isinstance(sample_weight, (list, tuple, dict)):
                raise ValueError(
                    "kind='empirical' weights each example as a whole: give one sample_weight "
                    "array for all outputs, not one per output."
                )
            unweighted = self._structured(problem)(self._model, labels, split.outputs, None)
            unit = split.gradients_at_points(unweighted)
        examples = tf.cast(tf.shape(split.points[0])[0], problem.dtype)

        def product(vector: tf.Tensor) -> tf.Tensor:
            tangents = split.jvp(vector)
            # g_iᵀ v / B for every example i: the directional derivatives, summed over outputs.
            directional = tf.add_n(
                [
                    tf.reduce_sum(tf.reshape(u * t, [tf.shape(t)[0], -1]), axis=1)
                    for u, t in zip(unit, tangents)
                ]
            )
            cotangents = [
                examples * w * tf.reshape(directional, [-1] + [1] * (w.shape.rank - 1))
                for w in weighted
            ]
            return split.with_regularization(split.vjp(cotangents), vector)

        return CurvatureParts(split.loss, split.gradient, product)


class FisherOperator(CurvatureOperator):
    """A Fisher matrix of a Keras model's loss, a symmetric PSD ``LinearOperator``.

    Both kinds are sums over examples of outer products of gradients, weighted like the
    loss. With J_i = ∂z_i/∂θ the Jacobian of example i's outputs, w_i its sample weight
    (1 without), n_b the size of its batch and λ the loss weight of an output (1 for a
    single output), c_i = λ·w_i/n_b is the example's weight in the batch loss
    L_b = Σ_i c_i ℓ_i (Keras' mean):

    * ``kind="mc"`` (Monte Carlo Fisher)::

          F = Σ_b (n_b/N) Σ_i c_i J_iᵀ [ (1/S) Σ_s ∇_zℓ_i(ŷ_is) ∇_zℓ_i(ŷ_is)ᵀ / κ ] J_i

      with S = ``num_samples`` labels ŷ_is drawn from the model's predictive distribution
      p(y | z_i): categorical for (sparse or one-hot) cross-entropy, from logits or from
      probabilities; Bernoulli for binary cross-entropy, one label per output entry;
      Gaussian N(z_i, I) of unit variance for MSE. κ makes ℓ = κ·(−log p): 1 for the
      cross-entropy, 1/d for the binary cross-entropy and 2/d for MSE, which Keras
      average over the d entries of the last axis. The labels are drawn once per batch
      from a stateless generator seeded with ``[seed, batch index]`` (and the output's
      position), so the operator is a fixed symmetric PSD matrix: every product, cached
      or streaming, sees the same labels. E_ŷ[F] is the true Fisher, which for
      cross-entropy (on logits, or on probabilities from a softmax/sigmoid activation)
      and MSE equals the generalized Gauss-Newton matrix
      (:class:`~spectra.operators.GGNOperator`; Martens 2014); the Monte Carlo error
      shrinks like 1/√(S·N). With several outputs the labels of each are drawn
      independently and F is block diagonal across outputs, like the GGN. Losses with no
      predictive distribution (custom callables, label smoothing, hinge, ...) are refused.
    * ``kind="empirical"`` (empirical Fisher)::

          E = Σ_b (n_b/N) Σ_i (w_i/n_b) g_i g_iᵀ,   g_i = J_iᵀ ∇_zℓ_i(y_i) = ∇_θ ℓ_i

      with the true labels: (1/N) Σ_i g_i g_iᵀ without sample weights, where g_i is the
      gradient of example i's whole loss ℓ_i = Σ_o λ_o ℓ_io (all outputs with their loss
      weights, so cross-output terms are included). A sample weight multiplies an
      example's term once, as it does in the loss (it counts the example w_i times); it
      must be one array for all outputs. Any loss that is a mean of per-example terms
      works, custom callables included. ℓ_i is Keras' per-example loss: for MSE the mean
      over the C output entries, so curvlinops' empirical Fisher (per-example loss summed
      over the outputs, reduction factor 1/(N·C)) is exactly C·E; for cross-entropy the
      two agree.

    **Building.** ``FisherOperator.from_keras(model, loss, data, kind=..., num_samples=...,
    seed=...)``: ``kind`` and ``num_samples`` are the Fisher's own keywords
    (:meth:`FisherCurvature.for_keras`), the others those of every matrix
    (:meth:`~spectra.operators.base.CurvatureOperator.from_keras`). ``seed`` (an int ≥ 0,
    default 0) seeds the sampled labels and, with ``training=True``, the Dropout masks;
    ``None`` draws the masks from the model's own seed states and the labels from seed 0.

    Kunstner, Hennig and Balles (2019) show that the empirical Fisher is not an
    approximation of the Fisher or of the Hessian in general: it is the uncentered
    covariance of the gradients, and near a minimum it reflects gradient noise rather
    than curvature; its eigenvectors need not align with the Hessian's. Use it knowing
    that; the Monte Carlo Fisher is the unbiased estimate of the Fisher.

    **Computation.** No per-example gradient is formed. A product computes J v for
    all examples at once (the double VJP of the GGN product), the per-example (or
    per-label) directional derivatives ∇ℓ_iᵀ J_i v on the outputs, weights the output
    gradients by them, and maps back with one VJP: Jᵀ(Σ_s c g_s (g_sᵀ J v)). The
    forward pass, the sampled labels and the output gradients are cached per batch,
    so a product costs about as much as a GGN product (about two gradients). The
    regularization enters with its exact Hessian ∇²R, as in the GGN (2λI for an L2
    kernel regularizer; ``include_regularization=False`` leaves it out).

    References: J. Martens, "New insights and perspectives on the natural gradient
    method", JMLR 21 (2020; arXiv:1412.1193). F. Kunstner, P. Hennig, L. Balles,
    "Limitations of the empirical Fisher approximation for natural gradient descent",
    NeurIPS 2019.
    """

    curvature_class = FisherCurvature
    is_positive_semidefinite = True  # sums of outer products (read by spectral_density)
    #: The sampled labels need a seed; it also fixes the Dropout masks in training mode.
    default_seed = 0

    @property
    def kind(self) -> str:
        """``"mc"`` or ``"empirical"``."""
        return "mc" if self.curvature == MonteCarloFisher.name else "empirical"
