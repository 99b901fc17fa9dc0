"""Directives of the spectra docs.

``.. spectra-help:: [COMMAND]`` inserts what ``spectra [COMMAND] --help`` prints, run in a
subprocess of this Python so that the reference is the parser's own text.
``.. spectra-exports::`` lists the public names of ``spectra`` (``spectra._EXPORTS``), each
linked to where it is documented.

Docstring markup. A docstring written as plain text that reStructuredText reads
differently (``|λ|`` as a substitution, an indented continuation line as a block quote)
gets a docutils message, and every such message fails ``make docs`` like any other
warning, except in the files of ``EXEMPT_DOCSTRING_FILES`` (files still being rewritten):
their messages are listed in ``DOCSTRING_REPORT`` in the output directory and counted in
one line at the end of the build. ``SPECTRA_DOCS_STRICT_DOCSTRINGS=1`` exempts nothing (to
fix them). Once those files are fixed the list is emptied.
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
# Files (relative to the repository) whose docstring markup problems do not fail the build
# yet: they are being rewritten. Every other file's docstrings must render cleanly.
EXEMPT_DOCSTRING_FILES = frozenset(
    {
        "spectra/callback.py",
        "spectra/io/checkpoints.py",
        "spectra/io/datasets.py",
    }
)
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


def _docstring_file(location: str) -> str | None:
    """The repository-relative file of a docstring message's location, else None.

    Sphinx locates a docstring as ``"<file>:docstring of <object>[:<line>]"``.
    """
    path, marker, _ = location.partition(":docstring of ")
    if not marker:
        return None
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path


class _DocstringMarkup(logging.Filter):
    """Keeps docutils' messages about the docstrings of ``exempt`` files out of the build's
    warnings, recording them; every other message passes (and fails a ``-W`` build)."""

    def __init__(self, exempt: frozenset[str] = EXEMPT_DOCSTRING_FILES) -> None:
        super().__init__()
        self.exempt = exempt
        self.messages: list[str] = []
        self.files: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        location = str(getattr(record, "location", "") or "")
        file = _docstring_file(location)
        if record.levelno >= logging.WARNING and file in self.exempt:
            self.messages.append(f"{location}: {record.getMessage()}")
            self.files.add(file)
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
            f"spectra docs: {len(messages)} docstring markup problems in files still exempted "
            f"(EXEMPT_DOCSTRING_FILES in docs/_ext/spectra_docs.py), not counted as warnings "
            f"(listed in {Path(app.outdir, DOCSTRING_REPORT)}; {STRICT_VARIABLE}=1 counts them)"
        )
    fixed = sorted(markup.exempt - markup.files)
    if fixed:
        print(
            f"spectra docs: no docstring markup problem left in {', '.join(fixed)}: remove "
            "them from EXEMPT_DOCSTRING_FILES in docs/_ext/spectra_docs.py"
        )


def _install_filter(app) -> None:  # type: ignore[no-untyped-def]
    _MARKUP.messages.clear()
    _MARKUP.files.clear()
    logging.getLogger(_DOCUTILS_LOGGER).addFilter(_MARKUP)


def setup(app):  # type: ignore[no-untyped-def]
    app.add_directive("spectra-help", SpectraHelp)
    app.add_directive("spectra-exports", SpectraExports)
    if os.environ.get(STRICT_VARIABLE, "") != "1":
        app.connect("builder-inited", _install_filter)
        app.connect("build-finished", _report_docstrings)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
