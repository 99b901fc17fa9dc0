"""Every use of a private or version-dependent TensorFlow/Keras API, each with a fallback.

spectra is tested with TensorFlow 2.16-2.21 and Keras 3 (see ``setup.cfg``). The few
places where it reaches below the public API live here, so that a TensorFlow or Keras
release that moves them breaks one small module, and each one has a fallback that is
exercised by ``tests/test_tf_compat.py`` (by hiding the private attribute):

* :func:`call_flat` calls a concrete function with a flat list of tensors through
  ``ConcreteFunction._call_flat`` (skipping argument binding, a few ms per call on small
  models); fallback: the ordinary call.
* :func:`trace_graph` traces a Python function into a graph without automatic control
  dependencies (``tf.compat.v1.wrap_function``); fallback: the graph of a
  ``tf.function`` concrete function (the engine then drops control edges that cross the
  split, see :mod:`spectra.operators.engine`).
  While tracing, the graph's private ``_add_control_dependencies`` flag is set, which
  ``while_v2``/``cond_v2`` read to trace loop bodies and branches with automatic control
  dependencies: the model's assertions inside a loop body (a Keras RNN cell) then stay
  in the body function; fallback (no such attribute): loop bodies are traced as before
  and such assertions are pruned (assertions outside loops are kept either way).
* :func:`exact_second_derivatives` (entered by :func:`trace_graph`) makes every graph
  spectra traces differentiable to second order where TensorFlow's is not:

  - ``tf.nn.moments`` computes the variance around ``stop_gradient(mean)``: its value and
    gradient are right (the variance's derivative with respect to the mean is zero), its
    derivative is not, so Hessians through LayerNormalization, GroupNormalization and
    training-mode BatchNormalization (Keras' TensorFlow backend calls ``tf.nn.moments``)
    were wrong by 15-67 %. The public attribute ``tf.nn.moments`` is replaced by the same
    arithmetic without the ``stop_gradient`` (a custom layer calling it is covered too).
  - ``SoftsignGrad``, ``ResizeNearestNeighborGrad``, ``ResizeBicubicGrad`` and
    ``ScaleAndTranslateGrad`` have no gradient (a Hessian through
    ``Activation("softsign")`` or a bicubic ``Resizing`` failed with a ``LookupError``),
    and ``ResizeBilinearGrad`` is declared not differentiable (a Hessian through
    ``UpSampling2D(interpolation="bilinear")`` silently missed a term). Each gets its
    exact gradient in TensorFlow's gradient registry (``ops._gradient_registry``,
    private) while spectra traces.

  - Two gradients do avoidable work per product, and get the same values more cheaply:
    ``MaxPool``'s (TensorFlow's ``MaxPoolGrad`` searches every window again, and its own
    derivative ``MaxPoolGradGrad`` once more per Hessian or GGN product) goes through
    the argmax of the forward windows (``MaxPoolWithArgmax``, computed once per batch),
    a scatter whose derivative is a gather (``MaxPoolGradWithArgmax``, to which
    TensorFlow gives no gradient, gets that one: 28 % off a small CNN's Hessian product,
    bit-identical); for a shallow filter (kh·kw·c_in ≤ 32: an image's first layer)
    ``Conv2D``'s filter gradient and ``Conv2DBackpropFilter``'s derivative in its incoming
    gradient (a convolution of the layer's input with the product's filter) are matrix
    products with the input's patches, extracted once per batch (1.3-5x faster than the
    convolutions on one CPU thread), and the patches' own gradient is a convolution's
    input gradient; ``ReluGrad``'s derivative in its features, zero, is not materialized as a
    tensor of zeros to be added.

  Fallback: :func:`inexact_second_derivative_ops` finds what is left in a traced graph
  (the signature of the original moments, a ``StopGradient`` of a ``Mean`` read by a
  ``SquaredDifference``; a ``ResizeBilinearGrad`` when the registry was out of reach),
  and the engine refuses such a Hessian in one line naming the layer.
* :func:`first_gpu_memory` reads the memory of the first visible GPU from
  ``tensorflow.python.client.device_lib`` (private); fallback: the public
  ``tf.config.experimental.get_memory_info`` peak is no total, so None (the operators'
  memory plan then uses the host's memory).
* :func:`model_distribute_strategy` reads the strategy a Keras model was built under
  (``Model._distribute_strategy``); fallback: the strategy in scope.
* :func:`graph_captures` lists the tensors a traced graph captured from outside, as
  ``(external, internal placeholder)`` pairs (``FuncGraph.captures``); fallback: the
  graph's ``external_captures`` and ``internal_captures`` side by side.
* :func:`captured_placeholder` finds the placeholder through which the graph being
  traced reads an eager tensor (a variable's handle): the input of an op reading it,
  ``tf.identity(tensor).op.inputs[0]``; fallback (when that is not a placeholder): the
  graph's own ``capture``.
* :func:`keras_logits` finds the logits behind a softmax or sigmoid output, which Keras'
  cross-entropies read instead of the probabilities (the ``_keras_logits`` attribute
  Keras sets on the activation's output); fallback: the input of a ``Softmax`` or
  ``Sigmoid`` op.

Keras' backend-independent internals (its layers, seed states, functional structure,
loss keyword arguments, optimizer state) are read by :mod:`spectra._keras_compat`, for
both engines.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import tensorflow as tf

SUPPORTED_TENSORFLOW = ">=2.16,<2.22"
SUPPORTED_KERAS = ">=3.3,<4"


def call_flat(function: Any, args: Sequence[tf.Tensor]) -> Any:
    """Call a concrete function with its flat list of tensor arguments.

    The ordinary call path first tries to bind the arguments to a structured signature;
    the flat path skips that. Both return the same tensors.
    """
    flat = getattr(function, "_call_flat", None)
    if flat is None:
        return function(*args)
    return flat(list(args), function.captured_inputs)


def trace_graph(
    fn: Callable[..., Any], signature: Sequence[tf.TensorSpec]
) -> tuple[Any, list, list]:
    """Trace ``fn(*placeholders)`` into a graph: ``(graph, input tensors, output tensors)``.

    ``tf.compat.v1.wrap_function`` traces without automatic control dependencies, so the
    only control edges are the ones the traced code asked for. The inputs are the
    placeholders of ``signature`` followed by those of captured tensors (see
    ``graph.captures``).
    """
    wrap = getattr(getattr(tf, "compat", None), "v1", None)
    wrap = getattr(wrap, "wrap_function", None)
    with exact_second_derivatives():
        if wrap is not None:
            wrapped = wrap(_with_checked_loop_bodies(fn), list(signature))
            return wrapped.graph, list(wrapped.graph.inputs), list(wrapped.outputs)
        return _trace_with_tf_function(fn, signature)


# -- second derivatives of first-derivative ops ----------------------------------------
# Each first-derivative op below is linear in its incoming gradient g (it applies the
# adjoint Rᵀ of a linear map R, or a diagonal scaling), so its derivative with respect to
# g is R (the forward op itself) and, for the resizes, nothing else depends on values.


def _softsign_grad_grad(op: Any, upstream: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """SoftsignGrad(g, x) = g / (1 + |x|)²: ∂/∂g = 1/(1 + |x|)², ∂/∂x = -2 g sign(x)/(1 + |x|)³."""
    g, x = op.inputs
    scale = 1.0 + tf.abs(x)
    by_g = upstream / tf.square(scale)
    return by_g, -2.0 * by_g * g * tf.sign(x) / scale


def _forward_resize(op: Any, upstream: tf.Tensor, resize: Callable[..., tf.Tensor]) -> tf.Tensor:
    """The resize R whose adjoint ``op`` applies, applied to ``upstream`` (image-shaped),
    back to the size of the op's incoming gradient, in that gradient's dtype."""
    g = op.inputs[0]
    size = tf.shape(g)[1:3]
    attrs = {"align_corners": op.get_attr("align_corners")}
    attrs["half_pixel_centers"] = op.get_attr("half_pixel_centers")
    return tf.cast(resize(upstream, size, **attrs), g.dtype)


def _resize_bilinear_grad_grad(op: Any, upstream: tf.Tensor) -> tuple[Any, ...]:
    from tensorflow.python.ops import gen_image_ops

    return _forward_resize(op, upstream, gen_image_ops.resize_bilinear), None


def _resize_bicubic_grad_grad(op: Any, upstream: tf.Tensor) -> tuple[Any, ...]:
    from tensorflow.python.ops import gen_image_ops

    return _forward_resize(op, upstream, gen_image_ops.resize_bicubic), None


def _resize_nearest_grad_grad(op: Any, upstream: tf.Tensor) -> tuple[Any, ...]:
    from tensorflow.python.ops import gen_image_ops

    return _forward_resize(op, upstream, gen_image_ops.resize_nearest_neighbor), None


def _scale_and_translate_grad_grad(op: Any, upstream: tf.Tensor) -> tuple[Any, ...]:
    """ScaleAndTranslateGrad(g, image, scale, translation) applies Rᵀ to g; R is
    ScaleAndTranslate(·, size of g, scale, translation)."""
    from tensorflow.python.ops import gen_image_ops

    g, _, scale, translation = op.inputs
    forward = gen_image_ops.scale_and_translate(
        upstream,
        tf.shape(g)[1:3],
        scale,
        translation,
        kernel_type=op.get_attr("kernel_type"),
        antialias=op.get_attr("antialias"),
    )
    return tf.cast(forward, g.dtype), None, None, None


# Tensors the gradients below compute from the forward pass alone (a pool's argmax, a
# convolution input's patches), made once per graph being traced although a Hessian
# product asks for them twice (first and second backward pass); emptied when the
# outermost exact_second_derivatives context exits.
_per_graph: dict[Hashable, tf.Tensor] = {}


def _once_per_graph(key: Hashable, build: Callable[[], tf.Tensor]) -> tf.Tensor:
    """``build()``, or the tensor it gave for ``key`` in the graph being traced."""
    key = (tf.compat.v1.get_default_graph(), key)
    if key not in _per_graph:
        _per_graph[key] = build()
    return _per_graph[key]


def _image_padding(op: Any) -> str | None:
    """The padding, "SAME" or "VALID", of a channels-last image op (pooling, convolution,
    patches); None for other layouts or explicit padding."""
    padding = op.get_attr("padding")
    padding = padding.decode() if isinstance(padding, bytes) else str(padding)
    try:
        data_format = op.get_attr("data_format")
    except ValueError:  # ExtractImagePatches: channels-last only
        data_format = "NHWC"
    data_format = data_format.decode() if isinstance(data_format, bytes) else str(data_format)
    return padding if data_format == "NHWC" and padding in ("SAME", "VALID") else None


def _pool_attrs(op: Any) -> tuple[Any, Any, str] | None:
    """``(ksize, strides, padding)`` of a max-pooling op that ``MaxPoolWithArgmax`` can
    redo (channels-last, "SAME" or "VALID" padding, a floating dtype); None otherwise."""
    padding = _image_padding(op)
    if padding is None:
        return None
    if op.inputs[0].dtype not in (tf.float16, tf.bfloat16, tf.float32, tf.float64):
        return None
    return op.get_attr("ksize"), op.get_attr("strides"), padding


def _max_pool_gradient(original: Callable[..., Any]) -> Callable[..., Any]:
    """MaxPool's gradient through the argmax of each window: ``MaxPoolGradWithArgmax``
    routes the gradient of each output to the input position ``MaxPoolWithArgmax`` found,
    where TensorFlow's ``MaxPoolGrad`` searches every window again, and differentiating it
    again (the second backward of a Hessian product, the double-VJP of a GGN product) a
    ``MaxPoolGradGrad`` searches them once more per product; with the argmax both become
    a scatter and a gather, and the argmax, which does not depend on the vector, is
    computed once per batch. Both kernels take a window's first maximum in row-major
    order, so the gradients are the same. Other pools (channels-first, explicit padding)
    keep TensorFlow's ``original`` gradient."""

    def gradient(op: Any, upstream: tf.Tensor) -> Any:
        attrs = _pool_attrs(op)
        if attrs is None:
            return original(op, upstream)
        ksize, strides, padding = attrs
        from tensorflow.python.ops import gen_nn_ops

        x = op.inputs[0]
        argmax = _once_per_graph(
            ("argmax", x.ref(), tuple(ksize), tuple(strides), padding),
            lambda: gen_nn_ops.max_pool_with_argmax(
                x, ksize, strides, padding, include_batch_in_index=True
            )[1],
        )
        return gen_nn_ops.max_pool_grad_with_argmax(
            x, upstream, argmax, ksize, strides, padding, include_batch_in_index=True
        )

    return gradient


