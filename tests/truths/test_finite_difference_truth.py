"""The finite-difference truth (tests/_dense.py) on functions whose Hessian is known in
closed form, and its refusals: float32 variables, a kink within a step, a non-finite
gradient — each leaving the variables exactly as they were."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from _dense import FD_TRUTH_RTOL, dense_hessian, finite_difference_hessian, relative_error


def _quartic(rng):
    """L = ½ θᵀAθ + ¼ Σ cᵢ θᵢ⁴ + θ₀θ₁·s over two variables; H = A + diag(3cθ²) + the
    cross term."""
    a = rng.standard_normal((5, 5))
    a = a + a.T
    c = rng.uniform(0.5, 2.0, 5)
    u = tf.Variable(rng.standard_normal((2, 2)))
    s = tf.Variable(rng.standard_normal(1) * 3)  # |θ| > 1: the step scales with it

    def loss():
        theta = tf.concat([tf.reshape(u, [-1]), s], 0)
        return (
            0.5 * tf.tensordot(theta, tf.linalg.matvec(a, theta), 1)
            + 0.25 * tf.reduce_sum(c * theta**4)
            + theta[0] * theta[1] * theta[4]
        )

    theta = np.concatenate([u.numpy().ravel(), s.numpy()])
    exact = a + np.diag(3 * c * theta**2)
    for i, j, k in [(0, 1, 4), (0, 4, 1), (1, 4, 0)]:
        exact[i, j] += theta[k]
        exact[j, i] += theta[k]
    return loss, [u, s], exact


def test_a_polynomial_hessian_to_rounding(rng):
    loss, variables, exact = _quartic(rng)
    before = [v.numpy().copy() for v in variables]
    result = finite_difference_hessian(loss, variables)
    # Richardson cancels the h² term; a quartic's gradient has no h⁴ term: rounding only.
    assert relative_error(result.hessian, exact) < 1e-10
    assert np.array_equal(result.hessian, result.hessian.T)
    # The estimate bounds the error of the unextrapolated differences: it is above the
    # actual error and below the self-check's limit.
    actual = np.linalg.norm(result.hessian - exact)
    assert actual <= result.error < 1e-6 * np.linalg.norm(exact)
    for v, b in zip(variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    assert relative_error(dense_hessian(loss, variables), exact) < FD_TRUTH_RTOL


def test_float32_variables_are_refused():
    w = tf.Variable(np.ones(3, np.float32), name="kernel")
    with pytest.raises(TypeError, match="'kernel.*float32.*float64 copy of the model"):
        dense_hessian(lambda: tf.reduce_sum(w**3), [w])


def test_a_kink_within_a_step_is_refused_and_the_weights_restored():
    w = tf.Variable([1e-5, 0.7, -0.3], dtype=tf.float64)  # ReLU's kink 1e-5 away
    before = w.numpy().copy()
    with pytest.raises(FloatingPointError, match="not converged.*kink"):
        dense_hessian(lambda: tf.reduce_sum(tf.nn.relu(w) ** 2), [w])
    np.testing.assert_array_equal(w.numpy(), before)
    # Away from the kink the same loss is smooth: H = 2·diag(w > 0).
    w.assign([1e-2, 0.7, -0.3])
    np.testing.assert_allclose(
        dense_hessian(lambda: tf.reduce_sum(tf.nn.relu(w) ** 2), [w]),
        np.diag([2.0, 2.0, 0.0]),
        atol=1e-9,
    )


def test_a_non_finite_gradient_is_refused_and_the_weights_restored():
    w = tf.Variable([1e-6, 2.0], dtype=tf.float64)  # sqrt's domain ends a step away
    before = w.numpy().copy()
    with pytest.raises(FloatingPointError, match="gradient is not finite"):
        dense_hessian(lambda: tf.reduce_sum(tf.sqrt(w) ** 3), [w])
    np.testing.assert_array_equal(w.numpy(), before)
