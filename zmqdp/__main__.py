"""Command line: `zmqdp demo` (the main job), `zmqdp mock`, `zmqdp keys` (CURVE keys
for a group) and `zmqdp serve` (the OpenAI-compatible HTTP gateway, `zmqdp.gateway`);
`python -m zmqdp ...` is the same."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

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


def _mock_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        required=True,
        help="the group URL the client binds, e.g. ipc:///tmp/zmqdp-g1/g (the client "
        "creates its directory)",
    )
    parser.add_argument("--engines", type=int, required=True, help="ranks to run")
    parser.add_argument("--lockstep", action="store_true", help="ranks step together")
    parser.add_argument(
        "--ranks",
        default=None,
        metavar="R[,R...]",
        help="run only these ranks of the group (independent groups; one engine process "
        "per rank, as for fault tests)",
    )
    parser.add_argument("--step-time", type=float, default=0.01, help="seconds per step")
    parser.add_argument("--max-num-seqs", type=int, default=16)
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


def mock_config(args: argparse.Namespace) -> MockConfig:
    """The `MockConfig` of `zmqdp mock`'s arguments (`zmqdp.mock.mock_command` is the
    inverse); `ValueError` for a bad `--fault` or `--ranks`."""
    from .mock import MockConfig, merge_faults, parse_fault

    ranks = None if args.ranks is None else tuple(int(r) for r in args.ranks.split(","))
    cfg = MockConfig(
        engines=args.engines,
        lockstep=args.lockstep,
        step_time=args.step_time,
        max_num_seqs=args.max_num_seqs,
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
    if cfg.ranks is not None and not all(0 <= r < cfg.engines for r in cfg.ranks):
        raise ValueError(f"--ranks: each rank must be from 0 to {cfg.engines - 1}")
    return cfg


def run_mock(args: argparse.Namespace) -> int:
    from functools import partial

    from .fdlimit import raise_open_files_limit
    from .mock import MockRejected, run_mock_group

    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    raise_open_files_limit(report=False)  # room for many ranks' sockets (zmqdp.fdlimit)
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
