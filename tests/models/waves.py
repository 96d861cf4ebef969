"""A model of N lockstep ranks and the client's wave clock (docs/protocol.md §5), with the
ranks' behaviour as a parameter (`Rules`): `NativeRules` here, zmqdp's engines;
`VllmRules` in tests/models/vllm_waves.py, vLLM's engine cores on vLLM's wire.

Native ranks follow only the engine MUST rules of §5, not the SHOULD rule (wave
agreement at sync), because the client must be safe without it:

* the group parks together at a sync point when no rank has work; each rank sends
  `wave_complete: wave` (its *own* wave), then `wave += 1`, `running = False`;
* WAKE(w) with `w >= wave` sets `wave = w, running = True`; a stale WAKE is ignored,
  and a WAKE received while running is adopted;
* an ADD while parked queues the request and sends `start_wave: wave`; with
  `self_wake` the rank also starts running at once, as vLLM's engines do.

Messages are FIFO per pipe (natively one pipe each way per rank; the rules say which
pipes there are and which one ADDs and wakes travel on). A rank handles its pipes only
between steps (a group step is one atomic transition), and the group steps only when
every rank is running: a running rank whose peers are parked is blocked in its
collective. The client (`Client`) is the real `WaveClock` (or a mutant) in
`ClockClient`: it wakes every rank when `start_wave` returns a wave, and optionally
after ADDs. With `coalesce` (what zmqdp's dispatcher does), the answers to the
`start_wave`s of one dispatcher pass are one wake, sent at the end of the pass with the
clock as it is then: the client may take any number of further messages before it
sends (`client_flush`).

`search()` explores every interleaving breadth-first; `WaveMachine` lets Hypothesis
pick interleavings (`GroupMachine` is what it shares with vLLM's). Both check the same
property, whatever the rules: when nothing more can happen, every request has finished
and no rank is running while another is parked.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

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

    def rules(self) -> Rules:
        return NativeRules(self.self_wake)


class Rank:
    __slots__ = ("counter", "fresh", "running", "wave", "work")

    def __init__(self) -> None:
        self.wave = 0
        self.running = False
        self.work: dict[int, int] = {}  # request -> steps left
        self.counter = 0  # steps since the group last parked
        self.fresh = True  # parked since its last step (vLLM's rank 0 reports the edge)

    def key(self) -> tuple[Any, ...]:
        return (self.wave, self.running, tuple(sorted(self.work.items())), self.counter, self.fresh)


# -- the client: the real wave clock (or a mutant), in a wire's words -----------------

Start = tuple[int, int | None]
"""A wake as the client publishes it: (wave, the rank it excludes or None). Natively it
is WAKE(wave); on vLLM's wire START_DP_WAVE(wave, exclude_engine_index)."""


class Client:
    """The client's wave rules: what it stamps on ADDs, what it publishes and when. Plain
    data, copied by `clone`. `ClockClient` is zmqdp's (the real `WaveClock` or a
    mutant); tests/models/vllm_waves.py adds vLLM's own coordinator and broken
    translations."""

    coalesce = True

    def stamp(self) -> int:
        """An ADD's wave (vLLM's `current_wave`; the native ADD carries none)."""
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

    def clone(self) -> Client:
        return copy.copy(self)


class ClockClient(Client):
    """zmqdp's §5 client rules: the real `WaveClock` (or `clock_cls`, a mutant). Every
    wake names the clock and excludes nobody; with `coalesce` (what the dispatcher does),
    the answers to the `start_wave`s of one pass are one wake at its end (`flush`)."""

    def __init__(self, coalesce: bool = True, clock_cls: type[WaveClock] = WaveClock) -> None:
        self.clock = clock_cls()
        self.coalesce = coalesce
        self.wake_due = False
        self.reporter: int | None = None  # the last answered start_wave's rank

    def clone(self) -> Client:
        c = copy.copy(self)
        c.clock = copy.copy(self.clock)
        return c

    def key(self) -> tuple[Any, ...]:
        return (
            type(self.clock).__name__,
            self.clock.wave,
            getattr(self.clock, "believed_running", None),
            self.wake_due,
        )

    def _wake(self, wave: int) -> Start:
        return (wave, None)

    def stamp(self) -> int:
        return self.clock.wave

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


# -- the ranks: the parameter ----------------------------------------------------------


