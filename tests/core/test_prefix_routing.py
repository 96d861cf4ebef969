"""Prefix affinity wired in: `Request.tokens` -> `Prepared.prefix` -> `GroupCore.submit` ->
`Routing.select` (the band, the fallback to the load decision, the lockstep pending
prefill), `GroupCore` feeding the index (handshake, load reports, deaths), and the exact
mode's rules on `PrefixIndex` by example (the state machine in tests/models/prefix.py
checks them against the reference)."""

from __future__ import annotations

import random
from typing import Any

import cbor2
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from tests.models import mutants
from tests.models.hunt import hunt
from tests.models.prefix import PrefixRoutingMachine
from zmqdp import Request
from zmqdp._core.errors import InvalidRequest
from zmqdp._core.handshake import RankUp, rank_identity
from zmqdp._core.messages import Load
from zmqdp._core.prefix import PREDICTED_BLOCKS, PrefixIndex
from zmqdp._core.routing import Routing
from zmqdp._core.state import GroupCore
from zmqdp._core.wire import NativeWire

SYSTEM = list(range(1000, 1064))  # a 64-token shared system prompt: 4 blocks of 16


def prompt(session: int, turns: int = 1) -> list[int]:
    return SYSTEM + [session] * (32 * turns)


# -- the native wire -----------------------------------------------------------------


def test_request_tokens_are_the_prepared_prefix_under_root_0() -> None:
    wire = NativeWire()
    assert wire.prepare(Request("a", {"x": 1}), [], 0.0).prefix is None
    tokens = [1, 2, 3]
    prepared = wire.prepare(Request("a", {"x": 1}, tokens=tokens), [], 0.0)
    assert prepared.prefix == (tokens, 0)
    assert prepared.prefix[0] is tokens  # no copy of a list of ints


class _Index:
    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def test_integer_likes_become_ints() -> None:
    prepared = NativeWire().prepare(Request("a", tokens=[_Index(5), 6]), [], 0.0)  # type: ignore[list-item]
    assert prepared.prefix == ([5, 6], 0)


class _Array:
    """An array-like that is no `Sequence` (as numpy's arrays): len, items, iteration."""

    def __init__(self, *items: Any) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]

    def __iter__(self) -> Any:
        return iter(self.items)


def test_array_likes_and_ranges_become_lists_of_ints() -> None:
    wire = NativeWire()
    for tokens in (_Array(_Index(5), 6), range(5, 7)):
        assert wire.prepare(Request("a", tokens=tokens), [], 0.0).prefix == ([5, 6], 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=r"holds 1\.5"):
        wire.prepare(Request("a", tokens=_Array(1, 1.5)), [], 0.0)  # type: ignore[arg-type]


def test_numpy_arrays_of_token_ids_are_taken() -> None:
    np = pytest.importorskip("numpy")
    wire = NativeWire()
    for dtype in (np.int64, np.int32, np.uint32):
        tokens = np.arange(40, dtype=dtype)
        assert wire.prepare(Request("a", tokens=tokens), [], 0.0).prefix == (list(range(40)), 0)
    for bad in (np.array(5), np.zeros((2, 2), dtype=np.int64), np.array([1.5])):
        with pytest.raises(InvalidRequest, match=r"'a'.*tokens"):
            wire.prepare(Request("a", tokens=bad), [], 0.0)


