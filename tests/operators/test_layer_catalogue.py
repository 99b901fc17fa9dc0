"""Keras' layer catalogue against finite differences of the float64 gradient.

Each case is a tiny float64 model around one layer (a Dense before it, so that the
layer's input depends on parameters, and a Dense head after it), with cross-entropy on
logits. spectra's dense Hessian (``H @ I``) is compared with central finite differences
of the gradient, which TensorFlow gets right even where its second derivatives are
wrong (``tf.nn.moments``, see :func:`spectra._tf_compat.exact_moments`): nothing of
the truth shares TensorFlow's second-derivative code.

The truth's accuracy: Richardson-extrapolated central differences along 3 random
directions (``_dense.finite_difference_products``, steps h and h/2, h = 1e-4) err by
O(h⁴) + O(ε|g|/h), about 1e-11 relative here, and check their own error estimate. A
tolerance of 1e-7 is thousands of times that and catches any real bug (TensorFlow's
moments were off by 15-67 %, a missing resize term by 16 %). The GGN, which
differentiates the model once, is checked through the same normalization layers against
Jᵀ H_z J with J from central differences of the outputs and H_z in closed form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import finite_difference_products, relative_error

import spectra
from spectra.operators.engine import clear_engine_cache

L = keras.layers
F64 = "float64"
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype=F64)
N = 6  # examples
TOLERANCE = 1e-7


@dataclass
class Case:
    name: str
    family: str
    body: Callable[[Any], Any]  # the layer(s) under test, applied to a (N, ...) tensor
    input_shape: tuple[int, ...] = (3, 4)
    pre: bool = True  # a Dense on the last axis before the layer
    kwargs: dict = field(default_factory=dict)
    batch_size: int | None = None
    marks: tuple = ()
    # TensorFlow's bilinear and bicubic resize kernels compute in float32 whatever the
    # image's dtype: the finite differences then carry float32 rounding (~1e-4 of ‖H‖;
    # a missing term of the Hessian was 16 %).
    float32_inside: bool = False


def _model(case: Case) -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input(case.input_shape, dtype=F64)
    h = inputs
    if case.pre:
        h = L.Dense(case.input_shape[-1], activation="tanh", dtype=F64)(h)
    h = case.body(h)
    if len(h.shape) > 2:
        h = L.Flatten(dtype=F64)(h)
    outputs = L.Dense(3, dtype=F64)(h)
    return keras.Model(inputs, outputs)


def _seq(shape=(3, 4)):
    return {"input_shape": shape}


CASES = [
    # core
    Case("Dense", "core", lambda h: L.Dense(3, activation="sigmoid", dtype=F64)(h)),
    Case(
        "EinsumDense",
        "core",
        lambda h: L.EinsumDense("abc,cd->abd", output_shape=(3, 2), bias_axes="d", dtype=F64)(h),
    ),
    # activations
    *(
        Case(f"Activation({a})", "activation", lambda h, a=a: L.Activation(a, dtype=F64)(h))
        for a in ("gelu", "silu", "elu", "selu", "softplus", "softsign", "mish", "log_softmax")
    ),
    Case("Softmax", "activation", lambda h: L.Softmax(dtype=F64)(h)),
    Case("PReLU", "activation", lambda h: L.PReLU(dtype=F64)(L.Dense(4, dtype=F64)(h))),
    # normalization
    Case("LayerNormalization", "normalization", lambda h: L.LayerNormalization(dtype=F64)(h)),
    Case(
        "LayerNormalization(axis=(1, 2))",
        "normalization",
        lambda h: L.LayerNormalization(axis=(1, 2), dtype=F64)(h),
    ),
    Case(
        "LayerNormalization(center=False, scale=False)",
        "normalization",
        lambda h: L.LayerNormalization(center=False, scale=False, dtype=F64)(h),
    ),
    Case("RMSNormalization", "normalization", lambda h: L.RMSNormalization(dtype=F64)(h)),
    Case(
        "GroupNormalization",
        "normalization",
        lambda h: L.GroupNormalization(groups=2, dtype=F64)(h),
    ),
    Case("UnitNormalization", "normalization", lambda h: L.UnitNormalization(dtype=F64)(h)),
    Case(
        "BatchNormalization (inference)",
        "normalization",
        lambda h: L.BatchNormalization(dtype=F64)(h),
    ),
    Case(
        "BatchNormalization (training, one batch)",
        "normalization",
        lambda h: L.BatchNormalization(dtype=F64)(h),
        kwargs={"training": True},
    ),
    Case(
        "BatchNormalization (training, batches of 4)",
        "normalization",
        lambda h: L.BatchNormalization(dtype=F64)(h),
        kwargs={"training": True},
        batch_size=4,
    ),
    Case(
        "SpectralNormalization (inference)",
        "normalization",
        lambda h: L.SpectralNormalization(L.Dense(3, dtype=F64), dtype=F64)(h),
    ),
    Case(
        "TimeDistributed(Dense)",
        "core",
        lambda h: L.TimeDistributed(L.Dense(2, activation="tanh", dtype=F64), dtype=F64)(h),
    ),
    # convolution and pooling
    Case(
        "Conv1D + MaxPooling1D",
        "convolution",
        lambda h: L.MaxPooling1D(2, dtype=F64)(L.Conv1D(2, 2, activation="tanh", dtype=F64)(h)),
        input_shape=(5, 2),
    ),
    Case(
        "Conv2D + AveragePooling2D",
        "convolution",
        lambda h: L.AveragePooling2D(2, dtype=F64)(L.Conv2D(2, 2, activation="tanh", dtype=F64)(h)),
        input_shape=(4, 4, 1),
        pre=False,
    ),
    Case(
        "SeparableConv2D",
        "convolution",
        lambda h: L.SeparableConv2D(2, 2, activation="tanh", dtype=F64)(h),
        input_shape=(3, 3, 2),
        pre=False,
    ),
    Case(
        "DepthwiseConv2D",
        "convolution",
        lambda h: L.DepthwiseConv2D(2, activation="tanh", dtype=F64)(h),
        input_shape=(3, 3, 2),
        pre=False,
    ),
    Case(
        "Conv2DTranspose",
        "convolution",
        lambda h: L.Conv2DTranspose(1, 2, activation="tanh", dtype=F64)(h),
        input_shape=(2, 2, 2),
        pre=False,
    ),
    Case(
        "Conv3D",
        "convolution",
        lambda h: L.Conv3D(1, 2, activation="tanh", dtype=F64)(h),
        input_shape=(2, 2, 3, 1),
        pre=False,
    ),
    Case(
        "GlobalMaxPooling1D",
        "convolution",
        lambda h: L.GlobalMaxPooling1D(dtype=F64)(h),
    ),
    Case(
        "UpSampling2D (bilinear)",
        "reshaping",
        lambda h: L.UpSampling2D(2, interpolation="bilinear", dtype=F64)(
            L.Conv2D(1, 1, activation="tanh", dtype=F64)(h)
        ),
        input_shape=(2, 2, 1),
        pre=False,
        float32_inside=True,
    ),
    Case(
        "UpSampling2D (nearest)",
        "reshaping",
        lambda h: L.UpSampling2D(2, dtype=F64)(L.Conv2D(1, 1, activation="tanh", dtype=F64)(h)),
        input_shape=(2, 2, 1),
        pre=False,
    ),
    Case(
        "Resizing (bicubic)",
        "reshaping",
        lambda h: L.Resizing(3, 3, interpolation="bicubic", dtype=F64)(
            L.Conv2D(1, 1, activation="tanh", dtype=F64)(h)
        ),
        input_shape=(2, 2, 1),
        pre=False,
        float32_inside=True,
    ),
    Case(
        "Resizing (nearest)",
        "reshaping",
        lambda h: L.Resizing(3, 3, interpolation="nearest", dtype=F64)(
            L.Conv2D(1, 1, activation="tanh", dtype=F64)(h)
        ),
        input_shape=(2, 2, 1),
        pre=False,
    ),
    Case(
        "ZeroPadding1D + Cropping1D + Permute",
        "reshaping",
        lambda h: L.Permute((2, 1), dtype=F64)(
            L.Cropping1D((1, 0), dtype=F64)(L.ZeroPadding1D(1, dtype=F64)(h))
        ),
    ),
    # merging
    Case(
        "Multiply + Add + Concatenate",
        "merging",
        lambda h: L.Concatenate(dtype=F64)(
            [L.Multiply(dtype=F64)([h, h]), L.Add(dtype=F64)([h, L.Dense(4, dtype=F64)(h)])]
        ),
    ),
    Case("Dot", "merging", lambda h: L.Dot(axes=2, dtype=F64)([h, L.Dense(4, dtype=F64)(h)])),
    Case("Maximum", "merging", lambda h: L.Maximum(dtype=F64)([h, L.Dense(4, dtype=F64)(h)])),
    # attention
    Case(
        "MultiHeadAttention",
        "attention",
        lambda h: L.MultiHeadAttention(num_heads=2, key_dim=2, dtype=F64)(h, h),
    ),
    Case(
        "GroupQueryAttention",
        "attention",
        lambda h: L.GroupQueryAttention(
            head_dim=2, num_query_heads=2, num_key_value_heads=1, dtype=F64
        )(h, h),
    ),
    Case("Attention", "attention", lambda h: L.Attention(dtype=F64)([h, h])),
    Case("AdditiveAttention", "attention", lambda h: L.AdditiveAttention(dtype=F64)([h, h])),
    # recurrent layers: the zoo (tests/_zoo.py) checks LSTM, GRU, SimpleRNN and
    # Bidirectional against the same finite-difference truth.
]


VOCABULARY, SEQUENCE = 5, 3


@pytest.fixture(autouse=True)
def _fresh_engines():
    clear_engine_cache()
    yield
    clear_engine_cache()


def _data(case: Case, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.standard_normal((N, *case.input_shape)), rng.integers(0, 3, N)


def layer_products(case: Case, rng: np.random.Generator, k: int = 3):
    """spectra's H V and its finite-difference truth for ``case``, k random vectors."""
    model = _model(case)
    x, y = _data(case, rng)
    training = case.kwargs.get("training", False)
    op = spectra.HessianOperator.from_keras(
        model, SCE, (x, y), batch_size=case.batch_size, dtype=np.float64, **case.kwargs
    )
    V = rng.standard_normal((op.shape[0], k))
    bs = N if case.batch_size is None else case.batch_size

    def loss():
        # Stateless: training-mode calls would otherwise update BatchNorm's moving
        # statistics between the finite-difference evaluations.
        total = 0.0
        with keras.StatelessScope():
            for start in range(0, N, bs):
                out = model(x[start : start + bs], training=training)
                total += SCE(y[start : start + bs], out) * (min(bs, N - start) / N)
        return total

    rtol = 1e-2 if case.float32_inside else 1e-6
    truth = finite_difference_products(loss, model.trainable_variables, V, rtol=rtol)
    return op.matmat(V), truth


