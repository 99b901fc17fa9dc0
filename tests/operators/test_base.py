"""spectra.operators.base: the snapshot of the weights, and streamed data.

An operator is the Hessian at the weights it was built with.

Each test builds an operator and, before using it at all, changes the model: training
steps, ``load_weights`` of another checkpoint, a second operator on the same model at
other weights (which shares the compiled engine and, for float64, the float64 clone).
The first operator must still give the products, loss and gradient of an operator built
on an untouched copy of the original weights — cached or streaming, float32 or float64.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra.operators import HessianOperator, block_size_for

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("tanh"),
            keras.layers.Dense(3),
        ]
    )


def copy_of(model: keras.Model) -> keras.Model:
    other = build_model()
    other.set_weights(model.get_weights())
    return other


@pytest.fixture
def data(rng):
    x = rng.standard_normal((20, 4)).astype("float32")
    y = rng.integers(0, 3, 20).astype("int32")
    return x, y


# "auto" that streams keeps the snapshot as "streaming" does (the same path once the mode is
# chosen): make test leaves it out (pytest.mark.long, run by make test-all).
CASES = [
    pytest.param(
        cache,
        dtype,
        id=f"{name}-{np.dtype(dtype or np.float32).name}",
        marks=[pytest.mark.long] if cache == "auto" else [],
    )
    for cache, name in [(True, "cached"), (False, "streaming"), ("auto", "auto-streaming")]
    for dtype in (None, np.float64)
]


def _operator(model, data, cache, dtype):
    # cache_bytes=1 makes "auto" stream, the mode a model too large to cache gets.
    extra = {"cache_bytes": 1} if cache == "auto" else {}
    return HessianOperator.from_keras(
        model, SCE, data, batch_size=7, cache=cache, dtype=dtype, **extra
    )


def _assert_same_operator(op, reference, rng):
    V = rng.standard_normal((op.shape[0], 3)).astype(op.dtype)
    tol = 1e-12 if op.dtype == np.float64 else 1e-6
    np.testing.assert_allclose(op.matmat(V), reference.matmat(V), rtol=tol, atol=tol)
    np.testing.assert_allclose(op.matvec(V[:, 0]), reference.matvec(V[:, 0]), rtol=tol, atol=tol)
    np.testing.assert_allclose(op.gradient(), reference.gradient(), rtol=tol, atol=tol)
    assert op.loss() == pytest.approx(reference.loss(), rel=tol)


# The checkpoint holds no optimizer state; Keras says so when loading it.
@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")
@pytest.mark.parametrize("cache, dtype", CASES)
def test_training_loading_and_another_operator_change_nothing(cache, dtype, data, rng, tmp_path):
    model = build_model()
    untouched = copy_of(model)
    op = _operator(model, data, cache, dtype)  # not used before the model changes
    reference = _operator(untouched, data, cache, dtype)
    # 1. Training goes on (weights and BatchNorm statistics move).
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=SCE)
    model.fit(*data, epochs=3, batch_size=5, verbose=0)
    assert not np.allclose(model.get_weights()[0], untouched.get_weights()[0])
    _assert_same_operator(op, reference, rng)
    assert op.is_cached == (cache is True)
    # 2. Another checkpoint is loaded.
    other = build_model()
    path = str(tmp_path / "other.weights.h5")
    other.save_weights(path)
    model.load_weights(path)
    _assert_same_operator(op, reference, rng)
    # 3. A second operator on the same model, at other weights, shares the compiled
    # engine (and, for float64, the float64 clone) and is used first.
    second = _operator(model, data, cache, dtype)
    assert second._engine is op._engine
    second.matvec(rng.standard_normal(second.shape[0]))
    op.reset_cache()  # dropping the cache recomputes it from the snapshot
    _assert_same_operator(op, reference, rng)
    _assert_same_operator(second, _operator(copy_of(model), data, cache, dtype), rng)


def test_assigning_variables_of_a_loss_fn_changes_nothing(rng):
    x = rng.standard_normal((10, 3))
    w = tf.Variable(rng.standard_normal(3))
    scale = tf.Variable(2.0, dtype=tf.float64)  # read by the loss, not differentiated

    def loss_fn(batch):
        return scale * tf.reduce_mean(tf.tanh(tf.linalg.matvec(batch[0], w)) ** 2)

    def dense(w_value, scale_value):
        xw = x @ w_value
        t = np.tanh(xw)
        d2 = 2 * (1 - t**2) ** 2 - 4 * t**2 * (1 - t**2)  # (tanh²)'' at xw
        return scale_value * (x.T * d2) @ x / len(x)

    expected = dense(w.numpy(), 2.0)
    for cache in (True, False):
        op = HessianOperator(loss_fn, [w], (x,), batch_size=4, cache=cache)
        w.assign(w * 3.0)
        scale.assign(7.0)
        np.testing.assert_allclose(op.matmat(np.eye(3)), expected, rtol=1e-12, atol=1e-14)
        w.assign(w / 3.0)
        scale.assign(2.0)


def test_dropout_state_advanced_by_the_model_changes_nothing(rng):
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(6, activation="tanh"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(3),
        ]
    )
    x = rng.standard_normal((12, 4)).astype("float32")
    y = rng.integers(0, 3, 12)
    untouched = keras.models.clone_model(model)
    untouched.set_weights(model.get_weights())
    for a, b in zip(model.non_trainable_variables, untouched.non_trainable_variables):
        b.assign(a)  # same seed generator state
    for cache in (True, False):
        op = HessianOperator.from_keras(model, SCE, (x, y), training=True, cache=cache)
        model(x, training=True)  # draws a mask: advances the seed generator
        reference = HessianOperator.from_keras(untouched, SCE, (x, y), training=True)
        v = rng.standard_normal(op.shape[0]).astype(np.float32)
        np.testing.assert_allclose(op.matvec(v), reference.matvec(v), rtol=1e-6)
        for a, b in zip(model.non_trainable_variables, untouched.non_trainable_variables):
            a.assign(b)


def test_snapshot_is_a_copy_not_a_view(data, rng):
    # In-place optimizer updates must not reach values the operator holds.
    model = build_model()
    op = _operator(model, data, True, None)
    before = [np.array(t) for t in op._snapshot.state[0]]
    for v in model.trainable_variables:
        v.assign_add(tf.ones_like(v))
    after = [np.array(t) for t in op._snapshot.state[0]]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_mixed_precision_operator_keeps_its_snapshot(data, rng):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = build_model()
        untouched = build_model()
    finally:
        keras.config.set_dtype_policy("float32")
    untouched.set_weights(model.get_weights())
    for cache in (True, False):
        op = _operator(model, data, cache, None)  # products from a float32 clone
        model.set_weights([w + 0.5 for w in model.get_weights()])
        _assert_same_operator(op, _operator(untouched, data, cache, None), rng)
        model.set_weights(untouched.get_weights())


# Data that does not fit in memory: streamed tf.data pipelines, block sizes from a budget.


@pytest.fixture(scope="module")
def problem():
    keras.utils.set_random_seed(11)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(5, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    rng = np.random.default_rng(3)
    x = rng.standard_normal((47, 4))
    y = rng.integers(0, 3, 47)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = HessianOperator.from_keras(model, loss, (x, y), batch_size=10)
    V = rng.standard_normal((reference.shape[0], 4))
    return model, loss, x, y, V, reference.matmat(V)


def test_generator_dataset_streams_batches(problem):
    model, loss, x, y, V, expected = problem
    produced = []

    def batches():
        for start in range(0, len(y), 10):
            produced.append(start)
            yield x[start : start + 10], y[start : start + 10]

    dataset = tf.data.Dataset.from_generator(
        batches,
        output_signature=(
            tf.TensorSpec([None, 4], tf.float64),
            tf.TensorSpec([None], tf.int64),
        ),
    )
    op = HessianOperator.from_keras(model, loss, dataset, cache=False)
    np.testing.assert_allclose(op.matmat(V), expected, rtol=1e-12)
    np.testing.assert_allclose(op.matmat(V), expected, rtol=1e-12)
    assert not op.is_cached and op.cache_nbytes == 0
    # One counting pass, one pass for loss and gradient, then one pass per matmat.
    assert len(produced) == 4 * 5
    assert op.num_examples == 47


def test_tfrecord_file_on_disk(problem, tmp_path):
    model, loss, x, y, V, expected = problem
    path = str(tmp_path / "data.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for xi, yi in zip(x, y):
            features = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=xi.tolist())),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(yi)])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=features))
            writer.write(example.SerializeToString())
    description = {
        "x": tf.io.FixedLenFeature([4], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }

    def parse(record):
        parsed = tf.io.parse_single_example(record, description)
        return tf.cast(parsed["x"], tf.float64), parsed["y"]

    dataset = tf.data.TFRecordDataset(path).map(parse).batch(10)
    op = HessianOperator.from_keras(model, loss, dataset)
    # TFRecord floats are float32: compare with the same rounding of x.
    x32 = x.astype(np.float32).astype(np.float64)
    rounded = HessianOperator.from_keras(model, loss, (x32, y), batch_size=10)
    np.testing.assert_allclose(op.matmat(V), rounded.matmat(V), rtol=1e-12)
    np.testing.assert_allclose(op.matmat(V), expected, rtol=1e-5)


def test_block_size_follows_the_memory_budget():
    # A block holds five (k, n) arrays: 512 MiB fits k = 26.8 of 4 MB rows, 13.4 of 8 MB.
    assert block_size_for(10_000, 4) == 64
    assert block_size_for(10**6, 4) == 16
    assert block_size_for(10**6, 8) == 8
    assert block_size_for(10**8, 4) == 1
    assert block_size_for(10**6, 4, budget_bytes=64 * 1024**2) == 2


def test_default_block_size_of_an_operator(problem):
    model, loss, x, y, _, _ = problem
    op = HessianOperator.from_keras(model, loss, (x, y))
    assert op.max_block_size == block_size_for(op.shape[0], 8) == 64
    small = HessianOperator.from_keras(model, loss, (x, y), max_block_size=2)
    assert small.max_block_size == 2
    with pytest.raises(ValueError, match="max_block_size must be an integer >= 1"):
        HessianOperator.from_keras(model, loss, (x, y), max_block_size=0)
