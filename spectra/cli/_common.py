"""What the subcommands share: errors, console output, inputs (checked, loaded, described),
the options' settings and the output directory.

The reports themselves (their settings, computation and figures) are :mod:`spectra.reports`;
the command modules map their arguments to its settings. Keras' backend is imported only by
:func:`require_backend` (TensorFlow quietly, see :mod:`spectra._console`; nothing of
TensorFlow under ``KERAS_BACKEND=jax``) and by the functions that load models, after the
cheap checks.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import numpy as np

from spectra import __version__
from spectra._validation import loss_config, loss_name
from spectra.analysis.trajectory import explain_null
from spectra.cli._curvature import curvature_choice
from spectra.io.files import (
    MANIFEST_NAME,
    DirectoryLock,
    DirectoryLocked,
    OutputClaim,
    atomic_write_json,
    claim_outputs,
    prepare_directory,
    remove_temporaries,
)
from spectra.reports.base import (
    DEFAULT_FAILURE_PROBABILITY,
    UNNAMED_OUTPUT,
    InputError,
    SettingConflict,
    compile_with_loss_weights,
    output_names,
    seed_generator_states,
)
from spectra.reports.figures import FigureOptions
from spectra.reports.figures import figure_record as record_figures
from spectra.reports.thresholds import PRECONDITIONED_OPTIMIZERS, check_preconditionable

if TYPE_CHECKING:
    import keras
    from matplotlib.figure import Figure
    from scipy.sparse.linalg import LinearOperator
    from tqdm import tqdm

    from spectra.io.datasets import Data
    from spectra.plotting.style import FigureFont


class UserError(Exception):
    """A problem with the command's inputs: reported in one line, exit status 2."""


class SettingError(UserError):
    """A setting that does not fit the model (found once it is loaded): never skipped."""


@contextlib.contextmanager
def user_errors(context: str | None = None) -> Iterator[None]:
    """Turn the errors that checking and loading user inputs raise into :class:`UserError`
    (the reports' input errors as :func:`report_errors` does, without ``context``)."""
    try:
        yield
    except UserError:
        raise
    except InputError as err:
        raise _user_error(err) from (err.__cause__ or err)
    except (OSError, ValueError, ImportError, DirectoryLocked) as err:
        text = str(err) or type(err).__name__
        raise UserError(f"{context}: {text}" if context else text) from err


@contextlib.contextmanager
def report_errors() -> Iterator[None]:
    """Turn the errors :mod:`spectra.reports` raises about a run's inputs into the command
    line's: an :class:`~spectra.reports.base.InputError` into a :class:`UserError`, a
    :class:`~spectra.reports.base.SettingConflict` into a :class:`SettingError`, with the
    same text and cause; any other error passes unchanged."""
    try:
        yield
    except InputError as err:
        raise _user_error(err) from (err.__cause__ or err)


def _user_error(err: InputError) -> UserError:
    return (SettingError if isinstance(err, SettingConflict) else UserError)(str(err))


def one_line(text: str) -> str:
    return " ".join(str(text).split())


# --------------------------------------------------------------------------- console


