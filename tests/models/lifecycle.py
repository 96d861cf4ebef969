"""A Hypothesis state machine for request retirement across engine incarnations.

The machine drives the real `GroupCore` (routing, request book, epochs, the codec)
through the facts production tells it (`submit`, `on_output` and `advance` with encoded
batches, `on_abort`, `on_deadline`, `on_rank_up`, `on_rank_dead`), reading what they
decided from `take_effects()` (ABORTs go to the engines' inboxes from there), against a
model that knows the ground truth the core cannot see: which *submission* (handle) and
which *incarnation* each engine message belongs to.

Engines are modelled per rank and per incarnation, each with a FIFO inbox (ADD/ABORT)
and a FIFO outbox (output batches). When a rank dies, its incarnation does not vanish:
it becomes a *zombie* that keeps taking input, emitting for what it holds, and
delivering its queued batches, all stamped with its old epoch, interleaved in any order
with the batches of the rank's next incarnation (docs/protocol.md §2.3). Application ids are
drawn from a set of four, so they are reused all the time, right after aborts and
while late outputs of their previous submission are still on the way (§3).

Invariants (after every step, and at teardown):
* every request ends exactly once, with the outcome the model predicts;
* every output is delivered to the submission it belongs to, renamed to its
  application id; nothing of one incarnation or wire id reaches another;
* each rank's in-flight set is exactly its live requests (no slot leaks), and a down
  rank holds nothing;
* an accepted ADD fits the chosen rank's `max_message_size`; a refused one reserves
  nothing (§1);
* a malformed entry ends only the request it names, and the rest of its batch stands
  (§7);
* admission: no pick takes a rank past its in-flight cap, and `Overloaded` comes only
  when the pinned rank, or every up rank, is full (nothing reserved);
* deadlines: when time passes, exactly the live requests whose deadline has come end
  TIMED_OUT (each once), and their ranks get an ABORT.

It is a plain module (not a test file) so that `test_mutants.py` can run it against
deliberately broken variants of the core.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import cbor2
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from zmqdp._core.codec import decode_request
from zmqdp._core.effects import Effects
from zmqdp._core.errors import (
    DuplicateRequestId,
    EngineDead,
    InvalidRank,
    InvalidRequest,
    NoEngineAvailable,
    Overloaded,
    RequestAborted,
    RequestTimeout,
)
from zmqdp._core.handshake import RankUp, rank_identity
from zmqdp._core.messages import Abort, Load
from zmqdp._core.requests import Outcome
from zmqdp._core.state import GroupCore

IDS = ["a", "b", "c", "d"]
MAX_RANKS = 4
SMALL_LIMIT = 64  # bytes: a rank with this max_message_size takes only small ADDs
BODIES = {"small": "x" * 8, "large": "x" * 200}  # an ADD of "large" never fits SMALL_LIMIT


class Handle:
    """One submission. Identity matters, not value."""

    _serials = itertools.count()

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.serial = next(self._serials)

    def __repr__(self) -> str:
        return f"<{self.request_id}#{self.serial}>"


@dataclass
class _Pending:
    """The batch the dispatcher is on: its incarnation, the slices still to come, and
    the wire ids it has already ended."""

    eng: Incarnation
    chunks: deque[list[Event]]
    dead: bool
    failed: set[str]
    more: bool = False
    """The core has the rest of this batch in hand (`GroupCore.in_hand`)."""


@dataclass
class Event:
    """One entry of a batch, with the ground truth the core does not get."""

    kind: str  # "output" | "terminal" | "drop" | "confirm" | "dup" | "ghost" | "bad"
    wire_id: str | None
    truth: Handle | None


@dataclass
class Incarnation:
    rank: int
    epoch: int
    inbox: deque[tuple[str, str, Handle | None]] = field(default_factory=deque)
    held: dict[str, Handle] = field(default_factory=dict)
    outbox: deque[list[Event]] = field(default_factory=deque)


@dataclass
class Live:
    rank: int
    handle: Handle
    wire_id: str


class RetirementMachine(RuleBasedStateMachine):
    """Subclass and set `core_cls` to run against a variant of the core."""

    core_cls: type[GroupCore[Any]] = GroupCore

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    @initialize(
        n=st.integers(1, MAX_RANKS),
        limits=st.lists(st.sampled_from([SMALL_LIMIT, 1 << 20]), min_size=MAX_RANKS),
        slice_entries=st.sampled_from([1, 2, 4096]),
        caps=st.lists(st.none() | st.integers(1, 3), min_size=MAX_RANKS),
    )
    def setup(self, n: int, limits: list[int], slice_entries: int, caps: list[int | None]) -> None:
        self.n = n
        # (no silence deaths: the model does not keep time for engines)
        self.core: GroupCore[Handle] = self.core_cls(n, lockstep=False, silence_timeout=math.inf)
        self.caps = caps[:n]
        self.deadlines: dict[Handle, float] = {}
        self.core.slice_entries = slice_entries  # small: long batches come in slices
        self.pending: _Pending | None = None
        self.routing = self.core.routing
        self.limits = limits[:n]
        self.epochs = itertools.count(100)
        self.current: list[Incarnation | None] = [None] * n
        self.zombies: list[Incarnation] = []
        self.live: dict[str, Live] = {}  # model: application id -> live submission
        self.ends: dict[Handle, list[Outcome]] = {}
        self.all_handles: list[Handle] = []
        self.last_seq: list[int | None] = [None] * n
        self.bursts = 0
        self.now = 0.0
        for rank in range(n):
            self._bring_up(rank)

    # -- helpers ----------------------------------------------------------------------

    def _rank(self, r: int) -> int:
        return r % self.n

    def _bring_up(self, rank: int) -> None:
        epoch = next(self.epochs)
        self.current[rank] = Incarnation(rank, epoch)
        self.core.on_rank_up(
            RankUp(rank, epoch, max_message_size=self.limits[rank]), self.now, cap=self.caps[rank]
        )
        fx = self.core.take_effects()
        assert fx.ranks == [(rank, True)] and not fx.ended and not fx.sends

    def _aborts(self, fx: Effects[Handle]) -> dict[int, list[str]]:
        """The ABORTs the core asked for, per rank, into the current engines' inboxes
        (what the transport would send)."""
        sent: dict[int, list[str]] = {}
        for rank, frames in fx.sends:
            msg = decode_request(frames[0], frames[1])
            assert isinstance(msg, Abort), f"rank {rank} sent {msg}"
            engine = self.current[rank]
            assert engine is not None, f"an ABORT to rank {rank}, which is down"
            for wid in msg.ids:
                engine.inbox.append(("abort", wid, None))
            sent.setdefault(rank, []).extend(msg.ids)
        return sent

    def _up(self, rank: int) -> bool:
        return self.current[rank] is not None

    def _engines(self) -> list[Incarnation]:
        return [e for e in self.current if e is not None] + self.zombies

    def _record_end(self, handle: Handle, outcome: Outcome, expected: Outcome) -> None:
        assert outcome is expected, f"{handle} ended {outcome}, expected {expected}"
        self.ends.setdefault(handle, []).append(outcome)
        entry = self.live.get(handle.request_id)
        assert entry is not None and entry.handle is handle, f"{handle} ended but is not live"
        del self.live[handle.request_id]

    def _full(self, rank: int) -> bool:
        cap = self.caps[rank]
        return cap is not None and self.routing.inflight_count(rank) >= cap

    def _submit(
        self, rid: str, pin: int | None, body: str = "small", timeout: float | None = None
    ) -> Handle | None:
        handle = Handle(rid)
        before = {r: self.routing.inflight_ids(r) for r in range(self.n)}
        try:
            sub = self.core.submit(rid, BODIES[body], handle, pin, self.now, timeout)
        except Overloaded:
            ranks = [pin] if pin is not None else [r for r in range(self.n) if self._up(r)]
            assert ranks and all(self._full(r) for r in ranks), "refused, yet there is room"
            assert before == {r: self.routing.inflight_ids(r) for r in range(self.n)}
            return None
        except DuplicateRequestId:
            assert rid in self.live, f"{rid} refused as duplicate but not live"
            return None
        except InvalidRank:
            assert pin is not None and not self._up(pin)
            return None
        except NoEngineAvailable:
            assert pin is None and not any(self._up(r) for r in range(self.n))
            return None
        except InvalidRequest:
            assert body == "large", "a small ADD was refused"
            ranks = [pin] if pin is not None else [r for r in range(self.n) if self._up(r)]
            assert any(self.limits[r] == SMALL_LIMIT for r in ranks), "refused, yet it fits"
            after = {r: self.routing.inflight_ids(r) for r in range(self.n)}
            assert after == before, "a refused submit kept a reservation"
            return None
        assert rid not in self.live, f"live id {rid} accepted twice"
        assert self._up(sub.rank), f"chose rank {sub.rank}, which is down"
        cap = self.caps[sub.rank]
        assert cap is None or len(before[sub.rank]) < cap, (
            f"rank {sub.rank} took a request past its in-flight cap {cap}"
        )
        if timeout is not None:
            self.deadlines[handle] = self.now + timeout
        assert len(sub.frames[0]) + len(sub.frames[1]) <= self.limits[sub.rank], (
            f"an ADD of {len(sub.frames[1]) + 1} bytes went to rank {sub.rank}, "
            f"which accepts {self.limits[sub.rank]}"
        )
        if pin is not None:
            assert sub.rank == pin
        assert all(sub.wire_id != e.wire_id for e in self.live.values())
        self.live[rid] = Live(sub.rank, handle, sub.wire_id)
        self.all_handles.append(handle)
        engine = self.current[sub.rank]
        assert engine is not None
        engine.inbox.append(("add", sub.wire_id, handle))
        return handle

    def _client_abort(self, rid: str, handle: Handle | None) -> None:
        ended = self.core.on_abort(rid, handle)
        fx = self.core.take_effects()
        entry = self.live.get(rid)
        if entry is None or (handle is not None and entry.handle is not handle):
            assert ended is None and not fx.ended, f"abort of {rid} ({handle}) ended {ended}"
            assert not fx.sends
            return
        assert ended is not None and ended.handle is entry.handle and ended.rank == entry.rank
        assert ended.wire_id == entry.wire_id
        [(got, error)] = fx.ended
        assert got is ended
        if handle is None:  # the user's abort: a reader sees why
            assert isinstance(error, RequestAborted) and error.request_id == rid
        else:
            assert error is None
        self._record_end(entry.handle, ended.outcome, Outcome.ABORTED)
        assert self._aborts(fx) == {entry.rank: [entry.wire_id]}

    # -- client rules -----------------------------------------------------------------

    @rule(
        rid=st.sampled_from(IDS),
        pin=st.none() | st.integers(0, MAX_RANKS - 1),
        body=st.sampled_from(sorted(BODIES)),
        timeout=st.none() | st.sampled_from([0.5, 1.0, 2.0]),
    )
    def submit(self, rid: str, pin: int | None, body: str, timeout: float | None) -> None:
        self._submit(rid, None if pin is None else self._rank(pin), body, timeout)

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0]))
    def time_passes(self, dt: float) -> None:
        """Deadlines come: exactly the live requests past theirs end TIMED_OUT."""
        self.now += dt
        due = {
            e.handle
            for e in self.live.values()
            if e.handle in self.deadlines and self.deadlines[e.handle] <= self.now
        }
        self.core.on_deadline(self.now)
        fx = self.core.take_effects()
        expired = fx.ended
        assert {ended.handle for ended, _ in expired} == due, (
            f"at {self.now} expired {[e.handle for e, _ in expired]}, due: {due}"
        )
        aborts: dict[int, list[str]] = {}
        for ended, error in expired:
            entry = self.live[ended.request_id]
            assert ended.wire_id == entry.wire_id and ended.rank == entry.rank
            assert isinstance(error, RequestTimeout)
            assert error.request_id == ended.request_id and error.rank == ended.rank
            self._record_end(ended.handle, ended.outcome, Outcome.TIMED_OUT)
            aborts.setdefault(entry.rank, []).append(entry.wire_id)
        assert self._aborts(fx) == aborts, "an expired request was not ABORTed on its rank"
        assert not fx.ranks, "a rank died of time passing"

    @rule(rid=st.sampled_from(IDS), pin=st.integers(MAX_RANKS, MAX_RANKS + 3))
    def submit_out_of_range(self, rid: str, pin: int) -> None:
        before = {r: self.routing.inflight_ids(r) for r in range(self.n)}
        try:
            self.core.submit(rid, None, Handle(rid), pin, self.now)
        except (InvalidRank, DuplicateRequestId):
            pass
        else:
            raise AssertionError(f"rank {pin} accepted in a group of {self.n}")
        assert before == {r: self.routing.inflight_ids(r) for r in range(self.n)}

    @rule(rid=st.sampled_from(IDS))
    def abort(self, rid: str) -> None:
        self._client_abort(rid, None)

    @rule(data=st.data())
    def stream_drop(self, data: st.DataObject) -> None:
        """A stream (any submission, possibly long ended) closes."""
        if self.all_handles:
            handle = data.draw(st.sampled_from(self.all_handles))
            self._client_abort(handle.request_id, handle)

    @rule(k=st.integers(1, 9))
    def burst(self, k: int) -> None:
        """With no load reported, k unpinned submits over n up ranks spread evenly."""
        up = [r for r in range(self.n) if self._up(r)]
        if not up or any(
            self.routing.inflight_count(r)
            or self.routing.load(r).waiting
            or self.routing.load(r).running
            for r in up
        ):
            return
        capped = [self.caps[r] for r in up if self.caps[r] is not None]
        if capped:  # spread until the smallest cap, which then shapes the rest
            k = min(k, len(up) * min(c for c in capped if c is not None))
        picks = dict.fromkeys(up, 0)
        for _ in range(k):
            self.bursts += 1
            handle = self._submit(f"burst-{self.bursts}", None)
            assert handle is not None
            picks[self.live[handle.request_id].rank] += 1
        assert max(picks.values()) - min(picks.values()) <= 1, f"uneven burst {picks}"

    # -- engine rules (any incarnation, current or zombie) ----------------------------

    @precondition(lambda self: any(e.inbox for e in self._engines()))
    @rule(data=st.data())
    def engine_takes_input(self, data: st.DataObject) -> None:
        engines = [e for e in self._engines() if e.inbox]
        if not engines:
            return
        eng = data.draw(st.sampled_from(engines))
        kind, wid, handle = eng.inbox.popleft()
        if kind == "add":
            assert handle is not None
            assert wid not in eng.held, f"an ADD reused wire id {wid!r}, which the engine holds"
            eng.held[wid] = handle
        elif wid in eng.held:
            eng.outbox.append([Event("confirm", wid, eng.held.pop(wid))])

    @precondition(lambda self: any(e.held for e in self._engines()))
    @rule(data=st.data())
    def engine_emits(self, data: st.DataObject) -> None:
        engines = [e for e in self._engines() if e.held]
        if not engines:
            return
        eng = data.draw(st.sampled_from(engines))
        wid = data.draw(st.sampled_from(sorted(eng.held)))
        how = data.draw(
            st.sampled_from(
                ["output", "outputs", "terminal", "terminal+finished", "drop", "bad", "mixed"]
            )
        )
        handle = eng.held[wid]
        if how == "output":
            eng.outbox.append([Event("output", wid, handle)])
            return
        if how == "outputs":  # several steps' worth in one batch
            eng.outbox.append([Event("output", wid, handle) for _ in range(3)])
            return
        del eng.held[wid]
        if how == "terminal":
            eng.outbox.append([Event("terminal", wid, handle)])
        elif how == "drop":
            eng.outbox.append([Event("drop", wid, handle)])
        elif how == "bad":  # a malformed entry that names the request (§7)
            eng.outbox.append([Event("output", wid, handle), Event("bad", wid, handle)])
        elif how == "mixed":  # observation 5: a good terminal plus an unusable bad entry
            eng.outbox.append([Event("terminal", wid, handle), Event("bad", None, None)])
        else:
            eng.outbox.append([Event("terminal", wid, handle), Event("dup", wid, handle)])

    @precondition(lambda self: any(len(e.outbox) >= 2 for e in self._engines()))
    @rule(data=st.data())
    def engine_merges_batches(self, data: st.DataObject) -> None:
        """An engine sends what it has queued as one batch, in order: batches grow long
        (longer than `slice_entries`), and a `dead` can come with entries."""
        engines = [e for e in self._engines() if len(e.outbox) >= 2]
        if engines:
            eng = data.draw(st.sampled_from(engines))
            first = eng.outbox.popleft()
            eng.outbox[0] = first + eng.outbox[0]

    @rule(data=st.data())
    def zombie_steals_input(self, data: st.DataObject) -> None:
        """Revision 1's hazard: a RESYNCed engine that kept its input socket shares the
        pipe with its next incarnation, so an old task can take a new request's ADD."""
        thieves = [z for z in self.zombies if (c := self.current[z.rank]) is not None and c.inbox]
        if thieves:
            zombie = data.draw(st.sampled_from(thieves))
            victim = self.current[zombie.rank]
            assert victim is not None
            zombie.inbox.append(victim.inbox.popleft())

    @rule(data=st.data())
    def engine_announces_dead(self, data: st.DataObject) -> None:
        engines = self._engines()
        if engines:
            eng = data.draw(st.sampled_from(engines))
            if eng.outbox and data.draw(st.booleans(), label="with the last batch"):
                eng.outbox[-1] = [*eng.outbox[-1], Event("dead", None, None)]
            else:
                eng.outbox.append([Event("dead", None, None)])

    @rule(data=st.data(), rid=st.sampled_from(["ghost", *IDS]))
    def engine_sends_garbage_ids(self, data: st.DataObject, rid: str) -> None:
        """A buggy engine names a wire id nobody issued (an application id is not one)."""
        engines = self._engines()
        if engines:
            eng = data.draw(st.sampled_from(engines))
            eng.outbox.append([Event("ghost", rid, None)])

    def _receivable(self) -> list[Incarnation]:
        """The engines whose next batch the model lets the dispatcher take now: any, or,
        while a long batch of one rank is in hand, those of other ranks whose next batch
        is short: it applies at once, ahead of the rest of that long batch (one rank's
        long batch holds up no other rank)."""
        engines = [e for e in self._engines() if e.outbox]
        pending = self.pending
        if pending is None:
            return engines
        k = self.core.slice_entries
        return [
            e
            for e in engines
            if e.rank != pending.eng.rank and sum(ev.kind != "dead" for ev in e.outbox[0]) <= k
        ]

    @precondition(lambda self: bool(self._receivable()))
    @rule(data=st.data())
    def client_receives(self, data: st.DataObject) -> None:
        """The dispatcher takes one batch; a long one (more than `slice_entries`
        entries) is applied slice by slice, and the rest may wait while other rules run
        (`client_continues`), as the dispatcher checkpoints between slices."""
        engines = self._receivable()
        if not engines:
            return
        eng = data.draw(st.sampled_from(engines))
        events = eng.outbox.popleft()
        rank = eng.rank
        current = self.current[rank] is eng
        dead = any(ev.kind == "dead" for ev in events)
        events = [ev for ev in events if ev.kind != "dead"]
        out_kinds = ("bad", "output", "terminal", "ghost")
        out_events = [ev for ev in events if ev.kind in out_kinds]
        fin_events = [ev for ev in events if ev.kind not in out_kinds]  # drop, confirm, dup
        outputs: list[dict[str, Any]] = []
        for ev in out_events:
            if ev.kind == "bad":
                outputs.append({"id": ev.wire_id, "finish": 3} if ev.wire_id else {"x": 1})
            else:
                finish = "stop" if ev.kind != "output" else None
                outputs.append({"id": ev.wire_id, "body": 1, "finish": finish})
        batch: dict[str, Any] = {"rank": rank, "epoch": eng.epoch, "outputs": outputs}
        batch["finished"] = [ev.wire_id for ev in fin_events]
        # every batch reports load, so a zombie's would show if it were applied
        batch["load"] = {"waiting": 9, "running": 9, "kv": 0.9}
        if dead:
            batch["dead"] = "going away"
        ordered = out_events + fin_events  # the order the core slices entries in
        k = self.core.slice_entries
        chunks = deque(ordered[i : i + k] for i in range(0, len(ordered), k)) or deque([[]])
        self.now += 0.001
        load_before = self.routing.load(rank)
        self.core.on_output([rank_identity(rank), cbor2.dumps(batch)], self.now)
        fx = self.core.take_effects()
        if not current:
            assert self.routing.load(rank) == load_before, "a stale batch's load was applied"
        pending = _Pending(eng, chunks, dead, set())
        self._check_slice(pending, fx)  # the rest, if any, comes with `client_continues`
        if pending.more:
            assert self.pending is None
            self.pending = pending

    @precondition(lambda self: self.pending is not None and self.pending.more)
    @rule()
    def client_continues(self) -> None:
        """The dispatcher applies the next slice of the batch it is on."""
        if self.pending is None or not self.pending.more:
            return
        self.now += 0.001
        self.core.advance(self.core.in_hand(), self.now)
        self._check_slice(self.pending, self.core.take_effects())

    def _check_slice(self, pending: _Pending, fx: Effects[Handle]) -> None:
        """Compare what the core did with one slice against the model's prediction."""
        eng = pending.eng
        rank = eng.rank
        chunk = pending.chunks.popleft()
        current = self.current[rank] is eng
        failed = pending.failed
        expect_deliver: list[tuple[Handle, str]] = []
        expect_end: list[tuple[Handle, Outcome]] = []

        def live(ev: Event) -> bool:
            entry = self.live.get(ev.truth.request_id) if ev.truth is not None else None
            return (
                current
                and entry is not None
                and entry.handle is ev.truth
                and entry.wire_id == ev.wire_id
                and ev.wire_id not in failed
            )

        # The core ends the requests named by a slice's malformed entries first (§7).
        for ev in chunk:
            if ev.kind == "bad" and ev.wire_id is not None and live(ev):
                assert ev.truth is not None
                expect_end.append((ev.truth, Outcome.PROTOCOL_ERROR))
                failed.add(ev.wire_id)
        for ev in chunk:
            if ev.kind in ("output", "terminal") and live(ev):
                assert ev.truth is not None
                expect_deliver.append((ev.truth, ev.truth.request_id))
                if ev.kind == "terminal":
                    expect_end.append((ev.truth, Outcome.FINISHED))
                    failed.add(str(ev.wire_id))  # no longer live
            elif ev.kind == "drop" and live(ev):
                assert ev.truth is not None
                expect_end.append((ev.truth, Outcome.TRUNCATED))
                failed.add(str(ev.wire_id))
        last = not pending.chunks
        in_hand = self.core.in_hand()
        more = rank in in_hand
        if current and not last:
            assert more, f"rank {rank}: a long batch stopped after a slice"
        else:
            assert not more, f"rank {rank}: slices left in a batch that is over"
        other = self.pending
        others = {other.eng.rank} if other is not None and other is not pending else set()
        want = ({rank} if more else set()) | others
        assert set(in_hand) == want, f"in hand: {in_hand}, expected the long batches of {want}"
        died = (rank, False) in fx.ranks
        if pending.dead and current and last:
            assert died, f"rank {rank} announced dead, nothing happened"
        else:
            assert not died, (
                f"rank {rank} killed by a batch of {'its current' if current else 'a dead'}"
                " incarnation with only entry errors"
            )
        got = [(h, o.request_id) for h, o in fx.deliveries]
        assert got == expect_deliver, f"delivered {got}, expected {expect_deliver}"
        ended = [(e.handle, e.outcome) for e, _ in fx.ended if e.outcome is not Outcome.FAILED]
        assert ended == expect_end, f"ended {ended}, expected {expect_end}"
        for handle, outcome in expect_end:
            self._record_end(handle, outcome, outcome)
        pending.more = more
        if not more and self.pending is pending:
            self.pending = None
        if died:
            self._check_death(rank, fx)
        else:
            assert not [e for e, _ in fx.ended if e.outcome is Outcome.FAILED]

    # -- rank lifecycle ---------------------------------------------------------------

    @precondition(lambda self: self.pending is not None and self.pending.more)
    @rule()
    def rank_dies_mid_batch(self) -> None:
        """The rank whose long batch the dispatcher is on dies between two slices (a
        send to it failed, it said HELLO again): the rest must not apply."""
        assert self.pending is not None
        self._kill(self.pending.eng.rank)

    @rule(r=st.integers(0, MAX_RANKS - 1))
    def rank_dies(self, r: int) -> None:
        """Declared dead (silence, rejoin, send failure): the process may live on as a
        zombie of the old epoch until its RESYNC takes effect."""
        self._kill(self._rank(r))

    def _kill(self, rank: int) -> None:
        if self.current[rank] is None:
            return
        self.core.on_rank_dead(rank, "dead: test")
        self._check_death(rank, self.core.take_effects())

    def _check_death(self, rank: int, fx: Effects[Handle]) -> None:
        """`rank`'s current incarnation was declared dead in `fx`: each of its live
        requests ends FAILED once, it is RESYNCed, and the rest of a batch of it in hand
        is dropped (it would apply to the next incarnation)."""
        eng = self.current[rank]
        assert eng is not None
        expected = {e.handle for e in self.live.values() if e.rank == rank}
        assert fx.closed is None and (rank, False) in fx.ranks
        assert fx.forgets == [(rank, True, eng.epoch)]
        failed = [(e, error) for e, error in fx.ended if e.outcome is Outcome.FAILED]
        assert {e.handle for e, _ in failed} == expected
        for e, error in failed:
            assert isinstance(error, EngineDead) and error.rank == rank
            self._record_end(e.handle, e.outcome, Outcome.FAILED)
        assert rank not in self.core.in_hand(), f"rank {rank} died, its batch is still in hand"
        if self.pending is not None and self.pending.eng is eng:
            self.pending = None
        self.current[rank] = None
        self.zombies.append(eng)
        self.last_seq[rank] = None

    @rule(r=st.integers(0, MAX_RANKS - 1))
    def rank_rejoins(self, r: int) -> None:
        rank = self._rank(r)
        if self.current[rank] is None:
            self._bring_up(rank)

    @precondition(lambda self: bool(self.zombies))
    @rule(data=st.data())
    def zombie_exits(self, data: st.DataObject) -> None:
        if self.zombies:
            self.zombies.remove(data.draw(st.sampled_from(self.zombies)))

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
        expect = self._up(rank) and (seq is None or last is None or seq >= last)
        assert applied == expect, f"seq {seq} after {last}: applied={applied}"
        if applied:
            if seq is not None:
                self.last_seq[rank] = seq
            stored = self.routing.load(rank)
            empty = not any(e.rank == rank for e in self.live.values())
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
            want = {e.wire_id for e in self.live.values() if e.rank == rank}
            assert ids == want, f"rank {rank} holds {set(ids)}, live there: {want}"
            assert not ids & seen, f"ids {ids & seen} are in two in-flight sets"
            seen |= ids
            if not self._up(rank):
                assert not ids, f"down rank {rank} holds {set(ids)}"
        assert len(self.core.book) == len(self.live)

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
        live = {e.handle for e in self.live.values()}
        for handle in self.all_handles:
            assert len(self.ends.get(handle, [])) == (0 if handle in live else 1), handle
