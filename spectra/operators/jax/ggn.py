"""The generalized Gauss-Newton matrix of a Keras model's loss on JAX.

The batch loss is split at the model's outputs z (what the loss receives as ``y_pred``,
or the logits behind a softmax or sigmoid output when a Keras cross-entropy reads them,
as on TensorFlow: :func:`spectra._jax_compat.keras_logits`):
L_b(θ) = ℓ_b(z(θ)) + R(θ), with R the regularization (``model.losses``), and

    G = Σ_b (n_b/N) [ J_bᵀ (∇²_z ℓ_b) J_b + ∇²R ],     J_b = ∂z/∂θ on batch b

(Schraudolph 2002; Martens 2014; the TensorFlow operator,
:class:`spectra.operators.GGNOperator`, states the conventions). Per batch,
:class:`OutputSplit` keeps ``jax.linearize`` of θ ↦ z (the forward pass and its
residuals: J v is one evaluation, Jᵀ u its transpose, ``jax.linear_transpose``, with the
same residuals), ``jax.linearize`` of z ↦ ∇_zℓ (∇²_zℓ t on the outputs only) and, with
regularization, of θ ↦ ∇R. A product is J v, ∇²_zℓ (J v) and Jᵀ(·): a forward pass of
tangents and one backward pass, without a second derivative through the network.

References: N. Schraudolph, "Fast curvature matrix-vector products for second-order
gradient descent", Neural Computation 14 (2002). J. Martens, "New insights and
perspectives on the natural gradient method", JMLR 21 (2020; arXiv:1412.1193, 2014).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spectra import _jax_compat
from spectra.operators.jax.base import CurvatureOperator
from spectra.operators.jax.curvature import BatchProblem, Curvature
from spectra.operators.keras_calls import unpack_batch
from spectra.operators.losses import output_entries

__all__ = ["GGN", "GGNOperator", "OutputSplit"]


class OutputSplit:
    """One batch's loss split at the model's outputs, as the GGN and Fisher products use it
    (built while ``prepare`` is traced, within the engine's
    :func:`~spectra._jax_compat.keras_logits` registry).

    Attributes
    ----------
    points:
        The split points z_1 … z_m: one array per output the data loss reads, that output
        itself or, for a Keras cross-entropy of a softmax or sigmoid output, the logits
        behind it (the array the loss differentiates).
    linearized:
        θ ↦ (z_1 … z_m) linearized at the snapshot: :meth:`jvp` and :meth:`vjp` use it.
    output_gradients:
        ∂ℓ/∂z_j, the data loss's gradient at each point.
    output_hessian:
        z ↦ ∇_zℓ linearized: t ↦ ∇²_zℓ t (block diagonal across outputs).
    regularization:
        θ ↦ ∇R linearized (None without regularization): v ↦ ∇²R v, exact (2λ v on a
        kernel with L2(λ); activity regularizers through the network).
    loss, gradient:
        The batch loss ℓ + R and its gradient Jᵀ∇_zℓ + ∇R (one array per variable).
    """

    def __init__(self, problem: BatchProblem) -> None:
        self._problem = problem
        model = problem.program.model
        _, labels, sample_weight = unpack_batch(problem.batch)
        registry = _jax_compat.current_logits()
        layout: dict[str, Any] = {}

        def points_of(params: list[Any]) -> tuple[list[Any], tuple[Any, ...]]:
            outputs, regularization = problem.outputs(params)
            data_loss = problem.output_loss(outputs)
            terms = problem.program.loss.terms(model, labels, outputs, sample_weight)
            read = {id(term.output) for term in terms}
            entries = output_entries(model, outputs)
            points: list[Any] = []
            constants: list[Any] = []
            activations: list[tuple[str, Any] | None] = []
            for _, output in entries:
                floating = jnp.issubdtype(jnp.result_type(output), jnp.floating)
                if id(output) not in read or not floating:
                    constants.append(output)
                    activations.append(None)
                    continue
                found = None
                if registry is not None and registry.was_read(output):
                    found = registry.logits_of(output)
                points.append(output if found is None else found[0])
                activations.append(None if found is None else (found[1], found[2]))
                constants.append(None)
            layout["structure"] = _structure(outputs, [name for name, _ in entries])
            layout["activations"] = activations
            return points, (data_loss, regularization, constants)

        points, linearized, aux = jax.linearize(points_of, problem.params, has_aux=True)
        _, regularization, constants = aux
        if not points:
            raise ValueError(
                "the loss does not depend on the model's outputs: there is no output curvature."
            )
        self.points = list(points)
        self.linearized = linearized
        self._structure = layout["structure"]
        self._activations = layout["activations"]
        self._constants = constants

        def value_and_gradient(points: list[Any]) -> tuple[list[Any], Any]:
            value, grads = jax.value_and_grad(self.output_loss)(points)
            return grads, value

        grads, output_hessian, value = jax.linearize(value_and_gradient, self.points, has_aux=True)
        self.data_loss = value
        self.output_gradients = list(grads)
        self.output_hessian = output_hessian
        (data_gradient,) = jax.linear_transpose(linearized, problem.params)(self.output_gradients)
        if regularization is None:
            self.regularization = None
            self.loss = value
            self.gradient = list(data_gradient)
        else:

            def regularization_gradient(params: list[Any]) -> Any:
                return jax.grad(lambda p: problem.outputs(p)[1])(params)

            reg_gradient, self.regularization = jax.linearize(
                regularization_gradient, problem.params
            )
            self.loss = value + regularization
            self.gradient = [d + r for d, r in zip(data_gradient, reg_gradient)]

    def outputs_at(self, points: list[Any]) -> tuple[Any, list[Any]]:
        """The model's outputs rebuilt from split points (a softmax or sigmoid recomputed
        from its logits, recorded so that a cross-entropy reads the logits again), and the
        output of each point."""
        values, pointed, remaining = [], [], iter(points)
        for activation, constant in zip(self._activations, self._constants):
            if constant is not None:
                values.append(constant)
                continue
            point = next(remaining)
            output = point if activation is None else self.activate(activation, point)
            values.append(output)
            pointed.append(output)
        kind, names = self._structure
        if kind == "dict":
            return dict(zip(names, values)), pointed
        if kind == "list":
            return list(values), pointed
        if kind == "tuple":
            return tuple(values), pointed
        return values[0], pointed

    def activation(self, index: int) -> tuple[str, Any] | None:
        """``(kind, axis)`` of the activation between point ``index`` and its output (None
        when the point is the output)."""
        return [a for a, c in zip(self._activations, self._constants) if c is None][index]

    @staticmethod
    def activate(activation: tuple[str, Any], point: Any) -> Any:
        """The output of a softmax or sigmoid ``activation`` at logits ``point``, recorded."""
        kind, axis = activation
        if kind == "softmax":
            return _jax_compat.activation_of("softmax")(point, axis=axis)
        return _jax_compat.activation_of(kind)(point)

    def output_loss(self, points: list[Any], sample_weights: bool = True) -> Any:
        """The data loss ℓ as a function of the split points."""
        return self._problem.output_loss(self.outputs_at(points)[0], sample_weights)

    @staticmethod
    def jvp(cache_linearized: Any, vector: list[Any]) -> list[Any]:
        """J v at every split point."""
        return list(cache_linearized(vector))

    @staticmethod
    def vjp(cache_linearized: Any, cotangents: list[Any], like: list[Any]) -> list[Any]:
        """Jᵀ u for cotangents u at the split points (``like``: arrays shaped like θ)."""
        (result,) = jax.linear_transpose(cache_linearized, like)(list(cotangents))
        return list(result)


def _structure(outputs: Any, names: list[str]) -> tuple[str, list[str]]:
    if isinstance(outputs, dict):
        return "dict", names
    if isinstance(outputs, list):
        return "list", names
    if isinstance(outputs, tuple):
        return "tuple", names
    return "single", names


def with_regularization(regularization: Any, product: list[Any], vector: list[Any]) -> list[Any]:
    """``product + ∇²R v`` (``regularization``: the linearized ∇R, or None)."""
    if regularization is None:
        return product
    return [p + r for p, r in zip(product, regularization(vector))]


class GGN(Curvature):
    """The generalized Gauss-Newton matrix Jᵀ ∇²_zℓ J + ∇²R of one batch."""

    name = "ggn"
    title = "generalized Gauss-Newton"
    needs_model_outputs = True

    def prepare(self, problem: BatchProblem) -> tuple[Any, list[Any], Any]:
        split = OutputSplit(problem)
        cache = (split.linearized, split.output_hessian, split.regularization)
        return split.loss, split.gradient, cache

    def apply(self, cache: Any, vector: list[Any]) -> list[Any]:
        linearized, output_hessian, regularization = cache
        tangents = OutputSplit.jvp(linearized, vector)
        curved = list(output_hessian(tangents))
        product = OutputSplit.vjp(linearized, curved, vector)
        return with_regularization(regularization, product, vector)


class GGNOperator(CurvatureOperator):
    """The generalized Gauss-Newton matrix of a Keras model's loss on JAX, a symmetric
    ``LinearOperator`` (positive semi-definite for a loss convex in z).

    ``GGNOperator.from_keras(model, loss, data, ...)``: the matrix of
    :class:`spectra.operators.GGNOperator` (whose docstring states where z is, the
    regularization's exact Hessian, and when G equals the Fisher), computed as the module
    docstring says.

    **Cost.** Per batch, once: the forward pass with its residuals, the output gradients
    and the data gradient (one backward pass through the transposed linearization): about
    1.0 gradient on the measured MLP. Per product: J v (a forward pass of tangents),
    ∇²_zℓ on the outputs, Jᵀ(·) (one backward pass), plus ∇²R v with regularization:
    about 1.4 gradients.
    """

    curvature_class = GGN
    is_positive_semidefinite = True  # for a loss convex in z (spectral_density checks)
