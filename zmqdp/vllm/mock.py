"""Fake vLLM 0.32 / 0.33 engine cores: msgspec + pyzmq, no vLLM, no torch. They run
behind ``zmqdp mock --wire vllm`` (try ``zmqdp serve --vllm`` with no vLLM installed:
docs/guides/quickstart-vllm.md), the tests and the benchmarks (tests/fakes/vllm.py
re-exports this module). Each `FakeVllmEngine` speaks the engine side of vLLM's wire
as `vllm/v1/engine/core.py` (`EngineCoreProc`, and `DPEngineCoreProc` for MoE ranks)
of the version it plays (`version`, "0.32" or "0.33", per group or per engine) does,
and runs a toy scheduler. tests/test_vllm_fake_fidelity.py checks the messages
against field lists taken from vLLM's sources, the golden 0.33 frames and a capture of
real 0.32 engine cores (tests/data/vllm_capture_v0320_dense.json);
tests/real_vllm/test_vllm_client_on_fakes.py runs vLLM's own DP client against them.

The model they pretend to run is `MOCK_MODEL` (``zmqdp-mock``, a directory shipped in
the package: `mock_model_dir`): a real tokenizer and chat template, so that a
frontend tokenizes, renders and detokenizes as for a real model, and a 4096-token
context, room for aiperf's default prompts (about 550 tokens) and a long answer.

Start-up (`EngineCoreProc.__init__`, `_perform_handshake`, `startup_handshake`):
HELLO ``{"status": "HELLO", "local": False, "headless": True}`` on the handshake DEALER
(a headless remote engine), the init (`EngineHandshakeMetadata`; an engine that cannot
decode it fails to start), for MoE ranks the DP process group (see "Refusals"), then
the input DEALER, the output PUSH, and when the init names a coordinator an XSUB to its
input (subscribed with ``b"\\x01"``) and a PUSH to its output; the
`EngineCoreReadyResponse` (every field of the version: 25 in 0.32, 28 in 0.33) on the
input socket; the coordinator's ``READY`` on the XSUB if there is one; and READY on the
handshake socket, with ``parallel_config_hash`` when the engine's data_parallel_size
is > 1 after the handshake. A dense rank is an independent engine
(`reconfigure_for_independent_dp_rank`): its data_parallel_size is 1 (unless the init's
parallel_config says otherwise), so its READY carries no hash and its ready response
says ``data_parallel_size: 1``; a MoE rank keeps the group's size. 0.33 engines add
``coord_store_port``, ``elastic_ep_max_dp_size`` and ``num_redundant_experts`` to READY
only with elastic EP (`enable_elastic_ep`).

Generation: a request emits `tokens_per_step` tokens per engine step, token ids counting
up from its last prompt token + 1 (with the group's `token_range` (low, high), ids wrap
from high - 1 back to low: the model's ordinary tokens, so that every one has text). The
output is a fixed function of the prompt, as greedy decoding is: the engines ignore
every sampling parameter but the ones below (temperature, seed, top_p... change
nothing). It stops (vLLM's `check_stop` order) with STOP when
it emits its ``_eos_token_id`` (stop_reason None) or one of its ``stop_token_ids``
(stop_reason = that id), with LENGTH at ``max_tokens`` or at `max_model_len` tokens. At
most `max_num_seqs` requests run per step (in arrival order), the others wait.

Outputs, as vLLM's scheduler makes them (`Scheduler.update_from_output`): one
`EngineCoreOutputs` (all 9 fields) per engine step; a step happens while the engine has
requests, and once more after a request finished or was aborted (the scheduler's
``finished_req_ids`` keep `has_requests()` true until the next `schedule()`). Each
`EngineCoreOutput` has every field of the version (18 in 0.32; 19 in 0.33, the 19th the
`error` RequestError). A step's message says ``weight_version: "default"``. With
stats logging (`log_stats`, the default of ``vllm serve``) each step carries a full
`SchedulerStats` map (18 fields, 0.32 and 0.33 alike) and a request's first output its
QUEUED and SCHEDULED events; the first output always carries the request's
PrefillStats.
``finished_requests`` is filled only when the init names a coordinator (vLLM's
``include_finished_set``: internal DP load balancing): every request that finished
(or was aborted) since the previous step, in that step's message.

Coordinator reports: when the init names a coordinator output (dense and MoE engines
alike: `EngineCoreProc` with ``has_coordinator``), the engine publishes its request
counts to that socket (vLLM's ``client_index -1``) before and after every step when
they changed from the last ones published, starting from ``(0, 0)``
(`_maybe_publish_request_counts`: a request is waiting until its first step); MoE ranks
stamp them with their step counter and wave, dense ones leave both 0.

MoE ranks run their version's `DPEngineCoreProc` wave rules (docs in
/work/shared/reference/vllm_dp.md §3): every step of a running rank is a collective
(`FakeVllmGroup.collective`, a barrier over all ranks: a rank running while a peer is
parked blocks, as a real one does in its all-reduce), the group decides to park at
step 1 and every `sync_interval` steps, rank 0 reports `wave_complete`, START_DP_WAVE
wakes the others (stale waves and the excluded index ignored), and rank 0 reports its
own paused->running edge. Who else starts a wave differs by version (`_add`): a 0.33
rank that gets an ADD while parked always wakes itself and reports ``start_wave``; a
0.32 rank does only for an ADD stamped with an older wave than its own (it adopts a
newer one silently, and for an ADD at its own wave it relies on the frontend's
FIRST_REQ to wake its peers). A step's outputs go out after its collective (the forward
pass is the collective), so a rank stuck in its collective says nothing more.

Refusals (`refused` names why; the engine then never sends READY and closes every
socket, as a real engine core that fails to start exits): an init that is no
`EngineHandshakeMetadata`; for MoE ranks a ``parallel_config`` without all of
data_parallel_master_ip, data_parallel_master_port, _data_parallel_master_port_list,
_coord_store_port, data_parallel_size (vLLM's frontend always sends all five; a real
rank would fall back to its own command-line values, its own port list among them, and
never meet its peers), of another size than the group, with ports that are no ports,
with a non-zero ``_coord_store_port`` nothing listens on (a real engine retries its
TCPStore connect for 2 x 300 s and dies), with DP master ports rank 0 cannot bind
(rank 0 binds each port it pops from ``_data_parallel_master_port_list`` - its DP
group's, retried up to 5 times on EADDRINUSE, and its worker's - and holds it while it
lives), or with another DP master than an earlier rank was given.

Faults: `die()` sends ENGINE_CORE_DEAD and stops; `vanish()` closes every socket
without a word; `freeze()` keeps the sockets but stops stepping (a silent engine);
`fail_request(id, message)` ends a request with FinishReason.ERROR at its next step
(0.33: with its RequestError), as a request-level error in vLLM's scheduler does;
`no_ready=True` says HELLO and never READY; `config_hash` is the READY's
`parallel_config_hash`; `ignore_start_dp_wave=True` drops START_DP_WAVEs (as a vLLM
engine does once a pause reached consensus); `send_raw(frames)` puts any message on the
output socket; `FakeVllmGroup.restart(rank)` makes a new incarnation of a rank (run it:
it says HELLO again).

Prefix cache (`prefix_cache`, on by default, as vLLM's): each engine keeps an LRU of
full blocks of `block_size` prompt tokens, at most `num_gpu_blocks` of them, keyed by its
own chained hash, seeded per incarnation as vLLM's is per process (so no client can
compute it). A new request's cached prefix is its longest run of leading blocks in the
cache, never the whole prompt (vLLM recomputes at least its last token); it is its
first output's ``num_cached_tokens`` and its step's prefix-cache ``hits``; its other
full blocks are stored (leaf first in the LRU, so a prefix's root is evicted last) and
the least recently used blocks beyond `num_gpu_blocks` evicted. `prefill_per_token`
(seconds, 0 by default) is the step time each uncached prompt token adds. Output
tokens are never cached (vLLM caches blocks they fill too), and a running request's
blocks may be evicted (vLLM's are pinned while it runs).

KV events (`kv_events`, a ``--kv-events-config`` map): the engine publishes its cache's
changes as vLLM 0.32's `ZmqEventPublisher` does (docs/kv-events.md): a PUB (an XPUB, to
count subscriptions: `kv_subscriptions`) at the endpoint offset by the rank
(``*``/``::``/ipc: bound; ``tcp://*:0``: bound on ``VLLM_HOST_IP``, or 127.0.0.1, and
the real address reported; a concrete address: connected), one ``[topic, seq,
KVEventBatch]`` per step that changed the cache (`BlockRemoved` per evicted block, then
`BlockStored`; the utility ``reset_prefix_cache`` publishes `AllBlocksCleared`), seq
from 0, the last ``buffer_steps`` batches kept for the replay ROUTER (``[id, b"",
start]`` in, each batch from `start` and the END marker out), and the resolved config in
the ready response's ``kv_events_config``. Faults: `kv_lose(n)` (the next n batches are
counted and buffered but not sent: a PUB past its high-water mark), `kv_replay_mute`
(the replay socket never answers), `publish_kv(events)` (any events, true or not, as the
next batch).

Not modelled: chunked prefill and the token budget,
preemption, several frontends (the engine uses the init's first input and output
address), elastic EP beyond its READY fields, the TCPStore protocol (a non-zero
``_coord_store_port`` that accepts a connection is taken as working).

Messages are handled at the top of each loop iteration, as vLLM's busy loop does; each
socket is owned by one task (`zmqdp._zmq.ZSocket`).
"""

