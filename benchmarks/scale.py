"""spectra at scale: ResNet-20, ResNet-18 and a small GPT, against PyHessian on ResNet-20.

Models and data are in ``benchmarks/models.py`` (synthetic, seeded CIFAR-shaped images
with random labels, and random token sequences; weights at initialisation, BatchNorm
statistics calibrated on the data). For every configuration, in one process:

* ``gradient``: a compiled (``tf.function``) gradient of the mean loss, to numpy;
* ``matvec`` and ``block``: ``HessianOperator.matvec`` and ``matmat`` of k vectors per
  vector, in the operator's default mode (``cache="auto"``: the batches that fit half the
  memory budget are cached, the others streamed), each timed alternately with a gradient
  (median of the paired ratios);
* ``top-1``: ``spectra.eigenvalues(op, k=1, tol=...)`` at tol 1e-6 and 1e-3;
* ``trace``: Hutchinson with a fixed number of products (100; ``--trace-products``);
* ``density``: stochastic Lanczos quadrature (one probe of a fixed number of steps, as
  PyHessian's default ``density(iter=100, n_v=1)``; ``--density-steps``);
* peak resident memory per mode, each mode in its own subprocess (``--modes``; ``default``,
  ``streaming``: ``cache=False``, ``recompute``: ``SPECTRA_GRAPH_SPLIT=0``), beside the
  operator's memory plan (its estimated peak and budget) and the resident memory of the
  model alone.

On ResNet-20 (up to 1,024 examples) the PyHessian side runs on a PyTorch twin with the
same weights (logits checked to agree to 1e-4 before anything is timed):
``pyhessian_compare``'s power iteration (one full batch, gradient graph kept), and, added
here in the same style (PyHessian's ``trace`` and ``density``), Hutchinson with the same
number of Rademacher products and SLQ with full reorthogonalisation. The two sides
alternate within each repeat and medians are reported. Top-1 is compared twice:

* at each side's own tol: the power iteration stops when the relative change of its
  Rayleigh quotient is below tol (at most ``--power-max`` products). These are not equal
  accuracies: on ResNet-20 it stops after 5-6 products about 1e-5 off, while spectra
  certifies about 1e-6 in 10-12;
* at equal accuracy: for each tol, the power iteration stops at the first product whose
  Rayleigh quotient θ is within the certified bound spectra returned at that tol
  (``error_bounds[0]``) of the top eigenvalue of the matrix it works on, λ_twin, or after
  ``--power-max`` products ("not reached"; the ratio is then an upper bound). λ_twin is
  computed first, untimed, by spectra's Lanczos on the PyHessian-style products (tol
  1e-6). It is not spectra's own tol-1e-6 value λ_ref, because the twin's float32 Hessian
  is the Keras model's only up to rounding: on ResNet-20 at 256 images the two λ₁ differ
  by 3.8e-3 (1.1e-5 relative), ten times spectra's tol-1e-6 bound (4.0e-4), so no method
  on the twin comes within that bound of λ_ref (the power iteration's θ settles 3.8e-3
  from it; PyHessian's normalisation v/(‖v‖ + 1e-6) also keeps θ about 2e-6 below λ).
  This oracle stopping rule knows the answer, so it favours the power iteration: no
  practical test stops as early at that accuracy. Errors are still reported against
  λ_ref, and the closest |θ − λ_twin| of a run that does not reach its target.

The trace and density rows use the same number of products on both sides. The run ends
with a Markdown summary, one column per configuration (also in the ``--json`` report).

Both frameworks get one thread (``--threads``), as in ``pyhessian_compare.py``. The
machine's load average is printed before and after each configuration; peak memory is
the resident high-water mark (``VmHWM``). PyTorch is optional (the PyHessian columns are
skipped without it): ``pip install torch==2.13.0`` (CPU build).

    python benchmarks/scale.py [--quick] [--configs resnet20:1024:256,gpt:512:128]
        [--trace-products N] [--density-steps N] [--power-max N]
        [--modes default,streaming,recompute | none] [--repeats 3]
        [--estimator-repeats 3] [--block 16] [--json out.json]

The full run (no options): ResNet-20 at 1,024 and 4,096 images and ResNet-18 at 256
(batches of 256, 256, 64), the GPT at 512 sequences (batches of 128); 100 trace products,
100 density steps, power iteration capped at 100 products, 3 estimator repeats, all three
memory modes: many hours on a 2-core CPU. ``--quick``: ResNet-20 at 256 images and the
GPT at 128 sequences, one estimator run, 10 trace products, 10 density steps, power
iteration capped at 30, memory modes default and streaming (ResNet-20), default (GPT);
about 10 minutes on a busy 2-core CPU. Options given explicitly override what
``--quick`` sets.

**Sizing a run.** Let g be one compiled gradient over a configuration's examples, p one
``HessianOperator`` product and q one PyHessian-style product. Measured on this
project's 2-core machine at load average about 5, one thread each: ResNet-20 g = 1.2-2.0
s per 256 images, p = 1.3-1.9 g, q = 3.3-3.9 g; GPT g = 0.4-0.55 s per 128 sequences, p =
2.1-2.2 g; all grow linearly with the examples (ResNet-18 is not measured: by
multiply-adds about 14x ResNet-20 per image). A block of k costs about 2 g per vector.
Per configuration:

* memory, per mode: a fresh process (TensorFlow's start, about 20 s), the model, a first
  pass (about 1.1 g), a matvec and a block of k: about 1 g + (1 + k) p;
* product timings: a warm-up and ``--repeats`` rounds of a gradient, a matvec and a block
  of k: (repeats + 1)(g + (1 + k) p), plus one first pass;
* per estimator repeat (``--estimator-repeats``): top-1 at tol 1e-6 and 1e-3 (12 and 10
  products on ResNet-20, 31 and 25 on the GPT), ``--trace-products`` and
  ``--density-steps`` products: (22 + T + D) p on ResNet-20;
* the PyHessian side (ResNet-20 up to 1,024 images), per estimator repeat: 5-6 products
  per tol at its own tol, up to ``--power-max`` per tol at equal accuracy, T + D for
  trace and density: at most (12 + 2 P + T + D) q; plus a setup, repeats + 1 products
  timed and about 12 q (untimed) for λ_twin.

For example ``--configs resnet20:1024:256 --estimator-repeats 1 --trace-products 20
--density-steps 20 --power-max 60 --modes default``: g is about 6 s and p about 10 s, so
the memory subprocess takes about 3 min, the product timings (k = 16, 3 repeats) 4 (g +
17 p) = 12 min, spectra's estimators 62 p = 10 min and the PyHessian side up to 184 q =
65 min: about 1.5 hours.

``--profile``: where ResNet-20's products spend their time (256 images, one batch): the
compiled forward pass and gradient, the engine's cache part and apply parts (one vector,
a ``tf.map_fn`` block), a product recomputing everything, a block as unrolled second
backwards of one persistent tape, and all of it again without BatchNorm.

    python benchmarks/scale.py --profile [--repeats 3] [--block 4] [--json profile.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's spectra, not an installed one

import numpy as np  # noqa: E402

# Seconds of rest before each timed call (the other framework's thread pools spin-wait).
PAUSE = 0.25
# (model, examples, batch size): batches of 256 keep one ResNet batch cache near 1.5 GiB.
FULL = [("resnet20", 1024, 256), ("resnet20", 4096, 256), ("resnet18", 256, 64), ("gpt", 512, 128)]
QUICK = [("resnet20", 256, 256), ("gpt", 128, 128)]
MODELS = ("resnet20", "resnet18", "gpt")
MODES = ("default", "streaming", "recompute")
# Memory modes of the reduced run (each a subprocess of some 30 s); other models: MODES.
QUICK_MODES = {"resnet20": ("default", "streaming"), "gpt": ("default",)}
# Largest ResNet-20 configuration compared with the PyHessian side (one full batch).
PYHESSIAN_MAX_EXAMPLES = 1024
# spectra's tolerances of the top-1 rows; the first is the reference (λ_ref) of the
# equal-accuracy comparison, so it runs first.
TOLS = (1e-6, 1e-3)


def parse_configs(text: str) -> list[tuple[str, int, int]]:
    """``model:examples:batch_size`` items, comma-separated, as (model, examples,
    batch_size) tuples (argparse ``type``: a bad item raises ``ArgumentTypeError``)."""
    configs = []
    for item in text.split(","):
        parts = [part.strip() for part in item.split(":")]
        if len(parts) != 3 or not all(part.isdigit() for part in parts[1:]):
            raise argparse.ArgumentTypeError(
                f"malformed item {item!r}: expected model:examples:batch_size, "
                "comma-separated, e.g. resnet20:1024:256,gpt:512:128"
            )
        name, examples, batch_size = parts[0], int(parts[1]), int(parts[2])
        if name not in MODELS:
            raise argparse.ArgumentTypeError(
                f"unknown model {name!r} in {item!r}: expected one of {', '.join(MODELS)}"
            )
        if examples < 1 or batch_size < 1:
            raise argparse.ArgumentTypeError(
                f"item {item!r}: examples and batch size must be at least 1"
            )
        if batch_size > examples:
            raise argparse.ArgumentTypeError(
                f"item {item!r}: batch size {batch_size} exceeds the {examples} examples; "
                f"use a batch size of at most {examples}"
            )
        configs.append((name, examples, batch_size))
    return configs


def parse_modes(text: str) -> tuple[str, ...]:
    """Comma-separated memory modes (a subset of ``MODES``, in the order given), or
    ``none`` for no memory subprocess (argparse ``type``)."""
    names = [name.strip() for name in text.split(",")]
    if names == ["none"]:
        return ()
    if "none" in names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: none (no memory subprocess) cannot be combined with other modes"
        )
    unknown = [name for name in names if name not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown mode {unknown[0]!r} in {text!r}: expected a comma-separated subset of "
            f"{','.join(MODES)}, or none"
        )
    return tuple(dict.fromkeys(names))


def at_least(minimum: int):
    """An argparse ``type``: an integer of at least ``minimum``."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected an integer of at least {minimum}, got {text!r}"
            )
        return value

    return integer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; options left out take the full run's values, or the reduced
    run's with ``--quick`` (an option given explicitly wins over ``--quick``)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Costs, to size a run: see the module docstring (benchmarks/scale.py).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the reduced run (about 10 minutes): resnet20:256:256,gpt:128:128, one "
        "estimator run, 10 trace products, 10 density steps, power iteration capped at 30, "
        "memory modes default,streaming (ResNet-20) and default (GPT)",
    )
    parser.add_argument(
        "--configs",
        type=parse_configs,
        metavar="MODEL:EXAMPLES:BATCH,...",
        help="the configurations, comma-separated model:examples:batch_size items with "
        f"model one of {', '.join(MODELS)} (default: {format_configs(FULL)}; quick: "
        f"{format_configs(QUICK)})",
    )
    parser.add_argument(
        "--trace-products",
        type=at_least(2),
        metavar="N",
        help="Hutchinson products of the trace rows, each side (100; quick 10)",
    )
    parser.add_argument(
        "--density-steps",
        type=at_least(1),
        metavar="N",
        help="Lanczos steps (products) of the one-probe density, each side (100; quick 10)",
    )
    parser.add_argument(
        "--power-max",
        type=at_least(1),
        metavar="N",
        help="the most products of one PyHessian-style power iteration, at its own tol and "
        "at equal accuracy (100; quick 30)",
    )
    parser.add_argument(
        "--modes",
        type=parse_modes,
        metavar="MODE,...",
        help="memory modes measured per configuration, each in a subprocess: a "
        f"comma-separated subset of {','.join(MODES)}, or none to skip them (all three; "
        "quick: default,streaming for ResNet-20, default for the GPT)",
    )
    parser.add_argument("--repeats", type=at_least(1), help="product timings (3)")
    parser.add_argument(
        "--estimator-repeats", type=at_least(1), help="runs of each estimator (3; quick 1)"
    )
    parser.add_argument(
        "--threads", type=at_least(1), default=1, help="threads of each framework (1)"
    )
    parser.add_argument("--block", type=at_least(1), help="block size k (16; quick 4)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--profile", action="store_true", help="time a product's parts")
    parser.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick

    def default(name: str, full, reduced) -> None:
        if getattr(args, name) is None:
            setattr(args, name, reduced if quick else full)

    default("configs", FULL, QUICK)
    default("repeats", 3, 3)
    default("estimator_repeats", 3, 1)
    default("block", 16, 4)
    default("trace_products", 100, 10)
    default("density_steps", 100, 10)
    default("power_max", 100, 30)
    return args


