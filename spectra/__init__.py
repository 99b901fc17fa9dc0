"""spectra: Hessian spectrum analysis for TensorFlow/Keras models.

The loss Hessian of a model, never formed, as a SciPy ``LinearOperator``
(:class:`HessianOperator`; also the generalized Gauss-Newton matrix, :class:`GGNOperator`,
and the Monte Carlo and empirical Fisher, :class:`FisherOperator`), and estimators that
read its spectrum through products: :func:`eigenvalues`, :func:`lanczos`, :func:`trace`,
:func:`diagonal`, :func:`spectral_density`, :func:`frobenius_norm`; per-layer spectra
(:func:`layerwise`), the optimizer-preconditioned Hessian (:func:`preconditioned`,
:func:`stability_threshold`) and subspace overlaps (:func:`subspace_overlap`,
:func:`gradient_overlap`). Estimators accept any symmetric ``LinearOperator`` (or a dense
array), so they run on plain matrices too.

The package is layered; each layer imports only from the ones before it:

* :mod:`spectra.io` — safe result files, checkpoints, datasets (no spectra imports);
* :mod:`spectra.operators` — curvature matrices and their TensorFlow engine, batching;
* :mod:`spectra.estimators` — NumPy/SciPy numerics over any ``LinearOperator`` and their
  results (no TensorFlow);
* :mod:`spectra.analysis` — what composes the two: per-layer spectra, preconditioning,
  stability thresholds, subspaces, loss landscapes, trajectories over checkpoints;
* :mod:`spectra.plotting`, :mod:`spectra.callback`, :mod:`spectra.cli` on top.

Names are imported on first use (PEP 562): ``import spectra`` and the NumPy-only
estimators do not import TensorFlow. The operators of Keras models come from the engine of
Keras' backend (:mod:`spectra._backend`): under ``KERAS_BACKEND=jax``,
``spectra.HessianOperator`` is the JAX engine's and TensorFlow is never imported; on
TensorFlow (the default) it imports TensorFlow, without TensorFlow's C++ start-up log
lines: ``import spectra`` raises ``TF_CPP_MIN_LOG_LEVEL`` to 3 (a higher value stays) and
makes the first import of TensorFlow quiet (:mod:`spectra._console`).
"""

from __future__ import annotations

import importlib
from typing import Any

from spectra._backend import module_for
from spectra._console import install_quiet_import
from spectra.operators.registry import operator_class_names

install_quiet_import()

__version__ = "0.1.0"

# The public names, one list per module. To export a new name, add it to its module's list.
_EXPORTS: dict[str, list[str]] = {
    "spectra._console": ["quiet_tensorflow"],
    "spectra.callback": ["SharpnessCallback"],
    "spectra.estimators.density": [
        "log_spectral_density",
        "spectral_density",
        "spectral_mass_below",
    ],
    "spectra.estimators.inverses": [
        "ConvergenceError",
        "ConvergenceWarning",
        "InverseOperator",
        "inverse",
    ],
    "spectra.estimators.log_determinant": ["logdet"],
    "spectra.estimators.stochastic_diagonal": ["diagonal", "xdiag"],
    "spectra.estimators.eigensolvers": ["eigenvalue_ratio", "eigenvalues"],
    "spectra.estimators.krylov": ["lanczos", "tridiagonal_eigh"],
    "spectra.analysis.landscape": ["loss_landscape", "random_direction"],
    "spectra.analysis.landscape_result": ["LandscapeResult"],
    "spectra.analysis.minibatch": ["MinibatchSharpness", "minibatch_sharpness"],
    "spectra.analysis.per_layer": ["LayerwiseResult", "layerwise"],
    "spectra.analysis.repeats": ["RepeatResult", "repeat_estimate", "subsample_indices"],
    # The operator classes of the registered curvature matrices (spectra.operators.registry).
    "spectra.operators": operator_class_names(),
    "spectra.operators.block_diagonal": ["BlockDiagonalOperator"],
    "spectra.operators.submatrix": ["SubmatrixOperator"],
    "spectra.operators.kfac": ["KFACOperator"],
    "spectra.operators.ekfac": ["EKFACOperator"],
    "spectra.operators.jacobian": ["JacobianOperator", "TransposedJacobianOperator"],
    "spectra.analysis.preconditioning": ["PreconditionedOperator", "preconditioned"],
    "spectra.estimators.results": [
        "DensityCurve",
        "DiagonalResult",
        "EigenResult",
        "FrobeniusResult",
        "InverseSolve",
        "LanczosResult",
        "LogDetResult",
        "LogSpectralDensity",
        "Result",
        "SpectralDensity",
        "SpectralMass",
        "SpectralMoments",
        "TraceResult",
    ],
    "spectra.reports.loading": ["load"],
    "spectra.analysis.stability": ["stability_threshold"],
    "spectra.analysis.subspaces": [
        "GradientOverlapResult",
        "gradient_overlap",
        "subspace_overlap",
    ],
    "spectra.estimators.stochastic_trace": [
        "frobenius_norm",
        "hutchinson_trace",
        "hutchpp_trace",
        "trace",
        "xtrace",
    ],
    "spectra.estimators.tridiagonal": ["gauss_quadrature"],
}

# Subpackages and modules reachable as attributes (``spectra.plotting``) without an import.
_SUBMODULES = (
    "analysis",
    "callback",
    "cli",
    "estimators",
    "io",
    "operators",
    "plotting",
    "reports",
)

_SOURCE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_SOURCE)


def __getattr__(name: str) -> Any:
    module = _SOURCE.get(name)
    if module is not None:
        # The operators of Keras models come from the engine of Keras' backend.
        module = module_for(name, module)
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})
