"""The OpenAI wire format, without HTTP: the fast chunk encoder writes exactly the bytes
of the plain one, for any text, finish reason, id and model."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from zmqdp.gateway.openai import ChunkEncoder, chunk


@given(
    request_id=st.text(max_size=40),
    created=st.integers(min_value=0, max_value=1 << 40),
    model=st.text(max_size=20),
    text=st.text(),
    finish=st.none() | st.sampled_from(["stop", "length", "abort"]) | st.text(max_size=10),
)
def test_the_chunk_encoder_writes_exactly_what_chunk_writes(
    request_id: str, created: int, model: str, text: str, finish: str | None
) -> None:
    fast = ChunkEncoder(request_id, created, model).text(text, finish)
    assert fast == chunk(request_id, created, model, text, finish)
    payload = json.loads(fast[len(b"data: ") : -2])
    assert payload["choices"][0]["text"] == text
    assert payload["choices"][0]["finish_reason"] == finish
