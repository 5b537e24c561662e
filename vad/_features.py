"""Cheap per-window acoustic features that back up Silero where it is slow or fooled.

Silero needs 100-300 ms to rise on some onsets (a weak "And", speech under kitchen noise), and it
scores DTMF tones and some noises as speech. Two features, both on the same 256-sample window the
VAD sees, settle those cases:

* ``voicing``: the peak of the normalised autocorrelation in the pitch range (62-400 Hz). Voiced
  speech reaches 0.6-0.98 within a window or two of its onset; coughs, clicks, keyboard and door
  slams stay under 0.55.
* ``dtmf``: the share of the window's energy at one DTMF low-group plus one high-group
  frequency. A keypress puts 80-95% there; speech almost never more than 40%.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["WindowFeatures", "window_features"]

_N = 256
_RATE = 8000
_HANN = np.hanning(_N)
_LOW = (697.0, 770.0, 852.0, 941.0)
_HIGH = (1209.0, 1336.0, 1477.0, 1633.0)
_MIN_LAG, _MAX_LAG = 20, 128  # 400 Hz .. 62.5 Hz


def _band_bins(freqs: tuple[float, ...]) -> list[np.ndarray]:
    out = []
    for f in freqs:
        c = int(round(f * _N / _RATE))
        out.append(np.arange(c - 1, c + 2))
    return out


_LOW_BINS = _band_bins(_LOW)
_HIGH_BINS = _band_bins(_HIGH)


@dataclass(frozen=True, slots=True)
class WindowFeatures:
    voicing: float
    dtmf: float


def window_features(window: np.ndarray, previous: np.ndarray | None = None) -> WindowFeatures:
    """Features of one 256-sample window; ``previous`` (up to 128 earlier samples) lengthens the
    autocorrelation so low voices are caught."""
    w = np.asarray(window, dtype=np.float64)
    x = w if previous is None or len(previous) == 0 else np.concatenate([previous, w])
    x = x - x.mean()
    n = len(x)
    spec = np.fft.rfft(x, 2 * n)
    ac = np.fft.irfft(spec.real**2 + spec.imag**2)[:n]
    voicing = 0.0
    if ac[0] > 1e-9 and n > _MAX_LAG:
        lags = np.arange(_MIN_LAG, _MAX_LAG + 1)
        voicing = float(np.max(ac[lags] / ac[0] * (n / (n - lags))))
    p = np.abs(np.fft.rfft(w[:_N] * _HANN[: len(w[:_N])], _N)) ** 2
    total = float(p.sum())
    dtmf = 0.0
    if total > 1e-12:
        lo = max(float(p[b].sum()) for b in _LOW_BINS)
        hi = max(float(p[b].sum()) for b in _HIGH_BINS)
        dtmf = (lo + hi) / total
    return WindowFeatures(min(voicing, 1.0), dtmf)
