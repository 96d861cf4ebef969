"""Drive a data-parallel group of vLLM 0.32 or 0.33 engine cores (``vllm serve MODEL --headless
--data-parallel-size N ...``) with zmqdp's `EngineGroup`: `zmqdp.vllm.connect(...)`, or
`dialect(...)` for `zmqdp.aio` and the gateway. Needs the ``vllm`` extra (msgspec,
vLLM's own serializer). See docs/guides/vllm.md.

What vLLM changes, by file: `wire.py` (requests, outputs, waves, calls), `codec.py` (the
msgspec frames), `handshake.py` (the start-up handshake), `sockets.py` (the frontend's
and coordinator's sockets), `kv_events.py` (following the engines' KV events for prefix
affinity), `group.py` (putting them together: `connect`). `mock.py` is
the other side: fake engine cores for ``zmqdp mock --wire vllm`` and the tests (not
imported here)."""

from .codec import FINISH_REASONS, WIRE_VERSIONS, SamplingParams, VllmError, VllmOutput
from .group import VllmEngineGroup, VllmGroup, connect, dialect
from .wire import VllmRequest, VllmWire

__all__ = [
    "FINISH_REASONS",
    "WIRE_VERSIONS",
    "SamplingParams",
    "VllmEngineGroup",
    "VllmError",
    "VllmGroup",
    "VllmOutput",
    "VllmRequest",
    "VllmWire",
    "connect",
    "dialect",
]
