"""Prefix affinity: which ranks probably hold a prompt's prefix in their KV cache, and a
pick that uses it only where load allows (``routing="prefix"``: `Routing.select`).

Theory of operation
-------------------
**The index** (`PrefixIndex`) is approximate: the client knows every prompt it sent and to
which rank, and assumes each rank caches what it was sent, as vLLM's prefix cache does, by
full blocks of ``block_size`` token ids (a partial last block is never cached, nor shared).

* A prompt is a chain of block hashes (`chain`): ``h_i = hash((h_{i-1}, *block_i))``
  from a ``root`` (0, or a hash of whatever splits caches: model, LoRA, cache salt). So
  a block's hash names the whole prefix up to it, and "the longest cached prefix of these
  tokens on rank r" is one walk down the chain, stopping at the first block r lacks.
  The hash is Python's own tuple hash: on ints it does not depend on ``PYTHONHASHSEED``
  (stable across processes, though the index never leaves one), it costs about 0.6 µs a
  block (0.04 µs a token: a 4,096-token prompt takes 160 µs, its walk 50 µs, on this
  loaded 2-core VM), and it is 64 bits wide: n blocks collide with probability about
  n² / 2⁶⁵ (1e-8 for a million). It is not keyed, so a client could craft a prompt whose
  chain collides with another's; the only effect is a wrong belief about what a rank
  caches, that is a misrouted request, which the load band below bounds. The engine's own
  cache uses its own hashes: a collision here never shares KV data.
* One dict maps each block hash to a bit mask of the ranks holding it, so a walk costs
  O(blocks + N) for all N ranks at once (`match`): the mask of ranks still matching
  narrows at each block, and a rank leaves it at the first block it lacks.
* **Eviction.** Each rank keeps its hashes in LRU order (`insert` touches a prompt's
  blocks from the last to the first, so a chain's root is its most recent entry and its
  leaves go first, as vLLM frees a request's blocks tail first). A rank keeps at most
  `limit` blocks: ``min(rank_blocks, max(min_blocks, round(C x (1 - u))))`` where C is the
  rank's KV capacity in blocks (`set_capacity`: vLLM's ``num_gpu_blocks`` from its ready
  response; `rank_blocks` if unknown) and u its last reported KV usage (`observe_usage`,
  0 if unknown or NaN). The model: blocks held by running requests (u x C) are mostly
  outputs and in-flight prompts the index cannot tell apart, and vLLM keeps finished
  requests' blocks cached in its free queue, (1 - u) x C blocks, reused LRU. Assuming
  the index's older entries live in that free part forgets early rather than late: a
  forgotten prefix costs a recompute, a believed one that is gone draws requests for
  nothing. Its limits: the index never sees outputs (multi-turn sessions send them back
  as the next prompt, where they are indexed), other clients' prompts, nor engine-side
  eviction order beyond LRU; a usage drop does not bring forgotten entries back.
  A global cap, `max_blocks`, bounds memory over all ranks: past it, the rank holding
  most blocks (the lowest such rank) drops its least recent one. So memory is
  O(max_blocks) whatever ranks claim (a capacity claim only sets C, bounded by
  `rank_blocks`), and a prompt longer than a rank's limit is indexed up to it.
* A rank that dies or is replaced loses its cache: `forget` drops its entries and takes
  the new incarnation number; an `insert` naming another incarnation is ignored.
* A change of block size (`set_block_size`: the engines' own, from vLLM's ready
  response, so that exact keys are the engine's blocks) clears every rank's entries:
  their keys named other blocks.

**Exact mode** (vLLM engines started with ``--kv-events-config``; `_core/kv_events.py`
turns their events into our own block keys, `block_key`, so both modes share one
index). Every method names the rank's incarnation, and one naming another is ignored:

* `set_exact` (the rank's events are live): its limit becomes its capacity, not shrunk
  by usage (the events say what it holds, in use or free); its approximate entries
  become *predictions*, at most `predicted_blocks` (`PREDICTED_BLOCKS`), the newest:
  an engine reports a block only once it computed it, after prefill, so the prompts
  just sent must count before their events arrive, and no longer.
* `store` (BlockStored): the blocks become exact entries (a predicted one moves over),
  oldest store first; `remove` (BlockRemoved) drops them, exact or predicted; `drop`
  (AllBlocksCleared, or events lost for good) drops every entry and keeps the
  incarnation; `hold` (a replay of missed events under way) makes `match` report
  nothing cached on the rank until released.
* **A hostile engine** can claim any blocks. Its entries count in its limit (its
  capacity, at most `rank_blocks`) and in the global cap, predictions evicted first and
  then its oldest stores: memory stays O(max_blocks). A claim of the whole prompt
  counts as the prompt (`pick` clamps), so it can tie an honest hit, never beat it; and
  the band bounds the requests it draws to what a rank within a quarter (+2) of the
  least-loaded one takes. Turning exact mode off makes its stores approximate entries,
  shrunk to the approximate limit.

**The pick** (`pick`) takes each candidate's load (whatever score the load decision uses;
+inf for a rank that is down or full), its cached tokens for this prompt (from `match`),
and a rotation start, as `Routing.select` does:

* **The band.** Only ranks with ``load <= min_load x (1 + band) + slack`` are eligible,
  in both modes: affinity without a load guard loses (sgl-project/sglang#21199), and a
  rank that lies about its cache (KV events) draws requests only while within the band.
  The default, a quarter over the least load plus two requests, lets a session stay on
  its rank through ordinary noise and sends it elsewhere once its rank holds a quarter
  more than the least-loaded one.
* **Independent ranks** (``pending is None``): the eligible rank with the most cached
  tokens, then the least load, then the first from `start`, wrapping. With nothing
  cached anywhere, that is the load decision (`Routing.select`'s first strictly lowest
  from the same start).
* **Lockstep groups** (``pending`` given: each rank's prefill tokens in flight, as far
  as the client knows), the rule of vllm-project/tpu-inference#3315: minimise the
  resulting maximum rank load, a rank's load being ``pending + prompt - cached``. The
  eligible rank with the least ``pending + prompt - cached`` minimises the maximum too:
  picking r leaves ``max(cost_r, max of the others' pending)``, and that maximum is at
  least the largest pending whatever the pick; so ties go to the least load, then the
  rotation. A rank made hot by affinity no longer wins once its queue outweighs the cache.
* One pick is O(N) after an O(blocks + N) walk. It could be O(log N) + O(blocks): the
  band's least load is the root of `Routing`'s segment tree, only the ranks a walk
  matched (usually few) need their loads read, and the load decision is the tree's pick;
  a second min tree on ``pending`` would serve lockstep groups.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

__all__ = [
    "block_key",
    "BAND",
    "BLOCK_SIZE",
    "PREDICTED_BLOCKS",
    "SLACK",
    "PrefixIndex",
    "chain",
    "pick",
]

BLOCK_SIZE = 16
"""Tokens per block: vLLM's default ``--block-size``."""
BAND = 0.25
"""`pick`: how far above the least load (as a fraction of it) a rank may be and still
win by its cache."""
SLACK = 2.0
"""`pick`: how far above the least load, in load units (requests for the least-loaded
score), a rank may be and still win by its cache."""

