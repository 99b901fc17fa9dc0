"""What a result's dictionary must hold before :meth:`spectra.estimators.results.Result.from_dict`
builds the class from it: each field of the type its annotation names, and, per class, the
shapes that must agree, the numbers that must be finite and the keys the figures and reports
read (:func:`check_fields`).

An edited or damaged file is refused in one line naming the field by its path in the file
("eigenvalues.error_bounds", "checkpoints[1].eigenvalues"), the way ``"null_values"`` names
them, and what was expected: :class:`FieldError`. The rules are keyed by class name, so that
this module imports none of the classes it checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "FieldError",
    "article",
    "check_fields",
    "check_figure_fields",
    "check_value",
    "damaged_file",
    "join_path",
    "read_array",
]


def join_path(prefix: str, path: str) -> str:
    """``path`` inside the field ``prefix``: "eigenvalues" + "error_bounds" gives
    "eigenvalues.error_bounds", "checkpoints" + "[1].step" gives "checkpoints[1].step"."""
    if not prefix:
        return path
    return f"{prefix}{path}" if path.startswith("[") else f"{prefix}.{path}"


class FieldError(ValueError):
    """A field that is not what its class holds: ``template`` with ``{0}``, ``{1}``… for the
    ``fields``' paths (quoted in the message), so that a nested result's error can be placed
    in its parent (:meth:`within`)."""

    def __init__(self, template: str, *fields: str) -> None:
        self.template = template
        self.fields = fields
        super().__init__(template.format(*(f'"{name}"' for name in fields)))

    def within(self, prefix: str) -> FieldError:
        """The same error with every field's path inside the field ``prefix``."""
        return FieldError(self.template, *(join_path(prefix, name) for name in self.fields))


# --------------------------------------------------------------------------- by annotation


def _split_union(annotation: str) -> list[str]:
    """The top-level alternatives of an annotation: "dict[str, Any] | None" -> two."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(annotation):
        depth += char == "["
        depth -= char == "]"
        if char == "|" and depth == 0:
            parts.append(annotation[start:i].strip())
            start = i + 1
    parts.append(annotation[start:].strip())
    return parts


def article(word: str) -> str:
    """ "a" or "an" before ``word``."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 20 else value[:17] + "..."
        return f"the text {shown!r}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        kind = value.get("type")
        return f"{article(kind)} {kind} dictionary" if isinstance(kind, str) else "a dictionary"
    return type(value).__name__


_SCALARS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "str": ("a text", lambda v: isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": (
        "a number",
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    ),
}


def _describe(annotation: str, result_classes: Callable[[str], Any]) -> str | None:
    """What a value of ``annotation`` is, in words; None for an annotation not checked."""
    if annotation in _SCALARS:
        return _SCALARS[annotation][0]
    if annotation.startswith("list["):
        return "a list"
    if annotation.startswith("dict["):
        return "a dictionary"
    if result_classes(annotation) is not None:
        return f'{article(annotation)} {annotation} (a dictionary with "type": "{annotation}")'
    return None


def check_value(
    value: Any, annotation: str, path: str, result_classes: Callable[[str], Any]
) -> None:
    """Raise :class:`FieldError` unless ``value`` (as read from JSON) has the type
    ``annotation`` names (a dataclass annotation as a string: "float | None",
    "list[dict[str, Any]]", "EigenResult"); ``result_classes(name)`` is the Result class
    called ``name`` or None. Arrays ("np.ndarray") and ``Any`` are left to the caller; an
    annotation this does not know is accepted."""
    alternatives = _split_union(annotation)
    if value is None:
        if "None" in alternatives or "Any" in alternatives:
            return
    described = []
    for part in alternatives:
        if part == "None":
            continue
        if part == "Any" or part.startswith("np.ndarray"):
            return
        if part in _SCALARS:
            if _SCALARS[part][1](value):
                return
        elif part.startswith("list["):
            if isinstance(value, list):
                _check_items(enumerate(value), part[5:-1], path, result_classes)
                return
        elif part.startswith("dict["):
            if isinstance(value, dict):
                inner = _split_union(part[5:-1].split(",", 1)[1].strip())
                _check_items(value.items(), " | ".join(inner), path, result_classes)
                return
        else:
            cls = result_classes(part)
            if cls is None:
                return  # an annotation this module does not know
            kind = value.get("type") if isinstance(value, dict) else None
            found = result_classes(kind) if isinstance(kind, str) else None
            if found is not None and issubclass(found, cls):
                return
        text = _describe(part, result_classes)
        if text is not None:
            described.append(text)
    if "None" in alternatives:
        described.append("null")
    raise FieldError(f"{{0}} is {_type_name(value)}, not {' or '.join(described)}", path)


