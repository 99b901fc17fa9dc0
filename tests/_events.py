"""TensorBoard event files read back with TensorFlow's own record reader and ``Event`` proto
(the ``tensorboard`` package, when installed, gives the same through ``EventAccumulator``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf


def event_files(run_dir: Path) -> list[Path]:
    return sorted(path for path in Path(run_dir).iterdir() if "tfevents" in path.name)


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, np.float32]]]:
    """Every scalar summary in the run directory's event files: tag -> [(step, value)], in
    the order written (files by name); each must carry the scalar plugin's metadata."""
    scalars: dict[str, list[tuple[int, np.float32]]] = {}
    for path in event_files(run_dir):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars", value.tag
                array = tf.make_ndarray(value.tensor)
                assert array.shape == () and array.dtype == np.float32, value.tag
                scalars.setdefault(value.tag, []).append((int(event.step), array[()]))
    return scalars


def expected_scalars(records, steps, prefix="sharpness", threshold=None):
    """What the event files must hold for these records (callback records or
    sharpness.json entries) at these steps: the values rounded to float32."""
    expected: dict[str, list[tuple[int, np.float32]]] = {}

    def add(tag, step, value):
        if value is not None:
            expected.setdefault(f"{prefix}/{tag}", []).append((step, np.float32(value)))

    for record, step in zip(records, steps, strict=True):
        for i, value in enumerate(record["eigenvalues"], start=1):
            add(f"lambda_{i}", step, value)
        for i, value in enumerate(record["error_bounds"], start=1):
            add(f"error_bound_{i}", step, value)
        add("threshold", step, threshold(record) if threshold else None)
        for name in ("trace", "trace_stderr", "loss", "eigenvector_overlap", "gradient_overlap"):
            add(name, step, record.get(name))
        if record.get("minibatch") is not None:
            for name in ("mean", "std", "q05", "q25", "q50", "q75", "q95"):
                add(f"minibatch_lambda_1_{name}", step, record["minibatch"]["summary"][name])
    return expected
