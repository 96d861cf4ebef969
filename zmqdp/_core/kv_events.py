"""vLLM's KV events, sans-IO: one rank's ``[topic, seq, payload]`` frames in, typed
changes to that rank's prefix index out (issue 36's exact mode; facts in
docs/kv-events.md).

Theory of operation
-------------------
A vLLM engine started with ``--kv-events-config`` publishes, on a PUB socket of its own
(the ready response's ``kv_events_config.endpoint``, port already offset by its DP
rank), one multipart message per engine step that changed its prefix cache:
``[topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]``. A `KvEventFeed` reads one
rank's messages (one feed per rank incarnation: a replaced engine starts at seq 0 with
an empty cache, so the trio layer makes a new feed and the index forgets the rank) and
returns what they mean, as values:

* `Stored(keys, parent, token_ids, block_size)`: full blocks the rank now caches. The
  keys are **our own** chained content hashes (`chain_hash` by default, or the
  index's function): ``key = chain(parent_key, block_token_ids)``. The engine's
  block hashes depend on its hash function and seed (vLLM #43483), so they are used
  only as handles: the feed keeps a bounded map engine hash → our key, to resolve a
  ``BlockStored``'s parent and a ``BlockRemoved``'s blocks.
* `Removed(keys)`: blocks the rank evicted (or that fell out of the feed's own map:
  an index must never keep a block the feed can no longer remove).
* `Dropped(reason)`: forget everything this rank's index holds, because the engine
  cleared its cache (``AllBlocksCleared``) or because the feed lost track of it (a
  seq gap that no replay filled, junk). The reason names the rank and the seq.
* `AskReplay(start_seq)`: the trio layer should send ``replay_request(start_seq)`` on
  the rank's replay socket (a DEALER: vLLM's ROUTER answers one request with many
  messages, which a REQ socket cannot read) and pass each answer to `replayed`.

Sequence numbers: the first message sets the expected seq (if it is not 0 and the rank
has a replay socket, the feed first asks for a replay from 0, since the engine counts
from 0 at start; `start` asks for it before any message, since a subscriber that joins
late misses what came first). An older seq is a duplicate (ignored); a newer one is a
gap: with a replay socket the feed asks for the missing range and holds live messages
(bounded) until the replay's end marker or `replay_timeout` (`tick`), then applies them
in order; what the replay did not cover becomes a `Dropped`. While a replay is under way
(`replaying`) the index may still hold blocks evicted in the missing range: the policy
must not use it for that rank. Without a replay socket a gap is a `Dropped` at once.
vLLM's PUB drops messages past its high-water mark, so gaps happen under load; dropping
is always safe (it only costs hits), keeping a block the engine evicted is not (it draws
traffic to a rank for a prefix it lost).

A hostile or broken engine cannot grow memory or the index without bound, or make
the feed raise: a payload over `max_payload` bytes, one that is not a
``KVEventBatch``, names another DP rank, or whose ``token_ids`` do not fill its
blocks is counted (`KvEventCounters.junk`) and becomes a `Dropped`; one batch adds at
most `max_blocks_per_batch` blocks (the rest are counted as `capped`); the engine-hash
map holds at most `max_known_blocks` (the oldest fall out as `Removed`); held live
messages and replayed messages are bounded. Blocks the client's prompts cannot match
are skipped and counted: other media (``CPU``/``STORAGE`` offload tiers), other
KV-cache groups (hybrid models: only the first full-attention group is indexed),
another block size, LoRA blocks, and blocks with extra keys (multimodal, cache salt);
their descendants then have no known parent (`orphans`). What the feed cannot check is
whether a well-formed ``BlockStored`` is true: an engine that lies draws traffic only
to itself, and only up to what the policy's load guard lets affinity do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, NamedTuple

import msgspec

from .prefix import block_key

__all__ = [
    "END_SEQ",
    "AskReplay",
    "Dropped",
    "KvEvent",
    "KvEventCounters",
    "KvEventFeed",
    "Removed",
    "Stored",
    "chain_hash",
    "event_endpoints",
    "replay_request",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame of the replay's end marker (``ZmqEventPublisher.END_SEQ``)."""

ChainHash = Callable[[int | None, Sequence[int]], int]


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Our content key of one full block: `zmqdp._core.prefix.block_key`, the key the
    approximate index gives the blocks of the prompts it sends, so both modes share
    one index. Unseeded (the same in every process), 64 bits: a collision among a
    million indexed blocks has odds of about 3e-8, and costs only a mis-scored pick,
    never a wrong answer."""
    return block_key(parent, tokens)


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to vLLM's replay ROUTER to get every buffered message
    from `start_seq` on (the ROUTER wants ``[identity, b"", seq]``)."""
    return [b"", start_seq.to_bytes(8, "big")]