def format_configs(configs: list[tuple[str, int, int]]) -> str:
    """The ``--configs`` spelling of ``configs``."""
    return ",".join(f"{name}:{examples}:{batch}" for name, examples, batch in configs)


def modes_for(name: str, args: argparse.Namespace) -> tuple[str, ...]:
    """The memory modes measured for model ``name``: ``--modes``, else the run's default."""
    if args.modes is not None:
        return args.modes
    return QUICK_MODES.get(name, MODES) if args.quick else MODES


def resident_peak_mib() -> float:
    """Peak resident set size of this process so far (``VmHWM`` of ``/proc/self/status``),
    MiB. Not ``ru_maxrss``: Linux carries that over from the parent through fork and
    exec, so a subprocess of a large parent would report the parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def set_threads(threads: int) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)


def build(name: str, examples: int):
    """(keras model, data, loss) with seeded weights and data."""
    import keras
    import models

    keras.utils.set_random_seed(0)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: expected one of {', '.join(MODELS)}")
    if name == "gpt":
        data = models.token_sequences(examples)
        model = models.gpt()
    else:
        data = models.cifar_like(examples)
        model = models.resnet20() if name == "resnet20" else models.resnet18()
        models.calibrate_batchnorm(model, data[0][:256])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, data, loss


def operator(model, loss, data, batch_size: int, mode: str):
    import spectra

    cache = {"default": "auto", "streaming": False, "recompute": "auto"}[mode]
    return spectra.HessianOperator.from_keras(model, loss, data, batch_size=batch_size, cache=cache)


# -- memory per mode (a subprocess each) ------------------------------------------------------
def memory_child(name: str, examples: int, batch_size: int, mode: str, block: int) -> None:
    """Build, fill the cache, one matvec and one block; print the figures as JSON."""
    set_threads(1)
    model, data, loss = build(name, examples)
    model_mib = resident_peak_mib()
    op = operator(model, loss, data, batch_size, mode)
    op.loss()
    rng = np.random.default_rng(0)
    op.matvec(rng.standard_normal(op.shape[0]).astype(op.dtype))
    op.matmat(rng.standard_normal((op.shape[0], block)).astype(op.dtype))
    plan = op.memory_plan(block)
    print(
        json.dumps(
            {
                "mode": mode,
                "product_path": op.product_path,
                "model_peak_mib": model_mib,
                "peak_mib": resident_peak_mib(),
                "plan_peak_mib": plan.peak / 2**20,
                "budget_mib": plan.budget / 2**20,
                "cached_batches": plan.cached_batches,
                "streamed_batches": plan.streamed_batches,
                "sub_block": plan.block_size,
                "per_vector_mib": plan.per_vector / 2**20,
                "cache_per_batch_mib": plan.cache_per_batch / 2**20,
            }
        )
    )


def memory_by_mode(name: str, examples: int, batch_size: int, args) -> dict:
    rows = {}
    for mode in modes_for(name, args):
        env = dict(os.environ)
        if mode == "recompute":
            env["SPECTRA_GRAPH_SPLIT"] = "0"
        command = [sys.executable, __file__, "--block", str(args.block), "--memory-child"]
        command += [name, str(examples), str(batch_size), mode]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            rows[mode] = {"error": done.stderr.strip().splitlines()[-1:]}
            print(f"  memory, {mode}: failed ({rows[mode]['error']})")
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows[mode] = row
        print(
            f"  memory, {mode:9s}: peak RSS {row['peak_mib']:7.0f} MiB (model and data alone "
            f"{row['model_peak_mib']:.0f}); plan: peak {row['plan_peak_mib']:.0f} MiB of a "
            f"{row['budget_mib']:.0f} MiB budget, {row['cached_batches']} cached / "
            f"{row['streamed_batches']} streamed batches of {row['cache_per_batch_mib']:.0f} "
            f"MiB, sub-blocks of {row['sub_block']} ({row['per_vector_mib']:.0f} MiB per "
            f"vector); path {row['product_path']}"
        )
    return rows


# -- the PyHessian side -----------------------------------------------------------------------
def pyhessian_side(torch, model, x, y):
    """pyhessian_compare's power iteration, with PyHessian's trace and density added."""
    from pyhessian_compare import PowerIterationHessian

    class PyHessianStyle(PowerIterationHessian):
        def trace(self, products: int, seed: int) -> float:
            """Hutchinson with Rademacher vectors (PyHessian's ``trace``), fixed count."""
            generator = self.torch.Generator().manual_seed(seed)
            samples = []
            for _ in range(products):
                v = [
                    self.torch.randint(0, 2, p.shape, generator=generator).to(p.dtype) * 2 - 1
                    for p in self.params
                ]
                samples.append(self._dot(self.product(v), v))
            return float(np.mean(samples))

        def density(self, steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
            """SLQ, one Rademacher probe, full reorthogonalisation (PyHessian's
            ``density(iter, n_v=1)``): Ritz values and weights."""
            torch = self.torch
            generator = torch.Generator().manual_seed(seed)
            flat = sum(p.numel() for p in self.params)
            shapes = [p.shape for p in self.params]
            sizes = [p.numel() for p in self.params]

            def product(vector):
                pieces = [c.reshape(s) for c, s in zip(torch.split(vector, sizes), shapes)]
                return torch.cat([h.reshape(-1) for h in self.product(pieces)])

            v = torch.randint(0, 2, (flat,), generator=generator).float() * 2 - 1
            basis = [v / torch.linalg.norm(v)]
            alpha, beta = [], []
            w = product(basis[0])
            for i in range(steps):
                a = float(torch.dot(w, basis[-1]))
                alpha.append(a)
                w = w - a * basis[-1] - (beta[-1] * basis[-2] if i else 0)
                for b in basis:  # full reorthogonalisation
                    w = w - torch.dot(w, b) * b
                if i == steps - 1:
                    break
                norm = float(torch.linalg.norm(w))
                beta.append(norm)
                basis.append(w / norm)
                w = product(basis[-1])
            T = np.diag(alpha) + np.diag(beta, 1) + np.diag(beta, -1)
            nodes, vectors = np.linalg.eigh(T)
            return nodes, vectors[0] ** 2

    inputs = torch.from_numpy(x)
    targets = torch.from_numpy(y.astype(np.int64))
    side = PyHessianStyle(torch, model, torch.nn.functional.cross_entropy, inputs, targets)
    side.setup()
    return side


def twin_operator(torch, power):
    """The PyHessian side's Hessian as a float32 ``LinearOperator`` (its products, in the
    twin's parameter order: the eigenvalues are those of the same matrix)."""
    from scipy.sparse.linalg import LinearOperator

    shapes = [p.shape for p in power.params]
    sizes = [p.numel() for p in power.params]

    def matvec(vector):
        flat = torch.from_numpy(np.ascontiguousarray(vector, np.float32).reshape(-1))
        pieces = [c.reshape(s) for c, s in zip(torch.split(flat, sizes), shapes)]
        return torch.cat([h.reshape(-1) for h in power.product(pieces)]).numpy()

    n = sum(sizes)
    return LinearOperator((n, n), matvec=matvec, dtype=np.float32)


# -- one configuration ------------------------------------------------------------------------
def timed(fn) -> tuple[float, object]:
    time.sleep(PAUSE)
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench(name: str, examples: int, batch_size: int, args, torch, memories: dict) -> dict:
    import models
    import tensorflow as tf

    import spectra

    load_before = os.getloadavg()
    model, (x, y), loss = build(name, examples)
    print(
        f"\n{name}, {examples} examples in batches of {batch_size} (load average "
        f"{load_before[0]:.2f}):"
    )
    row: dict = {"model": name, "examples": examples, "batch_size": batch_size}
    row["load_before"] = load_before
    row["memory"] = memories[(name, examples, batch_size)]
    op = operator(model, loss, (x, y), batch_size, "default")
    n = op.shape[0]
    row["parameters"] = n
    variables = [v.value for v in model.trainable_variables]
    spec = [
        tf.TensorSpec([None, *x.shape[1:]], x.dtype),
        tf.TensorSpec([None, *y.shape[1:]], y.dtype),
    ]

    @tf.function(input_signature=spec)
    def gradient_fn(xb, yb):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=False))
        return tf.concat([tf.reshape(g, [-1]) for g in tape.gradient(value, variables)], 0)

    batches = [
        (tf.constant(x[i : i + batch_size]), tf.constant(y[i : i + batch_size]))
        for i in range(0, examples, batch_size)
    ]

    def gradient():
        return sum(gradient_fn(xb, yb).numpy() * (len(yb) / examples) for xb, yb in batches)

    setup, _ = timed(op.loss)
    rng = np.random.default_rng(0)
    v = rng.standard_normal(n).astype(np.float32)
    V = rng.standard_normal((n, args.block)).astype(np.float32)
    gradient(), op.matvec(v), op.matmat(V)  # warm
    times = {"gradient": [], "matvec": [], "block": []}
    ratios = {"matvec": [], "block": []}
    for _ in range(args.repeats):
        tg, _ = timed(gradient)
        tv, _ = timed(lambda: op.matvec(v))
        tb, _ = timed(lambda: op.matmat(V))
        tb /= args.block
        times["gradient"].append(tg), times["matvec"].append(tv), times["block"].append(tb)
        ratios["matvec"].append(tv / tg), ratios["block"].append(tb / tg)
    med = {k: statistics.median(t) for k, t in times.items()}
    row["seconds"] = med
    row["cache_fill_seconds"] = setup
    row["matvec_x_gradient"] = statistics.median(ratios["matvec"])
    row["block_x_gradient"] = statistics.median(ratios["block"])
    row["block_k"] = args.block
    print(
        f"  {n:,} parameters; gradient {med['gradient']:.2f} s; matvec {med['matvec']:.2f} s "
        f"({row['matvec_x_gradient']:.2f}x); block of {args.block}: {med['block']:.2f} s per "
        f"vector ({row['block_x_gradient']:.2f}x); first pass (cache fill) {setup:.2f} s"
    )
    plan = op.memory_plan(args.block)
    row["plan"] = {"peak_mib": plan.peak / 2**20, "budget_mib": plan.budget / 2**20}
    print(f"  {plan}".replace("\n", "\n  "))

    power = None
    # PyHessian's side holds one full batch's gradient graph: at 4,096 images that is
    # beyond this project's 23 GiB machine, so it runs up to 1,024.
    if torch is not None and name == "resnet20" and examples <= PYHESSIAN_MAX_EXAMPLES:
        twin = models.torch_resnet20(torch, model)
        keras_logits = np.asarray(model(x[:256], training=False))
        with torch.no_grad():
            torch_logits = twin(torch.from_numpy(x[:256])).numpy()
        gap = float(np.max(np.abs(keras_logits - torch_logits)))
        scale = max(1.0, float(np.max(np.abs(keras_logits))))
        row["logit_gap"] = gap
        print(f"  torch twin: logits differ by {gap:.1e} at most (|logits| <= {scale:.2f})")
        if not gap <= 1e-4 * scale:
            raise SystemExit(f"{name}: the twin's logits differ by {gap:.2e} > 1e-4")
        power = pyhessian_side(torch, twin, x, y)
        tv = [
            torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) for p in power.params
        ]
        power.product(tv)
        product_times = [timed(lambda: power.product(tv))[0] for _ in range(args.repeats)]
        row["pyhessian_product_seconds"] = statistics.median(product_times)
        row["pyhessian_setup_seconds"] = timed(power.setup)[0]
        print(
            f"  PyHessian-style product {row['pyhessian_product_seconds']:.2f} s "
            f"({row['pyhessian_product_seconds'] / med['gradient']:.2f}x spectra's gradient)"
        )

    twin_reference = None
    if power is not None:
        # Untimed, first: the top eigenvalue of the matrix the power iteration works on
        # (float32 products of another framework are not the Keras model's Hessian to the
        # last digits), the reference of its equal-accuracy runs.
        twin = spectra.eigenvalues(twin_operator(torch, power), k=1, tol=1e-6, progress=False)
        twin_reference, twin_bound = float(twin.eigenvalues[0]), float(twin.error_bounds[0])
        row["lambda_1_twin"], row["lambda_1_twin_bound"] = twin_reference, twin_bound
        print(
            f"  the twin's λ₁ (spectra's Lanczos on PyHessian-style products, tol 1e-6, "
            f"{twin.num_products} products, untimed) = {twin_reference:.6g} ± {twin_bound:.1e}"
        )
    runs: dict[str, list] = {}

    def record(key, seconds, products, value, extra=None):
        runs.setdefault(key, []).append((seconds, products, value, extra))

    reference = None  # λ_ref: the first repeat's tol-1e-6 value (TOLS[0] runs first)
    for r in range(args.estimator_repeats):
        seed = r
        for tol in TOLS:
            s, res = timed(
                lambda tol=tol, seed=seed: spectra.eigenvalues(
                    op, k=1, tol=tol, seed=seed, progress=False
                )
            )
            value, bound = float(res.eigenvalues[0]), float(res.error_bounds[0])
            record(f"top1_{tol:g}", s, res.num_products, value, bound)
            if reference is None:
                reference = value
            if power is None:
                continue
            s, (value, products) = timed(
                lambda tol=tol, seed=seed: power.top_eigenvalue(seed, args.power_max, tol)
            )
            record(f"pyhessian_top1_{tol:g}", s, products, value)
            if not np.isfinite(bound):
                print(f"  top-1 at tol {tol:g}: spectra's bound is {bound}, no equal-accuracy run")
                continue
            target = (twin_reference, bound)
            s, (value, products) = timed(
                lambda tol=tol, seed=seed, target=target: power.top_eigenvalue(
                    seed, args.power_max, tol, target=target
                )
            )
            closest = min(abs(theta - twin_reference) for theta in power.history)
            reached = abs(value - twin_reference) <= bound
            extra = {"target": bound, "reached": reached, "closest": closest}
            record(f"pyhessian_top1_{tol:g}_equal_accuracy", s, products, value, extra)
        s, res = timed(
            lambda seed=seed: spectra.trace(
                op, num_products=args.trace_products, seed=seed, progress=False
            )
        )
        record("trace", s, res.num_products, res.estimate, res.stderr)
        if power is not None:
            s, value = timed(lambda seed=seed: power.trace(args.trace_products, seed))
            record("pyhessian_trace", s, args.trace_products, value)
        s, res = timed(
            lambda seed=seed: spectra.spectral_density(
                op, num_steps=args.density_steps, num_probes=1, seed=seed, progress=False
            )
        )
        record("density", s, res.num_products, float(np.max(res.nodes)))
        if power is not None:
            s, (nodes, _) = timed(lambda seed=seed: power.density(args.density_steps, seed))
            record("pyhessian_density", s, args.density_steps, float(np.max(nodes)))
    assert reference is not None
    row["lambda_1"], row["lambda_1_bound"] = reference, runs["top1_1e-06"][0][3]
    row["estimators"] = summarize_runs(runs, reference, args.power_max)
    print(f"  λ₁ = λ_ref = {reference:.6g} ± {row['lambda_1_bound']:.1e} (spectra, tol 1e-6)")
    if twin_reference is not None:
        gap = abs(twin_reference - reference)
        print(
            f"  the twin's λ₁ is {gap:.1e} from λ_ref (relative {gap / abs(reference):.1e}); the "
            "equal-accuracy runs stop at the first product within spectra's bound at that tol "
            "of the twin's λ₁ (an oracle rule that favours the power iteration)"
        )
    for key, e in row["estimators"].items():
        extra = f", rel. error {e['relative_error']:.1e}" if "relative_error" in e else ""
        if "reached" in e:
            extra += f"; target ± {e['target']:.1e}"
            if not e["reached"]:
                extra += (
                    f", not reached in {args.power_max} products (closest |θ − λ_twin| "
                    f"{e['closest']:.1e})"
                )
        extra += f", {e['x_pyhessian']:.2f}x PyHessian" if "x_pyhessian" in e else ""
        if e.get("x_pyhessian_equal_accuracy") is not None:
            extra += f", {e['x_pyhessian_equal_accuracy']:.2f}x PyHessian at equal accuracy"
        elif "x_pyhessian_equal_accuracy_at_most" in e:
            extra += (
                f", at most {e['x_pyhessian_equal_accuracy_at_most']:.2f}x PyHessian at "
                "equal accuracy (not reached)"
            )
        print(
            f"  {key:38s} {e['seconds']:8.2f} s {e['products']:5.0f} products, "
            f"value {e['value']:.5g}{extra}"
        )
    row["load_after"] = os.getloadavg()
    row["process_peak_mib"] = resident_peak_mib()
    return row


