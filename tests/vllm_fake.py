"""A fake vLLM 0.33 engine group for the tests and benchmarks: msgspec + pyzmq, no vLLM,
no torch. Each `FakeVllmEngine` speaks the engine side of vLLM's wire exactly as
`vllm/v1/engine/core.py` does (handshake DEALER: HELLO, init, ready response on the
input socket, coordinator READY for MoE, READY; input DEALER; output PUSH; MoE: XSUB to
the coordinator and a PUSH to its PULL) and runs a toy scheduler.

Generation: a request emits `tokens_per_step` tokens per engine step, token ids
counting up from its last prompt token + 1. It stops with STOP when it emits its
``_eos_token_id`` (stop_reason None) or one of its ``stop_token_ids`` (stop_reason = that
id), with LENGTH at ``max_tokens``.

MoE ranks run vLLM 0.33's `DPEngineCoreProc` wave rules (docs in
/work/shared/reference/vllm_dp.md §3): every step of a running rank is a collective
(`FakeVllmGroup.collective`, a barrier over all ranks: a rank running while a peer is
parked blocks, as a real one does in its all-reduce), the group decides to park at
step 1 and every `sync_interval` steps, rank 0 reports `wave_complete`, a parked rank
that gets an ADD wakes itself and reports `start_wave`, START_DP_WAVE wakes the others
(stale waves and the excluded index ignored), and rank 0 reports its own
paused->running edge.

MoE ranks also publish their request counts to the coordinator before each step when
they changed (vLLM's `_maybe_publish_request_counts`: a request is waiting until its
first step), and a step's outputs go out after its collective (the forward pass is the
collective), so a rank stuck in its collective says nothing more.

Faults: `die()` sends ENGINE_CORE_DEAD and stops; `vanish()` closes every socket
without a word; `freeze()` keeps the sockets but stops stepping (a silent engine);
`no_ready=True` says HELLO and never READY; `config_hash` is the READY's
`parallel_config_hash`; `ignore_start_dp_wave=True` drops START_DP_WAVEs (as a vLLM
engine does once a pause reached consensus); `send_raw(frames)` puts any message on the
output socket; `FakeVllmGroup.restart(rank)` makes a new incarnation of a rank (run it:
it says HELLO again).

Messages are handled at the top of each loop iteration, as vLLM's busy loop does; each
socket is owned by one task (`zmqdp._zmq.ZSocket`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio
import zmq

from zmqdp._zmq import ZSocket

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


def outputs_message(
    rank: int,
    outputs: list[list[Any]] | None = None,
    stats: dict[str, Any] | None = None,
    utility: list[Any] | None = None,
    wave_complete: int | None = None,
    start_wave: int | None = None,
) -> bytes:
    """An `EngineCoreOutputs` as vLLM 0.33 encodes it (all 9 fields)."""
    return enc(
        [
            rank,
            outputs or [],
            stats,
            time.monotonic(),
            utility,
            None,
            wave_complete,
            start_wave,
            None,
        ]
    )


def output_entry(rid: str, tokens: list[int], finish: int | None, stop: Any = None) -> list[Any]:
    e: list[Any] = [rid, tokens, None, None, None, finish, stop, None, None, None]
    return [*e, None, None, None, 0, None, None, None, None, None]


class FakeVllmGroup:
    """N fake engines and the collective that couples MoE ranks."""

    def __init__(
        self,
        url: str,
        size: int,
        *,
        moe: bool = False,
        sync_interval: int = 2,
        tokens_per_step: int = 1,
        step_delay: float = 0.0,
    ) -> None:
        self.url = url
        self.size = size
        self.moe = moe
        self.sync_interval = sync_interval
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.tokens_per_step = tokens_per_step
        self.step_delay = step_delay
        self.engines = [
            FakeVllmEngine(self, r, tokens_per_step=tokens_per_step, step_delay=step_delay)
            for r in range(size)
        ]
        self.nursery: trio.Nursery | None = None  # set by the tests' fixture
        # the collective: a generation-counting barrier with a global OR
        self._arrived = 0
        self._any = False
        self._generation = 0
        self._released = trio.Event()
        self._result = False
        self.collectives = 0

    async def collective(self, local_unfinished: bool) -> bool:
        """One DP collective (forward pass + all-reduce): blocks until every rank joins."""
        self._arrived += 1
        self._any = self._any or local_unfinished
        if self._arrived == self.size:
            self._result, self._any, self._arrived = self._any, False, 0
            self._generation += 1
            self.collectives += 1
            released, self._released = self._released, trio.Event()
            released.set()
            await trio.lowlevel.checkpoint()
            return self._result
        await self._released.wait()
        return self._result

    def restart(self, rank: int) -> FakeVllmEngine:
        """A new incarnation of `rank` (the old one should be gone: `vanish()`); it says
        HELLO when run."""
        engine = FakeVllmEngine(
            self, rank, tokens_per_step=self.tokens_per_step, step_delay=self.step_delay
        )
        self.engines[rank] = engine
        return engine

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self.context.destroy(linger=0)


class FakeVllmEngine:
    def __init__(
        self, group: FakeVllmGroup, rank: int, *, tokens_per_step: int, step_delay: float
    ) -> None:
        self.group = group
        self.rank = rank
        self.tokens_per_step = tokens_per_step
        self.step_delay = step_delay
        self.identity = rank.to_bytes(2, "little")
        self.requests: dict[str, dict[str, Any]] = {}  # id -> state
        self.inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self.received: list[tuple[str, Any]] = []  # every message, for the tests
        self.changed = trio.Event()
        self._seen = trio.Event()
        self.utilities: dict[str, Any] = {
            "is_sleeping": lambda: False,
            "echo": lambda *a: list(a),
        }
        self.no_ready = False
        self.frozen = False
        self.dead = False
        self.stats_override: dict[str, Any] | None = None
        self.config_hash = "fake-hash"
        self.ignore_start_dp_wave: bool | Callable[[], bool] = False
        self.dropped_starts = 0
        self._last_counts: tuple[int, int] | None = None
        # wave state (MoE)
        self.current_wave = 0
        self.engines_running = False
        self.step_counter = 0
        self.sockets: list[ZSocket] = []
        self.init: dict[str, Any] | None = None
        self.up = trio.Event()
        self.cancel = trio.CancelScope()

    # -- sockets ----------------------------------------------------------------------

    def _socket(self, kind: int, address: str, identity: bytes | None = None) -> ZSocket:
        sock = self.group.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(address)
        zs = ZSocket(sock)
        self.sockets.append(zs)
        return zs

    def close(self) -> None:
        for zs in self.sockets:
            zs.close()
        self.sockets = []

    # -- life -------------------------------------------------------------------------

    async def run(self) -> None:
        with self.cancel:
            try:
                await self._run()
            finally:
                self.close()

    async def _run(self) -> None:
        hs = self._socket(zmq.DEALER, self.group.url, self.identity)
        await hs.send([enc({"status": "HELLO", "local": False, "headless": True})])
        [body] = (await hs.receive_batch(1))[0]
        self.init = init = dec(body)
        addrs = init["addresses"]
        inp = self._socket(zmq.DEALER, addrs["inputs"][0], self.identity)
        out = self._socket(zmq.PUSH, addrs["outputs"][0])
        coord_out = xsub = None
        if addrs["coordinator_output"] is not None:
            coord_out = self._socket(zmq.PUSH, addrs["coordinator_output"])
        if addrs["coordinator_input"] is not None:
            xsub = self._socket(zmq.XSUB, addrs["coordinator_input"])
            await xsub.send([b"\x01"])
        await inp.send([enc(self.ready_response())])
        if xsub is not None:  # "Waiting for READY message from DP Coordinator..."
            while True:
                msgs = await xsub.receive_batch(1)
                if msgs[0] == [b"READY"]:
                    break
        if self.no_ready:
            await trio.sleep_forever()
        ready = {"status": "READY", "local": False, "headless": True}
        ready["parallel_config_hash"] = self.config_hash
        await hs.send([enc(ready)])
        self.up.set()
        for zs in self.sockets:  # handed over to the tasks below, one owner each
            zs.release()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_input, inp)
            if xsub is not None:
                nursery.start_soon(self._serve_xsub, xsub)
            await self._busy_loop(out, coord_out)
            nursery.cancel_scope.cancel()

    def ready_response(self) -> dict[str, Any]:
        return {
            "max_model_len": 4096,
            "num_gpu_blocks": 1000,
            "block_size": 16,
            "data_parallel_size": self.group.size,
            "data_parallel_rank": self.rank,
            "max_num_seqs": 256,
            "vllm_version": "0.33.0",
        }

    def _push(self, kind: str, value: Any) -> None:
        self.inbox.append((kind, value))
        self.received.append((kind, value))
        self.changed.set()
        self._seen.set()

    async def wait_for(self, predicate: Any) -> None:
        """Until `predicate()` holds, re-checked after every message received and
        after the busy loop handled its inbox."""
        while not predicate():
            self._seen = trio.Event()
            await self._seen.wait()

    def got(self, kind: str) -> list[Any]:
        return [v for k, v in self.received if k == kind]

    def send_raw(self, frames: list[bytes]) -> None:
        """Put `frames` on the output socket (from the busy loop, its owner)."""
        self.inbox.append(("raw", frames))
        self.changed.set()

    async def _serve_input(self, zs: ZSocket) -> None:
        while True:
            for frames in await zs.receive_batch():
                kind, payload = frames[0], dec(frames[1])
                if kind == b"\x00":
                    self._push("add", payload)
                elif kind == b"\x01":
                    self._push("abort", payload)
                elif kind == b"\x03":
                    self._push("utility", payload)

    async def _serve_xsub(self, zs: ZSocket) -> None:
        while True:
            for frames in await zs.receive_batch():
                if frames[0] == b"\x02":
                    self._push("start_dp_wave", dec(frames[1]))

    # -- the busy loop (vLLM's EngineCoreProc / DPEngineCoreProc) -----------------------

    def has_work(self) -> bool:
        return self.engines_running or bool(self.requests)

    async def _busy_loop(self, out: ZSocket, coord: ZSocket | None) -> None:
        moe = self.group.moe
        while True:
            while not self.inbox and (self.frozen or not self.has_work()):
                self.changed = trio.Event()
                await self.changed.wait()
            was_running = self.engines_running  # before the inbox, as vLLM's loop
            for frames in self._process_inbox(coord):
                await out.send(frames)
            if self.frozen or self.dead:
                continue
            if moe:
                await self._maybe_publish_request_counts(coord)
            outputs = self._step()
            if not moe:
                if outputs or self.requests:
                    await out.send([outputs_message(self.rank, outputs, self._stats())])
                if self.step_delay:
                    await trio.sleep(self.step_delay)
                await trio.lowlevel.checkpoint()
                continue
            if self.step_delay:
                await trio.sleep(self.step_delay)
            local_unfinished = bool(self.requests)
            if not outputs and not local_unfinished and not self.engines_running:
                continue
            self.step_counter += 1
            global_unfinished = await self.group.collective(local_unfinished)
            if outputs or self.requests:  # the forward pass (a collective) is done
                await out.send([outputs_message(self.rank, outputs, self._stats())])
            await self._maybe_publish_request_counts(coord)
            sync = self.step_counter == 1 or self.step_counter % self.group.sync_interval == 0
            self.engines_running = global_unfinished if sync else True
            assert coord is not None
            if not self.engines_running:
                if self.rank == 0:
                    await coord.send([outputs_message(0, wave_complete=self.current_wave)])
                self.current_wave += 1
                self.step_counter = 0
            elif not was_running and self.rank == 0:
                await coord.send([outputs_message(0, start_wave=self.current_wave)])
            self._seen.set()  # `wait_for` re-checks after every step (a park, say)

    async def _maybe_publish_request_counts(self, coord: ZSocket | None) -> None:
        counts = self._counts()
        if counts != self._last_counts and coord is not None:
            self._last_counts = counts
            await coord.send([outputs_message(self.rank, stats=self._stats())])

    def _counts(self) -> tuple[int, int]:
        waiting = sum(1 for st in self.requests.values() if not st["scheduled"])
        return len(self.requests) - waiting, waiting

    def _process_inbox(self, coord: ZSocket | None) -> list[list[bytes]]:
        """Handle every queued message; returns the messages to send on the output
        socket (utility replies, raw messages)."""
        replies: list[list[bytes]] = []
        while self.inbox:
            kind, p = self.inbox.popleft()
            if kind == "raw":
                replies.append(p)
            elif kind == "add":
                self._add(p, coord)
            elif kind == "abort":
                for rid in p:
                    self.requests.pop(rid, None)
            elif kind == "utility":
                _client, call_id, method, args = p
                fn = self.utilities.get(method)
                if fn is None:
                    continue  # a method that never answers
                try:
                    reply = [call_id, None, [None, fn(*args)]]
                except Exception as exc:
                    reply = [call_id, f"Call to {method} method failed: {exc}", None]
                replies.append([outputs_message(self.rank, utility=reply)])
            elif kind == "start_dp_wave":
                ignore = self.ignore_start_dp_wave
                if ignore() if callable(ignore) else ignore:
                    self.dropped_starts += 1
                    continue
                wave, exclude = p
                if exclude != self.rank and wave >= self.current_wave:
                    self.current_wave = wave
                    self.engines_running = True
        self._seen.set()  # `wait_for` also re-checks what handling a message changed
        return replies

    def _add(self, req: list[Any], coord: ZSocket | None) -> None:
        sp = req[3]
        rid = req[0]
        self.requests[rid] = {
            "next": req[1][-1] + 1,
            "left": sp.get("max_tokens", 16),
            "eos": sp.get("_eos_token_id"),
            "stops": set(sp.get("stop_token_ids", [])),
            "scheduled": False,
        }
        if self.group.moe:
            wave = req[12]
            if wave > self.current_wave:
                self.current_wave = wave
            if not self.engines_running:
                self.engines_running = True
                assert coord is not None
                coord.send_nowait([outputs_message(self.rank, start_wave=self.current_wave)])

    def _step(self) -> list[list[Any]]:
        outputs = []
        for rid, st in list(self.requests.items()):
            st["scheduled"] = True
            tokens: list[int] = []
            finish = stop = None
            for _ in range(self.tokens_per_step):
                t = st["next"]
                st["next"] += 1
                st["left"] -= 1
                tokens.append(t)
                if t == st["eos"]:
                    finish = 0
                elif t in st["stops"]:
                    finish, stop = 0, t
                elif st["left"] <= 0:
                    finish = 1
                if finish is not None:
                    break
            outputs.append(output_entry(rid, tokens, finish, stop))
            if finish is not None:
                del self.requests[rid]
        return outputs

    def _stats(self) -> dict[str, Any]:
        if self.stats_override is not None:
            return self.stats_override
        running, waiting = self._counts()
        return {
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "kv_cache_usage": 0.1,
            "step_counter": self.step_counter,
            "current_wave": self.current_wave,
        }

    # -- faults -----------------------------------------------------------------------

    def freeze(self) -> None:
        self.frozen = True

    def vanish(self) -> None:
        self.cancel.cancel()

    def die(self) -> None:
        """ENGINE_CORE_DEAD on the output socket (vLLM's `_send_engine_dead`), then stop."""
        self.dead = True
        for zs in self.sockets:
            if zs.sock.type == zmq.PUSH:
                zs.release()
                zs.send_nowait([ENGINE_CORE_DEAD])
                break
        self.cancel.cancel()
