"""Writing files atomically: results are never seen half-written, and a run that is
interrupted leaves the previous version of a file intact."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(temp_path)``, then move the temporary file onto ``path``.

    The temporary file lies in the same directory (so ``os.replace`` is atomic); missing
    parent directories are created. An existing file keeps its permissions, a new one
    gets the usual ones (0666 less the umask) rather than ``mkstemp``'s owner-only 0600.
    On any error the temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
    )
    os.close(handle)
    try:
        write(temp_name)
        if target.exists():
            mode = target.stat().st_mode & 0o777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(temp_name, mode)
        os.replace(temp_name, target)
    except BaseException:
        if os.path.exists(temp_name):
            os.unlink(temp_name)
        raise
    return target


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""

    def write(temp_name: str) -> None:
        with open(temp_name, "w", encoding="utf-8") as stream:
            stream.write(text)

    return atomic_write(path, write)


def atomic_write_json(path: str | os.PathLike, payload: Any) -> Path:
    """Write ``payload`` as indented JSON to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(payload, indent=2) + "\n")
