"""spectra: Hessian spectrum analysis for TensorFlow/Keras models.

The loss Hessian of a model, never formed, as a SciPy ``LinearOperator``
(:class:`HessianOperator`), and estimators that read its spectrum through products:
:func:`eigenvalues`, :func:`lanczos`, :func:`trace`, :func:`diagonal`,
:func:`spectral_density`, :func:`frobenius_norm`; per-layer spectra (:func:`layerwise`),
the optimizer-preconditioned Hessian (:func:`preconditioned`, :func:`stability_threshold`)
and subspace overlaps (:func:`subspace_overlap`, :func:`gradient_overlap`). Estimators
accept any symmetric ``LinearOperator`` (or a dense array), so they run on plain matrices
too.
"""

from spectra.callback import SharpnessCallback
from spectra.density import negative_mass_fraction, spectral_density
from spectra.diagonal import diagonal
from spectra.eigenvalues import eigenvalue_ratio, eigenvalues
from spectra.lanczos import lanczos, tridiagonal_eigh
from spectra.landscape import LandscapeResult, loss_landscape, random_direction
from spectra.layerwise import LayerwiseResult, layerwise
from spectra.operator import HessianOperator
from spectra.preconditioned import PreconditionedOperator, preconditioned
from spectra.results import (
    DensityCurve,
    DiagonalResult,
    EigenResult,
    FrobeniusResult,
    LanczosResult,
    Result,
    SpectralDensity,
    SpectralMoments,
    TraceResult,
)
from spectra.stability import stability_threshold
from spectra.subspace import GradientOverlapResult, gradient_overlap, subspace_overlap
from spectra.trace import frobenius_norm, hutchinson_trace, hutchpp_trace, trace, xtrace

__version__ = "0.1.0"

__all__ = [
    "DensityCurve",
    "DiagonalResult",
    "EigenResult",
    "FrobeniusResult",
    "GradientOverlapResult",
    "HessianOperator",
    "LanczosResult",
    "LandscapeResult",
    "LayerwiseResult",
    "PreconditionedOperator",
    "Result",
    "SharpnessCallback",
    "SpectralDensity",
    "SpectralMoments",
    "TraceResult",
    "diagonal",
    "eigenvalue_ratio",
    "eigenvalues",
    "frobenius_norm",
    "gradient_overlap",
    "hutchinson_trace",
    "hutchpp_trace",
    "lanczos",
    "layerwise",
    "loss_landscape",
    "negative_mass_fraction",
    "preconditioned",
    "random_direction",
    "spectral_density",
    "stability_threshold",
    "subspace_overlap",
    "trace",
    "tridiagonal_eigh",
    "xtrace",
]
