"""Old names kept working after a rename: a module's `__getattr__` that finds the new
object and warns (`DeprecationWarning`) each time an old name is looked up."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["renamed"]


def renamed(where: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """What module `where`'s `__getattr__` returns (it must call this directly): `names`
    maps each old name to its new home, ``"package.module.NewName"``. Python calls a
    module's `__getattr__` only for names it lacks, so the new names cost nothing."""

    def __getattr__(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {where!r} has no attribute {name!r}")
        module, _, attribute = new.rpartition(".")
        # Frames: this, the module's `__getattr__`, its caller. `from package import
        # name` asks importlib's `hasattr` first: one warning, at the importer's line.
        if not sys._getframe(2).f_code.co_filename.startswith("<frozen importlib"):
            warnings.warn(
                f"{where}.{name} is deprecated: use {new}", DeprecationWarning, stacklevel=3
            )
        return getattr(importlib.import_module(module), attribute)

    return __getattr__
