"""The argument parser of the ``spectra`` command line.

The options every subcommand shares are argument groups here (:func:`common_options`: data
and loss, model and computation, output; :func:`eigen_options`; :func:`trace_options`); each
subcommand module (``spectra/cli/<command>.py``) registers its own parser and options with an
``add_arguments(commands)`` function and runs with ``run(args, console)``. Adding a
subcommand is that module plus its name in :data:`COMMANDS`. The command modules import no
TensorFlow at module level, so ``spectra --help`` never loads it (it imports NumPy and SciPy
with them: about 0.3 s of CPU).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from typing import Any, NoReturn

from spectra import __version__
from spectra._validation import MAX_SEED, check_seed

# The subcommands, in the order ``spectra --help`` lists them: each is the module
# spectra.cli.<name>, with add_arguments(commands) and run(args, console).
COMMANDS = ("analyze", "sharpness", "landscape", "plot")
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


def positive_int(text: str) -> int:
    """An option's positive integer (argparse ``type=``): a one-line usage error else."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """An option's positive finite number (argparse ``type=``): a one-line usage error else."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _seed(text: str) -> int:
    """A seed: an integer 0 ≤ s < 2⁶² (what the operators' stateless generators take),
    checked by :func:`spectra._validation.check_seed`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    try:
        return check_seed("--seed", value, below=MAX_SEED)  # type: ignore[return-value]
    except ValueError as err:
        # argparse names the option itself: "argument --seed: must be ...".
        raise argparse.ArgumentTypeError(str(err).removeprefix("--seed ")) from None


def format_list(text: str) -> list[str]:
    """``--format``'s comma-separated figure formats (``"png,PDF"``: png and pdf), each one
    of :data:`FIGURE_FORMATS`."""
    formats = [part.strip().lower().lstrip(".") for part in text.split(",") if part.strip()]
    unknown = [name for name in formats if name not in FIGURE_FORMATS]
    if not formats or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown figure format(s) {unknown or text!r}; choose from {', '.join(FIGURE_FORMATS)}"
        )
    return list(dict.fromkeys(formats))


class _PerOutputAction(argparse.Action):
    """A repeatable ``OUTPUT=VALUE`` option gathered into a dict by output name (``None``
    until given); with ``plain`` (``--loss``) also one ``VALUE`` for every output, as a
    string (the last one given wins), which cannot be mixed with ``OUTPUT=VALUE``. Each
    VALUE goes through ``convert`` (argparse's ``type`` would get the whole ``OUTPUT=VALUE``);
    an output named twice is an error."""

    def __init__(self, *args: Any, plain: bool = False, convert: Any = None, **kwargs: Any) -> None:
        self.plain = plain
        self.convert = convert
        super().__init__(*args, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        text = str(values).strip()
        current = getattr(namespace, self.dest, None)
        output, named, value = (part.strip() for part in text.partition("="))
        if not named:
            if not self.plain:
                raise argparse.ArgumentError(
                    self, f"give OUTPUT=VALUE, one output at a time, got {text!r}"
                )
            if isinstance(current, dict):
                raise argparse.ArgumentError(
                    self,
                    f"{text!r} after OUTPUT=NAME: give one loss for all outputs or one "
                    "per output (OUTPUT=NAME), not both",
                )
            setattr(namespace, self.dest, text)
            return
        if not output or not value:
            raise argparse.ArgumentError(self, f"give OUTPUT=VALUE, got {text!r}")
        if isinstance(current, str):
            raise argparse.ArgumentError(
                self,
                f"{text!r} after {current!r}: give one loss for all outputs or one per "
                "output (OUTPUT=NAME), not both",
            )
        gathered = dict(current or {})
        if output in gathered:
            raise argparse.ArgumentError(self, f"output {output!r} given twice")
        try:
            gathered[output] = value if self.convert is None else self.convert(value)
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentError(self, f"{output}={value}: {err}") from None
        setattr(namespace, self.dest, gathered)


def _output_loss(text: str) -> str | None:
    """A loss name of ``--loss OUTPUT=NAME``; ``none`` leaves the output out of the loss."""
    return None if text.lower() == "none" else text


def _loss_weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def common_options(*, value_labels: bool = False) -> argparse.ArgumentParser:
    """Options shared by all subcommands: data, loss, model loading, precision, output,
    figures (:func:`figure_options`; ``value_labels``: also ``--no-labels``, for commands
    whose figures write values at their marks)."""
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
        action=_PerOutputAction,
        plain=True,
        convert=_output_loss,
        metavar="[OUTPUT=]NAME",
        help="a Keras loss name, e.g. sparse_categorical_crossentropy, binary_crossentropy, "
        "mse, for every output; or, repeated, one per output of a multi-output model, "
        "--loss out1=mse --loss out2=sparse_categorical_crossentropy (every output named; "
        "OUTPUT=none leaves one out). Default: the loss the model was compiled with, its "
        "loss weights included; a .keras file saved after compile carries it. --loss "
        "replaces the compiled loss weights too",
    )
    group.add_argument(
        "--loss-weight",
        dest="loss_weights",
        action=_PerOutputAction,
        convert=_loss_weight,
        metavar="OUTPUT=W",
        help="repeatable: the weight W >= 0 of an output's loss in the total Σ W·L_OUTPUT "
        "(as Keras' compile(loss_weights=...); outputs not named keep weight 1), with "
        "--loss or the compiled loss",
    )
    group.add_argument(
        "--max-examples",
        type=positive_int,
        metavar="N",
        help="use a random subset of N examples (drawn with --seed; default: all)",
    )
    group.add_argument(
        "--batch-size",
        type=positive_int,
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
        "--custom-objects",
        metavar="MODULE",
        help="import this module before loading a .keras file, so that the custom classes it "
        "defines or registers (keras.saving.register_keras_serializable) are known: "
        "'path/to/module.py', a dotted module name, or either with ':attr' naming a dict or "
        "list of them; this runs the module's code (as --builder does), Keras' safe mode "
        "stays on",
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
        type=format_list,
        default=["png"],
        metavar="FMT[,FMT]",
        help="figure formats, e.g. png,pdf,svg (default png)",
    )
    group.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (by default a bar appears on stderr when it is a terminal, once "
        "a run has lasted 2 s)",
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
    _add_figure_options(common, value_labels=value_labels)
    return common


def eigen_options() -> argparse.ArgumentParser:
    """The eigensolver's options (``--method``, ``--tol``)."""
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
        type=positive_float,
        default=1e-8,
        metavar="T",
        help="relative eigenvalue tolerance (default 1e-8; float32 products limit the "
        "accuracy to about 1.2e-6 of the largest eigenvalue)",
    )
    return eigen


