"""``spectra sharpness CHECKPOINTS``: the sharpness of every checkpoint of a run, resumable.

The bookkeeping (resume, lock, files) is :class:`spectra.analysis.trajectory.SharpnessRun`, the
measurement :func:`spectra.analysis.trajectory.measure_sharpness`; this module reads the options,
finds the checkpoints and the stability threshold, and prints.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spectra._format import count_text, plus_minus
from spectra.analysis.minibatch import minibatch_sharpness, summary_scalars
from spectra.analysis.stability import (
    StabilityThreshold,
    gradient_descent_threshold,
    stability_threshold_of,
    threshold_matrix,
)
from spectra.analysis.trajectory import (
    PlannedCheckpoint,
    ResumeRefused,
    SharpnessRun,
    measure_sharpness,
    plan_checkpoints,
)
from spectra.cli._common import (
    DEFAULT_FAILURE_PROBABILITY,
    CommandReport,
    Console,
    SettingError,
    UserError,
    bound_holds,
    bound_note,
    check_builder_use,
    check_curvature,
    check_loss,
    check_model,
    check_out_option,
    check_preconditionable,
    compiles_model,
    custom_objects_option,
    data_description,
    data_fingerprint,
    describe_data,
    describe_matrix,
    figure_font,
    figure_names,
    figure_record,
    finish_figure,
    load_data,
    make_operator,
    matrix_title,
    measurement_settings,
    model_description,
    number_settings,
    one_line,
    require_backend,
    save_figure_formats,
    user_errors,
    versions,
)
from spectra.cli._parser import (
    _positive_float,
    _positive_int,
    common_options,
    eigen_options,
    trace_options,
)
from spectra.io.files import read_json
from spectra.io.tensorboard import SharpnessEvents, sharpness_scalars

_FIGURE = "sharpness"
_UNIT_LABELS = {
    ("step", "--steps"): "Training step (from --steps)",
    ("step", "file names"): "Training step (from the file names)",
    ("epoch", "file names"): "Epoch (from the file names)",
    ("checkpoint", "file names"): "Checkpoint number (from the file names)",
}
# The x axes of --x: where each source puts the checkpoints, and the axis label it gives.
_X_CHOICES = ("steps", "epochs")
_STEP_SOURCE_LABELS = {
    "--steps": "from --steps",
    "optimizer iterations": "optimizer iterations",
    "file names": "from the file names",
}
# The training steps' source as the numerator of an epoch axis' label.
_STEPS_PER_EPOCH_LABELS = {
    "--steps": "--steps",
    "optimizer iterations": "optimizer iterations",
    "file names": "steps in the file names",
}

# --lr and a recorded learning rate are the same rate when they agree to 1e-6: a rate read
# back from a saved float32 optimizer variable carries a relative rounding of 2^-24 ≈ 6e-8.
_SAME_RATE_RTOL = 1e-6


@dataclass
class SharpnessReport(CommandReport):
    """A ``spectra sharpness`` run as written to ``sharpness.json``
    (:meth:`spectra.analysis.trajectory.SharpnessRun.report`), reloaded by :func:`spectra.load`.

    ``checkpoints`` holds one entry per checkpoint recorded so far, in step order: ``file``,
    ``step``, ``sha256``, ``path``, ``status`` (``"done"`` or ``"failed"``), ``error`` and
    the measurement (``eigenvalues`` largest first, ``error_bounds``, ``residual_norms``,
    ``converged``, ``trace``, ``trace_stderr``, ``loss``, ``eigenvector_overlap``,
    ``num_products``, ``wall_time``, …; None for a failed one), NaN where the file wrote
    null and said so. ``settings`` are the values a resume must match, ``plan`` every
    checkpoint of the run, ``summary`` the counts, ``threshold`` the stability threshold
    (:meth:`spectra.analysis.stability.StabilityThreshold.to_dict`) or None, ``model`` the
    model's description (None before the first measurement). :attr:`done`, :attr:`steps`,
    :attr:`eigenvalues` and :attr:`error_bounds` give the measured checkpoints as arrays.
    """

    format: str
    checkpoints_source: str
    step_source: str
    step_unit: str
    learning_rate: float | None
    learning_rate_source: str | None
    threshold: dict[str, Any] | None
    warm_start: bool
    plan: list[dict[str, Any]]
    summary: dict[str, int]
    checkpoints: list[dict[str, Any]]
    model: dict[str, Any] | None = None
    learning_rate_stored: float | None = None
    """The learning rate as the first checkpoint's optimizer stores it (a float32 read back,
    0.009999999776482582), None when no checkpoint records one; ``learning_rate`` is then
    the shortest decimal with the same float32 value (0.01), the threshold's η."""
    x_axis: str | None = None
    """``--x``: ``"steps"``, ``"epochs"``, or None for the file names' own numbers
    (``step_unit`` says what they count)."""
    x_axes: dict[str, Any] | None = None
    """Every x axis the run could place its checkpoints on (``"steps"``, ``"epochs"``), each
    ``{"source", "label", "values": {file: position}}``, so that ``spectra plot --x`` can
    switch between them; ``source`` is ``"--steps"``, ``"optimizer iterations"`` (the
    counter saved in each checkpoint), ``"file names"`` or, for epochs, the steps' source
    divided by ``--steps-per-epoch``."""
    dropped_threshold: dict[str, Any] | None = None
    """The recorded optimizer's threshold when it bounds the other matrix and is not drawn
    (:meth:`spectra.analysis.stability.StabilityThreshold.to_dict`; e.g. Adam's, which
    bounds λ_max(P⁻¹H), on a run measuring λ_max(H)), so that the figure can name it."""
    figures: dict[str, Any] | None = None
    """How the figure was drawn and its title and full caption, which the compact figure
    does not draw by default (:func:`spectra.cli._common.figure_record`); None before a
    checkpoint is measured."""

    @property
    def done(self) -> list[dict[str, Any]]:
        """The entries of the checkpoints measured, in step order."""
        return [entry for entry in self.checkpoints if entry.get("status") == "done"]

    @property
    def steps(self) -> np.ndarray:
        """The steps (in :attr:`step_unit`) of the measured checkpoints, int64."""
        return np.array([entry["step"] for entry in self.done], dtype=np.int64)

    @property
    def eigenvalues(self) -> np.ndarray:
        """The eigenvalues of the measured checkpoints, shape (checkpoints, top_k), float64."""
        return self._matrix("eigenvalues")

    @property
    def error_bounds(self) -> np.ndarray:
        """Their error bounds, shape (checkpoints, top_k), float64."""
        return self._matrix("error_bounds")

    def _matrix(self, name: str) -> np.ndarray:
        k = int(self.settings.get("top_k", 1))
        rows = [entry[name] for entry in self.done]
        return np.array(rows, dtype=np.float64).reshape(len(rows), k)


