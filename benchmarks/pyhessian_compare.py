"""spectra against a PyHessian-style power iteration, on the same trained model and data.

The PyHessian-style side is written here from the PyHessian paper (Yao, Gholami, Keutzer
& Mahoney 2020, "PyHessian: Neural networks through the lens of the Hessian") and its
documented defaults, in PyTorch: one full batch; the loss and its gradient computed once
with the gradient graph kept (``torch.autograd.grad(loss, params, create_graph=True)``);
then power iteration from a Gaussian start, each Hessian-vector product one
``torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)``, the Rayleigh
quotient vᵀHv as the estimate, stopping when its relative change is below ``tol = 1e-3``
or after ``maxIter = 100`` products.

spectra's side: ``spectra.eigenvalues(op, k=1, tol=1e-6)`` (Lanczos with certified and
probabilistic bounds) on a ``HessianOperator`` of the Keras model. The reference λ₁ is
spectra's certified value (its bound is printed); the PyHessian-style answer's relative
error is taken against it.

Models (the torch twins get the Keras weights, and their losses are checked to agree to
1e-6 before anything is timed):

* ``mlp``: ``data/digits_mlp.keras`` (64-256-256-10, ReLU, softmax output with Keras'
  sparse categorical cross-entropy, i.e. cross-entropy of the logits) on all 1797
  examples of ``data/digits.npz``.
* ``cnn``: a small residual CNN (conv 3x3x16, one residual block of two 3x3x16 convs,
  global average pooling, dense 10), trained here for a few seeded epochs on the same
  data.

Timing: both frameworks get the same number of threads (``--threads``, default 1: TF's
intra- and inter-op pools, torch's intra- and inter-op threads). One thread each is the
robust comparison on a shared machine: with 2 threads on 2 busy cores, PyTorch's OpenMP
threads wait for each other and its products slow down several times, which would
flatter spectra. The two solvers are
timed alternately, one run of each per repeat with the same seed index, in one process,
and medians over the repeats are reported, so that a busy machine affects both sides
alike. "solve" is the eigensolve alone, after each side's per-batch setup (PyHessian's
loss and gradient graph; spectra's cache fill); "setup" is that setup, timed the same
way. PyTorch is an optional dependency of this benchmark only:

    pip install torch==2.13.0          # a CPU build is enough
    python benchmarks/pyhessian_compare.py [--threads 1] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# Seconds of rest before each timed call: the thread pools of the framework that ran last
# (TensorFlow's and OpenMP's) spin-wait for a while after their work and would slow the
# other one down.
PAUSE = 0.25
# Products timed alone per repeat and side (the unit of "product times").
PRODUCTS = 5
INSTALL_HINT = (
    "This benchmark compares spectra with a PyHessian-style power iteration written in "
    "PyTorch, which is not installed. Install it with\n"
    "    pip install torch==2.13.0\n"
    "(a CPU build is enough) and run it again."
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="threads of each framework")
    parser.add_argument("--repeats", type=int, default=7, help="alternating timed runs")
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp,cnn")
    parser.add_argument("--tol", type=float, default=1e-6, help="spectra's tolerance")
    parser.add_argument("--json", help="also write the results to this JSON file")
    return parser.parse_args()


# -- the PyHessian-style power iteration --------------------------------------------------
class PowerIterationHessian:
    """Top Hessian eigenvalue by power iteration on one full batch (PyHessian's method).

    ``setup`` computes the loss and keeps the graph of its gradient; each product is a
    second backward through that graph.
    """

    def __init__(self, torch, model, loss_fn, inputs, targets):
        self.torch = torch
        self.model = model
        self.loss_fn = loss_fn
        self.inputs = inputs
        self.targets = targets
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads = None
        self.loss = None

    def setup(self) -> None:
        self.loss = self.loss_fn(self.model(self.inputs), self.targets)
        self.grads = self.torch.autograd.grad(self.loss, self.params, create_graph=True)

    def product(self, vectors):
        return self.torch.autograd.grad(
            self.grads, self.params, grad_outputs=vectors, retain_graph=True
        )

    def _dot(self, left, right) -> float:
        return float(sum(self.torch.sum(a * b) for a, b in zip(left, right)))

    def _normalized(self, vectors):
        norm = self._dot(vectors, vectors) ** 0.5
        return [v / (norm + 1e-6) for v in vectors]

    def top_eigenvalue(
        self,
        seed: int,
        max_iter: int = 100,
        tol: float = 1e-3,
        target: tuple[float, float] | None = None,
    ):
        """(estimate, products): power iteration from a seeded Gaussian start.

        Each iteration is one product w = Hv of the unit iterate v; the estimate is the
        Rayleigh quotient θ = vᵀHv and the next iterate w/‖w‖. It stops at the first product
        where θ's relative change |θ_prev − θ| / (|θ_prev| + 1e-6) is below ``tol``
        (PyHessian's test), or, with ``target=(reference, tolerance)``, instead at the first
        product where |θ − reference| ≤ tolerance: an oracle rule (it knows the answer, so
        it stops as early as any rule could at that accuracy, which favours the power
        iteration in a comparison at equal accuracy); in either case after ``max_iter``
        products at most. With a target, it was reached iff |estimate − reference| ≤
        tolerance. The run's Rayleigh quotients are left in ``self.history``. Cost: one
        product per iteration.
        """
        if max_iter < 1:
            raise ValueError(f"max_iter must be at least 1, got {max_iter}")
        if target is not None and not (np.isfinite(target).all() and target[1] >= 0):
            raise ValueError(
                f"target must be (reference, tolerance), both finite and tolerance >= 0, got "
                f"{target!r}: pass spectra's value and its finite error bound"
            )
        generator = self.torch.Generator().manual_seed(seed)
        vectors = self._normalized(
            [self.torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in self.params]
        )
        history: list[float] = []
        self.history = history
        for _ in range(max_iter):
            image = self.product(vectors)
            value = self._dot(image, vectors)
            history.append(value)
            vectors = self._normalized(image)
            if target is not None:
                if abs(value - target[0]) <= target[1]:
                    break
            elif len(history) > 1:
                previous = history[-2]
                if abs(previous - value) / (abs(previous) + 1e-6) < tol:
                    break
        return history[-1], len(history)


# -- the models -------------------------------------------------------------------------------
def digits_data():
    from spectra.io.datasets import load_data

    data = load_data(str(ROOT / "data" / "digits.npz"))
    x, y = data.as_tuple()[:2]
    return np.asarray(x, np.float32), np.asarray(y, np.int64)


def mlp_pair(torch, keras, x, y):
    """The trained Keras MLP and its torch twin (same weights, logits out)."""
    from spectra.io.checkpoints import load_model

    model = load_model(ROOT / "data" / "digits_mlp.keras")
    dense = [layer for layer in model.layers if layer.weights]
    modules = []
    for index, layer in enumerate(dense):
        kernel, bias = (np.asarray(w) for w in layer.get_weights())
        linear = torch.nn.Linear(kernel.shape[0], kernel.shape[1])
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(kernel.T.copy()))
            linear.bias.copy_(torch.from_numpy(bias))
        modules.append(linear)
        activation = layer.get_config()["activation"]
        if index < len(dense) - 1:
            if activation != "relu":
                raise SystemExit(f"unexpected hidden activation {activation!r}")
            modules.append(torch.nn.ReLU())
        elif activation != "softmax":
            raise SystemExit(f"unexpected output activation {activation!r}")
    # Keras' sparse categorical cross-entropy of a softmax output is computed from the
    # logits (the softmax's input), i.e. PyTorch's cross-entropy of the logits.
    return model, torch.nn.Sequential(*modules), "sparse_categorical_crossentropy"


def residual_cnn_pair(torch, keras, x, y):
    """A small residual CNN trained here (seeded) and its torch twin."""
    keras.utils.set_random_seed(0)
    images = x.reshape(-1, 8, 8, 1)
    inputs = keras.Input((8, 8, 1))
    stem = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    branch = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(stem)
    branch = keras.layers.Conv2D(16, 3, padding="same")(branch)
    merged = keras.layers.Activation("relu")(keras.layers.Add()([stem, branch]))
    pooled = keras.layers.GlobalAveragePooling2D()(merged)
    logits = keras.layers.Dense(10)(pooled)
    model = keras.Model(inputs, logits, name="residual_cnn")
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(images, y, batch_size=64, epochs=15, verbose=0, shuffle=True)

    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    (dense,) = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]

    def conv_twin(layer):
        kernel, bias = (np.asarray(w) for w in layer.get_weights())
        conv = torch.nn.Conv2d(kernel.shape[2], kernel.shape[3], 3, padding=1)
        with torch.no_grad():
            conv.weight.copy_(torch.from_numpy(kernel.transpose(3, 2, 0, 1).copy()))
            conv.bias.copy_(torch.from_numpy(bias))
        return conv

    class ResidualCNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.first, self.second = (conv_twin(layer) for layer in convs)
            kernel, bias = (np.asarray(w) for w in dense.get_weights())
            self.head = torch.nn.Linear(kernel.shape[0], kernel.shape[1])
            with torch.no_grad():
                self.head.weight.copy_(torch.from_numpy(kernel.T.copy()))
                self.head.bias.copy_(torch.from_numpy(bias))

        def forward(self, batch):
            images = batch.reshape(-1, 8, 8, 1).permute(0, 3, 1, 2)
            stem = torch.relu(self.stem(images))
            branch = self.second(torch.relu(self.first(stem)))
            merged = torch.relu(stem + branch)
            return self.head(merged.mean(dim=(2, 3)))

    spectra_model = keras.Sequential([keras.Input((64,)), keras.layers.Reshape((8, 8, 1)), model])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return spectra_model, ResidualCNN(), loss


# -- one comparison ---------------------------------------------------------------------------
def compare(name, keras_model, torch_model, loss, torch, x, y, args) -> dict:
    import spectra

    inputs, targets = torch.from_numpy(x), torch.from_numpy(y)
    power = PowerIterationHessian(
        torch, torch_model, torch.nn.functional.cross_entropy, inputs, targets
    )
    power.setup()
    op = spectra.HessianOperator.from_keras(keras_model, loss, (x, y))
    torch_loss = float(power.loss.detach())
    loss_gap = abs(op.loss() - torch_loss)
    flat = torch.cat([g.reshape(-1) for g in power.grads]).detach().numpy()
    gradient_gap = float(np.linalg.norm(op.gradient() - reorder(flat, op, torch_model, name)))
    gradient_gap /= float(np.linalg.norm(flat))
    print(
        f"\n{name}: {op.shape[0]:,} parameters, {len(y)} examples (one batch); "
        f"loss spectra {op.loss():.8f}, torch {torch_loss:.8f} (|Δ| {loss_gap:.1e}); "
        f"gradients differ by {gradient_gap:.1e} (relative)"
    )
    if not loss_gap <= 1e-6:
        raise SystemExit(f"{name}: the two models' losses differ by {loss_gap:.2e} > 1e-6")
    reference = spectra.eigenvalues(op, k=1, tol=args.tol, seed=1234, progress=False)
    lam, bound = float(reference.eigenvalues[0]), float(reference.error_bounds[0])

    def setup_spectra():
        op.reset_cache()
        op.loss()

    power_runs, spectra_runs, power_setup, spectra_setup = [], [], [], []
    power_product, spectra_product = [], []
    torch_vector = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) for p in power.params
    ]
    vector = np.random.default_rng(5).standard_normal(op.shape[0]).astype(op.dtype)
    power.product(torch_vector)  # warm both sides
    spectra.eigenvalues(op, k=1, tol=args.tol, seed=999, progress=False)
    for repeat in range(args.repeats):
        power_product.append(timed(lambda: power.product(torch_vector), PRODUCTS) / PRODUCTS)
        spectra_product.append(timed(lambda: op.matvec(vector), PRODUCTS) / PRODUCTS)
        power_setup.append(timed(power.setup))
        spectra_setup.append(timed(setup_spectra))
        time.sleep(PAUSE)
        start = time.perf_counter()
        value, products = power.top_eigenvalue(seed=repeat)
        power_runs.append((time.perf_counter() - start, products, value))
        time.sleep(PAUSE)
        start = time.perf_counter()
        result = spectra.eigenvalues(op, k=1, tol=args.tol, seed=repeat, progress=False)
        spectra_runs.append(
            (
                time.perf_counter() - start,
                result.num_products,
                float(result.eigenvalues[0]),
                result.num_operator_calls,
                float(result.error_bounds[0]),
                result.failure_probability,
            )
        )
    ratios = [s[0] / p[0] for s, p in zip(spectra_runs, power_runs)]
    totals = [
        (s[0] + ss) / (p[0] + ps)
        for s, p, ss, ps in zip(spectra_runs, power_runs, spectra_setup, power_setup)
    ]
    errors = [abs(p[2] - lam) / abs(lam) for p in power_runs]
    spectra_errors = [abs(s[2] - lam) for s in spectra_runs]
    row = {
        "parameters": int(op.shape[0]),
        "threads": args.threads,
        "lambda_1": lam,
        "lambda_1_bound": bound,
        "pyhessian_style": {
            "seconds": statistics.median(p[0] for p in power_runs),
            "products": statistics.median(p[1] for p in power_runs),
            "relative_error_median": statistics.median(errors),
            "relative_error_max": max(errors),
            "setup_seconds": statistics.median(power_setup),
            "product_seconds": statistics.median(power_product),
        },
        "spectra": {
            "seconds": statistics.median(s[0] for s in spectra_runs),
            "products": statistics.median(s[1] for s in spectra_runs),
            "data_passes": statistics.median(s[3] for s in spectra_runs),
            "max_error_vs_reference": max(spectra_errors),
            "error_bound": statistics.median(s[4] for s in spectra_runs),
            "failure_probability": spectra_runs[0][5],
            "setup_seconds": statistics.median(spectra_setup),
            "product_seconds": statistics.median(spectra_product),
        },
        "ratio_solve": statistics.median(ratios),
        "ratio_with_setup": statistics.median(totals),
    }
    ph, sp = row["pyhessian_style"], row["spectra"]
    ph["product_times"] = ph["seconds"] / ph["product_seconds"]
    sp["product_times"] = sp["seconds"] / sp["product_seconds"]
    print(f"  spectra's certified λ₁ = {lam:.7f} ± {bound:.1e}")
    print(
        f"  PyHessian-style: {ph['products']:.0f} products, {1e3 * ph['seconds']:.1f} ms; "
        f"relative error {ph['relative_error_median']:.1e} (median), "
        f"{ph['relative_error_max']:.1e} (max); setup {1e3 * ph['setup_seconds']:.1f} ms; "
        f"one product {1e3 * ph['product_seconds']:.1f} ms, the solve "
        f"{ph['product_times']:.1f} product times"
    )
    print(
        f"  spectra tol {args.tol:g}: {sp['products']:.0f} products, {sp['data_passes']:.0f} "
        f"data passes, {1e3 * sp['seconds']:.1f} ms; bound {sp['error_bound']:.1e}, failure "
        f"probability {sp['failure_probability']}; setup {1e3 * sp['setup_seconds']:.1f} ms; "
        f"one product {1e3 * sp['product_seconds']:.1f} ms, the solve "
        f"{sp['product_times']:.1f} product times"
    )
    print(
        f"  spectra / PyHessian-style wall time (median of paired ratios over "
        f"{args.repeats} repeats): solve {row['ratio_solve']:.2f}x, "
        f"with setup {row['ratio_with_setup']:.2f}x"
    )
    return row


def reorder(flat, op, torch_model, name):
    """The torch gradient in spectra's parameter order and layout (Keras kernels)."""
    pieces, at = [], 0
    for p in torch_model.parameters():
        size = p.numel()
        value = flat[at : at + size].reshape(tuple(p.shape))
        at += size
        if value.ndim == 2:
            value = value.T  # Linear (out, in) -> Dense (in, out)
        elif value.ndim == 4:
            value = value.transpose(2, 3, 1, 0)  # Conv2d (out, in, h, w) -> (h, w, in, out)
        pieces.append(value.reshape(-1))
    return np.concatenate(pieces)


def timed(fn, times: int = 1) -> float:
    time.sleep(PAUSE)
    start = time.perf_counter()
    for _ in range(times):
        fn()
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    try:
        import torch
    except ImportError:
        print(INSTALL_HINT)
        sys.exit(0)
    import keras
    import tensorflow as tf

    import spectra

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(args.threads)
    print(
        f"spectra {spectra.__version__}, TensorFlow {tf.__version__}, PyTorch "
        f"{torch.__version__}; {args.threads} thread(s) each; {os.cpu_count()} CPU cores; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    x, y = digits_data()
    builders = {"mlp": mlp_pair, "cnn": residual_cnn_pair}
    report = {}
    for name in args.models.split(","):
        keras_model, torch_model, loss = builders[name](torch, keras, x, y)
        report[name] = compare(name, keras_model, torch_model, loss, torch, x, y, args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
