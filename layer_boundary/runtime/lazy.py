"""Packages whose public names load on first use (PEP 562), so that importing the package
imports no torch: what lets ``layer-boundary --help`` answer before torch loads."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str], names: list[str]):
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each public name to the
    (relative) module that defines it; a name is imported on its first lookup and then kept
    in the package's namespace, so later lookups do not come here again."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
