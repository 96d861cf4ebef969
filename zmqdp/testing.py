"""What tests and benchmarks read of a connected group's sockets, without reaching into
private attributes (`group._transport`).

`EngineGroup.statistics()` is the user's view: counters with a stable meaning, exported
by the gateway's `/metrics`. The readings here are below it: the client's own sockets
(messages sent, times a task parked on an fd, the size limit libzmq enforces), where
engines connect, and the handshake's bookkeeping on vLLM's wire. They follow the
implementation, so they are for tests, benchmarks and debugging sessions, not for
monitoring. Every function takes the group as `connect` yielded it, on either wire,
and reads without changing anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import zmq

from ._transport import TransportBase, TransportStatistics
from ._zmq import ZSocket, ZSocketSet, ZSocketStatistics
from .client import EngineGroup

__all__ = [
    "TransportStatistics",
    "ZSocketStatistics",
    "input_statistics",
    "message_size_limits",
    "open_connections",
    "output_address",
    "parallel_config",
    "resumptions",
    "transport_statistics",
]


def _transport(group: EngineGroup[Any]) -> TransportBase:
    transport = group._transport
    assert isinstance(transport, TransportBase), transport
    return transport


def transport_statistics(group: EngineGroup[Any]) -> TransportStatistics:
    """The transport's counters, per socket (`handshake`, `input`, `output`: messages,
    waits, safety-timeout fallbacks) and of the handshake, including `input_rounds` (a
    spinning input task would show there). `statistics()` sums some of these."""
    return _transport(group).statistics()


def input_statistics(group: EngineGroup[Any]) -> ZSocketStatistics:
    """The input socket's counters alone (`sent`: messages handed to libzmq for the
    engines; `waits`: times the input task parked on its fd): cheap enough to poll in a
    benchmark's timed loop."""
    return _transport(group).input.statistics()


def output_address(group: EngineGroup[Any]) -> str:
    """Natively: the address engines connect their output DEALER to, as INIT announces it
    (a tcp URL bound on port 0 has its port here). TypeError on vLLM's wire, whose
    output sockets are one per rank."""
    address = getattr(_transport(group), "output_address", None)
    if not isinstance(address, str):
        raise TypeError("output_address: the group has one output socket per rank")
    return address


def message_size_limits(group: EngineGroup[Any]) -> dict[str, tuple[int, ...]]:
    """The largest message (bytes) libzmq accepts on each receiving socket, by role:
    ``{"handshake": (n,), "input": (n,), "output": (n, ...)}`` (one per output socket).
    A peer's message over the limit is dropped with its connection."""
    transport = _transport(group)

    def limit(zs: ZSocket) -> int:
        return int(zs.sock.getsockopt(zmq.MAXMSGSIZE))

    outputs = transport.output
    members = outputs.members if isinstance(outputs, ZSocketSet) else [outputs]
    return {
        "handshake": (limit(transport.handshake),),
        "input": (limit(transport.input),),
        "output": tuple(limit(zs) for zs in members),
    }


def open_connections(group: EngineGroup[Any]) -> int:
    """Open connections of the socket whose closing ends a rank (natively the
    handshake socket, on vLLM's wire the input socket): a predecessor engine's close
    shows here."""
    return len(_transport(group)._watch)


def resumptions(group: EngineGroup[Any]) -> int:
    """vLLM's wire: ranks that came back up in the same engine process (it answered a
    probe after a death), without a new handshake. 0 natively, where every return is
    a new incarnation."""
    return int(getattr(_transport(group), "resumptions", 0))


def parallel_config(group: EngineGroup[Any]) -> Mapping[str, Any]:
    """vLLM's wire: the `parallel_config` the engines' init carried (empty for dense
    groups). TypeError natively."""
    config = getattr(_transport(group), "parallel_config", None)
    if not isinstance(config, Mapping):
        raise TypeError("parallel_config: only groups on vLLM's wire have one")
    return config