def _check_items(
    items: Any, annotation: str, path: str, result_classes: Callable[[str], Any]
) -> None:
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else join_path(path, str(key))
        check_value(item, annotation, where, result_classes)


def read_array(value: Any, path: str) -> np.ndarray:
    """A list (nested) as written by ``to_dict`` back to an array: bool, int64 or float64 as
    the values are; nulls (a NaN or inf restored, or a missing value) make it float64. An
    empty list gives an empty float64 array. :class:`FieldError` for anything else (text,
    a dictionary, ragged lists)."""
    if isinstance(value, np.ndarray):
        return value
    if not isinstance(value, (list, int, float, bool)):
        raise FieldError(f"{{0}} must be a list of numbers, got {_type_name(value)}", path)
    try:
        array = np.asarray(value)
    except ValueError:  # ragged nested lists
        raise FieldError("{0} must be a rectangular list of numbers", path) from None
    if array.dtype == object:
        try:
            missing = np.vectorize(lambda item: item is None, otypes=[bool])(array)
            array = np.where(missing, np.nan, array).astype(np.float64)
        except (TypeError, ValueError):
            raise FieldError("{0} must be a list of numbers", path) from None
    elif array.size == 0:
        array = array.astype(np.float64)
    if array.dtype.kind not in "bif":
        raise FieldError(f"{{0}} must be a list of numbers, got {array.dtype} values", path)
    return array


# --------------------------------------------------------------------------- per class

# How the values of an array must be: "finite" (no NaN, no ±inf), "bound" (not negative; +inf
# is an error bound not found, NaN one not computed, both shown as such), "number" (any).
_FINITE, _BOUND, _NUMBER = "finite", "bound", "number"


class _Array:
    """An array field: its number of dimensions, the kind of its values ("b" true/false,
    "i" integers, "f" numbers) and what they must be."""

    def __init__(self, ndim: int, kind: str = "f", values: str = _NUMBER) -> None:
        self.ndim, self.kind, self.values = ndim, kind, values


_KIND_WORDS = {"b": "true/false values", "i": "integers", "f": "numbers"}


def _check_array(array: np.ndarray, spec: _Array, path: str) -> None:
    if array.ndim != spec.ndim and not (array.size == 0 and spec.ndim > 1):
        shape = "a list" if spec.ndim == 1 else f"a {spec.ndim}-level nested list (a matrix)"
        raise FieldError(
            f"{{0}} must be {shape} of {_KIND_WORDS[spec.kind]}, got {array.ndim} levels", path
        )
    kind = array.dtype.kind
    # An empty list reads back as float64: it fits any kind.
    fits = array.size == 0 or {"b": kind == "b", "i": kind in "iu", "f": kind in "iuf"}[spec.kind]
    if not fits:
        raise FieldError(f"{{0}} must hold {_KIND_WORDS[spec.kind]}, got {array.dtype}", path)
    if spec.kind != "f" or spec.values == _NUMBER:
        return
    values = array.astype(np.float64, copy=False)
    if spec.values == _FINITE and np.isnan(values).any():
        index = int(np.flatnonzero(np.isnan(values).ravel())[0])
        raise FieldError(f"{{0}} holds NaN (entry {index}) where a number is required", path)
    if spec.values == _FINITE and not np.isfinite(values).all():
        index = int(np.flatnonzero(~np.isfinite(values).ravel())[0])
        raise FieldError(f"{{0}} holds an infinite value (entry {index})", path)
    negative = values < 0  # NaN compares False
    if spec.values == _BOUND and negative.any():
        index = int(np.flatnonzero(negative.ravel())[0])
        raise FieldError(f"{{0}} holds a negative bound (entry {index})", path)