PREDICTED_BLOCKS = 512
"""Exact mode (`PrefixIndex.set_exact`): the most approximate entries a rank keeps once
its KV events are live. An engine reports a block only after it computed it (prefill),
so the prompts just sent are predicted for that long; older ones are the events' to
tell."""


def block_key(parent: int | None, block: Sequence[int]) -> int:
    """The key of one full block after the block keyed `parent` (None: the first, under
    root 0): the one content hash both modes use, so blocks a prompt was sent with and
    blocks an engine's KV events say it stored (`_core/kv_events.py`) meet in one index.
    Python's tuple hash of ints: the same in every process (no hash seed), 64 bits."""
    return hash((0 if parent is None else parent, *block))


def chain(tokens: Sequence[int], block_size: int = BLOCK_SIZE, root: int = 0) -> list[int]:
    """The chained hashes of the full blocks of `tokens`: the i-th names tokens
    ``[0, (i + 1) x block_size)`` (module docstring); ``block_key`` applied block by
    block from `root`."""
    hashes: list[int] = []
    parent = root
    for end in range(block_size, len(tokens) + 1, block_size):
        parent = hash((parent, *tokens[end - block_size : end]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Which blocks each of ranks ``0 .. size-1`` probably caches (module docstring)."""

    __slots__ = (
        "_blocks",
        "_capacity",
        "_exact",
        "_held",
        "_holders",
        "_incarnation",
        "_stored",
        "_total",
        "_usage",
        "block_size",
        "max_blocks",
        "min_blocks",
        "predicted_blocks",
        "rank_blocks",
        "size",
    )

    def __init__(
        self,
        size: int,
        *,
        block_size: int = BLOCK_SIZE,
        max_blocks: int = 1 << 20,
        rank_blocks: int | None = None,
        min_blocks: int = 64,
        predicted_blocks: int = PREDICTED_BLOCKS,
    ) -> None:
        if size < 1:
            raise ValueError(f"a group needs at least one rank, got {size}")
        if block_size < 1 or max_blocks < 1:
            raise ValueError("block_size and max_blocks must be positive")
        self.size = size
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.rank_blocks = max_blocks if rank_blocks is None else min(rank_blocks, max_blocks)
        self.min_blocks = min(max(min_blocks, 0), self.rank_blocks)
        self.predicted_blocks = max(predicted_blocks, 0)
        """Exact mode: the most approximate entries (predictions) a rank keeps."""
        self._holders: dict[int, int] = {}  # block hash -> bit mask of the ranks holding it
        # per rank: approximate entries (predictions in exact mode), least recent first
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(size)]
        # per rank: blocks its KV events say it holds (exact mode), oldest store first
        self._stored: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(size)]
        self._exact = [False] * size
        self._held = 0  # bit mask of the ranks `hold` hides from `match`
        self._capacity: list[int | None] = [None] * size
        self._usage = [0.0] * size
        self._incarnation = [0] * size
        self._total = 0

    # -- what ranks report ------------------------------------------------------------

    def limit(self, rank: int) -> int:
        """How many blocks `rank` is assumed to keep: its capacity (or `rank_blocks`)
        times one minus its KV usage, at least `min_blocks`, at most `rank_blocks`.
        In exact mode, its capacity whatever its usage (its events tell what it holds,
        in use or not)."""
        capacity = self._capacity[rank]
        blocks = self.rank_blocks if capacity is None else capacity
        kept = blocks if self._exact[rank] else round(blocks * (1.0 - self._usage[rank]))
        kept = max(kept, self.min_blocks)
        return min(kept, self.rank_blocks)

    def set_block_size(self, block_size: int) -> None:
        """The engines' block size (vLLM's ready response: exact keys must be the
        engine's blocks). A change clears every rank's entries (their keys hashed other
        blocks); incarnations, capacities, usage and modes stay."""
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"a block size must be a positive int, got {block_size!r}")
        if block_size != self.block_size:
            self.block_size = block_size
            for rank in range(self.size):
                self._clear(rank)

    def set_capacity(self, rank: int, blocks: int | None) -> None:
        """`rank`'s KV cache holds `blocks` blocks (vLLM's ``num_gpu_blocks``; None or
        junk: unknown). Shrinks its entries to the new `limit`."""
        self._capacity[rank] = blocks if type(blocks) is int and blocks >= 0 else None
        self._shrink(rank)

    def observe_usage(self, rank: int, kv: float) -> None:
        """`rank` reported KV usage `kv` (a fraction; NaN: unknown, counted as 0)."""
        self._usage[rank] = min(kv, 1.0) if kv > 0.0 else 0.0  # False for NaN
        self._shrink(rank)

    # -- lifecycle ----------------------------------------------------------------------

    def incarnation(self, rank: int) -> int:
        return self._incarnation[rank]

    def forget(self, rank: int, incarnation: int | None = None) -> None:
        """`rank` died or was replaced: drop its entries, its capacity and usage (the new
        incarnation reports its own), leave exact mode and any `hold`, and take
        `incarnation` (default: the next) as its current one."""
        self._clear(rank)
        self._capacity[rank] = None
        self._usage[rank] = 0.0
        self._exact[rank] = False
        self._held &= ~(1 << rank)
        current = self._incarnation[rank]
        self._incarnation[rank] = current + 1 if incarnation is None else incarnation

    def _clear(self, rank: int) -> None:
        """Drop every entry of `rank`, approximate and exact."""
        bit = ~(1 << rank)
        holders = self._holders
        for entries in (self._blocks[rank], self._stored[rank]):
            for h in entries:
                mask = holders.get(h, 0) & bit
                if mask:
                    holders[h] = mask
                else:
                    holders.pop(h, None)
        self._total -= len(self._blocks[rank]) + len(self._stored[rank])
        self._blocks[rank] = OrderedDict()
        self._stored[rank] = OrderedDict()

    # -- exact mode (KV events) ---------------------------------------------------------

    def _current(self, rank: int, incarnation: int | None) -> bool:
        return incarnation is None or incarnation == self._incarnation[rank]

    def is_exact(self, rank: int) -> bool:
        return self._exact[rank]

    def set_exact(self, rank: int, on: bool, incarnation: int | None = None) -> None:
        """`rank`'s KV events are live (`on`) or no longer are. On: its approximate
        entries become predictions, the newest `predicted_blocks` at most, and its
        limit stops shrinking with its usage. Off: its exact entries become approximate
        ones (older than its predictions), shrunk to the approximate limit."""
        if not self._current(rank, incarnation) or self._exact[rank] == on:
            return
        self._exact[rank] = on
        if not on:
            stored = self._stored[rank]
            blocks = self._blocks[rank]
            merged: OrderedDict[int, None] = OrderedDict.fromkeys(stored)
            merged.update(blocks)  # (disjoint: a stored key is never predicted too)
            self._blocks[rank] = merged
            self._stored[rank] = OrderedDict()
        self._shrink(rank)

    def store(self, rank: int, keys: Sequence[int], incarnation: int | None = None) -> None:
        """`rank`'s engine holds the blocks `keys` (BlockStored: our `block_key`s, in
        chain order). They become its newest exact entries (a predicted one moves
        over), counted in its `limit` and the global cap: past them, its predictions go
        first, then its oldest stores. A stale `incarnation` is ignored."""
        if not self._current(rank, incarnation):
            return
        stored = self._stored[rank]
        blocks = self._blocks[rank]
        holders = self._holders
        bit = 1 << rank
        added = 0
        for h in keys:
            if h in stored:
                stored.move_to_end(h)
                continue
            stored[h] = None
            if h in blocks:
                del blocks[h]
            else:
                holders[h] = holders.get(h, 0) | bit
                added += 1
        self._total += added
        self._shrink(rank)
        while self._total > self.max_blocks:
            self._evict(self._fullest(), 1)

    def remove(self, rank: int, keys: Sequence[int], incarnation: int | None = None) -> None:
        """`rank`'s engine evicted the blocks `keys` (BlockRemoved): gone from its
        entries, exact or predicted. A stale `incarnation` is ignored."""
        if not self._current(rank, incarnation):
            return
        stored = self._stored[rank]
        blocks = self._blocks[rank]
        holders = self._holders
        bit = ~(1 << rank)
        for h in keys:
            if h in stored:
                del stored[h]
            elif h in blocks:
                del blocks[h]
            else:
                continue
            self._total -= 1
            mask = holders[h] & bit
            if mask:
                holders[h] = mask
            else:
                del holders[h]

    def drop(self, rank: int, incarnation: int | None = None) -> None:
        """Every entry of `rank` is gone (AllBlocksCleared, or events lost for good);
        its incarnation, capacity, usage and mode stay. A stale `incarnation` is
        ignored."""
        if self._current(rank, incarnation):
            self._clear(rank)

    def hold(self, rank: int, held: bool, incarnation: int | None = None) -> None:
        """While `held` (a replay of missed events is under way), `match` reports
        nothing cached on `rank`: its entries may be stale. A stale `incarnation` is
        ignored."""
        if not self._current(rank, incarnation):
            return
        if held:
            self._held |= 1 << rank
        else:
            self._held &= ~(1 << rank)

    # -- prompts ------------------------------------------------------------------------

    def chain(self, tokens: Sequence[int], root: int = 0) -> list[int]:
        return chain(tokens, self.block_size, root)

    def insert(self, rank: int, hashes: Sequence[int], incarnation: int | None = None) -> None:
        """A prompt whose `chain` is `hashes` was sent to `rank` (of `incarnation`, if
        given: another one's prompt is ignored). Its first `limit` blocks become the
        rank's most recent entries, the root the most recent of all."""
        if incarnation is not None and incarnation != self._incarnation[rank]:
            return
        limit = self.limit(rank)
        if self._exact[rank] and limit > self.predicted_blocks:
            limit = self.predicted_blocks
        if len(hashes) > limit:
            hashes = hashes[:limit]
        blocks = self._blocks[rank]
        holders = self._holders
        bit = 1 << rank
        added = 0
        stored = self._stored[rank]
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            elif h in stored:  # the engine said it holds it: no prediction needed
                continue
            else:
                blocks[h] = None
                holders[h] = holders.get(h, 0) | bit
                added += 1
        self._total += added
        self._shrink(rank)
        while self._total > self.max_blocks:
            self._evict(self._fullest(), 1)

    def match(self, hashes: Sequence[int]) -> list[int]:
        """How many leading blocks of the prompt whose `chain` is `hashes` each rank
        holds (multiply by `block_size` for tokens). Touches nothing."""
        matched = [0] * self.size
        holders = self._holders
        mask = ((1 << self.size) - 1) & ~self._held
        if not mask:
            return matched
        for depth, h in enumerate(hashes):
            held = holders.get(h, 0) & mask
            gone = mask & ~held
            while gone:  # the ranks that stop here
                low = gone & -gone
                matched[low.bit_length() - 1] = depth
                gone ^= low
            mask = held
            if not mask:
                return matched
        depth = len(hashes)
        while mask:
            low = mask & -mask
            matched[low.bit_length() - 1] = depth
            mask ^= low
        return matched

    def cached_tokens(self, hashes: Sequence[int]) -> list[int]:
        """`match` in tokens."""
        size = self.block_size
        return [m * size for m in self.match(hashes)]

    # -- inspection ---------------------------------------------------------------------

    def blocks(self, rank: int) -> int:
        """Entries of `rank`, approximate and exact."""
        return len(self._blocks[rank]) + len(self._stored[rank])

    def stored(self, rank: int) -> int:
        """Exact entries of `rank` (`store`)."""
        return len(self._stored[rank])

    @property
    def total(self) -> int:
        """Entries over all ranks (at most `max_blocks`)."""
        return self._total

    @property
    def distinct(self) -> int:
        """Distinct blocks over all ranks (at most `total`): the hash-to-ranks map's size."""
        return len(self._holders)

    # -- eviction -----------------------------------------------------------------------

    def _shrink(self, rank: int) -> None:
        excess = self.blocks(rank) - self.limit(rank)
        if self._exact[rank]:
            excess = max(excess, len(self._blocks[rank]) - self.predicted_blocks)
        if excess > 0:
            self._evict(rank, excess)

    def _fullest(self) -> int:
        """The rank holding most blocks (the lowest such rank). O(N), only past the
        global cap."""
        counts = [self.blocks(r) for r in range(self.size)]
        return counts.index(max(counts))

    def _evict(self, rank: int, count: int) -> None:
        """Drop `rank`'s `count` least recent entries: approximate ones (predictions)
        first, then the oldest exact ones."""
        blocks = self._blocks[rank]
        stored = self._stored[rank]
        holders = self._holders
        bit = ~(1 << rank)
        for _ in range(count):
            if blocks:  # (a key is never both predicted and stored)
                h, _ = blocks.popitem(last=False)
            else:
                h, _ = stored.popitem(last=False)
            mask = holders[h] & bit
            if mask:
                holders[h] = mask
            else:
                del holders[h]
        self._total -= count


def pick(
    loads: Sequence[float],
    cached: Sequence[int],
    prompt: int,
    *,
    start: int = 0,
    pending: Sequence[float] | None = None,
    band: float = BAND,
    slack: float = SLACK,
) -> int:
    """The rank for a prompt of `prompt` tokens (module docstring): `loads` per rank
    (+inf: not a candidate), `cached` tokens per rank, `pending` prefill tokens per rank
    for a lockstep group (None: independent ranks). -1 if no rank has a finite load.
    A rank's cached tokens count for at most the prompt: a claim can tie, never beat, a
    whole-prompt hit."""
    size = len(loads)
    least = min(loads, default=math.inf)
    if least == math.inf:
        return -1
    bound = least * (1.0 + band) + slack if least >= 0.0 else least + slack
    best = -1
    best_key = (math.inf, math.inf)
    for offset in range(size):
        r = start + offset
        if r >= size:
            r -= size
        load = loads[r]
        if not load <= bound or load == math.inf:  # out of the band, not a candidate, NaN
            continue
        hit = cached[r]
        if hit > prompt:  # a claim past the prompt counts as the whole prompt, no more
            hit = prompt
        elif hit < 0:
            hit = 0
        key = (-float(hit), load) if pending is None else (pending[r] + prompt - hit, load)
        if key < best_key:
            best, best_key = r, key
    return best
