"""Tests of spectra.estimators.results.

Every result class round-trips through its JSON: ``to_json`` then ``from_json`` (and
:func:`spectra.load`) gives the same dataclass, field by field, with numpy arrays of the
dtype written, NaN and ±inf where strict JSON wrote null; bad files are refused in one line
naming the path and the cause.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import pytest
from _matrices import random_symmetric, single_blas_thread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import spectra.reports  # noqa: F401  (registers the report and analysis result types with load)
from spectra.estimators import results as results_module
from spectra.estimators.density import spectral_density
from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.krylov import lanczos
from spectra.estimators.results import (
    EigenResult,
    LanczosResult,
    Result,
    SpectralDensity,
    _result_class,
    load,
)
from spectra.estimators.stochastic_diagonal import diagonal
from spectra.estimators.stochastic_trace import frobenius_norm, trace
from spectra.io import result_validation as rules
from spectra.io.result_validation import FieldError


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with single_blas_thread():
        yield


@pytest.fixture(scope="module")
def results():
    a = random_symmetric(40, seed=1)
    density = spectral_density(a, num_steps=10, num_probes=3)
    return [
        eigenvalues(a, k=2, return_eigenvectors=True),
        lanczos(a, 8, return_basis=True),
        trace(a, num_products=20),
        frobenius_norm(a, num_products=20),
        diagonal(a, num_products=20),
        density,
        density.density(),
        density.moments(3),
    ]


def test_to_dict_round_trips_through_json(results):
    for result in results:
        data = result.to_dict()
        assert data["type"] == type(result).__name__
        assert json.loads(json.dumps(data)) == data


def test_to_dict_converts_numpy_types():
    result = EigenResult(
        eigenvalues=np.array([2.0]),
        residual_norms=np.array([0.0]),
        error_bounds=np.array([0.0]),
        converged=np.array([True]),
        which="largest",
        method="lanczos",
        num_products=np.int64(3),
        num_operator_calls=3,
        wall_time=np.float32(0.5),
        settings={"tol": np.float64(1e-8), "nested": {"a": np.arange(2)}},
    )
    data = result.to_dict()
    assert type(data["num_products"]) is int and type(data["wall_time"]) is float
    assert data["settings"] == {"tol": 1e-8, "nested": {"a": [0, 1]}}
    assert data["converged"] == [True] and data["eigenvectors"] is None


def test_include_vectors_false_omits_large_fields(results):
    eig, lan = results[0], results[1]
    assert "eigenvectors" in eig.to_dict()
    assert len(eig.to_dict()["eigenvectors"]) == 40
    assert "eigenvectors" not in eig.to_dict(include_vectors=False)
    assert "basis" not in lan.to_dict(include_vectors=False)


def test_to_json_writes_atomically(tmp_path, results):
    path = tmp_path / "result.json"
    text = results[2].to_json(path)
    assert json.loads(path.read_text()) == json.loads(text) == results[2].to_dict()
    results[3].to_json(str(path))  # overwrite in place
    assert json.loads(path.read_text())["type"] == "FrobeniusResult"
    assert os.listdir(tmp_path) == ["result.json"]
    # Missing directories are created; no temporary file is left anywhere.
    results[2].to_json(tmp_path / "new" / "result.json")
    assert json.loads((tmp_path / "new" / "result.json").read_text()) == results[2].to_dict()
    assert sorted(os.listdir(tmp_path)) == ["new", "result.json"]
    assert os.listdir(tmp_path / "new") == ["result.json"]
    # The file is readable like any other, not owner-only as mkstemp would leave it.
    assert (tmp_path / "new" / "result.json").stat().st_mode & 0o044


def test_lanczos_result_helpers(results):
    lan = results[1]
    assert isinstance(lan, LanczosResult)
    t = lan.tridiagonal()
    assert t.shape == (lan.num_steps_taken, lan.num_steps_taken)
    np.testing.assert_allclose(lan.ritz_values(), np.linalg.eigvalsh(t), atol=1e-12)


def test_to_json_is_strict_json_with_the_reasons_for_nulls(tmp_path):
    # One probe has no sampling error bar: its standard error is NaN, written as null.
    single = spectral_density(random_symmetric(30, seed=2), num_steps=8, num_probes=1)
    moments = single.moments(2)
    assert np.isnan(moments.stderr).all()
    path = tmp_path / "moments.json"
    text = moments.to_json(path)

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    data = json.loads(path.read_text(), parse_constant=refuse)
    assert data == json.loads(text, parse_constant=refuse)
    assert data["stderr"] == [None, None, None]
    assert set(data["null_values"]) == {"stderr[0]", "stderr[1]", "stderr[2]"}
    assert all(reason.startswith("NaN") for reason in data["null_values"].values())
    np.testing.assert_allclose(data["estimate"], moments.estimate)


CLASSES = [
    "EigenResult",
    "LanczosResult",
    "TraceResult",
    "FrobeniusResult",
    "DiagonalResult",
    "DensityCurve",
    "SpectralMoments",
    "SpectralDensity",
    "SpectralMass",
    "LogSpectralDensity",
    "LogDetResult",
    "InverseSolve",
    "LayerwiseResult",
    "GradientOverlapResult",
    "LandscapeResult",
    "CommandReport",
    "AnalysisReport",
    "LandscapeReport",
    "RepeatResult",
    "SharpnessReport",
]


# Array fields that hold other dtypes than float64, as the estimators produce them.
INT_ARRAYS = {"steps_taken", "orders", "seeds", "subset_sizes", "iterations"}


BOOL_ARRAYS = {"converged"}


# Any float, the non-finite ones included (strict JSON writes them as null).
FLOATS = st.floats(allow_nan=True, allow_infinity=True)


KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)


INTS = st.integers(-(2**53), 2**53)


SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=8))


JSONISH = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=3)),
    max_leaves=8,
)


def _array(name: str) -> st.SearchStrategy[np.ndarray]:
    if name in BOOL_ARRAYS:
        dtype, elements = np.bool_, st.booleans()
    elif name in INT_ARRAYS:
        dtype, elements = np.int64, st.integers(-(2**40), 2**40)
    else:
        dtype, elements = np.float64, FLOATS
    shapes = hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=4)
    return hnp.arrays(dtype, shapes, elements=elements)


def _strategy(annotation: str, name: str) -> st.SearchStrategy:
    """Values of a field from its annotation (the string ``from __future__`` leaves)."""
    if annotation.endswith(" | None"):
        return st.one_of(st.none(), _strategy(annotation.removesuffix(" | None"), name))
    simple = {
        "float": FLOATS,
        "int": INTS,
        "bool": st.booleans(),
        "str": st.text(max_size=10),
        "np.ndarray": _array(name),
        "list[str]": st.lists(st.text(max_size=5), max_size=3),
        "list[int]": st.lists(INTS, max_size=3),
        "list[np.ndarray]": st.lists(_array(name), max_size=3),
        "dict[str, np.ndarray]": st.dictionaries(KEYS, _array(name), max_size=3),
        "dict[str, str]": st.dictionaries(KEYS, st.text(max_size=5), max_size=3),
        "dict[str, float]": st.dictionaries(KEYS, FLOATS, max_size=3),
        "dict[str, int]": st.dictionaries(KEYS, INTS, max_size=3),
        "dict[str, Any]": st.dictionaries(KEYS, JSONISH, max_size=3),
        "list[dict[str, Any]]": st.lists(st.dictionaries(KEYS, JSONISH, max_size=3), max_size=2),
        "Any": st.one_of(JSONISH, st.deferred(lambda: results_of("LandscapeResult"))),
    }
    if annotation in simple:
        return simple[annotation]
    return st.deferred(lambda: results_of(annotation))


def results_of(name: str) -> st.SearchStrategy[Result]:
    """Results of the class ``name`` with every field generated."""
    cls = _result_class(name)
    assert cls is not None, name
    fields = {spec.name: _strategy(str(spec.type), spec.name) for spec in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


def assert_same(loaded, original, where: str = "") -> None:
    """Equal field by field: arrays with the dtype written (float64 for an empty one) and
    NaN in the same places; nested results and containers recursively."""
    assert type(loaded) is type(original), where
    if isinstance(original, Result):
        for spec in dataclasses.fields(original):
            assert_same(
                getattr(loaded, spec.name), getattr(original, spec.name), f"{where}.{spec.name}"
            )
    elif isinstance(original, np.ndarray):
        np.testing.assert_array_equal(loaded, original, err_msg=where)
        assert loaded.shape == original.shape, where
        assert loaded.dtype == original.dtype, where
    elif isinstance(original, dict):
        assert list(loaded) == list(original), where
        for key in original:
            assert_same(loaded[key], original[key], f"{where}.{key}")
    elif isinstance(original, (list, tuple)):
        assert len(loaded) == len(original), where
        for index, (a, b) in enumerate(zip(loaded, original)):
            assert_same(a, b, f"{where}[{index}]")
    elif isinstance(original, float) and math.isnan(original):
        assert isinstance(loaded, float) and math.isnan(loaded), where
    else:
        assert loaded == original, where
        assert type(loaded) is type(original), where


# ----------------------------------------------------------------- valid results, by the rules
# The shapes and values each class must have are read from result_validation's tables
# (_ARRAYS: dimensions and values; _AGREE: lengths that must agree); the rules written as code
# there (_CHECKS) are followed by the fix-ups below, one per class.
FINITE = st.floats(allow_nan=False, allow_infinity=False)


# Not negative: +inf (a bound not found) and NaN (one not computed) are allowed.
BOUNDS = st.one_of(st.floats(min_value=0.0), st.just(math.nan))


SIDES = st.integers(1, 4)


def _rule_array(spec, shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    """Arrays of ``shape`` that the rule ``spec`` (a result_validation ``_Array``) accepts."""
    if spec.kind == "b":
        return hnp.arrays(np.bool_, shape, elements=st.booleans())
    if spec.kind == "i":
        return hnp.arrays(np.int64, shape, elements=st.integers(-(2**40), 2**40))
    elements = {rules._FINITE: FINITE, rules._BOUND: BOUNDS}.get(spec.values, FLOATS)
    return hnp.arrays(np.float64, shape, elements=elements)


def _valid_field(draw, cls_name: str, annotation: str, name: str, lengths: dict) -> object:
    """A value of the field ``name`` that its class's rules accept; ``lengths`` maps
    (field, axis) to the length drawn for its agreement group."""
    if annotation.endswith(" | None"):
        if draw(st.booleans()):
            return None
        annotation = annotation.removesuffix(" | None")
    spec = rules._ARRAYS.get(cls_name, {}).get(name)
    if annotation == "np.ndarray" and spec is not None:
        shape = tuple(lengths.get((name, axis)) or draw(SIDES) for axis in range(spec.ndim))
        return draw(_rule_array(spec, shape))
    if annotation.startswith("list[") and (name, 0) in lengths:
        size = lengths[(name, 0)]
        item = _strategy(annotation[5:-1], name)
        return draw(st.lists(item, min_size=size, max_size=size))
    if annotation == "Any":
        return draw(st.one_of(JSONISH, valid_results_of("LandscapeResult")))
    if _result_class(annotation) is not None:
        return draw(valid_results_of(annotation))
    return draw(_strategy(annotation, name))


def _fix_lanczos(draw, fields: dict) -> None:
    size = fields["alpha"].size
    fields["beta"] = draw(hnp.arrays(np.float64, (max(size - 1, 0),), elements=FLOATS))
    if fields["basis"] is not None:
        rows = fields["basis"].shape[0]
        fields["basis"] = draw(hnp.arrays(np.float64, (rows, size), elements=FLOATS))


def _fix_layerwise(draw, fields: dict) -> None:
    names = ("eigenvalues", "error_bounds", "residual_norms", "converged")
    for i in range(len(fields["groups"])):
        size = draw(SIDES)
        for name in names:
            fields[name][i] = draw(_rule_array(rules._EIGEN[name], (size,)))


def _fix_landscape_result(draw, fields: dict) -> None:
    size = fields["alphas"].size
    curve = hnp.arrays(np.float64, (size,), elements=FLOATS)
    fields["losses"] = draw(st.dictionaries(KEYS, curve, max_size=3))
    fields["base_loss"] = draw(FINITE)


def _fix_analysis_report(draw, fields: dict) -> None:
    fields["loss"] = draw(FINITE)


def _fix_landscape_report(draw, fields: dict) -> None:
    curves = st.one_of(st.none(), valid_results_of("LandscapeResult"))
    fields["curves"], fields["surface"] = draw(curves), draw(curves)
    if fields["curves"] is not None and fields["surface"] is not None:
        size = fields["curves"].alphas.size
        grid = draw(hnp.arrays(np.float64, (size, size), elements=FLOATS))
        fields["surface"] = dataclasses.replace(fields["surface"], losses_2d=grid)


def _done_checkpoint(draw, count: int) -> dict:
    """A measured checkpoint of sharpness.json with ``count`` eigenvalues."""
    keys = {**rules._DONE_ENTRY, **rules._DONE_ENTRY_OPTIONAL}
    entry = {key: draw(_strategy(a.split(" | ")[0], key)) for key, a in keys.items()}
    for key in ("eigenvalues", "error_bounds", "residual_norms", "converged"):
        entry[key] = draw(_rule_array(rules._EIGEN[key], (count,))).tolist()
    return {**entry, "status": "done"}


def _fix_sharpness_report(draw, fields: dict) -> None:
    for name in ("threshold", "dropped_threshold"):
        if fields[name] is not None:
            threshold = {key: draw(_strategy(a, key)) for key, a in rules._THRESHOLD.items()}
            threshold["value"] = draw(st.floats(min_value=1e-300, allow_infinity=False))
            fields[name] = threshold
    # Done checkpoints hold as many eigenvalues as each other and as settings["top_k"].
    count = draw(SIDES)
    if isinstance(fields["settings"].get("top_k"), int):
        fields["settings"]["top_k"] = count
    done = draw(st.integers(0, 2))
    fields["checkpoints"] += [_done_checkpoint(draw, count) for _ in range(done)]


FIX_UPS = {
    "LanczosResult": _fix_lanczos,
    "LayerwiseResult": _fix_layerwise,
    "LandscapeResult": _fix_landscape_result,
    "AnalysisReport": _fix_analysis_report,
    "LandscapeReport": _fix_landscape_report,
    "SharpnessReport": _fix_sharpness_report,
}


# Every class with a rule written as code has its fix-up.
assert set(rules._CHECKS) <= set(FIX_UPS)


@st.composite
def _valid_result(draw, name: str) -> Result:
    cls = _result_class(name)
    assert cls is not None, name
    lengths: dict[tuple[str, int], int] = {}
    for group in rules._AGREE.get(name, []):
        shared = [lengths[key] for key in group if key in lengths]
        size = shared[0] if shared else draw(SIDES)  # groups sharing a field share a length
        lengths.update({key: size for key in group})
    fields = {
        spec.name: _valid_field(draw, name, str(spec.type), spec.name, lengths)
        for spec in dataclasses.fields(cls)
    }
    if name in FIX_UPS:
        FIX_UPS[name](draw, fields)
    return cls(**fields)


def valid_results_of(name: str) -> st.SearchStrategy[Result]:
    """Results of the class ``name`` that loading accepts: fields that must agree in length
    drawn with one length, finite numbers and non-negative bounds where the rules ask."""
    return st.deferred(lambda: _valid_result(name))


SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _assert_round_trips(original: Result, path) -> None:
    original.to_json(path)
    assert_same(type(original).from_json(path), original)
    assert_same(load(path), original)
    assert_same(type(original).from_dict(original.to_dict()), original)


@pytest.mark.parametrize("name", CLASSES)
@settings(SETTINGS, max_examples=25)
@given(data=st.data())
def test_every_result_round_trips_through_its_json(name, data, tmp_path):
    """Every draw is a result loading accepts, and it comes back exactly."""
    _assert_round_trips(data.draw(valid_results_of(name)), tmp_path / f"{name}.json")


# Classes whose loading checks more than the fields' types.
CONSTRAINED = sorted(set(rules._ARRAYS) | set(rules._AGREE) | set(rules._CHECKS))


@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_independent_draws_are_refused_in_one_line_or_round_trip(data, tmp_path):
    """Fields drawn independently need not agree (an eigenvalue with two bounds, NaN for an
    eigenvalue): such a result is refused by both readers in one line, never half-read."""
    name = data.draw(st.sampled_from(CONSTRAINED))
    original = data.draw(results_of(name))
    path = tmp_path / f"{name}.json"
    try:
        type(original).from_dict(original.to_dict())
    except FieldError as error:
        original.to_json(path)
        with pytest.raises(FieldError) as refused:
            load(path)
        assert str(refused.value).startswith(f"{path}: {error.template.split('{0}')[0]}")
        assert "\n" not in str(refused.value)
        return
    _assert_round_trips(original, path)


def _eigen(**changes) -> EigenResult:
    fields = dict(
        eigenvalues=np.array([3.0, 2.0]),
        residual_norms=np.array([1e-9, np.inf]),
        error_bounds=np.array([np.nan, 1e-3]),
        converged=np.array([True, False]),
        which="largest",
        method="lanczos",
        num_products=12,
        num_operator_calls=3,
        wall_time=0.5,
        failure_probability=None,
        settings={"tol": 1e-6, "note": None},
    )
    return EigenResult(**{**fields, **changes})


def test_nan_and_inf_come_back_where_strict_json_wrote_null(tmp_path):
    path = tmp_path / "eig.json"
    _eigen().to_json(path)
    written = json.loads(path.read_text())
    assert written["error_bounds"] == [None, 0.001]
    assert written["null_values"] == {"error_bounds[0]": "NaN", "residual_norms[1]": "Infinity"}
    loaded = EigenResult.from_json(path)
    np.testing.assert_array_equal(loaded.error_bounds, [np.nan, 1e-3])
    np.testing.assert_array_equal(loaded.residual_norms, [1e-9, np.inf])
    assert loaded.converged.dtype == np.bool_ and loaded.eigenvalues.dtype == np.float64
    # None that was None stays None (not NaN): it is not in null_values.
    assert loaded.failure_probability is None and loaded.settings["note"] is None


def test_vectors_left_out_come_back_as_none():
    original = _eigen(eigenvectors=np.eye(2))
    assert EigenResult.from_dict(original.to_dict(include_vectors=False)).eigenvectors is None
    np.testing.assert_array_equal(EigenResult.from_dict(original.to_dict()).eigenvectors, np.eye(2))


def test_a_reloaded_density_plots():
    """The issue's case: SpectralDensity(**json) built, but plotting it failed on lists."""
    from spectra.plotting import plot_spectral_density

    density = SpectralDensity(
        nodes=np.array([[-1.0, 0.5, 2.0], [-0.5, 1.0, 1.0]]),
        weights=np.array([[0.2, 0.5, 0.3], [0.6, 0.4, 0.0]]),
        steps_taken=np.array([3, 2]),
        dimension=10,
        num_products=5,
        num_operator_calls=5,
        wall_time=0.1,
        settings={"num_steps": 3},
    )
    loaded = SpectralDensity.from_dict(json.loads(density.to_json()))
    assert loaded.steps_taken.dtype == np.int64
    np.testing.assert_array_equal(loaded.density().values, density.density().values)
    assert plot_spectral_density(loaded) is not None


