"""Batches and their weights n_b/N through the operator, against a NumPy float64 truth.

The loss is the mean over all N examples, L = Σ_b (n_b/N) L_b, so the loss, the gradient
and every product are sums over batches with these weights: one batch or many, arrays or
a tf.data pipeline, cached or streamed, vectors multiplied in one block or several. The
truth (tests/_relu_mlp.py) is computed by hand in NumPy on all N examples at once, so a
wrong weight, a batch dropped or counted twice, or a block lost shows as an O(1) error.
Small and fast: these tests also drive the mutation testing of spectra/operators/batching.py and
spectra/operators/base.py (make mutate).
"""

from __future__ import annotations

import itertools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from _relu_mlp import ReluMLP

from spectra.operators import HessianOperator, block_size_for
from spectra.operators.batching import Batches
from spectra.operators.memory import BLOCK_COPIES

RTOL = 1e-11
NUM_EXAMPLES = 20
LOSS = keras.losses.SparseCategoricalCrossentropy(dtype="float64")


@pytest.fixture(scope="module")
def problem():
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="float64"),
            keras.layers.Dense(4, activation="relu", dtype="float64"),
            keras.layers.Dense(3, activation="softmax", dtype="float64"),
        ]
    )
    rng = np.random.default_rng(6)
    x = rng.standard_normal((NUM_EXAMPLES, 3))
    y = rng.integers(0, 3, NUM_EXAMPLES)
    truth = ReluMLP.from_keras(model, x, y)
    V = rng.standard_normal((truth.n, 5))
    return model, x, y, truth, truth.dense(), V


