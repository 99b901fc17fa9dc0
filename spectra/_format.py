"""Numbers written as measurements are: a value rounded from its uncertainty.

An error is written to 2 significant digits and its value to the same decimal place,
trailing zeros kept (``1.6991200 ± 7.5e-06``, ``79.2 ± 7.0``, ``3800 ± 50``), as the ISO
Guide to the Expression of Uncertainty in Measurement (GUM, section 7.2.6) recommends. The
console (:func:`plus_minus`), the callback's log lines and the figures' value labels
(:func:`format_value`) follow the one rule. Counts are written as a number and its noun,
never as a compound adjective: "5 subsets of 898 examples", not "5 898-example subsets"
(:func:`count_text`). Pure Python: any layer may import it.
"""

from __future__ import annotations

import math

__all__ = [
    "ERROR_SIGNIFICANT_DIGITS",
    "count_text",
    "format_value",
    "keep_zeros",
    "plus_minus",
    "value_digits",
]

ERROR_SIGNIFICANT_DIGITS = 2
# The console writes at most this many significant digits of a value (a float64 result
# with a 1e-15 bound would otherwise print 17 digits).
_CONSOLE_MOST_DIGITS = 12


def value_digits(value: float, error: float | None, *, most: int = 12) -> int | None:
    """Significant digits of ``value`` that its ``error`` leaves meaningful: the value ends
    at the decimal place of the error's second significant digit (at least 1, at most
    ``most``); None when the error is unknown, zero or not finite, or the value is 0."""
    if error is None or not (math.isfinite(error) and math.isfinite(value)):
        return None
    if error <= 0 or value == 0:
        return None
    digits = (
        math.floor(math.log10(abs(value)))
        - math.floor(math.log10(error))
        + ERROR_SIGNIFICANT_DIGITS
    )
    return min(max(digits, 1), most)


def keep_zeros(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits with its trailing zeros kept (1.6991200,
    7.0), no bare trailing point (3800, not 3800.)."""
    text = f"{value:#.{digits}g}"
    mantissa, _, exponent = text.partition("e")
    return mantissa.removesuffix(".") + (f"e{exponent}" if exponent else "")


def format_value(value: float, error: float | None, *, most: int = 6) -> str:
    """``value`` rounded from its uncertainty (:func:`value_digits`), trailing zeros kept:
    17.63 for 17.634 ± 0.41, 17.60 for 17.6 ± 0.41, 22.2153 for 22.215331 ± 2.1e-06
    (capped at ``most`` digits); with no usable error, ``most`` significant digits. The
    figures' labels use it (6 digits at most: a label is not a table)."""
    digits = value_digits(value, error, most=most)
    if digits is None:
        return f"{value:.{most}g}"
    return keep_zeros(value, digits)


def plus_minus(value: float | None, error: float | None) -> str:
    """``value ± error`` with the error to 2 significant digits and the value to the same
    decimal place (20.92 ± 0.87, 3.7447885 ± 4.5e-06, 1.6991200 ± 7.5e-06, 79.2 ± 7.0);
    ``n/a`` for a missing value, 6 significant digits when the error is unusable."""
    if value is None:
        return "n/a"
    if error is None or not math.isfinite(error) or not math.isfinite(value):
        return f"{value:.6g}" if error is None else f"{value:.6g} ± {error:.2g}"
    digits = value_digits(value, error, most=_CONSOLE_MOST_DIGITS)
    if digits is None:
        return f"{value:.6g} ± {error:.2g}"
    return f"{keep_zeros(value, digits)} ± {keep_zeros(error, ERROR_SIGNIFICANT_DIGITS)}"


def count_text(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and its noun, with thousands separators: ``"1 example"``, ``"1,797
    examples"`` (``plural`` default ``noun + "s"``). Counts of counts read as a number
    and its noun each, "5 subsets of 898 examples", never "5 898-example subsets"."""
    return f"{count:,} {noun if count == 1 else (plural or noun + 's')}"
