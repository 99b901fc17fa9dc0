"""K-FAC and EKFAC of layers that share their weights over positions: Dense on sequences,
EinsumDense (attention's projections) and ReversibleEmbedding (a tiny GPT-2 end to end is in
test_kfac_pass.py).

The references do not use the operator's capture: each model is run again by a plain
NumPy forward pass (z = a W + b per position, tanh, flatten, a softmax head) and the output
gradients are back-propagated by hand through the same formulas, from the columns of a
square root of the softmax cross-entropy's output Hessian diag(p) − ppᵀ (type-2). The
factors are then formed from their definitions (Eschenhagen et al. 2023): "expand"
A = (1/(NT)) Σ_{n,t} ā ā ᵀ, G = (1/N) Σ_{n,t,c} g gᵀ; "reduce" A from each example's mean ā,
G from Σ_t g.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra.operators import GGNOperator
from spectra.operators.ekfac import EKFACOperator
from spectra.operators.kfac import KFACOperator

F64 = "float64"
N, T, D, CLASSES = 5, 3, 4, 3
LOSS = "sparse_categorical_crossentropy"


def _close(got, want, tol=1e-10):
    """|got − want| ≤ tol · max|want| entrywise (and want is not trivially zero)."""
    scale = float(np.abs(want).max())
    assert scale > 1e-6
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


class _Layer:
    """One hidden layer of a reference model in NumPy: ``forward`` (h → z), ``rows``
    (h → the per-position inputs a, T × d_in, in the kernel's row order), ``cols``
    (∂z → the per-position output gradients g, T × d_out, in the kernel's column order),
    ``back`` (∂z → ∂h); ``bias``: whether the layer has one."""

    def __init__(self, forward, rows, cols, back, bias):
        self.forward, self.rows, self.cols, self.back, self.bias = forward, rows, cols, back, bias


def _dense(layer):
    W, b = layer.kernel.numpy(), layer.bias.numpy()
    return _Layer(lambda h: h @ W + b, lambda h: h, lambda dz: dz, lambda dz: dz @ W.T, True)


def _einsum(layer):
    """The EinsumDense equations of the tests, written out per example (batch axis dropped)."""
    K = layer.kernel.numpy()
    b = 0.0 if layer.bias is None else layer.bias.numpy()
    bias = layer.bias is not None
    if layer.equation == "abc,cde->abde":  # query/key/value: (T, c) -> (T, heads, dim)
        return _Layer(
            lambda h: np.einsum("tc,cde->tde", h, K) + b,
            lambda h: h,
            lambda dz: dz.reshape(len(dz), -1),
            lambda dz: np.einsum("tde,cde->tc", dz, K),
            bias,
        )
    if layer.equation == "abcd,cde->abe":  # attention output: (T, heads, dim) -> (T, e)
        return _Layer(
            lambda h: np.einsum("tcd,cde->te", h, K) + b,
            lambda h: h.reshape(len(h), -1),
            lambda dz: dz,
            lambda dz: np.einsum("te,cde->tcd", dz, K),
            bias,
        )
    assert layer.equation == "acb,cd->adb"  # channels first: (c, T) -> (d, T)
    return _Layer(
        lambda h: np.einsum("ct,cd->dt", h, K) + b,  # Keras' bias has shape (d, 1)
        lambda h: h.T,
        lambda dz: dz.T,
        lambda dz: np.einsum("dt,cd->ct", dz, K),
        bias,
    )


def _reference(model, hidden, x, labels, variant):
    """Per layer (hidden ones, then the softmax head): the factors A, G of ``variant`` and
    the per-example gradient matrices Σ_t ā_t g_tᵀ of every column, from NumPy alone."""
    head = model.layers[-1]
    Wd, bd = head.kernel.numpy(), head.bias.numpy()
    layers = [*hidden, _dense(head)]
    A = [None] * len(layers)
    G = [None] * len(layers)
    per_example = [[] for _ in layers]
    for n in range(len(x)):
        h, inputs, zs = x[n], [], []
        for layer in hidden:
            inputs.append(h)
            zs.append(layer.forward(h))
            h = np.tanh(zs[-1])
        flat = h.reshape(-1)
        logits = flat @ Wd + bd
        p = np.exp(logits - logits.max())
        p /= p.sum()
        values, vectors = np.linalg.eigh(np.diag(p) - np.outer(p, p))
        columns = vectors * np.sqrt(np.maximum(values, 0))
        abars = []
        for layer, a in zip(layers, [*inputs, flat[None]]):
            rows = layer.rows(a) if layer is not layers[-1] else a
            abars.append(np.concatenate([rows, np.ones((len(rows), 1))], axis=1))
            if not layer.bias:
                abars[-1] = abars[-1][:, :-1]
        for c in range(CLASSES):
            s = columns[:, c]
            grads = [s[None]]  # the head: one position
            dh = (Wd @ s).reshape(h.shape)
            for layer, z in zip(reversed(hidden), reversed(zs)):
                dz = dh * (1 - np.tanh(z) ** 2)
                grads.insert(0, layer.cols(dz))
                dh = layer.back(dz)
            for index, (abar, g) in enumerate(zip(abars, grads)):
                if variant == "expand" or len(abar) == 1:
                    a_part = abar.T @ abar / len(abar)
                    g_part = g.T @ g
                else:
                    a_part = np.outer(abar.mean(axis=0), abar.mean(axis=0))
                    g_part = np.outer(g.sum(axis=0), g.sum(axis=0))
                if c == 0:
                    A[index] = (0 if A[index] is None else A[index]) + a_part / len(x)
                G[index] = (0 if G[index] is None else G[index]) + g_part / len(x)
                per_example[index].append(abar.T @ g)
    return A, G, per_example


def _block_diagonal(op, factors):
    """The block-diagonal matrix of Kronecker products kron(A_l, G_l), placed at each
    layer's kernel rows then bias rows (the row-major flattening of [W; b])."""
    out = np.zeros(op.shape)
    for block, (A, G) in zip(op.blocks, factors):
        rows = np.r_[
            block.kernel_slice or slice(0, 0),
            block.bias_slice or slice(0, 0),
        ]
        out[np.ix_(rows, rows)] = np.kron(A, G)
    return out


def _check_against_numpy(model, hidden, data, variant, *, ekfac=True):
    x, labels = data
    op = KFACOperator.from_keras(model, LOSS, data, batch_size=2, conv=variant)
    A, G, per_example = _reference(model, hidden, x, labels, variant)
    assert len(op.blocks) == len(A)
    for block, a, g in zip(op.blocks, A, G):
        _close(block.A, a)
        _close(block.G, g)
    _close(op.to_dense(), _block_diagonal(op, list(zip(A, G))))
    if ekfac:
        ek = EKFACOperator.from_keras(model, LOSS, data, batch_size=2, conv=variant)
        for block, grads in zip(ek.blocks, per_example):
            QA, QG = block.basis
            expected = sum((QA.T @ m @ QG) ** 2 for m in grads) / len(x)
            # Directions where A or G is zero to working precision get scaling 0. Under
            # "expand" those projections vanish (q_Aᵀ ā_t = 0 at every position); under
            # "reduce" with several positions they need not (only the mean ā is
            # orthogonal to q_A), so there the comparison is on the other directions.
            live = np.outer(
                np.diag(QA.T @ block.A @ QA) > 1e-12, np.diag(QG.T @ block.G @ QG) > 1e-12
            )
            if variant == "expand":
                live[:] = True
            _close(np.where(live, block.scalings, 0), np.where(live, expected, 0))
    return op


@pytest.fixture(scope="module")
def sequences():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, T, D)), rng.integers(0, CLASSES, N)


