#!/usr/bin/env python3
"""The chaos soak (R4), long: `.venv/bin/python scripts/soak.py --requests 10000`.

Streams requests through an EngineGroup while the mock group is killed, frozen and
restarted, the client restarts, and the workload aborts, cancels and reuses ids; then
checks the history (tests/soak.py): every request ended exactly once, no output crossed
requests, outputs in order without gaps, no slot leaked. Exit status 1 on a violation.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.soak import SoakConfig, soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chaos-every", type=float, default=0.7, help="mean s between blows")
    args = parser.parse_args()
    cfg = SoakConfig(
        requests=args.requests,
        engines=args.engines,
        concurrency=args.concurrency,
        seed=args.seed,
        chaos_every=args.chaos_every,
        deadline=3600,
    )
    directory = tempfile.mkdtemp(prefix="zmqdp-soak-")
    try:
        report = trio.run(soak, f"ipc://{directory}/g", cfg)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"requests      {len(report.records)} in {report.seconds:.1f} s (seed {cfg.seed})")
    print(f"chaos         {report.chaos}")
    print(f"endings       {report.endings()}")
    print(f"refused       {report.refused} submits (no engine up, id live, group closed)")
    problems = report.violations()
    print(f"violations    {len(problems)}")
    for line in problems[:50]:
        print(f"  {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