def _max_pool_grad_with_argmax_grad(op: Any, upstream: tf.Tensor) -> tuple[Any, ...]:
    """MaxPoolGradWithArgmax(x, g, argmax) adds each entry of g at position argmax of an
    x-shaped zero tensor: linear in g, with derivative the gather of ``upstream`` at
    argmax; piecewise constant in x, and argmax is an index (no derivatives)."""
    _, g, argmax = op.inputs
    if op.get_attr("include_batch_in_index"):
        picked = tf.gather(tf.reshape(upstream, [-1]), argmax)
    else:  # indices within each example
        n = tf.shape(upstream)[0]
        picked = tf.gather(tf.reshape(upstream, [n, -1]), tf.reshape(argmax, [n, -1]), batch_dims=1)
    return None, tf.reshape(picked, tf.shape(g)), None


def _relu_gradient_gradient(original: Callable[..., Any]) -> Callable[..., Any]:
    """ReluGrad(g, x) = g·[x > 0] differentiated without the zeros TensorFlow's gradient
    materializes for x (an x-sized tensor per product, then added to x's other
    gradients): its derivative in x is zero where it exists, returned as None."""

    del original  # the same ReluGrad of the incoming gradient, without the zeros

    def gradient(op: Any, upstream: tf.Tensor) -> Any:
        from tensorflow.python.ops import gen_nn_ops

        return gen_nn_ops.relu_grad(upstream, op.inputs[1]), None

    return gradient


