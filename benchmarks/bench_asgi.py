"""The asyncio flavour's HTTP servers against each other (issue 34, A rows): ``zmqdp serve
--server uvicorn`` on its pure-Python parser (``--http h11``) and on httptools (``--http
httptools``, the default once installed), and the same app on granian (Rust, hyper; its
ASGI interface on uvloop, with trio as a guest of granian's loop as on uvicorn).

    .venv/bin/python benchmarks/bench_asgi.py [--rounds 3] [--window 2] [--step-time 0.005]
        [--servers h11,httptools,granian] [--quick]

Each server runs in front of a fake vLLM engine group of its own, with bench_gateway.py's
S-row machinery (_smg.py's `Stack`, `smg_rounds`: every stack up for the whole run,
rounds rotating the stacks' order, c=32 and c=256, SSE and non-streaming JSON, the same
load generator and 64-token request, `--step-time` the fakes' step). A server's CPU is
that of every one of its processes (granian runs its worker in a child process).
Figures: tokens/s, CPU µs per token and CPU µs per HTTP write (per SSE chunk, or per
JSON answer), each ÷ uvicorn on h11; granian also ÷ uvicorn on httptools.

granian is not a dependency of zmqdp: the granian stack runs only where ``python -m
granian`` imports (``pip install granian``, or a ``--target`` directory on PYTHONPATH).
Its bounds as run here: a request head of at most 16 KiB (``--http1-buffer-size
16384``: 431), at most 100 headers (hyper's own), 5 s to send a head from the
connection's start or its last response (``--http1-header-read-timeout 5000``);
granian has no bound on open connections and no hook to add one in Python (its accept
loop is Rust), which `zmqdp serve` needs (`zmqdp.gateway.connections`).

Not in run_all.py (it needs granian); its rows are saved as ``asgi`` all the same.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import Any

import _smg
from _harness import Row, save
from bench_gateway import TOKENS, paired_results, print_paired, smg_rounds

SERVERS = ("h11", "httptools", "granian")
BASE = "h11"


def per_write(f: dict[str, float]) -> float:
    """CPU µs per HTTP write: per SSE chunk, or per JSON answer."""
    return f["cpu_us"] * f["tok_write"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short round, SSE only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=2.0, help="seconds counted a round")
    parser.add_argument("--settle", type=float, default=0.5, help="s after the stagger")
    parser.add_argument("--step-time", type=float, default=0.005, help="fakes: s per step")
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--no-json", action="store_true", help="SSE only")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.window = 1, 1.0
    args.smg_step_time = args.step_time  # smg_rounds' name for it
    kinds = args.servers.split(",")
    if "granian" in kinds and importlib.util.find_spec("granian") is None:
        print("granian skipped: not importable (pip install granian)")
        kinds.remove("granian")
    if BASE not in kinds:
        kinds.insert(0, BASE)
    conc = [32, 256]
    modes = ["sse"] + ([] if args.no_json or args.quick else ["json"])
    engines = (
        f"fake vLLM 0.33 engines: {_smg.RANKS} dense ranks in one process per server, step "
        f"{1e3 * args.step_time:g} ms + its own time, {TOKENS}-token completions"
    )
    print(f"asyncio servers: {', '.join(kinds)}; {engines}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="zmqdp-asgi-model-"))
    stacks: dict[str, Any] = {}
    try:
        model = _smg.model_dir(tmp)
        _smg.check_tokens(model)
        for kind in kinds:  # all up at once; the idle ones cost next to nothing
            stacks[kind] = _smg.Stack(kind, model, args.step_time, None)
        for stack in stacks.values():
            stack.wait_ready()
        runs = smg_rounds(args, stacks, conc, modes)
    finally:
        for stack in stacks.values():
            stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results = paired_results(runs, conc, modes)
    print_paired(
        results,
        stacks,
        BASE,
        conc,
        modes,
        f"\n{engines}; medians of {args.rounds} round(s) of {args.window:g} s",
        {},
        "each server ÷ uvicorn on h11 (tokens/s; CPU µs per token of all its processes)",
    )
    print("\nCPU µs per HTTP write (SSE chunk or JSON answer), and ÷ h11:")
    for c in conc:
        for mode in modes:
            base = per_write(results[BASE][c][mode])
            each = {k: per_write(results[k][c][mode]) for k in kinds}
            cells = [f"{k} {us:6.1f} ({us / base:.2f})" for k, us in each.items()]
            print(f"  c={c:3} {mode:4}: " + "; ".join(cells))
    rows = []
    for kind in kinds:
        if kind == BASE:
            continue
        for c in conc:
            for mode in modes:
                f, b = results[kind][c][mode], results[BASE][c][mode]
                also = ""
                if kind == "granian" and "httptools" in results:
                    h = results["httptools"][c][mode]
                    also = (
                        f"; ÷ httptools: tokens/s {f['tok_s'] / h['tok_s']:.2f}, CPU/token "
                        f"{f['cpu_us'] / h['cpu_us']:.2f}"
                    )
                rows.append(
                    Row(
                        f"A{c}{mode[0]}{kind[:2]}",
                        f"{_smg.Stack.NAMES[kind]} ÷ uvicorn on h11, CPU µs per token, "
                        f"{'SSE' if mode == 'sse' else 'JSON'}, c={c} (context)",
                        f["cpu_us"] / b["cpu_us"],
                        "",
                        f"{f['cpu_us']:.1f} vs {b['cpu_us']:.1f} µs/token, "
                        f"{per_write(f):.1f} vs {per_write(b):.1f} µs/write "
                        f"({f['tok_write']:.2f} vs {b['tok_write']:.2f} tokens/write), "
                        f"{f['tok_s']:,.0f} vs {b['tok_s']:,.0f} tok/s{also}; {engines}"
                        + ("; DISTURBED" if min(f["rounds"], b["rounds"]) < 0 else ""),
                    )
                )
    save(
        "asgi",
        rows,
        {
            "servers": {k: _smg.Stack.NAMES[k] for k in stacks},
            "results": {k: {str(c): v for c, v in r.items()} for k, r in results.items()},
        },
    )


if __name__ == "__main__":
    main()
