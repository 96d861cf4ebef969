"""The stream interval (`ConnectOptions.stream_interval`, `stream_max_delay`): outputs
held on the dispatcher's side until k are waiting or their time comes, the first and the
terminal output and the end of the request at once, nothing merged, reordered, dropped.

A property over interleavings of deliveries, the clock, the consumer and the request's
end, on `RequestStream.deliver_all_held` / `release_due` / `finish` as the carrier and
the dispatcher call them; then the same through a group on each wire and from asyncio.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.fakes.threaded import RUNNERS, EngineThread, Run, loop_runner, url_in
from tests.fakes.threaded import wait_until as threaded_wait_until
from zmqdp import EngineDead, InvalidRequest, Output, Request, RequestAborted, RequestStream
from zmqdp._core.requests import Outcome
from zmqdp.aio import AsyncioEngineGroup

from .helpers import READY_TIMEOUT, group_of, wait_until
from .test_vllm_group import req, vllm_group

# -- the rule, with time as a value -------------------------------------------------------

Step = tuple[str, int, int]  # (action, stream, argument)

steps = st.lists(
    st.one_of(
        st.tuples(st.just("out"), st.integers(0, 2), st.integers(1, 3)),  # k outputs
        st.tuples(st.just("last"), st.integers(0, 2), st.just(0)),  # the terminal one
        st.tuples(st.just("tick"), st.just(0), st.integers(0, 30)),  # the clock moves
        st.tuples(st.just("read"), st.integers(0, 2), st.just(0)),  # the consumer drains
        st.tuples(st.just("end"), st.integers(0, 2), st.just(0)),  # ends without a last
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(steps, st.integers(1, 5), st.sampled_from([None, 10, 25]), st.sampled_from([None, 6]))
@example(  # a flush and a new hold in one step: held from then (the model was too strict)
    [("out", 0, 2), ("tick", 0, 13), ("out", 0, 2), ("tick", 0, 12)], 2, 25, None
)
def test_nothing_is_lost_reordered_merged_or_held_too_long(
    script: list[Step], interval: int, delay: int | None, limit: int | None
) -> None:
    """The carrier's and the dispatcher's calls in any order: the consumer sees every
    output once, in order, each as delivered; the first and terminal ones, and all
    before them, the moment they are delivered; an end after everything; nothing held
    k outputs deep or past its time; a stream woken (dirty) only when it got some."""
    streams = [RequestStream._create(f"r{i}", lambda s: None, limit) for i in range(3)]
    for s in streams:
        s._interval = interval
    holding: dict[RequestStream, float] = {}
    sent: list[list[Output]] = [[] for _ in streams]
    seen: list[list[Output]] = [[] for _ in streams]
    overflowed = [False] * 3
    ended = [False] * 3
    held_since: list[float | None] = [None] * 3
    held_first: list[Output | None] = [None] * 3  # the first held output held_since is of
    now = 0.0
    for action, i, arg in script:
        s = streams[i]
        dirty: set[RequestStream] = set()
        if action in ("out", "last") and not ended[i]:
            outs = [Output(s.request_id, (i, len(sent[i]) + j)) for j in range(arg)]
            if action == "last":
                outs = [Output(s.request_id, (i, len(sent[i])), "stop")]
            before = len(s._buffer or ())
            full = RequestStream.deliver_all_held(
                [(s, o) for o in outs], dirty, [], holding, now + (delay or math.inf)
            )
            taken = len(outs) - len(full)
            grew = len(s._buffer or ()) > before
            assert (s in dirty) == grew  # woken only when it got something to read
            sent[i] += outs[:taken]
            if full:  # the carrier ends an overflowing request
                overflowed[i] = True
                s.finish(Outcome.FAILED, EngineDead(0, "overflow", s.request_id))
                holding.pop(s, None)
                ended[i] = True
            elif action == "last":
                s.finish(Outcome.FINISHED)
                holding.pop(s, None)
                ended[i] = True
            if taken and len(sent[i]) == taken:  # its first output: at once
                assert s._buffer and s._buffer[0] is outs[0]
            if action == "last" and not full:  # everything up to the last one: at once
                assert not s._held and s._buffer and s._buffer[-1] is outs[0]
        elif action == "tick":
            now += arg
            RequestStream.release_due(holding, now, dirty)
        elif action == "read":
            try:
                seen[i] += s.drain_nowait()
            except (trio.EndOfChannel, EngineDead):
                assert ended[i]
        elif action == "end" and not ended[i]:
            s.finish(Outcome.FAILED, EngineDead(0, "gone", s.request_id))
            holding.pop(s, None)
            ended[i] = True
        for j, t in enumerate(streams):
            held = t._held or []
            if held and (held_since[j] is None or held[0] is not held_first[j]):
                # held from now: also when a step flushed what was held and held anew
                held_since[j], held_first[j] = now, held[0]
            elif not held:
                held_since[j] = None
            assert len(held) < interval  # never k deep
            assert (t in holding) == bool(held)  # held iff the dispatcher will release it
            if held and delay is not None:
                since = held_since[j]
                assert since is not None and now < since + delay  # never held past its time
            if action == "tick" and t in dirty:
                assert t._buffer
        assert all(s in holding for s in streams if s._held)
    for i, s in enumerate(streams):
        if not ended[i]:
            s.finish(Outcome.FAILED, EngineDead(0, "closed", s.request_id))
        seen[i] += list(s._buffer or ())
        assert not s._held
        assert seen[i] == sent[i]  # once each, in order, unmerged (the same objects)
        assert all(a is b for a, b in zip(seen[i], sent[i], strict=True))


def test_an_interval_of_one_holds_nothing() -> None:
    s = RequestStream._create("r", lambda _: None)
    holding: dict[RequestStream, float] = {}
    dirty: set[RequestStream] = set()
    RequestStream.deliver_all_held([(s, Output("r", i)) for i in range(3)], dirty, [], holding, 1)
    assert list(s._buffer or ()) == [Output("r", i) for i in range(3)] and not holding


# -- through a group ---------------------------------------------------------------------


def taken(stream: RequestStream, seen: list[list[Any]]) -> int:
    """The outputs the dispatcher gave `stream`: read (`seen`), buffered or held."""
    return sum(map(len, seen)) + len(stream._buffer or ()) + len(stream._held or ())


async def _batches(stream: RequestStream) -> list[list[Any]]:
    got: list[list[Any]] = []
    while True:
        try:
            got.append([out.body for out in await stream.receive_batch()])
        except trio.EndOfChannel:
            return got


async def test_native_outputs_are_held_until_k_then_the_last_at_once(tmp_path: Path) -> None:
    """Played by hand on a scripted rank: which outputs the consumer can see after each
    batch the dispatcher read."""
    with trio.fail_after(20):
        async with (
            group_of(tmp_path, 1, stream_interval=3, stream_max_delay=None) as (
                group,
                (engine,),
            ),
            group.submit(Request("r", {"hold": True})) as stream,
        ):
            await wait_until(lambda: engine.holds("r"))
            wid = engine.wire("r")
            seen: list[list[Any]] = []
            for i, finish in enumerate([None] * 6 + ["length"]):
                await engine.emit((Output(wid, i, finish),))
                await wait_until(lambda n=i + 1: taken(stream, seen) == n)
                seen.append([out.body for out in stream.drain_nowait()])
            assert seen == [[0], [], [], [1, 2, 3], [], [], [4, 5, 6]]
            with pytest.raises(trio.EndOfChannel):
                stream.drain_nowait()


async def test_a_held_output_waits_stream_max_delay_at_most(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with (
            group_of(tmp_path, 1, stream_interval=100, stream_max_delay=0.2) as (
                group,
                (engine,),
            ),
            group.submit(Request("r", {"hold": True})) as stream,
        ):
            await wait_until(lambda: engine.holds("r"))
            wid = engine.wire("r")
            await engine.emit((Output(wid, 0),))
            assert [o.body for o in await stream.receive_batch()] == [0]
            sent = trio.current_time()
            await engine.emit((Output(wid, 1),))
            assert [o.body for o in await stream.receive_batch()] == [1]
            assert trio.current_time() - sent >= 0.2  # it was held, not lost


@pytest.mark.parametrize("end", ["dead", "abort"])
async def test_a_request_that_ends_while_outputs_are_held_ends_once(
    tmp_path: Path, end: str
) -> None:
    """Its held outputs come before its error, its end is counted once, nothing stays
    held."""
    with trio.fail_after(20):
        async with group_of(tmp_path, 1, stream_interval=5, stream_max_delay=None) as (
            group,
            (engine,),
        ):
            async with group.submit(Request("r", {"hold": True})) as stream:
                await wait_until(lambda: engine.holds("r"))
                wid = engine.wire("r")
                for i in range(3):
                    await engine.emit((Output(wid, i),))
                await wait_until(lambda: taken(stream, []) == 3)
                assert [o.body for o in stream.drain_nowait()] == [0]  # 1, 2 held
                if end == "dead":
                    await engine.emit(dead="the test killed it")
                    error: type[Exception] = EngineDead
                else:
                    await group.abort("r")
                    error = RequestAborted
                got = []
                with pytest.raises(error):
                    async for out in stream:
                        got.append(out.body)
                assert got == [1, 2]
            assert group._dispatcher._holding == {}
            stats = group.statistics()
            assert stats.ranks[0].inflight == 0
            assert stats.finished == 0 and stats.failed + stats.aborted == 1


async def test_vllm_wire_tokens_come_k_outputs_per_wake() -> None:
    """On vLLM's wire (fake engines, one token per step): the consumer's batches end at
    the first output, then every third, and the concatenation is every token."""
    with trio.fail_after(20):
        kw: dict[str, Any] = {"stream_interval": 3, "stream_max_delay": None}
        async with vllm_group(1, fake_kw={"step_delay": 0.005}, **kw) as (group, _):
            async with group.submit(req("r", max_tokens=11)) as stream:
                batches = await _batches(stream)
            tokens = [t for batch in batches for body in batch for t in body.token_ids]
            assert tokens == list(range(21, 32))
            ends = [sum(map(len, batches[: i + 1])) for i in range(len(batches) - 1)]
            assert ends and all(e % 3 == 1 for e in ends), batches


run = pytest.fixture(params=sorted(RUNNERS), name="run")(loop_runner)


def test_asyncio_consumers_see_the_same_holding(tmp_path: Path, run: Run) -> None:
    """From asyncio (a trio guest run): the same outputs held, and a consumer parked on
    its future is woken by the terminal output with the held ones before it."""
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            engines.attach()
            async with (
                AsyncioEngineGroup.connect(
                    engines.url,
                    1,
                    ready_timeout=READY_TIMEOUT,
                    stream_interval=3,
                    stream_max_delay=None,
                ) as group,
                group.submit(Request("r", {"hold": True})) as stream,
            ):
                wire = (await engines.wait_for(0, lambda v: v.holds("r"))).wire("r")
                seen: list[list[Any]] = []
                for i in range(6):
                    await engines.emit(0, Output(wire, i, None))
                    await threaded_wait_until(lambda n=i + 1: taken(stream, seen) == n)
                    seen.append([out.body for out in stream.drain_nowait()])
                assert seen == [[0], [], [], [1, 2, 3], [], []]
                batch, _ = await asyncio.gather(
                    stream.receive_batch(), engines.emit(0, Output(wire, 6, "length"))
                )
                assert [out.body for out in batch] == [4, 5, 6]
                with pytest.raises(trio.EndOfChannel):
                    await stream.receive_batch()

        run(main)


async def test_serve_stream_interval_reaches_the_group() -> None:
    """`zmqdp serve --stream-interval N`: the group holds outputs N at a time, and a
    streamed answer still carries every token and its end."""
    serve = pytest.importorskip("zmqdp.gateway.serve")
    from tests.test_gateway import serving
    from tests.test_serve_routing import parse

    answers = []
    for argv in ((), ("--stream-interval", "4")):
        app = serve.app_from_args(parse(*argv))
        async with serving(app) as client:
            body = {"prompt": "hi", "max_tokens": 9, "stream": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert app.group is not None
            assert app.group._stream_interval == (4 if argv else 1)
            events = [
                json.loads(line[6:])["choices"][0]["text"]
                for line in response.text.split("\n")
                if line.startswith("data: {")
            ]
            answers.append(events)
    assert "".join(answers[0]) == "".join(answers[1]) and len(answers[0]) == 9
    assert len(answers[1]) <= 3  # the first token, then (at most) two writes of four


async def test_one_request_has_its_own_interval_and_a_bad_one_is_refused(
    tmp_path: Path,
) -> None:
    """`Request.stream_interval` in a group of interval 1: that request's outputs are
    held, another's are not; a non-positive interval is an `InvalidRequest` naming the
    request, before anything is sent."""
    with trio.fail_after(20):
        async with group_of(tmp_path, 1, stream_max_delay=None) as (group, (engine,)):
            with pytest.raises(InvalidRequest, match=r"'bad'.*stream_interval must be a pos"):
                group.submit(Request("bad", {"hold": True}, stream_interval=0))
            async with (
                group.submit(Request("k", {"hold": True}, stream_interval=2)) as held,
                group.submit(Request("one", {"hold": True})) as plain,
            ):
                await wait_until(lambda: engine.holds("k") and engine.holds("one"))
                assert not engine.holds("bad")
                seen: dict[str, list[list[Any]]] = {"k": [], "one": []}
                for i in range(3):
                    for stream in (held, plain):
                        rid = stream.request_id
                        await engine.emit((Output(engine.wire(rid), i),))
                        await wait_until(
                            lambda s=stream, n=i + 1: taken(s, seen[s.request_id]) == n
                        )
                        seen[rid].append([out.body for out in stream.drain_nowait()])
                assert seen == {"k": [[0], [], [1, 2]], "one": [[0], [1], [2]]}