def summarize_runs(runs: dict[str, list], reference: float, power_max: int) -> dict:
    """Medians over the estimator repeats of each key's (seconds, products, value, extra)
    runs, the top-1 rows' worst relative error against ``reference``, and spectra's time
    over the PyHessian side's (``x_pyhessian``; top-1 also ``x_pyhessian_equal_accuracy``,
    None when the power iteration did not reach spectra's accuracy in every repeat, with
    ``x_pyhessian_equal_accuracy_at_most`` then: the power iteration would need more time
    than its capped runs took, so the ratio is at most that)."""
    est: dict[str, dict] = {}
    for key, values in runs.items():
        e = est[key] = {
            "seconds": statistics.median(v[0] for v in values),
            "products": statistics.median(v[1] for v in values),
            "value": statistics.median(v[2] for v in values),
        }
        if key.startswith(("top1", "pyhessian_top1")):
            e["relative_error"] = max(abs(v[2] - reference) / abs(reference) for v in values)
        if key.startswith("top1"):
            e["error_bound"] = statistics.median(v[3] for v in values)
        if key.endswith("_equal_accuracy"):
            e["target"] = statistics.median(v[3]["target"] for v in values)
            e["reached"] = all(v[3]["reached"] for v in values)
            # The worst repeat's closest |θ − λ_twin| (above the target iff it missed it).
            e["closest"] = max(v[3]["closest"] for v in values)
            e["power_max"] = power_max
        if key == "trace":
            e["stderr"] = statistics.median(v[3] for v in values)
    for tol in TOLS:
        key = f"top1_{tol:g}"
        equal = est.get(f"pyhessian_{key}_equal_accuracy")
        if key in est and equal is not None:
            ratio = est[key]["seconds"] / equal["seconds"]
            est[key]["x_pyhessian_equal_accuracy"] = ratio if equal["reached"] else None
            if not equal["reached"]:
                est[key]["x_pyhessian_equal_accuracy_at_most"] = ratio
    for key in ("top1_0.001", "top1_1e-06", "trace", "density"):
        if key in est and f"pyhessian_{key}" in est:
            est[key]["x_pyhessian"] = est[key]["seconds"] / est[f"pyhessian_{key}"]["seconds"]
    return est


