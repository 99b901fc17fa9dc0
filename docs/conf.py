"""Sphinx configuration of the spectra documentation (make docs: warnings are errors).

Pages are Markdown (MyST); the API reference is generated from the docstrings (autodoc,
NumPy-style sections through napoleon); the CLI reference from ``spectra <command> --help``
(docs/_ext/spectra_docs.py); the gallery shows the notebooks of notebooks/ as they were
executed (myst-nb, not re-executed). Math is written as MathML when the site is built
(docs/_ext/spectra_math.py), so the pages need no script and no network to show it.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))

import spectra  # noqa: E402

# autodoc imports TensorFlow: without its C++ start-up log lines.
spectra.quiet_tensorflow()

project = "spectra"
author = "the spectra authors"
copyright = "2026, the spectra authors"
release = spectra.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_nb",
    "spectra_docs",
    "spectra_math",
]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "_ext", "**/.ipynb_checkpoints"]

myst_enable_extensions = ["dollarmath", "deflist"]
myst_heading_anchors = 3
# The notebooks are stored executed (the test suite runs them); the site shows them as they are.
nb_execution_mode = "off"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = False
napoleon_numpy_docstring = True

# MathML written at build time (latex2mathml), shown by the browser itself: offline too.
html_math_renderer = "mathml"

html_theme = "furo"
html_title = f"spectra {release}"
