"""Real vLLM engine cores as subprocesses, and a trio client living in a thread.

`EngineProcs` starts ``vllm serve MODEL --headless`` with one rank per process (one
``--data-parallel-size-local 1 --data-parallel-start-rank R`` process per rank), as the
README recommends for fault isolation: with both ranks in one headless process, vLLM's
process manager SIGTERMs the survivor when one engine dies. Each process's output goes to
a log file, named in every failure.

`GroupHost` keeps one `zmqdp.vllm.connect`'s group connected for a whole test module. vLLM engines
do the handshake once (a second client cannot reuse them), and start-up takes 40-140 s
here, so the group cannot be remade per test: it runs in its own thread under
`trio.run`, and the (synchronous) tests hand it coroutines with `host.run(afn)`, each
under `trio.fail_after`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import trio

import zmqdp.vllm
from zmqdp.vllm import VllmGroup

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
# The engines import tools/realvllm/cpu_moe_plugin from this checkout, ahead of the copy
# installed in the venv (which only has to supply the entry point): a venv shared by
# several checkouts then runs each one's own plugin.
PLUGIN_SRC = ROOT / "tools" / "realvllm" / "cpu_moe_plugin"
ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    # the plugin asks Linux for AMX in every engine process before its first forward
    # pass: vLLM's AMX kernels do not, and die with SIGILL without it (see the plugin)
    "ZMQDP_CPU_AMX": "1",
}
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EngineProcs:
    """The engine processes of one group: one per rank."""

    def __init__(
        self,
        venv: Path,
        model: Path,
        size: int,
        logs: Path,
        *,
        moe: bool = False,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.venv = venv
        self.model = model
        self.size = size
        self.logs = logs
        self.moe = moe
        self.extra = extra
        self.port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.incarnations = [0] * size
        logs.mkdir(parents=True, exist_ok=True)

    def command(self, rank: int) -> list[str]:
        cmd = [
            str(self.venv / "bin" / "vllm"),
            "serve",
            str(self.model),
            "--headless",
            "--data-parallel-size",
            str(self.size),
            "--data-parallel-size-local",
            "1",
            "--data-parallel-start-rank",
            str(rank),
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            str(self.port),
            "--load-format",
            "dummy",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--seed",
            "0",
        ]
        if self.moe:
            cmd += ["--enable-expert-parallel", "--enforce-eager"]
        return [*cmd, *self.extra]

    def log_path(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.{self.incarnations[rank]}.log"

    def start(self, rank: int) -> None:
        env = {**os.environ, **ENGINE_ENV}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PLUGIN_SRC), os.environ.get("PYTHONPATH", "")) if p
        )
        if self.moe:
            env["ZMQDP_CPU_MOE"] = "1"
        self.incarnations[rank] += 1
        with self.log_path(rank).open("wb") as log:
            self.procs[rank] = subprocess.Popen(
                self.command(rank),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: killed as one
            )

    def start_all(self) -> None:
        for rank in range(self.size):
            self.start(rank)

    def children(self, rank: int) -> list[int]:
        """The PIDs of the rank's process's children (its EngineCore process)."""
        pid = self.procs[rank].pid
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def engine_core_pid(self, rank: int, timeout: float = 10.0) -> int:
        """The rank's EngineCore process (vLLM titles it ``VLLM::EngineCore_DP<r>``; its
        other child is multiprocessing's resource tracker)."""
        deadline = time.monotonic() + timeout
        while True:
            for pid in self.children(rank):
                with contextlib.suppress(OSError):
                    if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        return pid
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {rank}: no EngineCore child of {self.procs[rank].pid}")
            time.sleep(0.1)  # polling /proc, not synchronising with the code under test

    def kill_engine_core(self, rank: int) -> int:
        """SIGKILL the rank's EngineCore process (not its parent, which then exits)."""
        pid = self.engine_core_pid(rank)
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self, rank: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(rank, None)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)

    def stop_all(self) -> None:
        for rank in list(self.procs):
            self.stop(rank)

    def worker_amx_status(self, rank: int) -> str | None:
        """What the plugin logged about AMX in the rank's worker process (the one that
        runs the forward passes; vLLM prefixes its lines ``(Worker... pid=N)``)."""
        text = self.log_path(rank).read_text(errors="replace")
        worker = re.search(r"\(Worker\w* pid=(\d+)\)", text)
        if worker is None:
            return None
        found = re.search(rf"zmqdp_cpu_moe: AMX tile data (.+?) in pid {worker[1]}\b", text)
        return None if found is None else found[1]

    def tail(self, lines: int = 30) -> str:
        out = []
        for rank in range(self.size):
            path = self.log_path(rank)
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path}\n" + "\n".join(text))
        return "\n".join(out)


class GroupHost:
    """A `zmqdp.vllm.connect`'s group connected in a thread of its own, for synchronous tests."""

    def __init__(self, engines: EngineProcs, **connect_kw: Any) -> None:
        self.engines = engines
        self.connect_kw = connect_kw
        self.group: VllmGroup | None = None
        self.error: BaseException | None = None
        self.connect_seconds = 0.0
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, daemon=True)

    def start(self, timeout: float) -> None:
        self._thread.start()
        if not self._ready.wait(timeout + 30):
            raise AssertionError(f"the group did not connect in {timeout} s\n{self.engines.tail()}")
        if self.error is not None:
            raise AssertionError(
                f"the group did not connect: {self.error!r}\n{self.engines.tail()}"
            ) from self.error

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by start() or close()
            self.error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        t0 = time.monotonic()
        engines = self.engines
        kw = {"insecure": True, **self.connect_kw}  # headless vLLM engines speak only tcp
        async with zmqdp.vllm.connect(engines.url, engines.size, **kw) as g:
            self.connect_seconds = time.monotonic() - t0
            self.group = g
            self._ready.set()
            await self._stop.wait()

    def run(self, afn: Callable[..., Awaitable[T]], *args: Any, timeout: float = 60.0) -> T:
        """Run ``afn(group, *args)`` in the group's trio thread, within `timeout`."""
        assert self._token is not None and self.group is not None, "the group is not up"
        group = self.group

        async def bounded() -> T:
            with trio.fail_after(timeout):
                return await afn(group, *args)

        return trio.from_thread.run(bounded, trio_token=self._token)

    def close(self) -> None:
        if self._token is not None and self._stop is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(60)


@contextlib.contextmanager
def running_group(
    engines: EngineProcs, *, ready_timeout: float, **connect_kw: Any
) -> Iterator[GroupHost]:
    engines.start_all()
    host = GroupHost(engines, ready_timeout=ready_timeout, **connect_kw)
    try:
        host.start(ready_timeout)
        yield host
    finally:
        host.close()
        engines.stop_all()
