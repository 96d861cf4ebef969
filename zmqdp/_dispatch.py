"""The dispatcher task: the one owner of a group's output socket and watchdog deadline.

Theory of operation
-------------------
One loop, one pass per drained batch of up to 256 messages:

1. park on the output socket until a message comes or the core's next deadline (at most
   a second away: a submit can give an idle rank a deadline while the task is parked;
   `move_deadline` wakes it earlier). A long batch in hand (`GroupCore.has_work`) means
   no parking: take what is queued and go on with it;
2. hand each message to the core (`GroupCore.on_output`), which applies it or holds it
   behind its rank's long batch, and carry out its effects at once; then one slice of
   each long batch that was in hand before the pass (`GroupCore.advance`);
3. if a deadline passed, even while other ranks kept this task busy (a silent rank must
   not hide behind a chatty one), first read what is queued (up to
   `DRAIN_BEFORE_JUDGING` batches: the heartbeats that arrived while this task was held
   up), then judge at the time of judging (`GroupCore.on_deadline`);
4. `GroupCore.end_pass` (one WAKE answers every `start_wave` of the pass), carry out
   what is left, release the outputs held by a stream interval whose time came
   (`ConnectOptions.stream_max_delay`; the park of step 1 also ends then), and wake each
   stream the pass fed once, not once per output.

Steps 2 to 4 run with the cyclic garbage collector paused (`_core.cbor.gc_paused`,
which restores whatever state the application left it in). A pass makes about four
GC-tracked objects per output (its decoded entry, its body, its `Output`, the delivery),
none in a cycle, and tens of thousands of them per pass triggered collection after
collection of the young generation and, with it, of the older ones holding every live
stream: 39 % of the client's CPU at 256 x 256 on vLLM's wire (issue 21). Paused, the
collector runs once after the pass instead. Measured with benchmarks/bench_vs_vllm.py
(P7a, zmqdp's tokens/s +30 %, CPU per token -25 %). After a pass of at least
`LET_CONSUMERS_TAKE` messages it stays paused for two scheduling rounds (when no
other pause is open: another group's, another thread's), in which the woken consumers
take their outputs: those they drop are freed by refcount, so the
collection that resuming triggers no longer walks (and promotes) a pass's worth of live
outputs (P7a: the collections' time per round / 3, 2-6 ms of ~100 ms of the client's CPU,
measured with gc.callbacks; issue 34).

A timer that fires with nothing queued is judged only after a short grace if the task
woke late (`HELD_UP`): libzmq's I/O thread may have been held up too, with heartbeats
still in the kernel.

A rank whose connection closed is reported to the core by the transport's tasks
(`GroupCore.on_connection_lost`, naming the incarnation) and judged by the core, which
decides (`on_deadline`; its `next_deadline` covers the reports); this task only sees to
it that the judgement comes at the top of the next pass and after reading what is queued
(up to `DRAIN_BEFORE_JUDGING` batches): an engine that sent a request's last output and
then exited must not see that request fail. A report may ask for a grace: the close of
a rank's output connection alone is judged `OUTPUT_GRACE` later, so that the close of
its other connections (the process exited or was killed) is reported first and names
the plain cause.

Cancellation: only at checkpoints (the group is closing); what was applied stays
applied.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ._core.cbor import gc_paused, gc_pausers
from ._core.effects import Effects
from ._core.state import GroupCore
from ._zmq import ZSocket, ZSocketSet
from .stream import RequestStream

__all__ = ["DRAIN_BEFORE_JUDGING", "HELD_UP", "Dispatcher"]

HELD_UP = 0.05
"""Seconds: a dispatcher that wakes this late was held up."""
DRAIN_BEFORE_JUDGING = 8
"""Batches of 256 messages read before a silence is judged inside a busy round."""
LET_CONSUMERS_TAKE = 32
"""Messages in a pass from which the collector stays paused until its consumers ran."""


Apply = Callable[[Effects[RequestStream], set[RequestStream]], None]


class Dispatcher:
    """Runs the loop of the module docstring; `apply` carries out one pass's effects
    (`EngineGroup._apply`), adding the streams it fed to the set it is given."""

    def __init__(
        self,
        core: GroupCore[RequestStream],
        output: ZSocket | ZSocketSet,
        apply: Apply,
        holding: dict[RequestStream, float] | None = None,
    ) -> None:
        self._core = core
        self._output = output
        self._apply = apply
        self._holding: dict[RequestStream, float] = {} if holding is None else holding
        """The carrier's streams holding outputs -> their release times, in order."""
        self._timer: trio.CancelScope | None = None  # the wait, while parked

    def move_deadline(self, when: float) -> None:
        """A submit's deadline is earlier than the parked wait's: wake in time."""
        timer = self._timer
        if timer is not None and when < timer.deadline:
            timer.deadline = when

    async def run(self) -> None:
        zs = self._output
        core = self._core
        while True:
            if core.next_loss() <= trio.current_time():  # a connection closed
                self._judge_silence()
                self._carry_out(set())
            if core.has_work():
                messages = zs.receive_nowait(256)
            else:
                holding = self._holding
                deadline = min(core.next_deadline(), trio.current_time() + 1.0)
                if holding:
                    deadline = min(deadline, next(iter(holding.values())))
                with trio.move_on_at(deadline) as timer:
                    self._timer = timer
                    try:
                        messages = await zs.receive_batch(256)
                    finally:
                        self._timer = None
                if timer.cancelled_caught:
                    messages = zs.receive_nowait(256)
                    if not messages and holding and core.next_deadline() > trio.current_time():
                        self._carry_out(set())  # only held outputs were due: release them
                        continue
                    if not messages and trio.current_time() - timer.deadline > HELD_UP:
                        with trio.move_on_after(HELD_UP):
                            messages = await zs.receive_batch(256)
                    if not messages:
                        core.on_deadline(trio.current_time())
                        self._carry_out(set())
                        continue
            # Each message's effects are carried out at once, not once per pass: holding
            # a whole pass's deliveries (up to 256 x 64 live tuples) made the identical
            # delivery code 15-35 % slower under cProfile (P1, issue 19's note).
            dirty: set[RequestStream] = set()
            in_hand = core.in_hand() if core.has_work() else None
            now = trio.current_time()
            with gc_paused():  # a pass makes ~4 tracked objects per output; no cycles
                for frames in messages:
                    core.on_output(frames, now)
                    self._apply(core.take_effects(), dirty)
                if in_hand:
                    core.advance(in_hand, now)
                if trio.current_time() >= core.next_deadline():
                    self._judge_silence()
                self._carry_out(dirty)
                if len(messages) >= LET_CONSUMERS_TAKE and gc_pausers() == 1:
                    # The consumers take their outputs before the collector comes back:
                    # outputs taken and dropped are freed by their refcount (each
                    # lowers the young generation's count), so the collection that
                    # re-enabling triggers does not walk and promote a pass's worth of
                    # live outputs (two rounds: trio runs a batch in either order).
                    # Only while no other pause is open: two busy groups whose paused
                    # rounds overlapped kept the collector off for as long as both were
                    # busy. The second round can be cancelled: a group read without a
                    # pause (a long batch in hand) must still stop when told.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    await trio.lowlevel.checkpoint()
                    continue
            if core.has_work():
                await trio.lowlevel.checkpoint()  # consumers and other tasks run

    def _carry_out(self, dirty: set[RequestStream]) -> None:
        core = self._core
        core.end_pass()
        self._apply(core.take_effects(), dirty)
        if self._holding:
            RequestStream.release_due(self._holding, trio.current_time(), dirty)
        for stream in dirty:
            stream.notify()

    def _read_queued(self) -> None:
        """Apply what is queued now (a judgement must not outrun what came before it)."""
        core = self._core
        for _ in range(DRAIN_BEFORE_JUDGING):
            messages = self._output.receive_nowait(256)
            now = trio.current_time()
            for frames in messages:  # no slice of a long batch: only what came before
                core.on_output(frames, now)
            if len(messages) < 256:
                break

    def _judge_silence(self) -> None:
        self._read_queued()
        self._core.on_deadline(trio.current_time())
