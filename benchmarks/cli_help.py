"""Start-up time of the command line: ``spectra --help`` and a subcommand's help.

Each is run in a fresh interpreter a few times; the median wall time is reported, with
whether TensorFlow was imported (it must not be: the commands import it lazily). The goal
is under 1 s; importing TensorFlow alone takes several.

    python benchmarks/cli_help.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 1.0
_PROBE = (
    "import runpy, sys\n"
    "sys.argv = ['spectra', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('spectra', run_name='__main__')\n"
    "except SystemExit:\n"
    "    pass\n"
    "print('tensorflow imported' if 'tensorflow' in sys.modules else 'no tensorflow',"
    " file=sys.stderr)\n"
)


def _time(arguments: list[str], repeat: int) -> tuple[float, str]:
    times = []
    note = ""
    for _ in range(repeat):
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-c", _PROBE, *arguments],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        times.append(time.perf_counter() - started)
        note = result.stderr.strip().splitlines()[-1]
    return statistics.median(times), note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (default 5)")
    args = parser.parse_args()
    for arguments in (["--help"], ["sharpness", "--help"]):
        seconds, note = _time(arguments, args.repeat)
        verdict = "ok" if seconds < TARGET_SECONDS else f"over {TARGET_SECONDS:g} s"
        print(f"spectra {' '.join(arguments):18s} {seconds:6.3f} s (median)  {note}  {verdict}")


if __name__ == "__main__":
    main()
