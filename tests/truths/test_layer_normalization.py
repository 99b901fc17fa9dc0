"""LayerNormalization against a plain NumPy truth, and the zoo's truths against nested tapes.

Nested ``tf.GradientTape``s differentiate ``tf.nn.moments`` with the mean held constant in
the variance (``stop_gradient``), so their Hessian of Dense(5, tanh) → LayerNormalization →
Dense(3) with cross-entropy is wrong by ~15 % (relative Frobenius). The truth here is a
NumPy forward pass and hand-written backward pass of that model (no TensorFlow), whose
Hessian is the complex-step derivative of the gradient: H e_j = Im g(θ + i·h·e_j) / h with
h = 1e-20 has no subtraction, so it is exact to a few ulps (Squire & Trapp 1998; Martins,
Sturdza & Alonso 2003). Its gradient and loss are checked against TensorFlow's (first
derivatives, which are right) and its symmetry against itself (a wrong backward pass gives
a Jacobian that is no Hessian).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _dense import FD_TRUTH_RTOL, flat_gradient, relative_error
from _zoo import ZOO, N, cast, dense_reference, float64_copy

from spectra import HessianOperator

EPSILON = 1e-3  # keras.layers.LayerNormalization's default
COMPLEX_STEP = 1e-20


def _forward_backward(params: list[np.ndarray], x: np.ndarray, y: np.ndarray):
    """Mean sparse cross-entropy of logits = LN(tanh(x W1 + b1))·W2 + b2 and its gradient
    (same order as the parameters), in real or complex arithmetic."""
    w1, b1, gamma, beta, w2, b2 = params
    a = np.tanh(x @ w1 + b1)
    mu = a.mean(axis=1, keepdims=True)
    centred = a - mu
    sigma = np.sqrt((centred**2).mean(axis=1, keepdims=True) + EPSILON)
    a_hat = centred / sigma
    out = gamma * a_hat + beta
    logits = out @ w2 + b2
    shifted = logits - logits.real.max(axis=1, keepdims=True)  # a constant shift
    log_z = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    n = len(y)
    onehot = np.eye(w2.shape[1])[y]
    loss = -(onehot * (shifted - log_z)).sum() / n
    # Backward pass.
    d_logits = (np.exp(shifted - log_z) - onehot) / n
    d_w2, d_b2 = out.T @ d_logits, d_logits.sum(axis=0)
    d_out = d_logits @ w2.T
    d_gamma, d_beta = (d_out * a_hat).sum(axis=0), d_out.sum(axis=0)
    d_hat = d_out * gamma
    d_a = (
        d_hat
        - d_hat.mean(axis=1, keepdims=True)
        - a_hat * (d_hat * a_hat).mean(axis=1, keepdims=True)
    ) / sigma
    d_z = d_a * (1.0 - a**2)
    d_w1, d_b1 = x.T @ d_z, d_z.sum(axis=0)
    return loss, [d_w1, d_b1, d_gamma, d_beta, d_w2, d_b2]


def numpy_hessian(params: list[np.ndarray], x: np.ndarray, y: np.ndarray):
    """(H, g, loss) of the LayerNormalization MLP: H by complex steps of the NumPy gradient."""
    shapes = [p.shape for p in params]
    theta = np.concatenate([p.ravel() for p in params]).astype(np.float64)
    splits = np.cumsum([int(np.prod(s)) for s in shapes])[:-1]

    def unflat(vector):
        return [part.reshape(s) for part, s in zip(np.split(vector, splits), shapes)]

    def flat_grad(vector):
        loss, grads = _forward_backward(unflat(vector), x, y)
        return loss, np.concatenate([g.ravel() for g in grads])

    loss, g = flat_grad(theta)
    H = np.empty((theta.size, theta.size))
    for j in range(theta.size):
        step = np.zeros(theta.size, complex)
        step[j] = 1j * COMPLEX_STEP
        H[:, j] = flat_grad(theta + step)[1].imag / COMPLEX_STEP
    return H, g, float(loss)


def _layernorm_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = next(e for e in ZOO if e.name == "layernorm").build("float64")
    rng = np.random.default_rng(seed)
    norm = model.layers[1]  # a scale and offset away from 1 and 0
    norm.gamma.assign(rng.uniform(0.5, 1.5, norm.gamma.shape))
    norm.beta.assign(0.3 * rng.standard_normal(norm.beta.shape))
    return model


def _data(seed: int, n: int = 10):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4)), rng.integers(0, 3, n).astype("int32")


def test_the_numpy_truth_has_tensorflows_gradient_and_loss():
    model = _layernorm_model(0)
    x, y = _data(1)
    H, g, loss = numpy_hessian(model.get_weights(), x, y)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
    value = float(sce(y, model(x)))
    tf_gradient = flat_gradient(lambda: sce(y, model(x)), model.trainable_variables)
    assert loss == pytest.approx(value, rel=1e-13)
    assert relative_error(g, tf_gradient) < 1e-12
    # Complex steps are exact to rounding: a Jacobian of a true gradient is symmetric.
    assert np.abs(H - H.T).max() <= 1e-13 * np.abs(H).max()


def test_the_operator_of_a_layer_normalization_mlp_is_the_numpy_hessian():
    """spectra's float64 operator against the NumPy truth (nested tapes miss by ~15 %)."""
    model = _layernorm_model(0)
    x, y = _data(1)
    H, g, loss = numpy_hessian(model.get_weights(), x, y)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    op = HessianOperator.from_keras(model, sce, (x, y), batch_size=4, dtype=np.float64)
    # Rounding of a float64 product is ~1e-15 relative; a real bug is far above 1e-9.
    assert relative_error(op @ np.eye(op.shape[0]), H) < 1e-9
    assert relative_error(op.gradient(), g) < 1e-12
    assert op.loss() == pytest.approx(loss, rel=1e-12)


def test_the_zoos_layer_normalization_truth_is_the_numpy_hessian():
    """The zoo's truth is not nested tapes: those would miss the NumPy Hessian by ~15 %."""
    entry = next(e for e in ZOO if e.name == "layernorm")
    rng = np.random.default_rng(12345)
    keras.utils.set_random_seed(5)
    model = float64_copy(entry, entry.build("float32"))
    x, y = entry.data(rng, N, 4)
    H, g, loss = dense_reference(entry, model, (x, y))
    truth, truth_g, truth_loss = numpy_hessian(model.get_weights(), cast(x, "float64"), y)
    assert relative_error(H, truth) < FD_TRUTH_RTOL
    assert relative_error(g, truth_g) < 1e-12
    assert loss == pytest.approx(truth_loss, rel=1e-12)
