"""zmqdp: drive a data-parallel group of inference engines over ZeroMQ from one trio client.

The wire contract is PROTOCOL.md (version 1). This release ships the sans-IO core
(codec, least-loaded routing, wave clock, request lifecycle); the trio client
`EngineGroup`, the engine-side API and the mock engine group follow.
"""

from ._core.errors import (
    DuplicateRequestId,
    EngineDead,
    GroupClosed,
    HandshakeRejected,
    HandshakeTimeout,
    InvalidRank,
    InvalidRequest,
    NoEngineAvailable,
    ProtocolError,
    StreamTruncated,
    ZmqdpError,
)
from ._core.messages import Load, Output

__version__ = "0.1.0.dev0"

__all__ = [
    "DuplicateRequestId",
    "EngineDead",
    "GroupClosed",
    "HandshakeRejected",
    "HandshakeTimeout",
    "InvalidRank",
    "InvalidRequest",
    "Load",
    "NoEngineAvailable",
    "Output",
    "ProtocolError",
    "StreamTruncated",
    "ZmqdpError",
    "__version__",
]
