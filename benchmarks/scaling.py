"""What a second worker or replica buys: throughput of Hessian products on one machine.

An MLP 512-1024-512-10 (1.06M float32 parameters) on 2,048 synthetic examples stored in 4
TFRecord files, read as a ``tf.data`` pipeline in batches of 512; products of blocks of
k = 16 vectors from the cache. Each configuration runs in fresh processes:

* ``1 process x 1 thread`` and ``1 process x 2 threads`` (TensorFlow's intra-op threads);
* ``2 processes x 1 thread``: a 2-worker ``MultiWorkerMirroredStrategy`` cluster on
  localhost, each worker reading only its 2 files (auto-sharding by file);
* ``MirroredStrategy``, 2 logical CPU devices, 1 intra-op thread each: the replicas issued
  from their own threads (the default) and, in the same process, one after another.

Throughput = k x examples / seconds per ``matmat`` (the best of 2, after the pass that
fills the cache). Bytes read per worker: what its input pipeline yielded over the counting
pass and the pass that fills the cache (cached products read nothing). In the cluster the
all-reduce of a (k, n) block is timed on its own for k = 1 and 16; the cost model (README,
"Scaling") predicts the 2-worker product from the 1-thread compute time (and from the
2-thread one, what the machine gave two threads) and that all-reduce, and is compared with
the measurement. The machine's load (``os.getloadavg``) is printed with the numbers: on a
shared machine the ratios, not the times, are what to read.

    python benchmarks/scaling.py
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _localhost_cluster import finish, run_workers

WIDTHS = (512, 1024, 512, 10)
EXAMPLES, BATCH, FILES, K, REPEATS = 2048, 512, 4, 16, 2
TIMEOUT = 300


# -- one process of a configuration -------------------------------------------------------
def _configure(config: str) -> None:
    """Threads and devices, before TensorFlow starts."""
    import tensorflow as tf

    intra, inter = {"1x1": (1, 1), "1x2": (2, 2), "cluster": (1, 1), "mirrored": (1, 2)}[config]
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    if config == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
        )


def _dataset(records: Path):
    import tensorflow as tf

    files = sorted(str(p) for p in records.glob("*.tfrecord"))
    features = {
        "x": tf.io.FixedLenFeature([], tf.string),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }

    def parse(record):
        example = tf.io.parse_single_example(record, features)
        x = tf.reshape(tf.io.decode_raw(example["x"], tf.float32), [WIDTHS[0]])
        return x, example["y"]

    return (
        tf.data.Dataset.from_tensor_slices(files)
        .interleave(tf.data.TFRecordDataset, cycle_length=1)
        .map(parse)
        .batch(BATCH)
    )


def _best_of(repeats: int, run) -> float:
    """The shortest of ``repeats`` timed calls (the one least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def _timed_products(op, vectors) -> float:
    """Seconds per matmat of ``vectors`` from the cache (after the pass that fills it)."""
    op.matmat(vectors)
    return _best_of(REPEATS, lambda: op.matmat(vectors))


def _allreduce_seconds(replicas, n: int) -> dict[str, float]:
    """Seconds of the all-reduce of one number (the latency) and of a (k, n) float32
    block, k = 1 and K."""
    import tensorflow as tf

    seconds = {"scalar": _best_of(REPEATS + 3, lambda: replicas.all_gather([1.0]))}
    for k in (1, K):
        accumulator = replicas.accumulator(tf.float32)
        accumulator.add(0, tf.ones((k, n), tf.float32))
        replicas.sum(accumulator, (k, n))  # warm-up
        reduce = functools.partial(replicas.sum, accumulator, (k, n))
        seconds[str(k)] = _best_of(REPEATS, lambda reduce=reduce: reduce().numpy())
    return seconds


def run_configuration(config: str, out: Path, records: Path) -> None:
    _configure(config)
    import keras
    import numpy as np
    import tensorflow as tf

    import spectra

    strategy = None
    if config == "mirrored":
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    elif config == "cluster":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.Sequential(
            [keras.Input((WIDTHS[0],))]
            + [keras.layers.Dense(w, activation="tanh") for w in WIDTHS[1:-1]]
            + [keras.layers.Dense(WIDTHS[-1])]
        )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    op = spectra.HessianOperator.from_keras(model, loss, _dataset(records), strategy=strategy)
    vectors = np.random.default_rng(1).standard_normal((op.shape[0], K)).astype(np.float32)
    result = {
        "config": config,
        "parameters": op.shape[0],
        "examples": op.num_examples,
        "seconds": _timed_products(op, vectors),
        "bytes_read": op.num_bytes_read,
        "examples_read": op.num_examples_read,
        "passes_read": 2,  # the counting pass and the pass that fills the cache
        "cached": op.is_cached,
    }
    if config == "mirrored":
        op._replicas.concurrent = False
        result["seconds_one_by_one"] = _timed_products(op, vectors)
    if config == "cluster":
        result["allreduce"] = _allreduce_seconds(op._replicas, op.shape[0])
        result["task"] = int(strategy.cluster_resolver.task_id)
    out.write_text(json.dumps(result))


# -- the driver ---------------------------------------------------------------------------
def _write_records(directory: Path) -> int:
    """The synthetic examples in FILES TFRecord files; returns their total size in bytes."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((EXAMPLES, WIDTHS[0])).astype(np.float32)
    y = rng.integers(0, WIDTHS[-1], EXAMPLES)
    for f, ids in enumerate(np.array_split(np.arange(EXAMPLES), FILES)):
        with tf.io.TFRecordWriter(str(directory / f"part-{f}.tfrecord")) as writer:
            for i in ids:
                feature = {
                    "x": tf.train.Feature(bytes_list=tf.train.BytesList(value=[x[i].tobytes()])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y[i])])),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())
    return sum(p.stat().st_size for p in directory.glob("*.tfrecord"))


def _start(config: str, out: Path, records: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--run", config, str(out), str(records)],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _cluster(tmp: Path, records: Path) -> list[dict]:
    outs = [tmp / f"cluster{task}.json" for task in range(2)]
    run_workers(lambda task, env: _start("cluster", outs[task], records, env), 2, TIMEOUT)
    return [json.loads(out.read_text()) for out in outs]


def main() -> None:
    started = time.perf_counter()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        records = tmp / "records"
        records.mkdir()
        file_bytes = _write_records(records)
        results = {}
        for config in ("1x1", "1x2", "mirrored"):
            out = tmp / f"{config}.json"
            finish(_start(config, out, records), TIMEOUT)
            results[config] = json.loads(out.read_text())
        workers = _cluster(tmp, records)
    load_after = os.getloadavg()
    first = results["1x1"]
    n, examples = first["parameters"], first["examples"]

    def throughput(seconds: float) -> float:
        return K * examples / seconds

    rows = [
        ("1 process x 1 thread", first["seconds"], first["bytes_read"]),
        ("1 process x 2 threads", results["1x2"]["seconds"], results["1x2"]["bytes_read"]),
        ("2 processes x 1 thread", workers[0]["seconds"], workers[0]["bytes_read"]),
        ("Mirrored, 2 devices, threads", results["mirrored"]["seconds"], None),
        ("Mirrored, one after another", results["mirrored"]["seconds_one_by_one"], None),
    ]
    mirrored_bytes = results["mirrored"]["bytes_read"]
    print(
        f"MLP {'-'.join(map(str, WIDTHS))}: n = {n:,} parameters (float32), "
        f"{examples:,} examples in {FILES} TFRecord files ({file_bytes / 2**20:.1f} MiB), "
        f"batches of {BATCH}, k = {K}, products from the cache"
    )
    print(
        f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, "
        f"after {tuple(round(x, 2) for x in load_after)} on {os.cpu_count()} cores"
    )
    print()
    print(f"{'configuration':32s} {'s/matmat':>9s} {'vec*ex/s':>10s} {'vs 1x1':>7s} {'vs 1x2':>7s}")
    for label, seconds, _ in rows:
        print(
            f"{label:32s} {seconds:9.3f} {throughput(seconds):10.0f} "
            f"{first['seconds'] / seconds:7.2f} {results['1x2']['seconds'] / seconds:7.2f}"
        )
    print()
    print("bytes read per worker (counting pass + cache fill; products read nothing):")
    print(f"  1 process:            {first['bytes_read'] / 2**20:8.2f} MiB")
    for w in workers:
        print(
            f"  worker {w['task']} of 2:          {w['bytes_read'] / 2**20:8.2f} MiB "
            f"({w['examples_read'] // 2} examples per pass)"
        )
    print(f"  Mirrored (1 process): {mirrored_bytes / 2**20:8.2f} MiB")
    print()
    # The cost model (README, "Scaling"): T_N = k c E/N + α + k 2(N-1)/N n s / B.
    timing = workers[0]["allreduce"]
    latency, reduce_1, reduce_k = timing["scalar"], timing["1"], timing[str(K)]
    per_vector = (reduce_k - latency) / K
    ring = 2 * (2 - 1) / 2
    bandwidth = ring * n * 4 / max(per_vector, 1e-12)
    compute = first["seconds"] / 2  # T_1x1 / N: each worker computes half the examples
    predicted = compute + reduce_k
    measured = workers[0]["seconds"]
    per_worker_vector = compute / K
    print(
        f"all-reduce on 2 workers: a number {latency * 1e3:.1f} ms (latency), (1, n) "
        f"{reduce_1 * 1e3:.1f} ms, ({K}, n) {reduce_k * 1e3:.0f} ms -> {per_vector * 1e3:.1f} ms "
        f"per vector, {bandwidth / 1e9:.2f} GB/s with the ring factor 2(N-1)/N = {ring:.0f}"
    )
    print(
        f"cost model, 2 workers: T_1x1/2 + all-reduce = {compute:.3f} + {reduce_k:.3f} "
        f"= {predicted:.3f} s; measured {measured:.3f} s "
        f"(measured/predicted {measured / predicted:.2f})"
    )
    # On a shared machine two workers rarely get two cores: the compute the same run got
    # from two threads (1 process x 2 threads) stands in for T_1x1/2.
    two_threads = results["1x2"]["seconds"] + reduce_k
    print(
        f"with the compute of 1 process x 2 threads: {results['1x2']['seconds']:.3f} + "
        f"{reduce_k:.3f} = {two_threads:.3f} s (measured/predicted {measured / two_threads:.2f})"
    )
    share = per_vector / per_worker_vector
    print(
        f"per vector: all-reduce {per_vector * 1e3:.1f} ms against {per_worker_vector * 1e3:.0f} "
        f"ms of compute per worker ({share:.1%}, whatever k); the latency is under 1% of a "
        f"block's compute from k >= {int(latency / (0.01 * per_worker_vector)) + 1}; the "
        f"all-reduce is under 5% of a product from {int(examples / 2 * share / 0.05) + 1} "
        "examples per worker"
    )
    print(f"benchmark wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--run":
        run_configuration(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        main()
