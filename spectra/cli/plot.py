"""``spectra plot RESULTS.json``: redraw a run's figures from its JSON, without TensorFlow.

Reads ``results.json`` (``spectra analyze``), ``sharpness.json`` (``spectra sharpness``; its
``--x steps|epochs`` may switch to another axis the run recorded) or
``landscape.json`` (``spectra landscape``), rebuilds the report (:func:`spectra.load`) and
draws the figures the original command draws, with the same functions
(:mod:`spectra.reports`), named by the settings the report records, in the ``--style``,
``--font``, ``--no-title``, ``--caption``, ``--no-legend`` and ``--no-labels`` given to
``spectra plot`` (the run's own are not reused, so that a replot in another style needs no
options of the run). The run's drawing options that only its recorded command line holds
(``analyze --log-scale``, ``--no-density-log``, ``--no-density-negative``; ``sharpness
--plot-overlap``) are read from it. Nothing is recomputed: it takes about a second, and
imports no TensorFlow.

The figures go to ``--out`` (default ``<the JSON's directory>/replot``, so that the run's
own figures are never overwritten), claimed and locked as every command's output directory
(a second run into it needs ``--restart``).
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
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
from spectra.cli._parser import figure_options, format_list
from spectra.io.result_validation import FieldError, check_figure_fields, damaged_file
from spectra.reports import (
    AnalysisReport,
    FigureOptions,
    LandscapeReport,
    SharpnessReport,
    analysis_figures,
    landscape_figures,
    load,
    sharpness_figures,
)
from spectra.reports.figures import DrawnFigure
from spectra.reports.sharpness_axes import x_positions

# The directory under the JSON's own that the figures go to by default.
_DEFAULT_SUBDIRECTORY = "replot"
# The drawing options of a run that its record keeps only in its command line, by command
# (the argparse names, which FigureOptions shares).
_RECORDED_DRAWING = {
    "analyze": ("log_scale", "density_log", "density_negative"),
    "sharpness": ("plot_overlap",),
    "landscape": (),
}


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
        type=format_list,
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
    its figure is drawn from (:meth:`spectra.reports.sharpness.SharpnessReport.to_dict`, NaN
    restored)."""
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


def _recorded_drawing(path: Path, command: object) -> dict[str, Any]:
    """The drawing options of the run that only its recorded command line holds
    (:data:`_RECORDED_DRAWING`): the command line parsed again, refused when it is not
    one this spectra reads."""
    from spectra.cli._parser import build_parser

    words = shlex.split(str(command)) if command else []
    if len(words) < 2 or words[0] != "spectra":
        raise UserError(f"{path}: records no spectra command line to read the options from")
    try:
        recorded = vars(build_parser().parse_args(words[1:]))
    except SystemExit:
        raise UserError(
            f"{path}: its recorded command line ({command}) is not one this spectra reads"
        ) from None
    names = _RECORDED_DRAWING.get(str(recorded.get("command_module")), ())
    return {name: recorded[name] for name in names}


def _options(path: Path, command: object, options: argparse.Namespace) -> FigureOptions:
    """The figure options of the replot: those of ``options`` (``spectra plot``'s own:
    ``--style``, ``--font``, ``--no-title``, ``--caption``, ``--no-legend``,
    ``--no-labels``, ``--x``), with the run's drawing options its command line records."""
    recorded = _recorded_drawing(path, command)
    return FigureOptions(
        style=getattr(options, "style", None),
        font=getattr(options, "font", "sans"),
        title=not getattr(options, "no_title", False),
        caption=getattr(options, "caption", None),
        legend=not getattr(options, "no_legend", False),
        labels=not getattr(options, "no_labels", False),
        x_axis=getattr(options, "x_axis", None),
        **recorded,
    )


def _drawing(
    path: Path, report: object, options: argparse.Namespace
) -> tuple[Callable[[], list[DrawnFigure]], tuple[str, ...]]:
    """A function drawing the report's figures (``(files key, stem, figure)``) and the
    stems, with ``spectra plot``'s arguments ``options``."""
    chosen = getattr(options, "x_axis", None)
    if chosen is not None and not (
        isinstance(report, dict) and report.get("type") == "SharpnessReport"
    ):
        raise UserError(
            f"--x {chosen}: only the figure of a sharpness.json has a training axis; leave "
            f"--x out for {path.name}."
        )
    if isinstance(report, AnalysisReport):
        drawn = _options(path, report.command, options)
        stems = ["eigenvalues"]
        stems += ["density"] if report.density is not None else []
        stems += ["layers"] if report.layers is not None else []
        return (lambda: analysis_figures(report, drawn)), tuple(stems)
    if isinstance(report, LandscapeReport):
        drawn = _options(path, report.command, options)
        stems = ["landscape_1d"] + (["landscape_2d"] if report.surface is not None else [])
        return (lambda: landscape_figures(report, drawn)), tuple(stems)
    if isinstance(report, dict) and report.get("type") == "SharpnessReport":
        return _sharpness_drawing(path, report, options), ("sharpness",)
    raise UserError(f"{path}: a {type(report).__name__} has no figures to redraw")


def _sharpness_drawing(
    path: Path, report: dict[str, Any], options: argparse.Namespace
) -> Callable[[], list[DrawnFigure]]:
    drawn = _options(path, report.get("command"), options)
    done = [entry for entry in report.get("checkpoints", []) if entry.get("status") == "done"]
    if not done:
        raise UserError(f"{path}: no checkpoint is done, so there is nothing to plot")
    unit, source = str(report.get("step_unit", "step")), str(report.get("step_source", ""))
    x_axis = drawn.x_axis if drawn.x_axis is not None else report.get("x_axis")

    # An axis the run did not record is refused before anything is drawn or claimed.
    with user_errors():
        x_positions(report, done, x_axis, unit, source)
    return lambda: sharpness_figures(report, drawn)
