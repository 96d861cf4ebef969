"""Write docs/grafana/zmqdp-gateway.json, the Grafana dashboard of the gateway's native
(``zmqdp_``) series, with Grafana's own Python SDK (`grafana-foundation-sdk`, generated
from Grafana's dashboard schema, so what it builds is a dashboard Grafana's schema
accepts):

    python -m venv /tmp/gf && /tmp/gf/bin/pip install grafana-foundation-sdk
    /tmp/gf/bin/python tools/grafana_dashboard.py [OUT.json]

The SDK is needed only here, not by zmqdp or its tests: tests/test_grafana_dashboard.py
checks the committed file (its structure, and that every query names only series the
gateway exports) and, when the SDK is installed, that building it again gives the same
file. Panels: group health, per-rank load, tokens/s, latency quantiles (time to first
token, time per output token, end to end), errors, queues.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef

OUT = Path(__file__).resolve().parents[1] / "docs/grafana/zmqdp-gateway.json"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'job=~"$job", instance=~"$instance"'
"""Every query's selector: the dashboard's job and instance variables."""
RATE = "$__rate_interval"


def q(expr: str, legend: str, ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref)


def series(
    title: str, unit: str, *queries: tuple[str, str], description: str = "", width: int = 12
) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DS).height(8).span(width)
    if description:
        panel = panel.description(description)
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(q(expr, legend, chr(ord("A") + i)))
    return panel


def quantiles(title: str, metric: str, description: str) -> timeseries.Panel:
    """p50, p90 and p99 of a histogram over every rank."""
    return series(
        title,
        "s",
        *(
            (
                f"histogram_quantile({p}, sum by (le) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
                f"p{round(p * 100)}",
            )
            for p in (0.5, 0.9, 0.99)
        ),
        description=description,
        width=8,
    )


def single(title: str, expr: str, unit: str = "none", description: str = "") -> stat.Panel:
    panel = stat.Panel().title(title).unit(unit).datasource(DS).height(4).span(4)
    if description:
        panel = panel.description(description)
    return panel.with_target(q(expr, title))


def build() -> dashboard.Dashboard:
    d = (
        dashboard.Dashboard("zmqdp gateway")
        .uid("zmqdp-gateway")
        .description(
            "The zmqdp gateway's native series (zmqdp_*): health, per-rank load, tokens/s, "
            "latency, errors and queues. With --vllm-metric-names (the default of "
            "serve --vllm) vLLM's own dashboards read its vllm:* series too."
        )
        .tags(["zmqdp", "llm"])
        .refresh("10s")
        .time("now-1h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(
            dashboard.QueryVariable("job")
            .label("Job")
            .datasource(DS)
            .query("label_values(zmqdp_group_size, job)")
            .include_all(True)
            .all_value(".*")
            .multi(True)
        )
        .with_variable(
            dashboard.QueryVariable("instance")
            .label("Gateway")
            .datasource(DS)
            .query('label_values(zmqdp_group_size{job=~"$job"}, instance)')
            .include_all(True)
            .all_value(".*")
            .multi(True)
        )
    )
    d = (
        d.with_row(dashboard.Row("Health"))
        .with_panel(
            single("Ready", f"min(zmqdp_group_ready{{{SEL}}})", description="1: takes requests.")
        )
        .with_panel(single("Ranks up", f"sum(zmqdp_group_ranks_up{{{SEL}}})"))
        .with_panel(single("Ranks", f"sum(zmqdp_group_size{{{SEL}}})"))
        .with_panel(single("Live requests", f"sum(zmqdp_group_inflight{{{SEL}}})"))
        .with_panel(
            single(
                "Room",
                f"sum(zmqdp_group_room{{{SEL}}})",
                description="Requests the up ranks can still take (+Inf: no cap).",
            )
        )
        .with_panel(single("Draining", f"max(zmqdp_group_draining{{{SEL}}})"))
        .with_panel(
            statetimeline.Panel()
            .title("Rank up")
            .description("1: up (selectable); 0: down (dead, restarting, or not yet joined).")
            .datasource(DS)
            .height(6)
            .span(12)
            .with_target(q(f"max by (rank) (zmqdp_rank_up{{{SEL}}})", "rank {{rank}}"))
        )
        .with_panel(
            series(
                "Rank deaths and requests they failed",
                "short",
                (
                    f"sum by (rank) (changes(zmqdp_rank_up{{{SEL}}}[{RATE}]))",
                    "rank {{rank}} up/down changes",
                ),
                (f"sum(rate(zmqdp_requests_failed_total{{{SEL}}}[{RATE}]))", "requests failed /s"),
                description="A rank that dies fails its live requests; a restarted rank "
                "comes back up.",
            )
        )
    )
    d = (
        d.with_row(dashboard.Row("Per-rank load"))
        .with_panel(
            series(
                "Live requests by rank",
                "short",
                (f"sum by (rank) (zmqdp_rank_inflight{{{SEL}}})", "rank {{rank}}"),
                description="Requests this gateway has live on each rank.",
                width=8,
            )
        )
        .with_panel(
            series(
                "Running and waiting, by rank (the engines' reports)",
                "short",
                (f"sum by (rank) (zmqdp_rank_running{{{SEL}}})", "running, rank {{rank}}"),
                (f"sum by (rank) (zmqdp_rank_waiting{{{SEL}}})", "waiting, rank {{rank}}"),
                width=8,
            )
        )
        .with_panel(
            series(
                "KV-cache usage by rank",
                "percentunit",
                (f"max by (rank) (zmqdp_rank_kv_cache_usage_ratio{{{SEL}}})", "rank {{rank}}"),
                width=8,
            )
        )
    )
    d = (
        d.with_row(dashboard.Row("Throughput"))
        .with_panel(
            series(
                "Tokens per second",
                "short",
                (f"sum(rate(zmqdp_gateway_completion_tokens_total{{{SEL}}}[{RATE}]))", "generated"),
                (f"sum(rate(zmqdp_gateway_prompt_tokens_total{{{SEL}}}[{RATE}]))", "prompt"),
            )
        )
        .with_panel(
            series(
                "Requests per second, by how they ended",
                "reqps",
                (f"sum(rate(zmqdp_requests_finished_total{{{SEL}}}[{RATE}]))", "finished"),
                (
                    f"sum(rate(zmqdp_requests_aborted_total{{{SEL}}}[{RATE}]))",
                    "aborted by the client",
                ),
                (f"sum(rate(zmqdp_requests_submitted_total{{{SEL}}}[{RATE}]))", "submitted"),
            )
        )
        .with_panel(
            series(
                "Engine batches per second, by rank",
                "short",
                (
                    f"sum by (rank) (rate(zmqdp_rank_batches_total{{{SEL}}}[{RATE}]))",
                    "rank {{rank}}",
                ),
            )
        )
        .with_panel(
            series(
                "Gateway CPU",
                "percentunit",
                (
                    f"sum by (instance) (rate(process_cpu_seconds_total{{{SEL}}}[{RATE}]))",
                    "{{instance}}",
                ),
                description="The gateway process's CPU: 1 is one core.",
            )
        )
    )
    d = (
        d.with_row(dashboard.Row("Latency"))
        .with_panel(
            quantiles(
                "Time to first token",
                "zmqdp_rank_ttft_seconds",
                "Seconds from submit to a request's first output, every rank.",
            )
        )
        .with_panel(
            quantiles(
                "Time per output token",
                "zmqdp_gateway_time_per_output_token_seconds",
                "Per request: seconds from its first token to its last, over tokens - 1.",
            )
        )
        .with_panel(
            quantiles(
                "End to end",
                "zmqdp_rank_latency_seconds",
                "Seconds from submit to a finished request's last output, every rank.",
            )
        )
        .with_panel(
            series(
                "Time to first token p99, by rank",
                "s",
                (
                    "histogram_quantile(0.99, sum by (le, rank) "
                    f"(rate(zmqdp_rank_ttft_seconds_bucket{{{SEL}}}[{RATE}])))",
                    "rank {{rank}}",
                ),
            )
        )
        .with_panel(
            series(
                "HTTP request duration p99, by route",
                "s",
                (
                    "histogram_quantile(0.99, sum by (le, route) "
                    f"(rate(zmqdp_gateway_request_duration_seconds_bucket{{{SEL}}}[{RATE}])))",
                    "{{route}}",
                ),
                description="Arrival to the end of the response, as the client sees it.",
            )
        )
    )
    d = (
        d.with_row(dashboard.Row("Errors"))
        .with_panel(
            series(
                "HTTP responses by status",
                "reqps",
                (
                    f"sum by (status) (rate(zmqdp_gateway_http_responses_total{{{SEL}}}[{RATE}]))",
                    "{{status}}",
                ),
            )
        )
        .with_panel(
            series(
                "Requests that did not finish",
                "reqps",
                (f"sum(rate(zmqdp_requests_failed_total{{{SEL}}}[{RATE}]))", "failed (rank died)"),
                (f"sum(rate(zmqdp_requests_timed_out_total{{{SEL}}}[{RATE}]))", "timed out"),
                (
                    f"sum(rate(zmqdp_requests_overloaded_total{{{SEL}}}[{RATE}]))",
                    "refused: no room (429)",
                ),
                (f"sum(rate(zmqdp_requests_overflowed_total{{{SEL}}}[{RATE}]))", "client too slow"),
                (
                    f"sum(rate(zmqdp_requests_protocol_failed_total{{{SEL}}}[{RATE}]))",
                    "malformed output",
                ),
                (
                    f"sum(rate(zmqdp_gateway_client_disconnects_total{{{SEL}}}[{RATE}]))",
                    "client went away",
                ),
            )
        )
        .with_panel(
            series(
                "Protocol errors by rank",
                "short",
                (
                    f"sum by (rank) (increase(zmqdp_rank_protocol_errors_total{{{SEL}}}[{RATE}]))",
                    "rank {{rank}}",
                ),
                description="Invalid messages and malformed entries a rank sent.",
            )
        )
    )
    d = (
        d.with_row(dashboard.Row("Queues"))
        .with_panel(
            series(
                "Waiting for admission",
                "short",
                (f"sum(zmqdp_group_waiting{{{SEL}}})", "requests"),
                description="Requests waiting for room on a rank (queue_timeout).",
                width=8,
            )
        )
        .with_panel(
            series(
                "Waiting on the engines, by rank",
                "short",
                (f"sum by (rank) (zmqdp_rank_waiting{{{SEL}}})", "rank {{rank}}"),
                width=8,
            )
        )
        .with_panel(
            series(
                "Messages queued to send, by rank",
                "short",
                (f"sum by (rank) (zmqdp_rank_queued_messages{{{SEL}}})", "rank {{rank}}"),
                width=8,
            )
        )
    )
    return d


def _pruned(value: object) -> object:
    """Without null values (the SDK writes ``"options": null`` for a panel given none;
    Grafana then fills in its defaults, as for a missing key)."""
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def render() -> str:
    plain = json.loads(json.dumps(build().build(), cls=JSONEncoder))
    return json.dumps(_pruned(plain), indent=2, sort_keys=True) + "\n"


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
