"""A hostile peer on vLLM's unauthenticated sockets, over real sockets: one 1 KB message
nested 1,000 deep (msgspec raises `RecursionError` for it) sent to a running group's
handshake socket, input socket or an output socket is counted and dropped; the group
stays up and serves the next request.

Before the fix, the handshake and input sockets' decoders let the `RecursionError` out
of their task: the group ended (`zmqdp serve --vllm` exited 1) for anyone who could
reach the port."""

from __future__ import annotations

from typing import Any

import pytest
import zmq

from zmqdp import RankState

from .helpers import raw, wait_until
from .test_vllm_group import collect, req, vllm_group

DEEP = b"\x91" * 1000 + b"\xc0"
"""1,001 bytes: 1,000 nested one-element arrays around a nil."""
DEEP_MAP = b"\x81\xa6status" + b"\x91" * 1000 + b"\xc0"
"""A map with a status, whose value is 1,000 levels deep."""


@pytest.mark.parametrize("body", [DEEP, DEEP_MAP], ids=["arrays", "status map"])
@pytest.mark.parametrize("socket", ["handshake", "input"])
async def test_a_deeply_nested_message_is_counted_and_the_group_serves_on(
    ctx: Any, socket: str, body: bytes
) -> None:
    async with vllm_group(2) as (group, fake):
        assert fake.engines[0].init is not None
        address = {
            "handshake": fake.url,
            "input": fake.engines[0].init["addresses"]["inputs"][0],
        }[socket]
        before = group.statistics()
        peer = raw(ctx, zmq.DEALER)  # an identity of libzmq's choosing: no rank
        try:
            peer.sock.connect(address)
            await peer.send([body])
            await wait_until(
                lambda: (
                    group.statistics().ignored_handshake_messages
                    > before.ignored_handshake_messages
                )
            )
        finally:
            peer.close()
        # counted where the native wire counts an undecodable handshake or input message
        stats = group.statistics()
        assert stats.ignored_handshake_messages == before.ignored_handshake_messages + 1
        assert group.closed is None
        assert [group.rank_state(r).value for r in (0, 1)] == [RankState.UP, RankState.UP]
        for rank in (0, 1):
            tokens, outs = await collect(group, req(f"after{rank}", rank=rank))
            assert tokens == [21, 22, 23, 24] and outs[-1].finish == "length"
        assert group.statistics().finished == 2


async def test_a_deeply_nested_output_message_is_counted_and_kills_nobody() -> None:
    """The output socket's decoder was already total; pinned with the same message."""
    async with vllm_group(2) as (group, fake):
        before = group.statistics().protocol_errors
        fake.engines[0].send_raw([DEEP])
        fake.engines[1].send_raw([b"\x92\x00\x91" + b"\x91" * 1000 + b"\xc0"])
        await wait_until(lambda: group.statistics().protocol_errors >= before + 2)
        assert group.statistics().protocol_errors == before + 2
        assert [group.rank_state(r).value for r in (0, 1)] == [RankState.UP, RankState.UP]
        for rank in (0, 1):
            tokens, _ = await collect(group, req(f"after{rank}", rank=rank))
            assert tokens == [21, 22, 23, 24]
