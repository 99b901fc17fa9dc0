"""Private Keras APIs that do not depend on the backend, each with a fallback.

What both engines read of a Keras model below its public API: the TensorFlow engine's
copies of these live in :mod:`spectra._tf_compat`, beside TensorFlow's own internals; the
code shared by both engines (:mod:`spectra.operators.losses`,
:mod:`spectra.operators.keras_calls`, :mod:`spectra.operators.keras_data`) and the JAX
engine read them here, so that the JAX path imports no TensorFlow. Checked with Keras
3.15; each fallback is exercised by ``tests/jax_engine/test_jax_compat.py`` (by hiding
the private attribute):

* :func:`flatten_layers` lists a model's layers recursively (``Layer._flatten_layers``);
  fallback: a walk over the public ``layers`` attributes.
* :func:`seed_state_variables` finds the state variables of a model's
  ``keras.random.SeedGenerator`` objects (``Layer._seed_generators``); fallback: the
  non-trainable variables whose path ends in ``seed_generator_state``.
* :func:`functional_structure` reads the nested input and output structure of a
  functional or Sequential model (``_inputs_struct``/``_outputs_struct``, a Sequential's
  ``_functional``); fallback: the public ``input``/``output`` of a functional model and
  ``inputs``/``outputs`` of a Sequential.
* :func:`layer_input_tensors` lists the tensors a layer was called on in the model's graph
  (``Layer._inbound_nodes``); fallback: the public ``layer.input`` (its first call).
* :func:`optimizer_slots` reads the per-variable state of a Keras optimizer (Adam's second
  moments, ...) from its private slot lists (``_velocities``, ``_velocity_hats``,
  ``_average_gradients``, ``_accumulators``), indexed by ``_get_variable_index``, checked
  with Keras 3.15; fallback: the public ``optimizer.variables``, found by the names Keras
  gives them (``{variable path with '/' as '_'}_{slot}``, ``add_variable_from_reference``).
* :func:`loss_function_kwargs` reads the keyword arguments a Keras loss object passes to
  its per-example function (``LossFunctionWrapper._fn_kwargs``); fallback: its
  ``get_config()`` without the keys every loss has (name, reduction, dtype).

Importing this module imports Keras only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

__all__ = [
    "OPTIMIZER_SLOTS",
    "flatten_layers",
    "functional_structure",
    "layer_input_tensors",
    "loss_function_kwargs",
    "optimizer_slots",
    "seed_state_variables",
]


def flatten_layers(model: Any) -> list[Any]:
    """All layers nested in ``model`` (not the model itself), in no guaranteed order."""
    private = getattr(model, "_flatten_layers", None)
    if private is not None:
        return list(private(include_self=False, recursive=True))
    return _walk_layers(model)


def _walk_layers(model: Any) -> list[Any]:
    found: list[Any] = []
    seen: set[int] = set()
    stack = list(reversed(getattr(model, "layers", [])))
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        found.append(layer)
        stack.extend(reversed(getattr(layer, "layers", [])))
    return found


def seed_state_variables(model: Any) -> list[Any]:
    """The state variables of the ``SeedGenerator`` objects used by ``model``'s layers."""
    layers = [model, *flatten_layers(model)]
    if all(hasattr(layer, "_seed_generators") for layer in layers):
        states: list[Any] = []
        for layer in layers:
            for generator in layer._seed_generators:
                state = getattr(generator, "state", None)
                if state is not None and all(state is not s for s in states):
                    states.append(state)
        return states
    return _seed_states_by_name(model)


def _seed_states_by_name(model: Any) -> list[Any]:
    return [
        v
        for v in model.non_trainable_variables
        if str(getattr(v, "path", v.name)).endswith("seed_generator_state")
    ]


def functional_structure(model: Any) -> tuple[Any, Any, list[Any]] | None:
    """``(inputs, outputs, layers)`` of a functional or Sequential model's graph.

    ``inputs`` and ``outputs`` are nested as the model was built (the KerasTensors of its
    ``Input`` layers and of its outputs: a dict, list or single tensor); None for a
    subclassed model, which declares neither.
    """
    graph = model if hasattr(model, "_inputs_struct") else getattr(model, "_functional", None)
    if graph is not None and hasattr(graph, "_outputs_struct"):
        return graph._inputs_struct, graph._outputs_struct, list(model.layers)
    return _public_structure(model)


def _public_structure(model: Any) -> tuple[Any, Any, list[Any]] | None:
    # A functional model's ``input``/``output`` are the nested structures; a Sequential
    # has one input and one output, listed in ``inputs``/``outputs``.
    with contextlib.suppress(AttributeError, ValueError):
        return model.input, model.output, list(model.layers)
    with contextlib.suppress(AttributeError, ValueError, TypeError):
        inputs, outputs = list(model.inputs), list(model.outputs)
        if len(inputs) == 1 and len(outputs) == 1:
            return inputs[0], outputs[0], list(model.layers)
    return None


def layer_input_tensors(layer: Any) -> list[Any]:
    """The KerasTensors ``layer`` was called on in its model's graph (every call)."""
    nodes = getattr(layer, "_inbound_nodes", None)
    if nodes is not None:
        return [tensor for node in nodes for tensor in node.input_tensors]
    try:
        return list(keras.tree.flatten(layer.input))
    except (AttributeError, ValueError):
        return []


