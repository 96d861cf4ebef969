"""A mock engine group: N ranks in one process, built on `zmqdp.engine`.

Run it as `python -m zmqdp mock --url URL --engines N [--lockstep] ...`, or embed it with
`run_mock_group(url, MockConfig(...))`.

Theory of operation
-------------------
Each rank streams tokens: an ADD body ``{"prompt": [int, ...], "max_tokens": k}`` queues
a request (`prompt` defaults to ``[]``, `max_tokens` to 16); each step every running
request emits one token (``{"token": 1000 + n}``, n from 1) and the last one has finish
``"length"``. A ``"tag"`` in the body is echoed in every output, so a test can check that
no output reaches another request. A body the mock cannot serve (not a map, a `prompt`
that is not a list of ints, a `max_tokens` that is not an int >= 1) ends that request
alone, at once, with one terminal output: finish ``"error"`` and body
``{"error": "'max_tokens' must be ..."}`` naming the field (as a vLLM engine fails a
request it refuses: an ``"error"`` finish with the reason); the rank serves on. At most
`max_num_seqs` requests run at once; the rest wait. Every batch
carries `load` (waiting, running, kv) and `seq`. Step time is per rank, so speeds can
differ, and a rank holding requests sends a batch at least once a second.

Each rank has a fake prefix cache (`PrefixCache`, on unless `prefix_cache=False`), the
model of vLLM's that prefix affinity is measured against (benchmarks/bench_prefix.py):
blocks of `block_size` prompt ids, chained as `zmqdp._core.prefix.chain` chains them,
at most ``kv_tokens // block_size`` of them, least recently used evicted first (leaf
before root, as vLLM frees a request's blocks tail first). A request admitted to run
looks its prompt up (the longest cached run of whole blocks, never the whole prompt:
vLLM always computes the last prompt token), stores its prompt's blocks, and, when it
ends, those of its prompt and generated tokens (vLLM caches output blocks too). Its
first output says ``"cached": n`` (vLLM's `num_cached_tokens`), and the step that
admits it lasts `prefill_time` seconds longer per uncached prompt token (0 by default,
so that the mock's timing is its step time alone). The ready info says `block_size` and
`num_gpu_blocks`, as a vLLM engine's ready response does.

Lockstep mode follows docs/protocol.md §5 and vLLM's DP engines (as vLLM's DP engines do):

* every running rank takes part in a collective on **every** step (idle ranks run dummy
  steps), through an in-process barrier; a rank running while its peers are parked
  blocks in that barrier, exactly as a real lost wake does;
* the inbox is handled only between steps;
* at step 1 and every `sync_interval` steps the ranks decide together whether any has
  work; if none has, every rank sends `wave_complete: wave`, bumps `wave`, parks;
  with `wave_agreement` (the spec's SHOULD) they first adopt the highest wave;
* WAKE(w) with w >= wave sets wave = w and runs; a stale WAKE is ignored;
* an ADD while parked always sends `start_wave: wave`; with `self_wake` the rank also
  starts running at once (vLLM's behaviour), otherwise it waits for the WAKE.

A RESYNC from the client reaches a rank as `Resync` in its inbox, behind every request
of the old incarnation: the rank drops its requests and its per-incarnation state
(`_reset`) and serves the next incarnation, which `zmqdp.engine` has already set up. The
rank keeps `eng.wave` current, so that the HELLO after a RESYNC reports its wave.

Faults are injected per rank (`RankFaults`): announce `dead`, go silent, send garbage
bodies, rejoin (a new incarnation that says HELLO again) every k outputs (at most
`rejoins` times, if set), run slower, or say a wrong field in HELLO. CALL methods:
`ping`, `info`, `echo`. `dead`, `silent` and `garbage` fire once per rank: a rank that
announced `dead` ignores everything until a RESYNC, a silent one sends nothing until a
RESYNC, and then both serve again, as a restarted engine would (an independent client
RESYNCs a rank it declared dead).
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from ._core.errors import HandshakeRejected, quote
from ._core.prefix import chain
from .engine import (
    Abort,
    Add,
    Call,
    Engine,
    Load,
    Output,
    OutputBatch,
    Reply,
    Resync,
    Wake,
    connect_engine,
)
from .keys import load_engine_keys

__all__ = [
    "MockConfig",
    "MockRejected",
    "PrefixCache",
    "RankFaults",
    "mock_command",
    "mock_process",
    "parse_body",
    "run_mock_group",
]

log = logging.getLogger("zmqdp.mock")


@dataclass(frozen=True)
class RankFaults:
    """Faults of one rank; counts are in outputs this rank has emitted."""

    dead_after: int | None = None
    silent_after: int | None = None
    garbage: int = 0  # undecodable bodies sent once the rank first has work
    rejoin_after: int | None = None  # rejoin every k outputs of an incarnation
    rejoins: int | None = None  # at most this many times (None: no limit)
    slow: float = 1.0  # step time multiplier
    bad_hello: str | None = None  # "size" | "lockstep": say it wrong in HELLO


@dataclass(frozen=True)
class MockConfig:
    """A mock engine group: what `zmqdp mock`'s options set (`zmqdp mock --help` says
    what each does), for `run_mock_group` and `mock_process`."""

    engines: int = 2
    lockstep: bool = False
    step_time: float = 0.01
    max_num_seqs: int = 16
    kv_tokens: int = 65536  # KV capacity per rank, for the `kv` load figure
    sync_interval: int = 4
    self_wake: bool = False
    wave_agreement: bool = True
    skew: float = 0.0  # rank r handles each inbound message r * skew seconds late
    faults: dict[int, RankFaults] = field(default_factory=dict)
    keys: str | None = None  # a `zmqdp.keys` directory: connect with CURVE
    ranks: tuple[int, ...] | None = None  # run only these ranks (None: all of them)
    prefix_cache: bool = True  # a fake prefix cache per rank (`PrefixCache`)
    block_size: int = 16  # its block, in prompt ids; kv_tokens // block_size blocks
    prefill_time: float = 0.0  # s per uncached prompt token, added to the admitting step


def parse_body(body: Any) -> tuple[int, int, Any]:
    """An ADD body's (prompt length, max_tokens, tag); `ValueError` naming the field if
    the mock cannot serve it."""
    if not isinstance(body, dict):
        raise ValueError(
            'the body must be a map {"prompt": [int, ...], "max_tokens": k}, '
            f"got {type(body).__name__}"
        )
    prompt = body.get("prompt", [])
    if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
        raise ValueError(f"'prompt' must be a list of token ids (ints), got {quote(prompt)}")
    tokens = body.get("max_tokens", 16)
    if type(tokens) is not int or tokens < 1:
        raise ValueError(f"'max_tokens' must be an int >= 1, got {quote(tokens)}")
    return len(prompt), tokens, body.get("tag")


@dataclass
class _Seq:
    id: str
    left: int
    tokens: int
    prompt: int
    tag: Any = None
    ids: list[int] = field(default_factory=list)  # the prompt's token ids
    cached: int | None = None  # prompt tokens found cached at admission (then said once)


class PrefixCache:
    """One rank's fake prefix cache (module docstring): an LRU of chained block keys.
    Only whole blocks are cached, and a lookup never covers the whole prompt."""

    def __init__(self, blocks: int, block_size: int) -> None:
        if block_size < 1 or blocks < 0:
            raise ValueError(f"a prefix cache of {blocks} blocks of {block_size} tokens")
        self.capacity = blocks
        self.block_size = block_size
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        """The blocks cached."""
        return len(self._lru)

    def lookup(self, prompt: Sequence[int]) -> int:
        """The prompt tokens cached (a multiple of the block size, less than the prompt),
        and mark those blocks used."""
        lru = self._lru
        hits = []
        for key in chain(prompt[: len(prompt) - 1], self.block_size):
            if key not in lru:
                break
            hits.append(key)
        for key in reversed(hits):  # the root most recent: evicted last
            lru.move_to_end(key)
        return len(hits) * self.block_size

    def store(self, tokens: Sequence[int]) -> None:
        """Cache the whole blocks of `tokens`, then evict past the capacity."""
        lru = self._lru
        for key in reversed(chain(tokens, self.block_size)):
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def clear(self) -> None:
        """Forget every block (a restarted engine starts with a cold cache)."""
        self._lru.clear()


class _Collective:
    """One barrier per step for the lockstep ranks: returns (any rank has work, highest
    wave) once every rank has arrived."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._arrived = 0
        self._any = False
        self._wave = 0
        self._done = trio.Event()
        self._result = (False, 0)

    async def exchange(self, has_work: bool, wave: int) -> tuple[bool, int]:
        done = self._done
        self._arrived += 1
        self._any |= has_work
        self._wave = max(self._wave, wave)
        if self._arrived == self.n:
            self._result = (self._any, self._wave)
            self._arrived, self._any, self._wave = 0, False, 0
            self._done = trio.Event()
            done.set()
            await trio.lowlevel.checkpoint()
        else:
            await done.wait()
        return self._result


