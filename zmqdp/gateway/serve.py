"""`python -m zmqdp serve`: the gateway on uvicorn (the default: asyncio, on uvloop and
its httptools parser when installed, `--http h11` for its pure-Python one; the group is
`zmqdp.aio`'s, trio as a guest) or hypercorn (`--server hypercorn`: trio-native, an
`EngineGroup`), with SIGTERM draining. uvicorn is the default because it costs a
quarter of hypercorn's CPU per streamed write, and no trio server gets near it
(docs/performance.md, "The trio HTTP server"). The bounds on connections and request
heads are `zmqdp.gateway.connections`'.

    python -m zmqdp serve --mock                       # an embedded mock group of 2
    python -m zmqdp serve --url ipc:///tmp/zmqdp-g1/g --engines 4 --max-inflight info

Signals, the same on both servers:

* the first SIGTERM or SIGINT once the server is up calls `app.begin_drain()`: `/ready`
  answers 503, the group drains (live requests finish, new ones get 503, for at most
  `--drain-timeout` s), and once it is drained the server is told to stop (hypercorn:
  its `shutdown_trigger` returns; uvicorn: `should_exit`), closes its connections and
  runs the lifespan shutdown; the exit status is 0;
* a second signal stops now (`app.stop_now()`): every live request is aborted on its
  rank and answered 503 `shutting_down` (a last SSE error event if its stream had
  begun), the drain ends, and the server stops as after any drain: no request is cut
  off without an answer, and nothing is logged as a traceback;
* a third signal, or a first one while the group is still connecting, stops at once
  (hypercorn: its tasks are cancelled and its connections closed, but a write to a
  client that stopped reading cannot be: hypercorn shields its socket writes; uvicorn:
  its `force_exit`).

An embedder running its own server gets the same by calling ``app.begin_drain()`` and
``await app.wait_drained()`` before it stops its server (app.py).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from types import FrameType
from typing import Any

import trio

from ..fdlimit import raise_open_files_limit
from .app import (
    DEFAULT_MAX_BUFFERED,
    DEFAULT_MAX_COLLECTED_CHARS,
    DEFAULT_MAX_COLLECTED_TOKENS,
    GatewayApp,
    create_app,
)
from .connections import (
    MAX_HEAD,
    UVICORN_HTTP,
    ConnectionCap,
    install_hypercorn_cap,
    install_hypercorn_fast_paths,
    uvicorn_http_name,
    uvicorn_protocol,
)

__all__ = [
    "SERVERS",
    "add_arguments",
    "banner",
    "listen_problem",
    "run",
    "serve_hypercorn",
    "serve_uvicorn",
]

log = logging.getLogger("zmqdp.gateway")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SERVERS = ("uvicorn", "hypercorn")
"""`--server`: the first is the default."""
ROUTING = ("speed", "least-loaded", "prefix")
"""`--routing`: the values `ConnectOptions.routing` accepts."""


def _positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (refused at the command line, not at start-up)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _natural_int(text: str) -> int:
    """An argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _model_len(text: str) -> int:
    """An argparse type: vLLM's `--max-model-len` (`human_readable_int`: 1k is 1000,
    1K is 1024), >= 1."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"must be an int such as 4096, 4k or 4K, not {text!r}")
    number, suffix = match.groups()
    if suffix.islower():
        value = int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
    elif suffix:
        if "." in number:
            raise argparse.ArgumentTypeError(f"no decimals with {suffix}: {text!r}")
        value = int(number) << (10 * ("KMGT".index(suffix) + 1))
    elif "." in number:
        raise argparse.ArgumentTypeError(f"must be an int, not {text!r}")
    else:
        value = int(number)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {text!r}")
    return value


VLLM_ONLY = ("max_model_len", "tokenizer", "chat_template")
"""`serve` options that need `--vllm` (the native wire has no tokenizer or model)."""
DEFAULT_READY_TIMEOUT = 600.0
"""`--ready-timeout`: vLLM's own wait for its engines (VLLM_ENGINE_READY_TIMEOUT_S), and
the vLLM wire's default: a real model loads for minutes."""
PROGRESS_INTERVAL = 30.0
"""Seconds between `serve`'s reports while it waits for ranks (the first comes after
`PROGRESS_FIRST`: a group that is up by then says nothing)."""
PROGRESS_FIRST = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` subcommand's options (vLLM's names where `vllm serve` has the same
    option: docs/guides/vllm.md has the table)."""
    group = parser.add_argument_group("engine group")
    group.add_argument("--mock", action="store_true", help="run an embedded mock group")
    group.add_argument(
        "--vllm",
        metavar="MODEL_DIR",
        help="front headless vLLM engine cores (vllm serve MODEL --headless ...) of this "
        "model directory: its tokenizer.json, config.json; --url is their "
        "--data-parallel-address/--data-parallel-rpc-port (tcp, with --insecure)",
    )
    group.add_argument("--moe", action="store_true", help="--vllm: an MoE (lockstep) group")
    group.add_argument("--url", help="the group URL to bind (default with --mock: private ipc)")
    group.add_argument(
        "--engines",
        "--data-parallel-size",
        "-dp",
        dest="engines",
        type=int,
        help="ranks (default with --mock: 2); --data-parallel-size and -dp are vLLM's names",
    )
    group.add_argument(
        "--advertise-host",
        default=None,
        metavar="HOST",
        help="with a wildcard --url (tcp://0.0.0.0:PORT): the address the engines are "
        "told to connect to",
    )
    group.add_argument(
        "--max-inflight",
        default=None,
        metavar="N|info",
        help="in-flight cap per rank (an int, or 'info': each rank's max_num_seqs); "
        "past it requests get 429",
    )
    group.add_argument(
        "--request-timeout", type=float, default=None, help="deadline of every request, s (504)"
    )
    group.add_argument(
        "--routing",
        choices=ROUTING,
        default="speed",
        help="how a request's rank is chosen. speed (default): the rank that would finish "
        "it first, from each rank's max_num_seqs and step time (timed by the requests it "
        "finishes; timing alone takes a rank at most 2 x max_num_seqs past its fair "
        "share); least-loaded: the rank holding the fewest requests; prefix: as least-loaded, "
        "but a prompt goes to the rank that probably caches its longest prefix while that "
        "rank's load is within a quarter (plus 2 requests) of the least loaded one's",
    )
    group.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="--routing prefix with --vllm: do not subscribe to the engines' KV events "
        "(--kv-events-config); route by the prompts sent alone (approximate)",
    )
    group.add_argument(
        "--ready-timeout",
        type=float,
        default=DEFAULT_READY_TIMEOUT,
        help="wait this long for every rank to come up, s (default 600, as vLLM: a model "
        "loads for minutes); progress is printed meanwhile",
    )
    group.add_argument(
        "--progress-interval", type=float, default=PROGRESS_INTERVAL, help=argparse.SUPPRESS
    )
    model = parser.add_argument_group("model (with --vllm; vLLM's options of the same names)")
    model.add_argument(
        "--max-model-len",
        type=_model_len,
        default=None,
        metavar="N",
        help="the longest prompt + completion, tokens (1k = 1000, 1K = 1024); default: the "
        "model's config.json, lowered to the engines' own once they are up (a prompt "
        "over it, or a max_tokens over it, is vLLM's 400)",
    )
    model.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the directory of tokenizer.json and tokenizer_config.json (default: --vllm's)",
    )
    model.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template, its file or the text itself (default: the tokenizer's)",
    )
    model.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults: auto (default) the model's generation_config.json, vllm "
        "none, DIR that folder's (temperature, top_p, top_k, min_p, the penalties, and "
        "max_new_tokens as a chat's default max_tokens); a request's own fields win",
    )
    group.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=3.0,
        help="a rank silent this long (not even a ZMTP heartbeat) is dead, s; raise it on "
        "an overloaded host (an MoE group's busy-waiting ranks can starve the gateway "
        "of CPU for seconds)",
    )
    group.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="CURVE keys (python -m zmqdp keys DIR --engines N): the client's pair and the "
        "ranks' allow-list; needed for a tcp URL unless --insecure",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="allow a tcp URL without --keys (whoever can reach the port, every local user "
        "for loopback, can claim a rank and read prompts)",
    )
    group.add_argument(
        "--no-recover",
        dest="recover",
        action="store_false",
        help="close for good when a lockstep group fails (default: wait for the ranks to "
        "come back, /ready 503 meanwhile)",
    )
    group.add_argument(
        "--recover-timeout",
        type=float,
        default=None,
        metavar="S",
        help="how long a failed lockstep group waits for every rank to come back before it "
        "closes for good, and /health answers 503 so that a liveness probe restarts this "
        "process (default: the ready timeout)",
    )
    group.add_argument(
        "--max-buffered",
        type=_natural_int,
        default=DEFAULT_MAX_BUFFERED,
        help="outputs a stream holds for a client that does not read; past it the request "
        "is aborted (0: no limit)",
    )
    group.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        metavar="N",
        help="engine steps per wake-up of a stream (vLLM's --stream-interval): the first "
        "and last outputs go at once, the others in groups of N, held at most 50 ms "
        "(default 1: every token as it comes, honest inter-token latency)",
    )
    group.add_argument("--step-time", type=float, default=0.01, help="mock: seconds per step")
    group.add_argument("--max-num-seqs", type=int, default=16, help="mock: running per rank")
    group.add_argument("--lockstep", action="store_true", help="mock: a lockstep group")
    http = parser.add_argument_group("http")
    http.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1, this machine only: vLLM's "
        "default is every interface; say --host 0.0.0.0 for that)",
    )
    http.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path prefix a proxy in front strips (ASGI root_path, as vLLM's)",
    )
    http.add_argument("--port", type=int, default=8000, help="0: any free port")
    http.add_argument(
        "--server",
        choices=SERVERS,
        default="uvicorn",
        help="uvicorn (default): asyncio, on uvloop and httptools when installed (the "
        "gateway extra installs both), ~15 us of CPU per streamed write; hypercorn: "
        "trio-native, for a trio-only stack, ~4x that per write",
    )
    http.add_argument(
        "--http",
        choices=UVICORN_HTTP,
        default="auto",
        help="--server uvicorn: its HTTP/1.1 parser. auto (default): httptools (C, "
        "llhttp) when installed (the gateway extra installs it), else h11 (pure Python); "
        "h11 forces it. Both bound a request head to 16 KiB (431)",
    )
    http.add_argument("--model", default="zmqdp", help="the model name in responses")
    http.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the names the model is served under (the first in responses; a request "
        "naming another gets 404); default: --model",
    )
    http.add_argument(
        "--vllm-metric-names",
        action="store_true",
        help="/metrics also has the vllm: series vLLM's dashboards read (on with --vllm)",
    )
    http.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $ZMQDP_API_KEY, "
        "else $VLLM_API_KEY; the flag wins, as vLLM's)",
    )
    http.add_argument(
        "--queue-timeout", type=float, default=0.0, help="wait for room before a 429, s"
    )
    http.add_argument("--retry-after", type=int, default=1, help="Retry-After of 429/503, s")
    http.add_argument(
        "--drain-timeout", type=float, default=30.0, help="SIGTERM: wait for live requests, s"
    )
    http.add_argument(
        "--drain-grace", type=float, default=0.0, help="SIGTERM: /ready 503 this long first, s"
    )
    http.add_argument(
        "--max-collected-tokens",
        type=int,
        default=DEFAULT_MAX_COLLECTED_TOKENS,
        help="the longest non-streaming answer, tokens: a larger max_tokens is a 400, an "
        "engine that overshoots a 502 (0: no limit)",
    )
    http.add_argument(
        "--max-collected-chars",
        type=int,
        default=DEFAULT_MAX_COLLECTED_CHARS,
        help="the most text of a non-streaming answer, characters; past it a 502 (0: no limit)",
    )
    http.add_argument("--access-log", action="store_true", help="log every request")
    http.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="open HTTP connections at most; past it a new one is answered 503 and closed "
        "(default: what the open-files limit leaves once the engine group's descriptors "
        "and room for its reconnects are set aside, logged at start; 0: no bound, which "
        "lets HTTP clients fill the descriptor table: libzmq then aborts the process)",
    )
    http.add_argument(
        "--header-timeout",
        type=float,
        default=5.0,
        help="a connection that does not complete a request head this long after it "
        "opened or after its last response is closed, s",
    )
    parser.add_argument("--log-level", default="INFO")


def _max_inflight(text: str | None) -> int | str | None:
    if text is None or text == "info":
        return text
    try:
        return int(text)
    except ValueError:
        raise SystemExit(
            f"zmqdp serve: --max-inflight must be an int or 'info', not {text!r}"
        ) from None


def api_key(flag: str | None) -> str | None:
    """The API key: `--api-key`, else $ZMQDP_API_KEY, else vLLM's $VLLM_API_KEY (the
    flag first, as vLLM's frontend takes it); None for none."""
    for key in (flag, os.environ.get("ZMQDP_API_KEY"), os.environ.get("VLLM_API_KEY")):
        if key is not None and key.strip():
            return key.strip()
    return None


def _vllm_only(args: argparse.Namespace) -> str | None:
    """The first model option given without `--vllm`, as its flag."""
    for name in VLLM_ONLY:
        if getattr(args, name) is not None:
            return "--" + name.replace("_", "-")
    if args.generation_config != "auto":
        return "--generation-config"
    return None


def app_from_args(args: argparse.Namespace) -> GatewayApp:
    from ..mock import MockConfig

    if args.mock and args.vllm is not None:
        raise SystemExit(
            "zmqdp serve: --mock runs zmqdp's own mock engines (its native wire), --vllm "
            "fronts vLLM engines: give one. For fake vLLM engines, run `zmqdp mock --wire "
            "vllm` and the `zmqdp serve --vllm ...` command it prints"
        )
    if args.moe and args.vllm is None:
        raise SystemExit(
            "zmqdp serve: --moe is for vLLM engines (--vllm MODEL_DIR); zmqdp's own "
            "engines say whether they step together (with --mock: --lockstep)"
        )
    if args.vllm is None and (flag := _vllm_only(args)) is not None:
        raise SystemExit(
            f"zmqdp serve: {flag} is for vLLM engines (--vllm MODEL_DIR): the native wire "
            "has no tokenizer"
        )
    options: dict[str, Any] = {
        "ready_timeout": args.ready_timeout,
        "heartbeat_timeout": args.heartbeat_timeout,
        "recover": args.recover,
        "recover_timeout": args.recover_timeout,
        "max_inflight": _max_inflight(args.max_inflight),
        "request_timeout": args.request_timeout,
        "max_buffered": args.max_buffered or None,
        "stream_interval": args.stream_interval,
        "insecure": args.insecure,
    }
    if args.advertise_host is not None:
        options["advertise_host"] = args.advertise_host
    options["routing"] = args.routing
    if not args.kv_events:
        if args.routing != "prefix" or args.vllm is None:
            raise SystemExit(
                "zmqdp serve: --no-kv-events is for --routing prefix with vLLM engines "
                "(--vllm MODEL_DIR): only they publish KV events"
            )
        options["kv_events"] = False
    if args.keys is not None:
        from ..keys import load_client_keys

        options["curve"] = load_client_keys(args.keys)
    common: dict[str, Any] = {
        "model": args.served_model_name or args.model,
        "api_key": api_key(args.api_key),
        "vllm_metric_names": args.vllm_metric_names or args.vllm is not None,
        "queue_timeout": args.queue_timeout,
        "retry_after": args.retry_after,
        "drain_timeout": args.drain_timeout,
        "drain_grace": args.drain_grace,
        "max_collected_tokens": args.max_collected_tokens or None,
        "max_collected_chars": args.max_collected_chars or None,
    }
    if args.mock:
        mock = MockConfig(
            engines=args.engines or 2,
            lockstep=args.lockstep,
            step_time=args.step_time,
            max_num_seqs=args.max_num_seqs,
            keys=args.keys,
        )
        return create_app(args.url, mock=mock, **common, **options)
    if args.url is None or args.engines is None:
        raise SystemExit(
            "zmqdp serve: give --url URL --engines N (or --data-parallel-size N), or --mock"
        )
    if args.vllm is not None:
        try:
            from .. import vllm
            from ..vllm.mock import model_directory
            from .vllm_frontend import VllmFrontend, load_chat_template
        except ImportError as exc:
            raise SystemExit(
                f"zmqdp serve --vllm needs the vllm extra ({exc.name} is missing): "
                "pip install 'zmqdp[vllm]'"
            ) from None
        try:  # (zmqdp-mock: the model directory shipped for `zmqdp mock --wire vllm`)
            template = (
                None if args.chat_template is None else load_chat_template(args.chat_template)
            )
            frontend = VllmFrontend(
                model_directory(args.vllm),
                max_model_len=args.max_model_len,
                tokenizer=None if args.tokenizer is None else model_directory(args.tokenizer),
                chat_template=template,
                generation_config=args.generation_config,
            )
        except ImportError as exc:
            raise SystemExit(
                f"zmqdp serve --vllm needs the vllm extra ({exc.name} is missing): "
                "pip install 'zmqdp[vllm]'"
            ) from None
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises its own
            raise SystemExit(f"zmqdp serve --vllm {args.vllm}: {exc}") from None
        if args.served_model_name is None and args.model == "zmqdp":
            common["model"] = args.vllm.rstrip("/")  # as vLLM names a model: its path
        wire = vllm.dialect(moe=args.moe)
        return create_app(args.url, args.engines, frontend=frontend, wire=wire, **common, **options)
    return create_app(args.url, args.engines, **common, **options)


