"""Which rank takes a request: per-rank load snapshots and in-flight id sets, in one object.

Theory of operation
-------------------
One object holds both the last load each rank reported and the ids this client has in
flight on each rank, because every decision reads both and the SMG connector learned the
hard way that two separately locked maps deadlock (see docs/design.md). Here there
are no locks at all: the object is used from one trio task at a time.

* `select` scores every up rank as
  ``max(own_inflight, waiting + running) + waiting * 6 * max(0, kv - 0.5)``
  and reserves the winner in the same call. The in-flight floor makes a burst between
  two load reports spread out instead of piling onto one stale minimum. The winner is
  the first strictly lowest score in rotated order: from a start index that moves by one
  per unpinned pick (even one that raises; pinned picks leave it alone), wrapping. So
  ties (a cold start) go round-robin. No up rank, or none with a finite score:
  `NoEngineAvailable`.
* Speed-aware (`speed=True`, the group's default `routing="speed"`): the score is
  `speed_score` instead, how long a new request would take on the rank in seconds:
  its step time (under `SPEED_BAND` of the fastest: the fastest's) x (1 + the
  lifetimes it would wait for a slot past the rank's capacity + `SPEED_SPREAD` x the
  least-loaded score / capacity). A rank's step time is the time per output per
  running request (`observe_outputs`, from the dispatcher's clock: one step gives each
  running request one output, however the engine batches them) over runs of
  `STEP_RUN` steps while it holds requests, averaged; its
  capacity is `max_num_seqs` from its handshake (`set_capacity`). So a slower rank
  gets requests only once the faster ones are full enough that waiting there takes
  longer, and equally fast ranks get them as least-loaded gives them. Every score
  rests on values that change only through the methods that rescore (the fastest
  step time is rounded to a grid, `SPEED_GRID`, and every score is rewritten when that
  rounding changes; so is the slowest, rounded up: the ceiling), so the index below
  still chooses exactly what the scan does.
  A rank that got slower is timed again only while it holds requests: one that is
  avoided keeps its old step time until the faster ranks fill up.
* A lying rank (the hostile review: empty outputs every 1 ms looked 20x faster and drew
  80 % of the requests) is met twice. First, timing needs completions: runs count only
  once a batch ends one of the rank's requests, so a rank that never finishes is never
  timed (it counts as the fastest, and shares by load with it); and a rank whose
  outputs per finished request exceed `TOKENS_SPREAD` x the group's fewest has its step
  time stretched by the excess, so padding requests with empty outputs buys nothing
  (bodies are opaque: the core cannot count tokens, only outputs and completions).
  Second, whatever timing a rank shows, it is bounded:

  **The share bound.** Let ``cost_r(h) = 1 + max(0, (h + 1 - C) / C) + SPEED_SPREAD x
  h / C`` for a rank of effective capacity C (``h + 1`` if no rank gave one), strictly
  increasing in the load score h, and ``K_r`` its `lead`, `SPEED_LEAD` x C
  (`SPEED_LEAD_REQUESTS` with no capacity). Every rank's credited step is at most the
  ceiling G (the slowest up rank's step time, rounded up on the grid; at least the
  reference), and from ``h_r >= K_r`` on, ``speed_score(r) >= G x cost_r(h_r - K_r)``.
  So an unpinned pick of r at ``h_r >= K_r`` gives, for every other candidate q,
  ``G cost_r(h_r - K_r) <= score(r) <= score(q) <= G cost_q(h_q)``, that is
  ``cost_r(h_r - K_r) <= cost_q(h_q)``: with equal capacities ``h_r <= h_q + K_r``.
  **Timing takes a rank at most K_r = 2 x its capacity past the pick least-loaded would
  make** (by load per capacity if capacities differ; a claimed capacity counts for at
  most `CAPACITY_SPREAD` x the smallest): right after any pick of it, it holds at most
  ``min_q h_q + K_r + 1`` (its fair share + its lead; h_q at that pick). Its share of
  the requests is what that many slots turn over: few, for a rank that finishes late.
  The bound costs an honest fast rank nothing until it holds 2 capacities more than a
  slower one (P5's, 3x faster, holds about 1.5 capacities more).
* Below `TREE_MIN_SIZE` ranks the winner is found by scanning every rank. From there on
  an index keeps a pick at O(log N) instead of O(N): a min segment tree (an implicit
  binary tree in one list; node i has children 2i and 2i + 1, node 1 is the root) whose
  leaf r holds rank r's score, +inf for a down rank and for the padding up to a power of
  two. The winner is the first leaf at or after the start, wrapping, that equals the
  root: climb from the start leaf to the first subtree to its right whose minimum is
  the root's and descend into it, or, if there is none, descend from the root (the first
  minimum of all). That is the scan's choice exactly, ties included, and an up rank with
  an infinite score is skipped by both. Every change to a score (the reservation in
  `select`, `release` and the load zeroing in it, `observe_load`, `set_up`, `take_down`)
  rewrites its leaf with what `score` returns, so both compare the same floats (never
  NaN: an unknown KV usage adds nothing). tests/core/test_routing.py runs the two
  side by side.
* Prefix affinity (``routing="prefix"``: a `PrefixIndex` given, and `select` given the
  prompt's token ids): an unpinned pick hashes the prompt into block keys and reads
  the tokens each rank caches (`PrefixIndex.match`). If a rank within the band
  (``load_score <= least x 1.25 + 2``, on `load_score` whatever the routing: its slack is
  in requests) caches some, `pick` chooses: the most cached, then the least loaded, then
  the rotation; in a lockstep group, the least pending prefill (prompt tokens minus
  cached of requests sent and not yet started: `started`, `release`) plus this
  prompt's uncached tokens (tpu-inference#3315). Otherwise it is the load decision
  exactly, as without a prefix. Either way the rotation moves by one, the rank is
  reserved and the prompt indexed on it. The cost is in the prompt, not in N: about
  300 µs for 4,096 tokens, hashing mostly (benchmarks/bench_prefix_pick.py).
* Admission: a rank may have an in-flight cap (`set_cap`). A rank at its cap is not a
  candidate (its leaf is +inf, as for a down rank); a request pinned to it, or an
  unpinned one when every up rank is at its cap, raises `Overloaded`, distinct from
  `NoEngineAvailable` (no rank up at all). A cap lowered below what a rank holds takes
  nothing away: the rank just gets no more until it is under the cap.
* In-flight slots are held **by id**, never by count. A request can end along several
  racing paths (terminal output, `finished`, abort, rollback) and `release` is called on
  more than one of them; removing an id twice must free one slot, not two.
* A rank's last report was sampled before its last request finished. So when its set
  becomes empty, its reported queue counts are stale by construction and are zeroed
  (KV usage is kept: cache pages outlive requests). For the same reason a report that
  arrives while the set is empty is stored with zero queue counts.
* Reports carry a per-incarnation `seq`; one older than a report already applied is
  ignored. Taking a rank down forgets its snapshot and returns the ids it held.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import ClassVar

from .errors import InvalidRank, NoEngineAvailable, Overloaded
from .messages import Load
from .prefix import BAND, SLACK, PrefixIndex, pick

__all__ = [
    "CAPACITY_SPREAD",
    "KV_THRESHOLD",
    "KV_WEIGHT",
    "SPEED_BAND",
    "SPEED_GRID",
    "SPEED_LEAD",
    "SPEED_LEAD_REQUESTS",
    "SPEED_SPREAD",
    "STEP_RUN",
    "STEP_WEIGHT",
    "TOKENS_SPREAD",
    "Routing",
]

KV_WEIGHT = 6.0
KV_THRESHOLD = 0.5
SPEED_SPREAD = 0.5
"""`Routing.speed_score`: the weight of a rank's load (as a fraction of its capacity)."""
SPEED_BAND = 0.25
"""`Routing.speed_score`: ranks this much slower than the fastest count as equally fast."""
CAPACITY_SPREAD = 4
"""`Routing.effective_capacity`: the most a rank's capacity counts for, in multiples of
the smallest in the group."""
SPEED_GRID = 1.1
"""`Routing.observe_outputs`: the fastest step time is rounded to a power of this."""
STEP_RUN = 4
"""`Routing.observe_outputs`: steps per step-time sample."""
STEP_WEIGHT = 0.25
"""`Routing.observe_outputs`: the weight of the newest sample in the average."""
SPEED_LEAD = 2
"""`Routing.lead`: how far past its fair share timing alone can take a rank, in
capacities (its effective one)."""
SPEED_LEAD_REQUESTS = 16
"""`Routing.lead` of a rank whose capacity is not known (nobody gave one), in requests."""
TOKENS_SPREAD = 4.0
"""`Routing.observe_outputs`: a rank whose finished requests got more than this many
times the group's fewest outputs per request has its step time stretched by the excess."""
_IDLE = Load()
_NOTHING = (0.0, 0.0)


