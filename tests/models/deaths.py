"""Deaths by closed connections, on both wires, as a Hypothesis state machine.

What it drives is what production runs, with the sockets taken away: the handshake
state machine of the wire (`HandshakeState` natively, `VllmHandshake` on vLLM's), a
`ConnectionWatch` for the socket that carries a rank's life, and `GroupCore`'s facts.
`Sockets` does what the transport does with them (`TransportBase._claim`,
`_watch_connections`, `_connection_lost`, `forget`): it claims a connection for the
incarnation whose message came on it, reports each close to the core naming that
incarnation, and forgets only what a forget effect names. Engines are processes, each
with its own connection; a new process of a rank (a restart, a second process) says
HELLO on its own one, and old ones may close at any time, before or after it.

The model (`ModelRank`) says, per rank: the incarnation of its latest admitted HELLO,
whether that one completed its handshake, and whether it was judged dead. Invariants:

* a rank is up in the core exactly when its latest incarnation completed its handshake
  and was not judged dead, and then the core and the handshake agree on it;
* a handshake under way (its HELLO admitted, not judged dead) is never wiped: a forget
  naming an older incarnation leaves it alone (the wiped replacement of issue 33);
* every death of an up incarnation is judged exactly once (one "dead" log), and once
  the deadlines pass no report is left unjudged.

`DeathMachine` is bound to a wire by `machine(wire)`; `tests/core/test_deaths.py` runs it
on both, and against `ForgetsAnyIncarnation` (a forget that ignores the incarnation it
names), which it must catch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from zmqdp._core.handshake import HandshakeState, RankPhase, rank_identity
from zmqdp._core.liveness import ConnectionWatch
from zmqdp._core.messages import Hello
from zmqdp._core.state import GroupCore
from zmqdp.vllm.handshake import VllmHandshake

N = 2
GRACE = 0.1
JUDGE = 3.5
"""Seconds the heartbeats take to judge an incumbent (natively a HELLO on a second
connection is held that long, `HandshakeState.contest`)."""


class ForgetsAnyIncarnation(HandshakeState):
    """Mutant: a forget wipes the rank's handshake whatever incarnation it names (as the
    transport did before issue 32: it wiped a replacement already under way)."""

    def superseded(self, rank: int, epoch: int | None) -> bool:
        return False


class VllmForgetsAnyIncarnation(VllmHandshake):
    """The same mutant on vLLM's wire."""

    def superseded(self, rank: int, epoch: int | None) -> bool:
        return False


@dataclass
class ModelRank:
    incarnation: int | None = None
    """The epoch (vLLM: the count) of its latest admitted HELLO."""
    up: bool = False
    """That incarnation completed its handshake (and was not judged dead since)."""
    dead: set[int | None] = field(default_factory=set)
    """Incarnations judged dead (a forget named them, or the core declared them)."""


class Sockets:
    """The transport's part, sans-IO: claims, reports, forgets (module docstring)."""

    def __init__(self, machine: DeathMachine) -> None:
        self.m = machine
        self.watch = ConnectionWatch()
        self.claimed: dict[int, int | None] = {}

    def claim(self, fd: int, rank: int) -> None:
        self.claimed[rank] = epoch = self.m.hs.epoch(rank)
        if not self.watch.claim(fd, rank):
            self.lost(rank, epoch)

    def closed(self, fd: int) -> None:
        if (rank := self.watch.disconnected(fd)) is not None:
            self.lost(rank, self.claimed.get(rank))

    def lost(self, rank: int, incarnation: int | None) -> None:
        self.m.core.on_connection_lost(rank, incarnation, "its connection closed", self.m.now)
        self.m.reported.append((rank, incarnation))

    def forget(self, rank: int, resync: bool, epoch: int | None) -> None:
        hs = self.m.hs
        if isinstance(hs, VllmHandshake):
            forgotten = hs.forget(rank, epoch=epoch)
        else:
            forgotten = hs.forget(rank, resync=resync, epoch=epoch)
        if forgotten:
            self.watch.release(rank)


