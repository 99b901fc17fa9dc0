"""Every notebook in notebooks/ runs from top to bottom without errors, and checks its own
numbers: each has assertion cells (against eigsh, exact traces or the independent float64
sharpness of data/gd_trajectory), so that an executed notebook is a verified one.

Each notebook runs in a fresh kernel that imports this checkout's spectra (PYTHONPATH), not
whichever is installed. The selected notebooks run in parallel kernels, two on a machine of two
or more cores (SPECTRA_NOTEBOOK_WORKERS overrides), the longest first, each kernel's TensorFlow
and BLAS limited to its share of the cores so that the kernels do not fight over them: on two
cores that halves the wall time against one kernel after the other. Under pytest-xdist each
worker process runs the notebooks of its own tests, one kernel each."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# The two that take longest (about 40 s and 20 s of the 100 s of all five on one kernel).
LONGEST_FIRST = ("04_hessian_vs_gauss_newton", "02_trained_classifier_spectrum")


def _workers() -> int:
    setting = os.environ.get("SPECTRA_NOTEBOOK_WORKERS")
    if setting is not None:
        if not setting.isdigit() or int(setting) < 1:
            raise ValueError(
                f"SPECTRA_NOTEBOOK_WORKERS: expected a positive integer, got {setting!r}"
            )
        return int(setting)
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def _kernel_env(workers: int) -> dict[str, str]:
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "MPLBACKEND": "Agg",
        "TF_NUM_INTRAOP_THREADS": threads,
        "TF_NUM_INTEROP_THREADS": threads,
        "OMP_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
    }


def _execute(path: Path, env: dict[str, str]) -> dict:
    """The notebook at ``path`` executed in a fresh kernel: the notebook, the exception that
    stopped it (None when it ran through) and its wall time in seconds."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    started, error = time.monotonic(), None
    try:
        # A loop of its own, closed when done (the thread's default one would be left open).
        asyncio.run(client.async_execute(env=env))
    except Exception as exc:  # reported by the notebook's own test, not by the others'
        error = exc
    return {"notebook": notebook, "error": error, "seconds": time.monotonic() - started}


@pytest.fixture(scope="module")
def executed(request: pytest.FixtureRequest):
    """path -> the notebook executed (see _execute). Without pytest-xdist, the notebooks
    whose execution test is selected run first, in parallel kernels; under pytest-xdist, which
    spreads the tests over processes itself, each runs its own notebook in one kernel."""
    pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    results: dict[str, dict] = {}
    if "PYTEST_XDIST_WORKER" in os.environ:
        env = _kernel_env(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    else:
        selected = {
            item.callspec.params["path"]
            for item in request.session.items
            if item.originalname == "test_notebook_executes"
        }
        # The longest first, so that no long one starts last.
        rank = {stem: i for i, stem in enumerate(LONGEST_FIRST)}
        paths = sorted(selected, key=lambda path: (rank.get(path.stem, len(rank)), path.name))
        workers = min(_workers(), len(paths)) or 1
        env = _kernel_env(workers)
        with ThreadPoolExecutor(workers) as pool:
            for path, result in zip(paths, pool.map(lambda path: _execute(path, env), paths)):
                results[path.name] = result

    def get(path: Path) -> dict:
        if path.name not in results:
            results[path.name] = _execute(path, env)
        return results[path.name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, executed, record_property) -> None:
    import nbformat

    result = executed(path)
    record_property("seconds", round(result["seconds"], 1))
    if result["error"] is not None:
        raise result["error"]
    errors = [
        output
        for cell in result["notebook"].cells
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
    assert len(NOTEBOOKS) >= 5, f"expected the five example notebooks (01 to 05) in {NOTEBOOK_DIR}"
