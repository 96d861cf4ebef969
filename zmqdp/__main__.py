"""Command line: `zmqdp demo` (the main job), `zmqdp mock`, `zmqdp keys` (CURVE keys
for a group) and `zmqdp serve` (the OpenAI-compatible HTTP gateway, `zmqdp.gateway`);
`python -m zmqdp ...` is the same."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shlex
import signal
import sys
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from .mock import MockConfig


def _unshadow() -> None:
    """Make `python -m zmqdp` work in a directory that holds a `zmqdp/` folder of its own.

    Python puts the current directory first on `sys.path`, and takes a `zmqdp/` folder
    there without an `__init__.py` (the ipc socket directory of `ipc:///tmp/zmqdp/g`, run
    from /tmp) for a namespace package. With zmqdp installed editable (setuptools' import
    hook rather than a path on `sys.path`), that namespace package hides the real one:
    `runpy` still finds this file, but `zmqdp` has no `__version__` and no submodules. Load
    the real package, the directory of this file, under its name: nothing of the empty
    namespace package has been used yet. A no-op in every other case (a regular install,
    the `zmqdp` console script, an import of this module)."""
    package = sys.modules.get("zmqdp")
    if package is None or getattr(package, "__file__", None) is not None:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "zmqdp", os.path.join(here, "__init__.py"), submodule_search_locations=[here]
    )
    if spec is None or spec.loader is None:  # pragma: no cover - a file path always has one
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["zmqdp"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules["zmqdp"] = package
        raise


_unshadow()


VLLM_MOCK_URL = "tcp://127.0.0.1:29550"
"""`zmqdp mock --wire vllm`'s default URL: vLLM's default data-parallel address and RPC
port (``--data-parallel-rpc-port 29550``), which the frontend binds."""
VLLM_MOCK_EOS_AFTER = 128
"""`zmqdp mock --wire vllm`'s default ``--eos-after``: answers end as a model's do, so
that a client that sends no max_tokens (aiperf's default run) gets answers of a few
seconds rather than the whole context."""


def _mock_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wire",
        choices=("native", "vllm"),
        default="native",
        help="native (default): zmqdp's own engines; vllm: fake vLLM engine cores "
        "(headless, vLLM's engine-core wire) for `zmqdp serve --vllm`, no vLLM needed",
    )
    parser.add_argument(
        "--url",
        default=None,
        help="the group URL the client binds, e.g. ipc:///tmp/zmqdp-g1/g (the client "
        f"creates its directory); required, but with --wire vllm: default {VLLM_MOCK_URL} "
        "(vLLM's)",
    )
    parser.add_argument(
        "--engines",
        "--data-parallel-size",
        type=int,
        default=None,
        help="ranks to run; required, but with --wire vllm: default 2",
    )
    parser.add_argument("--lockstep", action="store_true", help="ranks step together")
    parser.add_argument(
        "--ranks",
        default=None,
        metavar="R[,R...]",
        help="run only these ranks of the group (independent groups; one engine process "
        "per rank, as for fault tests)",
    )
    parser.add_argument("--step-time", type=float, default=0.01, help="seconds per step")
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="running per rank (16; --wire vllm 256)"
    )
    parser.add_argument("--sync-interval", type=int, default=4)
    parser.add_argument("--self-wake", action="store_true", help="ADD while parked runs at once")
    parser.add_argument(
        "--no-wave-agreement", action="store_true", help="skip the spec's SHOULD at sync"
    )
    parser.add_argument(
        "--skew", type=float, default=0.0, help="rank r handles inbound messages r*SKEW s late"
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="RANK:KIND[=N]",
        help="dead=N, silent=N, garbage=N, rejoin=N (every N outputs; rejoins=K: only K "
        "times), slow=F, bad_hello=size|lockstep",
    )
    parser.add_argument(
        "--keys", default=None, metavar="DIR", help="connect with CURVE keys from DIR"
    )
    parser.add_argument("--log-level", default="WARNING")
    vllm = parser.add_argument_group("--wire vllm")
    vllm.add_argument(
        "--model",
        default=None,
        metavar="NAME|DIR",
        help="the model the engines pretend to run: its context and tokenizer (default "
        "zmqdp-mock, the directory shipped with zmqdp; `zmqdp serve --vllm zmqdp-mock` "
        "finds it too)",
    )
    vllm.add_argument(
        "--max-model-len", type=int, default=None, help="the context (default: the model's)"
    )
    vllm.add_argument(
        "--eos-after",
        type=int,
        default=VLLM_MOCK_EOS_AFTER,
        metavar="N",
        help="an answer ends with the model's EOS token as its N-th token (finish 'stop'; "
        f"not with ignore_eos); 0: never (to max_tokens or the context); default "
        f"{VLLM_MOCK_EOS_AFTER}",
    )
    vllm.add_argument("--moe", action="store_true", help="MoE ranks (vLLM's DP waves)")
    vllm.add_argument(
        "--vllm-version", choices=("0.32", "0.33"), default="0.33", help="the wire played"
    )
    vllm.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (vLLM's --block-size)"
    )
    vllm.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=27000,
        help="KV blocks per engine: its prefix cache's capacity",
    )
    vllm.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="no prefix cache (vLLM's --no-enable-prefix-caching): num_cached_tokens is 0",
    )
    vllm.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        metavar="US",
        help="microseconds of prefill per uncached prompt token (so cache hits show in TTFT)",
    )
    vllm.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV events as vLLM's engines do with this --kv-events-config, e.g. "
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5657"} (the exact mode of serve --routing prefix); '
        "rank R binds each tcp port + R, as vLLM's engines do, so the two ports must be "
        "at least --engines apart (or tcp://*:0: ports the OS picks)",
    )


def mock_banner(
    url: str,
    engines: int,
    ranks: tuple[int, ...] | None,
    lockstep: bool,
    keys: str | None = None,
) -> str:
    """The line the mock prints as it starts, before any client is there: what it runs
    and the client's call that binds it (`curve=` with `--keys`, `insecure=True` for a
    tcp URL without them: the client refuses a plain tcp URL)."""
    which = range(engines) if ranks is None else ranks
    kind = "a lockstep" if lockstep else "an independent"
    extra = ""
    if keys is not None:
        extra = f", curve=zmqdp.keys.load_client_keys({keys!r})"
    elif url.startswith("tcp://"):
        extra = ", insecure=True"
    return (
        f"zmqdp mock: mock engines for rank(s) {', '.join(map(str, which))} of {kind} "
        f"group of {engines}, connecting to {url}; waiting for a client to bind it: "
        f"EngineGroup.connect({url!r}, {engines}{extra})"
    )


def _ranks(text: str | None, engines: int) -> tuple[int, ...] | None:
    if text is None:
        return None
    ranks = tuple(int(r) for r in text.split(","))  # (ValueError: int's own message)
    if not all(0 <= r < engines for r in ranks):
        raise ValueError(f"--ranks: each rank must be from 0 to {engines - 1}")
    return ranks


def mock_config(args: argparse.Namespace) -> MockConfig:
    """The `MockConfig` of `zmqdp mock`'s arguments (`zmqdp.mock.mock_command` is the
    inverse); `ValueError` for a bad `--fault` or `--ranks`."""
    from .mock import MockConfig, merge_faults, parse_fault

    problem = _wire_problem(args)
    if problem is not None:
        raise ValueError(problem)
    missing = [f"--{n}" for n in ("url", "engines") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"the following arguments are required: {', '.join(missing)}")
    ranks = _ranks(args.ranks, args.engines)
    cfg = MockConfig(
        engines=args.engines,
        lockstep=args.lockstep,
        step_time=args.step_time,
        max_num_seqs=16 if args.max_num_seqs is None else args.max_num_seqs,
        sync_interval=args.sync_interval,
        self_wake=args.self_wake,
        wave_agreement=not args.no_wave_agreement,
        skew=args.skew,
        faults=merge_faults([parse_fault(f) for f in args.fault]),
        keys=args.keys,
        ranks=ranks,
    )
    if cfg.ranks is not None and cfg.lockstep:
        raise ValueError("--ranks: lockstep ranks step together: run them all in one process")
    return cfg


def run_mock(args: argparse.Namespace) -> int:
    from functools import partial

    from .fdlimit import raise_open_files_limit
    from .mock import MockRejected, run_mock_group

    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    raise_open_files_limit(report=False)  # room for many ranks' sockets (zmqdp.fdlimit)
    if args.wire == "vllm":
        return run_vllm_mock(args)
    try:
        cfg = mock_config(args)
    except ValueError as exc:  # bad --fault or --ranks: one line, like argparse's errors
        print(f"zmqdp mock: error: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def stop_on_signal() -> None:  # from the start: no client may come
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(stop_on_signal)
                # said at once: the ranks are up only once a client has bound the URL
                banner = mock_banner(args.url, cfg.engines, cfg.ranks, cfg.lockstep, cfg.keys)
                print(banner, flush=True)
                try:
                    up = await nursery.start(
                        partial(run_mock_group, wait_for_client=True), args.url, cfg
                    )
                except MockRejected as exc:  # no rank serves: say why, and exit
                    print(f"zmqdp mock: error: {exc}", file=sys.stderr, flush=True)
                    nursery.cancel_scope.cancel()
                    return 1
                kind = "lockstep" if cfg.lockstep else "independent"
                ranks = ", ".join(map(str, up))
                print(f"zmqdp mock: {kind} rank(s) {ranks} up at {args.url}", flush=True)
                return 0
        return 0  # pragma: no cover - a signal before the ranks settled

    return trio.run(main)


NATIVE_ONLY = {
    "lockstep": False,
    "self_wake": False,
    "no_wave_agreement": False,
    "skew": 0.0,
    "fault": [],
    "keys": None,
}
VLLM_ONLY = {
    "model": None,
    "max_model_len": None,
    "eos_after": VLLM_MOCK_EOS_AFTER,
    "moe": False,
    "vllm_version": "0.33",
    "block_size": 16,
    "num_gpu_blocks": 27000,
    "no_prefix_cache": False,
    "prefill_us_per_token": 0.0,
    "kv_events_config": None,
}


def _kv_events_config(text: str | None, engines: int) -> dict[str, Any] | None:
    """`--kv-events-config`: vLLM's JSON form (a JSON object; ValueError otherwise), whose
    sockets the group's ranks can all bind: vLLM's engines offset a tcp port by their
    rank and leave other endpoints as given (`ZmqEventPublisher.offset_endpoint_port`),
    so a clash only shows as one rank's bind failing, after the others started."""
    if text is None:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config: not JSON ({exc.msg})") from None
    if not isinstance(config, dict):
        raise ValueError("--kv-events-config: a JSON object, as vLLM's")
    if not config.get("enable_kv_cache_events"):
        return config  # nothing published, nothing bound (as vLLM's engines)
    ports: dict[str, tuple[str, int]] = {}
    for key in ("endpoint", "replay_endpoint"):
        endpoint = config.get(key, "tcp://*:5557" if key == "endpoint" else None)
        if endpoint is None:
            continue
        if not isinstance(endpoint, str):
            raise ValueError(f"--kv-events-config: {key} must be a string, not {endpoint!r}")
        if endpoint.startswith("tcp://"):
            host, _, port = endpoint[6:].rpartition(":")
            if not port.isdigit() or int(port) > 65535:
                raise ValueError(f"--kv-events-config: {key} {endpoint}: no tcp port")
            if int(port):  # 0: the OS picks a free port for each rank
                ports[key] = (host, int(port))
        elif engines > 1 and not endpoint.startswith("inproc://"):
            raise ValueError(
                f"--kv-events-config: {key} {endpoint}: every rank would bind this same "
                "endpoint (vLLM offsets only tcp ports by the rank); use tcp://*:PORT"
            )
    if len(ports) == 2:
        (host, a), (other, b) = ports["endpoint"], ports["replay_endpoint"]
        wildcard = {"*", "0.0.0.0", "[::]"}
        if (host == other or {host, other} & wildcard) and abs(a - b) < engines:
            raise ValueError(
                f"--kv-events-config: endpoint port {a} and replay_endpoint port {b} clash: "
                f"rank R binds each port + R (as vLLM's engines), so {engines} ranks need "
                f"them at least {engines} apart (e.g. replay_endpoint tcp://{host}:{a + 100}), "
                "or tcp://*:0 for ports the OS picks"
            )
    return config


