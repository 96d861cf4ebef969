"""Deprecated: the gateway's dialect is now its frontend (`zmqdp.gateway.frontend`).

The old names still work, with a `DeprecationWarning`: `Dialect` is `Frontend`,
`MockDialect` is `MockFrontend`. (The wire's dialect, `zmqdp.vllm.dialect(...)`, keeps
its name: it is the protocol the group speaks to its engines.)
"""

from __future__ import annotations

from typing import Any

from ._renamed import renamed

__all__ = ["CompletionRequest", "Dialect", "MockDialect", "Piece", "Prepared"]  # noqa: F822 (served by __getattr__)

_NEW = "zmqdp.gateway.frontend."
_old = renamed(
    __name__,
    {
        "CompletionRequest": _NEW + "CompletionRequest",
        "Dialect": _NEW + "Frontend",
        "MockDialect": _NEW + "MockFrontend",
        "Piece": _NEW + "Piece",
        "Prepared": _NEW + "Prepared",
    },
)


def __getattr__(name: str) -> Any:
    return _old(name)