class Console:
    """What a command prints: results on stdout (nothing with ``--quiet``), details with
    ``--verbose``, warnings on stderr, progress bars on a terminal."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.quiet = bool(args.quiet)
        self.verbose = bool(args.verbose)
        self.progress: bool | None = False if (args.no_progress or args.quiet) else None

    def info(self, text: str) -> None:
        if not self.quiet:
            self._write(text, sys.stdout)

    def detail(self, text: str) -> None:
        if self.verbose:
            self._write(text, sys.stdout)

    def warn(self, text: str) -> None:
        self._write(f"spectra: warning: {one_line(text)}", sys.stderr)

    @staticmethod
    def _write(text: str, stream: TextIO) -> None:
        from tqdm import tqdm

        tqdm.write(text, file=stream)
        stream.flush()

    def bar(self, total: int, desc: str, unit: str) -> tqdm:
        """A tqdm bar over ``total`` planned items on stderr: by default shown on a terminal once
        the run has lasted about 2 s, never with ``--quiet`` or ``--no-progress`` (the
        estimators' rule, :func:`spectra.estimators._products.make_progress_bar`)."""
        from spectra.estimators._products import make_progress_bar

        return make_progress_bar(total, desc, unit, self.progress)


def require_backend(args: argparse.Namespace) -> str:
    """Keras' backend (``"tensorflow"`` or ``"jax"``), imported now: TensorFlow without its
    C++ log lines unless ``--verbose``; a backend without an engine is a user error."""
    from spectra._backend import configured_backend, keras_backend

    if configured_backend() == "tensorflow":
        from spectra._console import quiet_tensorflow

        quiet_tensorflow(verbose=bool(args.verbose))

    try:
        return keras_backend()
    except RuntimeError as err:
        raise UserError(str(err)) from err


# --------------------------------------------------------------------------- inputs


def input_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`spectra.reports.base.InputSettings` of a command's options (data, loss,
    model), as keywords for its settings class."""
    return {
        "loss": args.loss,
        "loss_weights": args.loss_weights,
        "max_examples": args.max_examples,
        "batch_size": args.batch_size,
        "float64": args.float64,
        "training": args.training,
        "seed": args.seed,
        "builder": args.builder,
    }


def estimate_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`spectra.reports.base.EstimateSettings` of a command's options
    (``--top-k``, the eigensolver's and the trace's), as keywords for its settings class."""
    return {
        "top_k": args.top_k,
        "method": args.method,
        "tol": args.tol,
        "trace": args.trace,
        "trace_method": args.trace_method,
        "trace_products": args.trace_products,
    }


def drawing_options(args: argparse.Namespace, **specific: Any) -> FigureOptions:
    """The :class:`spectra.reports.figures.FigureOptions` of the figure options every
    command has (``--style``, ``--font``, ``--no-title``, ``--caption``, ``--no-legend``),
    with the ``specific`` ones of the command (``labels=...``, ``log_scale=...``)."""
    return FigureOptions(
        style=args.style,
        font=args.font,
        title=not args.no_title,
        caption=args.caption,
        legend=not args.no_legend,
        **specific,
    )


def check_out_option(args: argparse.Namespace) -> None:
    """``--out`` must name a directory: an empty one would write into the current directory."""
    if not str(args.out).strip():
        raise UserError("--out is empty: give a directory (it is created if missing).")


@contextlib.contextmanager
def locked_output(args: argparse.Namespace, outputs: Sequence[str]) -> Iterator[OutputClaim]:
    """``--out``, created, proven writable, locked and claimed for this run before anything is
    computed: the names in ``outputs`` must not be links (nor anything but regular files),
    the directory must not hold another run's files (``--restart`` removes exactly those its
    manifest lists) and the manifest lists ``outputs`` before any is written
    (:func:`spectra.io.files.claim_outputs`); temporary files a killed run left are removed.
    Yields the claim: write the outputs with :meth:`OutputClaim.attempt` and end with
    :func:`finish_outputs`."""
    check_out_option(args)
    with user_errors("--out"):
        out = prepare_directory(args.out)
        lock = DirectoryLock(out).acquire()
    try:
        with user_errors("--out"):
            remove_temporaries(out, [*outputs, MANIFEST_NAME])
            claim, _ = claim_outputs(
                out,
                getattr(args, "command_module", "spectra"),
                outputs,
                restart=bool(getattr(args, "restart", False)),
                command_line=getattr(args, "command_line", None),
            )
        yield claim
    finally:
        lock.release()


class WrittenReport(Protocol):
    """A report :func:`write_outputs` writes: its JSON and the files it lists."""

    files: dict[str, Any]

    def to_dict(self, include_vectors: bool = True) -> dict[str, Any]: ...


def write_outputs(
    out: OutputClaim,
    report: WrittenReport,
    results: str,
    figures: Sequence[tuple[str, str, Figure]],
    formats: list[str],
) -> None:
    """Write the results JSON first, then the figures (``(key, stem, figure)``), so that a
    full disk keeps the numbers: ``report.files`` lists the files written and, if some were
    not, ``not_written`` with the reason (the JSON is then written again to say so). What
    could not be written is recorded in ``out`` (see :func:`finish_outputs`)."""

    def write_json(path: Path) -> None:
        atomic_write_json(path, report.to_dict(include_vectors=False), explain_null)

    report.files = {"results": str(out / results)}
    for key, stem, _ in figures:
        report.files[key] = [str(out / f"{stem}.{fmt}") for fmt in formats]
    written = out.attempt(results, write_json)
    for key, stem, figure in figures:
        report.files[key] = save_figure_formats(figure, out, stem, formats)
    if out.not_written:
        report.files["not_written"] = dict(out.not_written)
        if written:
            out.attempt(results, write_json)


