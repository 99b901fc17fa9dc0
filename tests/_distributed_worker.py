"""Runs one process of the distributed tests (started by tests/operators/test_distributed.py).

    python _distributed_worker.py mirrored OUT.json
        2 logical CPU devices: MirroredStrategy against one device, with arrays and with a
        dataset function, concurrent and one-after-another replicas.
    python _distributed_worker.py worker OUT.json RECORDS_DIR    (with TF_CONFIG set)
        one worker of a 2-worker MultiWorkerMirroredStrategy cluster; several checks on
        one cluster start: arrays, dataset functions (halves, one batch more, an empty
        shard, a bad label on one worker), TFRecord files sharded by file, a dataset of
        tensors sharded by data, Dropout in training mode with batches dealt round-robin.
    python _distributed_worker.py single OUT.json
        the reference: the same model and examples in one process without a strategy
        (also ``single_checks()`` of the module imported, as the tests do).

Each writes a JSON file with the numbers the test compares. Every check reads the same 51
examples; products are of a fixed block of 3 vectors, in float64.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

# Imported (not run) only for the single-process reference: no strategy.
MODE = sys.argv[1] if __name__ == "__main__" else "single"

if MODE == "mirrored":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )
    STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
elif MODE == "worker":
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING
        )
    )
else:
    STRATEGY = None

import keras  # noqa: E402

import spectra  # noqa: E402

NUM_EXAMPLES, FEATURES, CLASSES, BATCH = 51, 6, 4, 8
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SIGNATURE = (
    tf.TensorSpec([None, FEATURES], tf.float64),
    tf.TensorSpec([None], tf.int64),
)


def build_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((FEATURES,), dtype="float64"),
            keras.layers.Dense(7, activation="tanh", dtype="float64"),
            keras.layers.Dense(CLASSES, dtype="float64"),
        ]
    )


def build_dropout_model() -> keras.Model:
    """With Dropout: in training mode each batch's products depend on its random draws."""
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((FEATURES,), dtype="float64"),
            keras.layers.Dense(7, activation="tanh", dtype="float64"),
            keras.layers.Dropout(0.4, dtype="float64"),
            keras.layers.Dense(CLASSES, dtype="float64"),
        ]
    )


def dropout_products(model, data) -> dict:
    """Products in training mode (seeded Dropout masks per batch)."""
    kwargs = {"batch_size": BATCH} if isinstance(data, tuple) else {}
    op = spectra.HessianOperator.from_keras(model, LOSS, data, training=True, seed=7, **kwargs)
    return products(op)


def make_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((NUM_EXAMPLES, FEATURES)), rng.integers(0, CLASSES, NUM_EXAMPLES)


X, Y = make_data()


def vectors(n: int) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((n, 3))


def products(op) -> dict:
    return {
        "products": op.matmat(vectors(op.shape[0])).tolist(),
        "loss": op.loss(),
        "gradient": op.gradient().tolist(),
        "num_examples": op.num_examples,
    }


def estimates(op) -> dict:
    top = spectra.eigenvalues(op, k=2, tol=1e-10, seed=4, progress=False)
    tr = spectra.trace(op, method="hutchinson", num_products=30, seed=5, progress=False)
    return {
        **products(op),
        "eigenvalues": top.eigenvalues.tolist(),
        "trace": tr.estimate,
        "trace_stderr": tr.stderr,
    }


def batches_of(ids: np.ndarray) -> list[np.ndarray]:
    return [ids[i : i + BATCH] for i in range(0, len(ids), BATCH)]


def dataset_function(plan, read: list[int], contexts: list[list[int]], features=X, labels=Y):
    """A dataset function whose pipeline ``p`` yields the batches ``plan(p, W)`` (lists of
    example ids) and records every id it yields in ``read``."""

    def data(context: tf.distribute.InputContext) -> tf.data.Dataset:
        contexts.append(
            [
                context.num_input_pipelines,
                context.input_pipeline_id,
                context.num_replicas_in_sync,
            ]
        )
        mine = plan(context.input_pipeline_id, context.num_input_pipelines)

        def generate():
            for ids in mine:
                read.extend(int(i) for i in ids)
                yield features[ids], labels[ids]

        return tf.data.Dataset.from_generator(generate, output_signature=SIGNATURE)

    return data


def halves(p: int, workers: int) -> list[np.ndarray]:
    """Contiguous parts of the examples, batched per worker (26 and 25 examples)."""
    return batches_of(np.array_split(np.arange(NUM_EXAMPLES), workers)[p])


def every_other_batch(p: int, workers: int) -> list[np.ndarray]:
    """The 7 batches of 8 dealt round-robin: 4 batches to worker 0, 3 to worker 1."""
    return batches_of(np.arange(NUM_EXAMPLES))[p::workers]


def all_on_first(p: int, workers: int) -> list[np.ndarray]:
    """Worker 0 reads everything, worker 1 nothing."""
    return batches_of(np.arange(NUM_EXAMPLES)) if p == 0 else []


