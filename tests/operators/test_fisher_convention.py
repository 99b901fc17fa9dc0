"""The empirical-Fisher convention, against per-example gradients computed densely.

spectra's empirical Fisher is E = (1/N) Σ_i g_i g_iᵀ with g_i the gradient of Keras'
per-example loss ℓ_i. For MSE Keras averages over the C output entries,
ℓ_i = (1/C) Σ_c (z_ic − y_ic)²; curvlinops' convention (PyTorch's ``MSELoss``) takes the
per-example loss summed over the outputs, ℓ'_i = Σ_c (z_ic − y_ic)² = C ℓ_i, with the
reduction factor 1/(N·C) of the mean over all N·C entries, so its matrix is
(1/(N·C)) Σ_i g'_i g'_iᵀ = (C²/(N·C)) Σ_i g_i g_iᵀ = C·E: exactly C times spectra's.
For cross-entropy the per-example loss is the same in both (a sum over the classes)
and the reduction factor 1/N, so the matrices agree: C plays no role.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import relative_error
from _gauss_newton import per_example_gradients

from spectra.operators import FisherOperator

F64 = "float64"
N, BATCH = 11, 4


def _model(outputs: int) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=F64),
            keras.layers.Dense(5, activation="tanh", dtype=F64),
            keras.layers.Dense(outputs, dtype=F64),
        ]
    )


def _gradients(model, x, per_example_loss) -> np.ndarray:
    """Row i: ∇_θ per_example_loss(i, z_i), one tape per example."""
    losses = [lambda i=i: per_example_loss(i, model(x[i : i + 1])[0]) for i in range(x.shape[0])]
    return per_example_gradients(losses, model.trainable_variables)


def _spectra_empirical_fisher(model, loss, x, y) -> np.ndarray:
    E = FisherOperator.from_keras(model, loss, (x, y), batch_size=BATCH, kind="empirical")
    return E.matmat(np.eye(E.shape[0]))


@pytest.mark.parametrize("outputs", [1, 3])
def test_mse_empirical_fisher_is_the_keras_per_example_mean_and_curvlinops_is_c_times(outputs, rng):
    C = outputs
    model = _model(C)
    x, y = rng.standard_normal((N, 4)), rng.standard_normal((N, C))
    E = _spectra_empirical_fisher(model, "mse", x, y)

    # Keras' per-example loss: the mean over the C outputs.
    keras_g = _gradients(
        model, x, lambda i, z: keras.losses.mean_squared_error(y[i : i + 1], z[None])[0]
    )
    assert relative_error(E, keras_g.T @ keras_g / N) < 1e-12

    # curvlinops: the per-example loss summed over the outputs, reduction factor 1/(N·C).
    summed_g = _gradients(model, x, lambda i, z: tf.reduce_sum((z - y[i]) ** 2))
    curvlinops = summed_g.T @ summed_g / (N * C)
    assert relative_error(curvlinops, C * E) < 1e-12
    if C > 1:
        assert relative_error(curvlinops, E) > 0.5  # the conventions differ


def test_cross_entropy_empirical_fisher_agrees_in_both_conventions(rng):
    C = 3
    model = _model(C)
    x, y = rng.standard_normal((N, 4)), rng.integers(0, C, N)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    E = _spectra_empirical_fisher(model, loss, x, y)

    # −log softmax(z)_y, written out: the same per-example loss in both conventions.
    g = _gradients(model, x, lambda i, z: tf.reduce_logsumexp(z) - z[y[i]])
    assert relative_error(E, g.T @ g / N) < 1e-12