def add_arguments(commands: argparse._SubParsersAction) -> None:
    """Register ``spectra sharpness`` and its options with the subcommand parsers ``commands``."""
    sharpness = commands.add_parser(
        "sharpness",
        parents=[common_options(), eigen_options(), trace_options()],
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
        "--x",
        dest="x_axis",
        choices=_X_CHOICES,
        help="the figure's x axis: 'steps' puts each checkpoint at its training step (from "
        "--steps, else the optimizer's iteration counter saved in the checkpoints, else the "
        "step numbers in the file names); 'epochs' at its epoch (the epoch numbers in the "
        "file names, or the training steps / --steps-per-epoch). Default: the numbers in the "
        "file names, labelled with what they count",
    )
    sharpness.add_argument(
        "--steps-per-epoch",
        type=_positive_int,
        metavar="N",
        help="optimizer steps in one epoch: with --x epochs, each checkpoint at its training "
        "step / N",
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
    sharpness.add_argument(
        "--per-batch",
        type=_positive_int,
        metavar="M",
        help="also measure λ1 on M mini-batches of --per-batch-size examples at every "
        "checkpoint (the same batches, drawn with --seed as SGD draws them, each a seeded "
        "permutation's runs of that size): their median and 5-95 %% band go on the figure, "
        "their values, mean and quantiles into sharpness.json (Jastrzębski et al. 2020); "
        "with --trace each batch's trace too. Cost: about M × (batch size) / (examples) "
        "measurements more per checkpoint",
    )
    sharpness.add_argument(
        "--per-batch-size",
        type=_positive_int,
        metavar="B",
        help="examples in each mini-batch of --per-batch (the batch size of training; "
        "required with --per-batch)",
    )
    sharpness.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write the values of each checkpoint as TensorBoard scalars at its step "
        "(sharpness/lambda_1, sharpness/trace, sharpness/loss, ...) into the run DIR/spectra/ "
        "(DIR: e.g. the log_dir of the training's keras.callbacks.TensorBoard); rewritten from "
        "sharpness.json at the end, so a resumed run holds one value per step",
    )
    sharpness.set_defaults(command_module="sharpness")


def run(args: argparse.Namespace, console: Console) -> int:
    settings = measurement_settings(args)
    check_out_option(args)
    figure_font(args)
    events = _tensorboard_events(args)
    with user_errors("--out"):
        store = SharpnessRun(args.out)
    with user_errors("--out"), store:
        return _run_locked(args, console, settings, store, events)


def _tensorboard_events(args: argparse.Namespace) -> SharpnessEvents | None:
    """The writer of ``--tensorboard DIR`` (its run directory created and proven writable
    before anything is measured), or None without the option."""
    if getattr(args, "tensorboard", None) is None:
        return None
    suffix = ".spectra-preconditioned-sharpness" if args.preconditioned else ".spectra-sharpness"
    with user_errors("--tensorboard"):
        events = SharpnessEvents(args.tensorboard, suffix=suffix)
        events.prepare()
    return events


def _tensorboard_scalars(
    entry: dict[str, Any], threshold: StabilityThreshold | None, preconditioned: bool
) -> dict[str, float]:
    """The TensorBoard scalars of a ``sharpness.json`` entry, with the run's threshold."""
    record = dict(entry)
    if threshold is not None:
        matrix = "preconditioned" if threshold.preconditioned else "hessian"
        record.update(threshold=threshold.value, threshold_matrix=matrix)
    scalars = sharpness_scalars(record, preconditioned=preconditioned)
    if entry.get("minibatch"):
        prefix = "preconditioned_sharpness" if preconditioned else "sharpness"
        scalars.update(summary_scalars(entry["minibatch"]["summary"], prefix))
    return scalars


def _minibatch(
    model: Any,
    args: argparse.Namespace,
    data: Any,
    settings: Any,
    measurement: Any,
    threshold: StabilityThreshold | None,
) -> dict[str, Any]:
    """λ₁ (and with --trace the trace) of the run's matrix on each of ``--per-batch``
    mini-batches at the checkpoint's weights, with the full-batch λ₁ and the threshold."""

    def build(batch: tuple[Any, ...]) -> Any:
        x, y, *weight = batch
        subset = dataclasses.replace(
            data,
            x=x,
            y=y,
            sample_weight=weight[0] if weight else None,
            num_examples=settings.per_batch_size,
        )
        return make_operator(model, args, subset)

    with user_errors("--per-batch"):
        result = minibatch_sharpness(
            model,
            data.as_tuple(),
            batch_size=settings.per_batch_size,
            num_batches=settings.per_batch,
            seed=settings.seed,
            tol=settings.tol,
            method=settings.method,
            trace=settings.trace,
            trace_products=settings.trace_products,
            build=build,
            progress=False,
        )
    result.full_batch = measurement.eigenvalues[0]
    if threshold is not None and threshold.preconditioned == bool(args.preconditioned):
        result.threshold = threshold.value
    return result.to_dict()


