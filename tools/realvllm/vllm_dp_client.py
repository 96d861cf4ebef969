"""vLLM's own data-parallel client against headless engine cores (real or fake).

Run with the vLLM venv's python:

    .venv-vllm/bin/python tools/realvllm/vllm_dp_client.py --port P --engines 2 \\
        [--moe] --requests N --model DIR

It builds `DPLBAsyncMPClient` the way ``vllm serve DIR --data-parallel-size N
--data-parallel-size-local 0 --data-parallel-address 127.0.0.1
--data-parallel-rpc-port P`` does (a `VllmConfig` from the same engine arguments, passed
to `EngineCoreClient.make_async_mp_client` on uvloop, `freeze_gc_heap()` after start-up):
it binds the handshake ROUTER at ``tcp://127.0.0.1:P``, spawns vLLM's
`DPCoordinatorProc` and waits until all N engines did HELLO, init and READY and sent
their `EngineCoreReadyResponse` (vLLM's typed decode: a missing field fails the build).
Then it sends N `EngineCoreRequest`s per round (prompt token ids, greedy sampling, a
few tokens; every third pinned with ``data_parallel_rank``, the others load-balanced by
the client), reads the outputs with one output task (`get_output_async()`, AsyncLLM's
pattern, no detokenization), and prints JSON lines on stdout:

* ``{"event": "config", "parallel_config_hash": ..., ...}`` before the client is built
  (a MoE frontend checks every engine's READY against that hash; fake engines need it);
* ``{"event": "ready", "build_s": ...}`` once the client is up;
* ``{"event": "result", "ok": ..., "requests": {...}, "ranks": {...}, ...}`` at the
  end: per request its tokens, finish reason and serving rank; per rank the requests it
  served; the round times; what the client still counts in flight (its
  `reqs_in_flight`, freed only by the engines' ``finished_requests``).

Exit status 0 only if every request finished (a finish reason) in time and the
client's in-flight accounting is empty again; 1 otherwise; 2 if the client could not
be built (the error is in the result line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from typing import Any

ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, sort_keys=True), flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True, help="--data-parallel-rpc-port")
    p.add_argument("--engines", type=int, default=2, help="--data-parallel-size")
    p.add_argument("--moe", action="store_true", help="the model is MoE (expert parallel)")
    p.add_argument("--requests", type=int, default=8, help="requests per round")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--model", required=True, help="model directory (config + tokenizer)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120.0, help="per round, seconds")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    engine_args = AsyncEngineArgs(
        model=args.model,
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        data_parallel_size=args.engines,
        data_parallel_size_local=0,
        data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=args.port,
        enable_expert_parallel=args.moe,
    )
    return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


async def run(args: argparse.Namespace, import_s: float) -> int:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.executor.abstract import Executor

    vllm_config = build_config(args)
    pc = vllm_config.parallel_config
    emit(
        {
            "event": "config",
            "parallel_config_hash": pc.compute_hash(),
            "is_moe": vllm_config.model_config.is_moe,
            "data_parallel_size": pc.data_parallel_size,
            "handshake": f"tcp://127.0.0.1:{args.port}",
            "import_s": round(import_s, 2),
        }
    )
    t0 = time.monotonic()
    try:
        client = EngineCoreClient.make_async_mp_client(
            vllm_config, Executor.get_class(vllm_config), log_stats=True
        )
    except Exception as exc:
        emit(
            {
                "event": "result",
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        )
        return 2
    build_s = time.monotonic() - t0
    freeze_gc_heap()
    emit({"event": "ready", "build_s": round(build_s, 2), "client": type(client).__name__})

    results: dict[str, dict[str, Any]] = {}
    rounds: list[float] = []
    errors: list[str] = []
    n = args.engines
    try:
        for round_ in range(args.rounds):
            pending: set[str] = set()
            done = asyncio.Event()

            async def outputs(pending: set[str] = pending, done: asyncio.Event = done) -> None:
                while pending:
                    out = await client.get_output_async()
                    for o in out.outputs:
                        r = results.get(o.request_id)
                        if r is None:
                            errors.append(f"an output for unknown request {o.request_id!r}")
                            continue
                        r["tokens"] += list(o.new_token_ids)
                        r["rank"] = out.engine_index
                        if o.finish_reason is not None:
                            r["finish"] = str(o.finish_reason)
                            pending.discard(o.request_id)
                done.set()

            t1 = time.monotonic()
            for i in range(args.requests):
                rid = f"r{round_}-{i}"
                pin = (i // 3) % n if i % 3 == 0 else None
                results[rid] = {"tokens": [], "finish": None, "pinned": pin, "rank": None}
                pending.add(rid)
            reader = asyncio.create_task(outputs())
            for i in range(args.requests):
                rid = f"r{round_}-{i}"
                await client.add_request_async(
                    EngineCoreRequest(
                        request_id=rid,
                        prompt_token_ids=[10 + i % 50, 20 + i % 50, 30 + i % 50],
                        mm_features=None,
                        sampling_params=SamplingParams(
                            max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
                        ),
                        pooling_params=None,
                        arrival_time=time.time(),
                        lora_request=None,
                        cache_salt=None,
                        data_parallel_rank=results[rid]["pinned"],
                    )
                )
            try:
                await asyncio.wait_for(done.wait(), args.timeout)
            except TimeoutError:
                errors.append(f"round {round_}: {len(pending)} request(s) unfinished")
                reader.cancel()
                break
            finally:
                if reader.done() and reader.exception() is not None:
                    errors.append(f"output task: {reader.exception()!r}")
            rounds.append(time.monotonic() - t1)
        in_flight = dict(getattr(client, "reqs_in_flight", {}))
        inflight_counts = {
            int.from_bytes(k, "little"): v
            for k, v in getattr(client, "engine_inflight", {}).items()
        }
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        in_flight, inflight_counts = {}, {}
    finally:
        client.shutdown(timeout=5)
    ranks: dict[str, int] = {}
    for r in results.values():
        if r["rank"] is not None:
            ranks[str(r["rank"])] = ranks.get(str(r["rank"]), 0) + 1
    finished = all(r["finish"] is not None for r in results.values())
    pinned_ok = all(r["pinned"] is None or r["pinned"] == r["rank"] for r in results.values())
    ok = finished and pinned_ok and not in_flight and not errors
    emit(
        {
            "event": "result",
            "ok": ok,
            "requests": results,
            "ranks": ranks,
            "pinned_ok": pinned_ok,
            "reqs_in_flight_left": sorted(in_flight),
            "engine_inflight": inflight_counts,
            "round_s": [round(t, 4) for t in rounds],
            "build_s": round(build_s, 2),
            "import_s": round(import_s, 2),
            "errors": errors,
        }
    )
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    args = parse(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    t0 = time.monotonic()
    import uvloop
    import vllm  # noqa: F401  (the slow first import, timed)

    import_s = time.monotonic() - t0
    return uvloop.run(run(args, import_s))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
