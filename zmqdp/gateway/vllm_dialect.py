"""Deprecated: `VllmDialect` is now `VllmFrontend` (`zmqdp.gateway.vllm_frontend`).

The old names still work, with a `DeprecationWarning`.
"""

from ._renamed import renamed

__all__ = ["FIELDS", "MAX_STOP_STRINGS", "VllmDialect"]  # noqa: F822

__getattr__ = renamed(__name__)
