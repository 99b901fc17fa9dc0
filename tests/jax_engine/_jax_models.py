"""Test models of the JAX engine and their truths: each model's forward pass and loss
written again by hand in ``jax.numpy`` from the Keras weights (never through Keras), and
dense float64 curvature matrices from ``jax.hessian``/``jax.jacfwd`` of those functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import keras
import numpy as np

layers = keras.layers

#: The loss of the classifiers (one object, so that operators share compiled functions).
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

#: Keras' default epsilon of LayerNormalization.
LAYER_NORM_EPSILON = 1e-3


# -- data ------------------------------------------------------------------------------
def classification_data(n: int = 20, features: int = 4, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    return x, rng.integers(0, classes, size=n)


def image_data(n: int = 8, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6, 6, 1)).astype(np.float32), rng.integers(0, 3, size=n)


# -- models ----------------------------------------------------------------------------
def mlp(activation: str = "tanh", hidden: int = 5, dropout: float | None = None) -> keras.Model:
    """4 → hidden (activation) → [Dropout] → 3 logits."""
    stack = [keras.Input((4,)), layers.Dense(hidden, activation=activation)]
    if dropout is not None:
        stack.append(layers.Dropout(dropout))
    stack.append(layers.Dense(3))
    return keras.Sequential(stack)


def layer_norm_mlp() -> keras.Model:
    """4 → 5 (tanh) → LayerNormalization → 3 logits."""
    return keras.Sequential(
        [
            keras.Input((4,)),
            layers.Dense(5, activation="tanh"),
            layers.LayerNormalization(),
            layers.Dense(3),
        ]
    )


def cnn() -> keras.Model:
    """6x6x1 → Conv2D(2, 3, tanh) → MaxPooling(2) → Flatten → Dense(3, softmax)."""
    return keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            layers.Conv2D(2, 3, activation="tanh"),
            layers.MaxPooling2D(2),
            layers.Flatten(),
            layers.Dense(3, activation="softmax"),
        ]
    )


def two_outputs() -> keras.Model:
    """x (4) → 5 (tanh) → {"a": 3 logits, "b": 2 linear}, compiled with a sparse
    cross-entropy on "a", MSE on "b" and loss weights {"a": 1.0, "b": 0.5}."""
    inputs = keras.Input((4,))
    hidden = layers.Dense(5, activation="tanh")(inputs)
    outputs = {"a": layers.Dense(3, name="a")(hidden), "b": layers.Dense(2, name="b")(hidden)}
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer="sgd",
        loss={"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "b": "mse"},
        loss_weights={"a": 1.0, "b": 0.5},
    )
    return model


# -- the same functions by hand ---------------------------------------------------------
def weights(model: keras.Model) -> list[np.ndarray]:
    """The trainable weights, float64 (the operator's flat order)."""
    return [np.asarray(v.value, np.float64) for v in model.trainable_variables]


def flat(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.reshape(a, -1) for a in arrays])


def unflatten(theta, shapes: Sequence[tuple[int, ...]]) -> list:
    parts, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        parts.append(theta[start : start + size].reshape(shape))
        start += size
    return parts


def dense(x, kernel, bias):
    return jnp.einsum("ni,io->no", x, kernel) + bias


def mlp_forward(params, x, activation=jnp.tanh):
    w1, b1, w2, b2 = params
    return dense(activation(dense(x, w1, b1)), w2, b2)


def layer_norm_forward(params, x):
    w1, b1, gamma, beta, w2, b2 = params
    h = jnp.tanh(dense(x, w1, b1))
    mean = jnp.sum(h, axis=-1, keepdims=True) / h.shape[-1]
    variance = jnp.sum((h - mean) ** 2, axis=-1, keepdims=True) / h.shape[-1]
    normed = (h - mean) / jnp.sqrt(variance + LAYER_NORM_EPSILON) * gamma + beta
    return dense(normed, w2, b2)


