"""What vLLM's wire changes: `VllmWire`, zmqdp's `Wire` speaking vLLM's engine-core
protocol (the codec itself is `codec.py`, the handshake `handshake.py`, the sockets
`sockets.py`). The core, routing, the request book, per-rank health and the wave clock
are the same as on the native wire.

* A request is a `VllmRequest` (prompt token ids, `SamplingParams`, the model's EOS
  token, priority, pinned rank). `prepare` does what vLLM's frontend does before it
  sends: a prompt must leave room for one output token, and `max_tokens=None` means "up
  to the model's length" (the engine compares with `max_tokens` at every step: None
  would kill it).
* An ADD is vLLM's `EngineCoreRequest`; its `current_wave` is the wave clock `c`
  (`request_wave`): a wave some rank has reached, never a lead (docs/protocol.md §5;
  vLLM's engines adopt a newer request wave).
* WAKE(c) is the coordinator's START_DP_WAVE(c, exclude=None), published on the XPUB
  (`start_dp_wave`, `wake_published`).
* Output messages come from PULL sockets and carry no routing identity, and neither
  a message's `engine_index` nor vLLM's death sentinel ``ENGINE_CORE_DEAD`` (one bare
  frame) can be trusted to name its rank: anyone who connects to a socket can write
  any index. So every rank is given an output socket of its own (`sockets.py`), which
  puts the rank's tag in front of every message it delivers (`source_tag`,
  unforgeable: it holds a secret of this wire, and an engine's own frames always come
  after it). **A message on rank r's socket is rank r's**: its outputs can end only
  rank r's requests, its sentinel kills only rank r (`OutputBatch.dead`, and a dense
  group keeps serving on the others), and one that is not an `EngineCoreOutputs`, or
  names another `engine_index`, is counted against rank r (`Incoming.junk`) without
  killing it. An untagged message (no such socket) names no rank; an untagged
  sentinel fails the whole group (`Incoming.group_dead`), as vLLM's own frontend does.
* A malformed output entry ends only its request (§7), and the client also sends that
  request's ABORT (`abort_malformed`): the engine would run it on to `max_tokens`.
* Call ids are random unsigned 64-bit ints, as vLLM's client makes them.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._core.codec import BatchDecoder, EntryCursor
from .._core.errors import InvalidRequest, ProtocolError, quote
from .._core.messages import OutputBatch
from .._core.prefix import block_key
from .._core.waves import WaveClock
from .._core.wire import Incoming, Prepared, check_tokens
from .codec import (
    ENGINE_CORE_DEAD,
    SamplingParams,
    decode_outputs,
    decode_outputs_with_stats,
    encode_abort,
    encode_add,
    encode_start_dp_wave,
    encode_utility,
    sampling_map,
)
from .stats import EngineStats

__all__ = ["VllmRequest", "VllmWire", "request_wave", "start_dp_wave"]


@dataclass(frozen=True, slots=True)
class VllmRequest:
    """One generation request. `id` as `zmqdp.Request.id`; `prompt_token_ids` the
    tokenized prompt (zmqdp has no tokenizer); `eos_token_id` the model's EOS token (the
    engine stops on it only if given; None: no EOS stop); `rank` pins it (vLLM's
    `data_parallel_rank`); `timeout` and `stream_interval` as `zmqdp.Request`'s."""

    id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    priority: int = 0
    rank: int | None = None
    timeout: float | None = None
    cache_salt: str | None = None
    stream_interval: int | None = None


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
    reporter is always safe. tests/models/vllm_waves.py checks both claims."""
    return wave, None


def _max_model_len(infos: Sequence[Mapping[str, Any]]) -> int | None:
    """The smallest `max_model_len` the ranks' ready responses announce, if any."""
    lengths: list[int] = [n for info in infos if type(n := info.get("max_model_len")) is int]
    return min(lengths) if lengths else None


