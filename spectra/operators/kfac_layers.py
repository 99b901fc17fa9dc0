"""Which Keras layers K-FAC factors, and how it reads them.

A factored layer is a weight matrix W (inputs × outputs) applied to inputs a, shared over
the positions between the batch axis and the features: Dense on any rank, Dense-like
``EinsumDense`` equations (attention's projections), Conv1D and Conv2D (on their patches),
Embedding and ``ReversibleEmbedding`` (one-hot inputs; a tied table at one of its two
uses). :class:`LayerCapture` records each factored layer's inputs and pre-activation
outputs during one forward pass (see :mod:`spectra.operators.kfac` for the factors);
:func:`uncovered_message` names every trainable variable K-FAC does not cover.
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from spectra import _keras_compat

__all__ = [
    "FACTORED",
    "FACTORED_NAMES",
    "MAX_VOCABULARY",
    "LayerCapture",
    "check_embedding",
    "dense_form",
    "factor_sizes",
    "image_patches",
    "is_tied",
    "kernel_of",
    "pooling_layers",
    "static_rank",
    "uncovered_message",
]

#: Largest Embedding vocabulary K-FAC factors: its A is held as a dense V × V float64
#: matrix (128 MiB at this size) and each batch's inputs as one-hot rows.
MAX_VOCABULARY = 4096
#: The layers K-FAC factors (a weight matrix W, and a bias for all but Embedding), most
#: specific first (the class whose ``call`` a layer must not override).
FACTORED = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    *([keras.layers.ReversibleEmbedding] if hasattr(keras.layers, "ReversibleEmbedding") else []),
    keras.layers.Embedding,
)
#: The layers as errors list them.
FACTORED_NAMES = "Dense, EinsumDense, Conv1D, Conv2D and Embedding"


class LayerCapture:
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
        pools: Sequence[Any] = (),
    ) -> None:
        self._layers = list(layers)
        #: MaxPooling2D layers whose backward uses the argmax of the forward pass
        #: (:func:`pooling_layers`, :meth:`_pool_call_of`).
        self._pools = list(pools)
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

    def __enter__(self) -> LayerCapture:
        for layer in self._layers:
            layer.call = self._call_of(layer)
        for layer in self._pools:
            layer.call = _pool_call_of(layer)
        return self

    def __exit__(self, *exc: Any) -> None:
        for layer in [*self._layers, *self._pools]:
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
                form = dense_form(layer, x.shape.rank)
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
                image = x[:, :, None, :]
                sizes, strides = [layer.kernel_size[0], 1], [layer.strides[0], 1]
                rates = [layer.dilation_rate[0], 1]
            else:
                image, padding = x, layer.padding
                sizes, strides = list(layer.kernel_size), list(layer.strides)
                rates = list(layer.dilation_rate)
            # Each patch is flattened (kh, kw, c_in) row-major, as the kernel's rows are.
            a = image_patches(image, sizes, strides, rates, padding.upper())
            positions = patch_grid(image, sizes, strides, rates, padding.upper())
            if not self.records and positions is not None:
                # The first factored layer of the forward pass: no gradient is taken
                # through its input, so z is the patches times the kernel, one GEMM over
                # the patches already held (on a CPU several times faster than the
                # convolution for the few input channels of a first layer: 0.5 ms against
                # 5-8 ms on the 1,797 digits), equal to it up to the order of the sums.
                c_out = int(kernel.shape[-1])
                flat = tf.matmul(tf.reshape(a, [-1, a.shape[-1]]), tf.reshape(kernel, [-1, c_out]))
                grid = positions if layer.rank == 2 else positions[:1]
                z = tf.reshape(flat, [tf.shape(x)[0], *grid, c_out])
            elif isinstance(layer, keras.layers.Conv1D):
                z = keras.ops.conv(
                    x,
                    kernel,
                    strides=list(layer.strides),
                    padding=padding,
                    dilation_rate=layer.dilation_rate,
                    data_format=layer.data_format,
                )
            else:
                z = layer.convolution_op(x, kernel)
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
            if is_tied(layer) and self._tied == "output":
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


def pooling_layers(model: Any) -> list[Any]:
    """The ``MaxPooling2D`` layers of ``model`` (channels last, Keras' own ``call``) whose
    backward :class:`LayerCapture` can take from the forward pass's argmax."""
    return [
        layer
        for layer in _keras_compat.flatten_layers(model)
        if isinstance(layer, keras.layers.MaxPooling2D)
        and type(layer).call is keras.layers.MaxPooling2D.call
        and getattr(layer, "data_format", None) == "channels_last"
    ]


def _pool_call_of(layer: Any) -> Any:
    """A ``MaxPooling2D`` call with the same output whose gradient routes each window's
    gradient to the argmax found in the forward pass (``max_pool_with_argmax``, then
    ``MaxPoolGradWithArgmax``): K-FAC back-propagates C columns through the same
    forward pass, and TensorFlow's ``MaxPoolGrad`` searches every window again for each
    (measured on one CPU thread for the digits CNN's (1,797, 6, 6, 8) pool: 10 gradients
    in 42 ms, against 7 ms with the argmax). Both take the first maximum of a window in
    row-major order, so the gradients are the same (bit-identical in the test)."""
    sizes = [1, *layer.pool_size, 1]
    strides = [1, *layer.strides, 1]
    padding = layer.padding.upper()

    def call(inputs: Any, *args: Any, **kwargs: Any) -> tf.Tensor:
        @tf.custom_gradient
        def pool(x: tf.Tensor) -> Any:
            y, argmax = tf.nn.max_pool_with_argmax(
                x, sizes, strides, padding, include_batch_in_index=True
            )

            def gradient(dy: tf.Tensor) -> tf.Tensor:
                return tf.raw_ops.MaxPoolGradWithArgmax(
                    input=x,
                    grad=dy,
                    argmax=argmax,
                    ksize=sizes,
                    strides=strides,
                    padding=padding,
                    include_batch_in_index=True,
                )

            return y, gradient

        return pool(tf.convert_to_tensor(inputs))

    return call


def image_patches(
    image: tf.Tensor,
    sizes: Sequence[int],
    strides: Sequence[int],
    rates: Sequence[int],
    padding: str,
) -> tf.Tensor:
    """The patches of ``image`` (n, H, W, c) a convolution with a kernel of ``sizes``
    (kh, kw), ``strides``, dilation ``rates`` and ``padding`` ("VALID" or "SAME") reads, as
    (n, T, kh·kw·c): T = H_out·W_out positions row-major, each patch flattened (kh, kw, c)
    row-major, the values of ``tf.image.extract_patches`` exactly (zeros where "SAME" pads:
    the total padding max((H_out − 1)·s + (kh − 1)·r + 1 − H, 0), its half rounded down
    before).

    Built from kh·kw strided slices of the (padded) image stacked on a new axis: a copy of
    the n·T·kh·kw·c values, as ``extract_patches`` makes, without its per-element index
    arithmetic (measured 3-6x faster on one CPU thread, e.g. 7 ms against 21 ms for the
    1,797 digits' 3 × 3 patches). Images of unknown height or width go to
    ``extract_patches``."""
    grid = patch_grid(image, sizes, strides, rates, padding)
    if grid is None:
        patches = tf.image.extract_patches(
            image,
            sizes=[1, *sizes, 1],
            strides=[1, *strides, 1],
            rates=[1, *rates, 1],
            padding=padding,
        )
        return tf.reshape(patches, [tf.shape(image)[0], -1, patches.shape[-1]])
    out_h, out_w = grid
    if padding == "SAME":
        spans = [(k - 1) * r + 1 for k, r in zip(sizes, rates)]
        pads = [
            max((o - 1) * s + span - int(e), 0)
            for o, s, span, e in zip(grid, strides, spans, image.shape[1:3])
        ]
        if any(pads):
            image = tf.pad(image, [[0, 0], *([p // 2, p - p // 2] for p in pads), [0, 0]])
    (s_h, s_w), (r_h, r_w) = strides, rates
    pieces = [
        image[
            :,
            i * r_h : i * r_h + (out_h - 1) * s_h + 1 : s_h,
            j * r_w : j * r_w + (out_w - 1) * s_w + 1 : s_w,
            :,
        ]
        for i in range(sizes[0])
        for j in range(sizes[1])
    ]
    stacked = tf.stack(pieces, axis=3)  # (n, out_h, out_w, kh·kw, c)
    return tf.reshape(stacked, [tf.shape(image)[0], out_h * out_w, -1])


def patch_grid(
    image: tf.Tensor,
    sizes: Sequence[int],
    strides: Sequence[int],
    rates: Sequence[int],
    padding: str,
) -> tuple[int, int] | None:
    """(H_out, W_out), the positions of a convolution's output on ``image`` (n, H, W, c) as
    TensorFlow sizes it: ⌈H / s⌉ for "SAME", ⌊(H − (kh − 1)·r − 1) / s⌋ + 1 for "VALID";
    None when H or W is not known statically."""
    extents = image.shape[1:3]
    if None in extents:
        return None
    spans = [(k - 1) * r + 1 for k, r in zip(sizes, rates)]
    if padding == "SAME":
        return (-(-int(extents[0]) // strides[0]), -(-int(extents[1]) // strides[1]))
    return (
        (int(extents[0]) - spans[0]) // strides[0] + 1,
        (int(extents[1]) - spans[1]) // strides[1] + 1,
    )


def is_tied(layer: Any) -> bool:
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


def dense_form(layer: Any, rank: int | None) -> _DenseForm:
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


def factor_sizes(layer: Any, transposed: bool = False) -> tuple[int, int]:
    """(d_in, d_out) of a factored layer: its kernel's rows and columns, the kernel
    flattened row-major (an EinsumDense kernel's contracted axes are its rows);
    ``transposed`` (a tied ReversibleEmbedding factored at its reverse call, whose kernel
    is the table's transpose): (d, V)."""
    shape = [int(d) for d in kernel_of(layer).shape]
    if transposed:
        return shape[1], shape[0]
    rows = len(shape) - 1
    if isinstance(layer, keras.layers.EinsumDense):
        rows = dense_form(layer, static_rank(layer)).rows
    return int(np.prod(shape[:rows])), int(np.prod(shape[rows:]))


def static_rank(layer: Any) -> int | None:
    """The input rank a built EinsumDense layer was built for (its ``input_spec``)."""
    spec = getattr(layer, "input_spec", None)
    spec = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
    return getattr(spec, "ndim", None)


def check_embedding(layer: Any) -> None:
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


def kernel_of(layer: Any) -> Any:
    """The layer's weight matrix W (rows: inputs, columns: outputs): the kernel of a Dense
    or Conv2D layer, the table (vocabulary × output dim) of an Embedding."""
    if isinstance(layer, keras.layers.Embedding):
        return layer.embeddings
    return layer.kernel


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


def uncovered_message(
    model: Any, weights: Sequence[Any], names: Sequence[str], at: Sequence[int]
) -> str:
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
        f"K-FAC factors {FACTORED_NAMES} layers; {count} trainable "
        f"variable{'s' if count != 1 else ''} in {len(groups)} "
        f"layer{'s' if len(groups) != 1 else ''} {'is' if count == 1 else 'are'} not "
        f"covered: {listed}. Pass "
        "other_variables='exclude' (their rows and columns are zero) or "
        "other_variables='diagonal' (the exact diagonal of the matrix for them), or make them "
        "non-trainable."
    )
