"""vLLM's engine-core wire, sans-IO: what zmqdp sends to engines and reads back. The
structs are vLLM 0.33's; 0.32 engines (`WIRE_VERSIONS`) differ only in what they send.

Theory of operation
-------------------
vLLM encodes its messages with msgspec's msgpack encoder (`vllm/v1/serial_utils.py`),
so this module uses msgspec too, with structs that mirror vLLM's field order:

* `EngineCoreRequest` (ADD) is an ``array_like`` struct that always carries all of its
  22 fields; its `sampling_params` is a msgpack **map** that omits every field equal to
  its default (`SamplingParams` is ``omit_defaults``), in vLLM's declaration order. The
  map is built the way vLLM's frontend builds it: `__post_init__` (stop lists become
  ``[]``, greedy sampling resets top-p/top-k/min-p, ...) and then
  `update_from_generation_config` with the EOS token the caller gives (vLLM's engine
  stops on EOS only through ``_eos_token_id``).
* ABORT is a list of request ids, UTILITY ``[client_index, call_id, method, args]``
  with an unsigned 64-bit call id, START_DP_WAVE ``[wave, exclude_engine_index]``; each
  goes after a one-byte request type frame.
* `EngineCoreOutputs` comes back as a positional array; its entries are decoded with
  typed structs (fast, validated). Arrays longer than we know are accepted (vLLM
  appends fields at the end) and shorter ones take trailing defaults. An entry that
  does not fit its struct ends only the request it names (`BadEntry`), as a
  malformed entry does in zmqdp's own protocol (§7); a body that is not an
  `EngineCoreOutputs` at all, or that names no engine, is a connection error.
* The engine's death is a single frame ``b"ENGINE_CORE_DEAD"`` (`ENGINE_CORE_DEAD`).

Decoded outputs are zmqdp's own `OutputBatch`, so the sans-IO core (routing, book,
waves) applies them unchanged: each `EngineCoreOutput` becomes an `Output` whose body
is a `VllmOutput` (new token ids, vLLM's stop reason) and whose `finish` is vLLM's
finish reason in lower case ("stop", "length", "abort", "error", "repetition").
`scheduler_stats` becomes the rank's `Load`; `wave_complete` and `start_wave` feed the
wave clock; `utility_output` becomes a `Reply`. `decode_outputs_with_stats` also reads
each entry's `events` and `prefill_stats` (five more fields) and counts the message in
an `EngineStats` (stats.py: vLLM's metrics); plain `decode_outputs` skips them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import msgspec

from .._core.errors import QUOTE_LIMIT, ProtocolError, quote
from .._core.messages import BadEntry, Load, Output, OutputBatch, Reply
from .stats import EngineStats

__all__ = [
    "ABORT",
    "ADD",
    "COORDINATOR_READY",
    "ENGINE_CORE_DEAD",
    "FINISH_REASONS",
    "START_DP_WAVE",
    "UTILITY",
    "WIRE_VERSIONS",
    "XSUB_SUBSCRIBE",
    "SamplingParams",
    "VllmError",
    "VllmOutput",
    "decode_hello",
    "decode_outputs",
    "decode_outputs_with_stats",
    "decode_ready",
    "decode_ready_response",
    "encode_abort",
    "encode_add",
    "encode_init",
    "encode_start_dp_wave",
    "encode_utility",
    "identity_rank",
    "rank_identity",
    "sampling_map",
    "wire_version",
]

# -- constants (vllm/v1/engine/__init__.py, core.py, coordinator.py) --------------------

ADD = b"\x00"
ABORT = b"\x01"
START_DP_WAVE = b"\x02"
UTILITY = b"\x03"
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
COORDINATOR_READY = b"READY"
"""What the coordinator publishes to engines once every one has subscribed."""
XSUB_SUBSCRIBE = b"\x01"
"""An XSUB's subscription to every message, as XPUB receives it."""

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")
"""vLLM's `FinishReason` (an IntEnum: STOP=0 .. REPETITION=4), as zmqdp finish strings."""

