"""benchmarks/scale.py's command line and summary, and the PyHessian-style power iteration's
stopping rules (benchmarks/pyhessian_compare.py) against a dense eigendecomposition. No
TensorFlow: the benchmark itself takes minutes and is run by hand."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(
        f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scale():
    path = list(sys.path)
    yield _load("scale")
    sys.path[:] = path  # scale.py puts the checkout first on sys.path


@pytest.fixture(scope="module")
def pyhessian_compare():
    return _load("pyhessian_compare")


# -- the command line -------------------------------------------------------------------------
def test_defaults_are_the_full_run(scale):
    args = scale.parse_args([])
    assert args.configs == scale.FULL
    assert (args.trace_products, args.density_steps, args.power_max) == (100, 100, 100)
    assert (args.repeats, args.estimator_repeats, args.block) == (3, 3, 16)
    assert scale.modes_for("resnet20", args) == scale.MODES
    assert scale.modes_for("gpt", args) == scale.MODES


def test_quick_and_explicit_options_override_it(scale):
    args = scale.parse_args(["--quick"])
    assert args.configs == scale.QUICK
    assert (args.trace_products, args.density_steps, args.power_max) == (10, 10, 30)
    assert (args.estimator_repeats, args.block) == (1, 4)
    assert scale.modes_for("resnet20", args) == ("default", "streaming")
    assert scale.modes_for("gpt", args) == ("default",)
    argv = ["--quick", "--configs", "resnet20:1024:256,gpt:512:128", "--trace-products", "7"]
    argv += ["--density-steps", "5", "--power-max", "60", "--modes", "recompute,default"]
    args = scale.parse_args(argv)
    assert args.configs == [("resnet20", 1024, 256), ("gpt", 512, 128)]
    assert (args.trace_products, args.density_steps, args.power_max) == (7, 5, 60)
    assert scale.modes_for("gpt", args) == ("recompute", "default")
    assert scale.modes_for("resnet20", scale.parse_args(["--modes", "none"])) == ()
    assert scale.format_configs(args.configs) == "resnet20:1024:256,gpt:512:128"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--configs", "resnet20:1024"],
            "argument --configs: malformed item 'resnet20:1024': expected "
            "model:examples:batch_size",
        ),
        (["--configs", "resnet20:1024:256,"], "argument --configs: malformed item ''"),
        (["--configs", "resnet20:-4:2"], "malformed item 'resnet20:-4:2'"),
        (
            ["--configs", "gpt:512:128,resnet50:256:64"],
            "argument --configs: unknown model 'resnet50' in 'resnet50:256:64': expected one "
            "of resnet20, resnet18, gpt",
        ),
        (["--configs", "gpt:0:1"], "item 'gpt:0:1': examples and batch size must be at least 1"),
        (
            ["--configs", "gpt:64:128"],
            "item 'gpt:64:128': batch size 128 exceeds the 64 examples",
        ),
        (["--modes", "default,fast"], "argument --modes: unknown mode 'fast' in 'default,fast'"),
        (["--modes", "none,default"], "none (no memory subprocess) cannot be combined"),
        (
            ["--trace-products", "1"],
            "argument --trace-products: expected an integer of at least 2, got '1'",
        ),
        (["--power-max", "many"], "argument --power-max: expected an integer of at least 1"),
        (["--density-steps", "0"], "argument --density-steps: expected an integer of at least 1"),
    ],
)
def test_bad_options_are_one_parser_error(scale, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        scale.parse_args(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert message in errors[0]


# -- the power iteration's stopping rules -----------------------------------------------------
@pytest.fixture(scope="module")
def quadratic(pyhessian_compare):
    """The power iteration on ½·mean((Xw − t)²): its Hessian is XᵀX/n = V diag(eigs) Vᵀ."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    eigs = np.array([5.0, 3.0, 2.0, 1.0, 0.5, 0.1])
    n, d = 20, eigs.size
    U = np.linalg.qr(rng.standard_normal((n, d)))[0]
    V = np.linalg.qr(rng.standard_normal((d, d)))[0]
    X = np.sqrt(n) * U @ np.diag(np.sqrt(eigs)) @ V.T
    hessian = X.T @ X / n
    model = torch.nn.Linear(d, 1, bias=False).double()

    def loss(out, targets):
        return 0.5 * ((out[:, 0] - targets) ** 2).mean()

    inputs = torch.from_numpy(X)
    targets = torch.from_numpy(rng.standard_normal(n))
    power = pyhessian_compare.PowerIterationHessian(torch, model, loss, inputs, targets)
    power.setup()
    return torch, power, hessian


