"""Long-run codec fuzz of both wires: the properties of tests/core/test_codec_fuzz.py
(zmqdp's CBOR) and tests/core/test_vllm_codec_fuzz.py (vLLM's msgpack), many more examples.

    .venv/bin/python scripts/fuzz_codec.py --examples 100000 [--seed N] [--wire cbor|vllm]

Runs every property of each wire's `PROPERTIES` (arbitrary bytes, byte-level mutations
of valid messages, hostile values inside valid messages, deep nesting among them) with
an even share of `--examples`, and prints, per property and decoder, how many inputs
were decoded, ignored (an unknown request type) or rejected with `ProtocolError`, the
slowest decode, and the total wall time. Exits with status 1 if a decoder raised
anything but `ProtocolError` or a check failed (the failing input is printed in hex,
truncated), or if a decode of an input under 64 KB took more than a second.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis.strategies import SearchStrategy  # noqa: E402

from tests.core import test_codec_fuzz, test_vllm_codec_fuzz  # noqa: E402
from tests.core.test_codec_fuzz import Case, Outcome  # noqa: E402


class Wire(NamedTuple):
    """One wire's fuzz: its properties, its decoders, and the function that runs one."""

    properties: dict[str, SearchStrategy[Case]]
    decoders: Sequence[str]
    exercise: Callable[..., list[Outcome]]


WIRES = {
    "cbor": Wire(test_codec_fuzz.PROPERTIES, test_codec_fuzz.DECODERS, test_codec_fuzz.exercise),
    "vllm": Wire(
        test_vllm_codec_fuzz.PROPERTIES,
        test_vllm_codec_fuzz.DECODERS,
        test_vllm_codec_fuzz.exercise,
    ),
}

SLOW_SECONDS = 1.0
SMALL_INPUT = 64 * 1024
RETIME_SECONDS = 0.02
"""A decode slower than this is timed again, three times with the garbage collector off,
and the fastest of those counts: a full collection over Hypothesis' own state (hundreds
of MB after tens of thousands of examples) can land inside any decode and take a second."""
HEX_LIMIT = 512


def _hex(data: bytes) -> str:
    text = data.hex()
    if len(text) <= HEX_LIMIT:
        return text
    return f"{text[:HEX_LIMIT]}... ({len(data)} bytes)"


def _describe(case: Case) -> str:
    return (
        f"target={case.target} kind={case.kind.hex() or '-'} view={case.view} "
        f"len={len(case.data)}\n    data={_hex(case.data)}"
    )


class Tally:
    """What one property saw: outcomes per decoder, the slowest decode, failures."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.slowest: dict[str, tuple[float, Case | None]] = {d: (0.0, None) for d in wire.decoders}
        self.slow: list[tuple[str, float, Case]] = []
        self.failure: tuple[Case, BaseException] | None = None
        self.inputs = 0
        self.noise = 0  # decodes that were slow once but not when timed again

    def _retime(self, case: Case, decoder: str) -> float:
        gc.collect()
        gc.disable()
        try:
            runs = [self.wire.exercise(case, round_trip=False) for _ in range(3)]
        finally:
            gc.enable()
        return min(o.seconds for outcomes in runs for o in outcomes if o.decoder == decoder)

    def run(self, case: Case) -> None:
        try:
            outcomes = self.wire.exercise(case)
        except BaseException as exc:
            self.failure = (case, exc)
            raise
        self.inputs += 1
        for decoder, result, seconds in outcomes:
            self.outcomes[decoder, result] += 1
            if seconds > RETIME_SECONDS:
                retimed = self._retime(case, decoder)
                self.noise += retimed <= RETIME_SECONDS
                seconds = retimed
            if seconds > self.slowest[decoder][0]:
                self.slowest[decoder] = (seconds, case)
            if seconds > SLOW_SECONDS and len(case.data) < SMALL_INPUT:
                self.slow.append((decoder, seconds, case))


def run_property(
    wire: Wire, strategy: SearchStrategy[Case], examples: int, seed: int | None
) -> Tally:
    tally = Tally(wire)

    def check(case: Case) -> None:
        if tally.failure is None:
            tally.run(case)
            return
        try:  # shrinking: keep the smallest failing input seen
            wire.exercise(case)
        except BaseException as exc:
            tally.failure = (case, exc)
            raise

    test = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )(given(strategy)(check))
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    try:
        test()
    except Exception:
        if tally.failure is None:  # a failure of Hypothesis itself, not of a decoder
            raise
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--examples", type=int, default=100_000, help="total, split evenly across properties"
    )
    parser.add_argument("--seed", type=int, default=None, help="Hypothesis seed")
    parser.add_argument(
        "--wire", choices=sorted(WIRES), action="append", help="only this wire (default: both)"
    )
    args = parser.parse_args(argv)
    wires = [WIRES[w] for w in args.wire or WIRES]
    properties = [(wire, n, s) for wire in wires for n, s in wire.properties.items()]
    per_property = max(1, -(-args.examples // len(properties)))  # at least --examples

    started = time.perf_counter()
    tallies: dict[str, Tally] = {}
    for wire, name, strategy in properties:
        t0 = time.perf_counter()
        tallies[name] = tally = run_property(wire, strategy, per_property, args.seed)
        gc.collect()
        print(f"{name}: {tally.inputs} inputs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    wall = time.perf_counter() - started

    header = f"{'property':<20} {'decoder':<27} {'decoded':>8} {'ignored':>8} {'rejected':>9}"
    print(f"{header} {'slowest ms':>11}")
    print("-" * (len(header) + 12))
    failed = False
    for name, tally in tallies.items():
        for decoder in tally.wire.decoders:
            counts = [tally.outcomes[decoder, r] for r in ("decoded", "ignored", "rejected")]
            if not any(counts):
                continue
            slowest = tally.slowest[decoder][0] * 1000
            print(
                f"{name:<20} {decoder:<27} {counts[0]:>8} {counts[1]:>8} {counts[2]:>9} "
                f"{slowest:>11.2f}"
            )
        print(
            f"{name:<20} {'(inputs)':<27} {tally.inputs:>8}"
            f"   ({tally.noise} slow once, not when timed again)"
        )
    print(f"\ntotal wall time: {wall:.1f} s ({sum(t.inputs for t in tallies.values())} inputs)")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")

    for name, tally in tallies.items():
        decoder, (seconds, case) = max(tally.slowest.items(), key=lambda item: item[1][0])
        if case is not None:
            print(f"\n{name}: slowest {decoder} {seconds * 1000:.2f} ms on {_describe(case)}")
        for decoder, seconds, case in tally.slow:
            failed = True
            print(f"\nSLOW ({name}, {decoder}, {seconds:.2f} s): {_describe(case)}")
        if tally.failure is not None:
            failed = True
            case, exc = tally.failure
            print(f"\nFAILURE in {name!r}: {type(exc).__name__}: {str(exc)[:1000]}")
            print(f"    {_describe(case)}")
            traceback.print_exception(exc, limit=-6)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