def _head(model_layers):
    return keras.Sequential(
        [
            *model_layers,
            keras.layers.Flatten(dtype=F64),
            keras.layers.Dense(CLASSES, activation="softmax", dtype=F64),
        ]
    )


@pytest.mark.parametrize("variant", ["expand", "reduce"])
def test_dense_on_sequences_matches_numpy(sequences, variant):
    keras.utils.set_random_seed(1)
    model = _head(
        [
            keras.Input((T, D), dtype=F64),
            keras.layers.Dense(5, activation="tanh", dtype=F64),
            keras.layers.Dense(2, activation="tanh", dtype=F64),
        ]
    )
    hidden = [_dense(model.layers[0]), _dense(model.layers[1])]
    op = _check_against_numpy(model, hidden, sequences, variant)
    assert [b.A.shape[0] for b in op.blocks] == [D + 1, 6, T * 2 + 1]


@pytest.mark.parametrize(("variant", "bias"), [("expand", "de"), ("reduce", None)])
def test_einsum_dense_matches_numpy(sequences, variant, bias):
    keras.utils.set_random_seed(2)
    model = _head(
        [
            keras.Input((T, D), dtype=F64),
            keras.layers.EinsumDense(
                "abc,cde->abde", (T, 2, 3), bias_axes=bias, activation="tanh", dtype=F64
            ),
            keras.layers.EinsumDense(
                "abcd,cde->abe", (T, 2), bias_axes="e", activation="tanh", dtype=F64
            ),
        ]
    )
    if bias:  # non-zero biases, so that the homogeneous coordinate matters
        model.layers[0].bias.assign(np.random.default_rng(3).normal(size=(2, 3)))
    hidden = [_einsum(model.layers[0]), _einsum(model.layers[1])]
    op = _check_against_numpy(model, hidden, sequences, variant)
    first = op.blocks[0]
    assert first.A.shape == (D + (1 if bias else 0),) * 2 and first.G.shape == (6, 6)
    assert (first.bias is None) == (bias is None)
    assert op.blocks[1].A.shape == (7, 7) and op.blocks[1].G.shape == (2, 2)