from __future__ import annotations

import collections
import errno
import json
import math
import os
import secrets
import socket as _socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio
import zmq

from zmqdp._zmq import ZSocket

__all__ = [
    "MOCK_MODEL",
    "FakeVllmEngine",
    "FakeVllmGroup",
    "mock_model_dir",
    "model_directory",
    "model_settings",
    "run_fake_group",
    "text_token_range",
]

MOCK_MODEL = "zmqdp-mock"
"""The name of the model directory shipped with zmqdp: ``--model zmqdp-mock`` (the
default of ``zmqdp mock --wire vllm``) and ``zmqdp serve --vllm zmqdp-mock`` find it."""


def mock_model_dir() -> Path:
    """The shipped model directory (package data): config.json, generation_config.json,
    tokenizer.json (a byte-level BPE of 870 tokens), tokenizer_config.json and
    chat_template.jinja; a 4096-token context; about 50 KB."""
    return Path(__file__).resolve().parent / "models" / MOCK_MODEL


def model_directory(model: str | Path) -> Path:
    """The model directory `model` names: a directory that exists (as vLLM, a local path
    first), else the shipped one for ``zmqdp-mock``; any other name is returned as a path
    (the caller then says what is missing in it)."""
    path = Path(model)
    if not path.is_dir() and str(model) == MOCK_MODEL:
        return mock_model_dir()
    return path


MASK64 = (1 << 64) - 1
KV_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _offset(endpoint: str, rank: int) -> str:
    """`ZmqEventPublisher.offset_endpoint_port`: the rank's endpoint (tcp port + rank,
    port 0 left to the OS; inproc suffixed ``_dp<rank>``; others as given)."""
    if rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return endpoint


enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"

VERSIONS = {"0.32": "0.32.0", "0.33": "0.33.0"}
"""The versions a fake plays, and the `vllm_version` each reports."""

STOP, LENGTH, ABORT, ERROR = 0, 1, 2, 3  # vLLM's FinishReason
QUEUED, SCHEDULED = 1, 2  # EngineCoreEventType

DP_INIT_KEYS = (
    "data_parallel_master_ip",
    "data_parallel_master_port",
    "_data_parallel_master_port_list",
    "_coord_store_port",
    "data_parallel_size",
)
"""What vLLM's frontend puts in a MoE init's parallel_config (`wait_for_engine_startup`)."""

KV_FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")

DP_PORT_RETRIES = 5
"""`ParallelConfig.stateless_init_dp_group`: tries with a fresh port after EADDRINUSE."""


def play(version: str) -> str:
    """A version name ("0.32", "0.33", or "0.32.0", "0.33.0") as the key of `VERSIONS`."""
    v = ".".join(str(version).split(".")[:2])
    if v not in VERSIONS:
        raise ValueError(f"the fake plays vLLM {sorted(VERSIONS)}, not {version!r}")
    return v


def outputs_message(
    rank: int,
    outputs: list[list[Any]] | None = None,
    stats: dict[str, Any] | None = None,
    utility: list[Any] | None = None,
    wave_complete: int | None = None,
    start_wave: int | None = None,
    *,
    finished_requests: list[str] | None = None,
    timestamp: float | None = None,
    weight_version: str | None = None,
) -> bytes:
    """An `EngineCoreOutputs` as vLLM encodes it (0.32 and 0.33: all 9 fields). An
    engine step's message has ``weight_version="default"`` (`_attach_weight_version`);
    count reports, utility replies and wave messages have None."""
    return enc(
        [
            rank,
            outputs or [],
            stats,
            time.monotonic() if timestamp is None else timestamp,
            utility,
            finished_requests,
            wave_complete,
            start_wave,
            weight_version,
        ]
    )


def output_entry(
    rid: str,
    tokens: list[int],
    finish: int | None,
    stop: Any = None,
    *,
    version: str = "0.33",
    events: list[dict[str, Any]] | None = None,
    trace_headers: dict[str, str] | None = None,
    prefill_stats: dict[str, int] | None = None,
    error: dict[str, Any] | None = None,
) -> list[Any]:
    """An `EngineCoreOutput` as vLLM encodes it: 18 fields in 0.32, 19 in 0.33 (the 19th
    is `error`, a RequestError map, sent with FinishReason.ERROR)."""
    e: list[Any] = [rid, tokens, None, None, None, finish, stop, events, None, None]
    e += [trace_headers, prefill_stats, None, 0, None, None, None, None]
    if not version.startswith("0.32"):
        e.append(error)
    return e


def request_error(code: str, message: str, retryable: bool = False) -> dict[str, Any]:
    """vLLM 0.33's `RequestError` (a dataclass: a map)."""
    return {"code": code, "message": message, "retryable": retryable}


