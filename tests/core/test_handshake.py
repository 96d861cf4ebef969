"""The sans-IO handshakes of both wires (`_core/handshake.py` natively,
`zmqdp/vllm/handshake.py`): their rules, counters, the forgets that name an incarnation,
and the rank-up record each builds.

`VllmHandshake` is also a Hypothesis state machine: HELLO, READY and ready responses in
any order, rejoins and deaths; a rank is up exactly when its READY and its ready
response both came after its latest HELLO, and `missing()` names exactly the ranks not
up. A broken variant (up on READY alone) must be caught."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from zmqdp._core.handshake import (
    MAX_REJECTIONS_KEPT,
    HandshakeState,
    RankPhase,
    RankUp,
    rank_identity,
)
from zmqdp._core.messages import Hello, Reject
from zmqdp.vllm.handshake import VllmHandshake

N = 3


class UpOnReadyAlone(VllmHandshake):
    """Mutant: treats READY as enough (forgets the ready response on the input socket,
    before which vLLM's frontend ROUTER cannot route to the engine)."""

    def on_ready(self, identity: bytes, msg: dict[str, Any]) -> int | None:
        rank = super().on_ready(identity, msg)
        r = self._rank(identity)
        if rank is None and r is not None and self.ranks[r].ready is not None:
            self.ranks[r].response = self.ranks[r].response or {}
            return self._maybe_up(r)
        return rank


def machine(cls: type[VllmHandshake]) -> type[RuleBasedStateMachine]:
    class HandshakeMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.hs = cls(N, lambda r: b"init", lockstep=False)
            self.model: list[dict[str, bool]] = [
                {"hello": False, "ready": False, "resp": False} for _ in range(N)
            ]

        @rule(r=st.integers(0, N - 1))
        def hello(self, r: int) -> None:
            v = self.hs.on_hello(rank_identity(r), {"status": "HELLO"})
            assert v.rank == r and v.reply == b"init"
            self.model[r] = {"hello": True, "ready": False, "resp": False}

        @rule(r=st.integers(0, N - 1))
        def ready(self, r: int) -> None:
            self.hs.on_ready(rank_identity(r), {"status": "READY"})
            if self.model[r]["hello"]:
                self.model[r]["ready"] = True

        @rule(r=st.integers(0, N - 1))
        def response(self, r: int) -> None:
            self.hs.on_ready_response(rank_identity(r), {"max_num_seqs": 8})
            if self.model[r]["hello"]:
                self.model[r]["resp"] = True

        @rule(r=st.integers(0, N - 1))
        def dies(self, r: int) -> None:
            self.hs.forget(r)
            self.model[r] = {"hello": False, "ready": False, "resp": False}

        @invariant()
        def up_iff_both_after_hello(self) -> None:
            for r, m in enumerate(self.model):
                assert self.hs.is_up(r) == (m["hello"] and m["ready"] and m["resp"]), (r, m)
            assert set(self.hs.missing()) == {r for r in range(N) if not self.hs.is_up(r)}

    return HandshakeMachine


TestVllmHandshake = machine(VllmHandshake).TestCase


def test_the_broken_variant_is_caught() -> None:
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine(UpOnReadyAlone))


def test_the_handshake_keeps_only_the_latest_rejections() -> None:
    """A peer can send any number of bad HELLOs; memory must not grow with them."""
    state = HandshakeState(1, "in", "out")
    for i in range(1000):
        state.on_hello(rank_identity(7), Hello(rank=7, size=1, lockstep=False, wave=i))
    assert state.rejections == 1000
    assert len(state.rejected) == MAX_REJECTIONS_KEPT and "rank 7" in state.rejected[-1]


