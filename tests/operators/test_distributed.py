"""Products under tf.distribute give the single-device numbers, and each worker reads only
its part of the data.

Each configuration runs in fresh processes (logical devices and cluster settings must be
fixed before TensorFlow starts): MirroredStrategy over 2 logical CPU devices, and one
start of a 2-worker MultiWorkerMirroredStrategy cluster on localhost that runs every
multi-worker check (see tests/_distributed_worker.py), against one single-process
reference (computed in the test process). Tolerances: float64 throughout; the distributed
sums add the same terms in another order, so products agree to about 1e-15 relative
(asserted: 1e-12).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from _localhost_cluster import finish, run_workers

WORKER = Path(__file__).resolve().parents[1] / "_distributed_worker.py"
TIMEOUT = 300
NUM_EXAMPLES, FEATURES, BATCH = 51, 6, 8  # as in _distributed_worker.py
RECORD_FILES = 4


def _run(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _assert_products(a: dict, b: dict) -> None:
    """Products, gradient and loss equal to 1e-12 (relative to the largest entry)."""
    for key in ("products", "gradient"):
        x, y = np.asarray(a[key]), np.asarray(b[key])
        assert x.shape == y.shape, key
        assert np.max(np.abs(x - y)) <= 1e-12 * np.max(np.abs(y)), key
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-12)
    assert a["num_examples"] == b["num_examples"] == NUM_EXAMPLES


def _assert_estimates(a: dict, b: dict) -> None:
    _assert_products(a, b)
    np.testing.assert_allclose(a["eigenvalues"], b["eigenvalues"], rtol=1e-11)
    assert a["trace"] == pytest.approx(b["trace"], rel=1e-11)
    assert a["trace_stderr"] == pytest.approx(b["trace_stderr"], rel=1e-9)


def _write_records(directory: Path) -> list[list[int]]:
    """The 51 examples in 4 TFRecord files (13, 13, 13, 12); returns the ids per file."""
    import tensorflow as tf

    rng = np.random.default_rng(0)  # the examples of _distributed_worker.make_data
    x = rng.standard_normal((NUM_EXAMPLES, FEATURES))
    y = rng.integers(0, 4, NUM_EXAMPLES)
    parts = np.array_split(np.arange(NUM_EXAMPLES), RECORD_FILES)
    for f, ids in enumerate(parts):
        with tf.io.TFRecordWriter(str(directory / f"part-{f}.tfrecord")) as writer:
            for i in ids:
                feature = {
                    "x": tf.train.Feature(bytes_list=tf.train.BytesList(value=[x[i].tobytes()])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y[i])])),
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(i)])),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())
    return [ids.tolist() for ids in parts]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One start of a 2-worker cluster running every check, and the reference (computed
    here, without a strategy, while the workers run; through JSON as theirs)."""
    import _distributed_worker

    tmp = tmp_path_factory.mktemp("cluster")
    records = tmp / "records"
    records.mkdir()
    files = _write_records(records)
    outs = [tmp / f"worker{task}.json" for task in range(2)]
    single: dict = {}

    def reference() -> None:
        single.update(json.loads(json.dumps(_distributed_worker.single_checks())))

    run_workers(
        lambda task, env: _run(["worker", str(outs[task]), str(records)], env),
        2,
        TIMEOUT,
        alongside=reference,
    )
    workers = [json.loads(out.read_text()) for out in outs]
    return {"workers": workers, "single": single, "files": files}