@pytest.mark.parametrize(
    ("text", "cause"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", 'a JSON object with a "type" field is needed'),
        ('{"type": "Nonsense"}', "unknown result type 'Nonsense' (known: "),
        ('{"type": "TraceResult", "estimate": 1.0}', '"stderr" is missing: a TraceResult needs it'),
        (
            '{"type": "SpectralMoments", "orders": [0], "estimate": [1.0], "stderr": [0.0], '
            '"extra": 1}',
            '"extra" is not a field of a SpectralMoments',
        ),
        (
            '{"type": "SpectralMoments", "orders": "abc", "estimate": [1.0], "stderr": [0.0]}',
            "\"orders\" must be a list of numbers, got the text 'abc'",
        ),
        (
            '{"type": "SpectralMoments", "orders": [[0], [1, 2]], "estimate": [1.0], '
            '"stderr": [0.0]}',
            '"orders" must be a rectangular list of numbers',
        ),
        (
            '{"type": "SpectralMoments", "orders": [0], "estimate": [null], "stderr": [0.0], '
            '"null_values": {"estimate[3]": "NaN"}}',
            "'null_values' names 'estimate[3]', which is not in the file",
        ),
    ],
)
def test_bad_files_are_refused_in_one_line_naming_path_and_cause(tmp_path, text, cause):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and cause in message and "\n" not in message


def test_from_json_of_another_class_and_from_dict_of_another_type(tmp_path):
    path = tmp_path / "eig.json"
    _eigen().to_json(path)
    with pytest.raises(ValueError, match=r"eig\.json: holds a EigenResult, not a TraceResult"):
        results_module.TraceResult.from_json(path)
    with pytest.raises(ValueError, match="describes a EigenResult, not a TraceResult"):
        results_module.TraceResult.from_dict(_eigen().to_dict())
    with pytest.raises(TypeError, match="TraceResult.from_dict needs a dictionary, got list"):
        results_module.TraceResult.from_dict([])
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.json")
