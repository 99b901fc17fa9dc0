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
* Files no one else can redirect: the output directory may be shared (anyone who can write in
  it can plant a symbolic link or a hard link where spectra writes). The lock is opened with
  ``O_NOFOLLOW`` and refused unless it is a regular file with one link; temporary files are
  created with ``O_EXCL`` (``mkstemp``) and moved onto their final names with ``os.replace``,
  which replaces a link at the final name instead of following it; :func:`check_outputs`
  refuses a directory in which a name spectra writes is a link or not a regular file.
* One run per directory: :func:`claim_outputs` records in ``.spectra-manifest.json`` which
  files a run writes, refuses a directory that holds another run's files (or files no manifest
  lists at the names this run writes), and with ``restart`` removes exactly the files the
  previous manifest lists.
* Errors name the path: a write that fails (a directory where the file should be, a file
  where a directory should be, a full disk) raises an ``OSError`` of the same class whose
  message is one line naming the path and the cause; ``errno`` is kept.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "MANIFEST_NAME",
    "DirectoryLock",
    "DirectoryLocked",
    "NotWritten",
    "OutputClaim",
    "OutputInUse",
    "UnsafeOutput",
    "atomic_write",
    "atomic_write_files",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_write_texts",
    "check_outputs",
    "claim_outputs",
    "prepare_directory",
    "read_json",
    "read_manifest",
    "remove_temporaries",
    "strict_json_text",
    "strictly_jsonable",
    "text_writer",
]

_TEMP_SUFFIX = ".tmp"
_LOCK_NAME = ".spectra.lock"
MANIFEST_NAME = ".spectra-manifest.json"
_MANIFEST_FORMAT = "spectra-manifest/1"
_NO_LINKS = (
    "spectra never writes through a link in an output directory (anyone who can write there "
    "could redirect its files)"
)


class UnsafeOutput(OSError):
    """A name spectra writes is a symbolic link, a hard link or not a regular file."""


class OutputInUse(ValueError):
    """The output directory holds another run's files, or files no manifest lists."""


class NotWritten(OSError):
    """Some output files could not be written (a full disk, say); the message says which."""


def _with_path(err: OSError, message: str) -> OSError:
    """An error of ``err``'s class with the one-line ``message`` (``errno`` kept)."""
    try:
        new = type(err)(message)
    except TypeError:  # an OSError subclass with another signature
        new = OSError(message)
    new.errno = err.errno
    return new


def _blocking_ancestor(path: Path) -> Path | None:
    """The first existing part of ``path`` (from the root) that is not a directory."""
    for part in reversed([path, *path.parents]):
        if os.path.lexists(part) and not part.is_dir():
            return part
    return None


