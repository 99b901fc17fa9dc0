"""K-FAC's data pass: one compiled TensorFlow function per pass kind and batch shape.

Per batch: the forward pass with the factored layers captured
(:class:`~spectra.operators.kfac_layers.LayerCapture`), the output Hessian's square roots
(type-2), sampled labels (mc) or the true labels (empirical), one backward pass to the
pre-activations per column (a ``tf.while_loop``), and every layer's contributions to A
and G (or EKFAC's scalings), summed in float64 inside TensorFlow and read once per pass.
Traced once per model, settings and batch shape, and kept (:func:`compiled_pass`, up to
eight; ``spectra.operators.engine.clear_engine_cache`` clears them).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from spectra import _tf_compat
from spectra.operators import keras_models
from spectra.operators.engine import register_compiled_cache
from spectra.operators.fisher import last_axis_size
from spectra.operators.kfac_layers import LayerCapture, factor_sizes, kernel_of, pooling_layers

__all__ = [
    "ROUNDING_UNITS",
    "Accumulators",
    "CompiledPass",
    "PassSettings",
    "SplitAtLogits",
    "check_convex",
    "closed_form",
    "compiled_pass",
    "convex_losses",
]

#: A factor's eigenvalue is zero to working precision when, on the factor scaled to a unit
#: diagonal (D⁻¹ F D⁻¹, D = diag(F)^½), it is at most this many units of rounding of the
#: dtype the factor was computed in. The scaled factor's entries carry errors of a few
#: units of rounding whatever the scale or grading of the data; measured on the digits
#: MLP: the softmax null direction of G at 0.9-10 units (float32 and float64), the smallest
#: genuine eigenvalues at 50 units and more (float32).
ROUNDING_UNITS = 32


class Accumulators:
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
            d_in, d_out = factor_sizes(layer, flag)
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


class SplitAtLogits(Exception):
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
    """Type-2 columns at a split point (n, T_1, ..., C) with positions (or (n, C) for a loss
    with a closed form, one position): column c holds, at every output position t, column
    c of a square root R_t of that position's block of the example's output Hessian
    (R_t R_tᵀ = H_t; ``KFACOperator``):

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
    (:meth:`CompiledPass.check`): a loss whose Hessian couples output positions, or that
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


def closed_form(found: Any, reads_logits: bool) -> str | None:
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


def convex_losses() -> frozenset[Any]:
    """Keras loss functions convex in the logits (cross-entropies) or outputs (MSE)."""
    return frozenset(
        [
            keras.losses.categorical_crossentropy,
            keras.losses.sparse_categorical_crossentropy,
            keras.losses.binary_crossentropy,
            keras.losses.mean_squared_error,
        ]
    )


def check_convex(acc: Accumulators, dtype: tf.DType) -> None:
    """Refuse (one line) a loss whose output Hessians had an eigenvalue more negative than
    the rounding of the dtype, relative to their largest magnitude over the whole dataset
    (so the verdict does not depend on the batching)."""
    eps = float(np.finfo(dtype.as_numpy_dtype).eps)
    if acc.most_negative > ROUNDING_UNITS * eps * acc.hessian_scale:
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
class PassSettings:
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


