"""The frontend's side of vLLM's engine start-up handshake, as a plain state machine.

Theory of operation
-------------------
vLLM (`vllm/v1/engine/utils.py` `wait_for_engine_startup`, `core.py`
`startup_handshake`): each engine connects a DEALER (identity = its DP rank, 2 bytes
little-endian) to the frontend's handshake ROUTER and says **HELLO**
``{"status": "HELLO", "local", "headless"}``. The frontend answers with the init
(`EngineHandshakeMetadata`: the addresses to connect to, and for MoE groups a
`parallel_config`). The engine connects its input DEALER and output PUSH, sends its
`EngineCoreReadyResponse` **on the input socket** (that is what lets the frontend's
ROUTER route to it), and finally says **READY** on the handshake socket (with
`parallel_config_hash` when DP > 1).

A rank is *up* once its READY and its ready response have both arrived after its
latest HELLO, in either order. A HELLO from a rank that had said HELLO before is a
**rejoin**: its previous incarnation is dead. A ready response from a rank with no
HELLO (it belongs to an incarnation that is gone) is stale and ignored. Incarnations are
counted (`epoch`): each `forget` names the one it ends, and a forget of an older one
than the current changes nothing (`superseded`), so the core's judgement of a dead
incarnation never wipes its replacement's handshake. A closed connection is only noted
(`note_lost`, for the timeout's message): the core judges it.

A vLLM engine does this handshake once per process. So a rank declared dead while its
process lives (it missed heartbeats, on a stalled host) can only come back as the same
process: `forget` keeps what its handshake said (`_Rank.kept`), and `resume` brings it
back up as a new incarnation once the transport has seen that same process answer again
(`sockets.py`, "dormant ranks"). A new HELLO drops what was kept.

Each rank's wire version (`_wire.wire_version`) comes from its ready response's
`vllm_version`, or from the caller's override; a guess is logged once per incarnation.

MoE groups: every rank's READY must carry the same `parallel_config_hash` as the
first one (vLLM compares it with the frontend's own config, which zmqdp does not
have; the caller may give the expected hash). A mismatching READY is rejected: the
rank stays down and the timeout names it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._core.errors import quote
from .._core.handshake import HelloVerdict, RankUp
from .codec import identity_rank, wire_version

__all__ = ["HelloVerdict", "VllmHandshake"]


class _Step(enum.Enum):
    NEW = "no HELLO on the handshake socket"
    HELLO = "said HELLO (init sent); no READY and no ready response yet"
    UP = "up"


@dataclass(slots=True)
class _Rank:
    step: _Step = _Step.NEW
    ready: dict[str, Any] | None = None
    response: dict[str, Any] | None = None
    hellos: int = 0
    rejected: str | None = None
    version: str | None = None
    lost: str | None = None
    """Why its last incarnation ended, if its connection closed (for `missing`)."""
    incarnations: int = 0
    """HELLOs accepted and resumptions: names the current incarnation (`epoch`)."""
    kept: tuple[dict[str, Any], dict[str, Any]] | None = None
    """The READY and ready response of an incarnation that was up when it was forgotten
    (`resume` may bring the same process back)."""


@dataclass(slots=True)
class VllmHandshake:
    size: int
    init_for: Callable[[int], bytes]
    """The init (EngineHandshakeMetadata bytes) for a rank."""
    lockstep: bool = False
    expected_hash: str | None = None
    version_override: str | None = None
    """`connect(vllm_version=)`: the wire version of every rank, whatever it says."""
    on_warning: Callable[[int, str], None] | None = None
    ranks: list[_Rank] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    rejections: int = 0
    ignored: int = 0
    config_hash: str | None = None

    def __post_init__(self) -> None:
        self.ranks = [_Rank() for _ in range(self.size)]
        self.config_hash = self.expected_hash

    def _rank(self, identity: bytes) -> int | None:
        rank = identity_rank(identity)
        return rank if rank is not None and rank < self.size else None

    def _reject(self, why: str) -> None:
        self.rejections += 1
        self.rejected.append(why)
        del self.rejected[:-16]

    def on_hello(self, identity: bytes, msg: dict[str, Any]) -> HelloVerdict:
        rank = self._rank(identity)
        if rank is None:
            why = f"identity {identity.hex()} is no rank of a group of {self.size}"
            self._reject(why)
            return HelloVerdict(None, None, refused=why)
        r = self.ranks[rank]
        rejoin = r.hellos > 0
        r.hellos += 1
        r.incarnations += 1
        r.step, r.ready, r.response, r.rejected = _Step.HELLO, None, None, None
        r.kept = None  # a new process: the old one cannot come back
        return HelloVerdict(rank, self.init_for(rank), admitted=True, rejoin=rejoin)

    def on_ready(self, identity: bytes, msg: dict[str, Any]) -> int | None:
        """READY on the handshake socket; returns the rank if it is now up."""
        rank = self._rank(identity)
        if rank is None or self.ranks[rank].step is not _Step.HELLO:
            self.ignored += 1
            return None
        r = self.ranks[rank]
        if self.lockstep:
            h = msg.get("parallel_config_hash")
            if self.config_hash is None and type(h) is str:
                self.config_hash = h
            if h != self.config_hash:
                if self.expected_hash is not None:
                    whose = "the parallel_config_hash given to connect()"
                else:
                    agreed = [i for i, o in enumerate(self.ranks) if o.ready is not None]
                    whose = (
                        f"the hash of rank(s) {agreed}, the first seen (pass "
                        "parallel_config_hash= to name the right one)"
                    )
                why = (
                    f"rank {rank}: READY parallel_config_hash {quote(h)} differs from "
                    f"{quote(self.config_hash)}, {whose}: the MoE ranks' parallel configs "
                    "differ"
                )
                self._reject(why)
                r.rejected = why
                r.step = _Step.NEW
                return None
        r.ready = msg
        return self._maybe_up(rank)

    def awaits_response(self, identity: bytes) -> int | None:
        """The rank of `identity` if it said HELLO and its ready response is due."""
        rank = self._rank(identity)
        return rank if rank is not None and self.ranks[rank].step is _Step.HELLO else None

    def on_ready_response(self, identity: bytes, info: dict[str, Any]) -> int | None:
        """The engine's `EngineCoreReadyResponse` on the input socket; returns the rank
        if it is now up."""
        rank = self._rank(identity)
        if rank is None or self.ranks[rank].step is not _Step.HELLO:
            self.ignored += 1
            return None
        r = self.ranks[rank]
        r.response = info
        r.version, warning = wire_version(info, self.version_override)
        if warning is not None and self.on_warning is not None:
            self.on_warning(rank, warning)
        return self._maybe_up(rank)

    def _maybe_up(self, rank: int) -> int | None:
        r = self.ranks[rank]
        if r.ready is not None and r.response is not None:
            r.step = _Step.UP
            return rank
        return None

    def on_ignored(self) -> None:
        """A message that is no step of the handshake (malformed, unknown, too late)."""
        self.ignored += 1

    def superseded(self, rank: int, epoch: int | None) -> bool:
        """A forget of incarnation `epoch` comes after a newer one of `rank` began (a
        HELLO, a resumption): that one stands."""
        current = self.epoch(rank)
        return epoch is not None and current is not None and current != epoch

    def note_lost(self, rank: int, epoch: int | None, why: str) -> None:
        """The connection of incarnation `epoch` closed (for `missing`, if it is not
        up again by then); its death is judged by the core."""
        if not self.superseded(rank, epoch):
            self.ranks[rank].lost = why

    def forget(self, rank: int, why: str | None = None, *, epoch: int | None = None) -> bool:
        """The incarnation `epoch` of the rank is dead (None: whichever is current;
        `why`, if its connection closed): it is up again only after a new HELLO (or a
        `resume`). False, and nothing changes, if a newer incarnation began since."""
        if self.superseded(rank, epoch):
            return False
        r = self.ranks[rank]
        if r.step is _Step.UP and r.ready is not None and r.response is not None:
            r.kept = (r.ready, r.response)
        r.step, r.ready, r.response = _Step.NEW, None, None
        if why is not None:
            r.lost = why
        return True

    def resumable(self, rank: int) -> bool:
        """The rank is down, and its last incarnation was up: its process may answer."""
        r = self.ranks[rank]
        return r.step is _Step.NEW and r.kept is not None

    def resume(self, rank: int) -> bool:
        """The process of the rank's last incarnation answered again: it is up, as a new
        incarnation with what its handshake said. False if nothing was kept."""
        r = self.ranks[rank]
        if not self.resumable(rank):
            return False
        assert r.kept is not None
        r.ready, r.response = r.kept
        r.kept, r.lost = None, None
        r.incarnations += 1
        r.step = _Step.UP
        return True

    def rank_up(self, rank: int) -> RankUp:
        return RankUp(rank, self.epoch(rank), info=self.info(rank), version=self.version(rank))

    def is_up(self, rank: int) -> bool:
        return self.ranks[rank].step is _Step.UP

    def ready(self) -> bool:
        return all(r.step is _Step.UP for r in self.ranks)

    def missing(self) -> dict[int, str]:
        """Why each rank that is not up is not, for `HandshakeTimeout`."""
        out = {}
        for rank, r in enumerate(self.ranks):
            if r.step is _Step.UP:
                continue
            if r.rejected is not None:
                out[rank] = r.rejected
            elif r.step is _Step.NEW and r.lost is not None:
                out[rank] = f"{r.step.value} since {r.lost}"
            elif r.step is _Step.NEW:
                out[rank] = r.step.value
            elif r.ready is None and r.response is None:
                out[rank] = (
                    "said HELLO (init sent); no READY, no ready response on the input socket"
                )
            elif r.ready is None:
                out[rank] = "sent its ready response on the input socket; no READY"
            else:
                out[rank] = "said READY; no ready response on the input socket"
        return out

    # -- what EngineGroup reads ---------------------------------------------------------

    def info(self, rank: int) -> dict[str, Any]:
        """The rank's `EngineCoreReadyResponse` (max_num_seqs, max_model_len, ...)."""
        return dict(self.ranks[rank].response or {})

    def version(self, rank: int) -> str | None:
        """The wire version spoken with the rank's incarnation (None before its ready
        response)."""
        return self.ranks[rank].version

    def epoch(self, rank: int) -> int | None:
        """The rank's incarnation count (None before its first HELLO): vLLM's handshake
        has no epoch, and a forget names the incarnation it ends."""
        return self.ranks[rank].incarnations or None

    def wave(self, rank: int) -> int | None:
        return None

    def engine_max_message_size(self, rank: int) -> int | None:
        return None

    def hello_wave(self) -> int:
        return 0
