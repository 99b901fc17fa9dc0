"""Dense ground truth for the Gauss-Newton and Fisher tests, independent of spectra.

Jacobians of a model's split points (its outputs, or the logits behind them) come from
``tf.GradientTape.jacobian``, output Hessians from nested tapes on constant copies of the
points, per-example gradients from one tape per example; all in float64 numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

F64 = "float64"


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


def head_model(units: int, head: str, *, regularizer: Any = None) -> keras.Model:
    """A float64 MLP 4 → 5 tanh → ``units`` logits (layer "logits") → ``head``: "logits"
    (none), "softmax"/"sigmoid" (Keras activations, read through their logits by the
    cross-entropies), or "probabilities"/"sigmoid-probabilities" (the same functions
    written out, which a loss reads as probabilities)."""
    inputs = keras.Input((4,), dtype=F64)
    hidden = keras.layers.Dense(5, activation="tanh", kernel_regularizer=regularizer, dtype=F64)(
        inputs
    )
    logits = keras.layers.Dense(units, name="logits", dtype=F64)(hidden)
    if head == "logits":
        outputs = logits
    elif head in ("softmax", "sigmoid"):
        outputs = keras.layers.Activation(head, dtype=F64)(logits)
    elif head == "probabilities":
        outputs = keras.layers.Lambda(
            lambda t: keras.ops.exp(t) / keras.ops.sum(keras.ops.exp(t), axis=-1, keepdims=True),
            dtype=F64,
        )(logits)
    else:
        outputs = keras.layers.Lambda(lambda t: 1.0 / (1.0 + keras.ops.exp(-t)), dtype=F64)(logits)
    return keras.Model(inputs, outputs)


def point_model(model: keras.Model, head: str) -> keras.Model:
    """What the loss differentiates: the logits behind a Keras softmax/sigmoid head, else
    the model's output."""
    if head in ("softmax", "sigmoid"):
        return keras.Model(model.input, model.get_layer("logits").output)
    return model


def random_labels(kind: str, units: int, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` labels: "sparse" classes, "onehot" rows, "binary" entries or "real" targets."""
    if kind == "sparse":
        return rng.integers(0, units, n)
    if kind == "onehot":
        return np.eye(units)[rng.integers(0, units, n)]
    if kind == "binary":
        return rng.integers(0, 2, (n, units)).astype(F64)
    return rng.standard_normal((n, units))


def log_cosh(y_true: Any, y_pred: Any) -> tf.Tensor:
    """A custom loss callable, convex and twice differentiable in y_pred (a batch mean)."""
    return tf.reduce_mean(tf.reduce_sum(tf.math.log(tf.cosh(y_pred - y_true)), axis=-1))
