"""Dense ground truth for Hessian tests: central finite differences of the float64 gradient.

TensorFlow's first derivatives are right where its second derivatives need not be:
``tf.nn.moments`` computes the variance around ``stop_gradient(mean)``, so nested tapes
through LayerNormalization, GroupNormalization or training-mode BatchNormalization give a
wrong Hessian (17 % relative Frobenius on Dense(5, tanh) → LayerNormalization → Dense(3)
with cross-entropy), and a test whose truth is nested tapes agrees with that bug. The
truth here, :func:`dense_hessian`, differences the gradient only; :func:`nested_tape_hessian`
is kept, under a name that says what it is, for consistency checks where nested tapes are
known to be right — never as a truth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import tensorflow as tf

# Relative step of the central differences (times max(1, |θ_j|)) and the largest accepted
# error estimate relative to ‖H‖_F; see finite_difference_hessian.
FD_STEP = 1e-4
FD_RTOL = 1e-5
# What a test may expect of the truth, relative to ‖H‖ (Frobenius; so also per entry and,
# by Weyl, per eigenvalue, relative to ‖H‖): the Richardson value errs by O(h⁴) +
# O(ε·|g|/h), measured ≤ 1e-11 on the tests' models (against nested tapes where those are
# right, and a complex-step NumPy Hessian); 1e-9 keeps a margin of ~100 and still catches
# a 1e-4 relative bug by 10⁵.
FD_TRUTH_RTOL = 1e-9


class FiniteDifferenceHessian(NamedTuple):
    hessian: np.ndarray  # n x n, float64, symmetric
    error: float  # estimated error, absolute Frobenius (conservative: see below)


def _flat_variables(variables: Sequence) -> list[tf.Variable]:
    # Keras 3 wraps the tf.Variable (whose own ``value`` is a method).
    return [v if isinstance(v, tf.Variable) else v.value for v in variables]


def finite_difference_hessian(
    loss: Callable[[], tf.Tensor],
    variables: Sequence[tf.Variable],
    *,
    step: float = FD_STEP,
    rtol: float = FD_RTOL,
) -> FiniteDifferenceHessian:
    """The n x n Hessian of ``loss()`` w.r.t. the flattened float64 ``variables``, by
    central differences of the gradient, with a self-check.

    Column j is D_h e_j = (g(θ + h_j e_j) − g(θ − h_j e_j)) / (2 h_j), with the gradient g
    from one compiled ``tf.function`` (traced once) that reads the variables; they are
    assigned θ ± h_j e_j in turn and restored exactly afterwards (also on error).
    Error of D_h: truncation h²/6·|g'''| plus rounding ~ε·|g|/h (ε = 2.2e-16).
    Computed at h and h/2, the Richardson value H = (4 D_{h/2} − D_h)/3 cancels the h²
    term, leaving O(h⁴) + O(ε|g|/h); with h = 1e-4·max(1, |θ_j|) both are ≲ 1e-11
    relative for O(1) derivatives. ‖D_h − D_{h/2}‖ = (3/4)·h²·|g'''|/6 (+ rounding) is
    three times the error of D_{h/2} and so bounds that of H in the smooth regime: it is
    returned as the error estimate (with the asymmetry ‖H − Hᵀ‖_F/2, also a lower bound
    of the error, if larger), and H is returned symmetrized.

    Raises if the estimate exceeds ``rtol``·‖H‖_F (1e-5 by default; the h² term of the
    tests' smooth models is 1e-9..5e-7 relative, the largest on training-mode
    BatchNormalization with 6 examples a batch): a kink (ReLU, max, abs, a branch) within a
    step of θ makes the differences O(jump/h), or one-sided, and the two steps disagree.
    Raises for non-float64 variables (differences in float32 carry ε/h ~ 1e-3 rounding and
    are no truth: build a float64 copy of the model) and for a non-finite gradient.
    """
    variables = _flat_variables(variables)
    for v in variables:
        if v.dtype != tf.float64:
            raise TypeError(
                f"finite-difference truths need float64 variables, got {v.name!r} "
                f"({v.dtype.name}): compute the truth on a float64 copy of the model"
            )
    originals = [v.numpy().copy() for v in variables]

    @tf.function
    def gradient() -> tf.Tensor:
        with tf.GradientTape() as tape:
            value = loss()
        grads = tape.gradient(value, variables, unconnected_gradients="zero")
        grads = [tf.convert_to_tensor(g) for g in grads]  # an Embedding's IndexedSlices
        return tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)

    def evaluate() -> np.ndarray:
        g = gradient().numpy()
        if not np.all(np.isfinite(g)):
            raise FloatingPointError(
                "the gradient is not finite near the weights: no finite-difference truth"
            )
        return g

    try:
        g0 = evaluate()
        n = g0.size
        D = {step: np.empty((n, n)), step / 2: np.empty((n, n))}
        column = 0
        for variable, original in zip(variables, originals):
            flat = original.reshape(-1)
            for i in range(flat.size):
                for h, matrix in D.items():
                    theta = flat[i]
                    scaled = h * max(1.0, abs(theta))
                    plus, minus = theta + scaled, theta - scaled  # the steps taken exactly
                    values = []
                    for point in (plus, minus):
                        perturbed = original.copy()
                        perturbed.reshape(-1)[i] = point
                        variable.assign(perturbed)
                        values.append(evaluate())
                    matrix[:, column] = (values[0] - values[1]) / (plus - minus)
                variable.assign(original)
                column += 1
    finally:
        for variable, original in zip(variables, originals):
            variable.assign(original)

    coarse, fine = D[step], D[step / 2]
    richardson = (4.0 * fine - coarse) / 3.0
    hessian = (richardson + richardson.T) / 2.0
    error = max(
        float(np.linalg.norm(coarse - fine)), float(np.linalg.norm(richardson - richardson.T)) / 2
    )
    scale = float(np.linalg.norm(hessian))
    # Rounding alone, for a Hessian that is (nearly) zero: n ulps of the gradient per step.
    floor = n * np.finfo(np.float64).eps * float(np.abs(g0).max() + 1.0) / step
    if not error <= rtol * scale + floor:
        raise FloatingPointError(
            f"finite-difference Hessian not converged: steps {step:g} and {step / 2:g} "
            f"differ by {error:.3g} against ‖H‖_F = {scale:.3g} (> {rtol:g} relative); "
            "a kink (ReLU, max, a branch) lies within a step of the weights: move the "
            "weights or the data off it, or pass a smaller step"
        )
    return FiniteDifferenceHessian(hessian, error)


def dense_hessian(loss: Callable[[], tf.Tensor], variables: Sequence[tf.Variable]) -> np.ndarray:
    """The truth: the Hessian of ``loss()`` by :func:`finite_difference_hessian` (float64
    variables only; accurate to ~``FD_TRUTH_RTOL`` relative)."""
    return finite_difference_hessian(loss, variables).hessian


def finite_difference_products(
    loss: Callable[[], tf.Tensor],
    variables: Sequence[tf.Variable],
    vectors: np.ndarray,
    *,
    step: float = FD_STEP,
    rtol: float = FD_RTOL,
) -> np.ndarray:
    """H V for the (n, k) ``vectors``, by central differences of the float64 gradient
    along each column: 4 gradients per vector instead of the 4n of a dense truth.

    Column v: ‖v‖ (g(θ + h v̂) − g(θ − h v̂)) / (2h) at h and h/2, Richardson-extrapolated
    as in :func:`finite_difference_hessian` (same error terms, h = ``step``·max(1, ‖θ‖∞));
    raises if the two steps disagree by more than ``rtol`` relative (a kink within a step).
    """
    variables = _flat_variables(variables)
    if any(v.dtype != tf.float64 for v in variables):
        raise TypeError("finite-difference truths need float64 variables: use a float64 copy")
    originals = [v.numpy().copy() for v in variables]
    sizes = [o.size for o in originals]
    theta_scale = max(1.0, max(float(np.abs(o).max()) for o in originals if o.size))

    @tf.function
    def gradient() -> tf.Tensor:
        with tf.GradientTape() as tape:
            value = loss()
        grads = tape.gradient(value, variables, unconnected_gradients="zero")
        return tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads], axis=0)

    def at(direction: np.ndarray) -> np.ndarray:
        for variable, original, part in zip(
            variables, originals, np.split(direction, np.cumsum(sizes)[:-1])
        ):
            variable.assign(original + part.reshape(original.shape))
        return gradient().numpy()

    vectors = np.asarray(vectors, dtype=np.float64).reshape(sum(sizes), -1)
    products = np.empty_like(vectors)
    try:
        for j, v in enumerate(vectors.T):
            norm = float(np.linalg.norm(v))
            if norm == 0.0:
                products[:, j] = 0.0
                continue
            unit = v / norm
            D = {}
            for h in (step * theta_scale, step * theta_scale / 2):
                D[h] = norm * (at(h * unit) - at(-h * unit)) / (2 * h)
            coarse, fine = D.values()
            products[:, j] = (4.0 * fine - coarse) / 3.0
            error, scale = np.linalg.norm(coarse - fine), np.linalg.norm(products[:, j])
            if not np.isfinite(scale) or error > rtol * scale + 1e-12 * norm:
                raise FloatingPointError(
                    f"finite-difference product {j} not converged: the steps differ by "
                    f"{error:.3g} against {scale:.3g}; a kink lies within a step of the "
                    "weights, or the gradient is not finite"
                )
    finally:
        for variable, original in zip(variables, originals):
            variable.assign(original)
    return products


def central_difference_hessian(
    gradient: Callable[[np.ndarray], np.ndarray], theta: np.ndarray, step: float = 1e-5
) -> np.ndarray:
    """The symmetrized Hessian of a function given by its float64 ``gradient`` of a flat
    parameter vector (a hand-written model), by central differences at ``theta``: error
    O(step² |g‴|) + O(ε|g|/step), ~1e-10 for O(1) derivatives at the default step."""
    columns = []
    for i in range(theta.size):
        e = np.zeros_like(theta)
        e[i] = step
        columns.append((gradient(theta + e) - gradient(theta - e)) / (2 * step))
    hessian = np.array(columns)
    return (hessian + hessian.T) / 2


def nested_tape_hessian(
    loss: Callable[[], tf.Tensor], variables: Sequence[tf.Variable]
) -> np.ndarray:
    """The Hessian by nested ``tf.GradientTape``s (the Jacobian of the gradient) — TensorFlow's
    second derivatives, wrong through ``tf.nn.moments``: for consistency checks only.

    Traced into one graph (a loop over the n rows; eagerly, models with recurrent layers
    take tens of seconds).
    """
    variables = _flat_variables(variables)

    def hessian() -> tf.Tensor:
        with tf.GradientTape(persistent=True) as outer:
            with tf.GradientTape() as inner:
                value = loss()
            grads = inner.gradient(value, variables, unconnected_gradients="zero")
            grads = [tf.convert_to_tensor(g) for g in grads]  # an Embedding's IndexedSlices
            flat = tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)
        blocks = outer.jacobian(
            flat, variables, unconnected_gradients="zero", experimental_use_pfor=False
        )
        n = int(flat.shape[0])
        return tf.concat([tf.reshape(b, [n, -1]) for b in blocks], axis=1)

    # A graph traced once per call (a new loss each time), without tf.function's
    # retracing warnings.
    return tf.compat.v1.wrap_function(hessian, [])().numpy().astype(np.float64)


def flat_gradient(loss: Callable[[], tf.Tensor], variables: Sequence[tf.Variable]) -> np.ndarray:
    variables = _flat_variables(variables)
    with tf.GradientTape() as tape:
        value = loss()
    grads = tape.gradient(value, variables, unconnected_gradients="zero")
    grads = [tf.convert_to_tensor(g) for g in grads]  # an Embedding's IndexedSlices
    return np.concatenate([np.reshape(g.numpy(), -1) for g in grads]).astype(np.float64)


def batch_weighted(batch_losses: Sequence[tuple[Callable[[], tf.Tensor], float]]):
    """A loss closure Σ_b w_b L_b() for dense references of batched data."""

    def loss() -> tf.Tensor:
        return tf.add_n([w * fn() for fn, w in batch_losses])

    return loss


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
