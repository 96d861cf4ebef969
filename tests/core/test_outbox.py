"""The input task's per-rank outbox (`_core/outbox.py`): examples, then the state machine
of tests/models/outbox.py."""

from __future__ import annotations

import math

from hypothesis import settings

from tests.models.outbox import OutboxMachine
from zmqdp._core.outbox import Outbox

TestOutbox = OutboxMachine.TestCase
TestOutbox.settings = settings(settings.default, stateful_step_count=60)


def test_a_blocked_rank_is_skipped_and_retried_with_backoff_until_its_send_timeout() -> None:
    box: Outbox[str] = Outbox(2, send_timeout=1.0, retry_first=0.001, retry_max=0.004)
    assert box.put(0, "a") and box.put(1, "b")
    assert box.sendable(0.0) == [0, 1]
    box.blocked(0, 0.0)  # rank 0's pipe is full
    assert box.sendable(0.0) == [1]  # rank 1 goes on
    assert not box.put(0, "a2")  # no need to wake the sender for a blocked rank
    retries = []
    now = 0.0
    while not box.overdue(now):
        now = box.next_retry()
        if box.sendable(now) == [0, 1]:
            retries.append(now)
            box.blocked(0, now)
    assert [round(t, 3) for t in retries[:4]] == [0.001, 0.003, 0.007, 0.011]  # capped
    assert now == 1.0 and box.overdue(now) == [0]
    assert box.drop(0) == 2 and len(box) == 1 and box.next_retry() == math.inf


def test_a_successful_send_unblocks_and_keeps_the_order() -> None:
    box: Outbox[int] = Outbox(1)
    for i in range(3):
        box.put(0, i)
    box.blocked(0, 5.0)
    box.sent(0)
    assert box.head(0) == 1 and box.sendable(5.0) == [0] and box.next_retry() == math.inf
    assert box.take_all(0) == [1, 2] and len(box) == 0
