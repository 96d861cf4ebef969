"""Small helpers for the trio layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

from ._core.errors import ZmqdpError

__all__ = ["single_exception"]


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(_leaves(exc))
        else:
            out.append(exc)
    return out


@contextmanager
def single_exception() -> Iterator[None]:
    """Turn an ExceptionGroup escaping an internal nursery into one plain exception.

    Users of zmqdp never see an ExceptionGroup: the first real error wins (a
    `ZmqdpError` before anything else, cancellations last) and the others are attached
    to it as notes so nothing is hidden.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        real = [e for e in leaves if not isinstance(e, trio.Cancelled)]
        if not real:
            raise leaves[0] from None
        real.sort(key=lambda e: not isinstance(e, ZmqdpError))
        first = real[0]
        for other in real[1:]:
            first.add_note(f"also raised: {type(other).__name__}: {other}")
        raise first from None
