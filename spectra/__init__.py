"""spectra: Hessian spectrum analysis for TensorFlow/Keras models.

The loss Hessian of a model, never formed, as a SciPy ``LinearOperator``
(:class:`HessianOperator`), and estimators that read its spectrum through products:
:func:`eigenvalues`, :func:`lanczos`, :func:`trace`, :func:`diagonal`,
:func:`spectral_density`, :func:`frobenius_norm`. Estimators accept any symmetric
``LinearOperator`` (or a dense array), so they run on plain matrices too.
"""

from spectra.callback import SharpnessCallback
from spectra.density import negative_mass_fraction, spectral_density, spectral_mass_below
from spectra.diagonal import diagonal
from spectra.eigenvalues import eigenvalue_ratio, eigenvalues
from spectra.lanczos import lanczos, tridiagonal_eigh
from spectra.landscape import LandscapeResult, loss_landscape, random_direction
from spectra.operator import HessianOperator
from spectra.results import (
    DensityCurve,
    DiagonalResult,
    EigenResult,
    FrobeniusResult,
    LanczosResult,
    Result,
    SpectralDensity,
    SpectralMass,
    SpectralMoments,
    TraceResult,
)
from spectra.trace import frobenius_norm, hutchinson_trace, hutchpp_trace, trace, xtrace

__version__ = "0.1.0"

__all__ = [
    "DensityCurve",
    "DiagonalResult",
    "EigenResult",
    "FrobeniusResult",
    "HessianOperator",
    "LanczosResult",
    "LandscapeResult",
    "Result",
    "SharpnessCallback",
    "SpectralDensity",
    "SpectralMass",
    "SpectralMoments",
    "TraceResult",
    "diagonal",
    "eigenvalue_ratio",
    "eigenvalues",
    "frobenius_norm",
    "hutchinson_trace",
    "hutchpp_trace",
    "lanczos",
    "loss_landscape",
    "negative_mass_fraction",
    "random_direction",
    "spectral_density",
    "spectral_mass_below",
    "trace",
    "tridiagonal_eigh",
    "xtrace",
]
