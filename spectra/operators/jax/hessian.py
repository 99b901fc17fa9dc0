"""The loss Hessian of a Keras model on JAX, as a SciPy ``LinearOperator``.

H = Σ_b (n_b/N) ∇²L_b(θ) at the weights the operator was built with. Per batch,
``jax.linearize`` of the gradient θ ↦ ∇L_b(θ) (forward-over-reverse differentiation,
Pearlmutter 1994; never reverse-over-reverse) computes the forward pass and the gradient
once and keeps the residuals the tangent pass needs; each product H_b v is one evaluation
of the linearized gradient: the tangent of the forward pass and of the backward pass,
about two gradients of arithmetic (measured in :mod:`spectra.operators.jax.engine`).

Reference: B. A. Pearlmutter, "Fast exact multiplication by the Hessian", Neural
Computation 6 (1994).
"""

from __future__ import annotations

from typing import Any

import jax

from spectra.operators.jax.base import CurvatureOperator
from spectra.operators.jax.curvature import BatchProblem, Curvature

__all__ = ["Hessian", "HessianOperator"]


class Hessian(Curvature):
    """The Hessian ∇²L_b: ``jax.linearize`` of the gradient of the batch loss."""

    name = "hessian"
    title = "Hessian"

    def prepare(self, problem: BatchProblem) -> tuple[Any, list[Any], Any]:
        def gradient(params: list[Any]) -> tuple[list[Any], Any]:
            loss, grads = jax.value_and_grad(problem.loss)(params)
            return grads, loss

        grads, linearized, loss = jax.linearize(gradient, problem.params, has_aux=True)
        return loss, grads, linearized

    def apply(self, cache: Any, vector: list[Any]) -> list[Any]:
        return list(cache(vector))


class HessianOperator(CurvatureOperator):
    """The Hessian of a Keras model's dataset loss on JAX, a symmetric ``LinearOperator``.

    ``HessianOperator.from_keras(model, loss, data, ...)``
    (:meth:`~spectra.operators.jax.base.CurvatureOperator.from_keras`; the semantics are
    the TensorFlow operator's, :class:`spectra.operators.HessianOperator`):
    H v = Σ_b (n_b/N) ∇²L_b(θ) v at the snapshot of the weights.

    **Cost.** Per batch, once: the forward pass, the gradient and the residuals of its
    linearization (about 1.3 gradients on the measured MLP; the batch's cache, kept while
    it fits the memory budget). Per product: one evaluation of the linearized gradient
    (about 2 gradients), one data pass per ``matmat`` of any number of vectors.
    """

    curvature_class = Hessian
