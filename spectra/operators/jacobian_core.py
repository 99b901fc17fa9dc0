"""What the model's Jacobian operators are, whichever engine computes their products.

:class:`JacobianCore` is the backend-neutral half of
:class:`spectra.operators.JacobianOperator` (TensorFlow, :mod:`spectra.operators.jacobian`)
and of its JAX counterpart (:mod:`spectra.operators.jax.jacobian`): J is the (N·C) × n
matrix of the derivatives of every example's outputs (C entries per example, in the
order of :attr:`~JacobianCore.output_names`) with respect to the n parameters; this
class holds its layouts (the parameter vector's and the output space's), the checked
``LinearOperator`` protocol and the transpose. :class:`TransposedJacobianCore` is Jᵀ,
sharing the Jacobian's snapshot, data and counters. NumPy and SciPy only.

An engine's Jacobian sets ``layout``, ``num_outputs``, ``num_products``,
``num_data_passes``, ``_batches`` (``num_examples``), ``_output_names`` and
``_output_shapes``, and implements the abstract ``_matmat`` (J V, one JVP per batch) and
``_rmatmat`` (Jᵀ U, one VJP per batch); its transpose class names it in ``_JACOBIAN``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from scipy.sparse.linalg import LinearOperator

from spectra.operators.layout import ParameterLayout, validated_block, validated_matrix

__all__ = ["JacobianCore", "TransposedJacobianCore"]


class JacobianCore(LinearOperator, metaclass=abc.ABCMeta):
    """J, an (N·C) × n ``LinearOperator`` of a model's outputs in its parameters (see the
    module docstring for what an engine's subclass provides)."""

    #: Shown after the class name by ``repr`` (" (JAX)" for the JAX engine's operators).
    _ENGINE_TAG = ""
    #: The engine's transpose class.
    _TRANSPOSE: ClassVar[type[TransposedJacobianCore]]

    layout: ParameterLayout
    num_outputs: int
    num_products: int
    num_data_passes: int
    _batches: Any
    _output_names: list[str]
    _output_shapes: list[tuple[int, ...]]

    # -- layouts --------------------------------------------------------------------
    @property
    def num_examples(self) -> int:
        """N, the number of examples of the data."""
        return self._batches.num_examples

    @property
    def output_names(self) -> list[str]:
        """The model's outputs in the order their entries appear within an example."""
        return list(self._output_names)

    @property
    def output_shapes(self) -> list[tuple[int, ...]]:
        """The per-example shape of each output (without the example dimension)."""
        return list(self._output_shapes)

    @property
    def variable_names(self) -> list[str]:
        """Names (Keras paths) of the parameter blocks, in the flat vector's order."""
        return list(self.layout.names)

    @property
    def variable_shapes(self) -> list[tuple[int, ...]]:
        return list(self.layout.shapes)

    def flatten(self, tensors: Sequence[Any]) -> np.ndarray:
        """Concatenate per-variable arrays (row-major) into one vector of length n."""
        return self.layout.flatten(tensors)

    def unflatten(self, vector: Any) -> list[np.ndarray]:
        """Split a vector of length n into arrays shaped like the variables."""
        return self.layout.unflatten(vector)

    def unflatten_outputs(self, vector: Any) -> list[np.ndarray]:
        """Split an output-space vector (length N·C) into one array per output, of shape
        ``(N, *shape)`` with ``shape`` its entry of :attr:`output_shapes`."""
        u = np.asarray(vector)
        if u.shape != (self.shape[0],):
            raise ValueError(f"expected a vector of shape ({self.shape[0]},), got {u.shape}.")
        per_example = u.reshape(self.num_examples, self.num_outputs)
        sizes = [int(np.prod(s, dtype=np.int64)) for s in self.output_shapes]
        pieces = np.split(per_example, np.cumsum(sizes)[:-1], axis=1)
        return [p.reshape(self.num_examples, *s) for p, s in zip(pieces, self.output_shapes)]

    def flatten_outputs(self, arrays: Sequence[Any]) -> np.ndarray:
        """The inverse of :meth:`unflatten_outputs`: one array of shape ``(N, *shape)`` per
        output into an output-space vector (length N·C)."""
        arrays = list(arrays)
        if len(arrays) != len(self.output_shapes):
            raise ValueError(
                f"expected {len(self.output_shapes)} arrays (one per output), got {len(arrays)}."
            )
        parts = []
        for name, a, shape in zip(self.output_names, arrays, self.output_shapes):
            a = np.asarray(a)
            if a.shape != (self.num_examples, *shape):
                raise ValueError(
                    f"output {name!r}: expected shape {(self.num_examples, *shape)}, got {a.shape}."
                )
            parts.append(a.reshape(self.num_examples, -1))
        return np.concatenate(parts, axis=1).reshape(-1).astype(self.dtype, copy=False)

    # -- products ---------------------------------------------------------------------
    def matvec(self, x: Any) -> np.ndarray:
        """J v for a parameter vector v of shape (n,) (or (n, 1))."""
        return super().matvec(validated_block(x, self.shape[1], self.dtype, "matvec"))

    def matmat(self, X: Any) -> np.ndarray:
        """J V for V of shape (n, k): k products in one pass over the data."""
        return super().matmat(validated_matrix(X, self.shape[1], self.dtype, "matmat"))

    def rmatvec(self, x: Any) -> np.ndarray:
        """Jᵀ u for an output-space vector u of shape (N·C,) (or (N·C, 1))."""
        return super().rmatvec(validated_block(x, self.shape[0], self.dtype, "rmatvec"))

    def rmatmat(self, X: Any) -> np.ndarray:
        """Jᵀ U for U of shape (N·C, k): k products in one pass over the data."""
        return super().rmatmat(validated_matrix(X, self.shape[0], self.dtype, "rmatmat"))

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._matmat(np.reshape(x, (-1, 1))).reshape(-1)

    def _rmatvec(self, x: np.ndarray) -> np.ndarray:
        return self._rmatmat(np.reshape(x, (-1, 1))).reshape(-1)

    @abc.abstractmethod
    def _matmat(self, X: np.ndarray) -> np.ndarray:
        """J X for a checked block X (n, k): one JVP pass over the batches."""

    @abc.abstractmethod
    def _rmatmat(self, U: np.ndarray) -> np.ndarray:
        """Jᵀ U for a checked block U (N·C, k): one VJP pass over the batches."""

    def _transpose(self) -> TransposedJacobianCore:
        return self._TRANSPOSE(self)

    def _adjoint(self) -> TransposedJacobianCore:
        return self._TRANSPOSE(self)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__}{self._ENGINE_TAG} shape={self.shape} dtype={self.dtype} "
            f"examples={self.num_examples} outputs per example={self.num_outputs}; "
            f"{self.num_products} products, {self.num_data_passes} data passes>"
        )


