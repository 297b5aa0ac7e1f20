"""The checks a public entry point gives its arguments, as config.json's fields get theirs
(models/config.py): a one-line error naming the call and the argument
(``declare_ffn(parallel='yes'): parallel must be True or False``) before anything is built.

Why each is needed: a string or a number where a flag belongs is truthy (``"no"`` reads as
on); NaN passes every comparison but ``!=`` and makes every product NaN; a bool is an int to
Python (``True`` would read as a size of 1).
"""

from __future__ import annotations

import math
import numbers


def _said(who: str, name: str, value) -> str:
    return f"{who}({name}={value!r})"


def flag(who: str, name: str, value) -> bool:
    """``value``, a real bool (``who``: the call, as the error names it)."""
    if not isinstance(value, bool):
        raise TypeError(f"{_said(who, name, value)}: {name} must be True or False, not "
                        f"{type(value).__name__}")
    return value


def optional_flag(who: str, name: str, value) -> bool | None:
    """``flag``, or None (not said)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{_said(who, name, value)}: {name} must be True, False or None, not "
                        f"{type(value).__name__}")
    return value


def positive_number(who: str, name: str, value) -> float:
    """``value`` as a float: a real number (not a bool), finite and above 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_said(who, name, value)}: {name} must be a number, not "
                        f"{type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{_said(who, name, value)}: {name} must be a positive, finite "
                         "number")
    return float(value)


def positive_int(who: str, name: str, value) -> int:
    """``value``: an integer (not a bool) of at least 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_said(who, name, value)}: {name} must be an integer, not "
                        f"{type(value).__name__}")
    if value < 1:
        raise ValueError(f"{_said(who, name, value)}: {name} must be at least 1")
    return int(value)
