"""Checks of the arguments of spectra's functions: one place, one contract.

Every check here takes the argument's name first and its value second,
``check_int(name, value, ...)``, returns the value in a plain Python type, and raises

* ``TypeError`` for a value of the wrong type: a bool is not a number (``k=True`` is a
  mistake, not k = 1), a float is not an integer even when integral, a string is not a
  number; numpy scalars are accepted;
* ``ValueError`` for a value of the right type outside what the argument allows (``k=0``,
  ``tol=-1``, ``tol=nan``, ``method='arpack'``).

The message names the argument first, then what it must be, then what it got:
``"k must be an integer >= 1, got 0"``. The estimators call these checks too, so this
module imports NumPy only (no TensorFlow, no SciPy). The checks of a Keras model's data
(labels, input dtypes, Embedding indices, graph errors) live in the operators layer,
:mod:`spectra.operators.data_checks`. :func:`loss_name` is how every message and result
names a loss.

Cost: a few ``isinstance`` tests per argument.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "MAX_SEED",
    "check_bool",
    "check_choice",
    "check_float",
    "check_float_dtype",
    "check_int",
    "check_seed",
    "is_bool",
    "loss_config",
    "loss_name",
]

SUPPORTED_FLOAT_DTYPES = ("float32", "float64")
# Seeds reach TensorFlow's stateless generators as int64 pairs (seed, batch index): below
# 2**62 they fit with a factor of two to spare, whatever is added to them.
MAX_SEED = 2**62


def is_bool(value: Any) -> bool:
    """Whether ``value`` is a Python or numpy bool (which the number checks refuse)."""
    return isinstance(value, (bool, np.bool_))


def _show(value: Any) -> str:
    """A numpy scalar as the user typed it (3, 0.5), not as ``np.int32(3)``."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _got(value: Any) -> str:
    """``True (bool)``: the value and its type, for a ``TypeError``."""
    return f"{_show(value)} ({type(value).__name__})"


def check_int(name: str, value: Any, *, minimum: int | None = 1, allow_none: bool = False) -> Any:
    """``value`` as a Python int (numpy integers accepted) at least ``minimum``, or None
    when ``allow_none``.

    Raises ``TypeError`` for a bool, a float (even an integral one) or any other non-integer,
    ``ValueError`` for an integer below ``minimum`` (no lower bound for ``minimum=None``).
    """
    if value is None and allow_none:
        return None
    if is_bool(value) or not isinstance(value, (int, np.integer)):
        kind = "an integer or None" if allow_none else "an integer"
        raise TypeError(f"{name} must be {kind}, got {_got(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {_show(value)}")
    return int(value)