def _wire_problem(args: argparse.Namespace) -> str | None:
    """An option of the other wire, given (None: none)."""
    other = NATIVE_ONLY if args.wire == "vllm" else VLLM_ONLY
    given = [k for k, default in other.items() if getattr(args, k) != default]
    if not given:
        return None
    names = ", ".join("--" + k.replace("_", "-") for k in given)
    if args.wire == "vllm":
        return f"{names}: for --wire native (--moe runs MoE ranks: vLLM's lockstep)"
    return f"{names}: for --wire vllm"


def vllm_mock_serve_command(
    url: str,
    engines: int,
    model: str,
    moe: bool = False,
    prog: str | None = None,
    kv_events: bool = False,
) -> str:
    """The `zmqdp serve --vllm` command line that fronts `zmqdp mock --wire vllm`'s
    engines (what the mock prints as it starts); engines that publish KV events are
    there for prefix affinity's exact mode, so the command routes by prefix."""
    parts = [prog or _prog(), "serve", "--vllm", model, "--url", url, "--engines", str(engines)]
    if moe:
        parts.append("--moe")
    if kv_events:
        parts += ["--routing", "prefix"]
    if url.startswith("tcp://"):
        parts.append("--insecure")
    return " ".join(shlex.quote(p) if p != parts[0] else p for p in parts)