def prefix_cache_stats(requests: int = 0, queries: int = 0, hits: int = 0) -> dict[str, Any]:
    """`PrefixCacheStats` as msgspec encodes the dataclass."""
    return {
        "reset": False,
        "requests": requests,
        "queries": queries,
        "hits": hits,
        "preempted_requests": 0,
        "preempted_queries": 0,
        "preempted_hits": 0,
        "hits_by_source": {},
    }


def scheduler_stats(
    running: int = 0,
    waiting: int = 0,
    *,
    kv_cache_usage: float = 0.0,
    step_counter: int = 0,
    current_wave: int = 0,
    prefix: dict[str, Any] | None = None,
    step: bool = False,
) -> dict[str, Any]:
    """`SchedulerStats` as msgspec encodes the dataclass (every field, in order; the
    same 18 in 0.32 and 0.33). `step`: as `Scheduler.make_stats` fills it for a step's
    message (the KV fetch counts by stage), else as a count report leaves it."""
    return {
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_skipped_waiting_reqs": 0,
        "num_kv_fetch_reqs_by_stage": dict.fromkeys(KV_FETCH_STAGES, 0) if step else {},
        "step_counter": step_counter,
        "current_wave": current_wave,
        "kv_cache_usage": kv_cache_usage,
        "iteration_details": None,
        "prefix_cache_stats": prefix or prefix_cache_stats(),
        "connector_prefix_cache_stats": None,
        "kv_cache_eviction_events": [],
        "spec_decoding_stats": None,
        "kv_connector_stats": None,
        "ec_connector_stats": None,
        "waiting_lora_adapters": {},
        "running_lora_adapters": {},
        "cudagraph_stats": None,
        "perf_stats": None,
    }


