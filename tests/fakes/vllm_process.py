"""One fake vLLM engine core (dense, `zmqdp.vllm.mock`) in a process of its own, for
fault tests that need a real process: `kill -9` and `SIGSTOP` (libzmq's heartbeats are
answered by its I/O thread, which only stopping the process stops).

    python -m tests.fakes.vllm_process URL SIZE RANK [STEP_DELAY]

Prints ``up`` once its handshake is sent; runs until killed or SIGTERM."""

from __future__ import annotations

import signal
import sys

import trio

from zmqdp.vllm.mock import FakeVllmGroup


async def main(url: str, size: int, rank: int, step_delay: float) -> None:
    fake = FakeVllmGroup(url, size, step_delay=step_delay)
    try:
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                fake.nursery = nursery
                nursery.start_soon(fake.engines[rank].run)
                print("up", flush=True)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
    finally:
        fake.close()


if __name__ == "__main__":
    url, size, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    trio.run(main, url, size, rank, float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