class CompiledPass:
    """K-FAC's per-batch computation as ``tf.function``s, traced once per pass kind
    (``"factors"``: the A and G sums, with the other variables' diagonal when asked;
    ``"scalings"``: EKFAC's second-pass S sums), split point (the logits or the output)
    and batch shape, and reused for every batch of that shape.

    One call runs a batch's forward pass with the layers captured (:class:`LayerCapture`, active
    while tracing only), the output-side columns (type-2 roots, sampled or true-label
    gradients), the backward passes to the captured pre-activations in a ``tf.while_loop``
    over the columns, and adds the batch's contributions to the running float64 sums it is
    given (the state), returning them with the per-batch scalars the host checks. The sums
    stay TensorFlow tensors during a pass and reach the host once, at its end.

    Holds no weights' values (the graph reads the model's variables when called): a pass
    built for a model is shared by the operators built on it with the same settings
    (:func:`compiled_pass`).
    """

    def __init__(
        self,
        run_model: Any,
        dense_layers: Sequence[Any],
        layout: Sequence[tuple[Any, int | None, int | None]],
        transposed: Sequence[bool],
        others: Sequence[Any],
        settings: PassSettings,
    ) -> None:
        self.run_model = run_model
        self.dense_layers = list(dense_layers)
        self.layout = list(layout)
        self.transposed = list(transposed)
        self.others = [_tf_variable(v) for v in others]
        #: Every variable of the operator, checked finite in each step (``weights_finite``).
        self.weights = [
            weight
            for layer, kernel, bias in self.layout
            for weight, index in ((kernel_of(layer), kernel), (getattr(layer, "bias", None), bias))
            if index is not None
        ] + self.others
        self.settings = settings
        #: How many times each pass kind was traced (a new batch shape or split point).
        self.traces = {"factors": 0, "scalings": 0}
        #: Set while tracing a batch with outputs with positions under type-2: the loss's
        #: effective closed form (None: autodiff blocks) and the split point's shape without
        #: its batch axis, for the host's one-line refusal (:meth:`check`).
        self.sequence: tuple[str | None, tuple[int, ...]] | None = None
        self._functions: dict[tuple[bool, bool, bool], Any] = {}
        self._sizes = [
            factor_sizes(layer, flag) for (layer, _, _), flag in zip(self.layout, self.transposed)
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
        if error > ROUNDING_UNITS * (classes + 1) * eps * bound:
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
        # The pools' argmax backward, except under the other variables' per-example
        # Jacobians (vectorized: their custom gradient is not).
        pools = [] if want_diagonal else pooling_layers(self.run_model)
        capture = LayerCapture(self.dense_layers, [outer, inner], s.tied_embeddings, pools)
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
                raise SplitAtLogits
            raise ValueError(
                "K-FAC: the loss has no gradient in the model's output (it does not read "
                "y_pred, or reads it through a tensor spectra cannot see): pass a loss that "
                "is a differentiable function of (y_true, y_pred)."
            )
        report["loss"] = true_value
        # The weights' check, in the step rather than one eager check per weight before it
        # (measured 1.4 ms of a 17 ms build on the digits CNN); the host names the first
        # non-finite weight when this is False.
        report["weights_finite"] = tf.reduce_all(
            tf.stack(
                [
                    tf.reduce_all(tf.math.is_finite(weight))
                    for weight in map(tf.convert_to_tensor, self.weights)
                    if weight.dtype.is_floating
                ]
                or [tf.constant(True)]
            )
        )
        # T output positions: Keras' losses average the per-position terms, so example i's
        # loss is (1/T) Σ_t ℓ_it (w = 1/T per position; N for reduction="sum", whose batch
        # loss is N Σ_it ℓ_it here), and its label distribution is a product over
        # positions: κ/T scales the sampled gradients of kind="mc".
        output_positions = int(np.prod([int(d) for d in point.shape[1:-1]]))
        # EKFAC's scalings of a layer shared over positions, for outputs with positions and
        # conv="expand": from each position's ā_t g_tᵀ (Eschenhagen et al.'s expand setting).
        per_position = point.shape.rank > 2 and conv == "expand"
        kappa = (
            s.distribution.scale(last_axis_size(output)) / output_positions if kind == "mc" else 1.0
        )
        closed = s.closed if kind == "type-2" else None
        if closed == "softmax" and point is output and reads_logits:
            closed = None  # probabilities without the logits behind them
        if output_positions == 1 and point.shape.rank == 2 and closed is None:
            count, column = _columns(
                outer, inner_gradient, point, sampled, true_value, kind, kappa, report
            )
        elif kind == "type-2":
            # Outputs with positions, or a Keras loss whose output Hessian's square root
            # has a closed form (no per-example Jacobian and eigendecomposition: measured
            # 30 ms of the 1,797 digits' 145 ms type-2 CNN pass).
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
        # (n, T, d_in): T = 1 for a layer applied once per example, its positions otherwise.
        inputs = [
            tf.reshape(tf.cast(record[0], dtype), [n, -1, d_in])  # type: ignore[index]
            for record, (d_in, _) in zip(records, self._sizes)
        ]
        zs = [record[1] for record in records]  # type: ignore[index]
        d_outs = [d for _, d in self._sizes]
        new: dict[str, list[tf.Tensor]] = {}
        if bases is None:
            A = list(state["A"])
            for index, ((_, kernel, bias), a) in enumerate(zip(self.layout, inputs)):
                positions = int(a.shape[1])
                # A in float64 products: it is computed once per batch (not per column),
                # and its entries then do not depend on the batching beyond float64
                # rounding.
                a = tf.cast(a, f64)
                if positions == 1 or conv == "expand":
                    rows, share = tf.reshape(a, [-1, a.shape[-1]]), 1.0 / positions
                else:
                    rows, share = tf.reduce_mean(a, axis=1), 1.0
                gram = _augmented_gram(rows, kernel is not None, bias is not None)
                A[index] += _symmetric(gram) * share
            new["A"] = A
            carried = [tf.zeros_like(G) for G in state["G"]]
        else:
            abars = [
                _augmented(a, kernel is not None, bias is not None)
                for (_, kernel, bias), a in zip(self.layout, inputs)
            ]
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
                for index in range(len(inputs))
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
                # g is ∂/∂z of the layer output z: z's static shape, which a gradient through
                # a Dropout layer's cond (keras-hub's GPT-2, dropout > 0) does not carry.
                g = tf.ensure_shape(g, zs[index].shape)
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
            # The batch's Σ_c g gᵀ made exactly symmetric once (the GEMMs sum entries (i, j)
            # and (j, i) in different orders), then added to the running sums.
            new["G"] = [G + _symmetric(batch) for G, batch in zip(state["G"], carried)]
            if "diagonal" in state:  # empty when every variable is factored
                new["diagonal"] = list(diagonal)
        else:
            new["S"] = [
                state["S"][index]
                + tf.cast(tf.matmul(projected_inputs[index], carried[index], transpose_a=True), f64)
                if index in projected_inputs
                else carried[index]
                for index in range(len(inputs))
            ]
        return new, report


class _Step:
    """A compiled step's Python body (:meth:`CompiledPass.traced` for one pass kind and
    split point). A callable object rather than a closure: TensorFlow counts retracing
    per function code, which every closure of one ``def`` shares, so the builds on
    different models would add up to its "excessive retracing" warning."""

    def __init__(
        self, owner: CompiledPass, what: str, *, reads_logits: bool, want_diagonal: bool
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
#: Grams of width at least twice this are computed by blocks of about this many columns.
_GRAM_BLOCK = 128


def _gram(rows: tf.Tensor) -> tf.Tensor:
    """rowsᵀ rows (rows: (m, d) in the model's dtype) as float64: in float64 products for
    float64 rows or d ≤ ``_FLOAT64_GRAM_WIDTH``, else in the rows' dtype. Symmetric up to
    the rounding of the diagonal blocks (:func:`_blocked_gram`; :func:`_symmetric` makes it
    exactly so)."""
    if rows.dtype == tf.float64 or int(rows.shape[-1]) <= _FLOAT64_GRAM_WIDTH:
        return _blocked_gram(tf.cast(rows, tf.float64))
    return tf.cast(_blocked_gram(rows), tf.float64)


def _blocked_gram(rows: tf.Tensor) -> tf.Tensor:
    """rowsᵀ rows for rows (m, d), in their dtype. For d ≥ 2·``_GRAM_BLOCK``, from the
    column blocks R_1..R_k of about ``_GRAM_BLOCK`` columns: the k(k+1)/2 products
    R_iᵀ R_j with i ≤ j, the blocks below the diagonal their transposes. That is
    m·d²·(1 + 1/k) flops against a GEMM's 2·m·d² (the symmetric rank-k update TensorFlow
    does not offer); measured on one CPU thread, (2048 × 512) float32 rows in 24 ms
    against 46 ms, (2048 × 785) float64 in 105 ms against 150 ms. Each entry is the same
    dot product over the m rows as in one GEMM, summed in the order of a smaller one."""
    d = int(rows.shape[-1])
    k = d // _GRAM_BLOCK
    if k < 2:
        return tf.matmul(rows, rows, transpose_a=True)
    edges = [d * i // k for i in range(k + 1)]
    columns = [rows[:, start:stop] for start, stop in itertools.pairwise(edges)]
    upper = {
        (i, j): tf.matmul(columns[i], columns[j], transpose_a=True)
        for i in range(k)
        for j in range(i, k)
    }
    return tf.concat(
        [
            tf.concat(
                [upper[i, j] if i <= j else tf.transpose(upper[j, i]) for j in range(k)], axis=1
            )
            for i in range(k)
        ],
        axis=0,
    )


def _symmetric(matrix: tf.Tensor) -> tf.Tensor:
    """(M + Mᵀ)/2: a sum of Grams made exactly symmetric."""
    return 0.5 * (matrix + tf.transpose(matrix))


def _augmented_gram(rows: tf.Tensor, kernel: bool, bias: bool) -> tf.Tensor:
    """Σ ā āᵀ over the m float64 rows a of ``rows`` (m, d_in), ā = [a; 1] (a alone when
    the bias is not a variable, the 1 alone when the kernel is not): the blocks
    [[Σ a aᵀ, Σ a], [Σ aᵀ, m]], without forming the (m, d_in + 1) rows [a, 1]."""
    count = tf.reshape(tf.cast(tf.shape(rows)[0], tf.float64), [1, 1])
    if not kernel:
        return count
    gram = _gram(rows)
    if not bias:
        return gram
    sums = tf.reduce_sum(rows, axis=0)
    return tf.concat(
        [
            tf.concat([gram, sums[:, None]], axis=1),
            tf.concat([sums[None, :], count], axis=1),
        ],
        axis=0,
    )


#: Compiled passes kept for models built on again with the same settings (a training
#: callback builds an operator every few steps): at most this many, least recent dropped.
_PASS_CACHE_SIZE = 8
_pass_cache: collections.OrderedDict[Hashable, tuple[tuple[Any, ...], CompiledPass]] = (
    collections.OrderedDict()
)
_pass_cache_lock = threading.Lock()


def _clear_pass_cache() -> None:
    with _pass_cache_lock:
        _pass_cache.clear()


register_compiled_cache(_clear_pass_cache)


def compiled_pass(
    key: Hashable | None, owners: tuple[Any, ...], factory: Callable[[], CompiledPass]
) -> CompiledPass:
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
