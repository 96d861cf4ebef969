"""A lying rank under speed-aware routing: its share is bounded, and timing needs completions.

The hostile review's finding: a rank that streams empty outputs every 1 ms looked 20x
faster than it was and drew 80 % of the requests (60 % if it never finished them),
while least-loaded gave it 6 %. `ShareMachine` (tests/models/routing.py) states the
bound for any claims a rank makes; the old cadence-only timing, and each half of it, are
shown to be caught; `simulate` replays the experiment on a simulated clock.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from tests.models import mutants
from tests.models.hunt import hunt
from tests.models.routing import ShareMachine, simulate
from zmqdp._core.routing import SPEED_LEAD, STEP_RUN, TOKENS_SPREAD, Routing

TestShare = ShareMachine.TestCase
TestShare.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)

HUNT = hunt(1000, 60)


@pytest.mark.parametrize(
    ("variant", "caught_by"),
    [
        (mutants.CadenceOnlyRouting, "share bound|unconfirmed timing"),
        (mutants.UnboundedLead, "share bound"),
        (mutants.UnconfirmedTiming, "unconfirmed timing"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_the_share_machine_catches(variant: type[Routing], caught_by: str) -> None:
    machine = type(f"ShareMachineWith{variant.__name__}", (ShareMachine,), {"routing_cls": variant})
    with pytest.raises(AssertionError, match=caught_by):
        run_state_machine_as_test(machine, settings=HUNT)


# -- the experiment ---------------------------------------------------------------------


@pytest.mark.parametrize("rank0", ["late", "never"])
def test_a_lying_rank_draws_no_more_than_least_loaded_gives_it(rank0: str) -> None:
    """4 ranks of 16, 64 clients, steps of 20 ms; rank 0 sends an empty output per
    request every 1 ms and finishes each after 10 s, or never. 362b651 gave it 81 %
    (75 %) of the requests and 192 (48) completions against least-loaded's ~2000."""
    speed = simulate(Routing(4, up=True, speed=True), rank0)
    least = simulate(Routing(4, up=True), rank0)
    old = simulate(mutants.CadenceOnlyRouting(4, up=True, speed=True), rank0)
    assert old.share > 0.7 and old.completed < least.completed / 5, old  # the finding
    assert speed.share <= max(least.share, 0.25), (speed, least)  # at most fair
    assert speed.most_held <= 16 + SPEED_LEAD * 16, speed  # fair + its lead, always
    assert speed.completed >= 0.95 * least.completed, (speed, least)
    assert speed.latency <= 1.1 * least.latency, (speed, least)


def test_a_slower_honest_rank_still_gets_few_requests() -> None:
    """The fix keeps what speed-aware routing is for: rank 0 honestly 3x slower gets
    under 1 % of the requests, and the p99 is half least-loaded's."""
    speed = simulate(Routing(4, up=True, speed=True), "slow")
    least = simulate(Routing(4, up=True), "slow")
    assert speed.share < 0.01 and least.share > 0.05, (speed, least)
    assert speed.p99 < 0.6 * least.p99, (speed, least)


# -- worked examples --------------------------------------------------------------------


def batches(
    routing: Routing, rank: int, start: float, step: float, n: int, outputs: int, end: int = 0
) -> float:
    """`n` batches of `rank`, `step` apart; the last ends `end` of its requests."""
    now = start
    for i in range(n):
        now += step
        running = routing.inflight_count(rank)
        if i == n - 1 and end:
            routing.release(rank, sorted(routing.inflight_ids(rank))[:end])
        routing.observe_outputs(rank, now, outputs, running)
    return now


def test_a_rank_that_never_finishes_is_never_timed() -> None:
    routing = Routing(2, up=True, speed=True)
    routing.set_capacity(0, 4)
    routing.select("a", 0)
    now = batches(routing, 0, 0.0, 0.001, 100 * STEP_RUN, 1)
    assert routing.step_time(0) is None
    routing.select("b", 0)
    batches(routing, 0, now, 0.001, STEP_RUN + 1, 2, end=1)  # one finishes: confirmed
    step_time = routing.step_time(0)
    assert step_time is not None and step_time == pytest.approx(0.001)


def test_a_rank_padding_its_requests_is_timed_per_request() -> None:
    """Rank 1 finishes a request every 36 outputs at 20 ms a step (0.72 s); rank 0
    streams an empty output every 1 ms and finishes a request every 10 s: its step time
    is stretched to 10000 / (`TOKENS_SPREAD` x 36) of its 1 ms steps, 3.5x rank 1's."""
    routing = Routing(2, up=True, speed=True)
    routing.select("held1", 1)
    routing.select("held0", 0)
    now = 0.0
    for i in range(4):
        routing.select(f"honest{i}", 1)
        now = batches(routing, 1, now, 0.02, 36, 2, end=1)
    routing.select("pad0", 0)
    now = batches(routing, 0, now, 0.001, 10000, 2, end=1)
    honest, padded = routing.step_time(1), routing.step_time(0)
    assert honest is not None and honest == pytest.approx(0.02)
    assert padded is not None
    assert padded == pytest.approx(0.001 * 10000 / (TOKENS_SPREAD * 36), rel=1e-3)
    assert padded > 3 * honest


def test_timing_alone_takes_a_rank_at_most_its_lead_past_least_loaded() -> None:
    """Rank 0 is confirmed 20x faster with as many outputs per request as the others
    (nothing to tell it from an honest fast rank): it holds at most `lead` requests
    more than least-loaded would give it, however many come."""
    routing = Routing(3, up=True, speed=True)
    for rank in range(3):
        routing.set_capacity(rank, 4)
    now = 0.0
    for rank, step in ((0, 0.001), (1, 0.02), (2, 0.02)):
        routing.select(f"warm{rank}", rank)
        routing.select(f"done{rank}", rank)
        now = batches(routing, rank, now, step, STEP_RUN + 1, 2, end=1)
    assert routing.lead(0) == SPEED_LEAD * 4
    for i in range(60):
        routing.select(f"r{i}")
    counts = [routing.inflight_count(r) for r in range(3)]
    assert counts[0] == min(counts[1:]) + routing.lead(0), counts
    least = Routing(3, up=True)
    for i in range(60):
        least.select(f"r{i}")
    assert least.inflight_count(0) == 20
