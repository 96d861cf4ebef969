"""vLLM 0.32 and 0.33 engine cores: which wire a rank speaks, 0.33's `error` detail of
an output, and the MoE init that real engines accept."""

from __future__ import annotations

import socket
from typing import Any

import msgspec
import pytest
import trio

import zmqdp.vllm
from zmqdp.vllm import WIRE_VERSIONS, VllmError, VllmOutput
from zmqdp.vllm.codec import decode_outputs, wire_version
from zmqdp.vllm.sockets import MASTER_PORTS, _ephemeral_low, moe_parallel_config

enc = msgspec.msgpack.encode


def entry(
    rid: str, tokens: list[int], finish: int | None, *, version: str, error: Any = None
) -> list[Any]:
    """An `EngineCoreOutput` with every field of `version` (18 in 0.32, 19 in 0.33)."""
    e: list[Any] = [rid, tokens, None, None, None, finish, None, None, None, None]
    e += [None, None, None, 0, None, None, None, None]
    assert len(e) == 18
    return e if version == "0.32" else [*e, error]


def outputs(rank: int, entries: list[list[Any]]) -> bytes:
    return enc([rank, entries, None, 1.0, None, None, None, None, None])


@pytest.mark.parametrize(
    ("said", "expected", "warns"),
    [
        ("0.32.0", "0.32", False),
        ("0.32.0+cpu", "0.32", False),
        ("0.33.0", "0.33", False),
        ("0.33.1rc1", "0.33", False),
        ("0.34.0", "0.33", True),
        ("0.31.2", "0.32", True),
        ("0.10.1", "0.32", True),
        ("nightly", "0.33", True),
        (None, "0.33", True),
    ],
)
def test_the_wire_version_comes_from_the_ready_response(
    said: str | None, expected: str, warns: bool
) -> None:
    info = {} if said is None else {"vllm_version": said}
    version, warning = wire_version(info)
    assert version == expected
    assert (warning is not None) is warns
    if warning is not None:
        assert "vllm_version" in warning or said in warning


def test_an_override_wins_and_does_not_warn() -> None:
    assert wire_version({"vllm_version": "0.33.0"}, "0.32") == ("0.32", None)
    assert wire_version({}, "0.33") == ("0.33", None)


async def test_connect_refuses_an_unknown_vllm_version() -> None:
    with pytest.raises(ValueError, match=r"vllm_version must be one of 0\.32, 0\.33"):
        async with zmqdp.vllm.connect("ipc:///tmp/zmqdp-never", 1, vllm_version="0.30"):
            pass
    assert WIRE_VERSIONS == ("0.32", "0.33")


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_outputs_of_both_versions_decode(version: str) -> None:
    batch = decode_outputs(
        [
            outputs(
                1, [entry("a", [1, 2], None, version=version), entry("b", [3], 1, version=version)]
            )
        ]
    )
    assert batch.rank == 1
    assert [(o.request_id, o.body, o.finish) for o in batch.outputs] == [
        ("a", VllmOutput([1, 2], None, None), None),
        ("b", VllmOutput([3], None, None), "length"),
    ]


def test_an_033_error_finish_keeps_the_engines_reason() -> None:
    error = {
        "code": "validation_error",
        "message": "token id 5000 >= vocab 1024",
        "retryable": False,
    }
    retry = {"code": "paused", "message": "the engine is paused", "retryable": True}
    batch = decode_outputs(
        [
            outputs(
                0,
                [
                    entry("ok", [1], None, version="0.33"),
                    entry("bad", [], 3, version="0.33", error=error),
                    entry("later", [], 3, version="0.33", error=retry),
                ],
            )
        ]
    )
    by_id = {o.request_id: o for o in batch.outputs}
    assert by_id["ok"].body.error is None
    bad = by_id["bad"]
    assert bad.finish == "error"
    assert bad.body.error == VllmError("validation_error", "token id 5000 >= vocab 1024", False)
    assert str(bad.body.error) == "validation_error: token id 5000 >= vocab 1024"
    assert by_id["later"].body.error == VllmError("paused", "the engine is paused", True)
    assert str(by_id["later"].body.error).endswith("(retryable)")


def test_an_032_error_finish_has_no_detail() -> None:
    batch = decode_outputs([outputs(0, [entry("bad", [], 3, version="0.32")])])
    [out] = batch.outputs
    assert out.finish == "error" and out.body.error is None


def test_a_malformed_error_detail_still_ends_the_request_with_error() -> None:
    batch = decode_outputs([outputs(0, [entry("bad", [], 3, version="0.33", error="boom")])])
    [out] = batch.outputs
    assert out.finish == "error" and out.body.error is None


def test_the_moe_init_names_no_coordination_store_and_enough_master_ports() -> None:
    """Real MoE engines never started: the init named a non-zero `_coord_store_port`
    that nothing listened on. vLLM's frontend, running no engine itself, sends 0 and
    at least 5 pre-allocated master ports."""
    config = moe_parallel_config(2)
    assert config["_coord_store_port"] == 0
    ports = config["_data_parallel_master_port_list"]
    assert len(ports) >= MASTER_PORTS >= 5
    assert len({config["data_parallel_master_port"], *ports}) == len(ports) + 1
    assert config["data_parallel_size"] == 2
    assert config["data_parallel_master_ip"] == "127.0.0.1"
    low = _ephemeral_low()
    for port in (config["data_parallel_master_port"], *ports):
        # below the ephemeral range: no outgoing connection takes it before an engine
        # binds it (a MoE worker died of EADDRINUSE when one did)
        assert port < low
        with socket.socket() as s:  # each one is free to bind
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("version", ["0.32", "0.33"])
async def test_the_engines_error_reaches_the_stream(version: str) -> None:
    """A request-level error on the engine: the stream's last output has finish
    "error", and with 0.33 engines the engine's reason (`VllmError`); the group goes on
    serving, and `wire_version` says what the ready response said."""
    from tests.test_vllm_group import collect, req, vllm_group

    with trio.fail_after(10):
        async with vllm_group(1, fake_kw={"version": version}) as (group, fake):
            assert group.wire_version(0) == version
            async with group.submit(req("bad", 10**6)) as stream:
                fake.engines[0].fail_request(stream.wire_id, "Invalid structured outputs: x")
                outs = [out async for out in stream]
            last = outs[-1]
            assert last.finish == "error"
            if version == "0.33":
                assert last.body.error == VllmError(
                    "validation_error", "Invalid structured outputs: x", False
                )
            else:
                assert last.body.error is None
            tokens, _ = await collect(group, req("after", 3))
            assert len(tokens) == 3
