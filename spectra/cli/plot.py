"""``spectra plot RESULTS.json``: redraw a run's figures from its JSON, without TensorFlow.

Reads ``results.json`` (``spectra analyze``), ``sharpness.json`` (``spectra sharpness``; its
``--x steps|epochs`` may switch to another axis the run recorded) or
``landscape.json`` (``spectra landscape``), rebuilds the report (:func:`spectra.load`; the
command line the run recorded is parsed again for the options its figures name) and draws
the figures the original command draws, with the same functions, in the ``--style``,
``--no-title`` and ``--caption`` given to ``spectra plot`` (the run's own are not reused,
so that a replot in another style needs no options of the run). Nothing is recomputed:
it takes about a second, and imports no TensorFlow.

The figures go to ``--out`` (default ``<the JSON's directory>/replot``, so that the run's
own figures are never overwritten), claimed and locked as every command's output directory
(a second run into it needs ``--restart``).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path
from typing import Any

from spectra.cli._common import (
    Console,
    UserError,
    figure_font,
    figure_names,
    finish_outputs,
    locked_output,
    one_line,
    save_figure_formats,
    user_errors,
)
from spectra.cli._parser import _formats, figure_options
from spectra.estimators.results import load
from spectra.io.result_validation import FieldError, check_figure_fields, damaged_file

# The directory under the JSON's own that the figures go to by default.
_DEFAULT_SUBDIRECTORY = "replot"


def add_arguments(commands: argparse._SubParsersAction) -> None:
    """Register ``spectra plot`` and its options with the subcommand parsers ``commands``."""
    plot = commands.add_parser(
        "plot",
        parents=[figure_options(value_labels=True)],
        help="redraw a run's figures from its results.json, sharpness.json or landscape.json "
        "(no TensorFlow, nothing recomputed)",
        description="Redraw the figures of a spectra analyze, sharpness or landscape run from "
        "the JSON it wrote, with the options it recorded. Nothing is recomputed and TensorFlow "
        "is not imported.",
    )
    plot.add_argument(
        "results",
        metavar="RESULTS.json",
        help="a results.json (analyze), sharpness.json (sharpness) or landscape.json "
        "(landscape) file",
    )
    plot.add_argument(
        "--out",
        metavar="DIR",
        help=f"output directory (default: {_DEFAULT_SUBDIRECTORY}/ in the JSON's directory, "
        "so that the run's own figures are not overwritten)",
    )
    plot.add_argument(
        "--format",
        type=_formats,
        default=["png"],
        metavar="FMT[,FMT]",
        help="figure formats, e.g. png,pdf,svg (default png)",
    )
    plot.add_argument(
        "--x",
        dest="x_axis",
        choices=("steps", "epochs"),
        help="a sharpness.json's x axis: training steps or epochs, when the run recorded "
        "that axis (default: the run's own)",
    )
    plot.add_argument(
        "--restart",
        action="store_true",
        help="replace the figures of an earlier spectra plot in --out (those its manifest lists)",
    )
    verbosity = plot.add_mutually_exclusive_group()
    verbosity.add_argument("--quiet", action="store_true", help="print only warnings and errors")
    verbosity.add_argument("--verbose", action="store_true", help="more detail")
    plot.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    plot.set_defaults(command_module="plot", no_progress=True)


def run(args: argparse.Namespace, console: Console) -> int:
    figure_font(args)
    path = Path(args.results)
    with user_errors():
        report = _read(path)
    if args.out is None:
        args.out = str(path.parent / _DEFAULT_SUBDIRECTORY)
    draw, stems = _drawing(path, report, args)
    with locked_output(args, figure_names(stems, args.format)) as out:
        written: list[str] = []
        for _, stem, figure in draw():
            written += save_figure_formats(figure, out, stem, args.format)
        finish_outputs(out)
    console.info(f"figures: {', '.join(written)}")
    return 0


def _read(path: Path) -> Any:
    """The report in ``path`` (:func:`spectra.load`); a ``sharpness.json`` as the dictionary
    its figure is drawn from (:meth:`spectra.cli.sharpness.SharpnessReport.to_dict`, NaN
    restored)."""
    from spectra.cli.sharpness import SharpnessReport

    wanted = "a run's results.json, sharpness.json or landscape.json"
    if not path.exists():
        raise UserError(f"no file '{path}': give {wanted}")
    if path.is_dir():
        raise UserError(f"'{path}' is a directory: give {wanted} in it")
    try:
        report = load(path)
    except FieldError as err:  # the right kind of file, edited or damaged: says what to rerun
        raise UserError(one_line(str(err))) from err
    except ValueError as err:
        raise UserError(f"{one_line(str(err))}; spectra plot redraws {wanted}") from err
    try:
        check_figure_fields(report)
    except FieldError as err:
        raise UserError(str(damaged_file(str(path), type(report).__name__, err))) from err
    if isinstance(report, SharpnessReport):
        return report.to_dict()
    return report


def _recorded_args(
    path: Path, command: Any, options: argparse.Namespace | None = None
) -> argparse.Namespace:
    """The options of the run: its recorded command line parsed again, with the figure
    options (``--style``, ``--font``, ``--no-title``, ``--caption``, ``--no-legend``,
    ``--no-labels``) of ``options``."""
    from spectra.cli._parser import build_parser

    words = shlex.split(str(command)) if command else []
    if len(words) < 2 or words[0] != "spectra":
        raise UserError(f"{path}: records no spectra command line to read the options from")
    try:
        args = build_parser().parse_args(words[1:])
    except SystemExit:
        raise UserError(
            f"{path}: its recorded command line ({command}) is not one this spectra reads"
        ) from None
    args.command_line = command
    if options is not None:
        for name in ("style", "no_title", "caption"):
            setattr(args, name, getattr(options, name))
        for name, default in (("font", "sans"), ("no_legend", False), ("no_labels", False)):
            setattr(args, name, getattr(options, name, default))
        if getattr(options, "x_axis", None) is not None:
            args.x_axis = options.x_axis
    return args


def _drawing(
    path: Path, report: Any, options: argparse.Namespace | None = None
) -> tuple[Any, tuple[str, ...]]:
    """A function drawing the report's figures (``(files key, stem, figure)``) and the stems."""
    from spectra.cli.analyze import AnalysisReport
    from spectra.cli.landscape import LandscapeReport

    chosen = getattr(options, "x_axis", None)
    if chosen is not None and not (
        isinstance(report, dict) and report.get("type") == "SharpnessReport"
    ):
        raise UserError(
            f"--x {chosen}: only the figure of a sharpness.json has a training axis; leave "
            f"--x out for {path.name}."
        )
    if isinstance(report, AnalysisReport):
        from spectra.cli import analyze

        args = _recorded_args(path, report.command, options)
        stems = ["eigenvalues"]
        stems += ["density"] if report.density is not None else []
        stems += ["layers"] if report.layers is not None else []
        return (lambda: analyze._figures(args, report)), tuple(stems)
    if isinstance(report, LandscapeReport):
        from spectra.cli import landscape

        args = _recorded_args(path, report.command, options)
        curves = report.curves
        slope = float(report.radius["slope_along_v1"])
        stems = ["landscape_1d"] + (["landscape_2d"] if report.surface is not None else [])
        return (
            lambda: landscape._figures(args, report, curves.alphas, curves.base_loss, slope)
        ), tuple(stems)
    if isinstance(report, dict) and report.get("type") == "SharpnessReport":
        return _sharpness_drawing(path, report, options), ("sharpness",)
    raise UserError(f"{path}: a {type(report).__name__} has no figures to redraw")


def _sharpness_drawing(
    path: Path, report: dict[str, Any], options: argparse.Namespace | None = None
) -> Any:
    from spectra.analysis.stability import StabilityThreshold
    from spectra.cli import sharpness

    args = _recorded_args(path, report.get("command"), options)
    done = [entry for entry in report.get("checkpoints", []) if entry.get("status") == "done"]
    if not done:
        raise UserError(f"{path}: no checkpoint is done, so there is nothing to plot")
    threshold = None
    recorded = report.get("threshold")
    if recorded is not None:
        names = [spec.name for spec in dataclasses.fields(StabilityThreshold)]
        threshold = StabilityThreshold(**{name: recorded[name] for name in names})
    unit, source = str(report.get("step_unit", "step")), str(report.get("step_source", ""))

    # An axis the run did not record is refused before anything is drawn or claimed.
    with user_errors():
        sharpness.x_positions(args, report, done, unit, source)

    def draw() -> list[tuple[str, str, Any]]:
        figure = sharpness.sharpness_figure(args, report, done, threshold, unit, source)
        return [("sharpness_figure", "sharpness", figure)]

    return draw
