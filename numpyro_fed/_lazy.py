"""Public names imported on first use (PEP 562), for the packages whose ``__init__`` would
otherwise import every algorithm (and SciPy's statistics behind some) at ``import``."""

from __future__ import annotations

import importlib
import sys

__all__ = ["lazy_names"]


def lazy_names(package: str, where: dict):
    """``(__getattr__, __dir__)`` for ``package``'s namespace: a name in ``where`` (name ->
    module that defines it) is imported from its module on first use and kept in the
    package's globals; ``__dir__`` lists them with the package's own globals."""
    namespace = vars(sys.modules[package])

    def __getattr__(name):
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
