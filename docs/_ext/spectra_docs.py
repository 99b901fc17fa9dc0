"""Directives of the spectra docs.

``.. spectra-help:: [COMMAND]`` inserts what ``spectra [COMMAND] --help`` prints, run in a
subprocess of this Python so that the reference is the parser's own text.
``.. spectra-exports::`` lists the public names of ``spectra`` (``spectra._EXPORTS``), each
linked to where it is documented.

Docstring markup problems (``|λ|`` read as a substitution, an indented continuation line
read as a block quote) are warnings like any other: they fail ``make docs``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList

ROOT = Path(__file__).resolve().parents[2]
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
                # Link to where the object is defined and documented (a package such as
                # spectra.operators only re-exports its operator classes).
                defined = getattr(getattr(spectra, name), "__module__", module) or module
                lines += [
                    f"   * - :{role}:`spectra.{name} <{defined}.{name}>`",
                    f"     - ``{module}``",
                ]
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="spectra-exports"), 0, container)
        return container.children


def setup(app):  # type: ignore[no-untyped-def]
    app.add_directive("spectra-help", SpectraHelp)
    app.add_directive("spectra-exports", SpectraExports)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
