"""The operator's memory plan against the measured peak of a block product.

For a CNN (two 3x3 convolutions of 32 channels on 512 CIFAR-shaped images, batches of
128) and an MLP 256-1024-1024-10 (8,192 examples, batches of 2,048), each in a fresh
process: an operator caching every batch runs one block of 8 vectors, and the plan's peak
(``op.memory_plan(8).peak``) is compared with the growth of the resident set's high-water
mark (``VmHWM``, reset through ``/proc/self/clear_refs`` after a warm-up that traces the
engine on 2 examples). Target: the plan within 25 % of the measured growth (the
activations dominate TensorFlow's own overhead: more than 300 MiB measured).

The processes run with one malloc arena (``MALLOC_ARENA_MAX=1``: with glibc's per-thread
arenas, memory freed on one TensorFlow thread is not reused on another and the resident
set grows with fragmentation, by tens of percent from run to run) and TensorFlow's default
threading, which the plan models. Linux only.

    python benchmarks/memory_plan.py [--models cnn,mlp] [--json out.json]

Exits with status 1 when a model misses the target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.25  # |plan − measured| / measured

# Builds the operator and runs the block in the child process; prints one JSON line.
_PEAK_SCRIPT = """
import json, sys
import keras, numpy as np
from spectra.operators import HessianOperator

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
if sys.argv[1] == "cnn":
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])
    x, batch_size = rng.standard_normal((512, 32, 32, 3)).astype(np.float32), 128
else:
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(1024, activation="tanh"),
        keras.layers.Dense(1024, activation="tanh"),
        keras.layers.Dense(10),
    ])
    x, batch_size = rng.standard_normal((8192, 256)).astype(np.float32), 2048
y = rng.integers(0, 10, len(x))
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
warm = HessianOperator.from_keras(model, loss, (x[:2], y[:2]), cache=False)
warm.matmat(np.ones((warm.shape[0], 2), np.float32))
V = rng.standard_normal((warm.shape[0], 8)).astype(np.float32)
del warm
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
op = HessianOperator.from_keras(model, loss, (x, y), batch_size=batch_size, cache=True)
op.matmat(V)
print(json.dumps({"measured": status("VmHWM") - base, "plan": op.memory_plan(8).peak}))
"""

# Threading variables a parent (a pytest-xdist worker, a CI job) may have set to one
# thread: the plan models TensorFlow's default threading.
_THREAD_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS")


def measure(model: str) -> dict[str, float]:
    """``{"measured": bytes, "plan": bytes}`` of ``model`` ("cnn" or "mlp") in a fresh
    process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2", MALLOC_ARENA_MAX="1")
    for name in _THREAD_VARIABLES:
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, model],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{model}: the measuring process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,mlp", help="comma-separated: cnn, mlp")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if not os.path.exists("/proc/self/clear_refs"):
        print("memory_plan.py needs Linux /proc to reset VmHWM; skipped.")
        return 0
    rows, missed = [], []
    print(f"{'model':<6} {'measured MiB':>13} {'plan MiB':>9} {'plan/measured':>14}  target ±25 %")
    for model in args.models.split(","):
        result = measure(model.strip())
        ratio = result["plan"] / result["measured"]
        met = result["measured"] > 300 * 1024**2 and abs(ratio - 1) <= TARGET
        rows.append({"model": model, **result, "ratio": ratio, "met": met})
        if not met:
            missed.append(model)
        print(
            f"{model:<6} {result['measured'] / 2**20:13.0f} {result['plan'] / 2**20:9.0f} "
            f"{ratio:14.2f}  {'met' if met else 'MISSED'}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
