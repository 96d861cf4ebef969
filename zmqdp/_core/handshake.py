"""The client side of the grouped handshake (docs/protocol.md §2), as a plain state machine.

Theory of operation
-------------------
Engines connect in any order. Each rank goes through:

    (nothing) --HELLO ok--> INIT sent --READY--> --REGISTER--> up
                                      --REGISTER--> --READY-->

READY arrives on the handshake socket and REGISTER on the input socket, over different
connections, so they may come in either order; a rank is *up* once both have arrived
after its latest admitted HELLO. The group is ready when all N ranks are up.

Incarnations are named (§2.3). Every admitted HELLO gets a fresh `epoch`, carried in the
INIT; epochs only grow (from `first_epoch`, which the caller picks at random so that a
restarted client does not hand out the numbers of its predecessor). The REGISTER must
echo it: a REGISTER of another epoch comes from a dead incarnation and is stale,
counted and ignored, so it can never bring up the next one. (A REGISTER without an
epoch is a revision-1 engine's, taken as current.) The output batches are checked the
same way by `GroupCore`.

A HELLO is answered with INIT or with REJECT and a reason: a version we do not speak,
an identity that is not 2 bytes, a `rank` that differs from the identity or is out of
range, a `size` other than N, a `lockstep` flag other than the ranks already admitted,
or a body that is not a valid HELLO. An invalid READY is answered with REJECT too,
naming READY (§7), and ends that rank's handshake. Rejections are kept (with the
identity) so a timeout can name them.

A HELLO from a rank that is already admitted is a **rejoin**, during the handshake or
after it, whether the HELLO is admitted or rejected (§7): that rank's previous
incarnation is dead. The caller is told (`HelloVerdict.rejoin`) so it can fail what the
old incarnation held. Two live processes claiming one rank show up as repeated rejoins
(each HELLO takes the rank's connection from the other, ROUTER_HANDOVER, and the other
is orphaned): a second rejoin within `conflict_window` seconds (three HELLOs of one rank
in that window) is reported once per episode (`HelloVerdict.conflict`, counted in
`identity_conflicts`); the episode ends after `conflict_window` seconds without a rejoin.
One restart is one rejoin and is not reported. An engine that crash-loops looks the same
as two processes, and deserves the same loud report.

RESYNC (§2.5). The client asks every rank it is waiting for (one that has not said
HELLO: at start-up, and after the caller `forget`s a dead rank) to start over, about
once every `resync_interval` seconds, until it says HELLO: `resync_due(now)` says whom
to send it to. This is how a restarted client picks up engines that kept running, and
how an engine whose connection libzmq dropped comes back (the engine recreates its
sockets on RESYNC).

Deaths are decided by `GroupCore`, never here: each `forget` names the incarnation it
ends (its epoch), and one that names an older incarnation than the rank's latest
admitted HELLO changes nothing (`superseded`): a replacement already under way keeps
its handshake. A rank that comes up is described by one record (`RankUp`, from
`rank_up`), which is all the group reads of its handshake.

Two connections, one rank (§7). Every ROUTER hands a rank's identity to its newest
connection, so a valid HELLO on another connection than the rank's open current one
is a second process, or a restart whose predecessor's close is not seen yet: it is
held (`contest`) while the heartbeats judge the incumbent, then admitted if the
incumbent closed, or refused if it stayed open (`settle`: a second process, counted in
`identity_conflicts`). And a RESYNC that finds no route, or the third in a row that gets
no HELLO (`resync_sent`), means ROUTER_HANDOVER cut the rank's engine off: `displaced`
names the connections to end, so that it reconnects and hears the next one. The caller
owns the sockets and the connection watch, and only carries these verdicts out.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .codec import encode_handshake
from .errors import ProtocolError, quote
from .messages import PROTOCOL_VERSION, Hello, Init, Reject

__all__ = [
    "MAX_REJECTIONS_KEPT",
    "UNANSWERED_RESYNCS",
    "HandshakeState",
    "HeldHello",
    "Settled",
    "HelloVerdict",
    "RankPhase",
    "RankUp",
    "identity_rank",
    "rank_identity",
]

MAX_REJECTIONS_KEPT = 64
"""How many recent rejection reasons a `HandshakeTimeout` can name."""

UNANSWERED_RESYNCS = 3
"""RESYNCs that reach a rank's identity without a HELLO in answer before the client ends
the displaced connections of earlier engines of the rank (`HandshakeState.resync_sent`)."""


def rank_identity(rank: int) -> bytes:
    """The ZeroMQ routing id of `rank`: 2 bytes, little-endian (§1)."""
    return rank.to_bytes(2, "little")


def identity_rank(identity: bytes) -> int | None:
    """The rank an identity names, or None if it is not 2 bytes long."""
    return int.from_bytes(identity, "little") if len(identity) == 2 else None


class RankPhase(enum.Enum):
    MISSING = "no HELLO yet"
    INIT_SENT = "INIT sent, waiting for READY and REGISTER"
    READY = "READY received, waiting for REGISTER on the input socket"
    REGISTERED = "REGISTER received, waiting for READY"
    UP = "up"


@dataclass
class _Rank:
    phase: RankPhase = RankPhase.MISSING
    info: dict[str, Any] = field(default_factory=dict)
    wave: int | None = None
    epoch: int | None = None
    max_message_size: int | None = None
    resync: bool = True
    """Whether to RESYNC this rank while it is MISSING."""
    last_resync: float = -math.inf


@dataclass(frozen=True, slots=True)
class HelloVerdict:
    """What a HELLO gets and what it means, on either wire (`HandshakeState.on_hello`,
    `zmqdp.vllm.handshake.VllmHandshake.on_hello`)."""

    rank: int | None
    """The rank its identity names (None: no rank of the group)."""
    reply: bytes | None
    """The encoded answer (natively INIT or REJECT, vLLM: the init), or None: nothing
    is sent (vLLM's engines are not told of a refusal)."""
    admitted: bool = False
    """A new incarnation of `rank` begins: its connection is claimed for it."""
    rejoin: bool = False
    """The rank had been admitted: its previous incarnation is dead."""
    conflict: float | None = None
    """A new identity-conflict episode (report it): the seconds its three HELLOs took."""
    refused: str | None = None
    """Why it was refused (None: admitted)."""


@dataclass(frozen=True, slots=True)
class RankUp:
    """A rank's incarnation completed its handshake: what the group needs of it, built
    by the handshake state machine of its wire (`rank_up`), so that nobody reads the
    handshake state afterwards."""

    rank: int
    epoch: int | None
    """The incarnation (§2.3: its epoch; vLLM: its incarnation count)."""
    hello_wave: int | None = None
    """The wave its HELLO said (lockstep, §5)."""
    max_message_size: int | None = None
    """What the rank said it accepts (None: the default)."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """Its handshake metadata (READY info, vLLM's ready response)."""
    version: str | None = None
    """The protocol version spoken with the incarnation."""


@dataclass(frozen=True, slots=True)
class HeldHello:
    """A HELLO held while the heartbeats judge its rank's current connection."""

    identity: bytes
    hello: Hello
    fd: int
    """The connection it came on."""
    deadline: float
    """When the incumbent, still open, has proved alive: the HELLO is then refused."""


@dataclass(frozen=True, slots=True)
class Settled:
    """What `HandshakeState.settle` decided about the held HELLOs."""

    admit: list[HeldHello]
    """The incumbent's connection closed: a restart. Answer each as a new HELLO."""
    refuse: list[tuple[HeldHello, bytes]]
    """The incumbent lives: a second process. Send it this REJECT."""
    next_at: float
    """When to settle again (inf: nothing held)."""


class Handshake(Protocol):
    """What the client reads of a handshake, on any wire (`HandshakeState` natively,
    `zmqdp.vllm.handshake.VllmHandshake` on vLLM's)."""

    def info(self, rank: int) -> dict[str, Any]:
        """The rank's free-form handshake metadata (READY info, vLLM's ready response)."""
        ...

    def epoch(self, rank: int) -> int | None:
        """The current incarnation's epoch (§2.3); None where the wire has none."""
        ...

    def wave(self, rank: int) -> int | None:
        """The wave its HELLO said (lockstep, §5); None if none."""
        ...

    def engine_max_message_size(self, rank: int) -> int | None:
        """What the rank said it accepts (None: the default)."""
        ...

    def hello_wave(self) -> int:
        """The highest HELLO wave of the admitted ranks (the clock starts there)."""
        ...

    def version(self, rank: int) -> str | None:
        """The protocol version spoken with the rank's incarnation."""
        ...

    def ready(self) -> bool:
        """Every rank is up."""
        ...

    def rank_up(self, rank: int) -> RankUp:
        """What the rank's incarnation said in its handshake (once it is up)."""
        ...

    def missing(self) -> dict[int, str]:
        """Why each rank that is not up is not (for `HandshakeTimeout`)."""
        ...


class HandshakeState:
    """Admits N ranks. Feed it what arrives; it says what to answer and who is up."""

    def __init__(
        self,
        size: int,
        input_address: str,
        output_address: str,
        *,
        first_epoch: int = 1,
        max_message_size: int | None = None,
        resync_interval: float = 1.0,
        conflict_window: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"a group needs at least one rank, got {size}")
        self.size = size
        self.input_address = input_address
        self.output_address = output_address
        self.max_message_size = max_message_size
        self.resync_interval = resync_interval
        self.lockstep: bool | None = None
        self._ranks = [_Rank() for _ in range(size)]
        self._next_epoch = first_epoch
        self.rejected: deque[str] = deque(maxlen=MAX_REJECTIONS_KEPT)
        self.rejected_ranks: dict[int, str] = {}
        """rank -> why its latest HELLO was refused (while it is not up): so a timeout
        says that, not "no HELLO yet"."""
        """The most recent rejection reasons (bounded: a peer can send any number)."""
        self.rejections = 0
        self.rejoins = [0] * size
        self.conflict_window = conflict_window
        self.identity_conflicts = 0
        self._hellos: list[deque[float]] = [deque(maxlen=2) for _ in range(size)]
        self._conflict_until = [-math.inf] * size
        self.ignored = 0
        self.stale_registers = 0
        self._held: dict[int, HeldHello] = {}
        """Rank -> a HELLO held while its current engine's connection is open."""
        self._unanswered = [0] * size
        """Per rank: routable RESYNCs since its last admitted HELLO."""

    # -- events -----------------------------------------------------------------------

    def hello_problem(self, identity: bytes, hello: Hello | ProtocolError) -> str | None:
        """Why `on_hello` would REJECT this HELLO (the reason), or None if it is valid.
        Changes nothing."""
        who = f"identity {identity.hex() or '(empty)'}"
        rank = identity_rank(identity)
        if isinstance(hello, ProtocolError):
            what = "HELLO" if hello.message in (None, "hello") else quote(hello.message)
            return f"{who}: invalid {what}: {hello.cause}"
        if hello.version != PROTOCOL_VERSION:
            return (
                f"{who} (rank {hello.rank}): protocol version {hello.version} is not "
                f"supported; this client speaks version {PROTOCOL_VERSION}"
            )
        if rank is None:
            return f"{who}: the identity must be the rank as 2 little-endian bytes"
        if hello.rank != rank:
            return f"{who}: HELLO says rank {hello.rank} but the identity is rank {rank}"
        if not 0 <= rank < self.size:
            return f"rank {rank} is out of range for a group of {self.size}"
        if hello.size != self.size:
            return f"rank {rank}: HELLO says size {hello.size}, the client expects {self.size}"
        if self.lockstep is not None and hello.lockstep != self.lockstep:
            mode = "lockstep" if self.lockstep else "independent"
            return (
                f"rank {rank}: HELLO says lockstep={hello.lockstep}, but the admitted ranks "
                f"are {mode}"
            )
        return None

    def on_hello(
        self, identity: bytes, hello: Hello | ProtocolError, now: float = 0.0
    ) -> HelloVerdict:
        """A HELLO (or a handshake message that failed to decode) from `identity`."""
        rank = identity_rank(identity)
        problem = self.hello_problem(identity, hello)
        if problem is not None:
            return self._reject_at(now, rank, problem)
        assert isinstance(hello, Hello) and rank is not None
        if self.lockstep is None:
            self.lockstep = hello.lockstep
        rejoin = self._ranks[rank].phase is not RankPhase.MISSING
        conflict = self._rejoined(rank, now) if rejoin else None
        self._hellos[rank].append(now)
        self.rejected_ranks.pop(rank, None)
        self._unanswered[rank] = 0
        epoch = self._next_epoch
        self._next_epoch += 1
        self._ranks[rank] = _Rank(
            RankPhase.INIT_SENT,
            wave=hello.wave,
            epoch=epoch,
            max_message_size=hello.max_message_size,
        )
        init = Init(
            input=self.input_address,
            output=self.output_address,
            size=self.size,
            epoch=epoch,
            max_message_size=self.max_message_size,
        )
        return HelloVerdict(rank, encode_handshake(init), True, rejoin, conflict)

    def _rejoined(self, rank: int, now: float) -> float | None:
        """Count a rejoin; if it is the second within `conflict_window` and no episode is
        under way, a new identity-conflict episode begins: return how long it took."""
        self.rejoins[rank] += 1
        hellos = self._hellos[rank]
        if len(hellos) < 2 or now - hellos[0] >= self.conflict_window:
            return None
        span = now - hellos[0]
        new = now >= self._conflict_until[rank]
        self._conflict_until[rank] = now + self.conflict_window
        if not new:
            return None
        self.identity_conflicts += 1
        return span

    # -- the contest: one rank, two connections ------------------------------------------

    def contest(
        self,
        identity: bytes,
        hello: Hello | ProtocolError,
        fd: int,
        now: float,
        incumbent: frozenset[int],
        judge_after: float | None,
    ) -> bool:
        """Whether to hold this HELLO (`settle` decides it later) rather than answer it:
        a valid HELLO, on connection `fd`, of a rank whose current handshake connections
        (`incumbent`, read from the monitor just before) are open and other: a second
        process for the rank, or a restart while the old process is stopped or its
        close is not seen yet. The heartbeats judge the incumbent within `judge_after`
        s (None: nothing judges it, so the newest wins and nothing is held)."""
        rank = identity_rank(identity)
        if (
            not isinstance(hello, Hello)
            or fd < 0
            or judge_after is None
            or rank is None
            or not incumbent
            or fd in incumbent
            or self.hello_problem(identity, hello) is not None  # REJECT, a rejoin
        ):
            return False
        self._held[rank] = HeldHello(identity, hello, fd, now + judge_after)
        return True

    def holds(self, rank: int) -> bool:
        """A HELLO of `rank` is held (no RESYNC: it would reach the newcomer, which
        holds the identity's route, and make it start over right after its INIT)."""
        return rank in self._held

    def holding(self) -> bool:
        """Some HELLO is held (`settle` has something to decide)."""
        return bool(self._held)

    def settle(
        self,
        now: float,
        is_open: Callable[[int], bool],
        incumbent: Callable[[int], frozenset[int]],
    ) -> Settled:
        """Decide the held HELLOs that can be decided (`is_open(fd)`: a connection is
        open; `incumbent(rank)`: the rank's current connections). The newcomer left:
        dropped. The incumbent closed: a restart, admitted. The incumbent stayed open
        past the deadline: a second process, refused (an identity conflict)."""
        admit: list[HeldHello] = []
        refuse: list[tuple[HeldHello, bytes]] = []
        next_at = math.inf
        for rank, held in list(self._held.items()):
            if not is_open(held.fd):
                del self._held[rank]
            elif not incumbent(rank):
                del self._held[rank]
                admit.append(held)
            elif now >= held.deadline:
                del self._held[rank]
                self.identity_conflicts += 1
                reason = (
                    f"rank {rank} is served by another engine process, which is alive "
                    "(its connection stays open and answers heartbeats); exactly one "
                    "engine may run as a rank"
                )
                refuse.append((held, encode_handshake(self.on_refused(reason))))
            else:
                next_at = min(next_at, held.deadline)
        return Settled(admit, refuse, next_at)

    # -- restoring a route -------------------------------------------------------------

    def resync_sent(self, rank: int) -> bool:
        """A RESYNC reached `rank`'s identity. True if it is the `UNANSWERED_RESYNCS`-th
        in a row without a HELLO: whoever holds the identity is no live engine of ours
        (an idle intruder, a zombie), so the rank's displaced connections are ended
        (`displaced`); the count starts again."""
        self._unanswered[rank] += 1
        if self._unanswered[rank] < UNANSWERED_RESYNCS:
            return False
        self._unanswered[rank] = 0
        return True

    @staticmethod
    def displaced(
        history: Iterable[int],
        is_open: Callable[[int], bool],
        owner: Callable[[int], int | None],
        *,
        unroutable: bool,
    ) -> list[int]:
        """Which of a rank's connections to end so that its engine reconnects and hears
        the next RESYNC (`ROUTER_HANDOVER` cut it off: libzmq will neither close nor
        route to it). `history`: the connections the rank ever claimed. `unroutable`
        (a RESYNC found no route): no connection holds the identity, so every open one
        is displaced (even one still claimed: an intruder's invalid HELLO is a rejoin
        that leaves the real engine's claimed); otherwise only those nobody claims (the
        rank's own engine may just be slow to answer)."""
        return [fd for fd in sorted(history) if is_open(fd) and (unroutable or owner(fd) is None)]

    def on_invalid(self, identity: bytes, error: ProtocolError) -> Reject:
        """A handshake message that claims no type at all: refused, no rank touched."""
        reason = f"identity {identity.hex() or '(empty)'}: invalid message: {error.cause}"
        self._rejected(reason)
        return Reject(reason)

    def on_refused(self, reason: str) -> Reject:
        """A HELLO refused outside `on_hello` (a second process for a rank whose engine
        lives: the contest, `_transport._settle`): counted as a rejection."""
        self.rejections += 1
        return Reject(reason)

    def _rejected(self, reason: str) -> None:
        self.rejected.append(reason)
        self.rejections += 1

    def on_ready(self, identity: bytes, ready: dict[str, Any] | ProtocolError) -> bool | Reject:
        """A READY's info (or the error that made it invalid). Returns True if it made
        its rank up, False if it was ignored, or the REJECT to answer it with."""
        state = self._state(identity)
        if isinstance(ready, ProtocolError):
            rank = identity_rank(identity)
            if state is not None and state.phase in (RankPhase.INIT_SENT, RankPhase.REGISTERED):
                assert rank is not None
                self._ranks[rank] = _Rank()  # that handshake is over; RESYNC will follow
            reason = f"identity {identity.hex() or '(empty)'}: invalid READY: {ready.cause}"
            self._rejected(reason)
            return Reject(reason)
        if state is None or state.phase not in (RankPhase.INIT_SENT, RankPhase.REGISTERED):
            self.ignored += 1
            return False
        state.info = dict(ready)
        state.phase = RankPhase.UP if state.phase is RankPhase.REGISTERED else RankPhase.READY
        return state.phase is RankPhase.UP

    def on_register(self, identity: bytes, epoch: int | None = None) -> bool:
        """A REGISTER on the input socket. Returns True if it made its rank up."""
        state = self._state(identity)
        if state is None or state.phase not in (RankPhase.INIT_SENT, RankPhase.READY):
            self.ignored += 1
            return False
        if epoch is not None and epoch != state.epoch:
            self.stale_registers += 1
            return False
        state.phase = RankPhase.UP if state.phase is RankPhase.READY else RankPhase.REGISTERED
        return state.phase is RankPhase.UP

    def on_ignored(self) -> None:
        """A message that is no step of any handshake (malformed, unknown, too late)."""
        self.ignored += 1

    def forget(self, rank: int, *, resync: bool = True, epoch: int | None = None) -> bool:
        """The incarnation `epoch` of the rank died (None: whichever is current): it must
        say HELLO again. With `resync`, `resync_due` asks it to, at once and then every
        `resync_interval` s. False, and nothing changes, if a newer HELLO was admitted
        since (`superseded`): that handshake stands."""
        if self.superseded(rank, epoch):
            return False
        self._ranks[rank] = _Rank(resync=resync)
        return True

    def superseded(self, rank: int, epoch: int | None) -> bool:
        """A forget of incarnation `epoch` comes after another HELLO of `rank` was
        admitted (forgetting would drop that handshake's INIT, or RESYNC an engine that
        is starting the new incarnation), or after that one was forgotten already."""
        return epoch is not None and self._ranks[rank].epoch != epoch

    def resync_due(self, now: float) -> list[int]:
        """The ranks to send RESYNC to now; each is then not due for `resync_interval`."""
        due = []
        for rank, state in enumerate(self._ranks):
            if (
                state.phase is RankPhase.MISSING
                and state.resync
                and now - state.last_resync >= self.resync_interval
            ):
                state.last_resync = now
                due.append(rank)
        return due

    def next_resync(self) -> float:
        """When `resync_due` next has something to say (inf: never)."""
        return min(
            (
                s.last_resync + self.resync_interval
                for s in self._ranks
                if s.phase is RankPhase.MISSING and s.resync
            ),
            default=math.inf,
        )

    # -- queries ----------------------------------------------------------------------

    def phase(self, rank: int) -> RankPhase:
        return self._ranks[rank].phase

    def info(self, rank: int) -> dict[str, Any]:
        return self._ranks[rank].info

    def epoch(self, rank: int) -> int | None:
        """The epoch of the rank's latest admitted HELLO."""
        return self._ranks[rank].epoch

    def engine_max_message_size(self, rank: int) -> int | None:
        """What the rank's HELLO said it accepts (None: the default)."""
        return self._ranks[rank].max_message_size

    def wave(self, rank: int) -> int | None:
        return self._ranks[rank].wave

    def version(self, rank: int) -> str | None:
        """docs/protocol.md's revision the rank's HELLO spoke: "2" with an epoch, "1"
        without; None before its HELLO."""
        r = self._ranks[rank]
        if r.phase is RankPhase.MISSING:
            return None
        return "1" if r.epoch is None else "2"

    def ready(self) -> bool:
        return all(r.phase is RankPhase.UP for r in self._ranks)

    def rank_up(self, rank: int) -> RankUp:
        r = self._ranks[rank]
        return RankUp(rank, r.epoch, r.wave, r.max_message_size, r.info, self.version(rank))

    def missing(self) -> dict[int, str]:
        """Every rank that is not up, with what it is waiting for (a rank whose HELLO
        was refused and that has not said another: the refusal)."""
        return {
            i: (
                f"its HELLO was rejected: {self.rejected_ranks[i]}"
                if r.phase is RankPhase.MISSING and i in self.rejected_ranks
                else r.phase.value
            )
            for i, r in enumerate(self._ranks)
            if r.phase is not RankPhase.UP
        }

    def hello_wave(self) -> int:
        """The highest `wave` any admitted rank said in its HELLO (0 if none did)."""
        return max((r.wave for r in self._ranks if r.wave is not None), default=0)

    # -- helpers ----------------------------------------------------------------------

    def _state(self, identity: bytes) -> _Rank | None:
        rank = identity_rank(identity)
        if rank is None or not 0 <= rank < self.size:
            return None
        return self._ranks[rank]

    def _reject_at(self, now: float, rank: int | None, reason: str) -> HelloVerdict:
        """Refuse a HELLO. If its identity names a rank that had been admitted, that
        rank's previous incarnation is dead (its identity now belongs to this peer)."""
        self._rejected(reason)
        rejoin = False
        conflict = None
        if rank is not None and 0 <= rank < self.size:
            self.rejected_ranks[rank] = reason
            rejoin = self._ranks[rank].phase is not RankPhase.MISSING
            if rejoin:
                conflict = self._rejoined(rank, now)
                self._hellos[rank].append(now)
                self._ranks[rank] = _Rank()
        reply = encode_handshake(Reject(reason))
        return HelloVerdict(rank, reply, False, rejoin, conflict, refused=reason)
