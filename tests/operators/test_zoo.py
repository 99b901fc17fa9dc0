"""Every supported architecture against its dense Hessian (finite differences).

For each model of tests/_zoo.py: the float64 operator's products, gradient and loss agree
with the Hessian of a float64 copy of the model to 1e-9 relative, the float32 operator's
products to 1e-4 (float32 round-off through a few layers is ~1e-6), and the top eigenvalue
from spectra.eigenvalues to 1e-8. The truth is central finite differences of the float64
gradient with Richardson extrapolation (tests/_dense.py), ~5e-12 relative to the exact
Hessian on these models (float64 products round at ~1e-15), so 1e-9 keeps a margin of
~100 and still catches a 1e-4 bug by 10⁵. Nested tapes cannot be the truth: their
second derivatives through tf.nn.moments (LayerNormalization, GroupNormalization,
training-mode BatchNormalization) are wrong, and ``dense_reference`` refuses them. The
reference calls the float64 copy directly, ``model(x, training=...)``, with Keras' loss
and ``model.losses`` — none of spectra's machinery.
"""

from __future__ import annotations

import _zoo
import numpy as np
import pytest
from _dense import nested_tape_hessian, relative_error
from _zoo import ZOO, N, ZooEntry, cast, operator_for, zoo_case

import spectra
from spectra.operators.engine import SPLIT_ENVIRONMENT_VARIABLE, clear_engine_cache


@pytest.fixture(autouse=True)
def _fresh_engines():
    clear_engine_cache()
    yield
    clear_engine_cache()


# Recurrent models take seconds each to trace (TensorFlow differentiating While loops).
_SLOW = {"lstm-masked", "gru", "simple-rnn", "bidirectional-lstm", "keras-scan"}
# Left out of make test (pytest.mark.long, run by make test-all): the recurrent entries
# but the SimpleRNN, which keeps a recurrent model's truth in every run (the JAX job checks
# the LSTM, GRU and bidirectional LSTM against the same truths on its engine), and the
# attention block, whose MultiHeadAttention the transformer block holds (and the layer
# catalogue checks MultiHeadAttention, GroupQueryAttention and Attention one by one); the
# tf.while_loop (the SimpleRNN's While loop stays), keras.ops.cond (on TensorFlow the same
# If op as the tf.cond entry, which stays) and training-mode BatchNormalization on one
# batch (the entry with several batches stays).
_LONG = {
    "lstm-masked",
    "gru",
    "bidirectional-lstm",
    "keras-scan",
    "attention",
    "tf-while-loop",
    "keras-cond",
    "batchnorm-training",
}
# The entries whose case several tests use: built once per module (see ``shared``).
_SHARED = ("mlp", "lstm-masked")


@pytest.fixture(scope="module")
def shared():
    """name -> (data, zoo_case) of the entries in _SHARED, traced once for the tests that
    use them (the LSTM's operators take seconds each); the cases of the others are not
    kept. The data are zoo_case's: the first draws of the same generator."""
    cases: dict[str, tuple] = {}

    def get(entry: ZooEntry) -> tuple:
        assert entry.name in _SHARED, entry.name
        if entry.name not in cases:
            data = entry.data(np.random.default_rng(12345), N, 4)
            cases[entry.name] = data, zoo_case(entry, np.random.default_rng(12345))
        return cases[entry.name]

    return get


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(
            e,
            marks=[pytest.mark.slow] * (e.name in _SLOW) + [pytest.mark.long] * (e.name in _LONG),
        )
        for e in ZOO
    ],
    ids=[e.name for e in ZOO],
)
def test_architecture_against_dense_hessian(entry: ZooEntry, rng, shared):
    case = shared(entry)[1] if entry.name in _SHARED else zoo_case(entry, rng)
    _, _, op64, op32, (H, g, loss) = case
    n = H.shape[0]
    assert op64.shape == (n, n) and n <= 300
    assert op64.product_path == "split", op64.fallback_reason
    V = rng.standard_normal((n, 3))
    assert relative_error(op64.matmat(V), H @ V) < 1e-9
    assert relative_error(op64.matvec(V[:, 0]), H @ V[:, 0]) < 1e-9
    assert relative_error(op64.gradient(), g) < 1e-9
    assert op64.loss() == pytest.approx(loss, rel=1e-10)
    if op32 is not None:
        products32 = op32.matmat(V.astype(np.float32)).astype(np.float64)
        assert op32.dtype == np.float32
        if entry.float32_reference:
            assert relative_error(products32, H @ V) < 1e-4
    top = spectra.eigenvalues(op64, k=1, tol=1e-12, seed=0, progress=False)
    exact = np.linalg.eigvalsh(H)[-1]
    assert abs(top.eigenvalues[0] - exact) <= 1e-8 * abs(exact)


