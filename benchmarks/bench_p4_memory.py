"""P4: client memory per in-flight request, at 10 000 live streams.

    .venv/bin/python benchmarks/bench_p4_memory.py [--quick] [--requests 10000]

Two engine processes (`_engines.sink`) take every ADD and never answer, so every request
stays live. tracemalloc measures what the client holds after `--requests` submits, once
the input task has sent every ADD: the stream, the request book and routing entries,
the wire id; not the application's own `Request` objects (dropped by the caller). The
figure is absolute (memory is not noisy): KB per in-flight request. As context, the same
is measured for a bare `dict` of 10 000 ids to a small tuple (what any client must keep).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import tempfile
import tracemalloc
from typing import Any

import trio
from _engines import engine_process, sink
from _harness import Row, save

import zmqdp.testing
from zmqdp import EngineGroup, Request, RequestStream


async def measure(n: int) -> tuple[float, float]:
    directory = tempfile.mkdtemp(prefix="zmqdp-p4-")
    url = f"ipc://{directory}/g"
    with contextlib.ExitStack() as stack:
        for rank in range(2):
            stack.enter_context(engine_process(sink, url, rank, 2))
        async with EngineGroup.connect(url, 2, ready_timeout=30) as group:
            sent = functools.partial(zmqdp.testing.input_statistics, group)
            body = {"prompt": [1, 2, 3], "max_tokens": 16}
            group.submit(Request("warm", body))
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            base = sent().sent
            streams: list[RequestStream] = []
            for i in range(n):
                streams.append(group.submit(Request(f"req-{i:06d}", body)))
                if i % 256 == 255:
                    await trio.lowlevel.checkpoint()
            while sent().sent < base + n:
                await trio.lowlevel.checkpoint()
            gc.collect()
            ours = (tracemalloc.get_traced_memory()[0] - before) / n
            tracemalloc.stop()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            bare: dict[str, Any] = {f"req-{i:06d}": (i % 2, None) for i in range(n)}
            theirs = (tracemalloc.get_traced_memory()[0] - before) / n
            tracemalloc.stop()
            del bare
            return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=10_000)
    args = parser.parse_args()
    ours, bare = trio.run(measure, args.requests)
    save(
        "p4_memory",
        [
            Row(
                "P4",
                f"client state per in-flight request at {args.requests:,} streams (KB)",
                ours / 1024,
                "≤ 0.8 KB",
                f"{ours:,.0f} bytes per request; a bare dict of ids costs {bare:,.0f}",
            )
        ],
    )


if __name__ == "__main__":
    main()
