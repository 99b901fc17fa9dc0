"""What a curvature operator differentiates: the hook for new curvature matrices.

A curvature matrix C of a dataset loss L(θ) = Σ_b (n_b/N) L_b(θ) is a sum of per-batch
matrices C = Σ_b (n_b/N) C_b. A :class:`Curvature` says how C_b v is computed on one
batch: its :meth:`Curvature.build` is called once, while the engine traces the batch
computation into a graph, with a :class:`BatchProblem` (the batch loss, the parameters,
and for Keras models the split at the model's output), and returns the batch loss, its
gradient and a function ``product(v) -> C_b v``. Everything else — snapshot of the
weights, batches and their weights, caching of the vector-independent part of the
graph, blocks of vectors, replicas, counters, flattening — is common
(:class:`spectra.operators.base.CurvatureOperator`).

A curvature is a small class (this is :class:`~spectra.operators.hessian.Hessian`)::

    class Hessian(Curvature):
        name = "hessian"
        title = "Hessian"

        def build(self, problem):
            loss = problem.loss()
            grads = problem.gradients(loss)           # ∇L_b, dense, one per block

            def product(v):                           # H_b v = ∇_θ (∇L_b · v)
                return problem.flatten(problem.vjp(grads, problem.unflatten(v)))

            return CurvatureParts(loss, problem.flatten(grads), product)

``product`` is traced once, for a single vector (a block maps the compiled product over
its rows; the recomputing fallback also traces it inside ``tf.map_fn``); whatever of it
does not depend on v is computed once per batch and cached by the engine.
Derivatives are symbolic (``tf.gradients`` in the traced graph, through
:meth:`BatchProblem.gradients` and :meth:`BatchProblem.vjp`): tracing nested tapes
through the loops of recurrent layers took about twice as long. A matrix split at the
model's output (generalized Gauss-Newton Jᵀ H_z J, Fisher) sets
``needs_model_outputs = True`` and builds from :meth:`BatchProblem.model_outputs` and
:meth:`BatchProblem.output_loss`; J v is a double VJP (the VJP of a VJP with a dummy
cotangent, linear in it) or ``tf.autodiff.ForwardAccumulator`` on
:attr:`BatchProblem.parameters`; Jᵀ u is :meth:`BatchProblem.vjp`. Per-batch random
draws (sampled labels) use :attr:`BatchProblem.seed`.

Its operator is a subclass naming it, and the matrix one line of
:mod:`spectra.operators.registry` (which the ``spectra`` exports and the CLI's
``--curvature`` read)::

    class HessianOperator(CurvatureOperator):
        curvature_class = Hessian

``from_keras`` is the base class's; a matrix with keywords of its own declares them as
the keyword-only parameters of its :meth:`Curvature.for_keras` (the Fisher's ``kind``
and ``num_samples``), which builds the curvature from them.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import tensorflow as tf

from spectra import _tf_compat

__all__ = ["BatchProblem", "Curvature", "CurvatureParts", "FunctionProgram", "Program"]


@dataclass
class CurvatureParts:
    """What :meth:`Curvature.build` returns: the batch loss, its flat gradient, and the
    flat product ``v -> C_b v`` (vectors of length n in the parameters' dtype)."""

    loss: tf.Tensor
    gradient: tf.Tensor
    product: Callable[[tf.Tensor], tf.Tensor]


class Curvature(abc.ABC):
    """How the per-batch curvature product is computed (the hook for new matrices).

    Subclasses set :attr:`name` and implement :meth:`build`. :attr:`key` identifies the
    compiled engine in the engine cache (include any option that changes the graph).
    """

    name: ClassVar[str]
    #: How messages name the matrix ("Hessian", "generalized Gauss-Newton", ...).
    title: ClassVar[str] = "curvature"
    #: True for matrices that need the split at the model's output (GGN, Fisher): they
    #: can only be built from Keras models (:meth:`BatchProblem.model_outputs`).
    needs_model_outputs: ClassVar[bool] = False

    @property
    def key(self) -> Hashable:
        return (self.name,)

    @classmethod
    def for_keras(cls, model: Any, loss: Any) -> Curvature:
        """The curvature a ``from_keras`` of this matrix differentiates, for ``model`` and
        the loss spec ``loss`` (None: the compiled loss), called after the model is
        checked.

        The curvature-specific keywords of ``from_keras`` are the keyword-only
        parameters of this method: a matrix with options (the Fisher's ``kind`` and
        ``num_samples``) overrides it to declare them, check them and choose or set up
        its curvature; ``from_keras`` refuses any other keyword. The default takes none.
        """
        return cls()

    @abc.abstractmethod
    def build(self, problem: BatchProblem) -> CurvatureParts:
        """Trace the batch loss, its gradient and the product (called once per engine)."""


class Program(Protocol):
    """The loss of one batch as a function of (state values, batch): what engines trace."""

    dtype: tf.DType

    @property
    def state_specs(self) -> list[tf.TensorSpec]: ...

    def parameter_names(self) -> list[str]: ...

    def parameter_shapes(self) -> list[tuple[int, ...]]: ...

    def parameters(self, state: Sequence[tf.Tensor]) -> list[Any]: ...

    def batch_loss(
        self, state: Sequence[tf.Tensor], batch: Any, *, num_examples: tf.Tensor | None = None
    ) -> tf.Tensor: ...


class FunctionProgram:
    """``loss_fn(batch)`` (or ``loss_fn()``) of ``tf.Variable`` parameters.

    There are no state inputs: the variables are read by the traced graph through their
    handles, which the engine turns into inputs so that each operator can feed the
    handles of its own snapshot variables.
    """

    def __init__(self, loss_fn: Callable[..., Any], variables: Sequence[tf.Variable]) -> None:
        self.loss_fn = loss_fn
        self.variables = list(variables)
        self.dtype = self.variables[0].dtype.base_dtype
        self.takes_batch = True

    @property
    def state_specs(self) -> list[tf.TensorSpec]:
        return []

    def parameter_names(self) -> list[str]:
        return [variable_name(v) for v in self.variables]

    def parameter_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(v.shape.as_list()) for v in self.variables]

    def parameters(self, state: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The variables' handles as the traced graph sees them (what reads consume).

        Differentiating with respect to the captured handle (as ``tf.gradients`` does for
        a variable) keeps the parameters tensors of the outer graph, so the products of
        a block, traced inside a loop body, still reach them.
        """
        return [_graph_handle(v) for v in self.variables]

    def batch_loss(
        self, state: Sequence[tf.Tensor], batch: Any, *, num_examples: tf.Tensor | None = None
    ) -> tf.Tensor:
        """``loss_fn(batch)``: the user's batch loss, taken as the mean over the batch
        (``num_examples`` is not used)."""
        return self.loss_fn(batch) if self.takes_batch else self.loss_fn()


def _graph_handle(variable: tf.Variable) -> tf.Tensor:
    """The tensor through which the graph being traced reads ``variable``."""
    handle = variable.handle
    if tf.executing_eagerly():
        return handle
    # An eager handle used in a graph is captured as a placeholder (the same one every
    # read uses).
    return _tf_compat.captured_placeholder(handle)


def variable_name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "<unnamed>"))


class BatchProblem:
    """One batch of the loss, as a :class:`Curvature` sees it while the engine traces.

    Attributes
    ----------
    parameters:
        The parameter blocks θ_1 … θ_m (tensors for Keras models, ``tf.Variable`` for a
        ``loss_fn``): what tapes watch. The flat parameter vector is their row-major
        concatenation.
    shapes, sizes, dtype, names:
        Their shapes, entry counts, common dtype and names.
    batch:
        The batch (nested tensors, the structure of the data).
    seed:
        An int64 tensor of shape (2,), different for every batch and fixed for the
        operator (``[seed, batch index]``): a seed for ``tf.random.stateless_*`` draws
        that must be the same in every product (e.g. sampled labels of a Monte Carlo
        Fisher).
    num_examples:
        An int64 scalar tensor: the number of examples N of the whole dataset (1 without
        data). Losses with ``reduction="sum"`` scale their batch sums by N/n_b, so that
        the weighted sum Σ_b (n_b/N) L_b is the sum over the dataset whatever the batching.
    """

    def __init__(
        self,
        program: Program,
        state: Sequence[tf.Tensor],
        batch: Any,
        seed: tf.Tensor,
        *,
        num_examples: tf.Tensor | None = None,
        allow_unused: bool,
    ) -> None:
        self._program = program
        self._state = list(state)
        self.batch = batch
        self.seed = seed
        self.num_examples = num_examples
        self.parameters = program.parameters(self._state)
        self.shapes = program.parameter_shapes()
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.dtype = program.dtype
        self.names = program.parameter_names()
        self._allow_unused = allow_unused

    # -- the loss -------------------------------------------------------------------
    def loss(self) -> tf.Tensor:
        """The batch loss L_b (plus regularization), a checked scalar: the engine weights
        it by n_b/N (see :meth:`spectra.operators.base.CurvatureOperator.from_keras` for what
        L_b is for each Keras loss reduction)."""
        loss = self._program.batch_loss(self._state, self.batch, num_examples=self.num_examples)
        return self.check_loss(loss)

    def model_outputs(self) -> tuple[Any, tf.Tensor | None]:
        """Keras models only: ``(outputs, regularization)`` at the parameters, where
        ``outputs`` is what the loss receives as ``y_pred`` (nested like the model's
        outputs) and ``regularization`` the sum of the model's losses (or None).
        The batch loss is ``output_loss(outputs) + regularization``."""
        outputs = getattr(self._program, "outputs", None)
        if outputs is None:
            raise TypeError(
                "this curvature needs the model's outputs, which only operators built with "
                "from_keras have; a loss_fn has no output split."
            )
        return outputs(self._state, self.batch)

    def output_loss(self, outputs: Any) -> tf.Tensor:
        """Keras models only: the data loss of ``outputs`` on this batch (no regularization)."""
        output_loss = self._program.output_loss  # type: ignore[attr-defined]
        return self.check_loss(output_loss(self.batch, outputs, num_examples=self.num_examples))

    def check_loss(self, loss: Any) -> tf.Tensor:
        if loss is None:
            raise ValueError("loss_fn returned None; it must return the scalar mean loss.")
        loss = tf.convert_to_tensor(loss)
        if loss.shape.rank != 0:
            raise ValueError(
                f"loss_fn must return a scalar (the mean loss of the batch); got shape "
                f"{loss.shape}. Reduce it, e.g. tf.reduce_mean(per_example_losses)."
            )
        if not loss.dtype.is_floating:
            raise TypeError(f"loss_fn must return a floating-point scalar; got {loss.dtype.name}.")
        if loss.dtype != self.dtype:
            raise TypeError(
                f"loss_fn returned a {loss.dtype.name} loss but the variables are "
                f"{self.dtype.name}; compute the loss in {self.dtype.name}."
            )
        return loss

    # -- derivatives and vectors ----------------------------------------------------
    def gradients(self, loss: tf.Tensor) -> list[tf.Tensor]:
        """∇_θ loss as dense tensors, one per parameter block (``tf.gradients``).

        A parameter that does not affect the loss is an error, or gives zeros with a
        warning when the operator allows unused parameters.
        """
        grads = tf.gradients(loss, self.parameters)
        unused = [name for name, g in zip(self.names, grads) if g is None]
        if unused and not self._allow_unused:
            raise ValueError(
                f"these variables do not affect the loss: {unused}. Pass variables without "
                "them (e.g. only the layers the loss uses), or allow_unused=True to keep "
                "them as zero rows and columns of the Hessian."
            )
        if unused:
            warnings.warn(
                f"variables {unused} do not affect the loss; their Hessian rows and "
                "columns are zero.",
                stacklevel=6,
            )
        return [
            tf.zeros(s, self.dtype) if g is None else tf.convert_to_tensor(g)
            for g, s in zip(grads, self.shapes)
        ]

    def vjp(self, outputs: Any, cotangents: Any) -> list[tf.Tensor]:
        """Σ ⟨cotangent, ∂output/∂θ⟩: the vector-Jacobian product of ``outputs`` (a tensor or
        list) with ``cotangents`` (same structure), one dense tensor per parameter block;
        zeros where the parameters do not reach the outputs."""
        grads = tf.gradients(
            outputs,
            self.parameters,
            grad_ys=cotangents,
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        return [tf.convert_to_tensor(g) for g in grads]

    def flatten(self, tensors: Sequence[Any]) -> tf.Tensor:
        """Concatenate per-parameter tensors (row-major) into one flat vector."""
        return tf.concat([tf.reshape(tf.convert_to_tensor(t), [-1]) for t in tensors], axis=0)

    def unflatten(self, vector: tf.Tensor) -> list[tf.Tensor]:
        """Split a flat vector into tensors shaped like the parameters."""
        parts = tf.split(vector, self.sizes)
        return [tf.reshape(p, s) for p, s in zip(parts, self.shapes)]
