"""K-FAC: the Kronecker-factored approximation of the GGN / Fisher of Dense, EinsumDense,
Conv1D, Conv2D and Embedding layers.

For a Dense layer z = a W + b (Keras' kernel W of shape d_in × d_out), the gradient of
example i's loss in the layer's parameters is the outer product of the layer's input and
of the gradient in its pre-activation output. With the bias as the homogeneous coordinate
of the input, ā = [a; 1], and the parameters flattened as spectra flattens them (kernel
row-major, then bias), the per-example gradient is ā ⊗ g. The layer's block of the GGN or
Fisher::

    (1/N) Σ_i Σ_c (ā_i ⊗ g_ic)(ā_i ⊗ g_ic)ᵀ = (1/N) Σ_i ā_i ā_iᵀ ⊗ (Σ_c g_ic g_icᵀ),

is approximated by the Kronecker product of the two expectations (Martens & Grosse 2015)::

    A = (1/N) Σ_i ā_i ā_iᵀ,     G = (1/N) Σ_i Σ_c g_ic g_icᵀ,     block ≈ A ⊗ G,

assuming activations and output gradients independent; blocks of different layers are
dropped (block diagonal). With one example each Dense layer's block is exact (the
cross-layer blocks are still dropped). Because the matrix is a Kronecker product per
layer, its whole spectrum is exact: the eigenvalues of A ⊗ G are the products α_i γ_j
of those of A and G.

Layers whose weights are shared over T positions (a convolution's output positions, a
sequence's tokens) have the per-example gradient Σ_t ā_t g_tᵀ, and are factored in the
"expand" or "reduce" variant (Eschenhagen et al. 2023)::

    expand:  A = (1/(NT)) Σ_{n,t} ā_nt ā_ntᵀ,      G = (1/N) Σ_{n,t,c} g_ntc g_ntcᵀ,
    reduce:  A = (1/N) Σ_n ā_n ā_nᵀ (ā_n = (1/T) Σ_t ā_nt),
             G = (1/N) Σ_{n,c} (Σ_t g_ntc)(Σ_t g_ntc)ᵀ,

both exact for one example with one position. Conv2D layers are Dense layers on the image
patches at every output position (KFC, Grosse & Martens 2016), Conv1D layers (causal
padding included) the same on a sequence. A Dense layer on inputs (batch, ..., features)
shares its kernel over all the axes between batch and features. An EinsumDense layer
whose equation contracts input axes with the kernel's leading axes (attention's
``abc,cde->abde`` projections, its ``abcd,cde->abe`` output) is the Dense layer of its
kernel flattened to (contracted, outputs) row-major, shared over its other non-batch
axes. An Embedding layer is a Dense layer without bias on one-hot inputs, so its A is
diagonal (the token frequencies).

Model outputs with positions (batch, T, ..., C), under a loss averaging per-position
terms (a language model under Keras' cross-entropy), have an output Hessian block
diagonal over the positions; type-2 back-propagates column c of every position's square
root at once (C passes, cross terms between positions included, as curvlinops does), mc
and empirical the gradients at per-position sampled or true labels. A tied
``ReversibleEmbedding`` table (lookup and logits h Wᵀ) is factored at one of its two uses
(``tied_embeddings``). See :class:`KFACOperator`; EKFAC is
:mod:`spectra.operators.ekfac`, the blocks and their eigendecompositions
:mod:`spectra.operators.kfac_blocks`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import keras
import numpy as np
import tensorflow as tf
from scipy.sparse.linalg import LinearOperator

from spectra import _keras_compat
from spectra._symmetric import SymmetricProducts
from spectra._validation import check_choice, check_float, check_int, check_seed
from spectra.operators import keras_models
from spectra.operators.batching import Batches
from spectra.operators.curvature import variable_name
from spectra.operators.data_checks import check_keras_data, graph_errors
from spectra.operators.fisher import predictive_distribution
from spectra.operators.keras_data import keras_loss_function
from spectra.operators.kfac_blocks import Eigen, KFACBlock, block_eigen
from spectra.operators.kfac_layers import (
    FACTORED,
    FACTORED_NAMES,
    check_embedding,
    dense_form,
    is_tied,
    kernel_of,
    static_rank,
    uncovered_message,
)
from spectra.operators.kfac_pass import (
    Accumulators,
    CompiledPass,
    PassSettings,
    SplitAtLogits,
    check_convex,
    closed_form,
    compiled_pass,
    convex_losses,
)
from spectra.operators.kronecker_products import KroneckerBlock, KroneckerProducts
from spectra.operators.layout import ParameterLayout, validated_matrix
from spectra.operators.losses import check_fisher_reduction
from spectra.operators.memory import KFACMemoryPlan

__all__ = ["KFACOperator"]

KINDS = ("type-2", "mc", "empirical")
OTHER_VARIABLES = ("error", "exclude", "diagonal")
CONV_VARIANTS = ("expand", "reduce")
#: Which use of a tied ReversibleEmbedding's table K-FAC factors.
TIED_EMBEDDINGS = ("error", "output", "input")
#: Keras cross-entropies that read the logits behind a softmax/sigmoid output.
_LOGIT_LOSSES = (
    "categorical_crossentropy",
    "sparse_categorical_crossentropy",
    "binary_crossentropy",
)
#: Where K-FAC's products run: True, in TensorFlow (one compiled function over all
#: blocks, the factors kept where TensorFlow places them); False, in NumPy; None (the
#: default), in TensorFlow where it has a GPU, else NumPy. On a CPU both run the same
#: BLAS-bound matrix products: measured on 2 cores, TensorFlow took 0.98x NumPy's time
#: on ResNet-50's layers and 1.2-10x on smaller ones (a compiled call's fixed cost).
PRODUCTS_IN_TENSORFLOW: bool | None = None
#: ``to_dense`` refuses matrices larger than this many rows (a dense float64 copy).
MAX_DENSE_SIZE = 20_000


def _round_up(x: float) -> float:
    """x rounded up to two significant digits (so that the printed value is ≥ x)."""
    unit = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / unit * (1 - 1e-12)) * unit


def _sandwich(left: np.ndarray, M: np.ndarray, right: np.ndarray) -> np.ndarray:
    """left @ M[j] @ right for every j of M (k, p, q), as two matrix products over the
    whole block (k·p × q, then p × k·q) instead of 2k small ones: the same
    O(k·(p²q + pq²)) arithmetic, in the large products BLAS runs fastest."""
    k, p, _ = M.shape
    right_applied = (M.reshape(k * p, -1) @ right).reshape(k, p, -1)
    q = right_applied.shape[2]
    stacked = right_applied.transpose(1, 0, 2).reshape(p, k * q)
    return (left @ stacked).reshape(left.shape[0], k, q).transpose(1, 0, 2)


class KFACOperator(SymmetricProducts, LinearOperator):
    """K-FAC (Kronecker-factored approximate curvature) of a Keras model's Dense,
    EinsumDense, Conv1D, Conv2D and Embedding layers, a symmetric PSD ``LinearOperator``
    over the same flat
    parameter vector as :class:`~spectra.operators.HessianOperator` (same
    ``variable_names``, ``flatten``, ``unflatten``).

    **The matrix.** For each Dense layer l with input a and pre-activation output z,
    ā = [a; 1] (bias as the homogeneous coordinate)::

        K_l = A_l ⊗ G_l,   A_l = (1/N) Σ_i ā_i ā_iᵀ,   G_l = (1/N) Σ_i Σ_c g_ic g_icᵀ,

    block diagonal across layers (Martens & Grosse 2015). With z the point where the loss
    reads the model's output (the logits behind a softmax/sigmoid output for Keras'
    cross-entropies, as in :class:`~spectra.operators.GGNOperator`), J_i = ∂z_i/∂z_l,i and
    ℓ_i example i's loss (Keras' per-example loss, so MSE is averaged over the last axis),
    the output gradients g_ic = J_iᵀ s_ic are:

    * ``kind="type-2"``: s_ic the columns of a square root of ∇²_z ℓ_i (diag p − ppᵀ for
      softmax cross-entropy, (2/d) I for MSE): the layer blocks of K are then those of the
      GGN with the expectation factorized. One backward pass per output dimension C. The
      root is √p_c (e_c − p) for Keras' categorical cross-entropies at the logits and
      √(2/d) e_c for MSE (checked on each batch against one output-Hessian product, as
      for outputs with positions below), else from the eigendecomposition of each
      example's C × C output Hessian.
    * ``kind="mc"``: s_is = ∇_z ℓ_i(ŷ_s)/√(κS) for S = ``num_samples`` labels drawn from the
      model's predictive distribution (as :class:`~spectra.operators.FisherOperator`,
      ``kind="mc"``; κ = 1 for cross-entropy, 2/d for MSE), each example's seeded by
      ``seed`` and its index in the dataset (so the matrix does not depend on
      ``batch_size``): the K-FAC of the Monte Carlo Fisher, whose expectation is type-2.
      Type-2 needs a loss convex in z: Keras' cross-entropies (at the logits) and MSE are;
      for another loss a negative output-Hessian eigenvalue beyond the dtype's rounding
      (relative to the largest over the whole dataset) is refused.
    * ``kind="empirical"``: s_i = ∇_z ℓ_i(y_i) at the true labels: K-FAC of the empirical
      Fisher.

    The loss is the dataset mean (1/N) Σ_i ℓ_i, as every spectra operator takes it; batches
    are weighted n_b/N, so the matrix does not depend on ``batch_size``. A Keras loss with
    ``reduction="sum"`` (L = Σ_i ℓ_i) scales G by N (type-2 only). With a single example,
    K-FAC of one Dense layer equals the GGN (type-2) exactly; with more it is an
    approximation (the expectation of a Kronecker product is not the Kronecker product of
    expectations).

    **Conv2D** (KFC; Grosse & Martens 2016). A Conv2D layer (channels last, ``groups=1``)
    is a Dense layer applied at each of its T output positions t to the image patch a_t
    (the values of ``tf.image.extract_patches``, flattened (kh, kw, c_in) as the kernel's
    rows are; built from kh·kw strided slices), with
    shared weights, so the per-example gradient is Σ_t ā_t g_tᵀ. ``conv="expand"``
    (default) treats positions as examples: A = (1/(NT)) Σ_{n,t} ā ā ᵀ,
    G = (1/N) Σ_{n,t,c} g gᵀ; ``conv="reduce"`` sums over positions first:
    A = (1/N) Σ_n ā̄_n ā̄_nᵀ with ā̄_n the mean patch, G = (1/N) Σ_{n,c} (Σ_t g)(Σ_t g)ᵀ
    (Eschenhagen et al. 2023). Both are exact for one example with one output position;
    the capture records the patches and computes z with the layer's own convolution, or,
    for the first factored layer of the forward pass (no gradient is taken through its
    input), as the patches times the kernel (one GEMM; equal up to the order of the sums).
    MaxPooling2D layers back-propagate the C columns from the argmax of the forward pass
    (the same gradient as TensorFlow's MaxPoolGrad, without searching every window again).
    Conv1D layers (channels last, ``groups=1``; ``padding="causal"`` included: the
    dilation·(k − 1) zeros on the left that Keras adds) are factored the same way, with
    patches of k positions × c_in channels.

    **Dense and EinsumDense on sequences** (transformers; Eschenhagen et al. 2023). A Dense
    layer on inputs of shape (batch, p_1, ..., p_k, features) applies its kernel at every
    one of the T = p_1 ⋯ p_k positions t, so its per-example gradient is Σ_t ā_t g_tᵀ as
    for a convolution, with ā_t = [a_t; 1] the features at t and g_t the gradient in its
    output there, and the ``conv`` variant applies: ``"expand"`` (default)
    A = (1/(NT)) Σ_{n,t} ā ā ᵀ, G = (1/N) Σ_{n,t,c} g gᵀ; ``"reduce"`` A from each example's
    mean ā over the positions, G from Σ_t g. On inputs (batch, features) both are the
    Dense factors above. An EinsumDense layer is factored when its equation is such a
    Dense layer: every kernel axis is either contracted with an input axis (not kept in
    the output) or an output axis, the contracted ones lead the kernel, the input's first
    (batch) axis and its other non-kernel axes (the positions) are kept in the output, and
    the bias, if any, is one per output unit (``bias_axes`` the kernel's output axes, in
    its order). Then z = a W + b with a the contracted input axes, W the kernel as a
    (d_in, d_out) matrix in its own row-major order (so the flat parameter vector is
    spectra's flattening of the kernel variable) and T the product of the positions' sizes:
    attention's query/key/value ``abc,cde->abde`` (W: d_model × heads·head_dim) and output
    ``abcd,cde->abe`` (W: heads·head_dim × d_model), with or without bias, and ``...``
    equations. Other equations (weights per position such as ``abc,bcd->abd``, a kernel
    whose output axes come first, a sum over a non-kernel axis, a bias per position) are
    refused in one line naming the layer and the equation. Exact for one example with one
    position; the capture computes z itself from the einsum and the layer's kernel and
    bias, in (batch, positions, outputs) order.

    **Outputs with positions** (a language model's logits; Eschenhagen et al. 2023's
    "expand" setting). For outputs z_i of shape (batch, T_1, ..., C) with T = T_1 ⋯ T_k
    output positions, Keras' cross-entropies and MSE average per-position terms, so
    example i's loss is ℓ_i = (1/T) Σ_t ℓ_it (w = 1/T per position; N Σ_t for
    ``reduction="sum"``) and its output Hessian is block diagonal over the positions,
    H_i = diag_t(H_it) with H_it = w ∇²ℓ_it (C × C). Each block has a square root
    R_it (R_it R_itᵀ = H_it): √(w p_tc)(e_c − p_t) as column c for softmax cross-entropy
    at the logits (diag p − ppᵀ = Σ_c p_c (e_c − p)(e_c − p)ᵀ), √(2w/C) e_c for MSE, and
    for other losses column c of the symmetric square root H_it^½, the blocks then taken
    from C backward passes through the loss alone (no (T·C) × (T·C) Hessian is formed).
    The cotangents are, per example:

    * ``kind="type-2"``: for each c = 1..C, s_ic stacks column c of every position's
      R_it, one backward pass for all positions at once (as curvlinops' K-FAC does), so
      Σ_c s_ic s_icᵀ = H_i + Σ_{t≠t'} Σ_c r_itc r_it'cᵀ: G (and, with ``conv="reduce"``,
      the per-example gradients Σ_t ā_t g_tᵀ) includes cross terms between output
      positions, J_tᵀ r_tc r_t'cᵀ J_t'. A layer position reached by one output position
      only gets none: the factors are those of per-position columns when there is one
      output position or when each layer position reaches only its own output position
      (a position-wise model, e.g. a language model's head; not the layers under a causal
      attention, which reach every later position). So a linear layer applied at every
      position under MSE has K = A ⊗ G equal to the GGN with ``conv="expand"``, for any
      number of examples (G = (2/C) I is constant). C backward passes per batch.
    * ``kind="mc"``: labels drawn independently per position (one stateless draw per
      example, seeded by its index, as above), s_is = ∇_z ℓ_i(ŷ_is)·√(T/(κS)) over all
      positions at once: the loss is κ/T times the sequence's negative log-likelihood.
      The cross terms between positions have zero mean, so the expectation is the
      factors of per-position columns (type-2 without the cross terms). S passes.
    * ``kind="empirical"``: s_i = ∇_z ℓ_i(y_i), the gradient of the whole example's
      loss: the per-example gradient Σ_t ā_t g_tᵀ is that of the empirical Fisher
      exactly (cross terms included by definition). One pass.

    Each batch's per-position blocks are checked against one output-Hessian product of
    the loss with a seeded random vector (to the dtype's rounding): a loss coupling the
    output positions (not a sum of per-position terms) is refused for type-2 in one line.
    EKFAC on outputs with positions and ``conv="expand"`` takes each (example, layer
    position) as an example (:class:`~spectra.operators.ekfac.EKFACOperator`).

    **Tied embeddings.** A ``ReversibleEmbedding`` with ``tie_weights=True`` (keras-hub's
    GPT-2, Gemma, ... token embeddings) uses its table W (V × d) twice: the token lookup
    z = e_x W and the logits z_out = h Wᵀ (``reverse=True``). Its per-example gradient is
    Σ_t e_xt g_tᵀ + Σ_s u_s h_sᵀ (u the gradient in the logits), whose second moment is
    the sum of two Kronecker products and their cross terms, not one. ``tied_embeddings``
    chooses the use that is factored: ``"error"`` (default) refuses it in one line naming
    the layer and the options; ``"output"`` factors the reverse call as a Dense layer
    without bias whose kernel is Wᵀ (d × V): per example Σ_s u_s h_sᵀ, flattened
    row-major over W's (V, d) as spectra flattens the table, u ⊗ h, so the block is
    E[u uᵀ] ⊗ E[h hᵀ], a :class:`KFACBlock` whose ``A`` is over the table's V rows (the
    logits' gradients, summed over columns c) and whose ``G`` is over its d columns (the
    inputs h; the roles of the two factors are swapped against a Dense layer's, with the
    ``conv`` variant's scalings: under "expand" the V × V factor sums over positions and
    the d × d one averages); ``"input"`` factors the lookup as an Embedding (diagonal
    token frequencies ⊗ G of the lookup's output). The other use's contribution is
    dropped; the block is the K-FAC of the table's curvature when that use contributes
    nothing (its gradient is zero), not otherwise: measure against
    :class:`~spectra.operators.GGNOperator` (``benchmarks/language_models.py``).

    **Embedding.** An Embedding layer (table W of shape V × d) computes z = e_x W for the
    one-hot vector e_x of its input token x: a Dense layer without bias whose input is
    one-hot, so its per-example gradient is e_x g ᵀ and A = (1/N) Σ_n e_xn e_xnᵀ is diagonal,
    the token frequencies (1/N)·counts (no homogeneous coordinate). G is taken from the
    gradients in the embedding's output z as for Dense. For sequence inputs (batch, T) the
    table is shared over the T positions, as a convolution's kernel is, and the ``conv``
    variant applies: ``"expand"`` (default) A = (1/(NT)) diag(counts over all positions),
    G = (1/N) Σ_{n,t,c} g gᵀ; ``"reduce"`` A from each example's mean one-hot (its token
    histogram / T, no longer diagonal), G from Σ_t g. Exact for one example with one
    position. ``mask_zero=True`` is refused (the masked positions would be counted in A),
    and so are vocabularies above 4096 (A is held dense, V × V). A ``ReversibleEmbedding``
    (Keras ≥ 3.13, keras-hub's token embeddings) is an Embedding on its forward calls;
    with ``tie_weights=True`` and a reverse call, ``tied_embeddings`` decides (above). With
    ``tie_weights=False`` the reverse table is a separate variable, not factored (an other
    variable, below).

    **Other variables.** Trainable variables not in a factored layer (BatchNorm,
    LayerNormalization, position embeddings, ...): ``other_variables="error"`` (default)
    refuses them in one line listing every one of them by name, grouped by the (innermost)
    layer holding it; ``"exclude"`` leaves their rows and columns zero
    (eigenvalue 0); ``"diagonal"`` keeps the exact diagonal of the matrix of ``kind`` for
    them, (1/N) Σ_i Σ_c (J_θ,iᵀ s_ic)², from per-example Jacobians (C backward passes per
    example: small models). Regularization
    (``model.losses``) is not included: K-FAC is the curvature of the data loss. Sample
    weights are refused.

    **Cost.** One pass over the data at construction: a forward pass per batch, C backward
    passes for type-2 (plus the output Hessian, C more on the outputs only), S for mc, one
    for empirical; a Conv2D layer also holds its patches (T·kh·kw·c_in per example) and an
    Embedding its one-hot inputs (T·V per example) while its batch is processed; EKFAC's
    second pass forms each shared layer's per-example gradients (d_a·d_out per example). The
    operator then holds only the factors: a product costs O(Σ_l d_a² d_out + d_a d_out²) on
    the host, computed as A V G per layer without forming
    the Kronecker product; eigendecompositions of the factors (O(d_a³ + d_out³) per layer,
    once) give the exact spectrum, trace, log-determinant, Frobenius norm and damped inverse.

    **Memory of the build.** Each batch runs as one compiled step (a ``tf.function`` per
    pass kind and batch shape, shared by later builds on the same model and settings).
    While it runs it holds: the forward pass's activations (kept by the tapes for the C
    backward passes), each factored layer's input a, in float64 for A (n·T·d_a per layer:
    a convolution's patches, T·kh·kw·c_in per example; an Embedding's one-hot rows, T·V)
    and its pre-activation z; for type-2 the batch's output-Hessian roots (n·C·C, or
    n·T·C·C for outputs with positions and a loss without a closed form); one column's
    backward pass at a time (the gradients in every layer's z, n·T·d_out each, in a
    ``tf.while_loop`` over the C columns); for ``other_variables="diagonal"`` the
    per-example Jacobians of the outputs in those variables (n·C·p); for EKFAC's second
    pass each shared layer's per-example gradients (n·d_a·d_out) and the eigenbases. The
    running sums (Σ ā āᵀ and Σ g gᵀ per layer, d_a² + d_out², or EKFAC's d_a·d_out) are
    float64 tensors carried from batch to batch and copied to the host once per pass;
    the operator then holds only the factors (and EKFAC's scalings and bases).

    **Precision.** A factor's eigenvalue that is rounding of the dtype the factors were
    computed in (judged on the factor scaled to a unit diagonal, so independent of the
    data's scale; e.g. the all-ones direction of G under softmax cross-entropy) is exactly
    0 in :meth:`eigenvalues`, and :meth:`logdet` and :meth:`inverse` refuse a damping
    below the bound on those zeros (one line with a damping that works). Graded factors
    (inputs of very different magnitudes beside the bias coordinate) are decomposed by a
    Jacobi SVD accurate to relative precision, and the log-determinant is summed in log
    space.
    The factors are computed at construction: the operator is a snapshot (training on
    changes nothing in it).

    References: J. Martens, R. Grosse, "Optimizing neural networks with Kronecker-factored
    approximate curvature", ICML 2015. R. Grosse, J. Martens, "A Kronecker-factored
    approximate Fisher matrix for convolution layers", ICML 2016. T. George, C. Laurent,
    X. Bouthillier, N. Ballas, P. Vincent, "Fast approximate natural gradient descent in a
    Kronecker-factored eigenbasis", NeurIPS 2018. R. Eschenhagen, A. Immer, R. Turner,
    F. Schneider, P. Hennig, "Kronecker-factored approximate curvature for modern neural
    network architectures", NeurIPS 2023.
    """

    is_positive_semidefinite = True  # A ⊗ G blocks of PSD factors (read by spectral_density)

    #: False: K-FAC (A ⊗ G); True (:class:`~spectra.operators.ekfac.EKFACOperator`):
    #: eigenvalue-corrected.
    eigenvalue_corrected = False

    def __init__(
        self,
        blocks: Sequence[KFACBlock],
        variable_names: Sequence[str],
        variable_shapes: Sequence[tuple[int, ...]],
        dtype: Any,
        *,
        kind: str = "type-2",
        num_examples: int = 0,
        other_slices: Sequence[slice] = (),
        other_diagonal: np.ndarray | None = None,
        build_traces: Mapping[str, int] | None = None,
    ) -> None:
        #: The flat parameter vector's layout.
        self.layout = ParameterLayout(variable_shapes, variable_names, dtype)
        size = self.layout.size
        super().__init__(dtype=np.dtype(dtype), shape=(size, size))
        self.blocks = list(blocks)
        self.kind = kind
        self._num_examples = int(num_examples)
        self._other_slices = list(other_slices)
        other_size = sum(s.stop - s.start for s in self._other_slices)
        self._other_diagonal = (
            np.zeros(other_size) if other_diagonal is None else np.asarray(other_diagonal, float)
        )
        if self._other_diagonal.shape != (other_size,):
            raise ValueError(
                f"other_diagonal has {self._other_diagonal.size} entries for {other_size} "
                "parameters outside the Dense blocks."
            )
        covered = sum(b.size for b in self.blocks) + other_size
        if covered != size:
            raise ValueError(
                f"the K-FAC blocks cover {covered} of the {size} parameters; every variable must "
                "belong to one Dense block or to the other variables."
            )
        self._eigen: list[Eigen] | None = None
        # Factors cast to a product dtype ((dtype name, block) -> arrays), made on first use.
        self._cast_factors: dict[tuple[str, int], tuple[np.ndarray, ...]] = {}
        # The products' compiled TensorFlow form (see _compiled_products), made on first use.
        self._compiled: KroneckerProducts | None = None
        self._has_gpu: bool | None = None
        #: How many times ``from_keras`` traced each pass kind ("factors", "scalings"): 1
        #: per batch shape on a model's first build, 0 when the compiled pass was reused
        #: (empty when not built by ``from_keras``).
        self._build_traces: dict[str, int] = dict(build_traces or {})

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_keras(
        cls,
        model: Any,
        loss: Any = None,
        data: Any = None,
        *,
        batch_size: int | None = None,
        kind: str = "type-2",
        num_samples: int = 1,
        seed: int = 0,
        other_variables: str = "error",
        conv: str = "expand",
        tied_embeddings: str = "error",
        dtype: Any = None,
    ) -> KFACOperator:
        """K-FAC of ``model``'s Dense, EinsumDense, Conv1D, Conv2D and Embedding layers at
        its current weights, from one pass over ``data``.

        Parameters
        ----------
        model:
            A built Keras model with one output of shape (batch, C), or (batch,
            positions..., C) under a loss averaging per-position terms (class docstring).
        loss:
            As for :meth:`CurvatureOperator.from_keras
            <spectra.operators.base.CurvatureOperator.from_keras>`: a Keras loss name or
            object, or a callable ``(y_true, y_pred) -> scalar`` batch mean; None: the loss
            the model was compiled with.
        data:
            ``(x, y)`` arrays or a ``tf.data.Dataset`` of such batches (no sample weights).
        batch_size:
            Examples per batch for array data (default: all at once); the matrix does not
            depend on it.
        kind:
            ``"type-2"`` (default), ``"mc"`` or ``"empirical"`` (see the class docstring).
        num_samples:
            Labels drawn per example for ``kind="mc"`` (an int ≥ 1; 1 for the other kinds).
        seed:
            An int ≥ 0 seeding the labels of ``kind="mc"`` (with each example's index in
            the dataset).
        other_variables:
            ``"error"`` (default), ``"exclude"`` or ``"diagonal"``: what to do with
            trainable variables outside the factored layers (``"error"``: a message
            listing all of them, grouped by layer).
        conv:
            ``"expand"`` (default) or ``"reduce"``: the variant for layers whose weights are
            shared over positions (Eschenhagen et al. 2023): Conv1D and Conv2D layers, and
            Dense, EinsumDense and Embedding layers on sequences (class docstring); no
            effect on layers applied once per example.
        tied_embeddings:
            ``"error"`` (default), ``"output"`` or ``"input"``: which use of a tied
            ``ReversibleEmbedding``'s table (looked up, and called with ``reverse=True``
            for logits) is factored; the other use's contribution is dropped (class
            docstring). No effect on other layers.
        dtype:
            float32 or float64 (default: the variables' dtype); float64 runs the pass on a
            float64 clone of the model.

        Returns
        -------
        KFACOperator
            The operator, holding the factors (a snapshot of the weights).

        Raises
        ------
        TypeError
            An argument of the wrong type.
        ValueError
            A value out of range, or a model, loss or data K-FAC does not cover (named in
            the message: several outputs, a layer called more than once, an EinsumDense
            equation that is not a Dense layer over positions, a tied ReversibleEmbedding
            called in reverse with ``tied_embeddings="error"``, a type-2 loss coupling
            output positions, an Embedding with
            ``mask_zero=True`` or a vocabulary above 4096, sample weights,
            other trainable variables with ``other_variables="error"``, a non-convex loss
            for type-2, a ``reduction="sum"`` loss for mc/empirical, non-finite values).
        """
        keras_models.check_model(model)
        options = _Options.checked(
            kind=kind,
            num_samples=num_samples,
            seed=seed,
            other_variables=other_variables,
            conv=conv,
            tied_embeddings=tied_embeddings,
        )
        if data is None:
            raise ValueError("data is required: (x, y) arrays or a tf.data.Dataset of them.")
        variables, positions, target = keras_models.resolve_variables_and_dtype(model, None, dtype)
        loss = _one_loss(model, loss)
        # The weights are checked finite in the pass's first step (FactorPasses._check).
        reading = _LossReading.of(loss, target, options.kind)
        parameters = _Parameters.of(
            variables, positions, keras_models.model_in_dtype(model, target), target
        )
        layers = _factored_layers(model, parameters, options.other_variables)
        passes = _factor_passes(
            cls.__name__, model, data, batch_size, reading, parameters, layers, options
        )
        passes.weights = list(variables)
        passes.run(want_diagonal=options.other_variables == "diagonal")
        if options.kind == "type-2" and not reading.convex:
            check_convex(passes.accumulators, target)
        blocks = cls._corrected_blocks(_factor_blocks(layers, parameters, passes), passes)
        diagonal = _other_diagonal(layers, passes, options.other_variables)
        return cls(
            blocks,
            parameters.names,
            parameters.shapes,
            target.as_numpy_dtype,
            kind=options.kind,
            num_examples=passes.num_examples,
            other_slices=[parameters.slice(j) for j in layers.others],
            other_diagonal=diagonal,
            build_traces=passes.build_traces(),
        )

    @classmethod
    def _corrected_blocks(cls, blocks: list[KFACBlock], passes: FactorPasses) -> list[KFACBlock]:
        """The blocks of the first pass's factors, as K-FAC keeps them (EKFAC re-estimates
        their eigenvalues in a second pass: :class:`~spectra.operators.ekfac.EKFACOperator`)."""
        return blocks

    # -- the parameter vector --------------------------------------------------------
    @property
    def variable_names(self) -> list[str]:
        """Names of the variables, in the order of the flat parameter vector."""
        return list(self.layout.names)

    @property
    def variable_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the variables, in the order of the flat parameter vector."""
        return list(self.layout.shapes)

    @property
    def num_examples(self) -> int:
        """N, the number of examples the factors average over."""
        return self._num_examples

    def flatten(self, tensors: Sequence[Any]) -> np.ndarray:
        """Concatenate per-variable arrays (row-major) into one flat vector."""
        return self.layout.flatten(tensors)

    def unflatten(self, vector: Any) -> list[np.ndarray]:
        """Split a flat vector into per-variable arrays (the inverse of :meth:`flatten`)."""
        return self.layout.unflatten(vector)

    # -- products ----------------------------------------------------------------------
    def _block_matrix(self, block: KFACBlock, X: np.ndarray) -> np.ndarray:
        """The rows of X for a block as matrices M (k, d_a, d_out), M[j] = unvec(X[:, j])."""
        d_out = block.G.shape[0]
        k = X.shape[1]
        parts = []
        if block.kernel_slice is not None:
            parts.append(X[block.kernel_slice].T.reshape(k, -1, d_out))
        if block.bias_slice is not None:
            parts.append(X[block.bias_slice].T.reshape(k, 1, d_out))
        return np.concatenate(parts, axis=1)

    def _put_block(self, block: KFACBlock, out: np.ndarray, M: np.ndarray) -> None:
        k = M.shape[0]
        rows = 0
        if block.kernel_slice is not None:
            rows = block.kernel_slice.stop - block.kernel_slice.start
            rows //= block.G.shape[0]
            out[block.kernel_slice] = M[:, :rows].reshape(k, -1).T
        if block.bias_slice is not None:
            out[block.bias_slice] = M[:, rows].T

    def _other_rows(self, X: np.ndarray) -> np.ndarray:
        if not self._other_slices:
            return np.zeros((0, X.shape[1]))
        return np.concatenate([X[s] for s in self._other_slices], axis=0)

    def _put_other(self, out: np.ndarray, rows: np.ndarray) -> None:
        start = 0
        for s in self._other_slices:
            n = s.stop - s.start
            out[s] = rows[start : start + n]
            start += n

    def _apply(self, X: np.ndarray, per_block: Any, per_other: Any) -> np.ndarray:
        out = np.zeros(X.shape, dtype=X.dtype)
        for index, block in enumerate(self.blocks):
            self._put_block(block, out, per_block(index, block, self._block_matrix(block, X)))
        if self._other_slices:
            self._put_other(out, per_other(self._other_rows(X)))
        return out

    def _checked(self, X: Any, method: str, dtype: Any = np.float64) -> np.ndarray:
        """X as a ``dtype`` block (P, k), refused as the exact operators refuse it (wrong
        shape, not real numbers, NaN or Inf, beyond the dtype's range)."""
        return validated_matrix(X, self.shape[0], self.dtype, method).astype(dtype, copy=False)

    def matvec(self, x: Any) -> np.ndarray:
        """K x for a vector of length P (or shape (P, 1)), in the operator's dtype."""
        array = np.asarray(x)
        if array.shape not in ((self.shape[0],), (self.shape[0], 1)):
            raise ValueError(
                f"expected a vector of length {self.shape[0]} (or shape ({self.shape[0]}, 1)); "
                f"got shape {array.shape}"
            )
        return self._matmat(array.reshape(-1, 1), "matvec").reshape(array.shape)

    def matmat(self, X: Any) -> np.ndarray:
        """K X for a block X of shape (P, k), in the operator's dtype."""
        return self._matmat(X)

    def rmatvec(self, x: Any) -> np.ndarray:
        """Kᵀ x = K x (K is symmetric)."""
        return self.matvec(x)

    def rmatmat(self, X: Any) -> np.ndarray:
        """Kᵀ X = K X (K is symmetric)."""
        return self._matmat(X)

    def _block_product(self, index: int, block: KFACBlock, M: np.ndarray) -> np.ndarray:
        """The block applied to M (k, d_a, d_out): A M G for K-FAC; for EKFAC
        Q_A [(Q_Aᵀ M Q_G) ∘ S] Q_Gᵀ; in M's dtype (the factors cast to it once)."""
        if block.scalings is None:
            A, G = self._factors_in(M.dtype, index, lambda: (block.A, block.G))
            return _sandwich(A, M, G)
        e = self._eigens()[index]
        QA, QG, scalings = self._factors_in(M.dtype, index, lambda: (e.QA, e.QG, block.scalings))
        return _sandwich(QA, _sandwich(QA.T, M, QG) * scalings, QG.T)

    def _factors_in(self, dtype: Any, index: int, factors: Any) -> tuple[np.ndarray, ...]:
        """``factors()`` (float64 arrays) in ``dtype``, cast once per block and dtype."""
        if dtype == np.float64:
            return factors()
        key = (np.dtype(dtype).name, index)
        found = self._cast_factors.get(key)
        if found is None:
            found = self._cast_factors[key] = tuple(np.asarray(f, dtype) for f in factors())
        return found

    def _matmat(self, X: np.ndarray, method: str = "matmat") -> np.ndarray:
        # Products in the operator's dtype: a float32 K-FAC multiplies in float32 (single
        # precision GEMMs, half the memory traffic), as the exact float32 operators do.
        X = self._checked(X, method, self.dtype)
        if self._products_in_tensorflow():
            return self._compiled_products()(X)
        diagonal = self._other_diagonal.astype(self.dtype, copy=False)
        out = self._apply(X, self._block_product, lambda rows: diagonal[:, None] * rows)
        return out.astype(self.dtype, copy=False)

    def _products_in_tensorflow(self) -> bool:
        """Whether products run as one compiled TensorFlow function
        (:class:`~spectra.operators.kronecker_products.KroneckerProducts`) rather than
        NumPy: as :data:`PRODUCTS_IN_TENSORFLOW` says (by default where TensorFlow has
        a GPU)."""
        if PRODUCTS_IN_TENSORFLOW is not None:
            return PRODUCTS_IN_TENSORFLOW
        if self._has_gpu is None:  # asked once, not on every product
            self._has_gpu = bool(tf.config.list_logical_devices("GPU"))
        return self._has_gpu

    @property
    def flushes_subnormals(self) -> bool:
        """Whether products run in TensorFlow (which flushes subnormals on a CPU) rather
        than NumPy (gradual underflow); read by the estimators' underflow check."""
        return self._products_in_tensorflow()

    def _kronecker_blocks(self, scalings: Sequence[np.ndarray | None]) -> list[KroneckerBlock]:
        """The blocks for :class:`KroneckerProducts`: K-FAC's A ⊗ G where ``scalings[i]``
        is None, else the eigen form Q_A diag(scalings) Q_Gᵀ in K-FAC's eigenbasis."""
        out = []
        for index, (block, scaling) in enumerate(zip(self.blocks, scalings)):
            common = (block.kernel_slice, block.bias_slice, block.G.shape[0])
            if scaling is None:
                out.append(KroneckerBlock(*common, A=block.A, G=block.G))
            else:
                e = self._eigens()[index]
                out.append(KroneckerBlock(*common, QA=e.QA, QG=e.QG, scalings=scaling))
        return out

    def _compiled_products(self) -> KroneckerProducts:
        """K's products as one compiled TensorFlow function, made once."""
        if self._compiled is None:
            self._compiled = KroneckerProducts(
                self.shape[0],
                self._kronecker_blocks([b.scalings for b in self.blocks]),
                self._other_slices,
                self._other_diagonal,
                self.dtype,
            )
        return self._compiled

    def memory_plan(self, block: int = 1) -> KFACMemoryPlan:
        """What this operator holds and what a product of ``block`` vectors adds, in bytes
        (a :class:`~spectra.operators.memory.KFACMemoryPlan`). Costs nothing.

        The factors are kept in float64 on the host (Σ_l d_a² + d_out², EKFAC's scalings
        d_a·d_out); the eigendecompositions (made by the spectrum, the inverse, EKFAC's
        products) as much again; products in TensorFlow keep a copy of the factors in the
        operator's dtype where they run (the GPU when there is one). The build's own
        peak (a batch's activations and output gradients) is not part of it.
        """
        block = check_int("block", block, minimum=1)
        itemsize = np.dtype(self.dtype).itemsize
        factors = (
            sum(
                b.A.nbytes + b.G.nbytes + (b.scalings.nbytes if b.scalings is not None else 0)
                for b in self.blocks
            )
            + self._other_diagonal.nbytes
        )
        eigen = sum(b.A.nbytes + b.G.nbytes for b in self.blocks)
        in_tensorflow = self._products_in_tensorflow()
        # Products in TensorFlow keep the factors in the operator's dtype where they run;
        # NumPy products in float32 keep a float32 copy (float64 ones use the factors).
        copies = factors * itemsize // 8 if in_tensorflow or itemsize != 8 else 0
        if self.eigenvalue_corrected and copies:  # Q_A, Q_G and the scalings
            copies = sum(b.A.nbytes + b.G.nbytes + b.size * 8 for b in self.blocks) * itemsize // 8
        widest = max((b.size for b in self.blocks), default=0)
        return KFACMemoryPlan(
            factors=factors,
            eigendecompositions=eigen,
            eigendecompositions_made=self._eigen is not None,
            product_copies=copies,
            block_size=block,
            per_vector=(4 * self.shape[0] + 2 * widest) * itemsize,
            device="TensorFlow" if in_tensorflow else "NumPy",
        )

    # -- the exact spectrum --------------------------------------------------------------
    def _eigens(self) -> list[Eigen]:
        if self._eigen is None:
            eps = float(np.finfo(self.dtype).eps)
            self._eigen = [block_eigen(b, eps) for b in self.blocks]
        return self._eigen

    def _block_values(self, index: int) -> np.ndarray:
        """The eigenvalues of block ``index`` as a d_a × d_out matrix (entry (i, j) belongs
        to the eigenvector q_A,i ⊗ q_G,j): α γᵀ for K-FAC, the scalings for EKFAC."""
        block = self.blocks[index]
        e = self._eigens()[index]
        if block.scalings is not None:
            return np.where(np.outer(e.alpha > 0, e.gamma > 0), block.scalings, 0.0)
        return np.outer(e.alpha, e.gamma)

    def eigenvalues(self) -> np.ndarray:
        """All eigenvalues, exact, in descending order: α_i γ_j for every pair of
        eigenvalues of each block's A and G (EKFAC: its scalings), and the diagonal of the
        other variables (0 when excluded). Cost: one eigendecomposition per factor
        (cached)."""
        parts = [self._block_values(i).ravel() for i in range(len(self.blocks))]
        parts.append(self._other_diagonal)
        return np.sort(np.concatenate(parts))[::-1]

    def trace(self) -> float:
        """tr K = Σ_l tr A_l · tr G_l (+ the other variables' diagonal), exact."""
        total = sum(
            float(np.trace(b.A)) * float(np.trace(b.G))
            if b.scalings is None
            else float(b.scalings.sum())
            for b in self.blocks
        )
        return total + float(self._other_diagonal.sum())

    def frobenius_norm(self) -> float:
        """‖K‖_F = √(Σ_l ‖A_l‖_F² ‖G_l‖_F² + Σ d²), exact."""
        squares = sum(
            float(np.sum(b.A**2)) * float(np.sum(b.G**2))
            if b.scalings is None
            else float(np.sum(b.scalings**2))
            for b in self.blocks
        ) + float(np.sum(self._other_diagonal**2))
        return math.sqrt(squares)

    def _check_invertible(self, damping: Any, method: str) -> float:
        """``damping`` as a float ≥ 0 for which K + δI is invertible to working precision;
        a one-line ``ValueError`` otherwise.

        K's eigenvalues that are zero to working precision (a factor's, see
        :func:`~spectra.operators.kfac_blocks.factor_eigen`; a zero EKFAC scaling or
        excluded variable) are exactly 0 in :meth:`eigenvalues`, but each may truly be as
        large as a bound u set by the rounding of the factors' dtype. K + δI is refused
        when δ ≤ u: its smallest eigenvalue would be rounding, not a number of the matrix.
        The suggested damping, max(1e-3 λ_max, 100 u), is accepted and puts that rounding
        below 1 %.
        """
        damping = check_float("damping", damping, positive=False)
        if damping < 0:
            raise ValueError(f"{method}: damping must be >= 0, got {damping}")
        if not self.shape[0]:
            return damping
        values = self.eigenvalues()
        zeros = int(np.count_nonzero(values == 0))
        if not zeros:
            return damping
        eigens = self._eigens()
        bounds = [
            e.zero_bound()
            for index, e in enumerate(eigens)
            if np.any(self._block_values(index) == 0)
        ]
        bound = max(bounds, default=0.0)
        if damping > bound:
            return damping
        largest = float(values[0])
        shown = _round_up(bound) if bound else 0.0  # printed rounded up: a safe threshold
        if 1e-3 * largest >= 100.0 * bound and largest > 0:
            suggestion, why = _round_up(1e-3 * largest), "1e-3 of the largest eigenvalue"
        else:
            suggestion, why = _round_up(100.0 * bound or 1.0), "100 times the rounding bound"
        within = f" (true size at most {shown:.2g}, {self.dtype} rounding)" if bound else ""
        raise ValueError(
            f"{method}: K + {damping:g}·I is singular: {zeros} of K's {self.shape[0]} "
            f"eigenvalues are 0{within}, the largest is {largest:.3g}; pass damping > "
            f"{shown:.2g}, e.g. damping={suggestion:.2g} ({why})."
        )

    def logdet(self, damping: float = 0.0) -> float:
        """log det(K + δI) = Σ log(α_i γ_j + δ), exact, evaluated as
        Σ logaddexp(log α_i + log γ_j, log δ) so that neither the products nor the sum
        underflow (EKFAC: Σ log(s_ij + δ)). ``damping`` δ ≥ 0; a one-line ``ValueError``
        when K + δI is singular to working precision (K is PSD and usually rank-deficient:
        the message gives a damping that works)."""
        damping = self._check_invertible(damping, "logdet")
        with np.errstate(divide="ignore"):
            log_damping = math.log(damping) if damping > 0 else -math.inf
            total = 0.0
            for index, block in enumerate(self.blocks):
                e = self._eigens()[index]
                if block.scalings is None:
                    logs = np.log(e.alpha)[:, None] + np.log(e.gamma)[None, :]
                else:
                    logs = np.log(self._block_values(index))
                total += float(np.sum(np.logaddexp(logs, log_damping)))
            total += float(np.sum(np.logaddexp(np.log(self._other_diagonal), log_damping)))
        return total

    def inverse(self, damping: float) -> LinearOperator:
        """(K + δI)⁻¹ as a ``LinearOperator``, exact through the factors'
        eigendecompositions: per block, V ↦ Q_A [(Q_Aᵀ V Q_G) / (α γᵀ + δ)] Q_Gᵀ.
        ``damping`` δ ≥ 0; a one-line ``ValueError`` when K + δI is singular to working
        precision (the message gives a damping that works). Vectors with NaN or Inf are
        refused as :meth:`matvec` refuses them. Returns float64 vectors.

        Precision and cost: 4 d_a d_out (d_a + d_out) flops per block and vector, in
        float64, except for float32 vectors given to a float32 operator: then in float32
        (half the time: single-precision GEMMs, half the memory traffic), each vector
        scaled to a largest entry of 1 and the reciprocals 1/(α γᵀ + δ) to a largest of 1,
        so nothing overflows or underflows (taken only when the reciprocals span at most
        ``2^60``, else float64). With u the float32 unit roundoff, the float32 result is
        (K + δI)⁻¹ (v + e₁) + e₂ with ‖e₁‖ ≲ d u ‖v‖ and ‖e₂‖ ≲ d u ‖y‖ (orthogonal
        rotations are backward stable; d the largest factor's size): the error that the
        vector's own float32 rounding already carries through the exact inverse, so the
        answer is exact to what a float32 caller can see (tested against a float64 dense
        inverse of the Kronecker blocks). Float64 vectors get float64 products, as
        before."""
        damping = self._check_invertible(damping, "inverse")
        eigens = self._eigens()
        reciprocals = [1.0 / (self._block_values(i) + damping) for i in range(len(self.blocks))]
        other_reciprocals = 1.0 / (self._other_diagonal + damping)
        largest = max(
            (float(r.max()) for r in [*reciprocals, other_reciprocals] if r.size), default=1.0
        )
        smallest = min(
            (float(r.min()) for r in [*reciprocals, other_reciprocals] if r.size), default=1.0
        )
        single = np.dtype(self.dtype) == np.float32 and largest <= 2.0**60 * smallest
        cast: list[tuple[np.ndarray, ...]] = []  # the float32 eigenvectors, made once

        def per_block(index: int, _block: KFACBlock, M: np.ndarray) -> np.ndarray:
            e = eigens[index]
            rotated = _sandwich(e.QA.T, M, e.QG)
            return _sandwich(e.QA, rotated / (self._block_values(index) + damping), e.QG.T)

        def per_other(rows: np.ndarray) -> np.ndarray:
            return rows / (self._other_diagonal + damping)[:, None]

        def per_block_single(index: int, _block: KFACBlock, M: np.ndarray) -> np.ndarray:
            QA, QG, scaled = cast[index]
            return _sandwich(QA, _sandwich(QA.T, M, QG) * scaled, QG.T)

        def single_precision(X: np.ndarray) -> np.ndarray:
            """The float32 products of the docstring, on X scaled per column."""
            if not cast:
                for e, r in zip(eigens, reciprocals):
                    f32 = np.float32
                    cast.append((e.QA.astype(f32), e.QG.astype(f32), (r / largest).astype(f32)))
                cast.append(((other_reciprocals / largest).astype(np.float32),))
            scale = np.max(np.abs(X), axis=0)
            scale[scale == 0] = 1.0
            other = cast[-1][0]
            out = self._apply(X / scale, per_block_single, lambda rows: rows * other[:, None])
            return out.astype(np.float64) * (scale.astype(np.float64) * largest)

        def matmat(X: np.ndarray) -> np.ndarray:
            given = np.asarray(X)
            X = self._checked(
                given, "inverse", np.float32 if given.dtype == np.float32 else np.float64
            )
            if compiled is not None:
                return compiled(X.astype(np.float64, copy=False))
            if single and X.dtype == np.float32:
                return single_precision(X)
            return self._apply(X, per_block, per_other)

        compiled = None
        if self._products_in_tensorflow():
            compiled = KroneckerProducts(
                self.shape[0],
                self._kronecker_blocks(reciprocals),
                self._other_slices,
                other_reciprocals,
                np.float64,
            )

        return LinearOperator(
            shape=self.shape,
            dtype=np.float64,
            matvec=lambda x: matmat(np.asarray(x).reshape(-1, 1)).reshape(-1),
            rmatvec=lambda x: matmat(np.asarray(x).reshape(-1, 1)).reshape(-1),
            matmat=matmat,
        )

    def to_dense(self) -> np.ndarray:
        """K as a dense float64 matrix (P × P; refused above 20 000 rows): the Kronecker
        products placed at each block's rows and columns."""
        size = self.shape[0]
        if size > MAX_DENSE_SIZE:
            raise ValueError(
                f"to_dense() would build a {size} x {size} matrix (more than {MAX_DENSE_SIZE} "
                "rows); use the products, eigenvalues() or trace() instead."
            )
        return self._apply(
            np.eye(size), self._block_product, lambda rows: self._other_diagonal[:, None] * rows
        )

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} kind={self.kind!r} of {len(self.blocks)} layers, "
            f"{self.shape[0]} parameters, dtype={self.dtype}>"
        )


