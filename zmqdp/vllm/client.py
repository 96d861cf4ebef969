"""`VllmEngineGroup`: zmqdp's `EngineGroup` driving vLLM 0.33 engine cores.

Theory of operation
-------------------
This is `zmqdp.EngineGroup` (same API, the same dispatcher, streams, admission control,
deadlines, drain and health) on a different wire: the sans-IO `VllmCore` encodes
vLLM's `EngineCoreRequest`/ABORT/UTILITY and decodes `EngineCoreOutputs`, and
`VllmTransport` plays the frontend's sockets (and, for MoE groups, the DP coordinator's).
Only what vLLM's wire forces differs:

* `submit` takes a `VllmRequest` (prompt token ids, `SamplingParams`, the model's EOS
  token, priority, pinned rank). Outputs are `Output`s whose body is a `VllmOutput`
  (new token ids, stop reason) and whose `finish` is vLLM's finish reason in lower case.
* `call` uses unsigned 64-bit call ids, as vLLM's client does.
* Load for least-loaded selection comes from the `scheduler_stats` engines put in their
  outputs (dense groups, engines started with stats logging, vLLM's default) and their
  coordinator reports (MoE groups).
* MoE (lockstep) groups: the client is the DP coordinator. The WAKEs of zmqdp's wave
  rules (docs/protocol.md §5) go out as START_DP_WAVE(c, exclude=None) on the XPUB: the
  wave clock only follows what engines report (`wave_complete`, `start_wave`) and every
  `start_wave` is answered. ADDs carry `current_wave = c`.
* A malformed output entry ends only its request (docs/protocol.md §7), and the client
  also sends that request's ABORT: a vLLM engine would otherwise run it to `max_tokens`
  with the slot zmqdp counts already free.
* vLLM's death sentinel names no rank: it fails the whole group (as vLLM's frontend
  does). A rank that vanishes (a send fails) or is silent while holding requests is
  dead by itself: in a dense group only its requests fail with `EngineDead`.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import trio

from .._calls import PendingCall, PendingCalls
from .._core.errors import (
    InvalidRequest,
    ProtocolError,
    quote,
)
from .._core.requests import Outcome
from .._core.state import DEFAULT_MAX_MESSAGE_SIZE, check_timeout
from ..client import EngineGroup, Request, _GroupListener
from ..stream import RequestStream
from ._core import VllmCore, start_dp_wave
from ._transport import VllmTransport, open_vllm_transport
from ._wire import WIRE_VERSIONS, SamplingParams, encode_start_dp_wave, encode_utility

__all__ = ["SamplingParams", "VllmEngineGroup", "VllmRequest"]

log = logging.getLogger("zmqdp.vllm")


@dataclass(frozen=True, slots=True)
class VllmRequest:
    """One generation request. `id` as `zmqdp.Request.id`; `prompt_token_ids` the
    tokenized prompt (zmqdp has no tokenizer); `eos_token_id` the model's EOS token (the
    engine stops on it only if given; None: no EOS stop); `rank` pins it (vLLM's
    `data_parallel_rank`); `timeout` as `zmqdp.Request.timeout`."""

    id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    priority: int = 0
    rank: int | None = None
    timeout: float | None = None
    cache_salt: str | None = None


class _U64Calls(PendingCalls):
    """Call ids as vLLM's client makes them: random unsigned 64-bit ints."""

    def open(self, rank: int, method: str) -> tuple[int, PendingCall]:
        while True:
            call_id = secrets.randbits(64)
            if call_id not in self._calls:
                break
        call = self._calls[call_id] = PendingCall(rank, method)
        return call_id, call


