"""vLLM's own DP client (`DPLBAsyncMPClient` with its `DPCoordinatorProc`, from the vLLM
venv) against tests/fakes/vllm.py's engines playing vLLM 0.32 (the venv's version).

The fakes run here, in trio, and connect to the handshake ROUTER that
tools/realvllm/vllm_dp_client.py binds (``vllm serve --data-parallel-size-local 0``'s
client); they retry until it is there. The client is strict where zmqdp is lenient: it
decodes every ready response as an `EngineCoreReadyResponse` (a missing field fails its
start-up), checks a MoE engine's READY hash against its own config, frees its routing
table only from ``finished_requests``, and for MoE leaves the waves to its real
coordinator. So a pass here says the fakes are engines vLLM's frontend accepts; the
last test shows it would notice if they were not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.fakes.vllm import FakeVllmEngine, FakeVllmGroup

from .engines import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "realvllm" / "vllm_dp_client.py"
VENV = os.environ.get("ZMQDP_REAL_VLLM")

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(not VENV, reason="real vLLM: run `python3 dev.py realvllm`"),
    pytest.mark.timeout_s(200),
]

LIMIT_S = 180.0
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert VENV is not None
    for candidate in (os.environ.get("ZMQDP_REAL_VLLM_MODELS"), "/tmp/zmodels"):
        if candidate and (Path(candidate) / "dense" / "config.json").exists():
            return Path(candidate)
    root = tmp_path_factory.mktemp("models")
    py = Path(VENV) / "bin" / "python"
    subprocess.run([str(py), str(ROOT / "tools/realvllm/make_models.py"), str(root)], check=True)
    return root


async def _kill_group(proc: trio.Process) -> None:
    """Cancel: SIGKILL the client and what it spawned (its coordinator), by group id."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()


