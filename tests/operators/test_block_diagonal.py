"""BlockDiagonalOperator against the dense block diagonal of explicit matrices and of a
small float64 Keras model's Hessian (from ``tf.GradientTape.jacobian``)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _dense import dense_hessian
from _matrices import BlockOperator, random_symmetric

import spectra
from spectra.operators import BlockDiagonalOperator, HessianOperator, layer_groups


def _block_diagonal(matrix: np.ndarray, blocks) -> np.ndarray:
    out = np.zeros_like(matrix)
    for block in blocks:
        out[np.ix_(block, block)] = matrix[np.ix_(block, block)]
    return out


@pytest.fixture(scope="module")
def problem():
    """A float64 MLP (n = 81: "hidden" 6·7 + 7, "logits" 7·4 + 4) on 60 examples in three
    unequal batches, its Hessian operator and its dense Hessian (as in
    tests/truths/test_estimators_on_hessian.py)."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((6,), dtype="float64"),
            keras.layers.Dense(7, activation="tanh", dtype="float64", name="hidden"),
            keras.layers.Dense(4, dtype="float64", name="logits"),
        ],
        name="net",
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 6))
    y = rng.integers(0, 4, 60)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
    op = HessianOperator.from_keras(model, loss, (x, y), batch_size=25)
    H = dense_hessian(lambda: loss(y, model(x)), model.trainable_variables)
    op.loss()  # the first pass over the data fills the cache; counters below start after it
    return op, H


def test_default_blocks_are_the_layers_of_a_hessian(problem):
    op, H = problem
    block_op = BlockDiagonalOperator(op)
    assert block_op.group_names == ["hidden", "logits"]
    np.testing.assert_array_equal(block_op.groups[0], np.arange(49))
    np.testing.assert_array_equal(block_op.groups[1], np.arange(49, 81))
    exact = _block_diagonal(H, block_op.groups)
    scale = np.max(np.abs(H))
    rng = np.random.default_rng(1)
    V = rng.standard_normal((81, 3))
    calls, products = op.num_data_passes, op.num_hvps
    np.testing.assert_allclose(block_op.matmat(V), exact @ V, rtol=0, atol=1e-10 * scale)
    # one data pass for the block: 2 blocks × 3 vectors = 6 products
    assert op.num_data_passes - calls == 1 and op.num_hvps - products == 6
    np.testing.assert_allclose(block_op.matvec(V[:, 0]), exact @ V[:, 0], atol=1e-10 * scale)
    np.testing.assert_allclose(block_op.rmatvec(V[:, 1]), exact @ V[:, 1], atol=1e-10 * scale)
    dense = block_op.to_dense()
    np.testing.assert_allclose(dense, exact, rtol=0, atol=1e-10 * scale)
    # the Hessian's off-diagonal blocks are not zero: the approximation drops them
    assert np.max(np.abs(H - exact)) > 1e-3 * scale


def test_eigenvalues_are_the_union_of_the_blocks(problem):
    op, H = problem
    block_op = BlockDiagonalOperator(op)
    union = np.sort(np.concatenate([np.linalg.eigvalsh(H[np.ix_(b, b)]) for b in block_op.groups]))
    np.testing.assert_allclose(
        np.linalg.eigvalsh(block_op.to_dense()), union, atol=1e-10 * np.max(np.abs(union))
    )
    # the estimators accept it (symmetric): its top eigenvalue is the largest block's
    top = spectra.eigenvalues(block_op, k=1, tol=1e-10, seed=0)
    np.testing.assert_allclose(top.eigenvalues[0], union[-1], rtol=1e-8)


