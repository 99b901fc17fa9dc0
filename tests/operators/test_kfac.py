"""KFACOperator against its definition and against the exact GGN, on small float64 models.

The references are built independently of the operator's capture of the layers: a
per-example loop that runs the MLP by hand (z = a W + b, σ(z)) under ``tf.GradientTape``,
takes the output Hessian in the logits with nested tapes and back-propagates the columns
of its square root (type-2) or the gradient at the true label (empirical).
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra.estimators.results import SpectralDensity
from spectra.operators import GGNOperator
from spectra.operators.ekfac import EKFACOperator
from spectra.operators.kfac import KFACOperator

N, BATCH, D_IN, CLASSES = 7, 3, 4, 3
F64 = "float64"


def _mlp(units, activations, seed=0, *, batchnorm=False):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((D_IN,), dtype=F64)]
    for i, (u, act) in enumerate(zip(units, activations)):
        layers.append(keras.layers.Dense(u, activation=act, dtype=F64))
        if batchnorm and i == 0:
            layers.append(keras.layers.BatchNormalization(dtype=F64))
    model = keras.Sequential(layers)
    if batchnorm:  # non-trivial moving statistics and affine parameters
        bn = model.layers[1]
        rng = np.random.default_rng(seed)
        for w in bn.weights:
            w.assign(rng.uniform(0.5, 1.5, size=w.shape))
    return model


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, D_IN))
    labels = rng.integers(0, CLASSES, N)
    return x, labels


@pytest.fixture(scope="module")
def mlp():
    return _mlp([5, CLASSES], ["tanh", "softmax"])


@pytest.fixture(scope="module")
def kfac(mlp, data):
    return KFACOperator.from_keras(mlp, "sparse_categorical_crossentropy", data, batch_size=BATCH)


def _reference_factors(model, x, labels, kind):
    """A_l, G_l by their definition, one example at a time."""
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    A = [np.zeros((layer.kernel.shape[0] + 1,) * 2) for layer in dense]
    G = [np.zeros((layer.kernel.shape[1],) * 2) for layer in dense]
    for i in range(len(x)):
        h = tf.constant(x[i : i + 1])
        with tf.GradientTape(persistent=True) as tape:
            zs = []
            for layer in dense:
                abar = np.concatenate([h.numpy()[0], [1.0]])
                A[len(zs)] += np.outer(abar, abar) / len(x)
                z = h @ layer.kernel.value + layer.bias.value
                tape.watch(z)
                zs.append(z)
                h = z if layer is dense[-1] else tf.tanh(z)
            logits = zs[-1]
            with tf.GradientTape() as inner_outer:
                inner_outer.watch(logits)
                with tf.GradientTape() as inner:
                    inner.watch(logits)
                    loss = keras.losses.sparse_categorical_crossentropy(
                        labels[i : i + 1], logits, from_logits=True
                    )[0]
                grad = inner.gradient(loss, logits)
            hessian = inner_outer.jacobian(grad, logits).numpy().reshape(CLASSES, CLASSES)
        if kind == "type-2":
            values, vectors = np.linalg.eigh(hessian)
            columns = vectors * np.sqrt(np.maximum(values, 0))
        else:
            columns = grad.numpy().reshape(CLASSES, 1)
        for c in range(columns.shape[1]):
            cot = tf.constant(columns[None, :, c])
            grads = tape.gradient(logits, zs, output_gradients=cot)
            for layer_index, g in enumerate(grads):
                g = np.zeros_like(G[layer_index][:1]) if g is None else g.numpy()
                G[layer_index] += g.T @ g / len(x)
    return A, G


@pytest.mark.parametrize("kind", ["type-2", "empirical"])
def test_factors_match_their_definition(mlp, data, kfac, kind):
    x, labels = data
    op = (
        kfac
        if kind == "type-2"
        else KFACOperator.from_keras(
            mlp, "sparse_categorical_crossentropy", data, batch_size=BATCH, kind=kind
        )
    )
    A, G = _reference_factors(mlp, x, labels, kind)
    assert len(op.blocks) == 2
    for block, a, g in zip(op.blocks, A, G):
        np.testing.assert_allclose(block.A, a, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(block.G, g, rtol=1e-10, atol=1e-14)
        assert np.abs(block.G).max() > 1e-3  # not trivially zero


def _kronecker_dense(op):
    """K from the blocks' float64 factors, placed by hand (not the operator's products)."""
    dense = np.zeros(op.shape)
    for block in op.blocks:
        rows = np.r_[block.kernel_slice, block.bias_slice]
        dense[np.ix_(rows, rows)] = np.kron(block.A, block.G)
    return dense


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_a_float32_inverse_is_exact_to_float32_rounding(cls):
    """Float32 vectors given to a float32 operator's inverse are multiplied in float32: the
    result is within the docstring's bound d·u·(‖v‖/λ_min(K + δI) + ‖y‖) of the float64
    dense inverse of the Kronecker blocks, float64 vectors still get float64 products."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(4)]
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype("float32")
    y = rng.integers(0, 4, 40)
    op = cls.from_keras(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), (x, y))
    assert op.dtype == np.float32
    if cls is KFACOperator:
        dense = _kronecker_dense(op)
    else:  # EKFAC: (Q_A ⊗ Q_G) diag(s) (Q_A ⊗ Q_G)ᵀ per block, from its float64 parts
        dense = op.to_dense()
    largest = np.linalg.eigvalsh(dense)[-1]
    u, d = np.finfo(np.float32).eps / 2, 13
    for damping in (1e-1 * largest, 1e-4 * largest):
        shifted = dense + damping * np.eye(len(dense))
        smallest = np.linalg.eigvalsh(shifted)[0]
        inverse = op.inverse(damping)
        V = rng.normal(size=(op.shape[0], 3)).astype("float32") * np.float32(1e20)
        truth = np.linalg.solve(shifted, V.astype(np.float64))
        got = inverse.matmat(V)
        assert got.dtype == np.float64
        for j in range(V.shape[1]):
            v, y_true = V[:, j].astype(np.float64), truth[:, j]
            bound = d * u * (np.linalg.norm(v) / smallest + np.linalg.norm(y_true))
            assert np.linalg.norm(got[:, j] - y_true) <= bound
            # Measured: a few float32 units, not the bound's worst case.
            assert np.linalg.norm(got[:, j] - y_true) <= 1e-5 * np.linalg.norm(y_true)
        one = inverse.matvec(V[:, 0])  # the same float32 products on one column
        assert np.linalg.norm(one - truth[:, 0]) <= 1e-5 * np.linalg.norm(truth[:, 0])
        # Float64 vectors: float64 products, as exact as the float64 operator's.
        np.testing.assert_allclose(
            inverse.matmat(V.astype(np.float64)), truth, rtol=1e-8, atol=1e-10 * np.abs(truth).max()
        )


