"""The vLLM side of benchmarks/bench_vs_vllm.py: vLLM's own DP client in a process of its
own, run with the vLLM venv's python and driven round by round over stdin/stdout.

    .venv-vllm/bin/python benchmarks/_vs_vllm_vllm.py --port P --engines N --model DIR

Built as ``vllm serve DIR --data-parallel-size N --data-parallel-size-local 0
--data-parallel-address 127.0.0.1 --data-parallel-rpc-port P`` builds it (as
tools/realvllm/vllm_dp_client.py does): a `VllmConfig` from those engine arguments
passed to `EngineCoreClient.make_async_mp_client` (a `DPLBAsyncMPClient`, which spawns
the real `DPCoordinatorProc`), on uvloop, `freeze_gc_heap()` once it is up. The model
directory needs only a ``config.json`` (``skip_tokenizer_init``: no detokenization).

The consumers follow AsyncLLM without its detokenizer: ONE output task loops over
`get_output_async()` and routes each `EngineCoreOutput` to its request's
`asyncio.Queue`, in chunks of ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` with an
``asyncio.sleep(0)`` between chunks (AsyncLLM's `output_handler`); one task per request
adds it (`add_request_async`, pinned to rank i mod N, as `AsyncLLM.generate`) and reads
its queue until the output with a finish reason.

Protocol: lines on stdout that start with ``@bench `` are JSON for the benchmark (vLLM
logs the rest); commands are JSON lines on stdin:

* ``{"event": "config", "vllm_version": ...}`` before the client is built;
* ``{"event": "ready", "build_s": ...}`` once it is up;
* command ``{"cmd": "round", "k": K, "requests": R, "tokens": T, "samples": bool}`` ->
  ``{"event": "round", "end": ..., "cpu": ..., "tokens": ..., "coord_cpu": ...,
  "samples": [[rank, first token id, receive time], ...] or null}``: ``end`` the
  `time.monotonic()` of the last output with a finish reason, ``cpu`` this process's
  `time.process_time()` over the round (submission included), ``coord_cpu`` its
  children's (the coordinator's) CPU over the round;
* command ``{"cmd": "stop"}``: shut the client down and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "realvllm"))
from vllm_dp_client import ENV  # vLLM settings for a CPU-only machine

PROMPT = [1, 2, 3]


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write("@bench " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def build_config(args: argparse.Namespace) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    engine_args = AsyncEngineArgs(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=4096,
        max_num_seqs=256,
        data_parallel_size=args.engines,
        data_parallel_size_local=0,
        data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=args.port,
    )
    return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def children_cpu() -> float:
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


async def serve(args: argparse.Namespace) -> None:
    import vllm.envs as envs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.executor.abstract import Executor

    config = build_config(args)
    t0 = time.monotonic()
    client: Any = EngineCoreClient.make_async_mp_client(
        config, Executor.get_class(config), log_stats=True
    )
    build_s = time.monotonic() - t0
    freeze_gc_heap()
    emit({"event": "ready", "build_s": round(build_s, 2), "client": type(client).__name__})

    chunk = envs.VLLM_V1_OUTPUT_PROC_CHUNK_SIZE
    queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}

    async def output_handler() -> None:
        while True:
            outputs = await client.get_output_async()
            batch = outputs.outputs
            n = len(batch)
            for start in range(0, n, chunk):
                for o in batch[start : start + chunk]:
                    q = queues.get(o.request_id)
                    if q is not None:
                        q.put_nowait(o)
                if start + chunk < n:
                    await asyncio.sleep(0)

    async def one_round(cmd: dict[str, Any]) -> dict[str, Any]:
        k, requests, tokens = cmd["k"], cmd["requests"], cmd["tokens"]
        samples: list[tuple[int, int, float]] | None = [] if cmd["samples"] else None
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        ends: list[float] = []
        received = [0]

        async def request(i: int) -> None:
            rid, rank = f"v{k}-{i}", i % args.engines
            q: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
            queues[rid] = q
            await client.add_request_async(
                EngineCoreRequest(
                    request_id=rid,
                    prompt_token_ids=PROMPT,
                    mm_features=None,
                    sampling_params=sp,
                    pooling_params=None,
                    arrival_time=time.time(),
                    lora_request=None,
                    cache_salt=None,
                    data_parallel_rank=rank,
                )
            )
            n = 0
            while True:
                o = await q.get()
                now = time.monotonic()
                n += len(o.new_token_ids)
                if samples is not None and o.new_token_ids:
                    samples.append((rank, o.new_token_ids[0], now))
                if o.finish_reason is not None:
                    break
            ends.append(now)
            del queues[rid]
            received[0] += n

        cpu, coord = time.process_time(), children_cpu()
        async with asyncio.TaskGroup() as tg:
            for i in range(requests):
                tg.create_task(request(i))
        return {
            "event": "round",
            "end": max(ends),
            "cpu": time.process_time() - cpu,
            "coord_cpu": children_cpu() - coord,
            "tokens": received[0],
            "samples": samples,
        }

    handler = asyncio.create_task(output_handler())
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                break
            emit(await one_round(cmd))
    finally:
        handler.cancel()
        client.shutdown(timeout=5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True, help="--data-parallel-rpc-port")
    p.add_argument("--engines", type=int, default=2, help="--data-parallel-size")
    p.add_argument("--model", required=True, help="a directory with a config.json")
    args = p.parse_args()
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    import uvloop
    import vllm

    emit({"event": "config", "vllm_version": vllm.__version__})
    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
