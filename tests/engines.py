"""Small scriptable engines built on `zmqdp.engine`, for the client tests.

`ScriptedEngine` runs one rank. ADD bodies say what to do:

* ``{"tokens": k}``: emit k outputs, one batch each, the last with finish "length";
* ``{"hold": True}``: keep the request until the test calls `finish()` or the client
  aborts it (then it is listed in `finished`, as PROTOCOL.md §3 asks);
* anything else: one terminal output echoing the body.

Every batch carries `load` from `load_override` if set, else from what it holds. Every
inbound message is recorded in `inbox`, so tests can check what reached which rank.
"""

from __future__ import annotations

from typing import Any

import trio

from zmqdp.engine import (
    Abort,
    Add,
    Call,
    Engine,
    Load,
    Output,
    OutputBatch,
    Reply,
    Resync,
    Wake,
    connect_engine,
)


class ScriptedEngine:
    def __init__(self, url: str, rank: int, size: int, *, lockstep: bool = False) -> None:
        self.url = url
        self.rank = rank
        self.size = size
        self.lockstep = lockstep
        self.inbox: list[Any] = []
        self.held: dict[str, Any] = {}
        self.load_override: Load | None = None
        self.extra: dict[str, Any] = {}
        self.engine: Engine | None = None
        self.ready = trio.Event()
        self.changed = trio.Event()

    def _load(self) -> Load:
        if self.load_override is not None:
            return self.load_override
        return Load(waiting=0, running=len(self.held), kv=0.1)

    async def emit(self, outputs: tuple[Output, ...] = (), **fields: Any) -> None:
        assert self.engine is not None
        batch = OutputBatch(rank=self.rank, outputs=outputs, load=self._load(), **fields)
        await self.engine.send(batch)

    async def finish(self, request_id: str, finish: str = "stop") -> None:
        self.held.pop(request_id)
        await self.emit((Output(request_id, "done", finish),))

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with connect_engine(
            self.url,
            rank=self.rank,
            size=self.size,
            lockstep=self.lockstep,
            info={"rank": self.rank},
        ) as eng:
            self.engine = eng
            self.ready.set()
            task_status.started()
            async for msg in eng:
                self.inbox.append(msg)
                await self.handle(msg)
                self.changed.set()
                self.changed = trio.Event()

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Add):
            body = msg.body
            if isinstance(body, dict) and "tokens" in body:
                n = body["tokens"]
                for i in range(n):
                    await self.emit((Output(msg.id, i, "length" if i == n - 1 else None),))
            elif isinstance(body, dict) and body.get("hold"):
                self.held[msg.id] = body
                await self.emit()
            else:
                await self.emit((Output(msg.id, body, "stop"),))
        elif isinstance(msg, Abort):
            dropped = tuple(i for i in msg.ids if self.held.pop(i, None) is not None)
            if dropped:
                await self.emit(finished=dropped)
        elif isinstance(msg, Call):
            if msg.method == "echo":
                await self.emit(replies=(Reply(msg.call, result=list(msg.args)),))
            else:
                await self.emit(replies=(Reply(msg.call, error=f"no method {msg.method}"),))
        elif isinstance(msg, Resync):
            self.held.clear()
        elif isinstance(msg, Wake):
            pass

    async def wait_for(self, predicate: Any) -> None:
        while not predicate():
            await self.changed.wait()


async def start_engines(
    nursery: trio.Nursery, url: str, n: int, *, lockstep: bool = False
) -> list[ScriptedEngine]:
    engines = [ScriptedEngine(url, r, n, lockstep=lockstep) for r in range(n)]
    for e in engines:
        nursery.start_soon(e.run)
    return engines


class Collective:
    """A step barrier for N in-process ranks: every running rank calls `step()`; it
    returns once all N have arrived, with whether any rank had work. A rank whose peers
    are parked blocks here, exactly as a real rank woken alone blocks in its all-reduce."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._arrived = 0
        self._any = False
        self._done = trio.Event()
        self._result = False

    async def step(self, has_work: bool) -> bool:
        done = self._done
        self._arrived += 1
        self._any |= has_work
        if self._arrived == self.n:
            self._result, self._arrived, self._any = self._any, 0, False
            self._done = trio.Event()
            done.set()
            await trio.lowlevel.checkpoint()
        else:
            await done.wait()
        return self._result


class LockstepRank:
    """One rank of an in-process lockstep group following PROTOCOL.md §5's MUST rules
    (no wave agreement at sync). ADD body: {"tokens": k}."""

    def __init__(
        self, url: str, rank: int, collective: Collective, *, sync: int = 2, self_wake: bool = False
    ) -> None:
        self.url = url
        self.rank = rank
        self.collective = collective
        self.sync = sync
        self.self_wake = self_wake
        self.wave = 0
        self.running = False
        self.work: dict[str, int] = {}
        self.steps = 0
        self.parks = 0
        self.parked = trio.Event()

    async def run(self) -> None:
        size = self.collective.n
        async with connect_engine(self.url, rank=self.rank, size=size, lockstep=True) as eng:
            self.engine = eng
            while True:
                # the inbox is handled only between steps
                while True:
                    try:
                        msg = eng.receive_nowait()
                    except trio.WouldBlock:
                        break
                    await self.handle(msg)
                if not self.running:
                    self.parked.set()
                    await self.handle(await eng.receive())  # parked: wait for a message
                    continue
                self.parked = trio.Event()
                any_work = await self.collective.step(bool(self.work))
                self.steps += 1
                outputs = []
                for rid in list(self.work):
                    self.work[rid] -= 1
                    left = self.work[rid]
                    outputs.append(Output(rid, left, None if left else "length"))
                    if not left:
                        del self.work[rid]
                if outputs:
                    await eng.send(OutputBatch(self.rank, outputs=tuple(outputs)))
                if self.steps % self.sync == 0:
                    any_work = await self.collective.step(bool(self.work))
                    if not any_work:
                        await eng.send(OutputBatch(self.rank, wave_complete=self.wave))
                        self.wave += 1
                        self.running = False
                        self.parks += 1
                        self.steps = 0

    async def handle(self, msg: Any) -> None:
        eng = self.engine
        if isinstance(msg, Add):
            self.work[msg.id] = int(msg.body["tokens"])
            if not self.running:
                await eng.send(OutputBatch(self.rank, start_wave=self.wave))
                if self.self_wake:
                    self.running = True
        elif isinstance(msg, Wake):
            if msg.wave >= self.wave:
                self.wave = msg.wave
                self.running = True
        elif isinstance(msg, Abort):
            dropped = tuple(i for i in msg.ids if self.work.pop(i, None) is not None)
            if dropped:
                await eng.send(OutputBatch(self.rank, finished=dropped))
