"""spectra._tf_compat and spectra._keras_compat (on TensorFlow's backend): each private or
version-dependent API and its fallback path.

Every fallback is exercised by hiding the private attribute (or the compat function) it
replaces, and compared with the primary path on the same input.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import dense_hessian, relative_error

from spectra import _keras_compat, _tf_compat
from spectra.operators import HessianOperator
from spectra.operators.engine import clear_engine_cache

ROOT = Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def _within(version: str, spec: str) -> bool:
    lower = re.search(r">=\s*([\d.]+)", spec)
    upper = re.search(r"<\s*([\d.]+)", spec)
    v = _version(version)
    return (lower is None or v >= _version(lower.group(1))) and (
        upper is None or v < _version(upper.group(1))
    )


def test_running_versions_are_the_supported_ones_stated_in_setup_cfg():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requires = config["options"]["install_requires"]
    assert f"tensorflow{_tf_compat.SUPPORTED_TENSORFLOW}" in requires
    assert f"keras{_tf_compat.SUPPORTED_KERAS}" in requires
    assert _within(tf.__version__, _tf_compat.SUPPORTED_TENSORFLOW), tf.__version__
    assert _within(keras.__version__, _tf_compat.SUPPORTED_KERAS), keras.__version__


class _NoFlatCall:
    """A concrete function seen through its public call only."""

    def __init__(self, function):
        self._function = function

    def __call__(self, *args):
        return self._function(*args)


def test_call_flat_and_its_fallback():
    function = tf.function(lambda a, b: [a * b, a + b]).get_concrete_function(
        tf.TensorSpec([2], tf.float32), tf.TensorSpec([2], tf.float32)
    )
    a, b = tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0])
    flat = _tf_compat.call_flat(function, [a, b])
    fallback = _tf_compat.call_flat(_NoFlatCall(function), [a, b])
    for x, y in zip(flat, fallback):
        np.testing.assert_array_equal(x, y)


def _problem(rng):
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(5, activation="tanh", dtype="float64"),
            keras.layers.Dropout(0.25, dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    x = rng.standard_normal((11, 4))
    y = rng.integers(0, 3, 11)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")

    def total():
        return loss(y, model(x, training=False))

    return model, (x, y), dense_hessian(total, model.trainable_variables)


def test_trace_graph_fallback_gives_the_same_products(rng, monkeypatch):
    # Without tf.compat.v1.wrap_function the graph comes from a tf.function, with its
    # automatic control dependencies; the split drops the ones crossing parts.
    model, data, H = _problem(rng)
    clear_engine_cache()
    monkeypatch.setattr(_tf_compat, "trace_graph", _tf_compat._trace_with_tf_function)
    op = HessianOperator.from_keras(model, "sparse_categorical_crossentropy", data)
    V = rng.standard_normal((op.shape[0], 3))
    # The string loss expects probabilities; compare with logits through the same op.
    assert op.product_path == "split"
    logits_op = HessianOperator.from_keras(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), data
    )
    assert relative_error(logits_op.matmat(V), H @ V) < 1e-10
    assert relative_error(logits_op.matvec(V[:, 0]), H @ V[:, 0]) < 1e-10
    clear_engine_cache()


def test_model_distribute_strategy_and_its_fallback():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert _tf_compat.model_distribute_strategy(model) is None
    assert _tf_compat.model_distribute_strategy(object()) is None
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        built = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert _tf_compat.model_distribute_strategy(built) is strategy


class _Hidden:
    """A model seen without one private attribute."""

    def __init__(self, model, hidden: str):
        self._model = model
        self._hidden = hidden

    def __getattr__(self, name):
        if name == self._hidden:
            raise AttributeError(name)
        return getattr(self._model, name)


def _nested_model():
    inner = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(3), keras.layers.Dropout(0.5)], name="inner"
    )
    return keras.Sequential(
        [keras.Input((3,)), inner, keras.layers.Dropout(0.2), keras.layers.Dense(2)]
    )


def test_flatten_layers_and_its_fallback():
    model = _nested_model()

    def names(layers):
        return sorted(
            layer.name for layer in layers if not isinstance(layer, keras.layers.InputLayer)
        )

    primary = _keras_compat.flatten_layers(model)
    fallback = _keras_compat.flatten_layers(_Hidden(model, "_flatten_layers"))
    assert names(fallback) == names(primary)
    assert len(names(primary)) == 5  # inner, its Dense and Dropout, Dropout, Dense


def test_seed_state_variables_and_its_fallback():
    model = _nested_model()
    primary = _keras_compat.seed_state_variables(model)
    assert len(primary) == 2
    fallback = _keras_compat.seed_state_variables(_Hidden(model, "_seed_generators"))
    assert {id(v) for v in fallback} == {id(v) for v in primary}


class _PublicOptimizer:
    """An optimizer seen through its public ``variables`` only (no private slot lists)."""

    def __init__(self, optimizer):
        self.variables = optimizer.variables


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.Adam(0.01),
        lambda: keras.optimizers.Adam(0.01, amsgrad=True),
        lambda: keras.optimizers.AdamW(0.01),
        lambda: keras.optimizers.RMSprop(0.01, centered=True),
        lambda: keras.optimizers.Adagrad(0.1),
    ],
    ids=["adam", "adam-amsgrad", "adamw", "rmsprop-centered", "adagrad"],
)
def test_optimizer_slots_and_their_fallback(rng, make):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]
    )
    optimizer = make()
    kind = type(optimizer).__name__
    variables = model.trainable_variables
    x, y = rng.standard_normal((16, 4)), rng.standard_normal((16, 3))
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    primary = _keras_compat.optimizer_slots(optimizer, variables, kind)
    fallback = _keras_compat.optimizer_slots(_PublicOptimizer(optimizer), variables, kind)
    expected = {"Adagrad": 1, "RMSprop": 2}.get(kind) or (2 if optimizer.amsgrad else 1)
    assert len(primary) == expected and primary.keys() == fallback.keys()
    for name in primary:
        assert len(primary[name]) == len(variables)
        for a, b, v in zip(primary[name], fallback[name], variables):
            assert a.shape == tuple(v.shape) and np.any(a != 0)
            np.testing.assert_array_equal(a, b)
    # Both find a variable of a model rebuilt with the same names by its path, and refuse
    # one the optimizer does not track.
    keras.utils.set_random_seed(0)
    stranger = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="elsewhere")])
    for seen in (optimizer, _PublicOptimizer(optimizer)):
        with pytest.raises(ValueError, match="'sequential.*elsewhere/kernel' is not tracked"):
            _keras_compat.optimizer_slots(seen, stranger.trainable_variables, kind)


def _multi_io_model():
    tokens = keras.Input((4,), dtype="int32", name="tokens")
    features = keras.Input((3,), name="features")
    embedded = keras.layers.Embedding(7, 2, name="embedding")(tokens)
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)
    joined = keras.layers.Concatenate()([pooled, features])
    outputs = {"a": keras.layers.Dense(2, name="a")(joined), "b": keras.layers.Dense(1)(features)}
    return keras.Model({"tokens": tokens, "features": features}, outputs)


def test_functional_structure_and_its_fallback():
    functional = _multi_io_model()
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    for model, hidden in ((functional, "_inputs_struct"), (sequential, "_functional")):
        inputs, outputs, layers = _keras_compat.functional_structure(model)
        fallback = _keras_compat.functional_structure(_Hidden(model, hidden))
        assert fallback is not None
        assert tf.nest.map_structure(id, fallback[0]) == tf.nest.map_structure(id, inputs)
        assert tf.nest.map_structure(id, fallback[1]) == tf.nest.map_structure(id, outputs)
        assert [id(layer) for layer in fallback[2]] == [id(layer) for layer in layers]
    inputs, outputs, _ = _keras_compat.functional_structure(functional)
    assert sorted(inputs) == ["features", "tokens"] and sorted(outputs) == ["a", "b"]

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    subclassed = Subclassed()
    subclassed(np.ones((1, 3), np.float32))
    assert _keras_compat.functional_structure(subclassed) is None


def test_layer_input_tensors_and_its_fallback():
    model = _multi_io_model()
    embedding = model.get_layer("embedding")
    primary = _keras_compat.layer_input_tensors(embedding)
    assert [id(t) for t in primary] == [id(model.input["tokens"])]
    fallback = _keras_compat.layer_input_tensors(_Hidden(embedding, "_inbound_nodes"))
    assert [id(t) for t in fallback] == [id(t) for t in primary]
    assert _keras_compat.layer_input_tensors(keras.layers.Dense(2)) == []  # never called
    assert _keras_compat.layer_input_tensors(_Hidden(keras.layers.Dense(2), "_inbound_nodes")) == []


class _NoCaptures:
    """A traced graph seen without its ``captures`` property."""

    def __init__(self, graph):
        self.external_captures = graph.external_captures
        self.internal_captures = graph.internal_captures


def test_graph_captures_and_its_fallback():
    variable = tf.Variable([1.0, 2.0])
    constant = tf.constant([3.0, 4.0])
    graph, _, _ = _tf_compat.trace_graph(
        lambda x: x * variable.read_value() + constant, [tf.TensorSpec([2], tf.float32)]
    )
    primary = _tf_compat.graph_captures(graph)
    fallback = _tf_compat.graph_captures(_NoCaptures(graph))
    assert len(primary) == 2
    assert [(id(e), i.name) for e, i in primary] == [(id(e), i.name) for e, i in fallback]
    assert {id(e) for e, _ in primary} == {id(variable.handle), id(constant)}
    assert all(i.graph is graph for _, i in primary)


def test_captured_placeholder_and_its_fallback():
    variable = tf.Variable([1.0, 2.0])
    found = {}

    def traced(x):
        primary = _tf_compat.captured_placeholder(variable.handle)
        found["primary"] = primary
        found["again"] = _tf_compat.captured_placeholder(variable.handle)
        found["fallback"] = _tf_compat._capture_through_graph(variable.handle)
        return x * tf.raw_ops.ReadVariableOp(resource=primary, dtype=tf.float32)

    graph, _, _ = _tf_compat.trace_graph(traced, [tf.TensorSpec([2], tf.float32)])
    assert found["primary"].op.type == "Placeholder"
    assert found["again"] is found["primary"] and found["fallback"] is found["primary"]
    assert [i.name for _, i in _tf_compat.graph_captures(graph)] == [found["primary"].name]


def test_keras_logits_and_its_fallback():
    found = {}

    def traced(x):
        found["x"] = x
        for name in ("softmax", "sigmoid"):
            output = keras.activations.get(name)(x)
            found[name] = (
                _tf_compat.keras_logits(output),
                _tf_compat._logits_of_activation(output),
                getattr(output, "_keras_logits", None),
            )
        found["relu"] = _tf_compat.keras_logits(tf.nn.relu(x))
        return x

    _tf_compat.trace_graph(traced, [tf.TensorSpec([2, 3], tf.float32)])
    for name in ("softmax", "sigmoid"):
        primary, fallback, attribute = found[name]
        assert attribute is not None  # the private attribute is there, and read
        assert primary is found["x"] and fallback is found["x"]
    assert found["relu"] is None


@pytest.mark.parametrize(
    "loss",
    [
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=2),
        keras.losses.CategoricalCrossentropy(label_smoothing=0.1),
        keras.losses.BinaryCrossentropy(from_logits=True),
        keras.losses.MeanSquaredError(),
    ],
    ids=["sparse", "smoothed", "binary", "mse"],
)
def test_loss_function_kwargs_and_its_fallback(loss):
    primary = _keras_compat.loss_function_kwargs(loss)
    assert primary == loss._fn_kwargs
    fallback = _keras_compat.loss_function_kwargs(_Hidden(loss, "_fn_kwargs"))
    # The config may leave out a default (the sparse cross-entropy's axis); every value it
    # gives is the function's.
    assert fallback.items() <= primary.items()
    assert {k: v for k, v in primary.items() if k != "axis"}.items() <= fallback.items()
    assert _keras_compat.loss_function_kwargs(lambda y_true, y_pred: y_pred) == {}


# -- exact second derivatives (moments, softsign, resizes) --------------------------------
def _hessian_in_context(f, x):
    """The Hessian of f at x by nested tapes in a graph traced *inside*
    exact_second_derivatives (the code under test, as spectra's engine traces); the truths
    below are closed-form or explicit matrices."""

    def hessian(t):
        # Symbolic tf.gradients, as the engine differentiates.
        g = tf.reshape(tf.gradients(f(t), t)[0], [-1])
        return tf.stack([tf.gradients(g[i], t)[0] for i in range(int(g.shape[0]))])

    with _tf_compat.exact_second_derivatives():
        H = tf.function(hessian, autograph=False)(tf.constant(x)).numpy()
    return H.reshape(H.shape[0], -1)


def test_moments_have_their_exact_hessian_only_inside_the_context():
    x = np.array([0.3, -1.2, 2.0, 0.5])
    n = x.size
    exact = (2 / n) * (np.eye(n) - np.ones((n, n)) / n)  # ∇² of the population variance

    def variance(t):
        return tf.nn.moments(t, axes=[0])[1]

    np.testing.assert_allclose(_hessian_in_context(variance, x), exact, atol=1e-15)
    # Keras' layers reach it through keras.ops.moments.
    keras_variance = lambda t: keras.ops.moments(t, axes=[0])[1]  # noqa: E731
    np.testing.assert_allclose(_hessian_in_context(keras_variance, x), exact, atol=1e-15)
    original = tf.nn.moments
    with _tf_compat.exact_second_derivatives(), _tf_compat.exact_second_derivatives():
        assert tf.nn.moments is not original  # re-entrant
    assert tf.nn.moments is original
    with tf.GradientTape(persistent=True) as outer:
        t = tf.constant(x)
        outer.watch(t)
        with tf.GradientTape() as inner:
            inner.watch(t)
            value = variance(t)
        g = inner.gradient(value, t)
    # Outside, TensorFlow's own: the (2/n) I of a variance around a constant mean.
    np.testing.assert_allclose(outer.jacobian(g, t).numpy(), (2 / n) * np.eye(n), atol=1e-15)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("keepdims", [False, True])
def test_exact_moments_give_tensorflows_values_and_gradients(dtype, keepdims, rng):
    x = tf.constant(rng.standard_normal((3, 4, 5)).astype(dtype))
    w = tf.constant(rng.standard_normal((3, 5)).astype(dtype))

    def first_derivative(moments):
        with tf.GradientTape() as tape:
            tape.watch(x)
            mean, variance = moments(x, axes=[1], keepdims=keepdims)
            value = tf.reduce_sum(tf.reshape(w * tf.reshape(mean + variance, [3, 5]), [-1]))
        return mean, variance, tape.gradient(value, x)

    ours = first_derivative(_tf_compat._exact_moments)
    theirs = first_derivative(tf.nn.moments)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(ours[0].numpy(), theirs[0].numpy())
    np.testing.assert_array_equal(ours[1].numpy(), theirs[1].numpy())
    # The gradient now also flows through the mean, whose share is zero up to rounding
    # (-2 E[x - m]): equal within a few units in the last place.
    scale = float(np.max(np.abs(theirs[2].numpy().astype(np.float64))))
    atol = 8 * np.finfo(dtype).eps * scale
    np.testing.assert_allclose(ours[2].numpy(), theirs[2].numpy(), rtol=0, atol=atol)


def test_softsign_has_its_second_derivative():
    x = np.array([-2.0, -0.1, 0.4, 3.0])
    c = np.array([0.5, -1.0, 2.0, 1.5])
    # f = Σ c·softsign(x)²: f'' = 2c(s'² + s·s''), s = x/(1+|x|), s' = 1/(1+|x|)²,
    # s'' = -2 sign(x)/(1+|x|)³.
    s, s1 = x / (1 + abs(x)), 1 / (1 + abs(x)) ** 2
    s2 = -2 * np.sign(x) / (1 + abs(x)) ** 3
    H = _hessian_in_context(lambda t: tf.reduce_sum(c * tf.nn.softsign(t) ** 2), x)
    np.testing.assert_allclose(H, np.diag(2 * c * (s1**2 + s * s2)), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("method", ["bilinear", "nearest", "bicubic", "lanczos3"])
def test_resize_gradients_have_their_second_derivatives(method, rng):
    # f(X) = Σ w ⊙ R(X)², R a linear resize of a 3x2 image to 5x4: ∇²f = 2 Rᵀ diag(w) R,
    # with R read column by column from resized basis images (float32: TensorFlow's
    # resize kernels compute in float32).
    shape, size = (3, 2), (5, 4)
    n = shape[0] * shape[1]

    def resize(t):
        return tf.image.resize(tf.reshape(t, [1, *shape, 1]), size, method=method)

    basis = np.eye(n, dtype=np.float32)
    R = np.stack([np.reshape(resize(tf.constant(e)).numpy(), -1) for e in basis], axis=1)
    w = rng.uniform(0.5, 2.0, size[0] * size[1]).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32)
    H = _hessian_in_context(lambda t: tf.reduce_sum(w * tf.reshape(resize(t), [-1]) ** 2), x)
    np.testing.assert_allclose(H, 2 * R.T @ np.diag(w) @ R, rtol=2e-5, atol=2e-6)


def _pool_selection(shape, pool, stride, padding):
    """The 0/1 matrix P with max_pool(X) = P X (flattened, row-major) for an X of ``shape``
    (n, H, W, c) with distinct entries, by a plain window search ("SAME" windows clipped
    to the image). Returns a function of X."""
    n, height, width, channels = shape

    def selection(x):
        def starts(size):
            if padding == "VALID":
                out = (size - pool) // stride + 1
                return [i * stride for i in range(out)]
            out = -(-size // stride)
            before = max((out - 1) * stride + pool - size, 0) // 2
            return [i * stride - before for i in range(out)]

        rows, cols = starts(height), starts(width)
        P = np.zeros((n * len(rows) * len(cols) * channels, x.size))
        flat = np.arange(x.size).reshape(shape)
        k = 0
        for b in range(n):
            for r in rows:
                for q in cols:
                    for ch in range(channels):
                        window = [
                            (i, j)
                            for i in range(max(r, 0), min(r + pool, height))
                            for j in range(max(q, 0), min(q + pool, width))
                        ]
                        i, j = max(window, key=lambda ij: x[b, ij[0], ij[1], ch])
                        P[k, flat[b, i, j, ch]] = 1.0
                        k += 1
        return P

    return selection


@pytest.mark.parametrize(
    ("pool", "stride", "padding"), [(2, 2, "VALID"), (3, 2, "SAME"), (3, 1, "VALID")]
)
def test_max_pool_derivatives_go_through_the_forward_argmax(pool, stride, padding, rng):
    # f(X) = Σ w ⊙ (P X)², P the pool's selection (fixed where the maxima are distinct):
    # ∇²f = 2 Pᵀ diag(w) P, overlapping windows (stride < pool) adding up.
    shape = (2, 5, 6, 2)
    x = rng.standard_normal(shape)
    P = _pool_selection(shape, pool, stride, padding)(x)
    w = rng.uniform(0.5, 2.0, P.shape[0])

    def f(t):
        pooled = tf.nn.max_pool2d(tf.reshape(t, shape), pool, stride, padding)
        return tf.reduce_sum(w * tf.reshape(pooled, [-1]) ** 2)

    H = _hessian_in_context(f, x.reshape(-1))
    np.testing.assert_allclose(H, 2 * P.T @ np.diag(w) @ P, rtol=1e-14, atol=1e-14)

    # The graph spectra traces routes both backward passes through the argmax: no window
    # search per product (MaxPoolGrad, MaxPoolGradGrad).
    def hessian_vector(t, v):
        g = tf.gradients(f(t), t)[0]
        return tf.gradients(g, t, grad_ys=v)[0]

    spec = [tf.TensorSpec([x.size], tf.float64)] * 2
    graph, _, _ = _tf_compat.trace_graph(hessian_vector, spec)
    types = {op.type for op in graph.get_operations()}
    assert "MaxPoolGradWithArgmax" in types
    assert not types & {"MaxPoolGrad", "MaxPoolGradGrad"}
    # The gradient is TensorFlow's own, bit for bit, and outside the context TensorFlow's
    # registry is back.
    t = tf.constant(x.reshape(-1))
    with _tf_compat.exact_second_derivatives():
        ours = tf.function(lambda t: tf.gradients(f(t), t)[0], autograph=False)(t)
    theirs = tf.function(lambda t: tf.gradients(f(t), t)[0], autograph=False)(t)
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    graph = tf.function(lambda t: tf.gradients(f(t), t)[0]).get_concrete_function(t).graph
    assert "MaxPoolGrad" in {op.type for op in graph.get_operations()}


@pytest.mark.parametrize("include_batch_in_index", [False, True])
def test_max_pool_with_argmax_has_its_second_derivative(include_batch_in_index, rng):
    # TensorFlow gives MaxPoolGradWithArgmax no gradient: a Hessian through
    # tf.nn.max_pool_with_argmax failed with a LookupError.
    shape = (2, 4, 4, 3)
    x = rng.standard_normal(shape)
    P = _pool_selection(shape, 2, 2, "VALID")(x)
    w = rng.uniform(0.5, 2.0, P.shape[0])

    def f(t):
        pooled, _ = tf.nn.max_pool_with_argmax(
            tf.reshape(t, shape), 2, 2, "VALID", include_batch_in_index=include_batch_in_index
        )
        return tf.reduce_sum(w * tf.reshape(pooled, [-1]) ** 2)

    H = _hessian_in_context(f, x.reshape(-1))
    np.testing.assert_allclose(H, 2 * P.T @ np.diag(w) @ P, rtol=1e-14, atol=1e-14)


def test_relu_second_derivative_has_no_zeros_to_add(rng):
    # f = Σ c·relu(x)²: ∇²f = diag(2c[x > 0]); ReluGrad's derivative in x is None inside
    # the context instead of a materialized zero tensor.
    x = rng.standard_normal(7)
    c = rng.uniform(0.5, 2.0, 7)
    f = lambda t: tf.reduce_sum(c * tf.nn.relu(t) ** 2)  # noqa: E731
    np.testing.assert_allclose(_hessian_in_context(f, x), np.diag(2 * c * (x > 0)), atol=0)

    def hessian_vector(t, v):
        return tf.gradients(tf.gradients(f(t), t)[0], t, grad_ys=v)[0]

    spec = [tf.TensorSpec([7], tf.float64)] * 2
    graph, _, _ = _tf_compat.trace_graph(hessian_vector, spec)
    assert "ZerosLike" not in {op.type for op in graph.get_operations()}


def _numpy_patches(x, kernel, stride, dilation, padding):
    """im2col in NumPy: (n·H_out·W_out, kh·kw·c) rows of x's (n, H, W, c) patches, each
    flattened (kh, kw, c) row-major, zeros where "SAME" pads (half the total before)."""
    n, height, width, channels = x.shape
    spans = [(k - 1) * dilation + 1 for k in kernel]
    if padding == "VALID":
        outs = [(size - span) // stride + 1 for size, span in zip((height, width), spans)]
        befores = [0, 0]
    else:
        outs = [-(-size // stride) for size in (height, width)]
        totals = [
            max((o - 1) * stride + span - size, 0)
            for o, span, size in zip(outs, spans, (height, width))
        ]
        befores = [t // 2 for t in totals]
    padded = np.zeros((n, height + 2 * spans[0], width + 2 * spans[1], channels))
    padded[:, spans[0] : spans[0] + height, spans[1] : spans[1] + width] = x
    rows = []
    for b in range(n):
        for i in range(outs[0]):
            for j in range(outs[1]):
                top = spans[0] + i * stride - befores[0]
                left = spans[1] + j * stride - befores[1]
                rows.append(
                    padded[
                        b,
                        top : top + spans[0] : dilation,
                        left : left + spans[1] : dilation,
                    ].reshape(-1)
                )
    return np.array(rows)


@pytest.mark.parametrize(
    ("channels", "stride", "dilation", "padding"),
    [(3, 2, 1, "SAME"), (1, 1, 2, "VALID"), (4, 1, 1, "SAME")],
    ids=["shallow-same-strided", "shallow-dilated", "deep"],
)
def test_convolution_second_derivative_in_the_filter_is_exact(
    channels, stride, dilation, padding, rng
):
    # f(W) = Σ w ⊙ conv(x, W)², conv(x, W) = P W with P x's patches (im2col): the block
    # of ∇²f of output channel o is 2 Pᵀ diag(w_o) P, the others zero. A filter of
    # kh·kw·c_in ≤ 32 takes the patches' matrix product in place of a convolution per
    # product; a deeper one keeps TensorFlow's.
    x = rng.standard_normal((2, 5, 6, channels))
    kernel, outputs = (3, 3), 2
    P = _numpy_patches(x, kernel, stride, dilation, padding)
    w = rng.uniform(0.5, 2.0, (P.shape[0], outputs))
    filter_size = kernel[0] * kernel[1] * channels * outputs

    def f(t):
        # As Keras convolves: a dilated convolution through space-to-batch on CPU.
        z = tf.nn.convolution(
            x, tf.reshape(t, [*kernel, channels, outputs]), stride, padding, dilations=dilation
        )
        return tf.reduce_sum(w * tf.reshape(z, [-1, outputs]) ** 2)

    H = _hessian_in_context(f, rng.standard_normal(filter_size))
    # W flattened (kh, kw, c_in, c_out) row-major: entry (k, o) at k·c_out + o.
    exact = np.zeros((filter_size, filter_size))
    for o in range(outputs):
        block = 2 * P.T @ np.diag(w[:, o]) @ P
        exact[o::outputs, o::outputs] = block
    np.testing.assert_allclose(H, exact, rtol=1e-12, atol=1e-12 * np.abs(exact).max())

    def hessian_vector(t, v):
        return tf.gradients(tf.gradients(f(t), t)[0], t, grad_ys=v)[0]

    spec = [tf.TensorSpec([filter_size], tf.float64)] * 2
    graph, _, _ = _tf_compat.trace_graph(hessian_vector, spec)
    convolutions = [op for op in graph.get_operations() if op.type == "Conv2D"]
    shallow = kernel[0] * kernel[1] * channels <= 32
    assert len(convolutions) == (1 if shallow else 2)  # the forward one, and per product


def test_convolution_second_derivative_in_image_and_filter_is_exact(rng):
    # The derivatives in the image (TensorFlow's formula rebuilt, and the patches' gradient
    # as a convolution's): the whole Hessian in (x, W) against central differences of
    # TensorFlow's gradient.
    shape, filter_shape = (2, 4, 5, 2), (3, 3, 2, 2)
    sizes = [int(np.prod(shape)), int(np.prod(filter_shape))]
    w = rng.uniform(0.5, 2.0, (2, 2, 3, 2))

    def f(t):
        x, kernel = tf.split(t, sizes)
        z = tf.nn.conv2d(tf.reshape(x, shape), tf.reshape(kernel, filter_shape), 2, "SAME")
        return tf.reduce_sum(w * tf.tanh(z))

    point = rng.standard_normal(sum(sizes))
    H = _hessian_in_context(f, point)
    gradient = tf.function(lambda t: tf.gradients(f(t), t)[0], autograph=False)
    step = 1e-5
    columns = []
    for i in range(point.size):
        e = np.zeros(point.size)
        e[i] = step
        columns.append(
            (gradient(tf.constant(point + e)).numpy() - gradient(tf.constant(point - e)).numpy())
            / (2 * step)
        )
    np.testing.assert_allclose(H, np.array(columns).T, rtol=0, atol=1e-8)
    # Inside the context the gradient's filter part is a product with the patches: the
    # same gradient up to rounding.
    with _tf_compat.exact_second_derivatives():
        ours = tf.function(lambda t: tf.gradients(f(t), t)[0], autograph=False)(point)
    np.testing.assert_allclose(ours.numpy(), gradient(tf.constant(point)).numpy(), rtol=1e-13)


def _layer_normalization_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((3,), dtype="float64"),
            keras.layers.Dense(4, activation="tanh", dtype="float64"),
            keras.layers.LayerNormalization(dtype="float64", name="norm"),
            keras.layers.Dense(2, dtype="float64"),
        ]
    )


def test_a_hessian_through_tensorflows_own_moments_is_refused_naming_the_layer(rng, monkeypatch):
    # The fallback: were the substitution not to reach the graph (a Keras that computes
    # moments another way), the engine finds TensorFlow's moments and refuses.
    clear_engine_cache()
    monkeypatch.setattr(_tf_compat, "_exact_moments", tf.nn.moments)
    x, y = rng.standard_normal((6, 3)), rng.integers(0, 2, 6)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with pytest.raises(ValueError, match=r"'sequential\w*/norm\w*' computes a variance with "):
        HessianOperator.from_keras(_layer_normalization_model(), loss, (x, y))
    # The GGN differentiates the model once: it is not refused.
    from spectra.operators import GGNOperator

    ggn = GGNOperator.from_keras(_layer_normalization_model(), loss, (x, y))
    assert np.all(np.isfinite(ggn @ np.ones(ggn.shape[0])))
    clear_engine_cache()


def test_a_bilinear_resize_gradient_left_undifferentiated_is_refused(rng, monkeypatch):
    clear_engine_cache()
    monkeypatch.setattr(_tf_compat, "_gradient_entries", lambda: None)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((2, 2, 1), dtype="float64"),
            keras.layers.Conv2D(1, 1, activation="tanh", dtype="float64"),
            keras.layers.UpSampling2D(2, interpolation="bilinear", dtype="float64", name="up"),
            keras.layers.Flatten(dtype="float64"),
            keras.layers.Dense(2, dtype="float64"),
        ]
    )
    x, y = rng.standard_normal((4, 2, 2, 1)), rng.integers(0, 2, 4)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with pytest.raises(ValueError, match="up.* computes ResizeBilinearGrad, which TensorFlow"):
        HessianOperator.from_keras(model, loss, (x, y))
    clear_engine_cache()


@pytest.mark.parametrize(
    ("layer", "named"),
    [
        (lambda: keras.layers.BatchNormalization(renorm=True, name="bn"), "'bn'.*renorm=True"),
        (
            lambda: keras.layers.SpectralNormalization(keras.layers.Dense(2), name="sn"),
            "'sn'.*SpectralNormalization",
        ),
    ],
    ids=["renorm", "spectral"],
)
def test_layers_whose_training_gradient_is_a_surrogate_are_refused_in_training(layer, named, rng):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), layer()])
    x, y = rng.standard_normal((6, 3)), rng.integers(0, 2, 6)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with pytest.raises(ValueError, match=named + r".*use training=False"):
        HessianOperator.from_keras(model, loss, (x, y), training=True)
    HessianOperator.from_keras(model, loss, (x, y))  # inference mode is exact


def test_first_gpu_memory_and_its_fallback(monkeypatch):
    import sys
    import types

    from tensorflow.python.client import device_lib

    assert _tf_compat.first_gpu_memory() is None or tf.config.list_physical_devices("GPU")
    gpu = types.SimpleNamespace(device_type="GPU", memory_limit=3 << 30)
    cpu = types.SimpleNamespace(device_type="CPU", memory_limit=1 << 30)
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: ["GPU:0"])
    monkeypatch.setattr(device_lib, "list_local_devices", lambda: [cpu, gpu])
    assert _tf_compat.first_gpu_memory() == 3 << 30
    # Without the private module: no figure (the memory plan then uses the host's).
    monkeypatch.setitem(sys.modules, "tensorflow.python.client.device_lib", None)
    monkeypatch.delattr(sys.modules["tensorflow.python.client"], "device_lib")
    assert _tf_compat.first_gpu_memory() is None
