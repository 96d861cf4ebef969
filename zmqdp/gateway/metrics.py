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

With vLLM's names (`vllm_names`: ``--vllm-metric-names``, on with ``serve --vllm``) the
page also has vLLM 0.32's ``vllm:`` families, with its names, types, labels and buckets
(docs/guides/metrics.md lists them, and those left out). The frontend-side ones come
from the gateway's answers, counted once per answer by the rank that served it
(`RankAnswers`); the engine-side ones (queue, prefill and decode time, inter-token
latency, prefix cache, preemptions, tokens per step) from the engines' own reports,
which the vLLM wire decodes only once `watch` gave it an `EngineStats`
(zmqdp/vllm/stats.py): a gateway without vLLM's names pays nothing per token for them.

The collector is registered in the app's own `CollectorRegistry` (several apps in one
process, as in the tests, do not collide). An embedder that serves its own /metrics adds
`app.collector` to its registry: ``prometheus_client.REGISTRY.register(app.collector)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .._core.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    Histogram,
    HistogramSnapshot,
    build_1_2_5_buckets,
)
from ..values import GroupHealth, GroupStatistics, PrefixStatistics, RankState

if TYPE_CHECKING:
    from ..vllm.stats import EngineStats, RankEngineStats

__all__ = ["FINISH_LABELS", "GatewayCollector", "HTTPCounters", "RankAnswers"]

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

_NOT_COUNTERS = {"ranks", "lockstep", "wave", "waiting", "prefix"}


FINISH_LABELS = frozenset({"stop", "length", "abort", "error", "repetition"})
"""The finish reasons counted under their own name (`HTTPCounters.finished`, the
``finished_reason`` label of ``vllm:request_success``): vLLM's, and the gateway's
"abort". Any other finish string an engine sends is counted as ``"other"``: a label
value taken from the engine would let it grow the metric series without bound (one
new series per unique string, kept for the life of the process)."""

TOKEN_BUCKETS: tuple[float, ...] = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
"""Token-count buckets, 1 to 500,000 in 1-2-5 steps (vLLM's `build_1_2_5_buckets`), when
the model's length is not known; vLLM ends them at its `max_model_len`."""

VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM's `FinishReason`s: every engine has a ``vllm:request_success`` series for each
from the start (0 until counted), as in vLLM."""


class RankAnswers:
    """The answers of one rank's requests, as the gateway saw them end (the
    frontend-side half of vLLM's per-engine metrics: the ``engine`` label)."""

    def __init__(self, token_buckets: tuple[float, ...]) -> None:
        self.finished: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        self.max_num_generation_tokens = Histogram(token_buckets)
        self.params_n = Histogram(REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = Histogram(token_buckets)
        self.ttft = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        """Seconds from a request's arrival to its first token."""
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        """Seconds from a request's arrival to its last output."""
        self.time_per_output_token = Histogram(INTER_TOKEN_LATENCY_BUCKETS)


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
        self.token_buckets = TOKEN_BUCKETS
        """The buckets of the per-rank token-count histograms (vLLM's: 1-2-5 up to the
        model's length; set before the first answer)."""
        self.ranks: dict[int, RankAnswers] = {}

    def rank(self, rank: int) -> RankAnswers:
        """One rank's answer counts, made on its first answer (the `engine` label)."""
        answers = self.ranks.get(rank)
        if answers is None:
            answers = self.ranks[rank] = RankAnswers(self.token_buckets)
        return answers

    def observe_answer(
        self,
        finish: str,
        prompt_tokens: int,
        tokens: int,
        first: float,
        last: float,
        *,
        rank: int = 0,
        arrived: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        """One answer that ended (`first`, `last`: when its first and last tokens came;
        `arrived`: when the request did, the same clock; `rank`: where it ran)."""
        label = finish if finish in FINISH_LABELS else "other"
        self.finished[label] += 1
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(tokens)
        tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
        if tokens > 1:
            self.time_per_output_token.observe(tpot)
        r = self.rank(rank)
        r.finished[label] += 1
        r.prompt_tokens += prompt_tokens
        r.generation_tokens += tokens
        r.request_prompt_tokens.observe(prompt_tokens)
        r.request_generation_tokens.observe(tokens)
        r.max_num_generation_tokens.observe(tokens)  # (n is 1: the request's own)
        r.params_n.observe(1)
        if max_tokens:
            r.params_max_tokens.observe(max_tokens)
        r.time_per_output_token.observe(tpot)
        if arrived is not None:
            if tokens:
                r.ttft.observe(first - arrived)
            r.e2e.observe(last - arrived)

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
        self.engine_stats: EngineStats | None = None
        """The engines' own reports (vLLM's wire: `watch`), for the ``vllm:`` series
        only engines know (queue, prefill and decode time, inter-token latency, prefix
        cache, preemptions...)."""
        self._batches = _Monotonic()
        self._protocol_errors = _Monotonic()

    def watch(self, frontend: Any = None, source: Any = None) -> None:
        """Size the ``vllm:`` token histograms from `frontend`'s model length (vLLM's
        buckets end at `max_model_len`), and, for vLLM's wire (`source`: a
        `zmqdp.vllm.dialect(...)`, or a group connected with one), have it count the
        engines' stats. Without ``vllm:`` names it does nothing (the decoder then skips
        the stats: no cost per token)."""
        if self.vllm_names is None:
            return
        length = getattr(frontend, "max_prompt_tokens", None)
        if type(length) is int and length > 0:
            self._http.token_buckets = build_1_2_5_buckets(length)
        wire = getattr(source, "wire", None) or getattr(source, "_wire", None)
        if wire is not None and hasattr(wire, "stats"):
            from ..vllm.stats import EngineStats

            self.engine_stats = wire.stats = EngineStats(length if type(length) is int else None)

    def collect(self) -> Iterator[Metric]:
        yield from self._gateway()
        health = self._health()
        if health is not None:
            yield from self._group_health(health)
        stats = self._stats()
        if stats is not None:
            yield from self._ranks(stats)
            yield from self._counters(stats)
            if stats.prefix is not None:
                yield from self._prefix(stats.prefix)

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
        tpot = HistogramMetricFamily(
            "zmqdp_gateway_time_per_output_token",
            "Per answer of more than one token: seconds from its first token to its last, "
            "over tokens - 1 (as the gateway saw them come).",
            unit="seconds",
        )
        snap = http.time_per_output_token.snapshot()
        tpot.add_metric([], [(_le(bound), float(n)) for bound, n in snap.cumulative()], snap.sum)
        yield tpot

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
        """vLLM 0.32's ``vllm:`` families (`vllm/v1/metrics/loggers.py`), with its names,
        types, labels (``model_name``, ``engine``: the DP rank) and buckets, so that
        vLLM's Grafana dashboards and a mixed fleet's queries read them as vLLM's.
        Frontend-side families come from the gateway's answers (`RankAnswers`);
        engine-side ones from the engines' reports (`engine_stats`), when the wire is
        vLLM's. docs/guides/metrics.md lists the families left out, and why."""
        model = self.vllm_names or ""
        ranks = [r.rank for r in stats.ranks]
        answers = {rank: self._http.rank(rank) for rank in ranks}
        engine = self.engine_stats
        engines = {rank: engine.rank(rank) for rank in ranks} if engine is not None else {}
        labels = ["model_name", "engine"]

        def per_rank(
            family: GaugeMetricFamily | CounterMetricFamily, values: dict[int, float]
        ) -> GaugeMetricFamily | CounterMetricFamily:
            for rank in ranks:
                family.add_metric([model, str(rank)], values[rank])
            return family

        def gauge(name: str, doc: str, values: dict[int, float]) -> Metric:
            return per_rank(GaugeMetricFamily(name, doc, labels=labels), values)

        def counter(name: str, doc: str, values: dict[int, float]) -> Metric:
            return per_rank(CounterMetricFamily(name, doc, labels=labels), values)

        def histogram(name: str, doc: str, values: dict[int, Histogram]) -> Metric:
            family = HistogramMetricFamily(name, doc, labels=labels)
            for rank in ranks:
                snap = values[rank].snapshot()
                buckets = [(_le(bound), float(n)) for bound, n in snap.cumulative()]
                family.add_metric([model, str(rank)], buckets, snap.sum)
            return family

        def by(
            name: str, doc: str, label: str, keys: tuple[str, ...], value: Callable[..., float]
        ) -> Metric:
            family = CounterMetricFamily(name, doc, labels=[*labels, label])
            for rank in ranks:
                for key in keys:
                    family.add_metric([model, str(rank), key], value(rank, key))
            return family

        # scheduler state: the engine's last report (the group's, without engine stats)
        reported = {r.rank: engines[r.rank] for r in stats.ranks if r.rank in engines}
        reported = {rank: e for rank, e in reported.items() if e.reports}
        load = {r.rank: r.load for r in stats.ranks}
        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            {k: reported[k].running if k in reported else load[k].running for k in ranks},
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            {k: reported[k].waiting if k in reported else load[k].waiting for k in ranks},
        )
        waiting_by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting "
            "for scheduling capacity; 'deferred' = deferred by transient constraints "
            "(LoRA budget, KV transfer, blocked status). Sum of all reasons equals "
            "vllm:num_requests_waiting.",
            labels=[*labels, "reason"],
        )
        for rank in ranks:
            e = reported.get(rank)
            deferred = e.deferred if e is not None else 0
            waiting = e.waiting if e is not None else load[rank].waiting
            waiting_by_reason.add_metric([model, str(rank), "capacity"], waiting - deferred)
            waiting_by_reason.add_metric([model, str(rank), "deferred"], deferred)
        yield waiting_by_reason
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means "
            "engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 "
            "means sleep level 2.",
            labels=[*labels, "sleep_state"],
        )
        for rank in ranks:  # (only a frontend puts its engines to sleep: zmqdp never does)
            for state, value in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
                sleep.add_metric([model, str(rank), state], value)
        yield sleep
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            {k: reported[k].kv_cache_usage if k in reported else load[k].kv for k in ranks},
        )

        # frontend-side: the gateway's answers, by the rank that ran them
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for rank in ranks:
            finished = answers[rank].finished
            for reason in (*VLLM_FINISH_REASONS, *sorted(set(finished) - {*VLLM_FINISH_REASONS})):
                success.add_metric([model, str(rank), reason], finished[reason])
        yield success
        if engine is None:
            yield counter(
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                {k: answers[k].prompt_tokens for k in ranks},
            )
            yield counter(
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                {k: answers[k].generation_tokens for k in ranks},
            )
        for name, doc, attribute in (
            (
                "request_prompt_tokens",
                "Number of prefill tokens processed.",
                "request_prompt_tokens",
            ),
            (
                "request_generation_tokens",
                "Number of generation tokens processed.",
                "request_generation_tokens",
            ),
            (
                "request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.",
                "max_num_generation_tokens",
            ),
            ("request_params_n", "Histogram of the n request parameter.", "params_n"),
            (
                "request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                "params_max_tokens",
            ),
            (
                "time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                "ttft",
            ),
            (
                "e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                "e2e",
            ),
        ):
            yield histogram("vllm:" + name, doc, {k: getattr(answers[k], attribute) for k in ranks})
        if engine is None:
            yield histogram(
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                {k: answers[k].time_per_output_token for k in ranks},
            )
            return
        yield from self._vllm_engines(ranks, engines, counter, histogram, by)

    @staticmethod
    def _vllm_engines(
        ranks: list[int],
        engines: dict[int, RankEngineStats],
        counter: Callable[[str, str, dict[int, float]], Metric],
        histogram: Callable[[str, str, dict[int, Histogram]], Metric],
        by: Callable[..., Metric],
    ) -> Iterator[Metric]:
        """The ``vllm:`` families only the engines' reports give (`EngineStats`)."""
        for name, doc, attribute in (
            (
                "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                "prefix_cache_queries",
            ),
            (
                "prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                "prefix_cache_hits",
            ),
            (
                "external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache "
                "sharing, in terms of number of queried tokens.",
                "external_prefix_cache_queries",
            ),
            (
                "external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache "
                "sharing, in terms of number of cached tokens.",
                "external_prefix_cache_hits",
            ),
            (
                "num_preemptions",
                "Cumulative number of preemption from the engine.",
                "preemptions",
            ),
            ("prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
            (
                "prompt_tokens_cached",
                "Number of cached prompt tokens (local + external).",
                "prompt_tokens_cached",
            ),
            (
                "generation_tokens",
                "Number of generation tokens processed.",
                "generation_tokens",
            ),
        ):
            yield counter("vllm:" + name, doc, {k: getattr(engines[k], attribute) for k in ranks})
        from ..vllm.stats import CACHE_SOURCES, PROMPT_SOURCES

        yield by(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            PROMPT_SOURCES,
            lambda rank, key: engines[rank].prompt_tokens_by_source[key],
        )
        yield by(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local "
            "HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM "
            "instance) or external_unspecified. Counted at admission; sums to "
            "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            "source",
            CACHE_SOURCES,
            lambda rank, key: engines[rank].cached_by_source[key],
        )
        for name, doc, attribute in (
            (
                "iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                "iteration_tokens",
            ),
            (
                "inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                "inter_token_latency",
            ),
            (
                "request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                "time_per_output_token",
            ),
            (
                "request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                "queue_time",
            ),
            (
                "request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                "inference_time",
            ),
            (
                "request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                "prefill_time",
            ),
            (
                "request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                "decode_time",
            ),
            (
                "request_num_preemptions",
                "Histogram of the number of times a request was preempted.",
                "num_preemptions",
            ),
            (
                "request_prefill_kv_computed_tokens",
                "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                "prefill_kv_computed",
            ),
        ):
            yield histogram("vllm:" + name, doc, {k: getattr(engines[k], attribute) for k in ranks})

    def _prefix(self, prefix: PrefixStatistics) -> Iterator[Metric]:
        """Prefix affinity (``--routing prefix``): ``zmqdp_prefix_*``."""
        yield CounterMetricFamily(
            "zmqdp_prefix_requests",
            "Requests routed with their prompt's token ids (prefix affinity).",
            prefix.routed,
        )
        yield CounterMetricFamily(
            "zmqdp_prefix_hits",
            "Requests sent to a rank believed to cache a prefix of their prompt.",
            prefix.hits,
        )
        yield CounterMetricFamily(
            "zmqdp_prefix_cached_tokens",
            "Prompt tokens the chosen ranks were believed to cache (predicted; the engines' "
            "own count is vllm:prompt_tokens_cached).",
            prefix.cached_tokens,
        )
        yield CounterMetricFamily(
            "zmqdp_prefix_prompt_tokens",
            "Prompt tokens of the requests routed with token ids.",
            prefix.prompt_tokens,
        )
        blocks = GaugeMetricFamily(
            "zmqdp_prefix_blocks", "Blocks in the prefix index, by rank.", labels=["rank"]
        )
        exact = GaugeMetricFamily(
            "zmqdp_prefix_exact",
            "1 if the rank's KV events are live (exact mode), 0 if approximate.",
            labels=["rank"],
        )
        exact_ranks = set(prefix.exact_ranks)
        for rank, n in enumerate(prefix.rank_blocks):
            blocks.add_metric([str(rank)], n)
            exact.add_metric([str(rank)], 1 if rank in exact_ranks else 0)
        yield blocks
        yield exact
        for name, value in sorted(prefix.kv_events.items()):
            if type(value) is int and name.isidentifier() and name.isascii():
                yield CounterMetricFamily(
                    f"zmqdp_prefix_kv_events_{name.lower()}",
                    f"KV events of the ranks: {name}, summed over the ranks.",
                    value,
                )

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
