"""A chaos soak against the mock engine group (R4), with a history check.

A gateway-like workload streams requests through an `EngineGroup` while a chaos task
hurts the engines and the client:

* the mock process is killed (SIGKILL) and restarted with new random faults (a rank
  that announces `dead`, goes silent, sends garbage, or rejoins after k outputs);
* it is frozen (SIGSTOP) for up to twice the silence timeout, then thawed (SIGCONT);
* the client itself closes and reconnects while the engines keep running (RESYNC);
* the workload aborts requests, leaves streams early, cancels readers, and reuses a
  small pool of application ids right after their requests end.

Every submission carries a unique tag, which the mock echoes in each output. The history
check: each submitted request ends exactly once (its reader always finishes, no stream
hangs); its outputs carry its own tag (no output crossed requests), come in order with
no gap and no duplicate, and a clean end of stream follows its terminal output and
nothing else; after the run no rank holds a slot, and the group's counters add up.

`scripts/soak.py` runs it long (>= 10 000 requests); tests/test_soak.py runs it short.
"""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import trio

from zmqdp import (
    DuplicateRequestId,
    EngineDead,
    EngineGroup,
    GroupClosed,
    HandshakeTimeout,
    InvalidRank,
    NoEngineAvailable,
    ProtocolError,
    Request,
    RequestAborted,
    StreamTruncated,
)

ENDINGS = (EngineDead, GroupClosed, StreamTruncated, ProtocolError, RequestAborted)
"""The errors a stream may end with under chaos (each is an end, never a hang)."""

REFUSALS = (DuplicateRequestId, NoEngineAvailable, GroupClosed, InvalidRank)
"""What `submit` may refuse with under chaos (then nothing was submitted)."""

PLANS = ("read", "read", "read", "leave", "abort", "cancel")


@dataclass
class SoakConfig:
    requests: int = 300
    concurrency: int = 24
    engines: int = 2
    seed: int = 0
    chaos_every: float = 0.7
    """Mean seconds between random chaos events (0: none)."""
    blows: int = 3
    """Chaos events spread over the run by progress (every requests/(blows+1) endings),
    cycling through kill, freeze and client restart: the run gets each for sure."""
    silence_timeout: float = 1.0
    step_time: float = 0.002
    ids: int = 8
    """The pool of application ids, reused all the time."""
    max_tokens: int = 24
    deadline: float = 600.0
    """Seconds the whole run may take before the unfinished requests count as hung."""


@dataclass
class Record:
    serial: int
    app_id: str
    max_tokens: int
    plan: str
    tokens: list[int] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)


