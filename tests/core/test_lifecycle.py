"""Request retirement in every order: the state machine, plus a few worked examples.

The examples drive `RequestBook` directly; `submit` below gives each submission a fresh
wire id, as `GroupCore.submit` does."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings

from tests.models.lifecycle import RetirementMachine
from zmqdp._core.errors import DuplicateRequestId, InvalidRank, NoEngineAvailable
from zmqdp._core.messages import Load, Output
from zmqdp._core.requests import Outcome, RequestBook
from zmqdp._core.routing import Routing

TestRetirement = RetirementMachine.TestCase
TestRetirement.settings = settings(settings.default, stateful_step_count=60)


def _book(n: int = 2) -> RequestBook[object]:
    return RequestBook(Routing(n, up=True))


def submit(book: RequestBook[object], rid: str, handle: object, rank: int | None = None) -> int:
    return book.submit(rid, book.new_wire_id(rid), handle, rank)


def wire(book: RequestBook[object], rid: str) -> str:
    wid = book.wire_id(rid)
    assert wid is not None
    return wid


def test_cold_burst_round_robins() -> None:  # SMG #5
    book = _book(2)
    assert [submit(book, f"r{i}", object()) for i in range(4)] == [0, 1, 0, 1]


def test_unreported_rank_beats_a_loaded_one() -> None:  # SMG #4
    book = _book(2)
    submit(book, "held", object(), 0)
    book.routing.observe_load(0, Load(waiting=5, running=3, kv=0.2), seq=1)
    assert book.routing.score(0) == 8
    assert submit(book, "next", object()) == 1


def test_kv_penalty_only_counts_waiting_above_half_full() -> None:
    routing = Routing(3, up=True)
    for r in range(3):
        routing.select(f"x{r}", r)
    routing.observe_load(0, Load(waiting=2, running=2, kv=1.0))  # 4 + 2*6*0.5 = 10
    routing.observe_load(1, Load(waiting=2, running=3, kv=0.5))  # 5, no penalty at 0.5
    routing.observe_load(2, Load(waiting=2, running=2, kv=math.nan))  # 4, NaN adds nothing
    assert [routing.score(r) for r in range(3)] == [10.0, 5.0, 4.0]
    assert routing.select("y") == 2


def test_failed_duplicate_submit_keeps_the_live_reservation() -> None:  # SMG #6
    book = _book(2)
    assert submit(book, "dup", object()) == 0
    with pytest.raises(DuplicateRequestId, match=r"'dup'.*rank 0"):
        submit(book, "dup", object())
    assert [book.routing.inflight_count(r) for r in range(2)] == [1, 0]
    assert submit(book, "next", object()) == 1


def test_retiring_twice_frees_only_its_own_slot() -> None:  # SMG #7
    book = _book(2)
    doomed, held = object(), object()
    submit(book, "doomed", doomed, 0)
    submit(book, "held", held, 0)
    first = book.abort("doomed")
    assert first is not None and first.rank == 0
    assert book.abort("doomed", doomed) is None  # the stream closing later: a no-op
    fx = book.apply_batch(0, [], [first.wire_id])  # the engine's confirmation: a no-op too
    assert fx.ended == [] and fx.late == 1
    assert book.routing.inflight_ids(0) == {wire(book, "held")}
    assert submit(book, "next", object()) == 1


def test_an_emptied_rank_sheds_its_stale_queue_counts() -> None:  # SMG #8
    book = _book(2)
    submit(book, "a", object(), 0)
    submit(book, "b", object(), 1)
    book.routing.observe_load(0, Load(waiting=5, running=3, kv=0.7), seq=4)
    fx = book.apply_batch(0, [Output(wire(book, "a"), 1, "stop")])
    assert [e.outcome for e in fx.ended] == [Outcome.FINISHED]
    assert book.routing.load(0) == Load(0, 0, 0.7)
    assert submit(book, "c", object()) == 0


def test_many_select_release_cycles_leave_every_set_empty() -> None:  # SMG #9
    routing = Routing(4, up=True)
    for i in range(8 * 2000):
        rank = routing.select(f"r{i}")
        routing.release(rank, [f"r{i}", f"r{i}"])
    assert all(routing.inflight_count(r) == 0 for r in range(4))


def test_pinned_rank_must_exist_and_be_up() -> None:
    book = _book(2)
    with pytest.raises(InvalidRank, match=r"rank 2 .*'r'.*out of range"):
        submit(book, "r", object(), 2)
    book.rank_down(1, "test")
    with pytest.raises(InvalidRank, match="down"):
        submit(book, "r", object(), 1)
    assert submit(book, "r", object()) == 0  # the unpinned pick skips the down rank
    book.rank_down(0, "test")
    with pytest.raises(NoEngineAvailable):
        submit(book, "s", object())


def test_late_output_for_a_reused_id_never_reaches_the_new_request() -> None:
    book = _book(1)
    old, new = object(), object()
    submit(book, "r", old)
    aborted = book.abort("r")
    assert aborted is not None and aborted.wire_id == "r#0"
    submit(book, "r", new)  # same id, same rank, before the engine confirmed the abort
    assert wire(book, "r") == "r#1"
    fx = book.apply_batch(0, [Output("r#0", "old token")])
    assert fx.deliveries == [] and fx.late == 1
    fx = book.apply_batch(0, [], ["r#0"])  # the confirmation of the abort
    assert fx.ended == [] and book.routing.inflight_ids(0) == {"r#1"}
    fx = book.apply_batch(0, [Output("r#1", "new", "stop")])
    assert fx.deliveries == [(new, Output("r", "new", "stop"))]  # renamed to the app id
    assert [(e.handle, e.outcome) for e in fx.ended] == [(new, Outcome.FINISHED)]


def test_one_batch_with_the_abort_confirmation_and_the_reuses_first_output() -> None:
    """Observation 1: ABORT(x), then ADD(x), then one batch `finished: [x]` plus the new
    x's first output. Revision 1 could not tell them apart; wire ids can."""
    book = _book(1)
    old, new = object(), object()
    submit(book, "x", old)
    book.abort("x")
    submit(book, "x", new)
    fx = book.apply_batch(0, [Output("x#1", "first")], ["x#0"])
    assert fx.deliveries == [(new, Output("x", "first"))]
    assert fx.ended == [] and fx.late == 1


