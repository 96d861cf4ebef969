"""The OpenAI wire format of `/v1/completions` and `/v1/chat/completions`: the
requests' validation, the response objects, the streaming chunks and the error bodies.

Only what those endpoints need. Every field is accounted for: the gateway's own
(`GATEWAY_FIELDS`) are checked, and a wrong one is a 400 naming the field (`param`), as
OpenAI does; the frontend's (`Frontend.fields`: sampling parameters its engine honours) go
to it in `CompletionRequest.raw`; an OpenAI field that neither handles is a 400
``unsupported_parameter`` naming it unless it has its neutral value (`NEUTRAL`): a
server that silently ignores `stop` or `temperature` answers a different question than
the one asked. Any other field is a 400 ``unrecognized_argument``, as OpenAI answers it.
A field sent as ``null`` is absent. JSON is written compact and ASCII
so that a chunk is a few hundred bytes whatever the text.

Large bodies (a hostile-peer review, finding 4): a body of more than `LARGE_BODY` bytes
is decoded with msgspec (3 times faster than `json.loads` on a list of ints, and the
decode is one C call that holds the GIL), and the gateway runs the whole parse in a
worker thread, so that only that call, 40 to 60 ms for the 4 MiB the gateway takes,
holds up its event loop; the validation loops over the elements are Python code, which
the loop's thread preempts (completions.py). Element counts are bounded before any
element is looked at: a prompt of more token ids than the model's context
(`max_prompt_tokens`), or a chat of more messages than that, is a 400 at once. Smaller
bodies keep `json.loads` (and its messages; it also takes a lone surrogate, which the
frontend then refuses by name).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from .errors import HTTPError
from .frontend import CompletionRequest

__all__ = [
    "DEFAULT_CHAT_MAX_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "GATEWAY_FIELDS",
    "NEUTRAL",
    "OPENAI_FIELDS",
    "MAX_MODEL_LENGTH",
    "ChatChunkEncoder",
    "ChunkEncoder",
    "DONE",
    "chunk",
    "chat_completion",
    "completion",
    "parse_chat",
    "error_body",
    "parse_completion",
    "sse",
]

LARGE_BODY = 1 << 16
"""Bytes: a body past this is decoded with msgspec, in a worker thread (module
docstring). Below it `json.loads` takes at most about 2 ms."""

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default `max_tokens` for completions."""
DEFAULT_CHAT_MAX_TOKENS = 4096
"""`max_tokens` of a chat request that gives none (OpenAI: until the model's context is
full; a frontend that knows the model's length caps it there)."""

MAX_INT = (1 << 31) - 1
"""The largest `max_tokens` and token id taken: past it a number is a client bug, and
the engine's int fields would reject it with a less helpful message."""

MAX_MODEL_LENGTH = 256
"""The longest `model` taken (characters). The name is echoed in the response, and in
every chunk of a stream: unbounded, a 3 MB name made each chunk 3 MB (a client could
have the gateway write hundreds of MiB a second for a few tokens)."""

GATEWAY_FIELDS = frozenset(
    {"model", "prompt", "max_tokens", "stream", "stream_options", "user", "n"}
)
"""The fields the gateway itself reads and checks."""
OPENAI_FIELDS = frozenset(
    {
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "presence_penalty",
        "seed",
        "stop",
        "suffix",
        "temperature",
        "top_p",
    }
)
"""The other fields of OpenAI's completions API: a frontend may honour some of them."""
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "stop": ([], ""),
    "suffix": ("",),
    "top_p": (1,),
}
"""Values that ask for nothing (what the field's absence means): taken whoever serves."""

DONE = b"data: [DONE]\n\n"
"""The last event of a stream that ended well."""


_ENCODER = json.JSONEncoder(separators=(",", ":"))
"""One encoder: `json.dumps` with arguments makes a new one per call."""


