"""A Hypothesis state machine for `_core/liveness.ConnectionWatch`: which connection's
close is a rank's death.

The machine plays engines against one monitored socket: incarnations of each rank start
(natively: a connection is accepted, then its HELLO claims it; on vLLM's wire: the
HELLO comes first, then the connection is accepted as the rank's), connections nobody
claims open (port scanners, refused handshakes), any open connection closes, and a
rank is declared dead for another reason (`release`). The OS hands out the lowest free
fd, so a closed connection's fd is reused by the next one, as it is in practice.
Invariant: **a close names a rank exactly when it is the last open connection of that
rank's live current incarnation**: never a previous incarnation's (a restarted engine
must not be killed by its predecessor's late close), never a stranger's, never a stray
one's while the engine's own stay open, never a reused fd's former owner, and never
misses the live one.

It is a plain module so that `test_mutants.py` can run it against a broken variant.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from zmqdp._core.liveness import ConnectionWatch


class ConnectionMachine(RuleBasedStateMachine):
    watch_cls: type[ConnectionWatch] = ConnectionWatch

    @initialize(n=st.integers(1, 3))
    def setup(self, n: int) -> None:
        self.n = n
        self.watch = self.watch_cls()
        self.open: dict[int, int | None] = {}  # model: fd -> the rank it carries, or None
        self.live: dict[int, set[int]] = {}  # model: rank -> its live incarnation's fds

    def _new_fd(self) -> int:
        fd = 3
        while fd in self.open:
            fd += 1
        return fd

    def _now_current(self, rank: int, fd: int) -> None:
        for old in self.live.pop(rank, ()):
            self.open[old] = None  # its predecessor's
        self.open[fd] = rank
        self.live[rank] = {fd}

    @rule(data=st.data())
    def native_incarnation(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.n - 1), label="rank")
        fd = self._new_fd()
        self.open[fd] = None
        self.watch.accepted(fd)
        self.watch.claim(fd, rank)  # its HELLO, accepted
        self._now_current(rank, fd)

    @rule(data=st.data())
    def vllm_incarnation(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.n - 1), label="rank")
        self.watch.release(rank)  # its HELLO: what is open now is a predecessor's
        self.live.pop(rank, None)
        fd = self._new_fd()
        self.watch.accepted(fd, rank)
        self._now_current(rank, fd)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def another_connection_to_a_ranks_socket(self, data: st.DataObject) -> None:
        """vLLM: a MoE engine's second PUSH, or a port probe, to a live rank's socket."""
        rank = data.draw(st.sampled_from(sorted(self.live)), label="rank")
        fd = self._new_fd()
        self.watch.accepted(fd, rank)
        self.open[fd] = rank
        self.live[rank].add(fd)

    @rule()
    def stranger(self) -> None:
        fd = self._new_fd()
        self.open[fd] = None
        self.watch.accepted(fd)

    @rule(data=st.data())
    def declared_dead(self, data: st.DataObject) -> None:
        rank = data.draw(st.integers(0, self.n - 1), label="rank")
        self.watch.release(rank)
        self.live.pop(rank, None)

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        fd = data.draw(st.sampled_from(sorted(self.open)), label="fd")
        carried = self.open.pop(fd)
        expected = None
        if carried is not None and fd in self.live.get(carried, ()):
            self.live[carried].discard(fd)
            if not self.live[carried]:  # its last: the engine is gone
                del self.live[carried]
                expected = carried
        got = self.watch.disconnected(fd)
        assert got == expected, (
            f"the close of fd {fd} named rank {got}, expected {expected} "
            f"({'a previous incarnation' if carried is not None else 'nobody'}'s connection)"
        )
        assert len(self.watch) == len(self.open)