def _length_words(count: int, axis: int, ndim: int) -> str:
    if ndim == 1:
        return f"{count} value{'s' if count != 1 else ''}"
    return f"{count} {'row' if axis == 0 else 'column'}{'s' if count != 1 else ''}"


def _agree(values: dict[str, Any], group: Sequence[tuple[str, int]], prefix: str = "") -> None:
    """The fields of ``group`` (name, axis) that are present have the same length there."""
    first: tuple[str, int, int, int] | None = None
    for name, axis in group:
        array = values.get(name)
        if array is None:
            continue
        if isinstance(array, list):
            count, ndim = len(array), 1
        else:
            array = np.asarray(array)
            if array.ndim <= axis:
                continue  # an empty matrix; its shape was checked already
            count, ndim = int(array.shape[axis]), array.ndim
        path = join_path(prefix, name)
        if first is None:
            first = (path, count, axis, ndim)
        elif count != first[1]:
            raise FieldError(
                f"{{0}} has {_length_words(first[1], first[2], first[3])} but {{1}} has "
                f"{_length_words(count, axis, ndim)}",
                first[0],
                path,
            )


def _finite_number(values: dict[str, Any], name: str, prefix: str = "") -> None:
    value = values.get(name)
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldError(
            f"{{0}} is {value!r} where a finite number is required", join_path(prefix, name)
        )


def _keys(values: dict[str, Any], name: str, required: dict[str, str], prefix: str = "") -> None:
    """The dictionary field ``name`` (when present) holds ``required``'s keys, each of the
    annotation given."""
    holder = values.get(name)
    if not isinstance(holder, dict):
        return
    path = join_path(prefix, name)
    for key, annotation in required.items():
        if key not in holder:
            raise FieldError(f'{{0}} has no "{key}"', path)
        check_value(holder[key], annotation, join_path(path, key), lambda _: None)


