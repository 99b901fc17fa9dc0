"""Writing result files safely.

* Atomic writes: a file is written to a temporary file beside it and moved into place with
  ``os.replace``, so readers never see a half-written file and an interrupted run leaves the
  previous version intact. Temporary files are named ``.NAME.<random>.tmp``
  (``tempfile.mkstemp``); those left by a killed process are removed by
  :func:`remove_temporaries`.
* Strict JSON: NaN and ±Infinity are not JSON. They are written as ``null`` and listed, with
  the reason, under ``"null_values"`` (:func:`strict_json_text`).
* Output directories: :func:`prepare_directory` creates one and proves it writable before any
  work is done; :class:`DirectoryLock` gives one process at a time the right to write there.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DirectoryLock",
    "DirectoryLocked",
    "atomic_write",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_write_texts",
    "prepare_directory",
    "remove_temporaries",
    "strict_json_text",
    "strictly_jsonable",
]

_TEMP_SUFFIX = ".tmp"
_LOCK_NAME = ".spectra.lock"

# ``explain(path, value)`` gives the reason a value is not finite, or None for the default.
Explain = Callable[[str, float], "str | None"]


def _temporary(target: Path) -> str:
    handle, temp_name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=_TEMP_SUFFIX
    )
    os.close(handle)
    return temp_name


def _publish(temp_name: str, target: Path) -> None:
    """Give ``temp_name`` the permissions ``target`` has (or the usual ones) and move it there.

    An existing file keeps its permissions, a new one gets 0666 less the umask rather than
    ``mkstemp``'s owner-only 0600.
    """
    if target.exists():
        mode = target.stat().st_mode & 0o777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(temp_name, mode)
    os.replace(temp_name, target)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(temp_path)``, then move the temporary file onto ``path``.

    The temporary file lies in the same directory (so ``os.replace`` is atomic); missing
    parent directories are created. On any error the temporary file is removed and ``path``
    is left as it was.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp_name = _temporary(target)
    try:
        write(temp_name)
        _publish(temp_name, target)
    except BaseException:
        if os.path.exists(temp_name):
            os.unlink(temp_name)
        raise
    return target


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_texts([(path, text)])[0]


def atomic_write_texts(files: Sequence[tuple[str | os.PathLike, str]]) -> list[Path]:
    """Write several text files as one step: all are written in full before any is replaced.

    The temporary files are written first; only when all are complete are they moved into
    place, in the given order (put the file that commits the step last: the other files are
    derived from it, so a reader or a later run can tell, and rebuild, a file that ran ahead).
    On an error before the moves nothing is replaced and no temporary file is left.
    """
    targets = [Path(path) for path, _ in files]
    temporaries: list[str] = []
    try:
        for target, (_, text) in zip(targets, files):
            target.parent.mkdir(parents=True, exist_ok=True)
            temporaries.append(_temporary(target))
            with open(temporaries[-1], "w", encoding="utf-8") as stream:
                stream.write(text)
        for temp_name, target in zip(temporaries, targets):
            _publish(temp_name, target)
    except BaseException:
        for temp_name in temporaries:
            if os.path.exists(temp_name):
                os.unlink(temp_name)
        raise
    return targets


def remove_temporaries(directory: str | os.PathLike, names: Iterable[str]) -> list[Path]:
    """Remove the temporary files (``.NAME.<random>.tmp``) of ``names`` left in ``directory``.

    Call it only while holding the directory's lock: another process's temporary files are
    work in progress. Returns the files removed.
    """
    directory = Path(directory)
    prefixes = tuple(f".{name}." for name in names)
    removed = []
    for entry in directory.iterdir():
        if entry.name.startswith(prefixes) and entry.name.endswith(_TEMP_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    return removed


# --------------------------------------------------------------------------- strict JSON


def _reason(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def strictly_jsonable(payload: Any, explain: Explain | None = None) -> tuple[Any, dict[str, str]]:
    """``payload`` with every non-finite float replaced by None, and the reasons.

    NumPy arrays and scalars become lists and Python numbers. The reasons map the path of
    each replaced value (``"trace.stderr"``, ``"eigenvalues[2]"``) to ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"``, followed by ``explain(path, value)`` when that gives
    a text.
    """
    reasons: dict[str, str] = {}

    def clean(value: Any, path: str) -> Any:
        if isinstance(value, np.ndarray):
            value = value.tolist()
        elif isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            reason = _reason(value)
            extra = explain(path, value) if explain is not None else None
            reasons[path] = reason if not extra else f"{reason}: {extra}"
            return None
        if isinstance(value, dict):
            return {
                str(key): clean(item, f"{path}.{key}" if path else str(key))
                for key, item in value.items()
            }
        if isinstance(value, (list, tuple)):
            return [clean(item, f"{path}[{index}]") for index, item in enumerate(value)]
        return value

    return clean(payload, ""), reasons


def strict_json_text(payload: Any, explain: Explain | None = None, indent: int = 2) -> str:
    """Strict JSON text (RFC 8259: no NaN or Infinity tokens) of ``payload``, newline-ended.

    Non-finite floats are written as ``null``; when ``payload`` is a dictionary, a
    ``"null_values"`` entry maps their paths to the reasons (see :func:`strictly_jsonable`).
    """
    clean, reasons = strictly_jsonable(payload, explain)
    if reasons and isinstance(clean, dict):
        clean = {**clean, "null_values": reasons}
    return json.dumps(clean, indent=indent, allow_nan=False, ensure_ascii=False) + "\n"


def atomic_write_json(
    path: str | os.PathLike, payload: Any, explain: Explain | None = None
) -> Path:
    """Write ``payload`` as strict, indented JSON to ``path`` atomically."""
    return atomic_write_text(path, strict_json_text(payload, explain))


# --------------------------------------------------------------------------- directories


def prepare_directory(path: str | os.PathLike, what: str = "the output directory") -> Path:
    """Create the directory ``path`` if needed and prove that files can be written in it.

    Raises:
        NotADirectoryError: ``path`` (or a parent) is a file.
        PermissionError, OSError: it cannot be created or written, with the reason.
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"{what} '{directory}' is a file, not a directory; give a directory (it is created "
            "if missing)."
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError as err:
        raise NotADirectoryError(
            f"cannot create {what} '{directory}': a part of the path is a file."
        ) from err
    except OSError as err:
        raise type(err)(f"cannot create {what} '{directory}': {err.strerror or err}.") from err
    try:
        handle, probe = tempfile.mkstemp(dir=directory, prefix=".spectra-write-test.")
        try:
            os.write(handle, b"spectra")
        finally:
            os.close(handle)
            os.unlink(probe)
    except OSError as err:
        raise type(err)(
            f"cannot write to {what} '{directory}': {err.strerror or err}. Choose a writable "
            "directory."
        ) from err
    return directory