# The keys of ``keras.losses.Loss.get_config()`` (and the wrapper's ``fn``): what is left
# of a loss object's config are the keyword arguments of its per-example function.
_LOSS_CONFIG_KEYS = frozenset({"name", "reduction", "dtype", "fn"})


def loss_function_kwargs(loss: Any) -> dict[str, Any]:
    """The keyword arguments a Keras loss object passes to its per-example function
    (``{"from_logits": True, "axis": -1, ...}``); ``{}`` for one without."""
    kwargs = getattr(loss, "_fn_kwargs", None)
    if kwargs is not None:
        return dict(kwargs)
    get_config = getattr(loss, "get_config", None)
    if get_config is None:
        return {}
    try:
        config = get_config()
    except (NotImplementedError, TypeError, ValueError):
        return {}
    return {k: v for k, v in dict(config or {}).items() if k not in _LOSS_CONFIG_KEYS}


# Keras 3 optimizers' per-variable state: the private slot list and the name Keras gives
# each slot variable, per optimizer class (Adam's ``_velocity_hats`` exist with amsgrad,
# RMSprop's ``_average_gradients`` with centered=True).
OPTIMIZER_SLOTS: Mapping[str, Mapping[str, str]] = {
    "Adam": {"_velocities": "velocity", "_velocity_hats": "velocity_hat"},
    "AdamW": {"_velocities": "velocity", "_velocity_hats": "velocity_hat"},
    "RMSprop": {"_velocities": "velocity", "_average_gradients": "average_gradient"},
    "Adagrad": {"_accumulators": "accumulator"},
}


def optimizer_slots(
    optimizer: Any, variables: Sequence[Any], kind: str
) -> dict[str, list[np.ndarray]]:
    """Per-variable float64 copies of the state of a ``kind`` optimizer (a key of
    :data:`OPTIMIZER_SLOTS`) for ``variables``: ``{slot list name: [array shaped like
    variable i, ...]}``, leaving out the slots it does not have.

    A variable is found by identity (Keras' own key), else by its ``path`` among the
    variables the optimizer was built on (a float64 clone, a model rebuilt with the same
    names). Raises ValueError for a variable the optimizer does not track.
    """
    slots = OPTIMIZER_SLOTS[kind]
    private = hasattr(optimizer, "_get_variable_index") and any(
        hasattr(optimizer, attribute) for attribute in slots
    )
    if private:
        return _private_slots(optimizer, variables, slots)
    return _slots_by_name(optimizer, variables, slots)


def _untracked(optimizer: Any, variable: Any) -> ValueError:
    name = getattr(variable, "path", None) or getattr(variable, "name", repr(variable))
    return ValueError(
        f"variable {name!r} is not tracked by the optimizer {type(optimizer).__name__}: "
        "build the operator on the variables the optimizer trains (e.g. "
        "model.trainable_variables of the same model)"
    )


def _as_array(value: Any, variable: Any) -> np.ndarray:
    return np.asarray(value.numpy(), dtype=np.float64).reshape(tuple(variable.shape))


def _private_slots(
    optimizer: Any, variables: Sequence[Any], slots: Mapping[str, str]
) -> dict[str, list[np.ndarray]]:
    tracked = list(getattr(optimizer, "_trainable_variables", []))
    indices = []
    for variable in variables:
        try:
            index = optimizer._get_variable_index(variable)
        except (KeyError, AttributeError):
            path = getattr(variable, "path", None)
            same = [
                i
                for i, candidate in enumerate(tracked)
                if path is not None
                and getattr(candidate, "path", None) == path
                and tuple(candidate.shape) == tuple(variable.shape)
            ]
            if len(same) != 1:
                raise _untracked(optimizer, variable) from None
            index = same[0]
        indices.append(index)
    found = {}
    for attribute in slots:
        values = getattr(optimizer, attribute, None)
        if values:
            found[attribute] = [_as_array(values[i], v) for i, v in zip(indices, variables)]
    return found


def _slots_by_name(
    optimizer: Any, variables: Sequence[Any], slots: Mapping[str, str]
) -> dict[str, list[np.ndarray]]:
    by_name: dict[str, list[Any]] = {}
    for candidate in optimizer.variables:
        name = str(getattr(candidate, "name", "")).removesuffix(":0").rpartition("/")[2]
        by_name.setdefault(name, []).append(candidate)
    found: dict[str, list[np.ndarray]] = {}
    for attribute, slot in slots.items():
        values: list[np.ndarray | None] = []
        for variable in variables:
            path = getattr(variable, "path", None)
            matches = [] if path is None else by_name.get(f"{path.replace('/', '_')}_{slot}", [])
            matches = [m for m in matches if tuple(m.shape) == tuple(variable.shape)]
            values.append(_as_array(matches[0], variable) if len(matches) == 1 else None)
        missing = [v for v, value in zip(variables, values) if value is None]
        if len(missing) == len(variables):
            continue  # a slot this optimizer does not have
        if missing:
            raise _untracked(optimizer, missing[0])
        found[attribute] = [value for value in values if value is not None]
    names = list(by_name)
    if not found and variables and any(n.endswith(f"_{s}") for n in names for s in slots.values()):
        raise _untracked(optimizer, variables[0])  # it has state, but for other variables
    return found