def vllm_mock_banner(
    url: str,
    engines: int,
    ranks: tuple[int, ...] | None,
    model: str,
    model_dir: str,
    max_model_len: int,
    moe: bool,
    version: str,
    kv_events: bool = False,
) -> str:
    """What `zmqdp mock --wire vllm` prints as it starts: what it runs, and on a line of
    its own the frontend's command that connects to it."""
    which = range(engines) if ranks is None else ranks
    kind = "MoE" if moe else "dense"
    return (
        f"zmqdp mock: fake vLLM {version} engine cores for rank(s) "
        f"{', '.join(map(str, which))} of a {kind} data-parallel group of {engines} "
        f"(as `vllm serve {model} --headless --data-parallel-size {engines}`), model "
        f"{model_dir} ({max_model_len}-token context), connecting to {url}. Start the "
        "frontend with:\n"
        f"    {vllm_mock_serve_command(url, engines, model, moe, kv_events=kv_events)}"
    )


def run_vllm_mock(args: argparse.Namespace) -> int:
    """`zmqdp mock --wire vllm`: fake vLLM engine cores until SIGINT or SIGTERM (exit
    status 0), or until every rank stopped (1: a rank refused the frontend's init)."""
    from .vllm.mock import (
        MOCK_MODEL,
        FakeVllmGroup,
        model_directory,
        model_settings,
        run_fake_group,
    )

    problem = _wire_problem(args)
    url = args.url or VLLM_MOCK_URL
    engines = 2 if args.engines is None else args.engines
    model = args.model or MOCK_MODEL
    directory = model_directory(model)
    try:
        if problem is not None:
            raise ValueError(problem)
        if engines < 1:
            raise ValueError("--engines: at least 1")
        ranks = _ranks(args.ranks, engines)
        if not (directory / "tokenizer.json").is_file():
            raise ValueError(
                f"--model {model}: no tokenizer.json in {directory} (a Hugging Face model "
                f"directory; or {MOCK_MODEL}, the one shipped with zmqdp)"
            )
        if args.eos_after < 0:
            raise ValueError("--eos-after: 0 (never) or more")
        if args.block_size < 1 or args.num_gpu_blocks < 1:
            raise ValueError("--block-size and --num-gpu-blocks: at least 1")
        if args.prefill_us_per_token < 0:
            raise ValueError("--prefill-us-per-token: 0 or more")
        kv_events = _kv_events_config(args.kv_events_config, engines)
    except ValueError as exc:
        print(f"zmqdp mock: error: {exc}", file=sys.stderr)
        return 2
    if kv_events is not None and not kv_events.get("enable_kv_cache_events"):
        print(
            'zmqdp mock: note: --kv-events-config without "enable_kv_cache_events": true: '
            "the engines publish no KV events (as vLLM's)",
            file=sys.stderr,
        )
    settings = model_settings(directory)
    if args.max_model_len is not None:
        settings["max_model_len"] = args.max_model_len
    group = FakeVllmGroup(
        url,
        engines,
        moe=args.moe,
        sync_interval=args.sync_interval,
        step_delay=args.step_time,
        version=args.vllm_version,
        max_num_seqs=256 if args.max_num_seqs is None else args.max_num_seqs,
        eos_after=args.eos_after or None,
        prefix_cache=not args.no_prefix_cache,
        prefill_per_token=args.prefill_us_per_token / 1e6,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_events=kv_events,
        **settings,
    )
    stopped: dict[int, str] = {}
    started = set(range(engines) if ranks is None else ranks)

    def report(rank: int, why: str | None) -> None:
        if why is None:
            print(f"zmqdp mock: rank {rank} up (handshake with the frontend done)", flush=True)
            return
        stopped[rank] = why
        print(f"zmqdp mock: rank {rank} stopped: {why}", file=sys.stderr, flush=True)

    async def main() -> int:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def stop_on_signal() -> None:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(stop_on_signal)
                banner = vllm_mock_banner(
                    url,
                    engines,
                    ranks,
                    model,
                    str(directory),
                    group.max_model_len,
                    args.moe,
                    args.vllm_version,
                    kv_events=bool(kv_events and kv_events.get("enable_kv_cache_events")),
                )
                print(banner, flush=True)
                await run_fake_group(group, ranks, report)
                nursery.cancel_scope.cancel()
        return 1 if stopped.keys() >= started else 0

    return trio.run(main)


