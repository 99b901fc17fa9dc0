"""Dense ground truth for the Gauss-Newton and Fisher tests, independent of spectra.

Jacobians of a model's split points (its outputs, or the logits behind them) come from
``tf.GradientTape.jacobian``, output Hessians from nested tapes on constant copies of the
points, per-example gradients from one tape per example; all in float64 numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf


def _variables(variables: Sequence[Any]) -> list[Any]:
    return [getattr(v, "value", v) for v in variables]


def _flat(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def point_jacobian(
    points: Callable[[], Sequence[tf.Tensor]], variables: Sequence[Any]
) -> tuple[list[np.ndarray], np.ndarray]:
    """The split points' values and J = ∂(points, flattened and concatenated)/∂θ, (m, n)."""
    variables = _variables(variables)

    def jacobian() -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            values = list(points())
            flat = _flat(values)
        blocks = tape.jacobian(
            flat, variables, unconnected_gradients="zero", experimental_use_pfor=False
        )
        m = int(flat.shape[0])
        return [tf.concat([tf.reshape(b, [m, -1]) for b in blocks], axis=1), *values]

    J, *values = tf.compat.v1.wrap_function(jacobian, [])()
    return [v.numpy() for v in values], J.numpy()


def point_hessian(
    loss: Callable[[list[tf.Tensor]], tf.Tensor], values: Sequence[np.ndarray]
) -> np.ndarray:
    """∇² of ``loss(points)`` in the points (flattened, concatenated), at ``values``."""
    points = [tf.constant(v) for v in values]
    with tf.GradientTape(persistent=True) as outer:
        outer.watch(points)
        with tf.GradientTape() as inner:
            inner.watch(points)
            value = loss(points)
        grads = inner.gradient(value, points, unconnected_gradients="zero")
        flat = _flat(grads)
    blocks = outer.jacobian(flat, points, unconnected_gradients="zero")
    m = int(flat.shape[0])
    return tf.concat([tf.reshape(b, [m, -1]) for b in blocks], axis=1).numpy()


def dense_ggn(
    batches: Sequence[tuple[Callable[[], Sequence[tf.Tensor]], Callable, float]],
    variables: Sequence[Any],
) -> np.ndarray:
    """Σ_b w_b J_bᵀ (∇²_z ℓ_b) J_b for batches ``(points_b(), loss_b(points), w_b)``."""
    total = None
    for points, loss, weight in batches:
        values, J = point_jacobian(points, variables)
        H = point_hessian(loss, values)
        term = weight * J.T @ H @ J
        total = term if total is None else total + term
    assert total is not None
    return total


def per_example_gradients(
    losses: Sequence[Callable[[], tf.Tensor]], variables: Sequence[Any]
) -> np.ndarray:
    """Row i: the flat gradient of ``losses[i]()``, (N, n)."""
    variables = _variables(variables)
    rows = []
    for loss in losses:
        with tf.GradientTape() as tape:
            value = loss()
        grads = tape.gradient(value, variables, unconnected_gradients="zero")
        rows.append(np.concatenate([np.ravel(g.numpy()) for g in grads]))
    return np.array(rows)


def take(tree: Any, start: int, stop: int) -> Any:
    """Examples ``start:stop`` of every array in ``tree``."""
    return tf.nest.map_structure(lambda a: a[start:stop], tree)


def symmetric_eigenvalues(M: np.ndarray) -> np.ndarray:
    return np.linalg.eigvalsh((M + M.T) / 2)