def test_layout_matches_the_exact_operators(mlp, data, kfac):
    ggn = GGNOperator.from_keras(mlp, "sparse_categorical_crossentropy", data)
    assert kfac.variable_names == ggn.variable_names
    assert kfac.variable_shapes == ggn.variable_shapes
    assert kfac.shape == ggn.shape
    vector = np.arange(kfac.shape[0], dtype=np.float64)
    for a, b in zip(kfac.unflatten(vector), ggn.unflatten(vector)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(kfac.flatten(kfac.unflatten(vector)), vector)


def test_products_eigenvalues_and_scalars_against_the_dense_matrix(kfac):
    dense = kfac.to_dense()
    np.testing.assert_array_equal(dense, dense.T)
    rng = np.random.default_rng(2)
    v = rng.normal(size=kfac.shape[0])
    V = rng.normal(size=(kfac.shape[0], 4))
    np.testing.assert_allclose(kfac.matvec(v), dense @ v, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(kfac.matmat(V), dense @ V, rtol=1e-12, atol=1e-14)
    # The Kronecker structure, checked on the first block: A ⊗ G in row-major order.
    block = kfac.blocks[0]
    rows = np.r_[block.kernel_slice, block.bias_slice]
    np.testing.assert_allclose(dense[np.ix_(rows, rows)], np.kron(block.A, block.G), rtol=1e-13)
    exact = np.linalg.eigvalsh(dense)[::-1]
    np.testing.assert_allclose(kfac.eigenvalues(), exact, rtol=1e-10, atol=1e-12 * exact[0])
    assert kfac.trace() == pytest.approx(np.trace(dense), rel=1e-12)
    assert kfac.frobenius_norm() == pytest.approx(np.linalg.norm(dense), rel=1e-12)
    damping = 1e-2
    sign, logdet = np.linalg.slogdet(dense + damping * np.eye(len(dense)))
    assert sign == 1
    assert kfac.logdet(damping) == pytest.approx(logdet, rel=1e-10)
    inverse = kfac.inverse(damping)
    solved = np.linalg.solve(dense + damping * np.eye(len(dense)), V)
    np.testing.assert_allclose(inverse.matmat(V), solved, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(
        inverse.matvec(v), np.linalg.solve(dense + damping * np.eye(len(dense)), v), rtol=1e-8
    )
    with pytest.raises(ValueError, match=r"singular: .* pass damping >"):
        kfac.logdet()  # A ⊗ G of a 7-example dataset is singular
    with pytest.raises(ValueError, match=r"singular: .* pass damping >"):
        kfac.inverse(0.0)


def test_exact_spectral_density(kfac):
    eigenvalues = np.linalg.eigvalsh(kfac.to_dense())
    density = SpectralDensity.from_eigenvalues(kfac.eigenvalues())
    assert density.dimension == kfac.shape[0] == density.nodes.shape[1]
    np.testing.assert_allclose(density.nodes[0], np.sort(kfac.eigenvalues()))
    moments = density.moments(2)
    np.testing.assert_allclose(moments.estimate[1], eigenvalues.mean(), rtol=1e-10)
    np.testing.assert_allclose(moments.estimate[2], np.mean(eigenvalues**2), rtol=1e-10)
    threshold = float(np.median(eigenvalues)) * 1.0001 + 1e-12
    mass = density.mass_below(threshold)
    assert mass.estimate == pytest.approx(
        np.mean(eigenvalues < threshold), abs=1.0 / len(eigenvalues)
    )
    curve = density.density()
    assert np.trapezoid(curve.values, curve.grid) == pytest.approx(1.0, abs=1e-3)
    np.testing.assert_array_equal(curve.lower, np.maximum(curve.values, 0))  # no sampling error
    with pytest.raises(ValueError, match="finite numbers"):
        SpectralDensity.from_eigenvalues([1.0, np.nan])


def test_one_example_single_linear_layer_mse_equals_the_ggn():
    model = _mlp([2], [None], seed=3)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(1, D_IN)), rng.normal(size=(1, 2))
    kfac = KFACOperator.from_keras(model, "mse", (x, y))
    ggn = GGNOperator.from_keras(model, "mse", (x, y), dtype=np.float64)
    exact = ggn.matmat(np.eye(ggn.shape[0]))
    np.testing.assert_allclose(kfac.to_dense(), exact, rtol=0, atol=1e-12)
    assert np.abs(exact).max() > 0.1
    # A linear layer under MSE has a constant G = (2/d) I: K-FAC is then exact for any N,
    # which checks the dataset weighting, for the mean and (G scaled by N) the sum.
    x, y = rng.normal(size=(5, D_IN)), rng.normal(size=(5, 2))
    for loss in ("mse", keras.losses.MeanSquaredError(reduction="sum")):
        kfac = KFACOperator.from_keras(model, loss, (x, y), batch_size=2)
        ggn = GGNOperator.from_keras(model, loss, (x, y), batch_size=2)
        exact = ggn.matmat(np.eye(ggn.shape[0]))
        np.testing.assert_allclose(kfac.to_dense(), exact, rtol=1e-12, atol=1e-12)


def test_one_example_single_softmax_layer_equals_the_ggn_and_several_do_not(data):
    x, labels = data
    model = _mlp([CLASSES], ["softmax"], seed=4)
    loss = "sparse_categorical_crossentropy"

    def dense_pair(n):
        kfac = KFACOperator.from_keras(model, loss, (x[:n], labels[:n]))
        ggn = GGNOperator.from_keras(model, loss, (x[:n], labels[:n]))
        return kfac.to_dense(), ggn.matmat(np.eye(ggn.shape[0]))

    one_k, one_g = dense_pair(1)
    np.testing.assert_allclose(one_k, one_g, rtol=0, atol=1e-12)
    many_k, many_g = dense_pair(N)
    # The approximation is real: E[ā āᵀ ⊗ S Sᵀ] ≠ E[ā āᵀ] ⊗ E[S Sᵀ] when p varies.
    assert np.linalg.norm(many_k - many_g) > 1e-2 * np.linalg.norm(many_g)
    # ... yet the traces agree only by accident: check the approximation keeps the scale.
    assert np.trace(many_k) == pytest.approx(np.trace(many_g), rel=0.5)


def test_ekfac_against_the_dense_projection(mlp, data, kfac):
    loss = "sparse_categorical_crossentropy"
    ekfac = EKFACOperator.from_keras(mlp, loss, data, batch_size=BATCH)
    ggn = GGNOperator.from_keras(mlp, loss, data).matmat(np.eye(kfac.shape[0]))
    dense = ekfac.to_dense()
    kfac_dense = kfac.to_dense()
    np.testing.assert_allclose(dense, dense.T, atol=1e-15)
    for block, kblock in zip(ekfac.blocks, kfac.blocks):
        # The eigenbasis is K-FAC's: the same factors, and Q_A, Q_G diagonalize them.
        np.testing.assert_array_equal(block.A, kblock.A)
        np.testing.assert_array_equal(block.G, kblock.G)
        QA, QG = block.basis
        for M, Q in ((block.A, QA), (block.G, QG)):
            rotated = Q.T @ M @ Q
            np.testing.assert_allclose(rotated, np.diag(np.diag(rotated)), atol=1e-12)
        # The scalings: the exact GGN block projected onto Q_A ⊗ Q_G, its diagonal.
        rows = np.r_[block.kernel_slice, block.bias_slice]
        exact_block = ggn[np.ix_(rows, rows)]
        Q = np.kron(QA, QG)
        expected = np.diag(Q.T @ exact_block @ Q).reshape(block.scalings.shape)
        np.testing.assert_allclose(block.scalings, expected, rtol=1e-9, atol=1e-14)
        # ... so EKFAC is at least as close to the exact block as K-FAC (here strictly).
        err_e = np.linalg.norm(dense[np.ix_(rows, rows)] - exact_block)
        err_k = np.linalg.norm(kfac_dense[np.ix_(rows, rows)] - exact_block)
        assert err_e < err_k
    exact = np.linalg.eigvalsh(dense)[::-1]
    np.testing.assert_allclose(ekfac.eigenvalues(), exact, rtol=1e-9, atol=1e-12 * exact[0])
    assert ekfac.trace() == pytest.approx(np.trace(dense), rel=1e-12)
    assert ekfac.trace() == pytest.approx(np.trace(ggn), rel=1e-12)  # diag(QᵀBQ) keeps tr B
    assert ekfac.frobenius_norm() == pytest.approx(np.linalg.norm(dense), rel=1e-12)
    damping = 1e-2
    shifted = dense + damping * np.eye(len(dense))
    assert ekfac.logdet(damping) == pytest.approx(np.linalg.slogdet(shifted)[1], rel=1e-10)
    v = np.random.default_rng(8).normal(size=len(dense))
    np.testing.assert_allclose(ekfac.matvec(v), dense @ v, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(
        ekfac.inverse(damping).matvec(v), np.linalg.solve(shifted, v), rtol=1e-8
    )


def test_batching_does_not_change_the_matrix(mlp, data, kfac):
    whole = KFACOperator.from_keras(mlp, "sparse_categorical_crossentropy", data)
    np.testing.assert_allclose(whole.to_dense(), kfac.to_dense(), rtol=1e-12, atol=1e-15)


def test_monte_carlo_approaches_type_2(mlp, data, kfac):
    mc = KFACOperator.from_keras(
        mlp, "sparse_categorical_crossentropy", data, kind="mc", num_samples=100, seed=5
    )
    few = KFACOperator.from_keras(
        mlp, "sparse_categorical_crossentropy", data, kind="mc", num_samples=1, seed=5
    )
    exact = kfac.to_dense()
    error = np.linalg.norm(mc.to_dense() - exact) / np.linalg.norm(exact)
    assert error < 0.1
    assert np.linalg.norm(few.to_dense() - exact) / np.linalg.norm(exact) > error


def test_snapshot_and_float32_model_in_float64(data):
    model = _mlp([5, CLASSES], ["tanh", "softmax"], seed=6)
    x, labels = data
    keras.utils.set_random_seed(6)
    f32 = keras.Sequential(
        [keras.Input((D_IN,)), keras.layers.Dense(5, activation="tanh"),
         keras.layers.Dense(CLASSES, activation="softmax")]
    )  # fmt: skip
    for w32, w64 in zip(f32.weights, model.weights):
        w32.assign(tf.cast(w64.value, tf.float32))
    op32 = KFACOperator.from_keras(f32, "sparse_categorical_crossentropy", data)
    op = KFACOperator.from_keras(
        f32, "sparse_categorical_crossentropy", (x.astype(np.float32), labels), dtype=np.float64
    )
    ref = KFACOperator.from_keras(model, "sparse_categorical_crossentropy", data)
    assert op32.dtype == np.float32 and op.dtype == np.float64
    np.testing.assert_allclose(op.to_dense(), ref.to_dense(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(op32.to_dense(), ref.to_dense(), rtol=1e-3, atol=1e-5)
    before = op.to_dense()
    for w in f32.weights:
        w.assign(w.value * 2)
    np.testing.assert_array_equal(op.to_dense(), before)
    assert not hasattr(f32.layers[0], "__dict__") or "call" not in f32.layers[0].__dict__


def test_other_variables(data):
    model = _mlp([5, CLASSES], ["tanh", "softmax"], seed=7, batchnorm=True)
    loss = "sparse_categorical_crossentropy"
    with pytest.raises(
        ValueError,
        match=r"'batch_normalization\w*' \(BatchNormalization\).*"
        r"other_variables='exclude'",
    ):
        KFACOperator.from_keras(model, loss, data)
    excluded = KFACOperator.from_keras(model, loss, data, other_variables="exclude")
    diagonal = KFACOperator.from_keras(model, loss, data, other_variables="diagonal")
    ggn = GGNOperator.from_keras(model, loss, data).matmat(np.eye(excluded.shape[0]))
    names = excluded.variable_names
    sizes = [int(np.prod(s)) for s in excluded.variable_shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    other = np.concatenate(
        [np.arange(offsets[j], offsets[j + 1]) for j, n in enumerate(names) if "batch_norm" in n]
    )
    assert len(other) == 10  # gamma and beta
    dense_excluded = excluded.to_dense()
    np.testing.assert_array_equal(dense_excluded[other], 0)
    dense_diagonal = diagonal.to_dense()
    np.testing.assert_allclose(np.diag(dense_diagonal)[other], np.diag(ggn)[other], rtol=1e-10)
    off = dense_diagonal[np.ix_(other, other)] - np.diag(np.diag(dense_diagonal)[other])
    np.testing.assert_array_equal(off, 0)
    np.testing.assert_allclose(
        np.linalg.eigvalsh(dense_diagonal)[::-1], diagonal.eigenvalues(), atol=1e-12
    )
    assert diagonal.trace() == pytest.approx(np.trace(dense_diagonal), rel=1e-12)


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"kind": "type2"}, ValueError, "kind must be one of 'type-2', 'mc', 'empirical'"),
        ({"kind": 2}, TypeError, "kind must be one of"),
        ({"num_samples": 3}, ValueError, "num_samples is for kind='mc'"),
        ({"kind": "mc", "num_samples": 0}, ValueError, "num_samples must be an integer >= 1"),
        ({"other_variables": "drop"}, ValueError, "other_variables must be one of"),
        ({"seed": -1}, ValueError, "seed must be a non-negative integer"),
    ],
)
def test_bad_arguments(mlp, data, keywords, error, match):
    with pytest.raises(error, match=match):
        KFACOperator.from_keras(mlp, "sparse_categorical_crossentropy", data, **keywords)


def test_refusals(mlp, data, kfac):
    x, labels = data
    loss = "sparse_categorical_crossentropy"
    with pytest.raises(ValueError, match="sample weights"):
        KFACOperator.from_keras(mlp, loss, (x, labels, np.ones(N)))
    with pytest.raises(ValueError, match="data is required"):
        KFACOperator.from_keras(mlp, loss)
    inputs = keras.Input((D_IN,), dtype=F64)
    shared_layer = keras.layers.Dense(D_IN, activation="tanh", dtype=F64)
    head = keras.layers.Dense(CLASSES, dtype=F64)
    shared = keras.Model(inputs, head(shared_layer(shared_layer(inputs))))
    with pytest.raises(ValueError, match=r"called more than once.*shared weights") as raised:
        KFACOperator.from_keras(shared, "mse", (x, np.zeros((N, CLASSES))))
    assert "\n" not in str(raised.value)
    assert "call" not in shared_layer.__dict__  # the layer is restored after the error
    with pytest.raises(ValueError, match="expected a vector of length"):
        kfac.matvec(np.ones(3))
    with pytest.raises(ValueError, match="damping must be >= 0"):
        kfac.inverse(-1.0)


# -- Conv2D (KFC) ---------------------------------------------------------------------------
H, W, C_IN, FILTERS = 4, 4, 2, 3


def _conv_model(seed, *, kernel=3, padding="same", strides=1, classes=CLASSES):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((H, W, C_IN), dtype=F64),
            keras.layers.Conv2D(
                FILTERS, kernel, strides=strides, padding=padding, activation="tanh", dtype=F64
            ),
            keras.layers.Flatten(dtype=F64),
            keras.layers.Dense(classes, activation="softmax", dtype=F64),
        ]
    )


