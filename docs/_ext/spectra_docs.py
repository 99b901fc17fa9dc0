"""Directives of the spectra docs.

``.. spectra-help:: [COMMAND]`` inserts what ``spectra [COMMAND] --help`` prints, run in a
subprocess of this Python so that the reference is the parser's own text.
``.. spectra-exports::`` lists the public names of ``spectra`` (``spectra._EXPORTS``), each
linked to where it is documented.

Docstring markup. Some docstrings are written as plain text that reStructuredText reads
differently (``|λ|`` as a substitution, an indented continuation line as a block quote).
Their docutils messages are not counted as build warnings: they are listed in
``DOCSTRING_REPORT`` in the output directory and counted in one line at the end of the
build. ``SPECTRA_DOCS_STRICT_DOCSTRINGS=1`` counts them as warnings (to fix them). Every
other warning, in the pages, the notebooks or the references, fails ``make docs``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList

ROOT = Path(__file__).resolve().parents[2]
DOCSTRING_REPORT = "docstring-markup.txt"
STRICT_VARIABLE = "SPECTRA_DOCS_STRICT_DOCSTRINGS"
# The logger through which Sphinx reports docutils' messages (sphinx.util.docutils).
_DOCUTILS_LOGGER = "sphinx.sphinx.util.docutils"
# Help text wrapped at a fixed width, whatever the terminal of the build.
HELP_COLUMNS = "88"


class SpectraHelp(Directive):
    optional_arguments = 1

    def run(self) -> list[nodes.Node]:
        command = [sys.executable, "-m", "spectra", *self.arguments, "--help"]
        env = {**os.environ, "COLUMNS": HELP_COLUMNS, "TF_CPP_MIN_LOG_LEVEL": "3"}
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise self.error(
                f"spectra-help: {' '.join(command[2:])} exited with {done.returncode}: "
                f"{done.stderr.strip().splitlines()[-1:]}"
            )
        block = nodes.literal_block(done.stdout, done.stdout)
        block["language"] = "text"
        return [block]


class SpectraExports(Directive):
    def run(self) -> list[nodes.Node]:
        import spectra

        lines = [".. list-table::", "   :header-rows: 1", "", "   * - name", "     - module"]
        for module, names in sorted(spectra._EXPORTS.items()):
            for name in sorted(names):
                role = "class" if name[:1].isupper() else "func"
                lines += [
                    f"   * - :{role}:`spectra.{name} <{module}.{name}>`",
                    f"     - ``{module}``",
                ]
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="spectra-exports"), 0, container)
        return container.children


class _DocstringMarkup(logging.Filter):
    """Keeps docutils' messages about docstrings out of the build's warnings, recording them."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        location = str(getattr(record, "location", "") or "")
        if record.levelno >= logging.WARNING and "docstring of " in location:
            self.messages.append(f"{location}: {record.getMessage()}")
            return False
        return True


_MARKUP = _DocstringMarkup()


def _report_docstrings(app, exception) -> None:  # type: ignore[no-untyped-def]
    markup = _MARKUP
    logging.getLogger(_DOCUTILS_LOGGER).removeFilter(markup)
    if exception is not None:
        return
    messages = sorted(set(markup.messages))
    Path(app.outdir, DOCSTRING_REPORT).write_text("".join(f"{m}\n" for m in messages))
    if messages:
        print(
            f"spectra docs: {len(messages)} docstring markup problems, not counted as warnings "
            f"(listed in {Path(app.outdir, DOCSTRING_REPORT)}; {STRICT_VARIABLE}=1 counts them)"
        )


def _install_filter(app) -> None:  # type: ignore[no-untyped-def]
    _MARKUP.messages.clear()
    logging.getLogger(_DOCUTILS_LOGGER).addFilter(_MARKUP)


def setup(app):  # type: ignore[no-untyped-def]
    app.add_directive("spectra-help", SpectraHelp)
    app.add_directive("spectra-exports", SpectraExports)
    if os.environ.get(STRICT_VARIABLE, "") != "1":
        app.connect("builder-inited", _install_filter)
        app.connect("build-finished", _report_docstrings)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
