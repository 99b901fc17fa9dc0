"""Every Keras-on-JAX workaround and private API the JAX engine uses, each with a fallback.

The JAX counterpart of :mod:`spectra._tf_compat`: checked with JAX 0.10.2 and Keras
3.15.1 (:data:`SUPPORTED_JAX`, :data:`SUPPORTED_KERAS`; Keras' backend-independent
internals are in :mod:`spectra._keras_compat`). Each fallback
is exercised by ``tests/jax_engine/test_jax_compat.py`` (by hiding the private attribute):

* :func:`exact_float64` — **Keras 3.15 on JAX computes float64 in float32.** Keras'
  type promotion (``keras.src.backend.common.dtypes``) maps every 64-bit result type to
  32 bits on backends other than TensorFlow (``BIT64_TO_BIT32_DTYPE``, "to be aligned
  with JAX's default"), even with ``jax_enable_x64`` on; so the result type of float64
  with float64 is float32. Probed on float64 models (a clone of the model in float64,
  fed float64 values under ``jax_enable_x64``): Dense, Conv2D, pooling, softmax,
  sigmoid, relu, gelu, softplus, elu, selu, swish, softsign, Dropout and the
  cross-entropy, MSE and Huber losses stay float64; ``tanh`` (a Dense activation, LSTM
  and GRU cells) computes in float32, LayerNormalization, BatchNormalization and
  GroupNormalization add their epsilon in float32 (so the whole normalization is
  float32), GlobalAveragePooling divides in float32, and a SimpleRNN fails outright (its
  loop carry changes dtype). Within :func:`exact_float64` the map keeps float64 (only
  that entry; integers keep Keras' 32 bits), and every one of those is float64. Fallback
  (no such map): nothing is changed, and :func:`low_precision_ops` finds what computes in
  fewer bits, which the engine refuses in one line naming the layer and the operation.
* :func:`float64_scope` — ``jax.enable_x64`` as a context (thread-local, public): the
  operator computes in float64 without setting ``jax_enable_x64`` for the whole process.
* :func:`low_precision_ops` — the operations of a traced float64 computation whose
  floating results have fewer than 64 bits (the layer is the JAX name stack Keras sets),
  searched through every nested computation (``jit``, loops, conditionals, custom
  derivatives).
* :func:`keras_logits` — **the logits behind a softmax or sigmoid output.** On
  TensorFlow, Keras' softmax and sigmoid record their input on their output
  (``_keras_logits``) and its cross-entropies read those logits instead of the
  probabilities (for numerical stability); on JAX an array takes no attribute, so the
  cross-entropies clip the probabilities to [1e-7, 1 − 1e-7] and take their log, a
  different function (and a different split point for the Gauss-Newton matrix). Within
  :func:`keras_logits`, Keras' JAX backend functions ``softmax`` and ``sigmoid``
  (``keras.src.backend.jax.nn``, private) record their outputs in a registry of the
  trace, and ``categorical_crossentropy``, ``sparse_categorical_crossentropy`` and
  ``binary_crossentropy`` read the logits of a recorded output as TensorFlow's backend
  does (``from_logits=True`` on them), so the same ``.keras`` file is the same function
  on both engines. Fallback (no such functions): the cross-entropies read the
  probabilities as Keras computes them on JAX, and the split point of the GGN and the
  Fisher is the output itself.
* :func:`first_device_memory` — the memory of the first accelerator
  (``Device.memory_stats()["bytes_limit"]``, public but None on CPU); fallback: None
  (the memory plan then uses the host's memory).
* :func:`set_random_seed` — ``keras.utils.set_random_seed`` without TensorFlow: Keras'
  own imports TensorFlow when it is installed (to seed it). This sets Python's and
  NumPy's generators and Keras' global seed (``keras.src.backend.common.global_state``,
  private); fallback: ``keras.utils.set_random_seed`` itself.
"""

from __future__ import annotations

import contextlib
import random
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

SUPPORTED_JAX = ">=0.10,<0.11"
SUPPORTED_KERAS = ">=3.15,<4"

__all__ = [
    "LogitsRegistry",
    "activation_of",
    "current_logits",
    "exact_float64",
    "first_device_memory",
    "float64_scope",
    "keras_logits",
    "low_precision_ops",
    "set_random_seed",
]


