"""Argument checks shared by the package: each raises a TypeError/ValueError naming the
argument; and :func:`warn_user`, for warnings issued deep inside JAX."""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings

__all__ = ["check_int", "check_positive", "check_real", "user_origin", "warn_user"]

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(module.__file__)) + os.sep
    for module in (sys.modules.get("jax"), sys.modules.get("jaxlib"), sys.modules.get("numpyro"))
    if module is not None and getattr(module, "__file__", None)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def user_origin():
    """``(filename, lineno, globals)`` of the first frame outside JAX, NumPyro and this
    package (the user's line that called into the library), or ``None``."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)


def warn_user(message: str, category=RuntimeWarning, origin=None) -> None:
    """``warnings.warn`` attributed to the user's line, not the library's: the first frame
    outside JAX, NumPyro and this package. A host callback inside a compiled loop may run on
    a thread of its own whose stack holds no user frame; it passes the ``origin`` that
    :func:`user_origin` recorded while the loop was traced (the call that started the run)."""
    here = user_origin()
    if here is not None or origin is None:
        frame, level = sys._getframe(1), 2
        while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
            frame, level = frame.f_back, level + 1
        warnings.warn(message, category, stacklevel=level if frame is not None else 2)
        return
    filename, lineno, module_globals = origin
    warnings.warn_explicit(
        message,
        category,
        filename,
        lineno,
        module=module_globals.get("__name__", "__main__"),
        registry=module_globals.setdefault("__warningregistry__", {}),
    )


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