def _run_locked(
    args: argparse.Namespace,
    console: Console,
    settings: Any,
    store: Any,
    events: SharpnessEvents | None = None,
) -> int:
    from spectra.io.checkpoints import find_checkpoints, step_unit

    store.claim(
        restart=args.restart,
        extra_outputs=figure_names([_FIGURE], args.format),
        command_line=args.command_line,
    )

    with user_errors(args.checkpoints):
        refs = find_checkpoints(args.checkpoints, steps=args.steps)
    check_builder_use(args, [ref.path for ref in refs])
    step_source = "--steps" if args.steps else "file names"
    unit = "step" if args.steps else step_unit([ref.path for ref in refs])
    data = load_data(args)
    with user_errors(args.checkpoints):
        plan = plan_checkpoints(refs)
    axes = x_axes(args, plan)
    threshold, rate, rate_source, notes, dropped = _threshold(args, refs)
    for note in notes:
        console.warn(note)
    header = {
        "command": args.command_line,
        "versions": versions(),
        "data": data_description(args, data),
        "checkpoints_source": args.checkpoints,
        "step_source": step_source,
        "step_unit": unit,
        "learning_rate": rate,
        "learning_rate_source": rate_source,
        "learning_rate_stored": recorded_learning_rate(refs),
        "threshold": None if threshold is None else threshold.to_dict(),
        "dropped_threshold": None if dropped is None else dropped.to_dict(),
        "warm_start": settings.warm_start,
        "x_axis": getattr(args, "x_axis", None),
        "x_axes": axes,
    }
    wanted = {
        **number_settings(args, settings),
        "data_sha256": data_fingerprint(data),
        "num_examples": data.num_examples,
    }
    try:
        with user_errors():
            state = store.start(
                plan,
                wanted,
                header,
                restart=args.restart,
                extra_outputs=figure_names([_FIGURE], args.format),
            )
    except UserError as err:
        if not isinstance(err.__cause__, ResumeRefused):
            raise
        # Only a record of this format whose settings or checkpoints differ is replaced.
        other_run = any(
            words in str(err.__cause__)
            for words in ("computed with other settings", "of another checkpoint set")
        )
        if not (other_run and _nothing_measured(store.json_path)):
            raise UserError(_refusal_in_words(str(err))) from err.__cause__
        # A run that measured nothing (it failed on its first checkpoint, say) holds
        # nothing to keep: the corrected rerun replaces it.
        with user_errors():
            state = store.start(
                plan,
                wanted,
                header,
                restart=True,
                extra_outputs=figure_names([_FIGURE], args.format),
            )
        console.info(
            f"replacing {store.json_path}: its run measured no checkpoint (other settings)"
        )

    console.info(f"{len(plan)} checkpoints in {args.checkpoints}; data {data.description}")
    if threshold is not None:
        console.info(f"stability threshold ({rate_source}): {threshold.label}")
    elif rate is None:
        console.info("learning rate unknown (no --lr, no recorded optimizer, no trajectory.json)")
    if state.removed_temporaries:
        console.detail(f"removed {state.removed_temporaries} temporary files of a killed run")
    if state.done:
        console.info(f"resuming: {state.done} of {len(plan)} checkpoints already done")
    if state.failed:
        console.info(f"retrying {state.failed} checkpoints that failed before")

    pending = store.pending()
    if pending:
        _measure_all(
            args, console, settings, store, plan, pending, data, threshold, unit, events=events
        )
    figure = None
    try:
        # Drawn before the last write, so that sharpness.json records its caption.
        figure = _prepared_figure(args, store, threshold, unit, step_source)
    finally:
        store.finish()
    if events is not None:
        # One file from sharpness.json: a resumed run's earlier values once each.
        done = [entry for entry in store.entries if entry["status"] == "done"]
        with user_errors("--tensorboard"):
            written = events.rewrite(
                (entry["step"], _tensorboard_scalars(entry, threshold, args.preconditioned))
                for entry in done
            )
        console.info(
            f"TensorBoard: {len(done)} steps in {written} "
            f"(view with: tensorboard --logdir {events.log_dir})"
        )
    return _conclude(args, console, store, threshold, unit, figure)


def _prepared_figure(
    args: argparse.Namespace,
    store: SharpnessRun,
    threshold: StabilityThreshold | None,
    unit: str,
    step_source: str,
) -> Any:
    """The figure of the checkpoints measured so far (None before the first), not yet
    saved; its settings, title and full caption go into the record's ``figures``."""
    done = [entry for entry in store.entries if entry["status"] == "done"]
    if not done:
        return None
    figure = sharpness_figure(args, store.report(), done, threshold, unit, step_source)
    record = figure_record(args, [("sharpness_figure", _FIGURE, figure)], compact=True)
    store.update_header(figures=record)
    return figure