# Largest patch (kh·kw·input channels) for which a convolution's derivative is computed as
# a matrix product with the input's patches: measured on one CPU thread, Conv2D with a
# 3x3x1 or 3x3x3 filter ran 3.5-5x slower than the patches' matrix product and
# Conv2DBackpropFilter 1.3-1.8x; at 3x3x16 the convolutions were faster.
_PATCH_PRODUCT_MAX_DEPTH = 32


def _convolution_filter_gradient_gradient(original: Callable[..., Any]) -> Callable[..., Any]:
    """The derivative of Conv2DBackpropFilter(x, sizes, dy) = Pᵀ dy, with P the patches of
    x (one row per output position, kh·kw·c_in columns), in dy: P u for an incoming
    filter-shaped u. TensorFlow's runs a convolution of x with u for each product; for a
    shallow filter (an image's first layer: kh·kw·c_in ≤ 32) P, which does not depend on
    the vector, is extracted once and u is applied by one matrix product. The derivative
    in x is TensorFlow's (a ``Conv2DBackpropInput``); other convolutions (channels-first,
    explicit padding, grouped, deeper filters) keep TensorFlow's ``original``."""

    def gradient(op: Any, upstream: tf.Tensor) -> Any:
        x, _, dy = op.inputs
        geometry = _patch_geometry(op, x, upstream.shape)
        if geometry is None:
            return original(op, upstream)
        from tensorflow.python.ops import gen_nn_ops

        (depth, padding), strides = geometry, op.get_attr("strides")
        by_input = gen_nn_ops.conv2d_backprop_input(
            tf.shape(x), upstream, dy, strides=strides, padding=padding, data_format="NHWC"
        )
        patches = _patch_rows(x, upstream.shape[:2], strides, padding, depth)
        by_dy = tf.matmul(patches, tf.reshape(upstream, [depth, -1]))
        return by_input, None, tf.reshape(by_dy, tf.shape(dy))

    return gradient


