"""The Hessian seen through an optimizer's diagonal preconditioner.

An adaptive optimizer steps ``θ ← θ − η P⁻¹ m`` with a diagonal P built from its state,
so its stability is governed by the eigenvalues of P⁻¹H, not of H (Cohen et al. 2022,
"Adaptive gradient methods at the edge of stability"). P⁻¹H is not symmetric, but it is
similar to the symmetric ``P^{-1/2} H P^{-1/2}`` (= D H D with D = P^{-1/2}), which has
the same eigenvalues; :func:`preconditioned` returns that symmetric operator, so every
estimator of spectra applies to it. If u is its eigenvector, D u is an eigenvector of
P⁻¹H with the same eigenvalue (:meth:`PreconditionedOperator.to_parameters`).

P from a Keras optimizer's state, as Keras 3 divides by it (t = the number of steps
taken, ``optimizer.iterations``; ε the optimizer's ``epsilon``; Keras rounds η and the
β's to float32 constants, which moves its step by about 1e-5 relative in the first steps
with β₂ = 0.999 — the formulas here use the exact values):

* Adam, AdamW: Keras computes ``θ ← θ − η·√(1−β₂ᵗ)/(1−β₁ᵗ) · m/(√v + ε)``, i.e.
  ``η m̂ / P`` with m̂ = m/(1−β₁ᵗ) and P = (√v + ε)/√(1−β₂ᵗ) = √v̂ + ε/√(1−β₂ᵗ),
  v̂ = v/(1−β₂ᵗ). (The textbook form √v̂ + ε differs only in ε's scaling, which matters
  where √v̂ is comparable to ε.) With ``amsgrad`` v is the running maximum v_hat.
  AdamW's decoupled weight decay is not part of P.
* RMSprop: P = √(v + ε), or √(v − ḡ² + ε) with ``centered=True`` (ε inside the root).
* Adagrad: P = √(a + ε) with the accumulator a (ε inside the root).

A ``LossScaleOptimizer`` is unwrapped. The state is read when the operator is built: a
later training step does not change it (the operator is the matrix at the state it was
built with). Keras keeps that state in private attributes of its optimizers; reading it is
:func:`spectra._keras_compat.optimizer_slots`, with a fallback through the public
``optimizer.variables``.

Cost: a product of the preconditioned operator is one product of the wrapped one (one
data pass of a Hessian) and 2n host multiplications by D; building it reads the
optimizer's state once (no data pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.sparse.linalg import LinearOperator, aslinearoperator

from spectra._symmetric import SymmetricProducts

__all__ = ["PreconditionedOperator", "preconditioned", "preconditioner_diagonal"]


# -- P from an optimizer -----------------------------------------------------------------------
def _supported_optimizer(optimizer: Any) -> Any:
    """The optimizer to read (a LossScaleOptimizer's inner one), after the clear errors."""
    from spectra._keras_compat import OPTIMIZER_SLOTS

    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    kind = type(optimizer).__name__
    if kind not in OPTIMIZER_SLOTS:
        hint = (
            " SGD has no preconditioner (P = I): use the operator itself."
            if kind == "SGD"
            else " Pass P's diagonal as an array instead."
        )
        raise ValueError(
            f"optimizer {kind} is not supported; supported: {', '.join(OPTIMIZER_SLOTS)}.{hint}"
        )
    steps = int(optimizer.iterations.numpy()) if optimizer.built else 0
    if steps < 1:
        raise ValueError(
            f"the {kind} optimizer has no state yet (it has never been applied): train at "
            "least one step first, or pass P's diagonal as an array"
        )
    return optimizer


def preconditioner_diagonal(
    optimizer: Any, variables: Sequence[Any], *, epsilon: float | None = None
) -> np.ndarray:
    """The flat diagonal of the optimizer's preconditioner P for ``variables`` (float64).

    Ordered like the parameter vector (``variables`` concatenated, each row-major).
    ``epsilon`` replaces the optimizer's ε in the formulas of the module docstring.
    Raises for unsupported optimizers, an optimizer never applied, variables it does
    not track, and a P that is not positive.
    """
    optimizer = _supported_optimizer(optimizer)
    kind = type(optimizer).__name__
    eps = float(optimizer.epsilon if epsilon is None else epsilon)
    if not eps >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    from spectra._keras_compat import optimizer_slots

    slots = optimizer_slots(optimizer, variables, kind)

    def slot(name: str) -> list[np.ndarray]:
        if name not in slots:
            import keras

            raise RuntimeError(
                f"cannot find the {kind} state {name!r} in Keras {keras.__version__} (read "
                "for Keras 3.15, see spectra._keras_compat.optimizer_slots): pass P's "
                "diagonal as an array instead"
            )
        return slots[name]

    steps = int(optimizer.iterations.numpy())
    if kind in ("Adam", "AdamW"):
        second = slot("_velocity_hats") if optimizer.amsgrad else slot("_velocities")
        correction = np.sqrt(1.0 - float(optimizer.beta_2) ** steps)
        parts = [(np.sqrt(v) + eps) / correction for v in second]
    elif kind == "RMSprop":
        second = slot("_velocities")
        if optimizer.centered:
            second = [v - g**2 for v, g in zip(second, slot("_average_gradients"))]
        parts = [np.sqrt(np.maximum(v + eps, 0.0)) for v in second]
    else:
        parts = [np.sqrt(np.maximum(a + eps, 0.0)) for a in slot("_accumulators")]
    diagonal = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0)
    bad = ~(np.isfinite(diagonal) & (diagonal > 0))
    if np.any(bad):
        raise ValueError(
            f"the {kind} preconditioner has {int(bad.sum())} entries that are zero, negative "
            "or not finite (a zero second moment with epsilon = 0, or NaN in the optimizer "
            "state): pass a positive epsilon"
        )
    return diagonal