def event_endpoints(config: Any, host: str) -> tuple[str, str | None] | None:
    """The (PUB, replay) addresses to connect to, from a ready response's
    ``kv_events_config`` (None: the rank publishes no events). The engine reports the
    addresses it bound, already offset by its DP rank; a wildcard host (``*``,
    ``0.0.0.0``, ``::``) becomes `host`, the address the client reaches the engine at."""
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
        return None
    if config.get("publisher", "zmq") != "zmq":
        return None
    endpoint = config.get("endpoint")
    if not isinstance(endpoint, str) or not endpoint:
        return None
    replay = config.get("replay_endpoint")
    return _connectable(endpoint, host), (
        _connectable(replay, host) if isinstance(replay, str) and replay else None
    )


def _connectable(endpoint: str, host: str) -> str:
    if not endpoint.startswith("tcp://"):
        return endpoint  # ipc://, inproc:// (vLLM suffixes inproc with _dp<rank>)
    where, _, port = endpoint[len("tcp://") :].rpartition(":")
    if where in ("*", "0.0.0.0", "::", "[::]", ""):
        where = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{where}:{port}"


# -- the wire (vLLM's vllm/distributed/kv_events.py, decoded with our own structs) ------

_Hash = bytes | int


class _Stored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(_Batch)

# -- what a feed returns -----------------------------------------------------------------


class Stored(NamedTuple):
    """Full blocks now cached on the rank, in chain order: ``keys[i]`` is our key of
    the block made of ``token_ids[i * block_size : (i + 1) * block_size]``, chained on
    ``keys[i - 1]`` (on `parent` for the first; None: the prompt's first block)."""

    keys: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int


class Removed(NamedTuple):
    """Blocks no longer cached on the rank (our keys)."""

    keys: list[int]


class Dropped(NamedTuple):
    """Forget every block of the rank (the engine cleared its cache, or the feed lost
    track of it: `reason` says which, with the rank and seq)."""

    reason: str


class AskReplay(NamedTuple):
    """Send ``replay_request(start_seq)`` on the rank's replay socket."""

    start_seq: int


KvEvent = Stored | Removed | Dropped | AskReplay


@dataclass
class KvEventCounters:
    """What one feed has seen (for metrics and logs)."""

    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    junk: int = 0
    capped: int = 0
    orphans: int = 0
    skipped: int = 0
    unknown_removed: int = 0
    overflowed: int = 0
    last_junk: str = ""


@dataclass
class _Replay:
    start: int
    deadline: float
    frames: int = 0
    held: list[tuple[int, bytes]] = field(default_factory=list)


