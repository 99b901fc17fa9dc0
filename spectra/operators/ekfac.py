"""EKFAC: K-FAC with its eigenvalues re-estimated in K-FAC's eigenbasis (George et al.
2018).

:class:`EKFACOperator` is a :class:`~spectra.operators.kfac.KFACOperator` whose blocks
carry scalings: its ``from_keras`` runs K-FAC's pass over the data, then a second one for
the second moments of the per-example gradients in the eigenbasis of the factors
(:func:`~spectra.operators.kfac_blocks.factor_eigen`). Its products, spectrum and inverse
are K-FAC's, read from those scalings.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spectra.operators.kfac import FactorPasses, KFACOperator
from spectra.operators.kfac_blocks import KFACBlock, factor_eigen

__all__ = ["EKFACOperator"]


class EKFACOperator(KFACOperator):
    """EKFAC (eigenvalue-corrected K-FAC; George et al. 2018), a symmetric PSD
    ``LinearOperator`` like :class:`~spectra.operators.kfac.KFACOperator`, built with the
    same ``from_keras``.

    Per Dense layer it keeps K-FAC's eigenbasis Q = Q_A ⊗ Q_G (the eigenvectors of A and
    G) and replaces the eigenvalues α_i γ_j by the second moments of the per-example
    gradients projected onto it::

        K_l = Q diag(s) Qᵀ,   s_ij = (1/N) Σ_n Σ_c (q_A,iᵀ ā_n)² (q_G,jᵀ g_nc)²,

    that is s = diag(Qᵀ B_l Q) for B_l the layer's exact block of the matrix of ``kind``
    ((1/N) Σ_n Σ_c (ā_n ⊗ g_nc)(ā_n ⊗ g_nc)ᵀ: the GGN's block for type-2). Among matrices
    diagonal in Q it is the closest to B_l in Frobenius norm, hence at least as close as
    K-FAC. Its spectrum is exact (the s_ij), and so are the trace, log-determinant,
    Frobenius norm and damped inverse. Cost: a second pass over the data (the eigenbasis
    needs the factors first) with the same backward passes as the first; products cost
    four matrix products per layer instead of two.

    For a layer shared over T positions (Conv1D, Conv2D, Dense, EinsumDense or Embedding on
    sequences) the per-example gradient is M_nc = Σ_t ā_nt g_ntcᵀ and
    s_ij = (1/N) Σ_n Σ_c (q_A,iᵀ M_nc q_G,j)², in the eigenbasis of the ``conv`` variant's
    factors, except for outputs with positions (a language model) and ``conv="expand"``:
    there each (example, layer position) counts as an example, as the expand factors
    count it (Eschenhagen et al. 2023), s_ij = (1/N) Σ_{n,t,c} (q_A,iᵀ ā_nt)² (q_G,jᵀ g_ntc)²,
    the diagonal in Q of (1/N) Σ_{n,t,c} (ā_nt ⊗ g_ntc)(ā_nt ⊗ g_ntc)ᵀ, which is the layer's
    type-2 GGN block when each layer position reaches only its own output position (no
    cross terms, see :class:`~spectra.operators.kfac.KFACOperator`); the per-example Σ_t
    would add the type-2 columns' cross terms between output positions to every scaling. A
    direction on which A or G is zero to working precision gets s_ij = 0. With
    ``conv="expand"`` (or one position) that is exact: q_Aᵀ ā_nt = 0 at every position.
    With ``conv="reduce"`` on several positions only the mean ā_n is orthogonal to such a
    q_A (likewise Σ_t g for G), so the exact projection there need not vanish: a
    rank-deficient reduce factor (fewer examples than its dimension) makes EKFAC equal to
    diag(Qᵀ B_l Q) on the other directions only.
    """

    eigenvalue_corrected = True

    @classmethod
    def _corrected_blocks(cls, blocks: list[KFACBlock], passes: FactorPasses) -> list[KFACBlock]:
        """K-FAC's blocks with their scalings and eigenbasis, from a second pass over the
        data; refused in one line when a scaling is not finite."""
        # Second pass: second moments of the per-example gradients in the eigenbasis.
        accumulators = passes.accumulators
        transposed = passes.transposed
        num_examples = passes.num_examples
        eps = float(np.finfo(passes.dtype.as_numpy_dtype).eps)
        factors = [(factor_eigen(b.A, eps), factor_eigen(b.G, eps)) for b in blocks]
        bases = [(fa[1], fg[1]) for fa, fg in factors]
        accumulators.bases = [
            (QG, QA) if flip else (QA, QG) for (QA, QG), flip in zip(bases, transposed)
        ]
        passes.run(want_diagonal=False, scalings=True)
        accumulators.S = [S.T if flip else S for S, flip in zip(accumulators.S, transposed)]
        # A direction on which A or G is zero to working precision has scaling 0 (its
        # per-example projections are rounding).
        blocks = [
            dataclasses.replace(
                block,
                scalings=np.where(np.outer(fa[0] > 0, fg[0] > 0), S / num_examples, 0.0),
                basis=basis,
            )
            for block, S, basis, (fa, fg) in zip(blocks, accumulators.S, bases, factors)
        ]
        for block, S in zip(blocks, accumulators.S):
            if not np.all(np.isfinite(S)):
                raise ValueError(f"EKFAC: the scalings of layer {block.layer!r} are not finite.")
        return blocks