_encoder = msgspec.msgpack.Encoder()
_encode = _encoder.encode
_any_decoder = msgspec.msgpack.Decoder()

_T = TypeVar("_T")


def _msgspec(decode: Callable[[Any], _T], data: Any, what: str) -> _T:
    """`decode(data)` (a msgspec decoder's `decode`, or `msgspec.convert`), made total:
    anything it raises becomes `ProtocolError` whose cause starts with `what`.

    The one gate for peer bytes on this wire. msgspec raises `DecodeError` and
    `ValidationError` for what is not msgpack or not the type, but `RecursionError` for
    deep nesting (about 1,000 levels, fewer from deeper in the stack): callers that
    caught `DecodeError` let one 1 KB message end a group."""
    try:
        return decode(data)
    except RecursionError:
        raise ProtocolError(f"{what}: nested too deeply for msgspec") from None
    except Exception as exc:  # DecodeError, ValidationError, whatever else msgspec raises
        detail = str(exc)  # a ValidationError names the path: 1,000 levels are long
        if len(detail) > QUOTE_LIMIT:
            detail = f"{detail[:QUOTE_LIMIT]}..."
        raise ProtocolError(f"{what}: {detail}") from None


_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2


def rank_identity(rank: int) -> bytes:
    """vLLM's engine identity: the DP rank, 2 bytes little-endian."""
    return rank.to_bytes(2, "little")


def identity_rank(identity: bytes) -> int | None:
    return int.from_bytes(identity, "little") if len(identity) == 2 else None


