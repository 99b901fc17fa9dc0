"""The memory budget: partial caching, sub-blocks sized from it, and the memory plan.

A small float64 CNN on 32 examples in 4 batches of 8. Partial caching (a budget that keeps
some batches and streams the others) must give exactly the products, loss and gradient of
caching everything and of streaming everything, Dropout masks included; a block product
under a tiny budget is split into sub-blocks with results equal to the unsplit product.
The dense Hessian (``tf.GradientTape.jacobian``) is the truth for one check of each mode.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _dense import FD_TRUTH_RTOL, dense_hessian, relative_error

from spectra.operators import HessianOperator, memory
from spectra.operators.memory import TANGENT_FACTOR, MemoryPlan

NUM_EXAMPLES = 32
BATCH = 8
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _cnn(dropout: bool) -> keras.Model:
    layers = [
        keras.Input((6, 6, 1)),
        keras.layers.Conv2D(3, 3, activation="tanh"),
        keras.layers.Flatten(),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(0.3))
    layers.append(keras.layers.Dense(3))
    return keras.Sequential(layers)


@pytest.fixture(scope="module")
def problem():
    keras.utils.set_random_seed(11)
    model = _cnn(dropout=False)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((NUM_EXAMPLES, 6, 6, 1)).astype(np.float32)
    y = rng.integers(0, 3, NUM_EXAMPLES)
    full = HessianOperator.from_keras(
        model, LOSS, (x, y), batch_size=BATCH, dtype=np.float64, cache=True
    )
    full.loss()
    V = rng.standard_normal((full.shape[0], 16))
    return model, x, y, full, V


def _dense_hessian(model, x, y) -> np.ndarray:
    """The float64 Hessian of the mean loss by finite differences (``_dense.dense_hessian``)."""
    weights = [tf.Variable(tf.cast(w, tf.float64)) for w in model.get_weights()]
    x64 = tf.constant(x, tf.float64)
    kernel, bias, dense, dense_bias = weights

    def loss():
        h = tf.tanh(tf.nn.conv2d(x64, kernel, 1, "VALID") + bias)
        logits = tf.reshape(h, [len(x), -1]) @ dense + dense_bias
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(tf.constant(y), logits)
        )

    return dense_hessian(loss, weights)


def _partial(model, x, y, full, **kwargs):
    """An operator whose cache budget holds two of the four batches."""
    per_batch = full.cache_nbytes // 4
    return HessianOperator.from_keras(
        model,
        LOSS,
        (x, y),
        batch_size=BATCH,
        dtype=np.float64,
        cache_bytes=2 * per_batch + 1,
        **kwargs,
    )


def test_partial_caching_equals_full_caching_and_streaming(problem):
    model, x, y, full, V = problem
    partial = _partial(model, x, y, full)
    streaming = HessianOperator.from_keras(
        model, LOSS, (x, y), batch_size=BATCH, dtype=np.float64, cache=False
    )
    assert partial.loss() == full.loss() == streaming.loss()
    np.testing.assert_array_equal(partial.gradient(), full.gradient())
    np.testing.assert_array_equal(partial.gradient(), streaming.gradient())
    assert (partial.num_cached_batches, partial.num_streamed_batches) == (2, 2)
    assert not partial.is_cached and full.is_cached and not streaming.is_cached
    assert 0 < partial.cache_nbytes <= partial.cache_bytes < full.cache_nbytes
    assert streaming.cache_nbytes == 0
    products = [op.matmat(V) for op in (partial, full, streaming)]
    # Same batch order, same kernels: equal to the last bit.
    np.testing.assert_array_equal(products[0], products[1])
    np.testing.assert_array_equal(products[0], products[2])
    hessian = _dense_hessian(model, x, y)
    # The finite-difference truth errs by ~1e-11 relative (FD_TRUTH_RTOL).
    assert relative_error(products[0], hessian @ V) < FD_TRUTH_RTOL
    # The kept caches are reused: a second pass gives the same numbers again.
    np.testing.assert_array_equal(partial.matvec(V[:, 0]), products[1][:, 0])
    assert partial.num_data_passes == 3  # the first pass, a matmat and a matvec


def test_the_mode_is_reported(problem):
    model, x, y, full, _ = problem
    partial = _partial(model, x, y, full)
    assert "not yet evaluated" in repr(partial)
    partial.loss()
    assert re.search(r"cached 2 of 4 batches \(\d+\.\d KiB\), streaming 2;", repr(partial))
    assert re.search(r"cached 4 of 4 batches \(\d+\.\d KiB\);", repr(full))
    partial.reset_cache()
    assert "not yet evaluated" in repr(partial) and partial.num_cached_batches == 0


def test_what_is_kept_is_worth_most_per_byte(problem):
    model, x, y, full, _ = problem
    # Batches of 8, 8, 8 and 2 examples: the 2-example batch is worth as much per byte,
    # and the later of equal batches is dropped first.
    per_batch = full.cache_nbytes // 4
    op = HessianOperator.from_keras(
        model,
        LOSS,
        (x[:26], y[:26]),
        batch_size=BATCH,
        dtype=np.float64,
        cache_bytes=per_batch + 1,
    )
    op.loss()
    assert [entry.batch_index for entry in op._caches] == [0]


def test_dropout_masks_are_the_same_in_kept_and_streamed_batches(problem):
    _, x, y, _, V = problem
    keras.utils.set_random_seed(13)
    model = _cnn(dropout=True)
    options = dict(batch_size=BATCH, dtype=np.float64, training=True, seed=3)
    full = HessianOperator.from_keras(model, LOSS, (x, y), cache=True, **options)
    streaming = HessianOperator.from_keras(model, LOSS, (x, y), cache=False, **options)
    full.loss()
    partial = HessianOperator.from_keras(
        model, LOSS, (x, y), cache_bytes=full.cache_nbytes // 2 + 1, **options
    )
    assert partial.loss() == full.loss() == streaming.loss()
    assert 0 < partial.num_cached_batches < 4
    W = V[:, :3]
    np.testing.assert_array_equal(partial.matmat(W), full.matmat(W))
    np.testing.assert_array_equal(partial.matmat(W), streaming.matmat(W))


def test_a_tiny_budget_splits_a_block_into_sub_blocks(problem, monkeypatch):
    model, x, y, full, V = problem
    plan = full.memory_plan()
    assert plan.measured and plan.cached == full.cache_nbytes and plan.block_size == 64
    # Room for the snapshot, the four caches and four vectors' tangents, not eight, as
    # estimated before the first product measures them.
    per_vector = int(TANGENT_FACTOR * plan.cache_per_batch)
    room = int(4.5 * (per_vector + memory.BLOCK_COPIES * plan.per_row))
    budget = plan.snapshot + plan.cached + room
    tight = HessianOperator.from_keras(
        model, LOSS, (x, y), batch_size=BATCH, dtype=np.float64, cache=True, memory_budget=budget
    )
    with warnings.catch_warnings():
        # The convolutions' workspaces while a cache is computed (measured, tens of MiB
        # in float64) are beyond this budget: the first pass warns that cache=True
        # exceeds it. The products' sub-blocks are what is tested here.
        warnings.simplefilter("ignore", UserWarning)
        tight.loss()
    assert tight.max_block_size == 4
    assert tight.memory_plan().products <= room
    sizes = []
    engine = tight._engine
    apply = engine.apply

    def spy(cache, vectors):
        sizes.append(int(vectors.shape[0]))
        return apply(cache, vectors)

    monkeypatch.setattr(engine, "apply", spy)
    out = tight.matmat(V)
    monkeypatch.undo()
    assert sizes == [4] * 16  # 4 sub-blocks on each of the 4 batches, one data pass
    assert tight.num_data_passes == 2
    unsplit = full.matmat(V)
    np.testing.assert_allclose(out, unsplit, rtol=0, atol=1e-12 * np.abs(unsplit).max())
    # A budget below one vector's room still multiplies, one vector at a time.
    tiniest = HessianOperator.from_keras(
        model, LOSS, (x, y), batch_size=BATCH, dtype=np.float64, memory_budget=1
    )
    np.testing.assert_allclose(tiniest.matmat(V[:, :3]), unsplit[:, :3], rtol=0, atol=1e-12)
    assert tiniest.max_block_size == 1 and tiniest.num_cached_batches == 0
    assert "over the budget by" in str(tiniest.memory_plan())


def test_explicit_overrides_take_precedence(problem):
    model, x, y, _, _ = problem
    op = HessianOperator.from_keras(
        model,
        LOSS,
        (x, y),
        batch_size=BATCH,
        dtype=np.float64,
        memory_budget=1,
        cache_bytes=10**9,
        max_block_size=5,
    )
    op.loss()
    assert op.max_block_size == 5 and op.is_cached and op.memory_budget == 1
    op.max_block_size = 2
    assert op.memory_plan().block_size == 2
    with pytest.raises(ValueError, match="max_block_size must be an integer >= 1"):
        op.max_block_size = 0
    with pytest.raises(ValueError, match="memory_budget must be an integer >= 1, got 0"):
        HessianOperator.from_keras(model, LOSS, (x, y), memory_budget=0)
    with pytest.raises(TypeError, match="memory_budget must be an integer or None, got"):
        HessianOperator.from_keras(model, LOSS, (x, y), memory_budget=1.5e9)


def test_the_default_budget_is_half_the_available_memory(problem, monkeypatch):
    model, x, y, _, _ = problem
    monkeypatch.setattr(memory, "_gpu_memory", lambda: None)
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 6 * 1024**3)
    assert memory.available_memory() == 6 * 1024**3
    op = HessianOperator.from_keras(model, LOSS, (x, y), batch_size=BATCH, dtype=np.float64)
    assert op.memory_budget == 3 * 1024**3
    assert op.cache_bytes == 3 * 1024**3 // 2 - op.shape[0] * 8
    plan = op.memory_plan()
    assert not plan.measured and "before the first pass" in str(plan)


def test_the_available_memory_is_read_from_meminfo():
    available = memory._meminfo_available()
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo on this system")
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    expected = int(fields["MemAvailable"].split()[0]) * 1024
    assert available is not None and abs(available - expected) < 256 * 1024**2


def test_the_plan_reads_as_a_summary():
    plan = MemoryPlan(
        budget=4 * 1024**3,
        snapshot=8 * 1024**2,
        cache_per_batch=300 * 1024**2,
        cached=900 * 1024**2,
        cached_batches=3,
        streamed_batches=1,
        per_vector=300 * 1024**2,
        per_row=1024**2,
        block_size=16,
        measured=True,
    )
    # Ten vectors' tangents in flight, five (16, n) arrays.
    assert plan.products == (10 * 300 + 5 * 16) * 1024**2
    assert plan.peak == (8 + 900 + 300 + 3080) * 1024**2
    text = str(plan)
    assert "budget 4.0 GiB, estimated peak 4.2 GiB" in text
    assert "cached 3 of 4 batches (900.0 MiB), streaming 1" in text
    assert "sub-blocks of 16 (3.0 GiB: 300.0 MiB of tangents per vector in flight" in text
    assert "(estimated), up to 10 vectors in flight" in text
    # A block run one vector at a time, with its tangents measured; computing a batch's
    # cache (the transient of its forward pass and gradient) is the larger phase.
    looped = dataclasses.replace(
        plan, parallel=1, per_vector_measured=True, cache_transient=2000 * 1024**2
    )
    assert looped.products == (300 + 5 * 16) * 1024**2
    assert looped.computing_cache == (900 + 2000) * 1024**2  # one batch streams
    assert looped.peak == (8 + 900 + 2000) * 1024**2
    text = str(looped)
    assert "computing one: 2.0 GiB (measured)" in text
    assert "(measured), one vector in flight" in text
    # On the first pass of an operator that keeps every batch, the batch being computed
    # is counted once.
    kept = dataclasses.replace(looped, streamed_batches=0, cached_batches=4, cached=1200 * 1024**2)
    assert kept.computing_cache == (1200 - 300 + 2000) * 1024**2


def test_large_batches_run_a_block_one_vector_at_a_time(problem, monkeypatch):
    """Above LOOP_BLOCK_BYTES a block's vectors run through the single-vector product, one
    at a time: bitwise the block product's result, and the plan counts one vector in
    flight; the first product measures one vector's tangents."""
    from spectra.operators import engine as engine_module

    model, x, y, full, V = problem
    blocked = full.matmat(V[:, :5])
    assert full.memory_plan().parallel == 10
    looping = HessianOperator.from_keras(
        model, LOSS, (x, y), batch_size=BATCH, dtype=np.float64, cache=True
    )
    monkeypatch.setattr(engine_module, "LOOP_BLOCK_BYTES", 0)
    assert looping.memory_plan().parallel == 1
    calls = []
    single = looping._engine._single_fn
    original = engine_module._tf_compat.call_flat

    def counting(function, args):
        calls.append(function is single)
        return original(function, args)

    monkeypatch.setattr(engine_module._tf_compat, "call_flat", counting)
    out = looping.matmat(V[:, :5])
    assert sum(calls) == 5 * NUM_EXAMPLES // BATCH  # five single products per batch
    np.testing.assert_array_equal(out, blocked)
    plan = looping.memory_plan()
    if _host_keeps_allocator_statistics():
        assert plan.per_vector_measured and plan.per_vector > 0
        assert plan.cache_transient > 0
    else:  # TensorFlow's CPU allocator keeps statistics on some machines only
        assert not plan.per_vector_measured and plan.cache_transient == 0
        assert plan.per_vector == int(TANGENT_FACTOR * plan.cache_per_batch)


