"""spectra.loss_landscape and random_direction on Keras' JAX backend against the loss of
the model written again in ``jax.numpy`` (:mod:`_jax_models`), evaluated at the shifted
parameters in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jax_models import SCCE, flat, mlp_forward, sparse_ce, unflatten

import spectra


def test_curves_and_grid_equal_the_jax_numpy_loss_at_the_shifted_parameters(tanh_mlp):
    model, x, y, params, shapes = tanh_mlp
    theta = flat(params)
    op = spectra.HessianOperator.from_keras(model, SCCE, (x, y), dtype=np.float64)
    directions = {
        "filter": spectra.random_direction(op, seed=1),
        "unit": spectra.random_direction(op, seed=2, normalization="unit"),
    }
    alphas = np.linspace(-1.0, 1.0, 5)
    curves = spectra.loss_landscape(
        model, SCCE, (x, y), directions, alphas, batch_size=7, dtype=np.float64
    )

    def loss(t):
        return jnp.mean(sparse_ce(mlp_forward(unflatten(t, shapes), x), y))

    with jax.enable_x64(True):
        at = jax.jit(loss)

        def truth(point):
            return float(at(jnp.asarray(point, jnp.float64)))

        for label, d in directions.items():
            expected = [truth(theta + a * d) for a in alphas]
            np.testing.assert_allclose(curves.losses[label], expected, rtol=1e-12)
        assert curves.base_loss == pytest.approx(truth(theta), rel=1e-12)
        betas = np.array([-0.5, 0.5])
        grid = spectra.loss_landscape(
            model, SCCE, (x, y), directions, alphas, betas=betas, dtype=np.float64
        )
        first, second = directions["filter"], directions["unit"]
        expected = [[truth(theta + a * first + b * second) for b in betas] for a in alphas]
        np.testing.assert_allclose(grid.losses_2d, expected, rtol=1e-12)
    # filter normalization: each kernel column has its weights' norm, biases are zero
    kernel = op.unflatten(directions["filter"])[0]
    np.testing.assert_allclose(
        np.linalg.norm(kernel, axis=0), np.linalg.norm(params[0], axis=0), rtol=1e-12
    )
    assert not np.any(op.unflatten(directions["filter"])[1])
    assert curves.num_evaluations == 1 + 2 * alphas.size
