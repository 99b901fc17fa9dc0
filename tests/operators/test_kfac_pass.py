"""K-FAC and EKFAC of models whose outputs have positions (batch, T, C) under a loss that
averages per-position terms, and of tied ReversibleEmbedding tables (a causal language
model's head); end to end on keras-hub's GPT-2 causal LM and BERT classifier.

The references do not use the operator's capture: each model is run again by a plain
NumPy forward pass and its output gradients are back-propagated by hand. Example n's loss
is ℓ_n = (1/T) Σ_t ℓ_nt (Keras averages over positions), so the block of its output
Hessian at position t is (1/T)(diag p_t − p_t p_tᵀ) for softmax cross-entropy at the
logits and (2/(TC)) I for MSE. Type-2 back-propagates, for each class c, column c of a
square root of every position's block at once: √(p_tc/T)(e_c − p_t), resp. √(2/(TC)) e_c.
The factors are then formed from their definitions: "expand" A = (1/(NT)) Σ_{n,t} ā āᵀ,
G = (1/N) Σ_{n,t,c} g gᵀ; "reduce" A from each example's mean ā, G from Σ_t g. EKFAC's
scalings: for "expand" (1/N) Σ_{n,t,c} (q_Aᵀ ā_nt)² (q_Gᵀ g_ntc)², for "reduce" those of
the per-example Σ_t ā_t g_tᵀ.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from spectra.operators import GGNOperator
from spectra.operators.ekfac import EKFACOperator
from spectra.operators.kfac import KFACOperator

F64 = "float64"
N, T, D, H, C = 5, 3, 4, 3, 3
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _close(got, want, tol=1e-10):
    """|got − want| ≤ tol · max|want| entrywise (and want is not trivially zero)."""
    scale = float(np.abs(want).max())
    assert scale > 1e-8
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _columns(z, y, loss, kind):
    """(K, T, C): the cotangents back-propagated from the outputs z (T, C) of one example
    (type-2: column c of every position's square root; empirical: the gradient)."""
    positions, classes = z.shape
    if loss == "sce":
        p = _softmax(z)
        if kind == "empirical":
            return ((p - np.eye(classes)[y]) / positions)[None]
        return np.stack(
            [
                np.sqrt(p[:, c : c + 1] / positions) * (np.eye(classes)[c] - p)
                for c in range(classes)
            ]
        )
    if loss == "mse":
        if kind == "empirical":
            return (2 * (z - y) / (positions * classes))[None]
        root = np.sqrt(2 / (positions * classes))
        return np.stack(
            [np.tile(root * np.eye(classes)[c], (positions, 1)) for c in range(classes)]
        )
    assert loss == "quartic"  # (1/(TC)) Σ (z − y)⁴: diagonal Hessian 12 (z − y)²/(TC)
    root = np.sqrt(12 / (positions * classes)) * np.abs(z - y)
    return np.stack([root * np.eye(classes)[c] for c in range(classes)])


def _factors(abars, grads, variant, per_position):
    """A, G and EKFAC's second moments from per-example lists: ``abars[n]`` (T_l, d_a),
    ``grads[n][k]`` (T_l, d_out) for each column k."""
    A = G = 0.0
    moments = []
    for abar, columns in zip(abars, grads):
        if variant == "expand" or len(abar) == 1:
            A = A + abar.T @ abar / len(abar)
            G = G + sum(g.T @ g for g in columns)
        else:
            A = A + np.outer(abar.mean(axis=0), abar.mean(axis=0))
            G = G + sum(np.outer(g.sum(axis=0), g.sum(axis=0)) for g in columns)
        if per_position and variant == "expand":
            moments.append([(a[:, None], g[None]) for g in columns for a, g in zip(abar, g)])
        else:
            moments.append([(abar.T @ g, None) for g in columns])
    return A / len(abars), G / len(abars), moments


def _scalings(block, moments, num_examples):
    """EKFAC's scalings in the block's basis from :func:`_factors`' moments."""
    QA, QG = block.basis
    total = 0.0
    for example in moments:
        for left, right in example:
            m = left if right is None else left * right  # ā gᵀ per position, or Σ_t ā gᵀ
            total = total + (QA.T @ m @ QG) ** 2
    return total / num_examples


def _dense_on_positions(hidden_mixes, seed):
    """x (T, D) → Dense(H, tanh) at every position → logits (T, C): position-wise
    (Dense(C) at every position), or mixing (flatten, Dense(T·C), reshape)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((T, D), dtype=F64)
    h = keras.layers.Dense(H, activation="tanh", dtype=F64)(x)
    if hidden_mixes:
        flat = keras.layers.Flatten(dtype=F64)(h)
        z = keras.layers.Reshape((T, C), dtype=F64)(keras.layers.Dense(T * C, dtype=F64)(flat))
    else:
        z = keras.layers.Dense(C, dtype=F64)(h)
    model = keras.Model(x, z)
    rng = np.random.default_rng(seed)
    for weight in model.weights:  # non-zero biases, so the homogeneous coordinate matters
        weight.assign(rng.normal(size=weight.shape) * 0.7)
    return model


def _reference(model, mixes, x, y, loss, kind, variant):
    """The factors of the two Dense layers (and EKFAC's moments) from NumPy alone."""
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    (W1, b1), (W2, b2) = [(layer.kernel.numpy(), layer.bias.numpy()) for layer in dense]
    abars, grads = [[], []], [[], []]
    for n in range(len(x)):
        h = np.tanh(x[n] @ W1 + b1)
        if mixes:
            z = (h.reshape(-1) @ W2 + b2).reshape(T, C)
            second_input = h.reshape(1, -1)
        else:
            z = h @ W2 + b2
            second_input = h
        abars[0].append(np.c_[x[n], np.ones(T)])
        abars[1].append(np.c_[second_input, np.ones(len(second_input))])
        columns = _columns(z, y[n], loss, kind)
        per_layer = [[], []]
        for s in columns:
            g2 = s.reshape(1, -1) if mixes else s
            dh = (g2 @ W2.T).reshape(T, H)
            per_layer[0].append(dh * (1 - h**2))
            per_layer[1].append(g2)
        grads[0].append(per_layer[0])
        grads[1].append(per_layer[1])
    return [_factors(a, g, variant, per_position=True) for a, g in zip(abars, grads)]


def _quartic(y_true, y_pred):
    return keras.ops.mean((y_pred - y_true) ** 4)


@pytest.fixture(scope="module")
def sequences():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, T, D))
    return x, rng.integers(0, C, (N, T)), rng.normal(size=(N, T, C))


