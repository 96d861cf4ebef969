"""zmqdp's vLLM dialect against fake vLLM engines (tests/vllm_fake.py, in this process):
tokens per second delivered to consumers, ready for a side-by-side with vLLM's own DP
client driving the same engines.

    .venv/bin/python benchmarks/bench_vllm.py [--quick] [--ranks N] [--requests R]
        [--tokens T] [--per-step K]

Each request streams T tokens, K per engine step (one `EngineCoreOutputs` per step
carries every running request, as vLLM's engines send them); R requests run at once,
each read by its own consumer task. The figure is tokens received by consumers / wall
time, median of the rounds. Standalone (no ratio row yet: the native-path baseline
against equivalent engines is still to write), so `run_all.py` does not collect it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.vllm_fake import FakeVllmGroup
from zmqdp.vllm import SamplingParams, VllmEngineGroup, VllmRequest


async def one_round(ranks: int, requests: int, tokens: int, per_step: int) -> float:
    d = tempfile.mkdtemp(prefix="zvb", dir="/tmp")
    fake = FakeVllmGroup(f"ipc://{d}/hs", ranks, tokens_per_step=per_step)
    received = 0
    try:
        async with trio.open_nursery() as nursery:
            for e in fake.engines:
                nursery.start_soon(e.run)
            async with VllmEngineGroup.connect(fake.url, ranks, ready_timeout=10) as group:

                async def consume(i: int) -> None:
                    nonlocal received
                    sp = SamplingParams(temperature=0.0, max_tokens=tokens)
                    async with group.submit(VllmRequest(f"b{i}", [1, 2, 3], sp)) as stream:
                        async for out in stream:
                            received += len(out.body.token_ids)

                start = time.perf_counter()
                async with trio.open_nursery() as inner:
                    for i in range(requests):
                        inner.start_soon(consume, i)
                elapsed = time.perf_counter() - start
            nursery.cancel_scope.cancel()
    finally:
        fake.close()
        shutil.rmtree(d, ignore_errors=True)
    assert received == requests * tokens, (received, requests * tokens)
    return received / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--per-step", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if a.quick:
        a.requests, a.tokens, a.rounds = 16, 16, 1
    rates = [
        trio.run(one_round, a.ranks, a.requests, a.tokens, a.per_step) for _ in range(a.rounds)
    ]
    print(
        f"vLLM dialect, {a.ranks} fake ranks, {a.requests} concurrent requests x {a.tokens} "
        f"tokens, {a.per_step} token(s)/step: {statistics.median(rates):,.0f} tokens/s "
        f"delivered to consumers (median of {a.rounds}; rounds: "
        f"{', '.join(f'{r:,.0f}' for r in rates)})"
    )


if __name__ == "__main__":
    main()