# -- from_keras's steps ---------------------------------------------------------------------
#: A factored layer, with the indices of its kernel and bias among the operator's variables
#: (None: not one of them).
_Slot = tuple[Any, int | None, int | None]


@dataclasses.dataclass(frozen=True)
class _Options:
    """``from_keras``'s choices of the matrix, checked."""

    kind: str
    num_samples: int
    seed: int
    other_variables: str
    conv: str
    tied_embeddings: str

    @classmethod
    def checked(
        cls,
        *,
        kind: Any,
        num_samples: Any,
        seed: Any,
        other_variables: Any,
        conv: Any,
        tied_embeddings: Any,
    ) -> _Options:
        """The options, each checked (``TypeError``/``ValueError`` in one line)."""
        kind = check_choice("kind", kind, KINDS)
        num_samples = check_int("num_samples", num_samples, minimum=1)
        if kind != "mc" and num_samples != 1:
            raise ValueError("num_samples is for kind='mc'; the other kinds draw no labels.")
        seed = cast(
            int, check_seed("seed", seed, below=2**62, allow_none=False, allow_generator=False)
        )
        other_variables = check_choice("other_variables", other_variables, OTHER_VARIABLES)
        conv = check_choice("conv", conv, CONV_VARIANTS)
        tied_embeddings = check_choice("tied_embeddings", tied_embeddings, TIED_EMBEDDINGS)
        return cls(kind, num_samples, seed, other_variables, conv, tied_embeddings)


