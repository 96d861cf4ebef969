"""GroupCore's watchdogs and batch handling, with time passed in (no event loop)."""

from __future__ import annotations

import math

import cbor2

from zmqdp._core.group import GroupCore


def core(lockstep: bool = False) -> GroupCore[object]:
    c: GroupCore[object] = GroupCore(
        2, lockstep=lockstep, silence_timeout=30, stall_timeout=5, max_decode_errors=3
    )
    for r in range(2):
        c.rank_up(r, now=0.0)
    return c


def test_an_idle_rank_is_never_silent_and_silence_starts_at_its_first_request() -> None:
    c = core()
    assert c.next_deadline() == math.inf
    c.submit("a", object(), 0, now=100.0)  # idle for 100 s, then given work
    assert c.next_deadline() == 130.0
    assert c.on_timeout(129.9) == ([], None)
    dead, _ = c.on_timeout(130.0)
    assert dead == [(0, "silent for 30.0 s while holding 1 request(s) (silence_timeout=30 s)")]


def test_any_batch_resets_silence() -> None:
    c = core()
    c.submit("a", object(), 1, now=0.0)
    c.on_batch(1, cbor2.dumps({"rank": 1, "load": {"running": 1}}), now=20.0)
    assert c.next_deadline() == 50.0


def test_stalled_lockstep_rank_gets_one_wake_at_the_clock_never_above() -> None:
    c = core(lockstep=True)
    c.on_batch(0, cbor2.dumps({"rank": 0, "wave_complete": 6}), now=0.0)
    c.submit("a", object(), 0, now=0.0)
    c.on_batch(0, cbor2.dumps({"rank": 0, "load": {"waiting": 1}}), now=1.0)
    assert c.next_deadline() == 5.0
    assert c.on_timeout(5.0) == ([], 7)
    assert c.on_timeout(6.0) == ([], None)  # once, until the rank makes progress
    assert c.counters.stall_wakes == 1
    c.on_batch(0, cbor2.dumps({"rank": 0, "outputs": [{"id": "a", "body": 1}]}), now=7.0)
    assert c.next_deadline() == 12.0  # progress re-arms the stall watch


def test_independent_groups_never_stall_wake() -> None:
    c = core()
    c.submit("a", object(), 0, now=0.0)
    c.on_batch(0, cbor2.dumps({"rank": 0, "load": {"waiting": 3}}), now=0.0)
    assert c.on_timeout(10.0) == ([], None)


def test_decode_errors_in_a_row_kill_but_a_good_batch_resets_the_count() -> None:
    c = core()
    assert c.on_batch(0, b"\xff", now=0).dead is None
    assert c.on_batch(0, b"\xff", now=0).dead is None
    assert c.on_batch(0, cbor2.dumps({"rank": 0}), now=0).error is None
    assert c.on_batch(0, b"\xff", now=0).dead is None
    assert c.on_batch(0, b"\xff", now=0).dead is None
    result = c.on_batch(0, cbor2.dumps({"rank": 1}), now=0)
    assert result.dead is not None and "3 invalid batches in a row" in result.dead
    assert "identity rank 0" in result.dead
    assert c.counters.protocol_errors == 5


def test_dead_announcement_is_applied_after_the_rest_of_the_batch() -> None:
    c = core()
    h = object()
    c.submit("a", h, 0, now=0)
    body = {"rank": 0, "outputs": [{"id": "a", "body": 1, "finish": "stop"}], "dead": "oom"}
    result = c.on_batch(0, cbor2.dumps(body), now=0)
    assert result.effects is not None and [e.handle for e in result.effects.ended] == [h]
    assert result.dead == "announced dead: oom"
    assert c.rank_dead(0, "announced dead: oom") == []  # nothing left to fail


def test_batches_from_a_down_rank_are_ignored() -> None:
    c = core()
    c.rank_dead(1, "test")
    assert c.on_batch(1, b"\xff", now=0).error is None
    assert c.counters.unknown_outputs == 1