def summary(rows: list[dict]) -> dict:
    """The end-of-run table, one column per configuration: ``{"columns": [...], "rows":
    {label: [cell per configuration]}, "markdown": text}``. "—": not measured (no
    PyHessian side for that configuration, or no memory subprocess of that mode)."""
    columns = [f"{r['model']}, {r['examples']:,} ({r['batch_size']} per batch)" for r in rows]
    table: dict[str, list[str]] = {}

    def add(label: str, cell) -> None:
        table[label] = [cell(r) for r in rows]

    def seconds(r: dict, key: str) -> str:
        e = r["estimators"][key]
        return f"{e['seconds']:.2f} s, {e['products']:.0f} products"

    def x_own(r: dict, key: str) -> str:
        e = r["estimators"][key]
        if "x_pyhessian" not in e:
            return "—"
        ph = r["estimators"][f"pyhessian_{key}"]
        text = f"{e['x_pyhessian']:.2f}x ({ph['products']:.0f} products"
        if "relative_error" in ph:
            text += f", rel. error {ph['relative_error']:.1e}"
        return text + ")"

    def x_equal(r: dict, key: str) -> str:
        e = r["estimators"][key]
        ph = r["estimators"].get(f"pyhessian_{key}_equal_accuracy")
        if ph is None:
            return "—"
        if ph["reached"]:
            return (
                f"{e['x_pyhessian_equal_accuracy']:.2f}x ({ph['products']:.0f} products to "
                f"± {ph['target']:.1e})"
            )
        return (
            f"not reached in {ph['power_max']} products (≤ "
            f"{e['x_pyhessian_equal_accuracy_at_most']:.2f}x; closest {ph['closest']:.1e} of "
            f"± {ph['target']:.1e})"
        )

    def same_products(r: dict, key: str) -> str:
        x = r["estimators"][key].get("x_pyhessian")
        return seconds(r, key) + ("" if x is None else f", {x:.2f}x")

    def memory(r: dict) -> str:
        default = r["memory"].get("default")
        if default is None:
            peak = "not measured"
        elif "error" in default:
            peak = "failed"
        else:
            peak = f"{default['peak_mib']:,.0f} MiB"
        budget = (default or {}).get("budget_mib", r["plan"]["budget_mib"])
        return f"{peak} / {budget:,.0f} MiB"

    k = rows[0]["block_k"] if rows else 0
    add("parameters", lambda r: f"{r['parameters']:,}")
    add("gradient (compiled)", lambda r: f"{r['seconds']['gradient']:.2f} s")
    add(
        "matvec (x gradient)",
        lambda r: f"{r['seconds']['matvec']:.2f} s ({r['matvec_x_gradient']:.2f}x)",
    )
    add(
        f"block of {k}, per vector (x gradient)",
        lambda r: f"{r['seconds']['block']:.2f} s ({r['block_x_gradient']:.2f}x)",
    )
    add("first pass (cache fill)", lambda r: f"{r['cache_fill_seconds']:.2f} s")
    add("peak memory, default mode / operator's budget", memory)
    add(
        "λ₁ (tol 1e-6, certified bound)",
        lambda r: f"{r['lambda_1']:.6g} ± {r['lambda_1_bound']:.1e}",
    )
    add(
        "λ₁ of the PyHessian side's twin (Lanczos on its products)",
        lambda r: (
            f"{r['lambda_1_twin']:.6g} ± {r['lambda_1_twin_bound']:.1e}"
            if "lambda_1_twin" in r
            else "—"
        ),
    )
    for tol, key in (("1e-3", "top1_0.001"), ("1e-6", "top1_1e-06")):
        add(f"top-1, tol {tol}", lambda r, key=key: seconds(r, key))
        add(f"top-1, tol {tol}: x PyHessian at its own tol", lambda r, key=key: x_own(r, key))
        add(
            f"top-1, tol {tol}: x PyHessian at equal accuracy",
            lambda r, key=key: x_equal(r, key),
        )
    for key in ("trace", "density"):
        add(f"{key} (x PyHessian, same products)", lambda r, key=key: same_products(r, key))
    add(
        "load average before / after",
        lambda r: f"{r['load_before'][0]:.2f} / {r['load_after'][0]:.2f}",
    )
    lines = ["| | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in table.items()]
    return {"columns": columns, "rows": table, "markdown": "\n".join(lines)}


# -- where a block product spends its time (--profile) ----------------------------------------
def profile(args) -> dict:
    """Time the parts of ResNet-20's products (256 images, one batch, one thread): the
    compiled forward pass and gradient, the engine's cache part (first pass), its apply
    parts for one vector and for a block (as the engine runs it: on this batch's 1.5 GiB
    cache, one vector at a time; and the compiled ``tf.map_fn``), a block as k unrolled second
    backwards of one persistent tape in one ``tf.function`` (no ``tf.map_fn``), and the
    same on ResNet-20 without BatchNorm (identity layers in its place)."""
    set_threads(args.threads)
    return {
        variant: _profile_variant(variant, args)
        for variant in ("resnet20", "resnet20 without BatchNorm")
    }


def _profile_variant(variant: str, args) -> dict:
    import keras
    import models
    import tensorflow as tf

    k = args.block
    if variant != "resnet20":
        models._bn = lambda name: keras.layers.Identity(name=name)
    model, (x, y), loss = build("resnet20", 256)
    op = operator(model, loss, (x, y), 256, "default")
    variables = [v.value for v in model.trainable_variables]
    xt, yt = tf.constant(x), tf.constant(y)
    n = op.shape[0]

    @tf.function
    def forward(xb, yb):
        return loss(yb, model(xb, training=False))

    @tf.function
    def gradient(xb, yb):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=False))
        return tape.gradient(value, variables)

    @tf.function
    def unrolled(xb, yb, block):
        with tf.GradientTape(persistent=True) as outer:
            with tf.GradientTape() as inner:
                value = loss(yb, model(xb, training=False))
            grads = inner.gradient(value, variables)
        out = []
        for i in range(k):
            pieces = tf.split(block[i], [int(np.prod(v.shape)) for v in variables])
            cot = [tf.reshape(p, v.shape) for p, v in zip(pieces, variables)]
            hv = outer.gradient(grads, variables, output_gradients=cot)
            out.append(tf.concat([tf.reshape(h, [-1]) for h in hv], 0))
        return tf.stack(out)

    @tf.function
    def one(xb, yb, vector):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                value = loss(yb, model(xb, training=False))
            grads = inner.gradient(value, variables)
        pieces = tf.split(vector, [int(np.prod(v.shape)) for v in variables])
        cot = [tf.reshape(p, v.shape) for p, v in zip(pieces, variables)]
        return outer.gradient(grads, variables, output_gradients=cot)

    op.loss()
    cache = op._caches[0].cache
    engine = op._engine

    def compiled_block(cache, vectors):
        """The compiled block product (``tf.map_fn``), which the engine runs only on
        batches whose cache is below ``memory.LOOP_BLOCK_BYTES``."""
        from spectra import _tf_compat
        from spectra.operators.engine import _pick

        args = [_pick(cache, source) for source in engine._block_sources]
        return _tf_compat.call_flat(engine._block_fn, [*args, vectors])[0]

    rng = np.random.default_rng(0)
    v1 = tf.constant(rng.standard_normal((1, n)).astype(np.float32))
    vk = tf.constant(rng.standard_normal((k, n)).astype(np.float32))

    def fill():
        op.reset_cache()
        op.loss()

    parts = {
        "forward (compiled)": lambda: forward(xt, yt),
        "gradient (compiled)": lambda: gradient(xt, yt),
        "cache part (first pass)": fill,
        "apply, one vector": lambda: engine.apply(op._caches[0].cache, v1),
        f"apply, block of {k} (engine default), per vector": lambda: engine.apply(cache, vk),
        f"apply, block of {k} (tf.map_fn), per vector": lambda: compiled_block(cache, vk),
        "one compiled product, all recomputed": lambda: one(xt, yt, v1[0]),
        f"block of {k}, unrolled in one graph, per vector": lambda: unrolled(xt, yt, vk),
    }
    for fn in parts.values():
        fn()
    times = {name: [] for name in parts}
    for _ in range(args.repeats):
        for name, fn in parts.items():
            times[name].append(timed(fn)[0] / (k if "per vector" in name else 1))
    med = {name: statistics.median(t) for name, t in times.items()}
    g = med["gradient (compiled)"]
    print(f"\n{variant}: {n:,} parameters, 256 images, {args.repeats} repeats (median)")
    for name, seconds in med.items():
        print(f"  {name:48s} {seconds:7.3f} s {seconds / g:6.2f}x gradient")
    return med