def _check_target(target: Path) -> None:
    """Refuse, naming the path, a target that is a directory or lies below a file."""
    if target.is_dir() and not target.is_symlink():
        raise IsADirectoryError(
            f"cannot write '{target}': it is a directory; give a file name (e.g. "
            f"'{target / 'results.json'}')."
        )
    blocking = _blocking_ancestor(target.parent)
    if blocking is not None:
        raise NotADirectoryError(
            f"cannot write '{target}': '{blocking}' is a file, not a directory."
        )


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
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        info = None
    if info is not None and stat.S_ISREG(info.st_mode):
        mode = info.st_mode & 0o777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(temp_name, mode)
    os.replace(temp_name, target)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(temp_path)``, then move the temporary file onto ``path``.

    The temporary file lies in the same directory (so ``os.replace`` is atomic) and is
    created with ``O_EXCL``; missing parent directories are created. A symbolic link at
    ``path`` is replaced by the file, never followed. On any error the temporary file is
    removed and ``path`` is left as it was.

    Raises
    ------
    IsADirectoryError
        ``path`` is a directory.
    NotADirectoryError
        a part of its parent is a file.
    OSError
        the write failed (a full disk, no permission), of the class and ``errno``
        of the cause, with a one-line message naming ``path``.
    """
    return atomic_write_files([(path, write)])[0]


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write_texts([(path, text)])[0]


def text_writer(text: str) -> Callable[[str], None]:
    """A ``write(temp_path)`` for :func:`atomic_write_files` that writes ``text`` (UTF-8)."""

    def write(temp_name: str) -> None:
        with open(temp_name, "w", encoding="utf-8") as stream:
            stream.write(text)

    return write


def atomic_write_texts(files: Sequence[tuple[str | os.PathLike, str]]) -> list[Path]:
    """Write several text files as one step (see :func:`atomic_write_files`)."""
    return atomic_write_files([(path, text_writer(text)) for path, text in files])


def atomic_write_files(
    files: Sequence[tuple[str | os.PathLike, Callable[[str], None]]],
) -> list[Path]:
    """Write several files as one step: all are written in full before any is replaced.

    Each ``write(temp_path)`` fills a temporary file beside its target; only when all are
    complete are they moved into place, in the given order (put the file that commits the
    step last: the other files are derived from it, so a reader or a later run can tell, and
    rebuild, a file that ran ahead). On an error before the moves nothing is replaced and no
    temporary file is left. Errors as :func:`atomic_write`.
    """
    targets = [Path(path) for path, _ in files]
    temporaries: list[str] = []
    current = targets[0] if targets else Path()
    try:
        for target, (_, write) in zip(targets, files):
            current = target
            _check_target(target)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as err:
                blocking = _blocking_ancestor(target.parent) or target.parent
                raise NotADirectoryError(
                    f"cannot write '{target}': '{blocking}' is not a directory."
                ) from err
            temporaries.append(_temporary(target))
            write(temporaries[-1])
        for temp_name, target in zip(temporaries, targets):
            current = target
            _publish(temp_name, target)
    except BaseException as err:
        for temp_name in temporaries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name)
        if isinstance(err, OSError) and str(current) not in str(err):
            raise _with_path(err, f"cannot write '{current}': {err.strerror or err}.") from err
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
                if entry.is_dir() and not entry.is_symlink():
                    continue  # not a temporary file of spectra's: left alone
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


# --------------------------------------------------------------------------- reading JSON

# The deepest nesting read_json accepts. spectra's files nest a few levels (a report, a result
# in it, a list of arrays, a row); the margin keeps every reader far from Python's recursion
# limit, which JSON nested thousands deep would reach (RecursionError).
MAX_JSON_DEPTH = 32
# A JSON string (escapes included) or a bracket: the tokens that decide the nesting depth.
_JSON_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def _nesting_too_deep(text: str, limit: int) -> int | None:
    """The offset of the first bracket nested deeper than ``limit`` in ``text``, or None."""
    depth = 0
    for match in _JSON_NESTING.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return match.start()
        elif token in "]}":
            depth -= 1
    return None


def read_json(path: str | os.PathLike, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value in the file ``path``, read as UTF-8.

    NaN and ±Infinity tokens are read as floats (files of older versions may hold them).
    Cost: one pass over the text to measure its nesting before parsing it.

    Raises
    ------
    ValueError
        one line naming ``path`` and what is wrong: not UTF-8 (the offset of the first bad
        byte), empty, nested deeper than ``max_depth``, not JSON (where, and whether the text
        ends in the middle of a value: a truncated file).
    OSError
        the file cannot be read (FileNotFoundError for a missing file).
    """
    where = os.fspath(path)
    with open(where, "rb") as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{where}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}), "
            "so not a JSON file spectra wrote"
        ) from None
    if not text.strip():
        raise ValueError(f"{where}: the file is empty, not JSON")
    deep = _nesting_too_deep(text, max_depth)
    if deep is not None:
        line = text.count("\n", 0, deep) + 1
        raise ValueError(
            f"{where}: JSON nested more than {max_depth} levels deep (line {line}), deeper "
            "than any file spectra writes"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        at = f"line {error.lineno} column {error.colno}"
        # A string without its closing quote runs to the end of the text.
        if error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string"):
            raise ValueError(
                f"{where}: not JSON: it ends in the middle of a value (started at {at}), so "
                "the file is cut short"
            ) from None
        raise ValueError(f"{where}: not JSON: {error.msg.removesuffix(' at')} at {at}") from None


# --------------------------------------------------------------------------- directories


def _describe_link(path: Path) -> str:
    """``'path' is a symbolic link (to 'target', which does not exist)``."""
    try:
        to = f" (to '{os.readlink(path)}'"
        to += ", which does not exist)" if not path.exists() else ")"
    except OSError:
        to = ""
    return f"'{path}' is a symbolic link{to}"


def prepare_directory(path: str | os.PathLike, what: str = "the output directory") -> Path:
    """Create the directory ``path`` if needed and prove that files can be written in it.

    ``path`` itself must not be a symbolic link (see the module docstring); its parents may be.

    Raises
    ------
    ValueError
        ``path`` is empty.
    UnsafeOutput
        ``path`` is a symbolic link (dangling or not).
    NotADirectoryError
        ``path`` (or a parent) is a file.
    PermissionError, OSError
        it cannot be created or written, with the reason.
    """
    if not str(path):
        raise ValueError(f"{what} is empty: give a directory (it is created if missing).")
    directory = Path(path)
    if directory.is_symlink():
        raise UnsafeOutput(
            f"{what} {_describe_link(directory)}; {_NO_LINKS}: give the directory itself."
        )
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"{what} '{directory}' is a file, not a directory; give a directory (it is created "
            "if missing)."
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:
        blocking = _blocking_ancestor(directory)
        part = f"'{blocking}' is a file" if blocking is not None else "a part of the path is a file"
        raise NotADirectoryError(f"cannot create {what} '{directory}': {part}.") from err
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


def check_outputs(directory: str | os.PathLike, names: Iterable[str]) -> None:
    """Refuse a directory where a name spectra writes (``names``, the lock and the manifest)
    is a symbolic link or anything but a regular file: files are written where the user
    said, nowhere else.

    Raises
    ------
    UnsafeOutput
        naming the first such entry.
    """
    directory = Path(directory)
    for name in dict.fromkeys([*names, _LOCK_NAME, MANIFEST_NAME]):
        path = directory / name
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode):
            raise UnsafeOutput(
                f"{_describe_link(path)} where spectra writes {name}; {_NO_LINKS}: remove the "
                "link or choose another --out."
            )
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise UnsafeOutput(
                f"'{path}' is {kind} where spectra writes {name}: move it away or choose "
                "another --out."
            )


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

        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        while True:
            try:
                handle = os.open(self.path, flags, 0o644)
            except OSError as err:
                if err.errno == errno.ELOOP:
                    raise UnsafeOutput(
                        f"the lock {_describe_link(self.path)}; {_NO_LINKS}: remove the link "
                        "or choose another --out."
                    ) from None
                if err.errno == errno.EISDIR:
                    raise UnsafeOutput(
                        f"the lock '{self.path}' is a directory: move it away or choose "
                        "another --out."
                    ) from None
                raise
            opened = os.fstat(handle)
            if stat.S_ISREG(opened.st_mode) and opened.st_nlink == 0:
                os.close(handle)  # removed by the holder before us since we opened it
                continue
            if not stat.S_ISREG(opened.st_mode) or opened.st_nlink != 1:
                os.close(handle)
                what = "has other hard links" if stat.S_ISREG(opened.st_mode) else "is not a file"
                raise UnsafeOutput(
                    f"the lock '{self.path}' {what}; {_NO_LINKS}: remove it or choose another "
                    "--out."
                )
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
                current = os.lstat(self.path)
            except FileNotFoundError:
                os.close(handle)
                continue
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


