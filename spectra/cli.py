"""The ``spectra`` command line (also ``python -m spectra``).

Subcommands:

* ``spectra analyze MODEL``: top eigenvalues, optionally the trace and the spectral density
  of the loss Hessian of one model; writes ``results.json`` and figures.
* ``spectra sharpness CHECKPOINTS``: the top eigenvalue(s) (and trace) of every checkpoint of a
  training run, resumable; writes ``sharpness.json``, ``sharpness.csv`` and ``sharpness.png``.
* ``spectra landscape MODEL``: the loss along the top eigenvector(s) and a random direction;
  writes ``landscape.json`` and ``landscape_1d.png`` (and ``landscape_2d.png``).

Errors in what the user gave (missing files, unreadable or mismatched data, an unknown loss,
changed settings on resume) print ``spectra: error: ...`` and exit with status 2; anything
else is a bug and raises.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import matplotlib
import numpy as np
import scipy
import tensorflow as tf

from spectra import __version__, _keras
from spectra._files import atomic_write_text
from spectra.checkpoints import find_checkpoints, load_model
from spectra.datasets import check_data_fits_model, load_data
from spectra.density import negative_mass_fraction, spectral_density
from spectra.eigenvalues import eigenvalue_ratio, eigenvalues
from spectra.landscape import LandscapeResult, loss_landscape, random_direction
from spectra.operator import HessianOperator
from spectra.plotting import (
    plot_eigenvalues,
    plot_loss_landscape_1d,
    plot_loss_landscape_2d,
    plot_sharpness,
    plot_spectral_density,
    save_figure,
)
from spectra.results import EigenResult, Result, SpectralDensity, SpectralMoments, TraceResult
from spectra.trace import trace

__all__ = ["main"]

_LANDSCAPE_RADIUS = 1.0
# Negative mass counts quadrature nodes below -1e-3·|λ₁|: the large cluster of (near-)zero
# eigenvalues of a trained network gets one node that lands just below or above 0.
_NEGATIVE_MASS_THRESHOLD = 1e-3
_LANDSCAPE_POINTS = 21
# Settings of ``spectra sharpness`` that change the numbers: a resumed run must match them.
_SHARPNESS_NUMBER_SETTINGS = (
    "loss",
    "data_sha256",
    "num_examples",
    "max_examples",
    "seed",
    "top_k",
    "method",
    "tol",
    "trace",
    "trace_method",
    "trace_products",
    "batch_size",
    "float64",
    "training",
    "builder",
)


class _UserError(Exception):
    """A problem with the command's inputs: reported in one line, exit status 2."""


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Turn the errors that loading and checking user inputs raise into :class:`_UserError`."""
    try:
        yield
    except (OSError, ValueError, ImportError) as err:
        raise _UserError(str(err)) from err


# --------------------------------------------------------------------------- reports


@dataclass
class _CommandReport(Result):
    """What every command records: how it was called, with which versions, on what data."""

    command: str
    versions: dict[str, str]
    settings: dict[str, Any]
    data: dict[str, Any]


@dataclass
class AnalysisReport(_CommandReport):
    """Everything ``spectra analyze`` computed, as written to ``results.json``."""

    model: dict[str, Any]
    loss: float
    eigenvalues: EigenResult
    eigenvalue_ratio: float | None
    trace: TraceResult | None
    density: SpectralDensity | None
    density_moments: SpectralMoments | None
    negative_mass: dict[str, float] | None
    num_products: int
    num_data_passes: int
    wall_times: dict[str, float]
    files: dict[str, str]


@dataclass
class SharpnessReport(_CommandReport):
    """Per-checkpoint sharpness of a training run, as written to ``sharpness.json``."""

    learning_rate: float | None
    learning_rate_source: str | None
    edge_of_stability: float | None
    checkpoints: list[dict[str, Any]]


@dataclass
class LandscapeReport(_CommandReport):
    """What ``spectra landscape`` computed, as written to ``landscape.json``."""

    model: dict[str, Any]
    eigenvalues: EigenResult
    directions: dict[str, str]
    curves: LandscapeResult
    surface: LandscapeResult | None
    files: dict[str, str]


# --------------------------------------------------------------------------- parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _common_options() -> argparse.ArgumentParser:
    """Options shared by all subcommands: data, loss, model loading, precision, output."""
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("data and loss")
    group.add_argument(
        "--data",
        required=True,
        help="a .npz file with arrays x, y (optional sample_weight), or a built-in data set: "
        "digits, breast_cancer, diabetes, iris, wine",
    )
    group.add_argument(
        "--loss",
        required=True,
        help="a Keras loss name, e.g. sparse_categorical_crossentropy, binary_crossentropy, mse",
    )
    group.add_argument(
        "--max-examples",
        type=_positive_int,
        metavar="N",
        help="use a random subset of N examples (drawn with --seed; default: all)",
    )
    group.add_argument(
        "--batch-size",
        type=_positive_int,
        metavar="N",
        help="examples per batch; the loss is the exact dataset mean either way "
        "(default: all examples in one batch)",
    )
    group = common.add_argument_group("model and computation")
    group.add_argument(
        "--builder",
        metavar="MODULE:FUNCTION",
        help="function returning the built model, for .weights.h5 files and "
        "tf.train.Checkpoints ('module:function' or 'path/to/file.py:function')",
    )
    group.add_argument(
        "--float64",
        action="store_true",
        help="compute in float64 on a float64 copy of the model (default: the model's dtype)",
    )
    group.add_argument(
        "--training",
        action="store_true",
        help="run layers in training mode (BatchNorm batch statistics, Dropout on)",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="seed of the data subset and random probes (default 0)"
    )
    group.add_argument(
        "--no-progress", action="store_true", help="no progress bars (shown only on a terminal)"
    )
    group.add_argument("--out", required=True, metavar="DIR", help="output directory")
    return common


def _eigen_options() -> argparse.ArgumentParser:
    eigen = argparse.ArgumentParser(add_help=False)
    group = eigen.add_argument_group("eigenvalues")
    group.add_argument(
        "--method",
        choices=("lanczos", "power", "lobpcg"),
        default="lanczos",
        help="eigenvalue method (default lanczos)",
    )
    group.add_argument(
        "--tol",
        type=_positive_float,
        default=1e-8,
        metavar="T",
        help="relative eigenvalue tolerance (default 1e-8; float32 products limit the "
        "accuracy to about 1e-7 of the largest eigenvalue)",
    )
    return eigen


def _trace_options(with_switch: bool) -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("trace")
    if with_switch:
        group.add_argument(
            "--trace", action="store_true", help="also estimate the trace of the Hessian"
        )
    group.add_argument(
        "--trace-method",
        choices=("hutchinson", "hutch++", "xtrace"),
        default="hutchinson",
        help="trace estimator (default hutchinson)",
    )
    group.add_argument(
        "--trace-products",
        type=_positive_int,
        default=100,
        metavar="M",
        help="Hessian-vector products for the trace (default 100)",
    )
    return options


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spectra",
        description="Hessian spectrum analysis of TensorFlow/Keras models: eigenvalues, "
        "trace, spectral density, sharpness along training, loss landscapes.",
    )
    parser.add_argument("--version", action="version", version=f"spectra {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common, eigen, trace = _common_options(), _eigen_options(), _trace_options(True)

    analyze = commands.add_parser(
        "analyze",
        parents=[common, eigen, trace],
        help="eigenvalues, trace and spectral density of one model's loss Hessian",
        description="Top eigenvalues (with error bounds), optionally the trace (± standard "
        "error) and the spectral density (stochastic Lanczos quadrature) of the Hessian of a "
        "model's dataset loss. Writes DIR/results.json, DIR/eigenvalues.png and, with "
        "--density, DIR/density.png.",
    )
    analyze.add_argument(
        "model",
        metavar="MODEL",
        help="a .keras file, or a .weights.h5 file or tf.train.Checkpoint with --builder",
    )
    analyze.add_argument(
        "--top-k", type=_positive_int, default=5, metavar="K", help="eigenvalues (default 5)"
    )
    group = analyze.add_argument_group("spectral density")
    group.add_argument("--density", action="store_true", help="estimate the spectral density")
    group.add_argument(
        "--density-steps",
        type=_positive_int,
        default=80,
        metavar="M",
        help="Lanczos steps per probe (default 80)",
    )
    group.add_argument(
        "--density-probes",
        type=_positive_int,
        default=10,
        metavar="P",
        help="random probes (default 10)",
    )
    analyze.set_defaults(run=_analyze)

    sharpness = commands.add_parser(
        "sharpness",
        parents=[common, eigen, trace],
        help="sharpness (top eigenvalue) of every checkpoint of a training run",
        description="Analyze each checkpoint in step order and write DIR/sharpness.json and "
        "DIR/sharpness.csv after each one, and DIR/sharpness.png at the end, with the "
        "edge-of-stability threshold 2/lr (Cohen et al. 2021) when the learning rate is known. "
        "Resumable: a rerun with the same settings skips the checkpoints already done.",
    )
    sharpness.add_argument(
        "checkpoints",
        metavar="CHECKPOINTS",
        help="a directory of checkpoints or a glob pattern (quote it), e.g. 'run/ckpt-*.keras'",
    )
    sharpness.add_argument(
        "--top-k", type=_positive_int, default=1, metavar="K", help="eigenvalues (default 1)"
    )
    sharpness.add_argument(
        "--lr",
        type=_positive_float,
        help="learning rate η of the run, for the 2/η line (default: 'learning_rate' from a "
        "trajectory.json next to the checkpoints, if there is one)",
    )
    sharpness.add_argument(
        "--steps",
        type=int,
        nargs="+",
        metavar="STEP",
        help="training steps of the checkpoint files in natural name order (default: the last "
        "integer in each file name)",
    )
    sharpness.add_argument(
        "--restart",
        action="store_true",
        help="discard the results in DIR and start again",
    )
    sharpness.set_defaults(run=_sharpness)

    landscape = commands.add_parser(
        "landscape",
        parents=[common, eigen],
        help="loss along the top eigenvector(s) and a random direction",
        description="The loss L(θ + α d) for d the top Hessian eigenvector v₁ (and v₂), and a "
        "random direction (filter-normalized as in Li et al. 2018, then scaled to unit norm), "
        "so that α is the Euclidean distance in parameter space for every curve. Writes "
        "DIR/landscape.json, DIR/landscape_1d.png and, with --directions 2, the surface "
        "L(θ + α v₁ + β v₂) in DIR/landscape_2d.png.",
    )
    landscape.add_argument(
        "model",
        metavar="MODEL",
        help="a .keras file, or a .weights.h5 file or tf.train.Checkpoint with --builder",
    )
    landscape.add_argument(
        "--directions",
        type=int,
        choices=(1, 2),
        default=1,
        help="eigenvectors to follow: 1 (v₁) or 2 (v₁, v₂ and the 2-D surface) (default 1)",
    )
    landscape.add_argument(
        "--radius",
        type=_positive_float,
        default=_LANDSCAPE_RADIUS,
        metavar="R",
        help=f"α runs over [-R, R], a distance in parameter space (default {_LANDSCAPE_RADIUS})",
    )
    landscape.add_argument(
        "--points",
        type=_positive_int,
        default=_LANDSCAPE_POINTS,
        metavar="N",
        help=f"points per direction; an even N is raised by one so that α = 0 is included "
        f"(default {_LANDSCAPE_POINTS})",
    )
    landscape.set_defaults(run=_landscape)
    return parser


# --------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    words = sys.argv[1:] if argv is None else list(argv)
    args.command_line = shlex.join(["spectra", *words])
    args.progress = False if args.no_progress else None
    try:
        args.run(args)
    except _UserError as err:
        message = " ".join(str(err).split())
        print(f"spectra: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spectra: interrupted", file=sys.stderr)
        return 130
    return 0


# --------------------------------------------------------------------------- shared steps


def _versions() -> dict[str, str]:
    return {
        "spectra": __version__,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "matplotlib": matplotlib.__version__,
        "python": sys.version.split()[0],
    }


def _dtype(args: argparse.Namespace) -> Any:
    return np.float64 if args.float64 else None


def _load_data(args: argparse.Namespace) -> Any:
    """The data, after checking that the loss name is known (both are user errors)."""
    with _user_errors():
        _keras.resolve_loss(args.loss, tf.float32)
        return load_data(args.data, args.max_examples, args.seed)


def _load_checked_model(path: str | os.PathLike, args: argparse.Namespace, data: Any) -> Any:
    """Load a model and check that the data and the loss fit it (cheap: 2 examples)."""
    with _user_errors():
        model = load_model(path, builder=args.builder)
        check_data_fits_model(model, data.x, data.y, args.loss)
    return model


def _operator(model: Any, args: argparse.Namespace, data: Any) -> Any:
    return HessianOperator.from_keras(
        model,
        args.loss,
        data.as_tuple(),
        batch_size=args.batch_size,
        training=args.training,
        dtype=_dtype(args),
    )


def _output_directory(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    with _user_errors():
        out.mkdir(parents=True, exist_ok=True)
    return out


def _data_description(args: argparse.Namespace, data: Any) -> dict[str, Any]:
    return {
        "spec": args.data,
        "name": data.name,
        "description": data.description,
        "num_examples": data.num_examples,
        "x_shape": list(data.x.shape),
        "y_shape": list(data.y.shape),
        "sample_weights": data.sample_weight is not None,
    }


def _model_description(path: str, model: Any, num_parameters: int) -> dict[str, Any]:
    return {
        "path": path,
        "name": model.name,
        "num_parameters": num_parameters,
        "dtype": str(model.trainable_variables[0].dtype),
    }


def _save(ax: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    save_figure(ax, path)
    plt.close(ax.figure)


def _plus_minus(value: float, error: float) -> str:
    return f"{value:.6g} ± {error:.1e}"


# --------------------------------------------------------------------------- analyze


def _analyze(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    data = _load_data(args)
    model = _load_checked_model(args.model, args, data)
    out = _output_directory(args)
    op = _operator(model, args, data)
    loaded = time.perf_counter()

    eig = eigenvalues(
        op, k=args.top_k, method=args.method, tol=args.tol, seed=args.seed, progress=args.progress
    )
    ratio = eigenvalue_ratio(eig) if args.top_k > 1 and eig.eigenvalues[-1] != 0 else None
    wall_times = {"load": loaded - started, "eigenvalues": eig.wall_time}
    trace_result = None
    if args.trace:
        trace_result = trace(
            op,
            method=args.trace_method,
            num_products=args.trace_products,
            seed=args.seed,
            progress=args.progress,
        )
        wall_times["trace"] = trace_result.wall_time
    density = moments = negative = None
    if args.density:
        density = spectral_density(
            op,
            num_steps=args.density_steps,
            num_probes=args.density_probes,
            seed=args.seed,
            progress=args.progress,
        )
        moments = density.moments()
        threshold = _NEGATIVE_MASS_THRESHOLD * abs(float(eig.eigenvalues[0]))
        fraction, stderr = negative_mass_fraction(density, eps=threshold)
        below_zero, below_zero_stderr = negative_mass_fraction(density)
        negative = {
            "fraction": fraction,
            "stderr": stderr,
            "below": -threshold,
            "relative_threshold": _NEGATIVE_MASS_THRESHOLD,
            "fraction_below_zero": below_zero,
            "stderr_below_zero": below_zero_stderr,
        }
        wall_times["density"] = density.wall_time

    files = {
        "results": str(out / "results.json"),
        "eigenvalues_figure": str(out / "eigenvalues.png"),
    }
    _save(plot_eigenvalues(eig), out / "eigenvalues.png")
    if density is not None:
        files["density_figure"] = str(out / "density.png")
        _save(plot_spectral_density(density), out / "density.png")
    wall_times["total"] = time.perf_counter() - started
    report = AnalysisReport(
        command=args.command_line,
        versions=_versions(),
        settings={
            **_measurement_settings(args),
            "density": args.density,
            "density_steps": args.density_steps if args.density else None,
            "density_probes": args.density_probes if args.density else None,
            "dtype": str(op.dtype),
        },
        model=_model_description(args.model, model, op.shape[0]),
        data=_data_description(args, data),
        loss=op.loss(),
        eigenvalues=eig,
        eigenvalue_ratio=ratio,
        trace=trace_result,
        density=density,
        density_moments=moments,
        negative_mass=negative,
        num_products=op.num_hvps,
        num_data_passes=op.num_data_passes,
        wall_times=wall_times,
        files=files,
    )
    report.to_json(out / "results.json", include_vectors=False)
    _print_analysis(report)


def _print_analysis(report: AnalysisReport) -> None:
    eig = report.eigenvalues
    print(
        f"{report.model['name']} ({report.model['num_parameters']:,} parameters, "
        f"{report.settings['dtype']}) on {report.data['name']} "
        f"({report.data['num_examples']} examples): loss {report.loss:.6g}"
    )
    print(f"top {eig.eigenvalues.size} eigenvalues ({eig.method}, ± error bound):")
    if report.settings["dtype"] != "float64":
        eps = np.finfo(report.settings["dtype"]).eps
        print(f"  ({report.settings['dtype']} products: accurate to about {eps:.0e}·λ1 at best)")
    for index, (value, bound, residual, converged) in enumerate(
        zip(eig.eigenvalues, eig.error_bounds, eig.residual_norms, eig.converged), start=1
    ):
        note = "" if converged else "  (not converged)"
        print(f"  λ{index} = {_plus_minus(value, bound)}   residual {residual:.1e}{note}")
    if report.eigenvalue_ratio is not None:
        print(f"λ1/λ{eig.eigenvalues.size} = {report.eigenvalue_ratio:.4g}")
    if report.trace is not None:
        print(
            f"trace ({report.trace.method}) = {report.trace.estimate:.6g} ± "
            f"{report.trace.stderr:.2g} (standard error)"
        )
    if report.negative_mass is not None:
        negative = report.negative_mass
        print(
            f"negative mass (fraction of the spectrum below -1e-3·λ1 = {negative['below']:.2g}) "
            f"= {negative['fraction']:.3g} ± {negative['stderr']:.1g} "
            f"({negative['fraction_below_zero']:.3g} below 0, the near-zero bulk included)"
        )
    print(
        f"{report.num_products:,} Hessian-vector products in {report.num_data_passes} data "
        f"passes, {report.wall_times['total']:.1f} s"
    )
    print(f"results: {report.files['results']}")
    figures = [path for key, path in report.files.items() if key.endswith("_figure")]
    print(f"figures: {', '.join(figures)}")


# --------------------------------------------------------------------------- sharpness


def _learning_rate(args: argparse.Namespace, refs: list[Any]) -> tuple[float | None, str | None]:
    """``--lr``, else ``learning_rate`` from a ``trajectory.json`` beside the checkpoints."""
    if args.lr is not None:
        return args.lr, "--lr"
    parents = {ref.path.parent for ref in refs}
    if len(parents) != 1:
        return None, None
    notes = parents.pop() / "trajectory.json"
    if not notes.is_file():
        return None, None
    with _user_errors():
        try:
            content = json.loads(notes.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"cannot read '{notes}' as JSON ({err}); give --lr.") from err
    rate = content.get("learning_rate") if isinstance(content, dict) else None
    if rate is None:
        return None, None
    if not (isinstance(rate, (int, float)) and rate > 0):
        raise _UserError(f"'{notes}' has learning_rate {rate!r}, not a positive number; give --lr.")
    return float(rate), str(notes)


def _fingerprint(data: Any) -> str:
    digest = hashlib.sha256()
    for array in (data.x, data.y, data.sample_weight):
        if array is not None:
            digest.update(np.ascontiguousarray(array).tobytes())
            digest.update(str((array.dtype, array.shape)).encode())
    return digest.hexdigest()


def _measurement_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options that decide the numbers of ``analyze`` and ``sharpness``."""
    return {
        "loss": args.loss,
        "max_examples": args.max_examples,
        "seed": args.seed,
        "top_k": args.top_k,
        "method": args.method,
        "tol": args.tol,
        "trace": args.trace,
        "trace_method": args.trace_method if args.trace else None,
        "trace_products": args.trace_products if args.trace else None,
        "batch_size": args.batch_size,
        "float64": args.float64,
        "training": args.training,
        "builder": args.builder,
    }


