"""spectra.operators.batching.Batches: weights, argument types, finite datasets, the reshuffle
guard, and sample weights inside a tf.data pipeline against a dense float64 Hessian."""

from __future__ import annotations

import itertools
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import batch_weighted, dense_hessian, relative_error
from _relu_mlp import ReluMLP

import spectra
import spectra.operators.batching
from spectra.operators import HessianOperator, block_size_for
from spectra.operators.batching import Batches
from spectra.operators.memory import BLOCK_COPIES

SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def arrays(rng, n=12, features=4, classes=3):
    return rng.standard_normal((n, features)), rng.integers(0, classes, n).astype("int32")


def generator_dataset(batches_per_pass, produced=None):
    """A tf.data pipeline of unknown cardinality; ``batches_per_pass()`` gives each pass."""

    def generate():
        for x, y in batches_per_pass():
            if produced is not None:
                produced.append(len(y))
            yield x, y

    return tf.data.Dataset.from_generator(
        generate,
        output_signature=(tf.TensorSpec([None, 4], tf.float64), tf.TensorSpec([None], tf.int32)),
    )


def small_mlp():
    return keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(5, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )


# -- weights and batch sizes ----------------------------------------------------------
def test_array_batches_and_weights(rng):
    x, y = arrays(rng, n=11)
    batches = Batches((x, y), np.int64(4))  # numpy integers are integers
    sizes = [int(b[1].shape[0]) for b, _ in batches]
    weights = [w for _, w in batches]
    assert sizes == [4, 4, 3] and batches.num_batches == 3 and batches.num_examples == 11
    np.testing.assert_allclose(weights, [4 / 11, 4 / 11, 3 / 11], rtol=1e-15)
    joined = np.concatenate([b[0].numpy() for b, _ in batches])
    np.testing.assert_array_equal(joined, x)


def test_dataset_batches_and_weights(rng):
    x, y = arrays(rng, n=11)
    batches = Batches(tf.data.Dataset.from_tensor_slices((x, y)).batch(4))
    assert [w for _, w in batches] == [4 / 11, 4 / 11, 3 / 11]
    assert batches.num_examples == 11 and batches.dataset is not None and batches.arrays is None
    # The number of batches, asked first, counts the dataset too.
    assert Batches(tf.data.Dataset.from_tensor_slices((x, y)).batch(4)).num_batches == 3


# -- type-strict arguments --------------------------------------------------------------
@pytest.mark.parametrize("bad", [True, False, np.bool_(True), 2.0, "4"])
def test_batch_size_must_be_an_integer(bad, rng):
    with pytest.raises(TypeError, match=r"batch_size must be an integer or None, got"):
        Batches(arrays(rng), bad)


@pytest.mark.parametrize("bad", [0, -3, np.int32(0)])
def test_batch_size_must_be_positive(bad, rng):
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got"):
        Batches(arrays(rng), bad)


def test_max_batches_must_be_an_integer(rng):
    dataset = tf.data.Dataset.from_tensor_slices(arrays(rng)).batch(4)
    with pytest.raises(TypeError, match=r"max_batches must be an integer or None, got True"):
        Batches(dataset, max_batches=True)


# -- finite datasets ----------------------------------------------------------------------
def test_infinite_dataset_is_refused_at_construction(rng):
    # Regression (issue 10): a .repeat() pipeline made the operator count examples forever.
    dataset = tf.data.Dataset.from_tensor_slices(arrays(rng)).batch(4).repeat()
    with pytest.raises(ValueError, match=r"infinite tf.data.Dataset.*dataset.take\(num_batches\)"):
        Batches(dataset)
    with pytest.raises(ValueError, match=r"infinite tf.data.Dataset"):
        HessianOperator.from_keras(small_mlp(), SCE, dataset)
    finite = tf.data.Dataset.from_tensor_slices(arrays(rng)).batch(4).repeat(2)
    assert Batches(finite).num_examples == 24


def test_max_batches_stops_an_endless_generator(rng):
    x, y = arrays(rng, n=4)

    def forever():
        while True:
            yield x, y

    batches = Batches(generator_dataset(forever), max_batches=50)
    with pytest.raises(ValueError, match=r"more than max_batches=50 batches.*dataset.take"):
        _ = batches.num_examples


def test_max_batches_with_a_known_cardinality(rng):
    dataset = tf.data.Dataset.from_tensor_slices(arrays(rng, n=12)).batch(4)
    with pytest.raises(ValueError, match=r"has 3 batches, more than max_batches=2"):
        Batches(dataset, max_batches=2)
    assert Batches(dataset, max_batches=3).num_examples == 12