def _nothing_measured(path: Path) -> bool:
    """Whether the ``sharpness.json`` at ``path`` is a record with no checkpoint done (its
    run failed before measuring one); False for a file that is not such a record."""
    try:
        checkpoints = read_json(path)["checkpoints"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(checkpoints, list) and not any(
        isinstance(entry, dict) and entry.get("status") == "done" for entry in checkpoints
    )


def _refusal_in_words(text: str) -> str:
    """A resume refusal as the command line says it: the option (``--restart``) without
    the Python API's argument, hashes shortened to 12 digits, the data's hash named as
    the data and the compiled loss for a loss of None."""
    text = text.replace("--restart (restart=True)", "--restart")
    text = re.sub(
        r"data_sha256: '([0-9a-f]{12})[0-9a-f]{52}' -> '([0-9a-f]{12})[0-9a-f]{52}'",
        r"data: other examples (sha256 \1… -> \2…)",
        text,
    )
    text = re.sub(r"\b([0-9a-f]{12})[0-9a-f]{52}\b", r"\1…", text)
    text = re.sub(r"\bloss: None ->", "loss: the compiled loss ->", text)
    return re.sub(r"(\bloss: '[^']*') -> None\b", r"\1 -> the compiled loss", text)


def _measure_all(
    args: argparse.Namespace,
    console: Console,
    settings: Any,
    store: SharpnessRun,
    plan: list[PlannedCheckpoint],
    pending: list[PlannedCheckpoint],
    data: Any,
    threshold: StabilityThreshold | None,
    unit: str,
    events: SharpnessEvents | None = None,
) -> None:
    """Measure the pending checkpoints in step order, each warm-started from the previous
    measurement; the eigenvector overlap is recorded between neighbours in the plan only
    (not across a checkpoint measured by an earlier run or one that failed). Each result also
    goes to ``events`` (``--tensorboard``) as it is recorded."""
    require_backend(args)
    check_loss(args)
    check_curvature(args)
    from spectra.io.checkpoints import CheckpointLoader

    loader = CheckpointLoader(
        builder=args.builder,
        compile=compiles_model(args),
        custom_objects=custom_objects_option(args),
    )
    before = {later.file: earlier.file for earlier, later in itertools.pairwise(plan)}
    # A resumed run starts where an uninterrupted one would: from the eigenvectors of the
    # checkpoint before the first pending one, kept by the run that measured it.
    previous = store.warm_start(pending[0])
    previous_file = before.get(pending[0].file) if previous is not None else None
    if store.warm_start_problem:
        console.warn(store.warm_start_problem)
    checked: Any = None
    totals = {"products": 0, "passes": 0}
    bar = console.bar(len(pending), "checkpoints", "checkpoint")
    try:
        for planned in pending:
            try:
                with user_errors(planned.file):
                    model = loader.load(planned.path)
                    if model is not checked:
                        # A new model instance (first checkpoint, another architecture).
                        size = check_model(model, args, data, planned.file)
                        checked = model
                        store.update_header(
                            model=model_description(planned.path, model, size),
                        )
                    op = make_operator(model, args, data)
                    vectors = previous
                    neighbour = (
                        previous_file is not None and before.get(planned.file) == previous_file
                    )
                    measurement = measure_sharpness(
                        op,
                        settings,
                        v0=vectors,
                        previous=vectors if neighbour else None,
                        progress=False,
                    )
                    if settings.per_batch:
                        measurement.minibatch = _minibatch(
                            model, args, data, settings, measurement, threshold
                        )
            except SettingError:
                raise
            except UserError as err:
                if not args.skip_bad:
                    raise UserError(
                        f"{err} (give --skip-bad to record a bad checkpoint as failed and go on)"
                    ) from err
                cause = err.__cause__ if err.__cause__ is not None else err
                store.record(planned, error=f"{type(cause).__name__}: {one_line(str(cause))}")
                console.warn(f"{planned.file} failed and is recorded as failed: {err}")
                previous, previous_file, checked = None, None, None
                bar.update(1)
                continue
            entry = store.record(planned, measurement)
            if events is not None:
                with user_errors("--tensorboard"):
                    events.write(
                        entry["step"],
                        _tensorboard_scalars(entry, threshold, args.preconditioned),
                    )
            previous, previous_file = measurement.eigenvectors, planned.file
            totals["products"] += measurement.num_products
            totals["passes"] += measurement.num_data_passes or 0
            bar.update(1)
            bar.set_postfix(products=totals["products"], passes=totals["passes"], refresh=False)
            console.info(_line(entry, threshold, unit, args.method, args.tol))
    finally:
        bar.close()
        if events is not None:
            events.close()
    console.detail(
        f"{loader.num_models_built} model(s) built for {len(pending)} checkpoints; "
        f"{totals['products']} products in {totals['passes']} data passes"
    )


def entry_failure_probability(entry: dict[str, Any], method: str) -> float | None:
    """The failure probability of an entry's bounds; for an entry recorded without one
    (by an earlier version), what its method certifies: "lanczos" the default level, "power"
    nothing (1), "lobpcg" no statement (None)."""
    if "failure_probability" in entry:
        return entry["failure_probability"]
    return {"lanczos": DEFAULT_FAILURE_PROBABILITY, "power": 1.0}.get(method)


def entry_certified(entry: dict[str, Any], method: str) -> bool:
    """Whether the top eigenvalue's bound of an entry is proven at the default level."""
    return bound_holds(entry["converged"][0], entry_failure_probability(entry, method))


def _side_of_threshold(entry: dict[str, Any], threshold: StabilityThreshold, method: str) -> str:
    """Where the bound puts λ1 against the threshold: ``"above"`` or ``"below"`` when the
    whole interval λ1 ± bound is on that side, ``"within"`` when the threshold lies inside
    it, ``"unproven"`` when the bound is not certified."""
    if not entry_certified(entry, method):
        return "unproven"
    value, bound = entry["eigenvalues"][0], entry["error_bounds"][0]
    if value - bound > threshold.value:
        return "above"
    if value + bound < threshold.value:
        return "below"
    return "within"


def _line(
    entry: dict[str, Any],
    threshold: StabilityThreshold | None,
    unit: str,
    method: str = "lanczos",
    tol: float | None = None,
) -> str:
    top = plus_minus(entry["eigenvalues"][0], entry["error_bounds"][0])
    line = f"{unit} {entry['step']:>6}  λ1 = {top}"
    if len(entry["eigenvalues"]) > 1:
        # The other eigenvalues of --top-k, each to the digits of its own bound.
        rest = [
            plus_minus(value, bound).split(" ± ")[0]
            for value, bound in zip(entry["eigenvalues"][1:], entry["error_bounds"][1:])
        ]
        line += f"  λ2..{len(entry['eigenvalues'])} = {', '.join(rest)}"
    note = bound_note(
        entry["converged"][0],
        entry_failure_probability(entry, method),
        value=entry["eigenvalues"][0],
        bound=entry["error_bounds"][0],
        tol=tol,
    )
    if note:
        line += f"  {note}"
    if threshold is not None:
        ratio = entry["eigenvalues"][0] / threshold.value
        side = _side_of_threshold(entry, threshold, method)
        proven = {"unproven": ", not proven", "within": ", threshold within the bound"}
        line += f"  ({ratio:.3f} × threshold{proven.get(side, '')})"
    if entry.get("eigenvector_overlap") is not None:
        line += f"  overlap with previous {entry['eigenvector_overlap']:.3f}"
    if entry["trace"] is not None:
        stderr = entry["trace_stderr"]
        finite = stderr is not None and math.isfinite(stderr)
        trace = plus_minus(entry["trace"], stderr) if finite else f"{entry['trace']:.5g}"
        line += f"  trace = {trace}"
    if entry.get("minibatch"):
        summary = entry["minibatch"]["summary"]
        line += (
            f"  mini-batch λ1 median {summary['q50']:.4g} "
            f"(5-95 % {summary['q05']:.4g} to {summary['q95']:.4g})"
        )
    start = "warm" if entry["warm_start"] else "cold"
    return (
        line + f"  loss {entry['loss']:.4f}  [{entry['num_products']} products, "
        f"{entry['num_data_passes']} passes, {entry['wall_time']:.2f} s, {start} start]"
    )


# --------------------------------------------------------------------------- threshold


def _trajectory_notes(refs: list[Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The ``trajectory.json`` beside the checkpoints (when they share one directory), its
    learning rate checked; a file that cannot be used is a UserError advising ``--lr``."""
    parents = {Path(ref.path).parent for ref in refs}
    if len(parents) != 1:
        return None, None
    notes = parents.pop() / "trajectory.json"
    if not notes.is_file():
        return None, None
    try:
        content = read_json(notes)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read '{notes}' as JSON ({err}); give --lr.") from err
    if not isinstance(content, dict):
        return None, str(notes)
    rate = content.get("learning_rate")
    if rate is not None and not (
        isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)
    ):
        raise UserError(f"'{notes}' has learning_rate {rate!r}, not a positive number; give --lr.")
    return content, str(notes)


def _threshold(
    args: argparse.Namespace, refs: list[Any]
) -> tuple[
    StabilityThreshold | None, float | None, str | None, list[str], StabilityThreshold | None
]:
    """The stability threshold of the run, its η and where they came from, warnings, and
    the threshold dropped because it bounds the other matrix (None when none was).

    The optimizer recorded in the first checkpoint (a compiled .keras file) decides the
    formula, else the optimizer named in a ``trajectory.json``, else gradient descent;
    ``--lr`` overrides the recorded η (a mismatch is warned about). A threshold for another
    matrix than the one measured (λ_max(P⁻¹H) with ``--preconditioned``, else λ_max(H)) is
    warned about and not returned: no line, ratio or count compares λ₁ with a threshold
    that does not bound it (the η stays recorded). ``--preconditioned`` on a run whose
    recorded optimizer has no preconditioner is refused here, before anything is measured.
    """
    from spectra.io.checkpoints import recorded_optimizer

    threshold, rate, source, notes = _recorded_threshold(args, refs)
    recorded = recorded_optimizer(refs[0].path)
    if args.preconditioned and recorded is None and threshold is not None and source != "--lr":
        # The optimizer named by a trajectory.json (SGD when it names none).
        name = threshold.optimizer
        if not threshold.preconditioned:
            raise SettingError(
                f"the optimizer recorded in {source} is {name}, which has no preconditioner "
                "(P = I): measure λ_max(H) without --preconditioned."
            )
    if args.preconditioned and recorded is not None:
        name = re.sub(r"_\d+$", "", str(recorded["class_name"]))
        with contextlib.suppress(ValueError):
            if threshold_matrix(name) == "hessian":
                raise SettingError(
                    f"the optimizer recorded in {Path(refs[0].path).name} is {name}, which has "
                    "no preconditioner (P = I): measure λ_max(H) without --preconditioned."
                )
        check_preconditionable(name, f"recorded in {Path(refs[0].path).name}")
    if threshold is not None and threshold.preconditioned and not args.preconditioned:
        notes.append(
            f"no threshold: {threshold.optimizer}'s threshold {threshold.formula} bounds the "
            "preconditioned sharpness λ_max(P⁻¹H), not the λ_max(H) this command measures "
            "(give --preconditioned to measure λ_max(P⁻¹H) against it)"
        )
        return None, rate, source, notes, threshold
    if threshold is not None and not threshold.preconditioned and args.preconditioned:
        notes.append(
            f"no threshold: {threshold.optimizer}'s threshold {threshold.formula} bounds "
            "λ_max(H), not the preconditioned sharpness λ_max(P⁻¹H) that --preconditioned "
            "measures"
        )
        return None, rate, source, notes, threshold
    return threshold, rate, source, notes, None


def _recorded_threshold(
    args: argparse.Namespace, refs: list[Any]
) -> tuple[StabilityThreshold | None, float | None, str | None, list[str]]:
    from spectra.io.checkpoints import recorded_optimizer

    notes: list[str] = []
    optimizer = recorded_optimizer(refs[0].path)
    source = f"optimizer recorded in {Path(refs[0].path).name}" if optimizer else None
    if optimizer is not None:
        config = dict(optimizer["config"])
        config["learning_rate"] = float32_decimal(config.get("learning_rate"))
        optimizer = {**optimizer, "config": config}
    if optimizer is None:
        try:
            content, where = _trajectory_notes(refs)
        except UserError as err:
            if args.lr is None:
                raise
            # The advice was followed: --lr makes the run independent of the file.
            notes.append(f"{str(err).removesuffix('; give --lr.')}: ignored, η from --lr")
            content = None
        if content is not None and content.get("learning_rate") is not None:
            rate = content["learning_rate"]
            name = str(content.get("optimizer") or "SGD")
            optimizer = {
                "class_name": name,
                "config": {
                    "learning_rate": float(rate),
                    "momentum": content.get("momentum") or 0.0,
                    "beta_1": content.get("beta_1", 0.9),
                    "nesterov": bool(content.get("nesterov", False)),
                },
            }
            source = where
    if optimizer is None:
        if args.lr is None:
            return None, None, None, notes
        return gradient_descent_threshold(args.lr), args.lr, "--lr", notes
    try:
        recorded = stability_threshold_of(optimizer)
    except ValueError as err:
        if args.lr is None:
            notes.append(f"no threshold line: {err}")
            return None, None, None, notes
        notes.append(f"{source}: {err}; the line is gradient descent's 2/η with --lr")
        return gradient_descent_threshold(args.lr), args.lr, "--lr", notes
    threshold = recorded
    same_rate = args.lr is None or math.isclose(
        args.lr, recorded.learning_rate, rel_tol=_SAME_RATE_RTOL
    )
    if not same_rate:
        notes.append(
            f"--lr {args.lr:g} differs from the learning rate {recorded.learning_rate:g} of the "
            f"{source}; the threshold uses --lr"
        )
        threshold = stability_threshold_of(optimizer, learning_rate=args.lr)
        source = f"{source}, η from --lr"
    return threshold, threshold.learning_rate, source, notes


def float32_decimal(value: Any) -> Any:
    """A float that holds a float32 exactly (a learning rate Keras saved from its float32
    variable: 0.009999999776482582) as the shortest decimal that rounds to the same float32
    (0.01), the rate the user gave; anything else (a schedule's dict, None, a float64
    value) unchanged."""
    if not isinstance(value, float) or not math.isfinite(value):
        return value
    single = np.float32(value)
    if float(single) != value:
        return value
    return float(np.format_float_positional(single, unique=True, trim="-"))


def recorded_learning_rate(refs: list[Any]) -> float | None:
    """The learning rate as stored in the first checkpoint's optimizer (before
    :func:`float32_decimal`), or None when it records none or stores no float."""
    from spectra.io.checkpoints import recorded_optimizer

    optimizer = recorded_optimizer(refs[0].path)
    rate = None if optimizer is None else optimizer["config"].get("learning_rate")
    return rate if isinstance(rate, float) else None


# --------------------------------------------------------------------------- the end


def _conclude(
    args: argparse.Namespace,
    console: Console,
    store: SharpnessRun,
    threshold: StabilityThreshold | None,
    unit: str,
    figure: Any,
) -> int:
    entries = store.entries
    done = [entry for entry in entries if entry["status"] == "done"]
    failed = [entry for entry in entries if entry["status"] == "failed"]
    figures: list[str] = []
    if done:
        figures = _save_figure(args, store, figure, len(done))
        top = max(done, key=lambda entry: entry["eigenvalues"][0])
        largest = plus_minus(top["eigenvalues"][0], top["error_bounds"][0])
        summary = f"largest λ1 = {largest} at {unit} {top['step']}"
        if threshold is not None:
            summary += f" (threshold {threshold.value:.7g})"
        uncertified = [entry for entry in done if not entry_certified(entry, args.method)]
        if threshold is not None:
            sides = [_side_of_threshold(entry, threshold, args.method) for entry in done]
            summary += (
                f"; certified above it: {sides.count('above')}, below: {sides.count('below')}, "
                f"threshold within the bound: {sides.count('within')}"
            )
        if uncertified:
            summary += (
                f"; {len(uncertified)} of {len(done)} bounds not certified, so whether "
                "those checkpoints are above or below the threshold is not proven"
                if threshold is not None
                else f"; {len(uncertified)} of {len(done)} bounds not certified"
            )
        console.info(summary)
        if uncertified:
            console.warn(
                f"{len(uncertified)} of {len(done)} checkpoints have bounds that are not "
                f"certified ({args.method}: not converged, or failure probability above "
                f"{DEFAULT_FAILURE_PROBABILITY:g}); the values may lie outside their bounds. "
                "--method lanczos certifies its bounds (hollow markers in the figure: "
                "not certified)"
            )
    console.info(f"results: {store.json_path}, {store.csv_path}")
    if figures:
        console.info(f"figures: {', '.join(figures)}")
    if failed:
        names = ", ".join(entry["file"] for entry in failed)
        console.warn(
            f"{len(failed)} of {len(entries)} checkpoints failed (recorded in "
            f"{store.json_path}): {names}"
        )
        return 1
    return 0


def _save_figure(
    args: argparse.Namespace, store: SharpnessRun, figure: Any, count: int
) -> list[str]:
    """Save the run's figure in every ``--format``; the paths written."""
    try:
        return save_figure_formats(figure, store.out, _FIGURE, args.format)
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else one_line(str(err))
        raise UserError(
            f"not written: the figure {_FIGURE} ({reason}); {store.json_path} and "
            f"{store.csv_path} hold the {count} results."
        ) from err


def _minibatch_quantiles(done: list[dict[str, Any]]) -> tuple[np.ndarray | None, str | None]:
    """The (5 %, median, 95 %) of the entries' mini-batch λ₁ (NaN where not measured) and
    their legend text, or (None, None) without any."""
    measured = [entry.get("minibatch") for entry in done]
    first = next((m for m in measured if m), None)
    if first is None:
        return None, None
    rows = [
        [m["summary"][q] for q in ("q05", "q50", "q95")] if m else [np.nan] * 3 for m in measured
    ]
    batches = count_text(first["num_batches"], "mini-batch", "mini-batches")
    examples = count_text(first["batch_size"], "example")
    label = f"λ₁ of {batches} of {examples}: median (dashed), 5–95 % (band)"
    return np.array(rows, dtype=np.float64), label


def sharpness_figure(
    args: argparse.Namespace,
    report: dict[str, Any],
    done: list[dict[str, Any]],
    threshold: StabilityThreshold | None,
    unit: str,
    step_source: str,
) -> Any:
    """The figure of a run's ``done`` entries (``report`` is ``sharpness.json``'s record),
    not yet saved; also drawn by ``spectra plot`` from a reloaded ``sharpness.json``."""
    from spectra.plotting import plot_sharpness, threshold_text

    threshold, missing = _plotted_threshold(args, report, threshold)
    steps, xlabel = x_positions(args, report, done, unit, step_source)
    values = np.array([entry["eigenvalues"] for entry in done], dtype=np.float64)
    errors = np.array([entry["error_bounds"] for entry in done], dtype=np.float64)
    if args.top_k == 1:
        values, errors = values[:, 0], errors[:, 0]
    traces = [entry["trace"] for entry in done] if args.trace else None
    trace_errors = None
    if args.trace:
        trace_errors = [
            np.nan if entry["trace_stderr"] is None else entry["trace_stderr"] for entry in done
        ]
    overlaps = None
    if args.plot_overlap:
        overlaps = [
            np.nan if entry.get("eigenvector_overlap") is None else entry["eigenvector_overlap"]
            for entry in done
        ]
    minibatch, minibatch_label = _minibatch_quantiles(done)
    ax = plot_sharpness(
        steps,
        values,
        threshold=threshold,
        errors=errors,
        traces=traces,
        trace_errors=trace_errors,
        losses=[entry["loss"] for entry in done],
        overlaps=overlaps,
        minibatch=minibatch,
        minibatch_label=minibatch_label,
        xlabel=xlabel,
        ylabel="Preconditioned sharpness λ₁(P⁻¹H)" if args.preconditioned else None,
        threshold_note=missing,
        legend=not getattr(args, "no_legend", False),
        style=getattr(args, "style", None),
        font=figure_font(args),
    )
    uncertified = [not entry_certified(entry, args.method) for entry in done]
    if any(uncertified):
        top = values if values.ndim == 1 else values[:, 0]
        picked = np.flatnonzero(uncertified)
        ax.plot(
            np.asarray(steps)[picked],
            top[picked],
            linestyle="none",
            marker="o",
            markersize=7,
            markerfacecolor="white",
            markeredgecolor="black",
            zorder=5,
        )
    model = report.get("model")
    start = "cold starts" if args.cold_start else "warm starts from the previous eigenvectors"
    short = (
        None if model is None else f"{model['name']}, {model['num_parameters']:,} parameters",
        describe_data(report["data"]),
        f"{args.method.capitalize()}, k = {args.top_k}, tol = {args.tol:g}, {start}",
    )
    full = (
        "P: the optimizer state of each checkpoint" if args.preconditioned else None,
        f"trace: {args.trace_method}, {args.trace_products} products" if args.trace else None,
        f"{len(done)} checkpoints",
        "bars: eigenvalue error bounds",
        "hollow markers: bound not certified" if any(uncertified) else None,
        None if threshold is None else f"threshold: {threshold_text(threshold.label)}",
        missing,
    )
    return finish_figure(
        ax,
        args,
        f"Sharpness of the {matrix_title(args)} along training",
        short,
        full,
        matrix=describe_matrix(args, model),
        compact=True,
    )


def _plotted_threshold(
    args: argparse.Namespace, report: dict[str, Any], threshold: StabilityThreshold | None
) -> tuple[StabilityThreshold | None, str | None]:
    """The threshold to draw: only one that bounds the plotted matrix (λ₁(P⁻¹H) with
    ``--preconditioned``, else λ₁(H), written as on the figure's axis); with the reason
    when a known threshold is not drawn (a run of an adaptive optimizer without
    ``--preconditioned``, or a record of an earlier version that kept the threshold of
    the other matrix)."""
    plotted = "λ₁(P⁻¹H)" if args.preconditioned else "λ₁(H)"
    other = "λ₁(H)" if args.preconditioned else "λ₁(P⁻¹H)"
    if threshold is not None and bool(threshold.preconditioned) == bool(args.preconditioned):
        return threshold, None
    dropped = report.get("dropped_threshold")
    if threshold is None and isinstance(dropped, dict) and dropped.get("optimizer"):
        threshold = StabilityThreshold(
            **{name: dropped[name] for name in StabilityThreshold.__dataclass_fields__}
        )
    if threshold is not None:
        return None, f"no threshold: {threshold.optimizer}'s is for {other}, not {plotted}"
    if report.get("learning_rate") is not None:
        return None, f"no threshold: the optimizer's does not bound {plotted}"
    return None, None


# --------------------------------------------------------------------------- the x axis


def x_axes(args: argparse.Namespace, plan: list[PlannedCheckpoint]) -> dict[str, Any]:
    """Every x axis the checkpoints of ``plan`` can be placed on, as recorded in
    ``sharpness.json``'s ``x_axes`` (see :class:`SharpnessReport`), after checking that the
    one ``--x`` asks for is among them (a :class:`UserError` naming what is missing and
    what to pass otherwise; nothing is loaded into TensorFlow).

    ``"steps"``: from ``--steps``; else the optimizer's iteration counter saved in every
    checkpoint (:func:`spectra.io.checkpoints.stored_iterations`), when they all hold one
    and no two are equal; else the file names' numbers when they count steps.
    ``"epochs"``: the training steps / ``--steps-per-epoch``; else the file names' numbers
    when they count epochs. Cost: reading each checkpoint's weights index once.
    """
    from spectra.io.checkpoints import _step_from_name, step_unit, stored_iterations

    choice = getattr(args, "x_axis", None)
    per_epoch = getattr(args, "steps_per_epoch", None)
    if per_epoch is not None and choice is None:
        raise UserError(
            f"--steps-per-epoch {per_epoch} places the checkpoints at training step / "
            f"{per_epoch} on an epoch axis: add --x epochs (or leave it out)."
        )
    named = step_unit([item.path for item in plan])
    from_names = {item.file: _step_from_name(item.path) for item in plan}
    axes: dict[str, Any] = {}
    missing = ""
    if args.steps:
        axes["steps"] = _axis("--steps", {item.file: item.step for item in plan})
    else:
        counters = {item.file: stored_iterations(item.path) for item in plan}
        without = [file for file, counter in counters.items() if counter is None]
        repeated = len(set(counters.values())) < len(counters)
        if not without and not repeated:
            axes["steps"] = _axis("optimizer iterations", counters)
        elif named == "step":
            axes["steps"] = _axis("file names", from_names)
        else:
            missing = _missing_steps(plan, named, without, counters)
    if per_epoch is not None and "steps" in axes:
        steps = axes["steps"]
        epochs = {file: value / per_epoch for file, value in steps["values"].items()}
        source = f"{steps['source']} / {per_epoch}"
        label = f"Epoch ({_STEPS_PER_EPOCH_LABELS[steps['source']]} / {per_epoch})"
        axes["epochs"] = {"source": source, "label": label, "values": epochs}
    elif named == "epoch" and per_epoch is None:
        axes["epochs"] = _axis("file names", from_names, unit="Epoch")
    if choice == "steps" and "steps" not in axes:
        raise UserError(f"--x steps: {missing}")
    if choice == "epochs" and "epochs" not in axes:
        if per_epoch is not None:
            reason = missing.removeprefix("the checkpoints' training steps are not known: ")
            raise UserError(
                f"--x epochs: --steps-per-epoch {per_epoch} divides the training steps, "
                f"which are not known: {reason}"
            )
        counted = "steps given by --steps" if args.steps else f"the file names count {named}s"
        raise UserError(
            f"--x epochs: the checkpoints' epochs are not known ({counted}, not epochs): "
            "pass --steps-per-epoch N (the optimizer steps in one epoch) to plot training "
            "step / N."
        )
    return axes


def _axis(source: str, values: dict[str, Any], unit: str = "Training step") -> dict[str, Any]:
    return {"source": source, "label": f"{unit} ({_STEP_SOURCE_LABELS[source]})", "values": values}


def _missing_steps(
    plan: list[PlannedCheckpoint], named: str, without: list[str], counters: dict[str, Any]
) -> str:
    """Why the training steps of ``plan`` are not known, and what to pass."""
    names = f"the file names count {named}s, not steps ({plan[0].file}, …)"
    if len(without) == len(plan):
        counter = (
            "no checkpoint holds an optimizer iteration counter (a .keras or .weights.h5 "
            "saved from a compiled model after training does)"
        )
    elif without:
        counter = (
            f"{len(without)} of {len(plan)} checkpoints hold no optimizer iteration counter "
            f"(e.g. {without[0]})"
        )
    else:
        counter = (
            f"their optimizer iteration counters repeat ({sorted(counters.values())[:6]}: "
            "the optimizer was rebuilt between saves)"
        )
    return (
        f"the checkpoints' training steps are not known: {names} and {counter}; pass --steps "
        "STEP [STEP ...] (one per checkpoint file, in natural name order)."
    )


def x_positions(
    args: argparse.Namespace,
    report: dict[str, Any],
    done: list[dict[str, Any]],
    unit: str,
    step_source: str,
) -> tuple[list[Any], str]:
    """The x positions of the ``done`` entries and the axis label: the file names' (or
    ``--steps``') numbers without ``--x``, else those of the recorded axis it names."""
    choice = getattr(args, "x_axis", None)
    if choice is None:
        return [entry["step"] for entry in done], _UNIT_LABELS.get(
            (unit, step_source), unit.capitalize()
        )
    axis = (report.get("x_axes") or {}).get(choice)
    if axis is None:
        known = ", ".join(sorted(report.get("x_axes") or {})) or "none"
        raise UserError(
            f"--x {choice}: the run records no {choice} for its checkpoints (axes recorded: "
            f"{known}); run spectra sharpness again with --x {choice} (it says what to pass)."
        )
    return [axis["values"][entry["file"]] for entry in done], str(axis["label"])
