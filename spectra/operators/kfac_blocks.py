"""K-FAC's blocks: one factored layer's Kronecker factors (:class:`KFACBlock`) and their
eigendecompositions (:func:`factor_eigen`, :func:`block_eigen`), which give K-FAC's and
EKFAC's exact spectrum, log-determinant and damped inverse (:mod:`spectra.operators.kfac`,
:mod:`spectra.operators.ekfac`). NumPy and SciPy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy.linalg import lapack

from spectra.operators.kfac_pass import ROUNDING_UNITS

__all__ = ["Eigen", "KFACBlock", "block_eigen", "factor_eigen"]


@dataclasses.dataclass(frozen=True)
class KFACBlock:
    """One factored layer's Kronecker factors.

    ``A`` (d_a × d_a): E[ā āᵀ] over examples, with ā the layer's input a (when its kernel
    is a variable of the operator) followed by 1 (when its bias is). ``G`` (d_out × d_out):
    E[Σ_c g_c g_cᵀ] of the pre-activation output gradients. For a layer shared over
    positions, both as the ``conv`` variant defines them
    (:class:`~spectra.operators.kfac.KFACOperator`).
    ``kernel``/``bias``: the names of the variables (None when not one of the operator's).
    ``kernel_slice``, ``bias_slice``: where they lie in the flat parameter vector.
    ``scalings`` (EKFAC only, d_a × d_out): the eigenvalues in the eigenbasis Q_A ⊗ Q_G of
    A ⊗ G, re-estimated as the second moments of the projected per-example gradients;
    ``basis`` (EKFAC only): that eigenbasis (Q_A, Q_G), the one the scalings were
    measured in.
    """

    layer: str
    A: np.ndarray
    G: np.ndarray
    kernel: str | None
    bias: str | None
    kernel_slice: slice | None
    bias_slice: slice | None
    scalings: np.ndarray | None = None
    basis: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def size(self) -> int:
        """Number of parameters of the block: d_a · d_out."""
        return self.A.shape[0] * self.G.shape[0]


@dataclasses.dataclass
class Eigen:
    """Eigendecompositions of one block's factors, with the eigenvalues that are zero to
    the working precision set to exactly 0 (see :func:`factor_eigen`); ``bound_A``,
    ``bound_G``: how large such a zeroed eigenvalue may truly be (0 when none is)."""

    alpha: np.ndarray
    QA: np.ndarray
    gamma: np.ndarray
    QG: np.ndarray
    bound_A: float = 0.0
    bound_G: float = 0.0

    def zero_bound(self) -> float:
        """How large the block's zeroed eigenvalues α_i γ_j (α_i or γ_j zeroed) may truly
        be: bound_A γ_max + α_max bound_G + bound_A bound_G."""
        alpha_max = float(self.alpha.max(initial=0.0))
        gamma_max = float(self.gamma.max(initial=0.0))
        return self.bound_A * gamma_max + alpha_max * self.bound_G + self.bound_A * self.bound_G


def factor_eigen(F: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Eigenvalues (ascending) and orthonormal eigenvectors of a PSD factor F (float64,
    computed from data in a dtype of unit roundoff ``eps``), and a bound on the zeroed ones.

    Rows with a zero diagonal are exact null directions. On the rest, F = D F̃ D with
    D = diag(F)^½ and F̃ of unit diagonal: the eigenvalues of F̃ at most
    ``ROUNDING_UNITS``·eps are rounding, so F has that many eigenvalues exactly 0, each of
    true size at most ``ROUNDING_UNITS``·eps·‖D Ṽₙ‖² (the returned bound; Ṽₙ those
    eigenvectors of F̃). The others
    come from ``eigh(F)``, which resolves them only to about 1e-16·‖F‖ absolute; when that
    is coarser than both 1e-8 and what the data determine (a graded factor, e.g. inputs
    of very different scales beside the bias coordinate) they come instead from F = B Bᵀ,
    B = D Ṽ diag(w̃)^½ (the kept eigenpairs of F̃), as the squared singular values and
    right singular vectors of the column-scaled Bᵀ by the preconditioned Jacobi SVD
    (LAPACK ``dgejsv``, JOBA='F'), which computes both to relative precision, small
    eigenvector components included, when Ṽ diag(w̃)^½ is well conditioned (Demmel &
    Veselić 1992; Drmač & Veselić 2008).
    """
    d = F.shape[0]
    diagonal = np.diag(F)
    live = np.flatnonzero(diagonal > 0)
    dead = np.flatnonzero(~(diagonal > 0))
    values = np.zeros(d)
    vectors = np.zeros((d, d))
    vectors[dead, np.arange(len(dead))] = 1.0
    m = len(live)
    if m == 0:
        return values, vectors, 0.0
    scale = np.sqrt(diagonal[live])
    sub = F[np.ix_(live, live)]
    scaled = sub / np.outer(scale, scale)
    w, V = np.linalg.eigh(sub)
    # eigh resolves the smallest kept eigenvalue to a relative eps64 ‖F‖ / λ; the data
    # determine it only to about eps / w̃ (w̃ the smallest kept of F̃). The Jacobi SVD (a
    # few times the cost) when eigh is the worse of the two and worse than 1e-8.
    f64 = float(np.finfo(np.float64).eps)

    def graded(values: np.ndarray, keep: np.ndarray, rank: int) -> bool:
        return bool(rank) and f64 * w[-1] > w[m - rank] * max(1e-8, eps / values[keep].min())

    # F̃'s eigenvalues first (a quarter of the cost with its eigenvectors: measured 49 against
    # 191 ms at 785 × 785, one thread): its eigenvectors are needed only for zeroed eigenvalues'
    # bound or the Jacobi SVD, and are then computed with the eigenvalues as before.
    scaled_values = np.linalg.eigvalsh(scaled)
    keep = scaled_values > ROUNDING_UNITS * eps
    rank = int(keep.sum())
    if rank < m or graded(scaled_values, keep, rank):
        scaled_values, scaled_vectors = np.linalg.eigh(scaled)
        keep = scaled_values > ROUNDING_UNITS * eps
        rank = int(keep.sum())
    # The discarded part D Ṽₙ diag(w̃ₙ) Ṽₙᵀ D has norm at most τ ‖D Ṽₙ‖², τ the threshold.
    bound = 0.0
    if rank < m:
        null = scale[:, None] * scaled_vectors[:, ~keep]
        bound = ROUNDING_UNITS * eps * float(np.linalg.norm(null, 2) ** 2)
    w[: m - rank] = 0.0
    if graded(scaled_values, keep, rank):
        # Bᵀ = diag(w̃)^½ Ṽᵀ D, padded with zero rows to m × m: a column-scaled matrix,
        # whose right singular vectors (the eigenvectors of F) Jacobi computes accurately
        # down to their smallest components.
        Bt = np.zeros((m, m))
        Bt[:rank] = (scaled_vectors[:, keep] * np.sqrt(scaled_values[keep])).T * scale
        # joba=2: 'F' (row and column pivoting), jobu=3: 'N', jobv=0: 'V', jobr=0: 'N'
        # (no restricted range), jobt=0: 'N', jobp=0: 'N' (no perturbation).
        sva, _, Vt, work, _, info = lapack.dgejsv(
            Bt, joba=2, jobu=3, jobv=0, jobr=0, jobt=0, jobp=0
        )
        if info != 0:
            raise ValueError(
                f"K-FAC: the Jacobi SVD of a graded factor did not converge (LAPACK dgejsv info "
                f"{info}); rescale the model's inputs to comparable magnitudes."
            )
        sigma = (sva * (work[0] / work[1]))[:rank]
        if np.any(sigma**2 < np.finfo(np.float64).tiny):
            raise ValueError(
                "K-FAC: a factor's eigenvalues underflow float64 (below 2.2e-308): the "
                "activations or output gradients are too small; rescale the model's inputs."
            )
        order = np.argsort(sigma)
        w = np.concatenate([np.zeros(m - rank), sigma[order] ** 2])
        V = np.concatenate([Vt[:, rank:], Vt[:, :rank][:, order]], axis=1)
    values[len(dead) :] = w
    vectors[np.ix_(live, np.arange(len(dead), d))] = V
    return values, vectors, bound


def _in_basis(M: np.ndarray, Q: np.ndarray, rank: int) -> np.ndarray:
    """The eigenvalues of M in its known eigenbasis Q (clipped at 0), all but the ``rank``
    largest set to 0."""
    values = np.maximum(np.einsum("ij,ik,kj->j", Q, M, Q), 0.0)
    values[np.argsort(values)[: len(values) - rank]] = 0.0
    return values


def block_eigen(block: KFACBlock, eps: float) -> Eigen:
    """The eigendecompositions of ``block``'s factors (computed from data in a dtype of
    unit roundoff ``eps``); for an EKFAC block, in the basis its scalings were measured
    in, with the eigenvalues of A and G in it."""
    alpha, QA, bound_A = factor_eigen(block.A, eps)
    gamma, QG, bound_G = factor_eigen(block.G, eps)
    if block.basis is not None:  # EKFAC: the basis the scalings were measured in
        QA, QG = block.basis
        alpha = _in_basis(block.A, QA, int(np.count_nonzero(alpha)))
        gamma = _in_basis(block.G, QG, int(np.count_nonzero(gamma)))
    return Eigen(alpha, QA, gamma, QG, bound_A, bound_G)
