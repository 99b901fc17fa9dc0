"""The loss Hessian of a TensorFlow/Keras model as a SciPy ``LinearOperator``.

The operator is the exact Hessian of the dataset loss ``L(θ) = Σ_b (n_b/N) L_b(θ)``
with respect to the flattened parameters θ, at the weights it was built with. Each
product is reverse-over-reverse automatic differentiation (Pearlmutter 1994):

    g = ∇L_b(θ)               (first backward, recorded by an outer tape)
    H_b v = ∇_θ (g · v)       (second backward)

of which the forward pass, the gradient and the vector-independent part of the second
backward are computed once per batch and cached (:mod:`spectra.operators.engine`), so a
product costs about two gradients of arithmetic (one backward of the tangent through the
first backward). When the graph cannot be split, products recompute the rest too; the
engine's docstring states what that costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from spectra.operators.base import CurvatureOperator
from spectra.operators.curvature import BatchProblem, Curvature, CurvatureParts

__all__ = ["Hessian", "HessianOperator"]


class Hessian(Curvature):
    """The Hessian ∇²L_b: reverse-over-reverse differentiation of the batch loss."""

    name = "hessian"
    title = "Hessian"

    def build(self, problem: BatchProblem) -> CurvatureParts:
        loss = problem.loss()
        grads = problem.gradients(loss)

        def product(vector: tf.Tensor) -> tf.Tensor:
            return problem.flatten(problem.vjp(grads, problem.unflatten(vector)))

        return CurvatureParts(loss, problem.flatten(grads), product)


class HessianOperator(CurvatureOperator):
    """Hessian of a loss with respect to ``variables``, as a symmetric ``LinearOperator``.

    Built from a ``loss_fn`` of variables (below), or from a Keras model with
    ``HessianOperator.from_keras(model, loss, data)``
    (:meth:`~spectra.operators.base.CurvatureOperator.from_keras`).

    ``H v = Σ_b (n_b/N) ∇²L_b(θ) v`` computed by reverse-over-reverse autodiff, at the
    values the variables hold when the operator is built (a snapshot: see below).

    Parameters
    ----------
    loss_fn:
        ``loss_fn(batch) -> scalar``: the mean loss of one batch, where ``batch`` has the
        structure of ``data`` (e.g. ``(x, y)``) with tensors as leaves; ``loss_fn()`` with
        no argument when ``data`` is None. It is traced into a graph once, and must be
        deterministic (random draws would differ between the batch passes).
    variables:
        ``tf.Variable`` or ``keras.Variable`` objects, all of one floating dtype, each
        listed once. The operator has shape (n, n) with n their total number of entries.
    data:
        None, a nested structure of arrays/tensors sharing a leading example dimension,
        a finite ``tf.data.Dataset`` of such batches, or a dataset function
        ``lambda input_context: dataset`` giving each worker its shard (see
        :mod:`spectra.operators.batching`).
    batch_size:
        Batch size for array data (default: one batch of everything).
    cache:
        ``"auto"`` (default): keep the vector-independent state of the batches that fit
        in ``cache_bytes`` (those with the most examples per byte) and stream the others
        (recomputing their forward pass and gradient once per ``matmat``); ``True`` keeps
        every batch, ``False`` none. The operator is the same matrix in every mode.
    cache_bytes:
        Budget of the kept caches; overrides the share of ``memory_budget`` (default:
        set on the first pass from its first batch, the budget less the snapshot and a
        reserve for one streamed batch and its product,
        :func:`spectra.operators.memory.cache_share`).
    max_block_size:
        At most this many vectors go through one compiled product (larger ``matmat``
        blocks are split into sub-blocks; all share one data pass); overrides the size
        from ``memory_budget``. Default: the largest power of two k ≤ 64 whose k
        per-vector tangents fit what the budget leaves after the snapshot and the caches
        (see :meth:`~spectra.operators.CurvatureOperator.memory_plan`).
    memory_budget:
        Bytes the operator may use beyond the model: snapshot, kept caches, one streamed
        batch and one sub-block of a product. Default: half of the memory available to
        the process (``MemAvailable``), or of the GPU's memory when there is one.
    allow_unused:
        Keep variables that do not affect the loss as zero rows (warned) instead of
        raising a ``ValueError``.
    strategy:
        A ``tf.distribute`` strategy (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``):
        each replica computes the products of its share of the batches on its device,
        and the sums are all-reduced, so every process gets the exact dataset Hessian
        product. With several workers, every worker runs the same code (SPMD): same
        estimator, same seed; each reads only its shard of a dataset (by file, or from a
        dataset function).

    Notes
    -----
    **Snapshot.** The operator is the Hessian at the weights it was built with. The
    constructor copies every ``tf.Variable`` the traced ``loss_fn`` reads (the
    ``variables`` and any other, e.g. BatchNorm statistics) and feeds the copies to the
    compiled functions; :meth:`from_keras` snapshots the model's values. Later training,
    ``load_weights``, ``assign`` or another operator built on the same model change
    neither its products nor ``loss()``/``gradient()``, cached or streaming, float32 or
    float64. Build a new operator to follow training (cheap: operators on the same model,
    loss and data shapes share their compiled functions). Weights with NaN/Inf are
    refused, naming the variable.

    **Products.** Per batch, the forward pass, the gradient and the vector-independent
    part of the second backward are computed once (cached, or once per ``matmat`` when
    streaming), so a product costs about 2 gradients; if the traced graph cannot be
    split, products recompute everything, exact all the same and slower (the cost is
    stated in :mod:`spectra.operators.engine`; warned once, :attr:`product_path` says
    which).

    Counters: ``num_hvps`` (vectors multiplied) and ``num_data_passes`` (passes over the
    batches or their caches; the first pass that fills the cache counts too).
    """

    curvature_class = Hessian

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        variables: Sequence[Any],
        data: Any = None,
        *,
        batch_size: int | None = None,
        cache: bool | str = "auto",
        cache_bytes: int | None = None,
        max_block_size: int | None = None,
        memory_budget: int | None = None,
        allow_unused: bool = False,
        strategy: tf.distribute.Strategy | None = None,
    ) -> None:
        self._init_from_function(
            Hessian(),
            loss_fn,
            variables,
            data,
            batch_size=batch_size,
            cache=cache,
            cache_bytes=cache_bytes,
            max_block_size=max_block_size,
            memory_budget=memory_budget,
            allow_unused=allow_unused,
            strategy=strategy,
        )