def sharded_check(model, plan, features=X, labels=Y) -> dict:
    read: list[int] = []
    contexts: list[list[int]] = []
    op = spectra.HessianOperator.from_keras(
        model, LOSS, dataset_function(plan, read, contexts, features, labels)
    )
    result = products(op)
    result.update(read=read, contexts=contexts, examples_read=op.num_examples_read)
    result["passes"] = op.num_data_passes
    return result


def tfrecord_dataset(directory: Path, read: list[int]) -> tf.data.Dataset:
    files = sorted(str(p) for p in directory.glob("*.tfrecord"))
    features = {
        "x": tf.io.FixedLenFeature([], tf.string),
        "y": tf.io.FixedLenFeature([], tf.int64),
        "id": tf.io.FixedLenFeature([], tf.int64),
    }

    def note(example_id: tf.Tensor) -> tf.Tensor:
        read.append(int(example_id))
        return example_id

    def parse(record: tf.Tensor):
        example = tf.io.parse_single_example(record, features)
        noted = tf.ensure_shape(tf.py_function(note, [example["id"]], tf.int64), [])
        x = tf.reshape(tf.io.decode_raw(example["x"], tf.float64), [FEATURES])
        return x, example["y"] + 0 * noted

    return (
        tf.data.Dataset.from_tensor_slices(files)
        .interleave(tf.data.TFRecordDataset, cycle_length=1)
        .map(parse)
        .batch(BATCH)
    )


def cluster_checks(records: Path) -> dict:
    with STRATEGY.scope():
        model = build_model()
    op = spectra.HessianOperator.from_keras(model, LOSS, (X, Y), batch_size=BATCH)
    result: dict = {"arrays": estimates(op)}
    result["replicas"] = op._replicas.total
    result["task_id"] = STRATEGY.cluster_resolver.task_id
    result["halves"] = sharded_check(model, halves)
    result["every_other_batch"] = sharded_check(model, every_other_batch)
    result["empty_shard"] = sharded_check(model, all_on_first)
    read: list[int] = []
    op = spectra.HessianOperator.from_keras(model, LOSS, tfrecord_dataset(records, read))
    result["tfrecord"] = {**products(op), "read": read, "examples_read": op.num_examples_read}
    result["tfrecord"]["passes"] = op.num_data_passes
    tensors = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    op = spectra.HessianOperator.from_keras(model, LOSS, tensors)
    result["data_sharded"] = {**products(op), "examples_read": op.num_examples_read}
    # Batches dealt round-robin: each worker's batch i is global batch 2i + w, and draws
    # the Dropout masks of that batch in one process.
    with STRATEGY.scope():
        dropout = build_dropout_model()
    result["dropout"] = dropout_products(dropout, dataset_function(every_other_batch, [], []))
    # A bad label or a NaN input in worker 1's shard fails its counting pass (which checks
    # the values): either way both workers must stop, neither wait.
    bad_labels, bad_features = Y.copy(), X.copy()
    bad_labels[30], bad_features[40, 0] = 99, np.nan
    for name, data in [
        ("labels", {"labels": bad_labels}),
        ("features", {"features": bad_features}),
    ]:
        try:
            sharded_check(model, halves, **data)
            result[f"bad_{name}"] = "no error"
        except Exception as err:  # the test checks which error each worker raised
            result[f"bad_{name}"] = f"{type(err).__name__}: {err}"
    return result


def mirrored_checks() -> dict:
    with STRATEGY.scope():
        model = build_model()
        # Built inside the scope: Keras loss objects would divide by 2 replicas here.
        inside = spectra.HessianOperator.from_keras(model, LOSS, (X, Y), batch_size=BATCH)
    result: dict = {"distributed": estimates(inside), "replicas": inside._replicas.total}
    plain = build_model()
    plain.set_weights(model.get_weights())
    single = spectra.HessianOperator.from_keras(plain, LOSS, (X, Y), batch_size=BATCH)
    result["single"] = estimates(single)
    result["single_replicas"] = single._replicas.total
    result["function"] = sharded_check(model, every_other_batch)
    # The same products with the replicas issued one after another (no threads), from
    # the cache and streaming: the per-replica sums add in the same order either way.
    for cache in (True, False):
        one_by_one = {}
        for concurrent in (True, False):
            op = spectra.HessianOperator.from_keras(
                model, LOSS, (X, Y), batch_size=BATCH, cache=cache
            )
            op._replicas.concurrent = concurrent
            one_by_one[str(concurrent)] = products(op)
        result[f"concurrent_cache_{cache}"] = one_by_one
    return result


def single_checks() -> dict:
    op = spectra.HessianOperator.from_keras(build_model(), LOSS, (X, Y), batch_size=BATCH)
    result = estimates(op)
    result["dropout"] = dropout_products(build_dropout_model(), (X, Y))
    return result


def main() -> None:
    if MODE == "mirrored":
        result = mirrored_checks()
    elif MODE == "worker":
        result = cluster_checks(Path(sys.argv[3]))
    else:
        result = single_checks()
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
