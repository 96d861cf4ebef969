"""Deliberately broken variants of the core. Each must be caught by a property test.

They live with the tests, never in the package: `test_mutants.py` runs the state
machines and the exhaustive wave search against each and requires a failure.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zmqdp._core.errors import DuplicateRequestId
from zmqdp._core.requests import RequestBook, _Live
from zmqdp._core.routing import Routing
from zmqdp._core.waves import WaveClock


class CountingRouting(Routing):
    """Releases by counter: every release of an id decrements the rank's count, even if
    that id was already released. Modelled on the set so the invariant can name ids:
    an id still held is removed; otherwise some other request's slot is freed, which
    is exactly what a decrement by one does to a count."""

    def release(self, rank: int, request_ids: Iterable[str]) -> None:
        held = self._inflight[rank]
        for rid in request_ids:
            if rid in held:
                held.discard(rid)
            elif held:
                held.pop()


class SelectFirstBook(RequestBook[Any]):
    """Selects (and reserves) before registering, then rolls the reservation back when
    the id turns out to be a live duplicate."""

    def submit(self, request_id: str, handle: Any, rank: int | None = None) -> int:
        chosen = self.routing.select(request_id, rank)
        live = self._live.get(request_id)
        if live is not None:
            self.routing.release(chosen, (request_id,))
            raise DuplicateRequestId(request_id, live.rank)
        self._live[request_id] = _Live(chosen, handle)
        return chosen


class BumpingClock(WaveClock):
    """SMG's rule: every wake names c + 1."""

    def start_wave(self, wave: int) -> int:
        self._wave = max(self._wave, wave) + 1
        return self._wave

    def wake_after_adds(self) -> int:
        self._wave += 1
        return self._wave


class IgnoresStartWave(WaveClock):
    """Never answers an engine's start_wave (still wakes after ADDs)."""

    def start_wave(self, wave: int) -> int | None:  # type: ignore[override]
        self._wave = max(self._wave, wave)
        return None


class BelievedParkedClock(WaveClock):
    """Wakes only after ADDs, and only while it believes the group parked (it has not
    woken the group since the last wave_complete it saw); never answers start_wave.
    This is SMG #2078's design, which PROTOCOL.md §5 rules out."""

    def __init__(self, start: int = 0) -> None:
        super().__init__(start)
        self.believed_running = False

    def wave_complete(self, wave: int) -> None:
        super().wave_complete(wave)
        self.believed_running = False

    def start_wave(self, wave: int) -> int | None:  # type: ignore[override]
        self._wave = max(self._wave, wave)
        return None

    def wake_after_adds(self) -> int | None:  # type: ignore[override]
        if self.believed_running:
            return None
        self.believed_running = True
        return self._wave
