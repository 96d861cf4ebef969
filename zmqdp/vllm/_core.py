"""`VllmCore`: zmqdp's sans-IO `GroupCore` speaking vLLM's wire.

Only the codec changes: routing, the request book (every request ends exactly once),
per-rank health (silence, stall WAKEs) and the wave clock are `GroupCore`'s own.

* An ADD is vLLM's `EngineCoreRequest`; its `current_wave` is the wave clock `c`
  (lockstep groups), a wave some rank has reached, never a lead (docs/protocol.md §5;
  vLLM's engines adopt a newer request wave).
* Output messages come from a PULL socket and carry no routing identity: the rank is
  the message's `engine_index`. A message that is not an `EngineCoreOutputs` names no
  rank and cannot kill one; it is counted (`protocol_errors`) and logged. One that
  names a rank outside the group is counted the same way.
* ``ENGINE_CORE_DEAD`` names no rank either (vLLM's sentinel is one bare frame on a
  PULL socket): `on_message` reports it with `BatchResult.dead` and rank None, and the
  client fails the whole group, as vLLM's own frontend does.
"""

from __future__ import annotations

from typing import Any

from .._core.errors import ProtocolError
from .._core.state import BatchRest, BatchResult, GroupCore
from .._core.waves import WAVE_MAX, WaveClock
from ._wire import ENGINE_CORE_DEAD, decode_outputs, encode_abort, encode_add, sampling_map

__all__ = ["VllmCore", "request_wave", "start_dp_wave"]


def request_wave(clock: WaveClock | None) -> int:
    """An ADD's `current_wave`: the clock `c` (0 in a dense group). A wave some rank has
    reached, never a lead: vLLM's engines adopt a request wave newer than their own, so
    a lead would renumber one rank of a running group ahead of its peers."""
    return clock.wave if clock is not None else 0


def start_dp_wave(wave: int) -> tuple[int, int | None]:
    """zmqdp's WAKE(c) on vLLM's wire: the coordinator's START_DP_WAVE(c, exclude=None),
    for the post-ADD WAKE, the answer to the `start_wave`s of a dispatcher pass and the
    stall WAKE alike.

    Never an excluded engine index. vLLM's own coordinator excludes the engine whose
    `start_wave: w` it answers with that very `w` (that engine woke itself at `w`).
    zmqdp answers with the clock `c >= w`, one START_DP_WAVE for every `start_wave` of
    a dispatcher pass: by then the reporter may be parked again at `c` (its request ran
    in a wave the clock has since seen complete), and excluding it would wake its peers
    without it. An engine that is already running at `c` is unaffected by the wake;
    one running at a lower wave never is (the clock never leads), so including the
    reporter is always safe. tests/vllm_wave_model.py checks both claims."""
    return wave, None


class VllmCore(GroupCore[Any]):
    """`GroupCore` with vLLM's codec. `encode_add` takes the body the trio layer
    builds: ``(VllmRequest, arrival_time)``."""

    client_index = 0

    def encode_add(self, wire_id: str, body: Any) -> tuple[bytes, bytes]:
        request, arrival_time = body
        try:
            sp = sampling_map(request.sampling, request.eos_token_id)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        tokens = request.prompt_token_ids
        if not tokens or any(type(t) is not int or t < 0 for t in tokens):
            raise ProtocolError("prompt_token_ids must be a non-empty list of ints >= 0")
        if type(request.priority) is not int:
            raise ProtocolError(f"priority must be an int, got {request.priority!r}")
        return encode_add(
            wire_id,
            tokens,
            sp,
            arrival_time,
            data_parallel_rank=request.rank,
            cache_salt=request.cache_salt,
            client_index=self.client_index,
            current_wave=request_wave(self.clock),
            priority=request.priority,
            external_req_id=request.id,
        )

    def encode_abort(self, wire_ids: tuple[str, ...]) -> tuple[bytes, bytes]:
        return encode_abort(wire_ids)

    def on_message(self, frames: list[bytes], now: float) -> tuple[int | None, BatchResult[Any]]:
        """One message from the output PULL socket: ``[EngineCoreOutputs, *aux]``."""
        if len(frames) == 1 and frames[0] == ENGINE_CORE_DEAD:
            return None, BatchResult(
                dead="an engine sent ENGINE_CORE_DEAD (vLLM's death sentinel names no rank)"
            )
        try:
            batch = decode_outputs(frames)
        except ProtocolError as exc:
            self.counters.protocol_errors += 1
            return None, BatchResult(error=exc)
        rank = batch.rank
        if rank >= self.size or rank < 0:
            self.counters.protocol_errors += 1
            return None, BatchResult(
                error=ProtocolError(f"outputs of engine_index {rank}, outside the group")
            )
        health = self.health[rank]
        if not self.is_up(rank):
            self.counters.stale_messages += 1
            return rank, BatchResult()
        for name, wave in (
            ("wave_complete", batch.wave_complete),
            ("start_wave", batch.start_wave),
        ):
            if wave is not None and not 0 <= wave <= WAVE_MAX:
                # A wave the clock would adopt and WAKE everyone with, past what the wire
                # can carry (docs/protocol.md §1): the message is invalid, as natively.
                return rank, self._connection_error(
                    rank, ProtocolError(f"{name} {wave} is outside 0..2**63-1")
                )
        return rank, self._apply(rank, health, batch, BatchRest(rank, health), now)