# -- requests ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling parameters zmqdp sends (a subset of vLLM's `SamplingParams`, same
    names and defaults). Everything that needs a tokenizer (stop strings, bad words,
    detokenization) is the frontend's job in vLLM and has no place here: stop on token
    ids instead (`stop_token_ids`, and the request's EOS token)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    extra_args: Mapping[str, Any] | None = None


class _Sampling(msgspec.Struct, omit_defaults=True, gc=False):
    """The SamplingParams fields zmqdp sends, in vLLM 0.33's declaration order, with
    vLLM's defaults: encoded as vLLM encodes its `SamplingParams` (a map that omits
    default values, with a 16-bit map header, as msgspec writes omit_defaults maps)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    eos_token_id: int | None = msgspec.field(default=None, name="_eos_token_id")
    all_stop_token_ids: set[int] = msgspec.field(default_factory=set, name="_all_stop_token_ids")
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: bool | None = None


def _check_sampling(p: SamplingParams) -> None:
    """vLLM's `_verify_args`, for what zmqdp sends: an engine would fail the request
    with FinishReason.ERROR; zmqdp refuses it at submit with the reason."""

    def number(name: str, value: Any) -> float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {quote(value)}")
        return float(value)

    if not -2.0 <= number("presence_penalty", p.presence_penalty) <= 2.0:
        raise ValueError(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}")
    if not -2.0 <= number("frequency_penalty", p.frequency_penalty) <= 2.0:
        raise ValueError(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}")
    if number("repetition_penalty", p.repetition_penalty) <= 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    if not 0.0 <= number("temperature", p.temperature) <= 2.0:
        raise ValueError(f"temperature must be in [0, 2], got {p.temperature}")
    if not 0.0 < number("top_p", p.top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if type(p.top_k) is not int or p.top_k < -1:
        raise ValueError(f"top_k must be 0 (disable), -1 or at least 1, got {quote(p.top_k)}")
    if not 0.0 <= number("min_p", p.min_p) <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}")
    if p.max_tokens is not None and (type(p.max_tokens) is not int or p.max_tokens < 1):
        raise ValueError(f"max_tokens must be an int >= 1 or None, got {quote(p.max_tokens)}")
    if type(p.min_tokens) is not int or p.min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {quote(p.min_tokens)}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})")
    if p.seed is not None and type(p.seed) is not int:
        raise ValueError(f"seed must be an int or None, got {quote(p.seed)}")
    if any(type(t) is not int for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids must be ints, got {quote(list(p.stop_token_ids))}")


def sampling_map(params: SamplingParams, eos_token_id: int | None) -> _Sampling:
    """The `sampling_params` vLLM's frontend sends for `params` and the model's
    `eos_token_id`: `SamplingParams.__post_init__`, then
    `update_from_generation_config` (without generation-config extras). Raises
    `ValueError` for parameters vLLM refuses."""
    _check_sampling(params)
    if eos_token_id is not None and type(eos_token_id) is not int:
        raise ValueError(f"eos_token_id must be an int or None, got {quote(eos_token_id)}")
    temperature = params.temperature
    if 0 < temperature < _MAX_TEMP:
        temperature = _MAX_TEMP
    greedy = temperature < _SAMPLING_EPS
    stop_token_ids = list(dict.fromkeys(params.stop_token_ids))
    all_stop: set[int] = set()
    all_stop.update(stop_token_ids)
    if eos_token_id is not None:
        all_stop.add(eos_token_id)
    return _Sampling(
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        temperature=temperature,
        top_p=1.0 if greedy else params.top_p,
        top_k=0 if greedy else params.top_k,
        min_p=0.0 if greedy else params.min_p,
        seed=None if params.seed == -1 else params.seed,
        stop=[],
        stop_token_ids=stop_token_ids,
        ignore_eos=params.ignore_eos,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        eos_token_id=None if params.ignore_eos else eos_token_id,
        all_stop_token_ids=all_stop,
        logit_bias=None
        if params.logit_bias is None
        else {int(k): min(100.0, max(-100.0, b)) for k, b in params.logit_bias.items()},
        allowed_token_ids=None
        if params.allowed_token_ids is None
        else list(params.allowed_token_ids),
        extra_args=None if params.extra_args is None else dict(params.extra_args),
        bad_words=[],
        skip_reading_prefix_cache=False,
    )


class _EngineCoreRequest(msgspec.Struct, array_like=True, gc=False):
    """vLLM 0.33's `EngineCoreRequest`, every field (always all 22 on the wire)."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: None
    sampling_params: _Sampling | None
    pooling_params: None
    arrival_time: float
    lora_request: None
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: None = None
    prompt_is_token_ids: None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: None = None
    abort_immediately: bool = False
    session_id: str | None = None
    kv_hints: None = None


def encode_add(
    request_id: str,
    prompt_token_ids: Sequence[int],
    sampling_params: _Sampling,
    arrival_time: float,
    *,
    data_parallel_rank: int | None = None,
    cache_salt: str | None = None,
    client_index: int = 0,
    current_wave: int = 0,
    priority: int = 0,
    external_req_id: str | None = None,
) -> tuple[bytes, bytes]:
    """The frames of an ADD (after the routing identity): type byte, EngineCoreRequest.
    Raises `ProtocolError` if a value has no msgpack form."""
    req = _EngineCoreRequest(
        request_id,
        list(prompt_token_ids),
        None,
        sampling_params,
        None,
        arrival_time,
        None,
        cache_salt,
        data_parallel_rank,
        client_index=client_index,
        current_wave=current_wave,
        priority=priority,
        external_req_id=external_req_id,
    )
    try:
        return ADD, _encode(req)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"ADD has no msgpack form: {exc}") from None


def encode_abort(request_ids: Sequence[str]) -> tuple[bytes, bytes]:
    return ABORT, _encode(list(request_ids))


