"""A property of long batches in the core, as a function of the core class, so that
`test_mutants.py` can run it against broken variants too.

A batch with more entries than `GroupCore.slice_entries` is applied in slices, and the
dispatcher checkpoints between them, so other things happen in between: here the rank
may die (and come back) after any slice, and the application may abort any request.
What must hold, whatever the slice size:

* the slices together deliver exactly what applying the batch whole would (same
  outputs, same order, same endings), as long as nothing happens in between;
* after the rank's incarnation ended, nothing more of the batch applies: no delivery,
  no ending, and above all no `dead` (it would kill the next incarnation);
* an abort in between makes that request's later entries late, never delivered.
"""

from __future__ import annotations

from typing import Any

import cbor2
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdp._core.handshake import rank_identity
from zmqdp._core.requests import Outcome
from zmqdp._core.state import GroupCore

EPOCH = 7
REQUESTS = ["a", "b", "c"]

entries = st.lists(
    st.tuples(st.sampled_from([*REQUESTS, "stray"]), st.sampled_from(["out", "end", "drop"])),
    min_size=1,
    max_size=12,
)


def _core(core_cls: type[GroupCore[Any]], slice_entries: int) -> GroupCore[str]:
    core: GroupCore[str] = core_cls(1, lockstep=False)
    core.slice_entries = slice_entries
    core.rank_up(0, 0.0, epoch=EPOCH)
    for rid in REQUESTS:
        core.submit(rid, None, rid, None, 0.0)
    return core


def _body(core: GroupCore[str], batch: list[tuple[str, str]], dead: bool) -> bytes:
    def wid(rid: str) -> str:
        if rid == "stray":
            return "zz#1"  # never issued
        return core.book.wire_id(rid) or f"{rid}#99"  # a request that ended: late

    outputs = [
        {"id": wid(rid), "body": i, "finish": "stop" if kind == "end" else None}
        for i, (rid, kind) in enumerate(batch)
        if kind != "drop"
    ]
    finished = [wid(rid) for rid, kind in batch if kind == "drop"]
    body: dict[str, Any] = {"rank": 0, "epoch": EPOCH, "outputs": outputs, "finished": finished}
    if dead:
        body["dead"] = "bye"
    return cbor2.dumps(body)


def _effects(results: list[Any]) -> tuple[list[tuple[str, Any]], list[tuple[str, Outcome]]]:
    delivered: list[tuple[str, Any]] = []
    ended: list[tuple[str, Outcome]] = []
    for result in results:
        if result.effects is not None:
            delivered += [(h, out.body) for h, out in result.effects.deliveries]
            ended += [(e.handle, e.outcome) for e in result.effects.ended]
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
    )
    def prop(
        batch: list[tuple[str, str]],
        dead: bool,
        k: int,
        kill_after: int | None,
        abort_after: tuple[int, str] | None,
    ) -> None:
        whole = _core(core_cls, 1 << 20)
        result = whole.on_message([rank_identity(0), _body(whole, batch, dead)], 1.0)[1]
        assert result.rest is None
        want_delivered, want_ended = _effects([result])

        core = _core(core_cls, k)
        result = core.on_message([rank_identity(0), _body(core, batch, dead)], 1.0)[1]
        results = [result]
        killed: int | None = None  # results applied before the rank died
        aborted: tuple[str, int] | None = None  # (request, deliveries before its abort)
        slice_no = 0
        while result.rest is not None:
            if kill_after == slice_no:
                assert core.rank_down(0, "died between slices") is not None
                core.rank_up(0, 1.0, epoch=EPOCH + 1)  # and came back at once
                killed = len(results)
            elif (
                abort_after is not None
                and abort_after[0] == slice_no
                and core.abort(abort_after[1], abort_after[1]) is not None
            ):
                aborted = abort_after[1], len(_effects(results)[0])
            result = core.continue_batch(result.rest, 1.0)
            results.append(result)
            slice_no += 1
        delivered, ended = _effects(results)
        if killed is not None:
            after = results[killed:]
            assert _effects(after) == ([], []), "a slice applied after its rank died"
            assert all(r.dead is None for r in after), "a dead incarnation's `dead` applied"
            return
        if aborted is not None:
            request, before = aborted
            assert all(h != request for h, _ in delivered[before:]), "delivered after its abort"
            return
        assert delivered == want_delivered, (
            f"slices delivered {delivered}, expected {want_delivered}"
        )
        assert ended == want_ended, f"slices ended {ended}, expected {want_ended}"
        assert (results[-1].dead is not None) == dead

    return prop
