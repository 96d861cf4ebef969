"""zmqdp/_core/kv_events.py: vLLM's KV-event frames -> changes to one rank's prefix index.

Golden frames from a real vLLM 0.32 engine (tests/data/vllm_kv_events_v0320.json,
captured by tools/realvllm/capture_kv_events.py), unit tests of each rule, a
Hypothesis state machine against a naive reference (the engine's own cache, as a set
of token prefixes) with lost messages, replays and junk, and mutants it must catch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from zmqdp._core.kv_events import (
    END_SEQ,
    AskReplay,
    Dropped,
    KvEvent,
    KvEventFeed,
    Removed,
    Stored,
    chain_hash,
    event_endpoints,
    replay_request,
)

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "vllm_kv_events_v0320.json"
_enc = msgspec.msgpack.Encoder()


def frames(seq: int, events: list[dict[str, Any]], rank: int | None = 0) -> list[bytes]:
    batch: list[Any] = [1.0, events] + ([] if rank is None else [rank])
    return [b"", seq.to_bytes(8, "big"), _enc.encode(batch)]


def stored(
    hashes: list[Any], parent: Any, tokens: list[int], size: int = 2, **more: Any
) -> dict[str, Any]:
    ev = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    ev.update(more)
    return ev


def removed(hashes: list[Any], **more: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **more}


CLEARED = {"type": "AllBlocksCleared"}


class Index:
    """What a consumer of the feed keeps: the set of our keys."""

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.asks: list[int] = []
        self.drops: list[str] = []

    def apply(self, events: list[KvEvent]) -> list[KvEvent]:
        for ev in events:
            if isinstance(ev, Stored):
                self.keys.update(ev.keys)
            elif isinstance(ev, Removed):
                self.keys.difference_update(ev.keys)
            elif isinstance(ev, Dropped):
                self.keys.clear()
                self.drops.append(ev.reason)
            else:
                self.asks.append(ev.start_seq)
        return events


def chain(tokens: list[int], size: int) -> list[int]:
    keys, key = [], None
    for i in range(0, len(tokens) - len(tokens) % size, size):
        key = chain_hash(key, tokens[i : i + size])
        keys.append(key)
    return keys


# -- golden frames from a real engine ---------------------------------------------------


def golden() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GOLDEN.read_text())
    return data


def test_golden_endpoints_come_from_the_ready_response() -> None:
    g = golden()
    cfg = g["kv_events_config"]
    pub, replay = event_endpoints(cfg, "127.0.0.1") or ("", None)
    assert pub == cfg["endpoint"].replace("*", "127.0.0.1")
    assert replay == cfg["replay_endpoint"].replace("*", "127.0.0.1")
    assert event_endpoints({**cfg, "enable_kv_cache_events": False}, "h") is None
    assert event_endpoints(None, "h") is None
    assert event_endpoints({**cfg, "endpoint": "tcp://*:5558"}, "::1") == (
        "tcp://[::1]:5558",
        replay.replace("127.0.0.1", "[::1]") if replay else None,
    )


def test_golden_frames_from_a_real_engine_follow_its_cache() -> None:
    """The engine's own hashes, as a naive reference (engine hash -> token prefix),
    and the feed's index agree after every message: keys are our hashes of the same
    prefixes; BlockRemoved resolves; AllBlocksCleared drops."""
    g = golden()
    size = g["block_size"]
    feed = KvEventFeed(0, block_size=size, replay=True)
    index = Index()
    engine: dict[Any, tuple[int, ...]] = {}
    for i, hexes in enumerate(g["pub_frames_hex"]):
        msg = [bytes.fromhex(h) for h in hexes]
        assert int.from_bytes(msg[1], "big") == i
        for ev in msgspec.msgpack.decode(msg[2])[1]:
            if ev["type"] == "BlockStored":
                prefix = () if ev["parent_block_hash"] is None else engine[ev["parent_block_hash"]]
                for j, h in enumerate(ev["block_hashes"]):
                    prefix = prefix + tuple(ev["token_ids"][j * size : (j + 1) * size])
                    engine[h] = prefix
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    engine.pop(h)
            else:
                engine.clear()
        index.apply(feed.feed(msg, 0.0))
        assert index.keys == {chain(list(p), size)[-1] for p in engine.values()}, i
    assert feed.counters.removed == 6 and feed.counters.cleared == 1
    assert feed.counters.junk == 0 and feed.counters.orphans == 0 and not index.asks
    assert len(index.drops) == 1 and "cleared its prefix cache" in index.drops[0]
    assert len(engine) == 8 and len(feed) == 8


def test_golden_replay_fills_a_gap() -> None:
    """Messages 1..5 lost: the feed asks for a replay from 1, holds live messages, and
    the engine's own replay (a DEALER's answer, delimiter stripped) makes it whole."""
    g = golden()
    pub = [[bytes.fromhex(h) for h in m] for m in g["pub_frames_hex"]]
    replayed = [[bytes.fromhex(h) for h in m][1:] for m in g["replay_dealer_from_1_hex"]]
    assert replayed[-1][1] == END_SEQ
    whole, gappy = KvEventFeed(0, replay=True), KvEventFeed(0, replay=True)
    a, b = Index(), Index()
    for m in pub:
        a.apply(whole.feed(m, 0.0))
    b.apply(gappy.feed(pub[0], 0.0))
    for m in pub[6:9]:
        b.apply(gappy.feed(m, 0.0))
    assert b.asks == [1] and gappy.deadline() == 2.0
    for m in replayed:
        b.apply(gappy.replayed(m, 0.5))
    for m in pub[9:]:
        b.apply(gappy.feed(m, 0.6))
    assert b.keys == a.keys and len(b.keys) == 8
    # the capture replayed 1..11: the held 6..8 and the later live 9..11 are duplicates
    assert gappy.counters.duplicates == 6
    assert [d for d in b.drops if "cleared" not in d] == []
    assert gappy.deadline() is None


# -- rules ------------------------------------------------------------------------------


def test_own_hash_ignores_the_engines_hash() -> None:
    """Two engines with different hash seeds (int and bytes hashes) give the same keys,
    and the keys are those of the client's own prompt."""
    tokens = [1, 2, 3, 4, 5]
    keys = []
    for h0, h1 in ((11, 12), (b"\x01" * 32, b"\x02" * 32)):
        feed = KvEventFeed(0, block_size=2)
        out = feed.feed(frames(0, [stored([h0, h1], None, tokens[:4])]), 0.0)
        assert len(out) == 1 and isinstance(out[0], Stored)
        keys.append(out[0].keys)
    assert keys[0] == keys[1] == chain(tokens, 2)