def trace_options() -> argparse.ArgumentParser:
    """The trace's options (``--trace``, ``--trace-method``, ``--trace-products``)."""
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("trace")
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
        type=positive_int,
        default=100,
        metavar="M",
        help="Hessian-vector products for the trace (default 100; hutch++ and xtrace need >= 4)",
    )
    return options


FIGURE_STYLES = ("column", "page")
CAPTIONS = ("none", "short", "full")


def figure_options(*, value_labels: bool = False) -> argparse.ArgumentParser:
    """How the figures are drawn (``--style``, ``--font``, ``--no-title``, ``--caption``,
    ``--no-legend``, with ``value_labels`` ``--no-labels``): shared by analyze, sharpness,
    landscape and plot."""
    options = argparse.ArgumentParser(add_help=False)
    _add_figure_options(options, value_labels=value_labels)
    return options


def _add_figure_options(parser: argparse.ArgumentParser, *, value_labels: bool = False) -> None:
    group = parser.add_argument_group("figures")
    group.add_argument(
        "--style",
        choices=FIGURE_STYLES,
        default="column",
        help="print size of the figures: 'column' (3.25 in wide, one column of a two-column "
        "paper) or 'page' (6.75 in, both columns); fonts 7-9 pt at that size, PNG at 300 dpi, "
        "PDF/PS fonts embedded as TrueType, SVG text kept as text (default column)",
    )
    group.add_argument(
        "--font",
        default="sans",
        metavar="serif|sans|FAMILY",
        help="the figures' font: serif (Times-like, math in Computer Modern; no TeX needed), "
        "sans (DejaVu Sans) or a font family matplotlib finds, e.g. 'DejaVu Serif' (an "
        "unknown one is an error listing those installed); recorded in the results and in "
        "each figure file's metadata (default sans)",
    )
    group.add_argument(
        "--no-title",
        action="store_true",
        help="no title above the figures (a paper's caption says what a figure shows)",
    )
    group.add_argument(
        "--caption",
        choices=CAPTIONS,
        help="the settings line under the title: none; short (model, data, matrix, "
        "estimator); full (also the seed, products, the trace when known and what the bars "
        "mean). Default short, so that a figure looked at later still says what it shows, "
        "except the sharpness figure's (none: it keeps its height for the data); for a "
        "paper give --no-title --caption none. The full settings go into every figure "
        "file's metadata (PDF Subject, PNG text, SVG description) and the results' JSON "
        "('figures') either way",
    )
    group.add_argument(
        "--no-legend",
        action="store_true",
        help="no legend (a paper's caption says what the marks are; the full caption in "
        "the metadata says it too)",
    )
    if value_labels:
        group.add_argument(
            "--no-labels",
            action="store_true",
            help="no values written beside the eigenvalues' markers and the per-layer bars",
        )


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``spectra`` and its subcommands (:data:`COMMANDS`, each registered by
    its own module's ``add_arguments``)."""
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
    for name in COMMANDS:
        importlib.import_module(f"spectra.cli.{name}").add_arguments(commands)
    return parser