class FakeVllmGroup:
    """N fake engines and the collective that couples MoE ranks. `version`,
    `max_model_len`, `max_num_seqs` and `log_stats` are each engine's defaults (an
    engine's own attributes may be changed before it runs); `token_range`: see the
    module docstring (Generation)."""

    def __init__(
        self,
        url: str,
        size: int,
        *,
        moe: bool = False,
        sync_interval: int = 2,
        tokens_per_step: int = 1,
        step_delay: float = 0.0,
        version: str = "0.33",
        max_model_len: int = 4096,
        max_num_seqs: int = 256,
        log_stats: bool = True,
        token_range: tuple[int, int] | None = None,
        eos_after: int | None = None,
        prefix_cache: bool = True,
        prefill_per_token: float = 0.0,
        block_size: int = 16,
        num_gpu_blocks: int = 27000,
        kv_events: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.prefix_cache = prefix_cache
        """Each engine caches its prompts' full blocks (module docstring)."""
        self.prefill_per_token = prefill_per_token
        """Seconds of step time per uncached prompt token."""
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.kv_events = dict(kv_events) if kv_events is not None else None
        """The engines' ``--kv-events-config`` (None: no events)."""
        self.token_range = token_range
        """(low, high): generated ids wrap from high - 1 to low (None: they count up)."""
        self.eos_after = eos_after
        """A request's EOS token (its ``_eos_token_id``, if it has one) is generated as
        its `eos_after`-th token (after ``min_tokens``): the answer ends as a model's
        does (None: never)."""
        self.size = size
        self.moe = moe
        self.sync_interval = sync_interval
        self.version = play(version)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.log_stats = log_stats
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.tokens_per_step = tokens_per_step
        self.step_delay = step_delay
        self.engines = [
            FakeVllmEngine(self, r, tokens_per_step=tokens_per_step, step_delay=step_delay)
            for r in range(size)
        ]
        self.nursery: trio.Nursery | None = None  # set by the tests' fixture
        # the DP master the first MoE rank was given (the others must be given the same)
        self.dp_master: tuple[int, tuple[Any, ...]] | None = None
        # the collective: a generation-counting barrier with a global OR
        self._arrived = 0
        self._any = False
        self._generation = 0
        self._released = trio.Event()
        self._result = False
        self.collectives = 0

    async def collective(self, local_unfinished: bool) -> bool:
        """One DP collective (forward pass + all-reduce): blocks until every rank joins."""
        self._arrived += 1
        self._any = self._any or local_unfinished
        if self._arrived == self.size:
            self._result, self._any, self._arrived = self._any, False, 0
            self._generation += 1
            self.collectives += 1
            released, self._released = self._released, trio.Event()
            released.set()
            await trio.lowlevel.checkpoint()
            return self._result
        await self._released.wait()
        return self._result

    def restart(self, rank: int) -> FakeVllmEngine:
        """A new incarnation of `rank` (the old one should be gone: `vanish()`), started
        with the same settings; it says HELLO when run."""
        old = self.engines[rank]
        engine = FakeVllmEngine(
            self, rank, tokens_per_step=self.tokens_per_step, step_delay=self.step_delay
        )
        for name in FakeVllmEngine.SETTINGS:
            setattr(engine, name, getattr(old, name))
        self.engines[rank] = engine
        return engine

    def close(self) -> None:
        """Close every engine's sockets and the group's ZeroMQ context."""
        for e in self.engines:
            e.close()
        self.context.destroy(linger=0)


class FakeVllmEngine:
    """One fake engine core: rank `rank` of `group`, a headless `EngineCoreProc` (or
    `DPEngineCoreProc` for a MoE group). `run` it: it connects to the group's URL, does
    the handshake and serves until it is cancelled or a fault stops it (module
    docstring)."""

    SETTINGS = (
        "version",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "num_gpu_blocks",
        "block_size",
        "dtype",
        "log_stats",
        "config_hash",
        "enable_elastic_ep",
        "prefix_cache",
        "prefill_per_token",
        "kv_events",
    )
    """What a restarted incarnation keeps (its command line)."""

    def __init__(
        self, group: FakeVllmGroup, rank: int, *, tokens_per_step: int, step_delay: float
    ) -> None:
        self.group = group
        self.rank = rank
        self.moe = group.moe
        self.tokens_per_step = tokens_per_step
        self.step_delay = step_delay
        self.identity = rank.to_bytes(2, "little")
        # the command line and what the engine computed at start-up
        self.version = group.version
        self.max_model_len = group.max_model_len
        self.max_num_seqs = group.max_num_seqs
        self.max_num_batched_tokens = 8192
        self.num_gpu_blocks = group.num_gpu_blocks
        self.block_size = group.block_size
        self.prefix_cache = group.prefix_cache
        self.prefill_per_token = group.prefill_per_token
        self.kv_events: dict[str, Any] | None = group.kv_events
        """Its ``--kv-events-config`` (module docstring)."""
        self.kv_events_config: dict[str, Any] | None = None
        """The resolved config (ready response), once its publisher is set up."""
        self.hash_seed = secrets.randbits(64)  # vLLM's NONE_HASH: random per process
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        """Cached blocks (the engine's hashes), least recently used first."""
        self.cache_hits = 0
        """Prompt tokens served from the cache, in all."""
        self.kv_seq = 0
        """The seq of the next KV-event batch."""
        self.kv_published: list[list[dict[str, Any]]] = []
        """Every KV-event batch's events, for the tests."""
        self.kv_replay_mute = False
        """The replay socket reads requests and never answers."""
        self._kv_lose = 0
        self._kv_events: list[dict[str, Any]] = []  # of the step under way
        self._kv_buffer: collections.deque[tuple[int, bytes]] = collections.deque()
        self._kv_out: collections.deque[list[bytes]] = collections.deque()
        self._kv_pub: ZSocket | None = None
        self.kv_subscriptions = 0
        """Subscriptions its KV-event PUB received."""
        self._prefilled = 0  # uncached prompt tokens of the last step
        self.dtype = "bfloat16"
        self.log_stats = group.log_stats
        self.enable_elastic_ep = False
        self.instance_id = str(time.time_ns())  # VllmConfig.__post_init__
        self.requests: dict[str, dict[str, Any]] = {}  # id -> state, in arrival order
        self.inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self.received: list[tuple[str, Any]] = []  # every message, for the tests
        self.changed = trio.Event()
        self._seen = trio.Event()
        self.utilities: dict[str, Any] = {
            "is_sleeping": lambda: False,
            "get_supported_tasks": lambda: ["generate"],
            "echo": lambda *a: list(a),
            "reset_mm_cache": lambda: None,  # vLLM's API server calls it at start-up
            "reset_prefix_cache": self.reset_prefix_cache,
        }
        self.no_ready = False
        self.frozen = False
        self.dead = False
        self.refused: str | None = None
        """Why the engine refused its init and died (None: it did not)."""
        self.stopped = trio.Event()
        """Set when `run` returned (refused, vanished, died)."""
        self.stats_override: dict[str, Any] | None = None
        self.config_hash = "fake-hash"
        self.ignore_start_dp_wave: bool | Callable[[], bool] = False
        self.dropped_starts = 0
        self.has_coordinator = False
        self.dp_size = group.size if group.moe else 1
        self.coord_store_port = 0
        self._last_counts: tuple[int, int] = (0, 0)  # EngineCoreProc.last_counts
        self._finished_since: set[str] = set()  # the scheduler's finished_req_ids
        self._finished_for_client: list[str] = []  # finished_req_ids_dict[0]
        self._to_fail: dict[str, dict[str, Any]] = {}
        self._executed = False
        self._new_requests = self._new_prompt_tokens = self._new_hits = 0  # of the last step
        self._dp_listeners: list[_socket.socket] = []
        # wave state (MoE)
        self.current_wave = 0
        self.engines_running = False
        self.step_counter = 0
        self.sockets: list[ZSocket] = []
        self.init: dict[str, Any] | None = None
        self.up = trio.Event()
        self.cancel = trio.CancelScope()

    # -- sockets ----------------------------------------------------------------------

    def _socket(self, kind: int, address: str, identity: bytes | None = None) -> ZSocket:
        sock = self.group.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(address)
        zs = ZSocket(sock)
        self.sockets.append(zs)
        return zs

    def _kv_socket(self, kind: int, endpoint: str) -> tuple[ZSocket, str]:
        """A KV-event socket at `endpoint` (already offset by the rank), bound or
        connected as `ZmqEventPublisher._socket_setup` does; the endpoint it reports."""
        sock = self.group.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        zs = ZSocket(sock)
        self.sockets.append(zs)
        bind = kind == zmq.ROUTER or "*" in endpoint or "::" in endpoint
        if not (bind or endpoint.startswith(("ipc://", "inproc://"))):
            sock.connect(endpoint)
        elif endpoint == "tcp://*:0":  # the node's IP, and the port the OS picked
            sock.bind(f"tcp://{os.environ.get('VLLM_HOST_IP') or '127.0.0.1'}:0")
            last = sock.getsockopt(zmq.LAST_ENDPOINT)
            endpoint = last.decode() if isinstance(last, bytes) else str(last)
        else:
            sock.bind(endpoint)
        return zs, endpoint

    def _open_kv_events(self) -> tuple[ZSocket | None, ZSocket | None]:
        """The publisher's PUB and replay ROUTER (`ZmqEventPublisher.__init__`), if the
        engine has a kv-events config that enables them; sets `kv_events_config`."""
        cfg = self.kv_events
        if not cfg or not cfg.get("enable_kv_cache_events"):
            self.kv_events_config = None
            return None, None
        endpoint = _offset(str(cfg.get("endpoint", "tcp://*:5557")), self.rank)
        replay_at = cfg.get("replay_endpoint")
        pub, endpoint = self._kv_socket(zmq.XPUB, endpoint)
        pub.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._kv_pub = pub
        replay = None
        if replay_at:
            replay, replay_at = self._kv_socket(zmq.ROUTER, _offset(str(replay_at), self.rank))
        buffer_steps = int(cfg.get("buffer_steps", 10_000))
        self._kv_buffer = collections.deque(maxlen=buffer_steps)
        self.kv_events_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay_at,
            "buffer_steps": buffer_steps,
            "hwm": int(cfg.get("hwm", 100_000)),
            "max_queue_size": int(cfg.get("max_queue_size", 100_000)),
            "topic": str(cfg.get("topic", "")),
        }
        return pub, replay

    def close(self) -> None:
        """Close the engine's sockets and DP listeners (a dead process's are gone)."""
        for zs in self.sockets:
            zs.close()
        self.sockets = []
        for s in self._dp_listeners:
            s.close()
        self._dp_listeners = []

    # -- life -------------------------------------------------------------------------

    async def run(self) -> None:
        """Start up and serve until cancelled, `vanish()`ed, `die()`d or refused."""
        with self.cancel:
            try:
                await self._run()
            finally:
                self.close()
                self.stopped.set()
                self._seen.set()

    def _refuse(self, why: str) -> None:
        """Fail to start, as a real engine core whose constructor raises: no READY,
        every socket closed (by `run`)."""
        self.refused = why
        self.dead = True

    async def _run(self) -> None:
        hs = self._socket(zmq.DEALER, self.group.url, self.identity)
        await hs.send([enc({"status": "HELLO", "local": False, "headless": True})])
        [body] = (await hs.receive_batch(1))[0]
        try:
            self.init = init = dec(body)
        except msgspec.DecodeError as exc:
            return self._refuse(f"the init is not msgpack: {exc}")
        if (why := _init_problem(init)) is not None:
            return self._refuse(why)
        addrs = init["addresses"]
        pc = init["parallel_config"]
        # startup_handshake: the init's parallel_config overrides the engine's own
        self.dp_size = pc.get("data_parallel_size", self.dp_size)
        if self.moe and (why := await self._init_data_parallel(pc)) is not None:
            return self._refuse(why)
        self.has_coordinator = addrs.get("coordinator_output") is not None
        inp = self._socket(zmq.DEALER, addrs["inputs"][0], self.identity)
        out = self._socket(zmq.PUSH, addrs["outputs"][0])
        coord_out = xsub = None
        if addrs.get("coordinator_output") is not None:
            coord_out = self._socket(zmq.PUSH, addrs["coordinator_output"])
        if addrs.get("coordinator_input") is not None:
            xsub = self._socket(zmq.XSUB, addrs["coordinator_input"])
            await xsub.send([b"\x01"])
        kv_pub, kv_replay = self._open_kv_events()  # the scheduler's, made before READY
        await inp.send([enc(self.ready_response())])
        if xsub is not None:  # "Waiting for READY message from DP Coordinator..."
            while True:
                msgs = await xsub.receive_batch(1)
                if msgs[0] == [b"READY"]:
                    break
        if self.no_ready:
            await trio.sleep_forever()
        await hs.send([enc(self.ready_message())])
        self.up.set()
        for zs in self.sockets:  # handed over to the tasks below, one owner each
            zs.release()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_input, inp)
            if xsub is not None:
                nursery.start_soon(self._serve_xsub, xsub)
            if kv_pub is not None:
                nursery.start_soon(self._serve_kv_pub, kv_pub)
            if kv_replay is not None:
                nursery.start_soon(self._serve_kv_replay, kv_replay)
            await self._busy_loop(out, coord_out)
            nursery.cancel_scope.cancel()

    async def _init_data_parallel(self, pc: dict[str, Any]) -> str | None:
        """`DPEngineCoreProc._init_data_parallel`: join the DP process group with what
        the init gave. Returns why a real rank would fail to (None: it would not)."""
        missing = [k for k in DP_INIT_KEYS if k not in pc]
        if missing:
            return (
                f"the init's parallel_config lacks {missing}: the rank would use its own "
                "command-line values (its own pre-allocated master ports among them) and "
                "never meet its peers in the DP group"
            )
        ip, port = pc["data_parallel_master_ip"], pc["data_parallel_master_port"]
        ports, store = pc["_data_parallel_master_port_list"], pc["_coord_store_port"]
        size = pc["data_parallel_size"]
        if size != self.group.size:
            return f"data_parallel_size {size!r} in a group of {self.group.size}"
        candidates = [port, *ports] if type(ports) is list else [None]
        if type(ip) is not str or not all(type(p) is int and 0 < p < 65536 for p in candidates):
            return f"the DP master {ip!r}:{port!r}, ports {ports!r} are no address and ports"
        if type(store) is not int or store < 0:
            return f"_coord_store_port {store!r} is no port"
        master = (ip, port, tuple(ports), store)
        if self.group.dp_master is None:
            self.group.dp_master = (self.rank, master)
        elif self.group.dp_master[1] != master:
            other, theirs = self.group.dp_master
            return (
                f"rank {self.rank} was given the DP master {master}, rank {other} {theirs}: "
                "the ranks would never meet in their DP group (a real engine times out)"
            )
        if store:
            try:
                with trio.fail_after(5):
                    stream = await trio.open_tcp_stream(ip, store)
                await stream.aclose()
            except (OSError, trio.TooSlowError) as exc:
                return (
                    f"_coord_store_port {store}: no TCPStore at {ip}:{store} ({exc}); a real "
                    "engine retries its TCPStore connect for 2 x 300 s, then dies "
                    "(DistNetworkError)"
                )
            return None  # the TCPStore picks the ports (the fake does not speak it)
        if self.rank != 0:
            return None  # only rank 0 binds; the others connect to it
        # ParallelConfig.get_next_dp_init_port: pop from the end of the list, then count
        # up from data_parallel_master_port. The engine's DP group (retried on
        # EADDRINUSE), then its worker's world group.
        left, next_port = list(ports), port
        for tries in (DP_PORT_RETRIES, 1):
            for attempt in range(tries):
                if left:
                    p = left.pop()
                else:
                    p, next_port = next_port, next_port + 1
                s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
                s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)  # as c10d's store
                try:
                    s.bind((ip, p))
                    s.listen()
                except OSError as exc:
                    s.close()
                    if exc.errno == errno.EADDRINUSE and attempt + 1 < tries:
                        continue
                    return f"rank 0 cannot listen on its DP master port {ip}:{p}: {exc}"
                self._dp_listeners.append(s)
                break
        return None

    def ready_response(self) -> dict[str, Any]:
        """The `EngineCoreReadyResponse` (`_make_ready_response`), every field of the
        version, in the dataclass's order."""
        init = self.init or {}
        addrs = init.get("addresses") or {}
        tokens = self.num_gpu_blocks * self.block_size
        r: dict[str, Any] = {
            "max_model_len": self.max_model_len,
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_size": self.block_size,
            "dp_stats_address": addrs.get("frontend_stats_publish_address"),
            "dtype": self.dtype,
            "vllm_version": VERSIONS[play(self.version)],
            "world_size": 1,
            "data_parallel_size": self.dp_size,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "decode_context_parallel_size": 1,
            "data_parallel_rank": self.rank,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "instance_id": self.instance_id,
            "supports_lora": False,
            "max_loras": 0,
            "mamba_block_size": None,
            "kv_cache_size_tokens": tokens,
            "kv_cache_max_concurrency": tokens / self.max_model_len,
            "kv_events_config": self.kv_events_config,
            "weight_transfer_backend": None,
            "enable_sleep_mode": False,
            "supports_draft_weight_updates": False,
            "effective_attention_block_size": self.block_size,
        }
        if play(self.version) != "0.32":
            r["coord_store_port"] = self._coord_store_port()
            r["coordinator_input_address"] = addrs.get("coordinator_input")
            r["coordinator_output_address"] = addrs.get("coordinator_output")
        return r

    def _coord_store_port(self) -> int:
        pc = (self.init or {}).get("parallel_config") or {}
        port = pc.get("_coord_store_port", 0)
        return port if type(port) is int else 0

    def ready_message(self) -> dict[str, Any]:
        """READY on the handshake socket (`_perform_handshake`)."""
        ready: dict[str, Any] = {"status": "READY", "local": False, "headless": True}
        if self.dp_size > 1:
            ready["parallel_config_hash"] = self.config_hash
        if play(self.version) != "0.32" and self.enable_elastic_ep:
            ready["coord_store_port"] = self._coord_store_port()
            ready["elastic_ep_max_dp_size"] = self.group.size
            ready["num_redundant_experts"] = 0
        return ready

    def _push(self, kind: str, value: Any) -> None:
        self.inbox.append((kind, value))
        self.received.append((kind, value))
        self.changed.set()
        self._seen.set()

    async def wait_for(self, predicate: Any) -> None:
        """Until `predicate()` holds, re-checked after every message received and
        after the busy loop handled its inbox."""
        while not predicate():
            self._seen = trio.Event()
            await self._seen.wait()

    def got(self, kind: str) -> list[Any]:
        """Every message of `kind` received ("add", "abort", "utility", "start_dp_wave")."""
        return [v for k, v in self.received if k == kind]

    def send_raw(self, frames: list[bytes]) -> None:
        """Put `frames` on the output socket (from the busy loop, its owner)."""
        self.inbox.append(("raw", frames))
        self.changed.set()

    async def _serve_input(self, zs: ZSocket) -> None:
        while True:
            for frames in await zs.receive_batch():
                kind, payload = frames[0], dec(frames[1])
                if kind == b"\x00":
                    self._push("add", payload)
                elif kind == b"\x01":
                    self._push("abort", payload)
                elif kind == b"\x03":
                    self._push("utility", payload)

    # -- the prefix cache and its KV events -----------------------------------------

    def _prefix(self, tokens: Sequence[int]) -> int:
        """A new request's prompt meets the cache (module docstring): its cached tokens.
        Stores its other full blocks and evicts past `num_gpu_blocks`, noting the
        events of both."""
        if not self.prefix_cache:
            return 0
        bs = self.block_size
        blocks = len(tokens) // bs
        hashes: list[int] = []
        parent: int | None = None
        for i in range(blocks):
            parent = hash((self.hash_seed, parent, *tokens[i * bs : (i + 1) * bs])) & MASK64
            hashes.append(parent)
        cache = self.cache
        hit = 0
        limit = min(blocks, (len(tokens) - 1) // bs)  # at least one token recomputed
        while hit < limit and hashes[hit] in cache:
            hit += 1
        mark = len(self._kv_events)
        stored: list[int] = []
        for i in range(hit, blocks + 1):  # runs of blocks not cached yet, each one event
            if i < blocks and hashes[i] not in cache:
                stored.append(i)
                continue
            if stored:
                first = stored[0]
                self._kv_events.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [hashes[j] for j in stored],
                        "parent_block_hash": hashes[first - 1] if first else None,
                        "token_ids": list(tokens[first * bs : (stored[-1] + 1) * bs]),
                        "block_size": bs,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                    }
                )
                stored = []
        for h in reversed(hashes):  # leaf first: the root is the most recently used
            cache[h] = None
            cache.move_to_end(h)
        removed = []
        while len(cache) > max(self.num_gpu_blocks, blocks):
            h, _ = cache.popitem(last=False)
            removed.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"})
        self._kv_events[mark:mark] = removed  # vLLM evicts (to allocate), then stores
        self.cache_hits += hit * bs
        return hit * bs

    def reset_prefix_cache(self) -> bool:
        """The ``reset_prefix_cache`` utility: empty the cache (`AllBlocksCleared`)."""
        self.cache.clear()
        self._kv_events.append({"type": "AllBlocksCleared"})
        self._publish_kv_step()
        return True

    def publish_kv(self, events: list[dict[str, Any]]) -> None:
        """Publish `events` (any, true or not) as the next batch: a lying engine."""
        self._kv_events.extend(events)
        self._publish_kv_step()

    def kv_lose(self, batches: int = 1) -> None:
        """The next `batches` batches get their seq and a place in the replay buffer,
        but never reach a subscriber (vLLM's PUB past its high-water mark)."""
        self._kv_lose += batches

    def _publish_kv_step(self) -> None:
        """The step's events as one batch (`Scheduler.update_from_output`), if any and
        if the engine publishes."""
        events, self._kv_events = self._kv_events, []
        cfg = self.kv_events_config
        if not events or cfg is None:
            return
        self.kv_published.append(events)
        seq, self.kv_seq = self.kv_seq, self.kv_seq + 1
        payload = enc([time.time(), events, self.rank])
        self._kv_buffer.append((seq, payload))
        if self._kv_lose:
            self._kv_lose -= 1
            return
        self._kv_out.append([cfg["topic"].encode(), seq.to_bytes(8, "big"), payload])
        if self._kv_pub is not None:
            self._kv_pub.kick()

    async def _serve_kv_pub(self, zs: ZSocket) -> None:
        """Own the PUB: send what the steps queued (it never blocks: past its high-water
        mark it drops). It is an XPUB, which subscribers cannot tell from vLLM's PUB,
        so that tests can wait for a subscription (`kv_subscriptions`) instead of
        losing the first batches to ZeroMQ's slow joiner."""
        while True:
            for frames in zs.receive_nowait():
                if frames and frames[0][:1] == b"\x01":
                    self.kv_subscriptions += 1
                    self._seen.set()
            while self._kv_out:
                zs.send_nowait(self._kv_out.popleft())
            await zs.wait_readable_or_kicked()

    async def _serve_kv_replay(self, zs: ZSocket) -> None:
        """Own the replay ROUTER (`_service_replay`): a 3-frame request gets every
        buffered batch from its seq on, then the END marker; others are ignored."""
        assert self.kv_events_config is not None
        topic = self.kv_events_config["topic"].encode()
        while True:
            for frames in await zs.receive_batch():
                if len(frames) != 3 or self.kv_replay_mute:
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                for seq, payload in list(self._kv_buffer):
                    if seq >= first:
                        zs.send_nowait([client, b"", topic, seq.to_bytes(8, "big"), payload])
                zs.send_nowait([client, b"", b"", KV_END_SEQ, b""])

    async def _serve_xsub(self, zs: ZSocket) -> None:
        while True:
            for frames in await zs.receive_batch():
                if frames[0] == b"\x02":
                    self._push("start_dp_wave", dec(frames[1]))

    # -- the busy loop (vLLM's EngineCoreProc / DPEngineCoreProc) -----------------------

    def has_work(self) -> bool:
        """The busy loop steps (`EngineCoreProc._process_engine_step` would run)."""
        return self.engines_running or bool(self.requests) or bool(self._finished_since)

    async def _busy_loop(self, out: ZSocket, coord: ZSocket | None) -> None:
        while True:
            while not self.inbox and (self.frozen or not self.has_work()):
                self.changed = trio.Event()
                await self.changed.wait()
            was_running = self.engines_running  # before the inbox, as vLLM's loop
            for frames in self._process_inbox(coord):
                await out.send(frames)
            if self.frozen or self.dead:
                await trio.lowlevel.checkpoint()  # a dead engine's cancel lands here
                continue
            await self._maybe_publish_request_counts(coord)
            message = self._engine_step()
            executed = self._executed
            if self._prefilled and self.prefill_per_token > 0:
                await trio.sleep(self._prefilled * self.prefill_per_token)  # the prefill
            if not self.moe:
                if message is not None:
                    await out.send([message])
                await self._maybe_publish_request_counts(coord)
                if self.step_delay and executed:
                    await trio.sleep(self.step_delay)
                await trio.lowlevel.checkpoint()
                self._seen.set()
                continue
            if not executed:
                if message is not None:  # a step that ran no model: no collective in it
                    await out.send([message])
                await self._maybe_publish_request_counts(coord)
            local_unfinished = bool(self.requests)
            if not executed and not local_unfinished and not self.engines_running:
                self._seen.set()
                await trio.lowlevel.checkpoint()
                continue
            if self.step_delay:
                await trio.sleep(self.step_delay)
            # the forward pass (the step's, or a dummy batch): a collective
            global_unfinished = await self.group.collective(local_unfinished)
            if executed:
                if message is not None:
                    await out.send([message])
                await self._maybe_publish_request_counts(coord)
            # _has_global_unfinished_reqs
            self.step_counter += 1
            sync = self.step_counter == 1 or self.step_counter % self.group.sync_interval == 0
            self.engines_running = global_unfinished if sync else True
            if not self.engines_running:
                if self.rank == 0 or coord is None:
                    done = outputs_message(self.rank, wave_complete=self.current_wave)
                    await (out if coord is None else coord).send([done])
                self.current_wave += 1
                self.step_counter = 0
            elif not was_running and coord is not None and self.rank == 0:
                await coord.send([outputs_message(0, start_wave=self.current_wave)])
            self._seen.set()  # `wait_for` re-checks after every step (a park, say)

    async def _maybe_publish_request_counts(self, coord: ZSocket | None) -> None:
        if coord is None:  # publish_dp_lb_stats: only with a coordinator
            return
        counts = self._counts()
        if counts != self._last_counts:
            self._last_counts = counts
            await coord.send([outputs_message(self.rank, stats=self._published_stats())])

    def _counts(self) -> tuple[int, int]:
        """`Scheduler.get_request_counts`: (running, waiting)."""
        waiting = sum(1 for st in self.requests.values() if not st["scheduled"])
        return len(self.requests) - waiting, waiting

    def _kv_cache_usage(self) -> float:
        blocks = sum(
            math.ceil((st["prompt"] + st["generated"]) / self.block_size)
            for st in self.requests.values()
            if st["scheduled"]
        )
        return min(1.0, float(blocks) / self.num_gpu_blocks)

    def _published_stats(self) -> dict[str, Any]:
        if self.stats_override is not None:
            return self.stats_override
        running, waiting = self._counts()
        return scheduler_stats(
            running,
            waiting,
            kv_cache_usage=self._kv_cache_usage(),
            step_counter=self.step_counter if self.moe else 0,
            current_wave=self.current_wave if self.moe else 0,
        )

    def _process_inbox(self, coord: ZSocket | None) -> list[list[bytes]]:
        """Handle every queued message; returns the messages to send on the output
        socket (utility replies, raw messages)."""
        replies: list[list[bytes]] = []
        while self.inbox:
            kind, p = self.inbox.popleft()
            if kind == "raw":
                replies.append(p)
            elif kind == "add":
                self._add(p, coord)
            elif kind == "abort":
                for rid in p:  # Scheduler.finish_requests(FINISHED_ABORTED): no output
                    self._to_fail.pop(rid, None)
                    if self.requests.pop(rid, None) is not None:
                        self._finished(rid)
            elif kind == "utility":
                _client, call_id, method, args = p
                fn = self.utilities.get(method)
                if fn is None:
                    continue  # a method that never answers
                try:
                    reply = [call_id, None, [None, fn(*args)]]
                except Exception as exc:
                    reply = [call_id, f"Call to {method} method failed: {exc}", None]
                replies.append([outputs_message(self.rank, utility=reply)])
            elif kind == "start_dp_wave":
                if not self.moe:
                    continue  # EngineCoreProc: "Unrecognized input request type"
                ignore = self.ignore_start_dp_wave
                if ignore() if callable(ignore) else ignore:
                    self.dropped_starts += 1
                    continue
                wave, exclude = p
                if exclude != self.rank and wave >= self.current_wave:
                    self.current_wave = wave
                    self.engines_running = True
        self._seen.set()  # `wait_for` also re-checks what handling a message changed
        return replies

    def _add(self, req: list[Any], coord: ZSocket | None) -> None:
        sp = req[3]
        rid = req[0]
        self.requests[rid] = {
            "next": self._next_token(req[1][-1]),
            "prompt": len(req[1]),
            "tokens": req[1],
            "generated": 0,
            "left": sp.get("max_tokens", 16),
            "eos": sp.get("_eos_token_id"),
            "stops": set(sp.get("stop_token_ids", [])),
            "eos_at": self._eos_at(sp),
            "scheduled": False,
            "events": [{"type": QUEUED, "timestamp": time.monotonic()}] if self.log_stats else [],
            "trace_headers": req[14] if len(req) > 14 else None,
        }
        if not (self.moe and coord is not None):  # the wave rules need a coordinator
            return
        wave = req[12] if len(req) > 12 else 0
        if play(self.version) == "0.32":
            if wave != self.current_wave:
                if wave > self.current_wave:
                    self.current_wave = wave
                elif not self.engines_running:
                    # "Request received for an already-completed wave, notify
                    # front-end that we need to start the next one."
                    self.engines_running = True
                    coord.send_nowait([outputs_message(self.rank, start_wave=self.current_wave)])
            return
        if wave > self.current_wave:
            self.current_wave = wave
        if not self.engines_running:
            # "Engines alone start waves: have the coordinator wake the others."
            self.engines_running = True
            coord.send_nowait([outputs_message(self.rank, start_wave=self.current_wave)])

    def _eos_at(self, sp: dict[str, Any]) -> int | None:
        """Which generated token is the request's EOS (`FakeVllmGroup.eos_after`)."""
        after = self.group.eos_after
        eos = sp.get("_eos_token_id")
        if after is None or type(eos) is not int:
            return None
        min_tokens = sp.get("min_tokens", 0)
        return max(after, (min_tokens if type(min_tokens) is int else 0) + 1)

    def _next_token(self, token: int) -> int:
        """The id generated after `token`: the next one, wrapped into `token_range`."""
        bounds = self.group.token_range
        if bounds is None:
            return token + 1
        low, high = bounds
        return token + 1 if low <= token < high - 1 else low

    def _finished(self, rid: str) -> None:
        self._finished_since.add(rid)
        if self.has_coordinator:  # include_finished_set (internal DP load balancing)
            self._finished_for_client.append(rid)

    def _engine_step(self) -> bytes | None:
        """`EngineCore.step`: nothing if the scheduler has no requests (unfinished, or
        finished since the last schedule), else one `EngineCoreOutputs` (None if it
        would carry nothing). Sets `_executed` (the model ran)."""
        if not self.requests and not self._finished_since:
            self._executed = False
            return None
        outputs = self._step()
        self._publish_kv_step()
        finished = None
        if self._finished_for_client:
            finished, self._finished_for_client = self._finished_for_client, []
        stats = self._stats() if self.log_stats or self.stats_override is not None else None
        if not outputs and finished is None and stats is None:
            return None
        return outputs_message(
            self.rank, outputs, stats, finished_requests=finished, weight_version="default"
        )

    def _step(self) -> list[list[Any]]:
        """Schedule and run one step; the step's `EngineCoreOutput` entries."""
        self._finished_since.clear()  # schedule() hands them to the model runner
        outputs = []
        failed = []
        version = play(self.version)
        self._new_prompt_tokens = new_requests = self._new_hits = self._prefilled = 0
        running = 0
        now = time.monotonic()
        for rid, st in list(self.requests.items()):
            if rid in self._to_fail:
                failed.append(rid)
                continue
            if running >= self.max_num_seqs:
                continue  # waits for a free slot
            running += 1
            first = not st["scheduled"]
            st["scheduled"] = True
            if first:
                new_requests += 1
                self._new_prompt_tokens += st["prompt"]
                st["cached"] = cached = self._prefix(st["tokens"])
                self._new_hits += cached
                self._prefilled += st["prompt"] - cached
                if self.log_stats:
                    st["events"].append({"type": SCHEDULED, "timestamp": now})
            tokens: list[int] = []
            finish = stop = None
            for _ in range(self.tokens_per_step):
                t = st["next"]
                st["next"] = self._next_token(t)
                if st["generated"] + 1 == st["eos_at"]:
                    t = st["eos"]
                st["left"] -= 1
                st["generated"] += 1
                tokens.append(t)
                if t == st["eos"]:
                    finish = STOP
                elif t in st["stops"]:
                    finish, stop = STOP, t
                elif st["left"] <= 0 or st["prompt"] + st["generated"] >= self.max_model_len:
                    finish = LENGTH
                if finish is not None:
                    break
            events, st["events"] = st["events"] or None, []
            prefill = None
            if first:  # Request.prefill_stats, taken with its first output
                p, cached = st["prompt"], st["cached"]
                prefill = {
                    "num_prompt_tokens": p,
                    "num_computed_tokens": p - cached,
                    "num_cached_tokens": cached,
                    "num_local_cached_tokens": cached,
                    "num_external_cached_tokens": 0,
                    "num_cache_creation_tokens": p // self.block_size * self.block_size - cached,
                }
            outputs.append(
                output_entry(
                    rid,
                    tokens,
                    finish,
                    stop,
                    version=version,
                    events=events,
                    trace_headers=st["trace_headers"],
                    prefill_stats=prefill,
                )
            )
            if finish is not None:
                del self.requests[rid]
                self._finished(rid)
        self._executed = running > 0
        self._new_requests = new_requests
        for rid in failed:  # the scheduler's request-level errors, after the outputs
            st = self.requests.pop(rid)
            err = self._to_fail.pop(rid)
            outputs.append(
                output_entry(
                    rid,
                    [],
                    ERROR,
                    version=version,
                    events=st["events"] or None,
                    trace_headers=st["trace_headers"],
                    error=err,
                )
            )
            self._finished(rid)
        return outputs

    def _stats(self) -> dict[str, Any]:
        """The `SchedulerStats` of a step (`Scheduler.make_stats`): counts after the
        step; step_counter and current_wave are not set there."""
        if self.stats_override is not None:
            return self.stats_override
        running, waiting = self._counts()
        return scheduler_stats(
            running,
            waiting,
            kv_cache_usage=self._kv_cache_usage(),
            prefix=prefix_cache_stats(self._new_requests, self._new_prompt_tokens, self._new_hits),
            step=True,
        )

    # -- faults -----------------------------------------------------------------------

    def fail_request(
        self, request_id: str, message: str, code: str = "validation_error", retryable: bool = False
    ) -> None:
        """End request `request_id` (its wire id) with FinishReason.ERROR at its next
        step, or at the first step after it arrives, as vLLM's scheduler ends a request
        on a request-level error (0.33: with ``error=RequestError(code, message,
        retryable)``, as for an invalid grammar; 0.32 has no such field)."""
        self._to_fail[request_id] = request_error(code, message, retryable)
        self.changed.set()

    def freeze(self) -> None:
        """Keep the sockets but stop stepping: a silent engine."""
        self.frozen = True

    def vanish(self) -> None:
        """Close every socket without a word, as a killed process's."""
        self.cancel.cancel()

    def die(self) -> None:
        """ENGINE_CORE_DEAD on the output socket (vLLM's `_send_engine_dead`), then stop."""
        self.dead = True
        for zs in self.sockets:
            if zs.sock.type == zmq.PUSH:
                zs.release()
                zs.send_nowait([ENGINE_CORE_DEAD])
                break
        self.cancel.cancel()


