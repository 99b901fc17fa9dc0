"""Curvature matrices of a loss as SciPy ``LinearOperator`` objects.

:class:`CurvatureOperator` (``base``) owns the snapshot of the weights, batches, caching,
blocks, replicas, counters, flattening and the one ``from_keras``; each matrix is one
module supplying a :class:`Curvature` (``curvature``): what is differentiated.
:class:`HessianOperator` (``hessian``) is the loss Hessian, :class:`GGNOperator`
(``ggn``) the generalized Gauss-Newton matrix and :class:`FisherOperator` (``fisher``)
the Monte Carlo and empirical Fisher matrices; ``registry`` lists them (one line each)
for the API and the CLI. :class:`KFACOperator` (``kfac``) is their Kronecker-factored
approximation for Dense, Conv1D, Conv2D and Embedding layers (K-FAC; EKFAC with
:class:`EKFACOperator`), whose spectrum is exact. The compiled machinery is in
``engine``; batches and their weights in ``batching``, devices and workers in
``replicas``, Keras models and losses in ``keras_models``, and the checks of data
against a model in ``data_checks``.
Structured views of any operator (NumPy only): the block-diagonal approximation
:class:`BlockDiagonalOperator` (``block_diagonal``; per layer by default) and the
submatrix :class:`SubmatrixOperator` (``submatrix``). The Jacobian of the model's outputs
and its transpose, :class:`JacobianOperator` and :class:`TransposedJacobianOperator`
(``jacobian``), are rectangular operators of the output split (G = Jᵀ H_z J).

Names are imported on first use (PEP 562), so that ``spectra.operators.registry`` can be
read without importing TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spectra._backend import module_for
from spectra.operators.registry import CURVATURES, curvature_entry

if TYPE_CHECKING:
    from spectra.operators.base import CurvatureOperator, block_size_for
    from spectra.operators.block_diagonal import BlockDiagonalOperator, layer_groups
    from spectra.operators.curvature import BatchProblem, Curvature, CurvatureParts
    from spectra.operators.ekfac import EKFACOperator
    from spectra.operators.fisher import EmpiricalFisher, FisherOperator, MonteCarloFisher
    from spectra.operators.ggn import GGN, GGNOperator
    from spectra.operators.hessian import Hessian, HessianOperator
    from spectra.operators.jacobian import JacobianOperator, TransposedJacobianOperator
    from spectra.operators.kfac import KFACOperator
    from spectra.operators.kfac_blocks import KFACBlock
    from spectra.operators.submatrix import SubmatrixOperator

_SOURCE: dict[str, str] = {
    "CurvatureOperator": "spectra.operators.base",
    "block_size_for": "spectra.operators.base",
    "BlockDiagonalOperator": "spectra.operators.block_diagonal",
    "layer_groups": "spectra.operators.block_diagonal",
    "SubmatrixOperator": "spectra.operators.submatrix",
    "BatchProblem": "spectra.operators.curvature",
    "Curvature": "spectra.operators.curvature",
    "CurvatureParts": "spectra.operators.curvature",
    "EmpiricalFisher": "spectra.operators.fisher",
    "MonteCarloFisher": "spectra.operators.fisher",
    "GGN": "spectra.operators.ggn",
    "Hessian": "spectra.operators.hessian",
    "JacobianOperator": "spectra.operators.jacobian",
    "TransposedJacobianOperator": "spectra.operators.jacobian",
    "EKFACOperator": "spectra.operators.ekfac",
    "KFACBlock": "spectra.operators.kfac_blocks",
    "KFACOperator": "spectra.operators.kfac",
    # The operator classes, from the registry.
    **{entry.class_name: entry.operator.partition(":")[0] for entry in CURVATURES.values()},
}

__all__ = [
    "GGN",
    "BatchProblem",
    "BlockDiagonalOperator",
    "Curvature",
    "CurvatureOperator",
    "CurvatureParts",
    "EKFACOperator",
    "EmpiricalFisher",
    "FisherOperator",
    "GGNOperator",
    "Hessian",
    "HessianOperator",
    "JacobianOperator",
    "KFACBlock",
    "KFACOperator",
    "MonteCarloFisher",
    "SubmatrixOperator",
    "TransposedJacobianOperator",
    "block_size_for",
    "build_curvature_operator",
    "curvature_operator",
    "layer_groups",
]


def curvature_operator(name: str | None) -> Any:
    """The operator class of the registered matrix ``name`` (the Hessian for None) on
    Keras' backend (imported now, and TensorFlow or JAX with it); a one-line
    ``ValueError`` for a name that is not registered or a class this process cannot use
    (which the CLI reports as a usage error)."""
    entry = curvature_entry(name)
    try:
        found = globals().get(entry.class_name) or __getattr__(entry.class_name)
    except AttributeError as err:
        if entry.class_name in _SOURCE:  # known, but not on this backend: say why
            raise ValueError(f"--curvature {entry.name}: {err}") from None
        found = None
    if found is None or not callable(getattr(found, "from_keras", None)):
        raise ValueError(
            f"--curvature {entry.name} needs spectra.{entry.class_name}, which this build "
            "of spectra does not have; choose one of the others or update spectra."
        )
    return found


def build_curvature_operator(
    name: str | None, model: Any, loss: Any, data: Any, seed: int | None, **keywords: Any
) -> Any:
    """``curvature_operator(name).from_keras(model, loss, data, seed=seed, **keywords,
    **entry.options)``. The seed is required (None is explicit): it fixes the random
    draws (sampled labels, Dropout masks in training mode), so that the same command and
    seed give the same matrix in every process."""
    entry = curvature_entry(name)
    return curvature_operator(name).from_keras(
        model, loss, data, **keywords, **entry.options, seed=seed
    )


def __getattr__(name: str) -> Any:
    module = _SOURCE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # The operators of Keras models come from the engine of Keras' backend.
    value = getattr(importlib.import_module(module_for(name, module)), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