def _patch_rows(
    x: tf.Tensor, kernel: Sequence[int], strides: Sequence[int], padding: str, depth: int
) -> tf.Tensor:
    """x's patches as rows (n·H_out·W_out, kh·kw·c_in), ordered as a filter reshaped to
    (kh·kw·c_in, c_out): ``tf.image.extract_patches``, which pads "SAME" as the
    convolution does; once per graph for the same x and geometry."""

    def build() -> tf.Tensor:
        patches = tf.image.extract_patches(
            x, sizes=[1, *kernel, 1], strides=list(strides), rates=[1, 1, 1, 1], padding=padding
        )
        return tf.reshape(patches, [-1, depth])

    key = ("patches", x.ref(), tuple(int(k) for k in kernel), tuple(strides), padding)
    return _once_per_graph(key, build)


def _convolution_gradient(original: Callable[..., Any]) -> Callable[..., Any]:
    """Conv2D's gradient with the filter's part Pᵀ dy (P: x's patches, one row per output
    position) a matrix product for a shallow filter (kh·kw·c_in ≤ 32): TensorFlow's
    ``Conv2DBackpropFilter`` took 4.1 of the digits CNN's 10 ms product (one CPU thread,
    without oneDNN). A Hessian product computes it again for every vector (the second
    backward through the forward convolution), P once per batch; its own derivatives are
    then matrix products too (and the patches' gradient, :func:`_patches_gradient`, where
    x depends on the parameters). The input's part is TensorFlow's
    ``Conv2DBackpropInput``."""

    def gradient(op: Any, upstream: tf.Tensor) -> Any:
        x, kernel = op.inputs
        geometry = _patch_geometry(op, x, kernel.shape)
        if geometry is None:
            return original(op, upstream)
        from tensorflow.python.ops import gen_nn_ops

        (depth, padding), strides = geometry, op.get_attr("strides")
        by_input = gen_nn_ops.conv2d_backprop_input(
            tf.shape(x), kernel, upstream, strides=strides, padding=padding, data_format="NHWC"
        )
        patches = _patch_rows(x, kernel.shape[:2], strides, padding, depth)
        by_kernel = tf.matmul(
            patches, tf.reshape(upstream, [-1, int(kernel.shape[-1])]), transpose_a=True
        )
        return by_input, tf.reshape(by_kernel, tf.shape(kernel))

    return gradient