# -- the operator ------------------------------------------------------------------------------
class PreconditionedOperator(SymmetricProducts, LinearOperator):
    """The symmetric ``D A D`` with ``D = P^{-1/2}``, for a symmetric A and a positive
    diagonal P: similar to P⁻¹A (same eigenvalues).

    Each ``matvec``/``matmat`` is one ``matmat`` of the wrapped operator (one data pass
    for a Hessian) on the scaled block. D is applied as 2^e·D' with D' at most 1 (a
    power of two: exact), so the wrapped operator never sees a vector beyond its dtype's
    range; P from 1e-300 to 1e300 gives products right wherever float64 holds them.
    Attributes: ``base`` (A), ``preconditioner`` (the diagonal of P) and ``scaling``
    (the diagonal of D), float64. ``variables``, ``variable_shapes``,
    ``flatten``/``unflatten``, ``loss()`` and ``gradient()`` come from A when it has
    them (the gradient in the coordinates u = P^{1/2}θ, i.e. D ∇L, so that D A D is its
    Hessian).
    """

    def __init__(self, base: LinearOperator | np.ndarray, preconditioner: np.ndarray):
        operator = aslinearoperator(base)
        self.base = base
        self._operator = operator
        self.preconditioner = np.asarray(preconditioner, dtype=np.float64)
        self.scaling = 1.0 / np.sqrt(self.preconditioner)
        # D = 2^e·D' with max D' in [0.5, 1): the wrapped operator multiplies D'v (no
        # overflow in its own dtype), and D A D = 4^e·D' A D' exactly (powers of two).
        largest = float(self.scaling.max(initial=0.0))
        self._exponent = int(np.frexp(largest)[1]) if largest > 0 else 0
        self._normalized = np.ldexp(self.scaling, -self._exponent)
        if hasattr(base, "variables"):
            self.variables = base.variables
        super().__init__(dtype=operator.dtype, shape=operator.shape)

    def _matmat(self, block: np.ndarray) -> np.ndarray:
        block = np.asarray(block, dtype=np.float64).reshape(self.shape[0], -1)
        scaled = self._normalized[:, None] * block
        image = np.asarray(self._operator.matmat(scaled), dtype=np.float64)
        image = self._normalized[:, None] * image
        if self._exponent:
            with np.errstate(over="ignore"):  # an overflow is the product's: inf, refused
                image = np.ldexp(image, 2 * self._exponent)
        return image.astype(self.dtype, copy=False)

    def to_parameters(self, vectors: np.ndarray) -> np.ndarray:
        """D·u for u (n,) or (n, m): eigenvectors of D A D become eigenvectors of P⁻¹A
        (in parameter coordinates, not normalized)."""
        vectors = np.asarray(vectors, dtype=np.float64)
        if vectors.shape[:1] != (self.shape[0],) or vectors.ndim > 2:
            n = self.shape[0]
            raise ValueError(f"expected shape ({n},) or ({n}, m), got {vectors.shape}")
        return self.scaling.reshape((-1,) + (1,) * (vectors.ndim - 1)) * vectors

    def _base_method(self, name: str) -> Any:
        method = getattr(self.base, name, None)
        if method is None:
            raise AttributeError(
                f"the wrapped {type(self.base).__name__} has no {name}(); it is available "
                "for operators that have one (e.g. HessianOperator)"
            )
        return method

    @property
    def variable_shapes(self) -> list[tuple[int, ...]]:
        return list(self._base_method("variable_shapes"))

    def flatten(self, tensors: Sequence[Any]) -> np.ndarray:
        return self._base_method("flatten")(tensors)

    def unflatten(self, vector: Any) -> list[np.ndarray]:
        return self._base_method("unflatten")(vector)

    def loss(self) -> float:
        """The wrapped operator's loss (unchanged by the change of coordinates)."""
        return self._base_method("loss")()

    def gradient(self) -> np.ndarray:
        """D ∇L: the gradient with respect to u = P^{1/2}θ (float64)."""
        return self.scaling * np.asarray(self._base_method("gradient")(), dtype=np.float64)

    def __repr__(self) -> str:
        return (
            f"<PreconditionedOperator n={self.shape[0]} dtype={self.dtype} "
            f"P in [{self.preconditioner.min():.3g}, {self.preconditioner.max():.3g}] "
            f"around {type(self.base).__name__}>"
        )


