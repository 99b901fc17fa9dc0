"""The TensorFlow and JAX engines side by side: each product's cost against its own
backend's compiled gradient, on the same ``.keras`` models.

Models: the trained digits MLP of ``data/`` (64-256-256-10, 85,002 parameters, softmax
output) and a small CNN (8x8x1 → Conv2D 16 → Conv2D 16 → Dense 10 logits, 5,274
parameters, saved once by the TensorFlow run and loaded by the JAX run), both on the 1,797
digits in one batch, float32. Rows, per backend:

* ``gradient``: a compiled gradient of the mean loss (``tf.function`` of a
  ``GradientTape``; ``jax.jit(jax.grad)`` of ``model.stateless_call``), the unit;
* ``Hessian matvec``, ``GGN matvec``: spectra's cached products (``HessianOperator``,
  ``GGNOperator``), per vector;
* ``Hessian block of 16``: ``matmat`` of 16 vectors, per vector.

Each product is timed alternately with its backend's gradient and the median of the
paired ratios is reported (so that a busy machine affects both sides alike). Each backend
runs in its own process (Keras' backend is fixed at import): TensorFlow in this
interpreter's environment, JAX in ``--jax-python`` (default ``.venv-jax/bin/python``,
made by ``make test-jax``; the JAX side is skipped in one line when there is none).

    python benchmarks/backends.py [--repeats 15] [--jax-python PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("gradient_ms", "hessian_matvec", "ggn_matvec", "hessian_block16")
LABELS = {
    "gradient_ms": "gradient (ms)",
    "hessian_matvec": "Hessian matvec / gradient",
    "ggn_matvec": "GGN matvec / gradient",
    "hessian_block16": "Hessian block of 16, per vector / gradient",
}


# -- the child: one backend ------------------------------------------------------------
def _models(directory: Path) -> dict[str, Path]:
    """The ``.keras`` files of both models; the CNN is built and saved here when missing
    (by the first backend that runs, TensorFlow)."""
    import keras

    cnn = directory / "cnn.keras"
    if not cnn.exists():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
                keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
                keras.layers.Flatten(),
                keras.layers.Dense(10),
            ]
        )
        model.save(cnn)
    return {"digits_mlp": ROOT / "data" / "digits_mlp.keras", "cnn": cnn}


def _gradient(model: Any, loss: Any, x: Any, y: Any) -> Any:
    """A compiled gradient of the mean loss, returning when its values are ready."""
    backend = keras_backend()
    if backend == "jax":
        import jax

        trainable = [v.value for v in model.trainable_variables]
        fixed = [v.value for v in model.non_trainable_variables]

        def value(params: list[Any]) -> Any:
            out, _ = model.stateless_call(params, fixed, x, training=False)
            return loss(y, out)

        grad = jax.jit(jax.grad(value))
        return lambda: jax.block_until_ready(grad(trainable))
    import tensorflow as tf

    @tf.function
    def grad() -> Any:
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=False))
        return tape.gradient(value, model.trainable_variables)

    return lambda: [g.numpy() for g in grad()]


def keras_backend() -> str:
    import keras

    return keras.backend.backend()


def _paired_ratio(product: Any, gradient: Any, repeats: int, per: int = 1) -> float:
    """Median over ``repeats`` of (product time / per) / gradient time, timed alternately
    after one untimed call of each."""
    product(), gradient()
    ratios = []
    for _ in range(repeats):
        start = time.perf_counter()
        gradient()
        g = time.perf_counter() - start
        start = time.perf_counter()
        product()
        ratios.append((time.perf_counter() - start) / per / g)
    return statistics.median(ratios)


def _measure_model(model: Any, loss: Any, inputs: Any, y: Any, repeats: int) -> dict[str, float]:
    import numpy as np

    import spectra

    gradient = _gradient(model, loss, inputs, y)
    start = time.perf_counter()
    for _ in range(repeats):
        gradient()
    row = {"gradient_ms": 1e3 * (time.perf_counter() - start) / repeats}
    rng = np.random.default_rng(0)
    data = (inputs, y)
    hessian = spectra.HessianOperator.from_keras(model, loss, data, batch_size=len(y))
    ggn = spectra.GGNOperator.from_keras(model, loss, data, batch_size=len(y))
    v = rng.standard_normal(hessian.shape[0]).astype(np.float32)
    block = rng.standard_normal((hessian.shape[0], 16)).astype(np.float32)
    row["hessian_matvec"] = _paired_ratio(lambda: hessian.matvec(v), gradient, repeats)
    row["ggn_matvec"] = _paired_ratio(lambda: ggn.matvec(v), gradient, repeats)
    row["hessian_block16"] = _paired_ratio(
        lambda: hessian.matmat(block), gradient, max(3, repeats // 3), per=16
    )
    row["parameters"] = float(hessian.shape[0])
    return row


def measure(directory: Path, repeats: int) -> dict[str, dict[str, float]]:
    """The rows of this process's backend, per model."""
    import keras
    import numpy as np

    with np.load(ROOT / "data" / "digits.npz") as data:
        x, y = data["x"].astype(np.float32), data["y"]
    rows: dict[str, dict[str, float]] = {}
    for name, path in _models(directory).items():
        model = keras.models.load_model(path, compile=False)
        if name == "cnn":
            inputs = x.reshape(len(x), 8, 8, 1)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        else:
            inputs, loss = x, keras.losses.SparseCategoricalCrossentropy()
        rows[name] = _measure_model(model, loss, inputs, y, repeats)
    return rows


# -- the driver: both backends -----------------------------------------------------------
def _run_backend(python: str, backend: str, directory: Path, repeats: int) -> dict[str, Any]:
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    command = [python, __file__, "--child", str(directory), "--repeats", str(repeats)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {backend} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(results: dict[str, dict[str, Any]]) -> str:
    models = list(next(iter(results.values())))
    head = [f"{model} ({backend})" for model in models for backend in results]
    lines = ["| | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for key in ROWS:
        cells = []
        for model in models:
            for backend in results:
                value = results[backend][model][key]
                cells.append(f"{value:.2f}" if key != "gradient_ms" else f"{value:.1f}")
        lines.append(f"| {LABELS[key]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--jax-python", default=str(ROOT / ".venv-jax" / "bin" / "python"))
    parser.add_argument("--json", type=Path, help="write both backends' rows here")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.child is not None:
        print(json.dumps(measure(args.child, args.repeats)))
        return 0
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as directory:
        results["tensorflow"] = _run_backend(
            sys.executable, "tensorflow", Path(directory), args.repeats
        )
        if Path(args.jax_python).exists():
            results["jax"] = _run_backend(args.jax_python, "jax", Path(directory), args.repeats)
        else:
            print(f"JAX side skipped: no {args.jax_python} (make test-jax makes .venv-jax).")
    print(_table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
