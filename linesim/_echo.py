"""The echo path: how the bot's own audio comes back on the caller's track.

``bot`` (what the gateway sent, on the call's timeline) goes through, in order:

1. the loudspeaker: ``none`` (linear), ``tanh`` (soft saturation, driven 6-12 dB into it) or
   ``clip`` (hard clipping 6-12 dB under the peak);
2. a short room/handset impulse response: a direct path, 3-6 reflections within 30 ms and a
   decaying noise tail of 40-80 ms, normalised to unit energy;
3. the bulk delay and the echo gain, per segment: before and after a path change the delay and
   the echo return loss (ERL) may differ; the two segments cross-fade over 20 ms.

ERL is exact by construction: the echo's active level (``_dsp.active_level_dbfs``) is set to the
bot's active level minus ``erl_db``, segment by segment. The line's band limit and mu-law come
after the mix (``_call``), as on a real line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ._dsp import Floats, active_level_dbfs

__all__ = ["EchoPath", "EchoStream", "Nonlinearity", "impulse_response"]

Nonlinearity = Literal["none", "tanh", "clip"]


def impulse_response(rng: np.random.Generator) -> Floats:
    n = int(rng.uniform(0.04, 0.08) * 8000)
    h = np.zeros(n)
    h[0] = 1.0
    for _ in range(int(rng.integers(3, 7))):
        k = int(rng.uniform(0.002, 0.03) * 8000)
        h[k] += rng.uniform(0.15, 0.5) * rng.choice([-1.0, 1.0])
    tail = rng.standard_normal(n) * np.exp(-np.arange(n) / (n / 4)) * 0.08
    tail[:16] = 0.0
    h += tail
    return np.asarray(h / np.sqrt(np.sum(h**2)), dtype=np.float64)


@dataclass(frozen=True, slots=True)
class EchoPath:
    """One call's echo path (see the module docstring)."""

    erl_db: float
    """Echo return loss before the change: bot level minus echo level (dB)."""
    delay_ms: float
    """Bulk delay before the change (ms)."""
    nonlinearity: Nonlinearity = "none"
    drive_db: float = 9.0
    """How far into the nonlinearity the bot's peaks go."""
    ir: tuple[float, ...] = (1.0,)
    change_ms: float | None = None
    """Where the path changes (ms of the call), or None."""
    erl_after_db: float | None = None
    delay_after_ms: float | None = None

    def _speaker(self, x: Floats) -> Floats:
        peak = float(np.max(np.abs(x))) if len(x) else 0.0
        if peak <= 0 or self.nonlinearity == "none":
            return x
        k = 10 ** (self.drive_db / 20) / peak
        if self.nonlinearity == "tanh":
            return np.asarray(np.tanh(x * k) / k, dtype=np.float64)
        return np.asarray(np.clip(x * k, -1.0, 1.0) / k, dtype=np.float64)

    def stream(self, bot: Floats) -> EchoStream:
        """A closed-loop echo: fed with what was actually played, frame by frame, it gives the
        echo of that (same speaker drive and echo gains as :meth:`render` of the planned
        ``bot``). The telephone band is part of its response (a 129-tap linear-phase band-pass,
        8 ms of delay taken off the bulk delay; delays under 8 ms come back at 8 ms)."""
        return EchoStream(self, bot)

    def render(self, bot: Floats) -> Floats:
        """The echo on the caller's track for ``bot`` on the same timeline (same length)."""
        n = len(bot)
        # FFT convolution: np.convolve of a 15 s call with a 60 ms response took 13 ms a call.
        ir = np.asarray(self.ir)
        size = 1 << int(np.ceil(np.log2(n + len(ir))))
        shaped = np.fft.irfft(np.fft.rfft(self._speaker(bot), size) * np.fft.rfft(ir, size),
                              size)[:n]
        bot_level = active_level_dbfs(bot)
        base_level = active_level_dbfs(shaped)
        if bot_level <= -100 or base_level <= -100:
            return np.zeros(n)

        def segment(delay_ms: float, erl_db: float) -> Floats:
            d = int(round(delay_ms * 8))
            g = 10 ** ((bot_level - erl_db - base_level) / 20)
            y = np.zeros(n)
            if d < n:
                y[d:] = shaped[: n - d] * g
            return y

        first = segment(self.delay_ms, self.erl_db)
        if self.change_ms is None:
            return first
        second = segment(self.delay_after_ms if self.delay_after_ms is not None else self.delay_ms,
                         self.erl_after_db if self.erl_after_db is not None else self.erl_db)
        c = int(self.change_ms * 8)
        fade = 160
        w = np.clip((np.arange(n) - c) / fade, 0.0, 1.0)
        return np.asarray(first * (1 - w) + second * w, dtype=np.float64)


