"""K-FAC products and inverses on ResNet-50's layers against an exact Hessian product.

A K-FAC product costs Σ_l 2 d_a d_out (d_a + d_out) flops, independent of the data (for
Keras' ResNet-50: 54 Conv2D/Dense blocks, 25.5M parameters, 156 GFLOP per vector, the
3×3×512 convolutions' A of 4,609 × 4,609 dominating); an exact Hessian product costs
about four forward passes per example (ResNet-50 at 224 × 224: about 4 GMAC forward). So
the two meet at a few images, and K-FAC is the cheaper product on any batch beyond.

For Keras' ``ResNet50(weights=None)`` in float32, in one process, all threads:

* K-FAC on that model's Conv2D and Dense layers with random symmetric factors of their
  exact shapes (a product's cost does not depend on the values; ``--build`` builds the real
  factors from the data instead, which takes minutes and about 13 GB): products of 1 and
  ``--block`` vectors (per vector) with NumPy and with the compiled TensorFlow function
  (``KroneckerProducts``, what ``KFACOperator`` uses where TensorFlow has a GPU), and
  the damped inverse's products (eigen form, four matrix products per block) in the
  default place, after its eigendecompositions;
* ``HessianOperator.matvec`` on ``--images`` synthetic images (224 × 224, 1,000
  classes, random labels), the BatchNorm layers in inference mode;
* the ratios, the operator's ``memory_plan()`` and the machine's load average.

    python benchmarks/kfac_large_layers.py [--images 8] [--block 8] [--repeats 3]
        [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import json
import statistics
import time

import keras
import numpy as np

import spectra
from spectra.operators import kfac as kfac_module
from spectra.operators.kfac import KFACOperator
from spectra.operators.kfac_blocks import KFACBlock


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=8, help="images of the Hessian (8)")
    parser.add_argument("--block", type=int, default=8, help="vectors of a block product (8)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per row (median; 3)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    return parser.parse_args(argv)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kfac_of_shapes(model: keras.Model, seed: int = 0) -> KFACOperator:
    """A K-FAC operator over the model's Conv2D and Dense kernels and biases, with random
    symmetric factors of their exact shapes (float32 products)."""
    rng = np.random.default_rng(seed)
    blocks, names, shapes = [], [], []
    start = 0
    for layer in model.layers:
        if not isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense)):
            continue
        kernel = tuple(layer.kernel.shape)
        d_in, d_out = int(np.prod(kernel[:-1])), int(kernel[-1])
        d_a = d_in + (1 if layer.use_bias else 0)
        A = rng.standard_normal((d_a, d_a))
        G = rng.standard_normal((d_out, d_out))
        kernel_slice = slice(start, start + d_in * d_out)
        start += d_in * d_out
        bias_slice = None
        names.append(layer.kernel.path)
        shapes.append(kernel)
        if layer.use_bias:
            bias_slice = slice(start, start + d_out)
            start += d_out
            names.append(layer.bias.path)
            shapes.append((d_out,))
        blocks.append(
            KFACBlock(
                layer.name, (A + A.T) / 2, (G + G.T) / 2, names[-1], None, kernel_slice, bias_slice
            )
        )
    return KFACOperator(blocks, names, shapes, np.float32)


def main() -> None:
    args = parse_args()
    load = os.getloadavg()[0]
    model = keras.applications.ResNet50(weights=None)
    op = kfac_of_shapes(model)
    flops = sum(2 * b.A.shape[0] * b.G.shape[0] * (b.A.shape[0] + b.G.shape[0]) for b in op.blocks)
    print(
        f"ResNet-50: {len(op.blocks)} K-FAC blocks, {op.shape[0]:,} parameters, "
        f"{flops / 1e9:.0f} GFLOP per K-FAC product; load {load:.2f}"
    )
    rng = np.random.default_rng(1)
    v = rng.standard_normal(op.shape[0]).astype(np.float32)
    V = rng.standard_normal((op.shape[0], args.block)).astype(np.float32)
    rows: dict[str, float] = {}
    for where, in_tensorflow in (("numpy", False), ("tensorflow", True)):
        kfac_module.PRODUCTS_IN_TENSORFLOW = in_tensorflow
        op._compiled = None
        op.matvec(v)  # trace (TensorFlow) and warm up
        rows[f"kfac_matvec_{where}_s"] = timed(lambda: op.matvec(v), args.repeats)
        rows[f"kfac_block_{where}_s_per_vector"] = (
            timed(lambda: op.matmat(V), args.repeats) / args.block
        )
        print(
            f"  {where}: matvec {rows[f'kfac_matvec_{where}_s']:.2f} s, block of {args.block} "
            f"{rows[f'kfac_block_{where}_s_per_vector']:.2f} s per vector",
            flush=True,
        )
    kfac_module.PRODUCTS_IN_TENSORFLOW = None
    op._compiled = None
    start = time.perf_counter()
    inverse = op.inverse(1e-3 * float(op.eigenvalues()[0]))
    rows["inverse_setup_s"] = time.perf_counter() - start
    inverse.matvec(v)
    rows["inverse_matvec_s"] = timed(lambda: inverse.matvec(v), args.repeats)
    plan = op.memory_plan(args.block)
    print(plan)

    images = rng.uniform(0, 1, (args.images, 224, 224, 3)).astype(np.float32)
    labels = rng.integers(0, 1000, args.images)
    hessian = spectra.HessianOperator.from_keras(
        model, "sparse_categorical_crossentropy", (images, labels), batch_size=args.images
    )
    u = rng.standard_normal(hessian.shape[0]).astype(np.float32)  # BatchNorm's too
    hessian.matvec(u)  # trace and cache
    rows["hessian_matvec_s"] = timed(lambda: hessian.matvec(u), args.repeats)
    ratios = {
        "kfac_matvec_numpy": rows["kfac_matvec_numpy_s"] / rows["hessian_matvec_s"],
        "kfac_matvec_tensorflow": rows["kfac_matvec_tensorflow_s"] / rows["hessian_matvec_s"],
        "kfac_block_numpy_per_vector": rows["kfac_block_numpy_s_per_vector"]
        / rows["hessian_matvec_s"],
        "kfac_block_tensorflow_per_vector": rows["kfac_block_tensorflow_s_per_vector"]
        / rows["hessian_matvec_s"],
        "inverse_matvec": rows["inverse_matvec_s"] / rows["hessian_matvec_s"],
    }
    print(f"\n| product (ResNet-50, {args.images} images, float32) | seconds | / Hessian product |")
    print("|---|---:|---:|")
    print(f"| Hessian matvec | {rows['hessian_matvec_s']:.2f} | 1 |")
    for label, key, ratio in (
        ("K-FAC matvec, NumPy", "kfac_matvec_numpy_s", "kfac_matvec_numpy"),
        ("K-FAC matvec, TensorFlow", "kfac_matvec_tensorflow_s", "kfac_matvec_tensorflow"),
        (
            f"K-FAC block of {args.block}, NumPy, per vector",
            "kfac_block_numpy_s_per_vector",
            "kfac_block_numpy_per_vector",
        ),
        (
            f"K-FAC block of {args.block}, TensorFlow, per vector",
            "kfac_block_tensorflow_s_per_vector",
            "kfac_block_tensorflow_per_vector",
        ),
        ("(K-FAC + δI)⁻¹ matvec", "inverse_matvec_s", "inverse_matvec"),
    ):
        print(f"| {label} | {rows[key]:.2f} | {ratios[ratio]:.2f} |")
    print(
        f"\ninverse's eigendecompositions: {rows['inverse_setup_s']:.1f} s; load after "
        f"{os.getloadavg()[0]:.2f}"
    )
    if args.json:
        report = {
            "images": args.images,
            "block": args.block,
            "parameters": op.shape[0],
            "gflop_per_kfac_product": flops / 1e9,
            "seconds": rows,
            "ratios_to_hessian_matvec": ratios,
            "memory_plan": {
                "peak": plan.peak,
                "factors": plan.factors,
                "copies": plan.product_copies,
            },
            "load": [load, os.getloadavg()[0]],
        }
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
