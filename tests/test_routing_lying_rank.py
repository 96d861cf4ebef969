"""A lying rank under speed-aware routing, over real sockets (the hostile review, finding 5).

Ranks 0 and 1 step honestly every 10 ms (4 requests at a time); rank 2 sends an empty
output to each request it holds every 1 ms, finishing none of them, or each only after
0.3 s. 24 closed-loop clients submit 5-token requests until the honest ranks have
finished 300. 362b651 took the liar for 10x faster than the others and gave it nearly
every client (its in-flight count passed fair share + lead, and the honest ranks ran
dry); now timing needs completions and can take a rank at most `Routing.lead` past
its fair share. The sans-IO bound is property-tested in tests/core/test_routing_share.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.fakes.engines import SteppingEngine
from zmqdp import EngineGroup, Request
from zmqdp.engine import Add

from .helpers import READY_TIMEOUT

CLIENTS = 24
HONEST = 300
LIAR = 2
CAPACITY = 4


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize("lie", ["never", "late"])
async def test_a_lying_rank_draws_at_most_its_fair_share_and_lead(tmp_path: Path, lie: str) -> None:
    url = f"ipc://{tmp_path}/g"
    engines = [SteppingEngine(url, r, 3, step=0.01, max_num_seqs=CAPACITY) for r in range(2)] + [
        SteppingEngine(url, LIAR, 3, step=0.001, max_num_seqs=CAPACITY, lie=lie, late=0.3)
    ]
    fair = CLIENTS // 3
    lead = 2 * CAPACITY  # SPEED_LEAD x the liar's capacity
    most_held = 0
    async with trio.open_nursery() as nursery:
        for engine in engines:
            nursery.start_soon(engine.run)
        async with EngineGroup.connect(
            url, 3, ready_timeout=READY_TIMEOUT, routing="speed"
        ) as group:
            stop = trio.Event()

            async def client(c: int) -> None:
                nonlocal most_held
                for i in range(10**6):
                    request = Request(f"c{c}-{i}", {"tokens": 5})
                    async with group.submit(request) as stream:
                        most_held = max(most_held, group.statistics().ranks[LIAR].inflight)
                        if most_held > fair + lead:
                            stop.set()  # the bound is broken: no need to go on
                        async for _ in stream:
                            pass
                    if engines[0].finished + engines[1].finished >= HONEST:
                        stop.set()

            async with trio.open_nursery() as clients:
                for c in range(CLIENTS):
                    clients.start_soon(client, c)
                await stop.wait()
                clients.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    assert most_held <= fair + lead, f"the liar held {most_held} (fair {fair} + lead {lead})"
    assert engines[0].finished + engines[1].finished >= HONEST
    adds = [sum(isinstance(m, Add) for m in e.inbox) for e in engines]
    assert adds[LIAR] <= sum(adds) / 3 + lead, adds