def _dense_rayleigh_quotients(torch, power, hessian, seed: int, steps: int) -> np.ndarray:
    """The Rayleigh quotients of power iteration on the dense Hessian from the same start."""
    generator = torch.Generator().manual_seed(seed)
    (start,) = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in power.params]
    v = start.numpy().reshape(-1)
    v = v / (np.linalg.norm(v) + 1e-6)
    quotients = []
    for _ in range(steps):
        w = hessian @ v
        quotients.append(v @ w)
        v = w / (np.linalg.norm(w) + 1e-6)
    return np.array(quotients)


def test_target_stops_at_the_first_product_within_the_tolerance(quadratic):
    torch, power, hessian = quadratic
    top = np.linalg.eigh(hessian)[0][-1]
    np.testing.assert_allclose(top, 5.0, rtol=1e-12)
    # PyHessian normalises by ‖w‖ + 1e-6, so θ settles about 2e-6 below λ (in the dense
    # iteration too): a tolerance of 1e-5 is reachable, 1e-7 would not be.
    tolerance = 1e-5
    value, products = power.top_eigenvalue(3, max_iter=200, target=(top, tolerance))
    dense = _dense_rayleigh_quotients(torch, power, hessian, 3, products)
    np.testing.assert_allclose(power.history, dense, rtol=1e-12)
    assert abs(value - top) <= tolerance
    assert all(abs(theta - top) > tolerance for theta in power.history[:-1])
    # The relative-change test alone stops far earlier and far less accurately.
    early, early_products = power.top_eigenvalue(3, max_iter=200, tol=1e-3)
    assert early_products < products
    assert abs(early - top) > tolerance


def test_target_not_reached_runs_to_the_cap(quadratic):
    torch, power, hessian = quadratic
    top = np.linalg.eigh(hessian)[0][-1]
    value, products = power.top_eigenvalue(3, max_iter=3, target=(top, 1e-10))
    assert products == 3 and len(power.history) == 3
    assert abs(value - top) > 1e-10
    np.testing.assert_allclose(
        power.history, _dense_rayleigh_quotients(torch, power, hessian, 3, 3), rtol=1e-12
    )


def test_relative_change_rule_is_unchanged(quadratic):
    _, power, _ = quadratic
    tol = 1e-4
    value, products = power.top_eigenvalue(5, max_iter=100, tol=tol)
    history = power.history
    changes = [abs(a - b) / (abs(a) + 1e-6) for a, b in itertools.pairwise(history)]
    assert products == len(history) < 100 and value == history[-1]
    assert changes[-1] < tol and all(change >= tol for change in changes[:-1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_iter": 0}, "max_iter must be at least 1"),
        ({"target": (5.0, float("nan"))}, "target must be (reference, tolerance)"),
        ({"target": (float("inf"), 1e-3)}, "both finite"),
        ({"target": (5.0, -1.0)}, "tolerance >= 0"),
    ],
)
def test_bad_stopping_arguments(quadratic, kwargs, message):
    _, power, _ = quadratic
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        power.top_eigenvalue(0, **kwargs)


# -- the summary ------------------------------------------------------------------------------
def _runs(reached: tuple[bool, ...]) -> dict:
    """Two estimator repeats of every key, with PyHessian rows."""
    runs: dict = {}
    for r, hit in enumerate(reached):
        runs.setdefault("top1_1e-06", []).append((10.0 + r, 12, 5.0, 2e-6))
        runs.setdefault("pyhessian_top1_1e-06", []).append((4.0, 6, 4.9999, None))
        extra = {"target": 2e-6, "reached": hit, "closest": 1e-6 if hit else 3e-3}
        runs.setdefault("pyhessian_top1_1e-06_equal_accuracy", []).append(
            (20.0 + r, 40 if hit else 60, 4.999999 if hit else 4.997, extra)
        )
        runs.setdefault("top1_0.001", []).append((8.0, 10, 5.0, 1e-3))
        runs.setdefault("pyhessian_top1_0.001", []).append((4.0, 5, 4.99, None))
        extra = {"target": 1e-3, "reached": True, "closest": 5e-4}
        runs.setdefault("pyhessian_top1_0.001_equal_accuracy", []).append((5.0, 8, 4.9995, extra))
        runs.setdefault("trace", []).append((3.0, 10, 100.0, 2.0))
        runs.setdefault("pyhessian_trace", []).append((6.0, 10, 101.0, None))
        runs.setdefault("density", []).append((2.0, 10, 5.0, None))
        runs.setdefault("pyhessian_density", []).append((8.0, 10, 5.0, None))
    return runs


