"""repeat_estimate: each repeat equals a direct call, the statistics are calibrated by
coverage over many independent draws, and bad input is refused in one line."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.sparse.linalg import aslinearoperator

import spectra
from spectra.analysis.repeats import RepeatResult, repeat_estimate, subsample_indices
from spectra.estimators.results import load

# A linear least-squares population: per-subset Hessian X_Sᵀ X_S / m, λ1 by dense eigh.
_N, _D = 400, 5


@pytest.fixture(scope="module")
def population() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((_N, _D)) * np.array([3.0, 1.5, 1.0, 0.7, 0.3])
    y = x @ rng.standard_normal(_D) + 0.1 * rng.standard_normal(_N)
    return x, y


def _gram(data: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    x = data[0]
    return x.T @ x / len(x)


def _top(matrix: np.ndarray, seed: int) -> float:
    return float(np.linalg.eigvalsh(matrix)[-1])


def test_seed_repeats_equal_direct_calls() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((30, 30))
    op = aslinearoperator(a + a.T)
    result = repeat_estimate(
        lambda o, s: spectra.trace(o, num_products=8, seed=s), op, repeats=4, seed=7
    )
    assert result.kind == "seeds" and result.names == ["trace"]
    np.testing.assert_array_equal(result.seeds, [7, 8, 9, 10])
    for i in range(4):
        direct = spectra.trace(op, num_products=8, seed=7 + i)
        assert abs(result.values[i, 0] - direct.estimate) <= 1e-12 * abs(direct.estimate)
        assert result.bounds[i, 0] == direct.stderr
    values = result.values[:, 0]
    assert result.mean[0] == pytest.approx(values.mean(), rel=1e-14)
    assert result.sd[0] == pytest.approx(values.std(ddof=1), rel=1e-12)
    assert result.sem[0] == pytest.approx(values.std(ddof=1) / 2.0, rel=1e-12)
    half = 3.182446305284263 * result.sem[0]  # t_{0.975, 3}
    assert result.ci_high[0] - result.mean[0] == pytest.approx(half, rel=1e-9)
    assert result.ci_low[0] == pytest.approx(result.mean[0] - half, rel=1e-9)


def test_eigenvalue_seed_spread_is_rounding(population: tuple[np.ndarray, np.ndarray]) -> None:
    op = aslinearoperator(_gram(population))
    result = repeat_estimate(lambda o, s: spectra.eigenvalues(o, k=2, seed=s), op, repeats=3)
    exact = np.linalg.eigvalsh(_gram(population))[::-1][:2]
    assert result.names == ["λ1", "λ2"] and result.bound_kinds == ["error bound"] * 2
    np.testing.assert_allclose(result.mean, exact, rtol=1e-10)
    assert np.all(result.sd <= 1e-10 * exact)


def test_subset_repeats_equal_direct_calls(population: tuple[np.ndarray, np.ndarray]) -> None:
    result = repeat_estimate(_top, data=population, build=_gram, subsample=0.3, repeats=5, seed=11)
    assert result.kind == "subsets" and result.num_examples == _N
    np.testing.assert_array_equal(result.subset_sizes, [120] * 5)
    for i in range(5):
        index = subsample_indices(_N, 0.3, 11, i)
        assert index.size == 120 and np.unique(index).size == 120
        np.testing.assert_array_equal(index, np.sort(index))
        direct = _top(_gram((population[0][index], population[1][index])), 11 + i)
        assert abs(result.values[i, 0] - direct) <= 1e-12 * direct
    others = [set(subsample_indices(_N, 0.3, 11, i).tolist()) for i in range(2)]
    assert others[0] != others[1]


def test_subsets_of_nested_labels_keep_their_structure() -> None:
    x = np.arange(10.0)[:, None]
    data = (x, {"a": np.arange(10), "b": [np.arange(10) * 2]}, None)
    seen = []
    repeat_estimate(
        lambda o, s: float(o),
        data=data,
        build=lambda d: seen.append(d) or 0.0,
        subsample=0.5,
        repeats=2,
    )
    subset = seen[0]
    index = subsample_indices(10, 0.5, 0, 0)
    np.testing.assert_array_equal(subset[0][:, 0], index)
    np.testing.assert_array_equal(subset[1]["a"], index)
    np.testing.assert_array_equal(subset[1]["b"][0], 2 * index)
    assert subset[2] is None


@pytest.fixture(scope="module")
def subset_truth(population: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    """Mean and variance of λ1(X_Sᵀ X_S/m) over random subsets of m = N/4 examples, from
    40 000 subsets (Monte Carlo error far below what the coverage test resolves)."""
    x = population[0]
    rng = np.random.default_rng(99)
    m = _N // 4
    index = np.argsort(rng.random((40_000, _N)), axis=1)[:, :m]
    blocks = x[index]
    grams = np.einsum("tmi,tmj->tij", blocks, blocks) / m
    top = np.linalg.eigvalsh(grams)[:, -1]
    return float(top.mean()), float(top.var(ddof=1))


@pytest.mark.parametrize("repeats", [2, 5])
def test_interval_covers_the_mean_over_subsets_at_the_nominal_rate(
    population: tuple[np.ndarray, np.ndarray], subset_truth: tuple[float, float], repeats: int
) -> None:
    """1000 independent runs at level 0.8: the count of intervals covering the true mean
    over subsets is Binomial(1000, 0.8) (sd 12.6) when sd uses ddof=1, sem = sd/√R and the
    t quantile; ddof=0 gives 726 covers for R=2, a missing √R 973 (R=2) and 968 (R=5),
    a normal instead of a t quantile 646 (R=2) — each far outside ±3.5 sd."""
    true_mean, true_var = subset_truth
    trials, level = 1000, 0.8
    covered = 0
    variances, means, sems = [], [], []
    for trial in range(trials):
        result = repeat_estimate(
            _top,
            data=population,
            build=_gram,
            subsample=0.25,
            repeats=repeats,
            seed=1000 + trial * repeats,
            level=level,
            progress=False,
        )
        covered += bool(result.ci_low[0] <= true_mean <= result.ci_high[0])
        variances.append(result.sd[0] ** 2)
        means.append(result.mean[0])
        sems.append(result.sem[0])
    expected, spread = trials * level, math.sqrt(trials * level * (1 - level))
    assert abs(covered - expected) <= 3.5 * spread, (covered, expected)
    # The sd predicts the spread of independent runs: E[sd²] = σ² (ddof=1), the sem² the
    # variance of the mean (relative sd of these averages: √(2/(R-1)/1000) ≤ 4.5%).
    assert np.mean(variances) / true_var == pytest.approx(1.0, abs=0.16)
    assert np.mean(np.square(sems)) / np.var(means, ddof=1) == pytest.approx(1.0, abs=0.2)


def test_round_trip_through_json(tmp_path, population: tuple[np.ndarray, np.ndarray]) -> None:
    result = repeat_estimate(
        lambda o, s: {"top": _top(o, s), "bottom": float(np.linalg.eigvalsh(o)[0])},
        data=population,
        build=_gram,
        subsample=0.5,
        repeats=3,
    )
    path = tmp_path / "repeats.json"
    result.to_json(path)
    again = load(path)
    assert isinstance(again, RepeatResult) and again.names == ["top", "bottom"]
    for name in ("values", "bounds", "mean", "sd", "sem", "ci_low", "ci_high", "seeds"):
        np.testing.assert_array_equal(getattr(again, name), getattr(result, name))
    assert again.seeds.dtype == np.int64 and np.isnan(again.bounds).all()
    assert again.subset_rule == result.subset_rule and again.subsample == 0.5
    assert RepeatResult.from_dict(result.to_dict()).repeats == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"repeats": 1}, ValueError, "repeats must be an integer >= 2, got 1"),
        ({"repeats": 2.0}, TypeError, "repeats must be an integer"),
        ({"repeats": 3, "subsample": 0.0}, ValueError, "subsample must be a positive"),
        ({"repeats": 3, "subsample": 1.5}, ValueError, r"subsample must be a fraction .* 1.5"),
        ({"repeats": 3, "subsample": 0.001}, ValueError, "leaves no example per subset"),
        ({"repeats": 3, "subsample": "half"}, TypeError, "subsample must be a number"),
        ({"repeats": 3, "level": 1.0}, ValueError, "level must be"),
        ({"repeats": 3, "seed": -1}, ValueError, "seed must be a non-negative integer"),
    ],
)
def test_bad_input_is_refused(
    population: tuple[np.ndarray, np.ndarray], kwargs: dict, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        repeat_estimate(_top, data=population, build=_gram, **{"subsample": 0.5, **kwargs})


def test_misuse_is_refused(population: tuple[np.ndarray, np.ndarray]) -> None:
    op = _gram(population)
    with pytest.raises(ValueError, match="rebuilt on each subset"):
        repeat_estimate(_top, op, repeats=2, subsample=0.5)
    with pytest.raises(ValueError, match="needs an operator"):
        repeat_estimate(_top, repeats=2)
    with pytest.raises(ValueError, match="subsample needs data"):
        repeat_estimate(_top, data=population, repeats=2, subsample=0.5)
    with pytest.raises(TypeError, match="estimate must be callable"):
        repeat_estimate(None, op, repeats=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="estimate must return"):
        repeat_estimate(lambda o, s: "λ1", op, repeats=2)
    with pytest.raises(ValueError, match="different numbers of examples"):
        repeat_estimate(
            _top, data=(np.zeros((4, 2)), np.zeros(5)), build=_gram, subsample=0.5, repeats=2
        )
    with pytest.raises(ValueError, match="every repeat must estimate the same"):
        repeat_estimate(lambda o, s: np.zeros(s + 1), op, repeats=2)


@pytest.mark.slow
def test_keras_subsets_match_the_dense_hessian_of_each_subset() -> None:
    """A tiny float64 Keras model: repeat i's λ1, λ2 are those of the explicit Hessian
    (tf.GradientTape.jacobian) of the loss on subset i, to the eigenvalues' error bounds."""
    import keras
    import tensorflow as tf
    from _dense import dense_hessian

    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 3))
    y = rng.integers(0, 3, 40)
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="float64"),
            keras.layers.Dense(4, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")

    def build(subset: tuple[np.ndarray, np.ndarray]) -> spectra.HessianOperator:
        return spectra.HessianOperator.from_keras(model, loss, subset, dtype=np.float64)

    result = repeat_estimate(
        lambda o, s: spectra.eigenvalues(o, k=2, seed=s),
        data=(x, y),
        build=build,
        subsample=0.5,
        repeats=3,
        seed=2,
    )
    for i in range(3):
        index = subsample_indices(40, 0.5, 2, i)
        xs, ys = tf.constant(x[index]), tf.constant(y[index])
        hessian = dense_hessian(lambda xs=xs, ys=ys: loss(ys, model(xs)), model.trainable_variables)
        exact = np.linalg.eigvalsh(hessian)[::-1][:2]
        tolerance = np.maximum(result.bounds[i], 1e-12 * exact[0])
        assert np.all(np.abs(result.values[i] - exact) <= tolerance), (i, result.values[i], exact)
    assert result.sd[0] > 1e-3 * result.mean[0]  # the subsets differ


def test_full_value_and_shift_show_the_subsets_bias(
    population: tuple[np.ndarray, np.ndarray], subset_truth: tuple[float, float]
) -> None:
    """``full`` (the estimate on all the data) gives ``full_values`` and ``shift`` =
    (mean − full)/sd; λ1 of N/4-example subsets is larger on average than the full-data λ1
    (the bias the shift reports), and it round-trips through JSON."""
    full = _top(_gram(population), 0)
    assert full == pytest.approx(np.linalg.eigvalsh(population[0].T @ population[0] / _N)[-1])
    # The exact mean over subsets (Monte Carlo over 40 000) lies above the full value.
    assert subset_truth[0] > full + 3 * math.sqrt(subset_truth[1] / 40_000)
    result = repeat_estimate(
        _top, data=population, build=_gram, subsample=0.25, repeats=5, seed=2, full=full
    )
    np.testing.assert_array_equal(result.full_values, [full])
    expected = (result.values[:, 0].mean() - full) / result.values[:, 0].std(ddof=1)
    assert result.shift[0] == pytest.approx(expected, rel=1e-12)
    again = RepeatResult.from_dict(result.to_dict())
    np.testing.assert_array_equal(again.shift, result.shift)
    assert (
        repeat_estimate(_top, data=population, build=_gram, subsample=0.5, repeats=2).shift is None
    )
    with pytest.raises(ValueError, match=r"full holds the quantities \['a'\]"):
        repeat_estimate(
            _top, data=population, build=_gram, subsample=0.5, repeats=2, full={"a": 1.0}
        )
