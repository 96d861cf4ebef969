"""`python -m zmqdp demo`: stream a workload through a mock engine group and report.

It starts `python -m zmqdp mock` in a subprocess on a private ipc path, connects an
`EngineGroup`, streams a mixed workload with a live progress bar (done, requests/s, in
flight, ETA), and prints a summary: the run time, throughput, time to first token and
total latency (p50/p99), requests and peak in-flight load per rank, and the errors
grouped by cause. The engines are simulated: tokens/s and the latencies follow from the
mock's step time (`--step-time`), not from a model. It exits 0 only if every request
completed, or failed exactly as the injected fault predicts.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import socket
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from . import EngineDead, EngineGroup, GroupClosed, HandshakeTimeout, Request, ZmqdpError
from ._core.errors import quote
from .keys import ClientKeys, generate_keys, load_client_keys
from .mock import mock_process

FAULTS = ("dead", "silent", "garbage", "rejoin", "bad_hello")


@dataclass
class Result:
    id: str
    rank: int = -1
    submitted: float = 0.0
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    error: BaseException | None = None


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    inflight: Counter[int] = field(default_factory=Counter)
    peak: Counter[int] = field(default_factory=Counter)
    per_rank: Counter[int] = field(default_factory=Counter)
    started: float = 0.0
    ended: float = 0.0
    connect_error: BaseException | None = None


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--engines", type=int, default=2, help="ranks in the group (2)")
    parser.add_argument("--lockstep", action="store_true", help="a lockstep (MoE-style) group")
    parser.add_argument("--requests", type=int, default=200, help="requests to send (200)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (32)")
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--step-time", type=float, default=0.02, help="engine step, s (0.02)")
    parser.add_argument("--slow-rank", type=int, default=None, help="make this rank slower")
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--fault", choices=FAULTS, default=None, help="inject a fault")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-after", type=int, default=40, help="outputs before the fault")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    parser.add_argument(
        "--curve",
        action="store_true",
        help="run over tcp on loopback with CURVE keys made for the demo (python -m zmqdp keys)",
    )
    return parser


def _mock_args(args: argparse.Namespace) -> list[str]:
    cmd = ["--step-time", str(args.step_time)]
    if args.lockstep:
        cmd.append("--lockstep")
    if args.slow_rank is not None:
        cmd += ["--fault", f"{args.slow_rank}:slow={args.slow_factor}"]
    if args.fault == "bad_hello":
        cmd += ["--fault", f"{args.fault_rank}:bad_hello=size"]
    elif args.fault == "garbage":  # one invalid batch kills the rank (docs/protocol.md §7)
        cmd += ["--fault", f"{args.fault_rank}:garbage=1"]
    elif args.fault == "rejoin":
        # one restart: a rank that rejoined every N outputs would be an engine restarting
        # in a loop, which the client reports as a possible identity conflict
        cmd += ["--fault", f"{args.fault_rank}:rejoin={args.fault_after}"]
        cmd += ["--fault", f"{args.fault_rank}:rejoins=1"]
    elif args.fault is not None:
        cmd += ["--fault", f"{args.fault_rank}:{args.fault}={args.fault_after}"]
    return cmd


async def _workload(
    group: EngineGroup[Request], args: argparse.Namespace, run: Run, progress: Any
) -> None:
    rng = random.Random(args.seed)
    limiter = trio.CapacityLimiter(args.concurrency)
    task = progress.add_task("requests", total=args.requests, inflight=0) if progress else None

    def show_inflight() -> None:
        if progress:
            progress.update(task, inflight=sum(run.inflight.values()))

    async def one(i: int) -> None:
        result = Result(f"req-{i}")
        run.results.append(result)
        body = {
            "prompt": [rng.randrange(32000) for _ in range(rng.randint(4, 64))],
            "max_tokens": rng.randint(args.min_tokens, args.max_tokens),
        }
        async with limiter:
            result.submitted = trio.current_time()
            try:
                stream = group.submit(Request(result.id, body))
            except ZmqdpError as exc:
                result.error = exc
            else:
                result.rank = stream.rank
                run.inflight[stream.rank] += 1
                run.per_rank[stream.rank] += 1
                run.peak[stream.rank] = max(run.peak[stream.rank], run.inflight[stream.rank])
                show_inflight()
                try:
                    async with stream:
                        async for _ in stream:
                            if result.first is None:
                                result.first = trio.current_time()
                            result.tokens += 1
                    result.done = trio.current_time()
                except ZmqdpError as exc:
                    result.error = exc
                finally:
                    run.inflight[stream.rank] -= 1
                    show_inflight()
        if progress:
            progress.advance(task)

    async with trio.open_nursery() as nursery:
        for i in range(args.requests):
            nursery.start_soon(one, i)


async def run_demo(args: argparse.Namespace, console: Any = None) -> Run:
    directory = tempfile.mkdtemp(prefix="zmqdp-demo-")  # mode 0700
    url = f"ipc://{directory}/group"
    mock_args = _mock_args(args)
    curve = None
    run = Run()
    try:
        if args.curve:  # the engines' keys and the client's allow-list, made for the demo
            keys = os.path.join(directory, "keys")
            generate_keys(keys, args.engines)
            curve = load_client_keys(keys)
            mock_args += ["--keys", keys]
            with socket.socket() as probe:  # a free port: engines must know it in advance
                probe.bind(("127.0.0.1", 0))
                url = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        async with mock_process(url, args.engines, *mock_args):
            await _run_against(url, args, run, console, curve)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return run


async def _run_against(
    url: str, args: argparse.Namespace, run: Run, console: Any, curve: ClientKeys | None = None
) -> None:
    """Connect to the mock group at `url`, run the workload, record it in `run`."""
    silence = 2.0 if args.fault == "silent" else 30.0
    ready = 5.0 if args.fault == "bad_hello" else 60.0
    try:
        async with EngineGroup.connect(
            url, args.engines, ready_timeout=ready, silence_timeout=silence, curve=curve
        ) as group:
            run.started = trio.current_time()
            if console is not None and not args.no_progress:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeRemainingColumn,
                )

                # transient: the summary's figures replace the live ones once done
                with Progress(
                    "[progress.description]{task.description}",
                    BarColumn(),
                    MofNCompleteColumn(),
                    _rate_column(),
                    TextColumn("{task.fields[inflight]} in flight"),
                    TextColumn("ETA"),
                    TimeRemainingColumn(compact=True),
                    console=console,
                    transient=True,
                ) as progress:
                    await _workload(group, args, run, progress)
            else:
                await _workload(group, args, run, None)
            run.ended = trio.current_time()
    except HandshakeTimeout as exc:
        run.connect_error = exc


def _rate_column() -> Any:
    """A progress column: completed requests per second (rich's recent-window estimate)."""
    from rich.progress import ProgressColumn, Task
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            text = "-- req/s" if speed is None else f"{speed:.1f} req/s"
            return Text(text, style="progress.data.speed")

    return RateColumn()


@dataclass(frozen=True)
class ErrorGroup:
    """Requests that failed the same way (`error_groups`)."""

    error: str
    """The error class and its message, the request id in it replaced by `<id>`."""
    count: int
    example: str
    """The id of one request that failed so."""


def normalized_error(error: BaseException, request_id: str) -> str:
    """`Class: message` with the request's id, quoted as zmqdp's error messages quote it,
    replaced by `<id>`: the same cause reads the same whatever the request. Ranks stay:
    a different rank is a different cause."""
    return f"{type(error).__name__}: {str(error).replace(quote(request_id), '<id>')}"


def error_groups(results: Iterable[Result]) -> list[ErrorGroup]:
    """The failed requests grouped by `normalized_error`, most frequent first (then in
    order of first occurrence), each with a count and one example request."""
    counts: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for r in results:
        if r.error is None:
            continue
        key = normalized_error(r.error, r.id)
        counts[key] += 1
        examples.setdefault(key, r.id)
    return [ErrorGroup(key, n, examples[key]) for key, n in counts.most_common()]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def verdict(args: argparse.Namespace, run: Run) -> tuple[bool, str]:
    """Did every request complete, or fail exactly as the injected fault predicts?"""
    if args.fault == "bad_hello":
        err = run.connect_error
        ok = isinstance(err, HandshakeTimeout) and any("size" in r for r in err.rejected)
        return ok, "the group never formed: the bad HELLO was rejected" if ok else f"{err!r}"
    if run.connect_error is not None:
        return False, f"could not connect: {run.connect_error}"
    failed = [r for r in run.results if r.error is not None]
    if args.fault is None:
        return not failed, "every request completed" if not failed else f"{len(failed)} failed"
    for r in failed:
        err = r.error
        expected = isinstance(err, EngineDead) and err.rank == args.fault_rank
        if args.lockstep:
            expected = expected or isinstance(err, GroupClosed)
        if not expected:
            return False, f"{r.id} failed unexpectedly: {err!r}"
    if not failed:
        return False, f"the injected fault ({args.fault}) caused no failure"
    what = f"EngineDead on rank {args.fault_rank}" + (" or GroupClosed" if args.lockstep else "")
    return True, (
        f"{len(failed)} failed as the fault predicts ({what}), "
        f"{len(run.results) - len(failed)} completed"
    )


MAX_ERROR_ROWS = 8


def report(args: argparse.Namespace, run: Run, console: Any) -> bool:
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    ok, why = verdict(args, run)
    why = escape(why)
    if run.connect_error is not None:
        console.print(f"[bold]connect:[/bold] {escape(str(run.connect_error))}")
        console.print(f"[bold {'green' if ok else 'red'}]{'OK' if ok else 'FAILED'}[/]: {why}")
        return ok
    done = [r for r in run.results if r.error is None]
    elapsed = max(run.ended - run.started, 1e-9)
    tokens = sum(r.tokens for r in run.results)
    ttft = [r.first - r.submitted for r in done if r.first is not None]
    total = [r.done - r.submitted for r in done if r.done is not None]
    summary = Table(title="zmqdp demo", show_header=False)
    summary.add_row(
        "group",
        f"{args.engines} engines, {'lockstep' if args.lockstep else 'independent'}"
        + (", tcp + CURVE" if args.curve else ", ipc")
        + (f", fault {args.fault} on rank {args.fault_rank}" if args.fault else "")
        + (
            f", rank {args.slow_rank} x{args.slow_factor:g} slower"
            if args.slow_rank is not None
            else ""
        ),
    )
    summary.add_row("requests", f"{len(done)} completed, {len(run.results) - len(done)} failed")
    summary.add_row("run time", f"{elapsed:.2f} s, from the first request to the last result")
    summary.add_row("requests/s", f"{len(done) / elapsed:.1f}")
    summary.add_row(
        "tokens/s",
        f"{tokens / elapsed:,.0f} (simulated: the mock engines emit one token per request "
        f"every --step-time {args.step_time:g} s, not a model's speed)",
    )
    summary.add_row(
        "TTFT p50 / p99", f"{_pct(ttft, 0.5) * 1e3:.1f} / {_pct(ttft, 0.99) * 1e3:.1f} ms"
    )
    summary.add_row(
        "latency p50 / p99", f"{_pct(total, 0.5) * 1e3:.0f} / {_pct(total, 0.99) * 1e3:.0f} ms"
    )
    console.print(summary)
    ranks = Table(title="per rank")
    for col in ("rank", "requests", "tokens", "peak in flight"):
        ranks.add_column(col, justify="right")
    for rank in range(args.engines):
        toks = sum(r.tokens for r in run.results if r.rank == rank)
        ranks.add_row(str(rank), str(run.per_rank[rank]), f"{toks:,}", str(run.peak[rank]))
    console.print(ranks)
    groups = error_groups(run.results)
    if groups:
        table = Table(title="errors, by cause (<id>: each request's own id)")
        table.add_column("count", justify="right")
        table.add_column("error", overflow="fold")
        table.add_column("e.g.", overflow="fold")
        for group in groups[:MAX_ERROR_ROWS]:
            table.add_row(str(group.count), Text(group.error), Text(group.example))
        if len(groups) > MAX_ERROR_ROWS:
            rest = groups[MAX_ERROR_ROWS:]
            table.add_row(
                str(sum(g.count for g in rest)), Text(f"... {len(rest)} other cause(s)"), ""
            )
        console.print(table)
    console.print(f"[bold {'green' if ok else 'red'}]{'OK' if ok else 'FAILED'}[/]: {why}")
    return ok


class ConsoleLog(logging.Handler):
    """zmqdp's warnings during the demo, labelled with their logger, printed on the
    demo's console (above the progress bar, which rich keeps at the bottom) rather than
    bare by Python's last-resort handler; counted for the note after the summary."""

    def __init__(self, console: Any) -> None:
        super().__init__(logging.WARNING)
        self.console = console
        self.count = 0
        self.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from rich.text import Text

            self.console.print(Text(self.format(record), style="dim"))
            self.count += 1
        except Exception:  # pragma: no cover - logging must not raise
            self.handleError(record)


FAULT_NOTES = {
    "rejoin": "the mock rank closes its connection and says HELLO again, as a restarted "
    "engine does; the client cannot tell that from an engine that exited, so it declares "
    "the rank dead, fails its requests, and takes it back at its HELLO",
    "dead": "the mock rank announces itself dead",
    "silent": "the mock rank stops sending; the client declares it dead when its "
    "liveness deadline passes",
    "garbage": "the mock rank sends an undecodable message",
    "bad_hello": "the mock rank says a wrong size in its HELLO",
}


def fault_note(args: argparse.Namespace, warnings: int) -> str | None:
    """The line after the summary that says the warnings above are the planned fault."""
    if not warnings or args.fault is None:
        return None
    return (
        f"note: the {warnings} zmqdp log line(s) above are the injected fault (--fault "
        f"{args.fault} on rank {args.fault_rank}) as the client sees it: "
        f"{FAULT_NOTES.get(args.fault, 'a planned fault')}"
    )


def main(args: argparse.Namespace) -> int:
    try:
        from rich.console import Console
    except ImportError:  # pragma: no cover
        print(
            "the demo needs rich, in the demo extra: pip install -e '.[demo]' in the "
            "clone, or pip install '/path/to/zmqdp[demo]' (docs/guides/install.md)",
            file=sys.stderr,
        )
        return 2
    console = Console()
    handler = ConsoleLog(console)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    if not root.handlers[:-1]:  # nobody configured logging: warnings and worse
        root.setLevel(logging.WARNING)
    try:
        run = trio.run(run_demo, args, console)
        ok = report(args, run, console)
        note = fault_note(args, handler.count)
        if note is not None:
            from rich.text import Text

            console.print(Text(note, style="dim"))
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return 0 if ok else 1
