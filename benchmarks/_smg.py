"""SMG (the Shepherd Model Gateway, `smg` 1.13.0 on the package registry) and zmqdp's
gateway, each in front of fake vLLM engines of its own, for bench_gateway.py's S rows.

A *stack* is one gateway and its engine group, each in a process of its own:

* the engines: tests/fakes/vllm.py's `FakeVllmEngine`s (vLLM 0.33's handshake and wire:
  the full `EngineCoreReadyResponse`, a full `SchedulerStats` in every step's message),
  2 dense ranks in one trio process (``python benchmarks/_smg.py fakes ...``), one step
  every `step_time` s plus the step's own time (the fake's ``step_delay``), one token per
  running request per step, token ids counting up from the prompt's last token + 1;
* SMG: ``smg launch --backend vllm --worker-urls ipc://PATH --zmq-engine-count 2
  --model-path MODEL --health-check-interval-secs 1`` from ``.venv-smg`` (made here on
  first use, `ensure_smg`). SMG binds: its data sockets are ``PATH-in.sock`` and
  ``PATH-out.sock``, its handshake ROUTER ``tcp://127.0.0.1:<20000 + FNV-1a-64(PATH) %
  10000>`` (`handshake_port`), which the engines connect to. The router is a Rust
  extension running in the launcher's own Python process (it renames itself
  ``smg::router``); its CPU is that process's, every thread, plus any descendant's;
* zmqdp: ``python -m zmqdp serve --vllm MODEL --url ipc://DIR/z --engines 2`` with
  ``--server hypercorn`` (trio) or ``--server uvicorn`` (asyncio, the default), exactly
  as a user runs it; the engines connect to
  its ipc handshake, data sockets on ipc as SMG's;
* vLLM's own API server (kinds "vllm" and "vllmrs", bench_gateway.py's V and R rows):
  ``vllm serve MODEL --data-parallel-size 2 --data-parallel-size-local 0 ...``, the Python
  frontend or (``VLLM_USE_RUST_FRONTEND=1``) the Rust one, the engines headless on its
  ``tcp://127.0.0.1:<--data-parallel-rpc-port>``; its CPU is every process below it
  (_vllmfe.py).

Both serve the model under its directory's path (each gateway's default) and tokenize
and detokenize with its tokenizer.json: tests/data/tiny-model, its context raised to 4096
as tools/aiperf_smoke.py does. The prompt ``PROMPT`` ends in the token " 70" (id 540),
so a 64-token answer is ids 541..604, which detokenize to " 71 72 ... 134": one space per
token, which is how the load generator counts them (bench_gateway.py `vllm_tokens`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, ClassVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV = ROOT / ".venv-smg"
SMG = "smg==1.13.0"
"""The version the S rows were written for (its wire and CLI as
/work/shared/reference/smg_run.md describes them)."""
PROMPT = "Hello, zmqdp 70"
TEXT_64 = " " + " ".join(str(n) for n in range(71, 135))
"""What every 64-token answer must read."""
RANKS = 2


def ensure_smg() -> tuple[Path | None, str]:
    """SMG's launcher in ``.venv-smg``, made on first use: (its path, its version), or
    (None, why not)."""
    exe = VENV / "bin" / "smg"
    if not exe.exists():
        print(f"(making {VENV.name} with {SMG}: once)", flush=True)
        try:
            subprocess.run(
                [sys.executable, "-m", "venv", "--clear", str(VENV)],
                check=True,
                capture_output=True,
                timeout=300,
            )
            pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", SMG]
            done = subprocess.run(pip, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"cannot make {VENV}: {exc}"
        if done.returncode != 0 or not exe.exists():
            return None, f"pip install {SMG} failed: {(done.stderr or done.stdout)[-600:]}"
    try:
        done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{exe} does not run: {exc}"
    version = (done.stdout or done.stderr).strip().splitlines()
    if done.returncode != 0 or not version:
        return None, f"{exe} --version failed: {done.stderr[-300:]}"
    return exe, version[0]


def model_dir(tmp: Path) -> Path:
    """The tiny test model with its context raised to 4096 (tools/aiperf_smoke.py's)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import aiperf_smoke
    finally:
        sys.path.remove(str(ROOT / "tools"))
    model: Path = aiperf_smoke.model_dir(tmp)
    return model


def check_tokens(model: Path) -> None:
    """The fake's 64 token ids after PROMPT detokenize to TEXT_64 (one space each)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    last = tok.encode(PROMPT, add_special_tokens=False).ids[-1]
    text = tok.decode(list(range(last + 1, last + 65)))
    if text != TEXT_64:
        raise RuntimeError(f"the fake's tokens after {PROMPT!r} read {text!r}, not {TEXT_64!r}")


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def handshake_port(path: str) -> int:
    """Where SMG 1.13 binds the handshake ROUTER of ``--worker-urls ipc://PATH``."""
    return 20000 + fnv1a64(path.encode()) % 10000


def port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        ppid = int(data[data.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class Stack:
    """A gateway (`kind`: one of `NAMES`) and its fake engine group."""

    NAMES: ClassVar[dict[str, str]] = {
        "smg": "SMG 1.13 (Rust)",
        "trio": "zmqdp serve --server hypercorn (trio)",
        "asyncio": "zmqdp serve --server uvicorn (asyncio, the default)",
        "vllm": "vllm serve (vLLM's Python API server)",
        "vllmrs": "VLLM_USE_RUST_FRONTEND=1 vllm serve (vLLM's Rust vllm-rs)",
        "h11": "zmqdp serve --server uvicorn --http h11",
        "httptools": "zmqdp serve --server uvicorn --http httptools",
        "granian": "the gateway's app on granian (Rust hyper, ASGI, uvloop)",
    }

    def __init__(
        self,
        kind: str,
        model: Path,
        step_time: float,
        smg: Path | None,
        version: str = "0.33",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """`smg`: SMG's launcher (kind "smg"), or vLLM's ``vllm`` CLI (kinds "vllm" and
        "vllmrs"), run with `extra_env`; `version`: the vLLM version the fake engines
        play (_vllmfe.py)."""
        self.kind = kind
        self.name = self.NAMES[kind]
        self.model = str(model)
        self.dir = Path(tempfile.mkdtemp(prefix=f"zmqdp-smg-{kind}-"))  # mode 0700
        self.port = free_port()
        self.stats_path = self.dir / "engines.json"
        self.logs = {n: self.dir / f"{n}.log" for n in ("gateway", "engines")}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        python = str(ROOT / ".venv" / "bin" / "python")
        if not Path(python).exists():
            python = sys.executable
        if kind == "smg":
            assert smg is not None
            for i in range(100):  # a path whose handshake port is free
                path = str(self.dir / (f"g{i}" if i else "g"))
                engines_url = f"tcp://127.0.0.1:{handshake_port(path)}"
                if port_free(handshake_port(path)):
                    break
            cmd = [str(smg), "launch", "--backend", "vllm", "--worker-urls", f"ipc://{path}"]
            cmd += ["--zmq-engine-count", str(RANKS), "--model-path", self.model]
            cmd += ["--health-check-interval-secs", "1", "--host", "127.0.0.1"]
            cmd += ["--port", str(self.port), "--prometheus-host", "127.0.0.1"]
            cmd += ["--prometheus-port", str(free_port()), "--log-level", "warn"]
        elif kind in ("vllm", "vllmrs"):  # as /work/shared/reference/vllm_frontend_run.md
            assert smg is not None
            rpc = free_port()
            engines_url = f"tcp://127.0.0.1:{rpc}"
            env.update(VLLM_TARGET_DEVICE="cpu", VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1")
            env.update(VLLM_LOGGING_LEVEL="WARNING", VLLM_NO_USAGE_STATS="1")
            env.update(extra_env or {})
            if kind == "vllmrs":
                env["VLLM_USE_RUST_FRONTEND"] = "1"
            cmd = [str(smg), "serve", self.model, "--data-parallel-size", str(RANKS)]
            cmd += ["--data-parallel-size-local", "0", "--data-parallel-address", "127.0.0.1"]
            cmd += ["--data-parallel-rpc-port", str(rpc), "--api-server-count", "1"]
            cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
            cmd += ["--disable-uvicorn-access-log"]
        elif kind == "granian":  # bench_asgi.py: the app serve builds (_granian_app.py)
            engines_url = f"ipc://{self.dir}/z"
            serve = ["--vllm", self.model, "--url", engines_url, "--engines", str(RANKS)]
            env["ZMQDP_SERVE_ARGS"] = shlex.join([*serve, "--log-level", "WARNING"])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
            cmd = [python, "-m", "granian", "--interface", "asgi", "--loop", "uvloop"]
            cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--http", "1", "--no-ws"]
            # its bounds: a 16 KiB head (431), 5 s to send one (slowloris); none on
            # connections (bench_asgi.py)
            cmd += ["--http1-buffer-size", "16384", "--http1-header-read-timeout", "5000"]
            cmd += ["--backlog", "2048", "--log-level", "warning", "_granian_app:app"]
        else:
            engines_url = f"ipc://{self.dir}/z"
            cmd = [python, "-m", "zmqdp", "serve", "--vllm", self.model, "--url", engines_url]
            cmd += ["--engines", str(RANKS), "--port", str(self.port), "--log-level", "WARNING"]
            if kind == "trio":
                cmd += ["--server", "hypercorn"]
            elif kind == "asyncio":
                cmd += ["--server", "uvicorn"]
            elif kind in ("h11", "httptools"):  # bench_asgi.py
                cmd += ["--server", "uvicorn", "--http", kind]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.procs["gateway"] = subprocess.Popen(
            cmd,
            cwd=self.dir,
            env=env,
            stdout=self.logs["gateway"].open("wb"),
            stderr=subprocess.STDOUT,
        )
        fakes = [python, str(Path(__file__).resolve()), "fakes", engines_url, str(RANKS)]
        fakes += [repr(step_time), str(self.stats_path), version]
        self.procs["engines"] = subprocess.Popen(
            fakes,
            cwd=ROOT,
            env=env,
            stdout=self.logs["engines"].open("wb"),
            stderr=subprocess.STDOUT,
        )
        self.gateway_pids: list[int] = [self.procs["gateway"].pid]
        self.engines_pid = self.procs["engines"].pid

    def tail(self, n: int = 2000) -> str:
        out = []
        for name, path in self.logs.items():
            text = path.read_text(errors="replace") if path.exists() else ""
            out.append(f"--- {self.kind} {name} ({path}):\n{text[-n:]}")
        return "\n".join(out)

    def request(self, body: dict[str, Any], timeout: float = 10.0) -> tuple[int, bytes]:
        data = json.dumps({"model": self.model, **body}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=data,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until a completion of 64 tokens succeeds and reads TEXT_64."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name}: the {name} process exited ({proc.returncode})\n"
                        + self.tail()
                    )
            try:
                status, body = self.request({"prompt": PROMPT, "max_tokens": 64}, timeout=5)
            except OSError as exc:
                last = str(exc)
            else:
                if status == 200:
                    answer = json.loads(body)
                    text = answer["choices"][0]["text"]
                    used = answer["usage"]["completion_tokens"]
                    if text != TEXT_64 or used != 64:
                        raise RuntimeError(f"{self.name} answered {used} tokens {text!r}")
                    # the descendants, once up (the smg launcher runs the router itself)
                    self.gateway_pids = descendants(self.procs["gateway"].pid)
                    return
                last = f"{status} {body[:300]!r}"
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} not ready in {timeout:g} s: {last}\n{self.tail()}")

    def engine_stats(self) -> dict[str, Any]:
        try:
            value: dict[str, Any] = json.loads(self.stats_path.read_text())
            return value
        except (OSError, ValueError):
            return {}

    def close(self) -> dict[str, Any]:
        """Stop the gateway, then the engines; what the engines counted."""
        for name in ("gateway", "engines"):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if name == "engines" else signal.SIGINT)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if name == "gateway":  # what it left (vllm serve's coordinator, vllm-rs...)
                for pid in self.gateway_pids[1:]:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        stats = self.engine_stats()
        shutil.rmtree(self.dir, ignore_errors=True)
        return stats


# -- the fake engine process ------------------------------------------------------------


def run_fakes(
    url: str, ranks: int, step_time: float, stats_path: str, version: str = "0.33"
) -> None:
    """`ranks` fake vLLM engines (playing `version`) of one group in this trio process,
    until SIGTERM; then write each rank's request count to `stats_path`."""
    import trio

    sys.path.insert(0, str(ROOT))
    from tests.fakes.vllm import FakeVllmEngine, FakeVllmGroup

    adds = [0] * ranks
    most = [0] * ranks

    class Engine(FakeVllmEngine):
        def _push(self, kind: str, value: Any) -> None:
            # as FakeVllmEngine's, without keeping every message for the tests
            self.inbox.append((kind, value))
            if kind == "add":
                adds[self.rank] += 1
            self.changed.set()
            self._seen.set()

        def _stats(self) -> dict[str, Any]:
            most[self.rank] = max(most[self.rank], len(self.requests))
            return super()._stats()

    async def main() -> None:
        group = FakeVllmGroup(url, ranks, step_delay=step_time, version=version)
        group.engines = [
            Engine(group, r, tokens_per_step=1, step_delay=step_time) for r in range(ranks)
        ]
        try:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async with trio.open_nursery() as nursery:
                    group.nursery = nursery
                    for engine in group.engines:
                        nursery.start_soon(engine.run)

                    async def stop() -> None:
                        async for _ in signals:
                            nursery.cancel_scope.cancel()
                            return

                    nursery.start_soon(stop)
        finally:
            refused[:] = [e.refused for e in group.engines]
            group.close()

    refused: list[str | None] = []
    try:
        trio.run(main)
    finally:
        stats = {"adds": adds, "most_running": most, "refused": refused}
        Path(stats_path).write_text(json.dumps(stats))


if __name__ == "__main__":
    if len(sys.argv) in (6, 7) and sys.argv[1] == "fakes":
        run_fakes(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), *sys.argv[5:])
    else:
        raise SystemExit("usage: _smg.py fakes URL RANKS STEP_TIME STATS_PATH [VERSION]")