def _reads(ids: list[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    return counts


def _assert_read_only(result: dict, expected: list[int], passes: int) -> None:
    """The pipeline yielded exactly the ``expected`` examples, each once per pass."""
    assert _reads(result["read"]) == {i: passes for i in expected}
    assert result["examples_read"] == passes * len(expected)


@pytest.mark.slow
def test_mirrored_strategy_on_two_logical_devices(tmp_path: Path) -> None:
    out = tmp_path / "mirrored.json"
    finish(_run(["mirrored", str(out)]), TIMEOUT)
    result = json.loads(out.read_text())
    assert result["replicas"] == 2 and result["single_replicas"] == 1
    _assert_estimates(result["distributed"], result["single"])
    # A dataset function on one machine: one input pipeline feeding both replicas.
    function = result["function"]
    assert function["contexts"] == [[1, 0, 2]]
    _assert_products(function, result["single"])
    _assert_read_only(function, list(range(NUM_EXAMPLES)), passes=2)  # count + cache fill
    # Replicas on their own threads add the same terms in the same order as one by one.
    for cache in (True, False):
        runs = result[f"concurrent_cache_{cache}"]
        assert runs["True"] == runs["False"]
        _assert_products(runs["True"], result["single"])


@pytest.mark.slow
@pytest.mark.long
def test_cluster_with_arrays(cluster: dict) -> None:
    for task, result in enumerate(cluster["workers"]):
        assert result["replicas"] == 2 and result["task_id"] == task
        _assert_estimates(result["arrays"], cluster["single"])


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(
    "check, shards",
    [
        ("halves", [range(0, 26), range(26, 51)]),
        # 7 batches of 8 dealt round-robin: one worker has one batch more.
        (
            "every_other_batch",
            [
                [*range(0, 8), *range(16, 24), *range(32, 40), *range(48, 51)],
                [*range(8, 16), *range(24, 32), *range(40, 48)],
            ],
        ),
        ("empty_shard", [range(0, 51), []]),
    ],
)
def test_cluster_with_a_dataset_function(cluster: dict, check: str, shards: list) -> None:
    for task, result in enumerate(cluster["workers"]):
        part = result[check]
        assert part["contexts"] == [[2, task, 2]]  # called once, with this worker's pipeline
        _assert_read_only(part, list(shards[task]), passes=2)  # count + cache fill
        _assert_products(part, cluster["single"])


@pytest.mark.slow
@pytest.mark.long
def test_cluster_shards_tfrecord_files(cluster: dict) -> None:
    files = cluster["files"]
    for task, result in enumerate(cluster["workers"]):
        part = result["tfrecord"]
        mine = [i for f in range(task, len(files), 2) for i in files[f]]  # files task, task+2
        _assert_read_only(part, mine, passes=2)
        _assert_products(part, cluster["single"])


@pytest.mark.slow
@pytest.mark.long
def test_cluster_shards_other_datasets_by_data(cluster: dict) -> None:
    # No files to shard by: every worker runs the whole pipeline and keeps every other
    # batch (7 batches of 8: 27 examples on worker 0, 24 on worker 1; 2 passes each).
    for result, kept in zip(cluster["workers"], (27, 24)):
        assert result["data_sharded"]["examples_read"] == 2 * kept
        _assert_products(result["data_sharded"], cluster["single"])


@pytest.mark.slow
@pytest.mark.long
def test_cluster_draws_what_one_process_draws(cluster: dict) -> None:
    # Training mode with Dropout: worker w's batch i seeds its masks as global batch
    # 2i + w, which it is when the batches are dealt round-robin. Reusing the local index
    # would give both workers' first batches the same masks, and other products.
    reference = cluster["single"]["dropout"]
    for result in cluster["workers"]:
        _assert_products(result["dropout"], reference)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(
    "check, during, error",
    [
        (
            "bad_labels",
            "the counting pass over the data",
            r"ValueError: .*y\[4\] = 99 in batch 0 of worker 1's shard of the dataset",
        ),
        (
            "bad_features",
            "the counting pass over the data",
            r"ValueError: x holds 1 NaN or infinite values in batch \d+ of worker 1's shard",
        ),
    ],
)
def test_cluster_stops_together_when_one_worker_fails(
    cluster: dict, check: str, during: str, error: str
) -> None:
    first, second = (result[check] for result in cluster["workers"])
    expected = f"WorkerFailed: worker(s) [1] of the cluster failed during {during}; "
    assert first.startswith(expected), first
    assert re.match(error, second, flags=re.DOTALL), second


# -- local replicas on their own threads (in-process, two stand-in devices) -----------------
def _two_replicas(concurrent: bool = True):
    from spectra.operators.replicas import Replicas

    replicas = Replicas(None)
    replicas.devices = [None, None]  # two local replicas on the default device
    replicas.concurrent = concurrent
    return replicas


def test_replicas_run_side_by_side_each_in_order() -> None:
    barrier = threading.Barrier(2, timeout=30)
    done: dict[int, list[int]] = {0: [], 1: []}

    def task(replica: int, step: int) -> None:
        if step == 0:
            barrier.wait()  # both replicas' first tasks must be running at the same time
        done[replica].append(step)

    tasks = ((i % 2, functools.partial(task, i % 2, i // 2)) for i in range(10))
    _two_replicas().run(tasks)
    assert done == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4]}
    # One after another, the first task waits for a partner that never comes.
    barrier = threading.Barrier(2, timeout=0.2)
    with pytest.raises(threading.BrokenBarrierError):
        _two_replicas(concurrent=False).run([(0, functools.partial(task, 0, 0))])


def test_replica_failures_are_raised_once_all_threads_stop() -> None:
    ran: list[str] = []

    def fail() -> None:
        raise ValueError("batch 0 is bad")

    tasks = [(0, fail), (1, lambda: ran.append("r1")), (0, lambda: ran.append("after"))]
    with pytest.raises(ValueError, match="batch 0 is bad"):
        _two_replicas().run(iter(tasks))
    assert "after" not in ran  # a failed replica does not go on

    def reading():
        yield 0, lambda: ran.append("read")
        raise OSError("the data source failed")

    with pytest.raises(OSError, match="data source failed"):
        _two_replicas().run(reading())


def test_one_process_agrees_with_itself() -> None:
    replicas = _two_replicas()
    replicas.agree(None, "a pass")  # nothing to wait for
    with pytest.raises(KeyError, match="mine"):
        replicas.agree(KeyError("mine"), "a pass")
    np.testing.assert_array_equal(replicas.all_gather([1.0, 2.0]), [[1.0, 2.0]])