class VllmWire:
    """vLLM 0.32/0.33's engine-core wire (module docstring). `client_index` is the
    frontend index the ADDs carry (vLLM's API-server index; one client: 0)."""

    name = "vLLM"
    abort_malformed = True
    resumes = True
    wake_published = True
    default_ready_timeout = 600.0

    def __init__(self, client_index: int = 0) -> None:
        self.client_index = client_index
        self.stats: EngineStats | None = None
        """Set it to count the engines' stats (vLLM's metrics, `stats.py`); None: the
        outputs are decoded without them (cheaper per token)."""
        self._source_secret = secrets.token_bytes(16)

    def source_tag(self, rank: int) -> bytes:
        """The frame the transport puts in front of every message that came on `rank`'s
        own output socket. No engine can forge it: it holds a secret of this wire, and
        what an engine sends always comes after it."""
        return self._source_secret + rank.to_bytes(2, "little")

    def _source(self, frames: list[bytes], size: int) -> int | None:
        """The rank whose socket tagged `frames` (`source_tag`), or None."""
        tag = frames[0] if frames else b""
        if len(tag) == 18 and tag[:16] == self._source_secret:
            rank = int.from_bytes(tag[16:], "little")
            if rank < size:
                return rank
        return None

    def prepare(
        self, request: VllmRequest, infos: Sequence[Mapping[str, Any]], wall_time: float
    ) -> Prepared:
        """`Wire.prepare`: a `VllmRequest` as vLLM's frontend would send it, with the ranks'
        ready responses (`max_tokens=None` becomes the room left in `max_model_len`; a prompt
        that leaves none raises `InvalidRequest`)."""
        if not isinstance(request, VllmRequest):
            raise InvalidRequest(
                str(getattr(request, "id", "?")),
                f"submit takes a VllmRequest on vLLM's wire, not {quote(request)}",
            )
        tokens = request.prompt_token_ids
        if type(tokens) is not list and type(tokens) is not tuple:
            # numpy's, a range, integer-likes: ints; junk: `InvalidRequest`. A list or a
            # tuple goes as it is (as before prefix affinity): checking each id costs
            # about 60 µs per 1,000 on every request, and msgpack sends what it is given
            tokens = check_tokens(request.id, tokens, "prompt_token_ids")
            request = dataclasses.replace(request, prompt_token_ids=tokens)
        limit = _max_model_len(infos)
        prompt = len(tokens)
        if limit is not None and prompt >= limit:
            raise InvalidRequest(
                request.id,
                f"the prompt has {prompt} tokens; the engines' max_model_len is {limit}",
            )
        if request.sampling.max_tokens is None:
            if limit is None:
                raise InvalidRequest(
                    request.id,
                    "max_tokens=None needs the engines' max_model_len (not in their READY)",
                )
            sampling = dataclasses.replace(request.sampling, max_tokens=limit - prompt)
            request = dataclasses.replace(request, sampling=sampling)
        # prefix affinity: the prompt (checked by `encode_add`) under its cache salt
        salt = request.cache_salt
        root = (
            0
            if salt is None
            else block_key(None, [hash(salt if type(salt) is str else repr(salt))])
        )
        prefix = (request.prompt_token_ids, root)
        return Prepared(request.id, (request, wall_time), request.rank, request.timeout, prefix)

    def encode_add(self, wire_id: str, body: Any, wave: int) -> tuple[bytes, bytes]:
        """`body` is what `prepare` built: ``(VllmRequest, arrival_time)``."""
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
        if self.stats is not None:
            self.stats.add(wire_id)
        return encode_add(
            wire_id,
            tokens,
            sp,
            arrival_time,
            data_parallel_rank=request.rank,
            cache_salt=request.cache_salt,
            client_index=self.client_index,
            current_wave=wave,
            priority=request.priority,
            external_req_id=request.id,
        )

    def encode_abort(self, wire_ids: tuple[str, ...]) -> tuple[bytes, bytes]:
        """`Wire.encode_abort`: vLLM's ABORT request type with the wire ids."""
        if self.stats is not None:
            self.stats.forget(wire_ids)
        return encode_abort(wire_ids)

    def encode_wake(self, wave: int) -> list[bytes]:
        """`Wire.encode_wake`: START_DP_WAVE(wave), published once on the coordinator XPUB."""
        return encode_start_dp_wave(*start_dp_wave(wave))

    def encode_call(self, call_id: int, method: str, args: tuple[Any, ...]) -> Sequence[bytes]:
        """A UTILITY request (vLLM's `call_utility`)."""
        return encode_utility(call_id, method, args)

    def new_call_id(self, taken: Container[int]) -> int:
        """`Wire.new_call_id`: a random uint64, as vLLM's `call_utility` draws them."""
        while (call_id := secrets.randbits(64)) in taken:
            pass
        return call_id

    def read(self, frames: list[bytes], size: int) -> Incoming:
        """``[source_tag, EngineCoreOutputs, *aux]`` from rank r's output PULL socket
        (module docstring: the message is rank r's, whatever it says)."""
        rank = self._source(frames, size)
        if rank is None:
            if frames == [ENGINE_CORE_DEAD]:
                return Incoming(
                    None,
                    group_dead="an engine sent ENGINE_CORE_DEAD (vLLM's death sentinel "
                    "names no rank)",
                )
            return Incoming(None, error=ProtocolError("a message from no rank's output socket"))
        frames = frames[1:]
        if frames == [ENGINE_CORE_DEAD]:
            dead = "ENGINE_CORE_DEAD (an engine-side fatal error: see that engine's log)"
            return Incoming(rank, batch=OutputBatch(rank, dead=dead))
        try:
            stats = self.stats
            batch = (
                decode_outputs(frames)
                if stats is None
                else decode_outputs_with_stats(frames, stats, rank)
            )
        except ProtocolError as exc:
            return Incoming(rank, junk=exc)
        if batch.rank != rank:
            junk = ProtocolError(
                f"outputs of engine_index {batch.rank} came on rank {rank}'s output socket: "
                "dropped (only rank r's engine connects to rank r's socket)"
            )
            return Incoming(rank, junk=junk)
        return Incoming(rank, batch=batch)

    def decode_batch(
        self, body: bytes, slice_entries: int
    ) -> tuple[OutputBatch, EntryCursor | None]:
        """Never called: vLLM's outputs are decoded whole by `read` (msgspec)."""
        raise ProtocolError("vLLM's outputs are decoded whole by `read`")

    def batch_decoder(self, body: bytes, judge: Any) -> BatchDecoder:
        """Never called: vLLM's outputs are decoded whole by `read` (msgspec)."""
        raise ProtocolError("vLLM's outputs are decoded whole by `read`")
