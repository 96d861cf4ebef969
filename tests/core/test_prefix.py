"""Prefix affinity's core (`_core/prefix.py`): the index against a naive reference, the
pick's guarantees, and each broken variant in tests/models/mutants.py shown caught."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from tests.models import mutants
from tests.models.hunt import hunt
from tests.models.prefix import IndexMachine, check_pick
from zmqdp._core.prefix import PrefixIndex, chain, pick

TestIndex = IndexMachine.TestCase
TestIndex.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)

HUNT = hunt(2000, 40)

Pick = Callable[..., int]

LOADS = st.lists(
    st.one_of(st.integers(0, 12).map(float), st.just(math.inf), st.floats(0, 12)),
    min_size=1,
    max_size=6,
)


@st.composite
def picks(draw: st.DrawFn) -> tuple[list[float], list[int], int, int, list[float] | None]:
    loads = draw(LOADS)
    n = len(loads)
    prompt = draw(st.integers(0, 64))
    most = draw(st.sampled_from([prompt, prompt, 4 * prompt + 8]))  # and lies past it
    cached = draw(st.lists(st.integers(0, most), min_size=n, max_size=n))
    if draw(st.booleans()):
        cached = [c if draw(st.booleans()) else 0 for c in cached]
    pending = draw(st.none() | st.lists(st.integers(0, 128).map(float), min_size=n, max_size=n))
    start = draw(st.integers(0, n - 1))
    return loads, cached, prompt, start, pending


def pick_property(chooser: Pick, config: settings | None = None) -> Callable[[], None]:
    @given(case=picks())
    def check(case: tuple[list[float], list[int], int, int, list[float] | None]) -> None:
        loads, cached, prompt, start, pending = case
        chosen = chooser(loads, cached, prompt, start=start, pending=pending)
        check_pick(chosen, loads, cached, prompt, start, pending)

    return config(check) if config is not None else check


test_pick_guarantees = settings(max_examples=500, deadline=None)(pick_property(pick))


# -- mutants --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "caught_by"),
    [
        (mutants.RootFirstIndex, "match of|blocks, expected"),
        (mutants.UnchainedIndex, "match of|blocks, expected|distinct blocks"),
        (mutants.UsageBlindIndex, "past its limit"),
        (mutants.UncappedIndex, "past max_blocks"),
        (mutants.TiedCapIndex, "blocks, expected|match of"),
        (mutants.LeakyIndex, "distinct blocks kept"),
        (mutants.KeepsForgottenIndex, "match of|blocks, expected"),
        (mutants.StaleInsertIndex, "match of|blocks, expected"),
        (mutants.StaleStoreIndex, "match of|blocks, expected"),
        (mutants.HoldBlindIndex, "match of"),
        (mutants.UnboundedStoreIndex, "past its limit|past max_blocks|blocks, expected"),
        (mutants.LongPredictionsIndex, "blocks, expected|match of"),
        (mutants.DropForgetsIndex, "blocks, expected|match of|exact mode"),
        (mutants.UsageShrinksExactIndex, "blocks, expected|match of"),
        (mutants.RemoveKeepsPredictedIndex, "blocks, expected|match of"),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_index_machine_catches(variant: type[PrefixIndex], caught_by: str) -> None:
    machine = type(f"IndexMachineWith{variant.__name__}", (IndexMachine,), {"index_cls": variant})
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(machine, settings=HUNT)
    assert any(c in str(info.value) for c in caught_by.split("|")), info.value


@pytest.mark.parametrize(
    ("variant", "caught_by"),
    [
        (mutants.pick_unbanded, "out of the band"),
        (mutants.pick_pending_blind, "lockstep"),
        (mutants.pick_cache_blind, "caches"),
        (mutants.pick_trusting, "caches most|lockstep"),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_pick_property_catches(variant: Pick, caught_by: str) -> None:
    with pytest.raises(AssertionError) as info:
        pick_property(variant, HUNT)()
    assert any(c in str(info.value) for c in caught_by.split("|")), info.value


# -- examples -------------------------------------------------------------------------


def test_chain_names_the_whole_prefix() -> None:
    a = chain([1, 2, 3, 4, 5], block_size=2)
    b = chain([9, 9, 3, 4], block_size=2)
    assert len(a) == 2  # the partial last block is not cached
    assert a[0] != b[0] and a[1] != b[1]  # the same block under another prefix
    assert chain([1, 2, 3, 4], block_size=2, root=7)[0] != a[0]  # another cache (salt)


def test_chain_does_not_depend_on_the_hash_seed() -> None:
    code = "from zmqdp._core.prefix import chain; print(chain(list(range(40)), 16))"
    seen = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        seen.add(out.stdout)
    assert len(seen) == 1, seen


def test_a_session_stays_on_its_rank_within_the_band() -> None:
    index = PrefixIndex(4, block_size=4)
    system = list(range(100, 132))  # 8 blocks
    turn1 = [*system, 1, 2, 3, 4]
    index.insert(2, index.chain(turn1))
    turn2 = [*turn1, 5, 6, 7, 8, 9, 10, 11, 12]
    cached = index.cached_tokens(index.chain(turn2))
    assert cached == [0, 0, 36, 0]
    assert pick([1.0, 0.0, 2.0, 1.0], cached, len(turn2)) == 2  # 2 <= 0 x 1.25 + 2
    # a rank past the band loses its session to the least loaded
    assert pick([1.0, 0.0, 2.5, 1.0], cached, len(turn2)) == 1


def test_lockstep_leaves_a_hot_rank_once_its_queue_outweighs_its_cache() -> None:
    """tpu-inference#3315's case: rank 0 caches 900 of a 1000-token prompt but has 1000
    prefill tokens queued; rank 1 has none. Rank 1 leaves max 1000, rank 0 1100."""
    cached = [900, 0]
    assert pick([1.0, 1.0], cached, 1000, pending=[0.0, 0.0]) == 0
    assert pick([1.0, 1.0], cached, 1000, pending=[1000.0, 0.0]) == 1


def test_a_busy_rank_is_assumed_to_keep_less() -> None:
    index = PrefixIndex(2, block_size=1, max_blocks=1000, min_blocks=4)
    index.set_capacity(0, 100)
    index.insert(0, index.chain(list(range(80))))
    assert index.blocks(0) == 80
    index.observe_usage(0, 0.9)  # 10 blocks free: the older entries are gone
    assert index.blocks(0) == 10
    assert index.match(index.chain(list(range(80)))) == [10, 0]  # the root side stays
    index.observe_usage(0, math.nan)  # unknown: counted as idle, nothing comes back
    assert index.limit(0) == 100 and index.blocks(0) == 10


def test_a_claimed_capacity_is_bounded() -> None:
    index = PrefixIndex(2, block_size=1, max_blocks=50, rank_blocks=30)
    index.set_capacity(0, 2**62)
    index.insert(0, index.chain(list(range(1000))))
    assert index.blocks(0) == 30
    index.insert(1, index.chain(list(range(2000, 2030))))
    assert index.total == 50 and index.blocks(0) == index.blocks(1) == 25  # the fullest gave way


def test_forget_drops_a_replaced_rank() -> None:
    index = PrefixIndex(2, block_size=2)
    hashes = index.chain([1, 2, 3, 4])
    index.insert(0, hashes)
    index.insert(1, hashes)
    old = index.incarnation(0)
    index.forget(0)
    assert index.match(hashes) == [0, 2]
    index.insert(0, hashes, incarnation=old)  # sent before it died: not cached there
    assert index.match(hashes) == [0, 2]
    index.insert(0, hashes, incarnation=index.incarnation(0))
    assert index.match(hashes) == [2, 2]


def test_a_claim_past_the_prompt_counts_as_the_prompt() -> None:
    assert pick([1.0, 0.0], [10**9, 100], 100) == 1  # a tie: the least load
    assert pick([0.0, 0.0], [10**9, 100], 100, pending=[0.0, 0.0], start=1) == 1


def test_no_candidate() -> None:
    assert pick([math.inf, math.inf], [5, 5], 10) == -1
    assert pick([], [], 10) == -1


def test_the_global_cap_costs_no_scan_of_every_rank_per_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past `max_blocks`, each dropped block scanned every rank for the fullest: a
    flood of stores at the cap (4,096 a batch) cost 4,096 x N scans in the event
    loop. The drops are now computed at once, with the same result (IndexMachine)."""
    size = 64
    index = PrefixIndex(size, block_size=1, max_blocks=size * 64)
    for r in range(size):
        index.store(r, list(range(r * 10**6, r * 10**6 + 64)))
    assert index.total == index.max_blocks
    calls = 0
    blocks = PrefixIndex.blocks

    def counted(self: PrefixIndex, rank: int) -> int:
        nonlocal calls
        calls += 1
        return blocks(self, rank)

    monkeypatch.setattr(PrefixIndex, "blocks", counted)
    index.store(0, list(range(-4096, 0)))  # a liar's flood, past the cap
    assert index.total == index.max_blocks
    assert calls < 4 * size, calls  # was about 4,096 x 64
    # the liar (fullest) paid: it was levelled with the others, who lost nothing much
    assert [index.blocks(r) for r in range(size)] == [64] * size
