"""Every use of a private or version-dependent TensorFlow/Keras API, each with a fallback.

spectra is tested with TensorFlow 2.16-2.21 and Keras 3 (see ``setup.cfg``). The few
places where it reaches below the public API live here, so that a TensorFlow or Keras
release that moves them breaks one small module, and each one has a fallback that is
exercised by ``tests/test_tf_compat.py`` (by hiding the private attribute):

* :func:`call_flat` calls a concrete function with a flat list of tensors through
  ``ConcreteFunction._call_flat`` (skipping argument binding, a few ms per call on small
  models); fallback: the ordinary call.
* :func:`trace_graph` traces a Python function into a graph without automatic control
  dependencies (``tf.compat.v1.wrap_function``); fallback: the graph of a
  ``tf.function`` concrete function (the engine then drops control edges that cross the
  split, see :mod:`spectra.operators.engine`).
* :func:`model_distribute_strategy` reads the strategy a Keras model was built under
  (``Model._distribute_strategy``); fallback: the strategy in scope.
* :func:`flatten_layers` lists a model's layers recursively (``Layer._flatten_layers``);
  fallback: a walk over the public ``layers`` attributes.
* :func:`seed_state_variables` finds the state variables of a model's
  ``keras.random.SeedGenerator``s (``Layer._seed_generators``); fallback: the
  non-trainable variables whose path ends in ``seed_generator_state``.

(The checks of a model's data that read Keras' functional structure live with the other
data checks in :mod:`spectra._validation`.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

SUPPORTED_TENSORFLOW = ">=2.16,<2.22"
SUPPORTED_KERAS = ">=3.3,<4"


def call_flat(function: Any, args: Sequence[tf.Tensor]) -> Any:
    """Call a concrete function with its flat list of tensor arguments.

    The ordinary call path first tries to bind the arguments to a structured signature;
    the flat path skips that. Both return the same tensors.
    """
    flat = getattr(function, "_call_flat", None)
    if flat is None:
        return function(*args)
    return flat(list(args), function.captured_inputs)


def trace_graph(
    fn: Callable[..., Any], signature: Sequence[tf.TensorSpec]
) -> tuple[Any, list, list]:
    """Trace ``fn(*placeholders)`` into a graph: ``(graph, input tensors, output tensors)``.

    ``tf.compat.v1.wrap_function`` traces without automatic control dependencies, so the
    only control edges are the ones the traced code asked for. The inputs are the
    placeholders of ``signature`` followed by those of captured tensors (see
    ``graph.captures``).
    """
    wrap = getattr(getattr(tf, "compat", None), "v1", None)
    wrap = getattr(wrap, "wrap_function", None)
    if wrap is not None:
        wrapped = wrap(fn, list(signature))
        return wrapped.graph, list(wrapped.graph.inputs), list(wrapped.outputs)
    return _trace_with_tf_function(fn, signature)


def _trace_with_tf_function(
    fn: Callable[..., Any], signature: Sequence[tf.TensorSpec]
) -> tuple[Any, list, list]:
    concrete = tf.function(fn, input_signature=list(signature), autograph=False)
    concrete = concrete.get_concrete_function()
    return concrete.graph, list(concrete.graph.inputs), list(concrete.outputs)


def model_distribute_strategy(model: Any) -> tf.distribute.Strategy | None:
    """The ``tf.distribute`` strategy in scope when ``model`` was built, if recorded."""
    strategy = getattr(model, "_distribute_strategy", None)
    if isinstance(strategy, tf.distribute.Strategy):
        return strategy
    return None


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
    """The state variables of the ``SeedGenerator``s used by ``model``'s layers."""
    layers = [model, *flatten_layers(model)]
    if all(hasattr(layer, "_seed_generators") for layer in layers):
        states = []
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
