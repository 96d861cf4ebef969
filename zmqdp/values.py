"""zmqdp's value types: what a request is, what a rank and the group look like from
outside (`EngineInfo`, `RankState`, `GroupStatistics`, `GroupHealth`), and the one
options record of `connect` (`ConnectOptions`).

JSON: `GroupStatistics`, `RankStatistics`, `GroupHealth` and `HistogramSnapshot` have
`to_json()`, a dict of JSON-safe values for a gateway to serve
(`json.dumps(group.statistics().to_json())`): field names as keys, `RankState` as its
value (``"up"``, ``"down"``), a `Load` and a histogram as dicts of their fields
(`HistogramSnapshot.to_json`), tuples as lists, and a float that is not finite as None
(a `Load.kv` of NaN: unknown), so even `json.dumps(..., allow_nan=False)` takes it.

Plain frozen records with no behaviour and no I/O, so every layer can import them: the
trio client, `zmqdp.aio`, the gateway, the vLLM wire and the admission queue.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypedDict, TypeVar

from ._core.messages import DEFAULT_MAX_MESSAGE_SIZE, Load, check_timeout
from ._core.metrics import HistogramSnapshot

MAX_ENGINES = 1 << 16
"""Ranks travel as 2-byte routing ids, so a group has at most 65536 of them."""


def check_engines(engines: object) -> int:
    """`engines` as a group size, or a ValueError/TypeError that says what is allowed
    (rather than an OverflowError from deep in the transport, or a bool read as 1)."""
    if type(engines) is not int:
        raise TypeError(f"engines must be an int, got {type(engines).__name__} {engines!r}")
    if not 1 <= engines <= MAX_ENGINES:
        raise ValueError(f"engines must be in 1..{MAX_ENGINES}, got {engines}")
    return engines


__all__ = [
    "ConnectKeywords",
    "ConnectOptions",
    "EngineInfo",
    "GroupHealth",
    "GroupStatistics",
    "PrefixStatistics",
    "RankState",
    "RankStatistics",
    "Request",
    "WatchedValue",
]


class RankState(enum.Enum):
    """Whether a rank takes requests."""

    UP = "up"
    """Handshake complete: selectable, pinnable."""
    DOWN = "down"
    """Dead, rejoining or not yet back: submits pinned to it raise `InvalidRank`."""


T = TypeVar("T")


def _json(value: Any) -> Any:
    """`value` as JSON-safe data (module docstring)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return _json(value.value)
    if isinstance(value, HistogramSnapshot):
        return value.to_json()
    if isinstance(value, tuple | list):
        return [_json(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    raise TypeError(f"no JSON form for {type(value).__name__}")


class WatchedValue(Protocol[T]):
    """A value that tasks can wait on (trio-util's `AsyncValue`, read-only here)."""

    @property
    def value(self) -> T: ...

    async def wait_value(
        self, value_or_predicate: T | Callable[[T], bool], *, held_for: float = 0
    ) -> T:
        """Wait until the value equals `value_or_predicate` (or the predicate holds)."""
        ...

    async def wait_transition(
        self, value_or_predicate: T | Callable[[T, T], bool] | None = None
    ) -> tuple[T, T]:
        """Wait for the next change (matching it, if given); returns (new, old)."""
        ...


@dataclass(frozen=True, slots=True)
class Request:
    """One request: `id` unique among live requests (a non-empty str of at most 512
    characters; reusable once the request ends), `body` any CBOR-able value
    (docs/protocol.md §8) whose ADD fits the engine's `max_message_size`, `rank` an int to
    pin it (None: least-loaded), `timeout` its deadline in seconds from submit (None:
    the group's `request_timeout`): past it the request is aborted on its rank and its
    stream raises `RequestTimeout`, `stream_interval` the group's
    `ConnectOptions.stream_interval` for this request alone (None: the group's)."""

    id: str
    """Yours: unique among live requests, a non-empty str of at most 512 characters;
    reusable as soon as the request ends (the wire uses `RequestStream.wire_id`)."""
    body: Any = None
    """What the engine takes (the mock: `{"prompt": [ids], "max_tokens": k}`), any value
    with a CBOR form (docs/protocol.md §8) whose ADD fits the engine's `max_message_size`."""
    rank: int | None = None
    """Pin the request to this rank (`InvalidRank` if it is outside the group or down);
    None: the group's routing chooses."""
    timeout: float | None = None
    """Seconds from submit to the request's deadline (None: the group's
    `request_timeout`): past it the request is aborted on its rank and its stream raises
    `RequestTimeout`."""
    stream_interval: int | None = None
    """`ConnectOptions.stream_interval` for this request alone (None: the group's)."""
    tokens: Sequence[int] | None = None
    """The prompt's token ids, for ``routing="prefix"`` (None: routed by load alone, as
    any other routing does). Client-side only: never sent (the body is what the engine
    gets); the group hashes them by blocks to find the rank that probably caches the
    longest prefix (docs/design.md, "Prefix affinity"). A list or tuple of ints is
    used as it is; a range or a numpy array of integers is converted (``list(ids)``).
    Not a sequence of ints: `InvalidRequest` at submit."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """One rank as the client sees it."""

    rank: int
    """The rank, 0 .. size - 1: the engine's routing identity on the wire."""
    info: Mapping[str, Any]
    """The free-form metadata of its READY (model, `max_num_seqs`, ...), as sent."""
    state: RankState
    """Whether it takes requests now."""


@dataclass(frozen=True, slots=True)
class RankStatistics:
    """One rank in `GroupStatistics`."""

    rank: int
    """The rank, 0 .. size - 1."""
    state: RankState
    """UP (takes requests) or DOWN (dead, rejoining or not yet back)."""
    inflight: int
    """Requests this client has live on the rank."""
    load: Load
    """The rank's latest load report (queue counts zeroed while it holds nothing)."""
    batches: int
    """Valid batches received from its current incarnation."""
    protocol_errors: int
    """Its invalid messages and malformed entries, this incarnation."""
    queued: int
    """Messages waiting to be sent to it (they pile up while its input pipe is full)."""
    cap: int | None
    """Its in-flight cap (`max_inflight`); None: no cap."""
    ttft: HistogramSnapshot
    """Seconds from submit to the first output, of requests sent to it."""
    latency: HistogramSnapshot
    """Seconds from submit to the terminal output, of its requests that finished."""

    def to_json(self) -> dict[str, Any]:
        """JSON-safe (module docstring): ``{"rank": 0, "state": "up", "load": {"waiting":
        0, "running": 0, "kv": 0.0 or None}, ..., "ttft": {histogram}, ...}``."""
        return _json(self)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class PrefixStatistics:
    """Prefix affinity (``routing="prefix"``) since connect: `GroupStatistics.prefix`."""

    routed: int
    """Requests routed with token ids (unpinned)."""
    hits: int
    """Of those, requests sent to a rank believed to cache a prefix of their prompt."""
    cached_tokens: int
    """Prompt tokens those ranks were believed to cache (predicted, not measured: the
    engines' own count is in their outputs, e.g. vLLM's ``num_cached_tokens``)."""
    prompt_tokens: int
    """Prompt tokens of the requests routed with token ids."""
    blocks: int
    """Entries in the index now, over all ranks (bounded: `max_blocks`)."""
    rank_blocks: tuple[int, ...]
    """Entries per rank now."""
    exact_ranks: tuple[int, ...]
    """Ranks whose KV events are live (exact mode)."""
    kv_events: dict[str, int] = dataclasses.field(default_factory=dict)
    """KV-event counters summed over the ranks (vLLM's wire; empty otherwise)."""


@dataclass(frozen=True, slots=True)
class GroupStatistics:
    """A snapshot of `EngineGroup.statistics()`: per rank, then counters since connect."""

    ranks: tuple[RankStatistics, ...]
    """One `RankStatistics` per rank, in rank order."""
    lockstep: bool
    """Whether the ranks step together (MoE): one rank's death fails the group."""
    wave: int | None
    """The wave clock (lockstep groups), else None."""
    submitted: int
    """Requests accepted by `submit` (their ADD was queued)."""
    finished: int
    """Requests that ended with their terminal output."""
    truncated: int
    """Requests the engine listed in `finished` without a terminal output."""
    aborted: int
    """Requests ended by `abort()` or by leaving their stream early."""
    failed: int
    """Requests ended because their rank died or the group closed."""
    rolled_back: int
    """Submits refused with `InvalidRequest` because the body could not be encoded or
    the ADD was too large; nothing was sent or kept."""
    protocol_failed: int
    """Requests ended with `ProtocolError` by a malformed entry naming them (§7)."""
    overflowed: int
    """Streams whose consumer fell `max_buffered` outputs behind: their request was
    aborted (or, if its terminal output came in the same batch, counted as finished
    too, and its outputs past the bound dropped)."""
    timed_out: int
    """Requests aborted because their deadline passed (`RequestTimeout`)."""
    overloaded: int
    """Submits refused by admission control (`Overloaded`); nothing was kept."""
    waiting: int
    """Tasks in `wait_submit` waiting for room now."""
    protocol_errors: int
    """Messages that were not valid batches (each killed its rank), or came from an
    identity that is no rank."""
    malformed_entries: int
    """Malformed entries of otherwise valid batches."""
    stale_messages: int
    """Messages of a dead incarnation (another epoch, from a rank that is down, or on
    vLLM's wire a connection of a previous incarnation), never applied."""
    late_outputs: int
    """Entries for requests that had already ended (e.g. outputs racing an abort)."""
    unknown_outputs: int
    """Entries naming a wire id the client never issued, or one live on another rank."""
    wakes: int
    """WAKE rounds sent to the whole group: after a run of ADDs, and at the end of a
    dispatcher pass that took `start_wave`s (one round answers all of them)."""
    stall_wakes: int
    """Extra WAKEs for a stalled lockstep rank; a correct group needs none."""
    fallbacks: int
    """Safety-timeout firings of the socket adapter; 0 in a healthy process."""
    rejected_hellos: int
    """Handshake messages answered with REJECT (invalid or mismatched HELLO, READY)."""
    ignored_handshake_messages: int
    """Handshake messages that were neither HELLO nor READY, or came out of turn, and
    input-socket messages that were not a valid REGISTER."""
    stale_registers: int
    """REGISTERs of a dead incarnation (another epoch), ignored."""
    resyncs: int
    """RESYNCs sent to ranks the group waited for (start-up, after a death)."""
    dropped_answers: int
    """Handshake answers dropped because that peer did not read them."""
    identity_conflicts: int
    """Times a rank said HELLO again soon after its previous HELLO: two processes
    claiming one rank, or an engine restarting in a loop (logged once, loudly)."""
    refused_connections: int
    """CURVE: connections refused because their key is not on the allow-list."""
    impersonations: int
    """CURVE: messages dropped because their routing id was not their key's rank."""
    connections_lost: int
    """Ranks declared dead because their connection closed: the engine exited or was
    killed, or missed heartbeats (`heartbeat_timeout`)."""
    routes_restored: int = 0
    """Natively: times the client ended the connections of an engine that another
    process with the rank's identity had displaced (`ROUTER_HANDOVER` leaves them open
    with no route), so that the engine reconnects and hears its RESYNC."""
    prefix: PrefixStatistics | None = None
    """Prefix affinity's counters (``routing="prefix"``), else None."""

    def to_json(self) -> dict[str, Any]:
        """JSON-safe (module docstring): every field, `ranks` a list of
        `RankStatistics.to_json()`."""
        return _json(self)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class GroupHealth:
    """`EngineGroup.health()`: what a liveness and a readiness probe ask."""

    live: bool
    """The group serves (not closed, not failed): restart the process if False."""
    ready: bool
    """Live, not draining, and at least one rank up: send it traffic."""
    draining: bool
    """`drain()` was called: no new requests."""
    ranks_up: int
    """Ranks that take requests now."""
    size: int
    """Ranks in the group, up or not."""
    inflight: int
    """Live requests."""
    room: int | None
    """Requests the up ranks can still take before admission refuses (None: no cap)."""
    recovering: bool = False
    """A failed lockstep group waits for its ranks (`ConnectOptions.recover`): live, not
    ready, until they are back or `recover_timeout` passes (then not live)."""

    def to_json(self) -> dict[str, Any]:
        """JSON-safe (module docstring): every field, as is."""
        return _json(self)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class ConnectOptions:
    """Everything `connect` takes besides the URL, the size and the wire, in one record:
    `EngineGroup.connect`, `zmqdp.vllm.connect` and `AsyncioEngineGroup.connect` take
    these as keyword arguments, or one record as `options=`. Invalid values raise
    `ValueError` (or `InvalidRequest` for `request_timeout`) before anything binds."""

    ready_timeout: float | None = None
    """Seconds for every rank's handshake (`HandshakeTimeout` names each missing rank);
    None: the wire's default (60 s natively, 600 s for vLLM engines, which load a model
    first)."""
    silence_timeout: float = 30.0
    """A rank that holds requests and sends nothing this long is dead (§6); lockstep
    groups: also one that delivers no output this long after a stall WAKE."""
    send_timeout: float = 10.0
    """A rank whose input pipe stays full this long is dead."""
    stall_timeout: float = 5.0
    """Lockstep groups: WAKE again a rank with waiting work and no output this long."""
    advertise_host: str | None = None
    """The host engines are told to connect to, for a URL bound on a wildcard."""
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    """Bytes: bounds every message the client receives (announced in INIT natively);
    each engine announces its own and `submit` refuses larger ADDs."""
    max_buffered: int | None = None
    """Unread outputs per stream: a request whose consumer falls this far behind is
    aborted on its rank and its stream raises `StreamOverflow` (None: unbounded)."""
    max_inflight: int | Literal["info"] | None = None
    """Admission control: requests in flight per rank (an int; "info": each rank's
    `max_num_seqs` from its handshake info, uncapped if it sends none; None: no cap).
    A submit that finds no room raises `Overloaded`; `wait_submit` waits."""
    routing: Literal["least-loaded", "speed", "prefix"] = "speed"
    """How an unpinned request's rank is chosen. "speed" (the default): the rank that
    would finish it first, from each rank's step time (measured from the cadence of its
    outputs, and counted only once its requests finish: a rank cannot look fast by
    sending empty outputs) and its capacity (`max_num_seqs` from its handshake info): a
    slower rank gets requests only when the faster ones are full enough to make them
    wait longer, and equally fast ranks (within 25 %) share them as least-loaded does.
    Timing takes a rank at most 2 x its capacity past its least-loaded share.
    "least-loaded": the rank holding the fewest requests (its own count or its last
    load report, whichever is higher), whatever its speed.
    "prefix": "least-loaded", except that a request with token ids (`Request.tokens`;
    vLLM's `prompt_token_ids`) goes to the rank that probably caches the longest prefix
    of its prompt, among the ranks within a load band (a quarter over the least-loaded
    one, plus two requests); lockstep groups minimise the largest pending prefill
    instead (docs/design.md, "Prefix affinity"). Its fallback is least-loaded, not
    "speed": on prefill-heavy engines the step times "speed" measures are inflated by
    prefill, and a speed-aware fallback cost up to 1.6 x least-loaded's TTFT on a
    workload with no shared prefix (benchmarks/RESULTS.md, rows PR* and Pv*)."""
    kv_events: bool = True
    """With ``routing="prefix"``, on vLLM's wire: subscribe to the KV events of every
    rank whose ready response enables them (``--kv-events-config``), and route by what
    it says it caches (exact mode). False: by what was sent where alone (approximate
    mode, as on the native wire, where this does nothing)."""
    request_timeout: float | None = None
    """Seconds: the deadline of every request without its own `timeout` (None: none);
    past it the request is aborted on its rank and its stream raises `RequestTimeout`."""
    curve: Any = None
    """`zmqdp.keys.load_client_keys(DIR)`: the client becomes a CURVE server admitting
    only engines on its allow-list, each as the rank its key is bound to. Native wire
    only (vLLM's has no authentication)."""
    insecure: bool = False
    """Allow a tcp URL that other machines can reach without authentication (a trusted
    network)."""
    heartbeat_interval: float | None = 0.5
    """Seconds between ZMTP heartbeats (PINGs, answered by libzmq in the engine's I/O
    thread, whatever its own code is doing) on the connections that carry the ranks'
    lives (natively the handshake socket's, on vLLM's wire the input socket's).
    An engine that exits or is killed is seen dead at once, by its connection's close,
    heartbeats or not; heartbeats catch one that stopped (SIGSTOP, a frozen host) but
    keeps its sockets open. None: no heartbeats (a connection whose ZMTP handshake
    stalls is still dropped after `heartbeat_timeout`). Heartbeats never count as
    progress: the silence and stall rules look at messages only."""
    heartbeat_timeout: float = 3.0
    """Seconds without any traffic after a PING before libzmq drops the connection,
    which makes the rank dead (`RankState.DOWN` at once, its requests end with
    `EngineDead`). A stopped engine is seen dead within about `heartbeat_interval` +
    `heartbeat_timeout`."""
    recover: bool = False
    """A lockstep group whose rank dies fails as a whole: its requests end either way.
    With `recover`, the group is not closed for good: it keeps its sockets bound,
    `submit` raises `GroupRecovering` (a `GroupClosed`: a gateway answers 503, and
    `health()` stays live but not ready), every rank is asked to start over (natively:
    RESYNC; a vLLM engine must be restarted), and once every rank has completed a new
    handshake (a restarted engine group, or the survivors starting a new incarnation)
    the group serves again. Nothing of the failed incarnation reaches the new one.
    (An independent group never fails as a whole: its ranks come back one by one.)
    The wait is bounded by `recover_timeout`."""
    recover_timeout: float | None = None
    """Seconds a failed lockstep group (`recover`) waits for every rank to complete a
    new handshake; past it, the group is closed for good (`GroupClosed` naming the ranks
    that did not come back, `health().live` False: a liveness probe restarts the host).
    None: the wire's `ready_timeout` default (60 s natively, 600 s for vLLM engines)."""
    raise_fd_limit: bool = True
    """Raise the process's soft open-files limit (RLIMIT_NOFILE) to its hard limit on
    connect, as servers do: libzmq aborts the process when an ipc accept finds the
    descriptor table full, which about a thousand connections do at the usual soft limit
    of 1,024 (`zmqdp.fdlimit`; the first connect logs what it did). False: leave the
    limit as the embedder set it."""
    stream_interval: int = 1
    """Outputs per wake-up of a stream's consumer (vLLM's ``--stream-interval``; an
    output is one engine step's for the request: a token, or several when speculating).
    1 (the default): every output is handed over as soon as it is read, which keeps
    inter-token latency honest. k > 1: a request's first and terminal outputs, and its
    end, are handed over at once; the outputs in between are held until k are waiting,
    or `stream_max_delay` passed, then handed over together: the consumer wakes once
    per k steps (a gateway writes once), for up to k - 1 steps of added latency.
    Nothing is merged, reordered or dropped."""
    stream_max_delay: float | None = 0.05
    """Seconds: the longest an output is held by `stream_interval` (None: until k are
    waiting or the request ends)."""

    def __post_init__(self) -> None:
        """Refuse what no group could use, before anything is bound."""
        mb = self.max_buffered
        if mb is not None and (type(mb) is not int or mb < 1):
            raise ValueError(f"max_buffered must be a positive int or None, got {mb!r}")
        si = self.stream_interval
        if type(si) is not int or si < 1:
            raise ValueError(f"stream_interval must be a positive int, got {si!r}")
        sd = self.stream_max_delay
        if sd is not None and (type(sd) not in (int, float) or not 0 < sd < math.inf):
            raise ValueError(f"stream_max_delay must be None or a positive number, got {sd!r}")
        mi = self.max_inflight
        if mi not in (None, "info") and (type(mi) is not int or mi < 1):
            raise ValueError(f"max_inflight must be a positive int, 'info' or None, got {mi!r}")
        if self.routing not in ("least-loaded", "speed", "prefix"):
            raise ValueError(
                f"routing must be 'least-loaded', 'speed' or 'prefix', got {self.routing!r}"
            )
        if type(self.kv_events) is not bool:
            raise ValueError(f"kv_events must be a bool, got {self.kv_events!r}")
        check_timeout("request_timeout", self.request_timeout)
        rt = self.recover_timeout
        if rt is not None and (type(rt) not in (int, float) or not 0 < rt < math.inf):
            raise ValueError(f"recover_timeout must be None or a positive number, got {rt!r}")
        hi, ht = self.heartbeat_interval, self.heartbeat_timeout
        if hi is not None and (type(hi) not in (int, float) or not 0.01 <= hi <= 3600):
            raise ValueError(f"heartbeat_interval must be None or 0.01..3600 s, got {hi!r}")
        if type(ht) not in (int, float) or not 0.01 <= ht <= 3600:
            raise ValueError(f"heartbeat_timeout must be 0.01..3600 s, got {ht!r}")
        if hi is not None and ht < hi:
            raise ValueError(
                f"heartbeat_timeout ({ht!r} s) must be at least heartbeat_interval ({hi!r} s)"
            )


class ConnectKeywords(TypedDict, total=False):
    """`ConnectOptions`'s fields as keyword arguments: ``**options:
    Unpack[ConnectKeywords]`` in `connect`'s signatures lets type checkers and IDEs
    list and check them (a misspelt option is an error); `help()` lists them through
    `with_connect_options`. Kept equal to `ConnectOptions` by a test."""

    ready_timeout: float | None
    silence_timeout: float
    send_timeout: float
    stall_timeout: float
    advertise_host: str | None
    max_message_size: int
    max_buffered: int | None
    max_inflight: int | Literal["info"] | None
    routing: Literal["least-loaded", "speed", "prefix"]
    kv_events: bool
    request_timeout: float | None
    curve: Any
    insecure: bool
    heartbeat_interval: float | None
    heartbeat_timeout: float
    recover: bool
    recover_timeout: float | None
    raise_fd_limit: bool
    stream_interval: int
    stream_max_delay: float | None


F = TypeVar("F", bound=Callable[..., Any])


def with_connect_options(fn: F, defaults: Mapping[str, Any] | None = None) -> F:
    """`fn` with its ``**options`` shown as `ConnectOptions`'s fields (keyword-only,
    with their defaults, or those of `defaults`) in `inspect.signature` and so in
    `help()`: the run-time view of its ``Unpack[ConnectKeywords]`` annotation."""
    signature = inspect.signature(fn)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    keyword = inspect.Parameter.KEYWORD_ONLY
    defaults = defaults or {}
    # Evaluated here: a string would be read in `fn`'s module (pdoc does), which need
    # not import what the fields' annotations name (`Literal`).
    hints = typing.get_type_hints(ConnectOptions)
    params += [
        inspect.Parameter(
            f.name, keyword, default=defaults.get(f.name, f.default), annotation=hints[f.name]
        )
        for f in dataclasses.fields(ConnectOptions)
    ]
    fn.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return fn


def connect_options(options: ConnectOptions | None, kwargs: Mapping[str, Any]) -> ConnectOptions:
    """`options`, or the `ConnectOptions` the keywords make: what every `connect` and
    opener takes (`options=` or keywords, not both: `TypeError`)."""
    if options is None:
        return ConnectOptions(**kwargs)
    if kwargs:
        raise TypeError("pass the options either as `options=` or as keywords, not both")
    return options
