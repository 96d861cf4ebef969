"""`VllmFrontend`: OpenAI completions in front of vLLM engine cores (``vllm serve MODEL
--headless``), with the model directory's tokenizer, as vLLM's own frontend does it.

Theory of operation
-------------------
vLLM's engine cores take token ids and send token ids; everything textual is the
frontend's (vLLM's `InputProcessor` and `OutputProcessor`). Here, per request:

1. `prepare` tokenizes a text prompt (`tokenizers`, the model's ``tokenizer.json``, with
   its post-processor: BOS where the model wants one), or checks a token-id prompt: every
   id must be in the tokenizer's vocabulary (an id past the engine's embedding is fatal
   to the engine, so it never gets there). The prompt plus `max_tokens` must fit the
   model's length, as vLLM answers (400). The OpenAI sampling fields become vLLM's
   `SamplingParams` (`FIELDS`); `stop` strings stay here (the engine only knows stop
   token ids), and the model's EOS token id goes with the request.
2. `_Decoder.batch` turns a delivery's new token ids (every output the gateway took at
   once) into text incrementally, in one call and one loop (`decode`: one output's)
   (`tokenizers.decoders.DecodeStream`: a multi-byte character split over several
   tokens comes out whole, once its last byte is there; special tokens are skipped).
3. Stop strings: the text is searched as it grows. Up to the longest stop string minus
   one character is held back (it may be the start of a stop string the next token
   completes), so a stop string never reaches the client. On a match the text ends
   before it (vLLM's default, `include_stop_str_in_output` false) and the piece says
   ``finish_reason="stop"`` and, as vLLM, ``stop_reason`` the string (of several found,
   the one that ends first); an engine's stop on a `stop_token_ids` id has that id as
   its ``stop_reason``, EOS none: the gateway ends the response there and aborts the
   request on its rank. The engine's own finish releases what was held back. With
   `min_tokens`, as vLLM, only once more than that many tokens are out, and only a
   stop string that ends in the text of the tokens past them.

`usage.completion_tokens` counts the engine's tokens (those after a stop string
included, up to the output that completed it).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._core.messages import Output
from .frontend import CompletionRequest, Piece, Prepared, decode_each, first_stop

__all__ = [
    "FIELDS",
    "GENERATION_CONFIG",
    "MAX_STOP_STRINGS",
    "VllmFrontend",
    "VllmValidationError",
    "load_chat_template",
]

FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
    }
)
"""The request fields this frontend honours (OpenAI's, and vLLM's extensions of them)."""
MAX_STOP_STRINGS = 16
"""At most this many stop strings per request (OpenAI takes 4)."""
MAX_STOP_LENGTH = 256
"""The longest stop string taken (characters)."""
PRIME_TOKENS = 5
"""Prompt tokens the detokenizer starts from (vLLM's initial offset)."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""A completion's `max_tokens` when the client gives none (vLLM's and OpenAI's)."""
GENERATION_CONFIG = ("auto", "vllm")
"""`generation_config`'s words (else a folder): vLLM's ``--generation-config``."""
_SAMPLING_DEFAULTS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)
"""The generation config's fields vLLM takes as sampling defaults (`get_diff_sampling_param`)."""
_HF_DEFAULTS: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
}
"""Hugging Face's `GenerationConfig` defaults: a field at its default is not in vLLM's
`to_diff_dict()`, so it is no default of vLLM's either."""


