"""vLLM 0.33's engine-side wave rules (`VllmRules`), the rank parameter of the wave model
in tests/models/waves.py, driven by the wave translation `zmqdp.vllm.connect`'s group
uses (or a broken one).

The ranks are vLLM's `DPEngineCoreProc` with a coordinator (/work/shared/reference/
vllm_dp.md §3; `vllm/v1/engine/core.py`, `coordinator.py`), not zmqdp's §5 engines:

* *park*: the group decides at step 1 of a wave and every `sync` steps
  (`dp_sync_interval`) whether any rank still has work; when none has, **only rank 0**
  reports `wave_complete: wave`, every rank does `wave += 1`, `running = False`;
* *edge report* (0.30+, so in both 0.32 and 0.33): rank 0, after the first step of a
  wave that did not park there, reports `start_wave: wave` (its own paused->running edge);
* *ADD*: the rank adopts the request's `current_wave` if it is newer than its own; if
  parked, it wakes **itself** (`running = True`) and reports `start_wave: wave`
  (0.33; with `engine="0.32"`, vLLM 0.11-0.32's rule: only an ADD for an *older* wave
  than the rank's, to a parked rank, is reported);
* *START_DP_WAVE(w, exclude)*: ignored by the excluded rank and if `w < wave`
  (stale); else `wave = w`, `running = True`. (The two-phase pause's
  `ignore_start_dp_wave` is not modelled: zmqdp never pauses a group.)

vLLM's sockets make the pipes: ADDs come on the input DEALER, START_DP_WAVE on the
coordinator XSUB, so an ADD and a START_DP_WAVE sent after it can arrive in either
order; each pipe is FIFO. An engine's reports reach the client's PULL on its
coordinator PUSH; its outputs (another PUSH) carry nothing for the wave clock and count
as delivered when produced. A rank handles its pipes only between group steps, and the
group steps only when every rank is running (a running rank whose peers are parked
sits in its collective).

The client is a `Dialect` (the model's `Client`): what it stamps on ADDs, what it
publishes and when. `ZmqdpDialect` is `zmqdp.vllm.connect`'s group's: the real
`WaveClock` (or a mutant clock) plus `zmqdp.vllm.wire`'s `start_dp_wave` and
`request_wave`: every WAKE of zmqdp's §5
(after ADDs, the answer to the `start_wave`s of a dispatcher pass, coalesced when
`coalesce`) goes out as START_DP_WAVE(c, None), ADDs carry `current_wave = c`.
`VllmCoordinatorDialect` is vLLM 0.33's own coordinator (no front-end wake), for
comparison; the rest are deliberately broken translations that must be caught.

`explore` (tests/models/waves.py) searches every interleaving of the model's `World`
under these rules; `VllmWaveMachine` lets Hypothesis pick them. The property is the
same as for zmqdp's engines: when nothing more can happen, every request has finished
and no rank runs while another is parked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from tests.models import mutants
from tests.models.waves import (
    Client,
    ClockClient,
    GroupMachine,
    Rules,
    SearchResult,
    Start,
    World,
    explore,
)
from zmqdp._core.waves import WaveClock
from zmqdp.vllm.wire import request_wave, start_dp_wave


@dataclass(frozen=True)
class VConfig:
    ranks: int = 2
    requests: int = 2
    steps: int = 1  # group steps each request needs
    sync: int = 1  # dp_sync_interval (the group also decides at step 1 of each wave)
    wake_after_adds: bool = True  # the client publishes START_DP_WAVE after ADDs
    coalesce: bool = True  # start_wave answers wait for the end of the client's pass
    engine: str = "0.33"  # "0.32": an ADD at the rank's own wave reports nothing

    def rules(self) -> Rules:
        return VllmRules(self.engine)


# -- the client side: what goes on vLLM's wire ------------------------------------------


Dialect = Client
"""The client/coordinator translation (the model's `Client`)."""


class ZmqdpDialect(ClockClient):
    """`zmqdp.vllm.connect`'s group: zmqdp's §5 client rules (the real `WaveClock`, or a mutant
    clock) on vLLM's wire through `zmqdp.vllm.wire`'s own translation."""

    clock_cls: type[WaveClock] = WaveClock

    def __init__(self, coalesce: bool = True) -> None:
        super().__init__(coalesce, self.clock_cls)

    def key(self) -> tuple[Any, ...]:
        return (
            type(self).__name__,
            self.clock.wave,
            getattr(self.clock, "believed_running", None),
            self.wake_due,
            self.reporter,
        )

    def _wake(self, wave: int) -> Start:
        return start_dp_wave(wave)

    def stamp(self) -> int:
        return request_wave(self.clock)


class VllmCoordinatorDialect(Dialect):
    """vLLM 0.33's own `DPCoordinatorProc` (front-end wake removed): `wave_complete: w`
    moves it to `w + 1`, parked, if not past it; `start_wave: w` is answered at once with
    START_DP_WAVE(w, exclude=reporter) if `w` is newer, or current while it believes the
    engines parked; the front end stamps ADDs with the coordinator's wave."""

    def __init__(self, coalesce: bool = True) -> None:
        self.wave = 0
        self.running = False

    def key(self) -> tuple[Any, ...]:
        return (type(self).__name__, self.wave, self.running)

    def stamp(self) -> int:
        return self.wave

    def wave_complete(self, wave: int, rank: int) -> list[Start]:
        if self.wave <= wave:
            self.wave, self.running = wave + 1, False
        return []

    def start_wave(self, wave: int, rank: int) -> list[Start]:
        if wave > self.wave or (wave == self.wave and not self.running):
            self.wave, self.running = wave, True
            return [(wave, rank)]
        return []


# -- broken translations (each must be caught) ----------------------------------------


class BumpingDialect(ZmqdpDialect):
    """SMG's rule: every wake names c + 1."""

    clock_cls = mutants.BumpingClock


class SilentDialect(ZmqdpDialect):
    """Never answers a start_wave (still publishes after ADDs)."""

    clock_cls = mutants.IgnoresStartWave


class BelievedParkedDialect(ZmqdpDialect):
    """SMG #2078: wakes after ADDs only while it believes the group parked."""

    clock_cls = mutants.BelievedParkedClock


class ExcludesReporterDialect(ZmqdpDialect):
    """Copies vLLM's coordinator's exclude index while answering with the clock:
    START_DP_WAVE(c, exclude=the last start_wave's rank)."""

    def start_wave(self, wave: int, rank: int) -> list[Start]:
        out = super().start_wave(wave, rank)
        return [(w, rank) for w, _ in out]

    def flush(self) -> list[Start]:
        self.wake_due = False
        return [(self.clock.wave, self.reporter)]


class StampsAheadDialect(ZmqdpDialect):
    """Stamps ADDs with c + 1, a wave no rank has reached (an engine adopts it)."""

    def stamp(self) -> int:
        return self.clock.wave + 1


class WakesOnCompleteOnlyDialect(ZmqdpDialect):
    """Answers start_wave only when its clock moves (a 'dedup' of repeated wakes)."""

    def start_wave(self, wave: int, rank: int) -> list[Start]:
        before = self.clock.wave
        out = super().start_wave(wave, rank)
        if self.clock.wave == before:
            self.wake_due = False
            return []
        return out


BROKEN_DIALECTS: list[type[Dialect]] = [
    BumpingDialect,
    SilentDialect,
    BelievedParkedDialect,
    ExcludesReporterDialect,
    StampsAheadDialect,
    WakesOnCompleteOnlyDialect,
]


# -- the engines ------------------------------------------------------------------------


class VllmRules(Rules):
    """`DPEngineCoreProc` with a coordinator (module docstring): ADDs on the input pipe,
    START_DP_WAVE on the coordinator pipe; only rank 0 reports, and outputs count as
    delivered when produced. `engine` is "0.33" or "0.32" (the ADD rule differs)."""

    pipes: ClassVar[dict[str, str]] = {"deliver_add": "in", "deliver_start": "coord"}
    add_pipe = "in"
    wake_pipe = "coord"
    defer_after_adds = True

    def __init__(self, engine: str = "0.33") -> None:
        self.engine = engine

    def add(self, request: int, stamp: int) -> Any:
        return (request, stamp)

    def wake(self, start: Start) -> Any:
        return start

    def deliver(self, world: World, rank: int, action: str, message: Any) -> None:
        if action == "deliver_add":
            self.deliver_add(world, rank, *message)
        else:
            self.deliver_start(world, rank, *message)

    def deliver_add(self, world: World, rank: int, request: int, wave: int) -> None:
        r = world.ranks[rank]
        r.work[request] = world.cfg.steps
        if self.engine == "0.32":
            # 0.11-0.32: only a request for an older wave, to a parked rank, is reported;
            # one for the rank's own wave relied on the front end's FIRST_REQ wake.
            if wave > r.wave:
                r.wave = wave
            elif wave < r.wave and not r.running:
                world.reports[rank].append(("start", r.wave))
            r.running = True  # it has requests: it steps
            return
        if wave > r.wave:
            r.wave = wave
        if not r.running:
            r.running = True
            world.reports[rank].append(("start", r.wave))

    def deliver_start(self, world: World, rank: int, wave: int, exclude: int | None) -> None:
        r = world.ranks[rank]
        if exclude != rank and wave >= r.wave:
            r.wave = wave
            r.running = True

    def group_step(self, world: World) -> None:
        for r in world.ranks:
            for req in list(r.work):
                r.work[req] -= 1
                if not r.work[req]:
                    del r.work[req]
                    world.done.add(req)
            r.counter += 1
        r0 = world.ranks[0]
        edge = r0.fresh
        for r in world.ranks:
            r.fresh = False
        sync = r0.counter == 1 or r0.counter % world.cfg.sync == 0
        if sync and not any(r.work for r in world.ranks):
            world.reports[0].append(("complete", r0.wave))
            for r in world.ranks:
                r.wave += 1
                r.running = False
                r.counter = 0
                r.fresh = True
        elif edge:
            world.reports[0].append(("start", r0.wave))


def vsearch(
    cfg: VConfig, dialect: Callable[..., Dialect] = ZmqdpDialect, limit: int = 2_000_000
) -> SearchResult:
    """Every interleaving of `cfg` under `dialect`, breadth-first (shortest trace)."""
    return explore(World(cfg, dialect(cfg.coalesce)), limit)


class VllmWaveMachine(GroupMachine):
    """Hypothesis picks the interleaving. Set `dialect_cls` to run a variant."""

    dialect_cls: type[Dialect] = ZmqdpDialect
    order: ClassVar[dict[str, int]] = {
        "deliver_add": 0,
        "deliver_start": 1,
        "client_receive": 2,
        "client_flush": 3,
        "client_after_flush": 4,
        "group_step": 5,
        "submit": 6,
    }

    @initialize(
        ranks=st.integers(2, 3),
        requests=st.integers(1, 4),
        steps=st.integers(1, 2),
        sync=st.integers(1, 3),
        wake_after_adds=st.booleans(),
        coalesce=st.booleans(),
    )
    def setup(self, **kw: Any) -> None:
        cfg = VConfig(**kw)
        self.world = World(cfg, self.dialect_cls(cfg.coalesce))  # type: ignore[call-arg]

    @rule(rank=st.integers(0, 2))
    def deliver_add(self, rank: int) -> None:
        self._do("deliver_add", rank)

    @rule(rank=st.integers(0, 2))
    def deliver_start(self, rank: int) -> None:
        self._do("deliver_start", rank)

    @rule()
    def client_after_flush(self) -> None:
        self._do("client_after_flush", 0)
