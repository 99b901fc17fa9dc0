import json
import os

import numpy as np
import pytest
from _matrices import random_symmetric, single_blas_thread

from spectra.estimators.density import spectral_density
from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.krylov import lanczos
from spectra.estimators.results import EigenResult, LanczosResult
from spectra.estimators.stochastic_diagonal import diagonal
from spectra.estimators.stochastic_trace import frobenius_norm, trace


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
