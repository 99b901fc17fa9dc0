"""spectra._jax_compat and spectra._keras_compat: each workaround does what it says, and
each private API has a fallback that works when it is hidden."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from _jax_models import SCCE, classification_data, matrix, mlp, relative_error

from spectra import _jax_compat, _keras_compat
from spectra.operators import memory
from spectra.operators.jax import FisherOperator, GGNOperator, HessianOperator
from spectra.operators.jax.engine import unreached_inputs


def _float64_tanh_jaxpr():
    """The jaxpr of keras.ops.tanh of a float64 array (traced anew: JAX keeps traces of a
    function it has seen)."""
    with jax.enable_x64(True):
        return jax.make_jaxpr(lambda t: keras.ops.tanh(t))(jnp.ones(3, jnp.float64))


def test_keras_computes_float64_tanh_in_float32_and_exact_float64_fixes_it():
    assert _jax_compat.low_precision_ops(_float64_tanh_jaxpr())  # the downcast is there
    with _jax_compat.exact_float64():
        assert _jax_compat.low_precision_ops(_float64_tanh_jaxpr()) == []
    assert _jax_compat.low_precision_ops(_float64_tanh_jaxpr())  # and only within


def test_without_the_promotion_map_float64_is_refused_naming_the_operation(monkeypatch):
    monkeypatch.setattr(_jax_compat, "_promotion_map", lambda: None)
    _jax_compat.set_random_seed(8)
    model = mlp("tanh", hidden=3)  # a model of its own: no compiled functions yet
    x, y = classification_data(6)
    with pytest.raises(TypeError, match=r"dtype=float64: .* tanh \(float32\)") as info:
        HessianOperator.from_keras(model, SCCE, (x, y), dtype=np.float64).loss()
    assert "\n" not in str(info.value)
    relu = mlp("relu", hidden=3)  # computes in float64 all the same
    op = HessianOperator.from_keras(relu, SCCE, (x, y), dtype=np.float64)
    assert np.isfinite(op.loss())


def test_float64_scope_is_the_calling_thread_s_only():
    with _jax_compat.float64_scope():
        assert jnp.ones(2, jnp.float64).dtype == np.float64
    assert jnp.ones(2).dtype == np.float32 and not jax.config.jax_enable_x64


def test_softmax_outputs_are_recorded_and_cross_entropies_read_their_logits():
    logits = jnp.asarray([[1.0, 2.0, 3.0]])
    with _jax_compat.keras_logits() as registry:
        probabilities = keras.activations.softmax(logits)
        assert registry.logits_of(probabilities)[0] is logits
        value = keras.losses.sparse_categorical_crossentropy(jnp.asarray([2]), probabilities)
        assert registry.was_read(probabilities)
    expected = -jax.nn.log_softmax(logits)[0, 2]
    assert float(value[0]) == pytest.approx(float(expected), rel=1e-6)
    # Outside the context, Keras' own functions.
    again = keras.losses.sparse_categorical_crossentropy(jnp.asarray([2]), probabilities)
    assert float(again[0]) == pytest.approx(float(expected), rel=1e-5)


def test_without_the_backend_functions_the_split_is_at_the_probabilities(monkeypatch):
    def softmax_model():
        _jax_compat.set_random_seed(9)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])

    x, y = classification_data(6)
    ce = keras.losses.SparseCategoricalCrossentropy()
    at_logits = matrix(GGNOperator.from_keras(softmax_model(), ce, (x, y), dtype=np.float64))
    monkeypatch.setattr(_jax_compat, "_backend_nn", lambda: None)
    # Another model (new compiled functions), traced without the backend's functions.
    fallback = GGNOperator.from_keras(softmax_model(), ce, (x, y), dtype=np.float64)
    at_probabilities = matrix(fallback)
    assert relative_error(at_probabilities, at_logits) > 1e-3  # a different matrix
    # Split at the probabilities, G = Jᵀ ∇²ℓ J with ∇²ℓ = ∇ℓ ∇ℓᵀ (ℓ = −log p_y): the
    # empirical Fisher of the model.
    empirical = FisherOperator.from_keras(
        softmax_model(), ce, (x, y), kind="empirical", dtype=np.float64
    )
    assert relative_error(at_probabilities, matrix(empirical)) < 1e-10


def test_device_memory_on_the_cpu_and_the_memory_budget_reads_it(monkeypatch):
    assert _jax_compat.first_device_memory() is None  # a CPU has no bytes_limit
    monkeypatch.setattr(_jax_compat, "first_device_memory", lambda: 3 << 30)
    assert memory.available_memory() == 3 << 30
    assert memory.default_memory_budget() == 3 << 29


def test_set_random_seed_and_its_fallback(monkeypatch):
    def initial() -> np.ndarray:
        return np.asarray(mlp("tanh").layers[0].kernel.value)

    _jax_compat.set_random_seed(21)
    first = initial()
    _jax_compat.set_random_seed(21)
    assert np.array_equal(initial(), first)
    monkeypatch.setattr(_jax_compat, "_keras_seed_state", lambda: None)
    _jax_compat.set_random_seed(21)  # keras.utils.set_random_seed (no TensorFlow here)
    assert np.array_equal(initial(), first)


def test_unreached_inputs_of_a_jaxpr():
    jaxpr = jax.make_jaxpr(lambda a, b, c: (jnp.sin(a) * c, b))(1.0, 2.0, 3.0)
    assert unreached_inputs(jaxpr, range(3), output=0) == [1]
    assert unreached_inputs(jaxpr, range(3), output=1) == [0, 2]


# -- spectra._keras_compat: the same answers with the private attributes hidden -----------
class _Without:
    """``obj`` with some attributes hidden (reads of them raise AttributeError)."""

    def __init__(self, obj, *hidden):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_hidden", set(hidden))

    def __getattr__(self, name):
        if name in object.__getattribute__(self, "_hidden"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_obj"), name)


def _functional():
    inputs = keras.Input((4,), name="features")
    hidden = keras.layers.Dense(5)(inputs)
    outputs = keras.layers.Dropout(0.5)(keras.layers.Dense(3)(hidden))
    return keras.Model(inputs, outputs)


def test_flatten_layers_and_its_fallback():
    def computing(layers):  # the layers that compute (inputs aside)
        return {id(layer) for layer in layers if not isinstance(layer, keras.layers.InputLayer)}

    inner = keras.Sequential([keras.layers.Dense(2)])
    model = keras.Sequential([keras.Input((4,)), inner])
    found = computing(_keras_compat.flatten_layers(model))
    assert found == {id(inner), id(inner.layers[0])}
    assert computing(_keras_compat.flatten_layers(_Without(model, "_flatten_layers"))) == found


def test_seed_state_variables_and_their_fallback():
    model = _functional()
    states = _keras_compat.seed_state_variables(model)
    assert len(states) == 1 and str(states[0].path).endswith("seed_generator_state")
    assert _keras_compat._seed_states_by_name(model) == states


def test_functional_structure_and_layer_inputs_and_their_fallbacks():
    model = _functional()
    inputs, outputs, layers = _keras_compat.functional_structure(model)
    public = _keras_compat.functional_structure(_Without(model, "_inputs_struct", "_functional"))
    assert public[0] is inputs and public[1] is outputs and public[2] == layers
    dense = model.layers[1]
    assert _keras_compat.layer_input_tensors(dense) == [inputs]
    assert _keras_compat.layer_input_tensors(_Without(dense, "_inbound_nodes")) == [inputs]


def test_loss_function_kwargs_and_its_fallback():
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    found = _keras_compat.loss_function_kwargs(loss)
    assert found["from_logits"] is True and found["axis"] == -1
    fallback = _keras_compat.loss_function_kwargs(_Without(loss, "_fn_kwargs"))
    assert fallback["from_logits"] is True and fallback.items() <= found.items()
