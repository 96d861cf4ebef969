"""Fake engine groups for benchmarks/bench_v1_vllm_delivery.py and bench_vs_vllm.py, each
run in a process of its own (`_engines.engine_process`) so that no client shares their GIL.

Both kinds run the same toy scheduler (tests/fakes/vllm.py's): every running request
gets `per_step` new tokens per step (token ids counting up from its last prompt token +
1) and ends with LENGTH at its `max_tokens`; a step is **one** message carrying every
running request's entry and the rank's load, as vLLM's engines send one
`EngineCoreOutputs` per step.

A round: each rank waits until it holds `per_rank` requests (read from the `SendClock`
the benchmark shares with the group, so one group serves rounds of several shapes),
then either

* **blasts** (`interval` 0): steps its requests to the end *encoding* every step's
  message, waits at a barrier until **every** rank of the group has encoded its round,
  then sends its messages back to back. The rank that opens the barrier writes the
  round's first send time (`time.monotonic()`, CLOCK_MONOTONIC: one clock for every
  process of the machine) into the `SendClock`; the benchmark's clock runs from there to
  the last stream end in the client. Encoding ahead keeps the engines' own codecs out of
  the window (zmqdp's CBOR engine encodes a 128-entry step in ~3x the time msgspec
  takes), and the barrier keeps one rank's encoding out of the other's sending (all
  ranks run in one trio process, so without it rank 1 encodes while rank 0's messages
  are already being timed);
* or **paces** (`interval` > 0): one step every `interval` seconds, each step encoded by
  every rank, then a barrier, then each rank stamps its send time for that step into
  the `SendClock` (`stamp(rank, step)`) and sends. A consumer finds the step of an
  output from its token id (the round's requests all start at the same step) and its
  latency is its receive time - `sent(rank, step)`.

* `vllm_group`: tests/fakes/vllm.py's engines (vLLM 0.32/0.33's handshake and wire:
  msgspec `EngineCoreOutputs`), dense, every step message as `_engine_step` makes it
  (scheduler stats, and `finished_requests` when the frontend runs a coordinator, as
  vLLM's does); request counts are published to a coordinator once before and once
  after each round (a real engine does it around every step; it goes to the coordinator,
  not to the client);
* `native_group`: `zmqdp.engine` engines (docs/protocol.md, CBOR batches stamped with
  the incarnation's epoch and a seq), each output an `Output(wire_id, [token ids],
  finish)`; the ADD body is ``{"prompt": [...], "max_tokens": T}``. Blast only.
"""

from __future__ import annotations

import mmap
import time
from typing import Any

import trio


class SendClock:
    """A few doubles in a file every process of a benchmark maps: what the engines do
    each round (`per_rank`, `interval`) and when they sent (`first_send`,
    `sent(rank, step)`), on CLOCK_MONOTONIC (`time.monotonic()`), which is one clock for
    every process of a Linux machine. `ranks` given: create the file."""

    STEPS = 4096
    """Steps per rank in the table (paced rounds are shorter)."""
    _FIRST, _PER_RANK, _INTERVAL, _TABLE = 0, 1, 2, 4

    def __init__(self, path: str, ranks: int | None = None) -> None:
        if ranks is not None:
            with open(path, "wb") as f:
                f.write(bytes(8 * (self._TABLE + ranks * self.STEPS)))
        self.path = path
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self._d = memoryview(self._map).cast("d")

    @property
    def first_send(self) -> float:
        """When the engines started sending this round (blast); 0.0: not yet."""
        return self._d[self._FIRST]

    @first_send.setter
    def first_send(self, value: float) -> None:
        self._d[self._FIRST] = value

    @property
    def per_rank(self) -> int:
        return int(self._d[self._PER_RANK])

    @property
    def interval(self) -> float:
        return self._d[self._INTERVAL]

    def configure(self, per_rank: int, interval: float = 0.0) -> None:
        """The next rounds' shape (set before their requests are submitted)."""
        self._d[self._PER_RANK] = per_rank
        self._d[self._INTERVAL] = interval

    def stamp(self, rank: int, step: int) -> None:
        if step < self.STEPS:
            self._d[self._TABLE + rank * self.STEPS + step] = time.monotonic()

    def sent(self, rank: int, step: int) -> float:
        return self._d[self._TABLE + rank * self.STEPS + step]