def _sharpness_settings(args: argparse.Namespace, data: Any) -> dict[str, Any]:
    values = {
        **_measurement_settings(args),
        "data_sha256": _fingerprint(data),
        "num_examples": data.num_examples,
    }
    return {name: values[name] for name in _SHARPNESS_NUMBER_SETTINGS}


def _previous_entries(path: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The checkpoints already in ``path``, after checking they were computed like these."""
    if not path.exists():
        return []
    hint = "rerun with --restart to discard them, or choose another --out"
    try:
        previous = json.loads(path.read_text())
        stored = previous["settings"]
        entries = list(previous["checkpoints"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise _UserError(
            f"'{path}' exists but is not a sharpness file of spectra ({err}); {hint}."
        ) from err
    wanted = json.loads(json.dumps(settings))
    changed = [
        f"{name}: {stored.get(name)!r} -> {wanted[name]!r}"
        for name in wanted
        if stored.get(name) != wanted[name]
    ]
    if changed:
        raise _UserError(
            f"'{path}' holds results computed with other settings ({'; '.join(changed)}); {hint}."
        )
    return entries


def _sharpness_csv(entries: list[dict[str, Any]], top_k: int) -> str:
    columns = ["step", "file", "loss"]
    for name in ("eigenvalue", "error_bound", "residual_norm"):
        columns += [f"{name}_{i}" for i in range(1, top_k + 1)]
    columns += ["trace", "trace_stderr", "num_products", "num_data_passes", "wall_time"]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(columns)
    for entry in entries:
        row = [entry["step"], entry["file"], repr(entry["loss"])]
        for name in ("eigenvalues", "error_bounds", "residual_norms"):
            row += [repr(value) for value in entry[name]]
        row += [
            "" if entry["trace"] is None else repr(entry["trace"]),
            "" if entry["trace_stderr"] is None else repr(entry["trace_stderr"]),
            entry["num_products"],
            entry["num_data_passes"],
            repr(entry["wall_time"]),
        ]
        writer.writerow(row)
    return text.getvalue()


def _measure_checkpoint(ref: Any, model: Any, args: argparse.Namespace, data: Any) -> dict:
    started = time.perf_counter()
    op = _operator(model, args, data)
    eig = eigenvalues(
        op, k=args.top_k, method=args.method, tol=args.tol, seed=args.seed, progress=args.progress
    )
    trace_result = None
    if args.trace:
        trace_result = trace(
            op,
            method=args.trace_method,
            num_products=args.trace_products,
            seed=args.seed,
            progress=args.progress,
        )
    return {
        "step": ref.step,
        "file": ref.path.name,
        "path": str(ref.path),
        "loss": op.loss(),
        "eigenvalues": eig.eigenvalues.tolist(),
        "error_bounds": eig.error_bounds.tolist(),
        "residual_norms": eig.residual_norms.tolist(),
        "converged": eig.converged.tolist(),
        "trace": None if trace_result is None else trace_result.estimate,
        "trace_stderr": None if trace_result is None else trace_result.stderr,
        "num_parameters": op.shape[0],
        "num_products": op.num_hvps,
        "num_data_passes": op.num_data_passes,
        "wall_time": time.perf_counter() - started,
    }


def _sharpness_line(entry: dict[str, Any], edge: float | None) -> str:
    top = _plus_minus(entry["eigenvalues"][0], entry["error_bounds"][0])
    line = f"step {entry['step']:>6}  λ1 = {top}"
    if edge is not None:
        line += f"  ({entry['eigenvalues'][0] / edge:.3f} × 2/lr)"
    if entry["trace"] is not None:
        line += f"  trace = {entry['trace']:.5g} ± {entry['trace_stderr']:.2g}"
    return line + f"  loss {entry['loss']:.4f}"


def _sharpness(args: argparse.Namespace) -> None:
    with _user_errors():
        refs = find_checkpoints(args.checkpoints, steps=args.steps)
    rate, rate_source = _learning_rate(args, refs)
    edge = None if rate is None else 2.0 / rate
    data = _load_data(args)
    out = _output_directory(args)
    json_path, csv_path = out / "sharpness.json", out / "sharpness.csv"
    settings = _sharpness_settings(args, data)
    entries = [] if args.restart else _previous_entries(json_path, settings)

    print(f"{len(refs)} checkpoints in {args.checkpoints}; data {data.description}")
    if rate_source == "--lr":
        print(f"learning rate {rate:g} (--lr): edge of stability 2/lr = {edge:.4g}")
    elif rate is not None:
        print(f"learning rate {rate:g} from {rate_source}: edge of stability 2/lr = {edge:.4g}")
    else:
        print("learning rate unknown (no --lr, no trajectory.json): no 2/lr line")
    done = {(entry["step"], entry["file"]) for entry in entries}
    steps_done = {entry["step"]: entry["file"] for entry in entries}
    for ref in refs:
        other = steps_done.get(ref.step)
        if other is not None and other != ref.path.name:
            raise _UserError(
                f"'{json_path}' holds step {ref.step} of file '{other}', not '{ref.path.name}'; "
                "rerun with --restart to discard it, or choose another --out."
            )
    skipped = sum((ref.step, ref.path.name) in done for ref in refs)
    if skipped:
        print(f"resuming: {skipped} of {len(refs)} checkpoints already done in {json_path}")

    report = SharpnessReport(
        command=args.command_line,
        versions=_versions(),
        settings=settings,
        data=_data_description(args, data),
        learning_rate=rate,
        learning_rate_source=rate_source,
        edge_of_stability=edge,
        checkpoints=entries,
    )
    for ref in refs:
        if (ref.step, ref.path.name) in done:
            print(f"step {ref.step:>6}  {ref.path.name}: already done, skipped")
            continue
        model = _load_checked_model(ref.path, args, data)
        entry = _measure_checkpoint(ref, model, args, data)
        entries.append(entry)
        entries.sort(key=lambda item: item["step"])
        report.to_json(json_path)
        atomic_write_text(csv_path, _sharpness_csv(entries, args.top_k))
        print(_sharpness_line(entry, edge), flush=True)
    # Once more at the end: a run with nothing left to do still records its command.
    report.to_json(json_path)
    atomic_write_text(csv_path, _sharpness_csv(entries, args.top_k))

    steps = [entry["step"] for entry in entries]
    values = np.array([entry["eigenvalues"] for entry in entries])
    errors = np.array([entry["error_bounds"] for entry in entries])
    if args.top_k == 1:
        values, errors = values[:, 0], errors[:, 0]
    ax = plot_sharpness(
        steps,
        values,
        lr=rate,
        errors=errors,
        traces=[entry["trace"] for entry in entries] if args.trace else None,
        trace_errors=[entry["trace_stderr"] for entry in entries] if args.trace else None,
    )
    _save(ax, out / "sharpness.png")
    top = max(entries, key=lambda entry: entry["eigenvalues"][0])
    summary = f"largest λ1 = {top['eigenvalues'][0]:.6g} at step {top['step']}"
    if edge is not None:
        summary += f" (2/lr = {edge:.4g})"
    print(summary)
    print(f"results: {json_path}, {csv_path}")
    print(f"figure: {out / 'sharpness.png'}")


# --------------------------------------------------------------------------- landscape


def _landscape(args: argparse.Namespace) -> None:
    data = _load_data(args)
    model = _load_checked_model(args.model, args, data)
    out = _output_directory(args)
    op = _operator(model, args, data)
    eig = eigenvalues(
        op,
        k=args.directions,
        method=args.method,
        tol=args.tol,
        seed=args.seed,
        progress=args.progress,
        return_eigenvectors=True,
    )
    assert eig.eigenvectors is not None
    random = random_direction(op, args.seed, normalization="filter")
    random /= np.linalg.norm(random)
    directions = {f"v{i + 1}": eig.eigenvectors[:, i] for i in range(args.directions)}
    directions["random"] = random
    half = args.points // 2
    alphas = np.linspace(-args.radius, args.radius, 2 * half + 1)
    common = {
        "batch_size": args.batch_size,
        "training": args.training,
        "dtype": _dtype(args),
    }
    curves = loss_landscape(model, args.loss, data.as_tuple(), directions, alphas, **common)
    names = {
        f"v{i + 1}": f"{symbol} (λ{symbol[1:]} = {value:.4g})"
        for i, (symbol, value) in enumerate(zip(("v₁", "v₂"), eig.eigenvalues))
    }
    names["random"] = "random direction"
    files = {"results": str(out / "landscape.json"), "curves_figure": str(out / "landscape_1d.png")}
    ax = plot_loss_landscape_1d(
        alphas,
        {names[label]: curves.losses[label] for label in curves.labels},
        xlabel="Distance α along the direction (parameter space)",
    )
    _save(ax, out / "landscape_1d.png")
    surface = None
    if args.directions == 2:
        plane = {label: directions[label] for label in ("v1", "v2")}
        surface = loss_landscape(
            model, args.loss, data.as_tuple(), plane, alphas, betas=alphas, **common
        )
        ax = plot_loss_landscape_2d(alphas, alphas, surface.losses_2d, labels=("v₁", "v₂"))
        files["surface_figure"] = str(out / "landscape_2d.png")
        _save(ax, out / "landscape_2d.png")
    report = LandscapeReport(
        command=args.command_line,
        versions=_versions(),
        settings={
            "loss": args.loss,
            "directions": args.directions,
            "radius": args.radius,
            "points": alphas.size,
            "method": args.method,
            "tol": args.tol,
            "batch_size": args.batch_size,
            "max_examples": args.max_examples,
            "float64": args.float64,
            "training": args.training,
            "seed": args.seed,
            "builder": args.builder,
        },
        model=_model_description(args.model, model, op.shape[0]),
        data=_data_description(args, data),
        eigenvalues=eig,
        directions={
            **{
                f"v{i + 1}": f"unit eigenvector of λ{i + 1} (sign as returned)"
                for i in range(args.directions)
            },
            "random": "Gaussian, filter-normalized (Li et al. 2018), scaled to unit norm",
        },
        curves=curves,
        surface=surface,
        files=files,
    )
    report.to_json(out / "landscape.json", include_vectors=False)
    print(
        f"{model.name} ({op.shape[0]:,} parameters) on {data.name} ({data.num_examples} "
        f"examples): loss {curves.base_loss:.6g}"
    )
    for label in curves.labels:
        losses = curves.losses[label]
        print(f"  {names[label]}: loss at α = ±{args.radius:g}: {losses[0]:.4g}, {losses[-1]:.4g}")
    print(f"results: {files['results']}")
    print(f"figures: {', '.join(p for k, p in files.items() if k.endswith('_figure'))}")
