"""The gateway in front of vLLM engine cores (`VllmFrontend`, issue 22): the model
directory's tokenizer, incremental detokenization, stop strings checked by the gateway,
the OpenAI sampling fields as vLLM's `SamplingParams`, and the refusals that keep bad
input away from the engines. Against tests/fakes/vllm.py's faithful fake engines (real
engines: tests/real_vllm/), the model directory tests/data/tiny-model/ (the real-engine
suite's dense model: a byte-level BPE tokenizer of 870 tokens, no weights).

The fakes generate token ids counting up from the prompt's last one: after "x" (id 91)
come 92, 93, ... which decode to "yz{|}~" and then to byte tokens that only make whole
characters together.
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from zmqdp._core.messages import Output
from zmqdp.gateway import GatewayApp, VllmFrontend, create_app
from zmqdp.gateway.completions import INLINE_PREPARE
from zmqdp.gateway.frontend import Piece, decode_each
from zmqdp.gateway.vllm_frontend import _Decoder
from zmqdp.mock import MockConfig
from zmqdp.vllm import VllmOutput

from .gateway_helpers import all_events, events
from .helpers import wait_until
from .test_gateway import serving
from .test_vllm_group import vllm_group

pytest.importorskip("tokenizers", reason="the vllm extra (tokenizers)")

MODEL = Path(__file__).parent / "data" / "tiny-model"


def frontend() -> VllmFrontend:
    return VllmFrontend(MODEL)


@functools.cache
def _tokenizer() -> Any:
    return frontend().model.tokenizer


def text_of(ids: list[int]) -> str:
    decoded: str = frontend().model.tokenizer.decode(ids, skip_special_tokens=True)
    return decoded


async def test_a_text_prompt_is_tokenized_and_the_answer_detokenized() -> None:
    async with vllm_group(2) as (group, fake):
        app: GatewayApp = create_app(group=group, frontend=frontend(), model="tiny")
        async with serving(app) as client:
            response = await client.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 6, "temperature": 0}
            )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == "yz{|}~" == text_of(list(range(92, 98)))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7}
    [add] = [a for e in fake.engines for a in e.got("add")]
    assert add[1] == [91]  # the tokenized prompt
    assert add[3]["temperature"] == 0.0 and add[3]["max_tokens"] == 6
    assert add[3]["_eos_token_id"] == 0  # the model's EOS (generation_config.json)


async def test_sampling_fields_reach_the_engine_as_vllms_sampling_params() -> None:
    fields = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 7, "stop_token_ids": [3]}
    async with (
        vllm_group(1) as (group, fake),
        serving(create_app(group=group, frontend=frontend())) as client,
    ):
        response = await client.post(
            "/v1/completions", json={"prompt": [10, 20], "max_tokens": 2, **fields}
        )
    assert response.status_code == 200, response.text
    [add] = fake.engines[0].got("add")
    sampling = add[3]
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"]) == (0.5, 0.9, 5)
    assert sampling["seed"] == 7 and sampling["stop_token_ids"] == [3]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_ends_the_answer_before_it_and_aborts_the_request(
    stream: bool,
) -> None:
    # one step every 10 ms: the 400 tokens would take 4 s, the stop string comes at the
    # fourth, so the request is still running on its rank when the gateway aborts it
    async with vllm_group(1, fake_kw={"step_delay": 0.01}) as (group, fake):
        async with serving(create_app(group=group, frontend=frontend())) as client:
            request = {"prompt": "x", "max_tokens": 400, "stop": ["|}"], "stream": stream}
            if stream:
                async with client.stream("POST", "/v1/completions", json=request) as response:
                    events = await all_events(response)
                assert events[-1] == "[DONE]"
                chunks = events[:-1]
                text = "".join(_chunk_text(c) for c in chunks)
                assert all("|}" not in _chunk_text(c) for c in chunks)
                finish = _finish_of(chunks)
            else:
                response = await client.post("/v1/completions", json=request)
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                text, finish = choice["text"], choice["finish_reason"]
        engine = fake.engines[0]
        await engine.wait_for(lambda: bool(engine.got("abort")))
    assert text == "yz{" and finish == "stop"


def _chunk_text(event: str) -> str:
    choices = json.loads(event)["choices"]
    return "".join(c["text"] for c in choices)


def _finish_of(events: list[str]) -> str | None:
    for event in events:
        for c in json.loads(event)["choices"]:
            if c.get("finish_reason"):
                return str(c["finish_reason"])
    return None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [10, 870]}, "out of vocabulary"),
        ({"prompt": "x", "max_tokens": 513}, "max_tokens=513 cannot be greater than"),
        ({"prompt": list(range(1, 514))}, "maximum context length is 512 tokens"),
        ({"prompt": "x", "temperature": 3}, "'temperature' must be a number from 0 to 2"),
        ({"prompt": "x", "stop": [""]}, "'stop' must be"),
        ({"prompt": "x", "stop_token_ids": [9999]}, "'stop_token_ids'"),
        ({"prompt": "x", "logprobs": 1}, "'logprobs' is not supported"),
    ],
)
async def test_bad_input_is_a_400_and_never_reaches_an_engine(
    body: dict[str, Any], param: str
) -> None:
    async with (
        vllm_group(1) as (group, fake),
        serving(create_app(group=group, frontend=frontend())) as client,
    ):
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"]
    assert fake.engines[0].got("add") == []


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab xyz\néö🙂{}"), min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_incremental_detokenization_equals_decoding_the_whole(text: str, cuts: list[int]) -> None:
    """Any split of a token sequence into outputs gives the text of the whole sequence
    (multi-byte characters over several byte tokens included)."""
    d = frontend()
    ids = d.encode(text)
    bounds = sorted({min(c, len(ids)) for c in cuts} | {0, len(ids)})
    decoder = _Decoder(d.model.tokenizer, ())
    pieces = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        last = i == len(bounds) - 2
        out = Output("r", VllmOutput(ids[a:b]), "length" if last else None)
        pieces.append(decoder.decode(out).text)
    assert "".join(pieces) == d.model.tokenizer.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab xyz"), min_size=1, max_size=40),
    stop=st.text(alphabet=st.sampled_from("ab xy"), min_size=1, max_size=3),
)
def test_stop_strings_end_the_text_at_their_first_occurrence(text: str, stop: str) -> None:
    d = frontend()
    ids = d.encode(text)
    decoder = _Decoder(d.model.tokenizer, (stop,))
    out_text, finish = "", None
    for i, t in enumerate(ids):
        piece = decoder.decode(
            Output("r", VllmOutput([t]), "length" if i == len(ids) - 1 else None)
        )
        out_text += piece.text
        if piece.finish_reason is not None:
            finish = piece.finish_reason
            break
    if stop in text:
        assert (out_text, finish) == (text[: text.index(stop)], "stop")
    else:
        assert (out_text, finish) == (text, "length")


def _split(items: list[Any], cuts: list[int]) -> list[list[Any]]:
    bounds = sorted({min(c, len(items)) for c in cuts} | {0, len(items)})
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


def _batches_match(
    make: Any,
    ids: list[int],
    output_cuts: list[int],
    batch_cuts: list[int],
    stops: tuple[str, ...],
    min_tokens: int,
    empty: int,
) -> None:
    """Batch decoding (`make(...)`'s `batch`) gives, for every delivery, the piece that
    per-output decoding (`_Decoder.decode`) joins for it (`decode_each`): the same text,
    tokens and finish, and ends at the same delivery."""
    tokenizer = _tokenizer()
    chunks = _split(ids, output_cuts)
    chunks.insert(min(empty, len(chunks)), [])  # an output without token ids
    outputs = [
        Output("r", VllmOutput(c), "length" if i == len(chunks) - 1 else None)
        for i, c in enumerate(chunks)
    ]
    per_output = _Decoder(tokenizer, stops, [91], min_tokens)
    batched = make(tokenizer, stops, [91], min_tokens)
    for delivery in _split(outputs, batch_cuts):
        want = decode_each(per_output.decode, delivery)
        assert batched.batch(delivery) == want
        if want.finish_reason is not None:
            break


_IDS = st.one_of(
    st.lists(st.integers(0, 869), min_size=1, max_size=40),  # any: bytes, specials
    st.text(alphabet=st.sampled_from("ab st{}0é🙂"), min_size=1, max_size=30).map(
        lambda text: _tokenizer().encode(text, add_special_tokens=False).ids
    ),
)
_CUTS = st.lists(st.integers(0, 40), max_size=12)


@st.composite
def _stops_in(draw: Any, ids: list[int]) -> tuple[str, ...]:
    """Up to two stop strings, mostly pieces of the ids' own text (so that they hit)."""
    text = _tokenizer().decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(draw(st.integers(0, 2))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start : start + draw(st.integers(1, 3))])
        else:
            stops.append(
                draw(st.text(alphabet=st.sampled_from("ab st{}0é"), min_size=1, max_size=3))
            )
    return tuple(stops)