def text_token_range(model_dir: str | Path) -> tuple[int, int] | None:
    """The longest run of consecutive token ids of the model's tokenizer.json that are
    one printable ASCII character each (a byte-level BPE's ``!`` to ``~``), as (low,
    high), for `FakeVllmGroup.token_range`: the fakes' answers are then readable text.
    None if there is no run of 16 or more (or no tokenizer.json)."""
    try:
        data = json.loads((Path(model_dir) / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(vocab, dict):
        return None
    ids = sorted(
        i
        for piece, i in vocab.items()
        if type(i) is int and len(piece) == 1 and "!" <= piece <= "~"
    )
    best: tuple[int, int] | None = None
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or ids[k] != ids[k - 1] + 1:
            if best is None or ids[k - 1] + 1 - ids[start] > best[1] - best[0]:
                best = (ids[start], ids[k - 1] + 1)
            start = k
    return best if best is not None and best[1] - best[0] >= 16 else None


def model_settings(model_dir: str | Path) -> dict[str, Any]:
    """`FakeVllmGroup` settings for the model in `model_dir`: its context
    (`max_model_len`, from config.json's max_position_embeddings or
    tokenizer_config.json's model_max_length) and its readable `token_range`."""
    settings: dict[str, Any] = {"token_range": text_token_range(model_dir)}
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        try:
            value = json.loads((Path(model_dir) / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if type(value) is int and 0 < value < 1 << 40:
            settings["max_model_len"] = value
            break
    return settings


async def run_fake_group(
    group: FakeVllmGroup,
    ranks: Sequence[int] | None = None,
    report: Callable[[int, str | None], None] | None = None,
) -> None:
    """Run `ranks` of `group` (every rank by default) until each has stopped (cancel
    to stop them; the group's context is destroyed on the way out). `report(rank,
    None)` is called when a rank's handshake with the frontend is done, and
    `report(rank, why)` when a rank stops (refused its init, died, vanished)."""

    async def one(engine: FakeVllmEngine) -> None:
        async with trio.open_nursery() as nursery:

            async def up() -> None:
                await engine.up.wait()
                if report is not None:
                    report(engine.rank, None)

            nursery.start_soon(up)
            await engine.run()
            nursery.cancel_scope.cancel()
        if report is not None:
            why = engine.refused or ("died" if engine.dead else "stopped")
            report(engine.rank, why)

    try:
        async with trio.open_nursery() as nursery:
            group.nursery = nursery
            for rank in range(group.size) if ranks is None else ranks:
                nursery.start_soon(one, group.engines[rank])
    finally:
        group.close()


def _init_problem(init: Any) -> str | None:
    """Why `init` is no `EngineHandshakeMetadata` a real engine could decode (None: it
    is one)."""
    if type(init) is not dict or "addresses" not in init or "parallel_config" not in init:
        return f"the init is no EngineHandshakeMetadata: {init!r:.200}"
    addrs, pc = init["addresses"], init["parallel_config"]
    if type(pc) is not dict:
        return f"the init's parallel_config is no map: {pc!r:.200}"
    if type(addrs) is not dict:
        return f"the init's addresses are no EngineZmqAddresses: {addrs!r:.200}"
    for key in ("inputs", "outputs"):
        value = addrs.get(key)
        if type(value) is not list or not value or not all(type(a) is str for a in value):
            return f"the init's addresses.{key} is no list of addresses: {value!r:.200}"
    for key in ("coordinator_input", "coordinator_output", "frontend_stats_publish_address"):
        if addrs.get(key) is not None and type(addrs[key]) is not str:
            return f"the init's addresses.{key} is no address: {addrs[key]!r:.200}"
    return None
