"""`GET /metrics`: the group's `statistics()` and `health()`, and the gateway's own HTTP
counters, in the Prometheus text exposition format.

Why a custom collector
----------------------
The group already counts everything (sans-IO counters and histograms, snapshotted by
`statistics()` in one call). Mirroring that into prometheus_client `Counter`/`Gauge`
objects would mean updating them on the request path and keeping two truths. A custom
collector instead reads one snapshot per scrape and renders it, so a scrape costs one
`statistics()` call and the request path costs nothing.

Every per-rank series carries ``rank="<r>"`` (vLLM's DP metrics only ever showed the
last engine until they got an `engine` label; users ask for this first). Group counters
are named after `GroupStatistics` fields; a counter that a later zmqdp adds to
`GroupStatistics` is exported too (``zmqdp_<field>_total``), with a generic help text,
so the exposition never silently lags the library.

The collector is registered in the app's own `CollectorRegistry` (several apps in one
process, as in the tests, do not collide). An embedder that serves its own /metrics adds
`app.collector` to its registry: ``prometheus_client.REGISTRY.register(app.collector)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .._core.metrics import Histogram, HistogramSnapshot
from ..values import GroupHealth, GroupStatistics, RankState

__all__ = ["FINISH_LABELS", "GatewayCollector", "HTTPCounters"]

REQUEST_COUNTERS: dict[str, str] = {
    "submitted": "Requests accepted by submit (their ADD was queued).",
    "finished": "Requests that ended with their terminal output.",
    "truncated": "Requests the engine listed in `finished` without a terminal output.",
    "aborted": "Requests aborted by the client (a closed stream: an HTTP client went away).",
    "failed": "Requests ended because their rank died or the group closed.",
    "rolled_back": "Submits refused because the body could not be encoded or was too large.",
    "protocol_failed": "Requests ended by a malformed entry naming them.",
    "overflowed": "Requests whose consumer fell max_buffered outputs behind.",
    "timed_out": "Requests aborted because their deadline passed.",
    "overloaded": "Submits refused by admission control (HTTP 429).",
}
"""`GroupStatistics` counters of requests: ``zmqdp_requests_<name>_total``."""

GROUP_COUNTERS: dict[str, str] = {
    "protocol_errors": "Messages that were not valid batches (each killed its rank).",
    "malformed_entries": "Malformed entries of otherwise valid batches.",
    "stale_messages": "Messages of a dead incarnation of a rank.",
    "late_outputs": "Entries for requests that had already ended (outputs racing an abort).",
    "unknown_outputs": "Entries naming a wire id the client never issued.",
    "wakes": "WAKE rounds sent to a lockstep group.",
    "stall_wakes": "Extra WAKEs for a stalled lockstep rank.",
    "fallbacks": "Safety-timeout firings of the socket adapter (0 when healthy).",
    "rejected_hellos": "Handshake messages answered with REJECT.",
    "ignored_handshake_messages": "Handshake messages out of turn or invalid.",
    "stale_registers": "REGISTERs of a dead incarnation.",
    "resyncs": "RESYNCs sent to ranks the group waited for.",
    "dropped_answers": "Handshake answers dropped because the peer did not read them.",
    "identity_conflicts": "Ranks that said HELLO again soon after their previous HELLO.",
    "refused_connections": "CURVE: connections refused (key not on the allow-list).",
    "impersonations": "CURVE: messages whose routing id was not their key's rank.",
}
"""Other `GroupStatistics` counters: ``zmqdp_<name>_total``."""

_NOT_COUNTERS = {"ranks", "lockstep", "wave", "waiting"}


FINISH_LABELS = frozenset({"stop", "length", "abort", "error", "repetition"})
"""The finish reasons counted under their own name (`HTTPCounters.finished`, the
``finished_reason`` label of ``vllm:request_success``): vLLM's, and the gateway's
"abort". Any other finish string an engine sends is counted as ``"other"``: a label
value taken from the engine would let it grow the metric series without bound (one
new series per unique string, kept for the life of the process)."""

TOKEN_BUCKETS: tuple[float, ...] = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
"""Token-count buckets, 1 to 500,000 in 1-2-5 steps (vLLM's `build_1_2_5_buckets`)."""


class HTTPCounters:
    """The gateway's own counts, kept as plain ints on the request path."""

    def __init__(self) -> None:
        self.responses: Counter[tuple[str, int]] = Counter()
        """(route, status) -> responses started."""
        self.disconnects: Counter[str] = Counter()
        """route -> requests whose client went away before the response ended."""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.active = 0
        """Completion requests being handled now."""
        self.durations: dict[str, Histogram] = {}
        """route -> seconds from a request's arrival to the end of its response."""
        self.finished: Counter[str] = Counter()
        """finish reason (one of `FINISH_LABELS`, or ``other``) -> requests whose answer
        ended."""
        self.request_prompt_tokens = Histogram(TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram(TOKEN_BUCKETS)
        self.time_per_output_token = Histogram()
        """Per request: seconds from its first token to its last, over tokens - 1."""

    def observe_answer(
        self, finish: str, prompt_tokens: int, tokens: int, first: float, last: float
    ) -> None:
        """One answer that ended (`first`, `last`: when its first and last tokens came)."""
        self.finished[finish if finish in FINISH_LABELS else "other"] += 1
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(tokens)
        if tokens > 1:
            self.time_per_output_token.observe((last - first) / (tokens - 1))

    def observe_duration(self, route: str, seconds: float) -> None:
        """One request's end-to-end seconds on `route` (its histogram made on first use)."""
        histogram = self.durations.get(route)
        if histogram is None:
            histogram = self.durations[route] = Histogram()
        histogram.observe(seconds)


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes it (`+Inf`, `0.005`, `1.0`)."""
    return "+Inf" if bound == math.inf else repr(float(bound))


def _histogram(name: str, doc: str) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=["rank"], unit="seconds")


def _add_histogram(family: HistogramMetricFamily, rank: str, snap: HistogramSnapshot) -> None:
    buckets = [(_le(bound), float(n)) for bound, n in snap.cumulative()]
    family.add_metric([rank], buckets, snap.sum)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _Monotonic:
    """A counter per rank that never goes down, from a count that restarts with each of
    the rank's incarnations (`RankStatistics.batches`): a scrape that finds the count
    lower than the last one adds the last one to the rank's carried total. (A restart
    whose new count has already passed the old one between two scrapes is not seen;
    the series then only undercounts, and stays monotonic.) Prometheus and aiperf read a
    drop as a counter reset and warn."""

    __slots__ = ("_carried", "_last")

    def __init__(self) -> None:
        self._carried: dict[int, int] = {}
        self._last: dict[int, int] = {}

    def total(self, rank: int, count: int) -> int:
        last = self._last.get(rank, 0)
        if count < last:
            self._carried[rank] = self._carried.get(rank, 0) + last
        self._last[rank] = count
        return self._carried.get(rank, 0) + count


class GatewayCollector(Collector):
    """Renders `statistics()`, `health()` and the `HTTPCounters` at every scrape.
    `stats` and `health` return None while there is no group (before startup)."""

    def __init__(
        self,
        stats: Callable[[], GroupStatistics | None],
        health: Callable[[], GroupHealth | None],
        http: HTTPCounters,
    ) -> None:
        self._stats = stats
        self._health = health
        self._http = http
        self.vllm_names: str | None = None
        """A model name: also export the `vllm:` series vLLM's dashboards read."""
        self._batches = _Monotonic()
        self._protocol_errors = _Monotonic()

    def collect(self) -> Iterator[Metric]:
        yield from self._gateway()
        health = self._health()
        if health is not None:
            yield from self._group_health(health)
        stats = self._stats()
        if stats is not None:
            yield from self._ranks(stats)
            yield from self._counters(stats)

    def _gateway(self) -> Iterator[Metric]:
        http = self._http
        responses = CounterMetricFamily(
            "zmqdp_gateway_http_responses",
            "HTTP responses started by the gateway, by route and status.",
            labels=["route", "status"],
        )
        for (route, status), n in sorted(http.responses.items()):
            responses.add_metric([route, str(status)], n)
        yield responses
        disconnects = CounterMetricFamily(
            "zmqdp_gateway_client_disconnects",
            "Requests whose HTTP client went away before the response ended "
            "(a live request is aborted on its rank).",
            labels=["route"],
        )
        for route, n in sorted(http.disconnects.items()):
            disconnects.add_metric([route], n)
        yield disconnects
        yield CounterMetricFamily(
            "zmqdp_gateway_prompt_tokens", "Prompt tokens of served requests.", http.prompt_tokens
        )
        yield CounterMetricFamily(
            "zmqdp_gateway_completion_tokens",
            "Completion tokens sent to clients.",
            http.completion_tokens,
        )
        yield _gauge(
            "zmqdp_gateway_requests_active", "Completion requests being handled.", http.active
        )
        durations = HistogramMetricFamily(
            "zmqdp_gateway_request_duration",
            "Seconds from a completion request's arrival to the end of its response "
            "(end to end, as the client sees it), by route.",
            labels=["route"],
            unit="seconds",
        )
        for route, histogram in sorted(http.durations.items()):
            snap = histogram.snapshot()
            buckets = [(_le(bound), float(n)) for bound, n in snap.cumulative()]
            durations.add_metric([route], buckets, snap.sum)
        yield durations

    def _group_health(self, health: GroupHealth) -> Iterator[Metric]:
        yield _gauge(
            "zmqdp_group_live",
            "1 while the group serves or recovers (not closed for good).",
            health.live,
        )
        yield _gauge("zmqdp_group_ready", "1 when the group takes requests.", health.ready)
        yield _gauge("zmqdp_group_draining", "1 while the group drains.", health.draining)
        yield _gauge("zmqdp_group_ranks_up", "Ranks up.", health.ranks_up)
        yield _gauge("zmqdp_group_size", "Ranks in the group.", health.size)
        yield _gauge("zmqdp_group_inflight", "Live requests.", health.inflight)
        yield _gauge(
            "zmqdp_group_room",
            "Requests the up ranks can still take before admission refuses (+Inf: no cap).",
            math.inf if health.room is None else health.room,
        )

    def _ranks(self, stats: GroupStatistics) -> Iterator[Metric]:
        def family(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["rank"])

        up = family("zmqdp_rank_up", "1 if the rank is up (selectable), 0 if down.")
        inflight = family("zmqdp_rank_inflight", "Requests this client has live on the rank.")
        cap = family("zmqdp_rank_cap", "The rank's in-flight cap (+Inf: no cap).")
        waiting = family("zmqdp_rank_waiting", "Requests waiting on the rank (its last report).")
        running = family("zmqdp_rank_running", "Requests running on the rank (its last report).")
        kv = family(
            "zmqdp_rank_kv_cache_usage_ratio",
            "KV-cache usage, 0 to 1 (its last report; NaN: unknown).",
        )
        queued = family("zmqdp_rank_queued_messages", "Messages waiting to be sent to the rank.")
        batches = CounterMetricFamily(
            "zmqdp_rank_batches",
            "Valid batches received from the rank (every incarnation this gateway saw).",
            labels=["rank"],
        )
        errors = CounterMetricFamily(
            "zmqdp_rank_protocol_errors",
            "The rank's invalid messages and malformed entries (every incarnation).",
            labels=["rank"],
        )
        ttft = _histogram("zmqdp_rank_ttft", "Seconds from submit to the first output, by rank.")
        latency = _histogram(
            "zmqdp_rank_latency",
            "Seconds from submit to the terminal output of finished requests, by rank.",
        )
        for r in stats.ranks:
            label = [str(r.rank)]
            up.add_metric(label, 1.0 if r.state is RankState.UP else 0.0)
            inflight.add_metric(label, r.inflight)
            cap.add_metric(label, math.inf if r.cap is None else r.cap)
            waiting.add_metric(label, r.load.waiting)
            running.add_metric(label, r.load.running)
            kv.add_metric(label, r.load.kv)
            queued.add_metric(label, r.queued)
            batches.add_metric(label, self._batches.total(r.rank, r.batches))
            errors.add_metric(label, self._protocol_errors.total(r.rank, r.protocol_errors))
            _add_histogram(ttft, label[0], r.ttft)
            _add_histogram(latency, label[0], r.latency)
        yield from (up, inflight, cap, waiting, running, kv, queued, batches, errors)
        yield from (ttft, latency)
        if self.vllm_names is not None:
            yield from self._vllm(stats)

    def _vllm(self, stats: GroupStatistics) -> Iterator[Metric]:
        """The names vLLM's own Grafana dashboards read (`vllm:...`, labels
        ``model_name`` and ``engine``: the DP rank), from the same snapshot."""
        model = self.vllm_names or ""
        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        def histogram(name: str, doc: str) -> HistogramMetricFamily:
            return HistogramMetricFamily(name, doc, labels=labels)

        running = gauge("vllm:num_requests_running", "Requests running (the engine's report).")
        waiting = gauge("vllm:num_requests_waiting", "Requests waiting (the engine's report).")
        kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1 (the engine's report).")
        ttft = histogram("vllm:time_to_first_token_seconds", "Seconds to the first token.")
        e2e = histogram("vllm:e2e_request_latency_seconds", "Seconds from submit to the end.")
        for r in stats.ranks:
            label = [model, str(r.rank)]
            running.add_metric(label, r.load.running)
            waiting.add_metric(label, r.load.waiting)
            kv.add_metric(label, r.load.kv)
            for family, snap in ((ttft, r.ttft), (e2e, r.latency)):
                buckets = [(_le(bound), float(n)) for bound, n in snap.cumulative()]
                family.add_metric(label, buckets, snap.sum)
        yield from (running, waiting, kv, ttft, e2e)
        http = self._http
        success = CounterMetricFamily(
            "vllm:request_success",
            "Requests whose answer ended, by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, n in sorted(http.finished.items()):
            success.add_metric([model, reason], n)
        yield success
        for name, doc, hist in (
            (
                "vllm:request_prompt_tokens",
                "Prompt tokens per request.",
                http.request_prompt_tokens,
            ),
            (
                "vllm:request_generation_tokens",
                "Generated tokens per request.",
                http.request_generation_tokens,
            ),
            (
                "vllm:request_time_per_output_token_seconds",
                "Per request: seconds from the first token to the last, over tokens - 1.",
                http.time_per_output_token,
            ),
        ):
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            snap = hist.snapshot()
            buckets = [(_le(bound), float(n)) for bound, n in snap.cumulative()]
            family.add_metric([model], buckets, snap.sum)
            yield family
        for name, doc, value in (
            ("vllm:prompt_tokens", "Prompt tokens processed.", http.prompt_tokens),
            ("vllm:generation_tokens", "Generation tokens processed.", http.completion_tokens),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([model], value)
            yield counter

    def _counters(self, stats: GroupStatistics) -> Iterator[Metric]:
        yield _gauge("zmqdp_group_lockstep", "1 for a lockstep group.", stats.lockstep)
        if stats.wave is not None:
            yield _gauge("zmqdp_group_wave", "The wave clock (lockstep groups).", stats.wave)
        yield _gauge("zmqdp_group_waiting", "Requests waiting for admission room.", stats.waiting)
        for field in dataclasses.fields(stats):
            name = field.name
            value = getattr(stats, name)
            if name in _NOT_COUNTERS or type(value) is not int:
                continue
            if name in REQUEST_COUNTERS:
                yield CounterMetricFamily(f"zmqdp_requests_{name}", REQUEST_COUNTERS[name], value)
            else:
                doc = GROUP_COUNTERS.get(name, f"GroupStatistics.{name}.")
                yield CounterMetricFamily(f"zmqdp_{name}", doc, value)
