"""Per-layer spectra against the dense diagonal blocks of a small MLP's Hessian."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
from _dense import FD_TRUTH_RTOL, dense_hessian

import spectra


def _mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6,), dtype="float64"),
            keras.layers.Dense(7, activation="tanh", dtype="float64", name="hidden"),
            keras.layers.Dense(4, dtype="float64", name="logits"),
        ],
        name="net",
    )


@pytest.fixture(scope="module")
def problem():
    """The Hessian operator of a float64 MLP (n = 81) on 60 examples in three unequal
    batches, its dense Hessian, and the parameter indices of its two layers."""
    keras.utils.set_random_seed(7)
    model = _mlp()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 6))
    y = rng.integers(0, 4, 60)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
    op = spectra.HessianOperator.from_keras(model, loss, (x, y), batch_size=25)
    H = dense_hessian(lambda: loss(y, model(x)), model.trainable_variables)
    op.loss()  # the first pass over the data fills the cache; counters below start after it
    layers = {"hidden": np.arange(0, 49), "logits": np.arange(49, 81)}
    return op, H, layers


def _block(H: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return H[np.ix_(indices, indices)]


def _hutchinson_sd(block: np.ndarray, num_probes: int) -> float:
    """Standard deviation of the mean of num_probes Rademacher samples zᵀBz."""
    off_diagonal = np.sum(block**2) - np.sum(np.diag(block) ** 2)
    return float(np.sqrt(2 * off_diagonal / num_probes))


def test_default_groups_are_the_layers_and_match_dense_blocks(problem):
    op, H, layers = problem
    passes_before, products_before = op.num_data_passes, op.num_hvps
    result = spectra.layerwise(op, k=3, trace=True, tol=1e-10, num_probes=100, seed=1)
    assert result.groups == ["hidden", "logits"]  # "net/" shared by both is dropped
    assert result.group_sizes == [49, 32]
    assert result.all_converged
    for i, indices in enumerate(layers.values()):
        block = _block(H, indices)
        exact = np.linalg.eigvalsh(block)[::-1][:3]
        np.testing.assert_allclose(result.eigenvalues[i], exact, rtol=1e-8)
        assert np.all(np.abs(result.eigenvalues[i] - exact) <= result.error_bounds[i] + 1e-12)
        assert np.all(result.residual_norms[i] < 1e-4 * exact[0])
        # Hutchinson's mean of 100 samples is close to normal: P(|error| > 4 sd) ≈ 6e-5
        # per group, so this fails by chance with probability < 1e-3 (fixed seed anyway).
        # A bug such as probes leaking into other groups inflates the standard error,
        # which the second check catches.
        assert abs(result.traces[i] - np.trace(block)) <= 4 * result.trace_stderr[i]
        assert 0.6 < result.trace_stderr[i] / _hutchinson_sd(block, 100) < 1.6
    # Every pass is one matmat of the operator: its counters agree with the result's.
    assert op.num_data_passes - passes_before == result.num_operator_calls
    assert op.num_hvps - products_before == result.num_products
    assert result.top_eigenvalues.shape == (2,)
    rows = result.rows()
    assert [row["group"] for row in rows] == ["hidden", "logits"]
    assert {"trace", "trace_stderr", "eigenvalues", "size"} <= set(rows[0])
    decoded = json.loads(result.to_json())
    assert decoded["type"] == "LayerwiseResult" and len(decoded["eigenvalues"][1]) == 3


def test_one_matmat_per_lanczos_step_serves_every_group(problem):
    op, _, _ = problem
    passes_before = op.num_data_passes
    result = spectra.layerwise(op, k=2, tol=1e-8, seed=3)
    calls = op.num_data_passes - passes_before
    # Lanczos steps of the slowest group, plus one pass for the residuals of the Ritz
    # vectors (the symmetry check rides in the first pass).
    assert calls == result.num_operator_calls == max(result.num_steps) + 1
    assert result.num_products == sum(result.num_steps) + 2 * 2 + 2
    # One operator per layer would pay one pass per product of each layer.
    assert calls < sum(result.num_steps)


def test_groups_by_variables_and_by_positions(problem):
    op, H, layers = problem
    hidden_kernel, hidden_bias, logits_kernel, logits_bias = op.variables
    by_kind = spectra.layerwise(
        op,
        k=2,
        groups={"kernels": [hidden_kernel, logits_kernel], "biases": [hidden_bias, logits_bias]},
        tol=1e-10,
        seed=0,
    )
    kernels = np.concatenate([np.arange(0, 42), np.arange(49, 77)])
    biases = np.concatenate([np.arange(42, 49), np.arange(77, 81)])
    for i, indices in enumerate((kernels, biases)):
        exact = np.linalg.eigvalsh(_block(H, indices))[::-1][:2]
        np.testing.assert_allclose(by_kind.eigenvalues[i], exact, rtol=1e-8)
    by_position = spectra.layerwise(op, groups={"a": [0, 1], "b": [2, 3]}, tol=1e-10)
    assert by_position.groups == ["a", "b"]
    for i, indices in enumerate(layers.values()):
        exact = np.linalg.eigvalsh(_block(H, indices))[-1]
        assert by_position.eigenvalues[i][0] == pytest.approx(exact, rel=1e-8)


def test_small_group_gets_all_of_its_eigenvalues(problem):
    op, H, _ = problem
    *_, logits_bias = op.variables
    result = spectra.layerwise(
        op, k=6, groups={"rest": [0, 1, 2], "bias": [logits_bias]}, tol=1e-10
    )
    bias = np.arange(77, 81)
    np.testing.assert_allclose(
        result.eigenvalues[1],
        np.linalg.eigvalsh(_block(H, bias))[::-1],
        rtol=1e-9,
        # The finite-difference truth errs by ~1e-11·‖H‖ per entry (a zero eigenvalue here).
        atol=FD_TRUTH_RTOL * np.linalg.norm(H),
    )
    assert result.num_steps[1] == 4 and result.converged[1].all()


def test_dense_matrix_with_index_groups_and_budget():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((50, 50))
    matrix = a + a.T
    order = rng.permutation(50)
    groups = {"a": order[:30], "b": order[30:45], "c": order[45:]}
    result = spectra.layerwise(matrix, k=3, groups=groups, tol=1e-12)
    assert result.all_converged
    for i, indices in enumerate(groups.values()):
        exact = np.linalg.eigvalsh(_block(matrix, indices))[::-1][:3]
        np.testing.assert_allclose(result.eigenvalues[i], exact, rtol=1e-10)
    # The 30-parameter group restarts (basis of 20); with a budget of 3 products per
    # group nothing large converges, and the report says so instead of inventing digits.
    short = spectra.layerwise(matrix, k=2, groups=groups, num_products=3)
    assert not short.converged[0].any() and short.num_steps == [3, 3, 3]
    assert all(np.all(np.isfinite(values)) for values in short.eigenvalues)


def test_same_eigenvalues_with_and_without_traces(problem):
    op, _, _ = problem
    plain = spectra.layerwise(op, k=1, seed=5)
    with_trace = spectra.layerwise(op, k=1, trace=True, num_probes=4, seed=5)
    for a, b in zip(plain.eigenvalues, with_trace.eigenvalues):
        np.testing.assert_array_equal(a, b)
    assert plain.traces is None and plain.trace_stderr is None
    assert with_trace.traces.shape == (2,)


def test_bad_groups_are_refused_clearly(problem):
    op, _, _ = problem
    hidden_kernel, hidden_bias, logits_kernel, logits_bias = op.variables
    everything = [hidden_kernel, hidden_bias, logits_kernel, logits_bias]
    with pytest.raises(ValueError, match="'net/logits/bias' is in groups 'a' and 'b'"):
        spectra.layerwise(op, groups={"a": everything, "b": [logits_bias]})
    with pytest.raises(ValueError, match=r"in no group: \['net/logits/bias'\]"):
        spectra.layerwise(op, groups={"a": everything[:3]})
    with pytest.raises(ValueError, match="twice"):
        spectra.layerwise(op, groups={"a": [*everything, hidden_bias]})
    with pytest.raises(ValueError, match="is empty"):
        spectra.layerwise(op, groups={"a": everything, "b": []})
    other = keras.Variable(np.zeros(3), name="stranger")
    with pytest.raises(ValueError, match="'stranger' is not one of the operator's variables"):
        spectra.layerwise(op, groups={"a": [*everything, other]})
    with pytest.raises(ValueError, match="out of range"):
        spectra.layerwise(op, groups={"a": [0, 1, 2, 3, 4]})
    with pytest.raises(TypeError, match="mapping"):
        spectra.layerwise(op, groups=[everything])
    # names are not looked up, and a float is not an index: each says so
    with pytest.raises(TypeError, match=r"^groups is the string 'dense': give a mapping"):
        spectra.layerwise(op, groups="dense")
    with pytest.raises(TypeError, match=r"^groups\['a'\] is the string 'dense'"):
        spectra.layerwise(op, groups={"a": "dense"})
    with pytest.raises(TypeError, match=r"^groups\['a'\] holds the string 'net/logits/bias'"):
        spectra.layerwise(op, groups={"a": [*everything[:3], "net/logits/bias"]})
    with pytest.raises(TypeError, match=r"^groups\['a'\] has a non-integer index 1.0"):
        spectra.layerwise(op, groups={"a": [0, 1.0, 2, 3]})
    with pytest.raises(ValueError, match="groups is empty"):
        spectra.layerwise(op, groups={})


def test_non_integer_and_string_indices_are_refused_not_truncated():
    # 0.5 used to become index 0 silently.
    matrix = np.diag(np.arange(1.0, 76.0))
    with pytest.raises(TypeError) as raised:
        spectra.layerwise(matrix, groups={"a": [0.5], "b": range(1, 75)})
    assert str(raised.value) == (
        "groups['a'] has a non-integer index 0.5: give integer parameter indices (0 <= i < 75)"
    )
    for bad in (np.array([0.0]), [True], ["0"]):
        with pytest.raises(TypeError, match=r"^groups\['a'\] has a non-integer index"):
            spectra.layerwise(matrix, groups={"a": bad, "b": range(1, 75)})
    with pytest.raises(TypeError, match=r"^groups\['b'\] is the string 'rest'"):
        spectra.layerwise(matrix, groups={"a": [0], "b": "rest"})
    with pytest.raises(TypeError, match=r"^groups is the string 'dense'"):
        spectra.layerwise(matrix, groups="dense")
    whole = spectra.layerwise(matrix, groups={"a": np.array([0]), "b": range(1, 75)})
    np.testing.assert_allclose(whole.eigenvalues[0], [1.0])


def test_bad_arguments_are_refused_clearly():
    matrix = np.diag(np.arange(1.0, 7.0))
    groups = {"a": [0, 1, 2], "b": [3, 4, 5]}
    with pytest.raises(ValueError, match="pass groups"):
        spectra.layerwise(matrix)
    with pytest.raises(ValueError, match=r"indices must be in \[0, 6\)"):
        spectra.layerwise(matrix, groups={"a": [0, 1, 2], "b": [3, 4, 6]})
    with pytest.raises(ValueError, match="parameter"):
        spectra.layerwise(matrix, groups={"a": [0, 1, 2], "b": [3, 4]})
    with pytest.raises(ValueError, match="k must be"):
        spectra.layerwise(matrix, k=0, groups=groups)
    with pytest.raises(ValueError, match="num_products must be an integer >= 3"):
        spectra.layerwise(matrix, k=3, num_products=2, groups=groups)
    with pytest.raises(ValueError, match="num_probes must be"):
        spectra.layerwise(matrix, trace=True, num_probes=1, groups=groups)
    with pytest.raises(ValueError, match="tol must be"):
        spectra.layerwise(matrix, tol=0.0, groups=groups)
    with pytest.raises(ValueError, match="square"):
        spectra.layerwise(np.ones((6, 5)), groups=groups)
    with pytest.raises(ValueError, match="not symmetric"):
        spectra.layerwise(np.triu(np.ones((6, 6))), groups=groups)


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


def test_layers_with_the_same_path_get_separate_spectra(same_named_layers):
    """spectra.layerwise shares BlockDiagonalOperator's grouping: two layers named "d"
    are two groups (before: one group "d" of 20 whose top eigenvalue was the whole
    matrix's)."""
    op, dense = same_named_layers
    result = spectra.layerwise(op, k=2, tol=1e-10)
    assert result.groups == ["d", "d#2"] and result.group_sizes == [12, 8]
    for block, values in zip((slice(0, 12), slice(12, 20)), result.eigenvalues):
        exact = np.linalg.eigvalsh(dense[block, block])[::-1][:2]
        np.testing.assert_allclose(values, exact, rtol=1e-8, atol=1e-12)
    whole = np.linalg.eigvalsh(dense)[-1]
    assert result.eigenvalues[0][0] < whole - 1e-3  # not the merged matrix's top value


def test_float32_zero_blocks_are_zeros_but_not_certified():
    """float32 cannot tell a zero operator from one whose products flush to zero (a loss
    scaled by 1e-38): zeros, not converged, with the reason; float64 zeros stay certified."""
    from spectra import layerwise

    groups = {"a": range(0, 4), "b": range(4, 10)}
    zero32 = layerwise(np.zeros((10, 10), dtype=np.float32), groups=groups)
    assert [values[0] for values in zero32.eigenvalues] == [0.0, 0.0]
    assert not zero32.all_converged
    assert "exactly 0 in float32" in zero32.settings["not_converged_reason"]
    zero64 = layerwise(np.zeros((10, 10)), groups=groups)
    assert zero64.all_converged and [b[0] for b in zero64.error_bounds] == [0.0, 0.0]
