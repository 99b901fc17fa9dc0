"""The argument parser of the ``spectra`` command line (imports nothing heavy: ``--help``
answers at once)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

from spectra import __version__
from spectra.cli._curvature import CURVATURES, DEFAULT_CURVATURE

# The landscape's α grid when --points is not given: enough points in the quadratic region.
LANDSCAPE_POINTS = 41
# The most loss evaluations (data passes) ``spectra landscape`` runs without --force: 2,000
# is 2 curves of 1,000 points, or a 2-D surface of 44² points (the default 41 points give
# 2·41 + 1 = 83 evaluations in 1-D and 41² + 2·41 + 1 = 1,764 with --directions 2).
LANDSCAPE_MAX_EVALUATIONS = 2000
# Seeds are non-negative and below 2**62 (the operators' stateless generators).
MAX_SEED = 2**62
FIGURE_FORMATS = ("png", "pdf", "svg", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``spectra: error: ...``, exit 2."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.split(" ", 1)[1] + " " if " " in self.prog else ""
        print(
            f"spectra: error: {message} (see 'spectra {command}--help')",
            file=sys.stderr,
        )
        raise SystemExit(2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _seed(text: str) -> int:
    """A seed: an integer 0 ≤ s < 2⁶² (what the operators' stateless generators take)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if not 0 <= value < MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer below 2**62, got {text}")
    return value


def _formats(text: str) -> list[str]:
    formats = [part.strip().lower().lstrip(".") for part in text.split(",") if part.strip()]
    unknown = [name for name in formats if name not in FIGURE_FORMATS]
    if not formats or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown figure format(s) {unknown or text!r}; choose from {', '.join(FIGURE_FORMATS)}"
        )
    return list(dict.fromkeys(formats))


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
        help="a Keras loss name, e.g. sparse_categorical_crossentropy, binary_crossentropy, "
        "mse (default: the loss the model was compiled with, its loss weights included; "
        "a .keras file saved after compile carries it)",
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
        help="examples per batch; in inference mode the loss is the exact dataset mean either "
        "way (default: all examples in one batch)",
    )
    group = common.add_argument_group("model and computation")
    group.add_argument(
        "--builder",
        metavar="MODULE:FUNCTION",
        help="function returning the built model, for .weights.h5 files (any that Keras' "
        "load_weights reads, subclassed models included) and tf.train.Checkpoints "
        "('module:function' or 'path/to/file.py:function')",
    )
    group.add_argument(
        "--float64",
        action="store_true",
        help="compute in float64 on a float64 copy of the model (default: the model's dtype)",
    )
    group.add_argument(
        "--training",
        action="store_true",
        help="run layers in training mode: Dropout on, BatchNorm with the statistics of each "
        "batch, so the loss is the batch-split loss Σ_b (n_b/N) L_b and depends on "
        "--batch-size (recorded in the results); default: inference mode",
    )
    group.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help="seed of the data subset, the random probes and, with --training, the Dropout "
        "masks: the same command and seed give the same numbers in every process, as the "
        "Python API with seed=S does (an integer 0 ≤ S < 2**62; default 0; recorded in the "
        "results)",
    )
    group = common.add_argument_group("output")
    group.add_argument("--out", required=True, metavar="DIR", help="output directory")
    group.add_argument(
        "--format",
        type=_formats,
        default=["png"],
        metavar="FMT[,FMT]",
        help="figure formats, e.g. png,pdf,svg (default png)",
    )
    group.add_argument(
        "--no-progress", action="store_true", help="no progress bars (shown only on a terminal)"
    )
    verbosity = group.add_mutually_exclusive_group()
    verbosity.add_argument(
        "--quiet", action="store_true", help="print only warnings and errors (files as usual)"
    )
    verbosity.add_argument(
        "--verbose",
        action="store_true",
        help="more detail, and TensorFlow's own log lines (hidden by default)",
    )
    group.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
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
        help="Hessian-vector products for the trace (default 100; hutch++ and xtrace need >= 4)",
    )
    return options


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``spectra`` and its subcommands."""
    parser = OneLineParser(
        prog="spectra",
        description="Hessian spectrum analysis of TensorFlow/Keras models: eigenvalues, "
        "trace, spectral density, sharpness along training, loss landscapes.",
        epilog="Exit status: 0 done; 1 some checkpoints failed (sharpness --skip-bad) or an "
        "internal error; 2 an error in the command or its inputs (one line "
        "'spectra: error: ...'; --debug shows the traceback); 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"spectra {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common, eigen, trace = _common_options(), _eigen_options(), _trace_options(True)

    analyze = commands.add_parser(
        "analyze",
        parents=[common, eigen, trace],
        help="eigenvalues, trace, spectral density and per-layer spectra of one model's loss "
        "Hessian (or GGN, Fisher)",
        description="Top eigenvalues (with error bounds), optionally the trace (± standard "
        "error) and the spectral density (stochastic Lanczos quadrature) of the Hessian of a "
        "model's dataset loss (or of another --curvature matrix). Writes DIR/results.json, "
        "DIR/eigenvalues.png, with --density DIR/density.png and with --layers "
        "DIR/layers.png (one file per --format).",
    )
    analyze.add_argument(
        "model",
        metavar="MODEL",
        help="a .keras file, or a .weights.h5 file or tf.train.Checkpoint with --builder",
    )
    analyze.add_argument(
        "--top-k", type=_positive_int, default=5, metavar="K", help="eigenvalues (default 5)"
    )
    analyze.add_argument(
        "--log-scale", action="store_true", help="eigenvalue figure on a logarithmic axis"
    )
    analyze.add_argument(
        "--curvature",
        choices=tuple(CURVATURES),
        default=DEFAULT_CURVATURE,
        help="the curvature matrix: the loss Hessian, the generalized Gauss-Newton matrix, "
        "the Monte Carlo Fisher (labels sampled with --seed) or the empirical Fisher "
        f"(default {DEFAULT_CURVATURE})",
    )
    analyze.add_argument(
        "--layers",
        action="store_true",
        help="also the top --top-k eigenvalues of each layer's diagonal block (and, with "
        "--trace, its Hutchinson trace from --trace-products probes per layer), all layers "
        "in one data pass per step; writes DIR/layers.png",
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
        help="random probes (default 10; one probe gives no standard error)",
    )
    analyze.add_argument(
        "--restart",
        action="store_true",
        help="remove the files of the previous spectra run in DIR (those its "
        ".spectra-manifest.json lists, nothing else) before writing; without it a DIR "
        "holding another run's files is refused",
    )
    analyze.set_defaults(command_module="analyze")

    sharpness = commands.add_parser(
        "sharpness",
        parents=[common, eigen, trace],
        help="sharpness (top eigenvalue) of every checkpoint of a training run",
        description="Analyze each checkpoint in step order and write DIR/sharpness.json and "
        "DIR/sharpness.csv after each one, and DIR/sharpness.png at the end, with the "
        "stability threshold of the run's optimizer (2/η for gradient descent, Cohen et al. "
        "2021) when it is known; with --preconditioned the sharpness of P⁻¹H for the "
        "optimizer state of each checkpoint, against the optimizer's threshold (38/η for "
        "Adam, Cohen et al. 2022). Each entry also records the overlap of the top "
        "eigenvector(s) with the previous checkpoint's. Resumable: a rerun with the same "
        "checkpoints and settings skips the checkpoints already done; anything else is "
        "refused. Checkpoints of one architecture share one model and one compiled Hessian "
        "product, and each eigensolve starts from the previous checkpoint's eigenvectors.",
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
        help="learning rate η of the run, for the threshold line (default: the optimizer "
        "recorded in a compiled .keras checkpoint, else 'learning_rate' of a trajectory.json "
        "beside the checkpoints); alone, it draws gradient descent's 2/η",
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
        help="discard the results in DIR and start again (removes the files of the previous "
        "spectra run in DIR, those its .spectra-manifest.json lists, nothing else)",
    )
    sharpness.add_argument(
        "--skip-bad",
        action="store_true",
        help="record a checkpoint that cannot be loaded or measured as failed, with the "
        "reason, and go on (exit status 1 if any failed)",
    )
    sharpness.add_argument(
        "--preconditioned",
        action="store_true",
        help="measure the preconditioned sharpness λ_max(P⁻¹H) (the eigenvalues of "
        "P^-1/2 H P^-1/2) with P the diagonal preconditioner of the optimizer state each "
        "checkpoint carries (Adam, AdamW, RMSprop, Adagrad; a .keras file saved by a "
        "compiled model after training), against the optimizer's threshold, e.g. "
        "(2+2β₁)/((1−β₁)η) for Adam (Cohen et al. 2022)",
    )
    sharpness.add_argument(
        "--plot-overlap",
        action="store_true",
        help="draw the overlap of consecutive top eigenvectors (recorded either way) on the figure",
    )
    sharpness.add_argument(
        "--cold-start",
        action="store_true",
        help="start every eigensolve from a random vector instead of the previous "
        "checkpoint's eigenvectors",
    )
    sharpness.set_defaults(command_module="sharpness")

    landscape = commands.add_parser(
        "landscape",
        parents=[common, eigen],
        help="loss along the top eigenvector(s) and a random direction",
        description="The loss L(θ + α d) for d the top Hessian eigenvector v₁ (and v₂), and a "
        "random direction (filter-normalized as in Li et al. 2018, then scaled to unit norm), "
        "so that α is the Euclidean distance in parameter space for every curve; the quadratic "
        "model along v₁ is drawn for comparison. Writes DIR/landscape.json, "
        "DIR/landscape_1d.png and, with --directions 2, the surface L(θ + α v₁ + β v₂) in "
        "DIR/landscape_2d.png.",
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
        metavar="R",
        help="α runs over [-R, R], a distance in parameter space (default: scaled to the "
        "curvature, R = 2·√(2L/λ₁), where the quadratic model along v₁ raises the loss L by 4L)",
    )
    landscape.add_argument(
        "--points",
        type=_positive_int,
        default=LANDSCAPE_POINTS,
        metavar="N",
        help=f"points per direction; an even N is raised by one so that α = 0 is included, "
        f"N = 1 evaluates α = 0 only (default {LANDSCAPE_POINTS}). Each point costs one pass "
        f"over the data: 1-D curves take (directions + 1)·N + 1 passes, --directions 2 adds "
        f"N² + 1; runs of more than {LANDSCAPE_MAX_EVALUATIONS:,} passes are refused without "
        "--force",
    )
    landscape.add_argument(
        "--force",
        action="store_true",
        help=f"run a landscape of more than {LANDSCAPE_MAX_EVALUATIONS:,} loss evaluations "
        "(the estimate of its cost is printed first)",
    )
    landscape.add_argument(
        "--restart",
        action="store_true",
        help="remove the files of the previous spectra run in DIR (those its "
        ".spectra-manifest.json lists, nothing else) before writing; without it a DIR "
        "holding another run's files is refused",
    )
    landscape.set_defaults(command_module="landscape")
    return parser
