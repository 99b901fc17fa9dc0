"""Where a Hessian product's time goes, by op type, against a gradient's.

For ResNet-20 (256 CIFAR-shaped images) and the small GPT (128 sequences), both from
``benchmarks/models.py``, this times the engine's compiled loss-and-gradient part and
its apply part for one vector (the vector-dependent second backward, fed by the cached
frontier) op by op: each part's graph is run in a ``tf.compat.v1.Session`` with one
intra- and one inter-op thread and ``FULL_TRACE`` step statistics, three times, and the
ops' times are summed by type. It prints the share of the convolutions and matrix
products (the arithmetic a product cannot avoid) and of the elementwise rest, and their
ratios between the apply part and the gradient.

The floor this measures against: an exact Hessian-vector product through a layer
``z = conv(x, W)`` needs, with the forward pass and gradient cached, the tangent
``conv(ẋ, W) + conv(x, Ẇ)`` and the tangents of both backward products
(``conv_input_grad(ġ, W) + conv_input_grad(g, Ẇ)`` and ``conv_filter_grad(ẋ, g) +
conv_filter_grad(x, ġ)``): six convolutions against the gradient's three, so about
twice the gradient's convolution time whatever the implementation (a Gauss-Newton
product needs four).

    python benchmarks/product_ops.py [--models resnet20,gpt] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's spectra, not an installed one
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

EXAMPLES = {"resnet20": 256, "gpt": 128}
ARITHMETIC = ("Conv", "MatMul", "Einsum")
REPEATS = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="resnet20,gpt", help="comma-separated: resnet20, gpt (default both)"
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in EXAMPLES]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {sorted(EXAMPLES)}")
    return args


def op_times(function, args: list[np.ndarray]) -> tuple[float, dict[str, tuple[float, int]]]:
    """(median wall seconds, {op type: (seconds per run, ops per run)}) of a concrete
    function's graph, run in a one-thread session with step statistics."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(function.graph.as_graph_def(), name="")
        outputs = [graph.get_tensor_by_name(t.name) for t in function.graph.outputs]
        feeds = {graph.get_tensor_by_name(p.name): a for p, a in zip(function.graph.inputs, args)}
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=1, inter_op_parallelism_threads=1
    )
    seconds: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    walls = []
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(outputs, feeds)
        for _ in range(REPEATS):
            options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
            metadata = tf.compat.v1.RunMetadata()
            started = time.perf_counter()
            session.run(outputs, feeds, options=options, run_metadata=metadata)
            walls.append(time.perf_counter() - started)
            for device in metadata.step_stats.dev_stats:
                for node in device.node_stats:
                    label = node.timeline_label
                    kind = label.split(" = ")[1].split("(")[0] if " = " in label else "?"
                    seconds[kind] += node.all_end_rel_micros / 1e6
                    counts[kind] += 1
    ops = {k: (seconds[k] / REPEATS, counts[k] // REPEATS) for k in seconds}
    return statistics.median(walls), ops


def split_arithmetic(ops: dict[str, tuple[float, int]]) -> tuple[float, float]:
    """(seconds of convolutions and matrix products, seconds of everything else)."""
    arithmetic = sum(s for k, (s, _) in ops.items() if any(a in k for a in ARITHMETIC))
    return arithmetic, sum(s for s, _ in ops.values()) - arithmetic


def profile(name: str) -> dict:
    import scale

    import spectra
    from spectra.operators.engine import _pick

    model, (x, y), loss = scale.build(name, EXAMPLES[name])
    op = spectra.HessianOperator.from_keras(model, loss, (x, y), batch_size=len(x), cache=True)
    op.loss()
    engine, cache = op._engine, op._caches[0].cache
    index, batch, _, replica = next(iter(op._batches.assigned()))
    inputs = [np.asarray(t) for t in op._inputs(index, batch, replica)]
    vector = np.random.default_rng(0).standard_normal((1, op.shape[0])).astype(op.dtype)
    frontier = [np.asarray(_pick(cache, s)) for s in engine._single_sources]
    parts = {
        "gradient": op_times(engine._loss_and_gradient_fn, inputs),
        "apply, one vector": op_times(engine._single_fn, [*frontier, vector]),
    }
    print(f"\n{name}: {op.shape[0]:,} parameters, {len(x)} examples, one thread")
    result: dict = {"parameters": op.shape[0], "examples": len(x)}
    for part, (wall, ops) in parts.items():
        arithmetic, rest = split_arithmetic(ops)
        total = arithmetic + rest
        print(
            f"  {part}: {wall:.3f} s wall; ops {total:.3f} s, of which convolutions and "
            f"matrix products {arithmetic:.3f} s ({100 * arithmetic / total:.0f}%)"
        )
        for kind, (seconds, count) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:8]:
            print(f"    {kind:34s} {seconds:7.3f} s {100 * seconds / total:5.1f}%  {count} ops")
        result[part] = {"wall": wall, "arithmetic": arithmetic, "rest": rest, "ops": ops}
    g, a = result["gradient"], result["apply, one vector"]
    ratios = {
        "wall": a["wall"] / g["wall"],
        "arithmetic": a["arithmetic"] / g["arithmetic"],
        "rest": a["rest"] / g["rest"],
    }
    result["apply_x_gradient"] = ratios
    print(
        f"  apply / gradient: {ratios['wall']:.2f}x wall, {ratios['arithmetic']:.2f}x "
        f"convolutions and matrix products, {ratios['rest']:.2f}x the rest"
    )
    return result


def main() -> None:
    args = parse_args()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    print(f"load average {os.getloadavg()[0]:.2f}")
    report = {name: profile(name) for name in args.models}
    print(f"load average after {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
