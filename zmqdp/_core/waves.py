"""The client's wave clock for lockstep groups (docs/protocol.md §5).

Theory of operation
-------------------
Lockstep ranks run every step together and park together between *waves*; each rank
counts waves itself (`wave += 1` at every park). A parked rank that gets an ADD sends
`start_wave: wave`, and somebody must then WAKE every rank, or the holder runs alone in
its collective forever.

The clock `c` only **follows** the waves the group reports; it never leads:

* it starts at the highest `wave` in the ranks' HELLOs (0 if none says);
* `wave_complete(w)` folds `c = max(c, w + 1)` and wakes nobody (waking on completion
  would make an idle group spin);
* `start_wave(w)` folds `c = max(c, w)` and always answers with WAKE(c) to every rank,
  whatever the client believes about the group;
* after sending ADDs the client may send WAKE(c) to every rank, one WAKE for several
  ADDs; if the group is parked at `c` this saves a round trip, and if it is stale the
  holder's `start_wave` still arrives.

Every WAKE therefore names a wave some rank has reached, and never `c + 1`. That is the
whole safety argument: a running rank never adopts a number its peers have not seen, so
the group always parks at one wave number, and a stale WAKE is stale for every rank
alike. The SMG connector's "bump to c + 1 on every wake" breaks this under delivery
skew (one rank adopts c + 1 while running, the group parks split, and the lower rank
later runs alone); the property tests keep that variant as a mutant that must fail.

The clock is plain data: the caller sends the WAKEs it is told to send.
"""

from __future__ import annotations

__all__ = ["WaveClock"]

WAVE_MAX = 2**63 - 1
"""The largest wave the wire carries (docs/protocol.md §1)."""
_WAVE_MAX = WAVE_MAX


class WaveClock:
    """Follows the waves a lockstep group reports and says which WAKE to send."""

    __slots__ = ("_wave", "completes", "starts", "wakes")

    def __init__(self, start: int = 0) -> None:
        self._wave = start
        self.completes = 0
        self.starts = 0
        self.wakes = 0

    @property
    def wave(self) -> int:
        """The clock `c`: the newest wave the group is known to have reached."""
        return self._wave

    def observe_hello(self, wave: int | None) -> None:
        """Fold a rank's HELLO `wave`, so a restarted client follows a running group."""
        if wave is not None and wave > self._wave:
            self._wave = wave

    def wave_complete(self, wave: int) -> None:
        """A rank finished wave `wave` and parked at `wave + 1`. Never wakes anyone."""
        self.completes += 1
        if wave + 1 > self._wave:
            self._wave = min(wave + 1, _WAVE_MAX)  # a WAKE above 2^63 - 1 is invalid (§1)

    def start_wave(self, wave: int) -> int:
        """A parked rank got work at `wave`. Returns the wave to WAKE every rank with."""
        self.starts += 1
        if wave > self._wave:
            self._wave = min(wave, _WAVE_MAX)
        self.wakes += 1
        return self._wave

    def wake_after_adds(self) -> int:
        """The wave to WAKE every rank with after sending one or more ADDs."""
        self.wakes += 1
        return self._wave
