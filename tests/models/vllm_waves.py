"""vLLM 0.33's engine-side wave rules as a rank variant of tests/models/waves.py, driven by
the wave translation `zmqdp.vllm.connect`'s group uses (or a broken one).

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

The client is a `Dialect`: what it stamps on ADDs, what it publishes and when.
`ZmqdpDialect` is `zmqdp.vllm.connect`'s group's: the real `WaveClock` (or a mutant clock) plus
`zmqdp.vllm.wire`'s `start_dp_wave` and `request_wave`: every WAKE of zmqdp's §5
(after ADDs, the answer to the `start_wave`s of a dispatcher pass, coalesced when
`coalesce`) goes out as START_DP_WAVE(c, None), ADDs carry `current_wave = c`.
`VllmCoordinatorDialect` is vLLM 0.33's own coordinator (no front-end wake), for
comparison; the rest are deliberately broken translations that must be caught.

`explore` (tests/models/waves.py) searches every interleaving; `VllmWaveMachine` lets
Hypothesis pick them. The property is the same as for zmqdp's engines: when nothing more
can happen, every request has finished and no rank runs while another is parked.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.models import mutants
from tests.models.waves import Checks, SearchResult, explore
from zmqdp._core.waves import WaveClock
from zmqdp.vllm.wire import request_wave, start_dp_wave

Start = tuple[int, int | None]
"""START_DP_WAVE(wave, exclude_engine_index)."""


@dataclass(frozen=True)
class VConfig:
    ranks: int = 2
    requests: int = 2
    steps: int = 1  # group steps each request needs
    sync: int = 1  # dp_sync_interval (the group also decides at step 1 of each wave)
    wake_after_adds: bool = True  # the client publishes START_DP_WAVE after ADDs
    coalesce: bool = True  # start_wave answers wait for the end of the client's pass
    engine: str = "0.33"  # "0.32": an ADD at the rank's own wave reports nothing


# -- the client side: what goes on vLLM's wire ------------------------------------------


class Dialect:
    """The client/coordinator translation. Plain data, copied by `clone`."""

    coalesce = True

    def stamp(self) -> int:
        """An ADD's `current_wave`."""
        raise NotImplementedError

    def after_adds(self) -> list[Start]:
        return []

    def wave_complete(self, wave: int, rank: int) -> list[Start]:
        return []

    def start_wave(self, wave: int, rank: int) -> list[Start]:
        """Published at once; or, when coalescing, remember that a flush is due."""
        return []

    def due(self) -> bool:
        return False

    def flush(self) -> list[Start]:
        """The end of a dispatcher pass."""
        return []

    def key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def clone(self) -> Dialect:
        return copy.copy(self)


class ZmqdpDialect(Dialect):
    """`zmqdp.vllm.connect`'s group: zmqdp's §5 client rules (the real `WaveClock`, or a mutant
    clock) on vLLM's wire through `zmqdp.vllm.wire`'s own translation."""

    clock_cls: type[WaveClock] = WaveClock

    def __init__(self, coalesce: bool = True) -> None:
        self.clock = self.clock_cls()
        self.coalesce = coalesce
        self.wake_due = False
        self.reporter: int | None = None  # the last start_wave's rank (for a mutant)

    def clone(self) -> Dialect:
        d = copy.copy(self)
        d.clock = copy.copy(self.clock)
        return d

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

    def after_adds(self) -> list[Start]:
        wave = self.clock.wake_after_adds()
        return [] if wave is None else [self._wake(wave)]

    def wave_complete(self, wave: int, rank: int) -> list[Start]:
        self.clock.wave_complete(wave)
        return []

    def start_wave(self, wave: int, rank: int) -> list[Start]:
        answer = self.clock.start_wave(wave)
        if answer is None:
            return []
        self.reporter = rank
        if self.coalesce:
            self.wake_due = True
            return []
        return [self._wake(answer)]

    def due(self) -> bool:
        return self.wake_due

    def flush(self) -> list[Start]:
        self.wake_due = False
        return [self._wake(self.clock.wave)]


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