async def drive(
    fake: FakeVllmGroup, port: int, model: Path, requests: int, log: Path, *, moe: bool = False
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Run the script against `fake`; returns (exit status, config line, result line)."""
    assert VENV is not None
    cmd = [str(Path(VENV) / "bin" / "python"), str(SCRIPT), "--port", str(port)]
    cmd += ["--engines", str(fake.size), "--requests", str(requests), "--model", str(model)]
    cmd += ["--max-tokens", str(MAX_TOKENS)] + (["--moe"] if moe else [])
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1"}
    env |= {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    lines: dict[str, dict[str, Any]] = {}
    with log.open("wb") as stderr:
        async with trio.open_nursery() as nursery:
            fake.nursery = nursery
            proc: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    check=False,
                    env=env,
                    start_new_session=True,
                    deliver_cancel=_kill_group,
                )
            )
            assert proc.stdout is not None
            buf = b""
            started = False
            async for chunk in proc.stdout:
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.startswith(b"{"):
                        continue
                    msg = json.loads(line)
                    lines[msg["event"]] = msg
                    if msg["event"] == "config" and not started:
                        started = True
                        for e in fake.engines:  # the frontend checks MoE READYs against it
                            e.config_hash = msg["parallel_config_hash"]
                            nursery.start_soon(e.run)
            await proc.wait()
            for e in fake.engines:  # a MoE group parks after its last request
                await e.wait_for(lambda e=e: not e.engines_running or e.stopped.is_set())
            nursery.cancel_scope.cancel()
    assert proc.returncode is not None
    if "result" not in lines:
        tail = (await trio.Path(log).read_text(errors="replace"))[-3000:]
        pytest.fail(f"the client printed no result (exit {proc.returncode}); its log:\n{tail}")
    return proc.returncode, lines["config"], lines["result"]


def _report(result: dict[str, Any]) -> None:
    summary = {k: result.get(k) for k in ("build_s", "import_s", "round_s", "ranks", "errors")}
    print(f"vllm_dp_client: {summary}", file=sys.stderr)


def check_outcome(fake: FakeVllmGroup, result: dict[str, Any], requests: int) -> None:
    assert result["ok"], result.get("errors")
    assert len(result["requests"]) == requests
    for rid, r in result["requests"].items():
        i = int(rid.rsplit("-", 1)[1])
        # the fake's tokens: counting up from the last prompt token (30 + i % 50)
        assert r["tokens"] == [31 + i % 50 + k for k in range(MAX_TOKENS)], rid
        assert r["finish"] == "length", rid
        if r["pinned"] is not None:
            assert r["rank"] == r["pinned"], rid
    # the load balancer spread the unpinned requests, and the fakes saw each ADD once
    assert sorted(result["ranks"]) == [str(r) for r in range(fake.size)]
    adds = {a[0]: e.rank for e in fake.engines for a in e.got("add")}
    assert len(adds) == requests
    assert all(adds[rid] == r["rank"] for rid, r in result["requests"].items())
    # the client's in-flight accounting was freed by the fakes' finished_requests
    assert result["reqs_in_flight_left"] == []
    assert all(v == 0 for v in result["engine_inflight"].values())


async def test_vllm_dp_client_dense_dp2(model_root: Path, tmp_path: Path) -> None:
    port = free_port()
    fake = FakeVllmGroup(f"tcp://127.0.0.1:{port}", 2, version="0.32")
    try:
        with trio.fail_after(LIMIT_S):
            rc, config, result = await drive(fake, port, model_root / "dense", 12, tmp_path / "log")
    finally:
        fake.close()
    _report(result)
    assert rc == 0, result
    assert config["is_moe"] is False
    check_outcome(fake, result, 12)
    for e in fake.engines:
        assert e.refused is None and e.up.is_set()
        assert e.init is not None and e.init["parallel_config"] == {}  # dense: no DP group
        # vLLM's frontend ran its coordinator (dense: load stats only), so the engines
        # had one to publish their counts to
        assert e.has_coordinator and e.init["addresses"]["coordinator_output"]


@pytest.mark.timeout_s(260)
async def test_vllm_dp_client_moe_dp2(model_root: Path, tmp_path: Path) -> None:
    port = free_port()
    fake = FakeVllmGroup(f"tcp://127.0.0.1:{port}", 2, moe=True, version="0.32")
    try:
        with trio.fail_after(LIMIT_S):
            rc, config, result = await drive(
                fake, port, model_root / "moe", 12, tmp_path / "log", moe=True
            )
    finally:
        fake.close()
    _report(result)
    assert rc == 0, result
    assert config["is_moe"] is True
    check_outcome(fake, result, 12)
    for e in fake.engines:
        assert e.refused is None and e.up.is_set()
        assert e.init is not None
        pc = e.init["parallel_config"]
        # what a headless-only frontend sends: no coordination store, >= 4 ports + master
        assert pc["_coord_store_port"] == 0 and len(pc["_data_parallel_master_port_list"]) >= 4
        # vLLM's coordinator ran the waves: it woke the ranks (0.32 engines do not start
        # a wave for an ADD at their own wave: the frontend's FIRST_REQ does) ...
        assert e.got("start_dp_wave")
        # ... and the group parked after its work (rank 0 reported wave_complete)
        assert e.current_wave >= 1


async def test_vllm_dp_client_refuses_an_incomplete_ready_response(
    model_root: Path, tmp_path: Path
) -> None:
    """The negative control: a fake whose ready response lacks `dp_stats_address` (as
    the old fake's did) is refused by vLLM's client at start-up."""

    class Incomplete(FakeVllmEngine):
        def ready_response(self) -> dict[str, Any]:
            r = super().ready_response()
            del r["dp_stats_address"]
            return r

    port = free_port()
    fake = FakeVllmGroup(f"tcp://127.0.0.1:{port}", 2, version="0.32")
    fake.engines[1] = Incomplete(fake, 1, tokens_per_step=1, step_delay=0.0)
    try:
        with trio.fail_after(LIMIT_S):
            rc, _, result = await drive(fake, port, model_root / "dense", 2, tmp_path / "log")
    finally:
        fake.close()
    assert rc == 2 and not result["ok"]
    assert "missing required field `dp_stats_address`" in result["error"]