@pytest.mark.parametrize("case", [pytest.param(c, marks=c.marks, id=c.name) for c in CASES])
def test_layer_against_finite_differences(case: Case, rng):
    products, truth = layer_products(case, rng)
    assert relative_error(products, truth) < (5e-3 if case.float32_inside else TOLERANCE)


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _output_jacobian(model, x, step=1e-5):
    """∂ logits / ∂θ by Richardson-extrapolated central differences (float64)."""
    variables = model.trainable_variables
    originals = [v.numpy().copy() for v in variables]
    logits = tf.function(lambda: model(x))
    columns = []
    try:
        for variable, original in zip(variables, originals):
            for i in range(original.size):

                def difference(h, variable=variable, original=original, i=i):
                    values = []
                    for sign in (1.0, -1.0):
                        moved = original.copy()
                        moved.reshape(-1)[i] += sign * h
                        variable.assign(moved)
                        values.append(logits().numpy().reshape(-1))
                    variable.assign(original)
                    return (values[0] - values[1]) / (2 * h)

                columns.append((4 * difference(step / 2) - difference(step)) / 3)
    finally:
        for variable, original in zip(variables, originals):
            variable.assign(original)
    return np.stack(columns, axis=1)


@pytest.mark.parametrize(
    "name", ["LayerNormalization", "GroupNormalization", "BatchNormalization (inference)"]
)
def test_ggn_through_normalization_layers_against_finite_differences(name, rng):
    case = next(c for c in CASES if c.name == name)
    model = _model(case)
    x, y = _data(case, rng)
    ggn = spectra.GGNOperator.from_keras(model, SCE, (x, y), dtype=np.float64)
    J = _output_jacobian(model, x)
    p = _softmax(np.asarray(model(x)))
    # Mean cross-entropy on logits: H_z = (1/N) blockdiag(diag(p_i) - p_i p_iᵀ).
    Hz = np.zeros((p.size, p.size))
    for i, row in enumerate(p):
        block = slice(i * p.shape[1], (i + 1) * p.shape[1])
        Hz[block, block] = (np.diag(row) - np.outer(row, row)) / N
    assert relative_error(ggn @ np.eye(ggn.shape[0]), J.T @ Hz @ J) < TOLERANCE