class Rules:
    """How the ranks behave and how the wire carries what reaches them: the model's
    parameter. `pipes` maps each deliver action to the inbound pipe it reads (FIFO, one
    per rank each); an ADD goes on `add_pipe`, a wake on `wake_pipe`. `defer_after_adds`:
    the post-ADD wake waits for the input task's flush (`client_after_flush`) instead of
    going out with the ADD."""

    pipes: ClassVar[dict[str, str]]
    add_pipe: str
    wake_pipe: str
    defer_after_adds: bool

    def add(self, request: int, stamp: int) -> Any:
        """The ADD of `request` as it sits in the pipe."""
        raise NotImplementedError

    def wake(self, start: Start) -> Any:
        """A wake as it sits in the pipe."""
        raise NotImplementedError

    def deliver(self, world: World, rank: int, action: str, message: Any) -> None:
        """`rank` takes `message` from the pipe of `action`, between steps."""
        raise NotImplementedError

    def group_step(self, world: World) -> None:
        """One step of the whole group (every rank is running)."""
        raise NotImplementedError


class NativeRules(Rules):
    """zmqdp's engines, docs/protocol.md §5's MUST rules (module docstring): one pipe each
    way; every rank reports `wave_complete` when the group parks; an ADD to a parked rank
    is reported with `start_wave` (and with `self_wake` starts it running)."""

    pipes: ClassVar[dict[str, str]] = {"deliver": "in"}
    add_pipe = wake_pipe = "in"
    defer_after_adds = False

    def __init__(self, self_wake: bool) -> None:
        self.self_wake = self_wake

    def add(self, request: int, stamp: int) -> Any:
        return ("add", request)

    def wake(self, start: Start) -> Any:
        return ("wake", start[0])

    def deliver(self, world: World, rank: int, action: str, message: Any) -> None:
        kind, value = message
        r = world.ranks[rank]
        if kind == "add":
            r.work[value] = world.cfg.steps
            if not r.running:
                world.reports[rank].append(("start", r.wave))
                if self.self_wake:
                    r.running = True
        elif value >= r.wave:  # WAKE: adopt unless stale
            r.wave = value
            r.running = True

    def group_step(self, world: World) -> None:
        for i, r in enumerate(world.ranks):
            for req in list(r.work):
                r.work[req] -= 1
                if not r.work[req]:
                    del r.work[req]
                    world.reports[i].append(("done", req))
            r.counter += 1
        if world.ranks[0].counter % world.cfg.sync == 0 and not any(r.work for r in world.ranks):
            for i, r in enumerate(world.ranks):
                world.reports[i].append(("complete", r.wave))
                r.wave += 1
                r.running = False
                r.counter = 0