class VllmValidationError(ValueError):
    """A request vLLM refuses with a 400 ``BadRequestError`` naming `param`: the gateway
    answers it with vLLM's type, message and param."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def load_chat_template(value: str) -> str:
    """vLLM's ``--chat-template``: a file's path (its text), else the template itself
    if it looks like one (it has ``{``, ``}`` or a newline). `ValueError` otherwise."""
    try:
        with open(value) as f:
            return f.read()
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"--chat-template {value!r}: no such file ({exc.strerror}), and not a "
                "template (no '{', '}' or newline)"
            ) from None
    return value


def generation_defaults(source: str, model_dir: Path) -> dict[str, Any]:
    """The sampling defaults vLLM takes from a model's ``generation_config.json``
    (``--generation-config``: "auto", the model directory's; "vllm", none; a folder,
    that folder's), with `max_new_tokens` as `max_tokens`: the fields of
    `_SAMPLING_DEFAULTS` not at Hugging Face's defaults."""
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else Path(source)
    if source != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {source}: no generation_config.json there")
    config = _read_json(folder / "generation_config.json")
    defaults = {
        k: v
        for k in _SAMPLING_DEFAULTS
        if (v := config.get(k)) is not None and (k not in _HF_DEFAULTS or v != _HF_DEFAULTS[k])
    }
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


@dataclass(frozen=True, slots=True)
class _Model:
    tokenizer: Any
    vocab: int
    eos_token_id: int | None
    max_model_len: int | None
    widest: int
    """The most characters one token stands for (its vocabulary string's length bounds
    them: byte-level and SentencePiece pieces are never shorter than their text)."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


def _first_int(value: Any) -> int | None:
    if type(value) is int:
        return value
    if isinstance(value, list) and value and type(value[0]) is int:
        return int(value[0])
    return None


def _number(raw: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = raw.get(name)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"'{name}' must be a number from {low:g} to {high:g}, got {value!r:.40}")
    return float(value)


def _integer(raw: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"'{name}' must be an int from {low} to {high}, got {value!r:.40}")
    return value


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in stops)
    ):
        raise ValueError(
            f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings of 1 "
            f"to {MAX_STOP_LENGTH} characters"
        )
    return tuple(stops)


class VllmFrontend:
    """Completions for vLLM engine cores: `VllmFrontend("/models/tiny")` reads the model
    directory's ``tokenizer.json`` (and ``config.json``, ``generation_config.json``
    for the EOS token id and the model length). Serve it with a group from
    `zmqdp.vllm.connect` (or `python -m zmqdp serve --vllm MODEL_DIR`).

    As vLLM's frontend (``vllm serve``'s flags of the same names):

    * `max_model_len`: the longest prompt + completion (default: the model's
      ``max_position_embeddings``, else the tokenizer's ``model_max_length``); once the
      engines are up, `learn_engines` lowers it to theirs (vLLM takes the least of its
      own and the engines' ready responses);
    * `tokenizer`: the directory of ``tokenizer.json`` and ``tokenizer_config.json``
      (default: `model_dir`);
    * `chat_template`: a template replacing the tokenizer's (`load_chat_template`);
    * `generation_config`: where the sampling defaults come from (`generation_defaults`):
      a request's own fields win, then these, then vLLM's neutral values; a folder's
      ``max_new_tokens`` caps every request (`override_max_tokens`), as in vLLM."""

    fields = FIELDS
    threaded = True
    """The gateway runs `chat_prompt` and `prepare` in a worker thread: tokenizing a
    long prompt takes long enough to hold up every other request on the event loop (and
    the tokenizer lets go of the GIL meanwhile: `_encoding`)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_model_len: int | None = None,
        tokenizer: str | Path | None = None,
        chat_template: str | None = None,
        generation_config: str = "auto",
    ) -> None:
        from tokenizers import Tokenizer

        directory = Path(model_dir)
        words = Path(tokenizer) if tokenizer is not None else directory
        path = words / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{words}: no tokenizer.json (a Hugging Face model directory)")
        tokenizer_ = Tokenizer.from_file(str(path))
        config = _read_json(directory / "config.json")
        generation = _read_json(directory / "generation_config.json")
        tokenizer_config = _read_json(words / "tokenizer_config.json")
        self.sampling_defaults: dict[str, Any] = generation_defaults(generation_config, directory)
        """The model's sampling defaults, as vLLM applies them (`generation_defaults`)."""
        cap = self.sampling_defaults.get("max_tokens")
        self.override_max_tokens: int | None = (
            cap
            if generation_config not in GENERATION_CONFIG and type(cap) is int and cap > 0
            else None
        )
        """A folder's ``max_new_tokens``: vLLM's `override_max_tokens`, a cap on every
        request's `max_tokens` (the model's own, "auto", is only a default)."""
        self.configured_max_model_len: int | None = None
        """The length from the flag or the model's config, before the engines' (`learn_engines`)."""
        eos = _first_int(generation.get("eos_token_id"))
        if eos is None:
            eos = _first_int(config.get("eos_token_id"))
        if eos is None and isinstance(tokenizer_config.get("eos_token"), str):
            eos = tokenizer_.token_to_id(tokenizer_config["eos_token"])
        if max_model_len is None:
            length = config.get("max_position_embeddings", tokenizer_config.get("model_max_length"))
            max_model_len = length if type(length) is int and 0 < length < 1 << 40 else None
        self.configured_max_model_len = max_model_len
        vocab = tokenizer_.get_vocab(with_added_tokens=True)
        self.model = _Model(
            tokenizer_,
            tokenizer_.get_vocab_size(with_added_tokens=True),
            eos,
            max_model_len,
            max(1, max((len(piece) for piece in vocab), default=1)),
        )
        self._special = {
            k: _token_text(tokenizer_config.get(k)) for k in ("bos_token", "eos_token")
        }
        source: Any = chat_template
        if source is None:
            source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # named templates: the "default" one
            source = next(
                (
                    t.get("template")
                    for t in source
                    if isinstance(t, dict) and t.get("name") == "default"
                ),
                None,
            )
        if not isinstance(source, str) and (words / "chat_template.jinja").is_file():
            source = (words / "chat_template.jinja").read_text()
        self._template: Any = None
        self.template_problem: str | None = None
        """Why chat is off for this model (no template, or one that does not compile);
        completions work either way."""
        if isinstance(source, str):
            try:
                self._template = _compile_template(source)
            except ValueError as exc:
                if chat_template is not None:  # the operator's own: refused at start
                    raise ValueError(f"--chat-template: {exc}") from None
                self.template_problem = str(exc)
        else:
            self.template_problem = (
                "this model has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja): use /v1/completions"
            )

    def chat_prompt(self, messages: tuple[Mapping[str, str], ...]) -> str:
        """The conversation rendered by the model's chat template (``chat_template`` of
        ``tokenizer_config.json``, else ``chat_template.jinja``), in a Jinja sandbox
        (a template cannot reach Python objects), with the generation prompt added, as
        vLLM and Hugging Face render it. `ValueError` if the model has no template or
        the template fails (its `raise_exception`, or an error of its own)."""
        template = self._template
        if template is None:
            raise ValueError(self.template_problem or "this model has no chat template")
        try:
            rendered: str = template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=True,
                bos_token=self._special.get("bos_token", ""),
                eos_token=self._special.get("eos_token", ""),
            )
        except Exception as exc:  # the template's own errors, sandbox refusals, anything
            raise ValueError(
                f"the model's chat template failed on these messages: {type(exc).__name__}: "
                f"{str(exc)[:200]}"
            ) from None
        return rendered

    def learn_engines(self, infos: Sequence[Mapping[str, Any]]) -> None:
        """Lower the model length to the engines' (each rank's ready response
        ``max_model_len``), as vLLM's frontend does once its engines are up: an engine
        started with ``--max-model-len 256`` under a config of 4096 has prompts checked
        against 256. Lengths only go down from `configured_max_model_len`."""
        lengths = [n for info in infos if type(n := info.get("max_model_len")) is int and n > 0]
        if not lengths:
            return
        length = min(lengths)
        if self.configured_max_model_len is not None:
            length = min(length, self.configured_max_model_len)
        if length != self.model.max_model_len:
            self.model = dataclasses.replace(self.model, max_model_len=length)

    @property
    def eos_token_id(self) -> int | None:
        return self.model.eos_token_id

    @property
    def max_prompt_tokens(self) -> int | None:
        """The most token ids a prompt can have (the model's length; None: unknown). The
        gateway refuses a longer token-id prompt, or a chat of more messages, before it
        looks at their elements (openai.py)."""
        return self.model.max_model_len

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text` (`special`: with the tokenizer's BOS/EOS post-processing).
        `ValueError` for text that cannot fit the model or has no UTF-8 form."""
        return self._encoding(text, special).ids  # type: ignore[no-any-return]

    def _encoding(self, text: str, special: bool) -> Any:
        """`text` tokenized (a `tokenizers.Encoding`: its length is the token count,
        known before a list of ids is made).

        A text that cannot fit the model is refused before tokenizing (a token stands
        for at most `widest` characters): a 2 MiB prompt takes seconds to tokenize. The
        tokenizer runs in `encode_batch_fast`, which releases the GIL while it works
        (`encode` did not, with tokenizers 0.23 under trio's worker thread: it froze the
        event loop, and every stream, for the whole 2 s of a long prompt), and skips the
        character offsets."""
        model = self.model
        length = model.max_model_len
        if length is not None and len(text) > length * model.widest:
            raise VllmValidationError(
                f"This model's maximum context length is {length} tokens. However, your "
                f"prompt contains {len(text)} characters (more than {length * model.widest} "
                f"characters, which is the upper bound for {length} input tokens). Please "
                "reduce the length of the input prompt.",
                "input_text",
            )
        try:
            return model.tokenizer.encode_batch_fast([text], add_special_tokens=special)[0]
        except TypeError:  # tokenizers' answer to a lone surrogate ("\ud800" in the JSON)
            raise ValueError("the prompt is not valid Unicode (a lone surrogate)") from None

    def prepare(self, request: CompletionRequest) -> Prepared:
        """`Frontend.prepare`: the prompt tokenized (or its token ids checked against the
        vocabulary), the sampling fields as vLLM's `SamplingParams`; a `ValueError` (400) for
        a prompt plus `max_tokens` past the model's length."""
        from ..vllm import SamplingParams, VllmRequest

        model = self.model
        prompt = request.prompt
        length = model.max_model_len
        max_tokens = request.max_tokens
        encoding: Any = None
        if isinstance(prompt, str):
            # a chat prompt has its special tokens from the template already
            encoding = self._encoding(prompt, not request.chat)
            count = len(encoding)
        else:
            count = len(prompt)
        if not count:
            raise ValueError("'prompt' is empty (no tokens)")
        defaults = self.sampling_defaults
        if not request.max_tokens_given:
            # vLLM: a completion's field defaults to 16; a chat's to the generation
            # config's max_new_tokens, else the rest of the model's length
            fallback: int | None = (
                defaults.get("max_tokens") if request.chat else DEFAULT_COMPLETION_MAX_TOKENS
            )
            if fallback is not None:
                max_tokens = fallback
            elif length is not None:
                max_tokens = length - count
        if length is not None:
            # vLLM's checks and clamp (TokenizeParams, get_max_tokens), before a list of
            # ids is made or each id looked at
            if count > length:
                raise VllmValidationError(
                    f"This model's maximum context length is {length} tokens. However, your "
                    f"prompt contains {count} input tokens, which exceeds this limit even "
                    "without any output tokens. Please reduce the length of the input prompt.",
                    "input_tokens",
                )
            if request.max_tokens_given and max_tokens > length:
                raise VllmValidationError(
                    f"max_tokens={max_tokens} cannot be greater than max_model_len={length}. "
                    "Please request fewer output tokens.",
                    "max_tokens",
                )
            max_tokens = min(max_tokens, length - count)
            if max_tokens < 1:
                raise VllmValidationError(
                    f"This model's maximum context length is {length} tokens. However, your "
                    f"prompt contains {count} input tokens, which leaves no room for output "
                    "tokens. Please reduce the length of the input prompt.",
                    "input_tokens",
                )
        if self.override_max_tokens is not None:  # (vLLM's get_max_tokens: the least)
            max_tokens = min(max_tokens, self.override_max_tokens)
        if isinstance(prompt, str):
            ids: list[int] = encoding.ids
        else:
            ids = list(prompt)
            bad = next((t for t in ids if t >= model.vocab), None)
            if bad is not None:
                raise ValueError(
                    f"'prompt': token id {bad} is out of vocabulary (the model has "
                    f"{model.vocab} tokens)"
                )
        raw = request.raw
        stop_ids = raw.get("stop_token_ids", [])
        if not isinstance(stop_ids, list) or not all(
            type(t) is int and 0 <= t < model.vocab for t in stop_ids
        ):
            raise ValueError(f"'stop_token_ids' must be a list of token ids below {model.vocab}")
        ignore_eos = raw.get("ignore_eos", False)
        if type(ignore_eos) is not bool:
            raise ValueError("'ignore_eos' must be a boolean")
        options: dict[str, Any | None] = {
            "temperature": _number(raw, "temperature", 0.0, 2.0),
            "top_p": _number(raw, "top_p", 1e-9, 1.0),
            "min_p": _number(raw, "min_p", 0.0, 1.0),
            "presence_penalty": _number(raw, "presence_penalty", -2.0, 2.0),
            "frequency_penalty": _number(raw, "frequency_penalty", -2.0, 2.0),
            "repetition_penalty": _number(raw, "repetition_penalty", 1e-9, 100.0),
            "top_k": _integer(raw, "top_k", -1, 1 << 20),
            "seed": _integer(raw, "seed", -(1 << 63), (1 << 63) - 1),
            "min_tokens": _integer(raw, "min_tokens", 0, max_tokens),
        }
        for name, value in defaults.items():  # the request's own fields win (vLLM)
            if options.get(name, 0) is None:
                options[name] = value if name == "top_k" else float(value)
        sampling = SamplingParams(
            **{k: v for k, v in options.items() if v is not None},
            max_tokens=max_tokens,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=ignore_eos,
        )
        stops = _stops(raw.get("stop"))
        eos = model.eos_token_id

        def make(request_id: str, rank: int | None) -> VllmRequest:
            return VllmRequest(request_id, ids, sampling, eos_token_id=eos, rank=rank)

        min_tokens = options["min_tokens"] or 0
        decoder = _Decoder(model.tokenizer, stops, ids[-PRIME_TOKENS:], min_tokens)
        return Prepared(None, len(ids), decoder, make)


def _token_text(value: Any) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken map."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _compile_template(source: str) -> Any:
    """A chat template compiled in Jinja's immutable sandbox, with Hugging Face's
    conventions: `trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`,
    `strftime_now`, and `tojson` as `json.dumps` (non-ASCII kept, keys in order)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def strftime_now(format: str) -> str:
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the model's chat template does not compile: {exc}") from None


_FINISHES = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class _Decoder:
    """One request's incremental detokenizer and stop-string check (module docstring,
    steps 2 and 3)."""

    __slots__ = ("_before", "_held", "_hold", "_step", "_stops", "_stream", "_tokenizer")

    def __init__(
        self,
        tokenizer: Any,
        stops: tuple[str, ...],
        prime: list[int] | None = None,
        min_tokens: int = 0,
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        # Primed with the prompt's last tokens, as vLLM's detokenizer starts: a
        # SentencePiece tokenizer drops the leading space of a text's first token.
        self._stream = DecodeStream(ids=prime or [], skip_special_tokens=True)
        self._step: Callable[[Any, int], str | None] = self._stream.step
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._held = ""
        self._before = min_tokens  # tokens before stop strings count (vLLM's min_tokens)

    def decode(self, output: Output) -> Piece:
        body = output.body
        ids = getattr(body, "token_ids", None) or []
        step, tokenizer = self._step, self._tokenizer
        parts = []
        finish = output.finish
        # An engine's "stop" is its EOS or a stop token id: vLLM's detokenizer leaves
        # that last token's text out (`include_stop_str_in_output` false), and so do we.
        texts = ids[:-1] if finish == "stop" else ids
        before = self._before if self._stops else 0
        pre = 0  # characters of this output's text within `min_tokens`
        if 0 < before < len(ids):  # `min_tokens` ends inside this output
            for t in texts[:before]:
                piece = step(tokenizer, t)
                if piece is not None:
                    parts.append(piece)
            pre = sum(map(len, parts))
            texts = texts[before:]
        for t in texts:  # (a plain loop: `step` of a
            piece = step(tokenizer, t)  # list holds back text it would not)
            if piece is not None:
                parts.append(piece)
        text = "".join(parts)
        if not self._stops:
            if finish is None:
                return Piece(text, len(ids), None)
            return Piece(
                text, len(ids), _FINISHES.get(finish, finish), getattr(body, "stop_reason", None)
            )
        held = self._held + text
        self._before -= len(ids)
        if self._before < 0:  # vLLM: past `min_tokens`, a stop string ending in new text
            match = _first_stop(held, self._stops, len(self._held) + pre)
            if match is not None:
                self._held = ""
                return Piece(held[: match[1]], len(ids), "stop", match[0])
        if finish is not None:
            self._held = ""
            return Piece(
                held, len(ids), _FINISHES.get(finish, finish), getattr(body, "stop_reason", None)
            )
        keep = len(held) - self._hold
        if keep <= 0:
            self._held = held
            return Piece("", len(ids), None)
        self._held = held[keep:]
        return Piece(held[:keep], len(ids), None)

    __call__ = decode

    def batch(self, outputs: Sequence[Output]) -> Piece:
        """`decode` of each output, in one call (`frontend.BatchDecode`): the same text,
        tokens and finish as the outputs' pieces joined, up to the output that ends the
        answer. Without stop strings (the hot path), one loop over the delivery's token
        ids and one `Piece`; with them, `decode` per output (held text and `min_tokens`
        are decided output by output, and stay exactly so)."""
        if self._stops:
            return decode_each(self.decode, outputs)
        step, tokenizer = self._step, self._tokenizer
        parts = []
        tokens = 0
        for output in outputs:
            ids = getattr(output.body, "token_ids", None) or ()
            tokens += len(ids)
            finish = output.finish
            for t in ids[:-1] if finish == "stop" else ids:  # (`decode`: a stop token's
                piece = step(tokenizer, t)  # text is left out, as vLLM does)
                if piece is not None:
                    parts.append(piece)
            if finish is not None:
                return Piece(
                    "".join(parts),
                    tokens,
                    _FINISHES.get(finish, finish),
                    getattr(output.body, "stop_reason", None),
                )
        return Piece("".join(parts), tokens, None)


_first_stop = first_stop  # (the mock's too: frontend.py)
