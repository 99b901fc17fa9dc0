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
(``tied_embeddings``). See :class:`KFACOperator`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import string
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import keras
import numpy as np
import tensorflow as tf
from scipy.linalg import lapack
from scipy.sparse.linalg import LinearOperator

from spectra import _keras_compat, _tf_compat
from spectra._validation import check_choice, check_float, check_int, check_seed
from spectra.operators import keras_models
from spectra.operators.batching import Batches
from spectra.operators.curvature import variable_name
from spectra.operators.data_checks import _loss_function, check_keras_data, graph_errors
from spectra.operators.engine import register_compiled_cache
from spectra.operators.fisher import _check_reduction, _last_axis, predictive_distribution
from spectra.operators.kronecker_products import KroneckerBlock, KroneckerProducts
from spectra.operators.layout import (
    ParameterLayout,
    SymmetricProducts,
    validated_matrix,
)
from spectra.operators.memory import KFACMemoryPlan

__all__ = ["EKFACOperator", "KFACBlock", "KFACOperator"]

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
#: Largest Embedding vocabulary K-FAC factors: its A is held as a dense V × V float64
#: matrix (128 MiB at this size) and each batch's inputs as one-hot rows.
MAX_VOCABULARY = 4096
#: The layers K-FAC factors (a weight matrix W, and a bias for all but Embedding), most
#: specific first (the class whose ``call`` a layer must not override).
_FACTORED = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    *([keras.layers.ReversibleEmbedding] if hasattr(keras.layers, "ReversibleEmbedding") else []),
    keras.layers.Embedding,
)
#: The layers as errors list them.
_FACTORED_NAMES = "Dense, EinsumDense, Conv1D, Conv2D and Embedding"


@dataclasses.dataclass(frozen=True)
class KFACBlock:
    """One factored layer's Kronecker factors.

    ``A`` (d_a × d_a): E[ā āᵀ] over examples, with ā the layer's input a (when its kernel
    is a variable of the operator) followed by 1 (when its bias is). ``G`` (d_out × d_out):
    E[Σ_c g_c g_cᵀ] of the pre-activation output gradients. For a layer shared over
    positions, both as the ``conv`` variant defines them (:class:`KFACOperator`).
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
class _Eigen:
    """Eigendecompositions of one block's factors, with the eigenvalues that are zero to
    the working precision set to exactly 0 (see :func:`_factor_eigen`); ``bound_A``,
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


#: A factor's eigenvalue is zero to working precision when, on the factor scaled to a unit
#: diagonal (D⁻¹ F D⁻¹, D = diag(F)^½), it is at most this many units of rounding of the
#: dtype the factor was computed in. The scaled factor's entries carry errors of a few
#: units of rounding whatever the scale or grading of the data; measured on the digits
#: MLP: the softmax null direction of G at 0.9-10 units (float32 and float64), the smallest
#: genuine eigenvalues at 50 units and more (float32).
_ROUNDING_UNITS = 32


def _factor_eigen(F: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Eigenvalues (ascending) and orthonormal eigenvectors of a PSD factor F (float64,
    computed from data in a dtype of unit roundoff ``eps``), and a bound on the zeroed ones.

    Rows with a zero diagonal are exact null directions. On the rest, F = D F̃ D with
    D = diag(F)^½ and F̃ of unit diagonal: the eigenvalues of F̃ at most
    ``_ROUNDING_UNITS``·eps are rounding, so F has that many eigenvalues exactly 0, each of
    true size at most ``_ROUNDING_UNITS``·eps·‖D Ṽₙ‖² (the returned bound; Ṽₙ those
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
    scaled_values, scaled_vectors = np.linalg.eigh(sub / np.outer(scale, scale))
    keep = scaled_values > _ROUNDING_UNITS * eps
    rank = int(keep.sum())
    # The discarded part D Ṽₙ diag(w̃ₙ) Ṽₙᵀ D has norm at most τ ‖D Ṽₙ‖², τ the threshold.
    null = scale[:, None] * scaled_vectors[:, ~keep]
    bound = _ROUNDING_UNITS * eps * float(np.linalg.norm(null, 2) ** 2) if rank < m else 0.0
    w, V = np.linalg.eigh(sub)
    w[: m - rank] = 0.0
    # eigh resolves the smallest kept eigenvalue to a relative eps64 ‖F‖ / λ; the data
    # determine it only to about eps / w̃ (w̃ the smallest kept of F̃). The Jacobi SVD (a
    # few times the cost) when eigh is the worse of the two and worse than 1e-8.
    f64 = float(np.finfo(np.float64).eps)
    if rank and f64 * w[-1] > w[m - rank] * max(1e-8, eps / scaled_values[keep].min()):
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


class _Capture:
    """Record each factored layer's input a (n, T, d_in: T positions, 1 for a layer applied
    once per example) and pre-activation output z = a W + b during one forward pass, by
    replacing the layer's ``call`` (an instance attribute, removed on exit) with the same
    computation written out, so that z is a tensor the tapes see.

    Why this way: Keras' Dense computes z inside ``call`` and returns only σ(z); wrapping
    ``call`` gives both a and z from the model's own forward pass (any model structure:
    Sequential, functional, subclassed, nested) without rebuilding the graph, and the
    gradient in z then comes from the tape, not from an added perturbation variable whose
    shape would depend on the batch.
    """

    def __init__(
        self,
        layers: Sequence[Any],
        tapes: Sequence[tf.GradientTape],
        tied_embeddings: str = "error",
    ) -> None:
        self._layers = list(layers)
        self._tapes = list(tapes)
        #: Which use of a tied ReversibleEmbedding's table is recorded (``from_keras``).
        self._tied = tied_embeddings
        self.records: dict[int, tuple[tf.Tensor, tf.Tensor]] = {}
        #: What the layers could not capture, raised after the forward pass (an error raised
        #: inside ``call`` reaches the user wrapped in Keras' multi-line context).
        self.errors: list[str] = []

    def check(self) -> None:
        """Raise the first capture problem as a one-line ``ValueError``."""
        if self.errors:
            raise ValueError(self.errors[0])

    def _refuse(self, layer: Any, message: str, inputs: Any) -> tf.Tensor:
        """Note ``message`` and compute the layer as Keras does, so the pass completes."""
        self.errors.append(message)
        return type(layer).call(layer, inputs)

    def _shared(self, layer: Any) -> str | None:
        if id(layer) not in self.records:
            return None
        return (
            f"K-FAC: the {type(layer).__name__} layer {layer.name!r} is called more than once "
            "in a forward pass (shared weights), which its Kronecker factors do not model; use "
            "GGNOperator or FisherOperator."
        )

    def __enter__(self) -> _Capture:
        for layer in self._layers:
            layer.call = self._call_of(layer)
        return self

    def __exit__(self, *exc: Any) -> None:
        for layer in self._layers:
            layer.__dict__.pop("call", None)

    def _call_of(self, layer: Any) -> Any:
        if isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D)):
            return self._conv_call_of(layer)
        if isinstance(layer, keras.layers.Embedding):
            return self._embedding_call_of(layer)

        def call(inputs: Any, *args: Any, **kwargs: Any) -> tf.Tensor:
            shared = self._shared(layer)
            if shared:
                return self._refuse(layer, shared, inputs)
            x = tf.convert_to_tensor(inputs)
            try:
                form = _dense_form(layer, x.shape.rank)
            except ValueError as error:
                return self._refuse(layer, str(error), inputs)
            kernel = tf.convert_to_tensor(layer.kernel)
            # z in (batch, positions..., outputs...) order, the kernel's output axes last
            # in its own order; a in (batch, positions..., contracted...) order, so that
            # both flatten to (n, T, d) with the kernel's rows and columns row-major.
            z = tf.einsum(form.product, x, kernel)
            if layer.bias is not None:
                z = z + tf.reshape(tf.convert_to_tensor(layer.bias), kernel.shape[form.rows :])
            for tape in self._tapes:
                tape.watch(z)
            a = x if form.inputs is None else tf.einsum(form.inputs, x)
            d_in = int(np.prod(kernel.shape[: form.rows]))
            self.records[id(layer)] = (tf.reshape(a, [tf.shape(x)[0], -1, d_in]), z)
            out = z if form.outputs is None else tf.einsum(form.outputs, z)
            return layer.activation(out) if layer.activation is not None else out

        return call

    def _conv_call_of(self, layer: Any) -> Any:
        def call(inputs: Any, *args: Any, **kwargs: Any) -> tf.Tensor:
            x = tf.convert_to_tensor(inputs)
            shared = self._shared(layer)
            if shared:
                return self._refuse(layer, shared, inputs)
            kernel = tf.convert_to_tensor(layer.kernel)
            if isinstance(layer, keras.layers.Conv1D):
                # As Keras' Conv1D.call: causal padding is dilation·(k − 1) zeros on the
                # left, then a "valid" convolution. The patches of the sequence are those
                # of a (length × 1) image with a (k × 1) kernel.
                padding = layer.padding
                if padding == "causal":
                    left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
                    x = tf.pad(x, [[0, 0], [left, 0], [0, 0]])
                    padding = "valid"
                z = keras.ops.conv(
                    x,
                    kernel,
                    strides=list(layer.strides),
                    padding=padding,
                    dilation_rate=layer.dilation_rate,
                    data_format=layer.data_format,
                )
                image = x[:, :, None, :]
                sizes, strides = [layer.kernel_size[0], 1], [layer.strides[0], 1]
                rates = [layer.dilation_rate[0], 1]
            else:
                z = layer.convolution_op(x, kernel)
                image, padding = x, layer.padding
                sizes, strides = list(layer.kernel_size), list(layer.strides)
                rates = list(layer.dilation_rate)
            patches = tf.image.extract_patches(
                image,
                sizes=[1, *sizes, 1],
                strides=[1, *strides, 1],
                rates=[1, *rates, 1],
                padding=padding.upper(),
            )
            # Each patch is flattened (kh, kw, c_in) row-major, as the kernel's rows are.
            a = tf.reshape(patches, [tf.shape(x)[0], -1, patches.shape[-1]])
            if layer.use_bias:
                z = z + tf.convert_to_tensor(layer.bias)
            for tape in self._tapes:
                tape.watch(z)
            self.records[id(layer)] = (a, z)
            return layer.activation(z) if layer.activation is not None else z

        return call

    def _embedding_call_of(self, layer: Any) -> Any:
        def call(inputs: Any, *args: Any, **kwargs: Any) -> tf.Tensor:
            if _is_reversible(layer) and (kwargs.get("reverse") or (args and args[0])):
                return self._reverse_call(layer, inputs)
            if _tied(layer) and self._tied == "output":
                # The lookup's use of the table is not the factored one: as Keras computes it.
                return type(layer).call(layer, inputs)
            shared = self._shared(layer)
            if shared:
                return self._refuse(layer, shared, inputs)
            indices = tf.convert_to_tensor(inputs)
            if indices.dtype not in (tf.int32, tf.int64):
                indices = tf.cast(indices, tf.int32)  # as Keras' Embedding.call does
            table = tf.convert_to_tensor(layer.embeddings)
            z = tf.gather(table, indices)
            for tape in self._tapes:
                tape.watch(z)
            # The input as one-hot rows, one per position: (n, T, vocabulary).
            flat = tf.reshape(indices, [tf.shape(indices)[0], -1])
            a = tf.one_hot(flat, int(layer.input_dim), dtype=table.dtype)
            self.records[id(layer)] = (a, z)
            return z

        return call

    def _reverse_call(self, layer: Any, inputs: Any) -> tf.Tensor:
        """A ``ReversibleEmbedding`` called with ``reverse=True`` (logits h Wᵀ). With
        ``tie_weights=False`` its separate table is not the factored one (an other
        variable): computed as Keras does. With tied weights: refused for
        ``tied_embeddings="error"``, computed as Keras does for ``"input"`` (this use's
        contribution dropped), and for ``"output"`` recorded as a Dense layer without bias
        whose input is h and whose kernel is Wᵀ (d × V)."""
        if not layer.tie_weights or self._tied == "input":
            return type(layer).call(layer, inputs, reverse=True)
        if self._tied == "error":
            return self._refuse_reverse(layer, inputs)
        shared = self._shared(layer)
        if shared:
            self.errors.append(shared)
            return type(layer).call(layer, inputs, reverse=True)
        h = tf.convert_to_tensor(inputs)
        table = tf.convert_to_tensor(layer.embeddings)
        if layer.reverse_dtype is not None:  # as Keras casts both operands
            h = tf.cast(h, layer.reverse_dtype)
            table = tf.cast(table, layer.reverse_dtype)
        # z = h Wᵀ in (batch, positions..., V) order, the soft cap (if any) after it.
        z = tf.einsum("...d,vd->...v", h, table)
        for tape in self._tapes:
            tape.watch(z)
        d = int(table.shape[1])
        self.records[id(layer)] = (tf.reshape(h, [tf.shape(h)[0], -1, d]), z)
        cap = layer.logit_soft_cap
        return z if cap is None else tf.tanh(z / cap) * cap

    def _refuse_reverse(self, layer: Any, inputs: Any) -> tf.Tensor:
        self.errors.append(
            f"K-FAC: the ReversibleEmbedding layer {layer.name!r} ties its table to the "
            "output projection (tie_weights=True, called with reverse=True): the table's "
            "block is then E[(e_x ⊗ g + g_out ⊗ h)(...)ᵀ], two Kronecker products and their "
            "cross terms, not one A ⊗ G. Pass tied_embeddings='output' (factor the logits "
            "h Wᵀ) or 'input' (factor the token lookup), dropping the other use's "
            "contribution, or use GGNOperator."
        )
        return type(layer).call(layer, inputs, reverse=True)


