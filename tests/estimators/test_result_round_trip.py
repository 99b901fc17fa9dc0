"""Every result class round-trips through its JSON: ``to_json`` then ``from_json`` (and
:func:`spectra.load`) gives the same dataclass, field by field, with numpy arrays of the
dtype written, NaN and ±inf where strict JSON wrote null; bad files are refused in one line
naming the path and the cause."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from spectra.estimators import results as results_module
from spectra.estimators.results import (
    EigenResult,
    Result,
    SpectralDensity,
    _result_class,
    load,
)
from spectra.io.result_validation import FieldError

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


@pytest.mark.parametrize("name", CLASSES)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_every_result_round_trips_through_its_json(name, data, tmp_path):
    original = data.draw(results_of(name))
    path = tmp_path / f"{name}.json"
    original.to_json(path)
    # Fields drawn independently need not agree (an eigenvalue with two bounds, NaN for an
    # eigenvalue): such a result is refused by both readers in one line, never half-read.
    try:
        type(original).from_dict(original.to_dict())
    except FieldError as error:
        with pytest.raises(FieldError) as refused:
            load(path)
        assert str(refused.value).startswith(f"{path}: {error.template.split('{0}')[0]}")
        assert "\n" not in str(refused.value)
        return
    assert_same(type(original).from_json(path), original)
    assert_same(load(path), original)
    assert_same(type(original).from_dict(original.to_dict()), original)


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
