"""Small helpers for the trio layer."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import trio

from ._core.errors import ZmqdpError

__all__ = ["LogLimiter", "NoPublicConstructor", "open_service_nursery", "single_exception"]


class LogLimiter:
    """Logs what peers cause without letting them decide how much is logged: per kind of
    event, the first `burst` occurrences, then only the 100th, 1000th, 10000th... each
    with its count. Kinds are fixed strings of ours, so the table stays small."""

    def __init__(self, logger: logging.Logger, burst: int = 10) -> None:
        self._logger = logger
        self._burst = burst
        self._counts: dict[str, int] = {}

    def log(self, level: int, kind: str, message: str, *args: Any) -> None:
        n = self._counts.get(kind, 0) + 1
        self._counts[kind] = n
        if n <= self._burst:
            self._logger.log(level, message, *args)
        elif str(n).rstrip("0") == "1":  # 100, 1000, ...
            self._logger.log(level, f"{message} ({n} times so far)", *args)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(_leaves(exc))
        else:
            out.append(exc)
    return out


def _only_cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


def collapse(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception to raise for a group of *library* task errors: the first real
    error wins (a `ZmqdpError` before anything else, cancellations last), and the
    others are attached to it as notes so nothing is hidden."""
    leaves = _leaves(group)
    real = [e for e in leaves if not isinstance(e, trio.Cancelled)]
    if not real:
        return leaves[0]
    real.sort(key=lambda e: not isinstance(e, ZmqdpError))
    first = real[0]
    for other in real[1:]:
        first.add_note(f"also raised: {type(other).__name__}: {other}")
    return first


@contextmanager
def single_exception() -> Iterator[None]:
    """Turn an ExceptionGroup escaping an internal nursery (no user code inside) into
    one plain exception (see `collapse`)."""
    try:
        yield
    except BaseExceptionGroup as group:
        raise collapse(group) from None


@asynccontextmanager
async def open_service_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery of library tasks around a *user's* block.

    Users never see an ExceptionGroup of ours, and never lose one of theirs: whatever
    the block raises passes out unchanged (an `ExceptionGroup` stays a group, so
    `except*` works), while errors of the library's own tasks are collapsed into one
    plain exception. Leaving the block cancels the tasks.

    Cancellation: the block's `Cancelled` passes out as it came, after the tasks end.
    """
    body_exc: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                yield nursery
            except BaseException as exc:
                body_exc = exc  # raised again below, once our tasks are gone
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        internal = collapse(group)
        if body_exc is None or _only_cancelled(body_exc):
            # The block was cancelled because a task of ours failed (or it ended and
            # a task failed while being cancelled): the task's error is the story.
            raise internal from None
        if not isinstance(internal, trio.Cancelled):
            body_exc.add_note(f"zmqdp also failed: {type(internal).__name__}: {internal}")
    if body_exc is not None:
        raise body_exc


T = TypeVar("T")


class NoPublicConstructor(type):
    """Metaclass for classes users get from a factory, never build (trio's idiom): the
    class can be named in annotations and `isinstance`, but calling it raises
    `TypeError`; the package builds instances with `Class._create(...)`."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor; "
            "zmqdp creates it for you"
        )

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        return super().__call__(*args, **kwargs)  # type: ignore[misc, no-any-return]
