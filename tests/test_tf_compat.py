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