class TransposedJacobianCore(LinearOperator):
    """Jᵀ, an n × (N·C) ``LinearOperator``: ``J.T`` of a Jacobian operator.

    Jᵀ u = Σ_i J_iᵀ u_i maps an output-space vector (one entry per example and output
    entry, in the row order of J) to the parameter space: one VJP per batch, a block of k
    vectors in one pass over the data. Its transpose (``.T``) is the Jacobian again; it
    shares the Jacobian's snapshot, data and counters.
    """

    _ENGINE_TAG = ""
    #: The engine's Jacobian class (what ``from_keras`` builds and ``__init__`` takes).
    _JACOBIAN: ClassVar[type[JacobianCore]]

    def __init__(self, jacobian: JacobianCore) -> None:
        name = self._JACOBIAN.__name__
        if not isinstance(jacobian, self._JACOBIAN):
            raise TypeError(
                f"jacobian must be a {name}; got {type(jacobian).__name__}. Build "
                f"one with {name}.from_keras(model, data) and take its .T."
            )
        self.jacobian = jacobian
        rows, columns = jacobian.shape
        super().__init__(dtype=jacobian.dtype, shape=(columns, rows))

    @classmethod
    def from_keras(cls, model: Any, data: Any, **kwargs: Any) -> TransposedJacobianCore:
        """``JacobianOperator.from_keras(model, data, **kwargs).T``."""
        return cls(cls._JACOBIAN.from_keras(model, data, **kwargs))

    def matvec(self, x: Any) -> np.ndarray:
        """Jᵀ u for u of shape (N·C,)."""
        return self.jacobian.rmatvec(x)

    def matmat(self, X: Any) -> np.ndarray:
        """Jᵀ U for U of shape (N·C, k), in one pass over the data."""
        return self.jacobian.rmatmat(X)

    def rmatvec(self, x: Any) -> np.ndarray:
        """J v for v of shape (n,)."""
        return self.jacobian.matvec(x)

    def rmatmat(self, X: Any) -> np.ndarray:
        """J V for V of shape (n, k)."""
        return self.jacobian.matmat(X)

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self.jacobian._rmatvec(x)

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        return self.jacobian._rmatmat(X)

    def _rmatvec(self, x: np.ndarray) -> np.ndarray:
        return self.jacobian._matvec(x)

    def _rmatmat(self, X: np.ndarray) -> np.ndarray:
        return self.jacobian._matmat(X)

    def _transpose(self) -> JacobianCore:
        return self.jacobian

    def _adjoint(self) -> JacobianCore:
        return self.jacobian

    def __repr__(self) -> str:
        return f"<{type(self).__name__}{self._ENGINE_TAG} shape={self.shape} dtype={self.dtype}>"
