"""TensorBoard event files of sharpness measurements (the callback's and ``spectra sharpness``'s).

The values go into ``<log_dir>/spectra/``, a run beside the ``train/`` and ``validation/`` runs
that Keras' ``keras.callbacks.TensorBoard(log_dir)`` writes, so one ``tensorboard --logdir
<log_dir>`` shows the sharpness next to the training curves. Each measurement becomes a set of
scalar summaries at its step (float32, as ``tf.summary.scalar`` writes them), tagged
``sharpness/lambda_1`` … ``sharpness/lambda_k``, ``sharpness/error_bound_1`` …,
``sharpness/threshold`` (the optimizer's stability threshold, only when it bounds the measured
matrix), ``sharpness/trace``, ``sharpness/trace_stderr``, ``sharpness/loss``,
``sharpness/eigenvector_overlap`` and ``sharpness/gradient_overlap`` (each when measured); the
preconditioned sharpness λ(P⁻¹H) uses the prefix ``preconditioned_sharpness/``.

The summaries are written with ``tf.summary.write`` and the metadata of TensorBoard's scalar
plugin, so the ``tensorboard`` package is not needed to write them (only to view them).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from spectra.io.files import prepare_directory

__all__ = [
    "RUN_NAME",
    "SharpnessEvents",
    "check_log_dir",
    "sharpness_scalars",
]

#: The run (subdirectory of the log directory) that spectra writes.
RUN_NAME = "spectra"
_EVENT_PREFIX = "events.out.tfevents."


def check_log_dir(log_dir: Any, what: str = "log_dir") -> Path:
    """``log_dir`` as a Path, refused when it cannot be a directory (nothing is created).

    Raises
    ------
    TypeError
        ``log_dir`` is not a ``str`` or ``os.PathLike``.
    ValueError
        it is empty, or it, its ``spectra/`` run or a parent is a file.
    """
    if not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(
            f"{what} must be a directory path (str or os.PathLike), got {type(log_dir).__name__}"
        )
    path = Path(log_dir)
    if not str(log_dir):
        raise ValueError(f"{what} is empty: give a directory (it is created if missing).")
    # The run directory, then the log directory and its parents: the first that exists must
    # be a directory.
    for candidate in (path / RUN_NAME, path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            if not candidate.is_dir():
                kind = "a file, not a directory" if candidate.is_file() else "not a directory"
                raise ValueError(
                    f"{what} '{path}': '{candidate}' is {kind}: give the TensorBoard log "
                    "directory (it is created if missing)."
                )
            break
    return path


def sharpness_scalars(
    record: Mapping[str, Any], *, preconditioned: bool = False
) -> dict[str, float]:
    """The scalars of one sharpness measurement (a callback record or a ``sharpness.json``
    entry), by tag; values that were not measured (None) are left out, NaN is kept.

    The threshold is included only when the record's ``threshold_matrix`` is the measured
    matrix (``"preconditioned"`` with ``preconditioned=True``, else ``"hessian"``); a record
    without ``threshold_matrix`` (a ``sharpness.json`` entry) has no threshold here.
    """
    prefix = "preconditioned_sharpness" if preconditioned else "sharpness"
    scalars: dict[str, Any] = {}
    for i, value in enumerate(record.get("eigenvalues") or [], start=1):
        scalars[f"lambda_{i}"] = value
    for i, value in enumerate(record.get("error_bounds") or [], start=1):
        scalars[f"error_bound_{i}"] = value
    measured = "preconditioned" if preconditioned else "hessian"
    if record.get("threshold") is not None and record.get("threshold_matrix") == measured:
        scalars["threshold"] = record["threshold"]
    for name in ("trace", "trace_stderr", "loss", "eigenvector_overlap", "gradient_overlap"):
        scalars[name] = record.get(name)
    return {
        f"{prefix}/{name}": float(value) for name, value in scalars.items() if value is not None
    }


def _scalar_metadata() -> Any:
    from tensorflow.core.framework import summary_pb2

    metadata = summary_pb2.SummaryMetadata()
    metadata.plugin_data.plugin_name = "scalars"
    return metadata


class SharpnessEvents:
    """Scalar summaries of sharpness measurements in ``<log_dir>/spectra/``.

    The TensorFlow writer is created at the first :meth:`write` (the directory too), each
    :meth:`write` is flushed to disk, and :meth:`close` closes the file (a later write opens a
    new one). :meth:`rewrite` replaces every event file this writer's ``suffix`` marks with one
    holding the given steps, so a resumed run leaves exactly one value per step and tag.
    Cost: one small file write per measurement.

    Parameters
    ----------
    log_dir:
        The TensorBoard log directory (``keras.callbacks.TensorBoard``'s ``log_dir``).
    suffix:
        The end of the event files' names, which marks the files :meth:`rewrite` replaces.
    """

    def __init__(self, log_dir: str | os.PathLike, suffix: str = ".spectra") -> None:
        self.log_dir = check_log_dir(log_dir)
        self.run_dir = self.log_dir / RUN_NAME
        self.suffix = suffix
        self._writer: Any = None

    def prepare(self) -> None:
        """Create the run directory and check that it can be written (before any measurement)."""
        prepare_directory(self.run_dir, "the TensorBoard run directory")

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """Write ``scalars`` (tag → value) at ``step`` and flush."""
        if self._writer is None:
            self.prepare()
            self._writer = _file_writer(self.run_dir, self.suffix)
        _write_scalars(self._writer, step, scalars)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def event_files(self) -> list[Path]:
        """This writer's event files in the run directory (those its suffix marks), by name."""
        if not self.run_dir.is_dir():
            return []
        return sorted(
            path
            for path in self.run_dir.iterdir()
            if path.name.startswith(_EVENT_PREFIX)
            and path.name.endswith(self.suffix)
            and path.is_file()
        )

    def rewrite(self, steps: Iterable[tuple[int, Mapping[str, float]]]) -> Path:
        """Replace this writer's event files by one holding ``steps`` (``(step, scalars)``
        pairs, written in the order given): written in a temporary directory, moved into
        the run directory, then the older files are removed. Returns the new file."""
        self.close()
        self.prepare()
        older = self.event_files()
        temporary = Path(tempfile.mkdtemp(dir=self.run_dir, prefix=".spectra-events."))
        try:
            writer = _file_writer(temporary, self.suffix)
            try:
                for step, scalars in steps:
                    _write_scalars(writer, step, scalars)
            finally:
                writer.close()
            (written,) = list(temporary.iterdir())
            target = self.run_dir / written.name
            os.replace(written, target)
        finally:
            for leftover in temporary.iterdir():
                leftover.unlink()
            temporary.rmdir()
        for path in older:
            if path != target:
                path.unlink(missing_ok=True)
        return target


def _file_writer(directory: Path, suffix: str) -> Any:
    import tensorflow as tf

    return tf.summary.create_file_writer(str(directory), filename_suffix=suffix)


def _write_scalars(writer: Any, step: int, scalars: Mapping[str, float]) -> None:
    import tensorflow as tf

    metadata = _scalar_metadata()
    with writer.as_default():
        for tag, value in scalars.items():
            tensor = tf.constant(float(value), tf.float32)
            tf.summary.write(tag, tensor, step=int(step), metadata=metadata)
