"""A Hypothesis state machine for request retirement, routing and load reports.

The machine drives the real `RequestBook` + `Routing` against a model that knows the
ground truth the core cannot see: which *incarnation* (handle) each engine message
belongs to. Engines are modelled per rank with a FIFO inbox (ADD/ABORT) and a FIFO
outbox (output batches), so aborts, confirmations, late outputs and id reuse arrive in
every order ZeroMQ allows. The core only sees ids; the model checks that it still
attributes every output to the right incarnation.

It is a plain module (not a test file) so that `test_mutants.py` can run it against
deliberately broken variants of the core.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from zmqdp._core.errors import DuplicateRequestId, InvalidRank, NoEngineAvailable
from zmqdp._core.messages import Load, Output
from zmqdp._core.requests import Outcome, RequestBook
from zmqdp._core.routing import Routing

IDS = ["a", "b", "c", "d"]
MAX_RANKS = 4


class Handle:
    """One submission (incarnation). Identity matters, not value."""

    _ids = itertools.count()

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.serial = next(self._ids)

    def __repr__(self) -> str:
        return f"<{self.request_id}#{self.serial}>"


@dataclass
class Event:
    """One entry of a batch, with the ground truth the core does not get."""

    kind: str  # "output" | "terminal" | "drop" | "confirm" | "ghost"
    request_id: str
    truth: Handle | None


@dataclass
class Engine:
    inbox: deque[tuple[str, str, Handle | None]] = field(default_factory=deque)
    held: dict[str, Handle] = field(default_factory=dict)
    outbox: deque[list[Event]] = field(default_factory=deque)


class RetirementMachine(RuleBasedStateMachine):
    """Subclass and set `routing_cls` / `book_cls` to run against a variant."""

    routing_cls: type[Routing] = Routing
    book_cls: type[RequestBook[Any]] = RequestBook

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    @initialize(n=st.integers(1, MAX_RANKS))
    def setup(self, n: int) -> None:
        self.n = n
        self.routing = self.routing_cls(n, up=True)
        self.book: RequestBook[Handle] = self.book_cls(self.routing)
        self.engines = [Engine() for _ in range(n)]
        self.up = [True] * n
        self.live: dict[str, tuple[int, Handle]] = {}  # model: id -> (rank, handle)
        self.ends: dict[Handle, list[Outcome]] = {}
        self.all_handles: list[Handle] = []
        self.last_seq: list[int | None] = [None] * n
        self.bursts = 0

    # -- helpers ----------------------------------------------------------------------

    def _rank(self, r: int) -> int:
        return r % self.n

    def _record_end(self, handle: Handle, outcome: Outcome, expected: Outcome) -> None:
        assert outcome is expected, f"{handle} ended {outcome}, expected {expected}"
        self.ends.setdefault(handle, []).append(outcome)
        rid = handle.request_id
        assert self.live.get(rid, (0, None))[1] is handle, f"{handle} ended but is not live"
        del self.live[rid]

    def _submit(self, rid: str, pin: int | None, *, send: bool = True) -> Handle | None:
        handle = Handle(rid)
        up_before = list(self.up)
        try:
            rank = self.book.submit(rid, handle, pin)
        except DuplicateRequestId:
            assert rid in self.live, f"{rid} refused as duplicate but not live"
            return None
        except InvalidRank:
            assert pin is not None and not self.up[pin]
            return None
        except NoEngineAvailable:
            assert pin is None and not any(self.up)
            return None
        assert rid not in self.live, f"live id {rid} accepted twice"
        assert up_before[rank], f"chose rank {rank}, which is down"
        if pin is not None:
            assert rank == pin
        self.live[rid] = (rank, handle)
        self.all_handles.append(handle)
        if send:
            self.engines[rank].inbox.append(("add", rid, handle))
        return handle

    # -- client rules -----------------------------------------------------------------

    @rule(rid=st.sampled_from(IDS), pin=st.none() | st.integers(0, MAX_RANKS - 1))
    def submit(self, rid: str, pin: int | None) -> None:
        self._submit(rid, None if pin is None else self._rank(pin))

    @rule(rid=st.sampled_from(IDS), pin=st.integers(MAX_RANKS, MAX_RANKS + 3))
    def submit_out_of_range(self, rid: str, pin: int) -> None:
        before = {r: self.routing.inflight_ids(r) for r in range(self.n)}
        try:
            self.book.submit(rid, Handle(rid), pin)
        except (InvalidRank, DuplicateRequestId):
            pass
        else:
            raise AssertionError(f"rank {pin} accepted in a group of {self.n}")
        assert before == {r: self.routing.inflight_ids(r) for r in range(self.n)}

    @rule(rid=st.sampled_from(IDS), pin=st.none() | st.integers(0, MAX_RANKS - 1))
    def submit_then_rollback(self, rid: str, pin: int | None) -> None:
        """Encode or send failed: the ADD never reached the engine."""
        handle = self._submit(rid, None if pin is None else self._rank(pin), send=False)
        if handle is not None:
            ended = self.book.rollback(rid, handle, "send failed")
            assert ended is not None and ended.handle is handle
            self._record_end(handle, ended.outcome, Outcome.ROLLED_BACK)

    @rule(rid=st.sampled_from(IDS))
    def submit_then_wake_fails(self, rid: str) -> None:
        """The ADD went out but the wake failed: the stranded request is aborted."""
        handle = self._submit(rid, None)
        if handle is not None:
            ended = self.book.abort(rid, handle, outcome=Outcome.ROLLED_BACK, cause="wake")
            assert ended is not None
            self._record_end(handle, ended.outcome, Outcome.ROLLED_BACK)
            self.engines[ended.rank].inbox.append(("abort", rid, None))

    @rule(rid=st.sampled_from(IDS))
    def abort(self, rid: str) -> None:
        ended = self.book.abort(rid)
        if rid not in self.live:
            assert ended is None, f"abort of {rid} ended something not live"
            return
        rank, handle = self.live[rid]
        assert ended is not None and ended.handle is handle and ended.rank == rank
        self._record_end(handle, ended.outcome, Outcome.ABORTED)
        self.engines[rank].inbox.append(("abort", rid, None))

    @rule(data=st.data())
    def stream_drop(self, data: st.DataObject) -> None:
        """A stream (any incarnation, possibly long ended) closes."""
        if not self.all_handles:
            return
        handle = data.draw(st.sampled_from(self.all_handles))
        rid = handle.request_id
        ended = self.book.abort(rid, handle)
        if self.live.get(rid, (0, None))[1] is not handle:
            assert ended is None, f"closing {handle} ended {ended}"
            return
        assert ended is not None and ended.handle is handle
        self._record_end(handle, ended.outcome, Outcome.ABORTED)
        self.engines[ended.rank].inbox.append(("abort", rid, None))

    @precondition(lambda self: self.n > 0)
    @rule(k=st.integers(1, 9))
    def burst(self, k: int) -> None:
        """With no load reported, k unpinned submits over n up ranks spread evenly."""
        up = [r for r in range(self.n) if self.up[r]]
        if not up or any(
            self.routing.inflight_count(r)
            or self.routing.load(r).waiting
            or self.routing.load(r).running
            for r in up
        ):
            return
        picks = dict.fromkeys(up, 0)
        for _ in range(k):
            self.bursts += 1
            handle = self._submit(f"burst-{self.bursts}", None)
            assert handle is not None
            picks[self.live[handle.request_id][0]] += 1
        assert max(picks.values()) - min(picks.values()) <= 1, f"uneven burst {picks}"

    # -- engine rules -----------------------------------------------------------------

    @rule(r=st.integers(0, MAX_RANKS - 1))
    def engine_takes_input(self, r: int) -> None:
        eng = self.engines[self._rank(r)]
        if not eng.inbox:
            return
        kind, rid, handle = eng.inbox.popleft()
        if kind == "add":
            assert handle is not None
            assert rid not in eng.held, f"ADD {rid} while it is live on the engine"
            eng.held[rid] = handle
        elif rid in eng.held:
            eng.outbox.append([Event("confirm", rid, eng.held.pop(rid))])

    @rule(r=st.integers(0, MAX_RANKS - 1), data=st.data())
    def engine_emits(self, r: int, data: st.DataObject) -> None:
        eng = self.engines[self._rank(r)]
        if not eng.held:
            return
        rid = data.draw(st.sampled_from(sorted(eng.held)))
        how = data.draw(st.sampled_from(["output", "terminal", "terminal+finished", "drop"]))
        handle = eng.held[rid]
        if how == "output":
            eng.outbox.append([Event("output", rid, handle)])
            return
        del eng.held[rid]
        if how == "terminal":
            eng.outbox.append([Event("terminal", rid, handle)])
        elif how == "drop":
            eng.outbox.append([Event("drop", rid, handle)])
        else:
            eng.outbox.append([Event("terminal", rid, handle), Event("dup", rid, handle)])

    @rule(r=st.integers(0, MAX_RANKS - 1), rid=st.sampled_from(["ghost", *IDS]))
    def engine_sends_garbage_ids(self, r: int, rid: str) -> None:
        """A buggy engine names an id it does not hold: a ghost, or an id live on another
        rank that this rank has no business confirming."""
        rank = self._rank(r)
        eng = self.engines[rank]
        if rid != "ghost" and (
            self.live.get(rid, (rank, None))[0] == rank
            or rid in eng.held
            or any(item[1] == rid for item in eng.inbox)
            or self.book.unconfirmed(rank).get(rid)
        ):
            return
        eng.outbox.append([Event("ghost", rid, None)])

    @rule(r=st.integers(0, MAX_RANKS - 1))
    def client_receives(self, r: int) -> None:
        rank = self._rank(r)
        eng = self.engines[rank]
        if not eng.outbox or not self.up[rank]:
            return
        events = eng.outbox.popleft()
        outputs = []
        finished = []
        expect_deliver: list[tuple[Handle, str]] = []
        expect_end: list[tuple[Handle, Outcome]] = []
        for ev in events:
            live = ev.truth is not None and self.live.get(ev.request_id, (0, None))[1] is ev.truth
            if ev.kind in ("output", "terminal", "ghost"):
                terminal = ev.kind != "output"
                outputs.append(Output(ev.request_id, None, "stop" if terminal else None))
                if live:
                    assert ev.truth is not None
                    expect_deliver.append((ev.truth, ev.request_id))
                    if terminal:
                        expect_end.append((ev.truth, Outcome.FINISHED))
            else:
                finished.append(ev.request_id)
                if live and ev.kind == "drop":
                    assert ev.truth is not None
                    expect_end.append((ev.truth, Outcome.TRUNCATED))
        fx = self.book.apply_batch(rank, outputs, finished)
        got = [(h, o.request_id) for h, o in fx.deliveries]
        assert got == expect_deliver, f"delivered {got}, expected {expect_deliver}"
        assert [(e.handle, e.outcome) for e in fx.ended] == expect_end, (
            f"ended {fx.ended}, expected {expect_end}"
        )
        for handle, outcome in expect_end:
            self._record_end(handle, outcome, outcome)

    @rule(r=st.integers(0, MAX_RANKS - 1))
    def rank_dies(self, r: int) -> None:
        rank = self._rank(r)
        if not self.up[rank]:
            return
        expected = {h for (rk, h) in self.live.values() if rk == rank}
        ended = self.book.rank_down(rank, "dead: test")
        assert {e.handle for e in ended} == expected
        for e in ended:
            self._record_end(e.handle, e.outcome, Outcome.FAILED)
        self.up[rank] = False
        self.engines[rank] = Engine()
        self.last_seq[rank] = None

    @rule(r=st.integers(0, MAX_RANKS - 1))
    def rank_rejoins(self, r: int) -> None:
        rank = self._rank(r)
        if self.up[rank]:
            return
        self.book.rank_up(rank)
        self.up[rank] = True

    @rule(
        r=st.integers(0, MAX_RANKS - 1),
        waiting=st.integers(0, 5),
        running=st.integers(0, 5),
        kv=st.sampled_from([0.0, 0.4, 0.75, 1.0, math.nan]),
        seq=st.none() | st.integers(0, 6),
    )
    def load_report(self, r: int, waiting: int, running: int, kv: float, seq: int | None) -> None:
        rank = self._rank(r)
        applied = self.routing.observe_load(rank, Load(waiting, running, kv), seq)
        last = self.last_seq[rank]
        expect = self.up[rank] and (seq is None or last is None or seq >= last)
        assert applied == expect, f"seq {seq} after {last}: applied={applied}"
        if applied:
            if seq is not None:
                self.last_seq[rank] = seq
            stored = self.routing.load(rank)
            empty = not any(rk == rank for rk, _ in self.live.values())
            assert (stored.waiting, stored.running) == ((0, 0) if empty else (waiting, running))
            assert stored.kv == kv or (math.isnan(kv) and math.isnan(stored.kv))

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def inflight_sets_are_exactly_the_live_requests(self) -> None:
        if not self.n:
            return
        seen: set[str] = set()
        for rank in range(self.n):
            ids = self.routing.inflight_ids(rank)
            want = {rid for rid, (rk, _) in self.live.items() if rk == rank}
            assert ids == want, f"rank {rank} holds {set(ids)}, live there: {want}"
            assert not ids & seen, f"ids {ids & seen} are in two in-flight sets"
            seen |= ids
            if not self.up[rank]:
                assert not ids, f"down rank {rank} holds {set(ids)}"
        assert len(self.book) == len(self.live)

    @invariant()
    def every_request_ends_at_most_once(self) -> None:
        for handle, outcomes in self.ends.items():
            assert len(outcomes) == 1, f"{handle} ended {len(outcomes)} times: {outcomes}"

    @invariant()
    def scores_never_nan(self) -> None:
        for rank in range(self.n):
            assert not math.isnan(self.routing.score(rank))

    def teardown(self) -> None:
        if not self.n:
            return
        # Every request that is not live has ended exactly once; live ones not at all.
        live = {h for _, h in self.live.values()}
        for handle in self.all_handles:
            assert len(self.ends.get(handle, [])) == (0 if handle in live else 1), handle