def _tied(layer: Any) -> bool:
    """Whether ``layer`` is a ``ReversibleEmbedding`` whose table is also its output
    projection (``tie_weights=True``)."""
    return _is_reversible(layer) and bool(layer.tie_weights)


def _is_reversible(layer: Any) -> bool:
    """Whether ``layer`` is a Keras ``ReversibleEmbedding`` (Keras ≥ 3.13)."""
    reversible = getattr(keras.layers, "ReversibleEmbedding", None)
    return reversible is not None and isinstance(layer, reversible)


@dataclasses.dataclass(frozen=True)
class _DenseForm:
    """A Dense or EinsumDense layer written as z = a W + b with W shared over positions.

    ``product``: the einsum computing z from the input and the kernel in (batch,
    positions..., output axes...) order, the output axes in the kernel's order;
    ``inputs``: the einsum bringing the input to (batch, positions..., contracted axes...)
    order, the contracted axes in the kernel's order (None: it already is); ``outputs``:
    the einsum putting z in the layer's output order (None: it already is); ``rows``: how
    many leading kernel axes are contracted (the kernel is (d_in, d_out) row-major with
    d_in their size product)."""

    product: str
    inputs: str | None
    outputs: str | None
    rows: int


def _equation_of(layer: Any, rank: int) -> tuple[str, str | None]:
    """The einsum equation and bias axes of a Dense or EinsumDense layer on inputs of
    ``rank`` axes: a Dense layer contracts the last axis, "…i,io->…o", bias "o"."""
    if isinstance(layer, keras.layers.EinsumDense):
        return layer.equation, layer.bias_axes
    kept = "abcdefghijklmnpqrstuvwxyABCDEFGHIJKLMNOPQRSTUVWXYZ"[: rank - 1]
    return f"{kept}z,zo->{kept}o", ("o" if layer.use_bias else None)


def _dense_form(layer: Any, rank: int | None) -> _DenseForm:
    """``layer`` (Dense or EinsumDense) on inputs of ``rank`` axes as a :class:`_DenseForm`;
    a one-line ``ValueError`` naming the layer and its equation when it is not a Dense
    layer shared over the non-batch axes its kernel does not touch."""
    if rank is None:
        raise ValueError(
            f"K-FAC: the {type(layer).__name__} layer {layer.name!r} gets inputs of unknown "
            "rank; build the model on inputs of known rank."
        )
    equation, bias_axes = _equation_of(layer, rank)
    reason = None
    match = re.fullmatch(r"([a-zA-Z.]+),([a-zA-Z]+)->([a-zA-Z.]+)", equation.replace(" ", ""))
    if match is None:
        reason = "it is not of the form input,kernel->output"
        inputs, kernel, output = "", "", ""
    else:
        inputs, kernel, output = match.groups()
        elided = rank - len(inputs.replace("...", ""))
        if "..." in inputs or "..." in output:
            # Letters the equation does not use, for the axes "..." stands for.
            unused = [
                c for c in string.ascii_uppercase + string.ascii_lowercase if c not in equation
            ]
            fresh = "".join(unused[: max(elided, 0)])
            inputs, output = inputs.replace("...", fresh), output.replace("...", fresh)
        if "." in inputs + output or len(inputs) != rank:
            reason = f"it does not match inputs of rank {rank}"
    if reason is None:
        reason = _dense_form_reason(inputs, kernel, output, bias_axes)
    if reason is not None:
        raise ValueError(
            f"K-FAC: the {type(layer).__name__} layer {layer.name!r} (equation {equation!r}"
            f"{'' if bias_axes is None else f', bias_axes {bias_axes!r}'}) is not a Dense "
            f"layer shared over positions: {reason}. Make its weights non-trainable and pass "
            "other_variables='exclude' or 'diagonal', or use GGNOperator."
        )
    batch = inputs[0]
    contracted = [c for c in kernel if c in inputs]
    outputs = kernel[len(contracted) :]
    positions = "".join(c for c in inputs[1:] if c not in kernel)
    canonical_inputs = batch + positions + "".join(contracted)
    canonical_output = batch + positions + outputs
    return _DenseForm(
        product=f"{inputs},{kernel}->{canonical_output}",
        inputs=None if inputs == canonical_inputs else f"{inputs}->{canonical_inputs}",
        outputs=None if output == canonical_output else f"{canonical_output}->{output}",
        rows=len(contracted),
    )


