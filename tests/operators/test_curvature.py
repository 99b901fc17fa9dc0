"""The hook for new curvature matrices: a Curvature subclass plus CurvatureOperator.

A matrix defined in this file (the Hessian of the data loss, through the split at the
model's output) must agree with the dense Hessian of that loss, get its own compiled
engine (the engine cache keys on the kind), and be refused for a plain loss_fn.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import dense_hessian, relative_error

from spectra.operators import (
    BatchProblem,
    Curvature,
    CurvatureOperator,
    CurvatureParts,
    HessianOperator,
)


class DataLossHessian(Curvature):
    """∇² of the data loss ℓ(f(θ)) alone (no regularization), via the output split."""

    name = "data-loss-hessian"
    title = "data-loss Hessian"
    needs_model_outputs = True

    def build(self, problem: BatchProblem) -> CurvatureParts:
        outputs, _ = problem.model_outputs()
        loss = problem.output_loss(outputs)
        grads = problem.gradients(loss)

        def product(vector: tf.Tensor) -> tf.Tensor:
            return problem.flatten(problem.vjp(grads, problem.unflatten(vector)))

        return CurvatureParts(loss, problem.flatten(grads), product)


class DataLossHessianOperator(CurvatureOperator):
    @classmethod
    def from_keras(cls, model, loss, data, **kwargs):
        return cls._build_from_keras(DataLossHessian(), model, loss, data, **kwargs)


def _model():
    return keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(
                5,
                activation="tanh",
                kernel_regularizer=keras.regularizers.L2(0.5),
                dtype="float64",
            ),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )


def test_a_new_curvature_is_one_class(rng):
    model = _model()
    x = rng.standard_normal((10, 4))
    y = rng.integers(0, 3, 10)
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
    op = DataLossHessianOperator.from_keras(model, sce, (x, y), batch_size=4)
    hessian = HessianOperator.from_keras(model, sce, (x, y), batch_size=4)
    assert op.curvature == "data-loss-hessian" and hessian.curvature == "hessian"
    assert op._engine is not hessian._engine
    H = dense_hessian(lambda: sce(y, model(x)), model.trainable_variables)
    V = rng.standard_normal((op.shape[0], 3))
    assert relative_error(op.matmat(V), H @ V) < 1e-11
    assert op.product_path == "split"
    # The regularizer is what tells the two matrices apart: 2·0.5 on the first kernel.
    diff = hessian.matmat(V) - op.matmat(V)
    np.testing.assert_allclose(diff[:20], V[:20], rtol=1e-10)
    np.testing.assert_allclose(diff[20:], 0.0, atol=1e-12)


def test_output_curvatures_need_a_keras_model():
    w = tf.Variable([1.0, 2.0])

    class FromFunction(CurvatureOperator):
        def __init__(self):
            self._init_from_function(DataLossHessian(), lambda: tf.reduce_sum(w**2), [w], None)

    with pytest.raises(TypeError, match="needs the model's outputs.*from_keras"):
        FromFunction()