def test_einsum_dense_with_transposed_axes_matches_numpy(sequences):
    """Positions after the contracted axis in the input, before the outputs' axis in the
    output: the capture transposes both to (batch, positions, features)."""
    x, labels = sequences
    channels_first = (x.transpose(0, 2, 1), labels)  # (N, D, T)
    keras.utils.set_random_seed(4)
    model = _head(
        [
            keras.Input((D, T), dtype=F64),
            keras.layers.EinsumDense(
                "acb,cd->adb", (2, T), bias_axes="d", activation="tanh", dtype=F64
            ),
        ]
    )
    model.layers[0].bias.assign(np.random.default_rng(5).normal(size=(2, 1)))
    _check_against_numpy(model, [_einsum(model.layers[0])], channels_first, "expand")


def test_one_position_linear_mse_equals_the_ggn():
    """One position, linear layers under MSE: K-FAC (and EKFAC) is the GGN exactly, for one
    example and for several (G = (2/d) I is constant), with uneven batches. The four
    layers sit on parallel branches whose outputs are concatenated: each output coordinate
    depends on one layer only, so the GGN has no blocks between them either."""
    keras.utils.set_random_seed(6)
    x_in = keras.Input((1, D), dtype=F64)
    branches = [
        keras.layers.Dense(2, dtype=F64)(x_in),
        keras.layers.EinsumDense("abc,cde->abde", (1, 2, 2), bias_axes="de", dtype=F64)(x_in),
        keras.layers.EinsumDense("abc,cde->abde", (1, 2, 2), dtype=F64)(x_in),
        keras.layers.EinsumDense("abcd,cde->abe", (1, 2), bias_axes="e", dtype=F64)(
            keras.layers.Reshape((1, 2, 2), dtype=F64)(x_in)
        ),
    ]
    flat = [keras.layers.Flatten(dtype=F64)(b) for b in branches]
    model = keras.Model(x_in, keras.layers.Concatenate(dtype=F64)(flat))
    rng = np.random.default_rng(7)
    for weight in model.weights:
        if "bias" in weight.path:
            weight.assign(rng.normal(size=weight.shape))
    x = rng.normal(size=(4, 1, D))
    y = rng.normal(size=(4, 2 + 4 + 4 + 2))
    for data, batch_size in (((x[:1], y[:1]), None), ((x, y), 3)):
        ggn = GGNOperator.from_keras(model, "mse", data, batch_size=batch_size)
        exact = ggn.matmat(np.eye(ggn.shape[0]))
        for cls, variant in (
            (KFACOperator, "expand"),
            (KFACOperator, "reduce"),
            (EKFACOperator, "expand"),
        ):
            op = cls.from_keras(model, "mse", data, batch_size=batch_size, conv=variant)
            assert len(op.blocks) == 4
            _close(op.to_dense(), exact)


def test_every_uncovered_variable_is_listed(sequences):
    class Scale(keras.layers.Layer):
        def build(self, shape):
            self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

        def call(self, inputs):
            return inputs * self.scale

    model = _head(
        [
            keras.Input((T, D), dtype=F64),
            keras.layers.LayerNormalization(dtype=F64, name="norm"),
            keras.layers.Dense(5, activation="tanh", dtype=F64, name="ffn"),
            Scale(dtype=F64, name="scale"),
            keras.layers.BatchNormalization(dtype=F64, name="bn"),
        ]
    )
    with pytest.raises(ValueError) as raised:
        KFACOperator.from_keras(model, LOSS, sequences)
    message = str(raised.value)
    assert "\n" not in message
    assert "5 trainable variables in 3 layers are not covered" in message
    for layer, names in (
        ("'norm' (LayerNormalization)", ("norm/gamma", "norm/beta")),
        ("'scale' (Scale)", ("scale/scale",)),
        ("'bn' (BatchNormalization)", ("bn/gamma", "bn/beta")),
    ):
        listed = ", ".join(f"'{model.name}/{name}'" for name in names)
        assert f"layer {layer}: {listed}" in message
    assert "ffn" not in message
    assert "other_variables='exclude'" in message and "other_variables='diagonal'" in message
    op = KFACOperator.from_keras(model, LOSS, sequences, other_variables="exclude")
    assert [b.layer for b in op.blocks] == ["ffn", model.layers[-1].name]


