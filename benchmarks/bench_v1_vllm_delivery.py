"""V1: zmqdp's vLLM dialect, tokens per second delivered to consumers, ÷ the native
`EngineGroup` against equivalent engines.

    .venv/bin/python benchmarks/bench_v1_vllm_delivery.py [--quick] [--ranks N] [--requests R]
        [--tokens T] [--per-step K] [--rounds 7]

Two fake engine groups run in processes of their own (benchmarks/_vllm_engines.py) with
the same toy scheduler: `ranks` ranks, each step one message carrying `per_step` new
tokens of every running request (vLLM's engines send one `EngineCoreOutputs` per step).
One is tests/fakes/vllm.py's vLLM 0.33 engines (msgspec `EngineCoreOutputs`), driven by
`zmqdp.vllm.connect`; the other is `zmqdp.engine` engines (docs/protocol.md,
CBOR), driven by `zmqdp.EngineGroup`. Both groups stay connected; rounds alternate
between them: `requests` requests of `tokens` tokens submitted at once (request i pinned
to rank i mod `ranks`, so that each rank knows how many to wait for), each read by its
own consumer task.

The clock: every rank of a group encodes its whole round first, then all ranks wait at
a barrier, then they send back to back (_vllm_engines.py), so no engine's encoding falls
inside the window. The window runs from the engines' first send (stamped by the engines
with `time.monotonic()`, CLOCK_MONOTONIC, one clock for all processes, in a file both
map: `SendClock`) to the last stream end in this process. (It used to start at the
first token a consumer saw, which flatters the side that decodes ahead.) The figure is
the client's delivery rate, tokens received by consumers / that window, the median of
each side.

V1 is context (no target): what vLLM's wire costs zmqdp against its own wire, on this
machine. benchmarks/bench_vs_vllm.py drives the same fake vLLM engines with vLLM's own
`DPLBAsyncMPClient` side by side (rows P7*).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any, ClassVar

import trio
from _engines import engine_process
from _harness import Row, median, save
from _vllm_engines import SendClock, native_group, vllm_group

import zmqdp.vllm
from zmqdp import EngineGroup, Request
from zmqdp.vllm import SamplingParams, VllmGroup, VllmRequest

PROMPT = [1, 2, 3]


class Round:
    """One round's clock: from the engines' first send (their `SendClock` stamp) to the
    last stream end."""

    cpu_shares: ClassVar[dict[str, list[float]]] = {"vllm": [], "native": []}
    """Per side, the client process's CPU time / wall time from the first token a
    consumer got to the last stream end (near 1: the client is the bottleneck, as it
    should be)."""

    def __init__(self, side: str, clock: SendClock) -> None:
        self.side = side
        self.clock = clock
        clock.first_send = 0.0
        self.first: float | None = None
        self.cpu = 0.0
        self.received = 0

    def got(self, n: int) -> None:
        if self.first is None:
            self.first = time.monotonic()
            self.cpu = time.process_time()
        self.received += n

    def rate(self, expected: int) -> float:
        end = time.monotonic()
        start = self.clock.first_send
        assert self.received == expected and self.first is not None, (self.received, expected)
        assert 0 < start <= self.first, (start, self.first)
        self.cpu_shares[self.side].append((time.process_time() - self.cpu) / (end - self.first))
        return self.received / (end - start)


async def vllm_round(group: VllmGroup, clock: SendClock, requests: int, tokens: int) -> float:
    rnd = Round("vllm", clock)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens)

    async def consume(i: int) -> None:
        request = VllmRequest(f"v{i}", PROMPT, sp, rank=i % group.size)
        async with group.submit(request) as stream:
            async for out in stream:
                rnd.got(len(out.body.token_ids))

    async with trio.open_nursery() as nursery:
        for i in range(requests):
            nursery.start_soon(consume, i)
    return rnd.rate(requests * tokens)


async def native_round(group: EngineGroup, clock: SendClock, requests: int, tokens: int) -> float:
    rnd = Round("native", clock)
    body = {"prompt": PROMPT, "max_tokens": tokens}

    async def consume(i: int) -> None:
        async with group.submit(Request(f"n{i}", body, rank=i % group.size)) as stream:
            async for out in stream:
                rnd.got(len(out.body))

    async with trio.open_nursery() as nursery:
        for i in range(requests):
            nursery.start_soon(consume, i)
    return rnd.rate(requests * tokens)


async def measure(a: Any) -> dict[str, list[float]]:
    directory = tempfile.mkdtemp(prefix="zmqdp-v1-")
    vurl, nurl = f"ipc://{directory}/vllm", f"ipc://{directory}/native"
    if a.requests % a.ranks:
        raise SystemExit("--requests must be a multiple of --ranks")
    vclock = SendClock(os.path.join(directory, "vllm.clock"), a.ranks)
    nclock = SendClock(os.path.join(directory, "native.clock"), a.ranks)
    for clock in (vclock, nclock):
        clock.configure(per_rank=a.requests // a.ranks)
    with (
        engine_process(vllm_group, vurl, a.ranks, a.per_step, vclock.path),
        engine_process(native_group, nurl, a.ranks, a.per_step, nclock.path),
    ):
        async with (
            zmqdp.vllm.connect(vurl, a.ranks, ready_timeout=30) as vgroup,
            EngineGroup.connect(nurl, a.ranks, ready_timeout=30) as ngroup,
        ):
            await vllm_round(vgroup, vclock, a.requests, a.tokens)  # warm up
            await native_round(ngroup, nclock, a.requests, a.tokens)
            Round.cpu_shares = {"vllm": [], "native": []}
            out: dict[str, list[float]] = {"vllm": [], "native": []}
            for _ in range(a.rounds):
                out["vllm"].append(await vllm_round(vgroup, vclock, a.requests, a.tokens))
                out["native"].append(await native_round(ngroup, nclock, a.requests, a.tokens))
            return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (the smoke test)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--per-step", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    if a.quick:
        a.requests, a.tokens, a.rounds = 64, 32, 2
    results = trio.run(measure, a)
    v, n = median(results["vllm"]), median(results["native"])
    cv, cn = median(Round.cpu_shares["vllm"]), median(Round.cpu_shares["native"])
    shape = (
        f"{a.ranks} ranks, {a.requests} concurrent requests x {a.tokens} tokens, {a.per_step}/step"
    )
    for name, side, share in (("vLLM dialect", "vllm", cv), ("native", "native", cn)):
        each = ", ".join(f"{r:,.0f}" for r in results[side])
        print(
            f"{name:12}: {median(results[side]):,.0f} tokens/s delivered to consumers, client "
            f"CPU {share:.0%} while tokens flowed (rounds: {each})"
        )
    save(
        "v1_vllm",
        [
            Row(
                "V1",
                "vLLM dialect tokens/s to consumers ÷ native EngineGroup, equivalent fake engines",
                v / n,
                "",
                f"{v:,.0f} vs {n:,.0f} tokens/s from the engines' first send (client CPU {cv:.0%} "
                f"vs {cn:.0%}); {shape}; engines encode, barrier, send; "
                f"median of {a.rounds}",
            )
        ],
        {**results, "cpu_shares": Round.cpu_shares, "shape": shape},
    )


if __name__ == "__main__":
    main()
