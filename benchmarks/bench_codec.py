"""Cost of zmqdp's strict decoding against a bare `cbor2.loads` in the same process.

    .venv/bin/python benchmarks/bench_codec.py

The baseline is what a codec that skipped docs/protocol.md §8 would pay (cbor2 alone ignores
trailing bytes, decodes tags and returns untyped dicts). The ratio is the price of the
§8 scan plus typed messages; absolute microseconds are printed only as context.
"""

from __future__ import annotations

import statistics
import timeit

import cbor2

from zmqdp._core import cbor
from zmqdp._core.codec import decode_batch, encode_request
from zmqdp._core.messages import Add


def batch(outputs: int) -> bytes:
    return cbor2.dumps(
        {
            "rank": 1,
            "seq": 1234,
            "outputs": [
                {"id": f"req-{i}", "body": {"token": 1000 + i, "logprob": -0.25}, "finish": None}
                for i in range(outputs)
            ],
            "load": {"waiting": 3, "running": 17, "kv": 0.42},
        }
    )


def best(fn: object, number: int) -> float:
    runs = timeit.repeat(fn, number=number, repeat=7)  # type: ignore[arg-type]
    return min(runs) / number * 1e6


def main() -> None:
    print(f"{'case':<34}{'baseline µs':>12}{'zmqdp µs':>10}{'ratio':>8}")
    ratios = []
    for n in (1, 8, 64):
        data = batch(n)
        base = best(lambda d=data: cbor2.loads(d), 20000 // n)
        ours = best(lambda d=data: decode_batch(d), 20000 // n)
        ratios.append(ours / base)
        name = f"decode batch, {n} outputs ({len(data)} B)"
        print(f"{name:<34}{base:>12.2f}{ours:>10.2f}{ours / base:>8.2f}")
    eight = batch(8)
    strict = best(lambda: cbor.loads(eight), 20000)
    print(f"{'  strict loads alone (8 outputs)':<34}{'':>12}{strict:>10.2f}")
    body = {"prompt": list(range(64)), "max_tokens": 128}
    base = best(lambda: cbor2.dumps({"id": "req-1", "body": body}), 20000)
    ours = best(lambda: encode_request(Add("req-1", body)), 20000)
    print(f"{'encode ADD (64-token prompt)':<34}{base:>12.2f}{ours:>10.2f}{ours / base:>8.2f}")
    print(f"median decode ratio: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
