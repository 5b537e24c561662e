"""Overload shedding: stop taking new calls while the calls in progress fall behind their audio.

``server.max_calls`` is a fixed count, but what one core holds depends on the machine, the
audio (echo, noise and speech cost the gate and features more than silence) and what else shares
the core: on the reference machine the same gateway ran 50 calls at a p99 frame lag of 17 ms and
62-100 calls at 49-90 ms, one run to the next (README, Benchmarks). Past that point every call
suffers at once: barge-in is late, the bot's audio is late, marks echo late. So the gateway also
watches what its callers would notice, the frame lag (how far behind its own media time each
inbound frame is done), and while the p99 of the last few seconds is over ``limit_ms`` it refuses
new calls politely (busy TwiML, ``/readyz`` 503) so the load balancer and Twilio send them
elsewhere. Calls in progress are never cut.

Why p99 over a window and not the last frame: one slow frame (a GC pass, a burst of starts) is
not an overload, and a guard that flaps would refuse and accept calls every few frames. The
window also holds the guard down: it lifts only once the late seconds have left the window
(there is no second, lower threshold).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from fractions import Fraction

__all__ = ["LagGuard"]


class LagGuard:
    """Is the p99 frame lag of the last ``window_s`` seconds over ``limit_ms``?

    The window is ``window_s`` one-second buckets, the newest one filling: between
    ``window_s - 1`` and ``window_s`` seconds of frames. :meth:`observe` is called for every
    media frame (cheap: two integer bumps in a ring of buckets). The guard judges only with at
    least ``min_frames`` frames in the window: at 50 frames a second per call, the default 500
    takes about three calls, so a gateway with a call or two is never called overloaded by a
    few late frames. ``limit_ms`` None switches the guard off. Not thread-safe (the event
    loop's thread only).
    """

    def __init__(self, limit_ms: float | None, *, window_s: int = 5, quantile: float = 0.99,
                 min_frames: int = 500, clock: Callable[[], float] = time.monotonic) -> None:
        if limit_ms is not None and not limit_ms > 0:
            raise ValueError(f"limit_ms must be positive or None, got {limit_ms!r}")
        if window_s < 1:
            raise ValueError(f"window_s must be at least 1, got {window_s!r}")
        if not 0 < quantile < 1:
            raise ValueError(f"quantile must be in (0, 1), got {quantile!r}")
        self.limit_ms = limit_ms
        self.window_s = window_s
        self._limit_s = None if limit_ms is None else limit_ms / 1000
        # The quantile is over the limit <=> more than (1 - quantile) of the frames are late.
        # Exact (0.99 as 99/100): in floats 1 - 0.9 is just under 0.1, which would call
        # exactly 10 % late frames a p90 over the limit.
        self._late_share = 1 - Fraction(str(quantile))
        self._min_frames = min_frames
        self._clock = clock
        self._frames = [0] * window_s
        self._late = [0] * window_s
        self._second = int(clock())

    def _roll(self) -> int:
        """Advance the ring to the current second; the index of its bucket."""
        now = int(self._clock())
        if now != self._second:
            for s in range(max(self._second + 1, now - self.window_s + 1), now + 1):
                i = s % self.window_s
                self._frames[i] = self._late[i] = 0
            self._second = now
        return now % self.window_s

    def observe(self, lag_s: float) -> None:
        """One media frame, done ``lag_s`` behind its media time."""
        if self._limit_s is None:
            return
        i = self._roll()
        self._frames[i] += 1
        if lag_s > self._limit_s:
            self._late[i] += 1

    @property
    def frames(self) -> int:
        """Frames observed in the window."""
        self._roll()
        return sum(self._frames)

    @property
    def late_share(self) -> float:
        """Share of the window's frames over the limit (0 without frames)."""
        self._roll()
        total = sum(self._frames)
        return sum(self._late) / total if total else 0.0

    @property
    def overloaded(self) -> bool:
        if self._limit_s is None:
            return False
        self._roll()
        total = sum(self._frames)
        return total >= self._min_frames and sum(self._late) > self._late_share * total
