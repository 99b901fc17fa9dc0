"""How much of a vector lies in a subspace: overlaps with eigenspaces.

``subspace_overlap(v, B) = ‖Qᵀv‖²/‖v‖²`` with Q an orthonormal basis of span(B): the
squared cosine of the angle between v and the subspace, 1 for v in it, 0 for v
orthogonal to it. Gur-Ari, Roberts & Dyer (2018, "Gradient descent happens in a tiny
subspace") found that after a short initial phase the gradient of a C-class classifier
lies mostly in the span of the top-C eigenvectors of the Hessian
(:func:`gradient_overlap`). The overlap of consecutive top eigenvectors tracks how the
sharpest direction rotates during training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from spectra.estimators.eigensolvers import eigenvalues
from spectra.estimators.results import Result

if TYPE_CHECKING:
    from scipy.sparse.linalg import LinearOperator

__all__ = ["GradientOverlapResult", "gradient_overlap", "orthonormal_basis", "subspace_overlap"]


def _as_columns(name: str, array: ArrayLike) -> np.ndarray:
    try:
        values = np.asarray(array, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a real array, got {type(array).__name__}") from error
    if values.ndim == 1:
        values = values[:, None]
    if values.ndim != 2 or values.shape[0] == 0 or values.shape[1] == 0:
        raise ValueError(
            f"{name} must have shape (n,) or (n, m) with n, m >= 1, got {np.shape(array)}"
        )
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{name} contains NaN or Inf")
    return values


def orthonormal_basis(basis: ArrayLike) -> np.ndarray:
    """Orthonormal columns spanning the columns of ``basis`` (n,) or (n, r), by SVD.

    Singular values below ``max(n, r)·eps·σ_max`` count as zero (numpy's ``matrix_rank``
    rule), so a rank-deficient basis (repeated or dependent columns) gives fewer
    columns: its numerical rank. A zero basis spans nothing and is refused.
    """
    columns = _as_columns("basis", basis)
    left, singular, _ = np.linalg.svd(columns, full_matrices=False)
    if not singular[0] > 0:
        raise ValueError("basis is zero: it spans no subspace")
    cutoff = max(columns.shape) * np.finfo(np.float64).eps * singular[0]
    return left[:, singular > cutoff]


def subspace_overlap(vectors: ArrayLike, basis: ArrayLike) -> np.ndarray:
    """Fraction ``‖Qᵀv‖²/‖v‖²`` of each vector in span(basis), in [0, 1].

    ``vectors`` has shape (n,) or (n, m) (one vector per column), ``basis`` (n,) or
    (n, r); Q is an orthonormal basis of span(basis) from an SVD (a rank-deficient basis
    counts with its numerical rank, see :func:`orthonormal_basis`). Returns an array of
    shape (m,), or a 0-d array for a single vector. Zero or non-finite vectors, a zero
    basis and mismatched lengths are refused. Cost: O(n r²) for the SVD, O(n r m) after.
    """
    single = np.ndim(vectors) == 1
    columns = _as_columns("vectors", vectors)
    q = orthonormal_basis(basis)
    if q.shape[0] != columns.shape[0]:
        raise ValueError(
            f"vectors have length {columns.shape[0]} but the basis vectors {q.shape[0]}"
        )
    norms = np.linalg.norm(columns, axis=0)
    if not np.all(norms > 0):
        zero = np.flatnonzero(~(norms > 0)).tolist()
        raise ValueError(f"vectors {zero} are zero: their overlap is undefined")
    projected = np.linalg.norm(q.T @ (columns / norms), axis=0) ** 2
    overlaps = np.clip(projected, 0.0, 1.0)
    return np.asarray(overlaps[0]) if single else overlaps


@dataclass
class GradientOverlapResult(Result):
    """The fraction of the gradient in the span of the top-k Hessian eigenvectors.

    ``overlap`` = ‖Vᵀg‖²/‖g‖² for the k unit eigenvectors V (orthonormalized), and
    ``per_direction[i]`` = (v_iᵀg)²/‖g‖² (they sum to ``overlap`` for orthonormal V).
    ``eigenvalues``, ``error_bounds`` and ``converged`` are those of the eigenvalue run;
    an unconverged subspace makes the overlap that of a nearby subspace.
    """

    overlap: float
    per_direction: np.ndarray
    eigenvalues: np.ndarray
    error_bounds: np.ndarray
    converged: np.ndarray
    gradient_norm: float
    num_products: int
    num_operator_calls: int
    wall_time: float
    settings: dict[str, Any] = field(default_factory=dict)


def gradient_overlap(
    op: LinearOperator,
    k: int = 10,
    *,
    tol: float = 1e-6,
    max_products: int | None = None,
    seed: int | np.random.Generator | None = 0,
    progress: bool | None = None,
) -> GradientOverlapResult:
    """Fraction of the gradient ``op.gradient()`` in the top-k eigenspace of ``op``
    (Gur-Ari, Roberts & Dyer 2018), with k the number of classes in their setting.

    The eigenvectors come from ``spectra.eigenvalues(op, k, tol=tol, ...)`` (Lanczos, the
    k largest eigenvalues); cost: that run's products, and the gradient from the
    operator's first data pass. ``op`` needs a ``gradient()`` method (a
    :class:`~spectra.HessianOperator`, or a preconditioned one). ``progress``: that of
    :func:`spectra.eigenvalues` (None: a bar on a terminal for runs longer than ~2 s;
    True: at once; False: none).
    """
    started = time.perf_counter()
    gradient_method = getattr(op, "gradient", None)
    if not callable(gradient_method):
        raise TypeError(
            f"{type(op).__name__} has no gradient(): use an operator built from a loss "
            "(HessianOperator), or subspace_overlap(gradient, eigenvectors) directly"
        )
    gradient = np.asarray(gradient_method(), dtype=np.float64).reshape(-1)
    gradient_norm = float(np.linalg.norm(gradient))
    if not np.isfinite(gradient_norm):
        raise ValueError("the gradient contains NaN or Inf")
    if gradient_norm == 0:
        raise ValueError("the gradient is zero: its overlap with any subspace is undefined")
    top = eigenvalues(
        op,
        k=k,
        tol=tol,
        max_products=max_products,
        return_eigenvectors=True,
        seed=seed,
        progress=progress,
    )
    vectors = top.eigenvectors
    assert vectors is not None  # return_eigenvectors=True
    unit = gradient / gradient_norm
    per_direction = (vectors.T @ unit) ** 2
    return GradientOverlapResult(
        overlap=float(subspace_overlap(unit, vectors)),
        per_direction=per_direction,
        eigenvalues=top.eigenvalues,
        error_bounds=top.error_bounds,
        converged=top.converged,
        gradient_norm=gradient_norm,
        num_products=top.num_products,
        num_operator_calls=top.num_operator_calls,
        wall_time=time.perf_counter() - started,
        settings={**top.settings, "k": k, "tol": tol},
    )