# --------------------------------------------------------------------------- one run per directory


def _plain_name(name: Any) -> bool:
    """A file name without a directory part (a manifest can list nothing else)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and os.sep not in name
        and "\0" not in name
    )


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest ``DIR/.spectra-manifest.json`` of the run that wrote ``directory``, or
    None when there is none.

    Raises
    ------
    OutputInUse
        the file is not a spectra manifest (or lists a name with a directory
        part: a manifest names files of its own directory only).
    """
    path = Path(directory) / MANIFEST_NAME
    if not os.path.lexists(path):
        return None
    check_outputs(directory, [])
    try:
        manifest = read_json(path)
        valid = (
            isinstance(manifest, dict)
            and manifest.get("format") == _MANIFEST_FORMAT
            and isinstance(manifest.get("files"), list)
            and all(_plain_name(name) for name in manifest["files"])
        )
    except (OSError, ValueError) as err:
        raise OutputInUse(
            f"'{path}' cannot be read as a spectra manifest ({err}); remove it or choose "
            "another --out."
        ) from err
    if not valid:
        raise OutputInUse(
            f"'{path}' is not a spectra manifest of the format {_MANIFEST_FORMAT!r}; remove it "
            "or choose another --out."
        )
    return manifest


def _listed_names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


class OutputClaim:
    """The files one run writes in its output directory, and its manifest.

    Made by :func:`claim_outputs` while the directory's lock is held. :meth:`attempt` writes
    one file and records a failure (a full disk) instead of raising, so that what fits is
    written; :meth:`finish` records what was written in the manifest and raises
    :class:`NotWritten` naming what was not.
    """

    def __init__(
        self, directory: Path, command: str, command_line: str | None, planned: Sequence[str]
    ) -> None:
        self.path = directory
        self.command = command
        self.command_line = command_line
        self.planned = list(dict.fromkeys(planned))
        self.written: list[str] = []
        self.not_written: dict[str, str] = {}
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def write_manifest(self, status: str, files: Sequence[str] | None = None) -> None:
        """Write the manifest with ``status``: ``files`` (default: ``planned`` while
        ``"running"``, else those written) and those this run could not write, with the
        reason."""
        if files is None:
            files = self.planned if status == "running" else self.written
        atomic_write_json(
            self.path / MANIFEST_NAME,
            {
                "format": _MANIFEST_FORMAT,
                "command": self.command,
                "command_line": self.command_line,
                "started": self.started,
                "status": status,
                "files": list(dict.fromkeys(files)),
                "not_written": dict(self.not_written),
            },
        )

    def attempt(self, name: str, write: Callable[[Path], Any]) -> bool:
        """Call ``write(DIR/name)``; an ``OSError`` is recorded (see :meth:`finish`), not
        raised. Returns whether the file was written."""
        try:
            write(self.path / name)
        except OSError as err:
            key = name if name not in self.written else f"{name} (its update)"
            self.not_written[key] = os.strerror(err.errno) if err.errno else str(err).rstrip(".")
            return False
        if name not in self.written:
            self.written.append(name)
        self.not_written.pop(name, None)
        return True

    def finish(self) -> None:
        """Record the files written in the manifest.

        Raises
        ------
        NotWritten
            some files (or the manifest) could not be written; the message
            names them with the reason, and those that were written.
        """
        manifest_error = None
        try:
            self.write_manifest("done" if not self.not_written else "incomplete")
        except OSError as err:
            manifest_error = os.strerror(err.errno) if err.errno else str(err).rstrip(".")
        if not self.not_written and manifest_error is None:
            return
        reasons: dict[str, list[str]] = {}
        for name, reason in self.not_written.items():
            reasons.setdefault(reason, []).append(name)
        if manifest_error is not None:
            reasons.setdefault(manifest_error, []).append(MANIFEST_NAME)
        missing = "; ".join(f"{_listed_names(names)} ({why})" for why, names in reasons.items())
        kept = f"; written: {_listed_names(self.written)}" if self.written else ""
        raise NotWritten(f"not written in '{self.path}': {missing}{kept}.")