def _patches(image, kernel, pad):
    """Patches of one (H, W, C) image by explicit slicing, each flattened (kh, kw, c)."""
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    rows = padded.shape[0] - kernel + 1
    cols = padded.shape[1] - kernel + 1
    return np.stack(
        [
            padded[i : i + kernel, j : j + kernel].reshape(-1)
            for i in range(rows)
            for j in range(cols)
        ]
    )


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(9)
    return rng.normal(size=(5, H, W, C_IN)), rng.integers(0, CLASSES, 5)


@pytest.mark.parametrize("variant", ["expand", "reduce"])
def test_conv_factors_match_their_definition(images, variant):
    x, labels = images
    model = _conv_model(10)
    op = KFACOperator.from_keras(
        model, "sparse_categorical_crossentropy", images, batch_size=2, conv=variant
    )
    conv, dense = model.layers[0], model.layers[2]
    kernel = conv.kernel.numpy().reshape(-1, FILTERS)
    d_a = kernel.shape[0] + 1
    A, G = np.zeros((d_a, d_a)), np.zeros((FILTERS, FILTERS))
    for i in range(len(x)):
        abar = np.concatenate([_patches(x[i], 3, 1), np.ones((H * W, 1))], axis=1)
        z = tf.constant((abar[:, :-1] @ kernel + conv.bias.numpy())[None])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(z)
            logits = tf.reshape(tf.tanh(z), [1, -1]) @ dense.kernel.value + dense.bias.value
            with tf.GradientTape() as outer:
                outer.watch(logits)
                with tf.GradientTape() as inner:
                    inner.watch(logits)
                    loss = keras.losses.sparse_categorical_crossentropy(
                        labels[i : i + 1], logits, from_logits=True
                    )[0]
                grad = inner.gradient(loss, logits)
            hessian = outer.jacobian(grad, logits).numpy().reshape(CLASSES, CLASSES)
        values, vectors = np.linalg.eigh(hessian)
        columns = vectors * np.sqrt(np.maximum(values, 0))
        if variant == "expand":
            A += abar.T @ abar / (H * W) / len(x)
        else:
            mean = abar.mean(axis=0)
            A += np.outer(mean, mean) / len(x)
        for c in range(CLASSES):
            g = tape.gradient(logits, z, output_gradients=tf.constant(columns[None, :, c]))
            g = g.numpy().reshape(H * W, FILTERS)
            if variant == "expand":
                G += g.T @ g / len(x)
            else:
                G += np.outer(g.sum(axis=0), g.sum(axis=0)) / len(x)
    block = op.blocks[0]
    np.testing.assert_allclose(block.A, A, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(block.G, G, rtol=1e-10, atol=1e-14)
    dense_op = op.to_dense()
    rng = np.random.default_rng(11)
    v = rng.normal(size=op.shape[0])
    np.testing.assert_allclose(op.matvec(v), dense_op @ v, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(
        op.eigenvalues(), np.linalg.eigvalsh(dense_op)[::-1], atol=1e-12 * op.eigenvalues()[0]
    )


def test_conv_with_one_position_and_one_example_equals_the_ggn(images):
    x, labels = images
    # A 4x4 kernel on a 4x4 image without padding: one output position (T = 1).
    model = _conv_model(12, kernel=4, padding="valid")
    loss = "sparse_categorical_crossentropy"
    ggn = GGNOperator.from_keras(model, loss, (x[:1], labels[:1]))
    exact = ggn.matmat(np.eye(ggn.shape[0]))
    conv_rows = np.arange(int(np.prod(model.layers[0].kernel.shape)) + FILTERS)
    for variant in ("expand", "reduce"):
        op = KFACOperator.from_keras(model, loss, (x[:1], labels[:1]), conv=variant)
        block = op.to_dense()[np.ix_(conv_rows, conv_rows)]
        np.testing.assert_allclose(block, exact[np.ix_(conv_rows, conv_rows)], atol=1e-12)


def test_conv_ekfac_against_the_dense_projection(images):
    model = _conv_model(13, strides=2)
    loss = "sparse_categorical_crossentropy"
    ekfac = EKFACOperator.from_keras(model, loss, images, batch_size=2)
    ggn = GGNOperator.from_keras(model, loss, images).matmat(np.eye(ekfac.shape[0]))
    for block in ekfac.blocks:
        rows = np.r_[block.kernel_slice, block.bias_slice]
        Q = np.kron(*block.basis)
        expected = np.diag(Q.T @ ggn[np.ix_(rows, rows)] @ Q).reshape(block.scalings.shape)
        np.testing.assert_allclose(block.scalings, expected, rtol=1e-9, atol=1e-14)


def test_dataset_input_and_unsupported_layers(mlp, data, kfac):
    x, labels = data
    dataset = tf.data.Dataset.from_tensor_slices((x, labels)).batch(BATCH)
    from_dataset = KFACOperator.from_keras(mlp, "sparse_categorical_crossentropy", dataset)
    np.testing.assert_allclose(from_dataset.to_dense(), kfac.to_dense(), rtol=1e-12, atol=1e-15)
    normalized = keras.Sequential(
        [keras.Input((D_IN,), dtype=F64), keras.layers.LayerNormalization(dtype=F64),
         keras.layers.Dense(CLASSES, dtype=F64)]
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"layer 'layer_normalization\w*' \(LayerNormalization\): '"
    ):
        KFACOperator.from_keras(normalized, "mse", (x, np.zeros((N, CLASSES))))
    with pytest.raises(ValueError, match="reduction='sum'"):
        KFACOperator.from_keras(
            mlp,
            keras.losses.SparseCategoricalCrossentropy(reduction="sum"),
            data,
            kind="empirical",
        )


# -- Embedding ------------------------------------------------------------------------------
VOCAB, SEQ, EMBED = 5, 3, 2


def _embedding_model(seed, *, length=SEQ, mask_zero=False, vocab=VOCAB):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((length,), dtype="int32"),
            keras.layers.Embedding(vocab, EMBED, mask_zero=mask_zero, dtype=F64),
            keras.layers.Flatten(dtype=F64),
            keras.layers.Dense(CLASSES, activation="softmax", dtype=F64),
        ]
    )


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(14)
    return rng.integers(0, VOCAB, (6, SEQ)), rng.integers(0, CLASSES, 6)