_CASE = _IDS.flatmap(lambda ids: st.tuples(st.just(ids), _stops_in(ids)))


@settings(max_examples=300, deadline=None)
@given(_CASE, _CUTS, _CUTS, st.integers(0, 8), st.integers(0, 40))
def test_batch_decoding_equals_decoding_each_output(
    case: tuple[list[int], tuple[str, ...]],
    output_cuts: list[int],
    batch_cuts: list[int],
    min_tokens: int,
    empty: int,
) -> None:
    """Any token ids (byte tokens and special ones included), split into outputs at
    random, the outputs into deliveries at random: one `batch` call per delivery equals
    `decode` per output joined, stop strings, `min_tokens` and held text included."""
    ids, stops = case
    _batches_match(_Decoder, ids, output_cuts, batch_cuts, stops, min_tokens, empty)


class _ListStep(_Decoder):
    """A broken batch decoder: `DecodeStream.step` given a delivery's ids as one list
    (tokenizers takes one), which holds back text that stepping id by id gives out."""

    __slots__ = ()

    def batch(self, outputs: Any) -> Any:
        if self._stops:
            return super().batch(outputs)
        ids = [t for out in outputs for t in out.body.token_ids]
        text = self._step(self._tokenizer, ids) if ids else None
        finish = next((o.finish for o in outputs if o.finish is not None), None)
        return Piece(text or "", len(ids), finish)