def write_json(path: str, report: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2))


def main() -> None:
    args = parse_args()
    if args.memory_child:
        name, examples, batch_size, mode = args.memory_child
        memory_child(name, int(examples), int(batch_size), mode, args.block)
        return
    if args.profile:
        result = profile(args)
        if args.json:
            write_json(args.json, result)
        return
    try:
        import torch

        torch.set_num_threads(args.threads)
        torch.set_num_interop_threads(args.threads)
    except ImportError:
        torch = None
        print("PyTorch is not installed: the PyHessian columns are skipped (pip install torch).")
    import tensorflow as tf

    import spectra

    set_threads(args.threads)
    load_before = os.getloadavg()
    started = time.perf_counter()
    print(
        f"spectra {spectra.__version__}, TensorFlow {tf.__version__}"
        + (f", PyTorch {torch.__version__}" if torch else "")
        + f"; {args.threads} thread(s) each; {os.cpu_count()} CPU cores; load average "
        f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}"
    )
    report: dict = {"quick": args.quick, "threads": args.threads, "load_before": load_before}
    report["settings"] = {
        "configs": format_configs(args.configs),
        "repeats": args.repeats,
        "estimator_repeats": args.estimator_repeats,
        "block": args.block,
        "trace_products": args.trace_products,
        "density_steps": args.density_steps,
        "power_max": args.power_max,
        "modes": {name: list(modes_for(name, args)) for name, _, _ in args.configs},
    }
    # Memory first, each mode in a subprocess, while this process is still small.
    memories = {}
    for config in args.configs:
        name, examples, batch_size = config
        if modes_for(name, args):
            print(f"\nmemory by mode, {name}, {examples} examples in batches of {batch_size}:")
        memories[config] = memory_by_mode(name, examples, batch_size, args)
    report["rows"] = [bench(*config, args, torch, memories) for config in args.configs]
    report["load_after"] = os.getloadavg()
    report["seconds"] = time.perf_counter() - started
    print(
        f"\nload average after: {report['load_after'][0]:.2f} {report['load_after'][1]:.2f} "
        f"{report['load_after'][2]:.2f}; {report['seconds']:.0f} s in all"
    )
    report["summary"] = summary(report["rows"])
    print("\nsummary (medians; x: spectra's time over the other's):\n")
    print(report["summary"]["markdown"])
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