def test_slow_count_of_unknown_cardinality_warns_once(rng, monkeypatch):
    x, y = arrays(rng, n=4)
    monkeypatch.setattr(spectra.operators.batching, "_SLOW_COUNT_SECONDS", 0.0)
    batches = Batches(generator_dataset(lambda: [(x, y)] * 3))
    with pytest.warns(RuntimeWarning, match=r"unknown cardinality: 1 batches") as w:
        assert batches.num_examples == 12
    assert len(w) == 1
    assert str(w[0].message).endswith(
        "The loss is the mean over the whole dataset; if it never ends, cut it with "
        "dataset.take(num_batches) (or pass max_batches to make this an error)."
    )
    # Counted well within the minute: no warning.
    monkeypatch.undo()
    quick = Batches(generator_dataset(lambda: [(x, y)] * 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quick.num_examples == 12
    # A dataset of known cardinality is finite: no warning however long it takes.
    known = Batches(tf.data.Dataset.from_tensor_slices((x, y)).batch(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert known.num_examples == 4


# -- the reshuffle guard ------------------------------------------------------------------
def passes(batches, count=3):
    return [[b[1].numpy().tolist() for b, _ in batches] for _ in range(count)]


def test_deterministic_pipeline_passes_the_guard(rng):
    x, y = arrays(rng, n=12)
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(12, seed=3, reshuffle_each_iteration=False)
        .map(lambda a, b: (2.0 * a, b))
        .batch(4)
    )
    seen = passes(Batches(dataset))
    assert seen[0] == seen[1] == seen[2]
    assert sorted(label for batch in seen[0] for label in batch) == sorted(y.tolist())


def reshuffled_examples(dataset):
    return dataset.shuffle(12, seed=3, reshuffle_each_iteration=True).batch(4)


def reshuffled_batches(dataset):
    return dataset.batch(3).shuffle(4, seed=5, reshuffle_each_iteration=True)


def randomly_augmented(dataset):
    noise = tf.random.Generator.from_seed(7)  # its state advances from pass to pass
    return dataset.batch(4).map(lambda a, b: (a + noise.normal(tf.shape(a), dtype=a.dtype), b))


@pytest.mark.parametrize(
    "pipeline, message",
    [
        # Regression (issue 13): the guard compared only batch sizes, so reshuffling every
        # pass (same sizes 4, 4, 4, other examples in each batch) went unnoticed.
        (
            reshuffled_examples,
            r"batch 0 has the same size \(4\) but different contents.*"
            r"reshuffle_each_iteration=False",
        ),
        (reshuffled_batches, r"same size \(3\) but different contents"),
        (randomly_augmented, r"batch 0 has the same size \(4\) but different contents"),
    ],
    ids=["reshuffled-examples", "reshuffled-batches", "random-augmentation"],
)
def test_pipelines_that_change_between_passes_are_detected(pipeline, message, rng):
    x, y = arrays(rng, n=12)
    batches = Batches(pipeline(tf.data.Dataset.from_tensor_slices((x, y))))
    assert batches.num_examples == 12  # the first pass records sizes and fingerprints
    with pytest.raises(ValueError, match=message):
        list(batches)


def test_augmentation_that_replays_its_seed_is_deterministic(rng):
    # Stateless noise with a fixed seed: the same augmentation on every pass.
    x, y = arrays(rng, n=8)
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(4)
        .map(lambda a, b: (a + tf.random.stateless_normal(tf.shape(a), [1, 2], dtype=a.dtype), b))
    )
    batches = Batches(dataset)
    firsts = [[b[0].numpy() for b, _ in batches] for _ in range(2)]
    np.testing.assert_array_equal(firsts[0][0], firsts[1][0])
    assert not np.allclose(firsts[0][0], x[:4])


def test_changed_batch_sizes_and_counts_are_detected(rng):
    x, y = arrays(rng, n=8)
    plans = iter([[4, 4], [2, 6], [4, 4, 1], [4]])

    def batches_per_pass():
        sizes = next(plans)
        start = 0
        for size in sizes:
            yield x[start : start + size], y[start : start + size]
            start = (start + size) % 8

    batches = Batches(generator_dataset(batches_per_pass))
    assert batches.num_examples == 8
    with pytest.raises(ValueError, match=r"batch 0 has 2 examples, on the first pass 4"):
        list(batches)
    with pytest.raises(ValueError, match=r"more than the 2 batches of the first pass"):
        list(batches)
    with pytest.raises(ValueError, match=r"1 batches, on the first pass 2"):
        list(batches)


def test_reshuffled_dataset_is_refused_by_the_operator(rng):
    x, y = arrays(rng, n=12)
    model = small_mlp()
    reshuffled = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(12, seed=3, reshuffle_each_iteration=True)
        .batch(4)
    )
    # Cached: the pass that fills the cache is compared with the counting pass.
    op = HessianOperator.from_keras(model, SCE, reshuffled)
    with pytest.raises(ValueError, match="different contents") as info:
        op.matvec(np.ones(op.shape[0]))
    assert "The Hessian operator needs the same batches on every pass" in str(info.value)
    # The message names the reader of the data (before: "The Hessian" for all of them).
    with pytest.raises(ValueError, match="The Jacobian operator needs the same batches"):
        jacobian = spectra.JacobianOperator.from_keras(model, reshuffled)
        jacobian.matvec(np.ones(jacobian.shape[1]))
    with pytest.raises(ValueError, match="EKFACOperator .* needs the same batches"):
        spectra.EKFACOperator.from_keras(model, SCE, reshuffled)
    with pytest.raises(ValueError, match="^the dataset yielded .*\\. spectra needs the same"):
        batches = Batches(reshuffled)
        for _ in range(3):
            list(batches)
    # A deterministic pipeline streams the same operator on every pass.
    fixed = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(12, seed=3, reshuffle_each_iteration=False)
        .batch(4)
    )
    streaming = HessianOperator.from_keras(model, SCE, fixed, cache=False)
    reference = HessianOperator.from_keras(model, SCE, (x, y))
    V = rng.standard_normal((streaming.shape[0], 3))
    first = streaming.matmat(V)
    np.testing.assert_allclose(streaming.matmat(V), first, rtol=0, atol=0)
    np.testing.assert_allclose(first, reference.matmat(V), rtol=1e-12)


