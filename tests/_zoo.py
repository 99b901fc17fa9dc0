"""A zoo of small Keras models, one per architecture spectra supports, with their data.

Each entry builds the same model in any float dtype (so that a float64 copy gives the
dense ground truth), makes data for it, and names its loss. Sizes scale with ``width``:
the tests use the default (n ≲ 300 parameters, for dense Hessians), the speed benchmark
larger ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from _dense import batch_weighted, dense_hessian, flat_gradient

from spectra.operators import HessianOperator, keras_models

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N = 12  # examples in the test data


@dataclass
class ZooEntry:
    name: str
    build: Callable[[str, int], keras.Model]
    data: Callable[[np.random.Generator, int, int], tuple]
    loss: Any = SCE
    loss_weights: Any = None
    kwargs: dict = field(default_factory=dict)
    batch_size: int | None = None
    compiled: bool = False  # the operator uses loss=None (the compiled loss)
    # Dropout draws its mask in the compute dtype: a float32 operator's masks differ
    # from those of the float64 reference, so its products are a different matrix.
    float32_reference: bool = True
    # Also build the float32 operator (its products against the float64 truth). Off for
    # entries whose float32 path repeats another's (the masked LSTM and the SimpleRNN keep
    # it for the recurrent layers, "attention" and "layernorm" for the transformer block):
    # tracing a float32 recurrent or transformer operator takes about 5 s.
    float32_operator: bool = True


def _classes(rng: np.random.Generator, n: int, classes: int = 3) -> np.ndarray:
    return rng.integers(0, classes, n).astype("int32")


def _floats(rng: np.random.Generator, n: int, *shape: int) -> np.ndarray:
    return rng.standard_normal((n, *shape)).astype("float32")


# -- feed-forward ------------------------------------------------------------------------
def mlp(dtype: str, width: int = 5) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(width, activation="tanh", dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def cnn(dtype: str, width: int = 2) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((5, 5, 1), dtype=dtype),
            keras.layers.Conv2D(width, 3, activation="tanh", dtype=dtype),
            keras.layers.MaxPooling2D(2, dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def batchnorm(dtype: str, width: int = 4) -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(width, dtype=dtype),
            keras.layers.BatchNormalization(dtype=dtype),
            keras.layers.Activation("tanh", dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )
    bn = model.layers[1]
    rng = np.random.default_rng(7)
    bn.moving_mean.assign(rng.standard_normal(width).astype(dtype))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, width).astype(dtype))
    return model


def layernorm(dtype: str, width: int = 5) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(width, activation="tanh", dtype=dtype),
            keras.layers.LayerNormalization(dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def groupnorm(dtype: str, width: int = 6) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(width, activation="tanh", dtype=dtype),
            keras.layers.GroupNormalization(groups=2, dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def transformer(dtype: str, width: int = 4) -> keras.Model:
    """One post-norm transformer block on 4 tokens: self-attention, residual,
    LayerNormalization, a Dense feed-forward, residual, LayerNormalization, then pooling."""
    inp = keras.Input((4, width), dtype=dtype)
    att = keras.layers.MultiHeadAttention(num_heads=2, key_dim=1, dtype=dtype)(inp, inp)
    h = keras.layers.LayerNormalization(dtype=dtype)(keras.layers.Add(dtype=dtype)([inp, att]))
    ff = keras.layers.Dense(width, activation="gelu", dtype=dtype)(h)
    ff = keras.layers.Dense(width, dtype=dtype)(ff)
    h = keras.layers.LayerNormalization(dtype=dtype)(keras.layers.Add(dtype=dtype)([h, ff]))
    pooled = keras.layers.GlobalAveragePooling1D(dtype=dtype)(h)
    return keras.Model(inp, keras.layers.Dense(3, dtype=dtype)(pooled))


def attention(dtype: str, width: int = 4) -> keras.Model:
    inp = keras.Input((3, width), dtype=dtype)
    att = keras.layers.MultiHeadAttention(num_heads=1, key_dim=2, dtype=dtype)(inp, inp)
    pooled = keras.layers.GlobalAveragePooling1D(dtype=dtype)(att)
    return keras.Model(inp, keras.layers.Dense(3, dtype=dtype)(pooled))


# -- recurrent and control flow -------------------------------------------------------
def lstm(dtype: str, width: int = 3) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(6, 2, mask_zero=True, dtype=dtype),
            keras.layers.LSTM(width, dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def gru(dtype: str, width: int = 3) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4, 2), dtype=dtype),
            keras.layers.GRU(width, dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def simple_rnn(dtype: str, width: int = 3) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4, 2), dtype=dtype),
            keras.layers.SimpleRNN(width, dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def bidirectional(dtype: str, width: int = 2) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4, 2), dtype=dtype),
            keras.layers.Bidirectional(keras.layers.LSTM(width, dtype=dtype), dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


@keras.saving.register_keras_serializable(package="spectra_zoo")
class ScanRecurrence(keras.layers.Layer):
    """h_t = tanh(x_t W + h_{t-1} U) by ``keras.ops.scan``; returns the last h."""

    def __init__(self, units: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1], self.units), name="w")
        self.u = self.add_weight(shape=(self.units, self.units), name="u")

    def call(self, x: Any) -> Any:
        def step(h: Any, x_t: Any) -> tuple[Any, Any]:
            h = keras.ops.tanh(keras.ops.matmul(x_t, self.w) + keras.ops.matmul(h, self.u))
            return h, h

        h0 = keras.ops.zeros((keras.ops.shape(x)[0], self.units), dtype=self.compute_dtype)
        last, _ = keras.ops.scan(step, h0, keras.ops.transpose(x, (1, 0, 2)))
        return last

    def get_config(self) -> dict:
        return {**super().get_config(), "units": self.units}


def scan(dtype: str, width: int = 3) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4, 2), dtype=dtype),
            ScanRecurrence(width, dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


@keras.saving.register_keras_serializable(package="spectra_zoo")
class WhileIteration(keras.layers.Layer):
    """Three steps of h <- tanh(h A) in a ``tf.while_loop``."""

    def build(self, input_shape: Any) -> None:
        self.a = self.add_weight(shape=(input_shape[-1], input_shape[-1]), name="a")

    def call(self, x: Any) -> Any:
        a = self.a  # read once, outside the loop

        def body(i: Any, h: Any) -> tuple[Any, Any]:
            return i + 1, tf.tanh(tf.matmul(h, a))

        _, h = tf.while_loop(lambda i, h: i < 3, body, (tf.constant(0), x))
        return h


def while_loop(dtype: str, width: int = 4) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(width, dtype=dtype),
            WhileIteration(dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


@keras.saving.register_keras_serializable(package="spectra_zoo")
class Branch(keras.layers.Layer):
    """tanh(x A) if the batch mean of x is positive, else sin(x B), by ``tf.cond`` or
    ``keras.ops.cond``."""

    def __init__(self, use_keras: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.use_keras = use_keras

    def build(self, input_shape: Any) -> None:
        self.a = self.add_weight(shape=(input_shape[-1], input_shape[-1]), name="a")
        self.b = self.add_weight(shape=(input_shape[-1], input_shape[-1]), name="b")

    def call(self, x: Any) -> Any:
        a, b = self.a, self.b
        positive = keras.ops.mean(x) > 0

        def first() -> Any:
            return keras.ops.tanh(keras.ops.matmul(x, a))

        def second() -> Any:
            return keras.ops.sin(keras.ops.matmul(x, b))

        if self.use_keras:
            return keras.ops.cond(positive, first, second)
        return tf.cond(positive, first, second)

    def get_config(self) -> dict:
        return {**super().get_config(), "use_keras": self.use_keras}


def _branch_model(dtype: str, width: int, use_keras: bool) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            Branch(use_keras=use_keras, dtype=dtype),
            keras.layers.Dense(width, activation="tanh", dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def tf_cond(dtype: str, width: int = 4) -> keras.Model:
    return _branch_model(dtype, width, use_keras=False)


def keras_cond(dtype: str, width: int = 4) -> keras.Model:
    return _branch_model(dtype, width, use_keras=True)


def _branch_data(rng: np.random.Generator, n: int, width: int) -> tuple:
    # Two batches (batch_size 6): the first takes one branch, the second the other.
    x = rng.standard_normal((n, 4)).astype("float32")
    x[:6] += 1.0
    x[6:] -= 1.0
    return x, _classes(rng, n)


# -- how models are written and called ------------------------------------------------
class NoTrainingArgument(keras.Model):
    """A subclassed model whose ``call`` takes no ``training`` argument."""

    def __init__(self, width: int = 4, dtype: str = "float32", **kwargs: Any) -> None:
        super().__init__(dtype=dtype, **kwargs)
        self.hidden = keras.layers.Dense(width, activation="tanh", dtype=dtype)
        self.out = keras.layers.Dense(3, dtype=dtype)

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))


def subclassed(dtype: str, width: int = 4) -> keras.Model:
    model = NoTrainingArgument(width, dtype)
    model(np.zeros((1, 4), dtype))
    return model


@keras.saving.register_keras_serializable(package="spectra_zoo")
class ActivityPenalty(keras.layers.Layer):
    """Identity that adds 0.05·mean(x²) to the model's losses (``add_loss``)."""

    def call(self, x: Any) -> Any:
        self.add_loss(0.05 * keras.ops.mean(keras.ops.square(x)))
        return x