@pytest.mark.parametrize("variant", ["expand", "reduce"])
def test_embedding_factors_match_their_definition(tokens, variant):
    x, labels = tokens
    model = _embedding_model(15)
    loss = "sparse_categorical_crossentropy"
    op = KFACOperator.from_keras(model, loss, tokens, batch_size=4, conv=variant)
    table, dense = model.layers[0].embeddings.numpy(), model.layers[2]
    A, G = np.zeros((VOCAB, VOCAB)), np.zeros((EMBED, EMBED))
    for i in range(len(x)):
        onehot = np.eye(VOCAB)[x[i]]  # (T, V): the layer's input, one row per position
        z = tf.constant((onehot @ table)[None])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(z)
            logits = tf.reshape(z, [1, -1]) @ dense.kernel.value + dense.bias.value
            with tf.GradientTape() as outer:
                outer.watch(logits)
                with tf.GradientTape() as inner:
                    inner.watch(logits)
                    value = keras.losses.sparse_categorical_crossentropy(
                        labels[i : i + 1], logits, from_logits=True
                    )[0]
                grad = inner.gradient(value, logits)
            hessian = outer.jacobian(grad, logits).numpy().reshape(CLASSES, CLASSES)
        values, vectors = np.linalg.eigh(hessian)
        columns = vectors * np.sqrt(np.maximum(values, 0))
        if variant == "expand":
            A += onehot.T @ onehot / SEQ / len(x)
        else:
            A += np.outer(onehot.mean(axis=0), onehot.mean(axis=0)) / len(x)
        for c in range(CLASSES):
            g = tape.gradient(logits, z, output_gradients=tf.constant(columns[None, :, c]))
            g = g.numpy().reshape(SEQ, EMBED)
            if variant == "expand":
                G += g.T @ g / len(x)
            else:
                G += np.outer(g.sum(axis=0), g.sum(axis=0)) / len(x)
    block = op.blocks[0]
    assert block.kernel == op.variable_names[0] and block.bias is None
    np.testing.assert_allclose(block.A, A, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(block.G, G, rtol=1e-10, atol=1e-15)
    assert np.abs(block.G).max() > 1e-3
    if variant == "expand":  # diagonal: the token frequencies (1/(NT)) counts
        counts = np.bincount(x.ravel(), minlength=VOCAB)
        np.testing.assert_array_equal(block.A - np.diag(np.diag(block.A)), 0)
        np.testing.assert_allclose(np.diag(block.A), counts / (len(x) * SEQ), rtol=1e-15)
    dense_op = op.to_dense()
    rows = np.arange(VOCAB * EMBED)
    np.testing.assert_allclose(dense_op[np.ix_(rows, rows)], np.kron(A, G), rtol=1e-10, atol=1e-15)
    # EKFAC on the same layer: the scalings are the exact GGN block in K-FAC's eigenbasis.
    ekfac = EKFACOperator.from_keras(model, loss, tokens, batch_size=4, conv=variant)
    ggn = GGNOperator.from_keras(model, loss, tokens).matmat(np.eye(op.shape[0]))
    Q = np.kron(*ekfac.blocks[0].basis)
    expected = np.diag(Q.T @ ggn[np.ix_(rows, rows)] @ Q).reshape(VOCAB, EMBED)
    np.testing.assert_allclose(ekfac.blocks[0].scalings, expected, rtol=1e-9, atol=1e-14)


def test_embedding_with_one_example_and_one_position_equals_the_ggn(tokens):
    x, labels = tokens
    model = _embedding_model(16, length=1)
    loss = "sparse_categorical_crossentropy"
    one = (x[:1, :1], labels[:1])
    exact = GGNOperator.from_keras(model, loss, one).matmat(np.eye(model.count_params()))
    rows = np.arange(VOCAB * EMBED)
    block = KFACOperator.from_keras(model, loss, one).to_dense()[np.ix_(rows, rows)]
    np.testing.assert_allclose(block, exact[np.ix_(rows, rows)], rtol=0, atol=1e-12)
    assert np.abs(exact[np.ix_(rows, rows)]).max() > 1e-2
    # Several positions: the table is shared, and the expand factors are an approximation.
    model = _embedding_model(16)
    exact = GGNOperator.from_keras(model, loss, tokens).matmat(np.eye(model.count_params()))
    block = KFACOperator.from_keras(model, loss, tokens).to_dense()[np.ix_(rows, rows)]
    assert np.linalg.norm(block - exact[np.ix_(rows, rows)]) > 1e-2 * np.linalg.norm(block)


def test_embedding_refusals(tokens):
    loss = "sparse_categorical_crossentropy"
    masked = keras.Sequential(
        [keras.Input((SEQ,), dtype="int32"),
         keras.layers.Embedding(VOCAB, EMBED, mask_zero=True, dtype=F64),
         keras.layers.GlobalAveragePooling1D(dtype=F64),
         keras.layers.Dense(CLASSES, activation="softmax", dtype=F64)]
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"'embedding\w*' has mask_zero=True") as raised:
        KFACOperator.from_keras(masked, loss, tokens)
    assert "\n" not in str(raised.value)
    large = _embedding_model(17, vocab=5000)
    with pytest.raises(ValueError, match="vocabulary of 5000 tokens, more than 4096"):
        KFACOperator.from_keras(large, loss, tokens)
    large.layers[0].trainable = False
    excluded = KFACOperator.from_keras(large, loss, tokens)
    assert len(excluded.blocks) == 1 and excluded.shape[0] == SEQ * EMBED * CLASSES + CLASSES


# -- Conv1D (causal padding included) -------------------------------------------------------
LENGTH, C1 = 6, 2


@pytest.mark.parametrize(
    ("padding", "strides", "dilation"), [("causal", 1, 2), ("valid", 2, 1), ("same", 1, 1)]
)
def test_conv1d_factors_match_their_definition(padding, strides, dilation):
    rng = np.random.default_rng(18)
    x, labels = rng.normal(size=(5, LENGTH, C1)), rng.integers(0, CLASSES, 5)
    keras.utils.set_random_seed(19)
    model = keras.Sequential(
        [
            keras.Input((LENGTH, C1), dtype=F64),
            keras.layers.Conv1D(
                FILTERS, 3, strides=strides, dilation_rate=dilation, padding=padding,
                activation="tanh", dtype=F64,
            ),
            keras.layers.Flatten(dtype=F64),
            keras.layers.Dense(CLASSES, activation="softmax", dtype=F64),
        ]
    )  # fmt: skip
    loss = "sparse_categorical_crossentropy"
    op = KFACOperator.from_keras(model, loss, (x, labels), batch_size=2)
    conv, dense = model.layers[0], model.layers[2]
    kernel = conv.kernel.numpy().reshape(-1, FILTERS)
    # Patches by explicit slicing of the padded sequence: positions t·s + j·d, j < 3.
    span = dilation * 2
    left = {"causal": span, "valid": 0, "same": span // 2}[padding]
    right = {"causal": 0, "valid": 0, "same": span - span // 2}[padding]
    A, G = np.zeros((3 * C1 + 1,) * 2), np.zeros((FILTERS, FILTERS))
    for i in range(len(x)):
        padded = np.pad(x[i], ((left, right), (0, 0)))
        starts = range(0, len(padded) - span, strides)
        patches = np.stack([padded[t : t + span + 1 : dilation].reshape(-1) for t in starts])
        abar = np.concatenate([patches, np.ones((len(patches), 1))], axis=1)
        z = tf.constant((patches @ kernel + conv.bias.numpy())[None])
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(z)
            logits = tf.reshape(tf.tanh(z), [1, -1]) @ dense.kernel.value + dense.bias.value
            with tf.GradientTape() as outer:
                outer.watch(logits)
                with tf.GradientTape() as inner:
                    inner.watch(logits)
                    value = keras.losses.sparse_categorical_crossentropy(
                        labels[i : i + 1], logits, from_logits=True
                    )[0]
                grad = inner.gradient(value, logits)
            hessian = outer.jacobian(grad, logits).numpy().reshape(CLASSES, CLASSES)
        # The sliced patches are the layer's: the model's own output is reproduced.
        np.testing.assert_allclose(tf.nn.softmax(logits), model(x[i : i + 1]), rtol=1e-12)
        values, vectors = np.linalg.eigh(hessian)
        columns = vectors * np.sqrt(np.maximum(values, 0))
        A += abar.T @ abar / len(patches) / len(x)
        for c in range(CLASSES):
            g = tape.gradient(logits, z, output_gradients=tf.constant(columns[None, :, c]))
            g = g.numpy().reshape(len(patches), FILTERS)
            G += g.T @ g / len(x)
    block = op.blocks[0]
    np.testing.assert_allclose(block.A, A, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(block.G, G, rtol=1e-10, atol=1e-14)
    assert np.abs(block.G).max() > 1e-3


def test_a_custom_loss_reading_the_logits_is_split_there(mlp, data, kfac):
    """The reviewer's custom mean cross-entropy on a softmax model: Keras computes it from
    the logits behind the softmax, so its gradient in the output is None (before: an
    AttributeError for type-2 and a TypeError for "empirical"). The split moves to the
    logits, as for the named loss: the same matrix."""

    def fn(yt, yp):
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(yt, yp))

    custom = KFACOperator.from_keras(mlp, fn, data, batch_size=BATCH)
    np.testing.assert_allclose(custom.to_dense(), kfac.to_dense(), rtol=1e-12, atol=1e-14)
    named = "sparse_categorical_crossentropy"
    for cls, kind in ((KFACOperator, "empirical"), (EKFACOperator, "type-2")):
        got = cls.from_keras(mlp, fn, data, batch_size=BATCH, kind=kind).to_dense()
        want = cls.from_keras(mlp, named, data, batch_size=BATCH, kind=kind).to_dense()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    # A loss with no gradient in the output at all is refused in one line.
    logits_model = _mlp([5, CLASSES], ["tanh", None])
    with pytest.raises(ValueError, match="the loss has no gradient in the model's output") as info:
        KFACOperator.from_keras(
            logits_model,
            lambda yt, yp: keras.ops.mean(keras.ops.stop_gradient(yp)),
            data,
            kind="empirical",
        )
    assert "\n" not in str(info.value)


def test_logdet_refuses_a_negative_damping_like_inverse(kfac):
    for method in (kfac.logdet, kfac.inverse):
        with pytest.raises(ValueError, match=r"damping must be >= 0, got -0\.01"):
            method(-1e-2)
    # Before: logdet(-1e-2) returned a number. At 0 and above it is the exact sum.
    values = np.linalg.eigvalsh(kfac.to_dense())
    assert kfac.logdet(1e-2) == pytest.approx(np.sum(np.log(values + 1e-2)), rel=1e-10)


def test_each_pass_is_traced_once_per_batch_shape_and_reused():
    """The per-batch computation is one compiled function per pass kind and batch shape,
    traced once and reused for every batch of that shape, and by the next operator built
    on the same model with the same settings, which still reads the current weights."""
    model = _mlp([5, CLASSES], ["tanh", "softmax"], seed=3)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(12, D_IN))
    labels = rng.integers(0, CLASSES, 12)
    loss = "sparse_categorical_crossentropy"
    first = EKFACOperator.from_keras(model, loss, (x, labels), batch_size=3)  # 4 batches
    assert first._build_traces == {"factors": 1, "scalings": 1}
    again = EKFACOperator.from_keras(model, loss, (x, labels), batch_size=3)
    assert again._build_traces == {"factors": 0, "scalings": 0}
    for a, b in zip(first.blocks, again.blocks):
        np.testing.assert_array_equal(a.A, b.A)
        np.testing.assert_array_equal(a.scalings, b.scalings)
    # K-FAC shares EKFAC's first pass; a last, smaller batch traces once more.
    uneven = KFACOperator.from_keras(model, loss, (x[:11], labels[:11]), batch_size=3)
    assert uneven._build_traces == {"factors": 1, "scalings": 0}
    # New weights: no new trace, and the factors are those of the new weights.
    kernel = model.layers[0].kernel
    kernel.assign(2 * kernel.numpy())
    moved = KFACOperator.from_keras(model, loss, (x, labels), batch_size=3)
    assert moved._build_traces == {"factors": 0, "scalings": 0}
    fresh = KFACOperator.from_keras(_mlp_like(model), loss, (x, labels), batch_size=3)
    for a, b in zip(moved.blocks, fresh.blocks):
        np.testing.assert_allclose(a.A, b.A, rtol=1e-12)
        np.testing.assert_allclose(a.G, b.G, rtol=1e-10, atol=1e-14)
    assert not np.allclose(moved.blocks[1].A, first.blocks[1].A)


def _mlp_like(model):
    """A new model with ``model``'s architecture and current weights."""
    copy = _mlp([5, CLASSES], ["tanh", "softmax"], seed=4)
    copy.set_weights(model.get_weights())
    return copy


def test_products_in_tensorflow_match_the_dense_matrix(monkeypatch, data):
    """The compiled TensorFlow products (used where TensorFlow has a GPU) give the
    same K-FAC, EKFAC and damped inverses as the dense matrices, other variables' diagonal
    included; the memory plan counts the factors and the device copies."""
    from spectra.operators import kfac as kfac_module

    model = _mlp([5, CLASSES], ["tanh", "softmax"], seed=7, batchnorm=True)
    loss = "sparse_categorical_crossentropy"
    rng = np.random.default_rng(4)
    for cls in (KFACOperator, EKFACOperator):
        op = cls.from_keras(model, loss, data, other_variables="diagonal")
        dense = op.to_dense()  # NumPy's products, checked against the GGN above
        assert not op._products_in_tensorflow()
        numpy_plan = op.memory_plan(4)
        monkeypatch.setattr(kfac_module, "PRODUCTS_IN_TENSORFLOW", True)
        assert op._products_in_tensorflow()
        V = rng.normal(size=(op.shape[0], 3))
        np.testing.assert_allclose(op.matmat(V), dense @ V, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(op.matvec(V[:, 0]), dense @ V[:, 0], rtol=1e-12, atol=1e-14)
        assert op._compiled.num_traces == 1
        shifted = dense + 1e-2 * np.eye(len(dense))
        np.testing.assert_allclose(
            op.inverse(1e-2).matmat(V), np.linalg.solve(shifted, V), rtol=1e-8, atol=1e-10
        )
        plan = op.memory_plan(4)
        factors = sum(b.A.nbytes + b.G.nbytes for b in op.blocks) + 8 * 10  # BN's diagonal
        if cls is EKFACOperator:
            factors += sum(b.scalings.nbytes for b in op.blocks)
        assert plan.factors == numpy_plan.factors == factors
        assert numpy_plan.product_copies == 0 and numpy_plan.device == "NumPy"
        assert plan.product_copies > 0 and plan.device == "TensorFlow"
        assert plan.eigendecompositions_made
        assert plan.peak == plan.factors + plan.eigendecompositions + plan.product_copies + (
            4 * plan.per_vector
        )
        assert "K-FAC memory plan" in str(plan) and "TensorFlow" in str(plan)
        monkeypatch.undo()


def test_diagonal_for_other_variables_when_every_variable_is_factored(images):
    """other_variables="diagonal" on a model whose variables are all factored (a Conv2D and
    a Dense layer) is the same operator as the default (before: a KeyError in the pass)."""
    x, y = images
    model = _conv_model(3)
    loss = "sparse_categorical_crossentropy"
    for cls in (KFACOperator, EKFACOperator):
        default = cls.from_keras(model, loss, (x, y))
        diagonal = cls.from_keras(model, loss, (x, y), other_variables="diagonal")
        np.testing.assert_array_equal(diagonal.to_dense(), default.to_dense())


# K-FAC and EKFAC where floating point decides: singular and graded factors, rounding in
# the output Hessian, Monte Carlo labels under rebatching, bad data and NaN vectors.
#
# Truths: the operator's dense matrix (``to_dense``, the Kronecker products placed in a
# float64 array) with numpy ``eigh``/``slogdet``/``solve``, and exact reasoning on a single
# linear layer under MSE, whose K-FAC is A ⊗ (2/d) I with A computed in numpy from the data.

SPARSE = "sparse_categorical_crossentropy"


def _softmax_mlp(dtype, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(5, activation="tanh", dtype=dtype),
            keras.layers.Dense(3, activation="softmax", dtype=dtype),
        ]
    )


@pytest.fixture(scope="module")
def classification():
    rng = np.random.default_rng(1)
    return rng.normal(size=(50, 4)), rng.integers(0, 3, 50)


# -- 1. singular K: the softmax's all-ones null direction of the last layer's G ----------
@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_singular_kfac_is_refused_with_a_damping_that_works(classification, cls, dtype):
    x, labels = classification
    model = _softmax_mlp(dtype)
    op = cls.from_keras(model, SPARSE, (x.astype(dtype), labels), batch_size=10)
    # Truth: G of the last layer has the all-ones vector in its null space (softmax
    # cross-entropy at the logits), so K has one zero eigenvalue per eigenvalue of that
    # layer's A (6: five inputs and the bias); everything else is positive here.
    zeros = op.blocks[-1].A.shape[0]
    values = op.eigenvalues()
    assert np.count_nonzero(values == 0) == zeros
    assert values[-zeros - 1] > 1e-6 * values[0]  # the rest kept, not rounded away
    # Before: logdet(0) -294.9 (float32) / -380.4 (float64) and |inverse(0) @ 1| ~ 4e10 /
    # 2e18, numbers made of rounding.
    for method in (op.logdet, op.inverse):
        with pytest.raises(ValueError, match=rf"K \+ 0·I is singular: {zeros} of K's") as err:
            method(0.0)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="singular"):
        op.inverse(0.0) @ np.ones(op.shape[0])
    advice = re.search(r"e\.g\. damping=(\S+) ", str(err.value))
    assert advice is not None
    damping = float(advice.group(1))
    # Following the advice works, and gives the dense matrix's numbers.
    dense = op.to_dense()
    shifted = dense + damping * np.eye(len(dense))
    sign, logdet = np.linalg.slogdet(shifted)
    assert sign == 1
    assert op.logdet(damping) == pytest.approx(logdet, rel=1e-10)
    v = np.random.default_rng(0).normal(size=op.shape[0])
    np.testing.assert_allclose(
        op.inverse(damping).matvec(v), np.linalg.solve(shifted, v), rtol=1e-8
    )
    # A damping below the rounding bound is refused as well; one above it is taken.
    bound = float(re.search(r"pass damping > (\S+),", str(err.value)).group(1))
    with pytest.raises(ValueError, match="singular"):
        op.logdet(bound / 2)
    assert np.isfinite(op.logdet(2 * bound))


def test_the_message_names_no_dtype_dependent_eigenvalue(classification):
    x, labels = classification
    messages = []
    for dtype in ("float32", "float64"):
        op = KFACOperator.from_keras(_softmax_mlp(dtype), SPARSE, (x.astype(dtype), labels))
        with pytest.raises(ValueError) as err:
            op.logdet()
        messages.append(str(err.value))
    for message in messages:  # the zero eigenvalues are reported as 0, with their bound
        assert "6 of K's 43 eigenvalues are 0 (true size at most" in message


# -- 2. graded factors: inputs x 1e-30 beside the bias coordinate ----------------------
SCALE = 1e-30


@pytest.fixture(scope="module")
def graded():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,), dtype="float64"), keras.layers.Dense(3, dtype="float64")]
    )
    rng = np.random.default_rng(1)
    x0 = rng.normal(size=(20, 4))
    return model, x0, rng.normal(size=(20, 3))