@pytest.mark.parametrize(
    ("mixes", "loss", "kind", "variant"),
    [
        (False, "sce", "type-2", "expand"),
        (False, "sce", "type-2", "reduce"),
        (False, "mse", "type-2", "expand"),
        (False, "mse", "type-2", "reduce"),
        (True, "sce", "type-2", "expand"),
        (True, "mse", "type-2", "reduce"),
        (True, "sce", "empirical", "reduce"),
        (False, "quartic", "type-2", "expand"),
    ],
)
def test_sequence_output_factors_match_numpy(sequences, mixes, loss, kind, variant):
    """Outputs (batch, T, C): the factors of both layers and EKFAC's scalings against
    NumPy, for a position-wise model (each layer position reaches its own output position)
    and a mixing one (the hidden layer's positions reach every output position, so its G
    holds the cross terms between output positions of the type-2 columns)."""
    x, labels, targets = sequences
    y = labels if loss == "sce" else targets
    keras_loss = {"sce": SCE, "mse": "mse", "quartic": _quartic}[loss]
    model = _dense_on_positions(mixes, seed=1)
    reference = _reference(model, mixes, x, y, loss, kind, variant)
    for cls in (KFACOperator, EKFACOperator):
        op = cls.from_keras(model, keras_loss, (x, y), batch_size=2, kind=kind, conv=variant)
        assert len(op.blocks) == 2
        for block, (A, G, moments) in zip(op.blocks, reference):
            _close(block.A, A)
            _close(block.G, G)
            if cls is EKFACOperator:
                want = _scalings(block, moments, N)
                if variant == "reduce":  # only the directions the reduce factors see
                    live = np.outer(
                        np.diag(block.basis[0].T @ block.A @ block.basis[0]) > 1e-12,
                        np.diag(block.basis[1].T @ block.G @ block.basis[1]) > 1e-12,
                    )
                    want, got = np.where(live, want, 0), np.where(live, block.scalings, 0)
                else:
                    got = block.scalings
                _close(got, want)


