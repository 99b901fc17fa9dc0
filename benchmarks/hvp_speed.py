"""Speed of Hessian-vector products, as ratios to one compiled gradient.

Models: the MLP 64-256-256-10 and a small CNN, on the full scikit-learn digits set (1797
examples, one batch), and an LSTM text classifier (Embedding 1000x32, LSTM 64 with
masking, Dense 10) on 512 random token sequences of length 40. For each model, in one run:

* ``gradient``: a compiled (``tf.function``) gradient of the mean loss, returned to numpy;
* ``matvec``: ``HessianOperator.matvec`` (cached: forward pass and gradient reused);
* ``matmat k``: ``HessianOperator.matmat`` per vector, k = 1, 4, 16, 64;
* ``streaming``: the same with ``cache=False`` (forward pass and gradient recomputed once
  per batch per call), the path taken when the data does not fit the cache budget;
* ``recompute``: the fallback product used when a graph cannot be split
  (``SPECTRA_GRAPH_SPLIT=0`` forces it): forward pass and gradient recomputed per call;
* ``naive eager``: two nested ``GradientTape``s recomputing everything for each vector, as
  in the question this project started from; ``naive compiled``: the same in a
  ``tf.function``.

Every product is timed alternately with a gradient and the median of the paired ratios is
reported, so that a busy, shared machine affects both sides of each ratio alike.
Targets on a 2-core CPU: matvec <= 2.2x a gradient, matmat <= 2.0x per vector for k >= 16,
both at least 2x faster than the naive nested-tape product.

    python benchmarks/hvp_speed.py [--repeats 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import spectra
from spectra.operators import HessianOperator
from spectra.operators.engine import SPLIT_ENVIRONMENT_VARIABLE


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int32)


def mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="mlp_64_256_256_10",
    )


def cnn() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ],
        name="cnn_16_32",
    )


def lstm() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((40,), dtype="int32"),
            keras.layers.Embedding(1000, 32, mask_zero=True),
            keras.layers.LSTM(64),
            keras.layers.Dense(10),
        ],
        name="lstm_classifier",
    )


def token_data(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    tokens = rng.integers(1, 1000, (512, 40)).astype(np.int32)
    lengths = rng.integers(10, 41, 512)
    tokens[np.arange(40)[None, :] >= lengths[:, None]] = 0  # padding, masked
    return tokens, rng.integers(0, 10, 512).astype(np.int32)


def recompute_operator(model: keras.Model, loss, data) -> HessianOperator:
    """The fallback (unsplit) product, forced by the environment variable."""
    previous = os.environ.get(SPLIT_ENVIRONMENT_VARIABLE)
    os.environ[SPLIT_ENVIRONMENT_VARIABLE] = "0"
    try:
        return HessianOperator.from_keras(model, loss, data)
    finally:
        if previous is None:
            del os.environ[SPLIT_ENVIRONMENT_VARIABLE]
        else:
            os.environ[SPLIT_ENVIRONMENT_VARIABLE] = previous


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired_ratio(product, gradient, repeats: int, per: int = 1) -> tuple[float, float]:
    """Median over repeats of (product time / per) / gradient time, and median product s."""
    product()
    gradient()
    ratios, seconds = [], []
    for _ in range(repeats):
        tg = timed(gradient)
        tp = timed(product) / per
        ratios.append(tp / tg)
        seconds.append(tp)
    return statistics.median(ratios), statistics.median(seconds)


def bench_model(name: str, model: keras.Model, x: np.ndarray, y: np.ndarray, repeats: int):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = [v.value for v in model.trainable_variables]
    xt, yt = tf.constant(x), tf.constant(y)
    signature = [tf.TensorSpec([None, *x.shape[1:]], x.dtype), tf.TensorSpec([None], tf.int32)]

    @tf.function(input_signature=signature)
    def gradient_fn(xb, yb):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=False))
        return tf.concat([tf.reshape(g, [-1]) for g in tape.gradient(value, variables)], 0)

    def gradient():
        return gradient_fn(xt, yt).numpy()

    def naive_hvp(xb, yb, v):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                value = loss(yb, model(xb, training=False))
            grads = inner.gradient(value, variables)
            flat = tf.concat([tf.reshape(g, [-1]) for g in grads], 0)
            dot = tf.reduce_sum(flat * v)
        return tf.concat([tf.reshape(h, [-1]) for h in outer.gradient(dot, variables)], 0)

    n = sum(int(np.prod(v.shape)) for v in variables)
    naive_compiled = tf.function(
        naive_hvp, input_signature=[*signature, tf.TensorSpec([n], tf.float32)]
    )
    op = HessianOperator.from_keras(model, loss, (x, y))
    rng = np.random.default_rng(0)
    v = rng.standard_normal(n).astype(np.float32)
    vt = tf.constant(v)
    rows = []
    ratio, sec = paired_ratio(gradient, gradient, repeats)
    rows.append(("gradient (compiled)", sec, 1.0))
    ratio, sec = paired_ratio(lambda: op.matvec(v), gradient, repeats)
    rows.append(("matvec (cached)", sec, ratio))
    for k in (1, 4, 16, 64):
        V = rng.standard_normal((n, k)).astype(np.float32)
        ratio, sec = paired_ratio(lambda V=V: op.matmat(V), gradient, repeats, per=k)
        rows.append((f"matmat k={k}, per vector", sec, ratio))
    streaming = HessianOperator.from_keras(model, loss, (x, y), cache=False)
    ratio, sec = paired_ratio(lambda: streaming.matvec(v), gradient, repeats)
    rows.append(("matvec (streaming, no cache)", sec, ratio))
    V16 = rng.standard_normal((n, 16)).astype(np.float32)
    ratio, sec = paired_ratio(lambda: streaming.matmat(V16), gradient, repeats, per=16)
    rows.append(("matmat k=16 (streaming), per vector", sec, ratio))
    recompute = recompute_operator(model, loss, (x, y))
    assert recompute.product_path == "recompute" and op.product_path == "split"
    ratio, sec = paired_ratio(lambda: recompute.matvec(v), gradient, repeats)
    rows.append(("matvec (recompute fallback)", sec, ratio))
    ratio, sec = paired_ratio(lambda: recompute.matmat(V16), gradient, repeats, per=16)
    rows.append(("matmat k=16 (recompute), per vector", sec, ratio))
    ratio, sec = paired_ratio(lambda: naive_hvp(xt, yt, vt).numpy(), gradient, max(3, repeats // 2))
    rows.append(("naive nested tapes (eager)", sec, ratio))
    ratio, sec = paired_ratio(lambda: naive_compiled(xt, yt, vt).numpy(), gradient, repeats)
    rows.append(("naive nested tapes (compiled)", sec, ratio))
    print(
        f"\n{name}: {n:,} parameters, {len(y)} examples (one batch), "
        f"cache {op.cache_nbytes / 2**20:.1f} MiB"
    )
    print(f"  {'':34s} {'ms':>9s} {'x gradient':>11s}")
    for label, sec, ratio in rows:
        print(f"  {label:34s} {sec * 1e3:9.2f} {ratio:11.2f}")
    table = {label: {"ms": sec * 1e3, "ratio_to_gradient": ratio} for label, sec, ratio in rows}
    naive = table["naive nested tapes (eager)"]["ratio_to_gradient"]
    matvec = table["matvec (cached)"]["ratio_to_gradient"]
    block16 = table["matmat k=16, per vector"]["ratio_to_gradient"]
    fallback = table["matvec (recompute fallback)"]["ratio_to_gradient"]
    print(
        f"  speed-up of matvec over naive eager: {naive / matvec:.1f}x; "
        f"of matmat k=16: {naive / block16:.1f}x; of the split matvec over the "
        f"recompute fallback: {fallback / matvec:.2f}x"
    )
    return {"parameters": n, "examples": len(y), "rows": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="paired timings per row")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--models", default="mlp,cnn,lstm", help="comma-separated: mlp,cnn,lstm")
    args = parser.parse_args()
    devices = tf.config.list_physical_devices()
    gpus = [d.name for d in devices if d.device_type == "GPU"]
    device = f"GPU ({len(gpus)})" if gpus else "CPU"
    print(
        f"spectra {spectra.__version__}, TensorFlow {tf.__version__}, {device}, "
        f"{os.cpu_count()} CPU cores, {platform.machine()}"
    )
    keras.utils.set_random_seed(0)
    x, y = digits()
    results = {"device": device, "tensorflow": tf.__version__, "cpu_count": os.cpu_count()}
    for name in args.models.split(","):
        if name == "mlp":
            results["mlp"] = bench_model("MLP 64-256-256-10", mlp(), x, y, args.repeats)
        elif name == "cnn":
            results["cnn"] = bench_model(
                "CNN conv16-conv32-dense10", cnn(), x.reshape(-1, 8, 8, 1), y, args.repeats
            )
        elif name == "lstm":
            tokens, labels = token_data(np.random.default_rng(1))
            results["lstm"] = bench_model(
                "LSTM classifier emb32-lstm64-dense10", lstm(), tokens, labels, args.repeats
            )
        else:
            parser.error(f"unknown model {name!r}; choose from mlp, cnn, lstm")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
