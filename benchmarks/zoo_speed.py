"""Every architecture of the test zoo: product error against a dense Hessian, and speed.

For each model of ``tests/_zoo.py``:

* **error**, at the test size (n ≲ 300): the relative error of float64 and float32
  products (3 random vectors) against the dense Hessian of a float64 copy;
* **speed**, at ``--width`` units/filters on ``--examples`` examples (one batch): the time
  of a cached ``matvec``, of a ``matmat`` of 16 vectors per vector, and of the
  recomputing fallback's ``matvec``, as ratios to one compiled gradient (a ``tf.function``
  of the same loss), timed alternately with it; medians of the paired ratios;
* whether the graph was **split** or products use the fallback.

    python benchmarks/zoo_speed.py [--width 32] [--examples 512] [--repeats 9] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import keras
import numpy as np
import tensorflow as tf
from _dense import relative_error
from _zoo import ZOO, ZooEntry, operator_for, zoo_case

from spectra.operators import keras_models
from spectra.operators.engine import SPLIT_ENVIRONMENT_VARIABLE


def errors(entry: ZooEntry) -> tuple[float, float | None, str]:
    """Relative product errors (float64, float32) at the test size, and the path."""
    rng = np.random.default_rng(12345)
    _, _, op64, op32, (H, _, _) = zoo_case(entry, rng)
    V = rng.standard_normal((H.shape[0], 3))
    e64 = relative_error(op64.matmat(V), H @ V)
    e32 = None
    if entry.float32_reference:
        e32 = relative_error(op32.matmat(V.astype(np.float32)).astype(np.float64), H @ V)
    return e64, e32, op64.product_path


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _paired(product, gradient, repeats: int, per: int = 1) -> float:
    product()
    gradient()
    ratios = []
    for _ in range(repeats):
        tg = _timed(gradient)
        ratios.append(_timed(product) / per / tg)
    return statistics.median(ratios)


def speed(entry: ZooEntry, width: int, examples: int, repeats: int) -> dict[str, float]:
    """Ratios of products to a compiled gradient at a larger width."""
    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(0)
    model = entry.build("float32", width)
    data = entry.data(rng, examples, width)
    bench = ZooEntry(**{**entry.__dict__, "batch_size": None})
    op = operator_for(bench, model, data)
    os.environ[SPLIT_ENVIRONMENT_VARIABLE] = "0"
    try:
        fallback = operator_for(bench, model, data)
    finally:
        del os.environ[SPLIT_ENVIRONMENT_VARIABLE]
    structured = keras_models.StructuredLoss(entry.loss, entry.loss_weights, tf.float32)
    training = entry.kwargs.get("training", False)
    variables = [v.value for v in model.trainable_variables]
    x, y = tf.nest.map_structure(tf.constant, data)

    @tf.function
    def gradient_fn():
        with tf.GradientTape() as tape:
            outputs = model(x, training=training)
            value = structured(model, y, outputs, None)
            if model.losses:
                value = value + tf.add_n(model.losses)
        grads = tape.gradient(value, variables)
        return tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads], 0)

    def gradient():
        return gradient_fn().numpy()

    v = rng.standard_normal(op.shape[0]).astype(np.float32)
    V = rng.standard_normal((op.shape[0], 16)).astype(np.float32)
    return {
        "parameters": op.shape[0],
        "matvec": _paired(lambda: op.matvec(v), gradient, repeats),
        "matmat16": _paired(lambda: op.matmat(V), gradient, repeats, per=16),
        "fallback_matvec": _paired(lambda: fallback.matvec(v), gradient, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--only", help="comma-separated zoo names")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    names = None if args.only is None else set(args.only.split(","))
    print(
        f"TensorFlow {tf.__version__}, {os.cpu_count()} CPU cores; speed at width "
        f"{args.width}, {args.examples} examples; ratios to a compiled gradient"
    )
    header = f"{'model':28s} {'path':9s} {'err f64':>9s} {'err f32':>9s} {'n':>7s}"
    print(f"{header} {'matvec':>7s} {'k=16':>7s} {'fallback':>8s}")
    results = {}
    for entry in ZOO:
        if names is not None and entry.name not in names:
            continue
        e64, e32, path = errors(entry)
        ratios = speed(entry, args.width, args.examples, args.repeats)
        results[entry.name] = {"path": path, "error_f64": e64, "error_f32": e32, **ratios}
        f32 = "  (masks)" if e32 is None else f"{e32:9.1e}"
        print(
            f"{entry.name:28s} {path:9s} {e64:9.1e} {f32:>9s} {ratios['parameters']:7d} "
            f"{ratios['matvec']:7.2f} {ratios['matmat16']:7.2f} {ratios['fallback_matvec']:8.2f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