def _dense_form_reason(inputs: str, kernel: str, output: str, bias_axes: str | None) -> str | None:
    """Why the einsum ``inputs,kernel->output`` (no ``...``) with a bias on ``bias_axes``
    is not z = a W + b over positions, or None when it is."""
    if not inputs:
        return "its input has no batch axis"
    for what, spec in (("input", inputs), ("kernel", kernel), ("output", output)):
        if len(set(spec)) != len(spec):
            return f"a subscript repeats in its {what} ({spec!r})"
    batch = inputs[0]
    if batch in kernel or batch not in output:
        return f"its batch axis {batch!r} is not kept apart from the kernel"
    contracted = [c for c in kernel if c in inputs]
    if not contracted:
        return "it contracts no input axis with the kernel"
    per_position = [c for c in contracted if c in output]
    if per_position:
        return (
            f"the kernel axis {per_position[0]!r} is also an output axis (weights per "
            "position, not shared)"
        )
    if kernel[: len(contracted)] != "".join(contracted):
        return (
            f"the kernel's contracted axes ({''.join(contracted)!r}) are not its leading "
            "axes, so it does not flatten to (inputs, outputs) row-major"
        )
    summed = [c for c in inputs[1:] if c not in kernel and c not in output]
    if summed:
        return f"it sums over the input axis {summed[0]!r}"
    outputs = kernel[len(contracted) :]
    if bias_axes:
        in_order = "".join(c for c in output if c in bias_axes)
        if set(bias_axes) != set(outputs):
            return (
                f"its bias axes {bias_axes!r} are not the kernel's output axes {outputs!r} "
                "(a bias per output unit, shared over positions)"
            )
        if in_order != outputs:
            return (
                f"its bias axes appear in the output as {in_order!r}, not in the kernel's "
                f"order {outputs!r}"
            )
    return None


def _factor_sizes(layer: Any, transposed: bool = False) -> tuple[int, int]:
    """(d_in, d_out) of a factored layer: its kernel's rows and columns, the kernel
    flattened row-major (an EinsumDense kernel's contracted axes are its rows);
    ``transposed`` (a tied ReversibleEmbedding factored at its reverse call, whose kernel
    is the table's transpose): (d, V)."""
    shape = [int(d) for d in _kernel_of(layer).shape]
    if transposed:
        return shape[1], shape[0]
    rows = len(shape) - 1
    if isinstance(layer, keras.layers.EinsumDense):
        rows = _dense_form(layer, _static_rank(layer)).rows
    return int(np.prod(shape[:rows])), int(np.prod(shape[rows:]))


def _static_rank(layer: Any) -> int | None:
    """The input rank a built EinsumDense layer was built for (its ``input_spec``)."""
    spec = getattr(layer, "input_spec", None)
    spec = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
    return getattr(spec, "ndim", None)


def _check_embedding(layer: Any) -> None:
    """Refuse what the Embedding factors do not model (one-line ``ValueError``)."""
    if layer.mask_zero:
        raise ValueError(
            f"K-FAC: the Embedding layer {layer.name!r} has mask_zero=True; the layers after it "
            "skip the masked positions, which its factors do not model (A would count the "
            "padding tokens). Build it with mask_zero=False or use GGNOperator."
        )
    if int(layer.input_dim) > MAX_VOCABULARY:
        raise ValueError(
            f"K-FAC: the Embedding layer {layer.name!r} has a vocabulary of {layer.input_dim} "
            f"tokens, more than {MAX_VOCABULARY}: its factor A is held as a dense V x V "
            "matrix. Make it non-trainable and pass other_variables='exclude', or use "
            "GGNOperator."
        )


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


