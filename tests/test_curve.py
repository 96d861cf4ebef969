"""CURVE groups (R6): who may join, and as which rank.

The client is the CURVE server; each engine has its own key pair, and the client's
allow-list binds each public key to one rank (`zmqdp.keys`). An engine without an
allowed key never joins and never injects anything; an allowed key claiming another
rank's identity is refused message by message; a tcp URL other machines can reach is
refused without keys.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio
import zmq

import zmqdp.testing
from zmqdp import (
    EngineDead,
    EngineGroup,
    HandshakeRejected,
    HandshakeTimeout,
    Output,
    RankState,
    Request,
)
from zmqdp._core.handshake import rank_identity
from zmqdp._sockets import GroupTransport
from zmqdp.engine import Add, OutputBatch, connect_engine
from zmqdp.keys import ClientKeys, EngineKeys, generate_keys, load_client_keys, load_engine_keys

from .helpers import (
    READY_TIMEOUT,
    RawEngine,
    collect,
    curve_options,
    free_tcp_url,
    group_in_background,
    raw,
    wait_until,
)


@pytest.fixture
def keys(tmp_path: Path) -> tuple[ClientKeys, list[EngineKeys]]:
    generate_keys(tmp_path / "keys", 2)
    return load_client_keys(tmp_path / "keys"), [
        load_engine_keys(tmp_path / "keys", r) for r in range(2)
    ]


@pytest.fixture
def foreign(tmp_path: Path, keys: tuple[ClientKeys, list[EngineKeys]]) -> EngineKeys:
    """A valid key pair the client does not allow (with the client's public key, which
    is no secret)."""
    generate_keys(tmp_path / "other", 1)
    other = load_engine_keys(tmp_path / "other", 0)
    return EngineKeys(public=other.public, secret=other.secret, server=keys[0].public)


async def echo(url: str, rank: int, size: int, curve: EngineKeys, **kw: Any) -> None:
    """Answers every ADD whose body is not "hold" with one terminal output."""
    async with connect_engine(url, rank=rank, size=size, curve=curve, **kw) as eng:
        async for msg in eng:
            if isinstance(msg, Add) and msg.body != "hold":
                out = Output(msg.id, {"rank": rank, "echo": msg.body}, "stop")
                await eng.send(OutputBatch(rank=rank, outputs=(out,)))


@asynccontextmanager
async def echo_group(
    tmp_path: Path, keys: tuple[ClientKeys, list[EngineKeys]]
) -> AsyncIterator[EngineGroup]:
    """A CURVE group of 2 `echo` engines with their own keys, on ipc under `tmp_path`."""
    client, engine_keys = keys
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        for r in range(2):
            nursery.start_soon(echo, url, r, 2, engine_keys[r])
        async with EngineGroup.connect(url, 2, curve=client, ready_timeout=10) as group:
            yield group
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_engines_with_allowed_keys_serve(
    keys: tuple[ClientKeys, list[EngineKeys]], tmp_path: Path, transport: str
) -> None:
    client, engine_keys = keys
    url = free_tcp_url() if transport == "tcp" else f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        for r in range(2):
            nursery.start_soon(echo, url, r, 2, engine_keys[r])
        async with EngineGroup.connect(url, 2, curve=client, ready_timeout=READY_TIMEOUT) as group:
            for r in range(2):
                assert await collect(group, Request(f"r{r}", "hi", r)) == [
                    Output(f"r{r}", {"rank": r, "echo": "hi"}, "stop")
                ]
            stats = group.statistics()
            assert (stats.refused_connections, stats.impersonations) == (0, 0)
        nursery.cancel_scope.cancel()


async def test_an_engine_without_an_allowed_key_never_joins(
    keys: tuple[ClientKeys, list[EngineKeys]], foreign: EngineKeys, tmp_path: Path
) -> None:
    client, engine_keys = keys
    url = f"ipc://{tmp_path}/g"
    async with group_in_background(url, 1, curve=client) as box:
        # refused during ZeroMQ's handshake; libzmq never retries, and the engine says so
        with pytest.raises(HandshakeRejected, match="refused this engine's CURVE key"):
            async with connect_engine(url, rank=0, size=1, curve=foreign):
                pass  # pragma: no cover
        assert not box.ready.is_set()  # the group still waits for rank 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo, url, 0, 1, engine_keys[0])
            group = await box.wait()
            assert group.statistics().refused_connections == 1
            assert group.statistics().rejected_hellos == 0  # its HELLO never arrived
            nursery.cancel_scope.cancel()


async def test_a_foreign_key_is_refused_and_cannot_inject(
    keys: tuple[ClientKeys, list[EngineKeys]], foreign: EngineKeys, ctx: Any, tmp_path: Path
) -> None:
    client, engine_keys = keys
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo, url, 0, 1, engine_keys[0])
        async with (
            EngineGroup.connect(url, 1, curve=client, ready_timeout=10) as group,
            group.submit(Request("live", "hold")) as stream,
        ):
            # a rogue with a valid key pair the client does not allow
            rogue = raw(ctx, zmq.DEALER, rank_identity(0), curve_options(foreign))
            rogue.sock.connect(zmqdp.testing.output_address(group))
            forged = {"rank": 0, "outputs": [{"id": stream.wire_id, "finish": "stop"}]}
            rogue.send_nowait([cbor2.dumps(forged)])  # queued until the handshake
            await wait_until(lambda: group.statistics().refused_connections == 1)
            assert group.rank_state(0).value is RankState.UP
            assert stream.outcome is None  # the forged output never arrived
            rogue.close()
        nursery.cancel_scope.cancel()


async def test_an_allowed_key_claiming_another_ranks_identity_on_the_handshake_socket_is_refused(
    keys: tuple[ClientKeys, list[EngineKeys]], ctx: Any, tmp_path: Path
) -> None:
    engine_keys = keys[1]
    async with echo_group(tmp_path, keys) as group:
        # rank 1's key says HELLO as rank 0: dropped, never answered, and rank 0,
        # which keeps serving on its other connections, is left alone
        url = f"ipc://{tmp_path}/g"
        impostor = RawEngine(ctx, url, 0, 2, options=curve_options(engine_keys[1]))
        await impostor.hs.send([impostor.hello_body()])
        await wait_until(lambda: group.statistics().impersonations == 1)
        assert group.statistics().rejected_hellos == 0
        assert group.rank_state(0).value is RankState.UP
        assert await collect(group, Request("still", "x", 0)) == [
            Output("still", {"rank": 0, "echo": "x"}, "stop")
        ]
        impostor.close()


async def test_an_allowed_key_claiming_another_ranks_identity_on_the_output_socket_is_refused(
    keys: tuple[ClientKeys, list[EngineKeys]], ctx: Any, tmp_path: Path
) -> None:
    engine_keys = keys[1]
    async with echo_group(tmp_path, keys) as group:
        # rank 1's key forges rank 0's terminal output: dropped. Having taken rank 0's
        # output connection (ROUTER_HANDOVER), it makes rank 0 dead at once...
        async with group.submit(Request("live", "hold", 0)) as stream:
            out = raw(ctx, zmq.DEALER, rank_identity(0), curve_options(engine_keys[1]))
            out.sock.connect(zmqdp.testing.output_address(group))
            forged = {"rank": 0, "outputs": [{"id": stream.wire_id, "finish": "stop"}]}
            out.send_nowait([cbor2.dumps(forged)])
            with pytest.raises(EngineDead, match="another rank's key"):
                await stream.receive()
            assert group.statistics().impersonations == 1
        # ... and RESYNCed: the real engine reconnects, takes its identity back, serves.
        await group.rank_state(0).wait_value(RankState.UP)
        assert await collect(group, Request("after", "x", 0)) == [
            Output("after", {"rank": 0, "echo": "x"}, "stop")
        ]
        out.close()


def test_a_tcp_url_needs_keys_or_insecure(keys: tuple[ClientKeys, list[EngineKeys]]) -> None:
    """Loopback too (issue 24 #3): every local user can reach it, while an ipc URL's
    directory admits only this user."""
    for url in ("tcp://0.0.0.0:*", "tcp://192.0.2.1:5555", "tcp://example.com:5555"):
        with pytest.raises(ValueError, match=r"other machines.*insecure=True"):
            GroupTransport(url, 1, advertise_host="127.0.0.1")
    for url in ("tcp://127.0.0.1:*", "tcp://[::1]:*", "tcp://localhost:*"):
        with pytest.raises(ValueError, match=r"every local user.*insecure=True"):
            GroupTransport(url, 1)
    for url, kw in [
        ("tcp://127.0.0.1:*", {"insecure": True}),
        ("tcp://[::1]:*", {"curve": keys[0]}),
        ("tcp://0.0.0.0:*", {"insecure": True}),
        ("tcp://0.0.0.0:*", {"curve": keys[0]}),
    ]:
        GroupTransport(url, 1, advertise_host="127.0.0.1", **kw).close()


# -- a copied key pair (issue 24 #11) ------------------------------------------------------


async def test_a_rank_with_a_copied_key_pair_is_named_in_the_handshake_timeout(
    tmp_path: Path,
) -> None:
    """Rank 1 runs with rank 0's key pair: every message it sends is dropped as an
    impersonation. The timeout used to say only "no HELLO yet" for rank 1."""
    generate_keys(tmp_path / "keys", 2)
    client = load_client_keys(tmp_path / "keys")
    rank0 = load_engine_keys(tmp_path / "keys", 0)
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo, url, 0, 2, rank0)
        nursery.start_soon(echo, url, 1, 2, rank0)  # the copy
        with pytest.raises(HandshakeTimeout) as caught:
            async with EngineGroup.connect(url, 2, curve=client, ready_timeout=1.0):
                pass  # pragma: no cover
        nursery.cancel_scope.cancel()
    assert set(caught.value.missing) == {1}
    text = str(caught.value)
    assert "claiming rank 1 came with rank 0's key" in text, text
    assert "rank 0's key pair copied as rank 1's" in text, text
