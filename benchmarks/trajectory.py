"""Sharpness over the checkpoints of a training run: model reuse and warm starts.

Two runs: ``data/gd_trajectory`` (11 checkpoints of an MLP 64-32-32-10, 3,466 parameters)
and 50 checkpoints of a small digits CNN (two 3×3 convolutions, 1,954 parameters) trained
here by full-batch gradient descent into a temporary directory. Each checkpoint's top
eigenvalue (Lanczos, tolerance 1e-8, float32 products, all 1,797 examples) is measured as
``spectra sharpness`` does, three ways:

* ``fresh``: every checkpoint loaded into a new model, so the Hessian product is traced
  again for each, and the eigensolver starts from a random vector (the 0.1 command line);
* ``reuse``: one model per architecture (weights loaded into it), one traced engine;
* ``reuse+warm``: and each eigensolve starts from the previous checkpoint's eigenvector.

Reported per checkpoint: seconds (load, build and measure) and products (the eigensolver's,
its fixed symmetry and residual checks included), and the largest difference of λ₁ to the
``fresh`` run in units of the error bounds.

    python benchmarks/trajectory.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import spectra

spectra.quiet_tensorflow()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from spectra.analysis.trajectory import SharpnessSettings, measure_sharpness  # noqa: E402
from spectra.io.checkpoints import CheckpointLoader, find_checkpoints, load_model  # noqa: E402
from spectra.io.datasets import load_data  # noqa: E402
from spectra.operators import HessianOperator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOSS = "sparse_categorical_crossentropy"
CNN_CHECKPOINTS = 50
CNN_STEPS_BETWEEN = 2
CNN_LEARNING_RATE = 0.5


def _train_cnn(directory: Path, x: np.ndarray, y: np.ndarray) -> None:
    """Full-batch gradient descent on a small CNN; a checkpoint every few steps."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="digits_cnn",
    )
    model.compile(optimizer=keras.optimizers.SGD(CNN_LEARNING_RATE), loss=LOSS)
    import tensorflow as tf

    batch = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x)).cache()
    for index in range(CNN_CHECKPOINTS):
        model.save(directory / f"step_{index * CNN_STEPS_BETWEEN:04d}.keras")
        model.fit(batch, epochs=CNN_STEPS_BETWEEN, verbose=0, shuffle=False)


def _measure(paths: list[Path], data: tuple, mode: str) -> list[dict]:
    settings = SharpnessSettings(top_k=1, tol=1e-8, warm_start=mode == "reuse+warm")
    loader = CheckpointLoader()
    previous = None
    rows = []
    for path in paths:
        started = time.perf_counter()
        model = load_model(path) if mode == "fresh" else loader.load(path)
        op = HessianOperator.from_keras(model, LOSS, data)
        result = measure_sharpness(
            op, settings, v0=None if previous is None else previous.eigenvectors
        )
        previous = result
        rows.append(
            {
                "file": path.name,
                "seconds": time.perf_counter() - started,
                "products": result.num_products,
                "sharpness": result.eigenvalues[0],
                "error_bound": result.error_bounds[0],
            }
        )
    return rows


def _summary(name: str, runs: dict[str, list[dict]]) -> dict:
    fresh = runs["fresh"]
    print(f"\n{name}: {len(fresh)} checkpoints")
    print(
        f"  {'mode':12s} {'s/ckpt':>8s} {'s/ckpt (2nd on)':>16s} {'products/ckpt':>14s} "
        f"{'max |Δλ₁|/bounds':>17s}"
    )
    summary = {}
    for mode, rows in runs.items():
        seconds = np.array([row["seconds"] for row in rows])
        products = np.array([row["products"] for row in rows])
        deviation = max(
            abs(row["sharpness"] - ref["sharpness"]) / (row["error_bound"] + ref["error_bound"])
            for row, ref in zip(rows, fresh)
        )
        summary[mode] = {
            "seconds_per_checkpoint": float(seconds.mean()),
            "seconds_per_checkpoint_after_first": float(seconds[1:].mean()),
            "products_per_checkpoint": float(products.mean()),
            "max_deviation_in_bounds": float(deviation),
            "rows": rows,
        }
        print(
            f"  {mode:12s} {seconds.mean():8.3f} {seconds[1:].mean():16.3f} "
            f"{products.mean():14.1f} {deviation:17.2f}"
        )
    base = summary["fresh"]["seconds_per_checkpoint_after_first"]
    for mode in ("reuse", "reuse+warm"):
        ratio = summary[mode]["seconds_per_checkpoint_after_first"] / base
        print(f"  {mode} / fresh (per checkpoint after the first): {ratio:.2f}x time")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    digits = load_data(str(ROOT / "data" / "digits.npz"))
    report = {}

    paths = [ref.path for ref in find_checkpoints(ROOT / "data" / "gd_trajectory")]
    data = digits.as_tuple()
    runs = {mode: _measure(paths, data, mode) for mode in ("fresh", "reuse", "reuse+warm")}
    report["gd_trajectory"] = _summary("data/gd_trajectory (MLP, 3,466 parameters)", runs)

    images = digits.x.reshape(-1, 8, 8, 1)
    with tempfile.TemporaryDirectory() as directory:
        started = time.perf_counter()
        _train_cnn(Path(directory), images, digits.y)
        print(
            f"\n(trained the CNN for {CNN_CHECKPOINTS * CNN_STEPS_BETWEEN} full-batch steps "
            f"in {time.perf_counter() - started:.1f} s)"
        )
        paths = [ref.path for ref in find_checkpoints(directory)]
        data = (images, digits.y)
        runs = {mode: _measure(paths, data, mode) for mode in ("fresh", "reuse", "reuse+warm")}
    report["cnn"] = _summary("digits CNN (1,954 parameters)", runs)
    print("\n(seconds on a shared machine: compare ratios within one run)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