class VRank:
    __slots__ = ("counter", "fresh", "running", "wave", "work")

    def __init__(self) -> None:
        self.wave = 0
        self.running = False
        self.work: dict[int, int] = {}  # request -> steps left
        self.counter = 0  # step_counter
        self.fresh = True  # parked since its last step (`was_running` is False)

    def key(self) -> tuple[Any, ...]:
        return (self.wave, self.running, tuple(sorted(self.work.items())), self.counter, self.fresh)


class VllmWorld(Checks):
    """One state of a group of vLLM engines and the client. Mutable; `clone()`."""

    def __init__(self, cfg: VConfig, dialect: Dialect) -> None:
        self.cfg = cfg
        self.dialect = dialect
        self.submitted = 0
        self.done: set[int] = set()
        self.ranks = [VRank() for _ in range(cfg.ranks)]
        self.inputs: list[deque[tuple[int, int]]] = [deque() for _ in range(cfg.ranks)]
        self.coord_in: list[deque[Start]] = [deque() for _ in range(cfg.ranks)]
        self.reports: list[deque[tuple[str, int]]] = [deque() for _ in range(cfg.ranks)]
        self.adds_due = False  # ADDs were sent and their START_DP_WAVE is not yet

    def clone(self) -> VllmWorld:
        w = copy.copy(self)
        w.dialect = self.dialect.clone()
        w.done = set(self.done)
        w.ranks = []
        for r in self.ranks:
            nr = copy.copy(r)
            nr.work = dict(r.work)
            w.ranks.append(nr)
        w.inputs = [deque(q) for q in self.inputs]
        w.coord_in = [deque(q) for q in self.coord_in]
        w.reports = [deque(q) for q in self.reports]
        return w

    def key(self) -> tuple[Any, ...]:
        return (
            self.dialect.key(),
            self.submitted,
            self.adds_due,
            frozenset(self.done),
            tuple(r.key() for r in self.ranks),
            tuple(tuple(q) for q in self.inputs),
            tuple(tuple(q) for q in self.coord_in),
            tuple(tuple(q) for q in self.reports),
        )

    # -- client -----------------------------------------------------------------------

    def _publish(self, starts: list[Start]) -> None:
        for start in starts:
            for q in self.coord_in:
                q.append(start)

    def submit(self, rank: int) -> None:
        self.inputs[rank].append((self.submitted, self.dialect.stamp()))
        self.submitted += 1
        self.adds_due = self.cfg.wake_after_adds

    def client_after_flush(self, _: int = 0) -> None:
        """The input task handed a run of ADDs to libzmq: one START_DP_WAVE, with the
        clock as it is now (`EngineGroup._after_flush`)."""
        self.adds_due = False
        self._publish(self.dialect.after_adds())

    def client_receive(self, rank: int) -> None:
        kind, wave = self.reports[rank].popleft()
        if kind == "complete":
            self._publish(self.dialect.wave_complete(wave, rank))
        else:
            self._publish(self.dialect.start_wave(wave, rank))

    def client_flush(self, _: int = 0) -> None:
        self._publish(self.dialect.flush())

    # -- engines (DPEngineCoreProc) ---------------------------------------------------

    def deliver_add(self, rank: int) -> None:
        request, wave = self.inputs[rank].popleft()
        r = self.ranks[rank]
        r.work[request] = self.cfg.steps
        if self.cfg.engine == "0.32":
            # 0.11-0.32: only a request for an older wave, to a parked rank, is reported;
            # one for the rank's own wave relied on the front end's FIRST_REQ wake.
            if wave > r.wave:
                r.wave = wave
            elif wave < r.wave and not r.running:
                self.reports[rank].append(("start", r.wave))
            r.running = True  # it has requests: it steps
            return
        if wave > r.wave:
            r.wave = wave
        if not r.running:
            r.running = True
            self.reports[rank].append(("start", r.wave))

    def deliver_start(self, rank: int) -> None:
        wave, exclude = self.coord_in[rank].popleft()
        r = self.ranks[rank]
        if exclude != rank and wave >= r.wave:
            r.wave = wave
            r.running = True

    def group_step(self) -> None:
        for r in self.ranks:
            for req in list(r.work):
                r.work[req] -= 1
                if not r.work[req]:
                    del r.work[req]
                    self.done.add(req)
            r.counter += 1
        r0 = self.ranks[0]
        edge = r0.fresh
        for r in self.ranks:
            r.fresh = False
        sync = r0.counter == 1 or r0.counter % self.cfg.sync == 0
        if sync and not any(r.work for r in self.ranks):
            self.reports[0].append(("complete", r0.wave))
            for r in self.ranks:
                r.wave += 1
                r.running = False
                r.counter = 0
                r.fresh = True
        elif edge:
            self.reports[0].append(("start", r0.wave))

    # -- what can happen --------------------------------------------------------------

    def actions(self) -> Iterator[tuple[str, int]]:
        if self.submitted < self.cfg.requests:
            for rank in range(self.cfg.ranks):
                yield ("submit", rank)
        for rank in range(self.cfg.ranks):
            if self.inputs[rank]:
                yield ("deliver_add", rank)
            if self.coord_in[rank]:
                yield ("deliver_start", rank)
            if self.reports[rank]:
                yield ("client_receive", rank)
        if all(r.running for r in self.ranks):
            yield ("group_step", 0)
        if self.dialect.due():
            yield ("client_flush", 0)
        if self.adds_due:
            yield ("client_after_flush", 0)

    def client_state(self) -> str:
        return f"client={self.dialect.key()}"