def test_a_zoo_truth_by_nested_tapes_is_refused(rng, monkeypatch):
    entry = next(e for e in ZOO if e.name == "layernorm")
    model = entry.build("float64")
    monkeypatch.setattr(_zoo, "dense_hessian", nested_tape_hessian)
    with pytest.raises(AssertionError, match="nested tapes"):
        _zoo.dense_reference(entry, model, entry.data(rng, N, 4))


@pytest.mark.parametrize(
    "name, clone",
    [("mlp", True), pytest.param("lstm-masked", False, marks=[pytest.mark.slow, pytest.mark.long])],
    ids=["mlp", "lstm-masked"],
)
def test_forced_fallback_agrees_with_the_split_product(name, clone, rng, monkeypatch, shared):
    # Against the split operator of the zoo case's float64 copy: recomputing operators of
    # the float32 model with dtype=float64 (its float64 clone), or for the LSTM, whose
    # clone takes seconds more to trace, of the float64 copy itself.
    entry = next(e for e in ZOO if e.name == name)
    data, (model, model64, split, _, _) = shared(entry)
    options: dict = {"dtype": np.float64}
    if not clone:
        model, data, options = model64, cast(data, "float64"), {}
    monkeypatch.setenv(SPLIT_ENVIRONMENT_VARIABLE, "0")
    for cache in (True, False):
        recompute = operator_for(entry, model, data, cache=cache, **options)
        assert split.product_path == "split" and recompute.product_path == "recompute"
        assert "disabled" in recompute.fallback_reason
        V = rng.standard_normal((split.shape[0], 4))
        assert relative_error(recompute.matmat(V), split.matmat(V)) < 1e-12
        v = V[:, 0]
        assert relative_error(recompute.matvec(v), split.matvec(v)) < 1e-12
        np.testing.assert_allclose(recompute.gradient(), split.gradient(), rtol=1e-12)


@pytest.mark.slow
@pytest.mark.long
def test_repeated_products_on_a_cached_recurrent_model_are_identical(rng, shared):
    # Loop accumulators (TensorLists) are cached; products must never consume them.
    op = shared(next(e for e in ZOO if e.name == "lstm-masked"))[1][2]
    assert op.is_cached
    v = rng.standard_normal(op.shape[0])
    first = op.matvec(v)
    for _ in range(3):
        np.testing.assert_array_equal(op.matvec(v), first)
        np.testing.assert_array_equal(op.matmat(np.stack([v, v], 1))[:, 1], first)
    assert op.cache_nbytes > 0


def test_a_graph_that_cannot_be_split_falls_back_with_one_warning(rng, monkeypatch):
    from spectra.operators import engine

    def fail(self, *args):
        raise engine._ExtractionError("part 'apply' could not be compiled: simulated")

    entry = next(e for e in ZOO if e.name == "mlp")
    model = entry.build("float64")
    data = entry.data(rng, N, 4)
    reference = operator_for(entry, model, data)
    monkeypatch.setattr(engine.Engine, "_build_split", fail)
    clear_engine_cache()
    with pytest.warns(RuntimeWarning, match="could not split.*simulated.*recompute") as caught:
        first = operator_for(entry, model, data)
        second = operator_for(entry, model, data)  # the same compiled engine: no new warning
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert first.product_path == second.product_path == "recompute"
    assert "simulated" in first.fallback_reason
    V = rng.standard_normal((first.shape[0], 3))
    np.testing.assert_allclose(first.matmat(V), reference.matmat(V), rtol=1e-12)