def test_rejoins_soon_after_the_previous_hello_are_one_identity_conflict_episode() -> None:
    state = HandshakeState(1, "in", "out", conflict_window=30.0)
    hello = Hello(rank=0, size=1, lockstep=False)
    me = rank_identity(0)
    assert state.on_hello(me, hello, now=0.0).conflict is None  # the first HELLO
    assert state.on_hello(me, hello, now=2.0).conflict is None  # one quick restart: fine
    assert state.on_hello(me, hello, now=100.0).conflict is None  # and one more, later
    assert state.on_hello(me, hello, now=101.0).conflict is None  # ... and another
    verdict = state.on_hello(me, hello, now=101.5)  # three HELLOs in 1.5 s: two processes
    assert verdict.rejoin and verdict.conflict == 1.5
    assert state.on_hello(me, hello, now=102.0).conflict is None  # same episode: reported once
    assert state.identity_conflicts == 1 and state.rejoins[0] == 5
    assert state.on_hello(me, hello, now=200.0).conflict is None  # quiet for a window
    assert state.on_hello(me, hello, now=200.5).conflict is None
    assert state.on_hello(me, hello, now=201.0).conflict == 1.0  # a new episode
    assert state.identity_conflicts == 2


def test_the_handshake_records_each_ranks_version_and_its_guesses() -> None:
    warnings: list[tuple[int, str]] = []
    hs = VllmHandshake(2, lambda _r: b"init", on_warning=lambda r, w: warnings.append((r, w)))
    for rank, info in ((0, {"vllm_version": "0.32.0"}), (1, {})):
        ident = rank.to_bytes(2, "little")
        hs.on_hello(ident, {"status": "HELLO"})
        hs.on_ready_response(ident, info)
        hs.on_ready(ident, {"status": "READY"})
    assert [hs.version(0), hs.version(1)] == ["0.32", "0.33"]
    assert [r for r, _ in warnings] == [1]
    forced = VllmHandshake(1, lambda _r: b"init", version_override="0.32")
    forced.on_hello(b"\x00\x00", {"status": "HELLO"})
    forced.on_ready_response(b"\x00\x00", {"vllm_version": "0.33.0"})
    assert forced.version(0) == "0.32"


# -- forgets name their incarnation (issue 33) -----------------------------------------

ME = rank_identity(0)
HELLO = Hello(rank=0, size=1, lockstep=False, wave=3, max_message_size=4096)


def native_up(state: HandshakeState) -> int:
    state.on_hello(ME, HELLO)
    state.on_ready(ME, {"gpu": "a"})
    epoch = state.epoch(0)
    assert epoch is not None and state.on_register(ME, epoch)
    return epoch


def test_native_forget_of_an_older_incarnation_keeps_the_newer_handshake() -> None:
    state = HandshakeState(1, "in", "out", first_epoch=7)
    old = native_up(state)
    state.on_hello(ME, HELLO)  # a replacement: INIT sent
    assert state.superseded(0, old) and not state.forget(0, epoch=old)
    assert state.phase(0) is RankPhase.INIT_SENT and state.resync_due(0.0) == []
    assert state.forget(0, epoch=old + 1)  # its own incarnation's forget does
    assert state.phase(0) is RankPhase.MISSING and state.resync_due(0.0) == [0]
    # a second forget of an incarnation already forgotten changes nothing (no new RESYNC)
    assert not state.forget(0, epoch=old + 1) and state.resync_due(0.1) == []
    assert state.forget(0)  # None: whichever is current


def test_vllm_forget_of_an_older_incarnation_keeps_the_newer_handshake() -> None:
    hs = VllmHandshake(1, lambda _r: b"init")
    hs.on_hello(ME, {"status": "HELLO"})
    hs.on_ready_response(ME, {"vllm_version": "0.33.0"})
    assert hs.on_ready(ME, {"status": "READY"}) == 0
    assert hs.epoch(0) == 1
    hs.on_hello(ME, {"status": "HELLO"})
    assert hs.epoch(0) == 2 and not hs.forget(0, epoch=1)
    assert hs.awaits_response(ME) == 0  # the replacement's handshake stands
    hs.note_lost(0, 1, "the old one's connection closed")  # about a gone one: ignored
    assert hs.forget(0, epoch=2) and hs.missing() == {0: "no HELLO on the handshake socket"}


def test_vllm_a_loss_is_noted_for_the_timeout_not_forgotten() -> None:
    hs = VllmHandshake(1, lambda _r: b"init")
    hs.on_hello(ME, {"status": "HELLO"})
    hs.note_lost(0, 1, "its connection closed")
    assert hs.awaits_response(ME) == 0  # the core judges; the handshake is untouched
    assert hs.forget(0, epoch=1)
    assert hs.missing() == {0: "no HELLO on the handshake socket since its connection closed"}


