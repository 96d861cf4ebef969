"""The client side of the grouped handshake (PROTOCOL.md §2), as a plain state machine.

Theory of operation
-------------------
Engines connect in any order. Each rank goes through:

    (nothing) --HELLO ok--> INIT sent --READY--> --REGISTER--> up
                                      --REGISTER--> --READY-->

READY arrives on the handshake socket and REGISTER on the input socket, over different
connections, so they may come in either order; a rank is *up* once both have arrived
after its latest admitted HELLO. The group is ready when all N ranks are up.

A HELLO is answered with INIT or with REJECT and a reason: a version we do not speak,
an identity that is not 2 bytes, a `rank` that differs from the identity or is out of
range, a `size` other than N, or a `lockstep` flag other than the ranks already
admitted. Rejections are kept (with the identity) so a timeout can name them.

A HELLO from a rank that is already admitted is a **rejoin**, during the handshake or
after it: that rank's previous incarnation is dead, and its handshake starts over. The
caller is told (`HelloVerdict.rejoin`) so it can fail what the old incarnation held.
Two live processes claiming one rank show up as repeated rejoins; `rejoins[rank]`
counts them so the caller can report it loudly.

Limitation of the protocol, noted rather than papered over: REGISTER carries no token
of the incarnation that sent it, so a REGISTER from an incarnation that died just after
sending it can be counted for the next one. The next send then fails or times out and
the rank is declared dead again, which is safe but slow.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .errors import ProtocolError
from .messages import PROTOCOL_VERSION, Hello, Init, Reject

__all__ = ["HandshakeState", "HelloVerdict", "RankPhase", "rank_identity", "identity_rank"]


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


@dataclass(frozen=True, slots=True)
class HelloVerdict:
    """What to answer a HELLO with, and what it means."""

    reply: Init | Reject
    rank: int | None
    rejoin: bool = False
    """The rank was already admitted: its previous incarnation is dead."""


class HandshakeState:
    """Admits N ranks. Feed it what arrives; it says what to answer and who is up."""

    def __init__(self, size: int, input_address: str, output_address: str) -> None:
        if size < 1:
            raise ValueError(f"a group needs at least one rank, got {size}")
        self.size = size
        self.input_address = input_address
        self.output_address = output_address
        self.lockstep: bool | None = None
        self._ranks = [_Rank() for _ in range(size)]
        self.rejected: list[str] = []
        self.rejoins = [0] * size
        self.ignored = 0

    # -- events -----------------------------------------------------------------------

    def on_hello(self, identity: bytes, hello: Hello | ProtocolError) -> HelloVerdict:
        """A HELLO (or an undecodable handshake message) from `identity`."""
        who = f"identity {identity.hex() or '(empty)'}"
        rank = identity_rank(identity)
        if isinstance(hello, ProtocolError):
            return self._reject(rank, f"{who}: invalid HELLO: {hello.cause}")
        if hello.version != PROTOCOL_VERSION:
            return self._reject(
                rank,
                f"{who} (rank {hello.rank}): protocol version {hello.version} is not "
                f"supported; this client speaks version {PROTOCOL_VERSION}",
            )
        if rank is None:
            return self._reject(
                None, f"{who}: the identity must be the rank as 2 little-endian bytes"
            )
        if hello.rank != rank:
            return self._reject(
                rank, f"{who}: HELLO says rank {hello.rank} but the identity is rank {rank}"
            )
        if not 0 <= rank < self.size:
            return self._reject(rank, f"rank {rank} is out of range for a group of {self.size}")
        if hello.size != self.size:
            return self._reject(
                rank, f"rank {rank}: HELLO says size {hello.size}, the client expects {self.size}"
            )
        if self.lockstep is not None and hello.lockstep != self.lockstep:
            mode = "lockstep" if self.lockstep else "independent"
            return self._reject(
                rank,
                f"rank {rank}: HELLO says lockstep={hello.lockstep}, but the admitted ranks "
                f"are {mode}",
            )
        if self.lockstep is None:
            self.lockstep = hello.lockstep
        state = self._ranks[rank]
        rejoin = state.phase is not RankPhase.MISSING
        if rejoin:
            self.rejoins[rank] += 1
        self._ranks[rank] = _Rank(RankPhase.INIT_SENT, wave=hello.wave)
        init = Init(input=self.input_address, output=self.output_address, size=self.size)
        return HelloVerdict(init, rank, rejoin)

    def on_ready(self, identity: bytes, info: dict[str, Any]) -> bool:
        """A READY. Returns True if it made its rank up."""
        state = self._state(identity)
        if state is None or state.phase not in (RankPhase.INIT_SENT, RankPhase.REGISTERED):
            self.ignored += 1
            return False
        state.info = dict(info)
        state.phase = RankPhase.UP if state.phase is RankPhase.REGISTERED else RankPhase.READY
        return state.phase is RankPhase.UP

    def on_register(self, identity: bytes) -> bool:
        """A REGISTER on the input socket. Returns True if it made its rank up."""
        state = self._state(identity)
        if state is None or state.phase not in (RankPhase.INIT_SENT, RankPhase.READY):
            self.ignored += 1
            return False
        state.phase = RankPhase.UP if state.phase is RankPhase.READY else RankPhase.REGISTERED
        return state.phase is RankPhase.UP

    def forget(self, rank: int) -> None:
        """The rank died after the handshake: it must say HELLO again."""
        self._ranks[rank] = _Rank()

    # -- queries ----------------------------------------------------------------------

    def phase(self, rank: int) -> RankPhase:
        return self._ranks[rank].phase

    def info(self, rank: int) -> dict[str, Any]:
        return self._ranks[rank].info

    def ready(self) -> bool:
        return all(r.phase is RankPhase.UP for r in self._ranks)

    def missing(self) -> dict[int, str]:
        """Every rank that is not up, with what it is waiting for."""
        return {i: r.phase.value for i, r in enumerate(self._ranks) if r.phase is not RankPhase.UP}

    def hello_wave(self) -> int:
        """The highest `wave` any admitted rank said in its HELLO (0 if none did)."""
        return max((r.wave for r in self._ranks if r.wave is not None), default=0)

    # -- helpers ----------------------------------------------------------------------

    def _state(self, identity: bytes) -> _Rank | None:
        rank = identity_rank(identity)
        if rank is None or not 0 <= rank < self.size:
            return None
        return self._ranks[rank]

    def _reject(self, rank: int | None, reason: str) -> HelloVerdict:
        self.rejected.append(reason)
        return HelloVerdict(Reject(reason), rank)