class Routing:
    """Least-loaded selection with in-flight reservations, for ranks ``0 .. size-1``.

    `tree` forces the selection index on (True) or off (False); by default it is used
    when `size` is at least `TREE_MIN_SIZE`. Both choose the same ranks."""

    __slots__ = (
        "_cadence",
        "_cap",
        "_capacity",
        "_ceiling",
        "_fastest",
        "_fewest",
        "_inflight",
        "_leaves",
        "_load",
        "_lockstep",
        "_next_start",
        "_outputs",
        "_pending",
        "_prefill_pending",
        "_reference",
        "_seq",
        "_slowest",
        "_smallest_capacity",
        "_speed",
        "_step",
        "_timing",
        "_tokens",
        "_tree",
        "_up",
        "prefilling",
        "prefix",
        "prefix_cached_tokens",
        "prefix_hits",
        "prefix_prompt_tokens",
        "prefix_routed",
        "size",
    )

    TREE_MIN_SIZE: ClassVar[int] = 8
    """The smallest group that selects through the index. A select + release pair breaks
    even at 3 to 4 ranks, but the index also adds about 0.35 µs to every load report;
    at 8 a pair is about 1.2 µs cheaper than the scan (benchmarks/bench_p6_selection.py)."""

    def __init__(
        self,
        size: int,
        *,
        up: bool = False,
        tree: bool | None = None,
        speed: bool = False,
        prefix: PrefixIndex | None = None,
        lockstep: bool = False,
    ) -> None:
        if size < 1:
            raise ValueError(f"a group needs at least one rank, got {size}")
        if prefix is not None and prefix.size != size:
            raise ValueError(f"a prefix index of {prefix.size} ranks for a group of {size}")
        self.size = size
        self.prefix = prefix
        """Prefix affinity (`select`'s `prefix`; None: off)."""
        self._lockstep = lockstep
        # lockstep prefix affinity: wire id -> (rank, prefill tokens) until its first
        # output or its end, and their sum per rank (`pick`'s `pending`)
        self.prefilling: dict[str, tuple[int, int]] = {}
        self._prefill_pending = [0.0] * size
        self.prefix_routed = 0
        """Unpinned requests routed with token ids."""
        self.prefix_hits = 0
        """Of those, sent to a rank believed to cache a prefix of theirs."""
        self.prefix_cached_tokens = 0
        """Prompt tokens those ranks were believed to cache."""
        self.prefix_prompt_tokens = 0
        """Prompt tokens of the requests routed with token ids."""
        self._speed = speed
        self._capacity: list[int | None] = [None] * size
        self._step = [0.0] * size  # the step time scores use (seconds); 0: not known yet
        self._cadence = [0.0] * size  # seconds per step from runs of outputs (EWMA)
        self._tokens = [0.0] * size  # outputs per finished request (EWMA); 0: not known
        self._outputs = [0] * size  # outputs since the rank last finished a request
        self._fewest = 0.0  # the smallest known `_tokens` of an up rank (0: none)
        self._timing: list[tuple[float, float] | None] = [None] * size  # (since, steps)
        # finished runs no completion has confirmed yet: (seconds, steps)
        self._pending: list[tuple[float, float]] = [_NOTHING] * size
        self._fastest = 0.0  # the smallest known `_step`, assumed for ranks not timed yet
        self._slowest = 0.0  # the largest known `_step`
        self._reference = 1.0  # `_fastest` on a grid: what `speed_score` assumes for it
        self._ceiling = 1.0  # the slowest step time on a grid, rounded up: `speed_score`
        self._smallest_capacity: int | None = None
        self._up = [up] * size
        self._inflight: list[set[str]] = [set() for _ in range(size)]
        self._load: list[Load] = [_IDLE] * size
        self._seq: list[int | None] = [None] * size
        self._cap: list[int | None] = [None] * size
        self._next_start = 0
        if tree is None:
            tree = size >= self.TREE_MIN_SIZE
        # The min segment tree: node i has children 2i and 2i + 1, node 1 is the root,
        # leaf `leaves + r` is rank r's score (+inf if down). None: select by scanning.
        self._leaves = 1 << (size - 1).bit_length()
        self._tree: list[float] | None = None
        if tree:
            nodes = [math.inf] * (2 * self._leaves)
            for r in range(size):
                nodes[self._leaves + r] = self.score(r) if up else math.inf
            for i in range(self._leaves - 1, 0, -1):
                left, right = nodes[2 * i], nodes[2 * i + 1]
                nodes[i] = left if left <= right else right
            self._tree = nodes

    # -- rank lifecycle ---------------------------------------------------------------

    def is_up(self, rank: int) -> bool:
        return 0 <= rank < self.size and self._up[rank]

    def set_up(self, rank: int) -> None:
        """Make `rank` selectable, with a fresh incarnation: no load, no seq, no step
        time yet (see `set_capacity`)."""
        self._up[rank] = True
        self._load[rank] = _IDLE
        self._seq[rank] = None
        if self.prefix is not None:  # a new incarnation: an empty cache
            self.prefix.forget(rank)
        self._forget_step(rank)
        if self._tree is not None:
            self._rescore(rank)

    def take_down(self, rank: int) -> set[str]:
        """Stop selecting `rank`; return (and forget) the ids it held."""
        self._up[rank] = False
        held = self._inflight[rank]
        self._inflight[rank] = set()
        if self.prefix is not None:
            self.prefix.forget(rank)
            if self.prefilling:
                self._prefill_done(held)
        self._load[rank] = _IDLE
        self._seq[rank] = None
        self._forget_step(rank)
        return held

    def _forget_step(self, rank: int) -> None:
        """A rank went down or came back: its step time belongs to the incarnation that
        is gone (a fastest rank that died must not set the others' reference)."""
        self._timing[rank] = None
        self._pending[rank] = _NOTHING
        tokens = self._tokens[rank]
        self._step[rank] = self._cadence[rank] = self._tokens[rank] = 0.0
        self._outputs[rank] = 0
        if tokens and tokens == self._fewest:
            self._fewest = self._least_tokens()
        self._refresh_fastest(rank)
        if self._tree is not None:
            self._rescore(rank)

    def set_capacity(self, rank: int, capacity: int | None) -> None:
        """How many requests `rank` runs at once (its `max_num_seqs`; None: unknown).
        Speed-aware scores use at most `CAPACITY_SPREAD` x the smallest known capacity,
        and that smallest for a rank that gave none (`effective_capacity`)."""
        self._capacity[rank] = capacity if type(capacity) is int and capacity > 0 else None
        smallest = min((c for c in self._capacity if c is not None), default=None)
        if smallest != self._smallest_capacity:
            self._smallest_capacity = smallest
            if self._tree is not None:
                for r in range(self.size):
                    self._rescore(r)
                return
        if self._tree is not None:
            self._rescore(rank)

    def effective_capacity(self, rank: int) -> int | None:
        """The capacity speed-aware scores use: the rank's own, bounded by
        `CAPACITY_SPREAD` x the smallest in the group (an engine that claims 2**62 must
        not take every request), or that smallest if it gave none (None: nobody did)."""
        smallest = self._smallest_capacity
        own = self._capacity[rank]
        if smallest is None:
            return own
        if own is None:
            return smallest
        bound = CAPACITY_SPREAD * smallest
        return own if own < bound else bound

    def set_cap(self, rank: int, cap: int | None) -> None:
        """`rank` takes at most `cap` requests in flight (None: no cap)."""
        if cap is not None and (type(cap) is not int or cap < 1):
            raise ValueError(f"an in-flight cap must be a positive int or None, got {cap!r}")
        self._cap[rank] = cap
        if self._tree is not None:
            self._rescore(rank)

    def cap(self, rank: int) -> int | None:
        return self._cap[rank]

    def has_room(self, rank: int) -> bool:
        """Whether `rank` is up and under its in-flight cap."""
        if not self._up[rank]:
            return False
        cap = self._cap[rank]
        return cap is None or len(self._inflight[rank]) < cap

    # -- selection and release --------------------------------------------------------

    def score(self, rank: int) -> float:
        """The score of `rank` (lower is better): `load_score`, or with `speed` on,
        `speed_score`."""
        if self._speed:
            return self.speed_score(rank)
        return self.load_score(rank)

    def load_score(self, rank: int) -> float:
        """The least-loaded score of `rank`: requests it holds or has queued."""
        load = self._load[rank]
        score = float(max(len(self._inflight[rank]), load.waiting + load.running))
        if load.waiting:
            kv = load.kv
            if kv > KV_THRESHOLD:  # False for NaN: an unknown KV usage adds nothing
                score += load.waiting * KV_WEIGHT * (kv - KV_THRESHOLD)
        return score

    def speed_score(self, rank: int) -> float:
        """How long a new request would take on `rank`, in step times: a rank under its
        capacity runs it at once; past it, the request waits about ``queued / capacity``
        request lifetimes for a slot. ``SPEED_SPREAD x load / capacity`` more spreads
        requests over equally fast ranks as least-loaded does (their step times grow
        with their batches). A rank within `SPEED_BAND` of the fastest counts as the
        fastest (measurement noise must not unbalance equal ranks), and so does one
        not timed yet. With no capacity known, the load counts in full.

        From its `lead` on, a rank scores at least what the slowest rank would score
        with ``lead`` requests fewer (`_ceiling`): past its fair share by its lead,
        timing no longer helps it (the share bound, module docstring)."""
        fastest = self._reference
        step = self._step[rank]
        if step < fastest * (1.0 + SPEED_BAND):
            step = fastest
        held = self.load_score(rank)
        capacity = self.effective_capacity(rank)
        if capacity is None:
            score = step * (held + 1.0)
            lead = SPEED_LEAD_REQUESTS
        else:
            queued = held + 1.0 - capacity
            wait = queued / capacity if queued > 0 else 0.0
            score = step * (1.0 + wait + SPEED_SPREAD * held / capacity)
            lead = SPEED_LEAD * capacity
        if held >= lead:  # the share bound: past its lead, timing no longer helps
            bound = self._ceiling * _cost(held - lead, capacity)
            if bound > score:
                score = bound
        return score

    def lead(self, rank: int) -> int:
        """How many requests past its fair share timing alone can take `rank`:
        `SPEED_LEAD` x its effective capacity (`SPEED_LEAD_REQUESTS` if none is known)."""
        capacity = self.effective_capacity(rank)
        return SPEED_LEAD * capacity if capacity is not None else SPEED_LEAD_REQUESTS

    def select(
        self,
        request_id: str,
        rank: int | None = None,
        *,
        name: str | None = None,
        prefix: tuple[Sequence[int], int] | None = None,
    ) -> int:
        """Choose a rank for `request_id` and reserve it there.

        A pinned `rank` is taken as is if it exists and is up (else `InvalidRank`) and
        under its cap (else `Overloaded`), and does not move the rotation. Raises
        `NoEngineAvailable` if no rank is up, `Overloaded` if every up rank is at its
        cap. Errors name the request `name` (default: `request_id`).

        `prefix`: the prompt's token ids and the root key of their chain; with the
        prefix index on, an unpinned pick prefers the rank that caches most of it
        within the load band (`_select_prefix`), and the prompt is indexed on the rank
        chosen. Without it, or with the index off, the pick is the load decision.
        """
        if rank is None and prefix is not None and self.prefix is not None:
            return self._select_prefix(request_id, name, prefix[0], prefix[1])
        if rank is not None:
            if not 0 <= rank < self.size:
                raise InvalidRank(
                    rank, self.size, name or request_id, f"out of range for a group of {self.size}"
                )
            if not self._up[rank]:
                raise InvalidRank(rank, self.size, name or request_id, "the rank is down")
            cap = self._cap[rank]
            if cap is not None and len(self._inflight[rank]) >= cap:
                raise Overloaded(name or request_id, rank, cap)
            self._inflight[rank].add(request_id)
            if self._tree is not None:
                self._rescore(rank)
            return rank
        size = self.size
        start = self._next_start
        self._next_start = start + 1 if start + 1 < size else 0
        if self._tree is not None:
            best = self._first_minimum(start)
            if best < 0:
                raise self._none_free(name or request_id)
            self._inflight[best].add(request_id)
            self._rescore(best)
            return best
        best = -1
        best_score = math.inf
        for offset in range(size):
            r = start + offset
            if r >= size:
                r -= size
            if self._up[r]:
                cap = self._cap[r]
                if cap is not None and len(self._inflight[r]) >= cap:
                    continue
                s = self.score(r)
                if s < best_score:
                    best, best_score = r, s
        if best < 0:
            raise self._none_free(name or request_id)
        self._inflight[best].add(request_id)
        return best

    def _select_prefix(
        self, request_id: str, name: str | None, tokens: Sequence[int], root: int
    ) -> int:
        """An unpinned pick with prefix affinity (docs/design.md, "Prefix affinity").

        The band is on `load_score` in both routings (its slack is in requests). If a
        rank in the band caches a prefix, `pick` decides: the most cached, then the
        least loaded, then the rotation; in a lockstep group the least pending prefill
        plus this prompt's uncached tokens. Otherwise the load decision as without a
        prefix (so a workload with no shared prefixes routes exactly as "speed" or
        "least-loaded" does). Either way the rotation moves by one, the rank is
        reserved, and the prompt is indexed on it."""
        index = self.prefix
        assert index is not None
        hashes = index.chain(tokens, root)
        prompt = len(tokens)
        start = self._next_start
        cached = index.cached_tokens(hashes) if hashes else None
        chosen = -1 if cached is None else self._affinity(cached, prompt, start)
        if chosen < 0:
            chosen = self.select(request_id, name=name)  # the load decision; may raise
        else:
            self._next_start = start + 1 if start + 1 < self.size else 0
            self._inflight[chosen].add(request_id)
            if self._tree is not None:
                self._rescore(chosen)
        hit = cached[chosen] if cached is not None else 0
        if hit > prompt:
            hit = prompt
        self.prefix_routed += 1
        self.prefix_prompt_tokens += prompt
        if hit:
            self.prefix_hits += 1
            self.prefix_cached_tokens += hit
        self._index_prompt(chosen, hashes)
        if self._lockstep:
            self.prefilling[request_id] = (chosen, prompt - hit)
            self._prefill_pending[chosen] += prompt - hit
        return chosen

    def _affinity(self, cached: Sequence[int], prompt: int, start: int) -> int:
        """The rank `pick` chooses for a prompt of `prompt` tokens, `cached` per rank,
        if a rank within the band (on `load_score`) caches some; else -1 (the load
        decision then). O(N) if some rank caches some."""
        if not any(cached):
            return -1
        size = self.size
        loads = [self.load_score(r) if self.has_room(r) else math.inf for r in range(size)]
        least = min(loads)
        if least == math.inf:
            return -1
        bound = least * (1.0 + BAND) + SLACK
        if not any(cached[r] and loads[r] <= bound for r in range(size)):
            return -1
        pending = self._prefill_pending if self._lockstep else None
        return pick(loads, cached, prompt, start=start, pending=pending)

    def _index_prompt(self, rank: int, hashes: Sequence[int]) -> None:
        """The prompt was sent to `rank`: its blocks are indexed there."""
        index = self.prefix
        assert index is not None
        index.insert(rank, hashes, index.incarnation(rank))

    def started(self, request_id: str) -> None:
        """`request_id` had its first output: its prefill is no longer pending."""
        entry = self.prefilling.pop(request_id, None)
        if entry is not None:
            rank, tokens = entry
            left = self._prefill_pending[rank] - tokens
            self._prefill_pending[rank] = left if left > 0 else 0.0

    def _prefill_done(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.started(request_id)

    def prefill_pending(self, rank: int) -> float:
        """Lockstep prefix affinity: prefill tokens sent to `rank` and not yet started."""
        return self._prefill_pending[rank]

    def _none_free(self, name: str) -> Exception:
        """Why an unpinned pick found no rank: none up, or every up rank full."""
        if any(self._up):
            return Overloaded(name)
        return NoEngineAvailable(name, self.size)

    def release(self, rank: int, request_ids: Iterable[str]) -> None:
        """Free the slots of these ids on `rank`. Idempotent by id."""
        held = self._inflight[rank]
        if not held:
            return
        if self.prefilling:
            request_ids = tuple(request_ids)
            self._prefill_done(request_ids)
        held.difference_update(request_ids)
        if not held:
            self._timing[rank] = None  # idle: the gap until its next output is no step
            load = self._load[rank]
            if load.waiting or load.running:
                self._load[rank] = Load(0, 0, load.kv)
        if self._tree is not None:
            self._rescore(rank)

    # -- load reports -----------------------------------------------------------------

    def observe_load(self, rank: int, load: Load, seq: int | None = None) -> bool:
        """Store `load` as rank's newest snapshot unless `seq` says it is older than one
        already applied (or the rank is down). Returns whether it was applied."""
        if not self._up[rank]:
            return False
        if seq is not None:
            last = self._seq[rank]
            if last is not None and seq < last:
                return False
            self._seq[rank] = seq
        if not self._inflight[rank] and (load.waiting or load.running):
            load = Load(0, 0, load.kv)
        self._load[rank] = load
        if self.prefix is not None:
            self.prefix.observe_usage(rank, load.kv)
        if self._tree is not None:
            self._rescore(rank)
        return True

    def observe_outputs(
        self, rank: int, now: float, outputs: int = 1, running: int | None = None
    ) -> None:
        """`rank` delivered `outputs` outputs (each naming a live request of the rank)
        in one batch read at `now` (the dispatcher's time of its pass), while it held
        `running` requests (default: what it holds now; the caller counts them before
        the batch's terminal outputs free their slots).

        Each running request gets one output per step, so the batch stands for
        ``outputs / running`` steps (running capped by the rank's capacity: the rest
        wait in its queue), at most one: one message per step as vLLM's engines send,
        or one per request, give the same step time (counting batches would make a rank
        that sends one per request look `n` times faster the busier it is). A run ends
        after `STEP_RUN` steps once time has moved on (batches read in one pass share
        one `now`).

        Completions confirm the timing (`_confirm`): runs wait, summed, until a batch
        ends one of the rank's requests (`running` more than it holds after the batch),
        and are then averaged in as one sample (`STEP_WEIGHT` for the newest); so an
        engine that streams empty outputs and never finishes is never timed. The same
        completions count the rank's outputs per finished request, which stretch its
        step time where they exceed the group's fewest by more than `TOKENS_SPREAD`:
        an engine that pads each request with empty outputs is timed per request."""
        inflight = self._inflight[rank]
        self._outputs[rank] += outputs
        timing = self._timing[rank]
        if timing is None:
            if inflight:
                self._timing[rank] = (now, 0.0)  # the run starts at this batch
        else:
            since, steps = timing
            held = len(inflight) if running is None else running
            capacity = self._capacity[rank]
            if capacity is not None and held > capacity:
                held = capacity
            if held >= 1 and outputs > 0:
                steps += outputs / held if outputs < held else 1.0
            if steps < STEP_RUN or now <= since:
                self._timing[rank] = (since, steps)
            else:
                self._timing[rank] = (now, 0.0) if inflight else None
                seconds, counted = self._pending[rank]
                self._pending[rank] = (seconds + now - since, counted + steps)
        if running is not None and running > len(inflight):
            self._confirm(rank, running - len(inflight))

    def _confirm(self, rank: int, ended: int) -> None:
        """`ended` requests of `rank` finished: count its outputs per finished request,
        average in the runs that waited for a completion, and set the step time the
        scores use: the runs' time per step, times how far its outputs per finished
        request exceed `TOKENS_SPREAD` x the group's fewest (if they do)."""
        tokens = self._outputs[rank] / ended
        self._outputs[rank] = 0
        old = self._tokens[rank]
        mine = self._tokens[rank] = tokens if not old else old + STEP_WEIGHT * (tokens - old)
        fewest = self._fewest  # kept without a pass over the ranks unless the least rose
        if mine and self._up[rank] and (not fewest or mine <= fewest):
            self._fewest = mine
        elif old and old == fewest:
            self._fewest = self._least_tokens()
        seconds, steps = self._pending[rank]
        if not steps:
            return
        self._pending[rank] = _NOTHING
        sample = seconds / steps
        old = self._cadence[rank]
        cadence = self._cadence[rank] = sample if not old else old + STEP_WEIGHT * (sample - old)
        fewest = self._fewest
        excess = mine / (TOKENS_SPREAD * fewest) if fewest else 1.0
        old = self._step[rank]
        new = self._step[rank] = cadence * excess if excess > 1.0 else cadence
        if self._fastest < old < self._slowest and self._fastest < new < self._slowest:
            if self._speed and self._tree is not None:  # neither the fastest nor the slowest
                self._rescore(rank)
            return
        self._refresh_fastest(rank)

    def _least_tokens(self) -> float:
        up = self._up
        return min((t for r, t in enumerate(self._tokens) if t and up[r]), default=0.0)

    def _refresh_fastest(self, rank: int) -> None:
        """`rank`'s step time changed (or was forgotten): recompute the fastest and
        slowest of the ranks that are up, their rounded reference and ceiling, and
        rewrite the scores that use them (all of them if either moved, else `rank`'s)."""
        up = self._up
        known = [s for r, s in enumerate(self._step) if s and up[r]]
        fastest = self._fastest = min(known, default=0.0)
        slowest = self._slowest = max(known, default=0.0)
        # The step time the scores assume for the fastest ranks, on a grid of 10 % steps
        # so that it changes rarely: every score that uses it is then rewritten. The
        # ceiling is the slowest's, rounded up: no rank's credited step exceeds it.
        reference = SPEED_GRID ** round(math.log(fastest, SPEED_GRID)) if fastest > 0 else 1.0
        ceiling = self._ceiling
        if not ceiling < slowest * SPEED_GRID or ceiling < slowest:  # off its grid step
            ceiling = SPEED_GRID ** math.ceil(math.log(slowest, SPEED_GRID)) if slowest else 1.0
            if ceiling < slowest:  # log rounded down by a hair
                ceiling *= SPEED_GRID
        if ceiling < reference:
            ceiling = reference
        if reference != self._reference or ceiling != self._ceiling:
            self._reference = reference
            self._ceiling = ceiling
            if self._speed and self._tree is not None:
                for r in range(self.size):
                    self._rescore(r)
                return
        if self._speed and self._tree is not None:
            self._rescore(rank)

    def step_time(self, rank: int) -> float | None:
        """`rank`'s step time as measured by `observe_outputs` (None: not yet)."""
        return self._step[rank] or None

    # -- the selection index ----------------------------------------------------------

    def _rescore(self, rank: int) -> None:
        """Write rank's current score (+inf if down) into its leaf and the minima above
        it, up to the first that does not change. Only called with the index on."""
        tree = self._tree
        assert tree is not None
        if rank < 0:  # the lists took it as an index from the end: so does the tree
            rank += self.size
        value = self.score(rank) if self.has_room(rank) else math.inf
        i = self._leaves + rank
        if tree[i] == value:
            return
        tree[i] = value
        i >>= 1
        while i:
            left = tree[2 * i]
            right = tree[2 * i + 1]
            least = left if left <= right else right
            if tree[i] == least:
                return
            tree[i] = least
            i >>= 1

    def _first_minimum(self, start: int) -> int:
        """The first rank at or after `start`, wrapping, whose leaf equals the minimum
        of all (-1 if that is +inf: no rank up, or none with a finite score)."""
        tree = self._tree
        assert tree is not None
        least = tree[1]
        if least == math.inf:
            return -1
        leaves = self._leaves
        i = leaves + start
        while tree[i] > least:  # nothing in this subtree: go to the next one to its right
            while i & 1:  # a right child: its parent's next subtree is the next one
                i >>= 1
            if not i:  # i was the last at its depth: no minimum at or after `start`
                i = 1  # so wrap: the first minimum of all
                break
            i += 1
        while i < leaves:  # descend to the first minimum in subtree i
            i <<= 1
            if tree[i] > least:
                i += 1
        return i - leaves

    # -- inspection -------------------------------------------------------------------

    def load(self, rank: int) -> Load:
        return self._load[rank]

    def inflight_count(self, rank: int) -> int:
        return len(self._inflight[rank])

    def inflight_ids(self, rank: int) -> frozenset[str]:
        return frozenset(self._inflight[rank])


def _cost(held: float, capacity: int | None) -> float:
    """`Routing.speed_score` in step times, for a rank with `held` requests."""
    if capacity is None:
        return held + 1.0
    queued = held + 1.0 - capacity
    wait = queued / capacity if queued > 0 else 0.0
    return 1.0 + wait + SPEED_SPREAD * held / capacity