class VllmEngineGroup(EngineGroup):
    """The client of one group of vLLM engines. Create it with `VllmEngineGroup.connect`."""

    _transport: VllmTransport  # type: ignore[assignment]

    @classmethod
    @asynccontextmanager
    async def connect(  # type: ignore[override]
        cls,
        url: str,
        engines: int,
        *,
        moe: bool = False,
        ready_timeout: float = 600.0,
        silence_timeout: float = 30.0,
        send_timeout: float = 10.0,
        stall_timeout: float = 5.0,
        advertise_host: str | None = None,
        parallel_config: Mapping[str, Any] | None = None,
        parallel_config_hash: str | None = None,
        max_buffered: int | None = None,
        max_inflight: int | Literal["info"] | None = None,
        request_timeout: float | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        insecure: bool = False,
        vllm_version: str | None = None,
    ) -> AsyncIterator[VllmEngineGroup]:
        """Bind the handshake ROUTER at `url` (``tcp://HOST:PORT``: the
        ``--data-parallel-address``/``--data-parallel-rpc-port`` the headless engines
        were started with), answer every engine's HELLO, wait until all `engines` ranks
        sent READY and their ready response, and serve them.

        `moe=True` for MoE models (vLLM runs their DP ranks in lockstep): the client
        plays the DP coordinator and the group is lockstep (a dead rank fails it
        whole). MoE engines need a `parallel_config` for their DP process group
        (`data_parallel_master_ip`, `data_parallel_master_port`,
        `_data_parallel_master_port_list`, `_coord_store_port`, `data_parallel_size`);
        by default free ports on `advertise_host` (or 127.0.0.1) are picked. Every rank's
        READY must carry the same `parallel_config_hash` (`parallel_config_hash`: the
        one expected).

        `max_inflight="info"` caps each rank at the `max_num_seqs` of its ready
        response. `max_message_size` bounds every frame the client receives (a larger
        one drops that engine's connection). vLLM's wire has no authentication, so a
        tcp URL other machines can reach needs `insecure=True` (a trusted network).

        `vllm_version` (``"0.32"`` or ``"0.33"``, `WIRE_VERSIONS`) says which vLLM
        engine-core wire the ranks speak; by default each rank's ready response says
        (`wire_version(rank)`), and an unknown version is taken as the nearest known one
        with a warning. zmqdp's wave rules serve both versions (see `WIRE_VERSIONS`).

        Raises `HandshakeTimeout` naming each missing rank and what it lacks,
        `ValueError` for such a URL without `insecure=True`.
        Other arguments as `zmqdp.EngineGroup.connect`.
        """
        if request_timeout is not None:
            check_timeout("request_timeout", request_timeout)
        if vllm_version is not None and vllm_version not in WIRE_VERSIONS:
            raise ValueError(
                f"vllm_version must be one of {', '.join(WIRE_VERSIONS)}, got {vllm_version!r}"
            )
        listener = _GroupListener()
        async with open_vllm_transport(
            url,
            engines,
            lockstep=moe,
            ready_timeout=ready_timeout,
            advertise_host=advertise_host,
            parallel_config=parallel_config,
            parallel_config_hash=parallel_config_hash,
            send_timeout=send_timeout,
            listener=listener,
            max_message_size=max_message_size,
            insecure=insecure,
            vllm_version=vllm_version,
        ) as transport:
            core = VllmCore(
                engines,
                lockstep=moe,
                silence_timeout=silence_timeout,
                stall_timeout=stall_timeout,
            )
            group = cls._create(
                transport,
                core,
                max_buffered,
                max_message_size,
                max_inflight,
                request_timeout,
            )
            group._calls = _U64Calls()
            for rank in range(engines):
                group._on_rank_up(rank)
            listener.group = group
            assert transport.nursery is not None
            transport.nursery.start_soon(group._dispatch, name="zmqdp-vllm-dispatcher")
            try:
                yield group
            finally:
                group._close()

    def submit(self, request: VllmRequest) -> RequestStream:  # type: ignore[override]
        """Send a request; return its stream (use it with `async with` at once). Raises
        what `EngineGroup.submit` raises; `InvalidRequest` also for sampling parameters
        vLLM would refuse, or prompt token ids that are not ints >= 0."""
        if not isinstance(request, VllmRequest):
            raise InvalidRequest(quote(request), "submit takes a VllmRequest")
        request = self._fit_to_model(request)
        return super().submit(
            Request(request.id, (request, time.time()), request.rank, request.timeout)
        )

    def wire_version(self, rank: int) -> str | None:
        """The vLLM wire version spoken with the rank (``"0.32"`` or ``"0.33"``): the
        `vllm_version` given to `connect`, else what its ready response says; None
        while the rank has not sent one."""
        return self._transport.state.version(rank)

    def _max_model_len(self) -> int | None:
        """The smallest `max_model_len` the ranks' ready responses announce, if any."""
        lengths = [
            e.info.get("max_model_len")
            for e in self.engines
            if isinstance(e.info, Mapping) and type(e.info.get("max_model_len")) is int
        ]
        return min(lengths) if lengths else None  # type: ignore[type-var]

    def _fit_to_model(self, request: VllmRequest) -> VllmRequest:
        """What vLLM's frontend does before it sends: a prompt must leave room for one
        output token, and `max_tokens=None` means "up to the model's length" (the engine
        compares with `max_tokens` at every step: None would kill it)."""
        limit = self._max_model_len()
        prompt = len(request.prompt_token_ids)
        if limit is not None and prompt >= limit:
            raise InvalidRequest(
                quote(request.id),
                f"the prompt has {prompt} tokens; the engines' max_model_len is {limit}",
            )
        if request.sampling.max_tokens is not None:
            return request
        if limit is None:
            raise InvalidRequest(
                quote(request.id),
                "max_tokens=None needs the engines' max_model_len (not in their READY)",
            )
        sampling = dataclasses.replace(request.sampling, max_tokens=limit - prompt)
        return dataclasses.replace(request, sampling=sampling)

    async def wait_submit(self, request: VllmRequest) -> RequestStream:  # type: ignore[override]
        return await super().wait_submit(request)  # type: ignore[arg-type]

    def _encode_call(
        self, rank: int, call_id: int, method: str, args: tuple[Any, ...]
    ) -> Sequence[bytes]:
        """A UTILITY request (vLLM's `call_utility`; `call()` is `EngineGroup.call`)."""
        try:
            return encode_utility(call_id, method, args)
        except ProtocolError as exc:
            raise InvalidRequest(f"utility {method}", exc.cause) from None

    def _take(self, frames: list[bytes], dirty: set[RequestStream]) -> None:
        """One message from the output PULL (no routing identity: the rank is the
        message's `engine_index`; vLLM's messages are never sliced)."""
        rank, result = self._core.on_message(frames, trio.current_time())
        if rank is None:
            if result.dead is not None:
                log.error("%s: the whole group fails, as vLLM's frontend does", result.dead)
                self._close(f"the engine group failed: {result.dead}")
            elif result.error is not None:
                self._logs.log(logging.WARNING, "vllm-output", "%s", result.error)
            return
        self._carry_out_batch(rank, result, dirty)
        fx = result.effects
        if fx is not None and fx.ended:
            # A malformed entry ended its request here (docs/protocol.md §7); the engine
            # would run it on to max_tokens (zmqdp's slot is already free): stop it.
            broken = tuple(e.wire_id for e in fx.ended if e.outcome is Outcome.PROTOCOL_ERROR)
            if broken and self._core.is_up(rank):
                self._transport.send(rank, self._core.encode_abort(broken))

    def _wake_all(self, wave: int, *, stall: bool = False) -> None:
        """zmqdp's WAKE(c) is the coordinator's START_DP_WAVE(c, exclude=None)."""
        if not stall:
            self._wake_rounds += 1
        self._transport.publish(encode_start_dp_wave(*start_dp_wave(wave)))
