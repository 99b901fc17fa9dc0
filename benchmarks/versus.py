"""spectra side by side with curvlinops and PyHessian, on identical float32 models.

For every operation both libraries have, each side is timed alternately in one process
(the order rotates between pairs) and the median over the pairs of the per-pair ratio
spectra time / other time is reported. Both frameworks run on one thread (TensorFlow's
intra- and inter-op pools, PyTorch's intra- and inter-op threads, and every BLAS pool
through threadpoolctl), so that a shared machine slows both sides alike.

Models (Keras and PyTorch twins holding the same float32 weights; before anything is
timed the logits are checked to agree and one Hessian and one GGN product of spectra are
checked against curvlinops'):

* ``cnn``: Conv2D 8 3x3 ReLU, max-pool 2, Dense 10 (810 parameters) on the 1,797 digits
  (8x8 images, ``data/digits.npz``);
* ``mlp``: 784-512-512-10 ReLU (669,706 parameters) on 2,048 seeded random examples of
  MNIST's shapes (no data set is downloaded);
* ``resnet20``: ResNet-20 of ``benchmarks/models.py`` (272,474 parameters, BatchNorm in
  inference mode, its statistics calibrated on the images) on seeded CIFAR-shaped
  images (``--resnet-images``), 64 by default;
* ``cnn_bn``: a PyHessian-style CNN with BatchNorm (two 3x3 conv-BN-ReLU-pool stages of 16
  and 32 channels, global average pooling, Dense 10: 5,466 parameters) on 1,024
  CIFAR-shaped images: top-1 only;
* ``digits_mlp``: the trained MLP of ``data/digits_mlp.keras`` on the digits: top-1 only.

Each model is one batch on every side (PyHessian keeps one batch's gradient graph; spectra
and curvlinops get the same single batch). Rows (per model, where both sides have it):

* Hessian / GGN ``matvec`` and a block of 16 (``matmat``; curvlinops ``vmap``s a block);
* K-FAC builds (type-2 and empirical: one data pass each) and EKFAC (type-2; curvlinops'
  constructors compute them), with
  curvlinops' ``separate_weight_and_bias=False`` (spectra factors a layer's kernel and
  bias jointly, ā = [a; 1]; curvlinops' default drops the kernel-bias blocks); K-FAC
  products, blocks of 16 and exact damped inverse products (δ = 1e-2; curvlinops'
  ``KFACInverseLinearOperator(use_exact_damping=True)``, caching its eigendecompositions
  as spectra does);
* CG solves of (GGN + δI) x = b to relative residual 1e-3 (curvlinops through
  ``CGInverseLinearOperator``, GPyTorch's ``linear_cg``), products counted on each side;
* Hutchinson, Hutch++ and XTrace traces of the Hessian, the Hutchinson diagonal and XDiag
  of the GGN, at equal numbers of products (``--products``; PyHessian's ``trace`` with
  its stopping rule off, so that it makes as many);
* top-1: ``spectra.eigenvalues(k=1)`` (Lanczos with a certified bound) against SciPy's
  ``eigsh`` on curvlinops' ``to_scipy()`` at the same tol, and against PyHessian's power
  iteration at its defaults (tol 1e-3, maxIter 100) and at tol 1e-6, warm (operator and
  graph built) and end to end (operator construction included);
* SLQ density, one probe, equal Lanczos steps (curvlinops'
  ``lanczos_approximate_spectrum``, PyHessian's ``density``).

Requires PyTorch, curvlinops (``curvlinops-for-pytorch``) and PyHessian; without them it
prints one line and exits 0.

    python benchmarks/versus.py [--models cnn,mlp,resnet20,cnn_bn,digits_mlp] [--pairs 5]
        [--products 100] [--quick] [--tensorflow-onednn on|default] [--markdown out.md]
        [--json out.json]
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Rest before each timed call: the pools of the framework that ran last spin-wait a while.
PAUSE = 0.1
DAMPING = 1e-2
CG_TOL = 1e-3
REQUIRED = ("torch", "curvlinops", "pyhessian")
SIDES = ("spectra", "curvlinops", "PyHessian")
# Products of PyHessian's last power iteration (its module's product function is wrapped).
PYHESSIAN_PRODUCTS = [0]
# Substrings of the operations to run (``--only``); empty: all of them.
ONLY: list[str] = []


def missing_requirements() -> list[str]:
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


# -- timing ---------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    operation: str
    equal: str
    seconds: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def ratio(self, other: str) -> float | None:
        if other not in self.seconds:
            return None
        pairs = zip(self.seconds["spectra"], self.seconds[other])
        return statistics.median(s / o for s, o in pairs)

    def median(self, side: str) -> float:
        return statistics.median(self.seconds[side])


def measure(
    rows: list[Row],
    model: str,
    operation: str,
    equal: str,
    sides: dict[str, Callable[[], Any]],
    pairs: int,
    warm: bool = True,
    notes: Callable[[dict[str, Any]], dict[str, str]] | None = None,
) -> Row | None:
    """Time each side ``pairs`` times, alternating (the order rotates each pair)."""
    if ONLY and not any(part in operation for part in ONLY):
        return None
    names = list(sides)
    last: dict[str, Any] = {}
    if warm:
        for name in names:
            last[name] = sides[name]()
    row = Row(model, operation, equal, {name: [] for name in names})
    for p in range(pairs):
        order = names[p % len(names) :] + names[: p % len(names)]
        for name in order:
            time.sleep(PAUSE)
            start = time.perf_counter()
            last[name] = sides[name]()
            row.seconds[name].append(time.perf_counter() - start)
    if notes is not None:
        row.notes = notes(last)
    rows.append(row)
    shown = ", ".join(
        f"÷ {other} {row.ratio(other):.2f}" for other in names[1:] if row.ratio(other) is not None
    )
    print(
        f"  {operation:44s} spectra {row.median('spectra') * 1e3:9.1f} ms  {shown}"
        + (f"   [{'; '.join(f'{k}: {v}' for k, v in row.notes.items())}]" if row.notes else ""),
        flush=True,
    )
    return row


# -- models ---------------------------------------------------------------------------------
class Pair:
    """A Keras model and its PyTorch twin with the same weights, the data, and the
    conversions between spectra's flat layout and the twin's parameters."""

    def __init__(
        self, name, keras_model, torch_model, x, y, torch_x, torch_y, loss, kfac_ok, params=None
    ):
        self.name = name
        self.keras_model = keras_model
        self.torch_model = torch_model.eval()
        self.x, self.y = x, y
        self.torch_x, self.torch_y = torch_x, torch_y
        self.loss = loss
        self.kfac_ok = kfac_ok
        # The twin's parameters in the order of the Keras model's trainable variables.
        self.params = params or [p for p in torch_model.parameters() if p.requires_grad]

    def to_torch(self, torch: Any, flat: np.ndarray, shapes: list[tuple[int, ...]]) -> Any:
        """Columns of spectra's layout (n,) or (n, k) as a torch tensor in the twin's."""
        block = flat.reshape(flat.shape[0], -1)
        pieces, at = [], 0
        for shape, p in zip(shapes, self.params):
            size = int(np.prod(shape))
            part = block[at : at + size].reshape(*shape, -1)
            at += size
            if len(shape) == 4:
                part = part.transpose(3, 2, 0, 1, 4)  # (h, w, in, out) -> (out, in, h, w)
            elif len(shape) == 2:
                part = part.transpose(1, 0, 2)  # (in, out) -> (out, in)
            if tuple(part.shape[:-1]) != tuple(p.shape):
                raise SystemExit(f"{self.name}: layouts differ at {shape} / {tuple(p.shape)}")
            pieces.append(part.reshape(-1, block.shape[1]))
        out = torch.from_numpy(np.ascontiguousarray(np.concatenate(pieces).astype(np.float32)))
        return out[:, 0] if flat.ndim == 1 else out

    def to_spectra(self, torch: Any, flat: Any, shapes: list[tuple[int, ...]]) -> np.ndarray:
        """The inverse of :meth:`to_torch`."""
        values = np.asarray(flat.detach().numpy(), np.float64)
        block = values.reshape(values.shape[0], -1)
        pieces, at = [], 0
        for shape, p in zip(shapes, self.params):
            size = int(np.prod(shape))
            part = block[at : at + size].reshape(*p.shape, -1)
            at += size
            if len(shape) == 4:
                part = part.transpose(2, 3, 1, 0, 4)
            elif len(shape) == 2:
                part = part.transpose(1, 0, 2)
            pieces.append(part.reshape(-1, block.shape[1]))
        out = np.concatenate(pieces)
        return out[:, 0] if values.ndim == 1 else out


def copy_dense(torch: Any, layer: Any) -> Any:
    kernel, bias = (np.asarray(w) for w in layer.get_weights())
    linear = torch.nn.Linear(kernel.shape[0], kernel.shape[1])
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(kernel.T.copy()))
        linear.bias.copy_(torch.from_numpy(bias))
    return linear


def copy_conv(torch: Any, layer: Any, padding: int) -> Any:
    weights = [np.asarray(w) for w in layer.get_weights()]
    kernel = weights[0]
    conv = torch.nn.Conv2d(
        kernel.shape[2], kernel.shape[3], kernel.shape[0], padding=padding, bias=len(weights) > 1
    )
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(kernel.transpose(3, 2, 0, 1).copy()))
        if len(weights) > 1:
            conv.bias.copy_(torch.from_numpy(weights[1]))
    return conv


def copy_bn(torch: Any, layer: Any) -> Any:
    gamma, beta, mean, var = (np.asarray(w) for w in layer.get_weights())
    bn = torch.nn.BatchNorm2d(gamma.shape[0], eps=layer.epsilon)
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(gamma))
        bn.bias.copy_(torch.from_numpy(beta))
        bn.running_mean.copy_(torch.from_numpy(mean))
        bn.running_var.copy_(torch.from_numpy(var))
    return bn


def digits() -> tuple[np.ndarray, np.ndarray]:
    data = np.load(ROOT / "data" / "digits.npz")
    return np.asarray(data["x"], np.float32), np.asarray(data["y"], np.int64)


def logits_loss(keras: Any) -> Any:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cnn_pair(torch: Any, keras: Any, args: argparse.Namespace) -> Pair:
    keras.utils.set_random_seed(0)
    x, y = digits()
    x = x.reshape(-1, 8, 8, 1)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ],
        name="cnn_810",
    )
    conv, dense = model.layers[0], model.layers[3]

    class CNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = copy_conv(torch, conv, 0)
            self.pool = torch.nn.MaxPool2d(2)
            self.head = copy_dense(torch, dense)

        def forward(self, images: Any) -> Any:
            z = self.pool(torch.relu(self.conv(images.permute(0, 3, 1, 2))))
            return self.head(z.permute(0, 2, 3, 1).reshape(z.shape[0], -1))

    return Pair(
        "CNN (810)", model, CNN(), x, y, torch.from_numpy(x), torch.from_numpy(y),
        logits_loss(keras), True,
    )  # fmt: skip


def mlp_pair(torch: Any, keras: Any, args: argparse.Namespace) -> Pair:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1.0, (args.mlp_examples, 784)).astype(np.float32)
    y = rng.integers(0, 10, args.mlp_examples).astype(np.int64)
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="mlp_784_512_512_10",
    )
    twin = torch.nn.Sequential(
        copy_dense(torch, model.layers[0]),
        torch.nn.ReLU(),
        copy_dense(torch, model.layers[1]),
        torch.nn.ReLU(),
        copy_dense(torch, model.layers[2]),
    )
    return Pair(
        "MLP 784-512-512-10", model, twin, x, y, torch.from_numpy(x), torch.from_numpy(y),
        logits_loss(keras), True,
    )  # fmt: skip


def resnet20_pair(torch: Any, keras: Any, args: argparse.Namespace) -> Pair:
    sys.path.insert(0, str(HERE))
    import models

    keras.utils.set_random_seed(0)
    x, y = models.cifar_like(args.resnet_images)
    model = models.resnet20()
    models.calibrate_batchnorm(model, x)
    twin = models.torch_resnet20(torch, model)
    y = y.astype(np.int64)
    # Keras orders a block's projection shortcut before its second convolution.
    modules = {"stem": twin.stem, "stem_bn": twin.stem_bn, "head": twin.head}
    for index, block in enumerate(twin.blocks):
        name = f"s{index // 3 + 1}b{index % 3 + 1}"
        modules.update({f"{name}_conv1": block.conv1, f"{name}_bn1": block.bn1})
        modules.update({f"{name}_conv2": block.conv2, f"{name}_bn2": block.bn2})
        if block.proj is not None:
            modules.update({f"{name}_proj": block.proj[0], f"{name}_proj_bn": block.proj[1]})
    params = []
    for variable in model.trainable_variables:
        layer, kind = variable.path.split("/")
        module = modules[layer]
        if isinstance(module, torch.nn.Sequential):  # padding, then the convolution
            module = module[-1]
        params.append(module.weight if kind in ("kernel", "gamma") else module.bias)
    return Pair(
        f"ResNet-20 ({args.resnet_images} images)", model, twin, x, y, torch.from_numpy(x),
        torch.from_numpy(y), logits_loss(keras), False, params,
    )  # fmt: skip


def cnn_bn_pair(torch: Any, keras: Any, args: argparse.Namespace) -> Pair:
    sys.path.insert(0, str(HERE))
    import models

    keras.utils.set_random_seed(0)
    x, y = models.cifar_like(1024, seed=1)
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for i, width in enumerate((16, 32)):
        h = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, name=f"conv{i}")(h)
        h = keras.layers.BatchNormalization(momentum=0.0, epsilon=1e-5, name=f"bn{i}")(h)
        h = keras.layers.MaxPooling2D(2)(keras.layers.ReLU()(h))
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(10, name="head")(h), name="cnn_bn")
    models.calibrate_batchnorm(model, x)
    layers = {layer.name: layer for layer in model.layers}

    class CNNBN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv0 = copy_conv(torch, layers["conv0"], 1)
            self.bn0 = copy_bn(torch, layers["bn0"])
            self.conv1 = copy_conv(torch, layers["conv1"], 1)
            self.bn1 = copy_bn(torch, layers["bn1"])
            self.head = copy_dense(torch, layers["head"])

        def forward(self, images: Any) -> Any:
            h = images.permute(0, 3, 1, 2)
            h = torch.max_pool2d(torch.relu(self.bn0(self.conv0(h))), 2)
            h = torch.max_pool2d(torch.relu(self.bn1(self.conv1(h))), 2)
            return self.head(h.mean(dim=(2, 3)))

    y = y.astype(np.int64)
    return Pair(
        "CNN-BN (5,466; 1,024 images)", model, CNNBN(), x, y, torch.from_numpy(x),
        torch.from_numpy(y), logits_loss(keras), False,
    )  # fmt: skip


def digits_mlp_pair(torch: Any, keras: Any, args: argparse.Namespace) -> Pair:
    sys.path.insert(0, str(HERE))
    import pyhessian_compare

    x, y = digits()
    model, twin, loss = pyhessian_compare.mlp_pair(torch, keras, x, y)
    return Pair(
        "digits MLP (trained)", model, twin, x, y, torch.from_numpy(x), torch.from_numpy(y),
        loss, False,
    )  # fmt: skip


BUILDERS = {
    "cnn": cnn_pair,
    "mlp": mlp_pair,
    "resnet20": resnet20_pair,
    "cnn_bn": cnn_bn_pair,
    "digits_mlp": digits_mlp_pair,
}
FULL = ("cnn", "mlp", "resnet20")


# -- one model --------------------------------------------------------------------------------
def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bench_model(key: str, pair: Pair, args: argparse.Namespace, rows: list[Row]) -> None:
    import curvlinops
    import pyhessian
    import scipy.sparse.linalg
    import torch
    from curvlinops.diagonal.epperly2024xtrace import xdiag as curv_xdiag
    from curvlinops.diagonal.hutchinson import hutchinson_diag as curv_diag
    from curvlinops.papyan2020traces.spectrum import lanczos_approximate_spectrum
    from curvlinops.trace.epperly2024xtrace import xtrace as curv_xtrace
    from curvlinops.trace.hutchinson import hutchinson_trace as curv_hutchinson
    from curvlinops.trace.meyer2020hutch import hutchpp_trace as curv_hutchpp
    from pyhessian.utils import hessian_vector_product

    import spectra

    pairs = args.pairs
    data = (pair.x, pair.y)
    batch = len(pair.y)
    criterion = torch.nn.CrossEntropyLoss()
    loader = [(pair.torch_x, pair.torch_y)]
    hessian = spectra.HessianOperator.from_keras(
        pair.keras_model, pair.loss, data, batch_size=batch
    )
    shapes = hessian.variable_shapes
    n = hessian.shape[0]
    to_torch = lambda v: pair.to_torch(torch, v, shapes)  # noqa: E731
    to_spectra = lambda v: pair.to_spectra(torch, v, shapes)  # noqa: E731

    keras_logits = np.asarray(pair.keras_model(pair.x, training=False))
    with torch.no_grad():
        torch_logits = pair.torch_model(pair.torch_x)
        if key == "digits_mlp":  # the Keras model ends in a softmax, its twin in logits
            torch_logits = torch.softmax(torch_logits, dim=1)
        torch_logits = torch_logits.numpy()
    logit_gap = float(np.max(np.abs(keras_logits - torch_logits)) / np.max(np.abs(keras_logits)))
    if not logit_gap <= 1e-4:
        raise SystemExit(f"{pair.name}: the twins' logits differ by {logit_gap:.1e} (relative)")
    curv_hessian = curvlinops.HessianLinearOperator(
        pair.torch_model, criterion, pair.params, loader
    )
    rng = np.random.default_rng(0)
    v = rng.standard_normal(n).astype(np.float32)
    V16 = rng.standard_normal((n, 16)).astype(np.float32)
    tv, tV16 = to_torch(v), to_torch(V16)
    gap = relative(to_spectra(curv_hessian @ tv), hessian.matvec(v))
    print(
        f"\n{pair.name}: {n:,} parameters, {batch:,} examples in one batch; logits agree to "
        f"{logit_gap:.1e}, Hessian products to {gap:.1e} (relative)",
        flush=True,
    )
    # float32 products through ResNet-20 agree to about 1e-3 (its logits to 1e-6).
    if not gap <= 5e-3:
        raise SystemExit(f"{pair.name}: the Hessian products differ by {gap:.1e} (relative)")
    ph = pyhessian.hessian(
        pair.torch_model, criterion, data=(pair.torch_x, pair.torch_y), cuda=False
    )
    m = pair.name

    def pyh_product() -> Any:
        return hessian_vector_product(ph.gradsH, ph.params, list(tv_list))

    tv_list = [torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) for p in ph.params]

    def top1_rows() -> None:
        reference = spectra.eigenvalues(hessian, k=1, tol=1e-6, seed=1234, progress=False)
        lam = float(reference.eigenvalues[0])
        for tol in (1e-3, 1e-6):

            def ours(tol: float = tol) -> Any:
                return spectra.eigenvalues(hessian, k=1, tol=tol, progress=False)

            def power(tol: float = tol) -> Any:
                torch.manual_seed(0)
                PYHESSIAN_PRODUCTS[0] = 0
                return ph.eigenvalues(maxIter=100, tol=tol, top_n=1)

            def note(last: dict[str, Any], tol: float = tol) -> dict[str, str]:
                ours = last["spectra"]
                power_value = float(last["PyHessian"][0][0])
                return {
                    "spectra": f"{ours.num_products} products, ±{ours.error_bounds[0]:.1e} "
                    "certified",
                    "PyHessian": f"{PYHESSIAN_PRODUCTS[0]} products, error "
                    f"{abs(power_value - lam) / abs(lam):.1e} relative",
                }

            measure(
                rows, m, f"top-1, tol {tol:g} (PyHessian maxIter 100)", "each its own rule",
                {"spectra": ours, "PyHessian": power}, pairs, warm=False, notes=note,
            )  # fmt: skip

            def ours_cold(tol: float = tol) -> Any:
                op = spectra.HessianOperator.from_keras(
                    pair.keras_model, pair.loss, data, batch_size=batch
                )
                return spectra.eigenvalues(op, k=1, tol=tol, progress=False)

            def power_cold(tol: float = tol) -> Any:
                torch.manual_seed(0)
                fresh = pyhessian.hessian(
                    pair.torch_model, criterion, data=(pair.torch_x, pair.torch_y), cuda=False
                )
                return fresh.eigenvalues(maxIter=100, tol=tol, top_n=1)

            measure(
                rows, m, f"top-1, tol {tol:g}, with operator build", "each its own rule",
                {"spectra": ours_cold, "PyHessian": power_cold}, pairs, warm=False,
            )  # fmt: skip

    if key not in FULL:
        measure(
            rows, m, "Hessian matvec", "1 product",
            {"spectra": lambda: hessian.matvec(v), "curvlinops": lambda: curv_hessian @ tv,
             "PyHessian": pyh_product}, pairs,
        )  # fmt: skip
        top1_rows()
        return

    ggn = spectra.GGNOperator.from_keras(pair.keras_model, pair.loss, data, batch_size=batch)
    curv_ggn = curvlinops.GGNLinearOperator(pair.torch_model, criterion, pair.params, loader)
    ggn_gap = relative(to_spectra(curv_ggn @ tv), ggn.matvec(v))
    print(f"  GGN products agree to {ggn_gap:.1e} (relative)", flush=True)
    if not ggn_gap <= 5e-3:
        raise SystemExit(f"{pair.name}: the GGN products differ by {ggn_gap:.1e} (relative)")

    # -- products
    measure(
        rows, m, "Hessian matvec", "1 product",
        {"spectra": lambda: hessian.matvec(v), "curvlinops": lambda: curv_hessian @ tv,
         "PyHessian": pyh_product}, pairs,
    )  # fmt: skip
    measure(
        rows, m, "GGN matvec", "1 product",
        {"spectra": lambda: ggn.matvec(v), "curvlinops": lambda: curv_ggn @ tv}, pairs,
    )  # fmt: skip
    measure(
        rows, m, "Hessian matmat, block of 16", "16 products",
        {"spectra": lambda: hessian.matmat(V16), "curvlinops": lambda: curv_hessian @ tV16},
        pairs,
    )  # fmt: skip
    measure(
        rows, m, "GGN matmat, block of 16", "16 products",
        {"spectra": lambda: ggn.matmat(V16), "curvlinops": lambda: curv_ggn @ tV16}, pairs,
    )  # fmt: skip

    if key == "resnet20":
        resnet_rows(rows, m, pair, args, hessian, curv_hessian, ph, pyhessian, criterion)
        return

    # -- K-FAC
    if pair.kfac_ok:
        kfac_rows(rows, pair, args, m, criterion, loader, v, V16, to_torch, to_spectra)

    # -- CG
    b = rng.standard_normal(n).astype(np.float32)
    tb = to_torch(b)
    counts: dict[str, int] = {}
    damped = DampedCurvlinops(curv_ggn, DAMPING, counts)

    def ours_cg() -> Any:
        inverse = spectra.inverse(ggn, DAMPING, method="cg", tol=CG_TOL, progress=False)
        x = inverse.matvec(b)
        counts["spectra"] = int(inverse.last.num_products)
        return x

    def curv_cg() -> Any:
        counts["curvlinops"] = 0
        return curvlinops.CGInverseLinearOperator(damped, tolerance=CG_TOL, max_iter=1000) @ tb

    def cg_note(last: dict[str, Any]) -> dict[str, str]:
        solution = to_spectra(last["curvlinops"])
        residual = ggn.matvec(solution.astype(np.float32)) + DAMPING * solution - b
        return {
            "products": f"{counts['spectra']} / {counts['curvlinops']}",
            "curvlinops residual": f"{np.linalg.norm(residual) / np.linalg.norm(b):.1e}",
        }

    measure(
        rows, m, f"CG solve, (GGN + {DAMPING:g} I) x = b, tol {CG_TOL:g}",
        "relative residual", {"spectra": ours_cg, "curvlinops": curv_cg}, pairs,
        warm=False, notes=cg_note,
    )  # fmt: skip

    # -- trace and diagonal
    k = args.products if key != "resnet20" else args.resnet_products
    k3 = 3 * (k // 3)
    k2 = 2 * (k // 2)
    torch.manual_seed(0)
    measure(
        rows, m, "Hutchinson trace (Hessian)", f"{k} products",
        {"spectra": lambda: spectra.hutchinson_trace(hessian, k, progress=False),
         "curvlinops": lambda: curv_hutchinson(curv_hessian, k),
         "PyHessian": lambda: ph.trace(maxIter=k, tol=-float("inf"))}, pairs, warm=False,
    )  # fmt: skip
    measure(
        rows, m, "Hutch++ trace (Hessian)", f"{k3} products",
        {"spectra": lambda: spectra.hutchpp_trace(hessian, k3, progress=False),
         "curvlinops": lambda: curv_hutchpp(curv_hessian, k3)}, pairs, warm=False,
    )  # fmt: skip
    measure(
        rows, m, "XTrace (Hessian)", f"{k2} products",
        {"spectra": lambda: spectra.xtrace(hessian, k2, progress=False),
         "curvlinops": lambda: curv_xtrace(curv_hessian, k2)}, pairs, warm=False,
    )  # fmt: skip
    measure(
        rows, m, "Hutchinson diagonal (GGN)", f"{k} products",
        {"spectra": lambda: spectra.diagonal(ggn, k, progress=False),
         "curvlinops": lambda: curv_diag(curv_ggn, k)}, pairs, warm=False,
    )  # fmt: skip
    measure(
        rows, m, "XDiag (GGN)", f"{k2} products",
        {"spectra": lambda: spectra.xdiag(ggn, k2, progress=False),
         "curvlinops": lambda: curv_xdiag(curv_ggn, k2)}, pairs, warm=False,
    )  # fmt: skip

    # -- eigenvalues
    scipy_curv = curv_hessian.to_scipy()
    for tol in (1e-3, 1e-6):
        eigsh_counts: dict[str, int] = {}

        def curv_eigsh(tol: float = tol, eigsh_counts: dict[str, int] = eigsh_counts) -> Any:
            calls = [0]

            def matvec(x: np.ndarray) -> np.ndarray:
                calls[0] += 1
                return scipy_curv.matvec(x)

            counted = scipy.sparse.linalg.LinearOperator(
                scipy_curv.shape, matvec=matvec, dtype=np.float32
            )
            start = np.random.default_rng(0).standard_normal(n).astype(np.float32)
            value = scipy.sparse.linalg.eigsh(counted, k=1, which="LA", tol=tol, v0=start)[0]
            eigsh_counts["curvlinops"] = calls[0]
            return value

        def eig_note(last: dict[str, Any], counts: dict[str, int] = eigsh_counts) -> dict[str, str]:
            ours = last["spectra"]
            return {
                "products": f"{ours.num_products} / {counts['curvlinops']}",
                "spectra bound": f"±{ours.error_bounds[0]:.1e}",
            }

        measure(
            rows, m, f"top-1, tol {tol:g} (curvlinops: SciPy eigsh)", "the same tol",
            {"spectra": lambda tol=tol: spectra.eigenvalues(hessian, k=1, tol=tol, progress=False),
             "curvlinops": curv_eigsh}, pairs, warm=False, notes=eig_note,
        )  # fmt: skip
    if key != "mlp":
        top1_rows()

    # -- density
    steps = args.steps if key != "resnet20" else args.resnet_products

    def curv_density() -> Any:
        torch.manual_seed(0)
        return lanczos_approximate_spectrum(
            curv_hessian, steps, num_repeats=1, boundaries=(-1.0, 1.0)
        )

    measure(
        rows, m, "SLQ density, 1 probe (Hessian)", f"{steps} Lanczos steps",
        {"spectra": lambda: spectra.spectral_density(hessian, steps, 1, progress=False),
         "curvlinops": curv_density,
         "PyHessian": lambda: pyhessian_density(torch, ph, steps)}, pairs, warm=False,
    )  # fmt: skip


def pyhessian_density(torch: Any, ph: Any, steps: int) -> Any:
    """PyHessian's ``density(iter=steps, n_v=1)``. Its last step calls ``torch.eig``, which
    PyTorch removed in 1.9+: for that call only, ``torch.eig`` is the symmetric
    ``torch.linalg.eigh`` of its tridiagonal matrix in the old (values, 2) format."""

    def eig(T: Any, eigenvectors: bool = False) -> Any:
        values, vectors = torch.linalg.eigh(T)
        return torch.stack([values, torch.zeros_like(values)], 1), vectors

    had = getattr(torch, "eig", None)
    torch.eig = eig
    try:
        return ph.density(iter=steps, n_v=1)
    finally:
        torch.eig = had


def resnet_rows(rows, m, pair, args, hessian, curv_hessian, ph, pyhessian, criterion) -> None:
    """ResNet-20's shorter list (its products cost seconds): Hutchinson's trace, top-1 at
    PyHessian's settings and the SLQ density."""
    import torch
    from curvlinops.papyan2020traces.spectrum import lanczos_approximate_spectrum
    from curvlinops.trace.hutchinson import hutchinson_trace as curv_hutchinson

    import spectra

    k = args.resnet_products
    measure(
        rows, m, "Hutchinson trace (Hessian)", f"{k} products",
        {"spectra": lambda: spectra.hutchinson_trace(hessian, k, progress=False),
         "curvlinops": lambda: curv_hutchinson(curv_hessian, k),
         "PyHessian": lambda: ph.trace(maxIter=k, tol=-float("inf"))}, args.pairs, warm=False,
    )  # fmt: skip
    reference = spectra.eigenvalues(hessian, k=1, tol=1e-6, seed=1234, progress=False)
    lam = float(reference.eigenvalues[0])
    for tol in (1e-3, 1e-6):

        def note(last: dict[str, Any]) -> dict[str, str]:
            ours, power_value = last["spectra"], float(last["PyHessian"][0][0])
            return {
                "spectra": f"{ours.num_products} products, ±{ours.error_bounds[0]:.1e} certified",
                "PyHessian": f"{PYHESSIAN_PRODUCTS[0]} products, error "
                f"{abs(power_value - lam) / abs(lam):.1e} relative",
            }

        def power(tol: float = tol) -> Any:
            torch.manual_seed(0)
            PYHESSIAN_PRODUCTS[0] = 0
            return ph.eigenvalues(maxIter=100, tol=tol, top_n=1)

        measure(
            rows, m, f"top-1, tol {tol:g} (PyHessian maxIter 100)", "each its own rule",
            {"spectra": lambda tol=tol: spectra.eigenvalues(hessian, k=1, tol=tol, progress=False),
             "PyHessian": power}, args.pairs, warm=False, notes=note,
        )  # fmt: skip

    def curv_density() -> Any:
        torch.manual_seed(0)
        return lanczos_approximate_spectrum(curv_hessian, k, num_repeats=1, boundaries=(-1.0, 1.0))

    measure(
        rows, m, "SLQ density, 1 probe (Hessian)", f"{k} Lanczos steps",
        {"spectra": lambda: spectra.spectral_density(hessian, k, 1, progress=False),
         "curvlinops": curv_density,
         "PyHessian": lambda: pyhessian_density(torch, ph, k)}, args.pairs, warm=False,
    )  # fmt: skip


