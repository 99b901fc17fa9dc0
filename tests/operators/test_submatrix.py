"""SubmatrixOperator against the dense submatrix of explicit matrices and of a small
float64 Keras model's Hessian."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _dense import dense_hessian
from _matrices import BlockOperator, random_symmetric

import spectra
from spectra.operators import HessianOperator, SubmatrixOperator


def test_rows_and_columns_of_a_plain_matrix():
    a = np.arange(80.0).reshape(8, 10) ** 1.5
    rows, cols = [5, 0, 7], [9, 2, 3, 4]
    sub = SubmatrixOperator(a, rows, cols)
    assert sub.shape == (3, 4) and sub.dtype == np.float64
    exact = a[np.ix_(rows, cols)]
    rng = np.random.default_rng(0)
    X = rng.standard_normal((4, 2))
    np.testing.assert_allclose(sub.matmat(X), exact @ X, rtol=1e-13)
    np.testing.assert_allclose(sub.matvec(X[:, 0]), exact @ X[:, 0], rtol=1e-13)
    Y = rng.standard_normal((3, 2))
    np.testing.assert_allclose(sub.rmatmat(Y), exact.T @ Y, rtol=1e-13)
    np.testing.assert_allclose(sub.H.matvec(Y[:, 1]), exact.T @ Y[:, 1], rtol=1e-13)
    np.testing.assert_allclose(sub.to_dense(), exact, rtol=1e-13)


def test_default_columns_are_the_rows_and_cost_one_product_per_vector():
    a = random_symmetric(15, seed=1)
    counted = BlockOperator(a)
    indices = np.array([14, 3, 8, 0])
    sub = SubmatrixOperator(counted, indices)
    assert sub.shape == (4, 4)
    np.testing.assert_allclose(sub.to_dense(), a[np.ix_(indices, indices)], rtol=1e-14)
    assert counted.matmat_calls == 1 and counted.columns == 4
    sub.matmat(np.ones((4, 3)))
    assert counted.matmat_calls == 2 and counted.columns == 7
    # symmetric: the estimators accept it
    exact = np.linalg.eigvalsh(a[np.ix_(indices, indices)])
    top = spectra.eigenvalues(sub, k=1, tol=1e-12, seed=0)
    np.testing.assert_allclose(top.eigenvalues[0], exact[-1], rtol=1e-10)


def test_a_layer_of_a_hessian():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(5, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    rng = np.random.default_rng(2)
    x = rng.standard_normal((30, 4))
    y = rng.integers(0, 3, 30)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
    op = HessianOperator.from_keras(model, loss, (x, y), batch_size=16)
    H = dense_hessian(lambda: loss(y, model(x)), model.trainable_variables)
    rows = np.arange(25, 43)  # the second layer (kernel 5·3, bias 3)
    cols = np.array([0, 7, 30, 41])
    sub = SubmatrixOperator(op, rows, cols)
    np.testing.assert_allclose(
        sub.to_dense(), H[np.ix_(rows, cols)], rtol=0, atol=1e-10 * np.max(np.abs(H))
    )
    square = SubmatrixOperator(op, rows)
    np.testing.assert_allclose(
        square.to_dense(), H[np.ix_(rows, rows)], rtol=0, atol=1e-10 * np.max(np.abs(H))
    )


def test_invalid_indices():
    a = np.eye(5)
    with pytest.raises(TypeError, match=r"^SubmatrixOperator: op must be a LinearOperator"):
        SubmatrixOperator([[1, 2], "x"], [0])
    with pytest.raises(TypeError, match=r"^row_indices must hold integer indices, got 1.0"):
        SubmatrixOperator(a, [0, 1.0])
    with pytest.raises(TypeError, match=r"^col_indices must hold integer indices, got True"):
        SubmatrixOperator(a, [0], [True, False])
    with pytest.raises(TypeError, match=r"^row_indices must be a list or 1-D array"):
        SubmatrixOperator(a, 3)
    with pytest.raises(TypeError, match=r"^row_indices must be a list or 1-D array"):
        SubmatrixOperator(a, "012")
    with pytest.raises(ValueError, match=r"^row_indices: index 5 is out of range \[0, 5\)"):
        SubmatrixOperator(a, [0, 5])
    with pytest.raises(ValueError, match=r"^col_indices: index -1 is out of range \[0, 5\)"):
        SubmatrixOperator(a, [0], [-1])
    with pytest.raises(ValueError, match=r"^row_indices: index 2 appears twice$"):
        SubmatrixOperator(a, [2, 1, 2])
    with pytest.raises(ValueError, match=r"^row_indices is empty"):
        SubmatrixOperator(a, [])
    with pytest.raises(ValueError, match=r"^row_indices must be 1-D, got shape \(1, 2\)"):
        SubmatrixOperator(a, [[0, 1]])
