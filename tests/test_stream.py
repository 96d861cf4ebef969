"""`RequestStream` on its own: the dispatcher's side (deliver, notify, finish) against the
consumer's (receive, receive_nowait, receive_batch, drain_nowait, iteration)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from zmqdp import EngineDead, Output, RequestStream
from zmqdp._core.requests import Outcome


def stream(closed: list[RequestStream] | None = None) -> RequestStream:
    return RequestStream._create("r", (closed if closed is not None else []).append)


def test_it_has_no_public_constructor() -> None:
    with pytest.raises(TypeError, match="no public constructor"):
        RequestStream("r", lambda s: None)  # type: ignore[call-arg]


async def test_outputs_come_in_order_then_a_clean_end() -> None:
    s = stream()
    for i in range(3):
        s.deliver(Output("r", i))
    s.finish(Outcome.FINISHED)
    assert [await s.receive(), s.receive_nowait()] == [Output("r", 0), Output("r", 1)]
    assert s.drain_nowait() == [Output("r", 2)]
    with pytest.raises(trio.EndOfChannel):
        s.drain_nowait()
    with pytest.raises(trio.EndOfChannel):
        await s.receive()


async def test_the_error_comes_after_every_buffered_output() -> None:
    s = stream()
    s.deliver(Output("r", 0))
    s.finish(Outcome.FAILED, EngineDead(0, "gone", "r"))
    assert [out async for out in _until_error(s)] == [Output("r", 0)]


async def _until_error(s: RequestStream):  # type: ignore[no-untyped-def]
    with pytest.raises(EngineDead, match="gone"):
        async for out in s:
            yield out


async def test_receive_batch_waits_for_the_first_then_takes_everything() -> None:
    s = stream()
    got: list[list[Output]] = []

    async def consumer() -> None:
        got.append(await s.receive_batch())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        s.deliver(Output("r", 0))
        s.deliver(Output("r", 1))
        s.notify()  # one wake-up for the whole batch
    assert got == [[Output("r", 0), Output("r", 1)]]


def test_nothing_buffered_yet_would_block() -> None:
    s = stream()
    with pytest.raises(trio.WouldBlock):
        s.receive_nowait()
    assert s.drain_nowait() == []


async def test_leaving_early_calls_on_close_once_and_not_after_the_end() -> None:
    closed: list[RequestStream] = []
    early = stream(closed)
    async with early:
        pass
    done = stream(closed)
    done.finish(Outcome.FINISHED)
    async with done:
        pass
    assert closed == [early]


async def test_a_second_reader_is_refused_and_a_cancelled_reader_can_retry() -> None:
    s = stream()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.receive)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await s.receive()
        nursery.cancel_scope.cancel()
    s.deliver(Output("r", 7))
    s.notify()
    assert await s.receive() == Output("r", 7)


async def test_a_second_reader_that_takes_a_woken_readers_output_never_hangs_it() -> None:
    """Reader A is woken, reader B takes the output before A runs and parks: one of the
    two gets BusyResourceError (before, A overwrote B as the waiter and B hung)."""
    s = RequestStream._create("x", lambda s: None)
    errors: list[BaseException] = []

    async def read_all() -> None:
        try:
            async for _ in s:
                pass
        except trio.BusyResourceError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)  # A
        await trio.testing.wait_all_tasks_blocked()
        s.deliver(Output("x", 1))
        s.notify()  # A is rescheduled, and has not run yet
        assert (await s.receive()).body == 1  # B takes it without a schedule point
        nursery.start_soon(read_all)  # B reads on
        await trio.testing.wait_all_tasks_blocked()
        s.deliver(Output("x", 2, "stop"))
        s.notify()
        s.finish(Outcome.FINISHED)
    assert len(errors) == 1
