"""Overload shedding: stop taking new calls while the calls in progress fall behind their audio.

``server.max_calls`` is a fixed count, but what one core holds depends on the machine, the
audio (echo, noise and speech cost the gate and features more than silence) and what else shares
the core: on the reference machine the same gateway ran 50 calls at a p99 frame lag of 17 ms and
62-100 calls at 49-90 ms, one run to the next (README, Benchmarks). Past that point every call
suffers at once: barge-in is late, the bot's audio is late, marks echo late. So the gateway also
watches its own lateness, and while it is over ``limit_ms`` it refuses new calls politely (busy
TwiML, ``/readyz`` 503) so the load balancer and Twilio send them elsewhere. Calls in progress are
never cut.

What counts as the gateway's lateness (:class:`OverloadGuard`), and what does not:

1. *Processing time per frame*: from the handler taking a frame off its socket to the frame
   fully done (VAD batch, decision, sends). A gateway short of CPU is slow here for every call.
2. *Event-loop lag*: how late a timer the loop set fires (:meth:`OverloadGuard.probe`, every
   50 ms: 0.3 % of a core on an idle loop, against 0.6 % every 20 ms; 10 s each, 2026-12-01).
   A saturated loop runs every callback late, frames waiting in socket buffers included, which
   (1) cannot see: a frame's clock starts only when the handler gets to it.
3. Not the frame's lag behind its media time. That lag is also what one caller's network adds:
   a call whose frames arrive in 200 ms bursts (a TCP retransmission stall) has 1 frame in 10
   on time and the rest up to 180 ms "late", which is over any p99 limit, and a guard judging by
   it refused every new call (17 of 17) on an idle gateway. The media-clock lag stays a metric
   (``callgate_frame_lag_seconds``), not a reason to refuse.

Why p99 over a window and not the last frame: one slow frame (a GC pass, a burst of starts) is
not an overload, and a guard that flaps would refuse and accept calls every few frames. The
window also holds the guard down: it lifts only once the late seconds have left the window
(there is no second, lower threshold).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from fractions import Fraction

__all__ = ["LagGuard", "OverloadGuard"]


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


class OverloadGuard:
    """The gateway's own lateness: per-frame processing time and event-loop lag.

    Two :class:`LagGuard` over the same window and limit: ``frames`` gets every frame's
    processing time (p99, from ``min_frames`` frames on, as before), ``loop`` the lateness of
    a timer the loop sets every ``probe_interval_s`` (:meth:`probe`, a task the app runs).
    Overloaded when either is. The loop's judgement uses the p95 of its probes (more than 1 in
    20 late, with at least half the window's probes seen): a stall makes one probe late however
    long it lasts, so a 150 ms GC pass is 1 late probe of the window's 100, not an overload; a
    loop late on more than 5 of them is.
    """

    def __init__(self, limit_ms: float | None, *, window_s: int = 5, min_frames: int = 500,
                 probe_interval_s: float = 0.050,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not probe_interval_s > 0:
            raise ValueError(f"probe_interval_s must be positive, got {probe_interval_s!r}")
        self.probe_interval_s = probe_interval_s
        self._window_s, self._min_frames, self._clock = window_s, min_frames, clock
        self.last_loop_lag_s = 0.0
        self.set_limit(limit_ms)

    def set_limit(self, limit_ms: float | None) -> None:
        """A new limit (a config reload); the window starts afresh."""
        self.limit_ms = limit_ms
        self.frames = LagGuard(limit_ms, window_s=self._window_s, min_frames=self._min_frames,
                               clock=self._clock)
        # Half the window's probes: the loop has run at least half of this window.
        probes = max(1, int(self._window_s / self.probe_interval_s) // 2)
        self.loop = LagGuard(limit_ms, window_s=self._window_s, quantile=0.95,
                             min_frames=probes, clock=self._clock)

    def observe_frame(self, processing_s: float) -> None:
        """One media frame, fully processed ``processing_s`` after the handler took it."""
        self.frames.observe(processing_s)

    def observe_loop(self, lag_s: float) -> None:
        """One probe of the event loop, its timer fired ``lag_s`` late."""
        self.last_loop_lag_s = lag_s
        self.loop.observe(lag_s)

    @property
    def overloaded(self) -> bool:
        return self.frames.overloaded or self.loop.overloaded

    @property
    def reason(self) -> str | None:
        """What is late (``"frame processing"``, ``"event loop"``), or None."""
        if self.frames.overloaded:
            return "frame processing"
        if self.loop.overloaded:
            return "event loop"
        return None

    async def probe(self, observe: Callable[[float], None] | None = None) -> None:
        """Measure the event loop's lag until cancelled: sleep ``probe_interval_s``, observe
        how much later than that the loop woke us (``observe``: also handed each lag)."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(self.probe_interval_s)
            lag = max(0.0, loop.time() - start - self.probe_interval_s)
            self.observe_loop(lag)
            if observe is not None:
                observe(lag)