def _patches_gradient(original: Callable[..., Any]) -> Callable[..., Any]:
    """ExtractImagePatches' gradient (adding each patch's entries back to the image) as the
    input gradient of a convolution with the identity filter (kh, kw, c, kh·kw·c), whose
    patches are the op's output; TensorFlow's builds index images and a sparse product.
    For a shallow patch (kh·kw·c ≤ 32, the patches of :func:`_convolution_gradient`)
    without dilation; others keep TensorFlow's ``original``."""

    def gradient(op: Any, upstream: tf.Tensor) -> Any:
        x = op.inputs[0]
        padding = _image_padding(op)
        kh, kw = (int(d) for d in op.get_attr("ksizes")[1:3])
        channels = x.shape[-1] if x.shape.rank == 4 else None
        if (
            padding is None
            or any(int(d) != 1 for d in op.get_attr("rates"))
            or channels is None
            or kh * kw * int(channels) > _PATCH_PRODUCT_MAX_DEPTH
            or x.dtype not in (tf.float32, tf.float64)
        ):
            return original(op, upstream)
        from tensorflow.python.ops import gen_nn_ops

        depth = kh * kw * int(channels)
        identity = tf.reshape(tf.eye(depth, dtype=x.dtype), [kh, kw, int(channels), depth])
        return gen_nn_ops.conv2d_backprop_input(
            tf.shape(x),
            identity,
            upstream,
            strides=op.get_attr("strides"),
            padding=padding,
            data_format="NHWC",
        )

    return gradient