def finish_outputs(claim: OutputClaim) -> None:
    """Record what was written in the manifest; files that could not be written (a full
    disk) are a :class:`UserError` naming them with the reason and those written."""
    with user_errors():
        claim.finish()


def check_builder_use(args: argparse.Namespace, paths: Sequence[str | os.PathLike]) -> None:
    """Refuse ``--builder`` with ``.keras`` files, which hold their architecture: the
    builder would be ignored (it applies to weights files and tf.train.Checkpoints)."""
    if args.builder is None:
        return
    archives = [Path(path).name for path in paths if str(path).lower().endswith(".keras")]
    if archives:
        shown = ", ".join(archives[:3]) + (", ..." if len(archives) > 3 else "")
        raise UserError(
            f"--builder applies to weights files (.weights.h5) and tf.train.Checkpoints "
            f"only; {shown} {'holds' if len(archives) == 1 else 'hold'} the whole model, "
            "architecture included, so the builder would be ignored: drop --builder, or "
            "give the weights file it should load."
        )


def load_data(args: argparse.Namespace) -> Data:
    from spectra.io.datasets import load_data as load

    with user_errors("--data"):
        data = load(args.data, args.max_examples, args.seed)
    check_data_values(data, args.data)
    if args.max_examples is not None and args.max_examples > data.num_examples:
        data.description += f"; {examples_note(data.num_examples, args.max_examples)}"
    return data


def examples_note(num_examples: int, max_examples: int | None) -> str:
    """``"1,797 examples"``, or ``"all 1,797 examples (--max-examples 5000 is more)"`` when
    ``--max-examples`` asked for more than the data holds."""
    if max_examples is not None and max_examples > num_examples:
        return f"all {num_examples:,} examples (--max-examples {max_examples} is more)"
    return f"{num_examples:,} examples"


def check_data_values(data: Data, spec: str) -> None:
    """Refuse data the loss cannot use, naming the array and what to do: arrays that are
    not numbers (string labels), and NaN or infinite values in x, y or sample_weight.

    Cost: one pass over the arrays.
    """
    arrays = {"x": data.x, **data.label_arrays(), "sample_weight": data.sample_weight}
    for name, array in arrays.items():
        if array is None:
            continue
        if array.dtype.kind not in "biuf":
            what = "strings" if array.dtype.kind in "US" else f"of dtype {array.dtype}"
            advice = (
                "encode the classes as integers 0..C-1, e.g. classes, y = np.unique(y, "
                "return_inverse=True), and save again"
                if name.startswith("y")
                else f"convert {name} to numbers and save again"
            )
            raise UserError(
                f"--data: {name} in '{spec}' holds {what} (e.g. {array.flat[0].item()!r}), not "
                f"numbers: {advice}."
            )
        if array.dtype.kind == "f":
            bad = ~np.isfinite(array)
            if bad.any():
                rows = np.flatnonzero(bad.reshape(len(array), -1).any(axis=1))
                raise UserError(
                    f"--data: {name} in '{spec}' holds NaN or infinite values ({int(bad.sum())} "
                    f"in {rows.size} of {len(array)} examples, the first at index "
                    f"{int(rows[0])}): "
                    "remove those examples or fill in the values, and save again."
                )


def check_loss(args: argparse.Namespace) -> None:
    """An unknown loss name is a user error (Keras resolves it, on any backend); no
    ``--loss`` means the compiled loss, checked with the model (:func:`check_model`), as
    are the output names of ``--loss OUTPUT=NAME`` and ``--loss-weight``."""
    if args.loss is None:
        return
    from spectra.operators.losses import resolve_loss

    if isinstance(args.loss, dict):
        if all(loss is None for loss in args.loss.values()):
            raise UserError("--loss: every output is 'none': there is no loss to measure.")
        for output, loss in args.loss.items():
            if loss is not None:
                with user_errors(f"--loss {output}={loss}"):
                    resolve_loss(loss, "float32")
        return
    with user_errors("--loss"):
        resolve_loss(args.loss, "float32")


