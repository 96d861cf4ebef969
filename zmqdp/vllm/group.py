"""`zmqdp.vllm.connect`: an `EngineGroup` driving vLLM 0.32 or 0.33 engine cores.

A vLLM group is zmqdp's own `EngineGroup` (the same core, dispatcher, streams, admission
control, deadlines, drain and health) given another dialect: `VllmWire` (`wire.py`)
and vLLM's socket map (`sockets.py`), where the client plays the frontend and, for MoE
groups, the DP coordinator. `dialect(...)` is that pair; `zmqdp.aio` and the gateway
take it too. `VllmEngineGroup` is the old spelling, kept for one release.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Unpack

from .._transport import GroupDialect, Transport, TransportListener
from ..client import EngineGroup
from ..values import ConnectKeywords, ConnectOptions, with_connect_options
from .codec import WIRE_VERSIONS
from .sockets import open_vllm_transport
from .wire import VllmRequest, VllmWire

__all__ = ["VllmEngineGroup", "VllmGroup", "connect", "dialect"]

VllmGroup = EngineGroup[VllmRequest]
"""The type of a group on vLLM's wire (what `connect` yields), for annotations."""


def dialect(
    *,
    moe: bool = False,
    parallel_config: Mapping[str, Any] | None = None,
    parallel_config_hash: str | None = None,
    vllm_version: str | None = None,
) -> GroupDialect[VllmRequest]:
    """vLLM's engine-core wire and sockets, for `EngineGroup.open`, `zmqdp.aio` and the
    gateway. The arguments are `connect`'s; `ValueError` for an unknown version."""
    if vllm_version is not None and vllm_version not in WIRE_VERSIONS:
        raise ValueError(
            f"vllm_version must be one of {', '.join(WIRE_VERSIONS)}, got {vllm_version!r}"
        )
    wire = VllmWire()

    @asynccontextmanager
    async def open_transport(
        url: str, engines: int, options: ConnectOptions, listener: TransportListener
    ) -> AsyncIterator[Transport]:
        if options.curve is not None:
            raise ValueError("vLLM's engine-core wire has no authentication: curve= is native only")
        async with open_vllm_transport(
            url,
            engines,
            options,
            listener,
            lockstep=moe,
            ready_timeout=options.ready_timeout or wire.default_ready_timeout,
            parallel_config=parallel_config,
            parallel_config_hash=parallel_config_hash,
            vllm_version=vllm_version,
            source_tag=wire.source_tag,
        ) as transport:
            yield transport

    return GroupDialect(wire, open_transport)


@with_connect_options
@asynccontextmanager
async def connect(
    url: str,
    engines: int,
    *,
    moe: bool = False,
    parallel_config: Mapping[str, Any] | None = None,
    parallel_config_hash: str | None = None,
    vllm_version: str | None = None,
    options: ConnectOptions | None = None,
    **kwargs: Unpack[ConnectKeywords],
) -> AsyncIterator[EngineGroup[VllmRequest]]:
    """Bind the handshake ROUTER at `url` (``tcp://HOST:PORT``: the
    ``--data-parallel-address``/``--data-parallel-rpc-port`` the headless engines were
    started with), answer every engine's HELLO, wait until all `engines` ranks sent
    READY and their ready response, and serve them. `submit` takes `VllmRequest`s;
    outputs are `Output`s whose body is a `VllmOutput` and whose `finish` is vLLM's
    finish reason in lower case.

    `moe=True` for MoE models (vLLM runs their DP ranks in lockstep): the client plays
    the DP coordinator and the group is lockstep (a dead rank fails it whole). MoE
    engines need a `parallel_config` for their DP process group; by default free ports
    on `advertise_host` (or 127.0.0.1) are picked. Every rank's READY must carry the
    same `parallel_config_hash` (`parallel_config_hash`: the one expected).

    `vllm_version` (``"0.32"`` or ``"0.33"``, `WIRE_VERSIONS`) says which vLLM
    engine-core wire the ranks speak; by default each rank's ready response says
    (`EngineGroup.wire_version(rank)`), and an unknown version is taken as the nearest
    known one with a warning.

    `routing="prefix"` sends a request where its prompt's prefix is cached (within the
    load band); with `kv_events=True` (the default) the client also follows the KV
    events of every rank whose ready response enables them (``--kv-events-config``),
    the exact mode (docs/guides/vllm.md, "Prefix affinity and KV events").

    The other keyword arguments are `zmqdp.ConnectOptions`'s, as for
    `EngineGroup.connect` (`ready_timeout` defaults to 600 s: engines load a model
    first; `curve` is refused: vLLM's wire has no authentication, so a tcp URL other
    machines can reach needs `insecure=True`, a trusted network). `max_inflight="info"`
    caps each rank at the `max_num_seqs` of its ready response.

    Raises `HandshakeTimeout` naming each missing rank and what it lacks, `ValueError`
    for an unknown `vllm_version` or a reachable URL without `insecure=True`.
    Cancellation as `EngineGroup.connect`.
    """
    spoken = dialect(
        moe=moe,
        parallel_config=parallel_config,
        parallel_config_hash=parallel_config_hash,
        vllm_version=vllm_version,
    )
    async with EngineGroup.open(url, engines, spoken, options, **kwargs) as group:
        yield group


class VllmEngineGroup:
    """Deprecated: `zmqdp.vllm.connect(...)` (the group is an `EngineGroup`). Kept for
    one release; `VllmEngineGroup.connect` warns and calls `connect`."""

    @staticmethod
    def connect(url: str, engines: int, **kwargs: Any) -> Any:
        """Deprecated spelling of `zmqdp.vllm.connect`."""
        warnings.warn(
            "VllmEngineGroup.connect is deprecated: use zmqdp.vllm.connect (the group is "
            "a zmqdp.EngineGroup)",
            DeprecationWarning,
            stacklevel=2,
        )
        return connect(url, engines, **kwargs)