def encode_utility(
    call_id: int, method: str, args: Sequence[Any], client_index: int = 0
) -> tuple[bytes, bytes]:
    """UTILITY ``[client_index, call_id, method, args]``; `call_id` is unsigned 64-bit.
    Raises `ProtocolError` if an argument has no msgpack form."""
    if not 0 <= call_id < 2**64:
        raise ProtocolError(f"utility call id {call_id} is not an unsigned 64-bit int")
    try:
        return UTILITY, _encode([client_index, call_id, method, list(args)])
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"UTILITY {method!r} has no msgpack form: {exc}") from None


def encode_start_dp_wave(wave: int, exclude_engine_index: int | None = None) -> list[bytes]:
    """The coordinator's START_DP_WAVE as published to engines (no identity frame)."""
    return [START_DP_WAVE, _encode([wave, exclude_engine_index])]


# -- handshake --------------------------------------------------------------------------

WIRE_VERSIONS = ("0.32", "0.33")
"""The vLLM engine-core versions zmqdp speaks. Their wires differ in what engines send
(0.33 adds `EngineCoreOutput.error`, three ready-response fields and READY extras) and
in who starts a wave: a 0.32 engine that gets an ADD for its own wave while parked
reports nothing (vLLM 0.32's frontend woke its peers with FIRST_REQ), a 0.33 engine
always reports `start_wave`. zmqdp's WAKE after ADDs (docs/protocol.md §5) wakes the
peers in both cases, so one client rule serves both; tests/models/vllm_waves.py checks
it against each version's engine rules."""


def wire_version(info: Mapping[str, Any], override: str | None = None) -> tuple[str, str | None]:
    """The wire version to speak with a rank, from its ready response's
    `vllm_version` (or `override`), and a warning if it is a guess: ``(version,
    warning)``. An unknown or absent version is taken as the nearest known one."""
    if override is not None:
        return override, None
    raw = info.get("vllm_version")
    if type(raw) is not str:
        return WIRE_VERSIONS[-1], (
            f"its ready response names no vllm_version; speaking vLLM "
            f"{WIRE_VERSIONS[-1]}'s wire (pass vllm_version= to say which)"
        )
    parts = raw.split(".")
    try:
        key = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return WIRE_VERSIONS[-1], (
            f"vllm_version {quote(raw)} is not MAJOR.MINOR...; speaking vLLM "
            f"{WIRE_VERSIONS[-1]}'s wire (pass vllm_version= to say which)"
        )
    known = {tuple(int(x) for x in v.split(".")): v for v in WIRE_VERSIONS}
    if key in known:
        return known[key], None
    nearest = WIRE_VERSIONS[0] if key < min(known) else WIRE_VERSIONS[-1]
    return nearest, (
        f"vLLM {raw} is not a version zmqdp was tested with ({', '.join(WIRE_VERSIONS)}); "
        f"speaking {nearest}'s wire"
    )


def decode_hello(body: bytes) -> dict[str, Any]:
    """A handshake message (HELLO or READY) as a map with a str `status`; raises
    `ProtocolError` for anything else."""
    msg = _msgspec(_any_decoder.decode, body, "handshake message is not msgpack")
    if type(msg) is not dict or type(msg.get("status")) is not str:
        raise ProtocolError(f"handshake message is not a map with a status: {quote(msg)}")
    return msg


decode_ready = decode_hello


def encode_init(
    inputs: Sequence[str],
    outputs: Sequence[str],
    coordinator_input: str | None = None,
    coordinator_output: str | None = None,
    frontend_stats_publish_address: str | None = None,
    parallel_config: Mapping[str, Any] | None = None,
) -> bytes:
    """EngineHandshakeMetadata: the addresses (an `EngineZmqAddresses`, every field)
    and `parallel_config` (empty for dense groups)."""
    return _encode(
        {
            "addresses": {
                "inputs": list(inputs),
                "outputs": list(outputs),
                "coordinator_input": coordinator_input,
                "coordinator_output": coordinator_output,
                "frontend_stats_publish_address": frontend_stats_publish_address,
            },
            "parallel_config": dict(parallel_config or {}),
        }
    )


