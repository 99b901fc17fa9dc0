"""The layers of spectra import one way (docs/architecture.md): io below everything; operators
(TensorFlow) and estimators (NumPy/SciPy, never TensorFlow) side by side; analysis above both;
plotting and callback above it; the commands' reports (spectra.reports) above those, and the
CLI on top. Every module of spectra/ is read with ``ast`` (imports
inside functions count too), and the estimators are also imported in a fresh interpreter to
check that TensorFlow stays out of ``sys.modules``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "spectra"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk(tree)`` less the bodies of ``if TYPE_CHECKING:`` blocks (their ``else``
    branches run, and stay)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _imports(name: str, runtime_only: bool = False) -> set[str]:
    """The modules ``name`` imports, absolute: ``from spectra import _tf_compat`` is
    spectra._tf_compat, ``from . import x`` is resolved against the package, and a name
    that is not a module (``from spectra import __version__``) is the package itself (its
    ``__init__``). ``runtime_only``: without the imports under ``if TYPE_CHECKING:``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = TREES[name]
    found: set[str] = set()
    for node in _runtime_nodes(tree) if runtime_only else ast.walk(tree):
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


IMPORTS = {name: _imports(name) for name in MODULES}
# What runs: the imports under `if TYPE_CHECKING:` are left out (the type checker's only).
RUNTIME_IMPORTS = {name: _imports(name, runtime_only=True) for name in MODULES}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _violations(importers: str, allowed=None, forbidden=(), graph=None) -> list[str]:
    """'importer -> imported' for each module under ``importers`` that imports a module
    under one of ``forbidden``, or (with ``allowed``) a spectra module under none of
    ``allowed``; ``graph``: the modules each module imports (default :data:`IMPORTS`)."""
    bad = []
    for name, imported in sorted((IMPORTS if graph is None else graph).items()):
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
    # an import inside a function counts; one under `if TYPE_CHECKING:` does not run
    assert "spectra._backend" in RUNTIME_IMPORTS["spectra.operators.memory"]
    assert "spectra.operators.base" in IMPORTS["spectra.operators"]
    assert "spectra.operators.base" not in RUNTIME_IMPORTS["spectra.operators"]
    # and the checker reports an import that a rule forbids
    assert "spectra.analysis.per_layer -> spectra.estimators.eigensolvers" in _violations(
        "spectra.analysis", forbidden=["spectra.estimators"]
    )
    assert "spectra.estimators.results -> spectra.io.files" in _violations(
        "spectra.estimators", allowed=["spectra.estimators"]
    )