def _patch_geometry(op: Any, x: tf.Tensor, filter_shape: tf.TensorShape) -> tuple[int, str] | None:
    """``(kh·kw·c_in, padding)`` of a convolution op (Conv2D, Conv2DBackpropFilter) of
    image x and a filter of ``filter_shape`` whose filter derivatives are best taken as
    products with x's patches (see :func:`_convolution_gradient`); None where
    TensorFlow's are kept."""
    padding = _image_padding(op)
    if padding is None or any(int(d) != 1 for d in op.get_attr("dilations")):
        return None
    if filter_shape.rank != 4 or not filter_shape.is_fully_defined():
        return None
    if x.shape.rank != 4 or x.shape[-1] is None or x.dtype not in (tf.float32, tf.float64):
        return None
    kh, kw, c_in, _ = (int(d) for d in filter_shape)
    if c_in != int(x.shape[-1]):  # a grouped convolution
        return None
    depth = kh * kw * c_in
    return (depth, padding) if depth <= _PATCH_PRODUCT_MAX_DEPTH else None


# First-derivative ops whose TensorFlow gradient does avoidable work per product, replaced
# while spectra traces by the same values computed more cheaply (a factory of the
# replacement from TensorFlow's own gradient, which the replacement may fall back to).
_CHEAPER_GRADIENTS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "MaxPool": _max_pool_gradient,
    "ReluGrad": _relu_gradient_gradient,
    "Conv2DBackpropFilter": _convolution_filter_gradient_gradient,
    "Conv2D": _convolution_gradient,
    "ExtractImagePatches": _patches_gradient,
}


# First-derivative ops TensorFlow leaves without a second derivative: no registered
# gradient (a Hessian fails with a LookupError) or declared not differentiable (a term of
# the Hessian is silently zero). Given theirs while spectra traces; a gradient a
# TensorFlow release registers itself is used instead.
_SECOND_DERIVATIVES: dict[str, Callable[..., Any]] = {
    "SoftsignGrad": _softsign_grad_grad,
    "ResizeBilinearGrad": _resize_bilinear_grad_grad,
    "ResizeNearestNeighborGrad": _resize_nearest_grad_grad,
    "ResizeBicubicGrad": _resize_bicubic_grad_grad,
    "ScaleAndTranslateGrad": _scale_and_translate_grad_grad,
    "MaxPoolGradWithArgmax": _max_pool_grad_with_argmax_grad,
}


_exact_lock = threading.Lock()
_exact_depth = 0
_saved_moments: Any = None
_saved_gradients: dict[str, Any] = {}


@contextlib.contextmanager
def exact_second_derivatives() -> Iterator[None]:
    """Within the context, ``tf.nn.moments`` is :func:`_exact_moments`, the op types of
    ``_SECOND_DERIVATIVES`` that TensorFlow does not differentiate have gradients, and
    those of ``_CHEAPER_GRADIENTS`` have the cheaper ones.

    Re-entrant and safe across threads: the originals are restored when the outermost
    context exits. Values and first derivatives are TensorFlow's own (the same ops in the
    same order, or for max-pooling other kernels giving the same bits), so code outside
    spectra running at the same time sees no difference beyond exact higher derivatives.
    The gradients are set in TensorFlow's gradient registry (private:
    ``ops._gradient_registry._registry``); fallback, without it: the op types with no
    gradient at all are registered for good with ``tf.RegisterGradient``, a
    ``ResizeBilinearGrad`` stays undifferentiated (the engine refuses such a Hessian) and
    the cheaper gradients are not used.
    """
    global _exact_depth, _saved_moments
    with _exact_lock:
        if _exact_depth == 0:
            _saved_moments = tf.nn.moments
            tf.nn.moments = _exact_moments
            _saved_gradients.update(_set_second_derivatives())
        _exact_depth += 1
    try:
        yield
    finally:
        with _exact_lock:
            _exact_depth -= 1
            if _exact_depth == 0:
                tf.nn.moments = _saved_moments
                _restore_gradients(_saved_gradients)
                _saved_gradients.clear()
                _per_graph.clear()