def _one_loss(model: Any, loss: Any) -> Any:
    """``loss``, or the loss ``model`` was compiled with (None); several losses are
    refused in one line."""
    if loss is None:
        loss, loss_weights = keras_models.compiled_loss(model)
        if loss_weights is not None:
            raise ValueError("K-FAC supports one output with one loss; loss_weights were given.")
    if isinstance(loss, (list, tuple, dict)):
        raise ValueError(
            "K-FAC supports a model with one output and one loss; got a "
            f"{type(loss).__name__} of losses. Use GGNOperator for several outputs."
        )
    return loss


@dataclasses.dataclass(frozen=True)
class _LossReading:
    """How K-FAC reads the loss: ``loss`` as given, ``call`` its batch mean in the pass's
    dtype and ``reduction``; ``distribution`` the predictive distribution (mc only);
    ``found`` the Keras function behind it (None for a custom loss); ``reads_logits``
    whether it is split at the logits behind a softmax/sigmoid output, and ``convex``
    whether it is convex at the split."""

    loss: Any
    call: Any
    reduction: str
    distribution: Any
    found: tuple[Any, dict[str, Any], str] | None
    reads_logits: bool
    convex: bool

    @classmethod
    def of(cls, loss: Any, target: tf.DType, kind: str) -> _LossReading:
        """The reading of ``loss`` for a pass in ``target`` of the matrix ``kind``
        (mc and empirical refuse a ``reduction="sum"`` loss)."""
        resolved = keras_models.resolve_loss(loss, target)
        reduction = keras_models.reduction_of(resolved.call)
        if kind != "type-2":
            check_fisher_reduction(resolved.call)
        distribution = predictive_distribution(loss) if kind == "mc" else None
        found = keras_loss_function(loss)
        reads_logits = (
            found is not None
            and found[0].__name__ in _LOGIT_LOSSES
            and not found[1].get("from_logits", False)
        )
        # Losses convex at the point K-FAC splits (the logits for Keras' cross-entropies):
        # a negative eigenvalue of their output Hessian is rounding, by theorem.
        convex = found is not None and (
            found[0] in convex_losses()
            and (
                reads_logits
                or found[0] is keras.losses.mean_squared_error
                or bool(found[1].get("from_logits", False))
            )
        )
        return cls(loss, resolved.call, reduction, distribution, found, reads_logits, convex)


