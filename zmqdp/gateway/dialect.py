"""Deprecated: the gateway's dialect is now its frontend (`zmqdp.gateway.frontend`).

The old names still work, with a `DeprecationWarning`: `Dialect` is `Frontend`,
`MockDialect` is `MockFrontend`. (The wire's dialect, `zmqdp.vllm.dialect(...)`, keeps
its name: it is the protocol the group speaks to its engines.)
"""

from ._renamed import renamed

__all__ = ["CompletionRequest", "Dialect", "MockDialect", "Piece", "Prepared"]  # noqa: F822

__getattr__ = renamed(__name__)