class _StopsOnceADelivery(_Decoder):
    """A broken batch decoder: stop strings looked for once in the delivery's text, not
    output by output (text given out while `min_tokens` ran is searched too)."""

    __slots__ = ()

    def batch(self, outputs: Any) -> Any:
        if not self._stops:
            return super().batch(outputs)
        parts, tokens = [], 0
        for out in outputs:
            for t in out.body.token_ids:
                parts.append(self._step(self._tokenizer, t) or "")
            tokens += len(out.body.token_ids)
            if out.finish is not None:
                break
        held = self._held + "".join(parts)
        self._before -= tokens
        cuts = [i for s in self._stops if (i := held.find(s)) >= 0] if self._before <= 0 else []
        ended = out.finish is not None
        if cuts:
            self._held = ""
            return Piece(held[: min(cuts)], tokens, "stop")
        if ended:
            self._held = ""
            return Piece(held, tokens, out.finish)
        keep = max(0, len(held) - self._hold)
        self._held = held[keep:]
        return Piece(held[:keep], tokens, None)


@pytest.mark.parametrize("broken", [_ListStep, _StopsOnceADelivery])
def test_the_batch_property_catches_a_broken_batch_decoder(broken: Any) -> None:
    """The property above fails for each broken variant (the check is not vacuous)."""

    # the explicit example is one that `_ListStep` fails (found by Hypothesis): random
    # generation alone missed it about one run in eight
    @settings(
        max_examples=300, deadline=None, database=None, phases=[Phase.explicit, Phase.generate]
    )
    @given(_CASE, _CUTS, _CUTS, st.integers(0, 8), st.integers(0, 40))
    @example(([4, 98], ()), [], [], 0, 0)
    def check(
        case: tuple[list[int], tuple[str, ...]],
        output_cuts: list[int],
        batch_cuts: list[int],
        min_tokens: int,
        empty: int,
    ) -> None:
        ids, stops = case
        _batches_match(broken, ids, output_cuts, batch_cuts, stops, min_tokens, empty)

    with pytest.raises(AssertionError):
        check()


