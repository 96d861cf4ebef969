"""A model of N lockstep ranks and the client's wave clock (docs/protocol.md §5).

The ranks follow only the engine MUST rules of §5, not the SHOULD rule (wave agreement
at sync), because the client must be safe without it:

* the group parks together at a sync point when no rank has work; each rank sends
  `wave_complete: wave` (its *own* wave), then `wave += 1`, `running = False`;
* WAKE(w) with `w >= wave` sets `wave = w, running = True`; a stale WAKE is ignored,
  and a WAKE received while running is adopted;
* an ADD while parked queues the request and sends `start_wave: wave`; with
  `self_wake` the rank also starts running at once, as vLLM's engines do.

Messages are FIFO per pipe (one pipe each way per rank). A rank handles its inbox only
between steps (a group step is one atomic transition), and the group steps only when
every rank is running: a running rank whose peers are parked is blocked in its
collective. The client is the real `WaveClock` (or a mutant): it sends WAKE(c) to every
rank when `start_wave` returns a wave, and optionally after each ADD. With `coalesce`
(what zmqdp's dispatcher does), the answers to the `start_wave`s of one dispatcher pass
are one WAKE(c), sent at the end of the pass with the clock as it is then: the client
may take any number of further messages before it sends (`client_flush`).

`search()` explores every interleaving breadth-first; `WaveMachine` lets Hypothesis
pick interleavings. Both check the same property: when nothing more can happen, every
request has finished and no rank is running while another is parked.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from zmqdp._core.waves import WaveClock


@dataclass(frozen=True)
class Config:
    ranks: int = 2
    requests: int = 2
    steps: int = 1  # group steps each request needs
    sync: int = 1  # sync interval: the group decides whether to park every `sync` steps
    self_wake: bool = False  # a parked rank that gets an ADD starts running at once
    wake_after_adds: bool = True  # the client sends WAKE(c) after each ADD
    coalesce: bool = False  # start_wave answers wait for the end of the client's pass


class Rank:
    __slots__ = ("counter", "running", "wave", "work")

    def __init__(self) -> None:
        self.wave = 0
        self.running = False
        self.work: dict[int, int] = {}  # request -> steps left
        self.counter = 0

    def key(self) -> tuple[Any, ...]:
        return (self.wave, self.running, tuple(sorted(self.work.items())), self.counter)


class Checks:
    """What `explore` asks of a model state, shared by `World` and the vLLM model
    (tests/models/vllm_waves.py): apply an action, and say what is wrong at a dead end."""

    cfg: Any
    ranks: list[Any]
    done: set[int]

    def group_step(self) -> None:
        raise NotImplementedError

    def client_state(self) -> str:
        raise NotImplementedError

    def apply(self, action: tuple[str, int]) -> None:
        name, arg = action
        if name == "group_step":
            self.group_step()
        else:
            getattr(self, name)(arg)

    def stuck(self) -> str | None:
        """At a state where nothing more can happen: what is wrong, if anything."""
        running = [i for i, r in enumerate(self.ranks) if r.running]
        if running and len(running) < len(self.ranks):
            return f"ranks {running} run while their peers are parked: {self.describe()}"
        missing = set(range(self.cfg.requests)) - self.done
        if missing:
            return f"requests {sorted(missing)} never finish: {self.describe()}"
        return None

    def describe(self) -> str:
        ranks = ", ".join(
            f"r{i}(wave={r.wave}, {'running' if r.running else 'parked'}, work={r.work})"
            for i, r in enumerate(self.ranks)
        )
        return f"{self.client_state()} {ranks}"


class World(Checks):
    """One state of the group and the client. Mutable; `clone()` for search."""

    def __init__(self, cfg: Config, clock: WaveClock) -> None:
        self.cfg = cfg
        self.clock = clock
        self.submitted = 0
        self.done: set[int] = set()
        self.ranks = [Rank() for _ in range(cfg.ranks)]
        self.to_rank: list[deque[tuple[str, int]]] = [deque() for _ in range(cfg.ranks)]
        self.to_client: list[deque[tuple[str, int]]] = [deque() for _ in range(cfg.ranks)]
        self.wake_due = False  # coalesce: a start_wave is not answered yet

    def clone(self) -> World:
        w = copy.copy(self)
        w.clock = copy.copy(self.clock)
        w.done = set(self.done)
        w.ranks = []
        for r in self.ranks:
            nr = copy.copy(r)
            nr.work = dict(r.work)
            w.ranks.append(nr)
        w.to_rank = [deque(q) for q in self.to_rank]
        w.to_client = [deque(q) for q in self.to_client]
        return w

    def key(self) -> tuple[Any, ...]:
        return (
            type(self.clock).__name__,
            self.clock.wave,
            getattr(self.clock, "believed_running", None),
            self.submitted,
            self.wake_due,
            frozenset(self.done),
            tuple(r.key() for r in self.ranks),
            tuple(tuple(q) for q in self.to_rank),
            tuple(tuple(q) for q in self.to_client),
        )

    # -- client -----------------------------------------------------------------------

    def _wake_all(self, wave: int | None) -> None:
        if wave is not None:
            for q in self.to_rank:
                q.append(("wake", wave))

    def submit(self, rank: int) -> None:
        self.to_rank[rank].append(("add", self.submitted))
        self.submitted += 1
        if self.cfg.wake_after_adds:
            self._wake_all(self.clock.wake_after_adds())

    def client_receive(self, rank: int) -> None:
        kind, value = self.to_client[rank].popleft()
        if kind == "complete":
            self.clock.wave_complete(value)
        elif kind == "start":
            wave = self.clock.start_wave(value)
            if self.cfg.coalesce and wave is not None:
                self.wake_due = True  # answered by `client_flush`, at the end of the pass
            else:
                self._wake_all(wave)
        else:
            self.done.add(value)

    def client_flush(self, _: int = 0) -> None:
        """The end of a dispatcher pass: one WAKE(c) answers every start_wave in it."""
        self.wake_due = False
        self._wake_all(self.clock.wave)

    # -- engines ----------------------------------------------------------------------

    def deliver(self, rank: int) -> None:
        kind, value = self.to_rank[rank].popleft()
        r = self.ranks[rank]
        if kind == "add":
            r.work[value] = self.cfg.steps
            if not r.running:
                self.to_client[rank].append(("start", r.wave))
                if self.cfg.self_wake:
                    r.running = True
        elif value >= r.wave:  # WAKE: adopt unless stale
            r.wave = value
            r.running = True

    def group_step(self) -> None:
        for i, r in enumerate(self.ranks):
            for req in list(r.work):
                r.work[req] -= 1
                if not r.work[req]:
                    del r.work[req]
                    self.to_client[i].append(("done", req))
            r.counter += 1
        if self.ranks[0].counter % self.cfg.sync == 0 and not any(r.work for r in self.ranks):
            for i, r in enumerate(self.ranks):
                self.to_client[i].append(("complete", r.wave))
                r.wave += 1
                r.running = False
                r.counter = 0

    # -- what can happen --------------------------------------------------------------

    def actions(self) -> Iterator[tuple[str, int]]:
        if self.submitted < self.cfg.requests:
            for rank in range(self.cfg.ranks):
                yield ("submit", rank)
        for rank in range(self.cfg.ranks):
            if self.to_rank[rank]:
                yield ("deliver", rank)
            if self.to_client[rank]:
                yield ("client_receive", rank)
        if all(r.running for r in self.ranks):
            yield ("group_step", 0)
        if self.wake_due:
            yield ("client_flush", 0)

    def client_state(self) -> str:
        return f"clock={self.clock.wave}"


@dataclass
class SearchResult:
    states: int
    counterexample: list[tuple[str, int]] | None
    problem: str | None


def search(
    cfg: Config, clock_factory: Callable[[], WaveClock] = WaveClock, limit: int = 2_000_000
) -> SearchResult:
    """Breadth-first search of every interleaving; the first stuck state wins (so the
    counterexample is a shortest one)."""
    return explore(World(cfg, clock_factory()), limit)


def explore(start: Any, limit: int = 2_000_000) -> SearchResult:
    """`search` from any start state with `clone`, `key`, `actions`, `apply` and
    `stuck` (tests/models/vllm_waves.py uses it for vLLM's engine rules)."""
    cfg = start.cfg
    parents: dict[tuple[Any, ...], tuple[tuple[Any, ...], tuple[str, int]] | None] = {
        start.key(): None
    }
    frontier = deque([start])
    while frontier:
        world = frontier.popleft()
        moved = False
        for action in world.actions():
            moved = True
            nxt = world.clone()
            nxt.apply(action)
            k = nxt.key()
            if k in parents:
                continue
            parents[k] = (world.key(), action)
            if len(parents) > limit:
                raise RuntimeError(f"state space of {cfg} exceeds {limit}")
            frontier.append(nxt)
        if not moved:
            problem = world.stuck()
            if problem:
                trace: list[tuple[str, int]] = []
                k = world.key()
                while parents[k] is not None:
                    parent, action = parents[k]  # type: ignore[misc]
                    trace.append(action)
                    k = parent
                return SearchResult(len(parents), trace[::-1], problem)
    return SearchResult(len(parents), None, None)


class WaveMachine(RuleBasedStateMachine):
    """Hypothesis picks the interleaving. Set `clock_cls` to run a variant."""

    clock_cls: type[WaveClock] = WaveClock

    def __init__(self) -> None:
        super().__init__()
        self.world: World | None = None

    @initialize(
        ranks=st.integers(2, 3),
        requests=st.integers(1, 4),
        steps=st.integers(1, 2),
        sync=st.integers(1, 3),
        self_wake=st.booleans(),
        wake_after_adds=st.booleans(),
        coalesce=st.booleans(),
    )
    def setup(self, **kw: Any) -> None:
        self.world = World(Config(**kw), self.clock_cls())

    def _enabled(self, name: str, arg: int) -> bool:
        assert self.world is not None
        return (name, arg) in set(self.world.actions())

    @rule(rank=st.integers(0, 2))
    def submit(self, rank: int) -> None:
        self._do("submit", rank)

    @rule(rank=st.integers(0, 2))
    def deliver(self, rank: int) -> None:
        self._do("deliver", rank)

    @rule(rank=st.integers(0, 2))
    def client_receive(self, rank: int) -> None:
        self._do("client_receive", rank)

    @rule()
    def group_step(self) -> None:
        self._do("group_step", 0)

    @rule()
    def client_flush(self) -> None:
        self._do("client_flush", 0)

    def _do(self, name: str, arg: int) -> None:
        assert self.world is not None
        arg %= self.world.cfg.ranks
        if self._enabled(name, arg):
            self.world.apply((name, arg))

    @invariant()
    def nothing_stuck_when_quiescent(self) -> None:
        if self.world is not None and not any(True for _ in self.world.actions()):
            problem = self.world.stuck()
            assert problem is None, problem

    def teardown(self) -> None:
        """Let the system run to quiescence under a fixed fair policy, then check."""
        world = self.world
        if world is None:
            return
        for _ in range(10_000):
            actions = list(world.actions())
            if not actions:
                break
            order = {
                "deliver": 0,
                "client_receive": 1,
                "client_flush": 2,
                "group_step": 3,
                "submit": 4,
            }
            world.apply(min(actions, key=lambda a: (order[a[0]], a[1])))
        else:
            raise AssertionError(f"no quiescence after 10000 steps: {world.describe()}")
        problem = world.stuck()
        assert problem is None, problem
