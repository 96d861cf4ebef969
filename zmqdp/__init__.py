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
    GroupDraining,
    GroupRecovering,
    HandshakeRejected,
    HandshakeTimeout,
    InvalidRank,
    InvalidRequest,
    NoEngineAvailable,
    Overloaded,
    ProtocolError,
    RequestAborted,
    RequestTimeout,
    StreamOverflow,
    StreamTruncated,
    ZmqdpError,
)
from ._core.messages import Load, Output
from ._core.metrics import HistogramSnapshot
from ._core.requests import Outcome
from ._core.wire import NativeWire, Wire
from ._transport import NATIVE, GroupDialect
from .client import EngineGroup
from .stream import RequestStream
from .values import (
    ConnectOptions,
    EngineInfo,
    GroupHealth,
    GroupStatistics,
    RankState,
    RankStatistics,
    Request,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "NATIVE",
    "CallFailed",
    "ConnectOptions",
    "GroupDialect",
    "NativeWire",
    "Wire",
    "CallTimeout",
    "DuplicateRequestId",
    "EngineDead",
    "EngineGroup",
    "EngineInfo",
    "GroupDraining",
    "GroupRecovering",
    "GroupHealth",
    "GroupStatistics",
    "HistogramSnapshot",
    "Outcome",
    "RankState",
    "RankStatistics",
    "Request",
    "RequestAborted",
    "RequestStream",
    "RequestTimeout",
    "GroupClosed",
    "HandshakeRejected",
    "HandshakeTimeout",
    "InvalidRank",
    "InvalidRequest",
    "Load",
    "NoEngineAvailable",
    "Output",
    "Overloaded",
    "ProtocolError",
    "StreamOverflow",
    "StreamTruncated",
    "ZmqdpError",
    "__version__",
]
