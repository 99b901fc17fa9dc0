"""The JAX operator's contract: the matrix of the dataset, whatever the batching, caching
or data source; a snapshot; one compilation per batch shape; estimators on it; clear
errors. Most tests share the tanh classifier and its compiled functions (float64, batches
of 7 of 20, so the last one is short)."""

from __future__ import annotations

import sys
import warnings

import jax
import keras
import numpy as np
import pytest
from _jax_models import SCCE, classification_data, matrix, mlp, relative_error

import spectra
from spectra.operators.jax import FisherOperator, GGNOperator, HessianOperator, JacobianOperator

F64 = np.float64


@pytest.fixture(scope="module")
def hessian(tanh_mlp):
    """The Hessian of the shared classifier (batches of 7) and its dense matrix."""
    model, x, y, _, _ = tanh_mlp
    op = HessianOperator.from_keras(model, SCCE, (x, y), batch_size=7, dtype=F64)
    return op, matrix(op)


def test_the_public_names_are_the_jax_engine_s_and_tensorflow_stays_out(hessian):
    assert spectra.HessianOperator is HessianOperator
    assert spectra.GGNOperator is GGNOperator
    assert spectra.JacobianOperator is JacobianOperator
    assert "tensorflow" not in sys.modules
    assert not jax.config.jax_enable_x64  # float64 operators leave the process's setting


def test_the_matrix_does_not_depend_on_the_batching(tanh_mlp, hessian):
    model, x, y, _, _ = tanh_mlp
    op, dense = hessian
    whole = HessianOperator.from_keras(model, SCCE, (x, y), dtype=F64)
    assert relative_error(matrix(whole), dense) < 1e-12
    assert whole.loss() == pytest.approx(op.loss(), rel=1e-13)
    block = np.random.default_rng(0).normal(size=(op.shape[0], 3))
    looped = whole @ block
    whole._engine.block_mode = "vmap"  # the other block mode: the same products
    try:
        assert relative_error(whole @ block, looped) < 1e-13
    finally:
        whole._engine.block_mode = "loop"
    assert relative_error(whole.gradient(), op.gradient()) < 1e-12
    assert op.num_examples == 20 and whole.num_cached_batches == 1


def test_a_sum_reduction_is_the_sum_over_the_dataset(tanh_mlp, hessian):
    # Each batch sum is scaled by N/n_b (here 2) before the n_b/N weighting.
    model, x, y, _, _ = tanh_mlp
    total = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    op = HessianOperator.from_keras(model, total, (x, y), batch_size=10, dtype=F64)
    assert relative_error(matrix(op), len(x) * hessian[1]) < 1e-12


def test_cached_streamed_and_sub_blocks_give_the_same_matrix(tanh_mlp, hessian):
    model, x, y, _, _ = tanh_mlp
    op, dense = hessian
    assert op.is_cached and op.num_cached_batches == 3 and op.num_streamed_batches == 0
    streamed = HessianOperator.from_keras(
        model, SCCE, (x, y), batch_size=7, dtype=F64, cache=False, max_block_size=4
    )
    assert np.array_equal(matrix(streamed), dense)
    assert streamed.num_cached_batches == 0 and streamed.num_streamed_batches == 3
    assert streamed.cache_nbytes == 0 and "streaming" in repr(streamed)
    # A cache room for one batch: the others stream, and the product is the same.
    partial = HessianOperator.from_keras(
        model, SCCE, (x, y), batch_size=7, dtype=F64, cache_bytes=op.cache_nbytes // 3 + 1
    )
    assert np.array_equal(matrix(partial), dense)
    assert (partial.num_cached_batches, partial.num_streamed_batches) == (1, 2)
    plan = partial.memory_plan()
    assert plan.measured and plan.cached_batches == 1 and plan.cached == partial.cache_nbytes
    assert "memory plan" in str(plan)


def test_counters_and_flat_vectors(hessian):
    op, _ = hessian
    hvps, passes = op.num_hvps, op.num_data_passes
    v = np.arange(op.shape[0], dtype=F64)
    op.matvec(v)
    op @ np.ones((op.shape[0], 3))
    assert (op.num_hvps, op.num_data_passes) == (hvps + 4, passes + 2)
    assert op.variable_names == [w.path for w in op.variables]
    assert [a.shape for a in op.unflatten(v)] == op.variable_shapes
    assert np.array_equal(op.flatten(op.unflatten(v)), v)
    assert op.rmatvec(v).shape == v.shape and op.H is op
    assert op.curvature == "hessian" and op.product_path == "split"
    op.reset_cache()
    assert not op.is_cached and "not yet evaluated" in repr(op)
    op.loss()
    assert op.is_cached