def _graded_truth(x0):
    """A = (1/N) Σ ā āᵀ with ā = [s x; 1], from its exact structure: the eigenvalues are
    s² eig(cov x) (the Schur complement of the bias entry) and 1 + O(s²) = 1 in float64."""
    cov = np.cov(x0.T, bias=True)
    return np.r_[SCALE**2 * np.linalg.eigvalsh(cov), 1.0]


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_graded_factors_logdet_is_exact(graded, cls):
    model, x0, y = graded
    op = cls.from_keras(model, "mse", (x0 * SCALE, y), batch_size=7)
    np.testing.assert_allclose(op.blocks[0].G, (2 / 3) * np.eye(3), rtol=1e-14, atol=1e-16)
    alpha, gamma = _graded_truth(x0), np.full(3, 2 / 3)
    np.testing.assert_allclose(
        np.sort(op.eigenvalues()), np.sort(np.outer(alpha, gamma).ravel()), rtol=1e-12
    )
    dense = op.to_dense()
    for damping in (1e-70, 1e-62, 1e-3):
        truth = float(np.sum(np.log(np.outer(alpha, gamma) + damping)))
        # Before: -1802.9 (K-FAC) and -1668.6 (EKFAC) against -1669.3 at 1e-70.
        assert op.logdet(damping) == pytest.approx(truth, rel=1e-12)
        sign, logdet = np.linalg.slogdet(dense + damping * np.eye(len(dense)))
        assert sign == 1 and op.logdet(damping) == pytest.approx(logdet, rel=1e-12)


