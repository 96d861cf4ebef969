"""The per-output hot path (issue 21): no output the dispatcher buffers for a consumer is
tracked by Python's cyclic garbage collector, on either wire, and outputs keep the
shape they had as named tuples (they unpack).

Why it matters: every tracked object that waits in a stream buffer is walked by each
young-generation collection until a consumer takes it; with two tracked objects per
output (`Output` and `VllmOutput` named tuples) collections were 39 % of the client's
CPU at 256 x 256 on vLLM's wire. Made tracked again (named tuples), these tests fail.
"""

from __future__ import annotations

import gc
from pathlib import Path

import trio

from tests.fakes.vllm import output_entry, outputs_message
from zmqdp import Output, Request
from zmqdp._core.codec import decode_batch, decode_batch_sliced, encode_batch
from zmqdp._core.messages import OutputBatch
from zmqdp.vllm import VllmOutput
from zmqdp.vllm.codec import decode_outputs

from .helpers import group_of
from .test_vllm_group import req, vllm_group


def _untracked(out: Output) -> bool:
    return not gc.is_tracked(out) and not (
        isinstance(out.body, VllmOutput) and gc.is_tracked(out.body)
    )


def test_decoded_outputs_are_untracked_on_both_wires() -> None:
    native = encode_batch(
        OutputBatch(rank=0, outputs=(Output("a#0", [1, 2]), Output("b#1", "x", "stop")))
    )
    whole = decode_batch(native).outputs
    sliced, cursor = decode_batch_sliced(native, 1)
    rest = cursor.next_slice(8)[0] if cursor is not None else ()
    vllm = decode_outputs(
        [outputs_message(0, [output_entry("a", [5, 6], None), output_entry("b", [7], 1)])]
    ).outputs
    outs = [*whole, *sliced.outputs, *rest, *vllm]
    assert len(outs) == 6
    assert all(_untracked(o) for o in outs), [o for o in outs if not _untracked(o)]


def test_outputs_unpack_like_the_named_tuples_they_were() -> None:
    rid, body, finish = Output("r", VllmOutput([1, 2], 7), "stop")
    ids, stop, error = body
    assert (rid, ids, stop, error, finish) == ("r", [1, 2], 7, None, "stop")
    assert Output("r", 1).terminal is False and Output("r", 1, "length").terminal


async def test_a_native_consumer_gets_untracked_outputs_with_its_own_id(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with (
            group_of(tmp_path, 1) as (group, _),
            group.submit(Request("r1", {"tokens": 3})) as stream,
        ):
            outs = [out async for out in stream]
    assert [(o.request_id, o.body, o.finish) for o in outs] == [
        ("r1", 0, None),
        ("r1", 1, None),
        ("r1", 2, "length"),
    ]
    assert all(_untracked(o) for o in outs)


async def test_a_vllm_consumer_gets_untracked_outputs_with_its_own_id() -> None:
    with trio.fail_after(10):
        async with vllm_group(2) as (group, _), group.submit(req("q", max_tokens=3)) as stream:
            outs = [out async for out in stream]
    assert [o.request_id for o in outs] == ["q"] * len(outs)
    assert sum(len(o.body.token_ids) for o in outs) == 3 and outs[-1].finish == "length"
    assert all(_untracked(o) for o in outs)