def test_token_ids_past_int64_hash_and_do_not_raise() -> None:
    feed = KvEventFeed(0, block_size=2)
    out = feed.feed(frames(0, [stored([7], None, [2**64 - 1, -(2**63)])]), 0.0)
    assert len(out) == 1 and isinstance(out[0], Stored)
    assert chain_hash(None, [2**64 - 1, 0]) != chain_hash(None, [-1, 0])


def test_removed_and_parent_resolve_through_engine_hashes() -> None:
    feed, index = KvEventFeed(0, block_size=2), Index()
    index.apply(feed.feed(frames(0, [stored([7], None, [1, 2])]), 0.0))
    index.apply(feed.feed(frames(1, [stored([8], 7, [3, 4])]), 0.0))
    assert index.keys == set(chain([1, 2, 3, 4], 2))
    index.apply(feed.feed(frames(2, [removed([7, 99])]), 0.0))
    assert index.keys == {chain([1, 2, 3, 4], 2)[1]}
    assert feed.counters.unknown_removed == 1
    index.apply(feed.feed(frames(3, [stored([9], 123, [5, 6])]), 0.0))  # unknown parent
    assert feed.counters.orphans == 1 and len(index.keys) == 1


def test_a_gap_without_replay_drops_and_with_replay_asks() -> None:
    feed, index = KvEventFeed(3, block_size=2), Index()
    index.apply(feed.feed(frames(0, [stored([7], None, [1, 2])], rank=3), 0.0))
    index.apply(feed.feed(frames(2, [stored([8], None, [3, 4])], rank=3), 0.0))
    assert index.keys == set(chain([3, 4], 2))
    assert index.drops == ["rank 3: KV events: missed seq 1..1 (no replay socket)"]
    feed, index = KvEventFeed(0, block_size=2, replay=True), Index()
    index.apply(feed.feed(frames(0, [stored([7], None, [1, 2])]), 0.0))
    assert index.apply(feed.feed(frames(2, [stored([8], None, [3, 4])]), 1.0)) == [AskReplay(1)]
    assert feed.deadline() == 3.0 and feed.tick(2.9) == []
    index.apply(feed.tick(3.0))  # unanswered: given up, the held message applied
    assert index.keys == set(chain([3, 4], 2)) and feed.counters.replay_failures == 1
    assert "replay from seq 1 failed: no end marker within 2.0 s" in index.drops[0]