def test_graded_factors_inverse_is_exact(graded):
    model, x0, y = graded
    op = KFACOperator.from_keras(model, "mse", (x0 * SCALE, y), batch_size=7)
    damping, gamma = 1e-70, 2 / 3
    # Truth: (A ⊗ γI + δI)⁻¹ acts on the kernel-and-bias matrix M (5 x 3) as
    # (γA + δI)⁻¹ M; solved on its diagonally scaled form, which is well conditioned.
    abar = np.c_[x0 * SCALE, np.ones(len(x0))]
    shifted = gamma * abar.T @ abar / len(x0) + damping * np.eye(5)
    d = np.sqrt(np.diag(shifted))
    v = np.random.default_rng(3).normal(size=op.shape[0])
    M = np.concatenate([v[:12].reshape(4, 3), v[12:].reshape(1, 3)])
    X = np.linalg.solve(shifted / np.outer(d, d), M / d[:, None]) / d[:, None]
    truth = np.r_[X[:4].ravel(), X[4]]
    np.testing.assert_allclose(op.inverse(damping).matvec(v), truth, rtol=1e-9)


# -- 3. type-2: rounding of the output Hessian is not non-convexity --------------------
@pytest.fixture(scope="module")
def digits_subset():
    model = keras.models.load_model("data/digits_mlp.keras", compile=False)
    data = np.load("data/digits.npz")
    # Examples 16-23: on them, batch_size=4 was refused and batch_size=8 built.
    return model, data["x"][16:24], data["y"][16:24]