def claim_outputs(
    directory: str | os.PathLike,
    command: str,
    outputs: Sequence[str],
    *,
    restart: bool = False,
    command_line: str | None = None,
    resumes: Callable[[dict[str, Any]], bool] | None = None,
    adopt: Sequence[str] = (),
) -> tuple[OutputClaim, dict[str, Any] | None]:
    """Claim ``directory`` (created and locked by the caller) for a run of ``command`` that
    writes the files ``outputs``, and record them in its manifest before anything is written.

    * A name of ``outputs`` (or the lock, or the manifest) that is a link or not a regular
      file is refused (:func:`check_outputs`).
    * Files listed by the manifest of a previous run that still exist are that run's: refused,
      unless ``resumes(manifest)`` says this run continues that one (``spectra sharpness``),
      or ``restart``, which removes exactly them (and nothing else) first. The same command
      line again (``make run`` twice) is a rerun of that run: it restarts it.
    * Files no manifest lists at the names in ``outputs`` (another program's, or a run of a
      spectra without manifests) are refused, ``restart`` or not: they are not spectra's to
      remove. Other files in the directory are left alone.
    * ``adopt``: without a manifest, these files count as a previous run this one continues
      (the record of a run by a spectra that wrote no manifest, recognised by the caller).

    Returns the claim and the previous manifest (None if there was none).

    Raises
    ------
    UnsafeOutput, OutputInUse
        as above, in one line naming the files and what to do.
    """
    directory = Path(directory)
    check_outputs(directory, outputs)
    manifest = read_manifest(directory)
    previous = (
        []
        if manifest is None
        else [name for name in manifest["files"] if os.path.lexists(directory / name)]
    )
    own = manifest is not None and resumes is not None and resumes(manifest)
    rerun = (
        manifest is not None
        and command_line is not None
        and manifest.get("command_line") == command_line
    )
    restart = restart or (rerun and not own)
    if manifest is None and adopt:
        previous = [name for name in adopt if os.path.lexists(directory / name)]
        own = True
    # Files not this run's own are those a previous manifest lists (an adopted run is own).
    if manifest is not None and previous and not own and not restart:
        what = manifest.get("command_line") or manifest.get("command") or "another run"
        raise OutputInUse(
            f"'{directory}' holds the files of another spectra run ({what}): "
            f"{_listed_names(previous)}; choose another --out, or give --restart to remove "
            "them first."
        )
    unknown = [
        name for name in outputs if os.path.lexists(directory / name) and name not in previous
    ]
    if unknown:
        raise OutputInUse(
            f"'{directory}' holds {_listed_names(unknown)}, which this run writes and no spectra "
            f"manifest there lists (another program's files, or an older spectra's); move them "
            "away or choose another --out."
        )
    if restart:
        handle = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for name in previous:
                with contextlib.suppress(FileNotFoundError):
                    if not stat.S_ISDIR(os.lstat(name, dir_fd=handle).st_mode):
                        os.unlink(name, dir_fd=handle)
        finally:
            os.close(handle)
        previous = []
    kept = previous if own else []
    claim = OutputClaim(directory, command, command_line, [*kept, *outputs])
    claim.write_manifest("running")
    return claim, manifest