def cnn_logits(params, x):
    """The logits behind the CNN's softmax: a valid 3x3 convolution written as a sum over
    the kernel's offsets, tanh, 2x2 max pooling, row-major flattening, a dense layer."""
    kernel, bias, w, b = params
    n, height, width, _ = x.shape
    kh, kw = kernel.shape[:2]
    out_h, out_w = height - kh + 1, width - kw + 1
    conv = bias
    for i in range(kh):
        for j in range(kw):
            conv = conv + jnp.einsum(
                "nhwc,co->nhwo", x[:, i : i + out_h, j : j + out_w, :], kernel[i, j]
            )
    h = jnp.tanh(conv)
    pooled = h.reshape(n, out_h // 2, 2, out_w // 2, 2, -1).max(axis=(2, 4))
    return dense(pooled.reshape(n, -1), w, b)


def two_output_forward(params, x):
    w, b, wa, ba, wb, bb = params
    h = jnp.tanh(dense(x, w, b))
    return {"a": dense(h, wa, ba), "b": dense(h, wb, bb)}


def sparse_ce(logits, y):
    """Per-example cross-entropy of integer labels, from logits."""
    logp = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
    return -jnp.take_along_axis(logp, jnp.asarray(y)[:, None], axis=-1)[:, 0]


def squared_error(z, t):
    """Per-example mean squared error over the last axis (Keras' MSE)."""
    return jnp.mean((z - t) ** 2, axis=-1)


# -- dense truths -------------------------------------------------------------------------
def hessian(loss: Callable, theta: np.ndarray) -> np.ndarray:
    """∇²loss at theta (float64, ``jax.hessian``)."""
    with jax.enable_x64(True):
        return np.asarray(jax.jit(jax.hessian(loss))(jnp.asarray(theta, jnp.float64)))


def jacobian(function: Callable, theta: np.ndarray) -> np.ndarray:
    """∂function/∂theta as a (outputs, n) matrix (float64, forward mode)."""
    with jax.enable_x64(True):
        found = jax.jit(jax.jacfwd(function))(jnp.asarray(theta, jnp.float64))
        return np.asarray(found).reshape(-1, theta.size)


def per_example_gradients(loss_i: Callable, theta: np.ndarray, count: int) -> np.ndarray:
    """g_i = ∇loss_i(theta, i) for i < count, as rows (float64, one compiled vmap)."""
    with jax.enable_x64(True):
        grads = jax.jit(jax.vmap(jax.grad(loss_i), in_axes=(None, 0)))(
            jnp.asarray(theta, jnp.float64), jnp.arange(count)
        )
        return np.asarray(grads)


def logit_ggn(logits_of: Callable, theta: np.ndarray) -> np.ndarray:
    """Jᵀ blockdiag((diag p_i − p_i p_iᵀ)/N) J of a classifier's logits z_i (float64):
    the GGN of a mean cross-entropy split at the logits."""

    def blocks(t):
        z = logits_of(t)
        p = jax.nn.softmax(z, axis=-1)
        return (jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]) / z.shape[0], z

    with jax.enable_x64(True):
        t = jnp.asarray(theta, jnp.float64)
        h, z = jax.jit(blocks)(t)
        jac = np.asarray(jax.jit(jax.jacfwd(logits_of))(t)).reshape(*z.shape, -1)
        return np.einsum("icn,icd,idm->nm", jac, np.asarray(h), jac)


def matrix(operator) -> np.ndarray:
    """An operator's dense matrix, from its products with the identity (float64)."""
    return np.asarray(operator.matmat(np.eye(operator.shape[1], dtype=operator.dtype)), np.float64)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got − want| / max |want|."""
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def two_inputs_two_outputs(l2: float) -> keras.Model:
    """x = {"a": (3,), "b": (2,)} → concatenated → 4 (tanh, kernel L2(l2)) → [3 logits, 1
    sigmoid], compiled with [sparse cross-entropy from logits, binary cross-entropy of the
    probability] and loss weights [1.0, 2.0]."""
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    joined = layers.Concatenate()([a, b])
    hidden = layers.Dense(4, activation="tanh", kernel_regularizer=keras.regularizers.L2(l2))(
        joined
    )
    outputs = [layers.Dense(3)(hidden), layers.Dense(1, activation="sigmoid")(hidden)]
    model = keras.Model({"a": a, "b": b}, outputs)
    model.compile(
        optimizer="sgd",
        loss=[SCCE, keras.losses.BinaryCrossentropy()],
        loss_weights=[1.0, 2.0],
    )
    return model


def two_inputs_forward(params, x):
    """The logits of both outputs (the second behind its sigmoid)."""
    w, b, w1, b1, w2, b2 = params
    h = jnp.tanh(dense(jnp.concatenate([x["a"], x["b"]], axis=1), w, b))
    return dense(h, w1, b1), dense(h, w2, b2)


def binary_ce_of_logits(logit, t):
    """Per-example binary cross-entropy of one logit per example."""
    return -(t * jax.nn.log_sigmoid(logit) + (1 - t) * jax.nn.log_sigmoid(-logit))[:, 0]
