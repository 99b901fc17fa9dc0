"""Cost of K-FAC and EKFAC against exact curvature products, as ratios to one compiled gradient.

Models: the trained digits MLP 64-256-256-10 of ``data/digits_mlp.keras`` (85,002
parameters) and a small CNN (Conv2D 8 3x3 ReLU, max-pool, Dense 32 ReLU, Dense 10 softmax;
2,746 parameters, seed 0), both on the full digits set (1797 examples, one batch), loss
sparse categorical cross-entropy on the softmax output. For each model, in one run, one
thread (TensorFlow and BLAS):

* ``gradient``: a compiled (``tf.function``) gradient of the mean loss, returned to numpy;
* ``GGN`` / ``Hessian matvec`` and ``matmat k=16`` per vector (cached operators);
* ``K-FAC build`` / ``EKFAC build``: ``from_keras`` (one / two passes over the data, each
  with a forward pass and C = 10 backward passes per batch, type-2);
* ``K-FAC matvec``, ``matmat k=16`` per vector, ``exact inverse matvec``
  (``inverse(δ)`` through the factors' eigenbases; the eigendecompositions are computed
  once, then cached, and timed on their own as ``eigendecompositions``), and the same for
  EKFAC;
* ``inverse cg`` / ``inverse minres``: ``spectra.inverse(GGN, δ, tol=1e-6)`` applied to one
  random right-hand side, with its products, on a float64 GGN (in float32 the products'
  rounding stops MINRES's residual near 1e-6).

Every timing is paired with a gradient timed just before it and the median of the paired
ratios over the repeats is reported, so that a busy, shared machine affects both sides of a
ratio alike. The iterative solves run once (their product counts are what matters).

    python benchmarks/approximations.py [--quick] [--repeats 7] [--damping 1e-2] [--json out.json]
"""

from __future__ import annotations

import os

# One thread, set before NumPy and TensorFlow start their pools.
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import spectra  # noqa: E402
from spectra.io.checkpoints import load_model  # noqa: E402
from spectra.io.datasets import load_data  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"
LOSS = "sparse_categorical_crossentropy"


def cnn() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="cnn_8_32_10",
    )


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired_ratio(work, gradient, repeats: int, per: int = 1) -> tuple[float, float]:
    """Median over repeats of (work time / per) / gradient time, and the median seconds."""
    work()
    gradient()
    ratios, seconds = [], []
    for _ in range(repeats):
        tg = timed(gradient)
        tw = timed(work) / per
        ratios.append(tw / tg)
        seconds.append(tw)
    return statistics.median(ratios), statistics.median(seconds)


