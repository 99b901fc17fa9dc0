"""spectra._tf_compat: each private or version-dependent API and its fallback path.

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

from spectra import _tf_compat
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

    primary = _tf_compat.flatten_layers(model)
    fallback = _tf_compat.flatten_layers(_Hidden(model, "_flatten_layers"))
    assert names(fallback) == names(primary)
    assert len(names(primary)) == 5  # inner, its Dense and Dropout, Dropout, Dense


def test_seed_state_variables_and_its_fallback():
    model = _nested_model()
    primary = _tf_compat.seed_state_variables(model)
    assert len(primary) == 2
    fallback = _tf_compat.seed_state_variables(_Hidden(model, "_seed_generators"))
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
    primary = _tf_compat.optimizer_slots(optimizer, variables, kind)
    fallback = _tf_compat.optimizer_slots(_PublicOptimizer(optimizer), variables, kind)
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
            _tf_compat.optimizer_slots(seen, stranger.trainable_variables, kind)


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
        inputs, outputs, layers = _tf_compat.functional_structure(model)
        fallback = _tf_compat.functional_structure(_Hidden(model, hidden))
        assert fallback is not None
        assert tf.nest.map_structure(id, fallback[0]) == tf.nest.map_structure(id, inputs)
        assert tf.nest.map_structure(id, fallback[1]) == tf.nest.map_structure(id, outputs)
        assert [id(layer) for layer in fallback[2]] == [id(layer) for layer in layers]
    inputs, outputs, _ = _tf_compat.functional_structure(functional)
    assert sorted(inputs) == ["features", "tokens"] and sorted(outputs) == ["a", "b"]

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    subclassed = Subclassed()
    subclassed(np.ones((1, 3), np.float32))
    assert _tf_compat.functional_structure(subclassed) is None


def test_layer_input_tensors_and_its_fallback():
    model = _multi_io_model()
    embedding = model.get_layer("embedding")
    primary = _tf_compat.layer_input_tensors(embedding)
    assert [id(t) for t in primary] == [id(model.input["tokens"])]
    fallback = _tf_compat.layer_input_tensors(_Hidden(embedding, "_inbound_nodes"))
    assert [id(t) for t in fallback] == [id(t) for t in primary]
    assert _tf_compat.layer_input_tensors(keras.layers.Dense(2)) == []  # never called
    assert _tf_compat.layer_input_tensors(_Hidden(keras.layers.Dense(2), "_inbound_nodes")) == []


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
    primary = _tf_compat.loss_function_kwargs(loss)
    assert primary == loss._fn_kwargs
    fallback = _tf_compat.loss_function_kwargs(_Hidden(loss, "_fn_kwargs"))
    # The config may leave out a default (the sparse cross-entropy's axis); every value it
    # gives is the function's.
    assert fallback.items() <= primary.items()
    assert {k: v for k, v in primary.items() if k != "axis"}.items() <= fallback.items()
    assert _tf_compat.loss_function_kwargs(lambda y_true, y_pred: y_pred) == {}