def test_summarize_runs_ratios(scale):
    est = scale.summarize_runs(_runs((True, True)), 5.0, 60)
    assert est["top1_1e-06"]["x_pyhessian"] == pytest.approx(10.5 / 4.0)
    assert est["top1_1e-06"]["x_pyhessian_equal_accuracy"] == pytest.approx(10.5 / 20.5)
    assert est["top1_0.001"]["x_pyhessian_equal_accuracy"] == pytest.approx(8.0 / 5.0)
    assert est["pyhessian_top1_1e-06_equal_accuracy"]["relative_error"] == pytest.approx(2e-7)
    assert est["trace"]["x_pyhessian"] == pytest.approx(0.5)
    assert est["density"]["x_pyhessian"] == pytest.approx(0.25)
    # One repeat short of the target: no ratio, only its upper bound.
    est = scale.summarize_runs(_runs((True, False)), 5.0, 60)
    equal = est["pyhessian_top1_1e-06_equal_accuracy"]
    assert equal["reached"] is False and equal["closest"] == 3e-3 and equal["power_max"] == 60
    assert est["top1_1e-06"]["x_pyhessian_equal_accuracy"] is None
    assert est["top1_1e-06"]["x_pyhessian_equal_accuracy_at_most"] == pytest.approx(10.5 / 20.5)


def _row(scale, model: str, runs: dict | None) -> dict:
    row = {
        "model": model,
        "examples": 1024,
        "batch_size": 256,
        "parameters": 272474,
        "seconds": {"gradient": 6.0, "matvec": 9.0, "block": 12.0},
        "matvec_x_gradient": 1.5,
        "block_x_gradient": 2.0,
        "block_k": 16,
        "cache_fill_seconds": 7.0,
        "plan": {"peak_mib": 8000.0, "budget_mib": 9600.0},
        "memory": {},
        "lambda_1": 5.0,
        "lambda_1_bound": 2e-6,
        "load_before": (1.5, 1.0, 1.0),
        "load_after": (2.25, 1.0, 1.0),
    }
    if runs is None:  # no PyHessian side
        runs = {k: v for k, v in _runs((True,)).items() if not k.startswith("pyhessian")}
    else:
        row["memory"] = {"default": {"peak_mib": 5368.4, "budget_mib": 9550.0}}
        row["lambda_1_twin"], row["lambda_1_twin_bound"] = 4.99996, 3e-6
    row["estimators"] = scale.summarize_runs(runs, 5.0, 60)
    return row


def test_summary_table(scale):
    rows = [_row(scale, "resnet20", _runs((True, False))), _row(scale, "gpt", None)]
    table = scale.summary(rows)
    assert table["columns"] == ["resnet20, 1,024 (256 per batch)", "gpt, 1,024 (256 per batch)"]
    lines = table["markdown"].splitlines()
    assert lines[0] == "| | resnet20, 1,024 (256 per batch) | gpt, 1,024 (256 per batch) |"
    assert lines[1] == "|---|---:|---:|"
    cells = table["rows"]
    assert len(lines) == 2 + len(cells)
    assert cells["matvec (x gradient)"] == ["9.00 s (1.50x)"] * 2
    assert cells["block of 16, per vector (x gradient)"] == ["12.00 s (2.00x)"] * 2
    assert cells["peak memory, default mode / operator's budget"] == [
        "5,368 MiB / 9,550 MiB",
        "not measured / 9,600 MiB",
    ]
    assert cells["λ₁ (tol 1e-6, certified bound)"] == ["5 ± 2.0e-06"] * 2
    assert cells["λ₁ of the PyHessian side's twin (Lanczos on its products)"] == [
        "4.99996 ± 3.0e-06",
        "—",
    ]
    assert cells["top-1, tol 1e-6"] == ["10.50 s, 12 products", "10.00 s, 12 products"]
    assert cells["top-1, tol 1e-6: x PyHessian at its own tol"] == [
        "2.62x (6 products, rel. error 2.0e-05)",
        "—",
    ]
    assert cells["top-1, tol 1e-6: x PyHessian at equal accuracy"] == [
        "not reached in 60 products (≤ 0.51x; closest 3.0e-03 of ± 2.0e-06)",
        "—",
    ]
    assert cells["top-1, tol 1e-3: x PyHessian at equal accuracy"][0] == (
        "1.60x (8 products to ± 1.0e-03)"
    )
    assert cells["trace (x PyHessian, same products)"] == [
        "3.00 s, 10 products, 0.50x",
        "3.00 s, 10 products",
    ]
    assert cells["load average before / after"] == ["1.50 / 2.25"] * 2
    assert "| density (x PyHessian, same products) | 2.00 s, 10 products, 0.25x |" in lines[-2]
