"""Frontends: how an OpenAI completion request becomes an engine request body, and how
the engine's outputs become text.

Why a frontend
--------------
zmqdp carries opaque bodies (docs/protocol.md §8): what an ADD says and what an output
holds is between the application and its engines. The gateway is the application here,
and it speaks OpenAI on one side and one engine's body format on the other. A frontend
(vLLM's word: what turns a request into an engine's input and its outputs into text) is
that translation, and nothing else: the HTTP handling, admission, disconnects, errors
and metrics stay the same for every engine. (Not to be confused with the wire's
dialect, `zmqdp.vllm.dialect(...)`: the protocol the group speaks to its engines.)

The interface is two calls, kept small on purpose (`MockFrontend` here, and
`VllmFrontend` with a tokenizer and an incremental detokenizer, vllm_frontend.py):

* `Frontend.prepare(request)` -> `Prepared`: validate what this engine needs of the
  request (raise `ValueError` for the client's mistakes: the gateway answers 400 with the
  message), and return the engine body, the prompt's token count (for `usage`) and a
  `decode` function for this one request;
* `Prepared.decode(output)` -> `Piece`: the text of one output, the completion tokens it
  stands for, and the OpenAI `finish_reason` of the terminal output. It is called once
  per output, in order, from one task, so it may keep per-request state (an incremental
  detokenizer holding back an incomplete UTF-8 sequence, stop strings...).

Optionally, `decode.batch(outputs)` -> `Piece` (`decode` an object with a `batch`
method, `BatchDecode`): every output the gateway took at once (`receive_batch()`, one
HTTP write) in one call, with the same result as `decode_each(decode, outputs)`. The
gateway's work is then per write, not per token: the frontend loops over the delivery's
token ids itself and makes one `Piece`. Without it (or for a `Prepared` whose `decode`
was replaced by a plain function), the gateway calls `decode` per output.

`decode` must not block: it runs on the event loop, between outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .._core.messages import Output

__all__ = [
    "BatchDecode",
    "CompletionRequest",
    "Frontend",
    "MockFrontend",
    "Piece",
    "Prepared",
    "decode_each",
]
# (`VllmFrontend`, for vLLM engine cores with a tokenizer: vllm_frontend.py)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A `POST /v1/completions` body, or a chat's (`/v1/chat/completions`), validated
    (`zmqdp.gateway.openai.parse_completion`, `parse_chat`)."""

    prompt: str | tuple[int, ...]
    """The one prompt: text, or token ids (a list of one prompt is unwrapped)."""
    max_tokens: int
    stream: bool
    model: str | None
    user: str | None
    include_usage: bool
    """`stream_options.include_usage`: a last chunk with `usage` before `[DONE]`."""
    raw: Mapping[str, Any]
    """The request's fields that the frontend reads itself (its `Frontend.fields`:
    `temperature`, `stop`, `seed`, ...), those sent and not null. Every other field
    was refused with a 400 unless it had its neutral value (openai.py)."""
    chat: bool = False
    """A `/v1/chat/completions` request: `prompt` is what the frontend's
    `chat_prompt` rendered from its messages."""
    max_tokens_given: bool = True
    """False: the client gave no `max_tokens` (a chat request: `max_tokens` is then
    `openai.DEFAULT_CHAT_MAX_TOKENS`, which a frontend knowing the model's length caps)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """What one engine output adds to the completion."""

    text: str
    tokens: int = 1
    """Completion tokens this output stands for (`usage.completion_tokens`)."""
    finish_reason: str | None = None
    """The OpenAI finish reason (`"stop"`, `"length"`...) of the terminal output; if a
    frontend leaves it None there, the gateway says `"stop"`. Set on an output that is
    not the engine's last (a stop string the frontend found), it ends the response
    there: later outputs are dropped and the request is aborted on its rank."""
    stop_reason: int | str | None = None
    """vLLM's `stop_reason` of the terminal output: the stop string matched, or the stop
    token id the engine stopped on (None: EOS, a length limit, or no such notion)."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """One request, ready for the engine."""

    body: Any
    """The ADD body (any CBOR-able value the engine understands)."""
    prompt_tokens: int
    decode: Callable[[Output], Piece]
    """Called for each output of this request, in order (module docstring); with a
    `batch` method (`BatchDecode`), that is called instead, once per delivery."""
    request: Callable[[str, int | None], Any] | None = None
    """Builds the group's request from the gateway's request id and pinned rank, for a
    group on another wire (a `zmqdp.vllm.VllmRequest`); None: a `zmqdp.Request`
    carrying `body` (the native wire)."""
    tokens: Sequence[int] | None = None
    """The prompt's token ids for the native wire's `zmqdp.Request.tokens`, so that
    ``--routing prefix`` routes by prefix with no host code (a `request` builder passes
    its own: vLLM's `prompt_token_ids`)."""


class BatchDecode(Protocol):
    """A `Prepared.decode` that also decodes a whole delivery in one call."""

    def __call__(self, output: Output, /) -> Piece: ...

    def batch(self, outputs: Sequence[Output], /) -> Piece:
        """Equal to `decode_each(self, outputs)` (module docstring)."""
        ...


def batch_decoder(decode: Callable[[Output], Piece]) -> Callable[[Sequence[Output]], Piece]:
    """`decode.batch` if it has one, else `decode_each` over `decode`."""
    batch: Callable[[Sequence[Output]], Piece] | None = getattr(decode, "batch", None)
    if batch is not None:
        return batch
    return lambda outputs: decode_each(decode, outputs)


class Frontend(Protocol):
    """Translates between OpenAI completions and one engine's bodies (module docstring).

    A frontend may have a `fields` attribute (a frozenset of request field names): the
    fields it reads from `CompletionRequest.raw` and honours. The gateway refuses any
    other field it does not read itself (openai.py); no attribute means none.

    A frontend serves `/v1/chat/completions` if it has a method
    ``chat_prompt(messages) -> str``: the prompt (text, with the chat template's special
    tokens) rendered from ``({"role": ..., "content": ...}, ...)``; `ValueError` for a
    conversation it cannot render (400). Without it, chat requests get 404.

    A frontend with ``threaded = True`` has `chat_prompt` and `prepare` run in a worker
    thread (they must then be thread-safe): for slow work such as a tokenizer. That of
    a request whose body is large runs in the heavy lane (`backends.HEAVY_LANE` threads).

    A frontend may have a `max_prompt_tokens` attribute (an int, or None): the most token
    ids a prompt can have. The gateway then refuses a longer token-id prompt, and a chat
    of more messages, with a 400 before it looks at any element (openai.py)."""

    def prepare(self, request: CompletionRequest) -> Prepared:
        """The engine body for `request`; `ValueError` (its message goes to the client,
        status 400) if this engine cannot serve it."""
        ...


MOCK_FIELDS = frozenset({"temperature", "seed", "stop", "stop_token_ids"})
"""The sampling fields `MockFrontend` takes. `stop` and `stop_token_ids` are honoured
(as vLLM does); `temperature` and `seed` are checked and change nothing: the mock's
answer is a fixed function of the prompt, as greedy decoding is, so every temperature
and seed gives that answer. Any other sampling field that asks for something (`top_p`
below 1, `logprobs`, penalties...) is refused with a 400 naming it (openai.py): the mock
cannot honour it, and ignoring it would answer another question than the one asked."""
MAX_STOP_STRINGS = 16
"""At most this many stop strings per request (OpenAI takes 4; as `VllmFrontend`)."""
MAX_STOP_LENGTH = 256
"""The longest stop string taken (characters)."""
MAX_STOP_TOKEN_IDS = 256
"""At most this many `stop_token_ids`."""


def _mock_sampling(raw: Mapping[str, Any]) -> tuple[tuple[str, ...], frozenset[int]]:
    """The stop strings and stop token ids of a request's `MOCK_FIELDS`; `ValueError`
    (a 400) naming the field for a value vLLM would refuse too."""
    temperature = raw.get("temperature")
    if temperature is not None and (
        type(temperature) not in (int, float)
        or not math.isfinite(temperature)
        or not 0 <= temperature <= 2
    ):
        raise ValueError(f"'temperature' must be a number from 0 to 2, got {temperature!r:.40}")
    seed = raw.get("seed")
    if seed is not None and (type(seed) is not int or not -(1 << 63) <= seed < 1 << 63):
        raise ValueError(f"'seed' must be a 64-bit int, got {seed!r:.40}")
    value = raw.get("stop")
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and len(s) <= MAX_STOP_LENGTH for s in stops)
    ):
        raise ValueError(
            f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings of at "
            f"most {MAX_STOP_LENGTH} characters"
        )
    ids = raw.get("stop_token_ids", [])
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_STOP_TOKEN_IDS
        or not all(type(t) is int and 0 <= t < 1 << 31 for t in ids)
    ):
        raise ValueError(
            f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids "
            "(ints from 0)"
        )
    return tuple(s for s in stops if s), frozenset(ids)