async def test_chat_renders_the_models_template_and_streams_deltas() -> None:
    async with (
        vllm_group(1) as (group, fake),
        serving(create_app(group=group, frontend=frontend())) as client,
    ):
        messages = [{"role": "user", "content": "x"}]
        response = await client.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 3}
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    rendered = "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    [add] = fake.engines[0].got("add")
    assert add[1] == frontend().encode(rendered, special=False)
    assert body["usage"]["prompt_tokens"] == len(add[1])
    assert body["choices"][0]["message"]["content"] == text_of(
        list(range(add[1][-1] + 1, add[1][-1] + 4))
    )


async def test_a_chat_without_max_tokens_gets_the_rest_of_the_models_length() -> None:
    async with (
        vllm_group(1) as (group, fake),
        serving(create_app(group=group, frontend=frontend())) as client,
    ):
        response = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "stream": True},
        )
        await response.aread()
    [add] = fake.engines[0].got("add")
    assert add[3]["max_tokens"] == 512 - len(add[1])


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ raise_exception('no system role here') }}", "no system role here"),
        ("{{ messages.__class__.__mro__ }}", "SecurityError"),
        ("{% for m in messages %}{{ m['nope'].x }}{% endfor %}", "UndefinedError"),
    ],
)
async def test_a_template_that_fails_is_a_400_naming_messages(
    tmp_path: Path, template: str, expected: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for f in MODEL.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "chat_template.jinja").write_text(template)
    bad = VllmFrontend(model)
    async with (
        vllm_group(1) as (group, fake),
        serving(create_app(group=group, frontend=bad)) as client,
    ):
        response = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and expected in error["message"]
    assert fake.engines[0].got("add") == []


# -- a hostile review's findings (each failed before its fix) ---------------------------


def test_a_prompt_too_long_for_the_model_is_refused_before_tokenizing() -> None:
    d = frontend()
    limit = 512 * d.model.widest
    with pytest.raises(ValueError, match="maximum context length"):
        d.encode("x" * (limit + 1))
    with pytest.raises(ValueError, match="lone surrogate"):
        d.encode("a\ud800")


async def test_the_frontends_work_runs_in_a_worker_thread_past_a_short_body() -> None:
    """Tokenizing (and rendering a chat) is the frontend's slow work: on the event loop
    a 4 MiB prompt held up every other stream for seconds. A body past `INLINE_PREPARE`
    bytes is prepared in a worker thread; a short one on the event loop (a thread's
    round trip costs more than tokenizing it)."""
    import threading

    seen: list[int] = []

    class Spy(VllmFrontend):
        def prepare(self, request: Any) -> Any:
            seen.append(threading.get_ident())
            return super().prepare(request)

    short = json.dumps({"prompt": "x", "max_tokens": 1})
    long = short + " " * INLINE_PREPARE  # JSON's whitespace: the same request, longer
    with trio.fail_after(30):
        async with (
            vllm_group(1) as (group, _),
            serving(create_app(group=group, frontend=Spy(MODEL))) as client,
        ):
            loop_thread = threading.get_ident()
            answers = [
                await client.post(
                    "/v1/completions", content=body, headers={"content-type": "application/json"}
                )
                for body in (short, long)
            ]
    assert [a.status_code for a in answers] == [200, 200]
    assert len(seen) == 2
    assert seen[0] == loop_thread and seen[1] != loop_thread


