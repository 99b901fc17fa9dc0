"""Mini-batch sharpness against a direct loop over the same batches with a closed-form truth.

For a linear model z = x W + b under the mean squared error over n examples and d outputs,
L = (1/(n d)) Σ ‖x_i W + b − y_i‖², the Hessian in (W, b) is (2/(n d)) X̃ᵀX̃ ⊗ I_d with
X̃ = [x 1], so λ₁ of a batch's Hessian is (2/(|B| d)) λ_max(X̃_BᵀX̃_B): NumPy's ``eigvalsh``
on the batch, no spectra and no autodiff.
"""

from __future__ import annotations

import json
import math

import keras
import numpy as np
import pytest

from spectra.analysis.minibatch import (
    MinibatchSharpness,
    draw_minibatches,
    minibatch_sharpness,
    summary_scalars,
)

_N, _FEATURES, _OUTPUTS = 48, 3, 2


@pytest.fixture(scope="module")
def linear_problem() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    # Features of different scales, so that batches differ visibly in λ₁.
    x = rng.normal(size=(_N, _FEATURES)) * np.array([2.0, 1.0, 0.3]) + 0.5
    y = rng.normal(size=(_N, _OUTPUTS))
    model = keras.Sequential([keras.Input((_FEATURES,)), keras.layers.Dense(_OUTPUTS)])
    model.set_weights([rng.normal(size=(_FEATURES, _OUTPUTS)), rng.normal(size=_OUTPUTS)])
    return model, x.astype(np.float32), y.astype(np.float32)


def _closed_form_sharpness(x: np.ndarray) -> float:
    augmented = np.hstack([x.astype(np.float64), np.ones((len(x), 1))])
    return 2.0 / (len(x) * _OUTPUTS) * float(np.linalg.eigvalsh(augmented.T @ augmented)[-1])


def test_draw_minibatches_is_sgd_sampling() -> None:
    batches = draw_minibatches(10, 3, 7, seed=5)
    assert len(batches) == 7
    assert all(len(b) == 3 and np.all(np.diff(b) > 0) for b in batches)
    # Three full batches per permutation (the 10th example dropped): disjoint within one.
    for epoch in (batches[0:3], batches[3:6]):
        joined = np.concatenate(epoch)
        assert len(set(joined.tolist())) == 9
    assert [b.tolist() for b in draw_minibatches(10, 3, 7, seed=5)] == [b.tolist() for b in batches]
    assert [b.tolist() for b in draw_minibatches(10, 3, 7, seed=6)] != [b.tolist() for b in batches]


def test_per_batch_sharpness_matches_a_direct_loop(linear_problem) -> None:
    model, x, y = linear_problem
    result = minibatch_sharpness(
        model,
        (x, y),
        "mse",
        batch_size=8,
        num_batches=9,
        seed=11,
        tol=1e-6,
        trace=True,
        trace_products=8,
        progress=False,
    )
    truth = [_closed_form_sharpness(x[index]) for index in draw_minibatches(_N, 8, 9, seed=11)]
    assert result.num_batches == 9 and result.batch_size == 8 and result.seed == 11
    assert all(result.converged)
    # float32 products: λ₁ to ~1e-6 relative, inside the certified bounds.
    for value, bound, expected in zip(result.sharpness, result.error_bounds, truth, strict=True):
        assert abs(value - expected) <= max(bound, 5e-6 * expected)
    np.testing.assert_allclose(result.sharpness, truth, rtol=5e-6)
    # The spread is real (the test would not pass with one value for every batch).
    assert np.std(truth) > 0.05 * np.mean(truth)
    summary = result.summary()
    np.testing.assert_allclose(summary["mean"], np.mean(truth), rtol=5e-6)
    np.testing.assert_allclose(summary["std"], np.std(truth, ddof=1), rtol=1e-4)
    np.testing.assert_allclose(summary["q50"], np.median(truth), rtol=5e-6)
    np.testing.assert_allclose(
        [summary["q05"], summary["q95"]], np.quantile(truth, [0.05, 0.95]), rtol=5e-6
    )
    assert summary["min"] <= summary["q25"] <= summary["q75"] <= summary["max"]
    # The trace of (2/(b d)) X̃ᵀX̃ ⊗ I_d is (2/b) ‖X̃‖²_F: Hutchinson within 5 standard errors.
    for index, trace, stderr in zip(
        draw_minibatches(_N, 8, 9, seed=11), result.traces, result.trace_stderrs, strict=True
    ):
        exact = 2.0 / 8 * (np.sum(x[index].astype(np.float64) ** 2) + 8)
        assert abs(trace - exact) <= 5 * stderr + 1e-5 * exact


def test_batches_partitioning_the_data_average_above_the_full_batch(linear_problem) -> None:
    """λ_max is convex and H is the mean of the H_B of a partition into equal batches, so the
    mean mini-batch sharpness is at least the full-batch one (Jensen)."""
    model, x, y = linear_problem
    batches = [(x[i : i + 12], y[i : i + 12]) for i in range(0, _N, 12)]
    result = minibatch_sharpness(model, loss="mse", batches=batches, tol=1e-7, progress=False)
    assert result.seed is None and result.batch_size == 12 and result.num_batches == 4
    np.testing.assert_allclose(
        result.sharpness, [_closed_form_sharpness(b[0]) for b in batches], rtol=5e-6
    )
    assert result.mean >= _closed_form_sharpness(x) * (1 - 1e-6)


def test_result_serializes_with_threshold_and_scalars() -> None:
    result = MinibatchSharpness(
        batch_size=4,
        num_batches=4,
        seed=0,
        sharpness=[1.0, 2.0, 3.0, 10.0],
        error_bounds=[0.0] * 4,
        converged=[True] * 4,
        threshold=2.5,
    )
    record = json.loads(json.dumps(result.to_dict()))
    assert record["summary"]["fraction_above_threshold"] == 0.5
    assert record["summary"]["q50"] == 2.5 and record["summary"]["mean"] == 4.0
    scalars = summary_scalars(record["summary"])
    assert scalars["sharpness/minibatch_lambda_1_mean"] == 4.0
    assert set(scalars) == {
        f"sharpness/minibatch_lambda_1_{name}"
        for name in ("mean", "std", "q05", "q25", "q50", "q75", "q95")
    }
    single = MinibatchSharpness(1, 1, 0, [1.0], [0.0], [True])
    assert math.isnan(single.std) and "sharpness/minibatch_lambda_1_std" not in summary_scalars(
        single.summary()
    )


def test_bad_input_is_refused_in_one_line(linear_problem) -> None:
    model, x, y = linear_problem
    with pytest.raises(ValueError, match="either data"):
        minibatch_sharpness(model, (x, y), "mse", batch_size=4, batches=[(x, y)])
    with pytest.raises(ValueError, match="batch_size is required"):
        minibatch_sharpness(model, (x, y), "mse")
    with pytest.raises(ValueError, match="larger than the 48 examples"):
        minibatch_sharpness(model, (x, y), "mse", batch_size=49)
    with pytest.raises(TypeError, match="batches="):
        minibatch_sharpness(model, {"x": x}, "mse", batch_size=4)
    with pytest.raises(ValueError, match="needs one loss"):
        minibatch_sharpness(model, (x, y), batch_size=4)