def _gradient_entries() -> dict[str, Any] | None:
    from tensorflow.python.framework import ops

    entries = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    return entries if isinstance(entries, dict) else None


def _set_second_derivatives() -> dict[str, Any]:
    """Give each op type of ``_SECOND_DERIVATIVES`` without a gradient its own; return
    what to restore (the previous registry entries, None where there was none)."""
    entries = _gradient_entries()
    if entries is None:
        for op_type, function in _SECOND_DERIVATIVES.items():
            with contextlib.suppress(KeyError):  # TensorFlow has one: it is used
                tf.RegisterGradient(op_type)(function)
        return {}
    saved = {}
    for op_type, function in _SECOND_DERIVATIVES.items():
        entry = entries.get(op_type)
        if entry is not None and entry.get("type") is not None:
            continue  # TensorFlow differentiates it: keep its gradient
        saved[op_type] = entry
        entries[op_type] = {"type": function, "location": (__name__, 0, "", "")}
    for op_type, factory in _CHEAPER_GRADIENTS.items():
        entry = entries.get(op_type)
        if entry is None or entry.get("type") is None:
            continue  # nothing to make cheaper
        saved[op_type] = entry
        entries[op_type] = {"type": factory(entry["type"]), "location": (__name__, 0, "", "")}
    return saved


def _restore_gradients(saved: dict[str, Any]) -> None:
    entries = _gradient_entries()
    if entries is None:
        return
    for op_type, entry in saved.items():
        if entry is None:
            entries.pop(op_type, None)
        else:
            entries[op_type] = entry


def _exact_moments(
    x: Any, axes: Any, shift: Any = None, keepdims: bool = False, name: str | None = None
) -> tuple[tf.Tensor, tf.Tensor]:
    """``tf.nn.moments`` without its ``stop_gradient``: mean m = E[x] and variance
    E[(x - m)²] over ``axes`` (the biased, population variance), with every derivative.

    The variance's Hessian with respect to x over a reduced group of N entries is
    (2/N)(I - 11ᵀ/N); TensorFlow's version differentiates only through the first factor
    and gives (2/N) I. float16 inputs are reduced in float32, as TensorFlow does.
    """
    del shift  # unused by TensorFlow's own implementation too
    with tf.name_scope(name or "moments"):
        x = tf.convert_to_tensor(x)
        y = tf.cast(x, tf.float32) if x.dtype == tf.float16 else x
        mean = tf.reduce_mean(y, axes, keepdims=True, name="mean")
        variance = tf.reduce_mean(
            tf.math.squared_difference(y, mean), axes, keepdims=True, name="variance"
        )
        if not keepdims:
            mean = tf.squeeze(mean, axes)
            variance = tf.squeeze(variance, axes)
        if x.dtype == tf.float16:
            return tf.cast(mean, tf.float16), tf.cast(variance, tf.float16)
        return mean, variance


def inexact_second_derivative_ops(graph_def: Any) -> list[tuple[str, str]]:
    """``(name scope, what)`` of each op in ``graph_def`` (and the functions it calls: loop
    bodies, branches) whose gradient is right but whose derivative TensorFlow gets wrong,
    left after :func:`exact_second_derivatives`:

    * a variance around a ``stop_gradient`` of a mean, TensorFlow's ``tf.nn.moments``: a
      ``StopGradient`` of a ``Mean`` read by a ``SquaredDifference``;
    * a ``ResizeBilinearGrad``, if the registry could not be given its gradient (declared
      not differentiable by TensorFlow: its term of the Hessian would be zero).
    """
    bodies = [graph_def.node, *(f.node_def for f in graph_def.library.function)]
    found = []
    for nodes in bodies:
        by_name = {node.name: node for node in nodes}
        readers: dict[str, list[Any]] = {}
        for node in nodes:
            for source in node.input:
                readers.setdefault(source.lstrip("^").split(":")[0], []).append(node)
        for node in nodes:
            scope = node.name.rsplit("/", 1)[0]
            if node.op == "ResizeBilinearGrad" and _gradient_entries() is None:
                found.append((scope, f"{node.op}, which TensorFlow does not differentiate"))
            if node.op != "StopGradient" or not node.input:
                continue
            source = by_name.get(node.input[0].split(":")[0])
            if source is None or source.op != "Mean":
                continue
            if any(r.op == "SquaredDifference" for r in readers.get(node.name, [])):
                found.append(
                    (
                        scope.removesuffix("/moments"),
                        "a variance with tf.nn.moments, whose second derivative is approximate",
                    )
                )
    return found