def _host_keeps_allocator_statistics() -> bool:
    """Whether TensorFlow's allocator on CPU:0 keeps the statistics the plan measures
    with (it does on some machines, not on others: 'Cannot reset memory stats')."""
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        tf.config.experimental.get_memory_info("CPU:0")
    except (ValueError, RuntimeError):
        return False
    return True


def test_without_allocator_statistics_the_plan_keeps_its_estimate(problem, monkeypatch):
    model, x, y, full, V = problem

    def unavailable(device):
        raise ValueError(f"no memory statistics for {device}")

    monkeypatch.setattr(tf.config.experimental, "get_memory_info", unavailable)
    op = HessianOperator.from_keras(model, LOSS, (x, y), batch_size=BATCH, dtype=np.float64)
    np.testing.assert_array_equal(op.matmat(V[:, :2]), full.matmat(V[:, :2]))
    plan = op.memory_plan()
    assert not plan.per_vector_measured and plan.cache_transient == 0
    assert plan.per_vector == int(TANGENT_FACTOR * plan.cache_per_batch)


def test_cache_true_over_a_tiny_budget_warns_once_and_keeps_its_products_right():
    """The reviewer's case: cache=True with memory_budget=4000 B on a 31-parameter MLP in
    batches of 4, 4, 3 keeps 1.9 KiB of caches: with the snapshot and a product, over the
    budget. Before, silently (and the product room went negative, so sub-blocks of 1); now
    a warning, once, naming the overrun and the sub-block size, and the products still
    match cache=False."""

    import spectra

    keras.utils.set_random_seed(0)
    legacy = np.random.RandomState(0)  # the reviewer's stream: np.random after that seed
    x = legacy.randn(11, 3)
    y = legacy.randint(0, 3, 11)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="float64"),
            keras.layers.Dense(4, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, activation="softmax", dtype="float64"),
        ]
    )
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    loss = "sparse_categorical_crossentropy"
    reference = spectra.HessianOperator.from_keras(model, loss, (x, y), cache=False)
    V = legacy.randn(reference.shape[0], 5)
    expected = reference.matmat(V)
    op = spectra.HessianOperator.from_keras(model, loss, data, cache=True, memory_budget=4000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        op.loss()
        planned = op.max_block_size  # before the first product measures its tangents
        first = op.matmat(V)
        second = op.matmat(V)
    messages = [str(w.message) for w in caught if "cache=True" in str(w.message)]
    assert len(messages) == 1, messages
    plan = op.memory_plan()
    assert plan.peak > 4000 and plan.cached_batches == 3
    assert "exceeds memory_budget=4000" in messages[0]
    assert f"sub-blocks of {planned} vectors" in messages[0]
    np.testing.assert_allclose(first, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(second, expected, rtol=1e-12, atol=1e-14)
    # The products' room counts the caches only up to their share of the budget: what
    # it leaves after the snapshot and a reserve for a streamed batch (its cache of 712 B,
    # the frontier of the single-vector product, tangents estimated at 1.15 times it, five
    # rows of 248 B) or computing one.
    reserve = max(plan.cache_transient, 712 + int(TANGENT_FACTOR * 712)) + 5 * 248
    assert plan.cache_per_batch == 712 and plan.per_row == 248
    assert op.cache_bytes == max(0, 4000 - plan.snapshot - reserve)
    assert op._block_room() == 4000 - plan.snapshot - min(op.cache_nbytes, op.cache_bytes)
    # cache="auto" stays within what it can and does not warn.
    auto = spectra.HessianOperator.from_keras(model, loss, data, memory_budget=4000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto.loss()
    assert not [w for w in caught if "cache=True" in str(w.message)]


def test_the_default_cache_share_leaves_room_for_one_streamed_product(problem, monkeypatch):
    """By default the caches get what the budget leaves after the snapshot and a reserve
    for one streamed batch's product (set from the first batch), not half the budget: a
    budget with room for the four caches and that reserve keeps all four, where half of it
    would keep three."""
    model, x, y, full, V = problem
    plan = full.memory_plan()
    per_batch, per_row = plan.cache_per_batch, plan.per_row
    assert plan.cached_batches == 4 and plan.cached == 4 * per_batch

    def unavailable(device):  # no measured transient: the reserve is the streamed product
        raise ValueError(f"no memory statistics for {device}")

    monkeypatch.setattr(tf.config.experimental, "get_memory_info", unavailable)
    reserve = per_batch + int(TANGENT_FACTOR * per_batch) + memory.BLOCK_COPIES * per_row
    budget = plan.snapshot + 4 * per_batch + reserve + 100
    assert budget // 2 - plan.snapshot < 4 * per_batch  # the former share: three batches
    op = HessianOperator.from_keras(
        model, LOSS, (x, y), batch_size=BATCH, dtype=np.float64, memory_budget=budget
    )
    op.loss()
    assert op.cache_bytes == 4 * per_batch + 100
    assert op.num_cached_batches == 4 and op.num_streamed_batches == 0
    assert op.memory_plan().peak <= budget
    np.testing.assert_array_equal(op.matmat(V[:, :2]), full.matmat(V[:, :2]))
    # An explicit cache_bytes is kept as given.
    given = HessianOperator.from_keras(
        model, LOSS, (x, y), batch_size=BATCH, dtype=np.float64, cache_bytes=2 * per_batch + 1
    )
    given.loss()
    assert given.cache_bytes == 2 * per_batch + 1 and given.num_cached_batches == 2
