"""Data that does not fit in memory: streamed tf.data pipelines, block sizes from a budget."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from spectra.operators import HessianOperator, block_size_for


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
