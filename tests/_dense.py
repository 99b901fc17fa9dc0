"""Dense ground truth for Hessian tests: explicit Hessians from tf.GradientTape.jacobian."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf


def dense_hessian(loss: Callable[[], tf.Tensor], variables: Sequence[tf.Variable]) -> np.ndarray:
    """The n x n Hessian of ``loss()`` w.r.t. the flattened ``variables`` (float64 numpy).

    Computed as the Jacobian of the concatenated gradient, with nested tapes that know
    nothing of spectra's engine, traced into one graph (a loop over the n rows; eagerly,
    models with recurrent layers take tens of seconds).
    """
    variables = [getattr(v, "value", v) for v in variables]

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
    variables = [getattr(v, "value", v) for v in variables]
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