# Array fields by class.
_EIGEN = {
    "eigenvalues": _Array(1, "f", _FINITE),
    "error_bounds": _Array(1, "f", _BOUND),
    "residual_norms": _Array(1, "f", _BOUND),
    "converged": _Array(1, "b"),
}
_ARRAYS: dict[str, dict[str, _Array]] = {
    "EigenResult": {**_EIGEN, "eigenvectors": _Array(2)},
    "LanczosResult": {"alpha": _Array(1), "beta": _Array(1), "basis": _Array(2)},
    "DiagonalResult": {"estimate": _Array(1), "stderr": _Array(1)},
    "DensityCurve": {name: _Array(1) for name in ("grid", "values", "lower", "upper")},
    "SpectralMoments": {"orders": _Array(1, "i"), "estimate": _Array(1), "stderr": _Array(1)},
    "SpectralDensity": {
        "nodes": _Array(2, "f", _FINITE),
        "weights": _Array(2, "f", _BOUND),
        "steps_taken": _Array(1, "i"),
    },
    "InverseSolve": {
        "converged": _Array(1, "b"),
        "iterations": _Array(1, "i"),
        "relative_residuals": _Array(1),
    },
    "LogDetResult": {"per_probe": _Array(1), "steps_taken": _Array(1, "i")},
    "GradientOverlapResult": {
        "per_direction": _Array(1),
        "eigenvalues": _Array(1, "f", _FINITE),
        "error_bounds": _Array(1, "f", _BOUND),
        "converged": _Array(1, "b"),
    },
    "LandscapeResult": {"alphas": _Array(1, "f", _FINITE), "betas": _Array(1, "f", _FINITE)},
    "LayerwiseResult": {"traces": _Array(1), "trace_stderr": _Array(1)},
    "RepeatResult": {
        **{name: _Array(2) for name in ("values", "bounds")},
        **{name: _Array(1) for name in ("mean", "sd", "sem", "ci_low", "ci_high")},
        "seeds": _Array(1, "i"),
        "subset_sizes": _Array(1, "i"),
        "full_values": _Array(1),
        "shift": _Array(1),
    },
}
_ARRAYS["LogSpectralDensity"] = _ARRAYS["SpectralDensity"]
# Groups of (field, axis) whose lengths must agree, by class.
_AGREE: dict[str, list[list[tuple[str, int]]]] = {
    "EigenResult": [[*((name, 0) for name in _EIGEN), ("eigenvectors", 1)]],
    "DiagonalResult": [[("estimate", 0), ("stderr", 0)]],
    "DensityCurve": [[("grid", 0), ("values", 0), ("lower", 0), ("upper", 0)]],
    "SpectralMoments": [[("orders", 0), ("estimate", 0), ("stderr", 0)]],
    "SpectralDensity": [
        [("nodes", 0), ("weights", 0), ("steps_taken", 0)],
        [("nodes", 1), ("weights", 1)],
    ],
    "InverseSolve": [[("converged", 0), ("iterations", 0), ("relative_residuals", 0)]],
    "LogDetResult": [[("per_probe", 0), ("steps_taken", 0)]],
    "GradientOverlapResult": [
        [("per_direction", 0), ("eigenvalues", 0), ("error_bounds", 0), ("converged", 0)]
    ],
    "LayerwiseResult": [
        [
            ("groups", 0),
            ("group_sizes", 0),
            ("eigenvalues", 0),
            ("residual_norms", 0),
            ("error_bounds", 0),
            ("converged", 0),
            ("num_steps", 0),
            ("traces", 0),
            ("trace_stderr", 0),
        ]
    ],
    "RepeatResult": [
        [
            *(("names", 0), ("bound_kinds", 0), ("values", 1), ("bounds", 1), ("mean", 0)),
            *(("sd", 0), ("sem", 0), ("ci_low", 0), ("ci_high", 0)),
            *(("full_values", 0), ("shift", 0)),
        ],
        [("values", 0), ("bounds", 0), ("seeds", 0)],
    ],
}
_AGREE["LogSpectralDensity"] = _AGREE["SpectralDensity"]
_DESCRIBED = {"name": "str", "num_parameters": "int"}
_DATA = {"name": "str", "num_examples": "int"}


def _lanczos(values: dict[str, Any]) -> None:
    alpha, beta = values.get("alpha"), values.get("beta")
    if alpha is not None and beta is not None and beta.size != max(alpha.size - 1, 0):
        raise FieldError(
            f"{{0}} has {alpha.size} values, so {{1}} must have {max(alpha.size - 1, 0)}, "
            f"not {beta.size}",
            "alpha",
            "beta",
        )
    _agree(values, [("alpha", 0), ("basis", 1)])


def _layerwise(values: dict[str, Any]) -> None:
    names = ("eigenvalues", "error_bounds", "residual_norms", "converged")
    specs = {name: _EIGEN[name] for name in names}
    for name in names:
        for i, array in enumerate(values.get(name) or []):
            _check_array(array, specs[name], f"{name}[{i}]")
    for i in range(len(values.get("groups") or [])):
        row = {f"{name}[{i}]": values[name][i] for name in names if values.get(name) is not None}
        _agree(row, [(key, 0) for key in row])


def _analysis_report(values: dict[str, Any]) -> None:
    _finite_number(values, "loss")


def _analysis_figures(values: dict[str, Any]) -> None:
    _keys(values, "settings", {"dtype": "str"})
    _keys(values, "model", _DESCRIBED)
    _keys(values, "data", _DATA)
    eigen = values.get("eigenvalues")
    if eigen is not None and eigen.eigenvalues.size == 0:
        raise FieldError("{0} holds no eigenvalue to draw", "eigenvalues.eigenvalues")