def decode_ready_response(body: bytes) -> dict[str, Any]:
    """The `EngineCoreReadyResponse` an engine sends first on the input socket (a map;
    an empty payload means "no info", as vLLM's client accepts)."""
    if not body:
        return {}
    msg = _msgspec(_any_decoder.decode, body, "ready response is not msgpack")
    if type(msg) is not dict:
        raise ProtocolError(f"ready response is not a map: {quote(msg)}")
    return msg


# -- outputs ----------------------------------------------------------------------------


class VllmError(NamedTuple):
    """Why an engine failed a request: vLLM 0.33's `RequestError`, sent with an
    ``"error"`` finish (`code` e.g. ``"validation_error"``; `retryable`: the same
    request may succeed later, e.g. it was refused while the engine was paused). vLLM
    0.32 engines send no detail: their ``"error"`` finishes have ``error=None``."""

    code: str
    message: str
    retryable: bool = False

    def __str__(self) -> str:
        again = " (retryable)" if self.retryable else ""
        return f"{self.code}: {self.message}{again}"


class VllmOutput(msgspec.Struct, gc=False):
    """The body of one output: the request's new token ids, for a STOP finish what
    stopped it (`stop_reason`: a stop token id, or None for EOS), and for an
    ``"error"`` finish what the engine said (`error`, vLLM >= 0.33).

    An untracked msgspec Struct, as `Output` (why: there); it unpacks as the named tuple
    it was (``ids, stop, error = out.body``)."""

    token_ids: list[int]
    stop_reason: int | str | None = None
    error: VllmError | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.token_ids, self.stop_reason, self.error))


class _RequestError(msgspec.Struct, gc=False):
    """vLLM's `RequestError` dataclass (a map on the wire)."""

    code: str
    message: str
    retryable: bool = False


class _Out(msgspec.Struct, array_like=True, gc=False):
    """vLLM's `EngineCoreOutput`, the fields zmqdp reads on every output (its other 11
    in 0.32, 12 in 0.33, are trailing elements the decoder skips)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Any = None
    new_prompt_logprobs_tensors: Any = None
    pooling_output: Any = None
    finish_reason: int | None = None
    stop_reason: int | str | None = None


class _StatsOut(_Out, array_like=True, gc=False):
    """`EngineCoreOutput` down to its 12th field, `prefill_stats`: decoded only when the
    wire keeps vLLM's metrics (`decode_outputs_with_stats`)."""

    events: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    trace_headers: Any = None
    prefill_stats: Any = None


class _ErrorOut(msgspec.Struct, array_like=True, gc=False):
    """`EngineCoreOutput` down to its 19th field, 0.33's `error`: decoded only for a
    message that has an ERROR finish (rare), so the common path skips 12 fields."""

    request_id: str
    new_token_ids: Any = None
    new_logprobs: Any = None
    new_prompt_logprobs_tensors: Any = None
    pooling_output: Any = None
    finish_reason: Any = None
    stop_reason: Any = None
    events: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    trace_headers: Any = None
    prefill_stats: Any = None
    routed_experts: Any = None
    num_nans_in_logits: Any = None
    mm_cache_miss_hashes: Any = None
    new_sampling_mask: Any = None
    spec_decode_metrics: Any = None
    prompt_token_id_logprobs: Any = None
    error: _RequestError | None = None


class _ErrorOutputs(msgspec.Struct, array_like=True, gc=False):
    engine_index: Any = None
    outputs: list[_ErrorOut] = []


_ERROR = 3
"""vLLM's FinishReason.ERROR."""