class KvEventFeed:
    """One rank incarnation's KV-event stream (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        *,
        block_size: int | None = None,
        dp_rank: int | None = None,
        replay: bool = False,
        chain: ChainHash = chain_hash,
        max_payload: int = 4 << 20,
        max_blocks_per_batch: int = 4096,
        max_known_blocks: int = 1 << 20,
        max_held: int = 1024,
        max_replayed: int = 20_000,
        replay_timeout: float = 2.0,
    ) -> None:
        self.rank = rank
        self.block_size = block_size
        self.dp_rank = rank if dp_rank is None else dp_rank
        self.replay = replay
        self.chain = chain
        self.max_payload = max_payload
        self.max_blocks_per_batch = max_blocks_per_batch
        self.max_known_blocks = max_known_blocks
        self.max_held = max_held
        self.max_replayed = max_replayed
        self.replay_timeout = replay_timeout
        self.counters = KvEventCounters()
        self.expected: int | None = None
        self._known: dict[_Hash, int] = {}  # engine hash -> our key, oldest first
        self._group: int | None = None  # the KV-cache group indexed (first full-attention)
        self._replay: _Replay | None = None

    def __len__(self) -> int:
        """How many blocks the feed can currently resolve (its map's size)."""
        return len(self._known)

    # -- input --------------------------------------------------------------------------

    def start(self, now: float) -> list[KvEvent]:
        """Before the first message, with a replay socket: ask for everything the engine
        still buffers. A SUB misses what was published before it joined (ZeroMQ's slow
        joiner), and an engine that is idle afterwards would publish nothing that
        reveals the gap."""
        if not self.replay or self._replay is not None or self.expected is not None:
            return []
        self.counters.replays += 1
        self._replay = _Replay(0, now + self.replay_timeout)
        return [AskReplay(0)]

    def feed(self, frames: Sequence[bytes], now: float) -> list[KvEvent]:
        """One message from the rank's PUB socket."""
        out: list[KvEvent] = []
        parsed = self._frames(frames, out)
        if parsed is None:
            return out
        seq, payload = parsed
        replay = self._replay
        if replay is not None:
            replay.held.append((seq, payload))
            if len(replay.held) > self.max_held:
                self._give_up(out, f"more than {self.max_held} messages arrived during it")
            return out
        if self.expected is None and seq > 0 and self.replay:
            self._ask(0, now, seq, payload, out)
            return out
        if self.expected is not None and seq > self.expected:
            self.counters.gaps += 1
            if self.replay:
                self._ask(self.expected, now, seq, payload, out)
                return out
            self._drop(out, f"missed seq {self.expected}..{seq - 1} (no replay socket)")
        self._apply(seq, payload, out)
        return out

    def replayed(self, frames: Sequence[bytes], now: float) -> list[KvEvent]:
        """One message from the replay socket, without the DEALER's empty delimiter
        (``[topic, seq, payload]``; the end marker has seq `END_SEQ`)."""
        out: list[KvEvent] = []
        replay = self._replay
        if replay is None:
            return out  # late or unasked-for: the range is applied or dropped already
        if len(frames) == 3 and frames[1] == END_SEQ:
            self._finish(out)
            return out
        parsed = self._frames(frames, out)
        if parsed is None:
            return out
        replay.frames += 1
        if replay.frames > self.max_replayed:
            self._give_up(out, f"more than {self.max_replayed} replayed messages")
            return out
        seq, payload = parsed
        if self.expected is not None and seq > self.expected:
            self.counters.gaps += 1
            self._drop(out, f"the replay starts at seq {seq}, after {self.expected}")
        self._apply(seq, payload, out)
        return out

    def tick(self, now: float) -> list[KvEvent]:
        """Time passed: a replay unanswered by its deadline is given up."""
        out: list[KvEvent] = []
        if self._replay is not None and now >= self._replay.deadline:
            self._give_up(out, f"no end marker within {self.replay_timeout} s")
        return out

    @property
    def replaying(self) -> bool:
        """A replay is under way: until it ends the index may still hold blocks evicted
        in the missing range, so a policy should score this rank as if its index were
        empty (no affinity) until then."""
        return self._replay is not None

    def deadline(self) -> float | None:
        """When `tick` next has something to do (None: nothing pending)."""
        return None if self._replay is None else self._replay.deadline

    # -- internals ----------------------------------------------------------------------

    def _frames(self, frames: Sequence[bytes], out: list[KvEvent]) -> tuple[int, bytes] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._junk(out, None, f"a message of {len(frames)} frames, not [topic, seq, payload]")
            return None
        return int.from_bytes(frames[1], "big"), frames[2]

    def _ask(self, start: int, now: float, seq: int, payload: bytes, out: list[KvEvent]) -> None:
        self.counters.replays += 1
        self._replay = _Replay(start, now + self.replay_timeout, held=[(seq, payload)])
        out.append(AskReplay(start))

    def _finish(self, out: list[KvEvent]) -> None:
        replay = self._replay
        assert replay is not None
        self._replay = None
        self._catch_up(replay.held, out)

    def _catch_up(self, held: list[tuple[int, bytes]], out: list[KvEvent]) -> None:
        """Apply the messages held during a replay, in order; a seq still missing is
        dropped (no second replay: the buffer did not have it)."""
        for seq, payload in sorted(held, key=lambda m: m[0]):
            if self.expected is not None and seq > self.expected:
                self.counters.gaps += 1
                self._drop(out, f"the replay did not cover seq {self.expected}..{seq - 1}")
            self._apply(seq, payload, out)

    def _give_up(self, out: list[KvEvent], why: str) -> None:
        replay = self._replay
        assert replay is not None
        self.counters.replay_failures += 1
        self._drop(out, f"replay from seq {replay.start} failed: {why}")
        self._replay = None
        if replay.held:  # the drop covers everything before the first held message
            first = min(seq for seq, _ in replay.held)
            if self.expected is None or first > self.expected:
                self.expected = first
        self._catch_up(replay.held, out)

    def _drop(self, out: list[KvEvent], why: str) -> None:
        self._known.clear()
        out.append(Dropped(f"rank {self.rank}: KV events: {why}"))

    def _junk(self, out: list[KvEvent], seq: int | None, why: str) -> None:
        self.counters.junk += 1
        at = "" if seq is None else f" at seq {seq}"
        self.counters.last_junk = f"rank {self.rank}: KV events{at}: {why}"
        self._drop(out, f"junk{at}: {why}")

    def _apply(self, seq: int, payload: bytes, out: list[KvEvent]) -> None:
        """Apply one in-order (or first, or after-a-drop) message."""
        if self.expected is not None and seq < self.expected:
            self.counters.duplicates += 1
            return
        self.expected = seq + 1
        if len(payload) > self.max_payload:
            self._junk(out, seq, f"a payload of {len(payload)} bytes (max {self.max_payload})")
            return
        try:
            batch = _decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._junk(out, seq, f"not a KVEventBatch ({str(exc)[:200]})")
            return
        if batch.data_parallel_rank is not None and batch.data_parallel_rank != self.dp_rank:
            self._junk(out, seq, f"a batch of DP rank {batch.data_parallel_rank}")
            return
        self.counters.batches += 1
        budget = self.max_blocks_per_batch
        for event in batch.events:
            if isinstance(event, _Stored):
                bad = _malformed(event)
                if bad:
                    self._junk(out, seq, bad)
                    return
                budget = self._stored(event, budget, out)
            elif isinstance(event, _Removed):
                self._removed(event, out)
            else:
                self.counters.cleared += 1
                self._drop(out, f"the engine cleared its prefix cache (seq {seq})")

    def _indexed(self, medium: str | None, group: int | None) -> bool:
        return medium in (None, "GPU") and (self._group is None or group == self._group)

    def _stored(self, ev: _Stored, budget: int, out: list[KvEvent]) -> int:
        n = len(ev.block_hashes)
        size = ev.block_size
        if (
            ev.kv_cache_spec_kind not in (None, "full_attention")
            or ev.medium not in (None, "GPU")
            or (self._group is not None and ev.group_idx != self._group)
            or (self.block_size is not None and size != self.block_size)
            or ev.lora_id is not None
            or ev.lora_name is not None
        ):
            self.counters.skipped += n
            return budget
        if ev.extra_keys is not None:  # blocks from the first keyed one on: skipped
            keyed = next((i for i, k in enumerate(ev.extra_keys) if k is not None), n)
            self.counters.skipped += n - keyed
            n = keyed
        if ev.parent_block_hash is None:
            parent = None
        else:
            parent = self._known.get(ev.parent_block_hash)
            if parent is None:
                self.counters.orphans += n
                return budget
        if n > budget:
            self.counters.capped += n - budget
            n = budget
        if n == 0:
            return budget
        if self._group is None:
            self._group = ev.group_idx
        keys: list[int] = []
        known = self._known
        tokens = ev.token_ids
        key = parent
        for i in range(n):
            key = self.chain(key, tokens[i * size : (i + 1) * size])
            h = ev.block_hashes[i]
            known.pop(h, None)  # re-stored: now the newest
            known[h] = key
            keys.append(key)
        self.counters.stored += n
        out.append(Stored(keys, parent, tokens[: n * size], size))
        if len(known) > self.max_known_blocks:
            self._overflow(out)
        return budget - n

    def _overflow(self, out: list[KvEvent]) -> None:
        """The map is over `max_known_blocks`: its oldest blocks fall out, and out of the
        index too (a block the feed cannot name cannot be removed when the engine
        evicts it)."""
        known = self._known
        excess = len(known) - self.max_known_blocks
        gone = [known.pop(h) for h in list(islice(known, excess))]
        self.counters.overflowed += excess
        out.append(Removed(gone))

    def _removed(self, ev: _Removed, out: list[KvEvent]) -> None:
        if not self._indexed(ev.medium, ev.group_idx):
            self.counters.skipped += len(ev.block_hashes)
            return
        keys = []
        for h in ev.block_hashes:
            key = self._known.pop(h, None)
            if key is None:
                self.counters.unknown_removed += 1
            else:
                keys.append(key)
        if keys:
            self.counters.removed += len(keys)
            out.append(Removed(keys))


def _malformed(ev: _Stored) -> str:
    """Why a ``BlockStored`` cannot be right ("" if it can)."""
    if ev.block_size <= 0:
        return f"BlockStored with block_size {ev.block_size}"
    if len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
        return (
            f"BlockStored with {len(ev.token_ids)} token ids for {len(ev.block_hashes)} "
            f"blocks of {ev.block_size}"
        )
    if ev.extra_keys is not None and len(ev.extra_keys) != len(ev.block_hashes):
        return f"BlockStored with {len(ev.extra_keys)} extra keys for {len(ev.block_hashes)} blocks"
    return ""