class MockRank:
    """One rank. `run()` connects, serves until cancelled, and rejoins on demand."""

    def __init__(
        self, url: str, rank: int, cfg: MockConfig, collective: _Collective | None
    ) -> None:
        self.url = url
        self.rank = rank
        self.cfg = cfg
        self.faults = cfg.faults.get(rank, RankFaults())
        self.collective = collective
        self.step_time = cfg.step_time * self.faults.slow
        self.delay = rank * cfg.skew
        self.curve = None if cfg.keys is None else load_engine_keys(cfg.keys, rank)
        self.delayed: deque[tuple[float, Any]] = deque()
        self.up = trio.Event()  # set once connected, or rejected (`rejected`)
        self.rejected: str | None = None  # why the client rejected this rank
        self.wave = 0
        self.running = False
        self.emitted = 0
        self.incarnation = 0
        self.counter = 0
        # the one-shot faults: armed until they fire (once per rank, not per incarnation)
        self.garbage_left = self.faults.garbage
        self.dead_armed = self.faults.dead_after is not None
        self.silent_armed = self.faults.silent_after is not None
        self.cache = (
            PrefixCache(cfg.kv_tokens // cfg.block_size, cfg.block_size)
            if cfg.prefix_cache
            else None
        )
        self._reset()

    def _reset(self) -> None:
        """Forget the incarnation: its requests, and the effect of a fault that fired.
        A new incarnation (RESYNC or rejoin) starts empty and serving."""
        self.active: list[_Seq] = []
        self.queue: deque[_Seq] = deque()
        self.finished: list[str] = []
        self.replies: list[Reply] = []
        self.refused: list[Output] = []  # "error" outputs of bodies the mock cannot serve
        self.pending_start: int | None = None
        self.silent = False  # the silent fault fired: send nothing
        self.zombie = False  # the dead fault fired: ignore everything but a RESYNC
        if self.cache is not None:
            self.cache.clear()  # a new incarnation is a restarted engine: a cold cache

    # -- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            self.incarnation += 1
            size, lockstep = self.cfg.engines, self.cfg.lockstep
            if self.faults.bad_hello == "size":
                size += 1
            elif self.faults.bad_hello == "lockstep":
                lockstep = not lockstep
            try:
                async with connect_engine(
                    self.url,
                    rank=self.rank,
                    size=size,
                    lockstep=lockstep,
                    wave=self.wave,
                    info=self._info(),
                    curve=self.curve,
                    # a mock waits for its client as long as it takes: it may be started
                    # first, and said so ("waiting for a client")
                    handshake_timeout=math.inf,
                ) as eng:
                    self.up.set()
                    rejoin = await self._serve(eng)
            except HandshakeRejected as exc:
                # settled, but not up: `run_mock_group` reports it (an error if no rank
                # is up), rather than counting it among the ranks that serve
                self.rejected = rejection(exc)
                if self.up.is_set():  # on a rejoin; a first rejection is reported there
                    log.error("%s", self.rejected)
                self.up.set()
                return
            if not rejoin:
                return
            log.warning("rank %d: rejoining (fault injection)", self.rank)
            self._reset()
            self.running = False

    def _info(self) -> dict[str, Any]:
        info = {
            "engine": "zmqdp-mock",
            "rank": self.rank,
            "max_num_seqs": self.cfg.max_num_seqs,
            "kv_tokens": self.cfg.kv_tokens,
            "lockstep": self.cfg.lockstep,
            "step_time": self.step_time,
        }
        if self.cache is not None:  # as a vLLM engine's ready response says them
            info["block_size"] = self.cache.block_size
            info["num_gpu_blocks"] = self.cache.capacity
        return info

    # -- serving ----------------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self.active or self.queue)

    async def _serve(self, eng: Engine) -> bool:
        """Serve until the rank rejoins (returns True). A RESYNC does not end it:
        `zmqdp.engine` redoes the handshake and the inbox says `Resync`."""
        self.delayed.clear()
        while True:
            eng.wave = self.wave  # what a HELLO after a RESYNC reports
            self._take_inbox(eng)  # the inbox is handled only between steps
            await self._flush_control(eng)
            idle = not self.running if self.collective is not None else not self._has_work()
            if idle:
                await self._wait_for_input(eng)
                continue
            await self._sleep_step(eng)
            if await self._step(eng):
                return True
            if self.zombie:
                continue  # it announced dead: it leaves the collective too
            if self.collective is not None:
                self.counter += 1
                any_work, top = await self.collective.exchange(self._has_work(), self.wave)
                if self.counter == 1 or self.counter % self.cfg.sync_interval == 0:
                    if self.cfg.wave_agreement:
                        self.wave = top
                    if not any_work:
                        await self._send(eng, OutputBatch(self.rank, wave_complete=self.wave))
                        self.wave += 1
                        self.running = False

    def _take_inbox(self, eng: Engine) -> None:
        """Handle every inbound message that is due; with skew, later ones wait."""
        now = trio.current_time()
        while True:
            try:
                self.delayed.append((now + self.delay, eng.receive_nowait()))
            except trio.WouldBlock:
                break
        while self.delayed and self.delayed[0][0] <= now:
            self._handle(self.delayed.popleft()[1])

    async def _wait_for_input(self, eng: Engine) -> None:
        if self.delayed:
            await trio.sleep_until(self.delayed[0][0])
        else:
            msg = await eng.receive()
            self.delayed.append((trio.current_time() + self.delay, msg))

    async def _sleep_step(self, eng: Engine) -> None:
        left = self.step_time
        while left > 1.0:  # a slow rank still says something once a second
            await trio.sleep(1.0)
            left -= 1.0
            await self._send(eng, OutputBatch(self.rank, load=self._load()))
        await trio.sleep(left)

    def _handle(self, msg: Any) -> None:
        """Apply one inbound message (replies and start_wave go out in the next flush)."""
        if self.zombie and not isinstance(msg, Resync):
            return  # announced dead: a dead engine does nothing
        if isinstance(msg, Add):
            try:
                prompt, tokens, tag = parse_body(msg.body)
            except ValueError as exc:  # that request alone ends, with an "error" finish
                log.info("rank %d: request %s refused: %s", self.rank, quote(msg.id), exc)
                out: dict[str, Any] = {"error": str(exc)}
                if isinstance(msg.body, dict) and "tag" in msg.body:
                    out["tag"] = msg.body["tag"]  # echoed, as in every output
                self.refused.append(Output(msg.id, out, "error"))
            else:
                ids = msg.body.get("prompt", []) if self.cache is not None else []
                self.queue.append(_Seq(msg.id, tokens, 0, prompt, tag, ids))
            # an ADD while parked reports start_wave even if it is refused: the rank
            # cannot know whether the client counts on it (§5)
            if self.collective is not None and not self.running:
                self.pending_start = self.wave
                if self.cfg.self_wake:
                    self._start_running()
        elif isinstance(msg, Wake):
            if self.collective is not None and msg.wave >= self.wave:
                self.wave = msg.wave
                if not self.running:
                    self._start_running()
        elif isinstance(msg, Abort):
            for rid in msg.ids:
                for seqs in (self.active, self.queue):
                    for s in list(seqs):
                        if s.id == rid:
                            seqs.remove(s)
                            self.finished.append(rid)
        elif isinstance(msg, Call):
            self.replies.append(self._call(msg))
        elif isinstance(msg, Resync):
            self._reset()

    def _start_running(self) -> None:
        self.running = True
        self.counter = 0

    def _call(self, msg: Call) -> Reply:
        if msg.method == "ping":
            return Reply(msg.call, result="pong")
        if msg.method == "info":
            return Reply(msg.call, result={**self._info(), "wave": self.wave})
        if msg.method == "echo":
            return Reply(msg.call, result=list(msg.args))
        return Reply(msg.call, error=f"unknown method {msg.method!r}")

    def _load(self) -> Load:
        used = sum(s.prompt + s.tokens for s in self.active)
        return Load(
            waiting=len(self.queue),
            running=len(self.active),
            kv=min(1.0, used / self.cfg.kv_tokens),
        )

    async def _send(self, eng: Engine, batch: OutputBatch) -> None:
        f = self.faults
        if self.silent_armed and f.silent_after is not None and self.emitted >= f.silent_after:
            self.silent_armed, self.silent = False, True
        if not self.silent:
            await eng.send(batch)

    async def _flush_control(self, eng: Engine) -> None:
        """Send what the inbox produced: refused requests, start_wave, finished, replies."""
        if (
            self.pending_start is None
            and not self.finished
            and not self.replies
            and not self.refused
        ):
            return
        batch = OutputBatch(
            self.rank,
            outputs=tuple(self.refused),
            finished=tuple(self.finished),
            replies=tuple(self.replies),
            start_wave=self.pending_start,
            load=self._load(),
        )
        self.finished, self.replies, self.refused, self.pending_start = [], [], [], None
        await self._send(eng, batch)

    async def _step(self, eng: Engine) -> bool:
        """One step: admit waiting requests, emit one token each. True to rejoin."""
        uncached = 0
        while self.queue and len(self.active) < self.cfg.max_num_seqs:
            s = self.queue.popleft()
            if self.cache is not None:
                s.cached = self.cache.lookup(s.ids)
                self.cache.store(s.ids)
                uncached += s.prompt - s.cached
            self.active.append(s)
        if not self.active:
            return False  # a dummy step (lockstep) or nothing to do
        if uncached and self.cfg.prefill_time > 0:  # the prefill of this step's admissions
            await trio.sleep(uncached * self.cfg.prefill_time)
        f = self.faults
        while self.garbage_left:  # k undecodable bodies in a row
            self.garbage_left -= 1
            await eng.send_raw_for_testing([b"\xff not cbor"])
        outputs = []
        for s in list(self.active):
            s.left -= 1
            s.tokens += 1
            done = s.left <= 0
            out: dict[str, Any] = (
                {"token": 1000 + s.tokens}
                if s.tag is None
                else {"token": 1000 + s.tokens, "tag": s.tag}
            )
            if s.cached is not None:  # the first output: vLLM's num_cached_tokens
                out["cached"], s.cached = s.cached, None
            outputs.append(Output(s.id, out, "length" if done else None))
            if done:
                self.active.remove(s)
                if self.cache is not None:  # the answer's whole blocks are cached too
                    self.cache.store([*s.ids, *range(1001, 1001 + s.tokens)])
        self.emitted += len(outputs)
        dead = None
        if self.dead_armed and f.dead_after is not None and self.emitted >= f.dead_after:
            self.dead_armed = False
            dead = "injected fault: dead_after"
        await self._send(
            eng, OutputBatch(self.rank, outputs=tuple(outputs), load=self._load(), dead=dead)
        )
        if dead is not None:
            # Dead until the client RESYNCs this rank. In lockstep the peers now block in
            # the collective, as they would for a real dead rank.
            self._reset()
            self.zombie = True
            self.running = False
            return False
        return bool(
            f.rejoin_after is not None
            and self.emitted >= f.rejoin_after * self.incarnation
            and (f.rejoins is None or self.incarnation <= f.rejoins)
        )


class MockRejected(Exception):
    """The client rejected every rank of the mock (`run_mock_group`): one line saying
    which ranks, the client's reason and what to do."""


def rejection(exc: HandshakeRejected) -> str:
    """One line for a rank the client rejected: the client's reason names the rank
    already ("rank 0: HELLO says size 1, ..."), so it is not said twice."""
    reason = exc.reason
    prefix = f"rank {exc.rank}: "
    if reason.startswith(prefix):
        reason = reason[len(prefix) :]
    return f"rank {exc.rank}: the client rejected it: {reason}"


async def run_mock_group(
    url: str,
    cfg: MockConfig,
    *,
    wait_for_client: bool = False,
    task_status: trio.TaskStatus[tuple[int, ...]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the group until cancelled: each rank dials `url`, where the client binds.

    ``await nursery.start(run_mock_group, url, cfg)`` returns the ranks it runs once
    they are dialling, before any client is there: the client's `connect` comes next,
    in the same task, and completes their handshakes. A rank the client rejects (a
    mock of the wrong size or mode) is logged; if it rejects them all, `MockRejected`
    (from the task, into its nursery).

    `wait_for_client`: `started(ranks)` only once every rank is up or rejected by the
    client, with the ranks that are up, and `MockRejected` from `start` itself if the
    client rejected them all (`zmqdp mock` says which ranks are up this way). The
    client must then be connecting from another task, or `start` waits forever."""
    collective = _Collective(cfg.engines) if cfg.lockstep else None
    if cfg.ranks is not None and cfg.lockstep:
        raise ValueError("lockstep ranks step together: run them all in one process")
    which = range(cfg.engines) if cfg.ranks is None else cfg.ranks
    ranks = [MockRank(url, r, cfg, collective) for r in which]
    async with trio.open_nursery() as nursery:
        for rank in ranks:
            nursery.start_soon(rank.run, name=f"zmqdp-mock-rank{rank.rank}")
        if not wait_for_client:
            task_status.started(tuple(which))
        for rank in ranks:
            await rank.up.wait()
        up = tuple(rank.rank for rank in ranks if rank.rejected is None)
        if up:
            for rank in ranks:
                if rank.rejected is not None:
                    log.error("%s; it does not serve", rank.rejected)
            if wait_for_client:
                task_status.started(up)
    # every rank was rejected (and so has returned): nothing serves
    reasons = [rank.rejected for rank in ranks if rank.rejected is not None]
    more = f" (and {len(reasons) - 1} more rank(s) likewise)" if len(reasons) > 1 else ""
    raise MockRejected(
        f"{reasons[0]}{more}; no rank is up. Start the mock to match the client: "
        "--engines N for EngineGroup.connect(url, N), and --lockstep only for a lockstep "
        "group"
    )


def parse_fault(text: str) -> tuple[int, RankFaults]:
    """`RANK:KIND[=N]`, e.g. `1:dead=20`, `0:slow=3`, `1:bad_hello=size`; `1:rejoin=40`
    with `1:rejoins=1` (merged by `merge_faults`) rejoins once, after 40 outputs."""
    rank_text, _, rest = text.partition(":")
    kind, _, value = rest.partition("=")
    rank = int(rank_text)
    kinds: dict[str, Any] = {
        "dead": lambda v: RankFaults(dead_after=int(v or 10)),
        "silent": lambda v: RankFaults(silent_after=int(v or 10)),
        "garbage": lambda v: RankFaults(garbage=int(v or 3)),
        "rejoin": lambda v: RankFaults(rejoin_after=int(v or 10)),
        "rejoins": lambda v: RankFaults(rejoins=int(v or 1)),
        "slow": lambda v: RankFaults(slow=float(v or 3)),
        "bad_hello": lambda v: RankFaults(bad_hello=v or "size"),
    }
    if kind not in kinds:
        raise ValueError(f"unknown fault {kind!r}; one of {', '.join(kinds)}")
    return rank, kinds[kind](value)


def merge_faults(items: list[tuple[int, RankFaults]]) -> dict[int, RankFaults]:
    out: dict[int, RankFaults] = {}
    for rank, f in items:
        base = out.get(rank, RankFaults())
        changes = {k: v for k, v in vars(f).items() if v != getattr(RankFaults(), k)}
        out[rank] = replace(base, **changes)
    return out


def _command(url: str, engines: int) -> list[str]:
    return [sys.executable, "-m", "zmqdp", "mock", "--url", url, "--engines", str(engines)]


def mock_command(url: str, config: MockConfig) -> Sequence[str]:
    """`python -m zmqdp mock ...` for `config` (what its command line can say: a
    `kv_tokens` other than the default is a `ValueError`). The inverse of the command
    line's parsing (`parse_fault`): the asyncio gateway runs its mock group with it."""
    default = MockConfig()
    for name in ("kv_tokens", "prefix_cache", "block_size", "prefill_time"):
        if getattr(config, name) != getattr(default, name):
            raise ValueError(f"MockConfig.{name} has no command-line form (python -m zmqdp mock)")
    cmd = _command(url, config.engines)
    cmd += ["--step-time", repr(config.step_time), "--max-num-seqs", str(config.max_num_seqs)]
    cmd += ["--sync-interval", str(config.sync_interval), "--skew", repr(config.skew)]
    if config.lockstep:
        cmd.append("--lockstep")
    if config.self_wake:
        cmd.append("--self-wake")
    if not config.wave_agreement:
        cmd.append("--no-wave-agreement")
    if config.keys is not None:
        cmd += ["--keys", config.keys]
    if config.ranks is not None:
        cmd += ["--ranks", ",".join(map(str, config.ranks))]
    none = RankFaults()
    for rank, faults in sorted(config.faults.items()):
        for kind, attr in (
            ("dead", "dead_after"),
            ("silent", "silent_after"),
            ("garbage", "garbage"),
            ("rejoin", "rejoin_after"),
            ("rejoins", "rejoins"),
            ("slow", "slow"),
            ("bad_hello", "bad_hello"),
        ):
            value = getattr(faults, attr)
            if value != getattr(none, attr):
                cmd += ["--fault", f"{rank}:{kind}={value}"]
    return cmd


@asynccontextmanager
async def mock_process(
    url: str, engines: int, *args: str, stop_timeout: float = 5.0
) -> AsyncIterator[trio.Process]:
    """Run `python -m zmqdp mock --url URL --engines N ARGS...` in a subprocess for the
    block (the demo's and the tests' mock group): SIGTERM on the way out, SIGKILL if it
    has not exited after `stop_timeout` s.

    Cancellation: the process is stopped all the same (shielded, bounded)."""
    proc = await trio.lowlevel.open_process(
        [*_command(url, engines), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield proc
    finally:
        with trio.CancelScope(shield=True):
            proc.terminate()
            with trio.move_on_after(stop_timeout):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