def _keys_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="where to write the key files")
    parser.add_argument("--engines", type=int, required=True, help="ranks to make keys for")
    parser.add_argument("--force", action="store_true", help="replace existing key files")


def run_keys(args: argparse.Namespace) -> int:
    from .keys import generate_keys

    try:
        files = generate_keys(args.directory, args.engines, force=args.force)
    except (OSError, ValueError) as exc:
        # Expected failures (existing keys, permissions, bad arguments): one line, no
        # traceback, exit status 2 like argparse's usage errors.
        print(f"zmqdp keys: error: {exc}", file=sys.stderr)
        return 2
    last = args.engines - 1
    print(f"zmqdp keys: wrote {len(files)} files for a client and {args.engines} engine(s):")
    for file in files:
        print(f"  {file}")
    print(
        "copy to the client machine: client.key_secret, "
        + ", ".join(f"rank-{r}.key" for r in range(min(args.engines, 3)))
        + (f", ..., rank-{last}.key" if args.engines > 3 else "")
    )
    print("copy to the machine of engine r: rank-r.key_secret and client.key")
    print("secret files (*.key_secret) must stay mode 0600 and never leave their machine")
    return 0


SERVE_INSTALL_HINT = (
    "install it from the source (zmqdp is not on PyPI): "
    "pip install -e '.[gateway]' in the clone, or pip install '/path/to/zmqdp[gateway]' "
    "(README.md, Install)"
)


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help = (
        "serve OpenAI completions, chat completions and models over an engine group "
        "(--mock: a mock group)"
    )
    try:
        from .gateway.serve import add_arguments
    except ImportError as exc:  # the gateway extra is not installed
        # No options and no -h: `main` then lets every `serve ...` through (`serve
        # --mock`, `serve --help`), and `run_serve` says what is missing and how to
        # install it, rather than "unrecognized arguments" or an empty option list.
        parser = sub.add_parser("serve", help=f"{help} [needs the gateway extra]", add_help=False)
        parser.set_defaults(serve_missing=str(exc))
        return
    add_arguments(sub.add_parser("serve", help=help))


