"""Latency histograms, sans-IO: the trio layer observes seconds it measured itself.

Fixed buckets (Prometheus-style upper bounds), so that a snapshot is a few small tuples
and exporting it to any metrics system is a copy: no quantile sketch, no allocation
per observation. The buckets span 5 ms (a token from a warm engine) to 5 min (a long
generation); what falls above the last lands in the implicit +Inf bucket.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INTER_TOKEN_LATENCY_BUCKETS",
    "ITERATION_TOKENS_BUCKETS",
    "LATENCY_BUCKETS",
    "REQUEST_LATENCY_BUCKETS",
    "REQUEST_NUM_PREEMPTIONS_BUCKETS",
    "REQUEST_PARAMS_N_BUCKETS",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "Histogram",
    "HistogramSnapshot",
    "build_1_2_5_buckets",
]

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

# vLLM 0.32's buckets (vllm/v1/metrics/buckets.py), so that the `vllm:` histograms of a
# zmqdp gateway aggregate with those of vLLM's own frontends (a quantile over a mixed
# fleet needs the same bounds). tests/data/vllm_metrics.json holds the same table, and
# tests/real_vllm/test_metrics_table.py compares it with an installed vLLM.

REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
"""vLLM's e2e, queue, inference, prefill and decode time buckets."""

TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0),
    *(7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
"""vLLM's time-to-first-token buckets."""

INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0),
)
"""vLLM's inter-token latency and time-per-output-token buckets."""

ITERATION_TOKENS_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in (0, *range(3, 15)))
"""vLLM's tokens-per-engine-step buckets: 1, 8, 16, ... 16384."""

REQUEST_PARAMS_N_BUCKETS: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 20.0)
REQUEST_NUM_PREEMPTIONS_BUCKETS: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's `build_1_2_5_buckets`: its
    token-count histograms end at the model's `max_model_len`)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        exponent += 1


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """`counts[i]` observations were <= `buckets[i]` and above the bucket before it;
    `counts[-1]` (one more than `buckets`) were above the last bound."""

    buckets: tuple[float, ...]
    """The upper bounds, ascending, in the histogram's unit (seconds for TTFT and
    latency)."""
    counts: tuple[int, ...]
    """Observations per bucket (not cumulative); the last entry is the +Inf bucket."""
    sum: float
    """The sum of every observation."""
    count: int
    """How many observations (the sum of `counts`)."""

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) pairs, ending with (inf, count): the
        Prometheus exposition."""
        out, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out

    def quantile(self, q: float) -> float:
        """The `q`-quantile (0 <= q <= 1; 0.99 is p99) estimated as Prometheus'
        `histogram_quantile` does: find the bucket holding the observation of rank
        `q * count` and interpolate linearly between its bounds, as if its observations
        were spread evenly over it. The estimate is only as fine as the buckets.

        Edge cases: no observations: NaN. `q` outside [0, 1] (or NaN): `ValueError`.
        The rank in the +Inf bucket (above the last bound): the highest finite bound
        (the histogram knows no more). The first bucket starts at 0 (its bound is
        returned as is if it is <= 0). `q == 0`: the lower bound of the first bucket
        that holds an observation. No finite bound at all: NaN.
        """
        if not 0.0 <= q <= 1.0:  # also refuses NaN
            raise ValueError(f"a quantile needs 0 <= q <= 1, got {q!r}")
        total = sum(self.counts)
        if total == 0 or not self.buckets:
            return math.nan
        rank = q * total
        below = 0  # observations in the buckets before this one
        i = n = 0
        for i, n in enumerate(self.counts):  # noqa: B007 - i and n are used below
            if n and below + n >= rank:
                break
            below += n
        if i == len(self.buckets):  # the +Inf bucket
            return self.buckets[-1]
        upper = self.buckets[i]
        if i == 0:
            if upper <= 0:
                return upper
            lower = 0.0
        else:
            lower = self.buckets[i - 1]
        if rank >= below + n:  # the bucket's last observation: its bound, exactly
            return upper
        estimate = lower + (upper - lower) * ((rank - below) / n)
        return min(max(estimate, lower), upper)  # rounding stays in the bucket

    def to_json(self) -> dict[str, Any]:
        """JSON-safe: ``{"buckets": [upper bounds], "counts": [per bucket, then one
        more: above the last bound (+Inf)], "sum": float, "count": int}``; a sum that
        is not finite becomes None. `json.dumps` takes it as is."""
        return {
            "buckets": list(self.buckets),
            "counts": list(self.counts),
            "sum": self.sum if math.isfinite(self.sum) else None,
            "count": self.count,
        }


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