# -- float64 -----------------------------------------------------------------------------
def _promotion_map() -> dict[str, str] | None:
    """Keras' map of 64-bit result types to 32 bits (private), or None."""
    try:
        from keras.src.backend.common import dtypes
    except ImportError:
        return None
    found = getattr(dtypes, "BIT64_TO_BIT32_DTYPE", None)
    return found if isinstance(found, dict) else None


_float64_lock = threading.Lock()
_float64_depth = 0
_saved_float64: Any = None


@contextlib.contextmanager
def exact_float64() -> Iterator[None]:
    """Within the context, Keras' type promotion keeps float64 (see the module docstring).

    Re-entrant and safe across threads: the map is restored when the outermost context
    exits. Only float64 changes: float32 computations, and integers, promote as Keras
    promotes them.
    """
    global _float64_depth, _saved_float64
    with _float64_lock:
        if _float64_depth == 0:
            table = _promotion_map()
            _saved_float64 = None if table is None else table.get("float64")
            if table is not None:
                table["float64"] = "float64"
        _float64_depth += 1
    try:
        yield
    finally:
        with _float64_lock:
            _float64_depth -= 1
            if _float64_depth == 0:
                table = _promotion_map()
                if table is not None and _saved_float64 is not None:
                    table["float64"] = _saved_float64


def float64_scope() -> contextlib.AbstractContextManager[Any]:
    """``jax.enable_x64(True)``: 64-bit types in this thread while the context lasts."""
    return jax.enable_x64(True)


def _sub_jaxprs(value: Any) -> Iterator[Any]:
    """The jaxprs nested in an equation parameter (a jaxpr, a closed jaxpr, lists of them)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _sub_jaxprs(item)
        return
    inner = getattr(value, "jaxpr", None)
    if inner is not None and hasattr(inner, "eqns"):
        yield inner
    elif hasattr(value, "eqns"):
        yield value


def low_precision_ops(jaxpr: Any, bits: int = 64) -> list[str]:
    """``"layer: operation (dtype)"`` for each kind of operation of ``jaxpr`` (a jaxpr or
    closed jaxpr, nested computations included) with a floating result of fewer than
    ``bits`` bits; empty when every floating value has ``bits``."""
    found: dict[str, None] = {}
    todo = [getattr(jaxpr, "jaxpr", jaxpr)]
    while todo:
        current = todo.pop()
        for eqn in current.eqns:
            for var in eqn.outvars:
                dtype = getattr(getattr(var, "aval", None), "dtype", None)
                if dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.floating):
                    continue
                if np.dtype(dtype).itemsize * 8 < bits:
                    scope = str(eqn.source_info.name_stack) or "the loss"
                    found[f"{scope}: {eqn.primitive.name} ({np.dtype(dtype).name})"] = None
            for value in eqn.params.values():
                todo.extend(_sub_jaxprs(value))
    return list(found)


# -- logits behind softmax and sigmoid outputs -------------------------------------------
class LogitsRegistry:
    """The softmax and sigmoid outputs of one trace and the logits behind them.

    ``record`` is called by Keras' activations (within :func:`keras_logits`) and by code
    that recomputes an output from its logits; ``logits_of`` gives ``(logits, kind, axis)``
    of a recorded output (the array itself, matched by identity), else None; ``read``
    holds the outputs whose logits a cross-entropy read.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, Any, str, Any]] = {}
        self._read: dict[int, Any] = {}

    def record(self, output: Any, logits: Any, kind: str, axis: Any = -1) -> None:
        self._entries[id(output)] = (output, logits, kind, axis)

    def logits_of(self, output: Any) -> tuple[Any, str, Any] | None:
        entry = self._entries.get(id(output))
        if entry is None or entry[0] is not output:
            return None
        return entry[1], entry[2], entry[3]

    def mark_read(self, output: Any) -> None:
        self._read[id(output)] = output

    def was_read(self, output: Any) -> bool:
        found = self._read.get(id(output))
        return found is not None and found is output


_local = threading.local()
_logits_lock = threading.Lock()
_logits_depth = 0
_saved_functions: dict[str, Callable[..., Any]] = {}

#: The backend functions that record logits, and the cross-entropies that read them (the
#: kind of activation TensorFlow's backend names in its warning).
_RECORDING = ("softmax", "sigmoid")
_READING = {
    "categorical_crossentropy": "Softmax",
    "sparse_categorical_crossentropy": "Softmax",
    "binary_crossentropy": "Sigmoid",
}