def _kernel_of(layer: Any) -> Any:
    """The layer's weight matrix W (rows: inputs, columns: outputs): the kernel of a Dense
    or Conv2D layer, the table (vocabulary × output dim) of an Embedding."""
    if isinstance(layer, keras.layers.Embedding):
        return layer.embeddings
    return layer.kernel


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
      GGN with the expectation factorized. One backward pass per output dimension C.
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
    (``tf.image.extract_patches``, flattened (kh, kw, c_in) as the kernel's rows are), with
    shared weights, so the per-example gradient is Σ_t ā_t g_tᵀ. ``conv="expand"``
    (default) treats positions as examples: A = (1/(NT)) Σ_{n,t} ā ā ᵀ,
    G = (1/N) Σ_{n,t,c} g gᵀ; ``conv="reduce"`` sums over positions first:
    A = (1/N) Σ_n ā̄_n ā̄_nᵀ with ā̄_n the mean patch, G = (1/N) Σ_{n,c} (Σ_t g)(Σ_t g)ᵀ
    (Eschenhagen et al. 2023). Both are exact for one example with one output position;
    the capture computes z with the layer's own convolution and records the patches.
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
    position) as an example (:class:`EKFACOperator`).

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

    #: False: K-FAC (A ⊗ G); True (:class:`EKFACOperator`): eigenvalue-corrected.
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
        self._eigen: list[_Eigen] | None = None
        # Factors cast to a product dtype ((dtype name, block) -> arrays), made on first use.
        self._cast_factors: dict[tuple[str, int], tuple[np.ndarray, ...]] = {}
        # The products' compiled TensorFlow form (see _compiled_products), made on first use.
        self._compiled: KroneckerProducts | None = None
        #: Traces of the compiled data passes during ``from_keras`` (empty otherwise).
        self._build_traces: dict[str, int] = {}

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
        if data is None:
            raise ValueError("data is required: (x, y) arrays or a tf.data.Dataset of them.")
        variables, positions, target = keras_models.resolve_variables_and_dtype(model, None, dtype)
        if loss is None:
            loss, loss_weights = keras_models.compiled_loss(model)
            if loss_weights is not None:
                raise ValueError(
                    "K-FAC supports one output with one loss; loss_weights were given."
                )
        if isinstance(loss, (list, tuple, dict)):
            raise ValueError(
                "K-FAC supports a model with one output and one loss; got a "
                f"{type(loss).__name__} of losses. Use GGNOperator for several outputs."
            )
        for weight, name in zip(variables, map(variable_name, variables)):
            keras_models.check_finite(tf.convert_to_tensor(weight), name)
        resolved = keras_models.resolve_loss(loss, target)
        reduction = keras_models.reduction_of(resolved.call)
        if kind != "type-2":
            _check_reduction(resolved.call)
        distribution = predictive_distribution(loss) if kind == "mc" else None
        found = _loss_function(loss)
        reads_logits = (
            found is not None
            and found[0].__name__ in _LOGIT_LOSSES
            and not found[1].get("from_logits", False)
        )
        # Losses convex at the point K-FAC splits (the logits for Keras' cross-entropies):
        # a negative eigenvalue of their output Hessian is rounding, by theorem.
        convex = found is not None and (
            found[0] in _convex_losses()
            and (
                reads_logits
                or found[0] is keras.losses.mean_squared_error
                or bool(found[1].get("from_logits", False))
            )
        )
        run_model = keras_models.model_in_dtype(model, target)
        run_weights = list(run_model.weights)
        chosen = [run_weights[p] for p in positions]
        names = [variable_name(v) for v in variables]
        shapes = [tuple(int(d) for d in v.shape) for v in variables]
        offsets = np.concatenate([[0], np.cumsum([int(np.prod(s)) for s in shapes])])

        def where(weight: Any) -> int | None:
            for j, v in enumerate(chosen):
                if v is weight:
                    return j
            return None

        dense_layers: list[Any] = []
        layout: list[tuple[Any, int | None, int | None]] = []
        covered: set[int] = set()
        for layer in _keras_compat.flatten_layers(run_model):
            if not isinstance(layer, _FACTORED):
                continue
            base = next(kind for kind in _FACTORED if isinstance(layer, kind))
            k = where(_kernel_of(layer))
            bias = getattr(layer, "bias", None)
            b = where(bias) if bias is not None else None
            if k is None and b is None:
                continue
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
                rank = _static_rank(layer) if base is keras.layers.EinsumDense else 2
                _dense_form(layer, rank)  # an EinsumDense that is not Dense-like: refused
            if isinstance(layer, keras.layers.Embedding):
                _check_embedding(layer)
            dense_layers.append(layer)
            layout.append((layer, k, b))
            covered.update(j for j in (k, b) if j is not None)
        others = [j for j in range(len(chosen)) if j not in covered]
        if others and other_variables == "error":
            raise ValueError(_uncovered(run_model, [chosen[j] for j in others], names, others))
        if not dense_layers:
            raise ValueError(
                f"model {model.name!r} has no {_FACTORED_NAMES.replace(' and ', ' or ')} layer "
                "with trainable variables: K-FAC covers those layers only."
            )
        batches = Batches(
            data,
            batch_size,
            cast_floats_to=target,
            purpose=f"{cls.__name__} (its factors' data passes)",
        )
        # Class labels and Embedding indices in range, input dtypes and shapes, before any
        # graph (as for every operator): one-line errors instead of the graph's.
        check_keras_data(model, loss, batches)
        num_examples = batches.num_examples
        # A tied ReversibleEmbedding factored at its reverse call z = h Wᵀ: accumulated as
        # the Dense layer of kernel Wᵀ (A over h, G over the V logits), then transposed
        # into the table's row-major layout (rows V, columns d).
        transposed = [_tied(layer) and tied_embeddings == "output" for layer, _, _ in layout]
        accumulators = _Accumulators(layout, others, chosen, transposed)
        accumulators.conv = conv
        # Keras' own losses whose output Hessian per position has a closed form.
        closed = _closed_form(found, reads_logits)

        # Split at the logits: known from the loss for Keras' own cross-entropies, found
        # on the first batch for a custom loss that reads them (its gradient in the
        # softmax output is None).
        split = {"logits": reads_logits}

        settings = _PassSettings(
            loss=resolved.call,
            tied_embeddings=tied_embeddings,
            closed=closed,
            reduction=reduction,
            kind=kind,
            num_samples=num_samples,
            distribution=distribution,
            conv=conv,
        )
        # The compiled pass is shared by the operators built on the same model with the
        # same settings (not on a clone made for this build's dtype: used once).
        loss_id, loss_owners = keras_models.loss_key(loss)
        pass_key = (
            None
            if run_model is not model
            else (
                id(model),
                loss_id,
                target.name,
                tuple(positions),
                kind,
                num_samples,
                other_variables,
                conv,
                tied_embeddings,
            )
        )
        compiled = _compiled_pass(
            pass_key,
            (model, *loss_owners),
            lambda: _CompiledPass(
                run_model, dense_layers, layout, transposed, accumulators.others, settings
            ),
        )
        traces_before = dict(compiled.traces)
        # The same labels in every pass and for every batching: stateless, from the seed
        # and each example's index.
        seed_tensor = tf.constant(seed, tf.int64)
        total = tf.constant(float(num_examples), tf.float64)

        def data_pass(want_diagonal: bool, scalings: bool = False) -> None:
            state = compiled.initial_state(scalings, want_diagonal)
            bases = (
                [(tf.constant(QA), tf.constant(QG)) for QA, QG in accumulators.bases]
                if scalings and accumulators.bases is not None
                else None
            )
            first_index = 0  # of the batch's first example in the dataset
            for index, (batch, _weight) in enumerate(batches):
                x, y, sample_weight = keras_models.unpack_batch(batch)
                if sample_weight is not None:
                    raise ValueError(
                        "K-FAC does not take sample weights: pass (x, y) data (the factors "
                        "are expectations over examples, each counted once)."
                    )
                n = len(tf.nest.flatten(y)[0])
                for _attempt in range(2):
                    try:
                        with graph_errors(batches.describe(index)):
                            step = compiled.function(split["logits"], scalings, want_diagonal)
                            updated, report = step(
                                x,
                                y,
                                tf.constant(first_index, tf.int32),
                                seed_tensor,
                                total,
                                state,
                                bases,
                            )
                        break
                    except _SplitAtLogits:
                        split["logits"] = True  # nothing was accumulated: redo the batch
                keras_models.check_finite(report["loss"], "the batch loss", inputs=x)
                values = {key: float(value) for key, value in report.items() if key != "loss"}
                compiled.check(values, n, target)
                if "most_negative" in values:
                    accumulators.most_negative = max(
                        accumulators.most_negative, values["most_negative"]
                    )
                    accumulators.hessian_scale = max(
                        accumulators.hessian_scale, values["hessian_scale"]
                    )
                state = updated
                first_index += n
            # The sums reach the host once per pass.
            if scalings:
                accumulators.S = [np.asarray(S) for S in state["S"]]
                return
            accumulators.A = [np.asarray(A) for A in state["A"]]
            accumulators.G = [np.asarray(G) for G in state["G"]]
            if want_diagonal:
                accumulators.diagonal = [np.asarray(d) for d in state["diagonal"]]

        data_pass(other_variables == "diagonal")
        if kind == "type-2" and not convex:
            _check_convex(accumulators, target)
        blocks = []
        for (layer, k, b), A, G, flip in zip(layout, accumulators.A, accumulators.G, transposed):
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
                    kernel=None if k is None else names[k],
                    bias=None if b is None else names[b],
                    kernel_slice=None if k is None else slice(int(offsets[k]), int(offsets[k + 1])),
                    bias_slice=None if b is None else slice(int(offsets[b]), int(offsets[b + 1])),
                )
            )
        if cls.eigenvalue_corrected:
            # Second pass: second moments of the per-example gradients in the eigenbasis.
            eps = float(np.finfo(target.as_numpy_dtype).eps)
            factors = [(_factor_eigen(b.A, eps), _factor_eigen(b.G, eps)) for b in blocks]
            bases = [(fa[1], fg[1]) for fa, fg in factors]
            accumulators.bases = [
                (QG, QA) if flip else (QA, QG) for (QA, QG), flip in zip(bases, transposed)
            ]
            data_pass(False, scalings=True)
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
                    raise ValueError(
                        f"EKFAC: the scalings of layer {block.layer!r} are not finite."
                    )
        diagonal = None
        if others and other_variables == "diagonal":
            diagonal = np.concatenate([d / num_examples for d in accumulators.diagonal])
            if not np.all(np.isfinite(diagonal)):
                raise ValueError("K-FAC: the diagonal of the other variables is not finite.")
        operator = cls(
            blocks,
            names,
            shapes,
            target.as_numpy_dtype,
            kind=kind,
            num_examples=num_examples,
            other_slices=[slice(int(offsets[j]), int(offsets[j + 1])) for j in others],
            other_diagonal=diagonal,
        )
        #: How many times this build traced each pass kind ("factors", "scalings"): 1 per
        #: batch shape on a model's first build, 0 when the compiled pass was reused.
        operator._build_traces = {
            what: count - traces_before[what] for what, count in compiled.traces.items()
        }
        return operator

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
        return bool(tf.config.list_logical_devices("GPU"))

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
    def _eigens(self) -> list[_Eigen]:
        if self._eigen is None:
            eps = float(np.finfo(self.dtype).eps)
            self._eigen = []
            for b in self.blocks:
                alpha, QA, bound_A = _factor_eigen(b.A, eps)
                gamma, QG, bound_G = _factor_eigen(b.G, eps)
                if b.basis is not None:  # EKFAC: the basis the scalings were measured in
                    QA, QG = b.basis
                    alpha = _in_basis(b.A, QA, int(np.count_nonzero(alpha)))
                    gamma = _in_basis(b.G, QG, int(np.count_nonzero(gamma)))
                self._eigen.append(_Eigen(alpha, QA, gamma, QG, bound_A, bound_G))
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
        :func:`_factor_eigen`; a zero EKFAC scaling or excluded variable) are exactly 0 in
        :meth:`eigenvalues`, but each may truly be as large as a bound u set by the
        rounding of the factors' dtype. K + δI is refused when δ ≤ u: its smallest
        eigenvalue would be rounding, not a number of the matrix. The suggested damping,
        max(1e-3 λ_max, 100 u), is accepted and puts that rounding below 1 %.
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
        refused as :meth:`matvec` refuses them."""
        damping = self._check_invertible(damping, "inverse")
        eigens = self._eigens()

        def per_block(index: int, _block: KFACBlock, M: np.ndarray) -> np.ndarray:
            e = eigens[index]
            rotated = _sandwich(e.QA.T, M, e.QG)
            return _sandwich(e.QA, rotated / (self._block_values(index) + damping), e.QG.T)

        def per_other(rows: np.ndarray) -> np.ndarray:
            return rows / (self._other_diagonal + damping)[:, None]

        def matmat(X: np.ndarray) -> np.ndarray:
            X = self._checked(X, "inverse")
            if compiled is not None:
                return compiled(X)
            return self._apply(X, per_block, per_other)

        compiled = None
        if self._products_in_tensorflow():
            compiled = KroneckerProducts(
                self.shape[0],
                self._kronecker_blocks(
                    [1.0 / (self._block_values(i) + damping) for i in range(len(self.blocks))]
                ),
                self._other_slices,
                1.0 / (self._other_diagonal + damping),
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


class EKFACOperator(KFACOperator):
    """EKFAC (eigenvalue-corrected K-FAC; George et al. 2018), a symmetric PSD
    ``LinearOperator`` like :class:`KFACOperator`, built with the same ``from_keras``.

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
    cross terms, see :class:`KFACOperator`); the per-example Σ_t would add the type-2
    columns' cross terms between output positions to every scaling. A direction on which
    A or G is zero to working precision gets s_ij = 0. With
    ``conv="expand"`` (or one position) that is exact: q_Aᵀ ā_nt = 0 at every position.
    With ``conv="reduce"`` on several positions only the mean ā_n is orthogonal to such a
    q_A (likewise Σ_t g for G), so the exact projection there need not vanish: a
    rank-deficient reduce factor (fewer examples than its dimension) makes EKFAC equal to
    diag(Qᵀ B_l Q) on the other directions only.
    """

    eigenvalue_corrected = True


def _owners(model: Any) -> dict[int, Any]:
    """The innermost layer holding each trainable weight (by ``id``). Nested layers list
    their sublayers' weights too; the innermost is the holder with the fewest."""
    found: dict[int, tuple[int, Any]] = {}
    for layer in _keras_compat.flatten_layers(model):
        weights = list(layer.trainable_weights)
        for w in weights:
            if id(w) not in found or len(weights) < found[id(w)][0]:
                found[id(w)] = (len(weights), layer)
    return {key: layer for key, (_, layer) in found.items()}