_BP_TAPS = 129


def _band_fir() -> Floats:
    """The telephone band (``_dsp.band_limit``) as a linear-phase FIR, centred at tap 64."""
    from ._dsp import band_limit

    x = np.zeros(1024)
    x[512] = 1.0
    h = band_limit(x)[512 - _BP_TAPS // 2 : 512 + _BP_TAPS // 2 + 1]
    return np.asarray(h * np.hanning(_BP_TAPS + 2)[1:-1], dtype=np.float64)


class EchoStream:
    """The echo of the audio actually played, built as it plays (see :meth:`EchoPath.stream`).

    :meth:`play` adds samples played at a position (in order, never rewritten); :meth:`echo`
    returns the echo over ``[a, b)``, which needs the played audio up to ``b`` only.
    """

    def __init__(self, path: EchoPath, bot: Floats) -> None:
        self.path = path
        n = len(bot)
        peak = float(np.max(np.abs(bot))) if n else 0.0
        self._k = 10 ** (path.drive_db / 20) / peak if peak > 0 else 1.0
        ir = np.asarray(path.ir)
        size = 1 << int(np.ceil(np.log2(n + len(ir) + 1)))
        shaped = np.fft.irfft(np.fft.rfft(self._speaker(bot), size) * np.fft.rfft(ir, size),
                              size)[:n]
        bot_level, base_level = active_level_dbfs(bot), active_level_dbfs(shaped)
        ok = bot_level > -100 and base_level > -100

        def gain(erl: float) -> float:
            return 10 ** ((bot_level - erl - base_level) / 20) if ok else 0.0

        self._h = np.convolve(ir, _band_fir())
        self._lag = _BP_TAPS // 2
        self._segments = [(path.delay_ms, gain(path.erl_db))]
        if path.change_ms is not None:
            self._segments.append((
                path.delay_after_ms if path.delay_after_ms is not None else path.delay_ms,
                gain(path.erl_after_db if path.erl_after_db is not None else path.erl_db)))
        self._shaped = np.zeros(n + len(self._h) + 8000)

    def _speaker(self, x: Floats) -> Floats:
        nl = self.path.nonlinearity
        if nl == "none":
            return x
        if nl == "tanh":
            return np.asarray(np.tanh(x * self._k) / self._k, dtype=np.float64)
        return np.asarray(np.clip(x * self._k, -1.0, 1.0) / self._k, dtype=np.float64)

    def play(self, at: int, samples: Floats) -> None:
        if not len(samples):
            return
        y = np.convolve(self._speaker(samples), self._h)
        end = at + len(y)
        if end > len(self._shaped):
            self._shaped = np.concatenate([self._shaped, np.zeros(end - len(self._shaped))])
        self._shaped[at:end] += y

    def echo(self, a: int, b: int) -> Floats:
        out = np.zeros(b - a)
        idx = np.arange(a, b)
        c = int(self.path.change_ms * 8) if self.path.change_ms is not None else None
        for i, (delay_ms, g) in enumerate(self._segments):
            d = max(0, int(round(delay_ms * 8)) - self._lag)
            src = idx - d
            ok = (src >= 0) & (src < len(self._shaped))
            seg = np.zeros(b - a)
            seg[ok] = self._shaped[src[ok]] * g
            if c is None:
                w = np.ones(b - a)
            else:
                w = np.clip((idx - c) / 160, 0.0, 1.0)
                w = 1 - w if i == 0 else w
            out += seg * w
        return out
