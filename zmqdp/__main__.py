"""Command line: `python -m zmqdp demo` (the main job), `python -m zmqdp mock`,
`python -m zmqdp keys` (CURVE keys for a group) and `python -m zmqdp serve` (the
OpenAI-compatible HTTP gateway, `zmqdp.gateway`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import trio

from . import __version__


def _mock_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the group URL the client binds")
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
        help="dead=N, silent=N, garbage=N, rejoin=N, slow=F, bad_hello=size|lockstep",
    )
    parser.add_argument(
        "--keys", default=None, metavar="DIR", help="connect with CURVE keys from DIR"
    )
    parser.add_argument("--log-level", default="WARNING")


def run_mock(args: argparse.Namespace) -> int:
    from .mock import MockConfig, merge_faults, parse_fault, run_mock_group

    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
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
        ranks=None if args.ranks is None else tuple(int(r) for r in args.ranks.split(",")),
    )

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(run_mock_group, args.url, cfg)
                kind = "lockstep" if cfg.lockstep else "independent"
                n = cfg.engines if cfg.ranks is None else len(cfg.ranks)
                print(f"zmqdp mock: {n} {kind} ranks up at {args.url}", flush=True)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)
    return 0


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


def _serve_parser(parser: argparse.ArgumentParser) -> None:
    try:
        from .gateway.serve import add_arguments
    except ImportError as exc:  # the gateway extra is not installed
        parser.set_defaults(serve_missing=str(exc))
        return
    add_arguments(parser)


def run_serve(args: argparse.Namespace) -> int:
    missing = getattr(args, "serve_missing", None)
    if missing is not None:
        print(
            f"zmqdp serve: {missing}; install the gateway extra: pip install 'zmqdp[gateway]'",
            file=sys.stderr,
        )
        return 2
    from .gateway.serve import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    from .demo import build_parser
    from .demo import main as demo_main

    parser = argparse.ArgumentParser(prog="python -m zmqdp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"zmqdp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    build_parser(sub.add_parser("demo", help="stream a workload through a mock engine group"))
    _mock_parser(sub.add_parser("mock", help="run a mock engine group"))
    _keys_parser(sub.add_parser("keys", help="generate CURVE keys for a client and its engines"))
    _serve_parser(
        sub.add_parser(
            "serve",
            help="serve OpenAI /v1/completions over an engine group (--mock: a mock group)",
        )
    )
    args = parser.parse_args(argv)
    if args.command == "mock":
        return run_mock(args)
    if args.command == "keys":
        return run_keys(args)
    if args.command == "serve":
        return run_serve(args)
    return demo_main(args)


if __name__ == "__main__":
    sys.exit(main())
