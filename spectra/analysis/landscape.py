"""The loss along directions in parameter space: 1-D curves and 2-D grids.

:func:`loss_landscape` evaluates the dataset loss ``L(θ + α d₁)`` (one curve per direction)
or ``L(θ + α d₁ + β d₂)`` (a grid) with the same definition as :class:`HessianOperator`:
``L = Σ_b (n_b/N) L_b`` (the mean over the dataset, or the sum for a loss with
``reduction="sum"``) and the model's regularization losses. The model is never changed:
each point is one call of a compiled function (traced once, fixed input signature) that
adds the flat perturbation to the variables' values and runs ``model.stateless_call`` on
them.

Units of α: the point is ``θ + α d`` with ``d`` as given. For a unit vector, such as an
eigenvector from ``eigenvalues(op, return_eigenvectors=True)``, α is the Euclidean distance
moved in the flat parameter space, and near α = 0 the curve along an eigenvector v with
eigenvalue λ is ``L(θ) + α ∇L·v + λ α²/2 + O(α³)``. For a filter-normalized direction
(:func:`random_direction`, Li et al. 2018) α is relative to the weights' own scale: α = 1
moves every filter by its own norm.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from spectra._backend import keras_backend
from spectra.analysis.landscape_result import LandscapeResult
from spectra.operators import keras_calls

__all__ = ["LandscapeResult", "loss_landscape", "random_direction"]

_NORMALIZATIONS = ("filter", "unit")


def random_direction(
    like: Any, seed: int | None = 0, *, normalization: str = "filter"
) -> np.ndarray:
    """A random direction in the flat parameter space of ``like``.

    ``like`` is a :class:`~spectra.operators.HessianOperator` (its variables give the shapes
    and the weights) or, for ``normalization="unit"`` only, a flat vector whose length is
    used. The direction is a standard Gaussian draw from ``numpy.random.default_rng(seed)``,
    returned in float64, normalized as

    * ``"filter"`` (default): filter-wise normalization of Li et al., "Visualizing the Loss
      Landscape of Neural Nets" (NeurIPS 2018): for every filter (the slices along the last
      axis of a kernel: an output unit of a Dense layer, an output channel of a convolution)
      ``d_f ← d_f · ‖θ_f‖ / ‖d_f‖``; variables with one axis (biases, normalization
      parameters) get zero, as in their default. The norm is that of the non-bias weights.
    * ``"unit"``: divided by its Euclidean norm, so α is a distance in parameter space.
    """
    if normalization not in _NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {_NORMALIZATIONS}; got {normalization!r}.")
    rng = np.random.default_rng(seed)
    if normalization == "unit":
        size = like.shape[0] if hasattr(like, "matvec") else np.asarray(like).size
        direction = rng.standard_normal(int(size))
        return direction / np.linalg.norm(direction)
    if not (hasattr(like, "variables") and hasattr(like, "flatten")):
        raise TypeError(
            "filter-wise normalization needs the weights: pass the HessianOperator, or use "
            "normalization='unit' for a flat vector."
        )
    pieces = []
    for variable in like.variables:
        weights = np.asarray(variable.numpy(), dtype=np.float64)
        if weights.ndim <= 1:
            pieces.append(np.zeros_like(weights))
            continue
        draw = rng.standard_normal(weights.shape)
        axes = tuple(range(weights.ndim - 1))
        draw_norms = np.sqrt(np.sum(draw * draw, axis=axes, keepdims=True))
        weight_norms = np.sqrt(np.sum(weights * weights, axis=axes, keepdims=True))
        pieces.append(draw * weight_norms / draw_norms)
    return like.flatten(pieces).astype(np.float64)


def loss_landscape(
    model: Any,
    loss: Any,
    data: Any,
    directions: Mapping[str, Any],
    alphas: Sequence[float] | np.ndarray,
    *,
    betas: Sequence[float] | np.ndarray | None = None,
    batch_size: int | None = None,
    variables: Sequence[Any] | None = None,
    training: bool = False,
    include_regularization: bool = True,
    dtype: Any = None,
) -> LandscapeResult:
    """The dataset loss along ``directions`` from the model's current parameters θ.

    Parameters
    ----------
    model, loss, data, batch_size, variables, training, include_regularization, dtype:
        As in :meth:`HessianOperator.from_keras`; the flat parameter vector is the
        concatenation of ``variables`` (default ``model.trainable_variables``), each
        flattened row-major, and ``dtype=np.float64`` evaluates on a float64 clone.
    directions:
        ``{label: flat vector}`` of the operator's length n. Without ``betas`` each gives a
        curve ``L(θ + α d)``; with ``betas`` exactly two are needed, for the grid
        ``L(θ + α d₁ + β d₂)`` (first direction along α).
    alphas, betas:
        The step sizes, in units of the directions (see the module docstring).

    Notes
    -----
    Cost: one pass over the data per point (len(alphas) per curve, or
    len(alphas)·len(betas) for the grid) plus one for ``base_loss``. The model's variables
    are read, never assigned.
    """
    started = time.perf_counter()
    keras_calls.check_model(model)
    alphas = _as_steps("alphas", alphas)
    betas = None if betas is None else _as_steps("betas", betas)
    if not directions:
        raise ValueError("directions is empty: give at least one {label: vector}.")
    if betas is not None and len(directions) != 2:
        raise ValueError(
            f"a 2-D landscape (betas given) needs exactly two directions; got {len(directions)}."
        )
    compile_loss = _jax_loss if keras_backend() == "jax" else _compile_loss
    evaluate, size, target = compile_loss(
        model, loss, data, batch_size, variables, training, include_regularization, dtype
    )
    vectors = {str(label): _as_direction(label, d, size) for label, d in directions.items()}
    labels = list(vectors)

    base_loss = evaluate(np.zeros(size))
    count = 1
    losses: dict[str, np.ndarray] = {}
    losses_2d = None
    if betas is None:
        for label in labels:
            losses[label] = np.array([evaluate(a * vectors[label]) for a in alphas])
            count += alphas.size
    else:
        first, second = (vectors[label] for label in labels)
        losses_2d = np.array([[evaluate(a * first + b * second) for b in betas] for a in alphas])
        count += alphas.size * betas.size
    return LandscapeResult(
        alphas=alphas,
        betas=betas,
        labels=labels,
        losses=losses,
        losses_2d=losses_2d,
        base_loss=base_loss,
        direction_norms={label: float(np.linalg.norm(v)) for label, v in vectors.items()},
        num_examples=evaluate.num_examples,
        num_evaluations=count,
        wall_time=time.perf_counter() - started,
        settings={
            "dimension": size,
            "dtype": np.dtype(target).name,
            "training": bool(training),
            "include_regularization": bool(include_regularization),
            "batch_size": batch_size,
        },
    )


def _as_steps(name: str, values: Any) -> np.ndarray:
    steps = np.asarray(values, dtype=np.float64).reshape(-1)
    if steps.size == 0 or not np.all(np.isfinite(steps)):
        raise ValueError(f"{name} must be a non-empty sequence of finite numbers.")
    return steps


def _as_direction(label: Any, vector: Any, size: int) -> np.ndarray:
    direction = np.asarray(vector, dtype=np.float64)
    if direction.shape != (size,):
        raise ValueError(
            f"direction {label!r} has shape {direction.shape}; the flat parameter vector has "
            f"shape ({size},)."
        )
    if not np.all(np.isfinite(direction)):
        raise ValueError(f"direction {label!r} contains NaN or Inf.")
    return direction


class _ShiftedModel:
    """The model as :func:`spectra.operators.keras_models.keras_loss_fn` sees it, at shifted
    parameters.

    ``keras_loss_fn`` evaluates ``model.stateless_call(model.trainable_variables,
    model.non_trainable_variables, x, ...)``. This stand-in exposes tensors θ + δ under those
    two names (set by :meth:`shift` while the compiled loss is traced) and delegates every
    other attribute to the model, so the landscape uses the operator's loss definition
    exactly, and nothing is ever assigned to the model's variables.
    """

    def __init__(self, model: Any, shifted: list[Any]) -> None:
        self._model = model
        self._shifted = shifted
        self.trainable_variables = list(model.trainable_variables)
        self.non_trainable_variables = list(model.non_trainable_variables)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def shift(self, deltas: list[Any]) -> None:
        """Use ``variable + delta`` for the k-th shifted variable, the value for the others."""
        import tensorflow as tf

        def values(group: list[Any]) -> list[Any]:
            out = []
            for variable in group:
                value = tf.convert_to_tensor(variable.value)
                k = next((k for k, s in enumerate(self._shifted) if s is variable), None)
                out.append(value if k is None else value + tf.cast(deltas[k], value.dtype))
            return out

        self.trainable_variables = values(self._model.trainable_variables)
        self.non_trainable_variables = values(self._model.non_trainable_variables)


class _LossAtPerturbation:
    """``evaluate(delta) -> L(θ + delta)`` over all batches, via one compiled function."""

    def __init__(self, function: Any, batches: Any, dtype: Any) -> None:
        self._function = function
        self._batches = list(batches)
        self._dtype = dtype
        self.num_examples = batches.num_examples

    def __call__(self, delta: np.ndarray) -> float:
        import tensorflow as tf

        from spectra.operators.data_checks import graph_errors

        perturbation = tf.constant(delta, self._dtype)
        total = 0.0
        for index, (batch, weight) in enumerate(self._batches):
            # A graph error (a failing assertion in the model, a bad index) is raised
            # with the batch and its root cause on the first line.
            with graph_errors(f"batch {index}"):
                value = self._function(perturbation, batch)
            total += weight * float(value)
        return total


def _compile_loss(
    model: Any,
    loss: Any,
    data: Any,
    batch_size: int | None,
    variables: Sequence[Any] | None,
    training: bool,
    include_regularization: bool,
    dtype: Any,
) -> tuple[_LossAtPerturbation, int, np.dtype]:
    """The loss as a function of a flat perturbation, its length n, and the dtype used, on
    TensorFlow. The model, dtype and loss are resolved as in
    :meth:`HessianOperator.from_keras`.
    """
    import tensorflow as tf

    from spectra.operators import keras_models
    from spectra.operators.batching import Batches

    _, positions, target = keras_models.resolve_variables_and_dtype(model, variables, dtype)
    run_model = keras_models.model_in_dtype(model, target)
    shifted_variables = [run_model.weights[i] for i in positions]
    shapes = [tuple(v.shape) for v in shifted_variables]
    sizes = [int(np.prod(shape)) for shape in shapes]
    shifted_model = _ShiftedModel(run_model, shifted_variables)
    loss_fn = keras_models.keras_loss_fn(
        shifted_model,
        loss,
        dtype=target,
        training=training,
        include_regularization=include_regularization,
    )
    batches = Batches(data, batch_size, cast_floats_to=target)
    num_examples = batches.num_examples  # N, for losses with reduction="sum"

    @tf.function(
        input_signature=[tf.TensorSpec([sum(sizes)], target), batches.element_spec],
        reduce_retracing=False,
    )
    def batch_loss(perturbation: tf.Tensor, batch: Any) -> tf.Tensor:
        pieces = tf.split(perturbation, sizes)
        shifted_model.shift([tf.reshape(p, shape) for p, shape in zip(pieces, shapes)])
        return loss_fn(batch, num_examples)

    evaluate = _LossAtPerturbation(batch_loss, batches, target)
    return evaluate, sum(sizes), np.dtype(target.as_numpy_dtype)


class _OperatorLoss:
    """``evaluate(delta) -> L(θ + delta)`` through an operator's ``loss_at`` (the JAX
    engine's), with ``num_examples`` as :class:`_LossAtPerturbation` has it."""

    def __init__(self, operator: Any) -> None:
        self._operator = operator
        self.num_examples = operator.num_examples

    def __call__(self, delta: np.ndarray) -> float:
        return self._operator.loss_at(delta)


def _jax_loss(
    model: Any,
    loss: Any,
    data: Any,
    batch_size: int | None,
    variables: Sequence[Any] | None,
    training: bool,
    include_regularization: bool,
    dtype: Any,
) -> tuple[_OperatorLoss, int, np.dtype]:
    """As :func:`_compile_loss`, on Keras' JAX backend: the loss of a JAX
    :class:`~spectra.operators.jax.HessianOperator` built with the same keywords (no
    compilation or data pass until the first point; ``seed=None``, so that Dropout in
    training mode draws from the model's own seed generator states, as on TensorFlow)."""
    from spectra.operators.jax import HessianOperator

    operator = HessianOperator.from_keras(
        model,
        loss,
        data,
        variables=variables,
        batch_size=batch_size,
        training=training,
        include_regularization=include_regularization,
        dtype=dtype,
        seed=None,
        cache=False,
    )
    return _OperatorLoss(operator), operator.shape[0], np.dtype(operator.dtype)
