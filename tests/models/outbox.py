"""A Hypothesis state machine for the input task's per-rank outbox (`_core/outbox.py`).

The machine plays the input task against a fake network in which each rank's pipe has
room for a number of messages that the rules change (a rank stops reading, drains, a
burst fills it). Time is a value. Invariants:

* per rank, messages go out in the order they were queued, each exactly once, unless
  the rank is given up on (then the rest is dropped, never sent);
* **nobody blocks anybody**: after a flush, every rank that has room and is not
  blocked has nothing left queued: a full rank never holds back another rank's messages;
* a rank that has had no room for `send_timeout` is reported overdue, and only then;
* the timer is honest: `next_retry()` is never later than the earliest due retry or
  give-up, so the input task never sleeps through one (and never spins: it is inf
  when no rank is blocked).

It is a plain module so that `test_mutants.py` can run it against a broken variant.
"""

from __future__ import annotations

import math
from collections import deque

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from zmqdp._core.outbox import Outbox

SEND_TIMEOUT = 1.0


class OutboxMachine(RuleBasedStateMachine):
    outbox_cls: type[Outbox[int]] = Outbox

    @initialize(n=st.integers(1, 4))
    def setup(self, n: int) -> None:
        self.n = n
        self.outbox: Outbox[int] = self.outbox_cls(n, send_timeout=SEND_TIMEOUT)
        self.room = [0] * n  # messages each rank's pipe can still take
        self.queued: list[deque[int]] = [deque() for _ in range(n)]  # model
        self.sent: list[list[int]] = [[] for _ in range(n)]
        self.given_up: list[bool] = [False] * n
        self.serial = 0
        self.now = 0.0
        self.stuck_since: list[float | None] = [None] * n  # model: no room since

    @rule(r=st.integers(0, 3), k=st.integers(1, 4))
    def queue(self, r: int, k: int) -> None:
        rank = r % self.n
        for _ in range(k):
            self.serial += 1
            self.outbox.put(rank, self.serial)
            self.queued[rank].append(self.serial)

    @rule(r=st.integers(0, 3), room=st.integers(0, 5))
    def pipe_changes(self, r: int, room: int) -> None:
        """The engine reads (room) or stops reading (no room)."""
        self.room[r % self.n] = room

    @rule(dt=st.sampled_from([0.0005, 0.003, 0.02, 0.3, 1.5]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule()
    def input_task_runs(self) -> None:
        """What `GroupTransport.serve_input` does: flush, then give up on overdue ranks."""
        now = self.now
        for rank in self.outbox.sendable(now):
            while (item := self.outbox.head(rank)) is not None:
                if self.room[rank] == 0:
                    self.outbox.blocked(rank, now)
                    if self.stuck_since[rank] is None:
                        self.stuck_since[rank] = now
                    break
                self.room[rank] -= 1
                self.outbox.sent(rank)
                assert self.queued[rank], f"rank {rank}: sent {item}, which was never queued"
                want = self.queued[rank].popleft()
                assert item == want, f"rank {rank}: sent {item} before {want}"
                self.sent[rank].append(item)
                self.stuck_since[rank] = None
        for rank in range(self.n):  # a rank that never found its pipe full is due
            if self.stuck_since[rank] is None and self.room[rank]:
                assert not self.outbox.queued(rank), (
                    f"rank {rank} has room and is due, yet {self.outbox.queued(rank)} "
                    "messages stay queued: held back by another rank"
                )
        overdue = self.outbox.overdue(now)
        for rank in range(self.n):
            since = self.stuck_since[rank]
            expect = since is not None and now - since >= SEND_TIMEOUT
            assert (rank in overdue) == expect, f"rank {rank}: overdue={rank in overdue}"
        for rank in overdue:
            self.outbox.drop(rank)
            self.queued[rank].clear()
            self.stuck_since[rank] = None
            self.given_up[rank] = True

    @invariant()
    def counts_agree(self) -> None:
        if not hasattr(self, "n"):
            return
        for rank in range(self.n):
            assert self.outbox.queued(rank) == len(self.queued[rank])
        assert len(self.outbox) == sum(len(q) for q in self.queued)

    @invariant()
    def the_timer_never_sleeps_through_a_retry(self) -> None:
        if not hasattr(self, "n"):
            return
        wake = self.outbox.next_retry()
        blocked = [r for r in range(self.n) if self.stuck_since[r] is not None and self.queued[r]]
        if not blocked:
            assert wake == math.inf, f"a timer at {wake} with no rank blocked: it would spin"
            return
        for rank in blocked:
            since = self.stuck_since[rank]
            assert since is not None
            assert wake <= since + SEND_TIMEOUT, f"rank {rank}: give-up at {wake}, too late"