@pytest.mark.parametrize("num_examples", [1, N])
def test_position_wise_linear_mse_kfac_equals_the_ggn(sequences, num_examples):
    """A linear layer z_t = ā_t W at each of T output positions under MSE. The GGN is
    (1/N) Σ_n Σ_t ā_nt ā_ntᵀ ⊗ (2/(TC)) I (J_t picks position t, the output Hessian is
    (2/(TC)) I); expand gives A = (1/(NT)) Σ ā āᵀ and, each layer position reaching only
    its own output position, G = Σ_{t,c} (2/(TC)) e_c e_cᵀ = (2/C) I: A ⊗ G is the GGN,
    for one example and for several (G is constant). EKFAC, diagonal in that basis, too."""
    x, _, targets = sequences
    data = (x[:num_examples], targets[:num_examples])
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((T, D), dtype=F64), keras.layers.Dense(C, dtype=F64)])
    model.layers[0].bias.assign(np.random.default_rng(3).normal(size=C))
    abar = np.concatenate([data[0], np.ones((num_examples, T, 1))], axis=-1).reshape(-1, D + 1)
    ggn = np.kron(abar.T @ abar / num_examples, 2 / (T * C) * np.eye(C))
    # spectra flattens [kernel rows; bias] row-major: (D + 1) · C parameters in that order.
    for cls in (KFACOperator, EKFACOperator):
        op = cls.from_keras(model, "mse", data, batch_size=2, conv="expand")
        _close(op.to_dense(), ggn)
    exact = GGNOperator.from_keras(model, "mse", data).matmat(np.eye(ggn.shape[0]))
    _close(exact, ggn)  # the operator agrees with the closed form above


def test_monte_carlo_on_sequences(sequences):
    """Per-position labels drawn per example: the matrix does not depend on the batching;
    its expectation is type-2 without cross terms between output positions, which is
    type-2 itself for a position-wise model's G."""
    x, labels, _ = sequences
    model = _dense_on_positions(False, seed=4)
    one = KFACOperator.from_keras(model, SCE, (x, labels), kind="mc", num_samples=3)
    two = KFACOperator.from_keras(model, SCE, (x, labels), kind="mc", num_samples=3, batch_size=2)
    _close(two.to_dense(), one.to_dense(), tol=1e-12)
    many = KFACOperator.from_keras(model, SCE, (x, labels), kind="mc", num_samples=80)
    type2 = KFACOperator.from_keras(model, SCE, (x, labels))
    for sampled, exact in zip(many.blocks, type2.blocks):
        _close(sampled.G, exact.G, tol=0.1)


def test_a_loss_coupling_positions_is_refused(sequences):
    x, _, targets = sequences
    model = _dense_on_positions(False, seed=5)

    def coupled(y_true, y_pred):
        return keras.ops.mean(keras.ops.sum(y_pred - y_true, axis=1) ** 2)

    with pytest.raises(ValueError, match="couples the output positions") as raised:
        KFACOperator.from_keras(model, coupled, (x, targets))
    assert "\n" not in str(raised.value)
    # The sampled and empirical kinds need no output Hessian.
    assert KFACOperator.from_keras(model, coupled, (x, targets), kind="empirical").trace() > 0


# -- tied ReversibleEmbedding ---------------------------------------------------------------
VOCAB, DIM = 6, 3
reversible = pytest.mark.skipif(
    not hasattr(keras.layers, "ReversibleEmbedding"), reason="Keras without ReversibleEmbedding"
)


@pytest.fixture(scope="module")
def tied_lm():
    """ids (T,) → table lookup → Dense(DIM, tanh) at every position → logits h Wᵀ with the
    same table W (V × d), under sparse cross-entropy at every position."""
    keras.utils.set_random_seed(6)
    ids = keras.Input((T,), dtype="int32")
    embedding = keras.layers.ReversibleEmbedding(VOCAB, DIM, tie_weights=True, dtype=F64)
    hidden = keras.layers.Dense(DIM, activation="tanh", dtype=F64)(embedding(ids))
    model = keras.Model(ids, embedding(hidden, reverse=True))
    rng = np.random.default_rng(7)
    model.layers[2].bias.assign(rng.normal(size=DIM))
    tokens = rng.integers(0, VOCAB, (N, T)).astype("int32")
    return model, (tokens, rng.integers(0, VOCAB, (N, T)))


