"""Deliberately broken variants of the core. Each must be caught by a property test.

They live with the tests, never in the package: `test_mutants.py` runs the state
machines and the exhaustive wave search against each and requires a failure.
"""

from __future__ import annotations

from typing import Any

from zmqdp._core.errors import ProtocolError
from zmqdp._core.messages import OutputBatch
from zmqdp._core.requests import RequestBook
from zmqdp._core.state import GroupCore, RankHealth
from zmqdp._core.waves import WaveClock

# -- request lifecycle (caught by tests/lifecycle_model.py) ----------------------------


class IgnoresEpoch(GroupCore[Any]):
    """Applies batches of any incarnation, as revision 1 did (§2.3 broken)."""

    def _is_stale(self, health: RankHealth, batch: OutputBatch) -> bool:
        return False


class ReusingWireIdBook(RequestBook[Any]):
    """Puts the application's id on the wire, as revision 1 did (§3 broken)."""

    def new_wire_id(self, request_id: str) -> str:
        return request_id


class ReusesWireIds(GroupCore[Any]):
    book_cls = ReusingWireIdBook


class DropsBatchOnBadEntry(GroupCore[Any]):
    """Treats one malformed entry as a bad batch (§7 entry scope broken)."""

    def _decode(self, body: bytes) -> OutputBatch:
        batch = super()._decode(body)
        if batch.bad_entries:
            raise ProtocolError(f"malformed entry: {batch.bad_entries[0].cause}")
        return batch


class NoSizeCheck(GroupCore[Any]):
    """Sends an ADD of any size (§1 broken)."""

    def _fits(self, rank: int, frames: tuple[bytes, bytes]) -> bool:
        return True


# -- waves (caught by tests/wave_model.py) ---------------------------------------------


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
    This is SMG #2078's design, which docs/protocol.md §5 rules out."""

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
