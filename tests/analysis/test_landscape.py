"""Loss landscapes: the loss at α = 0, curvature along the top eigenvector, 2-D grids,
regularization, batching, random directions, and that the model is never changed."""

from pathlib import Path

import keras
import numpy as np
import pytest

from spectra import HessianOperator, eigenvalues
from spectra.analysis.landscape import LandscapeResult, loss_landscape, random_direction
from spectra.io.checkpoints import load_model
from spectra.io.datasets import load_data

DATA = Path(__file__).resolve().parents[2] / "data"
LOSS = "sparse_categorical_crossentropy"


@pytest.fixture(scope="module")
def digits():
    """The trained digits MLP, 200 examples, and its float64 Hessian's top eigenpair."""
    model = load_model(DATA / "digits_mlp.keras")
    data = load_data(DATA / "digits.npz", max_examples=200, seed=0)
    op = HessianOperator.from_keras(model, LOSS, data.as_tuple(), dtype=np.float64)
    top = eigenvalues(op, k=2, return_eigenvectors=True)
    return model, data, op, top


def test_loss_at_zero_is_the_dataset_loss(digits):
    model, data, op, top = digits
    result = loss_landscape(
        model, LOSS, data.as_tuple(), {"v1": top.eigenvectors[:, 0]}, [-0.1, 0.0, 0.1]
    )
    keras_loss = float(keras.losses.SparseCategoricalCrossentropy()(data.y, model(data.x)))
    assert isinstance(result, LandscapeResult)
    assert result.base_loss == pytest.approx(keras_loss, rel=1e-5)
    assert result.base_loss == pytest.approx(op.loss(), rel=1e-5)
    assert result.losses["v1"][1] == result.base_loss
    assert result.num_examples == 200
    assert result.num_evaluations == 4


def test_curvature_along_the_top_eigenvector_is_lambda_1(digits):
    model, data, _, top = digits
    lambda_1 = top.eigenvalues[0]
    steps = np.array([1e-3, 1e-4])
    result = loss_landscape(
        model,
        LOSS,
        data.as_tuple(),
        {"v1": top.eigenvectors[:, 0]},
        np.concatenate([-steps, steps]),
        dtype=np.float64,
    )
    losses = result.losses["v1"]
    second_difference = (losses[:2] + losses[2:] - 2 * result.base_loss) / steps**2
    # ReLU kinks make larger steps less accurate: about 1.2% at 1e-3, 0.05% at 1e-4.
    relative_error = np.abs(second_difference / lambda_1 - 1)
    assert relative_error[0] < 0.05, (second_difference, lambda_1)
    assert relative_error[1] < 0.01, (second_difference, lambda_1)
    assert result.direction_norms["v1"] == pytest.approx(1.0)
    assert result.settings["dtype"] == "float64"


def test_the_model_is_not_changed(digits):
    model, data, _, top = digits
    before = [w.numpy().copy() for w in model.weights]
    loss_landscape(
        model,
        LOSS,
        data.as_tuple(),
        {"v1": top.eigenvectors[:, 0], "v2": top.eigenvectors[:, 1]},
        [-1.0, 1.0],
        betas=[-1.0, 1.0],
        dtype=np.float64,
    )
    loss_landscape(model, LOSS, data.as_tuple(), {"v1": top.eigenvectors[:, 0]}, [0.5])
    for old, new in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(old, new.numpy())


def test_grid_agrees_with_the_curves(digits):
    model, data, _, top = digits
    v1, v2 = top.eigenvectors[:, 0], top.eigenvectors[:, 1]
    alphas, betas = np.array([-0.5, 0.0, 0.5]), np.array([-0.2, 0.0, 0.2, 0.4])
    grid = loss_landscape(model, LOSS, data.as_tuple(), {"v1": v1, "v2": v2}, alphas, betas=betas)
    curves = loss_landscape(model, LOSS, data.as_tuple(), {"v1": v1, "v2": v2}, alphas)
    along_v2 = loss_landscape(model, LOSS, data.as_tuple(), {"v2": v2}, betas)
    assert grid.losses_2d.shape == (3, 4)
    assert grid.losses == {}
    assert grid.labels == ["v1", "v2"]
    np.testing.assert_allclose(grid.losses_2d[:, 1], curves.losses["v1"], rtol=1e-6)
    np.testing.assert_allclose(grid.losses_2d[1, :], along_v2.losses["v2"], rtol=1e-6)
    point = loss_landscape(model, LOSS, data.as_tuple(), {"d": 0.5 * v1 + 0.4 * v2}, [1.0])
    assert grid.losses_2d[2, 3] == pytest.approx(point.losses["d"][0], rel=1e-6)
    assert grid.to_dict()["losses_2d"][2][3] == grid.losses_2d[2, 3]