@pytest.mark.parametrize("tokens", ["abc", b"ab", [1, "2"], [1, True], {1: 2}, 5, [1.5]])
def test_tokens_that_are_no_sequence_of_ints_are_refused_naming_the_request(tokens: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        NativeWire().prepare(Request("req-7", tokens=tokens), [], 0.0)
    assert "req-7" in str(info.value) and "tokens" in str(info.value)


# -- Routing -------------------------------------------------------------------------


def routing(size: int = 2, *, speed: bool = True, lockstep: bool = False) -> Routing:
    return Routing(size, up=True, speed=speed, prefix=PrefixIndex(size), lockstep=lockstep)


@pytest.mark.parametrize("speed", [False, True])
@pytest.mark.parametrize("size", [2, 3, 8])
def test_requests_without_tokens_are_routed_exactly_as_without_the_index(
    size: int, speed: bool
) -> None:
    """Same facts to a plain Routing and one with the index: the same picks, as long as
    no request carries token ids (and with tokens that share no block, too)."""
    rng = random.Random(size * 2 + speed)
    plain = Routing(size, up=True, speed=speed)
    prefixed = routing(size, speed=speed)
    live: list[tuple[str, int]] = []
    for i in range(600):
        op = rng.random()
        if op < 0.5 or not live:
            rid = f"r{i}"
            tokens = [i] * rng.choice([0, 8, 40]) if rng.random() < 0.5 else None
            got = prefixed.select(rid, prefix=None if tokens is None else (tokens, 0))
            assert got == plain.select(rid), f"pick {i}"
            live.append((rid, got))
        elif op < 0.8:
            rid, rank = live.pop(rng.randrange(len(live)))
            plain.release(rank, [rid])
            prefixed.release(rank, [rid])
        else:
            rank = rng.randrange(size)
            load = Load(rng.randrange(4), rng.randrange(4), rng.random())
            plain.observe_load(rank, load)
            prefixed.observe_load(rank, load)
            plain.observe_outputs(rank, i * 0.01, 1)
            prefixed.observe_outputs(rank, i * 0.01, 1)


@pytest.mark.parametrize("speed", [False, True])
def test_a_session_follows_its_prefix_within_the_band_and_leaves_out_of_it(speed: bool) -> None:
    r = routing(speed=speed)
    first = r.select("s0", prefix=(prompt(7), 0))
    assert r.prefix is not None and r.prefix.blocks(first) == 6
    # a load on its rank within the band (least x 1.25 + 2): the follow-ups stay
    other = 1 - first
    for turn in range(2):
        assert r.select(f"s{turn + 1}", prefix=(prompt(7, turn + 2), 0)) == first
    assert r.inflight_count(first) == 3 and r.inflight_count(other) == 0
    # a fourth on it is out of the band (3 > 0 x 1.25 + 2): the next turn leaves
    assert r.select("s3", prefix=(prompt(7, 4), 0)) == other
    assert r.prefix_routed == 4 and r.prefix_hits == 2
    assert r.prefix_cached_tokens == 96 + 128


def test_a_lying_rank_draws_nothing_past_the_band() -> None:
    """Rank 0 claims (KV events) every prompt before it is sent: new prompts, which no
    honest rank caches. It gets one only while within the band: right after any pick
    it holds at most the least-loaded rank's load x 1.25 + 2, plus the one it got."""
    r = routing(4)
    index = r.prefix
    assert index is not None
    index.set_exact(0, True)
    for i in range(60):
        tokens = [i] * 64 + list(range(64))
        index.store(0, index.chain(tokens))  # the liar claims it
        r.select(f"q{i}", prefix=(tokens, 0))
        least = min(r.inflight_count(q) for q in range(1, 4))
        assert r.inflight_count(0) <= least * 1.25 + 2 + 1, f"pick {i}"
    assert r.prefix_hits == r.inflight_count(0) > 15  # it drew all it could


def test_lockstep_picks_the_least_pending_prefill_and_releases_it_at_the_first_output() -> None:
    r = routing(2, speed=False, lockstep=True)
    long = prompt(3, 20)  # 704 tokens, 44 blocks
    assert r.select("a", prefix=(long, 0)) == 0  # nothing cached: the load decision
    assert r.prefill_pending(0) == 704
    # cached on 0, but 0 holds 704 pending: 704 + 0 uncached there, 0 + 704 on rank 1:
    # equal resulting loads, and the tie goes to the least loaded
    assert r.select("b", prefix=(long, 0)) == 1
    assert r.prefill_pending(1) == 704
    # both cache it now: each would cost its pending only; a tie, then the rotation
    assert r.select("c", prefix=(long, 0)) == 0
    assert r.prefill_pending(0) == 704  # nothing uncached added
    r.started("a")  # its first output
    assert r.prefill_pending(0) == 0
    r.started("a")  # twice: nothing more
    assert r.prefill_pending(0) == 0
    # the session's next turn: 0 pending + 16 uncached on rank 0, though it holds
    # more requests, against 704 pending + 16 on rank 1
    assert r.select("d", prefix=(long + [9] * 16, 0)) == 0
    r.release(1, ["b"])  # its end, before any output
    assert r.prefill_pending(1) == 0 and "b" not in r.prefilling
    r.take_down(0)
    assert not r.prefilling and r.prefill_pending(0) == 0


# -- GroupCore -----------------------------------------------------------------------


def core(size: int = 2, lockstep: bool = False, **info: Any) -> GroupCore[object]:
    c: GroupCore[object] = GroupCore(size, lockstep=lockstep, speed=True, prefix=True)
    for r in range(size):
        c.on_rank_up(RankUp(r, 10 + r, info=info), 0.0)
    c.take_effects()
    return c


def test_the_core_feeds_the_index_from_handshakes_loads_and_deaths() -> None:
    c = core(block_size=4, num_gpu_blocks=100)
    index = c.prefix
    assert index is not None and c.routing.prefix is index
    assert index.block_size == 4 and index.limit(0) == 100
    tokens = list(range(40))
    sub = c.submit("a", {"p": 1}, object(), None, 1.0, None, (tokens, 0))
    assert index.blocks(sub.rank) == 10
    load = {"running": 1, "kv": 0.5}
    body = cbor2.dumps({"rank": sub.rank, "epoch": 10 + sub.rank, "load": load})
    c.on_output([rank_identity(sub.rank), body], 2.0)
    assert index.limit(sub.rank) == 64  # 100 x (1 - 0.5), at least min_blocks
    before = index.incarnation(sub.rank)
    c.on_rank_dead(sub.rank, "test")
    assert index.blocks(sub.rank) == 0 and index.incarnation(sub.rank) > before
    c.on_rank_up(RankUp(sub.rank, 99, info={"block_size": 4}), 3.0)
    assert index.limit(sub.rank) == index.rank_blocks  # its capacity is not known now
    assert index.match(index.chain(tokens)) == [0, 0]


def test_a_new_block_size_clears_the_index() -> None:
    c = core(block_size=4)
    index = c.prefix
    assert index is not None
    c.submit("a", None, object(), None, 1.0, None, (list(range(40)), 0))
    assert index.total == 10
    c.on_rank_dead(0, "test")
    c.on_rank_dead(1, "test")  # the whole group restarts, with another block size
    c.take_effects()
    c.on_rank_up(RankUp(1, 50, info={"block_size": 8}), 2.0)
    assert index.block_size == 8 and index.total == 0
    c.on_rank_up(RankUp(0, 51, info={"block_size": 8}), 2.0)
    assert index.block_size == 8


@pytest.mark.parametrize("junk", [1, 2**62, 8])
def test_one_rank_alone_cannot_change_the_groups_block_size(junk: int) -> None:
    """A rank that comes back (or lies) with another block size while the others are
    up cleared every rank's index, and 2^62 turned affinity off for the whole group:
    the group's block size stays, and a warning names the rank."""
    c = core(block_size=16)
    index = c.prefix
    assert index is not None
    tokens = list(range(64))
    first = c.submit("a", None, object(), None, 1.0, None, (tokens, 0)).rank
    other = 1 - first
    c.on_rank_dead(other, "test")
    c.take_effects()
    c.on_rank_up(RankUp(other, 77, info={"block_size": junk}), 2.0)
    assert index.block_size == 16 and index.blocks(first) == 4  # nothing cleared
    logs = c.take_effects().logs
    assert any(f"rank {other}" in m and str(junk) in m for _, _, m in logs), logs
    again = c.submit("b", None, object(), None, 3.0, None, (tokens + [1] * 16, 0))
    assert again.rank == first  # affinity still works


def test_a_core_without_prefix_routing_ignores_the_prefix() -> None:
    c: GroupCore[object] = GroupCore(2, lockstep=False)
    c.on_rank_up(RankUp(0, 1), 0.0)
    c.on_rank_up(RankUp(1, 2), 0.0)
    assert c.prefix is None
    assert c.submit("a", None, object(), None, 1.0, None, ([1] * 64, 0)).rank == 0
    assert c.submit("b", None, object(), None, 1.0, None, ([1] * 64, 0)).rank == 1


# -- exact mode by example -------------------------------------------------------------


def test_exact_mode_stores_removes_drops_and_holds_by_incarnation() -> None:
    index = PrefixIndex(2, block_size=2)
    keys = index.chain([1, 2, 3, 4, 5, 6])
    index.set_exact(0, True, index.incarnation(0))
    index.store(0, keys, index.incarnation(0))
    assert index.match(keys) == [3, 0] and index.stored(0) == 3
    index.store(0, keys, index.incarnation(0) - 1)  # stale: ignored
    index.remove(0, keys[1:2], index.incarnation(0) - 1)
    assert index.match(keys) == [3, 0]
    index.remove(0, keys[1:2], index.incarnation(0))
    assert index.match(keys) == [1, 0]
    index.hold(0, True, index.incarnation(0))
    assert index.match(keys) == [0, 0]
    index.hold(0, False, index.incarnation(0))
    index.drop(0, index.incarnation(0))
    assert index.blocks(0) == 0 and index.is_exact(0)
    index.forget(0)
    assert not index.is_exact(0)


def test_exact_mode_keeps_predictions_short_and_the_stores_within_the_caps() -> None:
    index = PrefixIndex(2, block_size=1, max_blocks=4 * PREDICTED_BLOCKS)
    index.set_exact(0, True)
    long = list(range(3 * PREDICTED_BLOCKS))
    index.insert(0, index.chain(long))
    assert index.blocks(0) == PREDICTED_BLOCKS  # the first blocks, predicted
    index.set_capacity(0, 2 * PREDICTED_BLOCKS)
    index.store(0, index.chain(long))  # a flood past its capacity
    assert index.blocks(0) == 2 * PREDICTED_BLOCKS and index.stored(0) == 2 * PREDICTED_BLOCKS
    assert index.total <= index.max_blocks
    index.set_exact(0, False)  # back to approximate: the stores kept, within its limit
    assert index.stored(0) == 0 and index.blocks(0) == index.limit(0)


# -- vLLM's wire and a lockstep core -------------------------------------------------


def test_the_vllm_wire_prepares_prompt_token_ids_under_the_cache_salt() -> None:
    from zmqdp._core.prefix import block_key
    from zmqdp.vllm import VllmRequest
    from zmqdp.vllm.wire import VllmWire

    wire = VllmWire()
    info = [{"max_model_len": 1000}]
    plain = wire.prepare(VllmRequest("a", [1, 2, 3]), info, 0.0)
    assert plain.prefix == ([1, 2, 3], 0)
    salted = wire.prepare(VllmRequest("b", [1, 2, 3], cache_salt="s"), info, 0.0)
    other = wire.prepare(VllmRequest("c", [1, 2, 3], cache_salt="t"), info, 0.0)
    assert salted.prefix == ([1, 2, 3], block_key(None, [hash("s")]))
    assert salted.prefix is not None and other.prefix is not None
    assert len({0, salted.prefix[1], other.prefix[1]}) == 3  # separate caches


def test_a_lockstep_cores_pending_prefill_ends_at_the_first_output() -> None:
    c = core(lockstep=True)
    sub = c.submit("a", None, object(), None, 1.0, None, (list(range(64)), 0))
    assert c.routing.prefill_pending(sub.rank) == 64
    body = cbor2.dumps(
        {"rank": sub.rank, "epoch": 10 + sub.rank, "outputs": [{"id": sub.wire_id, "body": 1}]}
    )
    c.on_output([rank_identity(sub.rank), body], 2.0)
    assert c.take_effects().deliveries  # delivered: its prefill is done
    assert c.routing.prefill_pending(sub.rank) == 0 and not c.routing.prefilling


# -- the prefix path against its rules (tests/models/prefix.py) -------------------------

TestPrefixRouting = PrefixRoutingMachine.TestCase
TestPrefixRouting.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)