def _is_keras_optimizer(value: Any) -> bool:
    if isinstance(value, (np.ndarray, list, tuple)) or not hasattr(value, "iterations"):
        return False
    import keras  # only needed (and imported) for optimizers

    return isinstance(value, keras.optimizers.Optimizer)


def preconditioned(
    op: LinearOperator | np.ndarray, optimizer_or_diagonal: Any, *, epsilon: float | None = None
) -> PreconditionedOperator:
    """The symmetric ``P^{-1/2} H P^{-1/2}`` (same eigenvalues as P⁻¹H) as a LinearOperator.

    ``optimizer_or_diagonal`` is a Keras optimizer that has taken at least one step
    (Adam, AdamW, RMSprop, Adagrad; P from its state by the formulas of the module
    docstring, for the operator's ``variables``) or the diagonal of P as a flat array of
    length n with positive entries (ordered like the parameter vector: use
    ``op.flatten`` for per-variable arrays). ``epsilon`` replaces an optimizer's ε
    (e.g. to study its effect); it is refused with a user's diagonal.

    Cost: each product is one product of ``op`` (one data pass for a Hessian), plus
    2n multiplications on the host. Compare its top eigenvalue with
    ``spectra.stability_threshold(optimizer)``, e.g. 38/η for Adam with β₁ = 0.9.
    """
    operator = aslinearoperator(op)
    n = int(operator.shape[0])
    if tuple(operator.shape) != (n, n):
        raise ValueError(f"op must be square, got shape {tuple(operator.shape)}")
    if _is_keras_optimizer(optimizer_or_diagonal):
        variables = getattr(op, "variables", None)
        if variables is None:
            raise ValueError(
                f"{type(op).__name__} has no variables to match with the optimizer's state; "
                "pass P's diagonal as an array, or use an operator built with "
                "HessianOperator.from_keras"
            )
        diagonal = preconditioner_diagonal(optimizer_or_diagonal, variables, epsilon=epsilon)
    else:
        if epsilon is not None:
            raise ValueError(
                "epsilon applies to an optimizer's state; add it to your diagonal yourself"
            )
        try:
            diagonal = np.asarray(optimizer_or_diagonal, dtype=np.float64)
        except (TypeError, ValueError) as error:
            raise TypeError(
                "optimizer_or_diagonal must be a Keras optimizer or a flat array of "
                f"positive numbers; got {type(optimizer_or_diagonal).__name__}"
            ) from error
        if diagonal.ndim != 1:
            raise ValueError(
                f"the diagonal must be a flat vector of length {n}, got shape {diagonal.shape} "
                "(use op.flatten for per-variable arrays)"
            )
        if diagonal.shape != (n,):
            raise ValueError(f"the diagonal has length {diagonal.shape[0]}, the operator n = {n}")
        bad = ~(np.isfinite(diagonal) & (diagonal > 0))
        if np.any(bad):
            raise ValueError(
                f"the diagonal of P must be positive and finite; {int(bad.sum())} of its "
                f"{diagonal.size} entries are not"
            )
    if diagonal.shape != (n,):
        raise ValueError(
            f"the optimizer's variables have {diagonal.shape[0]} entries, the operator n = {n}"
        )
    return PreconditionedOperator(op, diagonal)