def test_the_operator_is_a_snapshot(tanh_mlp, hessian):
    model, x, y, _, _ = tanh_mlp
    op = HessianOperator.from_keras(model, SCCE, (x, y), batch_size=7, dtype=F64)
    saved = [np.array(w.value) for w in model.weights]
    try:
        for w in model.weights:
            w.assign(np.asarray(w.value) * 1.5)
        assert np.array_equal(matrix(op), hessian[1])  # built before: unchanged
        moved = HessianOperator.from_keras(model, SCCE, (x, y), batch_size=7, dtype=F64)
        assert relative_error(matrix(moved), hessian[1]) > 1e-3
    finally:
        for w, value in zip(model.weights, saved):
            w.assign(value)


def test_one_compilation_per_batch_shape(tanh_mlp):
    model, x, y, _, _ = tanh_mlp
    # A model of its own, so that no earlier test has compiled its functions.
    twin = keras.models.clone_model(model)
    op = GGNOperator.from_keras(twin, SCCE, (x, y), batch_size=7, dtype=F64)
    assert op.num_compiles == 0  # nothing runs before the first use
    op.matvec(np.ones(op.shape[0]))
    # prepare and apply, each for batches of 7 and for the last one of 6
    assert op.num_compiles == 4
    op @ np.ones((op.shape[0], 5))
    op.matvec(np.ones(op.shape[0]))
    GGNOperator.from_keras(twin, SCCE, (x, y), batch_size=7, dtype=F64).matvec(np.ones(op.shape[0]))
    assert op.num_compiles == 4


def test_estimators_on_the_jax_operator(hessian):
    op, dense = hessian
    exact = np.linalg.eigvalsh(dense)
    found = spectra.eigenvalues(op, k=2)
    assert np.allclose(found.eigenvalues, exact[::-1][:2], rtol=1e-8, atol=1e-10)
    trace = spectra.trace(op, method="xtrace", num_products=2 * op.shape[0])
    assert trace.estimate == pytest.approx(np.trace(dense), rel=1e-8)


def test_data_sources_give_the_same_matrix(tanh_mlp, hessian):
    model, x, y, _, _ = tanh_mlp
    batches = [(x[i : i + 7], y[i : i + 7]) for i in range(0, 20, 7)]

    class Sequence(keras.utils.PyDataset):
        def __len__(self):
            return len(batches)

        def __getitem__(self, index):
            return batches[index]

    class Reiterable:
        def __iter__(self):
            return iter(batches)

    for data in (batches, Sequence(), Reiterable()):
        op = HessianOperator.from_keras(model, SCCE, data, dtype=F64)
        assert op.num_examples == 20
        assert np.array_equal(matrix(op), hessian[1])


def test_a_source_that_changes_between_passes_is_refused(tanh_mlp):
    model, x, y, _, _ = tanh_mlp
    calls = []

    class Shuffled:
        def __iter__(self):
            calls.append(1)
            order = np.random.default_rng(len(calls)).permutation(20)
            parts = (order[:7], order[7:14], order[14:])  # the shapes compiled already
            return iter([(x[part], y[part]) for part in parts])

    op = HessianOperator.from_keras(model, SCCE, Shuffled(), dtype=F64, cache=False)
    with pytest.raises(ValueError, match="same batches on every pass"):
        op.matvec(np.ones(op.shape[0]))


def test_float64_leaves_float32_to_the_rest_of_the_process(hessian):
    op, _ = hessian
    assert op.dtype == F64 and op.matvec(np.ones(op.shape[0])).dtype == F64
    assert jax.numpy.ones(2).dtype == np.float32


def test_vectors_must_fit_the_operator_s_dtype(tanh_mlp):
    model, x, y, _, _ = tanh_mlp
    op = HessianOperator.from_keras(model, SCCE, (x, y))
    with pytest.raises(ValueError, match="beyond the largest float32"):
        op.matvec(np.full(op.shape[0], 1e39))
    with pytest.raises(ValueError, match="NaN or Inf"):
        op.matvec(np.full(op.shape[0], np.nan))
    with pytest.raises(ValueError, match="expected a vector of length 43"):
        op.matvec(np.ones(3))


