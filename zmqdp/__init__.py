"""zmqdp: drive a data-parallel group of inference engines over ZeroMQ from one client,
on trio (`EngineGroup`) or asyncio (`zmqdp.aio`); vLLM engine cores too (`zmqdp.vllm`).

The wire contract is docs/protocol.md (version 1).

    async with EngineGroup.connect("ipc:///tmp/zmqdp-g1/g", engines=2) as group:
        async with group.submit(Request("r1", body)) as stream:
            async for out in stream:
                ...

Engine authors: see `zmqdp.engine`. The exceptions, and when each is raised:
`help(zmqdp.ZmqdpError)`.
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
    SubmitRefused,
    ZmqdpError,
)
from ._core.messages import Load, Output
from ._core.metrics import HistogramSnapshot
from ._core.requests import Outcome
from ._core.wire import NativeWire, Wire
from ._sockets import NATIVE
from ._transport import GroupDialect
from .client import EngineGroup
from .stream import RequestStream
from .values import (
    ConnectKeywords,
    ConnectOptions,
    EngineInfo,
    GroupHealth,
    GroupStatistics,
    PrefixStatistics,
    RankState,
    RankStatistics,
    Request,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "NATIVE",
    "CallFailed",
    "ConnectKeywords",
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
    "PrefixStatistics",
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
    "SubmitRefused",
    "ZmqdpError",
    "__version__",
]


def _report_public_module() -> None:
    """Tracebacks, `help()` and `type()` name `zmqdp.EngineDead`, not the private
    module it is defined in (trio's idiom); `pickle` finds each class here. Only the
    exceptions, the group, its stream and the enums: the dataclass values keep their
    defining module, where `typing.get_type_hints` (pydantic, Hypothesis) resolves their
    annotations."""
    for name in ("EngineGroup", "RequestStream", "RankState", "Outcome"):
        globals()[name].__module__ = __name__
    for value in list(globals().values()):
        if isinstance(value, type) and issubclass(value, ZmqdpError):
            value.__module__ = __name__


_report_public_module()