def banner(url: str, server: str, app: GatewayApp) -> str:
    """What `serve` prints once it listens: the URL and a request to try."""
    group = app.group
    size = "" if group is None else f" over {group.size} rank(s)"
    # the key is a secret: not printed, its place shown (a try without it is a 401)
    auth = "" if app._bearer is None else " -H 'Authorization: Bearer KEY'"
    return (
        f"zmqdp gateway: serving{size} at {url} ({server})\n"
        f'  try: curl {url}/v1/completions{auth} -d \'{{"prompt":"hi","max_tokens":5}}\'\n'
        f"  probes: {url}/health {url}/ready   metrics: {url}/metrics\n"
        "  SIGTERM or Ctrl-C drains (/ready 503, live requests finish), then exits"
    )


def _announce(text: str) -> None:
    print(text, flush=True)


# -- hypercorn (trio) -------------------------------------------------------------------


async def serve_hypercorn(
    app: GatewayApp,
    host: str,
    port: int,
    *,
    announce: Callable[[str], None] = _announce,
    access_log: bool = False,
    startup_timeout: float = 70.0,
    max_connections: int | None = None,
    header_timeout: float = 5.0,
    root_path: str = "",
) -> None:
    """Serve `app` with hypercorn's trio worker until a signal drains it (module
    docstring). `announce` gets the banner once the server listens. `max_connections`
    and `header_timeout`: `--max-connections` and `--header-timeout`
    (`zmqdp.gateway.connections`); `root_path`: `--root-path`, the ASGI scope's."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.root_path = root_path
    config.accesslog = "-" if access_log else None
    # hypercorn's loggers as they are (under `logging.basicConfig`), not its own stderr
    # handler as well: each line once.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.startup_timeout = startup_timeout
    config.graceful_timeout = 5.0
    # hypercorn's default backlog (100) reset connections of a burst of 3000 clients
    # that uvicorn (2048) served; the kernel caps it at somaxconn anyway
    config.backlog = 2048
    # hypercorn's keep-alive timeout runs from a connection's start, and from each
    # response, until a request head is complete: the head deadline
    config.keep_alive_timeout = header_timeout
    cap = ConnectionCap(max_connections)
    install_hypercorn_cap(config, cap)
    install_hypercorn_fast_paths(config)
    stop = trio.Event()
    started = False

    with trio.open_signal_receiver(*SIGNALS) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_when_drained() -> None:
                await app.wait_drained()
                stop.set()

            async def on_signals() -> None:
                count = 0
                async for signum in signals:
                    name = signal.Signals(signum).name
                    count += 1
                    if started and count == 1:
                        log.warning("%s: draining, then stopping (again to stop now)", name)
                        app.begin_drain()
                        nursery.start_soon(stop_when_drained)
                    elif started and count == 2:
                        log.warning(
                            "%s: stopping now: live requests are answered 503 (again to "
                            "exit at once)",
                            name,
                        )
                        app.stop_now()
                    else:
                        log.warning("%s: stopping now", name)
                        nursery.cancel_scope.cancel()
                        return

            async def server(task_status: trio.TaskStatus[list[str]]) -> None:
                await serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)  # type: ignore[arg-type]
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signals)
            binds: list[str] = await nursery.start(server)
            started = True
            if app.group is not None:  # else the startup failed: hypercorn raises it next
                cap.settle(app.group.size)
                announce(banner(binds[0], "hypercorn, trio", app))


# -- uvicorn (asyncio) ------------------------------------------------------------------


def serve_uvicorn(
    app: GatewayApp,
    host: str,
    port: int,
    *,
    announce: Callable[[str], None] = _announce,
    access_log: bool = False,
    log_level: str = "info",
    max_connections: int | None = None,
    header_timeout: float = 5.0,
    http: str = "auto",
    root_path: str = "",
) -> int:
    """Serve `app` with uvicorn until a signal drains it (module docstring); returns the
    exit status. `max_connections` and `header_timeout`: as `serve_hypercorn`'s; `http`:
    its HTTP/1.1 implementation (`--http`, `zmqdp.gateway.connections.UVICORN_HTTP`)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's `Server`, with the first signal draining the app before
        `should_exit` (uvicorn's own handler stops accepting at once)."""

        loop: asyncio.AbstractEventLoop | None = None
        drain_task: asyncio.Task[None] | None = None
        signalled = False
        signals = 0

        async def startup(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if app.group is not None:
                cap.settle(app.group.size)
            if self.started and self.servers and self.servers[0].sockets:
                bound = self.servers[0].sockets[0].getsockname()
                where = f"http://{bound[0]}:{bound[1]}"
                loop = "uvloop" if type(self.loop).__module__.startswith("uvloop") else "asyncio"
                announce(banner(where, f"uvicorn, {loop}, {uvicorn_http_name(protocol)}", app))

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # A signal handler (main thread, between bytecodes): hand over to the loop.
            loop = self.loop
            self.signalled = True
            if self.started and loop is not None:
                self.signals += 1
                if self.signals == 1:
                    loop.call_soon_threadsafe(self._begin_drain, sig)
                    return
                if self.signals == 2:
                    loop.call_soon_threadsafe(self._stop_now, sig)
                    return
            self.should_exit = self.force_exit = True
            if not self.started and loop is not None:
                # uvicorn looks at should_exit only once the lifespan startup is over,
                # and that waits for every rank: stop the startup itself.
                log.warning("%s: stopping now", signal.Signals(sig).name)
                loop.call_soon_threadsafe(app.begin_drain)

        def _begin_drain(self, sig: int) -> None:
            log.warning("%s: draining, then stopping (again to stop now)", signal.Signals(sig).name)
            app.begin_drain()
            self.drain_task = asyncio.ensure_future(self._exit_when_drained())

        def _stop_now(self, sig: int) -> None:
            # Not `force_exit`: uvicorn would then stop without waiting for the
            # responses, and `asyncio.run` would cancel the live requests' tasks (bare
            # 500s, a CancelledError traceback each). The app answers them instead; the
            # drain, left with nothing to wait for, ends; `_exit_when_drained` follows.
            log.warning(
                "%s: stopping now: live requests are answered 503 (again to exit at once)",
                signal.Signals(sig).name,
            )
            app.stop_now()

        async def _exit_when_drained(self) -> None:
            await app.wait_drained()
            self.should_exit = True

    cap = ConnectionCap(max_connections)
    protocol = uvicorn_protocol(cap, header_timeout, http)
    config = uvicorn.Config(
        app,
        # uvloop when it is installed (the gateway extra installs it off Windows), else
        # asyncio's own loop: the measured rows of this flavour are on uvloop
        loop="auto",
        http=protocol,
        h11_max_incomplete_event_size=MAX_HEAD,
        host=host,
        port=port,
        lifespan="on",
        access_log=access_log,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=5,
        root_path=root_path,
    )
    server = DrainingServer(config)
    failed_bind = _FailedBind()
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(failed_bind)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 3 if the lifespan startup failed, 1 if its bind
        if server.signalled:
            return 0
        if failed_bind.error is not None:
            # The port was taken between `listen_problem` and uvicorn's bind (which comes
            # after the group connected): the same one line as before the group.
            advice = _bind_advice(host, port, failed_bind.error)
            print(f"zmqdp serve: {advice}", file=sys.stderr)
            return 1
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        uvicorn_log.removeFilter(failed_bind)
    return 0 if server.started or server.signalled else 1


class _FailedBind(logging.Filter):
    """Holds back uvicorn's log of a failed bind (it logs the bare `OSError`, then exits
    1) and keeps the error, for `serve_uvicorn` to say it as `serve` says it before the
    group connects."""

    error: OSError | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, OSError) and record.msg.errno in _BIND_ERRNOS:
            self.error = record.msg
            return False
        return True


# -- the command ------------------------------------------------------------------------


_BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL})
"""What a server's bind raises for a busy port or a host that is not this machine's."""


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_advice(host: str, port: int, error: OSError) -> str:
    """One line: why the server cannot listen on host:port, and what to do."""
    where = _where(host, port)
    if error.errno == errno.EADDRINUSE:
        return (
            f"cannot listen on {where}: the port is in use (another server?); choose "
            "another --port, or --port 0 for any free port"
        )
    if error.errno == errno.EACCES:
        return (
            f"cannot listen on {where}: permission denied (ports below 1024 need "
            "privileges); choose another --port, or --port 0 for any free port"
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot listen on {where}: {host} is not an address of this machine; use "
            "--host 127.0.0.1 (this machine only) or --host 0.0.0.0 (every interface)"
        )
    reason = error.strerror or str(error)
    return f"cannot listen on {where}: {reason}; check --host and --port"


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on `host:port` (one line naming it and a next step),
    or None if it can. It binds a socket there as hypercorn and uvicorn do (IPv6 if the
    host has a colon, SO_REUSEADDR) and closes it at once: checked before the engine
    group connects, which can take a while, rather than after. Port 0 (any free port)
    always can."""
    if port == 0:
        return None
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bare, port))
    except OSError as exc:  # socket.gaierror too: a host name that does not resolve
        return _bind_advice(bare, port, exc)
    return None


def _bind_error(error: BaseException) -> OSError | None:
    """The server's failed bind, if that is what `error` (a group, nested or not) is."""
    if isinstance(error, OSError):
        return error if error.errno in _BIND_ERRNOS else None
    if isinstance(error, BaseExceptionGroup):
        matched, rest = error.split(lambda e: isinstance(e, OSError) and e.errno in _BIND_ERRNOS)
        if matched is not None and rest is None:
            leaf = _first_leaf(matched)
            assert isinstance(leaf, OSError)
            return leaf
    return None