def _tied_reference(model, data, mode, variant):
    """Per factored layer (the table, then the Dense): (A, G, EKFAC moments) in NumPy.
    "output": the table's block is E[g gᵀ] (V × V, rows) ⊗ E[h hᵀ] (d × d, columns),
    the per-example gradient of W in z = h Wᵀ being Σ_t g_t h_tᵀ (V × d); "input": the
    lookup's one-hot ⊗ the gradient in its output, as an Embedding."""
    table = model.layers[1].embeddings.numpy()
    dense = model.layers[2]
    Wd, bd = dense.kernel.numpy(), dense.bias.numpy()
    tokens, labels = data
    table_in, table_out, dense_in, dense_out = [], [], [], []
    for n in range(len(tokens)):
        e = table[tokens[n]]
        h = np.tanh(e @ Wd + bd)
        logits = h @ table.T
        columns = _columns(logits, labels[n], "sce", "type-2")
        grads_table, grads_dense = [], []
        for s in columns:
            dz = (s @ table) * (1 - h**2)
            grads_dense.append(dz)
            grads_table.append(s if mode == "output" else dz @ Wd.T)
        dense_in.append(np.c_[e, np.ones(T)])
        dense_out.append(grads_dense)
        # "output": the reverse call's input h and logit gradients, as a Dense layer with
        # kernel Wᵀ; transposed below into the table's (V rows, d columns) layout.
        table_in.append(h if mode == "output" else np.eye(VOCAB)[tokens[n]])
        table_out.append(grads_table)
    A, G, moments = _factors(table_in, table_out, variant, per_position=True)
    if mode == "output":
        A, G = G, A
        moments = [[(m.T, None) if r is None else (r.T, m.T) for m, r in ex] for ex in moments]
    return [(A, G, moments), _factors(dense_in, dense_out, variant, per_position=True)]


@reversible
@pytest.mark.parametrize(
    ("mode", "variant"), [("output", "expand"), ("output", "reduce"), ("input", "expand")]
)
def test_tied_embedding_blocks_match_numpy(tied_lm, mode, variant):
    model, data = tied_lm
    reference = _tied_reference(model, data, mode, variant)
    for cls in (KFACOperator, EKFACOperator):
        op = cls.from_keras(model, SCE, data, batch_size=2, conv=variant, tied_embeddings=mode)
        table = op.blocks[-1] if op.blocks[-1].layer == model.layers[1].name else op.blocks[0]
        blocks = [table, next(b for b in op.blocks if b is not table)]
        assert table.kernel_slice == slice(0, VOCAB * DIM) and table.bias is None
        assert (table.A.shape[0], table.G.shape[0]) == (VOCAB, DIM)  # rows V, columns d
        for block, (A, G, moments) in zip(blocks, reference):
            _close(block.A, A)
            _close(block.G, G)
            if cls is EKFACOperator and variant == "expand":
                _close(block.scalings, _scalings(block, moments, N))


@reversible
def test_tied_embedding_refusals(tied_lm):
    model, data = tied_lm
    with pytest.raises(ValueError) as raised:
        KFACOperator.from_keras(model, SCE, data)
    message = str(raised.value)
    assert "\n" not in message
    assert f"ReversibleEmbedding layer {model.layers[1].name!r} ties its table" in message
    assert "tied_embeddings='output'" in message and "tied_embeddings='input'" not in message
    assert "'input' (factor the token lookup)" in message
    with pytest.raises(ValueError, match="tied_embeddings must be one of"):
        KFACOperator.from_keras(model, SCE, data, tied_embeddings="both")
    # A tied table used for the lookup only, factored at its reverse call: refused.
    keras.utils.set_random_seed(8)
    ids = keras.Input((T,), dtype="int32")
    embedding = keras.layers.ReversibleEmbedding(VOCAB, DIM, dtype=F64)
    lookup_only = keras.Model(ids, keras.layers.Dense(VOCAB, dtype=F64)(embedding(ids)))
    with pytest.raises(ValueError, match="not called with reverse=True"):
        KFACOperator.from_keras(lookup_only, SCE, data, tied_embeddings="output")
    KFACOperator.from_keras(lookup_only, SCE, data, tied_embeddings="input")


# -- keras-hub end to end -------------------------------------------------------------------
SEQUENCE, VOCABULARY, EXAMPLES = 8, 64, 4


def _consistent(op, rng):
    """trace = Σ eigenvalues, logdet and the damped inverse consistent with them."""
    damping = 1e-3
    values = op.eigenvalues()
    assert values[0] > 0 and values[-1] >= 0
    assert op.trace() == pytest.approx(values.sum(), rel=1e-10)
    assert op.logdet(damping) == pytest.approx(np.sum(np.log(values + damping)), rel=1e-10)
    v = rng.normal(size=op.shape[0])
    np.testing.assert_allclose(
        op.inverse(damping).matvec(op.matvec(v) + damping * v), v, rtol=0, atol=1e-6
    )
    # The largest eigenvalue is attained: the Rayleigh quotient of power iteration on K.
    u = rng.normal(size=op.shape[0])
    for _ in range(30):
        u = op.matvec(u)
        u /= np.linalg.norm(u)
    assert u @ op.matvec(u) == pytest.approx(values[0], rel=1e-3)


