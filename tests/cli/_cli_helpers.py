"""What the command-line tests share: the example model and data of data/, and running a
command in this process."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import matplotlib.image

from spectra.cli import main

ROOT = Path(__file__).resolve().parents[2]

DATA = ROOT / "data"

MLP = str(DATA / "digits_mlp.keras")

DIGITS = str(DATA / "digits.npz")

LOSS = "sparse_categorical_crossentropy"

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(args: list[str]) -> tuple[int, str]:
    """``main(args)`` in this process; returns the exit status and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(args)
    return status, out.getvalue()


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
