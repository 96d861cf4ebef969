"""Which open connection belongs to which rank's current incarnation (sans-IO).

Theory of operation
-------------------
libzmq's socket monitor says when a connection of a bound socket is accepted and when
it is closed, naming it by its fd; a closed one is an engine that exited, was killed,
or missed ZMTP heartbeats (a stopped process). That is death within a second, even for
an idle engine, without a polling protocol of our own. What the monitor cannot say is
whose connection it was. `ConnectionWatch` keeps that, for one monitored socket:

* natively, one handshake ROUTER serves every rank: a connection becomes rank r's when
  a HELLO of r that the client accepts arrives on it (`claim`, with the fd libzmq
  gives the message);
* on vLLM's wire every rank has an output socket of its own: a connection accepted on
  rank r's socket after r's latest HELLO is r's (`accepted(fd, rank=r)`; a MoE engine
  opens two there, its output and its coordinator output); the ones from before are a
  previous incarnation's (`release`).

`disconnected(fd)` names the rank whose current incarnation lost its *last* open
connection, or None: a connection nobody claimed (a port scanner, a refused
handshake), one a later incarnation replaced (a restarted engine's predecessor, whose
close arrives late), or a stray one to a rank's socket while the engine's own stay
open, is not a death. Ordering, which the owner guarantees: events are fed in the order libzmq
emitted them, and before any message that arrived after them (libzmq emits the close
of a connection before it closes its fd, so an fd number reused by a new connection is
always seen closed first).
"""

from __future__ import annotations

__all__ = ["ConnectionWatch"]


class ConnectionWatch:
    """Open connections of one monitored socket, by fd, and the rank each belongs to."""

    def __init__(self) -> None:
        self._owner: dict[int, int | None] = {}
        """Open fd -> the rank whose current incarnation it carries (None: nobody's)."""
        self._conns: dict[int, set[int]] = {}
        """Rank -> the fds of its current incarnation's open connections."""

    def accepted(self, fd: int, rank: int | None = None) -> None:
        """A connection was accepted on `fd`; `rank`: it is one more connection of that
        rank's current incarnation (vLLM: the rank's own socket, after its HELLO)."""
        self._drop(fd)  # defensive: libzmq reports a close before the fd is reused
        self._owner[fd] = rank
        if rank is not None:
            self._conns.setdefault(rank, set()).add(fd)

    def claim(self, fd: int, rank: int) -> bool:
        """A message of `rank`'s current incarnation arrived on `fd`: that connection
        is the rank's, and only that one (natively, where its HELLO came). The caller
        has read the monitor to its end, so every connection still open has been
        reported: False if `fd` is not open any more (the engine sent the message and
        then died, and the close was read first): the rank is dead already."""
        self.release(rank)  # an earlier incarnation's: their close is no death
        if fd not in self._owner:
            return False
        self._owner[fd] = rank
        self._conns[rank] = {fd}
        return True

    def release(self, rank: int) -> None:
        """`rank`'s incarnation ended (or a new one said HELLO): none of the connections
        open now is its current one any more."""
        for fd in self._conns.pop(rank, ()):
            self._owner[fd] = None

    def disconnected(self, fd: int) -> int | None:
        """The connection on `fd` closed: the rank whose current incarnation's last
        open connection it was, if any (that rank is dead), else None. A stray
        connection to a rank's socket (a port probe) closing kills nobody while the
        engine's own stay open; an engine that exits, is killed or stops closes them
        all."""
        rank = self._owner.pop(fd, None)
        if rank is None:
            return None
        fds = self._conns.get(rank)
        if fds is None or fd not in fds:
            return None
        fds.discard(fd)
        if fds:
            return None
        del self._conns[rank]
        return rank

    def _drop(self, fd: int) -> None:
        rank = self._owner.pop(fd, None)
        if rank is not None and (fds := self._conns.get(rank)) is not None:
            fds.discard(fd)
            if not fds:
                del self._conns[rank]

    def owner(self, fd: int) -> int | None:
        """The rank whose current incarnation `fd` carries, if any."""
        return self._owner.get(fd)

    def open_fds(self) -> set[int]:
        """Every open connection's fd (a new set)."""
        return set(self._owner)

    def __contains__(self, fd: object) -> bool:
        """Whether `fd` is an open connection."""
        return fd in self._owner

    def newest_stray(self) -> int | None:
        """The open connection accepted last that is no rank's (None: there is none)."""
        for fd in reversed(self._owner):
            if self._owner[fd] is None:
                return fd
        return None

    def strays(self) -> int:
        """Open connections that are no rank's current incarnation's."""
        return len(self._owner) - sum(len(fds) for fds in self._conns.values())

    def connections(self, rank: int) -> frozenset[int]:
        """The fds of `rank`'s current incarnation's open connections."""
        return frozenset(self._conns.get(rank, ()))

    def __len__(self) -> int:
        """Open connections (claimed or not): bounded by what libzmq keeps open."""
        return len(self._owner)