HUNT = hunt(1000, 40)


@pytest.mark.parametrize(
    ("variant", "caught_by"),
    [
        (mutants.UnbandedPrefixRouting, "out of the band"),
        (mutants.NoFallbackPrefixRouting, "nothing cached in the band"),
        (mutants.UnindexedRouting, "of the prompt's"),
        (mutants.PrefillLeakRouting, "pending drifted|outlived"),
    ],
)
def test_prefix_routing_machine_catches(variant: type[Routing], caught_by: str) -> None:
    machine = type(
        f"PrefixRoutingWith{variant.__name__}", (PrefixRoutingMachine,), {"routing_cls": variant}
    )
    with pytest.raises(AssertionError, match=caught_by):
        run_state_machine_as_test(machine, settings=HUNT)


# -- token ids as hosts have them (hostile review) ---------------------------------------


class _ArrayLike:
    """numpy's ndarray as `check_tokens` sees it: sized, iterable and indexable, of
    integer-likes, but no registered `collections.abc.Sequence`."""

    def __init__(self, values: list[int]) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Any:
        return (_Index(v) for v in self.values)

    def __getitem__(self, i: int) -> _Index:
        return _Index(self.values[i])


def test_array_like_tokens_become_ints_on_both_wires() -> None:
    """A tokenizer's numpy array was refused as 'not a sequence' on the native wire
    and raised a bare ValueError (truth value of an array) on vLLM's."""
    from zmqdp.vllm import VllmRequest
    from zmqdp.vllm.wire import VllmWire

    native = NativeWire().prepare(Request("a", tokens=_ArrayLike([5, 6])), [], 0.0)  # type: ignore[arg-type]
    assert native.prefix == ([5, 6], 0)
    wire = VllmWire()
    prepared = wire.prepare(VllmRequest("b", _ArrayLike([1, 2, 3])), [{"max_model_len": 99}], 0.0)  # type: ignore[arg-type]
    assert prepared.prefix == ([1, 2, 3], 0)
    assert prepared.body[0].prompt_token_ids == [1, 2, 3]  # what the ADD carries: ints
    wire.encode_add("w", prepared.body, 0)  # msgpack takes them