class DampedCurvlinops:
    """(A + δI) of a curvlinops operator for ``linear_cg``, counting its products."""

    def __init__(self, A: Any, damping: float, counts: dict[str, int]) -> None:
        from curvlinops._torch_base import PyTorchLinearOperator

        outer = self

        class _Damped(PyTorchLinearOperator):
            SELF_ADJOINT = True

            def __init__(self) -> None:
                super().__init__(A._in_shape, A._out_shape)

            def _matmat(self, X: list[Any]) -> list[Any]:
                counts["curvlinops"] = counts.get("curvlinops", 0) + int(X[0].shape[-1])
                return [ax + damping * x for ax, x in zip(A._matmat(X), X)]

            def _adjoint(self) -> Any:
                return self

            @property
            def device(self) -> Any:
                return A.device

            @property
            def dtype(self) -> Any:
                return A.dtype

        self.op = _Damped()
        del outer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.op, name)


def kfac_rows(rows, pair, args, m, criterion, loader, v, V16, to_torch, to_spectra) -> None:
    import curvlinops
    from curvlinops.kfac import FisherType

    import spectra

    pairs = args.pairs
    data = (pair.x, pair.y)
    batch = len(pair.y)
    tv, tV16 = to_torch(v), to_torch(V16)
    built: dict[str, Any] = {}

    for kind, fisher_type in (("type-2", FisherType.TYPE2), ("empirical", FisherType.EMPIRICAL)):

        def ours(kind: str = kind) -> Any:
            built[kind] = spectra.KFACOperator.from_keras(
                pair.keras_model, pair.loss, data, batch_size=batch, kind=kind
            )
            return built[kind]

        def theirs(kind: str = kind, fisher_type: Any = fisher_type) -> Any:
            op = curvlinops.KFACLinearOperator(
                pair.torch_model, criterion, pair.params, loader, fisher_type=fisher_type,
                separate_weight_and_bias=False,
            )  # fmt: skip
            # The constructor computes the factors (one more compute_kronecker_factors()
            # would add a second pass's sums to them).
            built["curv " + kind] = op
            return op

        measure(
            rows, m, f"K-FAC build ({kind})", "1 data pass",
            {"spectra": ours, "curvlinops": theirs}, pairs,
        )  # fmt: skip
        if kind not in built:  # the build's row was left out (--only): build once
            ours()
            theirs()
        if kind == "type-2":
            gap = relative(to_spectra(built["curv type-2"] @ tv), built["type-2"].matvec(v))
            print(f"  K-FAC products agree to {gap:.1e} (relative)", flush=True)
            if not gap <= 1e-3:
                raise SystemExit(f"{pair.name}: the K-FAC products differ by {gap:.1e}")

    def ekfac_ours() -> Any:
        built["ekfac"] = spectra.EKFACOperator.from_keras(
            pair.keras_model, pair.loss, data, batch_size=batch
        )
        return built["ekfac"]

    def ekfac_theirs() -> Any:
        op = curvlinops.EKFACLinearOperator(
            pair.torch_model, criterion, pair.params, loader, fisher_type=FisherType.TYPE2,
            separate_weight_and_bias=False,
        )  # fmt: skip
        return op  # the constructor computes the factors and the eigenvalue correction

    measure(
        rows, m, "EKFAC build (type-2)", "2 data passes",
        {"spectra": ekfac_ours, "curvlinops": ekfac_theirs}, pairs,
    )  # fmt: skip
    ours, theirs = built["type-2"], built["curv type-2"]
    measure(
        rows, m, "K-FAC matvec", "1 product",
        {"spectra": lambda: ours.matvec(v), "curvlinops": lambda: theirs @ tv}, pairs,
    )  # fmt: skip
    measure(
        rows, m, "K-FAC matmat, block of 16", "16 products",
        {"spectra": lambda: ours.matmat(V16), "curvlinops": lambda: theirs @ tV16}, pairs,
    )  # fmt: skip
    our_inverse = ours.inverse(DAMPING)
    their_inverse = curvlinops.KFACInverseLinearOperator(
        theirs, damping=DAMPING, use_exact_damping=True
    )
    gap = relative(to_spectra(their_inverse @ tv), our_inverse.matvec(v))
    print(f"  K-FAC damped inverse products agree to {gap:.1e} (relative)", flush=True)
    measure(
        rows, m, f"K-FAC (K + {DAMPING:g} I)⁻¹ matvec, exact", "1 product",
        {"spectra": lambda: our_inverse.matvec(v), "curvlinops": lambda: their_inverse @ tv},
        pairs,
    )  # fmt: skip