def test_a_gap_among_held_messages_drops_again() -> None:
    feed, index = KvEventFeed(0, block_size=2, replay=True), Index()
    index.apply(feed.feed(frames(0, [stored([7], None, [1, 2])]), 0.0))
    index.apply(feed.feed(frames(2, [stored([8], None, [3, 4])]), 0.0))  # 1 lost: ask
    index.apply(feed.feed(frames(4, [stored([9], None, [5, 6])]), 0.0))  # 3 lost: held
    index.apply(feed.tick(5.0))
    assert [d.split(": ", 2)[2] for d in index.drops] == [
        "replay from seq 1 failed: no end marker within 2.0 s",
        "the replay did not cover seq 3..3",
    ]
    assert index.keys == set(chain([5, 6], 2)) and feed.expected == 5


def test_a_late_start_asks_for_the_engines_first_messages() -> None:
    feed, index = KvEventFeed(0, block_size=2, replay=True), Index()
    assert index.apply(feed.feed(frames(5, [stored([8], 7, [3, 4])]), 0.0)) == [AskReplay(0)]
    index.apply(feed.replayed(frames(4, [stored([7], None, [1, 2])])[:3], 0.0))
    index.apply(feed.replayed([b"", END_SEQ, b""], 0.0))
    assert index.keys == set(chain([1, 2, 3, 4], 2))
    assert replay_request(5) == [b"", (5).to_bytes(8, "big")]


def test_start_asks_for_everything_buffered_before_the_first_message() -> None:
    """`start`: a replay from 0 before any message (the SUB joined late and the engine
    went quiet); live messages meanwhile are held, duplicates ignored, a seq the
    replay did not reach dropped; without a replay socket, or once started, nothing."""
    assert KvEventFeed(0, block_size=2).start(0.0) == []
    feed, index = KvEventFeed(0, block_size=2, replay=True), Index()
    assert index.apply(feed.start(1.0)) == [AskReplay(0)]
    assert feed.replaying and feed.deadline() == 3.0 and feed.start(1.0) == []
    index.apply(feed.feed(frames(1, [stored([8], 7, [3, 4])]), 1.1))  # live, held
    assert index.keys == set()
    index.apply(feed.replayed(frames(0, [stored([7], None, [1, 2])])[:3], 1.2))
    index.apply(feed.replayed(frames(1, [stored([8], 7, [3, 4])])[:3], 1.2))
    index.apply(feed.replayed([b"", END_SEQ, b""], 1.3))
    assert index.keys == set(chain([1, 2, 3, 4], 2)) and not feed.replaying
    assert feed.counters.duplicates == 1 and feed.expected == 2 and not index.drops
    feed, index = KvEventFeed(0, block_size=2, replay=True), Index()
    index.apply(feed.start(0.0))
    index.apply(feed.feed(frames(3, [stored([9], None, [5, 6])]), 0.1))
    index.apply(feed.replayed(frames(0, [stored([7], None, [1, 2])])[:3], 0.2))
    index.apply(feed.replayed([b"", END_SEQ, b""], 0.3))  # 1..2 never came
    assert index.keys == set(chain([5, 6], 2)) and len(index.drops) == 1
    feed = KvEventFeed(0, block_size=2, replay=True)
    feed.feed(frames(0, [stored([7], None, [1, 2])]), 0.0)
    assert feed.start(0.0) == []  # too late to start


