"""spectra's JAX engine where the accelerator is: ResNet-20 and the small GPT on one device.

Runs under ``KERAS_BACKEND=jax`` with TensorFlow not installed (the machines with GPUs that
this project can borrow have JAX, not TensorFlow), on whatever device JAX has: a GPU when
there is one, else the CPU (``--quick`` there). Models and data are those of
``benchmarks/scale.py`` (``benchmarks/models.py``: ResNet-20 at initialisation with
calibrated BatchNorm statistics on seeded CIFAR-shaped data; the 2-layer GPT, d = 128, on
random token sequences), with the mean sparse cross-entropy of the logits.

Rows, for each configuration, in one process, each timed as a median over ``--repeats``
after one untimed call (compiles happen there):

* ``gradient``: a compiled (``jax.jit``) gradient of the dataset loss, Σ_b (n_b/N) ∇L_b,
  with the batches' results summed on the device — the unit of every ratio;
* ``reference product``: a hand-written compiled forward-over-reverse product
  ``jax.jvp(jax.grad(L_b), (θ,), (v,))`` per batch, recomputing everything per call
  (what a user writes without spectra);
* ``matvec``, ``block per vector``: ``spectra.HessianOperator``'s cached product (the
  forward pass and gradient linearized once per batch and kept), one vector and a block
  of ``--block`` vectors, per vector;
* ``top-1 tol 1e-3 / 1e-6``: ``spectra.eigenvalues(op, k=1, tol=...)`` (products, seconds
  and the certified bound);
* ``trace``: Hutchinson with ``--trace-products`` products; ``density``: stochastic
  Lanczos quadrature, one probe of ``--density-steps`` steps.

Peak device memory (``memory_stats()["peak_bytes_in_use"]``, where the device keeps
statistics: GPUs do, the CPU does not) after each configuration, and the bytes that cross
between host and device: products stay on the device, and only the vectors the
estimators ask for (n values in, n out per product) cross, counted from the operator's
product counter.

    KERAS_BACKEND=jax python benchmarks/gpu.py [--quick] [--configs resnet20:1024:256,...]
        [--repeats 3] [--block 16] [--trace-products 100] [--density-steps 100]
        [--json out.json]

On a GPU machine without network access (see docs/benchmarks.md for the exact command),
carry the ``keras`` wheel and its small dependencies (``namex``, ``optree``); JAX is
there. Not measured on a GPU yet: docs/benchmarks.md says so until it is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's spectra, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

# (model, examples, batch size).
FULL = [("resnet20", 1024, 256), ("resnet20", 4096, 512), ("gpt", 512, 128)]
QUICK = [("resnet20", 64, 32), ("gpt", 16, 8)]


def parse_configs(text: str) -> list[tuple[str, int, int]]:
    """``model:examples:batch_size`` items, comma-separated (argparse ``type``)."""
    configs = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or parts[0] not in ("resnet20", "gpt"):
            raise argparse.ArgumentTypeError(
                f"expected model:examples:batch_size with model resnet20 or gpt; got {item!r}"
            )
        try:
            examples, batch = int(parts[1]), int(parts[2])
        except ValueError as err:
            message = f"examples and batch size are integers: {item!r}"
            raise argparse.ArgumentTypeError(message) from err
        if examples < 1 or batch < 1:
            raise argparse.ArgumentTypeError(f"examples and batch size are positive: {item!r}")
        configs.append((parts[0], examples, batch))
    return configs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU: a few minutes)")
    parser.add_argument("--configs", type=parse_configs, help="model:examples:batch_size,...")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per row (3)")
    parser.add_argument("--block", type=int, help="block size (16; quick 4)")
    parser.add_argument("--trace-products", type=int, help="Hutchinson products (100; quick 10)")
    parser.add_argument("--density-steps", type=int, help="SLQ steps (100; quick 10)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    quick = args.quick
    args.configs = args.configs or (QUICK if quick else FULL)
    args.block = args.block or (4 if quick else 16)
    args.trace_products = args.trace_products or (10 if quick else 100)
    args.density_steps = args.density_steps or (10 if quick else 100)
    return args


def _timed(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one untimed call; ``fn``
    returns what it computed, and the clock stops when that is ready."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_device_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def _model_and_data(name: str, examples: int) -> tuple[Any, np.ndarray, np.ndarray]:
    import models

    if name == "resnet20":
        x, y = models.cifar_like(examples)
        model = models.resnet20()
        models.calibrate_batchnorm(model, x[: min(examples, 256)])
    else:
        x, y = models.token_sequences(examples)
        model = models.gpt()
    return model, x, y


def _loss_functions(model: Any, x: np.ndarray, y: np.ndarray, batch: int) -> dict[str, Any]:
    """The compiled gradient and the hand-written forward-over-reverse product of the
    dataset loss, batch by batch, summed on the device with the weights n_b/N."""
    import jax
    import jax.numpy as jnp
    import keras

    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def batch_loss(params: list[Any], xb: Any, yb: Any) -> Any:
        logits, _ = model.stateless_call(params, fixed, xb, training=False)
        return cross_entropy(yb, logits)

    gradient = jax.jit(jax.grad(batch_loss))

    @jax.jit
    def product(params: list[Any], xb: Any, yb: Any, v: list[Any]) -> Any:
        return jax.jvp(lambda p: jax.grad(batch_loss)(p, xb, yb), (params,), (v,))[1]

    n = len(x)
    batches = [
        (jnp.asarray(x[i : i + batch]), jnp.asarray(y[i : i + batch]), min(batch, n - i) / n)
        for i in range(0, n, batch)
    ]

    def weighted_sum(fn: Any) -> Any:
        total = None
        for xb, yb, weight in batches:
            part = jax.tree_util.tree_map(lambda a, w=weight: a * w, fn(xb, yb))
            total = part if total is None else jax.tree_util.tree_map(jnp.add, total, part)
        return total

    tangent = [jnp.ones_like(p) for p in trainable]
    return {
        "gradient": lambda: weighted_sum(lambda xb, yb: gradient(trainable, xb, yb)),
        "reference": lambda: weighted_sum(lambda xb, yb: product(trainable, xb, yb, tangent)),
        "num_parameters": int(sum(int(np.prod(p.shape)) for p in trainable)),
    }


def run_config(name: str, examples: int, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import keras

    import spectra

    keras.utils.clear_session()
    model, x, y = _model_and_data(name, examples)
    baseline = _loss_functions(model, x, y, batch)
    n = baseline["num_parameters"]
    row: dict[str, Any] = {
        "model": name,
        "examples": examples,
        "batch_size": batch,
        "parameters": n,
        "device": str(jax.devices()[0]),
    }
    gradient = _timed(baseline["gradient"], args.repeats)
    row["gradient_s"] = gradient
    row["reference_product"] = _timed(baseline["reference"], args.repeats) / gradient

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    start = time.perf_counter()
    op = spectra.HessianOperator.from_keras(model, loss, (x, y), batch_size=batch)
    row["build_s"] = time.perf_counter() - start
    rng = np.random.default_rng(0)
    v = rng.standard_normal(n).astype(op.dtype)
    block = rng.standard_normal((n, args.block)).astype(op.dtype)
    row["matvec"] = _timed(lambda: op.matvec(v), args.repeats) / gradient
    row["block_per_vector"] = _timed(lambda: op.matmat(block), args.repeats) / (
        args.block * gradient
    )
    row["cached_batches"] = op.num_cached_batches
    row["streamed_batches"] = op.num_streamed_batches
    for tol in (1e-3, 1e-6):
        before, start = op.num_hvps, time.perf_counter()
        result = spectra.eigenvalues(op, k=1, tol=tol, progress=False)
        row[f"top1_{tol:g}"] = {
            "seconds": time.perf_counter() - start,
            "gradients": (time.perf_counter() - start) / gradient,
            "products": op.num_hvps - before,
            "eigenvalue": float(result.eigenvalues[0]),
            "bound": float(result.error_bounds[0]),
        }
    start = time.perf_counter()
    spectra.trace(op, num_products=args.trace_products, progress=False)
    row["trace_gradients"] = (time.perf_counter() - start) / gradient
    start = time.perf_counter()
    spectra.spectral_density(op, num_steps=args.density_steps, num_probes=1, progress=False)
    row["density_gradients"] = (time.perf_counter() - start) / gradient
    # n values in and n out per product, in the operator's dtype.
    row["host_device_bytes"] = 2 * op.num_hvps * n * np.dtype(op.dtype).itemsize
    row["products"] = op.num_hvps
    row["peak_device_bytes"] = _peak_device_bytes()
    return row


def _summary(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: one column per configuration, ratios to the compiled gradient."""
    head = [f"{r['model']} {r['examples']}/{r['batch_size']}" for r in rows]
    lines = ["| | " + " | ".join(head) + " |", "|---" * (len(rows) + 1) + "|"]

    def line(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    line("device", [r["device"] for r in rows])
    line("parameters", [f"{r['parameters']:,}" for r in rows])
    line("gradient (s)", [f"{r['gradient_s']:.4g}" for r in rows])
    line("reference jvp(grad) product / gradient", [f"{r['reference_product']:.2f}" for r in rows])
    line("spectra matvec / gradient", [f"{r['matvec']:.2f}" for r in rows])
    line("spectra block, per vector / gradient", [f"{r['block_per_vector']:.2f}" for r in rows])
    for tol in ("0.001", "1e-06"):
        line(
            f"top-1 tol {tol}: gradients (products)",
            [f"{r[f'top1_{tol}']['gradients']:.1f} ({r[f'top1_{tol}']['products']})" for r in rows],
        )
    line("trace / gradient", [f"{r['trace_gradients']:.1f}" for r in rows])
    line("density / gradient", [f"{r['density_gradients']:.1f}" for r in rows])
    line("host-device bytes", [f"{r['host_device_bytes']:,}" for r in rows])
    line(
        "peak device memory",
        [
            "n/a" if r["peak_device_bytes"] is None else f"{r['peak_device_bytes'] / 2**30:.2f} GiB"
            for r in rows
        ],
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit("benchmarks/gpu.py runs on Keras' JAX backend: set KERAS_BACKEND=jax.")
    rows = []
    for name, examples, batch in args.configs:
        print(f"{name}: {examples} examples, batches of {batch}", flush=True)
        rows.append(run_config(name, examples, batch, args))
    table = _summary(rows)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "table": table}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