def _first_leaf(error: BaseException) -> BaseException:
    """The first exception of a (nested) group that is not a group."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


_CLI_WORDS = (
    ("raise ready_timeout", "raise --ready-timeout"),
    ("`ready_timeout`", "--ready-timeout"),
    ("pass insecure=True", "pass --insecure"),
    ("without `insecure=True`", "without --insecure"),
    (
        "pass advertise_host=<an address the engines can reach>",
        "pass --advertise-host HOST (an address the engines can reach)",
    ),
    (
        "Give the client CURVE keys (curve=load_client_keys(DIR), keys made by ",
        "Give --keys DIR (keys made by ",
    ),
    ("max_inflight='info'", "--max-inflight info"),
    ("recover_timeout=", "--recover-timeout "),
    ("heartbeat_timeout", "--heartbeat-timeout"),
)
"""The library's words for its options (right for a library user) and `serve`'s flags
for them: a `serve` error names what its user types."""
_LIBRARY_PREFIXES = ("ValueError: ", "PermissionError: ", "FileExistsError: ", "OSError: ")


def cli_text(message: str) -> str:
    """A library error's message in `serve`'s words (`_CLI_WORDS`), without the Python
    type of a plain configuration error."""
    for prefix in _LIBRARY_PREFIXES:
        if message.startswith(prefix):
            message = message[len(prefix) :]
            break
    for library, flag in _CLI_WORDS:
        message = message.replace(library, flag)
    return message


def start_command(args: argparse.Namespace) -> str:
    """How to start the engines `serve` waits for (each missing rank R)."""
    url: str = args.url or ""
    if args.vllm is None:
        keys = f" --keys {args.keys}" if args.keys else ""
        return f"python -m zmqdp mock --url {url} --engines {args.engines}{keys}"
    host, port = "HOST", "PORT"
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://") :].rpartition(":")
        if args.advertise_host:
            host = args.advertise_host
    command = (
        f"vllm serve {args.vllm} --headless --data-parallel-size {args.engines} "
        "--data-parallel-size-local 1 --data-parallel-start-rank R "
        f"--data-parallel-address {host} --data-parallel-rpc-port {port}"
    )
    from ..vllm.mock import MOCK_MODEL

    if os.path.basename(args.vllm.rstrip("/")) == MOCK_MODEL:  # trying it without vLLM
        moe = " --moe" if args.moe else ""
        command += (
            f" (or, without vLLM, the fake engines: zmqdp mock --wire vllm --url {url} "
            f"--engines {args.engines}{moe})"
        )
    return command


class StartupWatch(logging.Filter):
    """What `serve` says while the group connects, and once if it fails.

    * Progress: the ranks that came up (the transport's "rank N: up" lines, seen
      whatever the log level) and those still missing, with the command that starts
      them, every `interval` s (the first after `PROGRESS_FIRST`), from a thread, until
      the app has its group.
    * A failure, once: the app's "gateway startup failed" line and the server's own
      copies of it ("Application startup failed", hypercorn's "Running on" that follows)
      are held back; `run` prints `failure` in the CLI's words (`cli_text`) instead."""

    def __init__(self, app: GatewayApp, args: argparse.Namespace, level: int) -> None:
        super().__init__()
        self.app = app
        self.args = args
        self.level = level
        self.up: set[int] = set()
        self.failure: str | None = None
        self.done = threading.Event()
        self.started = time.monotonic()
        self._loggers = [
            logging.getLogger(name) for name in ("zmqdp", "zmqdp.gateway", "uvicorn.error")
        ]
        self._loggers.append(logging.getLogger("hypercorn.error"))
        self._saved = logging.getLogger("zmqdp").level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "zmqdp":
            args = record.args
            if record.msg == "rank %d: up (%s)" and isinstance(args, tuple) and args:
                rank = args[0]
                if type(rank) is int:
                    self.up.add(rank)
            return record.levelno >= self.level
        if record.name == "zmqdp.gateway" and record.msg == "gateway startup failed: %s":
            args = record.args
            self.failure = str(args[0]) if isinstance(args, tuple) and args else record.getMessage()
            return False
        text = record.getMessage()
        if record.name == "hypercorn.error" and text.startswith("Running on "):
            return False  # (the banner says where, once the group is up)
        return not (
            text == "Application startup failed. Exiting."
            or (self.failure is not None and text == self.failure)
        )

    def __enter__(self) -> StartupWatch:
        for logger in self._loggers:
            logger.addFilter(self)
        zmqdp_log = logging.getLogger("zmqdp")
        if zmqdp_log.getEffectiveLevel() > logging.INFO:
            # to see "rank N: up" under a higher --log-level; the root's handlers then
            # hold back what that level would not have shown (zmqdp's loggers below it)
            zmqdp_log.setLevel(logging.INFO)
            for handler in logging.getLogger().handlers:
                handler.addFilter(self._quiet)
        if self.args.mock or self.app.group is not None:
            return self
        threading.Thread(target=self._report, name="zmqdp-serve-progress", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for logger in self._loggers:
            logger.removeFilter(self)
        for handler in logging.getLogger().handlers:
            handler.removeFilter(self._quiet)
        logging.getLogger("zmqdp").setLevel(self._saved)

    def _quiet(self, record: logging.LogRecord) -> bool:
        """A root handler's filter: zmqdp's records below the chosen level are dropped."""
        zmqdp = record.name == "zmqdp" or record.name.startswith("zmqdp.")
        return not zmqdp or record.levelno >= self.level

    def _report(self) -> None:
        interval = max(0.05, self.args.progress_interval)
        wait = min(PROGRESS_FIRST, interval)
        while not self.done.wait(wait):
            wait = interval
            if self.app.group is not None or self.failure is not None:
                return
            print(self.progress(), file=sys.stderr, flush=True)

    def progress(self) -> str:
        """One report: the ranks up and missing, and how to start the missing."""
        engines: int = self.args.engines
        up = sorted(r for r in self.up if 0 <= r < engines)
        missing = [r for r in range(engines) if r not in self.up]
        waited = time.monotonic() - self.started
        ranks = ", ".join(map(str, up)) if up else "none"
        return (
            f"zmqdp serve: waiting for engines at {self.args.url} ({waited:.0f} s of "
            f"--ready-timeout {self.args.ready_timeout:g}): {len(up)} of {engines} ranks "
            f"up ({ranks}); missing: {', '.join(map(str, missing))}. Start each missing "
            f"rank R with: {start_command(self.args)}"
        )


def run(args: argparse.Namespace) -> int:
    """`python -m zmqdp serve ...`."""
    level = getattr(logging, args.log_level.upper(), logging.INFO)
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    raise_open_files_limit()  # before anything opens: see zmqdp.fdlimit
    if args.max_connections is not None and args.max_connections < 0:
        print("zmqdp serve: --max-connections must be >= 0 (0: no bound)", file=sys.stderr)
        return 2
    if not args.header_timeout > 0:
        print("zmqdp serve: --header-timeout must be > 0", file=sys.stderr)
        return 2
    if args.http == "httptools":
        import importlib.util

        if args.server != "uvicorn":
            print(
                "zmqdp serve: --http httptools is uvicorn's parser (hypercorn's is h11): drop "
                "--server hypercorn (uvicorn is the default)",
                file=sys.stderr,
            )
            return 2
        if importlib.util.find_spec("httptools") is None:
            print(
                "zmqdp serve: --http httptools needs httptools: pip install 'zmqdp[gateway]'",
                file=sys.stderr,
            )
            return 2
    app = app_from_args(args)  # the flags' errors first: they are the user's to fix
    problem = listen_problem(args.host, args.port)
    if problem is not None:  # before the group connects: one line, no traceback
        print(f"zmqdp serve: {problem}", file=sys.stderr)
        return 1
    if args.server == "uvicorn":
        try:
            import uvicorn  # noqa: F401

            import zmqdp.aio  # noqa: F401
        except ImportError as exc:
            print(
                f"zmqdp serve: --server uvicorn (the default) cannot start: {exc}; "
                "pip install 'zmqdp[gateway]', or --server hypercorn",
                file=sys.stderr,
            )
            return 2
        with StartupWatch(app, args, level) as watch:
            status = serve_uvicorn(
                app,
                args.host,
                args.port,
                access_log=args.access_log,
                log_level=args.log_level,
                max_connections=args.max_connections,
                header_timeout=args.header_timeout,
                http=args.http,
                root_path=args.root_path,
            )
        if watch.failure is not None:
            print(f"zmqdp serve: {cli_text(watch.failure)}", file=sys.stderr)
            return status or 1
        return status
    from hypercorn.utils import LifespanFailureError

    with StartupWatch(app, args, level) as watch:
        try:
            trio.run(
                partial(
                    serve_hypercorn,
                    app,
                    args.host,
                    args.port,
                    access_log=args.access_log,
                    startup_timeout=args.ready_timeout + 10,
                    max_connections=args.max_connections,
                    header_timeout=args.header_timeout,
                    root_path=args.root_path,
                )
            )
        except LifespanFailureError as exc:
            failure = watch.failure or str(exc)
        except (OSError, BaseExceptionGroup) as error:
            # The port was taken between `listen_problem` and hypercorn's own bind (which
            # comes after the group connected): the same one line, not the nested groups.
            bind = _bind_error(error)
            if bind is not None:
                print(f"zmqdp serve: {_bind_advice(args.host, args.port, bind)}", file=sys.stderr)
                return 1
            if not isinstance(error, BaseExceptionGroup):
                raise
            failed, rest = error.split(LifespanFailureError)
            if failed is None or rest is not None:
                raise
            failure = watch.failure or str(_first_leaf(failed))
        else:
            return 0
    print(f"zmqdp serve: {cli_text(failure)}", file=sys.stderr)
    return 1