def _landscape_report(values: dict[str, Any]) -> None:
    for name in ("curves", "surface"):
        curves = values.get(name)
        if curves is not None and type(curves).__name__ != "LandscapeResult":
            raise FieldError(
                f"{{0}} is {_type_name(curves)}, not a LandscapeResult (a dictionary with "
                '"type": "LandscapeResult")',
                name,
            )
    curves, surface = values.get("curves"), values.get("surface")
    if curves is not None and surface is not None:
        grid = None if surface.losses_2d is None else np.asarray(surface.losses_2d)
        size = curves.alphas.size
        if grid is None or grid.shape != (size, size):
            raise FieldError(
                f"{{0}} must be a {size} × {size} matrix (one row and column per alpha), got "
                f"{'none' if grid is None else ' × '.join(map(str, grid.shape))}",
                "surface.losses_2d",
            )


def _landscape_figures(values: dict[str, Any]) -> None:
    _keys(values, "settings", {"dtype": "str"})
    _keys(values, "model", _DESCRIBED)
    _keys(values, "data", _DATA)
    _keys(values, "radius", {"slope_along_v1": "float", "rule": "str"})
    eigen, curves = values.get("eigenvalues"), values.get("curves")
    if eigen is None or curves is None:
        raise FieldError("{0} is null: there is no curve to draw", "curves")
    count = eigen.eigenvalues.size
    if count == 0:
        raise FieldError("{0} holds no eigenvalue to draw", "eigenvalues.eigenvalues")
    known = {"random", *(f"v{i + 1}" for i in range(min(count, 2)))}
    for i, label in enumerate(curves.labels):
        if label not in known:
            raise FieldError(
                f"{{0}} is {label!r}, not one of {', '.join(sorted(known))}",
                f"curves.labels[{i}]",
            )
        if label not in curves.losses:
            raise FieldError(
                f'{{0}} has no curve "{label}", which {{1}} names',
                "curves.losses",
                f"curves.labels[{i}]",
            )


def _landscape_result(values: dict[str, Any]) -> None:
    alphas = values.get("alphas")
    for label, curve in (values.get("losses") or {}).items():
        _check_array(curve, _Array(1), join_path("losses", label))
        if alphas is not None:
            path = join_path("losses", label)
            _agree({"alphas": alphas, path: curve}, [("alphas", 0), (path, 0)])
    _finite_number(values, "base_loss")


_THRESHOLD = {
    "value": "float",
    "formula": "str",
    "optimizer": "str",
    "learning_rate": "float",
    "parameters": "dict[str, float]",
    "preconditioned": "bool",
    "reference": "str",
}
# A measured checkpoint of sharpness.json: what the figure, the table and a resume read.
_DONE_ENTRY = {"file": "str", "step": "int | float", "loss": "float | None"}
# Read when present (entries of earlier versions may lack them).
_DONE_ENTRY_OPTIONAL = {
    "trace": "float | None",
    "trace_stderr": "float | None",
    "eigenvector_overlap": "float | None",
    "failure_probability": "float | None",
}


def _sharpness_figures(values: dict[str, Any]) -> None:
    _keys(values, "data", _DATA)
    _keys(values, "model", _DESCRIBED)
    axes = values.get("x_axes")
    if isinstance(axes, dict):
        for name, axis in axes.items():
            _keys({name: axis}, name, {"label": "str", "values": "dict[str, float]"}, "x_axes")