def _relative(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


def _dataset(x, y, sizes):
    starts = np.cumsum([0, *sizes])
    parts = [(x[a:b], y[a:b]) for a, b in itertools.pairwise(starts)]
    return tf.data.Dataset.from_generator(
        lambda: iter(parts),
        output_signature=(tf.TensorSpec([None, 3], tf.float64), tf.TensorSpec([None], tf.int64)),
    )


CASES = {
    "one batch": dict(batch_size=None),
    "arrays 7+7+6": dict(batch_size=7),
    "arrays 19+1": dict(batch_size=19),
    "dataset 7+7+6": dict(sizes=[7, 7, 6]),
    "dataset 1+12+7": dict(sizes=[1, 12, 7]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cache", [True, False], ids=["cached", "streamed"])
def test_loss_gradient_and_products_are_the_weighted_sums(problem, case, cache):
    model, x, y, truth, hessian, V = problem
    spec = CASES[case]
    data = _dataset(x, y, spec["sizes"]) if "sizes" in spec else (x, y)
    kwargs = {} if "sizes" in spec else {"batch_size": spec["batch_size"]}
    op = HessianOperator.from_keras(model, LOSS, data, cache=cache, max_block_size=2, **kwargs)
    assert op.num_examples == NUM_EXAMPLES
    assert op.loss() == pytest.approx(truth.loss(), rel=RTOL)
    gradient = op.gradient()
    assert _relative(gradient, truth.gradient()) < RTOL
    gradient[:] = 0.0  # a copy: the operator's gradient is unchanged
    assert _relative(op.gradient(), truth.gradient()) < RTOL
    assert op.num_data_passes == 1  # loss and gradient in one pass
    passes = op.num_data_passes
    # Five vectors in blocks of 2, 2 and 1: every block, every batch, each weight n_b/N.
    assert _relative(op.matmat(V), hessian @ V) < RTOL
    assert op.num_hvps == 5 and op.num_data_passes == passes + 1
    assert _relative(op.matvec(V[:, 0]), hessian @ V[:, 0]) < RTOL
    assert _relative(op @ V[:, 1:2], hessian @ V[:, 1:2]) < RTOL
    assert op.num_hvps == 7 and op.num_data_passes == passes + 3
    assert op.is_cached == cache
    assert op.matmat(np.zeros((truth.n, 0))).shape == (truth.n, 0)


def test_a_cache_over_budget_falls_back_to_streaming(problem):
    model, x, y, truth, hessian, V = problem
    op = HessianOperator.from_keras(model, LOSS, (x, y), batch_size=7, cache="auto", cache_bytes=1)
    assert op.loss() == pytest.approx(truth.loss(), rel=RTOL)
    assert not op.is_cached and op.cache_nbytes == 0
    assert _relative(op.matmat(V), hessian @ V) < RTOL
    roomy = HessianOperator.from_keras(model, LOSS, (x, y), batch_size=7, cache="auto")
    assert _relative(roomy.matmat(V), hessian @ V) < RTOL
    assert roomy.is_cached and roomy.cache_nbytes > 0
    roomy.reset_cache()
    assert not roomy.is_cached
    assert _relative(roomy.matmat(V), hessian @ V) < RTOL


def test_flatten_and_unflatten_are_inverse_and_checked(problem):
    model, x, y, truth, _, _ = problem
    op = HessianOperator.from_keras(model, LOSS, (x, y))
    shapes = [tuple(w.shape) for w in model.get_weights()]
    assert op.variable_shapes == shapes
    vector = np.arange(truth.n, dtype=np.float64)
    pieces = op.unflatten(vector)
    assert [p.shape for p in pieces] == shapes
    # Row-major, variable after variable: the pieces are consecutive slices.
    np.testing.assert_array_equal(np.concatenate([p.reshape(-1) for p in pieces]), vector)
    assert pieces[0][1, 0] == shapes[0][1] and pieces[1][0] == np.prod(shapes[0])
    flat = op.flatten(pieces)
    assert flat.dtype == op.dtype
    np.testing.assert_array_equal(flat, vector)
    np.testing.assert_array_equal(op.flatten(model.get_weights()), truth_flat(model))
    with pytest.raises(ValueError, match=f"expected {len(shapes)} arrays"):
        op.flatten(pieces[:-1])
    with pytest.raises(ValueError, match="array 1 has shape"):
        op.flatten([pieces[0], pieces[1][:-1], *pieces[2:]])
    with pytest.raises(ValueError, match=rf"expected a vector of shape \({truth.n},\)"):
        op.unflatten(vector[:-1])


def truth_flat(model) -> np.ndarray:
    return np.concatenate([w.reshape(-1) for w in model.get_weights()])


@pytest.mark.parametrize(
    "num_parameters, itemsize, budget, expected",
    [
        (1000, 8, 512 * 1024**2, 64),  # capped at 64
        (10**7, 4, 512 * 1024**2, 2),  # 512 MiB / (5 copies · 4e7 B) = 2.7 -> 2
        (100, 8, BLOCK_COPIES * 100 * 8 * 5, 4),  # 5 fit -> 4
        (100, 8, BLOCK_COPIES * 100 * 8 * 8, 8),  # exactly 8 fit
        (100, 8, BLOCK_COPIES * 100 * 8 * 8 - 1, 4),  # one byte short of 8
        (100, 8, 1, 1),  # nothing fits: still one vector
    ],
)
def test_block_size_is_the_largest_power_of_two_that_fits(
    num_parameters, itemsize, budget, expected
):
    assert block_size_for(num_parameters, itemsize, budget) == expected


@pytest.mark.parametrize("sizes", [[7, 7, 6], [1, 12, 7], [20]])
def test_batches_of_a_dataset_carry_their_weights(problem, sizes):
    _, x, y, _, _, _ = problem
    batches = Batches(_dataset(x, y, sizes))
    for _ in range(2):  # the counting pass, then a checked pass
        seen = [(int(batch[0].shape[0]), weight) for batch, weight in batches]
        assert [n for n, _ in seen] == sizes
        np.testing.assert_allclose([w for _, w in seen], np.array(sizes) / NUM_EXAMPLES)
    assert batches.num_examples == NUM_EXAMPLES and batches.num_batches == len(sizes)


@pytest.mark.parametrize(
    "batch_size, sizes", [(None, [20]), (7, [7, 7, 6]), (20, [20]), (30, [20])]
)
def test_batches_of_arrays_carry_their_weights(problem, batch_size, sizes):
    _, x, y, _, _, _ = problem
    batches = Batches((x, y), batch_size)
    seen = list(batches)
    assert [int(batch[0].shape[0]) for batch, _ in seen] == sizes
    np.testing.assert_allclose([w for _, w in seen], np.array(sizes) / NUM_EXAMPLES)
    # Consecutive slices in order: together the examples, each once.
    np.testing.assert_array_equal(np.concatenate([batch[0] for batch, _ in seen]), x)
    np.testing.assert_array_equal(np.concatenate([batch[1] for batch, _ in seen]), y)
    assert batches.num_examples == NUM_EXAMPLES and batches.num_batches == len(sizes)


def test_the_cache_budget_counts_every_batch(problem):
    model, x, y, truth, hessian, V = problem
    one = HessianOperator.from_keras(model, LOSS, (x[:7], y[:7]), cache="auto")
    one.loss()
    total = HessianOperator.from_keras(model, LOSS, (x, y), batch_size=7, cache="auto")
    total.loss()
    needed = total.cache_nbytes  # batches of 7, 7 and 6 examples
    assert total.is_cached and 2 * one.cache_nbytes < needed
    # A budget of exactly what the three caches hold keeps all three; one byte less keeps
    # two and streams the third, though each batch alone fits.
    for budget, kept in ((needed, 3), (needed - 1, 2)):
        op = HessianOperator.from_keras(
            model, LOSS, (x, y), batch_size=7, cache="auto", cache_bytes=budget
        )
        assert op.loss() == pytest.approx(truth.loss(), rel=RTOL)
        assert op.is_cached is (kept == 3)
        assert (op.num_cached_batches, op.num_streamed_batches) == (kept, 3 - kept)
        assert (op.cache_nbytes == needed) is (kept == 3) and op.cache_nbytes <= budget
        assert _relative(op.matmat(V), hessian @ V) < RTOL


def test_a_non_finite_batch_is_named_with_its_size(problem):
    model, x, y, _, _, _ = problem
    bad = x.copy()
    # In the third batch (6 examples): finite, but the first unit's pre-activation
    # max·Σ|w| overflows (NaN itself is refused with the operator, naming x[15, 0]).
    bad[15] = np.finfo(np.float64).max * np.sign(model.layers[0].kernel.numpy()[:, 0])
    op = HessianOperator.from_keras(model, LOSS, (bad, y), batch_size=7)
    with pytest.raises(ValueError, match=r"^batch 2 \(6 examples\) gives a non-finite loss"):
        op.loss()


def test_passes_accumulate_and_the_mode_is_shown(problem):
    model, x, y, truth, _, _ = problem
    op = HessianOperator.from_keras(model, LOSS, (x, y), batch_size=7, cache=False)
    assert "not yet evaluated; 0 products, 0 data passes" in repr(op)
    assert op.loss() == pytest.approx(truth.loss(), rel=RTOL)
    assert "streaming; 0 products, 1 data passes" in repr(op)
    op.reset_cache()
    assert "not yet evaluated" in repr(op)
    op.gradient()
    assert op.num_data_passes == 2 and "streaming" in repr(op)


def test_a_float32_operator_computes_in_float32_whatever_the_input(problem):
    _, x, y, _, _, _ = problem
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    op = HessianOperator.from_keras(model, loss, (x.astype(np.float32), y), batch_size=7)
    assert op.dtype == np.float32
    V = np.random.default_rng(8).standard_normal((op.shape[0], 3))
    product = op.matmat(V)
    assert product.dtype == np.float32
    np.testing.assert_array_equal(product, op.matmat(V.astype(np.float32)))
    empty = op.matmat(np.zeros((op.shape[0], 0)))
    assert empty.shape == (op.shape[0], 0) and empty.dtype == np.float32
    # Beyond float32: refused, not returned as inf or NaN.
    huge = np.ones(op.shape[0])
    huge[4] = 1e39  # finite in float64, infinite in float32
    with pytest.raises(ValueError, match=r"entries up to 1e\+39, beyond the largest float32"):
        op.matvec(huge)
    with pytest.raises(ValueError) as overflow:  # fits float32, but the product overflows
        op.matvec(np.full(op.shape[0], 3e38))
    assert re.fullmatch(
        r"the Hessian product is not finite \(\d+ NaN/Inf entries, from batch \d[^)]*\) "
        r"although the weights, the batch losses and gradients are finite: the product "
        r"overflows float32 for this vector\. Scale the vector down \(products are linear\) "
        r"or build the operator with dtype=np\.float64\.",
        str(overflow.value),
    ), str(overflow.value)


def test_graph_errors_name_their_root_cause_first(rng):
    # Indices out of range inside the loss: no check before the graph can see them.
    table = tf.Variable(rng.standard_normal(6))
    indices = rng.integers(0, 6, (10, 3)).astype("int32")
    indices[7, 1] = 10

    def loss_fn(batch):
        return tf.reduce_mean(tf.gather(table, batch[0]) ** 3)

    op = HessianOperator(loss_fn, [table], (indices,), batch_size=5)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        op.loss()
    first_line = str(info.value).splitlines()[0]
    assert first_line == "batch 1: indices[2,1] = 10 is not in [0, 6)", first_line
    assert "Graph execution error" not in first_line
    assert isinstance(info.value.__cause__, tf.errors.InvalidArgumentError)
    streaming = HessianOperator(loss_fn, [table], (indices,), batch_size=5, cache=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"^batch 1: indices"):
        streaming.matvec(np.ones(6))
