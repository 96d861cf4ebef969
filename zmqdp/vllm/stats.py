"""What vLLM engines report about their work, accumulated as vLLM's frontend does, for
the gateway's ``vllm:`` metrics. Sans-IO: fed decoded `EngineCoreOutputs`, read by the
collector at each scrape.

Theory of operation
-------------------
A vLLM engine with stats logging on (``vllm serve``'s default, headless too) sends in
every step's `EngineCoreOutputs` its `SchedulerStats` (queue lengths, KV usage, prefix
cache queries and hits of that step) and a monotonic `timestamp`, and in a request's
outputs the request's `events` (QUEUED, SCHEDULED, PREEMPTED, each with the engine's
monotonic time) and, in its first output, its `prefill_stats`. vLLM's frontend turns
these into its metrics (`vllm/v1/metrics/stats.py`, `IterationStats`); `EngineStats`
does the same arithmetic on the same fields:

* per step: generation tokens (new token ids), prompt tokens by source (from
  `prefill_stats`), tokens of the step (`iteration_tokens_total`: computed prompt tokens
  plus new tokens), preemptions, prefix cache queries and hits;
* per output of a request but its first: the inter-token latency, the step's timestamp
  minus that of the request's previous output;
* per finished request: queue (QUEUED to first SCHEDULED), prefill (SCHEDULED to first
  token), decode (first token to last), inference (SCHEDULED to last) and mean time
  per output token, its preemptions, and its prompt tokens computed (not cached).

Only engine clocks are subtracted from engine clocks, and an interval is never
negative nor NaN (a clock gone back counts 0; a timestamp that is not a finite number
is ignored): a histogram's sum is a counter to Prometheus. The frontend-side series
(time to first token, end to end, request counts by finish reason) are the gateway's own
(`zmqdp.gateway.metrics`). The decoder feeds an `EngineStats` only if the wire has one
(`VllmWire.stats`), so a group without metrics pays nothing per token. A request's state
is made when its ADD is sent and dropped when it finishes or is aborted (the outputs of
a request it does not know, as those of an aborted one, are not counted, as in vLLM); a
rank that dies leaves its requests' states, so at most `MAX_TRACKED` are kept (the
oldest go first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .._core.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    Histogram,
    build_1_2_5_buckets,
)

__all__ = ["CACHE_SOURCES", "MAX_TRACKED", "PROMPT_SOURCES", "EngineStats", "RankEngineStats"]

CACHE_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
"""vLLM's `CacheHitSource`: the ``source`` label of
``vllm:prompt_tokens_cached_by_source``."""

MAX_TRACKED = 1 << 16
"""Requests whose engine-side state is kept at most (a bound for ranks that died)."""

PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""vLLM's `PromptTokenStats.ALL_SOURCES`: the ``source`` label of
``vllm:prompt_tokens_by_source``."""

_QUEUED, _SCHEDULED, _PREEMPTED = 1, 2, 3


class _Request:
    __slots__ = (
        "first",
        "last",
        "outputs",
        "preemptions",
        "prompt",
        "queued",
        "scheduled",
        "tokens",
    )

    def __init__(self) -> None:
        self.queued = self.scheduled = self.first = self.last = 0.0
        self.preemptions = 0
        self.prompt = -1
        """Prompt tokens computed (not cached), from `prefill_stats`; -1: unknown."""
        self.outputs = self.tokens = 0
        """Outputs and tokens so far."""