def test_type2_builds_the_readme_model_at_batch_4(digits_subset):
    model, x, y = digits_subset
    # Before: batch_size=4 refused as a "non-convex loss" (eigenvalue -1.75e-08, rounding
    # of p - p² judged against the batch), though it built at 8 (and 32).
    small = KFACOperator.from_keras(model, SPARSE, (x, y), batch_size=4)
    large = KFACOperator.from_keras(model, SPARSE, (x, y), batch_size=8)
    for a, b in zip(small.blocks, large.blocks):
        # A (257 wide) is summed in float32 (factors over 64 wide: see _gram) and G comes
        # from float32 backward passes: rounding differs with the batch shapes (A by
        # 3e-8 of its largest entry on an AVX2 machine, bit-identical on an AVX-512 one).
        np.testing.assert_allclose(a.A, b.A, rtol=0, atol=1e-6 * np.abs(b.A).max())
        np.testing.assert_allclose(a.G, b.G, rtol=0, atol=1e-5 * np.abs(b.G).max())


def test_type2_custom_loss_rounding_judged_over_the_dataset(digits_subset):
    model, x, y = digits_subset

    def custom(y_true, y_pred):  # not recognized as convex: the numeric check runs
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred))

    op = KFACOperator.from_keras(model, custom, (x, y), batch_size=4)
    named = KFACOperator.from_keras(model, SPARSE, (x, y), batch_size=4)
    for a, b in zip(op.blocks, named.blocks):
        # The named loss's output-Hessian root is the closed form √p_c (e_c − p), the
        # custom one's from each example's eigh: the same G up to the float32 rounding of
        # the backward passes (measured 2e-6 of its largest entry).
        np.testing.assert_allclose(a.G, b.G, rtol=0, atol=1e-5 * np.abs(b.G).max())


