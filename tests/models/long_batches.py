"""A property of long batches in the core, as a function of the core class, so that
`test_mutants.py` can run it against broken variants too.

A batch with more entries than `GroupCore.slice_entries` is applied in slices, and the
dispatcher checkpoints between them, so other things happen in between: here the rank
may die (and come back) after any slice, the application may abort any request, and
the rank's next messages arrive (they wait behind the long batch, `held_limit`). The
property drives the core as the dispatcher does: `on_output`, then `advance` of what
is `in_hand`, reading `take_effects()`. What must hold, whatever the slice size:

* the slices, and the messages held behind them, together deliver exactly what
  applying each message whole, in order, would (same outputs, same order, same
  endings), as long as nothing happens in between;
* after the rank's incarnation ended, nothing more of the batch applies: no delivery,
  no ending, and above all no `dead` (it would kill the next incarnation);
* an abort in between makes that request's later entries late, never delivered;
* the bytes held behind a long batch count against `held_limit`: once they pass it,
  the rank is dead, and nothing held is ever applied.
"""

from __future__ import annotations

import math
from typing import Any

import cbor2
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdp._core.effects import Effects
from zmqdp._core.handshake import RankUp, rank_identity
from zmqdp._core.requests import Outcome
from zmqdp._core.state import GroupCore

EPOCH = 7
REQUESTS = ["a", "b", "c"]
BEHIND = 1000
"""Output bodies of the messages sent behind the long batch start here."""

entries = st.lists(
    st.tuples(st.sampled_from([*REQUESTS, "stray"]), st.sampled_from(["out", "end", "drop"])),
    min_size=1,
    max_size=12,
)


def _core(core_cls: type[GroupCore[Any]], slice_entries: int, held_limit: int) -> GroupCore[str]:
    core: GroupCore[str] = core_cls(1, lockstep=False, held_limit=held_limit)
    core.slice_entries = slice_entries
    core.on_rank_up(RankUp(0, EPOCH), 0.0)
    for rid in REQUESTS:
        core.submit(rid, None, rid, None, 0.0)
    core.take_effects()
    return core


def _frames(
    batch: list[tuple[str, str]], dead: bool, first_body: int = 0, epoch: int = EPOCH
) -> list[bytes]:
    """An output message of rank 0 (wire ids as `_core` issued them: a#0, b#1, c#2)."""

    def wid(rid: str) -> str:
        return "zz#1" if rid == "stray" else f"{rid}#{REQUESTS.index(rid)}"  # zz: never issued

    outputs = [
        {"id": wid(rid), "body": first_body + i, "finish": "stop" if kind == "end" else None}
        for i, (rid, kind) in enumerate(batch)
        if kind != "drop"
    ]
    finished = [wid(rid) for rid, kind in batch if kind == "drop"]
    body: dict[str, Any] = {"rank": 0, "epoch": epoch, "outputs": outputs, "finished": finished}
    if dead:
        body["dead"] = "bye"
    return [rank_identity(0), cbor2.dumps(body)]


def _death(fx: Effects[str]) -> str | None:
    causes = [m for _, _, m in fx.logs if m.startswith("rank 0: dead: ")]
    assert len(causes) <= 1, f"rank 0 declared dead twice: {causes}"
    return causes[0] if causes else None


def _effects(fxs: list[Effects[str]]) -> tuple[list[tuple[str, Any]], list[tuple[str, Outcome]]]:
    delivered: list[tuple[str, Any]] = []
    ended: list[tuple[str, Outcome]] = []
    for fx in fxs:
        delivered += [(h, out.body) for h, out in fx.deliveries]
        ended += [(e.handle, e.outcome) for e, _ in fx.ended if e.outcome is not Outcome.FAILED]
    return delivered, ended


