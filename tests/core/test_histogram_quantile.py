"""`HistogramSnapshot.quantile`: Prometheus' `histogram_quantile` on zmqdp's snapshots
(linear interpolation within the bucket holding the rank), its edge cases, and
`HistogramSnapshot.to_json`."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zmqdp import HistogramSnapshot
from zmqdp._core.metrics import LATENCY_BUCKETS, Histogram


def snap(
    buckets: tuple[float, ...], counts: tuple[int, ...], total: float = 0.0
) -> HistogramSnapshot:
    return HistogramSnapshot(buckets, counts, total, sum(counts))


# -- worked examples ------------------------------------------------------------------


def test_the_median_of_evenly_spread_buckets() -> None:
    # 10 in (0, 1], 10 in (1, 2]: rank 10 is the last of the first bucket.
    h = snap((1.0, 2.0), (10, 10, 0))
    assert h.quantile(0.5) == 1.0
    assert h.quantile(0.25) == 0.5  # rank 5 of 10 in (0, 1]
    assert h.quantile(0.75) == 1.5  # rank 15: 5 of 10 into (1, 2]
    assert h.quantile(1.0) == 2.0


def test_interpolation_matches_prometheus() -> None:
    # le=0.1: 2, le=0.5: 8 (6 more), le=1: 10 (2 more), +Inf: 10.
    h = snap((0.1, 0.5, 1.0), (2, 6, 2, 0))
    # p50: rank 5, in (0.1, 0.5], 3 of its 6: 0.1 + 0.4 * 3/6 = 0.3
    assert h.quantile(0.5) == pytest.approx(0.3)
    # p90: rank 9, in (0.5, 1], 1 of its 2: 0.75
    assert h.quantile(0.9) == pytest.approx(0.75)
    # p10: rank 1, in (0, 0.1], 1 of its 2: 0.05 (the first bucket starts at 0)
    assert h.quantile(0.1) == pytest.approx(0.05)


def test_a_rank_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    h = snap((1.0, 2.0), (1, 1, 8))
    assert h.quantile(0.99) == 2.0
    assert h.quantile(1.0) == 2.0
    assert h.quantile(0.1) == 1.0  # rank 1: the whole first bucket


def test_q_zero_is_the_lower_bound_of_the_first_bucket_that_holds_anything() -> None:
    assert snap((1.0, 2.0, 4.0), (0, 3, 1, 0)).quantile(0.0) == 1.0
    assert snap((1.0, 2.0), (5, 0, 0)).quantile(0.0) == 0.0


def test_a_first_bound_at_or_below_zero_is_returned_as_is() -> None:
    assert snap((-1.0, 2.0), (4, 0, 0)).quantile(0.5) == -1.0


def test_empty_histograms_and_bucketless_ones_give_nan() -> None:
    assert math.isnan(snap((1.0, 2.0), (0, 0, 0)).quantile(0.5))
    assert math.isnan(snap((), (3,)).quantile(0.5))
    assert math.isnan(Histogram().snapshot().quantile(0.99))


@pytest.mark.parametrize("q", [-0.01, 1.01, math.nan, math.inf, -math.inf])
def test_q_outside_zero_one_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match="0 <= q <= 1"):
        snap((1.0,), (1, 0)).quantile(q)


def test_a_live_histogram() -> None:
    h = Histogram()
    for seconds in (0.003, 0.004, 0.02, 0.2, 0.2, 7.0):
        h.observe(seconds)
    s = h.snapshot()
    assert s.quantile(1 / 3) == 0.005  # the two in (0, 0.005]
    assert 0.1 < s.quantile(0.75) <= 0.25
    assert 5.0 < s.quantile(1.0) <= 10.0


def test_to_json() -> None:
    h = Histogram((0.5, 1.0))
    for seconds in (0.1, 0.7, 3.0):
        h.observe(seconds)
    data = h.snapshot().to_json()
    assert data == {"buckets": [0.5, 1.0], "counts": [1, 1, 1], "sum": 3.8, "count": 3}
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert HistogramSnapshot((1.0,), (0, 1), math.inf, 1).to_json()["sum"] is None


# -- properties -----------------------------------------------------------------------

bounds = st.lists(
    st.floats(min_value=1e-6, max_value=1e6, allow_nan=False), min_size=1, max_size=12, unique=True
).map(lambda b: tuple(sorted(b)))


@st.composite
def snapshots(draw: st.DrawFn) -> HistogramSnapshot:
    buckets = draw(st.sampled_from([LATENCY_BUCKETS]) | bounds)
    counts = tuple(
        draw(st.lists(st.integers(0, 1000), min_size=len(buckets) + 1, max_size=len(buckets) + 1))
    )
    return snap(buckets, counts, 1.0)


qs = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


def bucket_of_rank(s: HistogramSnapshot, q: float) -> tuple[float, float]:
    """The bounds of the bucket that holds the observation of rank q * count (for q = 0:
    the first bucket that holds any), its +Inf bucket clamped to the last bound."""
    rank = q * s.count
    below = 0
    for i, n in enumerate(s.counts):
        if n and below + n >= rank:
            if i == len(s.buckets):
                return s.buckets[-1], s.buckets[-1]
            return (0.0 if i == 0 else s.buckets[i - 1]), s.buckets[i]
        below += n
    raise AssertionError("no bucket holds the rank")  # pragma: no cover


@given(snapshots(), qs, qs)
def test_quantile_is_monotone_in_q(s: HistogramSnapshot, a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    if s.count == 0:
        assert math.isnan(s.quantile(lo)) and math.isnan(s.quantile(hi))
    else:
        assert s.quantile(lo) <= s.quantile(hi)


@given(snapshots(), qs)
def test_quantile_lies_in_the_bucket_holding_the_rank(s: HistogramSnapshot, q: float) -> None:
    if s.count == 0:
        return
    lower, upper = bucket_of_rank(s, q)
    assert lower <= s.quantile(q) <= upper


@given(snapshots())
def test_the_extremes(s: HistogramSnapshot) -> None:
    if s.count == 0:
        return
    assert s.quantile(0.0) == bucket_of_rank(s, 0.0)[0]
    highest = max(i for i, n in enumerate(s.counts) if n)
    assert s.quantile(1.0) == s.buckets[min(highest, len(s.buckets) - 1)]
