"""The operators of Keras models come from the engine of Keras' backend (spectra._backend)."""

from __future__ import annotations

import sys

import keras
import pytest

import spectra
from spectra import _backend


def test_tensorflow_backend_gives_the_tensorflow_operators() -> None:
    assert _backend.keras_backend() == "tensorflow"
    from spectra.operators.hessian import HessianOperator
    from spectra.operators.jacobian import JacobianOperator

    assert spectra.HessianOperator is HessianOperator
    assert spectra.operators.JacobianOperator is JacobianOperator
    assert spectra.KFACOperator.__module__ == "spectra.operators.kfac"
    # names that do not depend on the backend never ask Keras which it is
    assert _backend.module_for("eigenvalues", "m") == "m"


def test_every_backend_name_is_exported() -> None:
    assert _backend.BACKEND_NAMES <= set(spectra.__all__)
    assert _backend.TENSORFLOW_ONLY <= set(spectra.__all__)
    assert not _backend.BACKEND_NAMES & _backend.TENSORFLOW_ONLY


def test_jax_backend_routes_to_the_jax_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    assert _backend.module_for("HessianOperator", "tf") == _backend.JAX_OPERATORS
    assert _backend.module_for("trace", "spectra.estimators.stochastic_trace") == (
        "spectra.estimators.stochastic_trace"
    )
    with pytest.raises(AttributeError, match=r"KFACOperator runs on Keras' TensorFlow backend"):
        _backend.module_for("KFACOperator", "spectra.operators.kfac")


def test_a_backend_without_an_engine_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(RuntimeError, match=r"KERAS_BACKEND='torch'.*tensorflow or jax"):
        _backend.module_for("HessianOperator", "spectra.operators.hessian")


def test_configured_backend_is_read_as_keras_reads_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    assert _backend.configured_backend() == "tensorflow"  # Keras' own answer, imported
    monkeypatch.delitem(sys.modules, "keras")
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    assert _backend.configured_backend() == "jax"
    monkeypatch.delenv("KERAS_BACKEND")
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    assert _backend.configured_backend() == "tensorflow"  # no keras.json
    (tmp_path / "keras.json").write_text('{"backend": "jax", "floatx": "float32"}')
    assert _backend.configured_backend() == "jax"
    (tmp_path / "keras.json").write_text("not json")
    assert _backend.configured_backend() == "tensorflow"