def _uncovered(model: Any, weights: Sequence[Any], names: Sequence[str], at: Sequence[int]) -> str:
    """The one-line refusal listing every trainable variable K-FAC does not cover
    (``weights``, named ``names[at[i]]``), grouped by the layer holding it."""
    owners = _owners(model)
    groups: dict[int, tuple[str, list[str]]] = {}
    for weight, j in zip(weights, at):
        layer = owners.get(id(weight))
        owner = "no layer" if layer is None else f"layer {layer.name!r} ({type(layer).__name__})"
        groups.setdefault(id(layer), (owner, []))[1].append(repr(names[j]))
    listed = "; ".join(f"{owner}: {', '.join(held)}" for owner, held in groups.values())
    count = len(weights)
    return (
        f"K-FAC factors {_FACTORED_NAMES} layers; {count} trainable "
        f"variable{'s' if count != 1 else ''} in {len(groups)} "
        f"layer{'s' if len(groups) != 1 else ''} {'is' if count == 1 else 'are'} not "
        f"covered: {listed}. Pass "
        "other_variables='exclude' (their rows and columns are zero) or "
        "other_variables='diagonal' (the exact diagonal of the matrix for them), or make them "
        "non-trainable."
    )


class _Accumulators:
    """Running sums Σ ā āᵀ, Σ g gᵀ per Dense layer and Σ (per-example gradient)² for the
    other variables, in float64."""

    def __init__(
        self,
        layout: Sequence[tuple[Any, int | None, int | None]],
        others: list[int],
        chosen: list[Any],
        transposed: Sequence[bool] = (),
    ) -> None:
        self.layout = list(layout)
        self.A: list[np.ndarray] = []
        self.G: list[np.ndarray] = []
        flags = list(transposed) or [False] * len(self.layout)
        for (layer, k, b), flag in zip(self.layout, flags):
            d_in, d_out = _factor_sizes(layer, flag)
            d_a = (d_in if k is not None else 0) + (1 if b is not None else 0)
            self.A.append(np.zeros((d_a, d_a)))
            self.G.append(np.zeros((d_out, d_out)))
        self.others = [chosen[j] for j in others]
        self.diagonal = [np.zeros(int(np.prod(v.shape))) for v in self.others]
        #: EKFAC's second pass: the eigenbases (Q_A, Q_G) per layer, and the sums
        #: Σ_i (Q_Aᵀ ā_i)² Σ_c (Q_Gᵀ g_ic)²ᵀ accumulated in S.
        self.bases: list[tuple[np.ndarray, np.ndarray]] | None = None
        #: How Conv2D factors treat the output positions: "expand" or "reduce".
        self.conv = "expand"
        #: Type-2: the most negative eigenvalue of the per-example output Hessians met in
        #: the pass (0 if none), and their largest eigenvalue magnitude (the scale the
        #: former is judged against, over the whole dataset so not batch-dependent).
        self.most_negative = 0.0
        self.hessian_scale = 0.0
        self.S = [np.zeros((A.shape[0], G.shape[0])) for A, G in zip(self.A, self.G)]
        #: Per layer: a tied ReversibleEmbedding accumulated at its reverse call (factors
        #: of Wᵀ, transposed into the table's layout by ``from_keras``).
        self.transposed = flags


def _augmented(a: tf.Tensor, kernel: bool, bias: bool) -> tf.Tensor:
    """[a; 1] along the last axis (a without the 1 when the bias is not a variable, only
    the 1 when the kernel is not)."""
    parts = [a] if kernel else []
    if bias:
        parts.append(tf.ones_like(a[..., :1]))
    return tf.concat(parts, axis=-1)


class _SplitAtLogits(Exception):
    """Raised while the batch computation is traced, before anything is accumulated, when
    the loss has no gradient in the softmax/sigmoid output but the output carries Keras
    logits."""


#: Eigenvalues of an example's output Hessian of magnitude at most this many units of
#: rounding times its largest are rounding (computed through eigh in the model's dtype,
#: e.g. the softmax's all-ones null direction): they get no column, so the null
#: direction of G stays at rounding of rounding.
_HESSIAN_ROUNDING_UNITS = 4


#: A column of the output-side square root: its index k (an int32 scalar tensor, the
#: loop counter of the traced pass) -> a cotangent of the split point's shape (the column
#: k of every example, at all its output positions at once).
_Column = Callable[[tf.Tensor], tf.Tensor]

#: What the traced batch reports besides the sums: per-batch scalars the host checks
#: (the batch loss, the output Hessians' extreme eigenvalues, the sequence check).
_Report = dict[str, tf.Tensor]


def _record_hessian(report: _Report, values: tf.Tensor, top: tf.Tensor) -> None:
    """The batch's most negative output-Hessian eigenvalue (as a magnitude, ≥ 0 is not
    enforced: the host takes the maximum with 0) and largest magnitude, for the convexity
    check over the whole dataset."""
    report["most_negative"] = tf.cast(-tf.reduce_min(values), tf.float64)
    report["hessian_scale"] = tf.cast(tf.reduce_max(top), tf.float64)


def _columns(
    tape: tf.GradientTape,
    inner_gradient: tf.Tensor | None,
    point: tf.Tensor,
    sampled: Sequence[tf.Tensor],
    true_value: tf.Tensor | None,
    kind: str,
    scale: float,
    report: _Report,
) -> tuple[int, _Column]:
    """The cotangents s_ik at a split point of shape (n, C): K columns per example, as
    (K, k -> the (n, C) cotangent of column k)."""
    if kind == "type-2":
        hessian = tape.batch_jacobian(inner_gradient, point)
        hessian = 0.5 * (hessian + tf.linalg.matrix_transpose(hessian))
        values, vectors = tf.linalg.eigh(hessian)
        top = tf.reduce_max(tf.abs(values), axis=-1, keepdims=True)
        _record_hessian(report, values, top)
        eps = float(np.finfo(point.dtype.as_numpy_dtype).eps)
        kept = tf.where(values > _HESSIAN_ROUNDING_UNITS * eps * top, values, 0)
        columns = vectors * tf.sqrt(kept)[:, None, :]
        return int(columns.shape[-1]), lambda k: tf.gather(columns, k, axis=2)
    return _sampled_columns(tape, point, sampled, true_value, kind, scale)


def _sampled_columns(
    tape: tf.GradientTape,
    point: tf.Tensor,
    sampled: Sequence[tf.Tensor],
    true_value: tf.Tensor | None,
    kind: str,
    scale: float,
) -> tuple[int, _Column]:
    """Empirical: the gradient of the example's loss at its true labels (one column);
    mc: those at the S sampled label sets, each divided by √(scale·S)."""
    if kind == "empirical":
        gradient = tape.gradient(true_value, point)
        return 1, lambda k: gradient
    grads = tf.stack([tape.gradient(value, point) for value in sampled])
    norm = tf.cast(tf.sqrt(scale * len(sampled)), point.dtype)
    return len(sampled), lambda k: tf.gather(grads, k) / norm