class DirectoryLocked(RuntimeError):
    """Another process holds the lock on a directory."""


class DirectoryLock:
    """An exclusive lock on a directory: one writer at a time.

    Held as ``flock`` on ``DIR/.spectra.lock``, which records the holder's pid, host and start
    time. The operating system releases the lock when the holder exits, however it exits, so
    a lock left by a killed run is simply taken over. :meth:`acquire` never waits: a second
    process gets :class:`DirectoryLocked` at once, naming the holder. Use as a context manager.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / _LOCK_NAME
        self._handle: int | None = None

    def acquire(self) -> DirectoryLock:
        import fcntl

        while True:
            handle = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(handle, 4096).decode("utf-8", "replace").split()
                os.close(handle)
                who = f"pid {holder[0]}" if holder else "a process"
                if len(holder) > 1 and holder[1] != socket.gethostname():
                    who += f" on {holder[1]}"
                raise DirectoryLocked(
                    f"another spectra run ({who}) is writing to '{self.directory}'; wait for "
                    "it to finish or choose another --out."
                ) from None
            # The holder before us may have removed the file after we opened it: then our
            # lock is on a file nobody else will see. Start again on the current file.
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                os.close(handle)
                continue
            opened = os.fstat(handle)
            if (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino):
                os.close(handle)
                continue
            break
        os.ftruncate(handle, 0)
        os.write(handle, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode())
        self._handle = handle
        return self

    def release(self) -> None:
        if self._handle is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._handle)
        self._handle = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