def test_fingerprint_tells_apart_many_strings():
    # Strings are hashed into 2**62 buckets first: distinct words, distinct fingerprints.
    words = [f"word-{i}" for i in range(300)]
    assert len({spectra.operators.batching._fingerprint(tf.constant([w])) for w in words}) == len(
        words
    )


def test_fingerprint_reads_contents_of_every_dtype():
    fingerprint = spectra.operators.batching._fingerprint
    a = (tf.constant([[1.0, 2.0]]), tf.constant(["cat"]), tf.constant([True]))
    same = (tf.constant([[1.0, 2.0]]), tf.constant(["cat"]), tf.constant([True]))
    assert fingerprint(a) == fingerprint(same)
    for changed in [
        (tf.constant([[1.0, 2.5]]), a[1], a[2]),
        (a[0], tf.constant(["dog"]), a[2]),
        (a[0], a[1], tf.constant([False])),
        (tf.constant([[1, 2]], tf.float64), a[1], a[2]),  # same values, other dtype
        (tf.constant([[1.0], [2.0]]), a[1], a[2]),  # same bytes, other shape
    ]:
        assert fingerprint(changed) != fingerprint(a)


# -- value checks during the counting pass --------------------------------------------------
def test_value_checks_ride_on_the_counting_pass(rng):
    x, y = arrays(rng, n=10)
    produced = []
    dataset = generator_dataset(lambda: [(x[:4], y[:4]), (x[4:], y[4:])], produced)
    batches = Batches(dataset)
    seen = []
    batches.check_values(lambda batch, where: seen.append((len(batch[1]), where)))
    assert seen == [] and produced == []  # nothing read yet
    assert batches.num_examples == 10
    assert seen == [(4, "batch 0 of the dataset"), (6, "batch 1 of the dataset")]
    assert produced == [4, 6]  # one pass for counting and checking
    list(batches)
    assert len(seen) == 2  # checks run once, not on every pass
    # After the count, a new check needs (and makes) a pass of its own.
    late = []
    batches.check_values(lambda batch, where: late.append(where))
    assert late == ["batch 0 of the dataset", "batch 1 of the dataset"]
    # Arrays are checked at once, as one batch of everything.
    whole = []
    Batches((x, y), 3).check_values(lambda batch, where: whole.append((len(batch[1]), where)))
    assert whole == [(10, None)]


def test_a_failing_check_stops_the_counting_pass(rng):
    x, y = arrays(rng, n=8)
    batches = Batches(tf.data.Dataset.from_tensor_slices((x, y)).batch(4))

    def refuse_second(batch, where):
        if where.endswith("1 of the dataset"):
            raise ValueError(f"bad labels in {where}")

    batches.check_values(refuse_second)
    with pytest.raises(ValueError, match="bad labels in batch 1 of the dataset"):
        _ = batches.num_examples


