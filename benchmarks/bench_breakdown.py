"""Where a streamed token's CPU goes in the gateway (issue 34): gateway CPU µs per token at
c=256 and c=32, SSE and non-streaming JSON, for both flavours, broken down by category
from py-spy's samples.

    .venv/bin/python benchmarks/bench_breakdown.py [--quick] [--rounds 3] [--window 2]
        [--flavours trio,asyncio] [--conc 256,32] [--modes sse,json] [--rate 100]
        [--frames 8] [--step-time 0.005] [--keep DIR]

The stacks are bench_gateway.py's S rows' zmqdp side (_smg.py `Stack` "trio" and
"asyncio"): ``python -m zmqdp serve --vllm MODEL --url ipc://... --engines 2`` on
hypercorn/trio, and the same with ``--server uvicorn``, each exactly as a user starts it,
each in front of fake vLLM 0.33 engines of its own (2 dense ranks in one process, one step
every ``--step-time`` s plus its own time, the tiny model's tokenizer, so every token is
detokenized as in production); the load is bench_gateway.py's (`run_http`: c keep-alive
connections, ``/v1/completions``, ``max_tokens`` 64, each answer checked). Both stacks are
up for the whole run and the rounds alternate between them.

For each measured window, py-spy (the `bench` extra) records the gateway process:
``py-spy record --pid P --rate R --format raw --full-filenames --threads --nonblocking``
(``--idle`` off: only samples of threads that were runnable count; every thread;
nonblocking, so the gateway is never paused: pausing it (``--blocking``) cut its
throughput by a third here). Then:

* total = the process's measured CPU (user + sys, every thread, /proc) ÷ the tokens
  received in the window (as bench_gateway.py's µs/token column);
* each thread's CPU over the recording (/proc/P/task) is spread over its samples, and
  each category = total * its share of that CPU, summed over the rounds. (py-spy counts
  a runnable thread waiting for a core as active: on this 2-core machine an idle worker
  thread would otherwise take the main thread's share.)

A sample (one stack) goes to the category of the first rule of `RULES`, in the table's
order, that matches any of its frames (the entry points at the root, `IGNORED`, aside):
the specific rules come first (what tokenizes the prompt, detokenizes, encodes, writes,
reads), then the broad ones (zmqdp's client, the gateway, the HTTP server's other code),
and last the run loops (trio, asyncio, uvloop, outcome...), which only take a stack
that nothing else claims (a scheduler pass, an epoll call, uvloop's C loop, a resumption
before a task's own code runs). So a socket send under hypercorn's ``app_send`` counts
as the write path, not as trio, and trio's cancel scopes under the gateway's request
handler count as its per-request work. A C function's time goes to its Python caller's
line (no native frames: DecodeStream.step is its caller's, uvloop's own work the run
loop's). A stack py-spy read while it changed can come out cut (its outer frames lost):
it counts by the frames it has. Stacks that no rule matches are "other", and their top
innermost frames are printed (``--frames N`` prints every category's).

How far to trust it: ``coverage`` is samples ÷ (rate * CPU seconds), all threads and
the main thread's. Near 1, the samples are the CPU. Above 1 (1.3-2 here, with the load
generator, the engines and other work sharing 2 cores), the main thread was often
runnable but waiting for a core, and was sampled where it waited: where it woke (an
epoll wait: the run loop) or where it had just woken another process (a socket send:
the write path), so those two categories are overstated by up to the excess. ``--gil``
(only samples holding the GIL) errs the other way: a syscall that releases the GIL
(the sends) is not counted. Compare the categories of one run, not runs of a loaded
machine.

If py-spy is missing or cannot attach (ptrace not allowed), the totals are still measured
and the breakdown is skipped with a message. Rows ``B256t``, ``B32t``, ``B256tj``... (t:
hypercorn/trio, a: uvicorn/asyncio, j: non-streaming JSON): the total µs/token (context,
no target), with the categories in their context; the full table goes into RESULTS.md
(`run_all.py` appends it) and plots/breakdown.png (stacked bars).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from _harness import Row, median, plot, save
from bench_gateway import CLK_TCK, SUFFIX, TOKENS, Plan, cpu_of, run_http

CATEGORIES = {  # key: label, in the order
    "write": "HTTP server write path",
    "parse": "HTTP request parse and connection handling",
    "encode": "SSE/JSON encoding",
    "detok": "detokenization",
    "wake": "consumer wake-ups and run loop",
    "client": "zmqdp dispatcher (receive, decode, apply, deliver) and submit",
    "request": "gateway per-request work (race, scopes, ids, metrics, body parse)",
    "threads": "prompt tokenization and worker threads",
    "other": "other (uncategorised)",
}

GW = "/zmqdp/gateway/"
GUEST = "<trio guest mode>"
"""A pseudo-frame `weigh` puts on the stacks of trio's cached threads when trio runs as
asyncio's guest: they are then its I/O thread (the run loop), not to_thread's workers."""
RULES: tuple[tuple[str, str, frozenset[str] | None], ...] = tuple(
    (category, path, None if names is None else frozenset(names.split()))
    for category, path, names in (
        # (category, a part of the frame's file path ("A!B": A and not B), its functions
        # (None: any)); a sample goes to the first rule, in this order, that matches any
        # frame of its stack (`IGNORED` frames aside); a name matches "name",
        # "Class.name" or "outer.<locals>.name" alike.
        # -- the I/O wait (trio's epoll, in the loop or in guest mode's I/O thread)
        ("wake", "/trio/_core/_io_epoll.py", "get_events"),
        # -- the prompt: tokenized in the loop or handed to a worker thread
        ("threads", f"{GW}vllm_frontend.py", "prepare encode _encoding chat_prompt"),
        ("threads", f"{GW}frontend.py", "MockFrontend.prepare MockFrontend.chat_prompt"),
        ("threads", f"{GW}completions.py", "_prepare"),
        ("threads", f"{GW}backends.py", "in_thread"),
        ("threads", "/trio/_threads.py", None),
        ("threads", "/concurrent/futures/thread.py", None),
        ("threads", "/asyncio/threads.py", None),
        # -- detokenization (DecodeStream.step is native: its time is decode's line's)
        ("detok", f"{GW}vllm_frontend.py", None),
        (
            "detok",
            f"{GW}frontend.py",
            "_mock_piece _mock_text _MockDecode.__call__ _MockDecode.batch decode_each",
        ),
        # -- the request's body parsed (per request), then the answer's encoding
        ("request", f"{GW}openai.py", "parse_completion parse_chat"),
        ("request", f"{GW}completions.py", "_parse"),
        ("encode", f"{GW}openai.py", None),
        ("encode", "/json/", None),
        # -- the write path: the gateway's ASGI send, the server's, h11's, the socket's
        ("write", f"{GW}http.py", "start body respond fail"),
        ("write", "/hypercorn/protocol/http_stream.py", "app_send _send_closed"),
        ("write", "/hypercorn/protocol/h11.py", "stream_send _send_h11_event send"),
        ("write", "/hypercorn/trio/tcp_server.py", "protocol_send"),
        ("write", "/hypercorn/asyncio/tcp_server.py", "protocol_send"),
        ("write", "/h11/_connection.py", "send send_with_data_passthrough"),
        ("write", "/h11/_writers.py", None),
        ("write", "/uvicorn/protocols/http/h11_impl.py", "RequestResponseCycle.send"),
        ("write", "/uvicorn/protocols/http/httptools_impl.py", "RequestResponseCycle.send"),
        ("write", "/uvicorn/protocols/http/flow_control.py", None),
        ("write", "/trio/_highlevel_socket.py", "send_all"),
        # zmqdp's hypercorn fast paths (direct writes, chunks framed past h11)
        ("write", f"{GW}connections.py", "protocol_send send_chunk chunk_of _Framer"),
        # -- the request's parse and the connection's handling (specific parts)
        ("parse", f"{GW}http.py", "read_body header"),
        ("parse", f"{GW}connections.py", None),
        # -- a consumer woken: its stream's receive side (the deliver side is the client's)
        (
            "wake",
            "/zmqdp/stream.py",
            "receive receive_batch receive_nowait drain_nowait _wait _abort_wait __anext__ "
            "_check_thread _busy _end_of_stream",
        ),
        ("wake", "/zmqdp/aio.py", "AsyncioRequestStream.__anext__ AsyncioRequestStream._wait"),
        ("wake", "/zmqdp/aio.py", "AsyncioRequestStream.receive_batch"),
        # -- zmqdp's client: the dispatcher's pass (receive, decode, apply, deliver), submit
        ("client", "/zmqdp/!/zmqdp/gateway/", None),
        ("client", "/zmq/", None),
        ("client", "/cbor2/", None),
        ("client", "/msgspec/", None),
        # -- the gateway's own per-request work (handler, race, scopes, ids, metrics)
        ("request", GW, None),
        ("request", "/uuid.py", None),
        ("request", "/prometheus_client/", None),
        # -- the HTTP servers' other code: reading, parsing, connections, the app's task
        ("parse", "/hypercorn/", None),
        ("parse", "/h11/", None),
        ("parse", "/uvicorn/", None),
        ("parse", "/httptools/", None),
        # -- trio's guest-mode I/O thread, and the loop's handing the wait to it
        ("wake", GUEST, None),
        ("wake", "/trio/_core/_thread_cache.py", "start_thread_soon"),
        # -- any other thread's own CPU (a worker between jobs, a thread's start)
        ("threads", "<thread !<thread MainThread", None),
        # -- the run loops: what no other rule claims
        ("wake", "/trio/", None),
        ("wake", "/outcome/", None),
        ("wake", "<attrs generated", None),
        ("wake", "/asyncio/", None),
        ("wake", "/uvloop/", None),
        ("wake", "/sniffio/", None),
        ("wake", "/selectors.py", None),
        ("wake", "/contextlib.py", None),
    )
)


IGNORED = (
    "/zmqdp/__main__.py",
    f"{GW}serve.py",
    "/runpy.py",
    "<frozen runpy>",
    "/uvicorn/server.py",
    "/uvicorn/main.py",
    "/uvicorn/_compat.py",
)
"""The entry points at the main thread's root (`python -m zmqdp serve`, uvicorn's
`Server.run`): every stack of that thread has them, so they decide nothing."""


def parse_frame(frame: str) -> tuple[str, str]:
    """(function, file) of a py-spy raw frame ``Class.func (/path/file.py:123)``."""
    name, _, where = frame.rpartition(" (")
    if not name:
        return frame, ""
    return name, where.rsplit(":", 1)[0]


def _matches(names: frozenset[str] | None, function: str) -> bool:
    if names is None:
        return True
    return function in names or function.rpartition(".")[2] in names


def categorize(frames: Sequence[str]) -> str:
    """The category of one stack (outermost frame first): the first rule of `RULES`
    that matches any frame; "other" if none does."""
    parsed = [(fn, file) for fn, file in map(parse_frame, frames) if not _ignored(file)]
    for category, path, names in RULES:
        part, _, unless = path.partition("!")
        for function, filename in parsed:
            skip = unless and unless in filename
            if part in filename and not skip and _matches(names, function):
                return category
    return "other"


def _ignored(filename: str) -> bool:
    return any(part in filename for part in IGNORED)


def read_raw(path: Path) -> Counter[tuple[str, ...]]:
    """py-spy's raw output: one ``thread (tid): name;frame;frame... count`` a line; the
    thread becomes the stack's first frame, ``thread (<thread NAME>:TID)``."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        body, _, count = line.rpartition(" ")
        if not body or not count.isdigit():
            continue
        frames = body.split(";")
        if frames and frames[0].startswith("thread ("):  # "thread (tid): name"
            tid, _, name = frames[0][8:].partition("): ")
            frames[0] = f"thread (<thread {name}>:{tid})"
        stacks[tuple(frames)] += int(count)
    return stacks