def operator_loss(args: argparse.Namespace) -> Any:
    """The ``loss`` the operators and the landscape get: ``--loss`` (a name, or a dict by
    output name, as ``compile`` takes it), or None, the loss the model is compiled with,
    which :func:`apply_loss_weights` makes the one with the ``--loss-weight`` weights."""
    if getattr(args, "loss_weights", None) is not None:
        return None
    return args.loss


def check_output_names(model: keras.Model, args: argparse.Namespace, source: str) -> None:
    """The outputs ``--loss OUTPUT=NAME`` and ``--loss-weight OUTPUT=W`` name must be the
    model's, and ``--loss OUTPUT=NAME`` must name every output (a :class:`SettingError`
    saying which outputs the model has)."""
    names = output_names(model)
    known = ", ".join(names)
    outputs = f"its outputs are {known}"
    if not getattr(model, "output_names", None):
        outputs = f"its one output has no name: call it {UNNAMED_OUTPUT!r}"
    for option, given in (
        ("--loss", args.loss),
        ("--loss-weight", getattr(args, "loss_weights", None)),
    ):
        if not isinstance(given, dict):
            continue
        unknown = [name for name in given if name not in names]
        if unknown:
            raise SettingError(
                f"{option} {unknown[0]}=...: {source} has no output {unknown[0]!r}; {outputs}."
            )
    if isinstance(args.loss, dict):
        missing = [name for name in names if name not in args.loss]
        if missing:
            raise SettingError(
                f"--loss names a loss for {', '.join(args.loss)} but not for "
                f"{', '.join(missing)} of the outputs of {source} ({known}): give --loss "
                f"{missing[0]}=NAME (or {missing[0]}=none to leave it out of the loss)."
            )


def apply_loss_weights(
    model: keras.Model, args: argparse.Namespace, like: keras.Model | None = None
) -> None:
    """With ``--loss-weight``: compile ``model`` with the run's loss and those weights
    (:func:`spectra.reports.base.compile_with_loss_weights`); nothing without it."""
    with report_errors():
        compile_with_loss_weights(model, args.loss, getattr(args, "loss_weights", None), like)


def compiles_model(args: argparse.Namespace) -> bool:
    """Whether models are loaded compiled: for the compiled loss (no ``--loss``) and for
    the optimizer state (``--preconditioned``)."""
    return args.loss is None or bool(getattr(args, "preconditioned", False))


def check_model(model: keras.Model, args: argparse.Namespace, data: Data, source: str) -> int:
    """Check that the model has a loss (``--loss`` or a compiled one), that the data and
    the loss fit ``model`` (2 examples) and that ``--top-k`` is not more than its
    parameters; returns the number of parameters."""
    from spectra.operators.keras_data import check_data_fits_model

    check_output_names(model, args, source)
    loss = args.loss if args.loss is not None else getattr(model, "loss", None)
    if loss is None:
        raise SettingError(
            f"{source} carries no compiled loss (it was saved without compile, or is a "
            "weights file): give --loss, e.g. --loss sparse_categorical_crossentropy."
        )
    with user_errors(source):
        check_data_fits_model(model, data.x, data.y, loss)
    apply_loss_weights(model, args)
    size = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    option = "--top-k" if hasattr(args, "top_k") else "--directions"
    top_k = getattr(args, "top_k", getattr(args, "directions", 1))
    if top_k > size:
        raise SettingError(
            f"{option} {top_k} is more than the {size} trainable parameters of {source}."
        )
    return size


def check_curvature(args: argparse.Namespace) -> None:
    """A ``--curvature`` whose operator this build of spectra lacks is a user error."""
    from spectra.operators import curvature_operator

    with user_errors():
        curvature_operator(getattr(args, "curvature", None))


