"""Estimators on the Hessian of the trained digits MLP 64-256-256-10 (full batch).

Top-5 eigenvalues by each method (with residual norms ‖Hv − λv‖, eigenvalue error bounds,
products and data passes), and the trace by each method at 100 products (with its
standard error), with wall times, on ``data/digits_mlp.keras`` and ``data/digits.npz``
(1797 examples, one batch, 85,002 parameters).

    python benchmarks/estimators_digits.py [--float64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

import spectra
from spectra.checkpoints import load_model
from spectra.datasets import load_data

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--float64", action="store_true", help="products in float64")
    parser.add_argument("--tol", type=float, default=1e-6, help="eigenvalue tolerance")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    model = load_model(ROOT / "data" / "digits_mlp.keras")
    data = load_data(str(ROOT / "data" / "digits.npz"))
    op = spectra.HessianOperator.from_keras(
        model,
        "sparse_categorical_crossentropy",
        data.as_tuple(),
        dtype=np.float64 if args.float64 else None,
    )
    start = time.perf_counter()
    print(f"loss {op.loss():.5f}; first pass (cache fill) {time.perf_counter() - start:.2f} s")
    print(f"{op.shape[0]:,} parameters, {op.num_examples} examples, {op.dtype} products\n")
    report: dict = {"dtype": str(op.dtype), "eigenvalues": {}, "trace": {}}
    print(f"top-5 eigenvalues, tol {args.tol:g}")
    for method in ("lanczos", "power", "lobpcg"):
        passes = op.num_data_passes
        result = spectra.eigenvalues(op, k=5, method=method, tol=args.tol, seed=0, progress=False)
        passes = op.num_data_passes - passes
        print(
            f"  {method:8s} {result.num_products:5d} products {passes:5d} passes "
            f"{result.wall_time:7.2f} s  converged {int(result.converged.sum())}/5"
        )
        for value, residual, bound in zip(
            result.eigenvalues, result.residual_norms, result.error_bounds
        ):
            print(f"      λ = {value:12.6f}   ‖Hv−λv‖ = {residual:.2e}   bound {bound:.2e}")
        report["eigenvalues"][method] = result.to_dict(include_vectors=False)
    print("\ntrace at 100 products")
    for method in ("hutchinson", "hutch++", "xtrace"):
        result = spectra.trace(op, method=method, num_products=100, seed=0, progress=False)
        print(
            f"  {method:10s} {result.estimate:12.4f} ± {result.stderr:9.4f}  "
            f"({result.num_products} products, {result.wall_time:.2f} s)"
        )
        report["trace"][method] = result.to_dict()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
