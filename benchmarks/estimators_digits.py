"""Estimators on the Hessian of the trained digits MLP 64-256-256-10 (full batch).

Top-1 to a relative 1e-6 (the sharpness call), repeated over seeds: products, data
passes and wall time, also in units of one Hessian-vector product timed in the same run
(what the eigensolve costs beyond its products: the fixed costs per call). Then the
top-5 eigenvalues by each method (with residual norms ‖Hv − λv‖, error bounds, failure
probability, products and data passes), and the trace by each method at 100 products
(with its standard error), with wall times, on ``data/digits_mlp.keras`` and
``data/digits.npz`` (1797 examples, one batch, 85,002 parameters).

Then the tolerance sweep: top-1 and top-5 by Lanczos at tol 1e-1, 1e-2, 1e-3 and 1e-6
(products, wall time, the certified relative bound and the relative error against a
tol-1e-8 reference), beside a PyHessian-style power iteration on the same operator
(Rayleigh quotient, stopping when its relative change is below 1e-3, at most 100
products, as in ``benchmarks/pyhessian_compare.py``): products and relative error at
PyHessian's own accuracy, without torch.

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
from spectra.io.checkpoints import load_model
from spectra.io.datasets import load_data

ROOT = Path(__file__).resolve().parents[1]


def top1(op: spectra.HessianOperator, tol: float, repeats: int) -> dict:
    """Top-1 to ``tol`` over ``repeats`` seeds, timed against single products."""
    vectors = np.random.default_rng(0).standard_normal((op.shape[0], 3)).astype(op.dtype)
    op.matvec(vectors[:, 0])  # warm: traced and cached
    runs, product_times = [], []
    for seed in range(repeats):
        start = time.perf_counter()
        op.matvec(vectors[:, 1 + seed % 2])
        product_times.append(time.perf_counter() - start)
        result = spectra.eigenvalues(op, k=1, tol=tol, seed=seed, progress=False)
        runs.append(result)
    product = float(np.median(product_times))
    products = [r.num_products for r in runs]
    walls = [r.wall_time for r in runs]
    summary = {
        "tol": tol,
        "products": products,
        "data_passes": [r.num_operator_calls for r in runs],
        "wall_times": walls,
        "product_time": product,
        "wall_in_products": [w / product for w in walls],
        "eigenvalues": [float(r.eigenvalues[0]) for r in runs],
        "error_bounds": [float(r.error_bounds[0]) for r in runs],
        "failure_probability": runs[0].failure_probability,
    }
    print(
        f"top-1 to tol {tol:g} over {repeats} seeds: {np.mean(products):.1f} products, "
        f"{np.mean(summary['data_passes']):.1f} data passes, {np.mean(walls):.3f} s "
        f"= {np.mean(summary['wall_in_products']):.1f} product times "
        f"(one product {1e3 * product:.1f} ms); λ₁ = {runs[0].eigenvalues[0]:.7f} "
        f"± {runs[0].error_bounds[0]:.1e} (failure probability {runs[0].failure_probability})\n"
    )
    return summary


def pyhessian_power(op, seed: int, tol: float = 1e-3, max_iter: int = 100):
    """(estimate, products) of PyHessian's power iteration (Yao et al. 2020): Gaussian
    start, Rayleigh quotient vᵀHv, stop when its relative change is below ``tol``."""
    vector = np.random.default_rng(seed).standard_normal(op.shape[0])
    vector /= np.linalg.norm(vector) + 1e-6
    estimate = None
    for products in range(1, max_iter + 1):
        image = np.asarray(op.matvec(vector.astype(op.dtype)), dtype=np.float64)
        value = float(image @ vector)
        vector = image / (np.linalg.norm(image) + 1e-6)
        if estimate is not None and abs(estimate - value) / (abs(estimate) + 1e-6) < tol:
            return value, products
        estimate = value
    return estimate, max_iter


def tolerance_sweep(op: spectra.HessianOperator, repeats: int) -> dict:
    """Products and time of Lanczos at loose and tight tol against PyHessian's power
    iteration at its default tol 1e-3, errors against a tol-1e-8 reference."""
    reference = spectra.eigenvalues(op, k=5, tol=1e-8, seed=1234, progress=False)
    truth = reference.eigenvalues
    print(
        f"\ntolerance sweep over {repeats} seeds (reference λ₁..λ₅ = "
        f"{np.array2string(truth, precision=6)}, bounds <= {reference.error_bounds.max():.1e})"
    )
    sweep: dict = {"reference": truth.tolist(), "lanczos": [], "power": {}}
    for k in (1, 5):
        for tol in (1e-1, 1e-2, 1e-3, 1e-6):
            runs = [
                spectra.eigenvalues(op, k=k, tol=tol, seed=seed, progress=False)
                for seed in range(repeats)
            ]
            errors = [float(np.max(np.abs(r.eigenvalues - truth[:k]) / truth[:k])) for r in runs]
            bounds = [float(np.max(r.error_bounds / np.abs(r.eigenvalues))) for r in runs]
            row = {
                "k": k,
                "tol": tol,
                "products": [r.num_products for r in runs],
                "wall_times": [r.wall_time for r in runs],
                "relative_bounds": bounds,
                "relative_errors": errors,
                "converged": all(r.all_converged for r in runs),
            }
            sweep["lanczos"].append(row)
            print(
                f"  lanczos k={k} tol {tol:<6g} products {row['products']}  "
                f"{np.mean(row['wall_times']):.2f} s  bound/|λ| <= {max(bounds):.1e}  "
                f"error/|λ| <= {max(errors):.1e}  converged {row['converged']}"
            )
    power, walls = [], []
    for seed in range(repeats):
        start = time.perf_counter()
        power.append(pyhessian_power(op, seed))
        walls.append(time.perf_counter() - start)
    errors = [abs(value - truth[0]) / truth[0] for value, _ in power]
    sweep["power"] = {
        "products": [products for _, products in power],
        "wall_times": walls,
        "relative_errors": errors,
    }
    print(
        f"  PyHessian-style power, top-1 at its tol 1e-3: products "
        f"{sweep['power']['products']}  {np.mean(walls):.2f} s  error/|λ| "
        f"{', '.join(f'{e:.1e}' for e in errors)} (no bound)"
    )
    return sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--float64", action="store_true", help="products in float64")
    parser.add_argument("--tol", type=float, default=1e-6, help="eigenvalue tolerance")
    parser.add_argument("--repeats", type=int, default=5, help="seeds of the top-1 timing")
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
    report: dict = {"dtype": str(op.dtype), "top1": {}, "eigenvalues": {}, "trace": {}}
    report["top1"] = top1(op, args.tol, args.repeats)
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
        print(f"      failure probability {result.failure_probability}")
        report["eigenvalues"][method] = result.to_dict(include_vectors=False)
    print("\ntrace at 100 products")
    for method in ("hutchinson", "hutch++", "xtrace"):
        result = spectra.trace(op, method=method, num_products=100, seed=0, progress=False)
        print(
            f"  {method:10s} {result.estimate:12.4f} ± {result.stderr:9.4f}  "
            f"({result.num_products} products, {result.wall_time:.2f} s)"
        )
        report["trace"][method] = result.to_dict()
    report["tolerance_sweep"] = tolerance_sweep(op, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
