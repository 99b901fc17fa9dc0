"""The JAX operators against truths that share none of their code: each model's forward
pass and loss written again in ``jax.numpy`` from the Keras weights
(:mod:`_jax_models`), differentiated densely in float64 (``jax.hessian``, ``jax.jacfwd``).
Relative errors are to the largest entry of the matrix: 1e-12 in float64, 1e-5 in
float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from _jax_models import (
    SCCE,
    binary_ce_of_logits,
    classification_data,
    cnn,
    cnn_logits,
    flat,
    hessian,
    image_data,
    jacobian,
    layer_norm_forward,
    layer_norm_mlp,
    logit_ggn,
    matrix,
    mlp,
    mlp_forward,
    per_example_gradients,
    relative_error,
    sparse_ce,
    squared_error,
    two_inputs_forward,
    two_inputs_two_outputs,
    two_output_forward,
    two_outputs,
    unflatten,
    weights,
)

from spectra import _jax_compat
from spectra.operators.jax import (
    FisherOperator,
    GGNOperator,
    HessianOperator,
    JacobianOperator,
)
from spectra.operators.jax.base import batch_key

F64, F32 = 1e-12, 1e-5


def test_hessian_gradient_and_loss_of_a_tanh_mlp(tanh_mlp):
    model, x, y, params, shapes = tanh_mlp
    theta = flat(params)

    def loss(t):
        return jnp.mean(sparse_ce(mlp_forward(unflatten(t, shapes), x), y))

    truth = hessian(loss, theta)
    op = HessianOperator.from_keras(model, SCCE, (x, y), batch_size=7, dtype=np.float64)
    assert relative_error(matrix(op), truth) < F64
    with jax.enable_x64(True):
        t = jnp.asarray(theta)
        value, gradient = jax.jit(jax.value_and_grad(loss))(t)
    assert op.loss() == pytest.approx(float(value), rel=1e-13)
    assert relative_error(op.gradient(), np.asarray(gradient)) < F64
    op32 = HessianOperator.from_keras(model, SCCE, (x, y))
    assert op32.dtype == np.float32 and op32.gradient().dtype == np.float32
    assert relative_error(matrix(op32), truth) < F32


def test_ggn_and_empirical_fisher_of_a_tanh_mlp(tanh_mlp):
    model, x, y, params, shapes = tanh_mlp
    theta = flat(params)
    ggn = logit_ggn(lambda t: mlp_forward(unflatten(t, shapes), x), theta)
    op = GGNOperator.from_keras(model, SCCE, (x, y), batch_size=10, dtype=np.float64)
    assert op.is_positive_semidefinite and op.curvature == "ggn"
    assert relative_error(matrix(op), ggn) < F64
    assert relative_error(matrix(GGNOperator.from_keras(model, SCCE, (x, y))), ggn) < F32

    def loss_i(t, i):
        return sparse_ce(mlp_forward(unflatten(t, shapes), x), y)[i]

    g = per_example_gradients(loss_i, theta, len(x))
    fisher = FisherOperator.from_keras(
        model, SCCE, (x, y), batch_size=10, kind="empirical", dtype=np.float64
    )
    assert fisher.kind == "empirical" and fisher.is_positive_semidefinite
    assert relative_error(matrix(fisher), g.T @ g / len(x)) < F64


def test_monte_carlo_fisher_is_its_definition_with_the_labels_it_drew(tanh_mlp):
    model, x, y, params, shapes = tanh_mlp
    theta = flat(params)
    samples, seed, size = 2, 5, 10
    op = FisherOperator.from_keras(
        model, SCCE, (x, y), batch_size=size, num_samples=samples, seed=seed, dtype=np.float64
    )
    assert op.kind == "mc"
    keys = np.stack([batch_key(seed, b) for b in range(len(x) // size)])

    # F = Σ_b (n_b/N) Σ_i (1/n_b) (1/S) Σ_s g_is g_isᵀ: labels ŷ_is drawn from the
    # categorical of the logits with the key of (seed, batch) folded with the output's
    # position (0), the S draws stacked along the batch axis.
    def fisher(t, keys):
        total = jnp.zeros((t.size, t.size))
        for b in range(len(keys)):
            xb = x[b * size : (b + 1) * size]

            def logits_of(t, xb=xb):
                return jnp.tile(mlp_forward(unflatten(t, shapes), xb), (samples, 1))

            key = jax.random.fold_in(jax.random.wrap_key_data(keys[b]), 0)
            logits = jax.lax.stop_gradient(mlp_forward(unflatten(t, shapes), xb))
            shape = (samples, size)
            drawn = jax.random.categorical(key, logits, axis=-1, shape=shape).reshape(-1)

            def loss_i(t, i, logits_of=logits_of, drawn=drawn):
                return sparse_ce(logits_of(t), drawn)[i]

            g = jax.vmap(jax.grad(loss_i), in_axes=(None, 0))(t, jnp.arange(samples * size))
            total = total + g.T @ g / (len(x) * samples)
        return total

    with jax.enable_x64(True):
        truth = np.asarray(jax.jit(fisher)(jnp.asarray(theta), keys))
    assert relative_error(matrix(op), truth) < F64


def test_monte_carlo_fisher_estimates_the_ggn(tanh_mlp):
    # For a cross-entropy of logits the Fisher equals the GGN (Martens 2014); with S·N =
    # 8000 draws the estimate is within a few percent.
    model, x, y, params, shapes = tanh_mlp
    ggn = logit_ggn(lambda t: mlp_forward(unflatten(t, shapes), x), flat(params))
    fisher = matrix(
        FisherOperator.from_keras(model, SCCE, (x, y), num_samples=400, dtype=np.float64)
    )
    assert np.linalg.norm(fisher - ggn) / np.linalg.norm(ggn) < 0.1
    assert np.linalg.eigvalsh(fisher).min() > -1e-12 * np.abs(fisher).max()


def test_jacobian_and_its_transpose(tanh_mlp):
    model, x, _, params, shapes = tanh_mlp
    theta = flat(params)
    truth = jacobian(lambda t: mlp_forward(unflatten(t, shapes), x), theta)
    rng = np.random.default_rng(0)
    v, u = rng.normal(size=(theta.size, 3)), rng.normal(size=(truth.shape[0], 2))
    op = JacobianOperator.from_keras(model, x, batch_size=10, dtype=np.float64)
    assert op.shape == truth.shape and op.num_outputs == 3
    assert relative_error(op @ v, truth @ v) < F64
    assert relative_error(op.T @ u, truth.T @ u) < F64
    assert relative_error(op.rmatvec(u[:, 0]), truth.T @ u[:, 0]) < F64
    assert op.T.T is op
    with jax.enable_x64(True):
        outputs = np.asarray(mlp_forward(unflatten(jnp.asarray(theta), shapes), x))
    assert relative_error(op.outputs(), outputs.reshape(-1)) < F64
    op32 = JacobianOperator.from_keras(model, (x,))
    assert relative_error(op32 @ v.astype(np.float32), truth @ v) < F32
    assert relative_error(op32.T @ u.astype(np.float32), truth.T @ u) < F32


def test_cnn_with_a_softmax_output():
    # The loss reads the probabilities (from_logits=False): as on TensorFlow, the
    # cross-entropy is computed from the logits behind the softmax, and the GGN splits there.
    _jax_compat.set_random_seed(4)
    model = cnn()
    x, y = image_data(8)
    params = weights(model)
    shapes = [p.shape for p in params]
    theta = flat(params)

    def loss(t):
        return jnp.mean(sparse_ce(cnn_logits(unflatten(t, shapes), x), y))

    ce = keras.losses.SparseCategoricalCrossentropy()
    op = HessianOperator.from_keras(model, ce, (x, y), dtype=np.float64)
    assert relative_error(matrix(op), hessian(loss, theta)) < F64
    ggn = logit_ggn(lambda t: cnn_logits(unflatten(t, shapes), x), theta)
    op = GGNOperator.from_keras(model, ce, (x, y), dtype=np.float64)
    assert relative_error(matrix(op), ggn) < F64


def test_layer_normalization_hessian_is_exact():
    # Keras' JAX LayerNormalization differentiates its variance around the mean exactly
    # (TensorFlow's tf.nn.moments holds the mean constant in the second derivative).
    _jax_compat.set_random_seed(5)
    model = layer_norm_mlp()
    x, y = classification_data(12, seed=2)
    params = weights(model)
    shapes = [p.shape for p in params]

    def loss(t):
        return jnp.mean(sparse_ce(layer_norm_forward(unflatten(t, shapes), x), y))

    op = HessianOperator.from_keras(model, SCCE, (x, y), dtype=np.float64)
    assert relative_error(matrix(op), hessian(loss, flat(params))) < F64


def test_two_outputs_with_loss_weights_and_sample_weights():
    _jax_compat.set_random_seed(6)
    model = two_outputs()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(15, 4)).astype(np.float32)
    y = {"a": rng.integers(0, 3, size=15), "b": rng.normal(size=(15, 2)).astype(np.float32)}
    w = rng.uniform(0.5, 2.0, size=15).astype(np.float32)
    params = weights(model)
    shapes = [p.shape for p in params]
    theta = flat(params)

    def outputs_of(t):
        z = two_output_forward(unflatten(t, shapes), x)
        return jnp.concatenate([z["a"], z["b"]], axis=1)

    def per_example(z):  # ℓ_i = 1.0·CE(a) + 0.5·MSE(b), the loss weights of compile
        return 1.0 * sparse_ce(z[:, :3], y["a"]) + 0.5 * squared_error(z[:, 3:], y["b"])

    def output_loss(z):  # sum_over_batch_size: Σ_i w_i ℓ_i / N over the dataset
        return jnp.sum(w * per_example(z)) / len(x)

    data = (x, y, w)
    op = HessianOperator.from_keras(model, None, data, batch_size=5, dtype=np.float64)
    truth = hessian(lambda t: output_loss(outputs_of(t)), theta)
    assert relative_error(matrix(op), truth) < F64

    jac = jacobian(outputs_of, theta)
    with jax.enable_x64(True):
        z = jax.jit(outputs_of)(jnp.asarray(theta))
        h_z = np.asarray(jax.jit(jax.hessian(lambda f: output_loss(f.reshape(z.shape))))(z.ravel()))
    op = GGNOperator.from_keras(model, None, data, batch_size=5, dtype=np.float64)
    assert relative_error(matrix(op), jac.T @ h_z @ jac) < F64

    g = per_example_gradients(lambda t, i: per_example(outputs_of(t))[i], theta, len(x))
    op = FisherOperator.from_keras(
        model, None, data, batch_size=5, kind="empirical", dtype=np.float64
    )
    assert relative_error(matrix(op), (g * w[:, None]).T @ g / len(x)) < F64


def test_two_inputs_list_outputs_and_regularization():
    # A dict of inputs, a list of outputs with loss weights, a sigmoid output whose binary
    # cross-entropy reads its logit, and an L2 kernel regularizer, whose exact Hessian
    # 2λI enters the GGN as well.
    _jax_compat.set_random_seed(8)
    l2 = 0.05
    model = two_inputs_two_outputs(l2)
    rng = np.random.default_rng(5)
    x = {"a": rng.normal(size=(10, 3)), "b": rng.normal(size=(10, 2))}
    x = {k: v.astype(np.float32) for k, v in x.items()}
    y = [rng.integers(0, 3, size=10), rng.integers(0, 2, size=(10, 1)).astype(np.float32)]
    params = weights(model)
    shapes = [p.shape for p in params]
    theta = flat(params)

    def logits_of(t):
        return jnp.concatenate(two_inputs_forward(unflatten(t, shapes), x), axis=1)

    def data_loss(z):
        per_example = sparse_ce(z[:, :3], y[0]) + 2.0 * binary_ce_of_logits(z[:, 3:], y[1])
        return jnp.mean(per_example)

    def regularization(t):
        return l2 * jnp.sum(unflatten(t, shapes)[0] ** 2)

    truth = hessian(lambda t: data_loss(logits_of(t)) + regularization(t), theta)
    op = HessianOperator.from_keras(model, None, (x, y), dtype=np.float64)
    assert relative_error(matrix(op), truth) < F64
    jac = jacobian(logits_of, theta)
    with jax.enable_x64(True):
        z = jax.jit(logits_of)(jnp.asarray(theta))
        h_z = jax.jit(jax.hessian(lambda f: data_loss(f.reshape(z.shape))))(z.ravel())
    ggn = jac.T @ np.asarray(h_z) @ jac + hessian(regularization, theta)
    op = GGNOperator.from_keras(model, None, (x, y), dtype=np.float64)
    assert relative_error(matrix(op), ggn) < F64
    without = GGNOperator.from_keras(
        model, None, (x, y), include_regularization=False, dtype=np.float64
    )
    assert relative_error(matrix(without), jac.T @ np.asarray(h_z) @ jac) < F64


def test_dropout_in_training_mode_is_one_fixed_symmetric_matrix():
    _jax_compat.set_random_seed(7)
    model = mlp("tanh", hidden=8, dropout=0.5)
    x, y = classification_data(20, seed=4)
    kwargs = dict(batch_size=10, training=True, dtype=np.float64)
    op = HessianOperator.from_keras(model, SCCE, (x, y), **kwargs)
    first = matrix(op)
    assert np.abs(first - first.T).max() < 1e-13 * np.abs(first).max()
    assert np.array_equal(matrix(op), first)  # the same masks on every pass
    streamed = HessianOperator.from_keras(model, SCCE, (x, y), cache=False, **kwargs)
    assert np.array_equal(matrix(streamed), first)
    assert streamed.num_streamed_batches == 2 and op.is_cached
    seeded = [
        matrix(HessianOperator.from_keras(model, SCCE, (x, y), seed=s, **kwargs))
        for s in (11, 11, 12)
    ]
    assert np.array_equal(seeded[0], seeded[1])
    assert relative_error(seeded[0], seeded[2]) > 1e-3
    assert relative_error(seeded[0], first) > 1e-3