def add_loss(dtype: str, width: int = 4) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(width, activation="tanh", dtype=dtype),
            ActivityPenalty(dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def multi_io(dtype: str, width: int = 4) -> keras.Model:
    a = keras.Input((3,), name="a", dtype=dtype)
    b = keras.Input((2,), name="b", dtype=dtype)
    h = keras.layers.Concatenate(dtype=dtype)(
        [keras.layers.Dense(width, activation="tanh", dtype=dtype)(a), b]
    )
    classes = keras.layers.Dense(3, name="classes", dtype=dtype)(h)
    value = keras.layers.Dense(1, name="value", dtype=dtype)(h)
    return keras.Model({"a": a, "b": b}, {"classes": classes, "value": value})


def _multi_io_data(rng: np.random.Generator, n: int, width: int) -> tuple:
    x = {"a": _floats(rng, n, 3), "b": _floats(rng, n, 2)}
    y = {"classes": _classes(rng, n), "value": _floats(rng, n, 1)}
    return x, y


@tf.custom_gradient
def _log1pexp(x: Any) -> Any:
    e = tf.exp(x)

    def grad(upstream: Any) -> Any:
        # Built from differentiable ops, so second derivatives are correct.
        return upstream * (1.0 - 1.0 / (1.0 + e))

    return tf.math.log1p(e), grad


@keras.saving.register_keras_serializable(package="spectra_zoo")
class Log1pExp(keras.layers.Layer):
    def call(self, x: Any) -> Any:
        return _log1pexp(x)


def custom_gradient(dtype: str, width: int = 4) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(width, dtype=dtype),
            Log1pExp(dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def dropout(dtype: str, width: int = 6) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,), dtype=dtype),
            keras.layers.Dense(width, activation="tanh", dtype=dtype),
            keras.layers.Dropout(0.5, seed=3, dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def _dense_data(rng: np.random.Generator, n: int, width: int) -> tuple:
    return _floats(rng, n, 4), _classes(rng, n)


def _sequence_data(rng: np.random.Generator, n: int, width: int) -> tuple:
    return _floats(rng, n, 4, 2), _classes(rng, n)


def _token_data(rng: np.random.Generator, n: int, width: int) -> tuple:
    tokens = rng.integers(0, 6, (n, 5)).astype("int32")
    tokens[::3, 3:] = 0  # padding, masked by mask_zero=True
    return tokens, _classes(rng, n)


ZOO = [
    ZooEntry("mlp", mlp, _dense_data, batch_size=5),
    ZooEntry("cnn", cnn, lambda rng, n, w: (_floats(rng, n, 5, 5, 1), _classes(rng, n))),
    ZooEntry("batchnorm", batchnorm, _dense_data, batch_size=5),
    ZooEntry("attention", attention, lambda rng, n, w: (_floats(rng, n, 3, w), _classes(rng, n))),
    # Normalization by batch or feature statistics (tf.nn.moments): nested tapes get their
    # second derivatives wrong, the finite-difference truth does not.
    ZooEntry("layernorm", layernorm, _dense_data, batch_size=5),
    ZooEntry("groupnorm", groupnorm, _dense_data),
    # Training mode: batch statistics, so the operator is defined per batch (DESIGN.md).
    ZooEntry("batchnorm-training", batchnorm, _dense_data, kwargs={"training": True}),
    ZooEntry(
        "batchnorm-training-batches",
        batchnorm,
        _dense_data,
        batch_size=4,
        kwargs={"training": True},
    ),
    ZooEntry(
        "transformer",
        transformer,
        lambda rng, n, w: (_floats(rng, n, 4, w), _classes(rng, n)),
        float32_operator=False,
    ),
    ZooEntry("lstm-masked", lstm, _token_data),
    ZooEntry("gru", gru, _sequence_data, float32_operator=False),
    ZooEntry("simple-rnn", simple_rnn, _sequence_data),
    ZooEntry("bidirectional-lstm", bidirectional, _sequence_data, float32_operator=False),
    ZooEntry("keras-scan", scan, _sequence_data, float32_operator=False),
    ZooEntry("tf-while-loop", while_loop, _dense_data),
    ZooEntry("tf-cond", tf_cond, _branch_data, batch_size=6),
    ZooEntry("keras-cond", keras_cond, _branch_data, batch_size=6),
    ZooEntry("subclassed-no-training-arg", subclassed, _dense_data),
    ZooEntry("add-loss", add_loss, _dense_data),
    ZooEntry(
        "multi-io-compiled",
        multi_io,
        _multi_io_data,
        loss={"classes": SCE, "value": "mse"},
        loss_weights={"classes": 1.0, "value": 0.5},
        compiled=True,
    ),
    ZooEntry("custom-gradient", custom_gradient, _dense_data),
    ZooEntry(
        "dropout-training",
        dropout,
        _dense_data,
        kwargs={"training": True},
        float32_reference=False,
    ),
]


def operator_for(entry: ZooEntry, model: keras.Model, data: tuple, **kwargs) -> HessianOperator:
    """The entry's Hessian operator (the compiled loss for entries that compile)."""
    if entry.compiled:
        model.compile(loss=entry.loss, loss_weights=entry.loss_weights)
        loss = None
    else:
        loss = entry.loss
    return HessianOperator.from_keras(
        model, loss, data, batch_size=entry.batch_size, **entry.kwargs, **kwargs
    )


def zoo_case(entry: ZooEntry, rng: np.random.Generator) -> tuple:
    """The entry's float32 model on test data, its float64 copy, the float64 and float32
    operators (None without ``entry.float32_operator``), and the dense reference
    ``(H, gradient, loss)`` of the copy."""
    keras.utils.set_random_seed(5)
    model = entry.build("float32")
    data = entry.data(rng, N, 4)
    model64 = float64_copy(entry, model)
    if entry.kwargs.get("training"):
        # The float64 copy draws from the same seed generator states as the model.
        for a, b in zip(model.non_trainable_variables, model64.non_trainable_variables):
            b.assign(a.numpy())
    op64 = operator_for(entry, model64, cast(data, "float64"))
    op32 = operator_for(entry, model, data) if entry.float32_operator else None
    return model, model64, op64, op32, dense_reference(entry, model64, data)


# -- dense ground truth -----------------------------------------------------------------
def float64_copy(entry: ZooEntry, model: keras.Model) -> keras.Model:
    copy = entry.build("float64")
    copy.set_weights(
        [w.astype(np.float64) if w.dtype.kind == "f" else w for w in model.get_weights()]
    )
    return copy


def cast(tree, dtype):
    return tf.nest.map_structure(
        lambda a: a.astype(dtype) if np.asarray(a).dtype.kind == "f" else a, tree
    )


def dense_reference(entry: ZooEntry, model64: keras.Model, data: tuple):
    """Dense Hessian, gradient and loss of Σ_b (n_b/N) L_b for the float64 copy; the
    Hessian by central finite differences of the gradient (``_dense.dense_hessian``), never
    by nested tapes, whose second derivatives through ``tf.nn.moments`` are wrong."""
    x, y = cast(data, "float64")
    training = entry.kwargs.get("training", False)
    structured = keras_models.StructuredLoss(entry.loss, entry.loss_weights, tf.float64)
    bs = N if entry.batch_size is None else entry.batch_size
    terms = []
    for index, start in enumerate(range(0, N, bs)):

        def take(a, s=start):
            return tf.nest.map_structure(lambda t: t[s : s + bs], a)

        seeds = seed_states(model64, index) if training else []

        def batch_loss(take=take, seeds=seeds):
            # Dropout (training=True) draws from the documented seeds: each seed generator
            # state as the operator snapshotted it, plus [batch index, 0]. The scope also
            # keeps BatchNormalization's moving statistics from being updated.
            with keras.StatelessScope(state_mapping=seeds, collect_losses=True):
                outputs = model64(take(x), training=training)
                extra = list(model64.losses)
            value = structured(model64, take(y), outputs, None)
            return value + (tf.add_n(extra) if extra else 0.0)

        terms.append((batch_loss, min(bs, N - start) / N))
    fn = batch_weighted(terms)
    variables = model64.trainable_variables
    with refusing_nested_tapes():
        hessian = dense_hessian(fn, variables)
    return hessian, flat_gradient(fn, variables), float(fn())


@contextlib.contextmanager
def refusing_nested_tapes() -> Iterator[None]:
    """``tf.GradientTape.jacobian`` and ``batch_jacobian`` raise inside: a truth computed
    with nested tapes would share TensorFlow's second-derivative bugs."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(
            "a truth used tf.GradientTape.jacobian (nested tapes); "
            "use _dense.dense_hessian (finite differences of the gradient)"
        )

    saved = tf.GradientTape.jacobian, tf.GradientTape.batch_jacobian
    tf.GradientTape.jacobian = tf.GradientTape.batch_jacobian = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        tf.GradientTape.jacobian, tf.GradientTape.batch_jacobian = saved  # type: ignore[method-assign]


def seed_states(model: keras.Model, batch_index: int) -> list:
    mapping = []
    for v in model.non_trainable_variables:
        if str(v.path).endswith("seed_generator_state"):
            base = np.asarray(v.numpy())
            mapping.append((v, tf.constant(base + np.array([batch_index, 0], base.dtype))))
    return mapping
