"""The operators of Keras models on Keras' JAX backend (no TensorFlow import).

Under ``KERAS_BACKEND=jax``, ``spectra.HessianOperator``, ``GGNOperator``,
``FisherOperator``, ``JacobianOperator`` and ``TransposedJacobianOperator`` are the
classes of this package (:mod:`spectra._backend`): same names, same ``from_keras``
keywords and public attributes as the TensorFlow operators, same matrices (the same
``.keras`` file gives the same products on both engines; ``tests/jax_engine`` checks it
against stored TensorFlow products). The estimators see a ``LinearOperator`` and are the same.

Modules, one per concept: ``data`` (batches and their weights n_b/N), ``models`` (the
model and loss as pure functions of the parameter values, through Keras' stateless
scope), ``curvature`` (the hook: what a matrix caches per batch and how it multiplies),
``engine`` (the compiled functions, one compilation per batch shape), ``base`` (the
operator: snapshot, caching, blocks, counters), ``hessian``, ``ggn``, ``fisher`` (the
matrices) and ``jacobian`` (J and Jᵀ). Keras-on-JAX workarounds are in
:mod:`spectra._jax_compat` (float64, the logits behind softmax outputs, device memory,
seeds).

Products are compiled once per batch shape and function; see
:mod:`spectra.operators.jax.engine` for the costs of the cached product against a
gradient and of blocks, measured on this project's CPU.

Names are imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spectra.operators.jax.base import CurvatureOperator
    from spectra.operators.jax.fisher import EmpiricalFisher, FisherOperator, MonteCarloFisher
    from spectra.operators.jax.ggn import GGN, GGNOperator
    from spectra.operators.jax.hessian import Hessian, HessianOperator
    from spectra.operators.jax.jacobian import JacobianOperator, TransposedJacobianOperator

_SOURCE = {
    "CurvatureOperator": "spectra.operators.jax.base",
    "EmpiricalFisher": "spectra.operators.jax.fisher",
    "FisherOperator": "spectra.operators.jax.fisher",
    "MonteCarloFisher": "spectra.operators.jax.fisher",
    "GGN": "spectra.operators.jax.ggn",
    "GGNOperator": "spectra.operators.jax.ggn",
    "Hessian": "spectra.operators.jax.hessian",
    "HessianOperator": "spectra.operators.jax.hessian",
    "JacobianOperator": "spectra.operators.jax.jacobian",
    "TransposedJacobianOperator": "spectra.operators.jax.jacobian",
}

__all__ = [
    "GGN",
    "CurvatureOperator",
    "EmpiricalFisher",
    "FisherOperator",
    "GGNOperator",
    "Hessian",
    "HessianOperator",
    "JacobianOperator",
    "MonteCarloFisher",
    "TransposedJacobianOperator",
]


def __getattr__(name: str) -> Any:
    module = _SOURCE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