def test_one_batch_adds_at_most_its_cap_and_the_map_is_bounded() -> None:
    feed = KvEventFeed(0, block_size=1, max_blocks_per_batch=3, max_known_blocks=5)
    index = Index()
    many = stored(list(range(100, 110)), None, list(range(10)), 1)
    index.apply(feed.feed(frames(0, [many, many]), 0.0))
    assert len(index.keys) == 3 and feed.counters.capped == 7 + 10
    index.apply(feed.feed(frames(1, [stored([200, 201, 202], 102, [3, 4, 5], 1)]), 0.0))
    assert len(feed) == 5 and len(index.keys) == 5 and feed.counters.overflowed == 1


@pytest.mark.parametrize(
    "extra",
    [
        {"medium": "CPU"},
        {"lora_name": "adapter", "lora_id": 1},
        {"kv_cache_spec_kind": "sliding_window"},
        {"extra_keys": [["salt"]]},
    ],
)
def test_blocks_a_prompt_cannot_match_are_skipped(extra: dict[str, Any]) -> None:
    feed = KvEventFeed(0, block_size=2)
    assert feed.feed(frames(0, [stored([7], None, [1, 2], **extra)]), 0.0) == []
    assert feed.counters.skipped == 1 and len(feed) == 0


def test_newer_fields_are_ignored() -> None:
    """vLLM 0.33 adds `lookahead_token_ids`; later versions may add more."""
    feed = KvEventFeed(0, block_size=2)
    ev = stored([7], None, [1, 2], lookahead_token_ids=[[3]], session_id="s", locality="LOCAL")
    out = feed.feed(frames(0, [ev]), 0.0)
    assert out == [Stored(chain([1, 2], 2), None, [1, 2], 2)]


@pytest.mark.parametrize(
    "msg, why",
    [
        ([b"", b"\0" * 8], "a message of 2 frames"),
        ([b"", b"\0" * 7, b""], "a message of 3 frames"),
        ([b"", b"\0" * 8, b"\xc1"], "not a KVEventBatch"),
        ([b"", b"\0" * 8, _enc.encode([1.0, [{"type": "Nope"}]])], "not a KVEventBatch"),
        (frames(0, [stored([7], None, [1, 2, 3])]), "3 token ids for 1 blocks of 2"),
        (frames(0, [stored([7], None, [], 0)]), "block_size 0"),
        (frames(0, [], rank=1), "a batch of DP rank 1"),
        ([b"", b"\0" * 8, b"\x90" * 300], "a payload of 300 bytes (max 200)"),
    ],
)
def test_junk_is_counted_and_drops_the_rank(msg: list[bytes], why: str) -> None:
    feed = KvEventFeed(0, max_payload=200)
    assert len(feed.feed(frames(0, [stored([5], None, [1, 2])]), 0.0)) == 1
    if len(msg) == 3 and len(msg[1]) == 8:
        msg = [msg[0], (1).to_bytes(8, "big"), msg[2]]  # the next seq
    out = feed.feed(msg, 0.0)
    assert len(out) == 1 and isinstance(out[0], Dropped) and why in out[0].reason, out
    assert "rank 0: KV events" in out[0].reason
    assert feed.counters.junk == 1 and why in feed.counters.last_junk and len(feed) == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.lists(st.binary(max_size=40), max_size=4),
            st.tuples(  # near-valid batches: any hashes, parents, sizes, token counts
                st.integers(0, 20),
                st.lists(
                    st.builds(
                        stored,
                        st.lists(st.integers(0, 6), max_size=6),
                        st.none() | st.integers(0, 6),
                        st.lists(st.integers(0, 3), max_size=12),
                        st.integers(-1, 3),
                    )
                    | st.builds(removed, st.lists(st.integers(0, 6), max_size=6))
                    | st.just(CLEARED),
                    max_size=4,
                ),
            ),
            st.tuples(
                st.integers(0, 2**64 - 1),
                st.recursive(
                    st.none()
                    | st.integers(-(2**63), 2**64 - 1)
                    | st.binary(max_size=8)
                    | st.text(max_size=12),
                    lambda inner: (
                        st.lists(inner, max_size=4)
                        | st.dictionaries(st.sampled_from(["type", "block_hashes"]), inner)
                    ),
                    max_leaves=12,
                ),
            ),
        ),
        max_size=12,
    )
)
def test_arbitrary_input_never_raises_and_stays_bounded(messages: list[Any]) -> None:
    feed = KvEventFeed(0, block_size=2, replay=True, max_known_blocks=4)
    now = 0.0
    for m in messages:
        now += 1.0
        if isinstance(m, tuple):
            m = [b"t", m[0].to_bytes(8, "big"), _enc.encode([now, m[1]])]
        for fn in (feed.feed, feed.replayed):
            for ev in fn(m, now):
                assert isinstance(ev, (Stored, Removed, Dropped, AskReplay))
        feed.tick(now)
        assert len(feed) <= 4


