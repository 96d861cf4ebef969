"""The process's open-files limit (RLIMIT_NOFILE): raising it to the hard limit, and
counting the descriptors in use.

Why it matters: libzmq (4.3.5) aborts the whole process (SIGABRT, "Too many open files
(src/ipc_listener.cpp:297)") when an ipc listener's accept finds the descriptor table
full; its tcp listener skips the connection instead. A client binds its group URL, so
each connection an engine (or any other process of the user) opens to it takes a slot of
that table, and so does each HTTP connection of a gateway in the same process: at the
usual soft limit of 1,024, about a thousand of them abort the process. Servers raise the
soft limit to the hard one at start (systemd's advice: the 1,024 default exists only for
`select()`, whose descriptor sets stop at 1,024; zmqdp, trio, asyncio and pyzmq poll with
epoll/kqueue/poll, and Python's own `select.select` refuses a larger descriptor rather than
corrupt memory). `EngineGroup.connect` does so unless
`ConnectOptions.raise_fd_limit` is False; `zmqdp serve` and `zmqdp mock` always do.

Raising the soft limit is not a bound: a process of the same user can still open more
connections to an ipc URL than the hard limit leaves, and libzmq has no accept cap to
stop it (docs/guides/security.md, "Open files"). A gateway bounds its own HTTP connections
(`zmqdp.gateway.connections`), which is what a remote client can open.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass

__all__ = ["OpenFilesLimit", "current_limit", "open_fds", "raise_open_files_limit"]

log = logging.getLogger("zmqdp")

LOW = 4096
"""A soft limit below this, after raising, gets a warning: a few thousand connections
is what one gateway or one busy client can meet."""

_FALLBACK_CEILINGS = (1 << 20, 1 << 16, 10240)
"""Targets tried, highest first, when the hard limit is unlimited: Linux refuses a soft
limit above fs.nr_open (1,048,576 by default), macOS one above kern.maxfilesperproc."""


@dataclass(frozen=True)
class OpenFilesLimit:
    """The soft limit found (`before`), the soft limit now (`soft`) and the hard limit
    (None: unlimited). All None where the platform has no RLIMIT_NOFILE (Windows)."""

    before: int | None
    soft: int | None
    hard: int | None

    @property
    def raised(self) -> bool:
        return self.before is not None and self.soft is not None and self.soft > self.before

    def describe(self) -> str:
        """One phrase for a log line."""
        if self.soft is None:
            return "no open-files limit known on this platform"
        hard = "unlimited" if self.hard is None else str(self.hard)
        if self.raised:
            return f"open-files limit raised from {self.before} to {self.soft} (hard {hard})"
        return f"open-files limit {self.soft} (hard {hard})"


_lock = threading.Lock()
_reported = False


def current_limit() -> OpenFilesLimit:
    """The limits as they are, changing nothing."""
    try:
        import resource
    except ImportError:  # Windows
        return OpenFilesLimit(None, None, None)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft_ = None if soft == resource.RLIM_INFINITY else soft
    hard_ = None if hard == resource.RLIM_INFINITY else hard
    return OpenFilesLimit(soft_, soft_, hard_)


def raise_open_files_limit(*, report: bool = True) -> OpenFilesLimit:
    """Raise the soft RLIMIT_NOFILE to the hard limit (or, if that is unlimited, to the
    highest the kernel takes) and return what was done. Idempotent and thread-safe; it
    never lowers the limit and never raises an error (a refused raise leaves the limit as
    it was). The first call in a process with `report` logs the outcome: INFO if it
    raised the limit, WARNING if the soft limit stays below `LOW` (a process that only
    connects, as the mock's ranks do, risks no abort: it says nothing)."""
    global _reported
    with _lock:
        found = current_limit()
        if found.soft is None:  # no limit (or no RLIMIT_NOFILE): nothing to do
            return found
        import resource

        targets = (found.hard,) if found.hard is not None else _FALLBACK_CEILINGS
        soft = found.soft
        for target in targets:
            if target is None or target <= soft:
                continue
            hard = resource.RLIM_INFINITY if found.hard is None else found.hard
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError):
                continue
            soft = target
            break
        result = OpenFilesLimit(found.soft, soft, found.hard)
        if report and not _reported:
            _reported = True
            _report(result)
        return result


def _report(limit: OpenFilesLimit) -> None:
    if limit.raised:
        log.info(
            "%s: libzmq aborts the process when an ipc accept finds the descriptor table "
            "full (ConnectOptions.raise_fd_limit=False leaves the limit alone)",
            limit.describe(),
        )
    elif limit.soft is not None and limit.soft < LOW:
        log.warning(
            "%s, and the hard limit allows no more: about %d connections to this process "
            "(engines', other local processes', HTTP clients') fill the descriptor table, "
            "and libzmq then aborts the process on an ipc URL; raise the hard limit "
            "(ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=)",
            limit.describe(),
            limit.soft,
        )


def open_fds() -> int | None:
    """Descriptors open in this process now, or None where it cannot be told (no
    /proc/self/fd or /dev/fd)."""
    for where in ("/proc/self/fd", "/dev/fd"):
        if sys.platform != "linux" and where == "/proc/self/fd":
            continue
        try:
            names = os.listdir(where)
        except OSError:
            continue
        return max(0, len(names) - 1)  # listdir's own descriptor is listed too
    return None