def test_a_half_precision_model_gets_float32_products():
    half = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(2, dtype="float16"),
            keras.layers.Dense(3, dtype="float16"),
        ]
    )
    x, y = classification_data(6)
    op = HessianOperator.from_keras(half, SCCE, (x, y))
    assert op.dtype == np.float32
    assert np.isfinite(op.matvec(np.ones(op.shape[0]))).all()


def test_variables_subsets_and_unused_variables(tanh_mlp, hessian):
    model, x, y, _, _ = tanh_mlp
    kernel = model.layers[-1].kernel
    op = HessianOperator.from_keras(model, SCCE, (x, y), variables=[kernel], dtype=F64)
    start = op_offset(hessian[0], kernel)
    block = slice(start, start + op.shape[0])
    assert op.variable_names == [kernel.path]
    assert relative_error(matrix(op), hessian[1][block, block]) < 1e-12
    inputs = keras.Input((4,))
    outputs = {"a": keras.layers.Dense(3)(inputs), "b": keras.layers.Dense(2)(inputs)}
    two = keras.Model(inputs, outputs)
    loss, labels = {"a": SCCE, "b": None}, (x, {"a": y})  # output "b" has no loss
    with pytest.raises(ValueError, match="do not affect the loss: .*'dense_.*/kernel'"):
        HessianOperator.from_keras(two, loss, labels).loss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dense = matrix(HessianOperator.from_keras(two, loss, labels, allow_unused=True))
    assert any("do not affect the loss" in str(w.message) for w in caught)
    assert not dense[-10:].any() and dense[:15, :15].any()


def op_offset(op, variable) -> int:
    index = [v.path for v in op.variables].index(variable.path)
    return int(op.layout.offsets[index])


# -- errors ---------------------------------------------------------------------------------
def test_strategy_and_unknown_keywords_are_refused(tanh_mlp):
    model, x, y, _, _ = tanh_mlp
    with pytest.raises(ValueError, match="strategy is not supported on Keras' JAX backend"):
        HessianOperator.from_keras(model, SCCE, (x, y), strategy=object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'kind'"):
        HessianOperator.from_keras(model, SCCE, (x, y), kind="mc")
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        FisherOperator.from_keras(model, SCCE, (x, y), colour="red")
    with pytest.raises(TypeError, match="from_keras"):
        HessianOperator(lambda: 0.0, model.trainable_variables)


def test_bad_data_is_refused_in_one_line(tanh_mlp):
    model, x, y, _, _ = tanh_mlp
    bad = x.copy()
    bad[3, 1] = np.nan
    cases = [
        ((bad, y), ValueError, r"x holds 1 NaN or infinite values, first x\[3, 1\] = nan"),
        ((x, y[:-1]), ValueError, "y has 19"),
        ((x, np.where(y == 0, 5, y)), ValueError, r"class indices in \[0, 3\)"),
        ((x, y, np.full(19, 1.0)), ValueError, "sample_weight has 19"),
        ((x[i : i + 5] for i in range(0, 20, 5)), TypeError, "can be read only once"),
        ("data.npz", TypeError, "data must be"),
    ]
    for data, error, message in cases:
        with pytest.raises(error, match=message) as info:
            HessianOperator.from_keras(model, SCCE, data, dtype=F64).loss()
        assert "\n" not in str(info.value)


def test_tf_data_without_tensorflow_is_refused(tanh_mlp):
    model, _, _, _, _ = tanh_mlp
    DatasetV2 = type("DatasetV2", (), {"__module__": "tensorflow.python.data.ops.dataset_ops"})
    with pytest.raises(TypeError, match="TensorFlow is not installed: pass arrays"):
        HessianOperator.from_keras(model, SCCE, DatasetV2())


def test_a_nan_product_names_its_batch(tanh_mlp):
    model, x, y, _, _ = tanh_mlp
    op = HessianOperator.from_keras(model, SCCE, (x, y))
    with pytest.raises(ValueError, match="product is not finite .* from batch 0"):
        op.matvec(np.full(op.shape[0], 3e38, np.float32))


def test_non_finite_weights_are_refused(tanh_mlp):
    _, x, y, _, _ = tanh_mlp
    model = mlp("tanh")
    model.layers[0].kernel.assign(np.full((4, 5), np.inf, np.float32))
    with pytest.raises(ValueError, match="has 20 non-finite entries .* Load finite weights"):
        HessianOperator.from_keras(model, SCCE, (x, y))