def check_long_batches(core_cls: type[GroupCore[Any]], hunt: settings | None = None) -> Any:
    """The property as a Hypothesis test of `core_cls` (call the result to run it),
    with the `hunt` settings if given."""

    @settings(hunt or settings(), deadline=None)
    @given(
        batch=entries,
        dead=st.booleans(),
        k=st.integers(1, 4),
        kill_after=st.none() | st.integers(0, 5),
        abort_after=st.none() | st.tuples(st.integers(0, 5), st.sampled_from(REQUESTS)),
        behind=st.lists(st.tuples(st.integers(0, 5), entries), max_size=3),
        held_limit=st.none() | st.integers(0, 400),
    )
    def prop(
        batch: list[tuple[str, str]],
        dead: bool,
        k: int,
        kill_after: int | None,
        abort_after: tuple[int, str] | None,
        behind: list[tuple[int, list[tuple[str, str]]]],
        held_limit: int | None,
    ) -> None:
        limit = 1 << 30 if held_limit is None else held_limit
        behind.sort(key=lambda b: b[0])  # (a stable sort: the order they are sent in)
        later = [  # (each at most k entries: short, so only the first batch is long)
            _frames(entries[:k], False, BEHIND + 100 * i) for i, (_, entries) in enumerate(behind)
        ]

        # What applying each message whole, in order, does.
        whole = _core(core_cls, 1 << 20, limit)
        whole.on_output(_frames(batch, dead), 1.0)
        assert not whole.has_work()
        for frames in later:
            whole.on_output(frames, 1.0)
        want = whole.take_effects()
        want_delivered, want_ended = _effects([want])

        core = _core(core_cls, k, limit)
        core.on_output(_frames(batch, dead), 1.0)
        fxs = [core.take_effects()]
        slices = math.ceil(len(batch) / k)  # the first is applied at once
        killed: int | None = None  # effects taken before the rank died
        aborted: tuple[str, int] | None = None  # (request, deliveries before its abort)
        held: list[int] = []  # the bytes of each message held behind the batch
        overflow: int | None = None  # effects taken before the hold queue overflowed
        sent = 0
        slice_no = 0
        while core.has_work():
            assert killed is None, "a long batch still in hand after its rank died"
            assert overflow is None, "a long batch still in hand after its rank died"
            assert slice_no + 1 < slices, f"{slices} slices of {k}, and more in hand"
            assert core.in_hand() == [0]
            if kill_after == slice_no:
                core.on_rank_dead(0, "died between slices")
                core.on_rank_up(RankUp(0, EPOCH + 1), 1.0)  # and came back at once
                fxs.append(core.take_effects())
                killed = len(fxs)
            elif (
                abort_after is not None
                and abort_after[0] == slice_no
                and core.on_abort(abort_after[1], abort_after[1]) is not None
            ):
                aborted = abort_after[1], len(_effects(fxs)[0])
                fxs.append(core.take_effects())
            while killed is None and sent < len(later) and behind[sent][0] <= slice_no:
                core.on_output(later[sent], 1.0)  # it arrives while the batch is in hand
                fxs.append(core.take_effects())
                held.append(len(later[sent][1]) + 2)
                sent += 1
                if sum(held) > limit:
                    cause = _death(fxs[-1])
                    assert cause is not None and "faster than its batches" in cause, (
                        f"{sum(held)} bytes held behind a long batch, past held_limit="
                        f"{limit}, and the rank is not dead"
                    )
                    overflow = len(fxs)
                    break
                assert _death(fxs[-1]) is None, f"dead with {sum(held)} bytes held, limit {limit}"
            core.advance(core.in_hand(), 1.0)
            fxs.append(core.take_effects())
            slice_no += 1
        for frames in later[sent:]:
            core.on_output(frames, 1.0)  # after the batch: applied at once
            fxs.append(core.take_effects())
        delivered, ended = _effects(fxs)
        if killed is not None:
            after = fxs[killed:]
            assert _effects(after) == ([], []), "a slice applied after its rank died"
            assert all(_death(fx) is None for fx in after), "a dead incarnation's `dead` applied"
            return
        if overflow is not None:
            assert all(body < BEHIND for _, body in delivered), (
                f"a message held behind a long batch was applied after its rank died: {delivered}"
            )
        if aborted is not None:
            request, before = aborted
            assert all(h != request for h, _ in delivered[before:]), "delivered after its abort"
            return
        if overflow is not None:
            assert delivered == want_delivered[: len(delivered)], (
                f"slices delivered {delivered}, expected a prefix of {want_delivered}"
            )
            return
        assert delivered == want_delivered, (
            f"slices delivered {delivered}, expected {want_delivered}"
        )
        assert ended == want_ended, f"slices ended {ended}, expected {want_ended}"
        assert (any(_death(fx) for fx in fxs)) == (_death(want) is not None) == dead

    return prop
