"""The documentation site builds without a warning, and it shows what it says it shows.

``make docs`` runs Sphinx with warnings as errors; this runs the same build into a
temporary directory (about 10-20 s: autodoc imports TensorFlow). It needs the ``[docs]``
extra, which ``make test`` installs; without it the build test is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOCS_PACKAGES = ("sphinx", "myst_parser", "myst_nb", "furo", "latex2mathml")


def test_every_notebook_is_in_the_gallery():
    notebooks = sorted(path.name for path in (ROOT / "notebooks").glob("*.ipynb"))
    gallery = sorted(path.name for path in (DOCS / "gallery").glob("*.ipynb"))
    assert notebooks and gallery == notebooks
    for name in gallery:
        link = DOCS / "gallery" / name
        # Links, not copies: the gallery shows the notebooks the suite executes.
        assert link.is_symlink() and link.resolve() == (ROOT / "notebooks" / name).resolve()
    toctree = (DOCS / "gallery" / "index.md").read_text()
    assert all(Path(name).stem in toctree for name in notebooks)


def test_every_page_is_in_the_table_of_contents():
    index = (DOCS / "index.md").read_text()
    pages = [path.relative_to(DOCS).with_suffix("").as_posix() for path in DOCS.rglob("*.md")]
    missing = [page for page in pages if page != "index" and f"\n{page}\n" not in index]
    assert not missing, missing


@pytest.mark.slow
def test_the_site_builds_without_warnings(tmp_path):
    missing = [name for name in DOCS_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(
            f"the [docs] extra is not installed (missing {', '.join(missing)}): "
            "pip install -e '.[docs]' (make test installs it)"
        )
    out = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "WARNING" not in done.stderr and "ERROR" not in done.stderr, done.stderr[-4000:]
    # The pages it promises: an API page with the estimators' docstrings, the CLI's help,
    # a notebook with its figures, the benchmarks.
    estimators = (out / "reference" / "estimators.html").read_text()
    assert 'id="spectra.estimators.eigensolvers.eigenvalues"' in estimators
    assert "spectra analyze" in (out / "reference" / "cli.html").read_text()
    assert "--top-k" in (out / "reference" / "cli.html").read_text()
    quickstart = (out / "gallery" / "01_quickstart.html").read_text()
    assert "<img" in quickstart
    assert "1 process × 2 threads" in (out / "benchmarks.html").read_text()
    # Math is MathML in the page, shown offline: no MathJax script (from a CDN), no LaTeX.
    assert "<math" in quickstart and "\\lVert" not in quickstart
    assert not re.search(r"<script[^>]*mathjax", quickstart, re.I)
    # The landing page shows the quickstart itself; the API index links every public name.
    landing = (out / "index.html").read_text()
    assert "digits_mlp.keras" in landing and "prints:" in landing
    api = (out / "reference" / "index.html").read_text()
    for name in ("HessianOperator", "GGNOperator", "FisherOperator"):
        assert f'href="operators.html#spectra.operators.{name[:-8].lower()}.{name}"' in api


def _documented_functions():
    """(qualified name, object whose docstring is read, its signature) of every function,
    method and class defined in a spectra module (a class: its ``__init__``'s signature)."""
    import importlib
    import importlib.util
    import inspect
    import pkgutil

    import spectra

    names = [m.name for m in pkgutil.walk_packages(spectra.__path__, "spectra.")]
    jax_missing = importlib.util.find_spec("jax") is None
    for module_name in ["spectra", *(n for n in names if not n.endswith("__main__"))]:
        if jax_missing and module_name.startswith(("spectra._jax_compat", "spectra.operators.jax")):
            continue  # the JAX engine imports JAX, which this environment does not have
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module_name:
                continue
            if inspect.isfunction(obj):
                yield f"{module_name}.{name}", obj, inspect.signature(obj)
            elif inspect.isclass(obj):
                yield f"{module_name}.{name}", obj, inspect.signature(obj.__init__)
                for method_name, method in vars(obj).items():
                    if inspect.isfunction(method):
                        qualified = f"{module_name}.{name}.{method_name}"
                        yield qualified, method, inspect.signature(method)


def test_parameter_sections_name_only_parameters():
    # A NumPy-style Parameters section runs to the next section header: prose after it
    # without one ("Cost: ...") is read as more parameters, and "name : text" makes the
    # text a type. Napoleon's reading must name parameters of the signature only.
    import inspect

    napoleon = pytest.importorskip("sphinx.ext.napoleon", reason="the [docs] extra is missing")
    from sphinx.ext.napoleon.docstring import NumpyDocstring

    config = napoleon.Config(napoleon_google_docstring=False, napoleon_numpy_docstring=True)
    wrong = []
    for qualified, obj, signature in _documented_functions():
        doc = inspect.getdoc(obj)
        if not doc or "\n----------" not in doc:
            continue
        lines = NumpyDocstring(doc, config, what="function").lines()
        documented = [m.group(1) for m in map(re.compile(r":param (.*?):").match, lines) if m]
        unknown = [
            name
            for entry in documented
            for name in entry.split(", ")
            if name.lstrip("*") not in signature.parameters
        ]
        if unknown:
            wrong.append(f"{qualified}: {unknown[:3]}")
    assert not wrong, wrong