class MockFrontend:
    """The mock engine's bodies (`zmqdp.mock`), and a stand-in for any engine that takes
    token ids and sends one token per output.

    * a text prompt becomes its UTF-8 bytes as token ids (a byte-level "tokenizer":
      ``"hi"`` -> ``[104, 105]``); a token-id prompt is sent as is;
    * the body is ``{"prompt": [int, ...], "max_tokens": k}``;
    * an output ``{"token": n}`` is the text ``f" t{n}"``; an output ``{"text": s}`` is
      ``s``; any other output is one token with no text;
    * the engine's finish string is the finish reason (the mock says ``"length"``);
    * `stop` strings and `stop_token_ids` end the answer as vLLM's do (`MOCK_FIELDS`:
      finish ``"stop"``, the text ends before the stop string, a stop token's text is
      left out, the request is aborted on its rank); `temperature` and `seed` are
      taken and change nothing (the answer is a fixed function of the prompt).
    """

    max_prompt_tokens: int = 1 << 20
    fields: frozenset[str] = MOCK_FIELDS
    """The sampling fields the mock takes (`MOCK_FIELDS`); others are refused."""

    def chat_prompt(self, messages: tuple[Mapping[str, str], ...]) -> str:
        """A plain transcript, ``"role: content"`` per line, then ``"assistant:"``."""
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"])

    def prepare(self, request: CompletionRequest) -> Prepared:
        """`Frontend.prepare`: the prompt's UTF-8 bytes as its token ids (no tokenizer)."""
        prompt = request.prompt
        try:
            tokens = prompt.encode() if isinstance(prompt, str) else prompt
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in the JSON)
            raise ValueError(f"'prompt' has no UTF-8 form: {exc.reason} at {exc.start}") from None
        if len(tokens) > self.max_prompt_tokens:  # checked before a list of ints is made
            raise ValueError(
                f"the prompt has {len(tokens)} tokens; this engine takes at most "
                f"{self.max_prompt_tokens}"
            )
        stops, stop_ids = _mock_sampling(request.raw) if request.raw else ((), frozenset())
        ids = list(tokens)
        body = {"prompt": ids, "max_tokens": request.max_tokens}
        if stops or stop_ids:
            return Prepared(body, len(ids), _MockStopDecode(stops, stop_ids), tokens=ids)
        return Prepared(body, len(ids), _MOCK_DECODE, tokens=ids)


