"""Old names kept working after a rename: every deprecated name of the gateway, and the
module `__getattr__` that finds its new home and warns (`DeprecationWarning`) each time
an old name is looked up."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["RENAMED", "renamed"]

_FRONTEND = "zmqdp.gateway.frontend."
_VLLM_FRONTEND = "zmqdp.gateway.vllm_frontend."

RENAMED: dict[str, dict[str, str]] = {
    # The gateway's dialect became its frontend (vLLM's word; "dialect" is the wire's).
    "zmqdp.gateway": {
        "Dialect": _FRONTEND + "Frontend",
        "MockDialect": _FRONTEND + "MockFrontend",
        "VllmDialect": _VLLM_FRONTEND + "VllmFrontend",
    },
    "zmqdp.gateway.dialect": {
        "CompletionRequest": _FRONTEND + "CompletionRequest",
        "Dialect": _FRONTEND + "Frontend",
        "MockDialect": _FRONTEND + "MockFrontend",
        "Piece": _FRONTEND + "Piece",
        "Prepared": _FRONTEND + "Prepared",
    },
    "zmqdp.gateway.vllm_dialect": {
        "FIELDS": _VLLM_FRONTEND + "FIELDS",
        "MAX_STOP_STRINGS": _VLLM_FRONTEND + "MAX_STOP_STRINGS",
        "VllmDialect": _VLLM_FRONTEND + "VllmFrontend",
    },
    # The mock's command line went to the mock.
    "zmqdp.gateway.backends": {"mock_command": "zmqdp.mock.mock_command"},
}
"""Per module, each old name and its new home, ``"package.module.NewName"``."""


def renamed(where: str) -> Callable[[str], Any]:
    """The `__getattr__` of module `where` (``__getattr__ = renamed(__name__)``), for its
    old names in `RENAMED`. Python calls a module's `__getattr__` only for names it
    lacks, so the new names cost nothing."""
    names = RENAMED[where]

    def __getattr__(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {where!r} has no attribute {name!r}")
        module, _, attribute = new.rpartition(".")
        # `from package import name` asks importlib's `hasattr` first: warn once, at
        # the importer's line.
        if not sys._getframe(1).f_code.co_filename.startswith("<frozen importlib"):
            warnings.warn(
                f"{where}.{name} is deprecated: use {new}", DeprecationWarning, stacklevel=2
            )
        return getattr(importlib.import_module(module), attribute)

    return __getattr__
