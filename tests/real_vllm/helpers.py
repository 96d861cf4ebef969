"""What the real-engine tests share: collecting a stream, spying on ABORTs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from zmqdp.vllm import SamplingParams, VllmGroup, VllmOutput, VllmRequest
from zmqdp.vllm.codec import ABORT

EOS = 0  # tools/realvllm/make_models.py: <|endoftext|>
VOCAB = 1024
PROMPT = [5, 6, 7]


@dataclass
class Result:
    rank: int | None
    tokens: list[int] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    finish: str | None = None
    stop_reason: Any = None
    error: BaseException | None = None


def request(
    rid: str,
    max_tokens: int | None = 16,
    *,
    prompt: Sequence[int] = PROMPT,
    rank: int | None = None,
    eos: int | None = EOS,
    **sampling: Any,
) -> VllmRequest:
    sampling.setdefault("temperature", 0.0)
    return VllmRequest(
        rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling), eos, rank=rank
    )


async def collect(group: VllmGroup, r: VllmRequest, *, limit: int | None = None) -> Result:
    """Read `r`'s stream to its end (or `limit` outputs, then leave: an abort). An error
    is kept in `Result.error`, not raised."""
    result = Result(None)
    try:
        async with group.submit(r) as stream:
            result.rank = stream.rank
            async for out in stream:
                assert isinstance(out.body, VllmOutput)
                result.outputs.append(out)
                result.tokens += out.body.token_ids
                if out.finish is not None:
                    result.finish, result.stop_reason = out.finish, out.body.stop_reason
                if limit is not None and len(result.outputs) >= limit:
                    break
    except Exception as exc:
        result.error = exc
    return result


class AbortSpy:
    """Records the request ids of every ABORT the client queues, per rank."""

    def __init__(self, group: VllmGroup) -> None:
        self.aborts: list[tuple[int, list[str]]] = []
        transport = group._transport
        self._transport = transport
        self._send = transport.send

        def send(rank: int, frames: Sequence[bytes]) -> None:
            if frames and frames[0] == ABORT:
                self.aborts.append((rank, msgspec.msgpack.decode(frames[1])))
            self._send(rank, frames)

        transport.send = send  # type: ignore[method-assign]

    def close(self) -> None:
        self._transport.send = self._send  # type: ignore[method-assign]

    def naming(self, wire_id: str) -> list[int]:
        return [rank for rank, ids in self.aborts if wire_id in ids]