def make_operator(model: keras.Model, args: argparse.Namespace, data: Data) -> LinearOperator:
    """The operator of the run's matrix at ``model``'s weights: ``--curvature`` (default
    the Hessian), with ``--preconditioned`` seen through the optimizer's preconditioner
    (:func:`spectra.preconditioned`)."""
    from spectra.operators import build_curvature_operator
    from spectra.operators.keras_calls import ComputeCopyError

    choice = curvature_choice(getattr(args, "curvature", None))
    with user_errors(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            op = build_curvature_operator(
                choice.name,
                model,
                operator_loss(args),
                data.as_tuple(),
                args.seed,
                batch_size=args.batch_size,
                training=args.training,
                dtype=np.float64 if args.float64 else None,
            )
        except ComputeCopyError as err:
            # The model cannot be copied into the compute dtype (float64 with --float64,
            # float32 for a half- or mixed-precision model): a fact about the model file.
            raise UserError(str(err)) from err
    _show_warnings(args, caught)
    if getattr(args, "preconditioned", False):
        op = _preconditioned(op, model)
    return op


def _show_warnings(args: argparse.Namespace, caught: Sequence[warnings.WarningMessage]) -> None:
    """spectra's warnings (``UserWarning``) as one ``spectra: warning:`` line each, once per
    run (operators built again for ``--repeats`` say it once); others as Python shows
    them."""
    shown: set[str] = vars(args).setdefault("shown_warnings", set())
    for warning in caught:
        text = one_line(str(warning.message))
        if not issubclass(warning.category, UserWarning):
            warnings.showwarning(
                warning.message, warning.category, warning.filename, warning.lineno
            )
        elif text not in shown:
            shown.add(text)
            Console(args).warn(text)


def _preconditioned(op: LinearOperator, model: keras.Model) -> LinearOperator:
    """``op`` seen through the preconditioner of ``model``'s restored optimizer state.

    Raises ValueError for a checkpoint without optimizer state (one checkpoint's problem)
    and :class:`SettingError` for an optimizer without a preconditioner (every checkpoint's).
    """
    from spectra.analysis.preconditioning import preconditioned
    from spectra.analysis.stability import threshold_matrix

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            "no optimizer state (saved without compile, or a weights file): "
            "--preconditioned needs a .keras file saved by a compiled model after training "
            "(model.save)."
        )
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if type(optimizer).__name__ not in ("SGD", *PRECONDITIONED_OPTIMIZERS):
        check_preconditionable(type(optimizer).__name__, "of the checkpoint")
    try:
        matrix = threshold_matrix(optimizer)
    except ValueError:
        matrix = None
    if matrix == "hessian":
        raise SettingError(
            f"the checkpoint's optimizer is {type(optimizer).__name__}, which has no "
            "preconditioner (P = I): measure λ_max(H) without --preconditioned."
        )
    steps = int(optimizer.iterations.numpy()) if getattr(optimizer, "built", False) else 0
    if steps < 1:
        raise ValueError(
            f"no optimizer state yet: its {type(optimizer).__name__} optimizer was saved "
            "before the first training step, and --preconditioned needs its second moments."
        )
    try:
        return preconditioned(op, optimizer)
    except (ValueError, RuntimeError) as err:
        raise SettingError(f"--preconditioned: {err}") from err


def load_operator(args: argparse.Namespace, data: Data) -> tuple[keras.Model, int, LinearOperator]:
    """The model of ``args.model`` (checked against the data, the loss and ``--top-k``), its
    number of parameters, and the operator of the run's matrix. Imports TensorFlow."""
    require_backend(args)
    check_loss(args)
    check_curvature(args)
    from spectra.io.checkpoints import load_model

    custom_objects = custom_objects_option(args)
    with user_errors(args.model):
        model = load_model(
            args.model,
            builder=args.builder,
            compile=compiles_model(args),
            custom_objects=custom_objects,
        )
    report_ignored_optimizer_state(args, args.model)
    if args.training:
        seed_generator_states(model, args.seed)
    size = check_model(model, args, data, args.model)
    with user_errors(args.model):
        op = make_operator(model, args, data)
    return model, size, op


def custom_objects_option(args: argparse.Namespace) -> dict[str, Any] | None:
    """The custom objects of ``--custom-objects`` (None without it), imported once, so that
    a missing or broken module is the option's error, not the model file's."""
    spec = getattr(args, "custom_objects", None)
    if spec is None:
        return None
    from spectra.io.checkpoints import resolve_custom_objects

    try:
        with user_errors("--custom-objects"):
            return resolve_custom_objects(spec)
    except TypeError as err:
        raise UserError(f"--custom-objects: {err}") from err


