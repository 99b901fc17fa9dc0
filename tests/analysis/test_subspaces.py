"""Subspace overlaps on known subspaces, and the gradient in the top eigenspace."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _dense import dense_hessian, flat_gradient

import spectra
from spectra.analysis.subspaces import orthonormal_basis


def test_inside_orthogonal_and_at_an_angle(rng):
    basis = rng.standard_normal((20, 3))
    inside = basis @ rng.standard_normal(3)
    q, _ = np.linalg.qr(basis)
    outside = rng.standard_normal(20)
    outside -= q @ (q.T @ outside)
    assert float(spectra.subspace_overlap(inside, basis)) == pytest.approx(1.0, abs=1e-12)
    assert float(spectra.subspace_overlap(outside, basis)) == pytest.approx(0.0, abs=1e-12)
    # v = cos φ·a + sin φ·b with a unit in the span, b unit and orthogonal: cos²φ.
    a, b = inside / np.linalg.norm(inside), outside / np.linalg.norm(outside)
    angles = np.array([0.1, 0.7, 1.2])
    vectors = np.cos(angles) * a[:, None] + np.sin(angles) * b[:, None]
    overlaps = spectra.subspace_overlap(3.5 * vectors, basis)  # scale does not matter
    np.testing.assert_allclose(overlaps, np.cos(angles) ** 2, atol=1e-12)
    assert overlaps.shape == (3,)
    assert spectra.subspace_overlap(inside, basis).shape == ()


def test_rank_deficient_and_one_dimensional_bases(rng):
    basis = rng.standard_normal((15, 2))
    dependent = np.c_[basis, basis @ [2.0, -1.0], basis[:, :1]]  # rank 2 in 4 columns
    assert orthonormal_basis(dependent).shape == (15, 2)
    vectors = rng.standard_normal((15, 4))
    np.testing.assert_allclose(
        spectra.subspace_overlap(vectors, dependent),
        spectra.subspace_overlap(vectors, basis),
        atol=1e-12,
    )
    direction = rng.standard_normal(15)
    expected = (vectors.T @ direction) ** 2 / (direction @ direction) / np.sum(vectors**2, axis=0)
    np.testing.assert_allclose(spectra.subspace_overlap(vectors, direction), expected, rtol=1e-12)
    # The whole space: every vector is inside.
    np.testing.assert_allclose(spectra.subspace_overlap(vectors, np.eye(15)), 1.0, atol=1e-12)


def test_bad_input_is_refused_clearly(rng):
    basis = rng.standard_normal((10, 2))
    with pytest.raises(ValueError, match="vectors have length 9 but the basis vectors 10"):
        spectra.subspace_overlap(np.ones(9), basis)
    with pytest.raises(ValueError, match=r"vectors \[1\] are zero"):
        spectra.subspace_overlap(np.c_[np.ones(10), np.zeros(10)], basis)
    with pytest.raises(ValueError, match="basis is zero"):
        spectra.subspace_overlap(np.ones(10), np.zeros((10, 2)))
    with pytest.raises(ValueError, match="NaN or Inf"):
        spectra.subspace_overlap(np.r_[np.ones(9), np.nan], basis)
    with pytest.raises(ValueError, match="shape"):
        spectra.subspace_overlap(np.ones((10, 2, 2)), basis)
    with pytest.raises(ValueError, match="shape"):
        spectra.subspace_overlap(np.ones(10), np.ones((10, 0)))
    with pytest.raises(TypeError, match="no gradient"):
        spectra.gradient_overlap(np.eye(4), k=1)


def test_gradient_overlap_against_dense_eigenvectors():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="float64"),
            keras.layers.Dense(6, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((40, 5)), rng.integers(0, 3, 40)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
    op = spectra.HessianOperator.from_keras(model, loss, (x, y))
    H = dense_hessian(lambda: loss(y, model(x)), model.trainable_variables)
    g = flat_gradient(lambda: loss(y, model(x)), model.trainable_variables)
    vectors = np.linalg.eigh(H)[1][:, ::-1][:, :3]
    result = spectra.gradient_overlap(op, k=3, tol=1e-12)
    per_direction = (vectors.T @ g) ** 2 / (g @ g)
    np.testing.assert_allclose(result.per_direction, per_direction, rtol=1e-6, atol=1e-12)
    assert result.overlap == pytest.approx(per_direction.sum(), rel=1e-6)
    assert result.gradient_norm == pytest.approx(np.linalg.norm(g), rel=1e-10)
    assert result.converged.all() and result.to_dict()["type"] == "GradientOverlapResult"