def test_groups_by_index_and_block_sizes_on_a_plain_matrix():
    a = random_symmetric(12, seed=3) + np.diag(np.arange(12.0))
    rng = np.random.default_rng(4)
    X = rng.standard_normal((12, 2))
    scattered = {"even": np.arange(0, 12, 2), "odd": [1, 3, 5, 7, 9, 11]}
    by_groups = BlockDiagonalOperator(a, groups=scattered)
    assert by_groups.group_names == ["even", "odd"] and by_groups.num_blocks == 2
    exact = _block_diagonal(a, [np.arange(0, 12, 2), np.arange(1, 12, 2)])
    np.testing.assert_allclose(by_groups @ X, exact @ X, rtol=1e-13)
    np.testing.assert_allclose(by_groups.to_dense(), exact, rtol=1e-13)
    by_sizes = BlockDiagonalOperator(a, block_sizes=[5, 4, 3])
    assert by_sizes.group_names == ["block_0", "block_1", "block_2"]
    exact = _block_diagonal(a, [range(0, 5), range(5, 9), range(9, 12)])
    np.testing.assert_allclose(by_sizes.matmat(X), exact @ X, rtol=1e-13)
    np.testing.assert_allclose(by_sizes.to_dense(), exact, rtol=1e-13)
    np.testing.assert_allclose(by_sizes.block(1), a[5:9, 5:9], rtol=1e-13)
    as_list = BlockDiagonalOperator(a, groups=[[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]])
    np.testing.assert_allclose(as_list.to_dense(), exact, rtol=1e-13)
    # a non-symmetric matrix: the adjoint is the block diagonal of the transpose
    b = np.arange(144.0).reshape(12, 12)
    non_symmetric = BlockDiagonalOperator(b, block_sizes=[6, 6])
    exact = _block_diagonal(b, [range(6), range(6, 12)])
    np.testing.assert_allclose(non_symmetric.rmatmat(X), exact.T @ X, rtol=1e-13)
    np.testing.assert_allclose(non_symmetric.H.matmat(X), exact.T @ X, rtol=1e-13)


def test_cost_one_call_per_block_of_vectors_and_zero_columns_skipped():
    a = random_symmetric(10, seed=5)
    counted = BlockOperator(a)
    block_op = BlockDiagonalOperator(counted, block_sizes=[3, 3, 4])
    block_op.matmat(np.ones((10, 4)))
    assert counted.matmat_calls == 1 and counted.columns == 12  # 3 blocks × 4 vectors
    inside = np.zeros(10)
    inside[4] = 1.0  # a vector inside one block costs one product
    np.testing.assert_allclose(block_op.matvec(inside)[3:6], a[3:6, 4], rtol=1e-14)
    assert counted.columns == 13
    block_op.to_dense()  # n products in all, one call per block
    assert counted.columns == 23 and counted.matmat_calls == 5


def test_layer_groups_names():
    names, members = layer_groups(
        ["net/hidden/kernel", "net/hidden/bias", "net/logits/kernel", "net/logits/bias"]
    )
    assert names == ["hidden", "logits"] and members == [[0, 1], [2, 3]]
    names, members = layer_groups(["a/w", "b/w", "b/c", "scalar"])
    assert names == ["a", "b", "scalar"] and members == [[0], [1, 2], [3]]