# -- the state machine ------------------------------------------------------------------

BLOCK = 2
CAP = 3  # blocks one batch may add
KNOWN = 3  # engine hashes the feed keeps
BUFFER = 3  # batches the engine keeps for replay


class FeedMachine(RuleBasedStateMachine):
    """A fake engine (its cache: engine hash -> token prefix, hashed with a seed the
    client does not know) publishes batches; the network loses some; the replay socket
    answers from the engine's last `BUFFER` batches, or not at all. The consumer's
    index must only ever hold blocks the engine holds, and hold all of them when
    nothing was lost for good."""

    feed_cls: type[KvEventFeed] = KvEventFeed

    @initialize(seed=st.integers(0, 2**32), replay=st.sampled_from(["none", "answers", "silent"]))
    def start(self, seed: int, replay: str) -> None:
        """`replay`: the rank has no replay socket, one that answers at once, or one
        that never answers (the feed gives up at its deadline)."""
        self.seed = seed
        self.answers = replay == "answers"
        self.feed = self.feed_cls(
            0,
            block_size=BLOCK,
            replay=replay != "none",
            max_blocks_per_batch=CAP,
            max_known_blocks=KNOWN,
        )
        self.index = Index()
        self.engine: dict[int, tuple[int, ...]] = {}
        self.truth: dict[int, tuple[int, ...]] = {}  # the engine as of its last message
        self.peak = 0  # the most blocks it held since then
        self.pending: list[dict[str, Any]] = []
        self.seq = 0
        self.sent: list[tuple[int, list[bytes]]] = []
        self.now = 0.0
        self.exact = True  # nothing lost for good, no cap or bound hit
        self.unseen = False  # the last message was lost: the feed cannot know yet

    def ehash(self, prefix: tuple[int, ...]) -> int:
        return hash((self.seed, prefix)) & (2**63 - 1)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=BLOCK, max_size=5 * BLOCK))
    def store(self, tokens: list[int]) -> None:
        """A prompt: its blocks past the longest cached prefix are stored (parent held)."""
        n = len(tokens) // BLOCK
        have = 0
        while have < n and self.ehash(tuple(tokens[: (have + 1) * BLOCK])) in self.engine:
            have += 1
        if have == n:
            return
        parent = self.ehash(tuple(tokens[: have * BLOCK])) if have else None
        hashes = []
        for i in range(have, n):
            prefix = tuple(tokens[: (i + 1) * BLOCK])
            hashes.append(self.ehash(prefix))
            self.engine[hashes[-1]] = prefix
        self.peak = max(self.peak, len(self.engine))
        self.pending.append(stored(hashes, parent, tokens[have * BLOCK : n * BLOCK], BLOCK))

    @precondition(lambda self: bool(self.engine))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.engine)))
        del self.engine[h]
        self.pending.append(removed([h]))

    @precondition(lambda self: bool(self.truth) and not self.pending)
    @rule(data=st.data())
    def lose_a_removal(self, data: st.DataObject) -> None:
        """The dangerous loss: a message that evicts a block the index may hold."""
        h = data.draw(st.sampled_from(sorted(self.truth)))
        if h in self.engine:
            del self.engine[h]
            self.pending.append(removed([h]))
            self.publish(lose=True)

    @rule()
    def clear(self) -> None:
        self.engine.clear()
        self.pending.append(CLEARED)

    @precondition(lambda self: bool(self.pending))
    @rule(lose=st.booleans())
    def publish(self, lose: bool) -> None:
        added = sum(len(e["block_hashes"]) for e in self.pending if e["type"] == "BlockStored")
        if added > CAP or self.peak > KNOWN:
            self.exact = False  # capped, or the feed's map overflowed
        self.truth, self.peak = dict(self.engine), len(self.engine)
        msg = frames(self.seq, self.pending)
        self.sent.append((self.seq, msg))
        self.seq += 1
        self.pending = []
        if lose:
            self.unseen = True
            if not self.feed.replay:
                self.exact = False
            return
        self.unseen = False
        self.now += 0.1
        self.deliver(self.feed.feed(msg, self.now))

    def deliver(self, out: list[KvEvent]) -> None:
        for ev in out:
            assert not isinstance(ev, Stored) or len(ev.keys) <= CAP, "a batch added past the cap"
        for ev in self.index.apply(out):
            if isinstance(ev, AskReplay):
                if not self.answers:
                    continue  # the replay socket never answers: tick() gives up
                buffered = self.sent[-BUFFER:]
                if buffered and buffered[0][0] > ev.start_seq:
                    self.exact = False  # the engine's buffer no longer has it
                for seq, msg in buffered:
                    if seq >= ev.start_seq:
                        self.deliver(self.feed.replayed(msg, self.now))
                self.deliver(self.feed.replayed([b"", END_SEQ, b""], self.now))

    @precondition(lambda self: self.feed.expected is None and not self.feed.replaying)
    @rule()
    def subscribe_late(self) -> None:
        """The consumer's `start` before its first message: everything buffered is
        asked for (what was published before it joined may have been lost)."""
        self.deliver(self.feed.start(self.now))

    @precondition(lambda self: self.feed.replaying)
    @rule()
    def wait(self) -> None:
        self.now += 10.0
        if self.feed.deadline() is not None:
            self.exact = False
        self.deliver(self.feed.tick(self.now))

    @rule(junk=st.binary(max_size=12))
    def junk(self, junk: bytes) -> None:
        self.exact = False
        self.unseen = False
        msg = [b"", self.seq.to_bytes(8, "big"), junk]
        self.sent.append((self.seq, msg))
        self.seq += 1
        self.deliver(self.feed.feed(msg, self.now))

    @invariant()
    def only_blocks_the_engine_holds(self) -> None:
        if not hasattr(self, "feed"):
            return
        assert len(self.feed) <= KNOWN, "the feed's map past its bound"
        removable = set(self.feed._known.values())
        assert self.index.keys <= removable, "the index holds a block the feed cannot remove"
        if self.unseen or self.feed.replaying:
            # the last message was lost (nobody can tell until the next one), or a
            # replay is under way (the consumer must not score the rank's index then)
            return
        truth = {chain(list(p), BLOCK)[-1] for p in self.truth.values()}
        stale = self.index.keys - truth
        assert not stale, f"the index holds {len(stale)} block(s) the engine evicted"
        if self.exact:
            assert self.index.keys == truth, "blocks the engine holds are missing"