def test_a_keras_hub_gpt2_backbone_against_finite_differences(rng):
    """keras-hub's GPT-2 (one block: LayerNormalization, causal attention, GELU MLP) with
    its reversible (tied) token embedding as the output layer, in float64."""
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is in the [test] extra")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=1,
        num_heads=2,
        hidden_dim=4,
        intermediate_dim=8,
        max_sequence_length=4,
        dtype=F64,
    )
    inputs = {
        name: keras.Input((SEQUENCE,), dtype="int32", name=name)
        for name in ("token_ids", "padding_mask")
    }
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    model = keras.Model(inputs, logits)
    x = {
        "token_ids": rng.integers(0, VOCABULARY, (N, SEQUENCE)).astype("int32"),
        "padding_mask": np.ones((N, SEQUENCE), "int32"),
    }
    y = rng.integers(0, VOCABULARY, (N, SEQUENCE))
    op = spectra.HessianOperator.from_keras(model, SCE, (x, y), dtype=np.float64)
    V = rng.standard_normal((op.shape[0], 3))
    truth = finite_difference_products(lambda: SCE(y, model(x)), model.trainable_variables, V)
    assert op.shape[0] > 150
    assert relative_error(op.matmat(V), truth) < TOLERANCE


def test_keras_hub_building_blocks_against_finite_differences(rng):
    """keras-hub's encoder and decoder blocks (post-norm, GELU), rotary position
    embedding and a reversible embedding with a soft-capped output, composed into one
    encoder-decoder model, in float64."""
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is in the [test] extra")
    keras.utils.set_random_seed(0)
    tokens = keras.Input((SEQUENCE,), dtype="int32")
    embedding = keras_hub.layers.ReversibleEmbedding(VOCABULARY, 4, logit_soft_cap=5.0, dtype=F64)
    h = keras_hub.layers.RotaryEmbedding(dtype=F64)(embedding(tokens))
    encoded = keras_hub.layers.TransformerEncoder(8, 2, activation="gelu", dtype=F64)(h)
    decoded = keras_hub.layers.TransformerDecoder(
        8, 2, activation="gelu", normalize_first=True, dtype=F64
    )(h, encoded)
    model = keras.Model(tokens, embedding(decoded, reverse=True))
    x = rng.integers(0, VOCABULARY, (N, SEQUENCE)).astype("int32")
    y = rng.integers(0, VOCABULARY, (N, SEQUENCE))
    op = spectra.HessianOperator.from_keras(model, SCE, (x, y), dtype=np.float64)
    V = rng.standard_normal((op.shape[0], 3))
    truth = finite_difference_products(lambda: SCE(y, model(x)), model.trainable_variables, V)
    assert relative_error(op.matmat(V), truth) < TOLERANCE