def test_the_detokenizer_starts_from_the_prompts_tail() -> None:
    """A SentencePiece (Metaspace) tokenizer drops a text's first leading space: the
    first completion token must be decoded after the prompt, as vLLM does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"▁The": 0, "▁capital": 1, "▁Paris": 2, "▁and": 3, "▁Rome": 4, "[UNK]": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    primed = _Decoder(tok, (), [0, 1])
    out = Output("r", VllmOutput([2, 3, 4]), "length")
    assert primed.decode(out).text == " Paris and Rome"


def test_stop_strings_wait_for_min_tokens() -> None:
    d = frontend()
    decoder = _Decoder(d.model.tokenizer, ("z",), [91], min_tokens=6)
    pieces = [decoder.decode(Output("r", VllmOutput([t]), None)) for t in range(92, 99)]
    text = "".join(p.text for p in pieces)
    assert all(p.finish_reason is None for p in pieces[:6]) and text.startswith("yz{")


@pytest.mark.parametrize(
    ("stop", "min_tokens", "cuts"),
    [("z", 2, [1] * 4), ("yz", 2, [1] * 4), ("yz", 2, [2, 2]), ("z{", 1, [3, 1])],
)
def test_a_stop_string_within_min_tokens_never_stops_as_in_vllm(
    stop: str, min_tokens: int, cuts: list[int]
) -> None:
    """vLLM's detokenizer looks for stop strings once more than `min_tokens` tokens
    are out, and only for one that ends in the text of those past it: "yz{|" with
    min_tokens 2 never stops on "z" nor "yz", and with min_tokens 1 it stops on "z{"
    (which ends in the third token). Before, the gateway also stopped at exactly
    `min_tokens` tokens, and on a string lying in the text `min_tokens` covered."""
    d = frontend()
    decoder = _Decoder(d.model.tokenizer, (stop,), [91], min_tokens)
    ids = iter(range(92, 96))
    outputs = [Output("r", VllmOutput([next(ids) for _ in range(n)]), None) for n in cuts]
    piece = decode_each(decoder.decode, outputs)
    if stop == "z{":
        assert (piece.text, piece.finish_reason, piece.stop_reason) == ("y", "stop", "z{")
    else:
        assert piece.finish_reason is None and piece.text + decoder._held == "yz{|"


def test_hugging_face_template_conventions(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for f in MODEL.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<|bos|>", "lstrip": False}  # an AddedToken map
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson }}{% endfor %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = VllmFrontend(model).chat_prompt(({"role": "user", "content": "é<b>"},))
    assert rendered == '<|bos|>{"role": "user", "content": "é<b>"}'
    config["chat_template"] = "{% for %}"  # does not compile: chat is off, not the model
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    broken = VllmFrontend(model)
    assert broken.template_problem is not None and "does not compile" in broken.template_problem
    with pytest.raises(ValueError, match="does not compile"):
        broken.chat_prompt(({"role": "user", "content": "x"},))


@pytest.mark.parametrize(
    ("path", "body", "code", "expected"),
    [
        ("/v1/completions", {"prompt": "a\ud800"}, 400, "lone surrogate"),
        ("/v1/completions", {"prompt": "x", "stream_options": {}}, 400, "only allowed"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt": [5]},
            400,
            "'prompt' is a",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": False, "max_tokens": 1},
            200,
            "",
        ),
    ],
)
async def test_request_shapes_found_by_the_review(
    path: str, body: dict[str, Any], code: int, expected: str
) -> None:
    async with (
        vllm_group(1) as (group, _),
        serving(create_app(group=group, frontend=frontend())) as client,
    ):
        response = await client.post(path, content=json.dumps(body).encode())
    assert response.status_code == code, response.text
    if expected:
        assert expected in response.json()["error"]["message"]


def test_an_api_key_must_be_sendable() -> None:
    for bad in ("", "k ", "k\n", "ключ"):
        with pytest.raises(ValueError, match="visible ASCII"):
            create_app(mock=MockConfig(engines=1), api_key=bad)


async def test_a_client_leaving_mid_detokenization_aborts_its_request_once() -> None:
    """The client goes away while the gateway is between the bytes of a multi-byte
    character (after "yz{|}~" the fakes' ids are byte tokens): the request is aborted on
    its rank exactly once, the frontend's decoder state goes with it, and the group is
    left with nothing in flight."""
    async with vllm_group(1, fake_kw={"step_delay": 0.01}) as (group, fake):
        app: GatewayApp = create_app(group=group, frontend=frontend())
        async with serving(app) as client:
            request = {"prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json=request) as response:
                assert response.status_code == 200
                seen = ""
                async for data in events(response):
                    seen += _chunk_text(data)
                    if len(seen) >= 7:  # past "yz{|}~": in the byte tokens
                        break
            engine = fake.engines[0]
            await engine.wait_for(lambda: len(engine.got("abort")) == 1)
            await wait_until(lambda: app.counters.disconnects["completions"] == 1)
            statistics = group.statistics()
            assert statistics.aborted == 1 and statistics.finished == 0
            assert group.health().inflight == 0
            # the gateway serves on, from a fresh decoder
            response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert response.json()["choices"][0]["text"] == "yz{"
    assert len(engine.got("abort")) == 1
    assert seen.startswith("yz{|}~")


# -- issue 35: vLLM's behaviour behind vLLM's flags ---------------------------------------


def _model_copy(tmp_path: Path, **files: str) -> Path:
    """tests/data/tiny-model copied, with `files` written over it (name: text)."""
    model = tmp_path / "model"
    model.mkdir()
    for f in MODEL.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    for name, text in files.items():
        (model / name.replace("_json", ".json")).write_text(text)
    return model


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", ["string", "first-to-end", "token id", "length"])
async def test_stop_reason_is_vllms(chat: bool, stream: bool, case: str) -> None:
    """vLLM's `stop_reason`: the stop string matched (of two, the one whose match ends
    first, not the one that starts first), the stop token id the engine stopped on, or
    null; in completions and chat, streamed (the last chunk) or not. The fakes count up
    from the prompt's last token: "x" is 91, the chat template's prompt ends in 202."""
    last = 202 if chat else 91
    fields: dict[str, Any] = {
        "string": {"stop": ["nope", text_of([last + 3, last + 4])]},
        "first-to-end": {
            "stop": [text_of(list(range(last + 2, last + 6))), text_of([last + 3, last + 4])]
        },
        "token id": {"stop_token_ids": [last + 4]},
        "length": {},
    }[case]
    expected = {
        "string": text_of([last + 3, last + 4]),
        "first-to-end": text_of([last + 3, last + 4]),
        "token id": last + 4,
        "length": None,
    }[case]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": 8, "stream": stream, **fields}
    body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
    async with (
        vllm_group(1) as (group, _),
        serving(create_app(group=group, frontend=frontend())) as client,
    ):
        if stream:
            async with client.stream("POST", path, json=body) as response:
                chunks = [json.loads(e) for e in (await all_events(response))[:-1]]
            last_choice = [c for c in chunks if c["choices"]][-1]["choices"][0]
            if not chat:  # vLLM's completion chunks all carry it, null until the end
                assert all("stop_reason" in c["choices"][0] for c in chunks if c["choices"])
        else:
            response = await client.post(path, json=body)
            assert response.status_code == 200, response.text
            last_choice = response.json()["choices"][0]
    assert last_choice["stop_reason"] == expected
    assert last_choice["finish_reason"] == ("length" if expected is None else "stop")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_token_s_text_is_left_out_as_vllm_does(stream: bool) -> None:
    """An engine that stops on a stop token id (or EOS) sends that token; vLLM's
    detokenizer leaves its text out (`include_stop_str_in_output` false), so the text
    ends before it, streamed or not (it was kept before)."""
    last = 91  # the fakes count up from the prompt's last token, "x"
    body = {"prompt": "x", "max_tokens": 8, "stream": stream, "stop_token_ids": [last + 4]}
    async with (
        vllm_group(1) as (group, _),
        serving(create_app(group=group, frontend=frontend())) as client,
    ):
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                chunks = [json.loads(e) for e in (await all_events(response))[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        else:
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            text = response.json()["choices"][0]["text"]
            assert response.json()["usage"]["completion_tokens"] == 4  # still counted
    assert text == text_of([last + 1, last + 2, last + 3])


async def test_the_engines_max_model_len_is_the_limit_and_max_tokens_is_clamped() -> None:
    """The engines' ready responses say 64 under a model config of 512: vLLM's frontend
    takes the least, so 64 is the limit (before issue 35 the gateway let max_tokens run
    past the engines' length: a 200 cut short where vLLM answers 400)."""
    async with (
        vllm_group(1, fake_kw={"max_model_len": 64}) as (group, fake),
        serving(create_app(group=group, frontend=frontend())) as client,
    ):
        over = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 65})
        prompt = list(range(10, 20))  # 10 tokens
        clamped = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 60})
        default = await client.post("/v1/completions", json={"prompt": prompt})
        long = await client.post("/v1/completions", json={"prompt": list(range(1, 66))})
    assert over.status_code == 400, over.text
    assert over.json()["error"] == {
        "message": "max_tokens=65 cannot be greater than max_model_len=64. Please request "
        "fewer output tokens.",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": over.json()["error"]["code"],
    }
    assert long.status_code == 400 and long.json()["error"]["param"] == "input_tokens"
    assert "maximum context length is 64 tokens" in long.json()["error"]["message"]
    # vLLM clamps a max_tokens that fits alone but not with the prompt: 64 - 10
    assert clamped.status_code == 200, clamped.text
    assert clamped.json()["usage"]["completion_tokens"] == 54
    assert default.json()["usage"]["completion_tokens"] == 16  # a completion's default
    maxes = [a[3].get("max_tokens", 16) for a in fake.engines[0].got("add")]  # (16: omitted)
    assert maxes == [54, 16]