LAYERS = (
    "spectra.estimators",
    "spectra.analysis",
    "spectra.plotting",
    "spectra.callback",
    "spectra.reports",
)
RULES = {
    # _validation's generic argument checks (NumPy only) sit below every layer, so io, like
    # the estimators, may use them.
    "io imports no other spectra package": dict(
        importers="spectra.io", allowed=["spectra.io", "spectra._validation"]
    ),
    "estimators import only estimators, _validation, _symmetric, io.files and "
    "io.result_validation, never TensorFlow": dict(
        importers="spectra.estimators",
        allowed=[
            "spectra.estimators",
            "spectra._validation",
            "spectra._symmetric",
            "spectra.io.files",
            "spectra.io.result_validation",
        ],
        forbidden=["tensorflow", "keras", "tf_keras"],
    ),
    "operators import no estimators, analysis, plotting, callback, reports or cli": dict(
        importers="spectra.operators", forbidden=[*LAYERS, "spectra.cli"]
    ),
    "analysis imports no plotting, callback, reports or cli": dict(
        importers="spectra.analysis",
        forbidden=["spectra.plotting", "spectra.callback", "spectra.reports", "spectra.cli"],
    ),
    "plotting imports no callback, reports or cli": dict(
        importers="spectra.plotting",
        forbidden=["spectra.callback", "spectra.reports", "spectra.cli"],
    ),
    "reports import no callback or cli, never TensorFlow": dict(
        importers="spectra.reports",
        forbidden=["spectra.callback", "spectra.cli", "tensorflow", "keras", "tf_keras"],
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


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the first module of ``component`` (a strongly connected
    component of ``graph``), as the modules it passes, the first one again at its end."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        for other in sorted(graph[node]):
            if other == start:
                return [*paths[node], start]
            if other in members and other not in paths:
                paths[other] = [*paths[node], other]
                todo.append(other)
    raise AssertionError(f"{component} is no circle")


def test_no_modules_import_each_other_in_a_circle() -> None:
    # Imports inside functions count: a circle there is one the next refactoring makes
    # a module-level one. Imports under `if TYPE_CHECKING:` do not: they never run.
    # Importing a package is importing its __init__.py.
    graph = {
        name: {module for module in imported if module in MODULES and module != name}
        for name, imported in RUNTIME_IMPORTS.items()
    }
    toy = {"a": {"b", "d"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"a"}}
    assert _cycles(toy) == [["a", "b", "c", "d"]]
    assert _cycle_path(toy, ["a", "b", "c", "d"]) == ["a", "d", "a"]
    circles = [
        f"{' -> '.join(_cycle_path(graph, component))} (in a circle: {', '.join(component)})"
        for component in _cycles(graph)
    ]
    assert not circles, "modules import each other in a circle:\n" + "\n".join(circles)


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


def test_only_the_cli_imports_the_package_itself() -> None:
    # spectra/__init__.py is the top: it re-exports every layer. A module below the CLI
    # that imports it (`import spectra`, `from spectra import __version__`) imports upwards.
    entry_points = ("spectra.cli", "spectra.__main__")
    bad = [
        name
        for name, imported in sorted(IMPORTS.items())
        if "spectra" in imported and not any(_within(name, entry) for entry in entry_points)
    ]
    assert not bad


# -- modules named in strings ------------------------------------------------------------
# A module imported by its name in a string is invisible to the checks above. Each place
# that names spectra modules to resolve them at runtime is listed here, with its reason:
# a string constant naming a spectra module ("spectra.x", "spectra.x:Name", "spectra.x.Name")
# outside docstrings and annotations, or a call of an import function (importlib's
# import_module, __import__, pkgutil.resolve_name) with a computed name. A place is its
# module and the function, class or module-level variable it is in.
NAMED_BY_STRING: dict[tuple[str, str], str] = {
    # Lazy exports (PEP 562): `import spectra`, `import spectra.operators` and reading
    # spectra.operators.registry import no TensorFlow (and no JAX); a name's module is
    # imported on first use. Each table names modules of its own package or below it.
    ("spectra", "_EXPORTS"): "the public names' modules, imported on first use",
    ("spectra", "__getattr__"): "imports a public name's module, or a subpackage or module "
    "reached as an attribute (spectra.plotting, spectra.cli, ...), on first use",
    ("spectra._backend", "JAX_OPERATORS"): "the JAX engine's package, where the lazy exports "
    "find the operators of models under KERAS_BACKEND=jax",
    ("spectra.operators", "_SOURCE"): "spectra.operators' names' modules, imported on first use",
    ("spectra.operators", "__getattr__"): "imports a name's module on first use",
    ("spectra.operators.registry", "CURVATURES"): "each matrix's class as 'module:Class', data "
    "that spectra.operators' lazy exports import on first use (spectra.operators."
    "curvature_operator), so that the CLI's parser and `import spectra` read the registry "
    "without TensorFlow",
    ("spectra.operators.jax", "_SOURCE"): "the JAX engine's names' modules, imported on first use",
    ("spectra.operators.jax", "__getattr__"): "imports a name's module on first use",
    # Not imports: lookups in sys.modules, so that memory.py imports neither engine and the
    # JAX engine, which uses it, never imports TensorFlow. (The import-free fix: each
    # engine's base operator hands memory.py its compat module's reader.)
    ("spectra.operators.memory", "_DEVICE_MEMORY"): "each engine's compat module and "
    "its function that reads the accelerator's memory, looked up in sys.modules only",
    # The command line imports a subcommand's module when it runs or adds its arguments
    # (`spectra --help` imports no TensorFlow).
    ("spectra.cli", "main"): "imports the chosen subcommand's module",
    ("spectra.cli._parser", "build_parser"): "imports each subcommand's module for its options",
    # The user's modules, named by the user (--builder, --custom-objects): never spectra's.
    ("spectra.io.checkpoints", "resolve_builder"): "imports the module of a 'module:function' "
    "model builder",
    ("spectra.io.checkpoints", "resolve_custom_objects"): "imports the module that provides "
    "a checkpoint's custom objects",
}

# The modules named in strings that are above the module naming them: none left
# (spectra.load, spectra.reports.loading, imports the result types it reads); anything a
# string names obeys the layer rules above.
UPWARD_BY_NAME: set[str] = set()

_SPECTRA_NAME = re.compile(r"spectra(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_][\w.]*)?")
_IMPORT_FUNCTIONS = {
    "importlib.import_module",
    "import_module",
    "__import__",
    "importlib.__import__",
    "pkgutil.resolve_name",
    "resolve_name",
}
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _scope(statement: ast.stmt) -> str:
    """A module-level statement's place: its function's or class's name, the variables it
    assigns, else ``<module>``."""
    if isinstance(statement, _SCOPES):
        return statement.name
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        targets = [statement.target]
    else:
        targets = []
    return ", ".join(t.id for t in targets if isinstance(t, ast.Name)) or "<module>"


def _scoped_nodes(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """Each node of ``tree`` with its place (:func:`_scope`; nested functions and methods
    as ``outer.inner``)."""
    for statement in tree.body:
        todo: list[tuple[str, ast.AST]] = [(_scope(statement), statement)]
        while todo:
            scope, node = todo.pop()
            yield scope, node
            for child in ast.iter_child_nodes(node):
                todo.append(
                    (f"{scope}.{child.name}" if isinstance(child, _SCOPES) else scope, child)
                )


def _not_code(tree: ast.Module) -> set[int]:
    """The ids of the string nodes that are documentation or annotations, not values."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, *_SCOPES)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skipped.add(id(first.value))
        annotations: list[ast.expr | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations.append(node.returns)
        elif isinstance(node, ast.arg):
            annotations.append(node.annotation)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for annotation in annotations:
            if annotation is not None:
                skipped.update(id(part) for part in ast.walk(annotation))
    return skipped


def _named_by_string(tree: ast.Module) -> list[tuple[str, str]]:
    """(place, what) for each spectra module ``tree`` names in a string constant, and each
    import function it calls with a computed name."""
    skipped = _not_code(tree)
    found = []
    for scope, node in _scoped_nodes(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in skipped and _SPECTRA_NAME.fullmatch(node.value):
                found.append((scope, repr(node.value)))
        elif isinstance(node, ast.Call) and node.args:
            function = ast.unparse(node.func)
            name = node.args[0]
            computed = not (isinstance(name, ast.Constant) and isinstance(name.value, str))
            if function in _IMPORT_FUNCTIONS and computed:
                found.append((scope, f"{function}({ast.unparse(name)})"))
    return found


NAMED = {name: _named_by_string(tree) for name, tree in TREES.items()}


def _module_named(text: str) -> str:
    """The spectra module a string names: 'spectra.x.y:Name' and 'spectra.x.y.Name' are
    spectra.x.y (the longest prefix that is a module)."""
    parts = text.partition(":")[0].split(".")
    while len(parts) > 1 and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts)


def test_the_string_reader_sees_names_and_computed_imports() -> None:
    source = (
        '"""Naming spectra.operators.hessian here is prose."""\n'
        "import importlib\n"
        'TABLE = {"a": "spectra.operators.hessian:HessianOperator", "b": "spectra", "c": "x.y"}\n'
        "def f(name: 'spectra.operators.base.CurvatureOperator'):\n"
        '    """As is spectra.operators.batching."""\n'
        '    importlib.import_module(f"spectra.{name}")\n'
        '    importlib.import_module("json")\n'
        "    return __import__(name)\n"
        "class C:\n"
        "    def g(self):\n"
        '        return "spectra.operators.batching.Batches"\n'
    )
    assert sorted(_named_by_string(ast.parse(source))) == [
        ("C.g", "'spectra.operators.batching.Batches'"),
        ("TABLE", "'spectra.operators.hessian:HessianOperator'"),
        ("f", "__import__(name)"),
        ("f", "importlib.import_module(f'spectra.{name}')"),
    ]
    assert _module_named("spectra.operators.hessian:HessianOperator") == (
        "spectra.operators.hessian"
    )
    assert _module_named("spectra.operators.batching.Batches") == "spectra.operators.batching"
    # and it sees the package's own
    assert ("__getattr__", "importlib.import_module(f'{__name__}.{name}')") in NAMED["spectra"]


def test_no_module_imports_spectra_modules_by_name_but_the_listed_ones() -> None:
    # A new place fails: import the module (inside a function if it must wait), or list
    # it in NAMED_BY_STRING with its reason.
    unlisted = [
        f"{name} ({scope}): {what}"
        for name, found in sorted(NAMED.items())
        for scope, what in found
        if (name, scope) not in NAMED_BY_STRING
    ]
    assert not unlisted, "modules named in strings:\n" + "\n".join(unlisted)


def test_the_modules_named_in_strings_obey_the_layers() -> None:
    # What a string names is imported at runtime, so it is held to the layer rules too;
    # no exception is left (UPWARD_BY_NAME).
    graph = {
        name: {_module_named(ast.literal_eval(what)) for _, what in found if what[0] in "'\""}
        for name, found in NAMED.items()
    }
    # the rules see a name above its namer
    upward = {"spectra.estimators.results": {"spectra.reports.loading"}}
    assert _violations("spectra.estimators", allowed=["spectra.estimators"], graph=upward)
    bad = set()
    for rule in RULES.values():
        bad.update(_violations(**rule, graph=graph))
    entry_points = ("spectra.cli", "spectra.__main__")
    bad.update(
        f"{name} -> {module}"
        for name, named in graph.items()
        if not any(_within(name, entry) for entry in entry_points)
        for module in named
        if _within(module, "spectra.cli")
    )
    assert UPWARD_BY_NAME <= bad  # the checker sees the known exception
    assert not sorted(bad - UPWARD_BY_NAME)


# -- TensorFlow's internals --------------------------------------------------------------
def _tensorflow_internals(tree: ast.Module) -> list[str]:
    """Where ``tree`` reaches ``tensorflow.python``: an import of it, an attribute
    ``tf.python`` of a name bound to TensorFlow, or a string constant naming it (outside
    documentation)."""
    bound = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name == "tensorflow"
    }
    skipped = _not_code(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"import {alias.name}"
                for alias in node.names
                if _within(alias.name, "tensorflow.python")
            ]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if any(_within(name, "tensorflow.python") for name in names):
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr == "python":
            if isinstance(node.value, ast.Name) and node.value.id in bound:
                found.append(f"{node.value.id}.python")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in skipped and node.value.startswith("tensorflow.python"):
                found.append(repr(node.value))
    return found


def test_only_tf_compat_reaches_tensorflows_internals() -> None:
    # TensorFlow's private modules (tensorflow.python.*) are used in spectra/_tf_compat.py
    # only, each behind a function with a tested fallback (tests/test_tf_compat.py).
    source = (
        "import tensorflow as tf\n"
        "from tensorflow.python.client import device_lib\n"
        "from tensorflow import python\n"
        "import tensorflow.python.ops\n"
        "ops = tf.python.ops\n"
        'name = "tensorflow.python.framework.ops"\n'
        "fine = tf.compat.v1\n"
    )
    assert len(_tensorflow_internals(ast.parse(source))) == 5
    assert _tensorflow_internals(TREES["spectra._tf_compat"])  # and it sees them there
    found = {
        name: where
        for name, tree in TREES.items()
        if name != "spectra._tf_compat" and (where := _tensorflow_internals(tree))
    }
    assert not found


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
