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

Names are imported on first use: ``import spectra`` and the NumPy-only estimators do not
import TensorFlow; ``spectra.HessianOperator`` does. Submodules (``spectra.plotting``,
``spectra.checkpoints``, ``spectra.trajectory``, …) are attributes too.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# The public names, one list per module. To export a new name, add it to its module's list.
_EXPORTS: dict[str, list[str]] = {
    "spectra._console": ["quiet_tensorflow"],
    "spectra.callback": ["SharpnessCallback"],
    "spectra.density": ["spectral_density", "spectral_mass_below"],
    "spectra.diagonal": ["diagonal"],
    "spectra.eigenvalues": ["eigenvalue_ratio", "eigenvalues"],
    "spectra.lanczos": ["lanczos", "tridiagonal_eigh"],
    "spectra.landscape": ["LandscapeResult", "loss_landscape", "random_direction"],
    "spectra.layerwise": ["LayerwiseResult", "layerwise"],
    "spectra.operators": ["FisherOperator", "GGNOperator", "HessianOperator"],
    "spectra.preconditioned": ["PreconditionedOperator", "preconditioned"],
    "spectra.results": [
        "DensityCurve",
        "DiagonalResult",
        "EigenResult",
        "FrobeniusResult",
        "LanczosResult",
        "Result",
        "SpectralDensity",
        "SpectralMass",
        "SpectralMoments",
        "TraceResult",
    ],
    "spectra.stability": ["stability_threshold"],
    "spectra.subspace": ["GradientOverlapResult", "gradient_overlap", "subspace_overlap"],
    "spectra.trace": ["frobenius_norm", "hutchinson_trace", "hutchpp_trace", "trace", "xtrace"],
    "spectra.tridiagonal": ["gauss_quadrature"],
}

# Submodules reachable as attributes (``spectra.plotting``) without an explicit import.
_SUBMODULES = (
    "callback",
    "checkpoints",
    "cli",
    "datasets",
    "landscape",
    "operators",
    "plotting",
    "results",
    "stability",
    "trajectory",
)

_SOURCE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_SOURCE)


def __getattr__(name: str) -> Any:
    module = _SOURCE.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})


class _Package(types.ModuleType):
    """The package module: a public function keeps its name when its submodule is imported.

    Importing a submodule binds it to the package under its name, so a later
    ``import spectra.trace`` would replace the function ``spectra.trace`` with the module
    ``spectra/trace.py``. Exported names are kept.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _SOURCE:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