async def test_a_rank_restarted_with_a_shorter_max_model_len_is_checked_against_it() -> None:
    """The engines' length is learnt again when a rank comes back: rank 1 restarted
    with ``--max-model-len 32`` under a gateway that had learnt 64 gets no prompt of 40
    tokens, nor a max_tokens of 40 (before, the length was learnt once per group: the
    prompt met the wire's own check, a 400 not in vLLM's words, and max_tokens=40 came
    back a 200 cut short where vLLM answers 400)."""
    prompt = list(range(10, 50))  # 40 tokens
    async with (
        vllm_group(2, fake_kw={"max_model_len": 64}, silence_timeout=10.0) as (group, fake),
        serving(create_app(group=group, frontend=frontend())) as client,
    ):
        before = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert before.status_code == 200, before.text
        fake.engines[1].vanish()
        again = fake.restart(1)
        again.max_model_len = 32
        assert fake.nursery is not None
        fake.nursery.start_soon(again.run)
        await wait_until(lambda: group.engines[1].info.get("max_model_len") == 32)
        after = await client.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 4},
            headers={"X-Data-Parallel-Rank": "1"},
        )
        too_many = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 40})
        assert not again.got("add")
    assert too_many.status_code == 400, too_many.text  # (before: a 200 cut at 32 tokens)
    assert too_many.json()["error"]["param"] == "max_tokens"
    assert after.status_code == 400, after.text
    assert after.json()["error"]["param"] == "input_tokens", after.text
    assert "maximum context length is 32 tokens" in after.json()["error"]["message"]