class DeathMachine(RuleBasedStateMachine):
    """See the module docstring. `wire` is "native" or "vllm"; `handshake_cls` the state
    machine of that wire (a mutant, to prove the machine can fail)."""

    wire = "native"
    handshake_cls: type[Any] = HandshakeState

    processes = Bundle("processes")

    def __init__(self) -> None:
        super().__init__()
        if self.wire == "vllm":
            self.hs: Any = self.handshake_cls(N, lambda _r: b"init")
        else:
            self.hs = self.handshake_cls(N, "in", "out", first_epoch=10)
        self.core: GroupCore[Any] = GroupCore(N, lockstep=False)
        self.sockets = Sockets(self)
        self.model = [ModelRank() for _ in range(N)]
        self.now = 0.0
        self.next_fd = 3
        self.open: dict[int, int] = {}
        """Open fd -> the rank of the engine process it belongs to."""
        self.reported: list[tuple[int, int | None]] = []
        self.dead_logs: dict[tuple[int, int | None], int] = {}
        self.proc_of: dict[int, int] = {}
        """Rank -> the connection of the process whose HELLO was admitted last."""

    # -- the engines --------------------------------------------------------------------

    @rule(target=processes, rank=st.integers(0, N - 1))
    def connect(self, rank: int) -> tuple[int, int]:
        """A process of `rank` connects (a first engine, a restart, a second process)."""
        fd = self.next_fd
        self.next_fd += 1
        self.sockets.watch.accepted(fd)
        self.open[fd] = rank
        return (rank, fd)

    @rule(proc=processes)
    def hello(self, proc: tuple[int, int]) -> None:
        """A process says HELLO on its connection (natively held while the rank's
        current connection is open and other: the contest)."""
        rank, fd = proc
        if fd not in self.open:
            return
        if self.wire == "native":
            hello = Hello(rank=rank, size=N, lockstep=False)
            incumbent = self.sockets.watch.connections(rank)
            if self.hs.contest(rank_identity(rank), hello, fd, self.now, incumbent, JUDGE):
                return
        self._answer_hello(rank, fd)

    @precondition(lambda self: self.wire == "native" and self.hs.holding())
    @rule(dt=st.sampled_from([0.0, 1.0, JUDGE]))
    def settle(self, dt: float) -> None:
        """The handshake decides the held HELLOs: a restart is admitted once the
        incumbent closed; a second process is refused while it lives."""
        self.now += dt
        watch = self.sockets.watch
        settled = self.hs.settle(self.now, watch.__contains__, watch.connections)
        for held in settled.admit:
            assert not watch.connections(held.hello.rank), "admitted over a live incumbent"
            self._answer_hello(held.hello.rank, held.fd)
        for held, _reply in settled.refuse:
            assert watch.connections(held.hello.rank), "refused, yet the incumbent closed"
            assert self.now >= held.deadline

    def _answer_hello(self, rank: int, fd: int) -> None:
        identity = rank_identity(rank)
        if self.wire == "vllm":
            verdict = self.hs.on_hello(identity, {"status": "HELLO"})
            self.sockets.watch.release(rank)  # its life is its ready response's
        else:
            verdict = self.hs.on_hello(identity, Hello(rank=rank, size=N, lockstep=False))
        if verdict.rejoin:
            self._judge_model(rank, self.model[rank].incarnation)
            self.core.on_rank_dead(rank, "said HELLO again (rejoin)", rejoin=True)
            self._apply()
        if self.wire == "native":
            self.sockets.claim(fd, rank)
        if verdict.rank == rank and self.hs.epoch(rank) is not None:
            self.model[rank] = ModelRank(self.hs.epoch(rank), False, self.model[rank].dead)
            self.proc_of[rank] = fd

    @rule(rank=st.integers(0, N - 1))
    def completes(self, rank: int) -> None:
        """The process of the latest HELLO sends the rest of its handshake."""
        fd = self.proc_of.get(rank)
        if fd is None or fd not in self.open:
            return
        identity = rank_identity(rank)
        if self.wire == "vllm":
            awaiting = self.hs.awaits_response(identity)
            up = self.hs.on_ready_response(identity, {"max_num_seqs": 4}) is not None
            if awaiting is not None:
                self.sockets.claim(fd, awaiting)
            up = self.hs.on_ready(identity, {"status": "READY"}) is not None or up
        else:
            self.hs.on_ready(identity, {"rank": rank})
            up = self.hs.on_register(identity, self.hs.epoch(rank)) is True
        if up:
            assert self.hs.epoch(rank) not in self.model[rank].dead, "a dead one came up"
            self.model[rank].up = True
            self.core.on_rank_up(self.hs.rank_up(rank), self.now)
            self._apply()

    @rule(proc=consumes(processes))
    def close(self, proc: tuple[int, int]) -> None:
        """A process exits, is killed, or misses its heartbeats: its connection closes."""
        _, fd = proc
        if self.open.pop(fd, None) is None:
            return
        self.sockets.closed(fd)

    # -- the core's judgements ----------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, GRACE, 1.0]))
    def deadline(self, dt: float) -> None:
        """Time passes; the core judges what is due."""
        self.now += dt
        for rank, incarnation in self.reported:  # all due: reported with no grace
            self._judge_model(rank, incarnation)
        self.reported = []
        self.core.on_deadline(self.now)
        self._apply()

    @precondition(lambda self: any(self.core.is_up(r) for r in range(N)))
    @rule(rank=st.integers(0, N - 1))
    def send_fails(self, rank: int) -> None:
        """Another death of the current incarnation (a failed send, silence)."""
        if not self.core.is_up(rank):
            return
        self._judge_model(rank, self.core.health[rank].epoch)
        self.core.on_rank_dead(rank, "a send failed")
        self._apply()

    def _judge_model(self, rank: int, incarnation: int | None) -> None:
        m = self.model[rank]
        if incarnation is None:
            return
        m.dead.add(incarnation)
        if incarnation == m.incarnation:
            m.up = False

    def _apply(self) -> None:
        fx = self.core.take_effects()
        for _level, _key, message in fx.logs:
            if ": dead: " in message:
                rank = int(message.split()[1].rstrip(":"))
                key = (rank, self.core.health[rank].epoch)
                self.dead_logs[key] = self.dead_logs.get(key, 0) + 1
        for rank, resync, epoch in fx.forgets:
            self._judge_model(rank, epoch)  # the incarnation it names is dead
            self.sockets.forget(rank, resync, epoch)

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def up_iff_its_latest_incarnation_completed_and_lives(self) -> None:
        for rank, m in enumerate(self.model):
            assert self.core.is_up(rank) == m.up, (rank, m)
            if m.up:
                assert self.core.health[rank].epoch == m.incarnation == self.hs.epoch(rank)

    @invariant()
    def a_handshake_under_way_is_never_wiped(self) -> None:
        for rank, m in enumerate(self.model):
            if m.incarnation is None or m.incarnation in m.dead:
                continue
            assert self.hs.epoch(rank) == m.incarnation, (
                f"rank {rank}: the handshake of incarnation {m.incarnation} was wiped "
                f"(a forget of an older incarnation: {sorted(map(str, m.dead))})"
            )
            if self.wire == "native":
                assert self.hs.phase(rank) is not RankPhase.MISSING, "wiped"
            else:
                assert self.hs.awaits_response(rank_identity(rank)) == rank or self.hs.is_up(
                    rank
                ), "wiped"

    @invariant()
    def every_death_is_judged_once(self) -> None:
        assert all(n == 1 for n in self.dead_logs.values()), self.dead_logs

    def teardown(self) -> None:
        self.now += 10.0
        self.core.on_deadline(self.now)
        self._apply()
        assert self.core.next_loss() == float("inf"), "a report was never judged"
        assert all(n == 1 for n in self.dead_logs.values()), self.dead_logs


def machine(wire: str, handshake_cls: type[Any] | None = None) -> type[DeathMachine]:
    """`DeathMachine` on `wire`, with `handshake_cls` (default: the wire's own)."""
    cls = handshake_cls or (VllmHandshake if wire == "vllm" else HandshakeState)
    return type(
        f"DeathMachine_{wire}_{cls.__name__}",
        (DeathMachine,),
        {"wire": wire, "handshake_cls": cls},
    )