def decode_each(decode: Callable[[Output], Piece], outputs: Sequence[Output]) -> Piece:
    """`decode` of each output, joined into one piece, up to the first output that ends
    the answer (the engine's finish, or a frontend's: a stop string), whose finish it
    has (`"stop"` if the frontend said none); later outputs are not decoded. None as
    the finish: the answer goes on. What `Prepared.decode_batch` must equal."""
    parts = []
    tokens = 0
    for output in outputs:
        piece = decode(output)
        parts.append(piece.text)
        tokens += piece.tokens
        if output.finish is not None or piece.finish_reason is not None:
            return Piece("".join(parts), tokens, piece.finish_reason or "stop", piece.stop_reason)
    return Piece("".join(parts), tokens, None)


def _mock_text(body: Any) -> str:
    if isinstance(body, dict):
        token = body.get("token")
        if type(token) is int:
            return f" t{token}"
        if isinstance(body.get("text"), str):
            return body["text"]  # type: ignore[no-any-return]
    return ""


class _MockDecode:
    """The mock's decoding: stateless, one for every request."""

    __slots__ = ()

    def __call__(self, output: Output) -> Piece:
        return Piece(_mock_text(output.body), 1, output.finish)

    def batch(self, outputs: Sequence[Output]) -> Piece:
        if len(outputs) == 1:  # (one token per write: c=32 is mostly that)
            output = outputs[0]
            finish = output.finish
            return Piece(_mock_text(output.body), 1, None if finish is None else finish or "stop")
        parts = []
        for i, output in enumerate(outputs):
            parts.append(_mock_text(output.body))
            finish = output.finish
            if finish is not None:
                return Piece("".join(parts), i + 1, finish or "stop")
        return Piece("".join(parts), len(outputs), None)


