"""Argument checks shared by the package: each raises a TypeError/ValueError naming the argument."""

from __future__ import annotations

import math
import numbers

__all__ = ["check_int", "check_positive", "check_real"]


def check_int(value, name: str, *, minimum: int | None = None) -> int:
    # bool is an Integral subclass, but True as a count is a bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_positive(value, name: str) -> float:
    value = check_real(value, name)
    if not value > 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value