def test_type2_refuses_a_loss_that_is_not_convex():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((2,), dtype="float64"), keras.layers.Dense(2, dtype="float64")]
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 2)), rng.normal(size=(6, 2))

    def wavy(y_true, y_pred):  # output Hessian -cos(z - y): indefinite
        return keras.ops.mean(keras.ops.cos(y_pred - y_true))

    with pytest.raises(ValueError, match="needs a loss convex in the model's outputs") as err:
        KFACOperator.from_keras(model, wavy, (x, y), batch_size=2)
    assert "\n" not in str(err.value)


# -- 4. errors as the exact operators give them ---------------------------------------
def _numerics_embedding_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(10, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(10, 4)
        self.flat = keras.layers.Flatten()
        self.head = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.head(self.flat(self.embed(x)))


TOKENS = np.array([[1, 2, 3], [4, 12, 1]])


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_out_of_range_index_and_label_are_one_line(cls):
    model = _numerics_embedding_model()
    with pytest.raises(
        ValueError, match=r"indices must lie in \[0, 10\), but x\[1, 1\] = 12"
    ) as err:
        cls.from_keras(model, SPARSE, (TOKENS, np.array([0, 1])))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"class indices in \[0, 3\).*y\[1\] = 7") as err:
        cls.from_keras(model, SPARSE, (TOKENS % 10, np.array([0, 7])))
    assert "\n" not in str(err.value)
    subclassed = _Subclassed()
    subclassed(TOKENS[:1])
    # No declared inputs to check before the pass: the layer's error, its cause first.
    with pytest.raises(
        Exception, match=r"^batch 0: indices\[1,1\] = 12 is not in \[0, 10\)"
    ) as err:
        cls.from_keras(subclassed, SPARSE, (TOKENS, np.array([0, 1])))
    assert "Exception encountered" not in str(err.value)


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_nan_vectors_are_refused_like_the_exact_operators(classification, cls):
    x, labels = classification
    op = cls.from_keras(_softmax_mlp("float64"), SPARSE, (x, labels))
    v = np.ones(op.shape[0])
    v[3] = np.nan
    inverse = op.inverse(1e-2)
    for name, call in (
        ("matvec", lambda: op.matvec(v)),
        ("matmat", lambda: op.matmat(v[:, None])),
        ("matvec", lambda: op @ v),
        ("inverse", lambda: inverse.matvec(v)),
        ("inverse", lambda: inverse @ np.c_[v, v]),
    ):
        with pytest.raises(ValueError, match=rf"^{name}: the input contains NaN or Inf\.$"):
            call()
    v[3] = np.inf
    with pytest.raises(ValueError, match="contains NaN or Inf"):
        inverse.matvec(v)


# -- 5. Monte Carlo labels per example: the matrix does not depend on the batching -----
@pytest.mark.parametrize(
    ("num_samples", "cls"),
    [
        # make test runs K-FAC with 2 samples per example and EKFAC (whose scalings pass
        # draws its own labels) with 1; make test-all all four.
        pytest.param(1, KFACOperator, marks=pytest.mark.long),
        pytest.param(1, EKFACOperator),
        pytest.param(2, KFACOperator),
        pytest.param(2, EKFACOperator, marks=pytest.mark.long),
    ],
    ids=["1-KFACOperator", "1-EKFACOperator", "2-KFACOperator", "2-EKFACOperator"],
)
def test_monte_carlo_kfac_does_not_depend_on_batch_size(classification, cls, num_samples):
    x, labels = classification
    x, labels = x[:7], labels[:7]
    model = _softmax_mlp("float64")
    dense = [
        cls.from_keras(
            model, SPARSE, (x, labels), batch_size=b, kind="mc", num_samples=num_samples, seed=3
        ).to_dense()
        for b in (1, 3, 7)
    ]
    # Before: 25 % apart between batch sizes (labels seeded by the batch index).
    for other in dense[:-1]:
        np.testing.assert_allclose(other, dense[-1], rtol=0, atol=1e-13 * np.abs(dense[-1]).max())
    other_seed = cls.from_keras(
        model, SPARSE, (x, labels), batch_size=7, kind="mc", num_samples=num_samples, seed=4
    ).to_dense()
    assert np.abs(other_seed - dense[-1]).max() > 1e-3 * np.abs(dense[-1]).max()
