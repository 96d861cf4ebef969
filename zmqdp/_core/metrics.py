"""Latency histograms, sans-IO: the trio layer observes seconds it measured itself.

Fixed buckets (Prometheus-style upper bounds), so that a snapshot is a few small tuples
and exporting it to any metrics system is a copy: no quantile sketch, no allocation
per observation. The buckets span 5 ms (a token from a warm engine) to 5 min (a long
generation); what falls above the last lands in the implicit +Inf bucket.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

__all__ = ["LATENCY_BUCKETS", "Histogram", "HistogramSnapshot"]

LATENCY_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """`counts[i]` observations were <= `buckets[i]` and above the bucket before it;
    `counts[-1]` (one more than `buckets`) were above the last bound."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) pairs, ending with (inf, count): the
        Prometheus exposition."""
        out, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class Histogram:
    """Counts of observations per bucket, and their sum."""

    __slots__ = ("_buckets", "_counts", "_sum")

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be strictly increasing, got {buckets!r}")
        self._buckets = buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._buckets, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self._buckets, tuple(self._counts), self._sum, sum(self._counts))