def test_numpy_tokens_become_ints() -> None:
    np = pytest.importorskip("numpy")
    prepared = NativeWire().prepare(Request("a", tokens=np.arange(3)), [], 0.0)
    assert prepared.prefix == ([0, 1, 2], 0) and type(prepared.prefix[0][0]) is int
    with pytest.raises(InvalidRequest, match=r"'a'.*holds"):
        NativeWire().prepare(Request("a", tokens=np.arange(4).reshape(2, 2)), [], 0.0)


@pytest.mark.parametrize("tokens", [(i for i in range(3)), "abc", {1: 2}, 7])
def test_vllm_prompt_token_ids_of_the_wrong_kind_are_refused_naming_the_request(
    tokens: Any,
) -> None:
    """A generator made prepare raise a bare TypeError (len), naming no request."""
    from zmqdp.vllm import VllmRequest
    from zmqdp.vllm.wire import VllmWire

    with pytest.raises(InvalidRequest) as info:
        VllmWire().prepare(VllmRequest("req-9", tokens), [{"max_model_len": 99}], 0.0)
    assert "req-9" in str(info.value) and "prompt_token_ids" in str(info.value)


def test_a_huge_prompt_under_a_one_token_block_costs_a_bounded_walk() -> None:
    """An engine whose ready response says block_size 1 and a 10^6-token prompt made
    one pick hash, insert and look up 10^6 blocks (seconds in the dispatcher, and one
    prompt took a million index entries): the walk stops at `max_prompt_blocks`."""
    from zmqdp._core.prefix import MAX_PROMPT_BLOCKS

    c = core(block_size=1)
    index = c.prefix
    assert index is not None and index.block_size == 1
    huge = list(range(10**6))
    assert len(index.chain(huge)) == MAX_PROMPT_BLOCKS
    first = c.submit("a", None, object(), None, 1.0, None, (huge, 0))
    assert index.total == MAX_PROMPT_BLOCKS
    # the same long prompt again: its first blocks are still told apart, and it follows
    again = c.submit("b", None, object(), None, 1.0, None, (huge, 0))
    assert again.rank == first.rank
    assert c.routing.prefix_cached_tokens == MAX_PROMPT_BLOCKS