class Checks:
    """What `explore` asks of a model state: apply an action, and say what is wrong at a
    dead end."""

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
    """One state of the group and the client, under `rules` (the ranks' behaviour) and
    `client` (the client's). Mutable; `clone()` for search."""

    def __init__(self, cfg: Any, client: Client, rules: Rules | None = None) -> None:
        self.cfg = cfg
        self.client = client
        self.rules = rules if rules is not None else cfg.rules()
        self.submitted = 0
        self.done: set[int] = set()
        self.ranks = [Rank() for _ in range(cfg.ranks)]
        names = sorted(set(self.rules.pipes.values()))
        self.pipes: list[dict[str, deque[Any]]] = [
            {name: deque() for name in names} for _ in range(cfg.ranks)
        ]
        self.reports: list[deque[tuple[str, int]]] = [deque() for _ in range(cfg.ranks)]
        self.adds_due = False  # ADDs were flushed and their post-ADD wake is not out yet

    def clone(self) -> World:
        w = copy.copy(self)
        w.client = self.client.clone()
        w.done = set(self.done)
        w.ranks = []
        for r in self.ranks:
            nr = copy.copy(r)
            nr.work = dict(r.work)
            w.ranks.append(nr)
        w.pipes = [{name: deque(q) for name, q in p.items()} for p in self.pipes]
        w.reports = [deque(q) for q in self.reports]
        return w

    def key(self) -> tuple[Any, ...]:
        return (
            self.client.key(),
            self.submitted,
            self.adds_due,
            frozenset(self.done),
            tuple(r.key() for r in self.ranks),
            tuple(tuple(tuple(q) for q in p.values()) for p in self.pipes),
            tuple(tuple(q) for q in self.reports),
        )

    def apply(self, action: tuple[str, int]) -> None:
        name, rank = action
        pipe = self.rules.pipes.get(name)
        if pipe is None:
            super().apply(action)
        else:
            self.rules.deliver(self, rank, name, self.pipes[rank][pipe].popleft())

    # -- client -----------------------------------------------------------------------

    def _publish(self, starts: list[Start]) -> None:
        for start in starts:
            for p in self.pipes:
                p[self.rules.wake_pipe].append(self.rules.wake(start))

    def submit(self, rank: int) -> None:
        self.pipes[rank][self.rules.add_pipe].append(
            self.rules.add(self.submitted, self.client.stamp())
        )
        self.submitted += 1
        if not self.cfg.wake_after_adds:
            return
        if self.rules.defer_after_adds:
            self.adds_due = True
        else:
            self._publish(self.client.after_adds())

    def client_after_flush(self, _: int = 0) -> None:
        """The input task handed a run of ADDs to libzmq: one wake, with the clock as it
        is now (`GroupCore.on_flushed`)."""
        self.adds_due = False
        self._publish(self.client.after_adds())

    def client_receive(self, rank: int) -> None:
        kind, value = self.reports[rank].popleft()
        if kind == "complete":
            self._publish(self.client.wave_complete(value, rank))
        elif kind == "start":
            self._publish(self.client.start_wave(value, rank))
        else:
            self.done.add(value)

    def client_flush(self, _: int = 0) -> None:
        """The end of a dispatcher pass: one wake answers every start_wave in it."""
        self._publish(self.client.flush())

    # -- engines ----------------------------------------------------------------------

    def group_step(self) -> None:
        self.rules.group_step(self)

    # -- what can happen --------------------------------------------------------------

    def actions(self) -> Iterator[tuple[str, int]]:
        if self.submitted < self.cfg.requests:
            for rank in range(self.cfg.ranks):
                yield ("submit", rank)
        for rank in range(self.cfg.ranks):
            for action, pipe in self.rules.pipes.items():
                if self.pipes[rank][pipe]:
                    yield (action, rank)
            if self.reports[rank]:
                yield ("client_receive", rank)
        if all(r.running for r in self.ranks):
            yield ("group_step", 0)
        if self.client.due():
            yield ("client_flush", 0)
        if self.adds_due:
            yield ("client_after_flush", 0)

    def client_state(self) -> str:
        return f"client={self.client.key()}"


@dataclass
class SearchResult:
    states: int
    counterexample: list[tuple[str, int]] | None
    problem: str | None


def search(
    cfg: Config, clock_factory: type[WaveClock] = WaveClock, limit: int = 2_000_000
) -> SearchResult:
    """Breadth-first search of every interleaving; the first stuck state wins (so the
    counterexample is a shortest one)."""
    return explore(World(cfg, ClockClient(cfg.coalesce, clock_factory)), limit)


def explore(start: Any, limit: int = 2_000_000) -> SearchResult:
    """`search` from any start state with `clone`, `key`, `actions`, `apply` and
    `stuck` (tests/models/vllm_waves.py starts it with vLLM's rules)."""
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


class GroupMachine(RuleBasedStateMachine):
    """Hypothesis picks the interleaving of a `World`; a subclass sets it up (its rules
    and client) and adds a rule per deliver action of its rules. `order` is the fixed
    fair policy `teardown` runs to quiescence with."""

    order: ClassVar[dict[str, int]]

    def __init__(self) -> None:
        super().__init__()
        self.world: World | None = None

    @rule(rank=st.integers(0, 2))
    def submit(self, rank: int) -> None:
        self._do("submit", rank)

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
        if (name, arg) in set(self.world.actions()):
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
            world.apply(min(actions, key=lambda a: (self.order[a[0]], a[1])))
        else:
            raise AssertionError(f"no quiescence after 10000 steps: {world.describe()}")
        problem = world.stuck()
        assert problem is None, problem


class WaveMachine(GroupMachine):
    """zmqdp's engines (`NativeRules`). Set `clock_cls` to run a variant."""

    clock_cls: type[WaveClock] = WaveClock
    order: ClassVar[dict[str, int]] = {
        "deliver": 0,
        "client_receive": 1,
        "client_flush": 2,
        "group_step": 3,
        "submit": 4,
    }

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
        cfg = Config(**kw)
        self.world = World(cfg, ClockClient(cfg.coalesce, self.clock_cls))

    @rule(rank=st.integers(0, 2))
    def deliver(self, rank: int) -> None:
        self._do("deliver", rank)