def _backend_nn() -> Any:
    """Keras' JAX backend ``nn`` module (private), or None."""
    try:
        from keras.src.backend.jax import nn
    except ImportError:
        return None
    if all(callable(getattr(nn, name, None)) for name in (*_RECORDING, *_READING)):
        return nn
    return None


def _current() -> LogitsRegistry | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def current_logits() -> LogitsRegistry | None:
    """The registry of the innermost :func:`keras_logits` of this thread (None outside)."""
    return _current()


def _recording(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def activation(x: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(x, *args, **kwargs)
        registry = _current()
        if registry is not None:
            axis = kwargs.get("axis", args[0] if args else -1)
            registry.record(output, x, name, axis)
        return output

    return activation


def _reading(name: str, original: Callable[..., Any], op_type: str) -> Callable[..., Any]:
    def crossentropy(target: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
        registry = _current()
        found = None if registry is None else registry.logits_of(output)
        if found is None or registry is None:
            return original(target, output, *args, **kwargs)
        arguments = list(args)
        if arguments:
            from_logits, arguments[0] = bool(arguments[0]), True
        else:
            from_logits = bool(kwargs.get("from_logits", False))
            kwargs["from_logits"] = True
        if from_logits:
            warnings.warn(
                f'"`{name}` received `from_logits=True`, but the `output` argument was '
                f"produced by a {op_type} activation and thus does not represent logits. "
                "Was this intended?",
                stacklevel=2,
            )
        registry.mark_read(output)
        return original(target, found[0], *arguments, **kwargs)

    return crossentropy


def _install() -> None:
    nn = _backend_nn()
    if nn is None:
        return
    for name in _RECORDING:
        _saved_functions[name] = getattr(nn, name)
        setattr(nn, name, _recording(name, _saved_functions[name]))
    for name, op_type in _READING.items():
        _saved_functions[name] = getattr(nn, name)
        setattr(nn, name, _reading(name, _saved_functions[name], op_type))


def _uninstall() -> None:
    nn = _backend_nn()
    if nn is not None:
        for name, function in _saved_functions.items():
            setattr(nn, name, function)
    _saved_functions.clear()


@contextlib.contextmanager
def keras_logits() -> Iterator[LogitsRegistry]:
    """Within the context (entered while a function is traced), Keras' softmax and sigmoid
    outputs are recorded in the returned registry and its cross-entropies read their
    logits, as on TensorFlow (see the module docstring).

    Re-entrant and safe across threads: each thread's trace has its own registry, and the
    backend's functions are restored when the outermost context exits; outside every
    context (or in a thread without one) they behave as Keras' own.
    """
    global _logits_depth
    with _logits_lock:
        if _logits_depth == 0:
            _install()
        _logits_depth += 1
    registry = LogitsRegistry()
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(registry)
    try:
        yield registry
    finally:
        stack.pop()
        with _logits_lock:
            _logits_depth -= 1
            if _logits_depth == 0:
                _uninstall()


def activation_of(kind: str) -> Callable[..., Any]:
    """The function of Keras' JAX backend that computes a recorded activation (``kind``
    ``"softmax"`` or ``"sigmoid"``), which records its output within :func:`keras_logits`."""
    nn = _backend_nn()
    if nn is not None:
        return getattr(nn, kind)
    return getattr(jax.nn, kind)


# -- devices and seeds -------------------------------------------------------------------
def first_device_memory() -> int | None:
    """Total memory of the first accelerator in bytes, or None on CPU (or where the device
    keeps no statistics)."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def _keras_seed_state() -> tuple[Any, str, str] | None:
    """Keras' global state module and the names of its global seed and seed generator
    (private), or None."""
    try:
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator
        from keras.src.utils import rng_utils
    except ImportError:
        return None
    seed_name = getattr(rng_utils, "GLOBAL_RANDOM_SEED", None)
    generator_name = getattr(seed_generator, "GLOBAL_SEED_GENERATOR", None)
    if seed_name is None or generator_name is None:
        return None
    return global_state, seed_name, generator_name


def set_random_seed(seed: int) -> None:
    """Seed Python's and NumPy's generators and Keras' global seed (layer initializers,
    ``keras.random`` without a seed), without importing TensorFlow."""
    found = _keras_seed_state()
    if found is None:
        import keras

        keras.utils.set_random_seed(seed)
        return
    global_state, seed_name, generator_name = found
    global_state.set_global_attribute(seed_name, seed)
    global_state.set_global_attribute(generator_name, None)
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002