def _with_checked_loop_bodies(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, tracing the bodies of loops and branches it creates with automatic control
    dependencies (so their stateful ops, e.g. assertions, stay in the body functions)
    while the traced graph itself gets none."""

    def traced(*args: Any) -> Any:
        graph = tf.compat.v1.get_default_graph()
        if hasattr(graph, "_add_control_dependencies"):
            graph._add_control_dependencies = True
        return fn(*args)

    return traced


def _trace_with_tf_function(
    fn: Callable[..., Any], signature: Sequence[tf.TensorSpec]
) -> tuple[Any, list, list]:
    concrete = tf.function(fn, input_signature=list(signature), autograph=False)
    concrete = concrete.get_concrete_function()
    return concrete.graph, list(concrete.graph.inputs), list(concrete.outputs)


def first_gpu_memory() -> int | None:
    """Total memory of the first visible GPU in bytes, or None without a GPU (or without
    TensorFlow's private ``device_lib``)."""
    if not tf.config.list_physical_devices("GPU"):
        return None
    try:
        from tensorflow.python.client import device_lib
    except ImportError:
        return None
    for device in device_lib.list_local_devices():
        if device.device_type == "GPU" and device.memory_limit:
            return int(device.memory_limit)
    return None


def model_distribute_strategy(model: Any) -> tf.distribute.Strategy | None:
    """The ``tf.distribute`` strategy in scope when ``model`` was built, if recorded."""
    strategy = getattr(model, "_distribute_strategy", None)
    if isinstance(strategy, tf.distribute.Strategy):
        return strategy
    return None


def graph_captures(graph: Any) -> list[tuple[Any, tf.Tensor]]:
    """``(external tensor, internal placeholder)`` for every tensor ``graph`` (a traced
    function graph) captured from outside it, in the order of its inputs."""
    captures = getattr(graph, "captures", None)
    if captures is not None:
        return [(external, internal) for external, internal in captures]
    return list(zip(graph.external_captures, graph.internal_captures))


def captured_placeholder(tensor: Any) -> tf.Tensor:
    """The placeholder through which the graph being traced reads the eager ``tensor``
    (captured now if it was not yet; the same placeholder for every read)."""
    read = tf.identity(tensor).op.inputs[0]
    if read.op.type == "Placeholder":
        return read
    return _capture_through_graph(tensor)


def _capture_through_graph(tensor: Any) -> tf.Tensor:
    return tf.compat.v1.get_default_graph().capture(tensor)


# Activations whose outputs Keras' cross-entropies replace by the logits behind them.
_LOGIT_ACTIVATIONS = ("Softmax", "Sigmoid")


def keras_logits(output: tf.Tensor) -> tf.Tensor | None:
    """The logits behind a softmax or sigmoid ``output`` of a traced graph, which Keras'
    cross-entropies read instead of the probabilities (None for another output)."""
    logits = getattr(output, "_keras_logits", None)
    if logits is not None:
        return tf.convert_to_tensor(logits)
    return _logits_of_activation(output)


def _logits_of_activation(output: tf.Tensor) -> tf.Tensor | None:
    op = getattr(output, "op", None)
    if op is not None and op.type in _LOGIT_ACTIVATIONS and len(op.inputs) == 1:
        return op.inputs[0]
    return None
