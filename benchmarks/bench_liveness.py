"""Time from an engine's death to `rank_state` DOWN, and what the surviving rank loses.

    .venv/bin/python benchmarks/bench_liveness.py [--quick] [--reps 20] [--wire native|vllm]
        [--fault kill|stop] [--load idle|busy]

A group of two ranks, each an engine process of its own (`tests/fakes/processes.py`:
`python -m zmqdp mock --ranks R` natively, a fake vLLM engine core on vLLM's wire), is
driven with the default heartbeat settings (`ConnectOptions.heartbeat_interval` 0.5 s,
`heartbeat_timeout` 3 s). Each repetition starts a fresh rank 1, waits until it is up,
then SIGKILLs it (`kill`) or SIGSTOPs it (`stop`), either idle or busy (`busy`: rank 1
streams 4 requests and rank 0 streams 4 survivors that outlast the detection bound),
and measures the seconds from the signal to the moment the client reports rank 1
DOWN. Survivors must all finish with their last token; the victim's requests must all
end with `EngineDead`.

The figure is the worst (max) detection time over the repetitions divided by its bound
(issue 20: 1 s for kill -9; `heartbeat_timeout` + 1 s for SIGSTOP): a ratio ≤ 1 meets
it. Median and p90 are context. The peer for comparison is described, not run: vLLM's
headless frontend (`DPLBAsyncMPClient`) never notices a SIGKILLed or stopped engine
(shared/vllm/REAL_ENGINES.md), and zmqdp before issue 20 noticed an idle one only when
something was sent to it, a busy one after `silence_timeout` (30 s).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from _harness import Row, pct, save

from tests.fakes.processes import STEP_TIME, Wire, resume
from zmqdp import EngineDead, RankState

HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 3.0
BOUNDS = {"kill": 1.0, "stop": HEARTBEAT_TIMEOUT + 1.0}
SURVIVORS = 4
VICTIMS = 4


@dataclass
class Tally:
    times: list[float] = field(default_factory=list)
    survivors_lost: int = 0
    survivors_done: int = 0
    victims_failed: int = 0
    victims_other: int = 0


async def _survivor(group: Any, req: Any, tally: Tally, first: trio.Event) -> None:
    try:
        async with group.submit(req) as stream:
            outs = []
            async for out in stream:
                outs.append(out)
                first.set()
        if outs and outs[-1].finish == "length":
            tally.survivors_done += 1
        else:
            tally.survivors_lost += 1
    except Exception:
        tally.survivors_lost += 1
        first.set()


async def _victim(group: Any, req: Any, tally: Tally, first: trio.Event) -> None:
    try:
        async with group.submit(req) as stream:
            async for _ in stream:
                first.set()
        tally.victims_other += 1
    except EngineDead:
        tally.victims_failed += 1
    except Exception:
        tally.victims_other += 1
    first.set()


async def one_rep(wire: Wire, group: Any, url: str, fault: str, busy: bool, tally: Tally) -> None:
    sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
    async with wire.engine(url, 2, 1) as victim:
        try:
            with trio.fail_after(60):
                await group.rank_state(1).wait_value(RankState.UP)
            async with trio.open_nursery() as nursery:
                if busy:
                    tokens = int((BOUNDS[fault] + 1.5) / STEP_TIME)
                    firsts = []
                    for i in range(SURVIVORS):
                        firsts.append(trio.Event())
                        req = wire.request(f"s{len(tally.times)}-{i}", tokens, rank=0)
                        nursery.start_soon(_survivor, group, req, tally, firsts[-1])
                    for i in range(VICTIMS):
                        firsts.append(trio.Event())
                        req = wire.request(f"v{len(tally.times)}-{i}", 10**6, rank=1)
                        nursery.start_soon(_victim, group, req, tally, firsts[-1])
                    for event in firsts:
                        await event.wait()
                t0 = trio.current_time()
                os.kill(victim.pid, sig)
                with trio.fail_after(60):
                    await group.rank_state(1).wait_value(RankState.DOWN)
                tally.times.append(trio.current_time() - t0)
        finally:
            resume(victim)
            victim.kill()


async def run_case(wire: Wire, fault: str, busy: bool, reps: int) -> Tally:
    tally = Tally()
    directory = tempfile.mkdtemp(prefix="zmqdp-live-")
    url = wire.url(Path(directory))
    async with (
        wire.engine(url, 2, 0),
        wire.engine(url, 2, 1) as first,
        wire.connect(
            url,
            2,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        ) as group,
    ):
        first.kill()  # every repetition starts its own rank 1
        with trio.fail_after(60):
            await group.rank_state(1).wait_value(RankState.DOWN)
        for _ in range(reps):
            await one_rep(wire, group, url, fault, busy, tally)
        assert group.closed is None
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repetition per case")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--wire", choices=["native", "vllm"], action="append")
    parser.add_argument("--fault", choices=["kill", "stop"], action="append")
    parser.add_argument("--load", choices=["idle", "busy"], action="append")
    args = parser.parse_args()
    reps = 1 if args.quick else args.reps
    rows = []
    extra: dict[str, Any] = {}
    for wire_name in args.wire or ["native", "vllm"]:
        for fault in args.fault or ["kill", "stop"]:
            for load in args.load or ["idle", "busy"]:
                tally = trio.run(run_case, Wire(wire_name), fault, load == "busy", reps)
                worst = max(tally.times)
                bound = BOUNDS[fault]
                key = f"L{wire_name[0]}{fault[0]}{load[0]}"  # Lnki: native, kill, idle
                lost = tally.survivors_lost
                context = (
                    f"{reps} reps: median {statistics.median(tally.times):.3f} s, "
                    f"p90 {pct(tally.times, 0.9):.3f} s, max {worst:.3f} s (bound {bound:g} s); "
                    f"survivors {tally.survivors_done} finished, {lost} lost; victims "
                    f"{tally.victims_failed} EngineDead, {tally.victims_other} other"
                )
                figure = (
                    f"{wire_name} {fault} -9 {load}"
                    if fault == "kill"
                    else (f"{wire_name} SIGSTOP {load}")
                )
                rows.append(
                    Row(
                        key, f"{figure}: death → DOWN, max ÷ bound", worst / bound, "≤ 1.0", context
                    )
                )
                extra[key] = {
                    "times": tally.times,
                    "survivors_lost": lost,
                    "victims_other": tally.victims_other,
                }
                save("liveness", rows, extra)


if __name__ == "__main__":
    main()
