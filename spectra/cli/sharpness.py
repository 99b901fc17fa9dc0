"""``spectra sharpness CHECKPOINTS``: the sharpness of every checkpoint of a run, resumable.

The bookkeeping (resume, lock, files) is :class:`spectra.analysis.trajectory.SharpnessRun`, the
measurement :func:`spectra.analysis.trajectory.measure_sharpness`; the options become a
:class:`spectra.reports.sharpness.SharpnessRunSettings`, the run's threshold, x axes, report
and figure are :mod:`spectra.reports`'. This module reads the options, finds the checkpoints,
measures them in order and prints.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spectra._format import plus_minus
from spectra.analysis.minibatch import summary_scalars
from spectra.analysis.stability import StabilityThreshold
from spectra.analysis.trajectory import (
    PlannedCheckpoint,
    ResumeRefused,
    SharpnessRun,
    measure_sharpness,
    plan_checkpoints,
)
from spectra.cli._common import (
    Console,
    SettingError,
    UserError,
    bound_note,
    check_builder_use,
    check_curvature,
    check_loss,
    check_model,
    check_out_option,
    compiles_model,
    custom_objects_option,
    data_description,
    data_fingerprint,
    drawing_options,
    estimate_settings,
    figure_font,
    figure_names,
    input_settings,
    load_data,
    make_operator,
    model_description,
    one_line,
    report_errors,
    require_backend,
    save_figure_formats,
    user_errors,
    versions,
)
from spectra.cli._parser import (
    common_options,
    eigen_options,
    positive_float,
    positive_int,
    trace_options,
)
from spectra.io.files import read_json
from spectra.io.tensorboard import SharpnessEvents, sharpness_scalars
from spectra.reports.base import DEFAULT_FAILURE_PROBABILITY
from spectra.reports.figures import (
    FigureOptions,
    figure_record,
)
from spectra.reports.sharpness import (
    SharpnessReport,
    SharpnessRunSettings,
    entry_certified,
    entry_failure_probability,
    minibatch_record,
    sharpness_figures,
    side_of_threshold,
)
from spectra.reports.sharpness_axes import X_AXES, x_axes
from spectra.reports.thresholds import recorded_learning_rate, recover_threshold

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from spectra.io.datasets import Data

__all__ = ["SharpnessReport", "add_arguments", "run"]

_FIGURE = "sharpness"


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
        "--top-k", type=positive_int, default=1, metavar="K", help="eigenvalues (default 1)"
    )
    sharpness.add_argument(
        "--lr",
        type=positive_float,
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
        choices=X_AXES,
        help="the figure's x axis: 'steps' puts each checkpoint at its training step (from "
        "--steps, else the optimizer's iteration counter saved in the checkpoints, else the "
        "step numbers in the file names); 'epochs' at its epoch (the epoch numbers in the "
        "file names, or the training steps / --steps-per-epoch). Default: the numbers in the "
        "file names, labelled with what they count",
    )
    sharpness.add_argument(
        "--steps-per-epoch",
        type=positive_int,
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
        type=positive_int,
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
        type=positive_int,
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
    settings = _settings(args)
    with user_errors():
        settings.measurement()
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


def _settings(args: argparse.Namespace) -> SharpnessRunSettings:
    """The settings of the run the options ask for."""
    return SharpnessRunSettings(
        **input_settings(args),
        **estimate_settings(args),
        warm_start=not args.cold_start,
        per_batch=args.per_batch,
        per_batch_size=args.per_batch_size,
        preconditioned=args.preconditioned,
        lr=args.lr,
        steps=args.steps,
        x_axis=args.x_axis,
        steps_per_epoch=args.steps_per_epoch,
    )


def _figure_options(args: argparse.Namespace) -> FigureOptions:
    return drawing_options(args, plot_overlap=args.plot_overlap, x_axis=args.x_axis)


def _run_locked(
    args: argparse.Namespace,
    console: Console,
    settings: SharpnessRunSettings,
    store: SharpnessRun,
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
    with report_errors():
        axes = x_axes(
            plan, x_axis=settings.x_axis, steps_per_epoch=settings.steps_per_epoch, steps=args.steps
        )
        recovered = recover_threshold(refs, lr=settings.lr, preconditioned=settings.preconditioned)
    threshold, rate, rate_source = recovered.threshold, recovered.learning_rate, recovered.source
    notes, dropped = recovered.notes, recovered.dropped
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
        "x_axis": settings.x_axis,
        "x_axes": axes,
    }
    wanted = {
        **settings.record(),
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
        figure = _prepared_figure(args, store)
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


def _prepared_figure(args: argparse.Namespace, store: SharpnessRun) -> Figure | None:
    """The figure of the checkpoints measured so far (None before the first), not yet
    saved; its settings, title and full caption go into the record's ``figures``."""
    options = _figure_options(args)
    figures = sharpness_figures(store.report(), options)
    if not figures:
        return None
    store.update_header(figures=figure_record(options, figures, compact=True))
    return figures[0].figure


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
    settings: SharpnessRunSettings,
    store: SharpnessRun,
    plan: list[PlannedCheckpoint],
    pending: list[PlannedCheckpoint],
    data: Data,
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
    measured = settings.measurement()
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
                        measured,
                        v0=vectors,
                        previous=vectors if neighbour else None,
                        progress=False,
                    )
                    if measured.per_batch:
                        with user_errors("--per-batch"):
                            measurement.minibatch = minibatch_record(
                                model,
                                data,
                                settings,
                                measurement,
                                threshold,
                                functools.partial(make_operator, model, args),
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
        side = side_of_threshold(entry, threshold, method)
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


# --------------------------------------------------------------------------- the end


def _conclude(
    args: argparse.Namespace,
    console: Console,
    store: SharpnessRun,
    threshold: StabilityThreshold | None,
    unit: str,
    figure: Figure | None,
) -> int:
    entries = store.entries
    done = [entry for entry in entries if entry["status"] == "done"]
    failed = [entry for entry in entries if entry["status"] == "failed"]
    figures: list[str] = []
    if done and figure is not None:  # a figure is drawn once a checkpoint is done
        figures = _save_figure(args, store, figure, len(done))
        top = max(done, key=lambda entry: entry["eigenvalues"][0])
        largest = plus_minus(top["eigenvalues"][0], top["error_bounds"][0])
        summary = f"largest λ1 = {largest} at {unit} {top['step']}"
        if threshold is not None:
            summary += f" (threshold {threshold.value:.7g})"
        uncertified = [entry for entry in done if not entry_certified(entry, args.method)]
        if threshold is not None:
            sides = [side_of_threshold(entry, threshold, args.method) for entry in done]
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
    args: argparse.Namespace, store: SharpnessRun, figure: Figure, count: int
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
