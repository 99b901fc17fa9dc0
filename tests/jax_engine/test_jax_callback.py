"""The SharpnessCallback in a ``model.fit`` on Keras' JAX backend, without TensorFlow: its
measurements against the dense float64 Hessian of the model written again in
``jax.numpy`` (:mod:`_jax_models`) at the weights training left, and the preconditioned
sharpness of Adam against P^{-1/2} H P^{-1/2} with P computed here from the optimizer's
public variables (Keras' Adam: P = (√v + ε)/√(1 − β₂ᵗ))."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from _jax_models import (
    SCCE,
    classification_data,
    flat,
    hessian,
    mlp,
    mlp_forward,
    sparse_ce,
    unflatten,
    weights,
)

import spectra
from spectra import _jax_compat


def _dense_hessian(model, x, y):
    params = weights(model)
    shapes = [p.shape for p in params]

    def loss(t):
        return jnp.mean(sparse_ce(mlp_forward(unflatten(t, shapes), x), y))

    with jax.enable_x64(True):
        value = float(loss(jnp.asarray(flat(params), jnp.float64)))
    return hessian(loss, flat(params)), value


def _fit(optimizer, callback, x, y, epochs=3):
    _jax_compat.set_random_seed(7)
    model = mlp("tanh")
    model.compile(optimizer=optimizer, loss=SCCE)
    model.fit(x, y, epochs=epochs, batch_size=len(y), callbacks=[callback], verbose=0)
    return model


def test_the_callback_measures_the_dense_hessian_s_top_eigenvalue_during_fit():
    x, y = classification_data(40)
    callback = spectra.SharpnessCallback((x, y), top_k=2, dtype=np.float64, tol=1e-10)
    model = _fit(keras.optimizers.SGD(0.5), callback, x, y)
    assert [record["epoch"] for record in callback.history] == [0, 1, 2, 3]
    truth, loss = _dense_hessian(model, x, y)  # at the weights of the last measurement
    last = callback.history[-1]
    top = np.linalg.eigvalsh(truth)[::-1][:2]
    bounds = np.asarray(last["error_bounds"])
    assert np.all(bounds < 1e-8 * top[0])
    assert np.all(np.abs(np.asarray(last["eigenvalues"]) - top) <= bounds + 1e-12 * top[0])
    assert last["loss"] == pytest.approx(loss, rel=1e-12)
    assert last["threshold"] == pytest.approx(2 / 0.5, rel=1e-6)
    first = callback.history[0]["eigenvalues"][0]
    assert abs(first - last["eigenvalues"][0]) > 1e-6  # training moved it: not one weight
    assert "tensorflow" not in sys.modules


def test_preconditioned_sharpness_of_adam_against_its_dense_truth():
    x, y = classification_data(40)
    callback = spectra.SharpnessCallback(
        (x, y), dtype=np.float64, tol=1e-10, preconditioned=True, every=2
    )
    optimizer = keras.optimizers.Adam(0.01)
    model = _fit(optimizer, callback, x, y, epochs=4)
    truth, _ = _dense_hessian(model, x, y)
    steps = int(optimizer.iterations.numpy())
    assert steps == 4
    velocities = {
        str(v.path).rpartition("/")[2]: np.asarray(v.numpy(), np.float64)
        for v in optimizer.variables
    }
    beta_2, epsilon = float(optimizer.beta_2), float(optimizer.epsilon)
    P = []
    for variable in model.trainable_variables:
        v = velocities[f"{str(variable.path).replace('/', '_')}_velocity"]
        P.append((np.sqrt(v) + epsilon) / np.sqrt(1 - beta_2**steps))
    D = 1 / np.sqrt(flat(P))
    expected = np.linalg.eigvalsh(D[:, None] * truth * D[None, :])[-1]
    last = callback.history[-1]
    assert last["epoch"] == 4
    assert abs(last["eigenvalues"][0] - expected) <= last["error_bounds"][0] + 1e-10 * expected


def test_log_dir_without_tensorflow_is_refused_in_one_line(tmp_path):
    x, y = classification_data(8)
    with pytest.raises(ValueError, match="TensorFlow is not installed .*log_file"):
        spectra.SharpnessCallback((x, y), log_dir=tmp_path / "logs")