def bench_model(name, model, x, y, repeats: int, damping: float) -> dict:
    loss = keras.losses.SparseCategoricalCrossentropy()
    variables = [v.value for v in model.trainable_variables]
    xt, yt = tf.constant(x), tf.constant(y)
    signature = [tf.TensorSpec([None, *x.shape[1:]], x.dtype), tf.TensorSpec([None], yt.dtype)]

    @tf.function(input_signature=signature)
    def gradient_fn(xb, yb):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=False))
        return tf.concat([tf.reshape(g, [-1]) for g in tape.gradient(value, variables)], 0)

    def gradient():
        return gradient_fn(xt, yt).numpy()

    data = (x, y)
    ggn = spectra.GGNOperator.from_keras(model, LOSS, data)
    hessian = spectra.HessianOperator.from_keras(model, LOSS, data)
    n = ggn.shape[0]
    rng = np.random.default_rng(0)
    v = rng.standard_normal(n).astype(np.float32)
    V16 = rng.standard_normal((n, 16)).astype(np.float32)
    rows: list[tuple[str, float, float, str]] = []

    def row(label, work, per=1, note="", reps=repeats):
        ratio, sec = paired_ratio(work, gradient, reps, per)
        rows.append((label, sec, ratio, note))

    # Its ratio to the gradient timed just before it shows how noisy the machine is.
    row("gradient (compiled)", gradient, note="paired with itself: the noise")
    for op_name, op in (("GGN", ggn), ("Hessian", hessian)):
        row(f"{op_name} matvec", lambda op=op: op.matvec(v), note="1 product")
        row(f"{op_name} matmat k=16, per vector", lambda op=op: op.matmat(V16), per=16)
    builds = max(2, repeats // 3)
    approximations = {}
    for op_name, cls, passes in (
        ("K-FAC", spectra.KFACOperator, 1),
        ("EKFAC", spectra.EKFACOperator, 2),
    ):
        built = []
        row(
            f"{op_name} build",
            lambda cls=cls, built=built: built.append(cls.from_keras(model, LOSS, data)),
            note=f"{passes} data pass{'es' if passes > 1 else ''}",
            reps=builds,
        )
        op = approximations[op_name] = built[-1]

        def eigendecompositions(op=op):
            op._eigen = None  # drop the cached eigendecompositions to time them
            op.eigenvalues()

        row(f"{op_name} eigendecompositions", eigendecompositions, note="once, then cached")
        row(f"{op_name} matvec", lambda op=op: op.matvec(v))
        row(f"{op_name} matmat k=16, per vector", lambda op=op: op.matmat(V16), per=16)
        inverse = op.inverse(damping)
        row(f"{op_name} exact inverse matvec", lambda inverse=inverse: inverse.matvec(v))
    solves = {}
    b = rng.standard_normal(n)
    # In float64: a float32 product's rounding (about 1e-7 relative) leaves MINRES's residual
    # stagnating near 1e-6, the target.
    ggn64 = spectra.GGNOperator.from_keras(model, LOSS, data, dtype=np.float64)
    for method in ("cg", "minres"):
        inverse = spectra.inverse(ggn64, damping, method=method, tol=1e-6)
        tg = timed(gradient)
        seconds = timed(lambda inverse=inverse: inverse.matvec(b))
        products = int(inverse.last.num_products)
        solves[method] = products
        rows.append(
            (f"inverse {method} (GGN f64), tol 1e-6", seconds, seconds / tg, f"{products} products")
        )
    print(f"\n{name}: {n:,} parameters, {len(y)} examples (one batch), damping δ = {damping:g}")
    print(f"  {'':36s} {'ms':>10s} {'x gradient':>11s}  note")
    for label, sec, ratio, note in rows:
        print(f"  {label:36s} {sec * 1e3:10.2f} {ratio:11.2f}  {note}")
    table = {
        label: {"ms": sec * 1e3, "ratio_to_gradient": ratio, "note": note}
        for label, sec, ratio, note in rows
    }
    build = table["K-FAC build"]["ratio_to_gradient"]
    product = table["GGN matmat k=16, per vector"]["ratio_to_gradient"]
    print(
        f"  building K-FAC costs as much as {build / product:.0f} GGN products (blocks of 16); "
        f"a CG solve to 1e-6 took {solves['cg']} products, MINRES {solves['minres']}"
    )
    return {"parameters": n, "examples": len(y), "damping": damping, "rows": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats per row")
    parser.add_argument("--repeats", type=int, default=7, help="paired timings per row")
    parser.add_argument("--damping", type=float, default=1e-2, help="δ of the inverses")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp,cnn")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    repeats = 3 if args.quick else args.repeats
    print(
        f"spectra {spectra.__version__}, TensorFlow {tf.__version__}, one thread, "
        f"{os.cpu_count()} CPU cores, {platform.machine()}, {repeats} repeats"
    )
    digits = load_data(DATA / "digits.npz")
    results = {"tensorflow": tf.__version__, "cpu_count": os.cpu_count(), "repeats": repeats}
    for name in args.models.split(","):
        if name == "mlp":
            model = load_model(DATA / "digits_mlp.keras")
            results["mlp"] = bench_model(
                "MLP 64-256-256-10 (trained)", model, digits.x, digits.y, repeats, args.damping
            )
        elif name == "cnn":
            x = digits.x.reshape(-1, 8, 8, 1)
            results["cnn"] = bench_model(
                "CNN conv8-pool-dense32-dense10", cnn(), x, digits.y, repeats, args.damping
            )
        else:
            parser.error(f"unknown model {name!r}; choose from mlp, cnn")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