# -- sample weights inside a tf.data pipeline ----------------------------------------------
def test_sample_weights_in_a_dataset_match_the_dense_hessian(rng):
    # Keras' meaning of sample weights: the batch loss is Σ_i w_i l_i / n_b (the
    # sum_over_batch_size reduction), and the dataset loss Σ_b (n_b/N) · that.
    model = small_mlp()
    n, batch_size = 11, 4
    x, y = arrays(rng, n=n)
    w = rng.uniform(0.1, 3.0, n)
    dataset = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(batch_size)
    op = HessianOperator.from_keras(model, SCE, dataset)

    variables = model.trainable_variables
    terms = []
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)

        def batch_loss(start=start, stop=stop):
            logits = model(x[start:stop])
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(y[start:stop], logits)
            return tf.reduce_sum(w[start:stop] * per_example) / (stop - start)

        terms.append((batch_loss, (stop - start) / n))
    H = dense_hessian(batch_weighted(terms), variables)
    V = rng.standard_normal((op.shape[0], 5))
    assert relative_error(op.matmat(V), H @ V) < 1e-9
    assert op.num_examples == n
    # The same data as arrays gives the same operator, and the weights matter.
    as_arrays = HessianOperator.from_keras(model, SCE, (x, y, w), batch_size=batch_size)
    assert relative_error(as_arrays.matmat(V), H @ V) < 1e-9
    unweighted = HessianOperator.from_keras(model, SCE, (x, y), batch_size=batch_size)
    assert relative_error(unweighted.matmat(V), H @ V) > 1e-2


# -- dataset functions and sharding across workers --------------------------------------
def test_dataset_function_matches_the_dense_hessian(rng):
    # data=lambda input_context: dataset, the convention of
    # strategy.distribute_datasets_from_function; without a strategy, one pipeline.
    model = small_mlp()
    x, y = arrays(rng, n=11)
    contexts = []

    def data(context):
        contexts.append(
            (context.num_input_pipelines, context.input_pipeline_id, context.num_replicas_in_sync)
        )
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(4)

    op = HessianOperator.from_keras(model, SCE, data)
    assert contexts == [(1, 0, 1)]  # called once, at construction

    def loss():
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    H = dense_hessian(loss, model.trainable_variables)
    V = rng.standard_normal((op.shape[0], 4))
    assert relative_error(op.matmat(V), H @ V) < 1e-10
    assert op.num_examples == 11
    # The counting pass and the pass that fills the cache read the data; products do not.
    op.matmat(V)
    assert op.num_examples_read == 2 * 11
    assert op.num_bytes_read == 2 * (x.nbytes + y.nbytes)


def test_array_batches_count_what_they_slice(rng):
    x, y = arrays(rng, n=11)
    batches = Batches((x, y), 4)
    assert batches.examples_read == 0 and batches.bytes_read == 0
    list(batches)
    assert batches.examples_read == 11 and batches.bytes_read == x.nbytes + y.nbytes


def test_dataset_function_errors(rng):
    x, y = arrays(rng)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    with pytest.raises(TypeError, match=r"data is a function.*data\(input_context\).*cannot be"):
        Batches(lambda: dataset)
    with pytest.raises(TypeError, match=r"must return a tf.data.Dataset.*returned a tuple"):
        Batches(lambda context: (x, y))
    with pytest.raises(ValueError, match=r"batch_size cannot be used .* dataset function"):
        Batches(lambda context: dataset, 4)
    with pytest.raises(ValueError, match=r"infinite tf.data.Dataset"):
        Batches(lambda context: dataset.repeat())


def test_components_of_unknown_rank_are_refused(rng):
    x, y = arrays(rng)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    unknown = dataset.map(lambda a, b: (a, tf.py_function(lambda t: t, [b], tf.int32)))
    with pytest.raises(ValueError, match=r"known rank.*tf.ensure_shape"):
        Batches(unknown)
    known = unknown.map(lambda a, b: (a, tf.ensure_shape(b, [None])))
    assert Batches(known).num_examples == 12


def test_dataset_elements_without_one_batch_dimension_are_refused(rng):
    # A scalar component is refused from the element spec, before any batch is read (so
    # counting never meets a component without a leading dimension); components of
    # different batch sizes are refused when the batch is read, naming both sizes.
    x, y = arrays(rng)
    scalar = tf.data.Dataset.from_tensor_slices((x, y.astype("float64")))
    with pytest.raises(ValueError) as raised:
        Batches(scalar)
    assert str(raised.value) == (
        "dataset elements must be batches (a leading example dimension); got scalar "
        "components. Batch the dataset, e.g. dataset.batch(256)."
    )
    with pytest.raises(ValueError) as raised:
        Batches(lambda context: scalar)
    assert "got scalar components" in str(raised.value)
    uneven = generator_dataset(lambda: [(x[:3], y[:4])])
    with pytest.raises(ValueError) as raised:
        Batches(uneven).synchronize()
    assert str(raised.value) == (
        "all components of a dataset element must have the same batch size; got [3, 4]."
    )


class _Workers:
    """What sharding reads of a strategy: W workers, this one's index, R replicas."""

    def __init__(self, num_workers, worker):
        self.num_workers, self.worker, self.total = num_workers, worker, num_workers

    def input_context(self):
        return tf.distribute.InputContext(self.num_workers, self.worker, self.total)