# -- report ---------------------------------------------------------------------------------
def markdown(rows: list[Row], header: str) -> str:
    lines = [
        header,
        "",
        "| model | operation | equal on both sides | spectra | ÷ curvlinops | ÷ PyHessian "
        "| notes |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for row in rows:
        ratios = []
        for other in SIDES[1:]:
            ratio = row.ratio(other)
            ratios.append("" if ratio is None else f"{ratio:.2f}")
        notes = "; ".join(f"{k}: {v}" for k, v in row.notes.items())
        lines.append(
            f"| {row.model} | {row.operation} | {row.equal} | {row.median('spectra') * 1e3:,.1f} ms"
            f" | {ratios[0]} | {ratios[1]} | {notes} |"
        )
    return "\n".join(lines)


def count_pyhessian_products() -> None:
    """Wrap the product function PyHessian's power iteration calls, to count its products."""
    import pyhessian  # noqa: F401  (the package's __init__ imports its module hessian)

    module = sys.modules["pyhessian.hessian"]  # the name pyhessian.hessian is its class
    product = module.hessian_vector_product

    def counted(*args: Any, **kwargs: Any) -> Any:
        PYHESSIAN_PRODUCTS[0] += 1
        return product(*args, **kwargs)

    module.hessian_vector_product = counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,cnn_bn,digits_mlp,resnet20,mlp")
    parser.add_argument("--pairs", type=int, default=5, help="alternating pairs per row")
    parser.add_argument("--products", type=int, default=100, help="trace and diagonal")
    parser.add_argument("--steps", type=int, default=30, help="SLQ Lanczos steps")
    parser.add_argument("--resnet-images", type=int, default=64)
    parser.add_argument("--resnet-products", type=int, default=10)
    parser.add_argument("--mlp-examples", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="small models, 3 pairs")
    parser.add_argument("--only", default="", help="comma-separated parts of row names to run")
    parser.add_argument(
        "--tensorflow-onednn",
        choices=("on", "default"),
        default="on",
        help="'on' sets TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow is imported: its oneDNN "
        "kernels, which PyTorch uses by default on x86 CPUs (TensorFlow turns them on by "
        "default only on CPUs with AVX-512 and newer); 'default' leaves TensorFlow's choice",
    )
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--json", help="also write the timings to this file")
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        print(
            f"versus.py skipped: {', '.join(missing)} not importable "
            "(pip install torch curvlinops-for-pytorch pyhessian)"
        )
        return
    ONLY.extend(part for part in args.only.split(",") if part)
    count_pyhessian_products()
    if args.quick:
        args.pairs = min(args.pairs, 3)
        args.models = "cnn,cnn_bn"
    if args.tensorflow_onednn == "on":
        if "tensorflow" in sys.modules:
            raise RuntimeError("TensorFlow was imported before its oneDNN setting was made")
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"
    import keras
    import tensorflow as tf
    import torch
    from threadpoolctl import threadpool_limits

    import spectra

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    threadpool_limits(1)
    before = os.getloadavg()
    onednn = (
        "on (TF_ENABLE_ONEDNN_OPTS=1)" if args.tensorflow_onednn == "on" else "TensorFlow's choice"
    )
    torch_onednn = "on" if torch.backends.mkldnn.is_available() else "unavailable"
    header = (
        f"spectra {spectra.__version__}, TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"PyTorch {torch.__version__}; TensorFlow's oneDNN kernels {onednn}, PyTorch's "
        f"{torch_onednn}; "
        f"one thread each; {os.cpu_count()} CPU cores "
        f"({platform.machine()}); {args.pairs} pairs per row; load average "
        f"{before[0]:.2f} / {before[1]:.2f} / {before[2]:.2f} at the start"
    )
    print(header, flush=True)
    for path in (args.markdown, args.json):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for key in args.models.split(","):
        pair = BUILDERS[key](torch, keras, args)
        bench_model(key, pair, args, rows)
        if args.markdown:  # what is done so far, in case a later model fails
            Path(args.markdown).write_text(markdown(rows, header + " (partial)") + "\n")
    after = os.getloadavg()
    header += f", {after[0]:.2f} / {after[1]:.2f} / {after[2]:.2f} at the end"
    table = markdown(rows, header)
    print("\n" + table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {"model": r.model, "operation": r.operation, "equal": r.equal,
                     "seconds": r.seconds, "notes": r.notes}
                    for r in rows
                ],
                indent=1,
            )
        )  # fmt: skip


if __name__ == "__main__":
    main()