def _gpt2(dropout: float) -> keras.Model:
    """keras-hub's GPT-2 (2 blocks, width 16) with its tied token embedding as the LM head."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=SEQUENCE,
        dropout=dropout,
        dtype=F64,
    )
    inputs = {
        name: keras.Input((SEQUENCE,), dtype="int32", name=name)
        for name in ("token_ids", "padding_mask")
    }
    return keras.Model(inputs, backbone.token_embedding(backbone(inputs), reverse=True))


@pytest.fixture(scope="module")
def gpt2_lm():
    keras.utils.set_random_seed(9)
    model = _gpt2(dropout=0.0)
    rng = np.random.default_rng(10)
    x = {
        "token_ids": rng.integers(0, VOCABULARY, (EXAMPLES, SEQUENCE)).astype("int32"),
        "padding_mask": np.ones((EXAMPLES, SEQUENCE), "int32"),
    }
    return model, (x, rng.integers(0, VOCABULARY, (EXAMPLES, SEQUENCE)))


@pytest.mark.slow
@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_gpt2_causal_lm(gpt2_lm, cls):
    """keras-hub GPT-2 with its tied token embedding as the LM head (outputs (batch, 8,
    64)), under sparse cross-entropy at every position."""
    model, data = gpt2_lm
    if cls is KFACOperator:
        # Every variable K-FAC cannot factor is named, by layer (LayerNormalization's, the
        # position embedding's), before any data pass.
        with pytest.raises(ValueError, match="trainable variables in .* layers are not covered"):
            cls.from_keras(model, SCE, data, tied_embeddings="output")
    op = cls.from_keras(
        model, SCE, data, other_variables="exclude", tied_embeddings="output", batch_size=4
    )
    names = [b.layer for b in op.blocks]
    assert len(names) == 2 * 6 + 1 and "token_embedding" in names
    table = op.blocks[names.index("token_embedding")]
    assert table.A.shape == (VOCABULARY, VOCABULARY) and table.G.shape == (16, 16)
    _consistent(op, np.random.default_rng(11))


def test_gpt2_with_dropout_has_the_factors_of_gpt2_without(gpt2_lm):
    """keras-hub's GPT-2 at its default dropout (0.1): the gradients through its Dropout
    layers carry no static shape, which the factor pass once needed (a TypeError). In
    inference mode Dropout is the identity, so the factors are those without dropout
    (measured: equal to 3e-16 relative)."""
    model, (x, y) = gpt2_lm
    dropped = _gpt2(dropout=0.1)
    dropped.set_weights(model.get_weights())
    options = {"other_variables": "exclude", "tied_embeddings": "output"}
    with_dropout = KFACOperator.from_keras(dropped, SCE, (x, y), **options)
    without = KFACOperator.from_keras(model, SCE, (x, y), **options)
    for a, b in zip(with_dropout.blocks, without.blocks, strict=True):
        assert a.layer == b.layer
        # The same factors, up to float64 rounding (the graphs differ by the Dropout ops).
        _close(a.A, b.A, tol=1e-13)
        _close(a.G, b.G, tol=1e-13)


@pytest.fixture(scope="module")
def bert_classifier():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(12)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=SEQUENCE,
        num_segments=2,
        dropout=0.0,
        dtype=F64,
    )
    inputs = {
        name: keras.Input((SEQUENCE,), dtype="int32", name=name)
        for name in ("token_ids", "segment_ids", "padding_mask")
    }
    head = keras.layers.Dense(C, dtype=F64, name="head")
    model = keras.Model(inputs, head(backbone(inputs)["pooled_output"]))
    rng = np.random.default_rng(13)
    x = {
        "token_ids": rng.integers(0, VOCABULARY, (EXAMPLES, SEQUENCE)).astype("int32"),
        "segment_ids": rng.integers(0, 2, (EXAMPLES, SEQUENCE)).astype("int32"),
        "padding_mask": np.ones((EXAMPLES, SEQUENCE), "int32"),
    }
    return model, (x, rng.integers(0, C, EXAMPLES))


@pytest.mark.slow
@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator])
def test_bert_classifier(bert_classifier, cls):
    model, data = bert_classifier
    op = cls.from_keras(model, SCE, data, other_variables="exclude", batch_size=4)
    names = [b.layer for b in op.blocks]
    assert {"head", "pooled_dense", "token_embedding", "segment_embedding"} <= set(names)
    assert len(names) == 2 * 6 + 4
    _consistent(op, np.random.default_rng(14))
