"""Small scriptable engines built on `zmqdp.engine`, for the client tests.

`ScriptedEngine` runs one rank. ADD bodies say what to do:

* ``{"tokens": k}``: emit k outputs, one batch each, the last with finish "length";
* ``{"hold": True}``: keep the request until the test calls `finish()` or the client
  aborts it (then it is listed in `finished`, as docs/protocol.md §3 asks);
* anything else: one terminal output echoing the body.

Every batch carries `load` from `load_override` if set, else from what it holds. Every
inbound message is recorded in `inbox`, so tests can check what reached which rank.

An engine's handle (`engine`) is set by its own task once `connect_engine` returns,
which can be after the client has seen its READY and REGISTER: a group can be up
while an engine's task has not resumed yet. So `ready` is set with the handle,
`started()` waits for it, `emit` waits for it, and `wait_ready` lets a harness that
connects its own group (tests/helpers.py `group_of`) yield only fully started engines.

Engines only ever see wire ids (``app-id#serial``, docs/protocol.md §3): `held` is keyed
by wire id, `holds(app_id)` and `wire(app_id)` translate for the tests.
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
        self.extra: dict[str, Any] = {}  # more READY info (max_num_seqs, ...)
        self.engine: Engine | None = None
        self.ready = trio.Event()
        self.changed = trio.Event()

    def _load(self) -> Load:
        if self.load_override is not None:
            return self.load_override
        return Load(waiting=0, running=len(self.held), kv=0.1)

    async def started(self) -> Engine:
        """The engine's handle, once its task has set it (see the module docstring)."""
        await self.ready.wait()
        assert self.engine is not None
        return self.engine

    async def emit(self, outputs: tuple[Output, ...] = (), **fields: Any) -> None:
        engine = self.engine if self.engine is not None else await self.started()
        batch = OutputBatch(rank=self.rank, outputs=outputs, load=self._load(), **fields)
        await engine.send(batch)

    def wire(self, request_id: str) -> str:
        """The wire id of the latest ADD this engine got for application id `request_id`."""
        for msg in reversed(self.inbox):
            if isinstance(msg, Add) and msg.id.rpartition("#")[0] == request_id:
                return msg.id
        raise AssertionError(f"no ADD for {request_id!r} reached rank {self.rank}")

    def holds(self, request_id: str) -> bool:
        return any(w.rpartition("#")[0] == request_id for w in self.held)

    async def finish(self, request_id: str, finish: str = "stop") -> None:
        wire_id = self.wire(request_id)
        self.held.pop(wire_id)
        await self.emit((Output(wire_id, "done", finish),))

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with connect_engine(
            self.url,
            rank=self.rank,
            size=self.size,
            lockstep=self.lockstep,
            info={"rank": self.rank, **self.extra},
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


class SteppingEngine(ScriptedEngine):
    """A rank that steps as a real engine does: every `step` s, one output to each of
    its first `max_num_seqs` requests (a ``{"tokens": k}`` body: the k-th finishes it),
    all in one batch; `max_num_seqs` goes in its READY info.

    `lie` makes it the hostile review's lying rank: every `step` s an empty output to
    each request it holds, never finishing one (``"never"``) or finishing each `late`
    s after it came (``"late"``). `finished` counts the requests it finished."""

    def __init__(
        self,
        url: str,
        rank: int,
        size: int,
        *,
        step: float,
        max_num_seqs: int,
        lie: str | None = None,
        late: float = 1.0,
    ) -> None:
        super().__init__(url, rank, size)
        self.step = step
        self.max_num_seqs = max_num_seqs
        self.extra["max_num_seqs"] = max_num_seqs
        self.lie = lie
        self.late = late
        self.queue: dict[str, list[float]] = {}  # wire id -> [tokens left, arrival]
        self.finished = 0

    def _load(self) -> Load:
        running = min(len(self.queue), self.max_num_seqs)
        return Load(waiting=len(self.queue) - running, running=running, kv=0.1)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(super().run)
            nursery.start_soon(self._steps)
            task_status.started()

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Add):
            self.queue[msg.id] = [float(msg.body["tokens"]), trio.current_time()]
        elif isinstance(msg, Abort):
            dropped = tuple(i for i in msg.ids if self.queue.pop(i, None) is not None)
            if dropped:
                await self.emit(finished=dropped)
        else:
            await super().handle(msg)

    async def _steps(self) -> None:
        while True:
            await trio.sleep(self.step)  # the engine's own clock: its step time
            if self.engine is None or not self.queue:
                continue
            outputs = []
            if self.lie is None:
                for wid in list(self.queue)[: self.max_num_seqs]:
                    entry = self.queue[wid]
                    entry[0] -= 1
                    done = entry[0] <= 0
                    outputs.append(Output(wid, int(entry[0]), "length" if done else None))
                    if done:
                        del self.queue[wid]
                        self.finished += 1
            else:
                now = trio.current_time()
                for wid, (_, came) in list(self.queue.items()):
                    done = self.lie == "late" and now - came >= self.late
                    outputs.append(Output(wid, None, "stop" if done else None))
                    if done:
                        del self.queue[wid]
                        self.finished += 1
            await self.emit(tuple(outputs))


async def start_engines(
    nursery: trio.Nursery, url: str, n: int, *, lockstep: bool = False
) -> list[ScriptedEngine]:
    """`n` engines for ranks 0..n-1 of a group at `url`, each running in `nursery`. They
    cannot be waited for here (their handshake needs the client): once the group is
    connected, `wait_ready(engines)` before using their handles."""
    engines = [ScriptedEngine(url, r, n, lockstep=lockstep) for r in range(n)]
    for e in engines:
        nursery.start_soon(e.run)
    return engines


async def wait_ready(engines: list[ScriptedEngine]) -> None:
    """Until every engine's task has set its handle: call it once the group is up, so
    that no test sees an engine whose handshake is done but whose task has not resumed."""
    for e in engines:
        await e.ready.wait()
