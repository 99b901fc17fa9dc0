"""What a JAX curvature operator differentiates: the hook for curvature matrices.

A curvature matrix C of a dataset loss L(θ) = Σ_b (n_b/N) L_b(θ) is a sum of per-batch
matrices C = Σ_b (n_b/N) C_b (:mod:`spectra.operators.curvature` states the convention
for both engines). On JAX a :class:`Curvature` gives two pure functions, both traced and
compiled by the engine (:mod:`spectra.operators.jax.engine`) once per batch shape:

* :meth:`Curvature.prepare` ``(problem) -> (L_b, ∇L_b, cache)``: the batch loss, its
  gradient and the **cache**, a pytree of arrays (and of the linear functions
  ``jax.linearize`` returns, whose leaves are the residuals it keeps) holding everything
  of C_b v that does not depend on v;
* :meth:`Curvature.apply` ``(cache, v) -> C_b v``: the product, linear in v, computed from
  the cache alone (no forward pass, no model call).

The Hessian is ``jax.linearize`` of the gradient (forward-over-reverse, Pearlmutter 1994):
the forward pass and the gradient are computed once, with the residuals the tangent pass
needs, and each product is one evaluation of the linearized gradient. The generalized
Gauss-Newton matrix and the Fisher matrices split the loss at the model's outputs
(:mod:`spectra.operators.jax.ggn`, :mod:`spectra.operators.jax.fisher`).
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import jax

from spectra.operators.jax.models import ModelProgram

__all__ = ["BatchProblem", "Curvature", "Static"]


@jax.tree_util.register_pytree_node_class
class Static:
    """Python values (ints, floats, strings, tuples of them) carried in a cache's structure
    rather than as arrays: part of the compiled function's signature, never traced."""

    def __init__(self, value: Hashable) -> None:
        self.value = value

    def tree_flatten(self) -> tuple[tuple[()], Hashable]:
        return (), self.value

    @classmethod
    def tree_unflatten(cls, value: Hashable, children: Sequence[Any]) -> Static:
        return cls(value)

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


class BatchProblem:
    """One batch of the loss, as a :class:`Curvature` sees it while the engine traces.

    Attributes
    ----------
    params:
        The parameter values θ_1 … θ_m (one array per variable): what is differentiated.
    batch:
        The batch (nested arrays, the structure of the data).
    key:
        A JAX random key, different for every batch and fixed for the operator (from the
        seed and the batch's index): for draws that must be the same in every product (the
        sampled labels of a Monte Carlo Fisher).
    num_examples:
        N, the number of examples of the dataset (a scalar): losses with
        ``reduction="sum"`` scale their batch sums by N/n_b.
    """

    def __init__(
        self,
        program: ModelProgram,
        params: Sequence[Any],
        state: Sequence[Any],
        batch: Any,
        key: Any,
        num_examples: Any,
    ) -> None:
        self.program = program
        self.params = list(params)
        self.state = list(state)
        self.batch = batch
        self.key = key
        self.num_examples = num_examples
        self.dtype = program.dtype

    @property
    def x(self) -> Any:
        return self.batch[0]

    def loss(self, params: Sequence[Any]) -> Any:
        """The batch loss L_b (plus regularization) at ``params``."""
        return self.program.batch_loss(params, self.state, self.batch, self.num_examples)

    def outputs(self, params: Sequence[Any]) -> tuple[Any, Any]:
        """``(outputs, regularization)`` at ``params``: what the loss receives as ``y_pred``
        (nested like the model's outputs) and the sum of the model's losses (or None)."""
        return self.program.outputs(params, self.state, self.x)

    def output_loss(self, outputs: Any, sample_weights: bool = True) -> Any:
        """The data loss of ``outputs`` on this batch (no regularization); without the
        sample weights when ``sample_weights`` is False."""
        batch = self.batch if sample_weights else tuple(self.batch[:2])
        return self.program.output_loss(batch, outputs, self.num_examples)


class Curvature(abc.ABC):
    """How the per-batch curvature product is computed on JAX (the hook for matrices).

    Subclasses set :attr:`name` and :attr:`title` and implement :meth:`prepare` and
    :meth:`apply`; :attr:`key` identifies the compiled functions in the engine cache
    (include any option that changes them). A matrix with keywords of its own in
    ``from_keras`` declares them as the keyword-only parameters of :meth:`for_keras`.
    """

    name: ClassVar[str]
    title: ClassVar[str] = "curvature"
    #: True for matrices split at the model's outputs (GGN, Fisher).
    needs_model_outputs: ClassVar[bool] = False

    @property
    def key(self) -> Hashable:
        return (self.name,)

    @classmethod
    def for_keras(cls, model: Any, loss: Any) -> Curvature:
        """The curvature a ``from_keras`` of this matrix differentiates (the default takes
        no keywords of its own)."""
        return cls()

    @abc.abstractmethod
    def prepare(self, problem: BatchProblem) -> tuple[Any, list[Any], Any]:
        """``(L_b, ∇L_b as one array per variable, cache)``, traced once per batch shape."""

    @abc.abstractmethod
    def apply(self, cache: Any, vector: list[Any]) -> list[Any]:
        """C_b v from the cache, v and the result one array per variable."""