def report_ignored_optimizer_state(args: argparse.Namespace, path: str | os.PathLike) -> None:
    """Say on the console how many arrays of optimizer state a ``.weights.h5`` file held
    that were not loaded (a compiled model's ``save_weights`` writes them)."""
    ignored = ignored_optimizer_weights(path)
    if ignored:
        Console(args).info(
            f"{path}: loaded the model's weights; ignored the {ignored} arrays of optimizer "
            "state saved with them (as Keras' load_weights does for an uncompiled model)."
        )


def ignored_optimizer_weights(path: str | os.PathLike) -> int | None:
    """The number of optimizer-state arrays in a ``.weights.h5`` file (not loaded into the
    model), None for other formats."""
    if not str(path).lower().endswith(".weights.h5"):
        return None
    from spectra.io.checkpoints import stored_weight_counts

    with user_errors(str(path)):
        return stored_weight_counts(path)["optimizer"]


def data_fingerprint(data: Data) -> str:
    """SHA-256 of the arrays (values, dtypes and shapes)."""
    digest = hashlib.sha256()
    labels = data.label_arrays()
    for name, array in [("x", data.x), *labels.items(), ("sample_weight", data.sample_weight)]:
        if name.startswith("y") and list(labels) != ["y"]:
            digest.update(name.encode() + b"\0")
        if array is not None:
            digest.update(np.ascontiguousarray(array).tobytes())
            digest.update(str((array.dtype, array.shape)).encode())
    return digest.hexdigest()


def data_description(
    args: argparse.Namespace, data: Data, model: keras.Model | None = None
) -> dict[str, Any]:
    """What ``results.json`` records of the data; with ``model``, ``labels``: which label
    array went to which of its outputs (``{output name: "y_<name>" | "y0" | "y"}``, in
    Keras' output order)."""
    description = {
        "spec": args.data,
        "name": data.name,
        "description": data.description,
        "num_examples": data.num_examples,
        "x_shape": list(data.x.shape),
        "y_shape": _label_shapes(data.y),
        "sample_weights": data.sample_weight is not None,
        "sha256": data_fingerprint(data),
    }
    if model is not None:
        from spectra.operators.keras_data import label_sources

        with user_errors(args.data):
            description["labels"] = label_sources(model, data.x, data.y)
    return description


def _label_shapes(y: Any) -> Any:
    """``list(y.shape)``; for several outputs a dict (by output name) or list of them."""
    if isinstance(y, dict):
        return {name: list(array.shape) for name, array in y.items()}
    if isinstance(y, list):
        return [list(array.shape) for array in y]
    return list(y.shape)


def model_description(
    path: str | os.PathLike, model: keras.Model, num_parameters: int
) -> dict[str, Any]:
    """The model's path, name, size, dtype and the loss it was compiled with (None if not
    compiled or not loaded compiled); for a ``.weights.h5`` file also
    ``ignored_optimizer_weights``, the arrays of optimizer state it held that were not
    loaded."""
    compiled = getattr(model, "loss", None)
    description = {
        "path": str(path),
        "name": model.name,
        "num_parameters": int(num_parameters),
        "dtype": str(model.trainable_variables[0].dtype),
        "compiled_loss": None if compiled is None else loss_name(compiled),
        "compiled_loss_config": loss_record(compiled),
    }
    ignored = ignored_optimizer_weights(path)
    if ignored is not None:
        description["ignored_optimizer_weights"] = ignored
    return description