FAST = settings(max_examples=200, deadline=None, stateful_step_count=30, database=None)


def test_feed_machine() -> None:
    run_state_machine_as_test(FeedMachine, settings=FAST)


# -- mutants: each must be caught -------------------------------------------------------


class IgnoresGaps(KvEventFeed):
    """Applies a message after a gap as if nothing was missed."""

    def feed(self, frames: Any, now: float) -> list[KvEvent]:
        if len(frames) == 3 and len(frames[1]) == 8 and self.expected is not None:
            self.expected = max(self.expected, int.from_bytes(frames[1], "big"))
        return super().feed(frames, now)


class SilentOverflow(KvEventFeed):
    """Forgets the oldest engine hashes without removing their blocks from the index."""

    def _overflow(self, out: list[KvEvent]) -> None:
        super()._overflow([])


class UncappedBatches(KvEventFeed):
    """Lets one batch add any number of blocks."""

    def _stored(self, ev: Any, budget: int, out: list[KvEvent]) -> int:
        return super()._stored(ev, 10**9, out)


class TrustsFailedReplays(KvEventFeed):
    """When a replay gets no answer, applies the held messages without dropping the
    rank's index (as if the missing range had changed nothing)."""

    def _drop(self, out: list[KvEvent], why: str) -> None:
        if "failed" not in why:
            super()._drop(out, why)


