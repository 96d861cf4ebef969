"""zmqdp: drive a data-parallel group of inference engines over ZeroMQ from one trio client.

The wire contract is docs/protocol.md (version 1).

    async with EngineGroup.connect("ipc:///run/zmqdp/g1", engines=2) as group:
        async with group.submit(Request("r1", body)) as stream:
            async for out in stream:
                ...

Engine authors: see `zmqdp.engine`.
"""

from ._core.errors import (
    CallFailed,
    CallTimeout,
    DuplicateRequestId,
    EngineDead,
    GroupClosed,
    HandshakeRejected,
    HandshakeTimeout,
    InvalidRank,
    InvalidRequest,
    NoEngineAvailable,
    ProtocolError,
    RequestAborted,
    StreamOverflow,
    StreamTruncated,
    ZmqdpError,
)
from ._core.messages import Load, Output
from ._core.requests import Outcome
from .client import (
    EngineGroup,
    EngineInfo,
    GroupStatistics,
    RankState,
    RankStatistics,
    Request,
)
from .stream import RequestStream

__version__ = "0.1.0.dev0"

__all__ = [
    "CallFailed",
    "CallTimeout",
    "DuplicateRequestId",
    "EngineDead",
    "EngineGroup",
    "EngineInfo",
    "GroupStatistics",
    "Outcome",
    "RankState",
    "RankStatistics",
    "Request",
    "RequestAborted",
    "RequestStream",
    "GroupClosed",
    "HandshakeRejected",
    "HandshakeTimeout",
    "InvalidRank",
    "InvalidRequest",
    "Load",
    "NoEngineAvailable",
    "Output",
    "ProtocolError",
    "StreamOverflow",
    "StreamTruncated",
    "ZmqdpError",
    "__version__",
]
