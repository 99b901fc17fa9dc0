"""The README's quickstart runs as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_runs(monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(compile(code, "README.md quickstart", "exec"), namespace)
    top, tr = namespace["top"], namespace["tr"]
    assert top.all_converged and len(top.eigenvalues) == 5
    assert tr.stderr > 0 and abs(tr.estimate) > 0
    assert "±" in capsys.readouterr().out
    assert os.path.exists(ROOT / "data" / "digits_mlp.keras")
