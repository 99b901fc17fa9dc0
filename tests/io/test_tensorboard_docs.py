"""The snippet of docs/guide/tensorboard.md that reads the values back runs and returns what
was written (float32 tensor summaries, read with EventAccumulator.Tensors)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest

from spectra.io.tensorboard import SharpnessEvents

DOC = Path(__file__).resolve().parents[2] / "docs" / "guide" / "tensorboard.md"


def _snippet() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Reading the values back", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match is not None, "no Python block under 'Reading the values back'"
    return match.group(1)


def test_the_documented_snippet_reads_the_values_back(tmp_path, monkeypatch) -> None:
    pytest.importorskip("tensorboard")
    written = {0: 1.25, 20: 3.5, 40: 9.875}
    events = SharpnessEvents(tmp_path / "out" / "logs" / "run1")
    for step, value in written.items():
        events.write(step, {"sharpness/lambda_1": value, "sharpness/error_bound_1": 1e-6})
    events.close()
    monkeypatch.chdir(tmp_path)  # the snippet's relative "out/logs/run1/spectra"
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_snippet(), str(DOC), "exec"), namespace)
    # The snippet rounds to 3 decimals; these values are exact in float32 at 3 decimals.
    assert namespace["lambda_1"] == [(step, float(np.float32(v))) for step, v in written.items()]
    assert "sharpness/lambda_1" in printed.getvalue()
    assert "sharpness/error_bound_1" in printed.getvalue()