@dataclasses.dataclass(frozen=True)
class _Parameters:
    """The operator's variables: ``names``, ``shapes`` and ``offsets`` (where each starts
    in the flat parameter vector, then its end); ``positions``, their indices among the
    model's weights, and ``chosen``, the same variables in ``run_model``, the model the
    passes run (the model itself, or its clone in ``dtype``)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: np.ndarray
    positions: list[int]
    chosen: list[Any]
    run_model: Any
    dtype: tf.DType

    @classmethod
    def of(
        cls, variables: Sequence[Any], positions: Sequence[int], run_model: Any, dtype: tf.DType
    ) -> _Parameters:
        """The parameters of ``variables`` (at ``positions`` among the model's weights)."""
        run_weights = list(run_model.weights)
        chosen = [run_weights[p] for p in positions]
        names = [variable_name(v) for v in variables]
        shapes = [tuple(int(d) for d in v.shape) for v in variables]
        offsets = np.concatenate([[0], np.cumsum([int(np.prod(s)) for s in shapes])])
        return cls(names, shapes, offsets, list(positions), chosen, run_model, dtype)

    def slice(self, j: int) -> slice:
        """Where variable ``j`` lies in the flat parameter vector."""
        return slice(int(self.offsets[j]), int(self.offsets[j + 1]))

    def index_of(self, weight: Any) -> int | None:
        """The index of ``weight`` (by identity) among the variables, None if not one."""
        for j, v in enumerate(self.chosen):
            if v is weight:
                return j
        return None


@dataclasses.dataclass(frozen=True)
class _Layers:
    """The layers K-FAC factors (``layout``: each with its kernel's and bias's indices
    among the variables) and the indices of the variables outside them (``others``)."""

    layout: list[_Slot]
    others: list[int]

    @property
    def layers(self) -> list[Any]:
        """The factored layers, in the order of their blocks."""
        return [layer for layer, _, _ in self.layout]


def _check_factorable(layer: Any, base: Any) -> None:
    """Refuse (one line) a layer of a factored class ``base`` that K-FAC cannot factor:
    its own ``call``, a Conv layer not channels-last or grouped, LoRA or quantization, an
    EinsumDense that is not a Dense layer over positions, an Embedding K-FAC does not
    cover."""
    if type(layer).call is not base.call:
        raise ValueError(
            f"K-FAC: layer {layer.name!r} ({type(layer).__name__}) overrides "
            f"{base.__name__}.call, so its pre-activations are not a W + b; spectra "
            "cannot factor it."
        )
    if base in (keras.layers.Conv1D, keras.layers.Conv2D) and (
        layer.data_format != "channels_last" or layer.groups != 1
    ):
        raise ValueError(
            f"K-FAC supports {base.__name__} layers with data_format='channels_last' and "
            f"groups=1; layer {layer.name!r} has data_format={layer.data_format!r}, "
            f"groups={layer.groups}. Pass other_variables='exclude' or 'diagonal' after "
            "making it non-trainable, or use GGNOperator."
        )
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        raise ValueError(
            f"K-FAC: the layer {layer.name!r} is LoRA-enabled or quantized; its "
            "kernel is not one matrix. Merge or dequantize it first."
        )
    if base in (keras.layers.Dense, keras.layers.EinsumDense):
        rank = static_rank(layer) if base is keras.layers.EinsumDense else 2
        dense_form(layer, rank)  # an EinsumDense that is not Dense-like: refused
    if isinstance(layer, keras.layers.Embedding):
        check_embedding(layer)


def _factored_layers(model: Any, parameters: _Parameters, other_variables: str) -> _Layers:
    """The layers of ``parameters.run_model`` that K-FAC factors (those of a factored
    class with a variable of the operator), each checked; refused in one line when there
    is none, or when variables lie outside them with ``other_variables="error"``."""
    layout: list[_Slot] = []
    covered: set[int] = set()
    for layer in _keras_compat.flatten_layers(parameters.run_model):
        if not isinstance(layer, FACTORED):
            continue
        base = next(kind for kind in FACTORED if isinstance(layer, kind))
        k = parameters.index_of(kernel_of(layer))
        bias = getattr(layer, "bias", None)
        b = parameters.index_of(bias) if bias is not None else None
        if k is None and b is None:
            continue
        _check_factorable(layer, base)
        layout.append((layer, k, b))
        covered.update(j for j in (k, b) if j is not None)
    chosen = parameters.chosen
    others = [j for j in range(len(chosen)) if j not in covered]
    if others and other_variables == "error":
        raise ValueError(
            uncovered_message(
                parameters.run_model, [chosen[j] for j in others], parameters.names, others
            )
        )
    if not layout:
        raise ValueError(
            f"model {model.name!r} has no {FACTORED_NAMES.replace(' and ', ' or ')} layer "
            "with trainable variables: K-FAC covers those layers only."
        )
    return _Layers(layout, others)


@dataclasses.dataclass
class FactorPasses:
    """The passes over the data of one build: K-FAC's factors (:meth:`run`), then
    EKFAC's scalings. ``compiled``: the batch step; ``accumulators``: the sums each pass
    leaves on the host; ``transposed``: per factored layer, a tied ReversibleEmbedding
    accumulated at its reverse call; ``seed``, ``total``: the labels' seed and N as the
    step takes them; ``reads_logits``: where the loss is split, known from the loss or
    found on the first batch (a custom loss reading the logits behind the output) and
    kept for the later passes; ``traces_before``: the compiled pass's trace counts when
    the build began."""

    compiled: CompiledPass
    batches: Batches
    accumulators: Accumulators
    dtype: tf.DType
    transposed: list[bool]
    num_examples: int
    seed: tf.Tensor
    total: tf.Tensor
    reads_logits: bool
    traces_before: dict[str, int]
    #: The operator's variables (of the model, not of a clone made for the dtype), named
    #: in the refusal of a non-finite one.
    weights: list[Any] = dataclasses.field(default_factory=list)

    def run(self, want_diagonal: bool, scalings: bool = False) -> None:
        """One pass over the data, its sums copied to ``accumulators`` at its end: A and
        G (and the other variables' diagonal when ``want_diagonal``), or with
        ``scalings`` EKFAC's S in the eigenbases ``accumulators.bases``."""
        state = self.compiled.initial_state(scalings, want_diagonal)
        bases = (
            [(tf.constant(QA), tf.constant(QG)) for QA, QG in self.accumulators.bases]
            if scalings and self.accumulators.bases is not None
            else None
        )
        first_index = 0  # of the batch's first example in the dataset
        for index, (batch, _weight) in enumerate(self.batches):
            x, y, sample_weight = keras_models.unpack_batch(batch)
            if sample_weight is not None:
                raise ValueError(
                    "K-FAC does not take sample weights: pass (x, y) data (the factors "
                    "are expectations over examples, each counted once)."
                )
            n = len(tf.nest.flatten(y)[0])
            arguments = (x, y, tf.constant(first_index, tf.int32), self.seed, self.total)
            updated, report = self._step(index, (*arguments, state, bases), scalings, want_diagonal)
            self._check(report, n, x)
            state = updated
            first_index += n
        # The sums reach the host once per pass.
        if scalings:
            self.accumulators.S = [np.asarray(S) for S in state["S"]]
            return
        self.accumulators.A = [np.asarray(A) for A in state["A"]]
        self.accumulators.G = [np.asarray(G) for G in state["G"]]
        if want_diagonal:
            self.accumulators.diagonal = [np.asarray(d) for d in state["diagonal"]]

    def _step(
        self, index: int, arguments: tuple[Any, ...], scalings: bool, want_diagonal: bool
    ) -> tuple[dict[str, list[tf.Tensor]], Any]:
        """Batch ``index``'s compiled step at the split known so far; at the logits, and
        from then on, when its trace finds that the loss reads them. A step that fails
        is first blamed on a non-finite weight, if there is one (the op that failed on
        it, e.g. an eigendecomposition of NaNs, says less)."""
        try:
            try:
                return self._call(index, arguments, scalings, want_diagonal)
            except SplitAtLogits:
                self.reads_logits = True  # nothing was accumulated: redo the batch
                return self._call(index, arguments, scalings, want_diagonal)
        except Exception:
            try:
                self._check_weights()
            except ValueError as error:
                raise error from None
            raise

    def _check_weights(self) -> None:
        """Refuse (one line) the first non-finite weight, by name."""
        for weight in self.weights:
            keras_models.check_finite(tf.convert_to_tensor(weight), variable_name(weight))

    def _call(
        self, index: int, arguments: tuple[Any, ...], scalings: bool, want_diagonal: bool
    ) -> tuple[dict[str, list[tf.Tensor]], Any]:
        """The compiled step for the split known so far, called on ``arguments``."""
        with graph_errors(self.batches.describe(index)):
            step = self.compiled.function(self.reads_logits, scalings, want_diagonal)
            return step(*arguments)

    def _check(self, report: Any, n: int, x: Any) -> None:
        """Refuse (one line) non-finite weights, a batch with a non-finite loss or
        output-Hessian blocks that disagree with its product; keep type-2's output-Hessian
        extremes."""
        if not bool(report["weights_finite"]):
            self._check_weights()
        if not math.isfinite(float(report["loss"])):
            keras_models.check_finite(report["loss"], "the batch loss", inputs=x)
        values = {
            key: float(value)
            for key, value in report.items()
            if key not in ("loss", "weights_finite")
        }
        self.compiled.check(values, n, self.dtype)
        if "most_negative" in values:
            accumulators = self.accumulators
            accumulators.most_negative = max(accumulators.most_negative, values["most_negative"])
            accumulators.hessian_scale = max(accumulators.hessian_scale, values["hessian_scale"])

    def build_traces(self) -> dict[str, int]:
        """How many times this build traced each pass kind ("factors", "scalings"): 1 per
        batch shape on a model's first build, 0 when the compiled pass was reused."""
        return {
            what: count - self.traces_before[what] for what, count in self.compiled.traces.items()
        }


def _factor_passes(
    owner: str,
    model: Any,
    data: Any,
    batch_size: int | None,
    reading: _LossReading,
    parameters: _Parameters,
    layers: _Layers,
    options: _Options,
) -> FactorPasses:
    """The passes of a build of ``owner`` (the operator class's name): the batches (the
    data checked against the model), the sums and the compiled step."""
    target = parameters.dtype
    batches = Batches(
        data,
        batch_size,
        cast_floats_to=target,
        purpose=f"{owner} (its factors' data passes)",
    )
    # Class labels and Embedding indices in range, input dtypes and shapes, before any
    # graph (as for every operator): one-line errors instead of the graph's.
    check_keras_data(model, reading.loss, batches)
    num_examples = batches.num_examples
    # A tied ReversibleEmbedding factored at its reverse call z = h Wᵀ: accumulated as
    # the Dense layer of kernel Wᵀ (A over h, G over the V logits), then transposed
    # into the table's row-major layout (rows V, columns d).
    transposed = [is_tied(layer) and options.tied_embeddings == "output" for layer in layers.layers]
    accumulators = Accumulators(layers.layout, layers.others, parameters.chosen, transposed)
    accumulators.conv = options.conv
    compiled = _compiled_pass(
        model, reading, parameters, layers, options, transposed, accumulators.others
    )
    return FactorPasses(
        compiled=compiled,
        batches=batches,
        accumulators=accumulators,
        dtype=target,
        transposed=transposed,
        num_examples=num_examples,
        # The same labels in every pass and for every batching: stateless, from the seed
        # and each example's index.
        seed=tf.constant(options.seed, tf.int64),
        total=tf.constant(float(num_examples), tf.float64),
        # Split at the logits: known from the loss for Keras' own cross-entropies, found
        # on the first batch for a custom loss that reads them (its gradient in the
        # softmax output is None).
        reads_logits=reading.reads_logits,
        traces_before=dict(compiled.traces),
    )


def _compiled_pass(
    model: Any,
    reading: _LossReading,
    parameters: _Parameters,
    layers: _Layers,
    options: _Options,
    transposed: list[bool],
    others: list[Any],
) -> CompiledPass:
    """The compiled batch step of these settings, shared by the operators built on the
    same model with the same settings (not on a clone made for this build's dtype: used
    once); ``others``: the variables outside the factored layers."""
    settings = PassSettings(
        loss=reading.call,
        tied_embeddings=options.tied_embeddings,
        # Keras' own losses whose output Hessian per position has a closed form.
        closed=closed_form(reading.found, reading.reads_logits),
        reduction=reading.reduction,
        kind=options.kind,
        num_samples=options.num_samples,
        distribution=reading.distribution,
        conv=options.conv,
    )
    loss_id, loss_owners = keras_models.loss_key(reading.loss)
    pass_key = (
        None
        if parameters.run_model is not model
        else (
            id(model),
            loss_id,
            parameters.dtype.name,
            tuple(parameters.positions),
            options.kind,
            options.num_samples,
            options.other_variables,
            options.conv,
            options.tied_embeddings,
        )
    )
    return compiled_pass(
        pass_key,
        (model, *loss_owners),
        functools.partial(
            CompiledPass,
            parameters.run_model,
            layers.layers,
            layers.layout,
            transposed,
            others,
            settings,
        ),
    )


def _factor_blocks(
    layers: _Layers, parameters: _Parameters, passes: FactorPasses
) -> list[KFACBlock]:
    """The factored layers' blocks from the first pass's sums, averaged over the examples
    (a tied table's factors of Wᵀ swapped into its layout); refused in one line when a
    factor is not finite."""
    num_examples = passes.num_examples
    accumulators = passes.accumulators
    blocks = []
    for (layer, k, b), A, G, flip in zip(
        layers.layout, accumulators.A, accumulators.G, passes.transposed
    ):
        A = A / num_examples
        G = G / num_examples
        if flip:  # the table W = (Wᵀ)ᵀ: its rows are the logits, its columns h
            A, G = G, A
        for factor, what in ((A, "A"), (G, "G")):
            if not np.all(np.isfinite(factor)):
                raise ValueError(
                    f"K-FAC: the factor {what} of layer {layer.name!r} is not finite (NaN or "
                    "Inf in the activations or output gradients); check the data and weights."
                )
        blocks.append(
            KFACBlock(
                layer=layer.name,
                A=A,
                G=G,
                kernel=None if k is None else parameters.names[k],
                bias=None if b is None else parameters.names[b],
                kernel_slice=None if k is None else parameters.slice(k),
                bias_slice=None if b is None else parameters.slice(b),
            )
        )
    return blocks


def _other_diagonal(
    layers: _Layers, passes: FactorPasses, other_variables: str
) -> np.ndarray | None:
    """The diagonal of the other variables (``other_variables="diagonal"``), averaged over
    the examples and checked finite; None otherwise."""
    if not (layers.others and other_variables == "diagonal"):
        return None
    diagonal = np.concatenate([d / passes.num_examples for d in passes.accumulators.diagonal])
    if not np.all(np.isfinite(diagonal)):
        raise ValueError("K-FAC: the diagonal of the other variables is not finite.")
    return diagonal
