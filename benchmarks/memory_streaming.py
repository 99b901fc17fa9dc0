"""Peak memory of a long Lanczos run on data streamed from a generator.

The MLP 64-256-256-10 on synthetic digits-shaped data (20,000 examples in batches of
1,000) produced by a Python generator, so no tensor of the whole dataset ever exists. The
operator's cache budget is set to a fraction (``--cache-fraction``, default a tenth) of
what caching every batch would take, so it keeps that share of the batches and streams
the others: every product recomputes their forward pass and gradient. The resident
memory of the process is sampled after every product, first for a run of plain products
(the operator alone: the target is a flat curve, peak after warm-up ≈ peak at the end),
then for a Lanczos run with full reorthogonalization, whose basis of steps × n float64
numbers is the only thing that should grow. The operator's memory plan is printed with
the measured growth of the resident set for comparison, and the time per product against
streaming every batch (``--cache-fraction 0``) shows what the kept batches save.

    python benchmarks/memory_streaming.py [--steps 100] [--examples 10000] [--cache-fraction 0.1]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from scipy.sparse.linalg import LinearOperator

import spectra


def resident_mib() -> float:
    """Current resident set size of this process (Linux /proc), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _Sampled(LinearOperator):
    """Wraps an operator and records resident memory after every product."""

    def __init__(self, op: LinearOperator) -> None:
        super().__init__(op.dtype, op.shape)
        self.op = op
        self.samples: list[float] = []

    def _matvec(self, x):
        out = self.op.matvec(x)
        self.samples.append(resident_mib())
        return out

    def _matmat(self, X):
        out = self.op.matmat(X)
        self.samples.append(resident_mib())
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="products / Lanczos steps")
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=1_000)
    parser.add_argument(
        "--cache-fraction", type=float, default=0.1, help="cache budget / full cache"
    )
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )

    def batches():
        rng = np.random.default_rng(0)  # the same data on every pass
        for start in range(0, args.examples, args.batch_size):
            size = min(args.batch_size, args.examples - start)
            yield (
                rng.uniform(0, 1, (size, 64)).astype(np.float32),
                rng.integers(0, 10, size).astype(np.int32),
            )

    dataset = tf.data.Dataset.from_generator(
        batches,
        output_signature=(
            tf.TensorSpec([None, 64], tf.float32),
            tf.TensorSpec([None], tf.int32),
        ),
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    probe = spectra.HessianOperator.from_keras(model, loss, dataset.take(1), cache=True)
    probe.loss()
    per_batch = probe.cache_nbytes
    num_batches = -(-args.examples // args.batch_size)
    full_cache = per_batch * num_batches
    budget = int(full_cache * args.cache_fraction)
    op = spectra.HessianOperator.from_keras(model, loss, dataset, cache_bytes=budget)
    start_mib = resident_mib()
    started = time.perf_counter()
    op.loss()
    sampled = _Sampled(op)
    vector = np.random.default_rng(0).standard_normal(op.shape[0])
    for _ in range(args.steps):
        vector = sampled.matvec(vector)
        vector /= np.linalg.norm(vector)
    elapsed = time.perf_counter() - started
    plain = np.array(sampled.samples)
    sampled.samples = []
    spectra.lanczos(sampled, num_steps=args.steps, seed=0)
    lanczos = np.array(sampled.samples)
    print(
        f"{op.shape[0]:,} parameters; {args.examples:,} examples streamed in {num_batches} batches"
    )
    print(
        f"full cache would take {full_cache / 2**20:.0f} MiB; budget {op.cache_bytes / 2**20:.0f}"
        f" MiB ({args.cache_fraction:g}) -> {op!r}"
    )
    print(op.memory_plan(1))
    print(
        f"{len(plain)} products in {elapsed:.1f} s ({1000 * elapsed / len(plain):.0f} ms each,"
        f" the first pass included); resident memory before {start_mib:.0f} MiB, growth to the"
        f" peak of the products {plain.max() - start_mib:.0f} MiB (plan:"
        f" {op.memory_plan(1).peak / 2**20:.0f} MiB)"
    )
    for label, samples, expected in (
        ("products", plain, 0.0),
        ("lanczos", lanczos, args.steps * op.shape[0] * 8 / 2**20),
    ):
        warm = samples[: max(1, len(samples) // 10)].max()
        print(
            f"  {label:9s} peak over the first 10%: {warm:6.0f} MiB, overall {samples.max():6.0f}"
            f" MiB, growth {samples.max() - warm:5.0f} MiB (basis: {expected:.0f} MiB);"
            f" peak overall / after warm-up {samples.max() / warm:.3f}"
        )


if __name__ == "__main__":
    main()