def test_batches_give_the_same_loss(digits):
    model, data, _, top = digits
    direction = {"v1": top.eigenvectors[:, 0]}
    whole = loss_landscape(model, LOSS, data.as_tuple(), direction, [0.3], dtype=np.float64)
    batched = loss_landscape(
        model, LOSS, data.as_tuple(), direction, [0.3], batch_size=64, dtype=np.float64
    )
    assert batched.losses["v1"][0] == pytest.approx(whole.losses["v1"][0], rel=1e-12)


def test_regularization_is_included_at_the_shifted_point():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1)),
            keras.layers.Dense(1),
        ]
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((30, 5)).astype(np.float32)
    y = rng.standard_normal((30, 1)).astype(np.float32)
    op = HessianOperator.from_keras(model, "mse", (x, y), dtype=np.float64)
    direction = rng.standard_normal(op.shape[0])
    result = loss_landscape(model, "mse", (x, y), {"d": direction}, [0.0, 0.7], dtype=np.float64)
    assert result.base_loss == pytest.approx(op.loss(), rel=1e-12)

    shifted = keras.models.clone_model(model)
    weights = [w.numpy().astype(np.float64) for w in model.weights]
    moved = [w + 0.7 * d for w, d in zip(weights, op.unflatten(direction), strict=True)]
    shifted.set_weights([w.astype(np.float32) for w in moved])
    expected = float(keras.losses.MeanSquaredError()(y, shifted(x))) + 0.1 * float(
        np.sum(moved[0] ** 2)
    )
    assert result.losses["d"][1] == pytest.approx(expected, rel=1e-5)


def test_random_direction_filter_normalization(digits):
    _, _, op, _ = digits
    direction = random_direction(op, seed=7)
    np.testing.assert_array_equal(direction, random_direction(op, seed=7))
    assert not np.array_equal(direction, random_direction(op, seed=8))
    for piece, variable in zip(op.unflatten(direction), op.variables, strict=True):
        weights = variable.numpy().astype(np.float64)
        if weights.ndim == 1:
            np.testing.assert_array_equal(piece, 0.0)
        else:
            axes = tuple(range(weights.ndim - 1))
            np.testing.assert_allclose(
                np.linalg.norm(piece, axis=axes), np.linalg.norm(weights, axis=axes), rtol=1e-6
            )


def test_random_direction_unit_norm(digits):
    _, _, op, _ = digits
    for like in (op, np.zeros(op.shape[0])):
        direction = random_direction(like, seed=1, normalization="unit")
        assert direction.shape == (op.shape[0],)
        assert np.linalg.norm(direction) == pytest.approx(1.0)
    with pytest.raises(TypeError, match="needs the weights"):
        random_direction(np.zeros(10))
    with pytest.raises(ValueError, match="normalization"):
        random_direction(op, normalization="layer")


def test_bad_directions_are_refused(digits):
    model, data, _, top = digits
    v1 = top.eigenvectors[:, 0]
    with pytest.raises(ValueError, match="shape"):
        loss_landscape(model, LOSS, data.as_tuple(), {"short": v1[:-1]}, [0.1])
    with pytest.raises(ValueError, match="exactly two"):
        loss_landscape(model, LOSS, data.as_tuple(), {"v1": v1}, [0.1], betas=[0.1])
    with pytest.raises(ValueError, match="NaN"):
        loss_landscape(model, LOSS, data.as_tuple(), {"v1": v1 * np.nan}, [0.1])
    with pytest.raises(ValueError, match="empty"):
        loss_landscape(model, LOSS, data.as_tuple(), {}, [0.1])
    with pytest.raises(ValueError, match="alphas"):
        loss_landscape(model, LOSS, data.as_tuple(), {"v1": v1}, [])