def run_serve(args: argparse.Namespace) -> int:
    missing = getattr(args, "serve_missing", None)
    if missing is not None:
        print(
            f"zmqdp serve: the gateway extra is not installed ({missing}); {SERVE_INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2
    from .gateway.serve import run

    return run(args)


def _prog() -> str:
    """`zmqdp` when run as the console script, else `python -m zmqdp`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    stem = os.path.splitext(name)[0]  # zmqdp.exe on Windows
    return "zmqdp" if stem in ("zmqdp", "zmqdp-script") else "python -m zmqdp"


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The command line (`zmqdp`, `python -m zmqdp`); returns the exit status."""
    from . import __version__
    from .demo import build_parser
    from .demo import main as demo_main

    parser = argparse.ArgumentParser(prog=prog or _prog(), description=__doc__)
    parser.add_argument("--version", action="version", version=f"zmqdp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    build_parser(sub.add_parser("demo", help="stream a workload through a mock engine group"))
    _mock_parser(sub.add_parser("mock", help="run a mock engine group"))
    _keys_parser(sub.add_parser("keys", help="generate CURVE keys for a client and its engines"))
    _serve_parser(sub)
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "serve_missing", None) is None:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")  # as parse_args says
    if args.command == "mock":
        return run_mock(args)
    if args.command == "keys":
        return run_keys(args)
    if args.command == "serve":
        return run_serve(args)
    return demo_main(args)


if __name__ == "__main__":
    sys.exit(main())