def _records(directory, num_files, per_file):
    files = []
    for f in range(num_files):
        path = str(directory / f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(per_file):
                writer.write(tf.io.serialize_tensor(tf.constant(100 * f + i, tf.int64)).numpy())
        files.append(path)
    return files


def _read_ids(dataset):
    return [int(i) for batch in dataset for i in batch.numpy()]


def _parsed(files):
    return (
        tf.data.Dataset.from_tensor_slices(files)
        .interleave(tf.data.TFRecordDataset, cycle_length=1)
        .map(lambda r: tf.io.parse_tensor(r, tf.int64))
        .map(lambda t: tf.ensure_shape(t, []))
        .batch(3)
    )


def test_file_datasets_are_sharded_by_file(tmp_path):
    files = _records(tmp_path, num_files=4, per_file=2)
    shards = [
        _read_ids(spectra.operators.batching._shard_across_workers(_parsed(files), _Workers(2, w)))
        for w in range(2)
    ]
    # Worker w opens files w and w + 2 only, and batches what it reads.
    assert shards == [[0, 1, 200, 201], [100, 101, 300, 301]]


def test_other_datasets_are_sharded_by_batch():
    dataset = tf.data.Dataset.range(10).batch(3)
    shards = [
        _read_ids(spectra.operators.batching._shard_across_workers(dataset, _Workers(2, w)))
        for w in (0, 1)
    ]
    assert shards == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9]]
    # OFF would let every worker compute every batch (counted twice in the sum): by data.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    off = spectra.operators.batching._shard_across_workers(
        dataset.with_options(options), _Workers(2, 1)
    )
    assert _read_ids(off) == [3, 4, 5, 9]
    # FILE on a dataset that reads no files: refused, with what to do instead.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    with pytest.raises(ValueError, match=r"FILE but TensorFlow found no files.*dataset function"):
        spectra.operators.batching._shard_across_workers(
            dataset.with_options(options), _Workers(2, 0)
        )


def test_how_each_kind_of_data_is_split_across_workers(rng):
    x, y = arrays(rng)
    dataset = tf.data.Dataset.range(10).batch(3)
    second_of_two = _Workers(2, 1)
    assert [Batches(d).sharding for d in (None, (x, y), dataset)] == ["none"] * 3
    # Arrays are held whole by every worker.
    replicated = Batches((x, y), replicas=second_of_two)
    assert replicated.sharding == "replicated" and replicated.arrays[0].shape[0] == 12
    # A dataset is auto-sharded: worker 1 of 2 keeps every other batch.
    sharded = Batches(dataset, replicas=second_of_two)
    assert sharded.sharding == "auto-shard" and _read_ids(sharded.dataset) == [3, 4, 5, 9]
    assert _read_ids(Batches(dataset, replicas=_Workers(1, 0)).dataset) == list(range(10))
    # A dataset function returns this worker's shard, which is taken as it is.
    contexts = []
    function = Batches(lambda context: contexts.append(context) or dataset, replicas=second_of_two)
    assert function.sharding == "function" and _read_ids(function.dataset) == list(range(10))
    assert [(c.num_input_pipelines, c.input_pipeline_id) for c in contexts] == [(2, 1)]


def test_no_data_is_one_batch_of_weight_one():
    batches = Batches(None)
    assert list(batches) == [((), 1.0)]
    assert batches.num_examples == 1 and batches.num_batches == 1
    batches.synchronize()
    assert batches.num_examples == 1 and batches.num_batches == 1


def test_one_array_and_one_example(rng):
    x, y = arrays(rng)
    assert Batches(x).num_examples == 12  # a single array: its leading dimension
    one = Batches((x[:1], y[:1]))
    assert one.num_examples == 1 and [w for _, w in one] == [1.0]


def test_float_arrays_are_cast_and_labels_left_alone(rng):
    x, y = arrays(rng)
    batches = Batches((x, y), cast_floats_to="float32")
    assert [t.dtype for t in batches.arrays] == [tf.float32, tf.int32]
    np.testing.assert_array_equal(batches.arrays[0].numpy(), x.astype(np.float32))
    assert Batches((x, y)).arrays[0].dtype == tf.float64


