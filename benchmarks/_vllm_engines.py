"""Twin fake engine groups for benchmarks/bench_v1_vllm_delivery.py, each run in a process
of its own (`_engines.engine_process`) so that neither shares the client's GIL.

Both run the same toy scheduler (tests/fakes/vllm.py's): every running request gets
`per_step` new tokens per step (token ids counting up from its last prompt token + 1)
and ends with LENGTH at its `max_tokens`; a step is **one** message carrying every
running request's entry and the rank's load, as vLLM's engines send one
`EngineCoreOutputs` per step.

A round: a rank waits until it holds `per_rank` requests, steps them to the end
*encoding* every step's message, then sends the messages back to back. Encoding ahead
keeps the engines' own codecs out of the figure (zmqdp's CBOR engine encodes a
128-entry step in ~3x the time msgspec takes): while messages flow, the client is the
bottleneck, and the benchmark times from the first token a consumer receives.

* `vllm_group`: tests/fakes/vllm.py's engines (vLLM 0.33's handshake and wire:
  msgspec `EngineCoreOutputs`), dense;
* `native_group`: `zmqdp.engine` engines (docs/protocol.md, CBOR batches stamped with
  the incarnation's epoch and a seq), each output an `Output(wire_id, [token ids],
  finish)`; the ADD body is ``{"prompt": [...], "max_tokens": T}``.
"""

from __future__ import annotations

from typing import Any

import trio


def vllm_group(url: str, ranks: int, per_step: int, per_rank: int) -> None:
    from tests.fakes.vllm import FakeVllmEngine, FakeVllmGroup, outputs_message
    from zmqdp._zmq import ZSocket

    class ReplayEngine(FakeVllmEngine):
        async def _busy_loop(self, out: ZSocket, coord: ZSocket | None) -> None:
            while True:
                while len(self.requests) < per_rank:
                    while not self.inbox:
                        self.changed = trio.Event()
                        await self.changed.wait()
                    self._process_inbox(coord)
                bodies = []
                while self.requests:
                    outputs = self._step()
                    bodies.append(outputs_message(self.rank, outputs, self._stats()))
                for body in bodies:
                    await out.send([body])

    async def main() -> None:
        fake = FakeVllmGroup(url, ranks, tokens_per_step=per_step)
        fake.engines = [
            ReplayEngine(fake, r, tokens_per_step=per_step, step_delay=0.0) for r in range(ranks)
        ]
        try:
            async with trio.open_nursery() as nursery:
                for engine in fake.engines:
                    nursery.start_soon(engine.run)
        finally:
            fake.close()

    trio.run(main)


async def _native_rank(url: str, rank: int, size: int, per_step: int, per_rank: int) -> None:
    from zmqdp._core.codec import encode_batch
    from zmqdp.engine import Add, Load, Output, OutputBatch, connect_engine

    async with connect_engine(url, rank=rank, size=size, info={"max_num_seqs": 256}) as eng:
        seq = 0
        while True:
            requests: dict[str, list[int]] = {}  # wire id -> [next token, tokens left]
            while len(requests) < per_rank:
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
            for body in bodies:
                await eng.send_raw_for_testing([body])


def native_group(url: str, ranks: int, per_step: int, per_rank: int) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for rank in range(ranks):
                nursery.start_soon(_native_rank, url, rank, ranks, per_step, per_rank)

    trio.run(main)
