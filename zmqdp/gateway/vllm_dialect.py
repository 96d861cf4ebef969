"""Deprecated: `VllmDialect` is now `VllmFrontend` (`zmqdp.gateway.vllm_frontend`).

The old names still work, with a `DeprecationWarning`.
"""

from __future__ import annotations

from typing import Any

from ._renamed import renamed

__all__ = ["FIELDS", "MAX_STOP_STRINGS", "VllmDialect"]  # noqa: F822 (served by __getattr__)

_NEW = "zmqdp.gateway.vllm_frontend."
_old = renamed(
    __name__,
    {
        "FIELDS": _NEW + "FIELDS",
        "MAX_STOP_STRINGS": _NEW + "MAX_STOP_STRINGS",
        "VllmDialect": _NEW + "VllmFrontend",
    },
)


def __getattr__(name: str) -> Any:
    return _old(name)