def vsearch(
    cfg: VConfig, dialect: Callable[..., Dialect] = ZmqdpDialect, limit: int = 2_000_000
) -> SearchResult:
    """Every interleaving of `cfg` under `dialect`, breadth-first (shortest trace)."""
    return explore(VllmWorld(cfg, dialect(cfg.coalesce)), limit)


class VllmWaveMachine(RuleBasedStateMachine):
    """Hypothesis picks the interleaving. Set `dialect_cls` to run a variant."""

    dialect_cls: type[Dialect] = ZmqdpDialect

    def __init__(self) -> None:
        super().__init__()
        self.world: VllmWorld | None = None

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
        self.world = VllmWorld(cfg, self.dialect_cls(cfg.coalesce))  # type: ignore[call-arg]

    @rule(rank=st.integers(0, 2))
    def submit(self, rank: int) -> None:
        self._do("submit", rank)

    @rule(rank=st.integers(0, 2))
    def deliver_add(self, rank: int) -> None:
        self._do("deliver_add", rank)

    @rule(rank=st.integers(0, 2))
    def deliver_start(self, rank: int) -> None:
        self._do("deliver_start", rank)

    @rule(rank=st.integers(0, 2))
    def client_receive(self, rank: int) -> None:
        self._do("client_receive", rank)

    @rule()
    def group_step(self) -> None:
        self._do("group_step", 0)

    @rule()
    def client_flush(self) -> None:
        self._do("client_flush", 0)

    @rule()
    def client_after_flush(self) -> None:
        self._do("client_after_flush", 0)

    def _do(self, name: str, arg: int) -> None:
        assert self.world is not None
        arg %= self.world.cfg.ranks
        if (name, arg) in set(self.world.actions()):
            self.world.apply((name, arg))

    @invariant()
    def nothing_stuck_when_quiescent(self) -> None:
        if self.world is not None and not any(True for _ in self.world.actions()):
            problem = self.world.stuck()
            assert problem is None, problem

    def teardown(self) -> None:
        """Run to quiescence under a fixed fair policy, then check."""
        world = self.world
        if world is None:
            return
        order = {
            "deliver_add": 0,
            "deliver_start": 1,
            "client_receive": 2,
            "client_flush": 3,
            "client_after_flush": 4,
            "group_step": 5,
            "submit": 6,
        }
        for _ in range(10_000):
            actions = list(world.actions())
            if not actions:
                break
            world.apply(min(actions, key=lambda a: (order[a[0]], a[1])))
        else:
            raise AssertionError(f"no quiescence after 10000 steps: {world.describe()}")
        problem = world.stuck()
        assert problem is None, problem
