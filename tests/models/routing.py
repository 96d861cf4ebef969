"""A Hypothesis state machine for speed-aware routing against a lying rank (`_core/routing.py`).

Rank 0 lies: it sends batches of outputs as often and as many as it likes (down to one
every 0.1 ms), reports any load, and finishes its requests late or never. The other
ranks step honestly (10 to 40 ms) and finish some requests in their batches. The
machine feeds `Routing` as the dispatcher does (a batch's running count is taken before
the batch frees its slots), picks unpinned ranks, aborts, takes ranks down and brings
them back. Invariants:

* **the share bound**: a rank is picked with a load score ``h`` at or past its lead
  ``K`` (`SPEED_LEAD` x its effective capacity; `SPEED_LEAD_REQUESTS` when no rank gave
  a capacity) only if ``cost(h - K) <= cost(h_q)`` for every other candidate q, where
  ``cost`` is the speed score's load term written out here. With equal capacities that
  is ``h - K <= h_q``: timing takes a rank at most K requests past least-loaded's pick,
  whatever it claims;
* **completions confirm timing**: a rank has a step time only once one of its requests
  ended in a batch of outputs since it came up: a rank that never finishes is never
  timed.

A plain module, so that `tests/core/test_routing_share.py` can run it against the
broken variants in `tests/models/mutants.py` (the old cadence-only timing).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zmqdp._core.messages import Load
from zmqdp._core.routing import SPEED_LEAD, SPEED_LEAD_REQUESTS, SPEED_SPREAD, Routing

LIAR = 0
CAPACITIES = st.sampled_from([1, 2, 3, 4, 4, 8, None])
LIAR_TICKS = st.sampled_from([0.0, 0.0001, 0.001])
HONEST_STEPS = st.sampled_from([0.01, 0.02, 0.04])


def cost(held: float, capacity: int | None) -> float:
    """The load term of the speed score, in step times (`Routing.speed_score`)."""
    if capacity is None:
        return held + 1.0
    return 1.0 + max(0.0, (held + 1.0 - capacity) / capacity) + SPEED_SPREAD * held / capacity


class ShareMachine(RuleBasedStateMachine):
    """Subclass and set `routing_cls` to run a variant of the routing."""

    routing_cls: type[Routing] = Routing

    @initialize(
        n=st.integers(2, 10),
        capacities=st.lists(CAPACITIES, min_size=10, max_size=10),
        tree=st.booleans(),
    )
    def setup(self, n: int, capacities: list[int | None], tree: bool) -> None:
        self.n = n
        self.routing = self.routing_cls(n, up=True, tree=tree, speed=True)
        for rank in range(n):
            self.routing.set_capacity(rank, capacities[rank])
        self.now = 0.0
        self.serial = 0
        self.completed = [False] * n  # model: one of its requests ended in a batch
        self.liar_picks = 0

    # -- helpers ----------------------------------------------------------------------

    def _batch(self, rank: int, outputs: int, ending: int) -> None:
        """One batch of `rank`, as the dispatcher applies it: running counted, the
        ended requests freed, then the outputs timed."""
        routing = self.routing
        held = sorted(routing.inflight_ids(rank))
        running = len(held)
        if ending and held:
            routing.release(rank, held[:ending])
            self.completed[rank] = True
        if outputs:
            routing.observe_outputs(rank, self.now, outputs, running)

    def _candidates(self) -> list[int]:
        return [r for r in range(self.n) if self.routing.has_room(r)]

    # -- rules ------------------------------------------------------------------------

    @rule(times=st.integers(1, 8))
    def submit(self, times: int) -> None:
        """Unpinned picks; each is checked against the share bound."""
        routing = self.routing
        for _ in range(times):
            candidates = self._candidates()
            if not candidates:
                return
            before = {r: routing.load_score(r) for r in candidates}
            capacity = {r: routing.effective_capacity(r) for r in candidates}
            self.serial += 1
            chosen = routing.select(f"q{self.serial}")
            if chosen == LIAR:
                self.liar_picks += 1
            held = before[chosen]
            cap = capacity[chosen]
            lead = SPEED_LEAD * cap if cap is not None else SPEED_LEAD_REQUESTS
            if held < lead:
                continue
            mine = cost(held - lead, cap)
            for q in candidates:
                theirs = cost(before[q], capacity[q])
                assert mine <= theirs * (1 + 1e-9), (
                    f"share bound: rank {chosen} picked at load {held} (lead {lead}, "
                    f"capacity {cap}): {mine} > rank {q}'s {theirs} at load {before[q]} "
                    f"(capacity {capacity[q]})"
                )

    @rule(tick=LIAR_TICKS, times=st.integers(1, 12), outputs=st.integers(0, 8))
    def liar_streams(self, tick: float, times: int, outputs: int) -> None:
        """Empty outputs, fast, finishing nothing."""
        for _ in range(times):
            self.now += tick
            self._batch(LIAR, outputs, 0)

    @rule(outputs=st.integers(1, 8), ending=st.integers(1, 3))
    def liar_finishes(self, outputs: int, ending: int) -> None:
        """At last (however late) it ends some of its requests."""
        self.now += 0.0001
        self._batch(LIAR, outputs, ending)

    @rule(r=st.integers(1, 9), step=HONEST_STEPS, times=st.integers(1, 8), ending=st.integers(0, 2))
    def honest_steps(self, r: int, step: float, times: int, ending: int) -> None:
        """`times` steps of an honest rank, one output per running request each; the
        last ends `ending` requests."""
        rank = 1 + (r - 1) % (self.n - 1)
        for i in range(times):
            self.now += step
            running = self.routing.inflight_count(rank)
            self._batch(rank, running, ending if i == times - 1 else 0)

    @rule(
        r=st.integers(0, 9),
        waiting=st.integers(0, 12),
        running=st.integers(0, 12),
        kv=st.sampled_from([0.0, 0.9, math.nan]),
    )
    def report_load(self, r: int, waiting: int, running: int, kv: float) -> None:
        """Any rank reports any load (the liar: whatever suits it)."""
        self.routing.observe_load(r % self.n, Load(waiting, running, kv))

    @rule(r=st.integers(0, 9), k=st.integers(1, 3))
    def abort(self, r: int, k: int) -> None:
        """The client ends requests (a timeout, a cancel): no completion."""
        rank = r % self.n
        self.routing.release(rank, sorted(self.routing.inflight_ids(rank))[:k])

    @precondition(lambda self: self.n > 2)
    @rule(r=st.integers(0, 9))
    def restart(self, r: int) -> None:
        """A rank dies and its next incarnation comes up: untimed again."""
        rank = r % self.n
        self.routing.take_down(rank)
        self.routing.set_up(rank)
        self.completed[rank] = False

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def the_fewest_outputs_per_request_are_kept_exactly(self) -> None:
        routing = self.routing
        known = [routing._tokens[r] for r in range(self.n) if routing._tokens[r]]
        up = [t for r, t in enumerate(routing._tokens) if t and routing.is_up(r)]
        assert len(known) == len(up)  # a rank that goes down forgets its count
        assert routing._fewest == min(up, default=0.0)

    @invariant()
    def completions_confirm_timing(self) -> None:
        for rank in range(self.n):
            if self.routing.step_time(rank) is not None:
                assert self.completed[rank], (
                    f"unconfirmed timing: rank {rank} has a step time "
                    f"({self.routing.step_time(rank)}) and never finished a request"
                )


# -- the finding's experiment, on a simulated clock -------------------------------------


@dataclass
class Outcome:
    """What `simulate` measured."""

    share: float
    """Of all picks, the fraction that went to rank 0."""
    completed: int
    """Requests that finished (client timeouts excluded)."""
    latency: float
    """Mean submit-to-finish time of those, s."""
    p99: float
    most_held: int
    """The most requests rank 0 ever held."""


def simulate(
    routing: Routing,
    rank0: str,
    *,
    seconds: float = 30.0,
    clients: int = 64,
    capacity: int = 16,
    step: float = 0.02,
    late: float = 10.0,
    timeout: float = 15.0,
    seed: int = 1,
) -> Outcome:
    """The hostile review's experiment in the core, time a value: `clients` closed-loop
    clients over `routing`'s ranks (`capacity` each), requests of 8 to 64 tokens, a
    client timeout of `timeout`. Ranks 1.. step every `step` s, one output for each of
    their first `capacity` requests. Rank 0 is ``"late"``: an empty output for each of
    its requests every 1 ms, each finished `late` s after it came; ``"never"``: the
    same, never finished; ``"slow"``: honest, 3x slower than the others. Fed as the
    dispatcher feeds `Routing` (running counted before the batch frees its slots)."""
    rng = random.Random(seed)
    ranks = routing.size
    for r in range(ranks):
        routing.set_capacity(r, capacity)
    born: dict[str, float] = {}
    left: dict[str, int] = {}
    queues: list[list[str]] = [[] for _ in range(ranks)]
    picks = [0] * ranks
    latencies: list[float] = []
    most_held = 0
    tick = 0.001
    every = round(step / tick)

    def submit(now: float) -> None:
        nonlocal most_held
        rid = f"q{sum(picks)}"
        rank = routing.select(rid)
        picks[rank] += 1
        born[rid], left[rid] = now, rng.randint(8, 64)
        queues[rank].append(rid)
        most_held = max(most_held, len(queues[0]))

    def batch(rank: int, now: float, outputs: int, done: list[str]) -> None:
        running = len(queues[rank])
        for rid in done:
            queues[rank].remove(rid)
            latencies.append(now - born[rid])
        routing.release(rank, done)
        routing.observe_outputs(rank, now, outputs, running)

    for _ in range(clients):
        submit(0.0)
    for t in range(1, round(seconds / tick) + 1):
        now = t * tick
        for rank, queue in enumerate(queues):
            if not queue:
                continue
            if rank == 0 and rank0 != "slow":
                done = []
                if rank0 == "late":
                    done = [rid for rid in queue if now - born[rid] >= late]
                batch(0, now, len(queue), done)
            elif t % (every * (3 if rank == 0 else 1)) == rank:
                active = queue[:capacity]
                for rid in active:
                    left[rid] -= 1
                batch(rank, now, len(active), [rid for rid in active if not left[rid]])
        for rank, queue in enumerate(queues):  # client timeouts: aborts, no completion
            expired = [rid for rid in queue if now - born[rid] >= timeout]
            for rid in expired:
                queue.remove(rid)
            routing.release(rank, expired)
        while sum(len(q) for q in queues) < clients:  # the closed loop: one out, one in
            submit(now)
    latencies.sort()
    return Outcome(
        share=picks[0] / sum(picks),
        completed=len(latencies),
        latency=sum(latencies) / max(1, len(latencies)),
        p99=latencies[int(0.99 * len(latencies))] if latencies else math.inf,
        most_held=most_held,
    )