HUNT = settings(
    max_examples=2000,
    derandomize=True,
    database=None,
    deadline=None,
    stateful_step_count=30,
    report_multiple_bugs=False,
    phases=(
        (Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink)
        if os.environ.get("HYPOTHESIS_SHRINK_MUTANTS")
        else (Phase.explicit, Phase.reuse, Phase.generate)
    ),
)

MUTANTS = {
    IgnoresGaps: "the engine evicted",
    SilentOverflow: "the feed cannot remove",
    UncappedBatches: "past the cap",
}
"""Mutants the derandomized hunt finds. `TrustsFailedReplays` needs a lost removal, a
silent replay socket and a wait in one run, which the hunt found in most runs but not
all (and not once the `subscribe_late` rule changed its search): it is caught by the
machine's invariant on the scripted run below."""


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda c: c.__name__)
def test_feed_machine_catches(mutant: type[KvEventFeed]) -> None:
    machine = type(f"FeedMachineWith{mutant.__name__}", (FeedMachine,), {"feed_cls": mutant})
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(machine, settings=HUNT)
    assert MUTANTS[mutant] in str(info.value), str(info.value)


@pytest.mark.parametrize("feed_cls", [KvEventFeed, TrustsFailedReplays])
def test_a_failed_replay_that_keeps_the_index_is_caught(feed_cls: type[KvEventFeed]) -> None:
    """The machine, scripted: a block stored, its removal lost, then a gap whose replay
    never answers. The feed must drop the rank (the index may hold the evicted block);
    `TrustsFailedReplays` keeps it, and the invariant says so."""
    machine = type("Scripted", (FeedMachine,), {"feed_cls": feed_cls})()
    machine.start(seed=0, replay="silent")
    machine.store([0] * BLOCK)
    machine.publish(lose=False)
    (evicted,) = machine.truth
    del machine.engine[evicted]
    machine.pending.append(removed([evicted]))
    machine.publish(lose=True)
    machine.store([1] * BLOCK)
    machine.publish(lose=False)  # the gap: a replay asked for, never answered
    machine.wait()
    if feed_cls is KvEventFeed:
        machine.only_blocks_the_engine_holds()
    else:
        with pytest.raises(AssertionError, match="the engine evicted"):
            machine.only_blocks_the_engine_holds()


def test_the_feed_is_sans_io() -> None:
    """The module imports neither trio nor zmq (only the standard library, msgspec, the
    codec vLLM's wire already uses, and the core's prefix module for the block key)."""
    import ast

    import zmqdp._core.kv_events as mod

    tree = ast.parse(Path(mod.__file__ or "").read_text())
    roots = {
        (node.module or "" if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert roots <= {
        "__future__",
        "array",
        "hashlib",
        "collections",
        "dataclasses",
        "itertools",
        "typing",
        "msgspec",
        "prefix",
    }, roots
