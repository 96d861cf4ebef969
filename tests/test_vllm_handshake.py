"""`VllmHandshake` as a Hypothesis state machine: HELLO, READY and ready responses in any
order, rejoins and deaths; a rank is up exactly when its READY and its ready response
both came after its latest HELLO, and `missing()` names exactly the ranks not up. A
broken variant (up on READY alone) must be caught."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from zmqdp.vllm.codec import rank_identity
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
