"""Drive a data-parallel group of vLLM 0.32 or 0.33 engine cores (``vllm serve MODEL --headless
--data-parallel-size N ...``) with zmqdp's `EngineGroup`. Needs the ``vllm`` extra
(msgspec, vLLM's own serializer). See README "Driving vLLM engines"."""

from ._wire import FINISH_REASONS, WIRE_VERSIONS, SamplingParams, VllmError, VllmOutput
from .client import VllmEngineGroup, VllmRequest

__all__ = [
    "FINISH_REASONS",
    "WIRE_VERSIONS",
    "SamplingParams",
    "VllmEngineGroup",
    "VllmError",
    "VllmOutput",
    "VllmRequest",
]