def thread_of(stack: Sequence[str]) -> int:
    """The thread id of a `read_raw` stack (0: unknown)."""
    if stack and stack[0].startswith("thread (<thread "):
        tid = stack[0].rpartition(":")[2].rstrip(")")
        return int(tid) if tid.isdigit() else 0
    return 0


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + sys) of each thread of `pid`, from /proc."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue  # gone
        fields = data[data.rindex(b")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def weigh(
    stacks: Counter[tuple[str, ...]], cpu: Mapping[int, float], main: int
) -> tuple[Counter[str], dict[str, Counter[str]]]:
    """CPU seconds per category, and per category its innermost frames': each thread's
    measured CPU (`cpu`, by thread id) spread over its samples. py-spy counts a runnable
    thread as active even while it waits for a core (2 cores, several busy processes):
    weighing by each thread's own CPU keeps a worker that mostly waited from taking the
    main thread's share. A thread that used CPU but was never sampled counts as its own
    category's: "threads" (any thread but `main`) or "other"."""
    per_thread: Counter[int] = Counter()
    guest = False
    for stack, n in stacks.items():
        per_thread[thread_of(stack)] += n
        guest = guest or any("guest_tick" in frame for frame in stack)
    per: Counter[str] = Counter()
    frames: dict[str, Counter[str]] = {k: Counter() for k in CATEGORIES}
    for stack, n in stacks.items():
        tid = thread_of(stack)
        seconds = n * cpu.get(tid, 0.0) / per_thread[tid]
        if guest and stack and stack[0].startswith("thread (<thread Trio thread"):
            stack = (f"guest ({GUEST}:0)", *stack)
        category = categorize(stack)
        per[category] += seconds
        function, filename = parse_frame(stack[-1] if stack else "?")
        frames[category][f"{function} ({_short(filename)})"] += seconds
    for tid, seconds in cpu.items():
        if seconds > 0 and not per_thread[tid]:
            category = "other" if tid == main else "threads"
            per[category] += seconds
            frames[category][f"thread {tid}, never sampled"] += seconds
    return per, frames


def _short(filename: str) -> str:
    for marker in ("/site-packages/", "/lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    root = str(Path(__file__).resolve().parent.parent) + "/"
    return filename.removeprefix(root)


# -- py-spy --------------------------------------------------------------------------------


def find_spy() -> str | None:
    """py-spy: next to this python (the `bench` extra's venv), else on the PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


class Spy:
    """One py-spy recording of `pid`, from `start()` to `stop()` (SIGINT: it writes its
    file and exits)."""

    def __init__(self, exe: str, pid: int, rate: int, out: Path, options: Sequence[str]) -> None:
        self.cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw"]
        self.cmd += ["--full-filenames", "--threads", "-o", str(out), *options]
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = out.with_suffix(".log")
        self.cpu = 0.0

    def start(self) -> int:
        """Start recording; return once py-spy samples (its start-up, which reads the
        interpreter's symbols, is then not in the window), or after 10 s."""
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            if b"Sampling process" in self.log.read_bytes():
                break
            time.sleep(0.01)
        self.cpu = cpu_of([self.proc.pid])
        return self.proc.pid

    def stop(self) -> Counter[tuple[str, ...]]:
        assert self.proc is not None
        self.cpu = cpu_of([self.proc.pid]) - self.cpu  # its CPU while it sampled
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if not self.out.exists():  # (it failed to attach: this round has no samples)
            print(f"(py-spy wrote nothing: {self.log.read_text(errors='replace')[-300:]})")
            return Counter()
        return read_raw(self.out)


def spy_works(exe: str | None) -> str | None:
    """None if py-spy can record a process here, else why not."""
    if exe is None:
        return "no py-spy (pip install 'zmqdp[bench]')"
    busy = "print('up', flush=True)\nwhile True: sum(range(1000))"
    child = subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        child.stdout.readline()  # (py-spy cannot attach before the interpreter is up)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "probe.txt"
            cmd = [exe, "record", "--pid", str(child.pid), "--duration", "1", "--rate", "50"]
            cmd += ["--format", "raw", "--nonblocking", "-o", str(out)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.SubprocessError) as exc:
                return f"py-spy did not run: {exc}"
            if done.returncode != 0 or not out.exists() or not read_raw(out):
                return f"py-spy cannot record here: {(done.stderr or done.stdout)[-400:]}"
    finally:
        child.kill()
        child.wait()
    return None


# -- the rounds -----------------------------------------------------------------------------


def measure(
    stack: Any,
    others: list[int],
    plan: Plan,
    mode: str,
    spy: Spy | None,
) -> dict[str, Any]:
    """One HTTP round on `stack`, py-spy recording its gateway over the window."""
    from _smg import PROMPT

    idle = list(others)  # py-spy's own CPU is this benchmark's, not other work's
    pids = {"server": stack.gateway_pids, "mock": stack.engines_pid, "idle": idle}
    stacks: Counter[tuple[str, ...]] = Counter()
    main = stack.gateway_pids[0]
    threads: list[dict[int, float]] = []

    def hook(start: bool) -> None:
        nonlocal stacks
        if spy is None:
            return
        if start:
            idle.append(spy.start())
            threads.append(thread_cpu(main))
        else:
            threads.append(thread_cpu(main))
            stacks = spy.stop()

    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": TOKENS}
    r = run_http(stack.port, plan, mode == "sse", pids, hook, body=body, vllm=True)
    r["stacks"] = stacks
    r["threads"] = {t: v - threads[0].get(t, 0.0) for t, v in threads[1].items()} if threads else {}
    r["main"] = main
    r["spy_cpu"] = 0.0 if spy is None else spy.cpu
    return r


def cell_figures(runs: list[dict[str, Any]], rate: int) -> dict[str, Any]:
    """One (flavour, c, mode)'s figures over its rounds: the medians of tokens/s and µs
    per token; each category's µs, the total * its share of the CPU (`weigh`) over
    every round; `coverage`: samples ÷ (rate * CPU seconds), all threads and the main
    one's (above 1: py-spy counted a thread waiting for a core as active)."""
    total = median([1e6 * r["cpu"] / max(1, r["tokens"]) for r in runs])
    per: Counter[str] = Counter()
    frames: dict[str, Counter[str]] = {k: Counter() for k in CATEGORIES}
    samples = main_samples = 0
    cpu = main_cpu = 0.0
    for r in runs:
        p, f = weigh(r["stacks"], r["threads"], r["main"])
        per.update(p)
        for k, c in f.items():
            frames[k].update(c)
        samples += sum(r["stacks"].values())
        main_samples += sum(n for s, n in r["stacks"].items() if thread_of(s) == r["main"])
        cpu += sum(r["threads"].values())
        main_cpu += r["threads"].get(r["main"], 0.0)
    weighed = sum(per.values())
    return {
        "tok_s": median([r["tokens"] / r["seconds"] for r in runs]),
        "cpu_us": total,
        "cpu_pct": median([100 * r["cpu"] / r["seconds"] for r in runs]),
        "tok_write": median([r["tokens"] / max(1, r["writes"]) for r in runs]),
        "spy_pct": median([100 * r["spy_cpu"] / r["seconds"] for r in runs]),
        "others_pct": median([100 * r["others_cpu"] / r["seconds"] for r in runs]),
        "samples": samples,
        "coverage": samples / (rate * cpu) if cpu else 0.0,
        "main_coverage": main_samples / (rate * main_cpu) if main_cpu else 0.0,
        "main_pct": 100 * main_cpu / cpu if cpu else 0.0,
        "us": {k: total * per[k] / weighed if weighed else 0.0 for k in CATEGORIES},
        "frames": {
            k: [(f, total * n / weighed) for f, n in frames[k].most_common(40)]
            for k in CATEGORIES
            if weighed
        },
    }


def column(flavour: str, c: int, mode: str) -> str:
    return f"{flavour} {c} {mode}"


def table(cells: dict[str, dict[str, Any]], markdown: bool = False) -> list[str]:
    """The breakdown: one row per category, one column per measured cell."""
    names = list(cells)
    if markdown:
        lines = [
            "| µs per token | " + " | ".join(names) + " |",
            "|---|" + "---:|" * len(names),
        ]

        def row(label: str, values: Iterable[str]) -> str:
            return f"| {label} | " + " | ".join(values) + " |"
    else:
        lines = [f"{'µs per token':58}" + "".join(f"{n:>17}" for n in names)]

        def row(label: str, values: Iterable[str]) -> str:
            return f"{label:58}" + "".join(f"{v:>17}" for v in values)

    for key, label in CATEGORIES.items():
        values = []
        for f in cells.values():
            us = f["us"].get(key, 0.0)
            values.append(f"{us:.1f} ({100 * us / f['cpu_us']:.0f}%)" if f["samples"] else "-")
        lines.append(row(label, values))
    lines.append(row("total: process CPU ÷ tokens", (f"{f['cpu_us']:.1f}" for f in cells.values())))
    lines.append(row("tokens/s", (f"{f['tok_s']:,.0f}" for f in cells.values())))
    lines.append(row("tokens per HTTP write", (f"{f['tok_write']:.2f}" for f in cells.values())))
    lines.append(row("gateway CPU, % of a core", (f"{f['cpu_pct']:.0f}" for f in cells.values())))
    lines.append(
        row(
            "py-spy samples (coverage, main's)",
            (
                f"{f['samples']} ({f['coverage']:.1f}, {f['main_coverage']:.1f})"
                for f in cells.values()
            ),
        )
    )
    lines.append(
        row("main thread's share of the CPU", (f"{f['main_pct']:.0f}%" for f in cells.values()))
    )
    lines.append(row("py-spy's CPU, % of a core", (f"{f['spy_pct']:.0f}" for f in cells.values())))
    lines.append(
        row("others' CPU, % of a core", (f"{f['others_pct']:.0f}" for f in cells.values()))
    )
    return lines


def print_frames(cells: dict[str, dict[str, Any]], keys: Iterable[str], n: int) -> None:
    for name, f in cells.items():
        for key in keys:
            top = f.get("frames", {}).get(key, [])[:n]
            if not top:
                continue
            print(f"  {name}, {CATEGORIES[key]}: top innermost frames (µs/token)")
            for frame, us in top:
                print(f"    {us:6.2f}  {frame}")


SHORT = {
    "write": "HTTP write path",
    "parse": "HTTP parse, connections",
    "encode": "SSE/JSON encoding",
    "detok": "detokenization",
    "wake": "wake-ups, run loop",
    "client": "zmqdp dispatcher, submit",
    "request": "per-request work",
    "threads": "prompt, worker threads",
    "other": "other",
}
"""The plot's legend."""


CELL_WORDS = {"trio": "hypercorn (trio)", "asyncio": "uvicorn (asyncio)"}
CELL_WORDS |= {"sse": "streaming", "json": "non-streaming"}


def cell_label(name: str) -> str:
    """A cell's name in words: "trio 256 sse" -> hypercorn (trio), 256 concurrent,
    streaming, a line each."""
    server, c, mode = name.split()
    return f"{CELL_WORDS[server]}\n{c} concurrent\n{CELL_WORDS[mode]}"


def draw(cells: dict[str, dict[str, Any]], directory: Path | None = None) -> None:
    """plots/breakdown.png: one stacked bar per measured cell."""
    names = list(cells)
    if not any(f["samples"] for f in cells.values()):
        return

    def bars(ax: Any) -> None:
        bottom = [0.0] * len(names)
        labels = [cell_label(n) for n in names]
        for key in CATEGORIES:
            values = [cells[n]["us"].get(key, 0.0) for n in names]
            ax.bar(labels, values, bottom=bottom, label=SHORT[key])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel("gateway CPU µs per token")
        ax.tick_params(axis="x", labelsize=7)

    plot(
        "breakdown",
        bars,
        "zmqdp serve: CPU per token, by category",
        size=(6.4 + 1.1 * max(0, len(names) - 4), 4.0),
        legend_outside=True,
        directory=directory,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short round, SSE only (CI)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=2.0, help="seconds counted a round")
    parser.add_argument("--settle", type=float, default=0.5, help="s after the stagger")
    parser.add_argument("--flavours", default="trio,asyncio")
    parser.add_argument("--conc", default="256,32")
    parser.add_argument("--modes", default="sse,json", help="sse, json (non-streaming)")
    parser.add_argument("--rate", type=int, default=100, help="py-spy: samples per second")
    parser.add_argument("--step-time", type=float, default=0.005, help="fake engines: s/step")
    parser.add_argument("--frames", type=int, default=0, help="every category's top frames")
    parser.add_argument(
        "--blocking", action="store_true", help="py-spy pauses the gateway for each sample"
    )
    parser.add_argument("--gil", action="store_true", help="py-spy: only samples holding the GIL")
    parser.add_argument("--keep", type=Path, help="keep py-spy's raw files in this folder")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.window, args.settle, args.modes = 1, 0.8, 0.3, "sse"
    import _smg

    flavours = args.flavours.split(",")
    conc = [int(c) for c in args.conc.split(",")]
    modes = args.modes.split(",")
    exe = find_spy()
    why = spy_works(exe)
    if why is not None:
        print(f"breakdown skipped ({why}): only the totals are measured", flush=True)
    options = [] if args.blocking else ["--nonblocking"]
    options += ["--gil"] if args.gil else []
    tmp = Path(tempfile.mkdtemp(prefix="zmqdp-breakdown-"))
    raw = args.keep or tmp
    raw.mkdir(parents=True, exist_ok=True)
    engines = (
        f"fake vLLM 0.33 engines: {_smg.RANKS} dense ranks, step {1e3 * args.step_time:g} ms + "
        f"its own time, {TOKENS}-token completions"
    )
    print(f"zmqdp serve ({', '.join(flavours)}) under py-spy at {args.rate} Hz; {engines}")
    stacks: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    period = TOKENS * args.step_time
    try:
        model = _smg.model_dir(tmp)
        _smg.check_tokens(model)
        for kind in flavours:
            stacks[kind] = _smg.Stack(kind, model, args.step_time, None)
        for stack in stacks.values():
            stack.wait_ready()
        every = {k: [*s.gateway_pids, s.engines_pid] for k, s in stacks.items()}
        if not args.quick:  # warm each up once
            for kind, stack in stacks.items():
                others = [p for k, ps in every.items() if k != kind for p in ps]
                measure(stack, others, Plan(max(conc), period, period + 0.3, 0.5), "sse", None)
        for n in range(args.rounds):
            order = flavours[n % len(flavours) :] + flavours[: n % len(flavours)]
            for c in conc:
                plan = Plan(c, period, period + args.settle, args.window)
                for mode in modes:
                    for kind in order:
                        stack = stacks[kind]
                        others = [p for k, ps in every.items() if k != kind for p in ps]
                        name = column(kind, c, mode)
                        out = raw / f"{name.replace(' ', '-')}-{n}.txt"
                        spy = (
                            None
                            if why
                            else Spy(str(exe), stack.gateway_pids[0], args.rate, out, options)
                        )
                        r = measure(stack, others, plan, mode, spy)
                        runs.setdefault(name, []).append(r)
                        print(
                            f"  round {n + 1}/{args.rounds} {name}: "
                            f"{r['tokens'] / r['seconds']:,.0f} tok/s, "
                            f"{1e6 * r['cpu'] / max(1, r['tokens']):.1f} µs/token, "
                            f"{sum(r['stacks'].values())} samples",
                            flush=True,
                        )
    finally:
        for stack in stacks.values():
            stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    cells = {name: cell_figures(rs, args.rate) for name, rs in runs.items()}
    heading = (
        f"gateway CPU µs per token by category ({'py-spy, ' if not why else ''}medians of "
        f"{args.rounds} round(s) of {args.window:g} s; the total is the process's CPU ÷ tokens, "
        "each category its share of that CPU: each thread's CPU spread over its samples)"
    )
    print(f"\n{engines}\n{heading}")
    for line in table(cells):
        print(line)
    print_frames(cells, ["other"], 8)
    if args.frames:
        print_frames(cells, [k for k in CATEGORIES if k != "other"], args.frames)
    if args.keep:
        print(f"(py-spy's raw files: {args.keep})")
    draw(cells)
    rows = []
    for name, f in cells.items():
        flavour, c, mode = name.split()
        parts = ", ".join(
            f"{key} {f['us'][key]:.1f}"
            for key in CATEGORIES
            if f["samples"] and f["us"][key] >= 0.05
        )
        rows.append(
            Row(
                f"B{c}{SUFFIX[flavour]}" + ("j" if mode == "json" else ""),
                f"gateway CPU µs per token (py-spy breakdown below), "
                f"{'HTTP SSE' if mode == 'sse' else 'non-streaming JSON'}, c={c}, "
                f"{_smg.Stack.NAMES[flavour]} (context)",
                f["cpu_us"],
                "",
                f"{f['tok_s']:,.0f} tok/s, {f['tok_write']:.2f} tokens/write; "
                + (f"by category (µs/token): {parts}" if parts else "no breakdown: " + str(why)),
            )
        )
    markdown = [
        "### Where the gateway's CPU per token goes (bench_breakdown.py)",
        "",
        f"{heading}; {engines}. Categories: the rules in `benchmarks/bench_breakdown.py` "
        "(`RULES`).",
        "",
        *table(cells, markdown=True),
    ]
    save(
        "breakdown",
        rows,
        {
            "markdown": "\n".join(markdown) if not why else "",
            "engines": engines,
            "rate": args.rate,
            "spy": why or "py-spy",
            "cells": {k: {x: y for x, y in f.items() if x != "frames"} for k, f in cells.items()},
        },
    )


if __name__ == "__main__":
    main()