@dataclass
class SoakReport:
    records: list[Record] = field(default_factory=list)
    refused: int = 0
    chaos: dict[str, int] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def endings(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            for e in r.ends:
                out[e] = out.get(e, 0) + 1
        return dict(sorted(out.items()))

    def violations(self) -> list[str]:
        problems = [f"request #{s} never ended (hung)" for s in self.hung]
        problems += self.leaks
        for r in self.records:
            if len(r.ends) != 1:
                problems.append(f"request #{r.serial} ended {len(r.ends)} times: {r.ends}")
            problems += [f"request #{r.serial}: {w}" for w in r.wrong]
        return problems


class _Client:
    """The current `EngineGroup`, replaced when the chaos task restarts the client."""

    def __init__(self) -> None:
        self.group: EngineGroup | None = None
        self.changed = trio.Event()
        self.restart = trio.Event()
        self.groups: list[EngineGroup] = []

    async def current(self) -> EngineGroup:
        while self.group is None or self.group.closed is not None:
            await self.changed.wait()
        return self.group

    def set(self, group: EngineGroup | None) -> None:
        self.group = group
        if group is not None:
            self.groups.append(group)
        self.changed.set()
        self.changed = trio.Event()


class _Mock:
    """The mock group's process, restarted with new random faults when killed."""

    def __init__(self, url: str, cfg: SoakConfig, rng: random.Random) -> None:
        self.url = url
        self.cfg = cfg
        self.rng = rng
        self.proc: trio.Process | None = None

    def _faults(self) -> list[str]:
        out = []
        for rank in range(self.cfg.engines):
            kind = self.rng.choice(["none", "none", "dead", "silent", "garbage", "rejoin"])
            if kind == "garbage":
                out += ["--fault", f"{rank}:garbage=1"]
            elif kind != "none":
                out += ["--fault", f"{rank}:{kind}={self.rng.randint(20, 400)}"]
        return out

    async def start(self) -> None:
        cmd = [sys.executable, "-m", "zmqdp", "mock", "--url", self.url]
        cmd += ["--engines", str(self.cfg.engines), "--step-time", str(self.cfg.step_time)]
        self.proc = await trio.lowlevel.open_process(
            [*cmd, *self._faults()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    async def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            await self.proc.wait()
        await self.start()

    async def stop(self) -> None:
        if self.proc is not None:
            with trio.CancelScope(shield=True):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
                await self.proc.wait()


class _Progress:
    """How many requests have ended, to wait on."""

    def __init__(self) -> None:
        self.ended = 0
        self._changed = trio.Event()

    def tick(self) -> None:
        self.ended += 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, count: int) -> None:
        while self.ended < count:
            await self._changed.wait()


async def _blows(
    cfg: SoakConfig,
    rng: random.Random,
    mock: _Mock,
    client: _Client,
    report: SoakReport,
    progress: _Progress,
    done: trio.Event,
) -> None:
    kinds = ["kill", "freeze", "client"]
    rng.shuffle(kinds)
    for i in range(cfg.blows):
        await progress.wait_for((i + 1) * cfg.requests // (cfg.blows + 1))
        await _blow(kinds[i % 3], cfg, rng, mock, client, report)
    done.set()


async def _chaos(
    cfg: SoakConfig, rng: random.Random, mock: _Mock, client: _Client, report: SoakReport
) -> None:
    while True:
        await trio.sleep(rng.expovariate(1 / cfg.chaos_every))
        await _blow(
            rng.choice(["kill", "freeze", "client", "none"]), cfg, rng, mock, client, report
        )


async def _blow(
    action: str,
    cfg: SoakConfig,
    rng: random.Random,
    mock: _Mock,
    client: _Client,
    report: SoakReport,
) -> None:
    report.chaos[action] = report.chaos.get(action, 0) + 1
    if action == "kill":
        await mock.kill()
    elif action == "freeze" and mock.proc is not None:
        mock.proc.send_signal(signal.SIGSTOP)
        try:
            await trio.sleep(rng.uniform(0.1, 2 * cfg.silence_timeout))
        finally:
            mock.proc.send_signal(signal.SIGCONT)
    elif action == "client":
        client.restart.set()


async def _serve_client(url: str, cfg: SoakConfig, client: _Client) -> None:
    """Keep a group connected; reconnect when asked to restart or when it failed."""
    while True:
        try:
            async with EngineGroup.connect(
                url,
                cfg.engines,
                ready_timeout=4 * cfg.silence_timeout + 2,
                silence_timeout=cfg.silence_timeout,
                send_timeout=cfg.silence_timeout,
            ) as group:
                client.set(group)
                # until a restart, or the group failed (a lockstep group fails whole);
                # `closed` has no event of its own, so it is looked at every 0.1 s
                while not client.restart.is_set() and group.closed is None:
                    with trio.move_on_after(0.1):
                        await client.restart.wait()
                client.restart = trio.Event()
                client.set(None)
        except HandshakeTimeout:
            pass  # the engines are frozen or restarting: try again


async def _one(
    rec: Record, cfg: SoakConfig, rng: random.Random, client: _Client, report: SoakReport
) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": rec.max_tokens, "tag": rec.serial}
    while True:
        group = await client.current()
        try:
            stream = group.submit(Request(rec.app_id, body))
            break
        except REFUSALS:
            report.refused += 1
            rec.app_id = f"id{rng.randrange(cfg.ids)}"
            await trio.sleep(0.01)
    stop_after = rng.randint(0, rec.max_tokens)
    ended = "?"
    try:
        async with stream:
            with trio.move_on_after(rng.uniform(0.001, 0.05) if rec.plan == "cancel" else 1e9):
                async for out in stream:
                    _check_output(rec, out)
                    if len(rec.tokens) == stop_after and rec.plan in ("leave", "abort"):
                        if rec.plan == "leave":
                            ended = "left early"
                            break
                        await group.abort(rec.app_id)
                else:
                    ended = "finished"
                    if not rec.tokens or len(rec.tokens) != rec.max_tokens:
                        rec.wrong.append(f"clean end after {len(rec.tokens)} outputs")
            if ended == "?":
                ended = "cancelled"
    except ENDINGS as exc:
        ended = type(exc).__name__
    rec.ends.append(ended)
    if stream.outcome is None:
        rec.wrong.append("its stream has no outcome after its reader finished")


def _check_output(rec: Record, out: Any) -> None:
    body = out.body
    if out.request_id != rec.app_id:
        rec.wrong.append(f"an output for {out.request_id!r} reached {rec.app_id!r}")
    if not isinstance(body, dict) or body.get("tag") != rec.serial:
        rec.wrong.append(f"an output of another request: {body!r}")
        return
    token = body.get("token")
    expected = 1001 + len(rec.tokens)
    if token != expected:
        rec.wrong.append(f"token {token} where {expected} was due (order, gap or duplicate)")
    rec.tokens.append(token)
    if out.finish is not None and len(rec.tokens) != rec.max_tokens:
        rec.wrong.append(f"terminal after {len(rec.tokens)} of {rec.max_tokens} outputs")


async def soak(url: str, cfg: SoakConfig) -> SoakReport:
    """Run the soak against a mock group at `url` (an ipc URL in a private directory)."""
    rng = random.Random(cfg.seed)
    report = SoakReport()
    logger = logging.getLogger("zmqdp")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # chaos is noisy by design
    client = _Client()
    mock = _Mock(url, cfg, rng)
    start = trio.current_time()
    await mock.start()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_client, url, cfg, client)
            if cfg.chaos_every > 0:
                nursery.start_soon(_chaos, cfg, rng, mock, client, report)
            progress = _Progress()
            blows_done = trio.Event()
            nursery.start_soon(_blows, cfg, rng, mock, client, report, progress, blows_done)
            limiter = trio.CapacityLimiter(cfg.concurrency)

            async def run(rec: Record) -> None:
                async with limiter:
                    await _one(rec, cfg, rng, client, report)
                progress.tick()

            with trio.move_on_after(cfg.deadline):
                async with trio.open_nursery() as workers:
                    for serial in range(cfg.requests):
                        rec = Record(
                            serial,
                            f"id{rng.randrange(cfg.ids)}",
                            rng.randint(1, cfg.max_tokens),
                            rng.choice(PLANS),
                        )
                        report.records.append(rec)
                        workers.start_soon(run, rec)
            report.hung = [r.serial for r in report.records if not r.ends]
            # A long blow (a freeze, a client restart) can outlast the requests left after
            # it: let the scheduled blows all happen before the chaos stops, within the
            # deadline, so that every kind is dealt even when the workload ends early.
            with trio.move_on_at(start + cfg.deadline):
                await blows_done.wait()
            nursery.cancel_scope.cancel()
    finally:
        await mock.stop()
        logger.setLevel(level)
    report.seconds = trio.current_time() - start
    for group in client.groups:
        stats = group.statistics()
        held = [r.inflight for r in stats.ranks]
        if any(held):
            report.leaks.append(f"a group closed with slots held: {held}")
    return report