def _sharpness_report(values: dict[str, Any]) -> None:
    for name in ("threshold", "dropped_threshold"):
        _keys(values, name, _THRESHOLD)
        threshold = values.get(name)
        if isinstance(threshold, dict):
            _finite_number(threshold, "value", prefix=name)
            if not threshold["value"] > 0:
                raise FieldError("{0} must be positive", join_path(name, "value"))
    top_k = (values.get("settings") or {}).get("top_k", None)
    columns = None
    for i, entry in enumerate(values.get("checkpoints") or []):
        path = f"checkpoints[{i}]"
        if entry.get("status") != "done":
            continue
        for key, annotation in {**_DONE_ENTRY, **_DONE_ENTRY_OPTIONAL}.items():
            if key not in entry:
                if key in _DONE_ENTRY_OPTIONAL:
                    continue
                raise FieldError(f'{{0}} is done but has no "{key}"', path)
            check_value(entry[key], annotation, join_path(path, key), lambda _: None)
        row = {}
        for key in ("eigenvalues", "error_bounds", "residual_norms", "converged"):
            if key not in entry:
                if key == "residual_norms":
                    continue
                raise FieldError(f'{{0}} is done but has no "{key}"', path)
            row[key] = read_array(entry[key], join_path(path, key))
            _check_array(row[key], _EIGEN[key], join_path(path, key))
        _agree(row, [(key, 0) for key in row], prefix=path)
        count = row["eigenvalues"].size
        if count == 0:
            raise FieldError("{0} holds no eigenvalue", join_path(path, "eigenvalues"))
        if columns is None:
            columns = (count, join_path(path, "eigenvalues"))
            if isinstance(top_k, int) and count != top_k:
                raise FieldError(
                    f"{{0}} has {count} values but {{1}} is {top_k}",
                    columns[1],
                    "settings.top_k",
                )
        elif count != columns[0]:
            raise FieldError(
                f"{{0}} has {columns[0]} values but {{1}} has {count}",
                columns[1],
                join_path(path, "eigenvalues"),
            )


_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "LanczosResult": _lanczos,
    "LayerwiseResult": _layerwise,
    "LandscapeResult": _landscape_result,
    "AnalysisReport": _analysis_report,
    "LandscapeReport": _landscape_report,
    "SharpnessReport": _sharpness_report,
}


_FIGURE_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "AnalysisReport": _analysis_figures,
    "LandscapeReport": _landscape_figures,
    "SharpnessReport": _sharpness_figures,
}
# What to do about a file whose fields are not what its class holds, by the command that
# writes it; any other result's file was written by to_json.
_REWRITE = {
    "AnalysisReport": "rerun the analysis (spectra analyze)",
    "LandscapeReport": "rerun spectra landscape",
    "SharpnessReport": "rerun spectra sharpness with --restart",
}


def damaged_file(where: str, kind: str, error: FieldError) -> FieldError:
    """``error`` of the file ``where`` (holding a ``kind``) as one line naming the path, the
    field, what was expected and what to rerun."""
    fix = _REWRITE.get(kind, f"write it again with {kind}.to_json")
    escaped = where.replace("{", "{{").replace("}", "}}")
    return FieldError(
        f"{escaped}: {error.template}; the file was edited or is damaged — {fix}", *error.fields
    )


def check_figure_fields(report: Any) -> None:
    """Raise :class:`FieldError` unless a loaded command report (``AnalysisReport``,
    ``LandscapeReport``, ``SharpnessReport``) holds what its figures read: the model's and
    the data's names and sizes, the dtype, the curves the eigenvalues name, the x axes."""
    check = _FIGURE_CHECKS.get(type(report).__name__)
    if check is not None:
        check({spec: getattr(report, spec) for spec in vars(report)})


def check_fields(class_name: str, values: dict[str, Any]) -> None:
    """Raise :class:`FieldError` unless the decoded fields ``values`` of the class called
    ``class_name`` have the shapes, values and keys it needs (see the module docstring).
    Arrays are numpy arrays already; nested results their classes."""
    for name, spec in _ARRAYS.get(class_name, {}).items():
        array = values.get(name)
        if isinstance(array, np.ndarray):
            _check_array(array, spec, name)
    for group in _AGREE.get(class_name, []):
        _agree(values, group)
    check = _CHECKS.get(class_name)
    if check is not None:
        check(values)
