"""The zmqdp side of benchmarks/bench_vs_vllm.py: `zmqdp.vllm.connect` in a process of its
own (this checkout's venv), driven round by round over stdin/stdout.

    .venv/bin/python benchmarks/_vs_vllm_zmqdp.py --url tcp://127.0.0.1:P --engines N

On trio, as an application uses it: the group binds the handshake ROUTER at ``--url``
(``insecure=True``: a loopback tcp address), and each round one task per request
submits it (`VllmRequest`, pinned to rank i mod N) and reads its stream with
`receive_batch()` until the end.

The protocol is _vs_vllm_vllm.py's (``@bench `` JSON lines on stdout, JSON commands on
stdin), with ``coord_cpu`` 0 (zmqdp's group has no coordinator process for a dense
group): ``ready``, then ``round`` per command, ``end`` the `time.monotonic()` at which
the last terminal output reached its consumer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's zmqdp

import zmqdp.vllm
from zmqdp.vllm import SamplingParams, VllmGroup, VllmRequest

PROMPT = [1, 2, 3]


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write("@bench " + json.dumps(obj) + "\n")
    sys.stdout.flush()


async def one_round(group: VllmGroup, cmd: dict[str, Any]) -> dict[str, Any]:
    k, requests, tokens = cmd["k"], cmd["requests"], cmd["tokens"]
    samples: list[tuple[int, int, float]] | None = [] if cmd["samples"] else None
    sp = SamplingParams(temperature=0.0, max_tokens=tokens)
    ends: list[float] = []
    received = 0

    async def request(i: int) -> None:
        nonlocal received
        rank = i % group.size
        n = 0
        async with group.submit(VllmRequest(f"z{k}-{i}", PROMPT, sp, rank=rank)) as stream:
            while True:
                try:
                    batch = await stream.receive_batch()
                except trio.EndOfChannel:
                    break
                now = time.monotonic()
                for out in batch:
                    ids = out.body.token_ids
                    n += len(ids)
                    if samples is not None and ids:
                        samples.append((rank, ids[0], now))
                    if out.finish is not None:
                        ends.append(now)
        received += n

    cpu = time.process_time()
    async with trio.open_nursery() as nursery:
        for i in range(requests):
            nursery.start_soon(request, i)
    return {
        "event": "round",
        "end": max(ends),
        "cpu": time.process_time() - cpu,
        "coord_cpu": 0.0,
        "tokens": received,
        "samples": samples,
    }


async def serve(url: str, engines: int) -> None:
    t0 = time.monotonic()
    async with zmqdp.vllm.connect(url, engines, insecure=True, ready_timeout=120) as group:
        emit({"event": "ready", "build_s": round(time.monotonic() - t0, 2)})
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                break
            emit(await one_round(group, cmd))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--engines", type=int, default=2)
    args = p.parse_args()
    trio.run(serve, args.url, args.engines)


if __name__ == "__main__":
    main()