def test_finished_without_abort_is_truncated_and_terminal_plus_finished_is_one_end() -> None:
    book = _book(1)
    a, b = object(), object()
    submit(book, "a", a)
    submit(book, "b", b)
    fx = book.apply_batch(0, [Output("a#0", 1, "stop")], ["a#0", "b#1"])
    assert [(e.handle, e.outcome) for e in fx.ended] == [
        (a, Outcome.FINISHED),
        (b, Outcome.TRUNCATED),
    ]
    assert len(book) == 0 and book.routing.inflight_count(0) == 0


def test_outputs_from_the_wrong_rank_are_counted_not_delivered() -> None:
    book = _book(2)
    submit(book, "a", object(), 0)
    fx = book.apply_batch(1, [Output("a#0", 1, "stop")], ["a#0", "a"])
    assert fx.deliveries == [] and fx.ended == [] and fx.unknown == 3
    assert "a" in book


def test_rank_death_fails_its_requests_once_and_rejoin_restores_selection() -> None:
    book = _book(2)
    h = object()
    submit(book, "a", h, 1)
    ended = book.rank_down(1, "announced dead")
    assert [(e.handle, e.outcome, e.cause) for e in ended] == [
        (h, Outcome.FAILED, "announced dead")
    ]
    assert book.rank_down(1, "again") == []
    assert book.apply_batch(1, [Output("a#0", 1, "stop")]).ended == []
    book.rank_up(1)
    assert book.routing.is_up(1) and submit(book, "a", object(), 1) == 1


def test_seq_orders_load_reports() -> None:
    routing = Routing(1, up=True)
    routing.select("x", 0)
    assert routing.observe_load(0, Load(1, 1, 0.1), seq=5)
    assert not routing.observe_load(0, Load(9, 9, 0.9), seq=4)
    assert routing.load(0) == Load(1, 1, 0.1)
    assert routing.observe_load(0, Load(2, 2, 0.2))  # no seq: always the newest
    routing.take_down(0)
    assert not routing.observe_load(0, Load(3, 3, 0.3), seq=6)
    routing.set_up(0)
    assert routing.observe_load(0, Load(0, 0, 0.3), seq=0)  # a new incarnation starts at 0
