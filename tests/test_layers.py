"""The layers of spectra import one way (docs/architecture.md): io below everything; operators
(TensorFlow) and estimators (NumPy/SciPy, never TensorFlow) side by side; analysis above both;
plotting, callback and the CLI on top. Every module of spectra/ is read with ``ast`` (imports
inside functions count too), and the estimators are also imported in a fresh interpreter to
check that TensorFlow stays out of ``sys.modules``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "spectra"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """The modules ``name`` imports, absolute: ``from spectra import _tf_compat`` is
    spectra._tf_compat, ``from . import x`` is resolved against the package, and a name
    that is not a module (``from spectra import __version__``) is the package itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.add(submodule if submodule in MODULES else module)
    return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _violations(importers: str, allowed=None, forbidden=()) -> list[str]:
    """'importer -> imported' for each module under ``importers`` that imports a module
    under one of ``forbidden``, or (with ``allowed``) a spectra module under none of
    ``allowed``."""
    bad = []
    for name, imported in sorted(IMPORTS.items()):
        if not _within(name, importers):
            continue
        for module in sorted(imported):
            spectra_module = _within(module, "spectra")
            if any(_within(module, prefix) for prefix in forbidden) or (
                allowed is not None
                and spectra_module
                and not any(_within(module, prefix) for prefix in allowed)
            ):
                bad.append(f"{name} -> {module}")
    return bad


def test_the_parser_sees_the_package() -> None:
    # The checks below are only as good as the import graph they read.
    assert {"spectra.io.files", "spectra.estimators.krylov", "spectra.cli.analyze"} <= set(MODULES)
    assert "spectra.estimators.tridiagonal" in IMPORTS["spectra.estimators.krylov"]
    assert "spectra._tf_compat" in IMPORTS["spectra.operators.engine"]  # from spectra import ...
    assert "spectra" in IMPORTS["spectra.cli._parser"]  # from spectra import __version__
    # and the checker reports an import that a rule forbids
    assert "spectra.analysis.per_layer -> spectra.estimators.eigensolvers" in _violations(
        "spectra.analysis", forbidden=["spectra.estimators"]
    )
    assert "spectra.estimators.results -> spectra.io.files" in _violations(
        "spectra.estimators", allowed=["spectra.estimators"]
    )


LAYERS = "spectra.estimators", "spectra.analysis", "spectra.plotting", "spectra.callback"
RULES = {
    # _validation's generic argument checks (NumPy only) sit below every layer, so io, like
    # the estimators, may use them.
    "io imports no other spectra package": dict(
        importers="spectra.io", allowed=["spectra.io", "spectra._validation"]
    ),
    "estimators import only estimators, _validation, io.files and io.result_validation, "
    "never TensorFlow": dict(
        importers="spectra.estimators",
        allowed=[
            "spectra.estimators",
            "spectra._validation",
            "spectra.io.files",
            "spectra.io.result_validation",
        ],
        forbidden=["tensorflow", "keras", "tf_keras"],
    ),
    "operators import no estimators, analysis, plotting, callback or cli": dict(
        importers="spectra.operators", forbidden=[*LAYERS, "spectra.cli"]
    ),
    "analysis imports no plotting, callback or cli": dict(
        importers="spectra.analysis",
        forbidden=["spectra.plotting", "spectra.callback", "spectra.cli"],
    ),
    "plotting imports no callback or cli": dict(
        importers="spectra.plotting", forbidden=["spectra.callback", "spectra.cli"]
    ),
}


@pytest.mark.parametrize("rule", RULES)
def test_layer_imports_one_way(rule: str) -> None:
    assert not _violations(**RULES[rule]), rule


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm):
    each is a set of modules that import each other in a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    # Imports inside functions count: a circle there is one the next refactoring makes
    # a module-level one.
    graph = {
        name: {module for module in imported if module in MODULES and module != name}
        for name, imported in IMPORTS.items()
    }
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles(graph)


def test_only_the_cli_imports_the_cli() -> None:
    # spectra/__main__.py is `python -m spectra`, the CLI's other entry point.
    entry_points = ("spectra.cli", "spectra.__main__")
    bad = [
        f"{name} -> {module}"
        for name, imported in sorted(IMPORTS.items())
        if not any(_within(name, entry) for entry in entry_points)
        for module in sorted(imported)
        if _within(module, "spectra.cli")
    ]
    assert not bad


def test_validation_imports_no_layer_and_no_tensorflow() -> None:
    assert not _violations(
        "spectra._validation",
        allowed=["spectra._validation"],
        forbidden=["tensorflow", "keras", "tf_keras"],
    )


def _reaches_tensorflow(name: str) -> list[str]:
    """The import chain from ``name`` to TensorFlow (imports inside functions count too),
    or [] when there is none."""
    chains = {name: [name]}
    todo = [name]
    while todo:
        current = todo.pop()
        for module in sorted(IMPORTS.get(current, ())):
            if module.split(".")[0] in ("tensorflow", "tf_keras"):
                return [*chains[current], module]
            if module in MODULES and module not in chains:
                chains[module] = [*chains[current], module]
                todo.append(module)
    return []


# What runs under KERAS_BACKEND=jax without TensorFlow installed: the backend choice, the
# backend-neutral modules of the operators (parameter layout, losses, model calls, data
# checks, predictive distributions, Keras internals), the JAX engine and its compat module.
# (The command line under JAX is run without TensorFlow by tests/jax_engine/test_jax_cli.py.)
JAX_PATH = (
    "spectra._backend",
    "spectra._jax_compat",
    "spectra._keras_compat",
    "spectra.operators.layout",
    "spectra.operators.operator_core",
    "spectra.operators.jacobian_core",
    "spectra.operators.losses",
    "spectra.operators.keras_calls",
    "spectra.operators.keras_data",
    "spectra.operators.predictive",
)


def test_the_jax_path_never_reaches_tensorflow() -> None:
    names = [n for n in MODULES if n in JAX_PATH or _within(n, "spectra.operators.jax")]
    assert "spectra.operators.layout" in names
    chains = {name: _reaches_tensorflow(name) for name in names}
    assert not {name: " -> ".join(chain) for name, chain in chains.items() if chain}
    # and the check sees a chain where there is one
    assert _reaches_tensorflow("spectra.operators.hessian")[-1] == "tensorflow"


def test_estimators_run_without_tensorflow() -> None:
    estimators = sorted(name for name in MODULES if _within(name, "spectra.estimators"))
    code = (
        "import importlib, sys\n"
        f"for name in {estimators!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tensorflow', 'keras', 'tf_keras'))\n"
        "print(len(sys.modules), loaded[:5])\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