def _dumps(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


def _bad(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, "invalid_request_error", "invalid_request", message, param=param)


def _is_int(value: Any) -> bool:
    return type(value) is int


def _token_ids(value: list[Any]) -> tuple[int, ...] | None:
    if all(_is_int(v) and 0 <= v <= MAX_INT for v in value):
        return tuple(value)
    return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _show(value: Any) -> str:
    """A short description of a client's value for an error message: never the repr
    of a whole container (a deep one would exhaust the recursion limit)."""
    if isinstance(value, list | dict):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"
    if isinstance(value, str):
        return repr(value[:50]) + ("..." if len(value) > 50 else "")
    return f"{value!r:.50}"  # a number (json's own limit: at most 4300 digits), or a bool


_DIGIT_LIMIT = "integer string conversion"
"""In the `ValueError` of `json.loads` for an int past Python's digit limit."""


def _unsupported(key: str, value: Any) -> HTTPError:
    if key in OPENAI_FIELDS:
        return HTTPError(
            400,
            "invalid_request_error",
            "unsupported_parameter",
            f"'{key}' is not supported by this server's engine (got {_show(value)}); "
            "remove it: it would be ignored",
            param=key,
        )
    return HTTPError(
        400,
        "invalid_request_error",
        "unrecognized_argument",
        f"unrecognized request argument supplied: {key[:64]!r}",
        param=key[:64],
    )


def _same(value: Any, neutral: Any) -> bool:
    """`value` is `neutral` (0.0 is 0, False is not 0)."""
    return bool(value == neutral) and (type(value) is bool) == (type(neutral) is bool)


def _extra_fields(data: dict[str, Any], frontend_fields: frozenset[str]) -> dict[str, Any]:
    """The frontend's fields of `data`; `HTTPError` 400 for any field nobody reads."""
    raw: dict[str, Any] = {}
    for key, value in data.items():
        if key in GATEWAY_FIELDS or value is None:
            continue
        if key in frontend_fields:
            raw[key] = value
        elif not any(_same(value, n) for n in NEUTRAL.get(key, ())):
            raise _unsupported(key, value)
    return raw


def parse_completion(
    body: bytes,
    frontend_fields: frozenset[str] = frozenset(),
    *,
    max_prompt_tokens: int | None = None,
) -> CompletionRequest:
    """A validated request, or `HTTPError` 400 (invalid JSON, a wrong known field, a
    field neither the gateway nor the frontend (`frontend_fields`) reads, a prompt of
    more than `max_prompt_tokens` token ids)."""
    return _request(_json_object(body), frontend_fields, max_prompt_tokens=max_prompt_tokens)


_DECODER = msgspec.json.Decoder()


def _json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object: a large one by msgspec (one fast call), a small one by
    the standard library (whose error texts the tests and clients know)."""
    try:
        if len(body) > LARGE_BODY:
            data = _DECODER.decode(body[3:] if body.startswith(b"\xef\xbb\xbf") else body)
        else:
            data = json.loads(body, parse_constant=_no_constant)
    except msgspec.DecodeError as exc:  # (its ValidationError too: 1e400, 2**64)
        raise _bad(f"the body is not valid JSON: {exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        if _DIGIT_LIMIT in str(exc):  # not the server's hint to raise that limit
            raise _bad("the body has an integer too long to parse (a number of digits)") from None
        raise _bad(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _bad("the body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise _bad(f"the body must be a JSON object, not {type(data).__name__}")
    return data


def _request(
    data: dict[str, Any],
    frontend_fields: frozenset[str],
    *,
    chat: bool = False,
    max_prompt_tokens: int | None = None,
) -> CompletionRequest:
    prompt: str | tuple[int, ...]
    raw_prompt = data.get("prompt")
    if isinstance(raw_prompt, list) and len(raw_prompt) == 1 and not _is_int(raw_prompt[0]):
        raw_prompt = raw_prompt[0]  # a batch of one prompt
    if (
        max_prompt_tokens is not None
        and isinstance(raw_prompt, list)
        and len(raw_prompt) > max_prompt_tokens
        and raw_prompt
        and _is_int(raw_prompt[0])
    ):  # before its elements are looked at; vLLM's answer (a frontend with a length is vLLM's)
        raise HTTPError(
            400,
            "BadRequestError",
            "invalid_request",
            f"This model's maximum context length is {max_prompt_tokens} tokens. However, "
            f"your prompt contains {len(raw_prompt)} input tokens, which exceeds this limit "
            "even without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
        )
    if isinstance(raw_prompt, str):
        prompt = raw_prompt
    elif isinstance(raw_prompt, list) and raw_prompt and (ids := _token_ids(raw_prompt)):
        prompt = ids
    elif isinstance(raw_prompt, list) and len(raw_prompt) > 1 and not _is_int(raw_prompt[0]):
        raise _bad(
            f"a batch of {len(raw_prompt)} prompts: this gateway takes one prompt per request",
            "prompt",
        )
    elif raw_prompt is None and "prompt" not in data:
        raise _bad("'prompt' is required", "prompt")
    else:
        raise _bad(
            "'prompt' must be a string, a non-empty list of token ids (ints from 0 to "
            f"{MAX_INT}), "
            "or a list of one of those",
            "prompt",
        )
    asked = data.get("max_tokens")
    given = asked is not None
    # chat without it: as long as the model allows, up to a bound (the frontend caps it)
    max_tokens: Any = asked if given else DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or not 1 <= max_tokens <= MAX_INT:
        raise _bad(
            f"'max_tokens' must be an int from 1 to {MAX_INT}, got {_show(max_tokens)}",
            "max_tokens",
        )
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if type(stream) is not bool:
        raise _bad(f"'stream' must be a boolean, got {_show(stream)}", "stream")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if model is not None and len(model) > MAX_MODEL_LENGTH:
        raise _bad(
            f"'model' is {len(model)} characters long; at most {MAX_MODEL_LENGTH} are taken",
            "model",
        )
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    n = data.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise _bad(f"'n' must be 1 (one choice per request), got {_show(n)}", "n")
    options = data.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        include_usage = options.get("include_usage") is True
    raw = _extra_fields(data, frontend_fields)
    return CompletionRequest(
        prompt, max_tokens, stream, model, user, include_usage, raw, chat, given
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    stop_reason: int | str | None = None,
) -> bytes:
    """The `text_completion` object of a non-streaming request (`stop_reason`: vLLM's,
    the stop string or token id that ended it, frontend.Piece)."""
    choice = {
        "text": text,
        "index": 0,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    return _answer(
        "text_completion", request_id, created, model, choice, prompt_tokens, completion_tokens
    )


def _answer(
    kind: str,
    request_id: str,
    created: int,
    model: str,
    choice: dict[str, Any],
    prompt_tokens: int,
    completion_tokens: int,
) -> bytes:
    return _dumps(
        {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(prompt_tokens, completion_tokens),
        }
    )


def sse(payload: bytes) -> bytes:
    """One server-sent event carrying `payload` (JSON: no newlines in it)."""
    return b"data: " + payload + b"\n\n"


def chunk(
    request_id: str,
    created: int,
    model: str,
    text: str | None,
    finish_reason: str | None,
    usage: tuple[int, int] | None = None,
    *,
    kind: str = "text_completion",
    stop_reason: int | str | None = None,
) -> bytes:
    """One streaming chunk: a choice with `text` (None: no choice, the usage chunk of
    `stream_options.include_usage`), and `usage` (prompt, completion tokens) if given.
    `kind`: the object (``chat.completion.chunk`` for chat's usage chunk)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": []
        if text is None
        else [
            {
                "text": text,
                "index": 0,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }
    if usage is not None:
        body["usage"] = _usage(*usage)
    return sse(_dumps(body))


def _finish(finish_reason: str | None) -> bytes:
    """A chunk's finish reason and the end of its event."""
    reason = b"null" if finish_reason is None else _ENCODER.encode(finish_reason).encode()
    return reason + b"}]}\n\n"


_NO_STOP_REASON = b',"stop_reason":null}]}\n\n'


def _finish_stop(finish_reason: str | None, stop_reason: int | str | None) -> bytes:
    """A chunk's finish reason, vLLM's `stop_reason`, and the end of its event."""
    if finish_reason is None:
        return b"null" + _NO_STOP_REASON
    reason = _ENCODER.encode(finish_reason).encode()
    if stop_reason is None:
        return reason + _NO_STOP_REASON
    return reason + b',"stop_reason":' + _ENCODER.encode(stop_reason).encode() + b"}]}\n\n"


def _chunk_prefix(kind: str, request_id: str, created: int, model: str, choice: bytes) -> bytes:
    """``data: {"id":...,"object":kind,"created":...,"model":...,"choices":[`` + `choice`:
    what a request's chunks share, encoded once."""
    head = _ENCODER.encode({"id": request_id, "object": kind, "created": created, "model": model})
    return b"data: " + head[:-1].encode() + b',"choices":[' + choice


class ChunkEncoder:
    """`chunk(...)` of one request's text chunks, faster: the JSON around the text is
    encoded once per request, and each write encodes only its text and finish reason
    (3.9 -> 0.3 µs a write, measured by benchmarks/bench_gateway.py --profile). The
    bytes are `chunk`'s exactly (tests/test_gateway_format.py)."""

    __slots__ = ("_prefix",)

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._prefix = _chunk_prefix("text_completion", request_id, created, model, b'{"text":')

    def text(
        self, text: str, finish_reason: str | None, stop_reason: int | str | None = None
    ) -> bytes:
        # (every chunk has a `stop_reason`, null until the last: vLLM's completion chunks)
        return b"".join(
            (
                self._prefix,
                _ENCODER.encode(text).encode(),
                b',"index":0,"logprobs":null,"finish_reason":',
                _finish_stop(finish_reason, stop_reason),
            )
        )


class ChatChunkEncoder:
    """`ChunkEncoder` for `/v1/chat/completions`: ``chat.completion.chunk`` objects whose
    choice carries a `delta` (the first with ``"role": "assistant"``), as OpenAI sends."""

    __slots__ = ("_first", "_prefix")

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._prefix = _chunk_prefix(
            "chat.completion.chunk", request_id, created, model, b'{"index":0,"delta":'
        )
        self._first = True

    def text(
        self, text: str, finish_reason: str | None, stop_reason: int | str | None = None
    ) -> bytes:
        delta: dict[str, str] = {"content": text} if text or finish_reason is None else {}
        if self._first:
            self._first = False
            delta = {"role": "assistant", "content": text}
        # (the last chunk has a `stop_reason`, the others none: vLLM's chat chunks)
        return b"".join(
            (
                self._prefix,
                _ENCODER.encode(delta).encode(),
                b',"logprobs":null,"finish_reason":',
                _finish(None)
                if finish_reason is None
                else _finish_stop(finish_reason, stop_reason),
            )
        )


def chat_completion(
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    stop_reason: int | str | None = None,
) -> bytes:
    """The `chat.completion` object of a non-streaming chat request."""
    message = {"role": "assistant", "content": text}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    return _answer(
        "chat.completion", request_id, created, model, choice, prompt_tokens, completion_tokens
    )


CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,),
    "top_logprobs": (0,),
    "tools": ([],),
    "parallel_tool_calls": (True, False),
}
"""Chat fields whose value asks for nothing (taken whoever serves)."""
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
"""The message roles taken."""


def _messages(data: dict[str, Any], max_messages: int | None = None) -> tuple[dict[str, str], ...]:
    """`messages` as (role, content) maps with text content; `HTTPError` 400 otherwise
    (more than `max_messages` of them: at once, before any is looked at)."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array of messages", "messages")
    if max_messages is not None and len(messages) > max_messages:
        raise _bad(
            f"'messages' has {len(messages)} messages: more than this model's maximum "
            f"context length ({max_messages} tokens) can hold (a message takes at least "
            "one token)",
            "messages",
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"'{where}' must be an object", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _bad(
                f"'{where}.role' must be one of {', '.join(sorted(CHAT_ROLES))}, got {_show(role)}",
                "messages",
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones are taken
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise _bad(f"'{where}.content': only text parts are supported", "messages")
                if not isinstance(part.get("text"), str):
                    raise _bad(f"'{where}.content': a text part needs 'text'", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)  # as vLLM joins text parts
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"'{where}.content' must be a string or text parts", "messages")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise _bad(
                f"'{where}' has fields this server does not support: "
                f"{', '.join(sorted(map(str, extra)))[:80]}",
                "messages",
            )
        out.append({"role": role, "content": content})
    return tuple(out)


def parse_chat(
    body: bytes,
    frontend_fields: frozenset[str] = frozenset(),
    *,
    max_prompt_tokens: int | None = None,
) -> tuple[CompletionRequest, tuple[dict[str, str], ...]]:
    """A `/v1/chat/completions` body: its messages, and the rest as a completion request
    whose prompt the frontend renders from them (`Frontend.chat_prompt`). `HTTPError` 400
    as `parse_completion`, and for more messages than `max_prompt_tokens`."""
    data = _json_object(body)
    messages = _messages(data, max_prompt_tokens)
    if "prompt" in data:
        raise _bad("'prompt' is a /v1/completions field: a chat has 'messages'", "prompt")
    rest = {k: v for k, v in data.items() if k not in ("messages", "max_completion_tokens")}
    if data.get("max_completion_tokens") is not None:
        rest["max_tokens"] = data["max_completion_tokens"]
    for name, neutral in CHAT_NEUTRAL.items():  # chat's own fields, asking for nothing
        if name in rest and any(_same(rest[name], n) for n in neutral):
            del rest[name]
    rest["prompt"] = "(chat)"
    return _request(rest, frontend_fields, chat=True), messages


def error_body(error: HTTPError) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}`, OpenAI's error object."""
    return _dumps(
        {
            "error": {
                "message": error.message,
                "type": error.type,
                "param": error.param,
                "code": error.code,
            }
        }
    )