_MOCK_DECODE = _MockDecode()


def first_stop(text: str, stops: Sequence[str], floor: int = 0) -> tuple[str, int] | None:
    """The stop string found in `text` that ends first (ties: the first in the list),
    and where it starts: vLLM's choice (`check_stop_strings`), so the text and
    `stop_reason` are those vLLM would give. Only a string ending past `floor` counts
    (vLLM searches the new text, and what `min_tokens` covers is never searched)."""
    best: tuple[str, int] | None = None
    best_end = len(text) + 1
    for stop in stops:
        at = text.find(stop, max(0, floor - len(stop) + 1))
        if at >= 0 and at + len(stop) < best_end:
            best, best_end = (stop, at), at + len(stop)
    return best


class _MockStopDecode:
    """The mock's decoding with stop strings and stop token ids, as vLLM's detokenizer
    applies them (`include_stop_str_in_output` false): the text ends before the first
    stop string found, with finish ``"stop"``; up to the longest stop string minus one
    character is held back meanwhile (the next token may complete one; of several, the
    one that ends first); a stop token id ends the answer with ``"stop"`` and its own
    text left out. `stop_reason` is the string or the id, as vLLM's. One per request."""

    __slots__ = ("_held", "_hold", "_stop_ids", "_stops")

    def __init__(self, stops: tuple[str, ...], stop_ids: frozenset[int]) -> None:
        self._stops = stops
        self._stop_ids = stop_ids
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._held = ""

    def __call__(self, output: Output) -> Piece:
        body = output.body
        token = body.get("token") if isinstance(body, dict) else None
        stopped = type(token) is int and token in self._stop_ids
        held = self._held if stopped else self._held + _mock_text(body)
        match = first_stop(held, self._stops)
        if match is not None:
            self._held = ""
            return Piece(held[: match[1]], 1, "stop", match[0])
        if stopped or output.finish is not None:
            self._held = ""
            if stopped:
                return Piece(held, 1, "stop", token)
            return Piece(held, 1, output.finish or "stop")
        keep = len(held) - self._hold
        self._held = held[max(keep, 0) :]
        return Piece(held[:keep] if keep > 0 else "", 1, None)

    def batch(self, outputs: Sequence[Output]) -> Piece:
        return decode_each(self, outputs)


def _mock_piece(output: Output) -> Piece:  # (kept: the name tests and embedders used)
    return _MOCK_DECODE(output)
