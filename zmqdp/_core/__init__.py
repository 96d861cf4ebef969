"""zmqdp's sans-IO core: codec, routing, wave clock and request lifecycle.

Plain synchronous code with no trio or zmq imports; time, where it matters, is passed
in as a value. The trio layer feeds it events and carries out what it returns, the way
trio-websocket drives wsproto.
"""

from .errors import (
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
from .messages import Load, Output, OutputBatch
from .requests import BatchEffects, Ended, Outcome, RequestBook
from .routing import Routing
from .waves import WaveClock

__all__ = [
    "BatchEffects",
    "DuplicateRequestId",
    "Ended",
    "EngineDead",
    "GroupClosed",
    "HandshakeRejected",
    "HandshakeTimeout",
    "InvalidRank",
    "InvalidRequest",
    "Load",
    "NoEngineAvailable",
    "Outcome",
    "Output",
    "OutputBatch",
    "ProtocolError",
    "RequestBook",
    "Routing",
    "StreamTruncated",
    "WaveClock",
    "ZmqdpError",
]
