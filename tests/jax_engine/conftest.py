"""The JAX engine's tests run under ``KERAS_BACKEND=jax`` only (the environment without
TensorFlow, ``.venv-jax``); under another backend each module is skipped unread, so that
the TensorFlow suite imports no JAX."""

from __future__ import annotations

import os

import pytest

from spectra._backend import configured_backend

BACKEND = configured_backend()
REASON = f"the JAX engine's tests need KERAS_BACKEND=jax (this run's Keras backend: {BACKEND})"

if BACKEND != "jax":

    class _Skipped(pytest.Module):
        def _getobj(self):  # the module is never imported
            pytest.skip(REASON, allow_module_level=True)

    def pytest_pycollect_makemodule(module_path, parent):
        return _Skipped.from_parent(parent, path=module_path)

else:
    # The tests compile about 90 small functions, and compiling is most of their time: at
    # XLA's backend optimization level 0 (LLVM's code generation unoptimized; the same
    # operations, so the same results to rounding) the run takes about 35 s of CPU on this
    # project's machine instead of 52 s. Set before JAX starts its backend.
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_backend_optimization_level=0".strip()

    @pytest.fixture(autouse=True)
    def _seeded():
        """Seed Python, NumPy and Keras (initializers, dropout) without TensorFlow."""
        from spectra import _jax_compat

        _jax_compat.set_random_seed(1234)
        yield


if BACKEND == "jax":

    @pytest.fixture(scope="session")
    def tanh_mlp():
        """The classifier most tests share (so that they share compiled functions): the
        downcast case, tanh (which Keras 3.15 on JAX computes in float32 for float64),
        its weights, and 20 examples (batches of 7 leave a short last one)."""
        from _jax_models import classification_data, mlp, weights

        from spectra import _jax_compat

        _jax_compat.set_random_seed(3)
        model = mlp("tanh")
        x, y = classification_data(20)
        params = weights(model)
        return model, x, y, params, [p.shape for p in params]