@pytest.mark.parametrize(
    "data, batch_size, message",
    [
        (None, 4, "batch_size was given but there is no data to batch."),
        (
            "dataset",
            4,
            "batch_size cannot be used with a tf.data.Dataset or a dataset function: their "
            "elements are taken as batches as they are. Batch the dataset yourself, e.g. "
            "dataset.batch(batch_size).",
        ),
        ((), None, "data is empty: it holds no arrays."),
        (
            "scalar",
            None,
            "every array in data needs a leading example dimension; got a scalar.",
        ),
        (
            "uneven",
            None,
            "all arrays in data must have the same number of examples (leading dimension); "
            "got [3, 4].",
        ),
        ("empty", None, "data is empty: it has 0 examples."),
    ],
    ids=[
        "batch-size-without-data",
        "batch-size-with-dataset",
        "no-arrays",
        "scalar",
        "uneven",
        "no-examples",
    ],
)
def test_bad_data_is_refused_with_what_to_do(data, batch_size, message, rng):
    x, y = arrays(rng)
    data = (
        {
            "dataset": tf.data.Dataset.from_tensor_slices((x, y)).batch(4),
            "scalar": (x, np.float64(1.0)),
            "uneven": (x[:3], y[:4]),
            "empty": (x[:0], y[:0]),
        }.get(data, data)
        if isinstance(data, str)
        else data
    )
    with pytest.raises(ValueError) as raised:
        Batches(data, batch_size)
    assert str(raised.value) == message


# Batches and their weights n_b/N through the operator, against a NumPy float64 truth.
#
# The loss is the mean over all N examples, L = Σ_b (n_b/N) L_b, so the loss, the gradient
# and every product are sums over batches with these weights: one batch or many, arrays or
# a tf.data pipeline, cached or streamed, vectors multiplied in one block or several. The
# truth (tests/_relu_mlp.py) is computed by hand in NumPy on all N examples at once, so a
# wrong weight, a batch dropped or counted twice, or a block lost shows as an O(1) error.
# Small and fast: these tests also drive the mutation testing of spectra/operators/batching.py and
# spectra/operators/base.py (make mutate).

RTOL = 1e-11
NUM_EXAMPLES = 20
LOSS = keras.losses.SparseCategoricalCrossentropy(dtype="float64")


@pytest.fixture(scope="module")
def problem():
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="float64"),
            keras.layers.Dense(4, activation="relu", dtype="float64"),
            keras.layers.Dense(3, activation="softmax", dtype="float64"),
        ]
    )
    rng = np.random.default_rng(6)
    x = rng.standard_normal((NUM_EXAMPLES, 3))
    y = rng.integers(0, 3, NUM_EXAMPLES)
    truth = ReluMLP.from_keras(model, x, y)
    V = rng.standard_normal((truth.n, 5))
    return model, x, y, truth, truth.dense(), V