def check_float(
    name: str,
    value: Any,
    *,
    positive: bool = True,
    below: float | None = None,
    allow_none: bool = False,
) -> Any:
    """``value`` as a finite Python float (numpy floats and any real number accepted; bools
    not), or None when ``allow_none``.

    ``positive=True`` (default) also requires ``value > 0`` (tolerances, step sizes);
    ``below`` an upper bound, exclusive (a probability ``< 1``). Raises ``TypeError`` for a
    non-number, ``ValueError`` for NaN, an infinity or a value outside those bounds.
    """
    if value is None and allow_none:
        return None
    if is_bool(value) or not isinstance(value, numbers.Real):
        kind = "a number or None" if allow_none else "a number"
        raise TypeError(f"{name} must be {kind}, got {_got(value)}")
    number = float(value)
    ok = math.isfinite(number) and (not positive or number > 0)
    if ok and below is not None:
        ok = number < below
    if not ok:
        kind = "a positive finite number" if positive else "a finite number"
        limit = f" and < {below:g}" if below is not None else ""
        raise ValueError(f"{name} must be {kind}{limit}, got {_show(value)}")
    return number


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool (``True``/``False`` or a numpy bool; not 0, 1 or "yes");
    ``TypeError`` otherwise."""
    if not is_bool(value):
        raise TypeError(f"{name} must be True or False, got {_got(value)}")
    return bool(value)


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """``value`` if it is one of the strings ``choices``: ``TypeError`` for a non-string,
    ``ValueError`` for another string; both list the choices."""
    choices = tuple(choices)
    valid = ", ".join(repr(choice) for choice in choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {valid}, got {_got(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {valid}, got {_show(value)}")
    return value


def check_seed(
    name: str,
    value: Any,
    *,
    below: int | None = None,
    allow_none: bool = True,
    allow_generator: bool = True,
) -> int | np.random.Generator | None:
    """A seed: a non-negative int (numpy integers accepted, bools not) below ``below`` when
    given; None when ``allow_none``; a ``numpy.random.Generator`` (returned as is, to be used
    as the random stream) when ``allow_generator``. ``TypeError`` for other types,
    ``ValueError`` for an int out of range."""
    if (value is None and allow_none) or (
        isinstance(value, np.random.Generator) and allow_generator
    ):
        return value
    if is_bool(value) or not isinstance(value, (int, np.integer)):
        kinds = [
            *(["None"] if allow_none else []),
            "a non-negative integer",
            *(["a numpy.random.Generator"] if allow_generator else []),
        ]
        kind = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " or " + kinds[-1]
        raise TypeError(f"{name} must be {kind}, got {_got(value)}")
    if value < 0 or (below is not None and value >= below):
        bound = "" if below is None else f" below {_power_of_two(below)}"
        raise ValueError(f"{name} must be a non-negative integer{bound}, got {_show(value)}")
    return int(value)


def _power_of_two(number: int) -> str:
    """``2**62`` for 2⁶², else the number: how a bound is written in a message."""
    exponent = number.bit_length() - 1
    return f"2**{exponent}" if number == 1 << exponent and exponent > 16 else str(number)


def check_float_dtype(name: str, value: Any, *, allow_none: bool = True) -> np.dtype | None:
    """``value`` (a name, a numpy dtype or type, or a TensorFlow dtype) as a numpy dtype,
    float32 or float64; None when ``value`` is None and ``allow_none``.

    A TensorFlow ``DType`` is read through its ``as_numpy_dtype`` (no TensorFlow import
    here). Raises ``TypeError`` for anything else, like ``numpy.dtype`` itself does for a
    value that is not a dtype.
    """
    supported = ", ".join(SUPPORTED_FLOAT_DTYPES)
    default = " (or None for the variables' dtype)" if allow_none else ""
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be one of {supported}, got None")
    try:
        dtype = np.dtype(getattr(value, "as_numpy_dtype", value))
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in SUPPORTED_FLOAT_DTYPES:
        shown = dtype.name if dtype is not None else repr(value)
        if shown in ("float16", "bfloat16"):
            shown += (
                " (half precision is too coarse for curvature: pass dtype='float32', which a "
                "half-precision model gets by default, or dtype='float64')"
            )
        raise TypeError(f"{name} must be one of {supported}{default}, got {shown}")
    return dtype


def loss_name(loss: Any) -> str:
    """How messages and results name a loss: a name as given, a loss object's ``name`` (or
    a function's ``__name__``, else its class) followed by ``(from_logits=True)`` when its
    config says so (the same name with and without it are different losses), and a dict
    or list of them per output as ``{out: name, ...}`` or ``[name, ...]``."""
    if isinstance(loss, str):
        return loss
    if isinstance(loss, Mapping):
        return "{" + ", ".join(f"{key}: {loss_name(value)}" for key, value in loss.items()) + "}"
    if isinstance(loss, Sequence):
        return "[" + ", ".join(loss_name(value) for value in loss) + "]"
    name = str(
        getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__
    )
    return f"{name}(from_logits=True)" if loss_config(loss).get("from_logits") is True else name


def loss_config(loss: Any) -> dict[str, Any]:
    """A loss object's ``get_config()`` (``{}`` for a name, a function, or a loss whose
    config cannot be read)."""
    get_config = getattr(loss, "get_config", None)
    if isinstance(loss, (str, type)) or not callable(get_config):
        return {}
    try:
        config = get_config()
    except (NotImplementedError, TypeError, ValueError, AttributeError):
        return {}
    return dict(config) if isinstance(config, Mapping) else {}
