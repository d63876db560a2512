"""Type checks for values that come from JSON bodies, flags or Python callers, where `True` must
not pass for the integer 1 and NaN must not pass for a number."""

from __future__ import annotations

from typing import Any


def is_int(x: Any) -> bool:
    """An int, not a bool (bool is a subclass of int in Python; JSON's true is not a count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """An int or float, not a bool, and not NaN (infinities pass: callers bound the range)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