def loss_record(loss: Any) -> Any:
    """A loss as ``results.json`` records it in full: a name as given, a loss object as
    ``{"class_name": ..., "config": ...}`` (its ``from_logits``, reduction and the rest),
    a function by its name, and a dict or list of them per output likewise."""
    if loss is None or isinstance(loss, str):
        return loss
    if isinstance(loss, dict):
        return {str(key): loss_record(value) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return [loss_record(value) for value in loss]
    config = loss_config(loss)
    if not config:
        return loss_name(loss)
    # Through JSON and back: a config value JSON cannot hold is recorded as its text.
    return {
        "class_name": type(loss).__name__,
        "config": json.loads(json.dumps(config, default=str)),
    }


def versions() -> dict[str, str]:
    """Versions of spectra and what it computes with (from the installed metadata): Keras'
    backend (``backend``) and its library (TensorFlow, or JAX and jaxlib), Keras, NumPy,
    SciPy and Matplotlib."""
    from spectra._backend import configured_backend

    backend = configured_backend()
    found = {"spectra": __version__, "python": sys.version.split()[0], "backend": backend}
    libraries = ("jax", "jaxlib") if backend == "jax" else (backend,)
    for name in (*libraries, "keras", "numpy", "scipy", "matplotlib"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            module = sys.modules.get(name)
            found[name] = getattr(module, "__version__", "unknown")
    return found


# --------------------------------------------------------------------------- figures


def figure_font(args: argparse.Namespace) -> FigureFont | None:
    """The :class:`spectra.plotting.FigureFont` of ``--font`` (None without the option):
    a family matplotlib does not find is a :class:`UserError` listing some it does."""
    from spectra.plotting import resolve_font

    with user_errors("--font"):
        return resolve_font(getattr(args, "font", None))


def figure_record(
    args: argparse.Namespace, figures: Sequence[tuple[str, str, Figure]], compact: bool = False
) -> dict[str, Any]:
    """:func:`spectra.reports.figures.figure_record` of a command's figure options (kept
    for tests/plotting/test_figures_print.py, which calls it with parsed arguments)."""
    options = drawing_options(args, labels=not getattr(args, "no_labels", False))
    return record_figures(options, figures, compact)


def save_figure_formats(
    figure: Figure, out: Path | OutputClaim, stem: str, formats: Sequence[str]
) -> list[str]:
    """Save ``figure`` as ``out/stem.FMT`` for each format, close it; returns the paths
    written. With a claim (:func:`locked_output`) a file that cannot be written is recorded
    in it (see :func:`finish_outputs`) and left out of the paths; with a path it raises."""
    import matplotlib.pyplot as plt

    from spectra.plotting import save_figure

    try:
        if isinstance(out, OutputClaim):
            names = [f"{stem}.{fmt}" for fmt in formats]
            return [
                str(out / name)
                for name in names
                if out.attempt(name, lambda path: save_figure(figure, path))
            ]
        return [str(save_figure(figure, out / f"{stem}.{fmt}")) for fmt in formats]
    finally:
        plt.close(figure)


def figure_names(stems: Sequence[str], formats: Sequence[str]) -> list[str]:
    return [f"{stem}.{fmt}" for stem in stems for fmt in formats]


# --------------------------------------------------------------------------- bounds


def bound_note(
    converged: bool,
    failure_probability: float | None,
    *,
    value: float | None = None,
    bound: float | None = None,
    tol: float | None = None,
    reason: str | None = None,
) -> str:
    """What a printed bound ``value ± bound`` proves, as a suffix ("" when it holds at
    the default level).

    ``(not converged: <reason>)`` when it did not converge (the given reason, else the
    bound against ``tol·|value|``); ``(failure probability p: ...)`` when p is above the
    default level, ``(not certified: ...)`` when it is unknown (None): the bound then
    holds for some eigenvalue near the value, not necessarily the one it is named for.
    Depends on both fields, so that a result saying ``converged=True`` with a failure
    probability of 1 is not printed as proven.
    """
    notes = []
    if not converged:
        if reason is None and value is not None and bound is not None and tol is not None:
            limit = tol * abs(value)
            reason = f"error bound {bound:.2g} > tol·|λ| = {limit:.2g}"
        notes.append(f"(not converged: {reason or 'the tolerance was not reached'})")
    if failure_probability is None:
        notes.append("(not certified: holds for some eigenvalue, maybe not this one)")
    elif failure_probability >= 0.5:
        notes.append(f"(not certified: failure probability {failure_probability:.2g})")
    elif failure_probability > DEFAULT_FAILURE_PROBABILITY:
        notes.append(
            f"(failure probability {failure_probability:.2g}, not {DEFAULT_FAILURE_PROBABILITY:g})"
        )
    return "  ".join(notes)
