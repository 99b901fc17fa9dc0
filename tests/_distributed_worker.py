"""Runs one process of the distributed tests (started by tests/test_distributed.py).

    python _distributed_worker.py mirrored OUT.json
        2 logical CPU devices, MirroredStrategy vs one device, same model and data.
    python _distributed_worker.py worker OUT.json    (with TF_CONFIG set)
        one worker of a MultiWorkerMirroredStrategy cluster.
    python _distributed_worker.py single OUT.json
        the same computation as a worker, in one process without a strategy.

Each writes a JSON file with the numbers the test compares.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

MODE, OUT = sys.argv[1], sys.argv[2]

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


def build_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((6,), dtype="float64"),
            keras.layers.Dense(7, activation="tanh", dtype="float64"),
            keras.layers.Dense(4, dtype="float64"),
        ]
    )


def make_data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((51, 6))
    y = rng.integers(0, 4, 51)
    return x, y


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def estimates(op) -> dict:
    vectors = np.random.default_rng(1).standard_normal((op.shape[0], 3))
    top = spectra.eigenvalues(op, k=2, tol=1e-10, seed=4, progress=False)
    tr = spectra.trace(op, method="hutchinson", num_products=30, seed=5, progress=False)
    return {
        "products": op.matmat(vectors).tolist(),
        "loss": op.loss(),
        "gradient": op.gradient().tolist(),
        "eigenvalues": top.eigenvalues.tolist(),
        "trace": tr.estimate,
        "trace_stderr": tr.stderr,
    }


def main() -> None:
    x, y = make_data()
    result: dict = {}
    if MODE == "mirrored":
        with STRATEGY.scope():
            model = build_model()
            # Built inside the scope: Keras loss objects would divide by 2 replicas here.
            inside = spectra.HessianOperator.from_keras(model, LOSS, (x, y), batch_size=8)
        result["distributed"] = estimates(inside)
        result["replicas"] = inside._replicas.total
        plain = build_model()
        plain.set_weights(model.get_weights())
        single = spectra.HessianOperator.from_keras(plain, LOSS, (x, y), batch_size=8)
        result["single"] = estimates(single)
        result["single_replicas"] = single._replicas.total
    elif MODE == "worker":
        with STRATEGY.scope():
            model = build_model()
        op = spectra.HessianOperator.from_keras(model, LOSS, (x, y), batch_size=8)
        result = estimates(op)
        result["replicas"] = op._replicas.total
        result["task_id"] = STRATEGY.cluster_resolver.task_id
    else:
        op = spectra.HessianOperator.from_keras(build_model(), LOSS, (x, y), batch_size=8)
        result = estimates(op)
    with open(OUT, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
