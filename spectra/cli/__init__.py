"""The ``spectra`` command line (also ``python -m spectra``).

Subcommands:

* ``spectra analyze MODEL``: top eigenvalues, optionally the trace, the spectral density and
  the per-layer spectra (``--layers``) of the loss Hessian of one model, or of another
  ``--curvature`` matrix (:mod:`spectra.cli._curvature`); writes ``results.json`` and figures.
* ``spectra sharpness CHECKPOINTS``: the top eigenvalue(s) (and trace) of every checkpoint of a
  training run, or with ``--preconditioned`` those of P⁻¹H for the optimizer state each
  checkpoint carries, and the overlap of consecutive top eigenvectors; resumable
  (:mod:`spectra.analysis.trajectory`); writes ``sharpness.json``, ``sharpness.csv`` and
  ``sharpness.png``.
* ``spectra landscape MODEL``: the loss along the top eigenvector(s) and a random direction;
  writes ``landscape.json`` and ``landscape_1d.png`` (and ``landscape_2d.png``).

Everything that can be checked is checked before computing: the options, ``--out`` (created,
proven writable and locked against a second run), the data, the model and the loss (``--loss``,
or without it the loss the model was compiled with). Errors in
what the user gave print one line ``spectra: error: ...`` and exit with status 2; an
unexpected error prints one line too and exits with 1; ``--debug`` shows the traceback.
TensorFlow is imported only by the commands that need it, without its C++ log lines
(``--verbose`` shows them), so ``spectra --help`` answers at once.
"""

from __future__ import annotations

import importlib
import shlex
import sys
from collections.abc import Sequence

from spectra.cli._parser import build_parser

__all__ = ["main"]

# Exit statuses besides 0 (done, which each command's run returns): an unexpected error, an
# error in the command or its inputs (argparse's own status for usage errors), and an
# interrupt (128 + SIGINT, the shell's convention).
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    words = sys.argv[1:] if argv is None else list(argv)
    args.command_line = shlex.join(["spectra", *words])
    from spectra.cli._common import Console, UserError, one_line

    console = Console(args)
    try:
        command = importlib.import_module(f"spectra.cli.{args.command_module}")
        return int(command.run(args, console))
    except UserError as err:
        if args.debug:
            raise
        print(f"spectra: error: {one_line(str(err))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("spectra: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:
        if args.debug:
            raise
        print(
            f"spectra: error: unexpected {type(err).__name__}: {one_line(str(err))} (rerun "
            "with --debug for the traceback, and please report it)",
            file=sys.stderr,
        )
        return EXIT_FAILED
