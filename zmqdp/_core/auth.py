"""Who may join a CURVE group, sans-IO: the ZAP answers and the per-message binding check.

Theory of operation
-------------------
With CURVE the client is the server and every engine has a key pair; the client holds
an allow-list that maps each engine public key to one rank (`zmqdp.keys`). libzmq asks
a ZAP handler (RFC 27) about every new connection; `ZapPolicy.answer` turns one ZAP
request into its reply:

* a key on the allow-list is accepted (200) with the rank, as a decimal string, for its
  *User-Id*: libzmq then stamps that User-Id on every message of the connection;
* any other key, mechanism or domain is refused (400): libzmq closes the connection
  before any message of it reaches the client, and the engine does not retry.

The ZAP request does not say which routing id the peer claims (its "identity" frame is
the *server's* own routing id), and a peer chooses its routing id freely. So the
binding of key to rank is checked on every message instead (`PeerBinding.admit`): a
message whose routing id is not the rank its User-Id names is dropped and counted. A
peer with rank 1's key that claims rank 0's identity can therefore never join, answer
a handshake, or inject an output as rank 0.

What it can still do, because every ROUTER sets `ROUTER_HANDOVER` (docs/protocol.md §1,
so that a restarted engine takes its identity back): take over rank 0's connection on a
socket. On the input or output socket that cuts rank 0 off, so the first message the
impostor sends there makes the caller declare rank 0 dead (its requests fail at once
instead of hanging) and RESYNC it; the transport restores the route of the displaced
engine when a RESYNC needs it (docs/design.md, "Connections taken over"). On the
handshake socket rank 0 keeps serving and is left alone. Only a holder of an allowed
key can do any of this.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import quote
from .handshake import identity_rank, rank_identity

__all__ = ["ZAP_DOMAIN", "PeerBinding", "Refusal", "ZapPolicy"]

ZAP_DOMAIN = b"zmqdp"
"""The ZAP domain of the client's sockets (libzmq refuses every connection if no
handler answers for it, `ZMQ_ZAP_ENFORCE_DOMAIN`)."""

MAX_KEPT = 64
"""Recent refusals kept for `statistics()` and errors; a peer can cause any number."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refused connection or message, for logs and errors."""

    what: str


@dataclass
class ZapPolicy:
    """Answers ZAP requests from an allow-list (`rank_of(raw 32-byte key)`)."""

    rank_of: Callable[[bytes], int | None]
    refused: int = 0
    """Connections refused (key not allowed, or not CURVE, or a malformed request)."""
    accepted: int = 0
    recent: deque[Refusal] = field(default_factory=lambda: deque(maxlen=MAX_KEPT))

    def answer(self, frames: list[bytes]) -> tuple[list[bytes] | None, str | None]:
        """The reply to one ZAP request as a ROUTER receives it (`[peer, b"", version,
        request id, domain, address, identity, mechanism, *credentials]`), and what to
        log if it was refused (None otherwise; the caller limits how much it logs). No
        reply (None) for a request too short to answer."""
        if len(frames) < 4:
            self.refused += 1
            return None, "ZAP: dropped a malformed request"
        peer, empty, version, request_id = frames[:4]
        head = [peer, empty, b"1.0", request_id]
        if version != b"1.0" or len(frames) < 8:
            return self._refuse(head, b"500", "malformed ZAP request")
        domain, address, _identity, mechanism, *credentials = frames[4:]
        where = quote(address.decode("utf-8", "replace"))
        if mechanism != b"CURVE" or domain != ZAP_DOMAIN or len(credentials) != 1:
            return self._refuse(
                head, b"400", f"{quote(mechanism)} in domain {quote(domain)} from {where}"
            )
        key = credentials[0]
        rank = self.rank_of(key)
        if rank is None:
            return self._refuse(
                head, b"400", f"a key not on the allow-list from {where} (raw key {key.hex()})"
            )
        self.accepted += 1
        return [*head, b"200", b"OK", str(rank).encode(), b""], None

    def _refuse(self, head: list[bytes], status: bytes, what: str) -> tuple[list[bytes], str]:
        self.refused += 1
        self.recent.append(Refusal(what))
        reply = [*head, status, b"refused" if status == b"400" else b"error", b"", b""]
        return reply, f"CURVE: refused {what}"


class PeerBinding:
    """The per-message check: a message is kept only if its routing id is the rank
    that its User-Id (the rank of the peer's key) names."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._identity_of = {str(r): rank_identity(r) for r in range(size)}
        self.impersonations = 0
        """Messages dropped because the routing id was not the key's rank."""
        self.recent: deque[Refusal] = deque(maxlen=MAX_KEPT)
        self.claims: dict[int, tuple[str, int]] = {}
        """Per rank of the group that impostors claimed: (whose key the last one had,
        how many messages were dropped). A rank that never joins is explained by it."""

    def admit(
        self, socket: str, identity: bytes, user_id: str | None
    ) -> tuple[bool, int | None, str | None]:
        """(keep the message?, the rank whose connection on `socket` an impostor has
        taken (the caller declares it dead), what to log)."""
        if user_id is not None and self._identity_of.get(user_id) == identity:
            return True, None, None
        self.impersonations += 1
        claimed = identity_rank(identity)
        key = f"rank {user_id}'s key" if user_id is not None else "no authenticated key"
        shown = f"rank {claimed}" if claimed is not None else f"identity {identity.hex()}"
        if claimed is not None and claimed < self.size:
            self.claims[claimed] = (key, self.claims.get(claimed, ("", 0))[1] + 1)
        what = f"a peer with {key} claimed {shown} on the {socket} socket"
        self.recent.append(Refusal(what))
        log_line = f"CURVE: dropped a message: {what}"
        displaced = None
        if socket != "handshake" and claimed is not None and claimed < self.size:
            displaced = claimed  # ROUTER_HANDOVER gave it that rank's connection
        return False, displaced, log_line

    def explain(self, rank: int) -> str | None:
        """Why `rank` may be missing: peers claimed it with another key, or None."""
        if rank not in self.claims:
            return None
        key, count = self.claims[rank]
        hint = ""
        if key.startswith("rank "):
            owner = key.removesuffix("'s key")
            hint = (
                f"; is {owner}'s key pair copied as rank {rank}'s? every rank "
                "needs a key pair of its own (python -m zmqdp keys DIR --engines N)"
            )
        return f"{count} message(s) claiming rank {rank} came with {key} and were dropped{hint}"