def test_a_pinned_prompt_is_indexed_and_its_lockstep_prefill_counted() -> None:
    """A pinned request with token ids was neither indexed (its session's next,
    unpinned, turn did not follow it to the rank that caches it) nor counted in a
    lockstep rank's pending prefill (affinity piled onto a rank busy prefilling it)."""
    r = routing(2, speed=False)
    long = prompt(4, 10)
    assert r.select("a", 1, prefix=(long, 0)) == 1
    assert r.prefix is not None and r.prefix.match(r.prefix.chain(long)) == [0, 24]
    assert r.select("b", prefix=(long + [5] * 16, 0)) == 1  # the next turn follows
    assert r.prefix_routed == 1  # the pinned one was not routed
    lock = routing(2, speed=False, lockstep=True)
    assert lock.select("a", prefix=(long, 0)) == 0  # cached on 0 from now on
    lock.started("a")
    lock.release(0, ["a"])
    huge = prompt(6, 100)  # 3,264 tokens pinned to rank 0: its prefill gates every step
    assert lock.select("h", 0, prefix=(huge, 0)) == 0
    assert lock.prefill_pending(0) == len(huge) - len(SYSTEM)  # the system prompt is cached
    # the session's next turn: 3,264 + 16 on rank 0 against 0 + 240 on rank 1
    assert lock.select("b", prefix=(long + [5] * 16, 0)) == 1
    lock.started("h")
    assert lock.prefill_pending(0) == 0 and "h" not in lock.prefilling
    assert lock.select("d", 0, prefix=(long, 0)) == 0  # cached there: nothing pending
    assert lock.prefill_pending(0) == 0
    lock.release(0, ["h", "d"])
    assert not lock.prefilling.keys() - {"b"}