def test_max_model_len_given_and_learned_takes_the_least() -> None:
    d = VllmFrontend(MODEL, max_model_len=100)
    assert d.max_prompt_tokens == 100
    d.learn_engines([{"max_model_len": 4096}, {}])
    assert d.max_prompt_tokens == 100  # never above the flag's
    d.learn_engines([{"max_model_len": 80}, {"max_model_len": 90}])
    assert d.max_prompt_tokens == 80


@pytest.mark.parametrize("source", ["auto", "folder", "vllm"])
async def test_generation_config_defaults_apply_as_vllm_applies_them(
    tmp_path: Path, source: str
) -> None:
    """The model's generation_config.json: temperature, top_k and max_new_tokens (a
    chat's default max_tokens) are defaults under a request's own fields; top_p at
    Hugging Face's default (1.0) is no default; "vllm" takes none. A folder's
    max_new_tokens caps every request, as vLLM's `override_max_tokens` (before, it was
    only a default)."""
    config = json.dumps(
        {"eos_token_id": 0, "temperature": 0.3, "top_k": 7, "top_p": 1.0, "max_new_tokens": 9}
    )
    if source == "folder":
        model = _model_copy(tmp_path)
        folder = tmp_path / "gen"
        folder.mkdir()
        (folder / "generation_config.json").write_text(config)
        d = VllmFrontend(model, generation_config=str(folder))
    else:
        d = VllmFrontend(
            _model_copy(tmp_path, generation_config_json=config), generation_config=source
        )
    chat = {"messages": [{"role": "user", "content": "x"}]}
    async with (
        vllm_group(1) as (group, fake),
        serving(create_app(group=group, frontend=d)) as client,
    ):
        plain = await client.post("/v1/chat/completions", json=chat)
        own = await client.post(
            "/v1/chat/completions", json={**chat, "temperature": 0.9, "max_tokens": 3}
        )
        long = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20})
    assert plain.status_code == own.status_code == long.status_code == 200, plain.text
    first, second, third = (a[3] for a in fake.engines[0].got("add"))
    # vLLM: a folder's max_new_tokens also caps every request's own max_tokens
    # (`override_max_tokens`); the model's own ("auto") only stands in for a missing one
    assert third["max_tokens"] == (9 if source == "folder" else 20)
    if source == "vllm":
        # (fields at vLLM's neutral values are left out of the encoded params)
        assert first.get("top_k", 0) in (0, -1) and first.get("temperature", 1.0) == 1.0
        assert first["max_tokens"] == 512 - len(fake.engines[0].got("add")[0][1])
    else:
        assert (first["temperature"], first["top_k"], first["max_tokens"]) == (0.3, 7, 9)
        assert first.get("top_p", 1.0) == 1.0
        assert (second["temperature"], second["top_k"], second["max_tokens"]) == (0.9, 7, 3)


def test_a_generation_config_folder_without_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        VllmFrontend(MODEL, generation_config=str(tmp_path))


def test_chat_template_and_tokenizer_as_vllms_flags(tmp_path: Path) -> None:
    """--chat-template: a file or the text itself; --tokenizer: another directory's
    tokenizer.json (the model directory then needs none)."""
    from zmqdp.gateway.vllm_frontend import load_chat_template

    words = tmp_path / "words"
    words.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (words / name).write_bytes((MODEL / name).read_bytes())
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((MODEL / "config.json").read_bytes())
    inline = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    file = tmp_path / "t.jinja"
    file.write_text("[{{ messages[0]['content'] }}]")
    assert load_chat_template(inline) == inline
    assert load_chat_template(str(file)) == "[{{ messages[0]['content'] }}]"
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template("missing.jinja")
    d = VllmFrontend(bare, tokenizer=words, chat_template=inline)
    assert d.chat_prompt(({"role": "user", "content": "hi"},)) == "<hi>"
    assert d.encode("x", special=False) == [91]
    with pytest.raises(ValueError, match="--chat-template"):
        VllmFrontend(MODEL, chat_template="{% for %}")
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        VllmFrontend(bare)