class Barrier:
    """A reusable barrier for the ranks of one trio process."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self._arrived = 0
        self._released = trio.Event()

    async def wait(self) -> bool:
        """Until every party arrived; True for the one that arrived last (it opens)."""
        released = self._released
        self._arrived += 1
        if self._arrived == self.parties:
            self._arrived = 0
            self._released = trio.Event()
            released.set()
            return True
        await released.wait()
        return False


def vllm_group(url: str, ranks: int, per_step: int, clock_path: str, version: str = "0.33") -> None:
    from tests.fakes.vllm import FakeVllmEngine, FakeVllmGroup
    from zmqdp._zmq import ZSocket

    clock = SendClock(clock_path)
    barrier = Barrier(ranks)

    class BenchEngine(FakeVllmEngine):
        async def _busy_loop(self, out: ZSocket, coord: ZSocket | None) -> None:
            while True:
                while not self.requests or len(self.requests) < clock.per_rank:
                    while not self.inbox:
                        self.changed = trio.Event()
                        await self.changed.wait()
                    for frames in self._process_inbox(coord):
                        await out.send(frames)
                await self._maybe_publish_request_counts(coord)
                if clock.interval > 0:
                    await self._paced(out, clock.interval)
                else:
                    await self._blast(out)
                await self._maybe_publish_request_counts(coord)

        async def _blast(self, out: ZSocket) -> None:
            bodies = []
            while (body := self._engine_step()) is not None:
                bodies.append(body)
            if await barrier.wait():
                clock.first_send = time.monotonic()
            for body in bodies:
                await out.send([body])

        async def _paced(self, out: ZSocket, interval: float) -> None:
            start = trio.current_time()
            step = 0
            while (body := self._engine_step()) is not None:
                await barrier.wait()
                clock.stamp(self.rank, step)
                await out.send([body])
                step += 1
                await trio.sleep_until(start + step * interval)

    async def main() -> None:
        fake = FakeVllmGroup(url, ranks, tokens_per_step=per_step, version=version)
        fake.engines = [
            BenchEngine(fake, r, tokens_per_step=per_step, step_delay=0.0) for r in range(ranks)
        ]
        try:
            async with trio.open_nursery() as nursery:
                for engine in fake.engines:
                    nursery.start_soon(engine.run)
        finally:
            fake.close()

    trio.run(main)


async def _native_rank(
    url: str, rank: int, size: int, per_step: int, clock: SendClock, barrier: Barrier
) -> None:
    from zmqdp._core.codec import encode_batch
    from zmqdp.engine import Add, Load, Output, OutputBatch, connect_engine

    async with connect_engine(url, rank=rank, size=size, info={"max_num_seqs": 256}) as eng:
        seq = 0
        while True:
            requests: dict[str, list[int]] = {}  # wire id -> [next token, tokens left]
            while not requests or len(requests) < clock.per_rank:
                msg: Any = await eng.receive()
                if isinstance(msg, Add):
                    requests[msg.id] = [msg.body["prompt"][-1] + 1, msg.body["max_tokens"]]
            bodies = []
            while requests:
                outputs = []
                for wid, st in list(requests.items()):
                    n = min(per_step, st[1])
                    outputs.append(
                        Output(wid, list(range(st[0], st[0] + n)), "length" if n == st[1] else None)
                    )
                    st[0] += n
                    st[1] -= n
                    if not st[1]:
                        del requests[wid]
                load = Load(waiting=0, running=len(requests), kv=0.1)
                batch = OutputBatch(rank, seq, eng.epoch, tuple(outputs), load=load)
                bodies.append(encode_batch(batch))
                seq += 1
            if await barrier.wait():
                clock.first_send = time.monotonic()
            for body in bodies:
                await eng.send_raw_for_testing([body])


def native_group(url: str, ranks: int, per_step: int, clock_path: str) -> None:
    clock = SendClock(clock_path)
    barrier = Barrier(ranks)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for rank in range(ranks):
                nursery.start_soon(_native_rank, url, rank, ranks, per_step, clock, barrier)

    trio.run(main)
