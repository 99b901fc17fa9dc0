"""Every notebook in notebooks/ runs from top to bottom without errors, and checks its own
numbers: each has assertion cells (against eigsh, exact traces or the independent float64
sharpness of data/gd_trajectory), so that an executed notebook is a verified one."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors
    # Committed notebooks show their outputs.
    committed = nbformat.read(path, as_version=4)
    code_cells = [c for c in committed.cells if c.cell_type == "code"]
    assert any(c.get("outputs") for c in code_cells), f"{path.name} was committed without outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_asserts_its_numbers(path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(path, as_version=4)
    checks = [c for c in notebook.cells if c.cell_type == "code" and "\nassert " in "\n" + c.source]
    assert checks, f"{path.name} asserts none of its numbers"


def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 3, f"expected the three example notebooks in {NOTEBOOK_DIR}"
