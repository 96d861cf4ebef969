"""`python -m zmqdp demo`: the main job. Until the demo lands it says what is there."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zmqdp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="stream a workload through a mock engine group")
    sub.add_parser("version", help="print the version")
    args = parser.parse_args(argv)
    if args.command == "version":
        print(__version__)
        return 0
    print(f"zmqdp {__version__}")
    print(
        "The demo (a mock engine group streaming a workload) is coming with the client.\n"
        "What is here now: the sans-IO core (codec, routing, wave clock, request\n"
        "lifecycle) and its property tests: python3 dev.py check"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
