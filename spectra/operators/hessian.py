"""The loss Hessian of a TensorFlow/Keras model as a SciPy ``LinearOperator``.

The operator is the exact Hessian of the dataset loss ``L(θ) = Σ_b (n_b/N) L_b(θ)``
with respect to the flattened parameters θ, at the weights it was built with. Each
product is reverse-over-reverse automatic differentiation (Pearlmutter 1994):

    g = ∇L_b(θ)               (first backward, recorded by an outer tape)
    H_b v = ∇_θ (g · v)       (second backward)

of which the forward pass, the gradient and the vector-independent part of the second
backward are computed once per batch and cached (:mod:`spectra.operators.engine`), so a
product costs about two gradients (one backward of the tangent through the first
backward) instead of three.
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
        ``"auto"`` (default): keep each batch's vector-independent state if all of it fits
        in ``cache_bytes``, else stream the batches (recomputing the forward pass and the
        gradient once per batch per ``matmat``). ``True``/``False`` force either. The
        operator is the same matrix in every mode.
    cache_bytes:
        Memory budget for the cache (default: 2 GiB or a quarter of physical memory).
    max_block_size:
        At most this many vectors go through one compiled product (larger ``matmat``
        blocks are split; all splits share one data pass). Default: chosen from a memory
        budget of 512 MiB for the (k, n) arrays of a block, at most 64 — so a model with
        n = 10⁶ float32 parameters gets blocks of 32, one with 10⁸ blocks of 1.
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
    split, products recompute everything (about 3, exact all the same; warned once,
    :attr:`product_path` says which).

    Counters: ``num_hvps`` (vectors multiplied) and ``num_data_passes`` (passes over the
    batches or their caches; the first pass that fills the cache counts too).
    """

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
            allow_unused=allow_unused,
            strategy=strategy,
        )

    @classmethod
    def from_keras(
        cls,
        model: Any,
        loss: Any = None,
        data: Any = None,
        *,
        variables: Sequence[Any] | None = None,
        batch_size: int | None = None,
        training: bool = False,
        include_regularization: bool = True,
        dtype: Any = None,
        seed: int | None = None,
        cache: bool | str = "auto",
        cache_bytes: int | None = None,
        max_block_size: int | None = None,
        allow_unused: bool = False,
        strategy: tf.distribute.Strategy | None = None,
    ) -> HessianOperator:
        """The Hessian of a Keras model's dataset loss at its current weights.

        ``loss``: a Keras loss name (``"sparse_categorical_crossentropy"``), a
        ``keras.losses.Loss`` object, a callable ``(y_true, y_pred) -> scalar`` mean loss,
        or for a model with several outputs a list (one per output) or a dict by output
        name, as in ``compile``. ``None`` (default) is the loss the model was compiled
        with, its ``loss_weights`` included. ``data``: ``(x, y)`` or ``(x, y,
        sample_weight)`` arrays (``x`` may be a dict or list for multi-input models, ``y``
        a list or dict for multi-output models), a ``tf.data.Dataset`` of such batches,
        or a dataset function ``input_context -> tf.data.Dataset`` (each worker's shard).
        ``variables`` defaults to ``model.trainable_variables``; a subset gives the
        Hessian block of those variables (e.g. one layer's kernel); a Keras weight may be
        given as its ``tf.Variable`` (``kernel.value``), but each weight only once.

        **The dataset loss, per Keras reduction** (of each output's loss object; never
        dependent on ``batch_size`` or on how a dataset is batched). With per-example
        losses ℓ_i, sample weights w_i (1 without) and N examples:

        * ``"sum_over_batch_size"`` (Keras' default), ``"mean"``: the mean
          L = (1/N) Σ_i w_i ℓ_i (ℓ_i averaged over its entries); batch b contributes
          (n_b/N) L_b with L_b Keras' batch mean. Names, per-example loss functions and
          callables ``(y_true, y_pred) -> scalar`` are taken as this batch mean.
        * ``"sum"``: the sum over the whole dataset L = Σ_i w_i ℓ_i, so H = Σ_b H_b (each
          batch sum is scaled by N/n_b before the n_b/N weighting).
        * ``"none"`` or ``None`` (unreduced): the mean of the values the loss returns, as
          for ``"sum_over_batch_size"``.
        * ``"mean_with_sample_weight"``: the mean without sample weights; with sample
          weights it is refused (``ValueError``), since it divides each batch by that
          batch's own total weight.

        With several outputs L = Σ_o λ_o L_o with the ``loss_weights`` λ_o, each L_o by its
        own reduction.

        The model is called as Keras calls it, ``model(x, training=training)``; a
        ``call`` without a ``training`` argument is called without it. Sequential,
        functional and subclassed models work, with recurrent layers (LSTM, GRU,
        SimpleRNN, Bidirectional), ``tf.while_loop``/``keras.ops.scan``, ``tf.cond``,
        masking, attention, BatchNorm, custom layers and ``tf.custom_gradient`` (whose
        gradient functions must themselves be differentiable for exact second
        derivatives).

        ``training=False`` (default) runs layers in inference mode: BatchNorm uses its
        moving statistics, Dropout is off. With ``training=True`` BatchNorm uses batch
        statistics and Dropout draws its mask once per batch: from the model's seed
        generator states at construction plus ``[batch index, 0]``, or, with ``seed``,
        from ``[seed, 2²⁰·j]`` plus ``[batch index, 0]`` for the j-th seed generator. The
        masks are the same in every product and pass (cached or streaming), so the
        operator is a fixed symmetric matrix: the Hessian of the loss with those masks.
        Either way the model's state is never updated. ``include_regularization`` adds
        ``model.losses`` (weight and activity regularizers, ``add_loss`` terms) to each
        batch loss.

        ``strategy`` defaults to the ``tf.distribute`` strategy the model was built under
        (or the one in scope); see the class docstring.

        ``dtype=np.float64`` computes the products in float64 on a float64 clone of the
        model fed with the weights cast to float64 (the model itself is not changed); the
        default is the variables' dtype. A model under a mixed-precision policy
        (``mixed_float16``, ``mixed_bfloat16``) gets its products from a clone that
        computes in the variables' dtype (float32), so the Hessian is not rounded to half
        precision. Supported: float32, float64.

        The operator snapshots the model's values (trainable and non-trainable, seed
        states included) here; see the class docstring.
        """
        operator = cls._build_from_keras(
            Hessian(),
            model,
            loss,
            data,
            variables=variables,
            batch_size=batch_size,
            training=training,
            include_regularization=include_regularization,
            dtype=dtype,
            seed=seed,
            cache=cache,
            cache_bytes=cache_bytes,
            max_block_size=max_block_size,
            allow_unused=allow_unused,
            strategy=strategy,
        )
        assert isinstance(operator, HessianOperator)
        return operator