def _sequence_columns(
    tape: tf.GradientTape,
    inner_gradient: tf.Tensor,
    point: tf.Tensor,
    closed: str | None,
    weight: tf.Tensor,
    report: _Report,
) -> tuple[int, _Column]:
    """Type-2 columns at a split point (n, T_1, ..., C) with positions: column c holds, at
    every output position t, column c of a square root R_t of that position's block of
    the example's output Hessian (R_t R_tᵀ = H_t; ``KFACOperator``):

    * ``closed="softmax"`` (Keras' categorical cross-entropies at the logits):
      H_t = w (diag p_t − p_t p_tᵀ) = Σ_c w p_tc (e_c − p_t)(e_c − p_t)ᵀ, column c
      √(w p_tc)(e_c − p_t), with w = ``weight`` the position's weight in the loss (a
      float64 scalar tensor, cast to the point's dtype);
    * ``closed="mse"``: H_t = (2w/C) I, column c √(2w/C) e_c;
    * otherwise the blocks H_t from C backward passes through the loss alone (exact when
      the loss is a sum of per-position terms, in a ``tf.while_loop``), column c of the
      symmetric square root H_t^½ (eigenvalues at rounding level set to 0, negative ones
      reported for the convexity check).

    Every path is checked on the batch against one output-Hessian product of the loss
    (a seeded random vector): the product's error and scale go to ``report``
    (``check_error``, ``check_bound``), judged on the host against the dtype's rounding
    (:meth:`_CompiledPass.check`): a loss whose Hessian couples output positions, or that
    is not what the closed form assumes, is refused in one line.
    """
    classes = int(point.shape[-1])
    dtype = point.dtype
    eps = float(np.finfo(dtype.as_numpy_dtype).eps)
    w = tf.cast(weight, dtype)
    if closed == "softmax":
        p = tf.nn.softmax(point)

        def column(c: tf.Tensor) -> tf.Tensor:
            share = tf.gather(p, [c], axis=-1)
            return tf.sqrt(w * share) * (tf.one_hot(c, classes, dtype=dtype) - p)

        def product(u: tf.Tensor) -> tf.Tensor:
            return w * (p * u - p * tf.reduce_sum(p * u, axis=-1, keepdims=True))

        def magnitude(u: tf.Tensor) -> tf.Tensor:
            return w * (p * u + p * tf.reduce_sum(p * u, axis=-1, keepdims=True))

    elif closed == "mse":
        root = tf.sqrt(2.0 * w / classes)

        def column(c: tf.Tensor) -> tf.Tensor:
            return root * tf.broadcast_to(tf.one_hot(c, classes, dtype=dtype), tf.shape(point))

        def product(u: tf.Tensor) -> tf.Tensor:
            return root**2 * u

        magnitude = product
    else:

        def row(c: tf.Tensor, rows: tf.TensorArray) -> tuple[tf.Tensor, tf.TensorArray]:
            value = tape.gradient(
                inner_gradient,
                point,
                output_gradients=tf.broadcast_to(
                    tf.one_hot(c, classes, dtype=dtype), tf.shape(point)
                ),
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            return c + 1, rows.write(c, value)

        _, rows = tf.while_loop(
            lambda c, _: c < classes,
            row,
            (tf.constant(0), tf.TensorArray(dtype, size=classes, element_shape=point.shape)),
        )
        rank = point.shape.rank
        # (n, T..., C, C): row c of each position's block.
        blocks = tf.transpose(rows.stack(), [*range(1, rank), 0, rank])
        blocks = 0.5 * (blocks + tf.linalg.matrix_transpose(blocks))
        values, vectors = tf.linalg.eigh(blocks)
        top = tf.reduce_max(tf.abs(values), axis=-1, keepdims=True)
        _record_hessian(report, values, top)
        kept = tf.where(values > _HESSIAN_ROUNDING_UNITS * eps * top, values, 0)
        roots = tf.linalg.matmul(vectors * tf.sqrt(kept)[..., None, :], vectors, adjoint_b=True)

        def column(c: tf.Tensor) -> tf.Tensor:
            return tf.gather(roots, c, axis=rank)

        def product(u: tf.Tensor) -> tf.Tensor:
            return tf.linalg.matvec(blocks, u)

        def magnitude(u: tf.Tensor) -> tf.Tensor:
            return tf.linalg.matvec(tf.abs(blocks), u)

    u = tf.random.stateless_normal(tf.shape(point), seed=[0, 1], dtype=dtype)
    exact = tape.gradient(inner_gradient, point, output_gradients=u, unconnected_gradients="zero")
    report["check_error"] = tf.cast(tf.reduce_max(tf.abs(exact - product(u))), tf.float64)
    report["check_bound"] = tf.cast(tf.reduce_max(magnitude(tf.abs(u))), tf.float64)
    return classes, column


def _closed_form(found: Any, reads_logits: bool) -> str | None:
    """``"softmax"`` for Keras' categorical cross-entropies read at the logits, ``"mse"``
    for mean squared error (classes or entries on the last axis, no ignored class), None
    for other losses (their per-position output Hessians come from autodiff)."""
    if found is None:
        return None
    fn, kwargs, _ = found
    if kwargs.get("axis", -1) != -1 or kwargs.get("ignore_class") is not None:
        return None
    if fn is keras.losses.mean_squared_error:
        return "mse"
    softmax = (keras.losses.categorical_crossentropy, keras.losses.sparse_categorical_crossentropy)
    if fn in softmax and (reads_logits or kwargs.get("from_logits", False)):
        return "softmax"
    return None


def _convex_losses() -> frozenset[Any]:
    """Keras loss functions convex in the logits (cross-entropies) or outputs (MSE)."""
    return frozenset(
        [
            keras.losses.categorical_crossentropy,
            keras.losses.sparse_categorical_crossentropy,
            keras.losses.binary_crossentropy,
            keras.losses.mean_squared_error,
        ]
    )


def _check_convex(acc: _Accumulators, dtype: tf.DType) -> None:
    """Refuse (one line) a loss whose output Hessians had an eigenvalue more negative than
    the rounding of the dtype, relative to their largest magnitude over the whole dataset
    (so the verdict does not depend on the batching)."""
    eps = float(np.finfo(dtype.as_numpy_dtype).eps)
    if acc.most_negative > _ROUNDING_UNITS * eps * acc.hessian_scale:
        raise ValueError(
            "K-FAC type-2 needs a loss convex in the model's outputs (a PSD output Hessian); "
            f"this loss has output-Hessian eigenvalue {-acc.most_negative:.3g} against a "
            f"largest magnitude {acc.hessian_scale:.3g} over the data, beyond {dtype.name} "
            "rounding. Use kind='mc' or 'empirical', or GGNOperator."
        )


def _per_example_labels(
    distribution: Any,
    output: tf.Tensor,
    point: tf.Tensor,
    num_samples: int,
    seed: tf.Tensor,
    first_index: tf.Tensor,
) -> tf.Tensor:
    """S label sets for the batch, stacked as ``distribution.sample`` stacks them (draw s of
    example i at row s·n + i), each example's drawn with a stateless seed of (``seed``, an
    int64 scalar, and its index in the dataset, ``first_index`` + i as int32): the labels,
    hence the operator, do not depend on the batching. One draw per example, in a
    ``tf.map_fn`` loop (the draws of a batch of n rows at once would depend on n)."""
    n = int(output.shape[0])
    same = point is output
    base = tf.stack([seed, tf.zeros_like(seed)])
    indices = first_index + tf.range(n, dtype=tf.int32)

    def draw(args: tuple[tf.Tensor, tf.Tensor, tf.Tensor]) -> tf.Tensor:
        row, row_point, index = args
        row = row[None]
        row_point = row if same else row_point[None]
        example_seed = tf.random.experimental.stateless_fold_in(base, index)
        return distribution.sample(row, row_point, num_samples, example_seed)

    # The draw's dtype and shape, from tracing it once on the first example (pruned).
    probe = draw((output[0], point[0], indices[0]))
    draws = tf.map_fn(
        draw,
        (output, point, indices),
        fn_output_signature=tf.TensorSpec(probe.shape, probe.dtype),
    )  # (n, S, ...): draw s of example i at [i, s]
    stacked = tf.transpose(draws, [1, 0, *range(2, draws.shape.rank)])
    return tf.reshape(stacked, tf.concat([[num_samples * n], tf.shape(stacked)[2:]], 0))


@dataclasses.dataclass(frozen=True)
class _PassSettings:
    """What the traced batch computation depends on besides the model (the key of the
    compiled pass, with the model, the loss and the variables)."""

    loss: Any
    tied_embeddings: str
    closed: str | None
    reduction: str
    kind: str
    num_samples: int
    distribution: Any
    conv: str


class _CompiledPass:
    """K-FAC's per-batch computation as ``tf.function``s, traced once per pass kind
    (``"factors"``: the A and G sums, with the other variables' diagonal when asked;
    ``"scalings"``: EKFAC's second-pass S sums), split point (the logits or the output)
    and batch shape, and reused for every batch of that shape.

    One call runs a batch's forward pass with the layers captured (:class:`_Capture`, active
    while tracing only), the output-side columns (type-2 roots, sampled or true-label
    gradients), the backward passes to the captured pre-activations in a ``tf.while_loop``
    over the columns, and adds the batch's contributions to the running float64 sums it is
    given (the state), returning them with the per-batch scalars the host checks. The sums
    stay TensorFlow tensors during a pass and reach the host once, at its end.

    Holds no weights' values (the graph reads the model's variables when called): a pass
    built for a model is shared by the operators built on it with the same settings
    (:func:`_compiled_pass`).
    """

    def __init__(
        self,
        run_model: Any,
        dense_layers: Sequence[Any],
        layout: Sequence[tuple[Any, int | None, int | None]],
        transposed: Sequence[bool],
        others: Sequence[Any],
        settings: _PassSettings,
    ) -> None:
        self.run_model = run_model
        self.dense_layers = list(dense_layers)
        self.layout = list(layout)
        self.transposed = list(transposed)
        self.others = [_tf_variable(v) for v in others]
        self.settings = settings
        #: How many times each pass kind was traced (a new batch shape or split point).
        self.traces = {"factors": 0, "scalings": 0}
        #: Set while tracing a batch with outputs with positions under type-2: the loss's
        #: effective closed form (None: autodiff blocks) and the split point's shape without
        #: its batch axis, for the host's one-line refusal (:meth:`check`).
        self.sequence: tuple[str | None, tuple[int, ...]] | None = None
        self._functions: dict[tuple[bool, bool, bool], Any] = {}
        self._sizes = [
            _factor_sizes(layer, flag) for (layer, _, _), flag in zip(self.layout, self.transposed)
        ]

    def initial_state(self, scalings: bool, want_diagonal: bool) -> dict[str, list[tf.Tensor]]:
        """Zero sums for a pass: A, G (and the diagonal) or EKFAC's S, in float64."""
        d_a = [
            (d_in if k is not None else 0) + (1 if b is not None else 0)
            for (_, k, b), (d_in, _) in zip(self.layout, self._sizes)
        ]
        d_out = [d for _, d in self._sizes]
        if scalings:
            return {"S": [tf.zeros((a, g), tf.float64) for a, g in zip(d_a, d_out)]}
        state = {
            "A": [tf.zeros((a, a), tf.float64) for a in d_a],
            "G": [tf.zeros((g, g), tf.float64) for g in d_out],
        }
        if want_diagonal:
            state["diagonal"] = [tf.zeros(int(np.prod(v.shape)), tf.float64) for v in self.others]
        return state

    def function(self, reads_logits: bool, scalings: bool, want_diagonal: bool) -> Any:
        """The compiled batch step ``(x, y, first_index, seed, num_examples, state, bases)
        -> (state, report)`` for a split point and pass kind (traced on first call per
        batch shape)."""
        key = (reads_logits, scalings, want_diagonal)
        found = self._functions.get(key)
        if found is None:
            what = "scalings" if scalings else "factors"
            step = _Step(self, what, reads_logits=reads_logits, want_diagonal=want_diagonal)
            # No autograph: errors raised while tracing (the one-line refusals) reach the
            # user as raised, and the loops are explicit ``tf.while_loop``s.
            found = self._functions[key] = tf.function(step, autograph=False)
        return found

    def traced(
        self,
        what: str,
        x: Any,
        y: Any,
        first_index: tf.Tensor,
        seed: tf.Tensor,
        num_examples: tf.Tensor,
        state: dict[str, list[tf.Tensor]],
        bases: Any,
        *,
        reads_logits: bool,
        want_diagonal: bool,
    ) -> tuple[dict[str, list[tf.Tensor]], _Report]:
        """The body of a compiled step: counts the trace, then traces the batch."""
        self.traces[what] += 1
        return self._batch(
            x,
            y,
            first_index,
            seed,
            num_examples,
            state,
            bases,
            reads_logits=reads_logits,
            want_diagonal=want_diagonal,
        )

    def check(self, report: dict[str, float], n: int, dtype: tf.DType) -> None:
        """Refuse (one line) a batch whose output-Hessian product disagrees with its
        per-position blocks beyond the dtype's rounding (outputs with positions, type-2)."""
        if "check_error" not in report or self.sequence is None:
            return
        closed, tail = self.sequence
        classes = tail[-1]
        eps = float(np.finfo(dtype.as_numpy_dtype).eps)
        error, bound = report["check_error"], report["check_bound"]
        if error > _ROUNDING_UNITS * (classes + 1) * eps * bound:
            what = (
                "is not the closed form of its Keras loss (a reduction other than a mean or "
                "sum over positions?)"
                if closed
                else "couples the output positions (not a sum of per-position terms)"
            )
            raise ValueError(
                f"K-FAC: the loss's Hessian in the outputs of shape {(n, *tail)} {what}: "
                f"a product with it differs by {error:.3g} from the per-position blocks' "
                f"(scale {bound:.3g}); K-FAC factors losses that average per-position terms, "
                "such as Keras' cross-entropies and MSE. Use GGNOperator."
            )

    def _batch(
        self,
        x: Any,
        y: Any,
        first_index: tf.Tensor,
        seed: tf.Tensor,
        num_examples: tf.Tensor,
        state: dict[str, list[tf.Tensor]],
        bases: Sequence[tuple[tf.Tensor, tf.Tensor]] | None,
        *,
        reads_logits: bool,
        want_diagonal: bool,
    ) -> tuple[dict[str, list[tf.Tensor]], _Report]:
        """One batch's contributions added to ``state`` (traced)."""
        s = self.settings
        kind, conv = s.kind, s.conv
        report: _Report = {}
        outer = tf.GradientTape(persistent=True, watch_accessed_variables=False)
        inner = tf.GradientTape(watch_accessed_variables=False)
        capture = _Capture(self.dense_layers, [outer, inner], s.tied_embeddings)
        other_tf = self.others if want_diagonal else []
        sampled: list[tf.Tensor] = []
        with outer:
            for v in other_tf:
                outer.watch(v)
            with inner:
                # Inside a scope of its own: a graph's root scope name may not start with
                # "_", as a Keras model's name may (a subclassed model's default).
                with capture, tf.name_scope("kfac"):
                    # As the exact operators call the model: Keras' multi-line call error
                    # becomes one line naming its cause.
                    outputs, _ = keras_models.stateless_forward(
                        self.run_model, [], [], x, training=False
                    )
                capture.check()
                flat = tf.nest.flatten(outputs)
                if len(flat) != 1:
                    raise ValueError(
                        f"K-FAC supports a model with one output; {self.run_model.name!r} "
                        f"has {len(flat)}."
                    )
                output = tf.convert_to_tensor(flat[0])
                point = output
                logits = _tf_compat.keras_logits(output) if reads_logits else None
                if logits is not None:
                    point = logits
                if (point.shape.rank or 0) < 2 or None in point.shape[1:]:
                    raise ValueError(
                        "K-FAC needs model outputs of shape (batch, C) or (batch, "
                        f"positions..., C) of known size; got {tuple(point.shape)}."
                    )
                inner.watch(point)
                outer.watch(point)
                # The batch's size, static: each batch shape has its own trace.
                n = int(point.shape[0] or tf.nest.flatten(y)[0].shape[0])
                dtype = point.dtype

                def unit_loss(labels: Any) -> tf.Tensor:
                    value = tf.convert_to_tensor(s.loss(labels, output))
                    if value.shape.rank:
                        value = tf.reduce_mean(value)
                    if s.reduction == "sum":
                        return tf.cast(num_examples, value.dtype) * value
                    return float(n) * value

                true_value = unit_loss(y)
                if kind == "mc":
                    labels = _per_example_labels(
                        s.distribution, output, point, s.num_samples, seed, first_index
                    )
                    for k in range(s.num_samples):
                        sampled.append(unit_loss(labels[k * n : (k + 1) * n]))
            inner_gradient = inner.gradient(true_value, point) if kind == "type-2" else None
        probe = inner_gradient if kind == "type-2" else outer.gradient(true_value, point)
        if probe is None:
            if point is output and _tf_compat.keras_logits(output) is not None:
                # The loss reads the logits behind the softmax/sigmoid output (a Keras
                # cross-entropy inside a custom function): split there, as for Keras' own.
                raise _SplitAtLogits
            raise ValueError(
                "K-FAC: the loss has no gradient in the model's output (it does not read "
                "y_pred, or reads it through a tensor spectra cannot see): pass a loss that "
                "is a differentiable function of (y_true, y_pred)."
            )
        report["loss"] = true_value
        # T output positions: Keras' losses average the per-position terms, so example i's
        # loss is (1/T) Σ_t ℓ_it (w = 1/T per position; N for reduction="sum", whose batch
        # loss is N Σ_it ℓ_it here), and its label distribution is a product over
        # positions: κ/T scales the sampled gradients of kind="mc".
        output_positions = int(np.prod([int(d) for d in point.shape[1:-1]]))
        # EKFAC's scalings of a layer shared over positions, for outputs with positions and
        # conv="expand": from each position's ā_t g_tᵀ (Eschenhagen et al.'s expand setting).
        per_position = point.shape.rank > 2 and conv == "expand"
        kappa = s.distribution.scale(_last_axis(output)) / output_positions if kind == "mc" else 1.0
        if output_positions == 1 and point.shape.rank == 2:
            count, column = _columns(
                outer, inner_gradient, point, sampled, true_value, kind, kappa, report
            )
        elif kind == "type-2":
            closed = s.closed
            if closed == "softmax" and point is output and reads_logits:
                closed = None  # probabilities without the logits behind them
            weight = (
                tf.cast(num_examples, tf.float64)
                if s.reduction == "sum"
                else tf.constant(1.0 / output_positions, tf.float64)
            )
            self.sequence = (closed, tuple(int(d) for d in point.shape[1:]))
            count, column = _sequence_columns(outer, inner_gradient, point, closed, weight, report)
        else:
            count, column = _sampled_columns(outer, point, sampled, true_value, kind, kappa)
        records = [capture.records.get(id(layer)) for layer in self.dense_layers]
        for index, ((layer, _, _), record) in enumerate(zip(self.layout, records)):
            if record is None:
                if self.transposed[index]:
                    raise ValueError(
                        f"K-FAC: the ReversibleEmbedding layer {layer.name!r} is not called "
                        "with reverse=True, the use tied_embeddings='output' factors; pass "
                        "tied_embeddings='input'."
                    )
                raise ValueError(
                    f"K-FAC: the {type(layer).__name__} layer {layer.name!r} is not called in "
                    "the model's forward pass, so it has no factors; make its weights "
                    "non-trainable."
                )
        f64 = tf.float64
        # Each batch's contributions are computed in the model's dtype (float32 matrix
        # products run several times faster than float64 ones on a CPU; a float32 GEMM's
        # rounding is a few units of float32, below that of its float32 inputs) and summed
        # in float64: over the columns, the batches and the passes.
        # (n, T, d_a): T = 1 for a layer applied once per example, its positions otherwise.
        abars = []
        for (_, kernel, bias), record, (d_in, _) in zip(self.layout, records, self._sizes):
            a = tf.reshape(tf.cast(record[0], dtype), [n, -1, d_in])  # type: ignore[index]
            abars.append(_augmented(a, kernel is not None, bias is not None))
        zs = [record[1] for record in records]  # type: ignore[index]
        d_outs = [d for _, d in self._sizes]
        new: dict[str, list[tf.Tensor]] = {}
        if bases is None:
            A = list(state["A"])
            for index, abar in enumerate(abars):
                positions = int(abar.shape[1])
                # A in float64 products: it is computed once per batch (not per column),
                # and its entries then do not depend on the batching beyond float64
                # rounding.
                abar = tf.cast(abar, f64)
                if positions == 1 or conv == "expand":
                    rows = tf.reshape(abar, [-1, abar.shape[-1]])
                    A[index] += _gram(rows) / positions
                else:
                    A[index] += _gram(tf.reduce_mean(abar, axis=1))
            new["A"] = A
            carried = list(state["G"])
        else:
            # Per layer applied once per example: (Q_Aᵀ ā_i)², and Σ_c (Q_Gᵀ g_ic)² summed
            # over the columns in the loop.
            bases = [(tf.cast(QA, dtype), tf.cast(QG, dtype)) for QA, QG in bases]
            projected_inputs = {
                index: tf.square(tf.matmul(abar[:, 0], bases[index][0]))
                for index, abar in enumerate(abars)
                if abar.shape[1] == 1
            }
            carried = [
                tf.zeros((n, d_outs[index]), dtype)
                if index in projected_inputs
                else state["S"][index]
                for index in range(len(abars))
            ]
        jacobians: list[tf.Tensor] = []
        if other_tf:
            size = int(np.prod(point.shape[1:]))
            jacobians = [
                tf.reshape(tf.cast(jac, dtype), [n, size, -1])
                for jac in outer.jacobian(
                    point, other_tf, unconnected_gradients=tf.UnconnectedGradients.ZERO
                )
            ]
            diagonal = list(state["diagonal"])
        else:
            diagonal = []

        def body(
            c: tf.Tensor, sums: list[tf.Tensor], diagonal: list[tf.Tensor]
        ) -> tuple[tf.Tensor, list[tf.Tensor], list[tf.Tensor]]:
            cotangent = column(c)
            grads = outer.gradient(
                point,
                zs,
                output_gradients=cotangent,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            sums = list(sums)
            for index, g in enumerate(grads):
                d_out = d_outs[index]
                g = tf.reshape(tf.cast(g, dtype), [n, -1, d_out])  # (n, T, d_out)
                positions = int(g.shape[1])
                if bases is None:
                    if positions == 1 or conv == "expand":
                        sums[index] += _gram(tf.reshape(g, [-1, d_out]))
                    else:
                        sums[index] += _gram(tf.reduce_sum(g, axis=1))
                    continue
                QA, QG = bases[index]
                if positions == 1:
                    sums[index] += tf.square(tf.matmul(g[:, 0], QG))
                elif per_position:
                    # Outputs with positions, "expand": each (example, position) as an
                    # example, the projections of ā_t g_tᵀ.
                    projected_a = tf.square(tf.einsum("nta,ab->ntb", abars[index], QA))
                    projected_g = tf.square(tf.einsum("ntg,gh->nth", g, QG))
                    sums[index] += tf.cast(tf.einsum("nta,ntb->ab", projected_a, projected_g), f64)
                else:
                    # Per-example gradients Σ_t ā_t g_tᵀ, projected onto the eigenbasis.
                    per_example = tf.einsum("nta,ntb->nab", abars[index], g)
                    rotated = tf.einsum("ai,nab,bj->nij", QA, per_example, QG)
                    sums[index] += tf.cast(tf.reduce_sum(tf.square(rotated), axis=0), f64)
            flat_column = tf.reshape(cotangent, [n, -1])
            diagonal = [
                total
                + tf.cast(
                    tf.reduce_sum(tf.einsum("njp,nj->np", jac, flat_column) ** 2, axis=0), f64
                )
                for total, jac in zip(diagonal, jacobians)
            ]
            return c + 1, sums, diagonal

        _, carried, diagonal = tf.while_loop(
            lambda c, *_: c < count, body, (tf.constant(0), carried, diagonal)
        )
        if bases is None:
            new["G"] = list(carried)
            if other_tf:
                new["diagonal"] = list(diagonal)
        else:
            new["S"] = [
                state["S"][index]
                + tf.cast(tf.matmul(projected_inputs[index], carried[index], transpose_a=True), f64)
                if index in projected_inputs
                else carried[index]
                for index in range(len(abars))
            ]
        return new, report


class _Step:
    """A compiled step's Python body (:meth:`_CompiledPass.traced` for one pass kind and
    split point). A callable object rather than a closure: TensorFlow counts retracing
    per function code, which every closure of one ``def`` shares, so the builds on
    different models would add up to its "excessive retracing" warning."""

    def __init__(
        self, owner: _CompiledPass, what: str, *, reads_logits: bool, want_diagonal: bool
    ) -> None:
        self._owner = owner
        self._what = what
        self._reads_logits = reads_logits
        self._want_diagonal = want_diagonal

    def __call__(
        self,
        x: Any,
        y: Any,
        first_index: tf.Tensor,
        seed: tf.Tensor,
        num_examples: tf.Tensor,
        state: dict[str, list[tf.Tensor]],
        bases: Any,
    ) -> tuple[dict[str, list[tf.Tensor]], _Report]:
        return self._owner.traced(
            self._what,
            x,
            y,
            first_index,
            seed,
            num_examples,
            state,
            bases,
            reads_logits=self._reads_logits,
            want_diagonal=self._want_diagonal,
        )


#: A factor's per-column contribution rowsᵀ rows of width d at most this is computed in
#: float64 products (m·d² is then small against the backward passes), wider ones in the
#: model's dtype: a small factor's exact null directions (the all-ones direction of a
#: softmax output layer's G) stay at float64 rounding, not a float32 GEMM's (measured:
#: 1e-7 against 0.2 units of float32 on the unit-diagonal factor).
_FLOAT64_GRAM_WIDTH = 64


def _gram(rows: tf.Tensor) -> tf.Tensor:
    """rowsᵀ rows (rows: (m, d) in the model's dtype) as float64: in float64 products for
    float64 rows or d ≤ ``_FLOAT64_GRAM_WIDTH``, else in the rows' dtype and made exactly
    symmetric (a GEMM sums entries (i, j) and (j, i) in different orders)."""
    if rows.dtype == tf.float64 or int(rows.shape[-1]) <= _FLOAT64_GRAM_WIDTH:
        rows = tf.cast(rows, tf.float64)
        return tf.matmul(rows, rows, transpose_a=True)
    product = tf.cast(tf.matmul(rows, rows, transpose_a=True), tf.float64)
    return 0.5 * (product + tf.transpose(product))


#: Compiled passes kept for models built on again with the same settings (a training
#: callback builds an operator every few steps): at most this many, least recent dropped.
_PASS_CACHE_SIZE = 8
_pass_cache: collections.OrderedDict[Hashable, tuple[tuple[Any, ...], _CompiledPass]] = (
    collections.OrderedDict()
)
_pass_cache_lock = threading.Lock()


def _clear_pass_cache() -> None:
    with _pass_cache_lock:
        _pass_cache.clear()


register_compiled_cache(_clear_pass_cache)


def _compiled_pass(
    key: Hashable | None, owners: tuple[Any, ...], factory: Callable[[], _CompiledPass]
) -> _CompiledPass:
    """The compiled pass stored under ``key`` (checked against ``owners``, the objects the
    key names by identity, which the entry keeps alive), or a new one from ``factory``
    (stored unless ``key`` is None: a model cloned for the build, used once)."""
    if key is None:
        return factory()
    with _pass_cache_lock:
        entry = _pass_cache.get(key)
        if (
            entry is not None
            and len(entry[0]) == len(owners)
            and all(a is b for a, b in zip(entry[0], owners))
        ):
            _pass_cache.move_to_end(key)
            return entry[1]
    compiled = factory()
    with _pass_cache_lock:
        _pass_cache[key] = (owners, compiled)
        _pass_cache.move_to_end(key)
        while len(_pass_cache) > _PASS_CACHE_SIZE:
            _pass_cache.popitem(last=False)
    return compiled


def _tf_variable(variable: Any) -> Any:
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) else variable
