"""Symmetric tridiagonal eigenproblems and the Gauss quadrature they define.

A leaf module (numpy/scipy only): :mod:`spectra.lanczos`, :mod:`spectra.estimators.density` and
:mod:`spectra.estimators.results` all read Lanczos tridiagonals through it.

For the Jacobi matrix T_m of a unit vector q and a symmetric A (the Lanczos
tridiagonal), the eigenvalues θ_i of T_m and the squared first components w_i of its
eigenvectors are the nodes and weights of the m-point Gauss quadrature of the
spectral measure of q: ``qᵀ f(A) q ≈ Σ_i w_i f(θ_i)``, exact for polynomials f of
degree < 2m (Golub & Meurant, "Matrices, Moments and Quadrature with Applications",
2010, ch. 6).
"""

from __future__ import annotations

from typing import Literal, overload

import numpy as np
from scipy.linalg import eigh_tridiagonal

__all__ = ["gauss_quadrature", "tridiagonal_eigh"]


@overload
def tridiagonal_eigh(
    alpha: np.ndarray, beta: np.ndarray, eigenvectors: Literal[True] = ...
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def tridiagonal_eigh(
    alpha: np.ndarray, beta: np.ndarray, eigenvectors: Literal[False]
) -> tuple[np.ndarray, None]: ...
@overload
def tridiagonal_eigh(
    alpha: np.ndarray, beta: np.ndarray, eigenvectors: bool
) -> tuple[np.ndarray, np.ndarray | None]: ...
def tridiagonal_eigh(
    alpha: np.ndarray, beta: np.ndarray, eigenvectors: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """Eigen-decomposition of the symmetric tridiagonal matrix (alpha, beta).

    Returns ascending eigenvalues θ and, if requested, the orthonormal
    eigenvectors as columns S (T = S diag(θ) Sᵀ). Uses LAPACK's ``stemr`` via
    ``scipy.linalg.eigh_tridiagonal``; O(m²) work.
    """
    alpha = np.asarray(alpha, dtype=np.float64)
    beta = np.asarray(beta, dtype=np.float64)
    if alpha.ndim != 1 or alpha.shape[0] < 1 or beta.shape != (alpha.shape[0] - 1,):
        raise ValueError(
            f"need alpha of length m >= 1 and beta of length m - 1, got {alpha.shape}, {beta.shape}"
        )
    if not eigenvectors:
        return eigh_tridiagonal(alpha, beta, eigvals_only=True), None
    theta, vectors = eigh_tridiagonal(alpha, beta)
    return theta, vectors


def gauss_quadrature(alpha: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nodes (ascending) and weights (summing to 1) of the Gauss rule of a Jacobi matrix."""
    theta, vectors = tridiagonal_eigh(alpha, beta)
    return theta, vectors[0] ** 2
