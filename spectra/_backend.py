"""The Keras backend the operators of Keras models run on (TensorFlow or JAX).

Keras fixes its backend when it is first imported (``KERAS_BACKEND``, else
``~/.keras/keras.json``, else TensorFlow), so within a process every model has the same
one. The operators of models — :class:`~spectra.HessianOperator`,
:class:`~spectra.GGNOperator`, :class:`~spectra.FisherOperator`,
:class:`~spectra.JacobianOperator` — come from that backend's engine: ``spectra.operators``
(TensorFlow, the default) or ``spectra.operators.jax`` (JAX, no TensorFlow import). The
estimators see only a ``LinearOperator`` and are the same on both.

Importing this module imports nothing; :func:`keras_backend` imports Keras (which, on the
TensorFlow backend, imports TensorFlow).
"""

from __future__ import annotations

__all__ = [
    "BACKEND_NAMES",
    "JAX_OPERATORS",
    "SUPPORTED_BACKENDS",
    "TENSORFLOW_ONLY",
    "configured_backend",
    "keras_backend",
    "module_for",
]

#: The Keras backends with an engine.
SUPPORTED_BACKENDS = ("tensorflow", "jax")
#: Where the operators of Keras models come from on JAX.
JAX_OPERATORS = "spectra.operators.jax"
#: The public names whose class depends on the backend (each engine defines all of them).
BACKEND_NAMES = frozenset(
    {
        "FisherOperator",
        "GGNOperator",
        "HessianOperator",
        "JacobianOperator",
        "TransposedJacobianOperator",
    }
)

#: Public names that run on the TensorFlow backend only, for now.
TENSORFLOW_ONLY = frozenset({"EKFACOperator", "KFACOperator"})


def configured_backend() -> str:
    """The backend Keras has or will choose, read without importing Keras: Keras' own
    answer once it is imported, else ``KERAS_BACKEND``, else the ``backend`` of
    ``$KERAS_HOME/keras.json`` (``~/.keras/keras.json``), else ``"tensorflow"``, as Keras
    decides at its import."""
    import json
    import os
    import sys

    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "backend"):
        return str(keras.backend.backend())
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return str(json.load(f).get("backend", "tensorflow"))
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def keras_backend() -> str:
    """``keras.backend.backend()``: ``"tensorflow"`` or ``"jax"``; a one-line
    ``RuntimeError`` for a backend without an engine (PyTorch)."""
    import keras

    name = str(keras.backend.backend())
    if name not in SUPPORTED_BACKENDS:
        raise RuntimeError(
            f"spectra's operators run on Keras' TensorFlow and JAX backends; this process "
            f"has KERAS_BACKEND={name!r}. Set KERAS_BACKEND=tensorflow or jax before Keras "
            "is first imported."
        )
    return name


def module_for(name: str, tensorflow_module: str) -> str:
    """The module that defines ``name`` on the current backend: ``tensorflow_module`` on
    TensorFlow and for names that do not depend on the backend, :data:`JAX_OPERATORS`
    for the operators of models on JAX; an ``AttributeError`` saying so for a name that
    runs on TensorFlow only (:data:`TENSORFLOW_ONLY`)."""
    if name not in BACKEND_NAMES and name not in TENSORFLOW_ONLY:
        return tensorflow_module
    if keras_backend() != "jax":
        return tensorflow_module
    if name in TENSORFLOW_ONLY:
        raise AttributeError(
            f"spectra.{name} runs on Keras' TensorFlow backend only for now; this process "
            "has KERAS_BACKEND=jax. Run it with KERAS_BACKEND=tensorflow (the same .keras "
            "file loads under either backend)."
        )
    return JAX_OPERATORS
