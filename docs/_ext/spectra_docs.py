"""Directives of the spectra docs.

``.. spectra-help:: [COMMAND]`` inserts what ``spectra [COMMAND] --help`` prints, run in a
subprocess of this Python so that the reference is the parser's own text.
``.. spectra-exports::`` lists the public names of ``spectra`` (``spectra._EXPORTS``), each
linked to where it is documented.
``.. spectra-signatures::`` (one name a line, as users call it: ``spectra.eigenvalues``,
``spectra.HessianOperator.from_keras``) shows each name's signature, read from the code, and
the first paragraph of its docstring, linked to its full entry: the top of a reference page.
A link of these two directives that resolves to no documented object is a warning (so the
build fails): every public name must be documented on some page.

Docstring markup problems (``|λ|`` read as a substitution, an indented continuation line
read as a block quote) are warnings like any other: they fail ``make docs``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.util import logging

logger = logging.getLogger(__name__)

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
        return _parse_checked(self, lines, "spectra-exports")


def _parse_checked(
    directive: Directive, lines: list[str], source: str, targets: set[str] | None = None
) -> list[nodes.Node]:
    """``lines`` (reST) parsed, with their cross-references to ``targets`` (default: all)
    marked to be checked."""
    container = nodes.container()
    directive.state.nested_parse(StringList(lines, source=source), 0, container)
    for reference in container.findall(addnodes.pending_xref):
        if targets is None or reference.get("reftarget") in targets:
            reference["spectra_checked"] = source
    return container.children


def _resolve(dotted: str) -> Any:
    """The object a dotted name such as ``spectra.HessianOperator.from_keras`` names."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ValueError(f"no module in {dotted!r}")


class SpectraSignatures(Directive):
    has_content = True

    def run(self) -> list[nodes.Node]:
        lines: list[str] = []
        targets: set[str] = set()
        for name in filter(None, (line.strip() for line in self.content)):
            try:
                obj = _resolve(name)
            except (ValueError, AttributeError) as error:
                raise self.error(f"spectra-signatures: {name}: {error}") from error
            # The full entry is where the object is defined (an inherited classmethod: its
            # defining class); the signature is the one users call (self, cls dropped).
            target = f"{obj.__module__}.{obj.__qualname__}"
            targets.add(target)
            if inspect.isclass(obj):
                directive, options, role = "py:class", [], "py:class"
            elif inspect.ismethod(obj) and inspect.isclass(obj.__self__):
                directive, options, role = "py:method", ["   :classmethod:"], "py:meth"
            else:
                directive, options, role = "py:function", [], "py:func"
            signature = _without_annotations(obj)
            summary = " ".join((inspect.getdoc(obj) or "").split("\n\n")[0].split())
            lines += [
                f".. {directive}:: {name}{signature}",
                *options,
                "   :no-index:",
                "",
                f"   {summary} (:{role}:`reference <{target}>`)",
                "",
            ]
        return _parse_checked(self, lines, "spectra-signatures", targets)


def _without_annotations(obj: Any) -> str:
    """The signature as called: parameters and defaults, no type annotations."""
    parameters = [
        parameter.replace(annotation=inspect.Parameter.empty)
        for parameter in inspect.signature(obj).parameters.values()
    ]
    return str(inspect.Signature(parameters))


def _unresolved(app, env, node, contnode):  # type: ignore[no-untyped-def]
    """Warn about a link of the exports table or a signatures block that resolves nowhere."""
    if node.get("spectra_checked"):
        logger.warning(
            "%s: %s is documented on no page (add it to a reference page)",
            node["spectra_checked"],
            node["reftarget"],
            location=node,
        )
    return None


def setup(app):  # type: ignore[no-untyped-def]
    app.add_directive("spectra-help", SpectraHelp)
    app.add_directive("spectra-exports", SpectraExports)
    app.add_directive("spectra-signatures", SpectraSignatures)
    app.connect("missing-reference", _unresolved)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
