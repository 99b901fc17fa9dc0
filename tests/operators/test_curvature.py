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
    curvature_class = DataLossHessian


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


# ----------------------------------------------------------------- one from_keras, one registry


def test_the_registry_is_what_spectra_and_the_cli_offer():
    import spectra
    import spectra.operators
    from spectra.cli import _curvature
    from spectra.operators import registry

    assert list(registry.CURVATURES) == ["hessian", "ggn", "fisher-mc", "fisher-empirical"]
    assert _curvature.CURVATURES is registry.CURVATURES
    assert registry.operator_class_names() == ["HessianOperator", "GGNOperator", "FisherOperator"]
    for entry in registry.CURVATURES.values():
        cls = spectra.operators.curvature_operator(entry.name)
        assert issubclass(cls, CurvatureOperator)
        assert getattr(spectra, entry.class_name) is cls
        assert getattr(spectra.operators, entry.class_name) is cls
        assert cls.__module__ == entry.operator.partition(":")[0]
        # The registry's options are keywords the class's curvature declares.
        assert set(entry.options) <= set(cls._curvature_keywords())
    functions = {"curvature_operator", "build_curvature_operator"}
    assert sorted(spectra.operators.__all__) == sorted({*spectra.operators._SOURCE, *functions})
    assert registry.curvature_entry(None).name == "hessian"
    with pytest.raises(ValueError, match=r"curvature must be one of \['fisher-empirical'.*'kfac'"):
        registry.curvature_entry("kfac")


def test_registry_reading_imports_no_tensorflow():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from spectra.operators.registry import CURVATURES, operator_class_names\n"
        "import spectra\n"
        "assert 'HessianOperator' in spectra.__all__ and len(CURVATURES) == 4\n"
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def dropout_problem():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(5, activation="tanh", dtype="float64"),
            keras.layers.Dropout(0.5, dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    rng = np.random.default_rng(2)
    data = (rng.standard_normal((12, 4)), rng.integers(0, 3, 12))
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
    return model, sce, data


@pytest.mark.parametrize(
    ("name", "keyword"),
    [("HessianOperator", "kind"), ("GGNOperator", "num_samples"), ("FisherOperator", "kinds")],
)
def test_an_unknown_keyword_is_a_type_error_naming_it(dropout_problem, name, keyword):
    import spectra

    model, sce, data = dropout_problem
    cls = getattr(spectra, name)
    own = {"FisherOperator": "its own are kind, num_samples"}.get(name, "it has none of its own")
    with pytest.raises(
        TypeError,
        match=rf"^{name}\.from_keras\(\) got an unexpected keyword argument '{keyword}'; "
        rf"see CurvatureOperator.from_keras .*\({own}\)\.$",
    ):
        cls.from_keras(model, sce, data, **{keyword: 1})
    # Positional arguments stop at data, as before.
    with pytest.raises(TypeError, match="positional argument"):
        cls.from_keras(model, sce, data, 4)


def test_seed_defaults_per_class(dropout_problem):
    """The Fisher's seed defaults to 0 (its labels and, in training mode, its Dropout
    masks), the others' to None (the model's own seed states)."""
    from spectra.operators import FisherOperator, GGNOperator

    model, sce, data = dropout_problem
    v = np.random.default_rng(3).standard_normal(
        HessianOperator.from_keras(model, sce, data).shape[0]
    )

    def product(cls, **kwargs):
        return cls.from_keras(model, sce, data, training=True, batch_size=4, **kwargs).matvec(v)

    assert HessianOperator.default_seed is None and GGNOperator.default_seed is None
    assert FisherOperator.default_seed == 0
    for cls in (HessianOperator, GGNOperator, FisherOperator):
        seeded = product(cls, seed=cls.default_seed)
        np.testing.assert_array_equal(product(cls), seeded)
    # The default matters: seed 0 and the model's seed states draw other masks.
    assert np.max(np.abs(product(HessianOperator, seed=0) - product(HessianOperator))) > 1e-6
    assert np.max(np.abs(product(FisherOperator, seed=None) - product(FisherOperator))) > 1e-6
