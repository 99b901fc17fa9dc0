"""KroneckerProducts against dense matrices assembled with numpy.kron."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

from spectra.operators.kronecker_products import KroneckerBlock, KroneckerProducts


def _psd(rng, n):
    B = rng.standard_normal((n, n + 2))
    return B @ B.T / n


def _layout(rng, eigen_form):
    """Three blocks (kernel and bias, kernel only, bias only) and two other slices,
    interleaved in the flat vector; the dense matrix built independently."""
    shapes = [(4, 3, True), (2, 5, False), (0, 2, True)]  # (d_in, d_out, bias)
    blocks, dense_blocks, order = [], [], []
    start = 0
    other_slices, other_values = [], []
    for index, (d_in, d_out, bias) in enumerate(shapes):
        if index == 1:  # an "other" variable between two blocks
            other_slices.append(slice(start, start + 3))
            other_values.append(rng.uniform(0.5, 2.0, 3))
            order.append(("other", 0))
            start += 3
        kernel = slice(start, start + d_in * d_out) if d_in else None
        start += d_in * d_out
        bias_slice = slice(start, start + d_out) if bias else None
        start += d_out if bias else 0
        d_a = d_in + bias
        A, G = _psd(rng, d_a), _psd(rng, d_out)
        if eigen_form:
            _, QA = np.linalg.eigh(A)
            _, QG = np.linalg.eigh(G)
            S = rng.uniform(0.1, 3.0, (d_a, d_out))
            block = KroneckerBlock(kernel, bias_slice, d_out, QA=QA, QG=QG, scalings=S)
            Q = np.kron(QA, QG)
            dense = Q @ np.diag(S.ravel()) @ Q.T
        else:
            block = KroneckerBlock(kernel, bias_slice, d_out, A=A, G=G)
            dense = np.kron(A, G)
        blocks.append(block)
        # The block's rows in the flat vector: kernel rows (row-major), then the bias.
        index_rows = []
        if kernel is not None:
            index_rows += list(range(kernel.start, kernel.stop))
        if bias_slice is not None:
            index_rows += list(range(bias_slice.start, bias_slice.stop))
        dense_blocks.append((np.array(index_rows), dense))
    other_slices.append(slice(start, start + 2))
    other_values.append(rng.uniform(0.5, 2.0, 2))
    start += 2
    full = np.zeros((start, start))
    for rows, dense in dense_blocks:
        full[np.ix_(rows, rows)] = dense
    for s, values in zip(other_slices, other_values):
        full[s, s] = np.diag(values)
    return start, blocks, other_slices, np.concatenate(other_values), full


@pytest.mark.parametrize("eigen_form", [False, True], ids=["kronecker", "eigen"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_products_match_the_dense_matrix(eigen_form, dtype):
    rng = np.random.default_rng(0)
    size, blocks, others, diagonal, full = _layout(rng, eigen_form)
    products = KroneckerProducts(size, blocks, others, diagonal, dtype)
    tol = 1e-13 if dtype == np.float64 else 2e-6
    for k in (1, 4):
        X = rng.standard_normal((size, k))
        out = products(X)
        assert out.dtype == dtype and out.shape == (size, k)
        np.testing.assert_allclose(out, full @ X, rtol=0, atol=tol * np.abs(full @ X).max())
    assert products.num_traces == 1  # one trace for every number of vectors
    assert (
        products.nbytes
        == sum(f.nbytes for b in blocks for f in b.factors()) * (np.dtype(dtype).itemsize / 8)
        + diagonal.size * np.dtype(dtype).itemsize
    )
    assert products.peak_bytes(4) > 4 * size * 4 * np.dtype(dtype).itemsize - 1


def test_no_blocks_is_the_diagonal():
    rng = np.random.default_rng(1)
    diagonal = rng.uniform(1, 2, 6)
    products = KroneckerProducts(6, [], [slice(0, 6)], diagonal, np.float64)
    X = rng.standard_normal((6, 2))
    np.testing.assert_allclose(products(X), diagonal[:, None] * X, rtol=1e-15)


def test_the_eigen_form_with_inverse_scalings_is_the_inverse():
    """S = 1/(αγᵀ + δ) in K-FAC's eigenbasis gives (A ⊗ G + δI)⁻¹ (scipy's solve as truth)."""
    rng = np.random.default_rng(2)
    A, G = _psd(rng, 4), _psd(rng, 3)
    alpha, QA = np.linalg.eigh(A)
    gamma, QG = np.linalg.eigh(G)
    damping = 0.1
    block = KroneckerBlock(
        slice(0, 9), slice(9, 12), 3, QA=QA, QG=QG, scalings=1 / (np.outer(alpha, gamma) + damping)
    )
    products = KroneckerProducts(12, [block], [], np.zeros(0), np.float64)
    X = rng.standard_normal((12, 3))
    truth = scipy.linalg.solve(np.kron(A, G) + damping * np.eye(12), X, assume_a="pos")
    np.testing.assert_allclose(products(X), truth, rtol=1e-12)