def test_invalid_arguments():
    a = np.eye(6)
    with pytest.raises(TypeError, match=r"^BlockDiagonalOperator: op must be a LinearOperator"):
        BlockDiagonalOperator("matrix", block_sizes=[6])
    with pytest.raises(ValueError, match=r"op must be square, got shape \(6, 3\)"):
        BlockDiagonalOperator(np.ones((6, 3)), block_sizes=[3])
    with pytest.raises(ValueError, match="has no variable_names/variable_shapes"):
        BlockDiagonalOperator(a)
    with pytest.raises(ValueError, match="give groups or block_sizes, not both"):
        BlockDiagonalOperator(a, groups=[[0, 1, 2, 3, 4, 5]], block_sizes=[6])
    with pytest.raises(
        ValueError, match=r"block_sizes sum to 5, but the operator's dimension is 6"
    ):
        BlockDiagonalOperator(a, block_sizes=[2, 3])
    with pytest.raises(ValueError, match=r"^block_sizes\[1\] must be an integer >= 1, got 0$"):
        BlockDiagonalOperator(a, block_sizes=[6, 0])
    with pytest.raises(TypeError, match=r"^block_sizes\[0\] must be an integer, got 3.0"):
        BlockDiagonalOperator(a, block_sizes=[3.0, 3])
    with pytest.raises(TypeError, match="block_sizes must be a list of positive integers"):
        BlockDiagonalOperator(a, block_sizes=6)
    with pytest.raises(
        ValueError, match=r"index 2 is in groups 'block_0' and 'block_1': groups must not overlap"
    ):
        BlockDiagonalOperator(a, groups=[[0, 1, 2], [2, 3, 4, 5]])
    with pytest.raises(ValueError, match=r"1 of the 6 indices are in no group \(the first is 5\)"):
        BlockDiagonalOperator(a, groups=[[0, 1, 2], [3, 4]])
    with pytest.raises(ValueError, match=r"groups\[1\]: index 6 is out of range \[0, 6\)"):
        BlockDiagonalOperator(a, groups=[[0, 1, 2], [3, 4, 5, 6]])
    with pytest.raises(TypeError, match=r"groups\['b'\] must hold integer indices, got 3.0"):
        BlockDiagonalOperator(a, groups={"a": [0, 1, 2], "b": [3.0, 4, 5]})
    with pytest.raises(TypeError, match="groups must be a list of index lists or a mapping"):
        BlockDiagonalOperator(a, groups="layers")
    with pytest.raises(ValueError, match="groups is empty"):
        BlockDiagonalOperator(a, groups=[])
    with pytest.raises(ValueError, match=r"groups\[0\] is empty"):
        BlockDiagonalOperator(a, groups=[[], [0, 1, 2, 3, 4, 5]])
    block_op = BlockDiagonalOperator(a, block_sizes=[6])
    with pytest.raises(ValueError, match=r"^index must be < 1 \(the number of blocks\), got 1$"):
        block_op.block(1)


class _TwoLayersNamedD(keras.Model):
    """The reviewer's subclassed model: two Dense layers both named "d", so the variable
    paths are m/d/kernel, m/d/bias, m/d/kernel, m/d/bias."""

    def __init__(self):
        super().__init__(name="m")
        self.l1 = keras.layers.Dense(3, activation="tanh", name="d", dtype="float64")
        self.l2 = keras.layers.Dense(2, name="d", dtype="float64")

    def call(self, x):
        return self.l2(self.l1(x))


@pytest.fixture(scope="module")
def same_named_layers():
    """Its GGN (MSE, 6 examples, n = 12 + 8) and the dense matrix."""
    keras.utils.set_random_seed(0)
    legacy = np.random.RandomState(0)  # the reviewer's stream: np.random after that seed
    x = legacy.randn(6, 3)
    y = legacy.randn(6, 2)
    model = _TwoLayersNamedD()
    model(x[:1])
    op = spectra.GGNOperator.from_keras(model, "mse", (x, y))
    return op, op.matmat(np.eye(op.shape[0]))


def test_layers_with_the_same_path_are_separate_blocks(same_named_layers):
    op, dense = same_named_layers
    assert op.variable_names == ["m/d/kernel", "m/d/bias", "m/d/kernel", "m/d/bias"]
    D = BlockDiagonalOperator(op)
    # Before: one block "d" of 20, so D == C.
    assert D.group_names == ["d", "d#2"]
    assert [g.tolist() for g in D.groups] == [list(range(12)), list(range(12, 20))]
    assert np.abs(dense[:12, 12:]).max() > 1e-2  # the dropped cross-layer block is not 0
    np.testing.assert_allclose(
        D.to_dense(), _block_diagonal(dense, D.groups), rtol=1e-12, atol=1e-14
    )


def test_layer_groups_splits_runs_at_a_repeated_path_and_never_merges_runs():
    paths = ["m/d/kernel", "m/d/bias", "m/d/kernel", "m/d/bias"]
    assert layer_groups(paths) == (["d", "d#2"], [[0, 1], [2, 3]])
    # Non-adjacent runs with the same parent stay apart; names stay distinct.
    paths = ["m/a/kernel", "m/b/kernel", "m/a/bias", "m/a#2/x"]
    names, members = layer_groups(paths)
    assert members == [[0], [1], [2], [3]] and len(set(names)) == 4
    assert layer_groups(["net/h/kernel", "net/h/bias", "net/o/kernel"]) == (
        ["h", "o"],
        [[0, 1], [2]],
    )