class RankEngineStats:
    """One rank's counts since the gateway started (they never go down: a restarted
    engine's reports add to them)."""

    def __init__(self, token_buckets: tuple[float, ...]) -> None:
        self.reports = 0
        """Scheduler reports seen (0: the engine sends no stats)."""
        self.clock = 0.0
        """The engine's last valid step timestamp (one that is not a finite number
        stands for this one: no interval is made of junk)."""
        self.running = self.waiting = self.deferred = 0
        self.kv_cache_usage = 0.0
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.external_prefix_cache_queries = self.external_prefix_cache_hits = 0
        self.cached_by_source = dict.fromkeys(CACHE_SOURCES, 0)
        """Prefix-cache hit tokens by tier: ``device`` the engine's own cache, the
        others from a KV connector's report."""
        self.preemptions = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.prompt_tokens_by_source = dict.fromkeys(PROMPT_SOURCES, 0)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.inter_token_latency = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.num_preemptions = Histogram(REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.prefill_kv_computed = Histogram(token_buckets)


def _span(start: float, end: float) -> float:
    """`end - start`, or 0.0 where an engine's clock went back: a histogram's sum is a
    counter to Prometheus, and a negative observation would make it go down."""
    span = end - start
    return span if span > 0 else 0.0


def _int(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


class EngineStats:
    """The engine-side half of vLLM's metrics, per rank (module docstring).
    `max_model_len` sets the token-count buckets, as vLLM's (1-2-5 up to it)."""

    def __init__(self, max_model_len: int | None = None) -> None:
        self.token_buckets = build_1_2_5_buckets(max_model_len or 500_000)
        self.ranks: dict[int, RankEngineStats] = {}
        self._requests: dict[str, _Request] = {}

    def rank(self, rank: int) -> RankEngineStats:
        """One rank's engine-side stats, made on its first report (the `engine` label)."""
        stats = self.ranks.get(rank)
        if stats is None:
            stats = self.ranks[rank] = RankEngineStats(self.token_buckets)
        return stats

    def add(self, request_id: str) -> None:
        """A request sent to an engine: its outputs are counted from now on (as vLLM's
        frontend, the outputs of a request it does not know are not counted)."""
        requests = self._requests
        if len(requests) >= MAX_TRACKED:
            del requests[next(iter(requests))]
        requests[request_id] = _Request()

    def forget(self, request_ids: Sequence[str]) -> None:
        """Requests aborted by the client: their later outputs are not theirs to count."""
        for rid in request_ids:
            self._requests.pop(rid, None)

    def step(self, rank: int, timestamp: Any, outputs: Sequence[Any], scheduler_stats: Any) -> None:
        """One `EngineCoreOutputs` of `rank`: its `timestamp`, its `outputs` (each with
        `request_id`, `new_token_ids`, `finish_reason`, `events`, `prefill_stats`) and
        its `scheduler_stats` (a map or None). Values of the wrong type count as absent:
        stats never fail a message."""
        r = self.rank(rank)
        if type(scheduler_stats) is dict:
            self._scheduler(r, scheduler_stats)
        if not outputs:
            return
        now = (
            float(timestamp)
            if type(timestamp) in (int, float) and math.isfinite(timestamp)
            else r.clock
        )
        r.clock = now
        requests = self._requests
        itl = r.inter_token_latency.observe
        new_tokens = computed = 0
        for o in outputs:
            rid = o.request_id
            state = requests.get(rid)
            if state is None:
                continue  # aborted, or sent before the stats were kept
            n = len(o.new_token_ids)
            new_tokens += n
            if o.events is not None:
                self._events(r, state, o.events)
            if o.prefill_stats is not None:
                computed += self._prefill(r, state, o.prefill_stats)
            if state.outputs:  # (vLLM's `is_prefilling` is "no output yet")
                gap = now - state.last
                itl(gap if gap > 0 else 0.0)  # (a clock gone back: a sum never goes down)
            else:
                state.first = now
            state.last = now
            state.outputs += 1
            state.tokens += n
            if o.finish_reason is not None:
                del requests[rid]
                self._finished(r, state)
        r.generation_tokens += new_tokens
        r.iteration_tokens.observe(computed + new_tokens)

    @staticmethod
    def _scheduler(r: RankEngineStats, s: dict[str, Any]) -> None:
        r.reports += 1
        r.running = _int(s.get("num_running_reqs"))
        r.deferred = _int(s.get("num_skipped_waiting_reqs"))
        r.waiting = _int(s.get("num_waiting_reqs")) + r.deferred
        kv = s.get("kv_cache_usage")
        r.kv_cache_usage = float(kv) if isinstance(kv, int | float) else 0.0
        prefix = s.get("prefix_cache_stats")
        if type(prefix) is dict:
            r.prefix_cache_queries += _int(prefix.get("queries"))
            hits = _int(prefix.get("hits"))
            r.prefix_cache_hits += hits
            r.cached_by_source["device"] += hits
        connector = s.get("connector_prefix_cache_stats")
        if type(connector) is dict:
            r.external_prefix_cache_queries += _int(connector.get("queries"))
            r.external_prefix_cache_hits += _int(connector.get("hits"))
            by_source = connector.get("hits_by_source")
            if type(by_source) is dict:
                for tier, n in by_source.items():
                    if tier in r.cached_by_source:  # (a fixed set: no unbounded labels)
                        r.cached_by_source[tier] += _int(n)

    @staticmethod
    def _events(r: RankEngineStats, state: _Request, events: Any) -> None:
        if type(events) is not list:
            return
        for event in events:
            if type(event) is not dict:
                continue
            kind, ts = event.get("type"), event.get("timestamp")
            if not isinstance(ts, int | float) or not math.isfinite(ts):
                continue
            if kind == _QUEUED:
                state.queued = ts
            elif kind == _SCHEDULED:
                if not state.scheduled:  # the first: later ones are resumptions
                    state.scheduled = ts
            elif kind == _PREEMPTED:
                state.preemptions += 1
                r.preemptions += 1

    @staticmethod
    def _prefill(r: RankEngineStats, state: _Request, p: Any) -> int:
        """Count one `PrefillStats` map; the prompt tokens it computed."""
        if type(p) is not dict:
            return 0
        total, computed = _int(p.get("num_prompt_tokens")), _int(p.get("num_computed_tokens"))
        local, external = (
            _int(p.get("num_local_cached_tokens")),
            _int(p.get("num_external_cached_tokens")),
        )
        r.prompt_tokens += total
        r.prompt_tokens_cached += _int(p.get("num_cached_tokens"))
        by_source = r.prompt_tokens_by_source
        by_source["local_compute"] += computed
        by_source["local_cache_hit"] += local
        by_source["external_kv_transfer"] += external
        state.prompt = total - _int(p.get("num_cached_tokens"))
        return computed

    @staticmethod
    def _finished(r: RankEngineStats, s: _Request) -> None:
        """vLLM's `update_from_finished_request`: intervals between engine clocks."""
        r.queue_time.observe(_span(s.queued, s.scheduled))
        r.prefill_time.observe(_span(s.scheduled, s.first))
        decode = _span(s.first, s.last)
        r.decode_time.observe(decode)
        r.inference_time.observe(_span(s.scheduled, s.last))
        r.time_per_output_token.observe(decode / (s.tokens - 1) if s.tokens > 1 else 0.0)
        r.num_preemptions.observe(s.preemptions)
        if s.prompt >= 0:
            r.prefill_kv_computed.observe(s.prompt)