class _Utility(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    failure_message: str | None = None
    result: Any = None


class _Outputs(msgspec.Struct, array_like=True, gc=False):
    engine_index: int = 0
    outputs: list[_Out] = []
    scheduler_stats: dict[str, Any] | None = None
    timestamp: float = 0.0
    utility_output: _Utility | None = None
    finished_requests: list[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None


class _StatsOutputs(msgspec.Struct, array_like=True, gc=False):
    engine_index: int = 0
    outputs: list[_StatsOut] = []
    scheduler_stats: dict[str, Any] | None = None
    timestamp: float = 0.0
    utility_output: _Utility | None = None
    finished_requests: list[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None


class _LooseOutputs(msgspec.Struct, array_like=True, gc=False):
    engine_index: int = 0
    outputs: list[msgspec.Raw] = []
    scheduler_stats: Any = None
    timestamp: Any = None
    utility_output: Any = None
    finished_requests: Any = None
    wave_complete: int | None = None
    start_wave: int | None = None


_outputs_decoder = msgspec.msgpack.Decoder(_Outputs)
_loose_decoder = msgspec.msgpack.Decoder(_LooseOutputs)
_stats_decoder = msgspec.msgpack.Decoder(_StatsOutputs)
_out_decoder = msgspec.msgpack.Decoder(_Out)
_utility_decoder = msgspec.msgpack.Decoder(_Utility)
_error_outputs_decoder = msgspec.msgpack.Decoder(_ErrorOutputs)
_NREASONS = len(FINISH_REASONS)
_NOT_OUTPUTS = "not an EngineCoreOutputs"


def _to_utility(value: Any) -> _Utility:
    return msgspec.convert(value, _Utility)


def _load(stats: Any) -> Load | None:
    """`SchedulerStats` (a map) as a `Load`; None if it has no usable counts."""
    if type(stats) is not dict:
        return None
    waiting = stats.get("num_waiting_reqs")
    running = stats.get("num_running_reqs")
    if type(waiting) is not int or type(running) is not int or waiting < 0 or running < 0:
        return None
    kv = stats.get("kv_cache_usage")
    return Load(waiting, running, float(kv) if isinstance(kv, int | float) else math.nan)


def _reply(u: _Utility) -> Reply:
    if u.failure_message is not None:
        return Reply(u.call_id, None, u.failure_message)
    result = u.result
    # UtilityResult: [type_info | None, value]
    if type(result) is list and len(result) == 2:
        result = result[1]
    return Reply(u.call_id, result, None)


def _errors(body: bytes) -> dict[str, VllmError]:
    """The `error` of each entry of `body` that has one (vLLM >= 0.33), by request id."""
    try:
        full = _msgspec(_error_outputs_decoder.decode, body, "error detail")
    except ProtocolError:  # a malformed detail: the finish is still "error"
        return {}
    return {
        o.request_id: VllmError(o.error.code, o.error.message, o.error.retryable)
        for o in full.outputs
        if o.error is not None
    }


def _converted(
    rank: int, outs: Sequence[_Out], bad: list[BadEntry], body: bytes
) -> tuple[Output, ...]:
    out: list[Output] = []
    append = out.append
    errors: dict[str, VllmError] | None = None
    for o in outs:
        fr = o.finish_reason
        error = None
        if fr is None:
            finish = None
        elif 0 <= fr < _NREASONS:
            finish = FINISH_REASONS[fr]
            if fr == _ERROR:  # rare: only then is the entry read down to its `error`
                if errors is None:
                    errors = _errors(body)
                error = errors.get(o.request_id)
        else:
            bad.append(BadEntry("outputs", o.request_id, f"finish_reason {fr} is not 0..4"))
            continue
        append(Output(o.request_id, VllmOutput(o.new_token_ids, o.stop_reason, error), finish))
    return tuple(out)


def decode_outputs(frames: Sequence[bytes]) -> OutputBatch:
    """One message from the output socket (`[EngineCoreOutputs, *aux]`) as zmqdp's
    `OutputBatch` (`rank` = its `engine_index`; `finished_requests` are not used: a
    finished request always has its terminal output in the same or an earlier
    message, on the same connection). Raises `ProtocolError` if the message as a
    whole is not an `EngineCoreOutputs` (a connection error); malformed entries come
    back in `bad_entries`."""
    if not frames:
        raise ProtocolError("an empty message")
    body = frames[0]
    try:
        m = _msgspec(_outputs_decoder.decode, body, _NOT_OUTPUTS)
    except ProtocolError:
        # A malformed entry, or one that is not even msgpack-valid inside (a request id
        # that is not UTF-8): each entry alone, so the others of the message still count.
        return _decode_loose(body)
    if m.engine_index < 0:
        raise ProtocolError(f"engine_index {m.engine_index} is negative")
    bad: list[BadEntry] = []
    outputs = _converted(m.engine_index, m.outputs, bad, body) if m.outputs else ()
    u = m.utility_output
    return OutputBatch(
        rank=m.engine_index,
        outputs=outputs,
        load=_load(m.scheduler_stats) if m.scheduler_stats is not None else None,
        wave_complete=m.wave_complete,
        start_wave=m.start_wave,
        replies=() if u is None else (_reply(u),),
        bad_entries=tuple(bad),
    )


def decode_outputs_with_stats(
    frames: Sequence[bytes], stats: EngineStats, rank: int
) -> OutputBatch:
    """`decode_outputs`, and the message's engine stats (events, prefill stats, scheduler
    stats, timestamp) counted in `stats` if it is a well-formed message of `rank` (a
    message with a malformed entry is decoded entry by entry, its stats not counted)."""
    if not frames:
        raise ProtocolError("an empty message")
    body = frames[0]
    try:
        m = _msgspec(_stats_decoder.decode, body, _NOT_OUTPUTS)
    except ProtocolError:
        return _decode_loose(body)
    if m.engine_index < 0:
        raise ProtocolError(f"engine_index {m.engine_index} is negative")
    if m.engine_index == rank:
        stats.step(rank, m.timestamp, m.outputs, m.scheduler_stats)
    bad: list[BadEntry] = []
    outputs = _converted(m.engine_index, m.outputs, bad, body) if m.outputs else ()
    u = m.utility_output
    return OutputBatch(
        rank=m.engine_index,
        outputs=outputs,
        load=_load(m.scheduler_stats) if m.scheduler_stats is not None else None,
        wave_complete=m.wave_complete,
        start_wave=m.start_wave,
        replies=() if u is None else (_reply(u),),
        bad_entries=tuple(bad),
    )


def _decode_loose(body: bytes) -> OutputBatch:
    """The slow path for a message with a malformed entry: each entry alone."""
    m = _msgspec(_loose_decoder.decode, body, _NOT_OUTPUTS)
    if m.engine_index < 0:
        raise ProtocolError(f"engine_index {m.engine_index} is negative")
    bad: list[BadEntry] = []
    good: list[_Out] = []
    for raw in m.outputs:
        try:
            good.append(_msgspec(_out_decoder.decode, raw, "output entry"))
        except ProtocolError as exc:
            try:
                entry = _msgspec(_any_decoder.decode, raw, "output entry")
            except ProtocolError:  # not even its request id is readable: names nothing
                entry = None
            rid = entry[0] if type(entry) is list and entry and type(entry[0]) is str else None
            bad.append(BadEntry("outputs", rid, exc.cause))
    replies: tuple[Reply, ...] = ()
    if m.utility_output is not None:
        try:
            replies = (_reply(_msgspec(_to_utility, m.utility_output, "utility output")),)
        except ProtocolError as exc:
            u = m.utility_output
            cid = u[0] if type(u) is list and u and type(u[0]) is int else None
            bad.append(BadEntry("replies", cid, exc.cause))
    return OutputBatch(
        rank=m.engine_index,
        outputs=_converted(m.engine_index, good, bad, body),
        load=_load(m.scheduler_stats),
        wave_complete=m.wave_complete,
        start_wave=m.start_wave,
        replies=replies,
        bad_entries=tuple(bad),
    )