def _relative(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


def _dataset(x, y, sizes):
    starts = np.cumsum([0, *sizes])
    parts = [(x[a:b], y[a:b]) for a, b in itertools.pairwise(starts)]
    return tf.data.Dataset.from_generator(
        lambda: iter(parts),
        output_signature=(tf.TensorSpec([None, 3], tf.float64), tf.TensorSpec([None], tf.int64)),
    )


CASES = {
    "one batch": dict(batch_size=None),
    "arrays 7+7+6": dict(batch_size=7),
    "arrays 19+1": dict(batch_size=19),
    "dataset 7+7+6": dict(sizes=[7, 7, 6]),
    "dataset 1+12+7": dict(sizes=[1, 12, 7]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cache", [True, False], ids=["cached", "streamed"])
def test_loss_gradient_and_products_are_the_weighted_sums(problem, case, cache):
    model, x, y, truth, hessian, V = problem
    spec = CASES[case]
    data = _dataset(x, y, spec["sizes"]) if "sizes" in spec else (x, y)
    kwargs = {} if "sizes" in spec else {"batch_size": spec["batch_size"]}
    op = HessianOperator.from_keras(model, LOSS, data, cache=cache, max_block_size=2, **kwargs)
    assert op.num_examples == NUM_EXAMPLES
    assert op.loss() == pytest.approx(truth.loss(), rel=RTOL)
    gradient = op.gradient()
    assert _relative(gradient, truth.gradient()) < RTOL
    gradient[:] = 0.0  # a copy: the operator's gradient is unchanged
    assert _relative(op.gradient(), truth.gradient()) < RTOL
    assert op.num_data_passes == 1  # loss and gradient in one pass
    passes = op.num_data_passes
    # Five vectors in blocks of 2, 2 and 1: every block, every batch, each weight n_b/N.
    assert _relative(op.matmat(V), hessian @ V) < RTOL
    assert op.num_hvps == 5 and op.num_data_passes == passes + 1
    assert _relative(op.matvec(V[:, 0]), hessian @ V[:, 0]) < RTOL
    assert _relative(op @ V[:, 1:2], hessian @ V[:, 1:2]) < RTOL
    assert op.num_hvps == 7 and op.num_data_passes == passes + 3
    assert op.is_cached == cache
    assert op.matmat(np.zeros((truth.n, 0))).shape == (truth.n, 0)


def test_a_cache_over_budget_falls_back_to_streaming(problem):
    model, x, y, truth, hessian, V = problem
    op = HessianOperator.from_keras(model, LOSS, (x, y), batch_size=7, cache="auto", cache_bytes=1)
    assert op.loss() == pytest.approx(truth.loss(), rel=RTOL)
    assert not op.is_cached and op.cache_nbytes == 0
    assert _relative(op.matmat(V), hessian @ V) < RTOL
    roomy = HessianOperator.from_keras(model, LOSS, (x, y), batch_size=7, cache="auto")
    assert _relative(roomy.matmat(V), hessian @ V) < RTOL
    assert roomy.is_cached and roomy.cache_nbytes > 0
    roomy.reset_cache()
    assert not roomy.is_cached
    assert _relative(roomy.matmat(V), hessian @ V) < RTOL


def test_flatten_and_unflatten_are_inverse_and_checked(problem):
    model, x, y, truth, _, _ = problem
    op = HessianOperator.from_keras(model, LOSS, (x, y))
    shapes = [tuple(w.shape) for w in model.get_weights()]
    assert op.variable_shapes == shapes
    vector = np.arange(truth.n, dtype=np.float64)
    pieces = op.unflatten(vector)
    assert [p.shape for p in pieces] == shapes
    # Row-major, variable after variable: the pieces are consecutive slices.
    np.testing.assert_array_equal(np.concatenate([p.reshape(-1) for p in pieces]), vector)
    assert pieces[0][1, 0] == shapes[0][1] and pieces[1][0] == np.prod(shapes[0])
    flat = op.flatten(pieces)
    assert flat.dtype == op.dtype
    np.testing.assert_array_equal(flat, vector)
    np.testing.assert_array_equal(op.flatten(model.get_weights()), truth_flat(model))
    with pytest.raises(ValueError, match=f"expected {len(shapes)} arrays"):
        op.flatten(pieces[:-1])
    with pytest.raises(ValueError, match="array 1 has shape"):
        op.flatten([pieces[0], pieces[1][:-1], *pieces[2:]])
    with pytest.raises(ValueError, match=rf"expected a vector of shape \({truth.n},\)"):
        op.unflatten(vector[:-1])


def truth_flat(model) -> np.ndarray:
    return np.concatenate([w.reshape(-1) for w in model.get_weights()])


@pytest.mark.parametrize(
    "num_parameters, itemsize, budget, expected",
    [
        (1000, 8, 512 * 1024**2, 64),  # capped at 64
        (10**7, 4, 512 * 1024**2, 2),  # 512 MiB / (5 copies · 4e7 B) = 2.7 -> 2
        (100, 8, BLOCK_COPIES * 100 * 8 * 5, 4),  # 5 fit -> 4
        (100, 8, BLOCK_COPIES * 100 * 8 * 8, 8),  # exactly 8 fit
        (100, 8, BLOCK_COPIES * 100 * 8 * 8 - 1, 4),  # one byte short of 8
        (100, 8, 1, 1),  # nothing fits: still one vector
    ],
)
def test_block_size_is_the_largest_power_of_two_that_fits(
    num_parameters, itemsize, budget, expected
):
    assert block_size_for(num_parameters, itemsize, budget) == expected


@pytest.mark.parametrize("sizes", [[7, 7, 6], [1, 12, 7], [20]])
def test_batches_of_a_dataset_carry_their_weights(problem, sizes):
    _, x, y, _, _, _ = problem
    batches = Batches(_dataset(x, y, sizes))
    for _ in range(2):  # the counting pass, then a checked pass
        seen = [(int(batch[0].shape[0]), weight) for batch, weight in batches]
        assert [n for n, _ in seen] == sizes
        np.testing.assert_allclose([w for _, w in seen], np.array(sizes) / NUM_EXAMPLES)
    assert batches.num_examples == NUM_EXAMPLES and batches.num_batches == len(sizes)


@pytest.mark.parametrize(
    "batch_size, sizes", [(None, [20]), (7, [7, 7, 6]), (20, [20]), (30, [20])]
)
def test_batches_of_arrays_carry_their_weights(problem, batch_size, sizes):
    _, x, y, _, _, _ = problem
    batches = Batches((x, y), batch_size)
    seen = list(batches)
    assert [int(batch[0].shape[0]) for batch, _ in seen] == sizes
    np.testing.assert_allclose([w for _, w in seen], np.array(sizes) / NUM_EXAMPLES)
    # Consecutive slices in order: together the examples, each once.
    np.testing.assert_array_equal(np.concatenate([batch[0] for batch, _ in seen]), x)
    np.testing.assert_array_equal(np.concatenate([batch[1] for batch, _ in seen]), y)
    assert batches.num_examples == NUM_EXAMPLES and batches.num_batches == len(sizes)


def test_the_cache_budget_counts_every_batch(problem):
    model, x, y, truth, hessian, V = problem
    one = HessianOperator.from_keras(model, LOSS, (x[:7], y[:7]), cache="auto")
    one.loss()
    total = HessianOperator.from_keras(model, LOSS, (x, y), batch_size=7, cache="auto")
    total.loss()
    needed = total.cache_nbytes  # batches of 7, 7 and 6 examples
    assert total.is_cached and 2 * one.cache_nbytes < needed
    # A budget of exactly what the three caches hold keeps all three; one byte less keeps
    # two and streams the third, though each batch alone fits.
    for budget, kept in ((needed, 3), (needed - 1, 2)):
        op = HessianOperator.from_keras(
            model, LOSS, (x, y), batch_size=7, cache="auto", cache_bytes=budget
        )
        assert op.loss() == pytest.approx(truth.loss(), rel=RTOL)
        assert op.is_cached is (kept == 3)
        assert (op.num_cached_batches, op.num_streamed_batches) == (kept, 3 - kept)
        assert (op.cache_nbytes == needed) is (kept == 3) and op.cache_nbytes <= budget
        assert _relative(op.matmat(V), hessian @ V) < RTOL


def test_a_non_finite_batch_is_named_with_its_size(problem):
    model, x, y, _, _, _ = problem
    bad = x.copy()
    # In the third batch (6 examples): finite, but the first unit's pre-activation
    # max·Σ|w| overflows (NaN itself is refused with the operator, naming x[15, 0]).
    bad[15] = np.finfo(np.float64).max * np.sign(model.layers[0].kernel.numpy()[:, 0])
    op = HessianOperator.from_keras(model, LOSS, (bad, y), batch_size=7)
    with pytest.raises(ValueError, match=r"^batch 2 \(6 examples\) gives a non-finite loss"):
        op.loss()


def test_passes_accumulate_and_the_mode_is_shown(problem):
    model, x, y, truth, _, _ = problem
    op = HessianOperator.from_keras(model, LOSS, (x, y), batch_size=7, cache=False)
    assert "not yet evaluated; 0 products, 0 data passes" in repr(op)
    assert op.loss() == pytest.approx(truth.loss(), rel=RTOL)
    assert "streaming; 0 products, 1 data passes" in repr(op)
    op.reset_cache()
    assert "not yet evaluated" in repr(op)
    op.gradient()
    assert op.num_data_passes == 2 and "streaming" in repr(op)


def test_a_float32_operator_computes_in_float32_whatever_the_input(problem):
    _, x, y, _, _, _ = problem
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    op = HessianOperator.from_keras(model, loss, (x.astype(np.float32), y), batch_size=7)
    assert op.dtype == np.float32
    V = np.random.default_rng(8).standard_normal((op.shape[0], 3))
    product = op.matmat(V)
    assert product.dtype == np.float32
    np.testing.assert_array_equal(product, op.matmat(V.astype(np.float32)))
    empty = op.matmat(np.zeros((op.shape[0], 0)))
    assert empty.shape == (op.shape[0], 0) and empty.dtype == np.float32
    # Beyond float32: refused, not returned as inf or NaN.
    huge = np.ones(op.shape[0])
    huge[4] = 1e39  # finite in float64, infinite in float32
    with pytest.raises(ValueError, match=r"entries up to 1e\+39, beyond the largest float32"):
        op.matvec(huge)
    with pytest.raises(ValueError) as overflow:  # fits float32, but the product overflows
        op.matvec(np.full(op.shape[0], 3e38))
    assert re.fullmatch(
        r"the Hessian product is not finite \(\d+ NaN/Inf entries, from batch \d[^)]*\) "
        r"although the weights, the batch losses and gradients are finite: the product "
        r"overflows float32 for this vector\. Scale the vector down \(products are linear\) "
        r"or build the operator with dtype=np\.float64\.",
        str(overflow.value),
    ), str(overflow.value)


def test_graph_errors_name_their_root_cause_first(rng):
    # Indices out of range inside the loss: no check before the graph can see them.
    table = tf.Variable(rng.standard_normal(6))
    indices = rng.integers(0, 6, (10, 3)).astype("int32")
    indices[7, 1] = 10

    def loss_fn(batch):
        return tf.reduce_mean(tf.gather(table, batch[0]) ** 3)

    op = HessianOperator(loss_fn, [table], (indices,), batch_size=5)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        op.loss()
    first_line = str(info.value).splitlines()[0]
    assert first_line == "batch 1: indices[2,1] = 10 is not in [0, 6)", first_line
    assert "Graph execution error" not in first_line
    assert isinstance(info.value.__cause__, tf.errors.InvalidArgumentError)
    streaming = HessianOperator(loss_fn, [table], (indices,), batch_size=5, cache=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"^batch 1: indices"):
        streaming.matvec(np.ones(6))
