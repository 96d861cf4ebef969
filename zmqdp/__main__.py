"""Command line: `python -m zmqdp demo` (the main job) and `python -m zmqdp mock`."""

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
    )

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(run_mock_group, args.url, cfg)
                kind = "lockstep" if cfg.lockstep else "independent"
                print(f"zmqdp mock: {cfg.engines} {kind} ranks up at {args.url}", flush=True)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .demo import build_parser
    from .demo import main as demo_main

    parser = argparse.ArgumentParser(prog="python -m zmqdp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"zmqdp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    build_parser(sub.add_parser("demo", help="stream a workload through a mock engine group"))
    _mock_parser(sub.add_parser("mock", help="run a mock engine group"))
    args = parser.parse_args(argv)
    if args.command == "mock":
        return run_mock(args)
    return demo_main(args)


if __name__ == "__main__":
    sys.exit(main())