def test_each_wire_builds_the_rank_up_record() -> None:
    state = HandshakeState(1, "in", "out", first_epoch=7)
    native_up(state)
    assert state.rank_up(0) == RankUp(0, 7, 3, 4096, {"gpu": "a"}, "2")
    hs = VllmHandshake(1, lambda _r: b"init", version_override="0.32")
    hs.on_hello(ME, {"status": "HELLO"})
    hs.on_ready_response(ME, {"max_num_seqs": 8})
    hs.on_ready(ME, {"status": "READY"})
    assert hs.rank_up(0) == RankUp(0, 1, info={"max_num_seqs": 8}, version="0.32")


def test_the_counters_are_the_state_machines() -> None:
    state = HandshakeState(1, "in", "out")
    state.on_ignored()
    reply = state.on_refused("rank 0 is served by another engine process")
    assert isinstance(reply, Reject) and (state.ignored, state.rejections) == (1, 1)
    hs = VllmHandshake(1, lambda _r: b"init")
    hs.on_ignored()
    assert hs.ignored == 1


# -- the contest, the refusal of a second process, restoring a route ---------------------


def test_a_hello_on_a_second_connection_is_held_while_the_incumbent_is_judged() -> None:
    state = HandshakeState(1, "in", "out")
    native_up(state)
    incumbent = frozenset({5})
    # nothing judges the incumbent (heartbeats off), or it is the same connection, or
    # the rank's connection is closed already: answered at once
    assert not state.contest(ME, HELLO, 6, 0.0, incumbent, None)
    assert not state.contest(ME, HELLO, 5, 0.0, incumbent, 3.5)
    assert not state.contest(ME, HELLO, 6, 0.0, frozenset(), 3.5)
    bad = Hello(rank=0, size=2, lockstep=False)  # REJECTed at once: a rejoin
    assert not state.contest(ME, bad, 6, 0.0, incumbent, 3.5)
    assert state.contest(ME, HELLO, 6, 0.0, incumbent, 3.5) and state.holds(0)
    open_fds = {5, 6}
    # within the deadline, with both open: nothing is decided
    settled = state.settle(1.0, open_fds.__contains__, lambda _r: incumbent)
    assert (settled.admit, settled.refuse, settled.next_at) == ([], [], 3.5)
    # the incumbent closed: a restart, admitted
    settled = state.settle(2.0, open_fds.__contains__, lambda _r: frozenset())
    assert [h.fd for h in settled.admit] == [6] and not state.holds(0)


def test_a_second_live_process_is_refused_and_counted() -> None:
    state = HandshakeState(1, "in", "out")
    native_up(state)
    assert state.contest(ME, HELLO, 6, 0.0, frozenset({5}), 3.5)
    settled = state.settle(3.5, lambda _fd: True, lambda _r: frozenset({5}))
    [(held, reply)] = settled.refuse
    assert held.fd == 6 and b"another engine process" in reply
    assert (state.identity_conflicts, state.rejections) == (1, 1)
    assert state.phase(0) is RankPhase.UP  # the incumbent keeps the rank
    # a newcomer that left before the verdict is dropped, and refused nothing
    assert state.contest(ME, HELLO, 7, 4.0, frozenset({5}), 3.5)
    settled = state.settle(5.0, lambda fd: fd != 7, lambda _r: frozenset({5}))
    assert (settled.admit, settled.refuse) == ([], []) and not state.holds(0)


def test_the_third_unanswered_resync_restores_the_route_and_a_hello_resets_it() -> None:
    state = HandshakeState(1, "in", "out")
    assert [state.resync_sent(0) for _ in range(4)] == [False, False, True, False]
    state.on_hello(ME, HELLO)
    assert [state.resync_sent(0) for _ in range(3)] == [False, False, True]


def test_only_displaced_connections_are_ended() -> None:
    owner = {3: 0, 4: None}.get
    is_open = {3, 4}.__contains__
    assert HandshakeState.displaced([5, 4, 3], is_open, owner, unroutable=False) == [4]
    assert HandshakeState.displaced([5, 4, 3], is_open, owner, unroutable=True) == [3, 4]
