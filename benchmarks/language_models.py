"""K-FAC and EKFAC of two tiny keras-hub transformers against the GGN they approximate.

Models (random weights, seed 0, float32): a GPT-2 causal language model (vocabulary 64,
2 layers, hidden 16, 2 heads, intermediate 32, sequence length 8; logits from the tied
token embedding called with ``reverse=True``, sparse cross-entropy at every position)
and a BERT classifier (the same sizes, 2 segments, a Dense head of 3 classes on the
pooled output), each on 32 random sequences of 8 tokens (one batch). For each model, in
one run, one thread (TensorFlow and BLAS):

* the GGN (``spectra.GGNOperator``) on exactly the variables K-FAC factors (the
  LayerNormalization and position-embedding variables left out, as
  ``other_variables="exclude"`` leaves them out of K-FAC): its top-5 eigenvalues
  (``spectra.eigenvalues(G, k=5, tol=1e-4)``, with their error bounds), Hutchinson's
  trace (100 products) ± its standard error and ``spectra.logdet(G, damping=1e-3)`` ± its
  standard error, each with its time, products and data passes;
* K-FAC and EKFAC (type-2, ``conv="expand"``, ``tied_embeddings="output"`` for GPT-2):
  their exact top-5 eigenvalues, trace and log det(K + 1e-3 I), the build time and the
  build time as a ratio to one compiled gradient of the loss (median of paired timings).

    python benchmarks/language_models.py [--quick] [--repeats 5] [--json out.json]
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

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import spectra  # noqa: E402
from spectra.operators.curvature import variable_name  # noqa: E402

VOCABULARY, LENGTH, HIDDEN, CLASSES = 64, 8, 16, 3
DAMPING = 1e-3
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def gpt2(examples: int) -> tuple[keras.Model, tuple, dict]:
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=HIDDEN,
        intermediate_dim=2 * HIDDEN,
        max_sequence_length=LENGTH,
        dropout=0.0,
    )
    inputs = {
        name: keras.Input((LENGTH,), dtype="int32", name=name)
        for name in ("token_ids", "padding_mask")
    }
    model = keras.Model(inputs, backbone.token_embedding(backbone(inputs), reverse=True))
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, VOCABULARY, (examples, LENGTH)).astype("int32"),
        "padding_mask": np.ones((examples, LENGTH), "int32"),
    }
    y = rng.integers(0, VOCABULARY, (examples, LENGTH))
    return model, (x, y), {"tied_embeddings": "output"}


def bert(examples: int) -> tuple[keras.Model, tuple, dict]:
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=HIDDEN,
        intermediate_dim=2 * HIDDEN,
        max_sequence_length=LENGTH,
        num_segments=2,
        dropout=0.0,
    )
    inputs = {
        name: keras.Input((LENGTH,), dtype="int32", name=name)
        for name in ("token_ids", "segment_ids", "padding_mask")
    }
    head = keras.layers.Dense(CLASSES, name="head")
    model = keras.Model(inputs, head(backbone(inputs)["pooled_output"]))
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, VOCABULARY, (examples, LENGTH)).astype("int32"),
        "segment_ids": rng.integers(0, 2, (examples, LENGTH)).astype("int32"),
        "padding_mask": np.ones((examples, LENGTH), "int32"),
    }
    return model, (x, rng.integers(0, CLASSES, examples)), {}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def counted(op, fn):
    """fn() with its seconds, and the products and data passes of ``op`` it spent."""
    hvps, passes = op.num_hvps, op.num_data_passes
    out, seconds = timed(fn)
    return out, seconds, op.num_hvps - hvps, op.num_data_passes - passes


def bench_model(name, model, data, options, repeats: int) -> dict:
    x, y = data
    variables = [v.value for v in model.trainable_variables]
    xt = {k: tf.constant(v) for k, v in x.items()}
    yt = tf.constant(y)

    @tf.function
    def gradient_fn(xb, yb):
        with tf.GradientTape() as tape:
            value = LOSS(yb, model(xb, training=False))
        return tf.concat([tf.reshape(g, [-1]) for g in tape.gradient(value, variables)], 0)

    def gradient():
        return gradient_fn(xt, yt).numpy()

    gradient()  # trace once
    rows: dict[str, dict] = {}
    approximations = {}
    for label, cls in (("K-FAC", spectra.KFACOperator), ("EKFAC", spectra.EKFACOperator)):
        ratios, seconds = [], []
        for _ in range(repeats):
            _, tg = timed(gradient)
            op, tb = timed(
                lambda cls=cls: cls.from_keras(
                    model, LOSS, data, other_variables="exclude", **options
                )
            )
            ratios.append(tb / tg)
            seconds.append(tb)
        approximations[label] = op
        # The operator spans every trainable variable, the excluded ones with eigenvalue
        # 0: its log-determinant on the factored variables drops their log δ each.
        excluded = op.shape[0] - sum(block.size for block in op.blocks)
        rows[label] = {
            "top5": [float(v) for v in op.eigenvalues()[:5]],
            "trace": op.trace(),
            "logdet": op.logdet(DAMPING) - excluded * np.log(DAMPING),
            "build_s": statistics.median(seconds),
            "build_x_gradient": statistics.median(ratios),
        }
    # The GGN on exactly the variables the blocks factor (kernels and biases, by name).
    factored = {n for b in approximations["K-FAC"].blocks for n in (b.kernel, b.bias) if n}
    chosen = [v for v in model.trainable_variables if variable_name(v) in factored]
    ggn = spectra.GGNOperator.from_keras(model, LOSS, data, variables=chosen)
    assert ggn.shape[0] == sum(b.size for b in approximations["K-FAC"].blocks)
    eig, t_eig, p_eig, d_eig = counted(ggn, lambda: spectra.eigenvalues(ggn, k=5, tol=1e-4))
    tr, t_tr, p_tr, d_tr = counted(ggn, lambda: spectra.trace(ggn, num_products=100))
    ld, t_ld, p_ld, d_ld = counted(ggn, lambda: spectra.logdet(ggn, damping=DAMPING))
    rows["GGN"] = {
        "top5": [float(v) for v in eig.eigenvalues],
        "top5_error_bounds": [float(b) for b in eig.error_bounds],
        "trace": tr.estimate,
        "trace_stderr": tr.stderr,
        "logdet": ld.estimate,
        "logdet_stderr": ld.stderr,
        "seconds": {"eigenvalues": t_eig, "trace": t_tr, "logdet": t_ld},
        "products": {"eigenvalues": p_eig, "trace": p_tr, "logdet": p_ld},
        "data_passes": {"eigenvalues": d_eig, "trace": d_tr, "logdet": d_ld},
    }
    _, tg = timed(gradient)
    n = ggn.shape[0]
    total = model.count_params()
    print(
        f"\n{name}: {n:,} factored parameters of {total:,} ({len(y)} sequences of {LENGTH}, "
        f"one batch); compiled gradient {tg * 1e3:.1f} ms"
    )
    g = rows["GGN"]
    print("  GGN (estimated)")
    bounds = ", ".join(f"{v:.4g}±{b:.1g}" for v, b in zip(g["top5"], g["top5_error_bounds"]))
    print(f"    top-5    {bounds}")
    print(f"             {t_eig:.2f} s, {p_eig} products, {d_eig} data passes")
    print(
        f"    trace    {g['trace']:.4g} ± {g['trace_stderr']:.2g}   "
        f"{t_tr:6.2f} s, {p_tr} products, {d_tr} data passes"
    )
    print(
        f"    logdet   {g['logdet']:.5g} ± {g['logdet_stderr']:.2g} (δ = {DAMPING:g})   "
        f"{t_ld:6.2f} s, {p_ld} products, {d_ld} data passes"
    )
    header = f"{'top-5 (exact)':52s} {'trace':>9s} {'logdet':>10s} {'build s':>8s}"
    print(f"  {'':6s} {header} {'x grad':>7s}")
    for label in ("K-FAC", "EKFAC"):
        r = rows[label]
        top = ", ".join(f"{v:.4g}" for v in r["top5"])
        print(
            f"  {label:6s} {top:52s} {r['trace']:9.4g} {r['logdet']:10.5g} "
            f"{r['build_s']:8.2f} {r['build_x_gradient']:7.0f}"
        )
    return {
        "parameters": total,
        "factored_parameters": n,
        "examples": len(y),
        "gradient_s": tg,
        "damping": DAMPING,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 build per operator")
    parser.add_argument("--repeats", type=int, default=3, help="paired build timings")
    parser.add_argument("--examples", type=int, default=32, help="sequences per model")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--models", default="gpt2,bert", help="comma-separated: gpt2,bert")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    repeats = 1 if args.quick else args.repeats
    print(
        f"spectra {spectra.__version__}, TensorFlow {tf.__version__}, one thread, "
        f"{os.cpu_count()} CPU cores, {platform.machine()}, {repeats} builds per operator"
    )
    results: dict = {"tensorflow": tf.__version__, "cpu_count": os.cpu_count()}
    for name in args.models.split(","):
        if name == "gpt2":
            model, data, options = gpt2(args.examples)
            title = "GPT-2 causal LM (tied embedding, logits (batch, 8, 64))"
        elif name == "bert":
            model, data, options = bert(args.examples)
            title = "BERT classifier (pooled output, Dense head of 3)"
        else:
            parser.error(f"unknown model {name!r}; choose from gpt2, bert")
        results[name] = bench_model(title, model, data, options, repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