@pytest.mark.parametrize(
    ("equation", "output", "bias_axes", "reason"),
    [
        ("abc,bcd->abd", (T, 2), None, "kernel axis 'b' is also an output axis"),
        ("abc,dc->abd", (T, 2), None, "are not its leading axes"),
        ("abc,cd->ad", 2, None, "sums over the input axis 'b'"),
        ("abc,cd->abd", (T, 2), "bd", "bias axes 'bd' are not the kernel's output axes"),
        ("abc,cde->abde", (T, 2, 2), "ed", None),  # allowed: the bias is (d, e) row-major
    ],
)
def test_einsum_dense_that_is_not_dense_is_refused(sequences, equation, output, bias_axes, reason):
    keras.utils.set_random_seed(9)
    model = _head(
        [
            keras.Input((T, D), dtype=F64),
            keras.layers.EinsumDense(equation, output, bias_axes=bias_axes, dtype=F64, name="proj"),
        ]
    )
    if reason is None:
        KFACOperator.from_keras(model, LOSS, sequences)
        return
    with pytest.raises(ValueError) as raised:
        KFACOperator.from_keras(model, LOSS, sequences, other_variables="exclude")
    message = str(raised.value)
    assert "\n" not in message
    assert f"layer 'proj' (equation {equation!r}" in message and reason in message
    model.layers[0].trainable = False
    assert len(KFACOperator.from_keras(model, LOSS, sequences).blocks) == 1


@pytest.mark.skipif(
    not hasattr(keras.layers, "ReversibleEmbedding"), reason="Keras without ReversibleEmbedding"
)
def test_reversible_embedding():
    """Forward: an Embedding. Reverse with tied weights: the table's block would be a sum
    of two Kronecker products, refused. Untied: the reverse table is an other variable."""
    vocab, dim = 6, 3
    rng = np.random.default_rng(10)
    tokens = rng.integers(0, vocab, (4, 1))
    labels = rng.integers(0, vocab, 4)

    def model(tie):
        keras.utils.set_random_seed(11)
        ids = keras.Input((1,), dtype="int32")
        embedding = keras.layers.ReversibleEmbedding(vocab, dim, tie_weights=tie, dtype=F64)
        pooled = keras.layers.Flatten(dtype=F64)(embedding(ids))
        logits = embedding(
            keras.layers.Dense(dim, activation="tanh", dtype=F64)(pooled), reverse=True
        )
        return keras.Model(ids, logits)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with pytest.raises(ValueError, match=r"ties its table .* two Kronecker products") as raised:
        KFACOperator.from_keras(model(True), loss, (tokens, labels), other_variables="exclude")
    assert "\n" not in str(raised.value)
    untied = model(False)
    with pytest.raises(ValueError, match=r"ReversibleEmbedding\): '.*reverse_embeddings'"):
        KFACOperator.from_keras(untied, loss, (tokens, labels))
    one = (tokens[:1], labels[:1])
    op = KFACOperator.from_keras(untied, loss, one, other_variables="exclude")
    exact = GGNOperator.from_keras(untied, loss, one).matmat(np.eye(op.shape[0]))
    table = np.arange(vocab * dim)  # the first variable: one example, one position, exact
    _close(op.to_dense()[np.ix_(table, table)], exact[np.ix_(table, table)])


@pytest.mark.parametrize(
    ("pool", "stride", "padding"),
    [(2, 2, "valid"), (3, 2, "same"), (3, 1, "same"), ((2, 3), (1, 2), "same")],
)
def test_max_pooling_backward_from_the_argmax_is_keras(pool, stride, padding):
    """The capture's MaxPooling2D (argmax kept from the forward pass) has Keras' output and
    TensorFlow's MaxPoolGrad gradient bit for bit, ties included (post-ReLU zeros and
    values rounded to 0.1: the first maximum of each window in both)."""
    from spectra.operators.kfac_layers import _pool_call_of, pooling_layers

    rng = np.random.default_rng(0)
    layer = keras.layers.MaxPooling2D(pool, stride, padding)
    x = tf.constant(np.maximum(rng.standard_normal((5, 7, 9, 3)), 0).round(1).astype("float32"))
    model = keras.Sequential([keras.Input(x.shape[1:]), layer])
    assert pooling_layers(model) == [layer]
    assert (
        pooling_layers(keras.Sequential([keras.Input((4, 4, 1)), keras.layers.AveragePooling2D(2)]))
        == []
    )
    call = _pool_call_of(layer)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        keras_out, ours = layer(x), call(x)
    np.testing.assert_array_equal(ours, keras_out)
    g = tf.constant(rng.standard_normal(keras_out.shape).astype("float32"))
    np.testing.assert_array_equal(tape.gradient(ours, x, g), tape.gradient(keras_out, x, g))
