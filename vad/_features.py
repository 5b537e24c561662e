"""Cheap per-window acoustic features that back up Silero where it is slow or fooled.

Silero needs 100-300 ms to rise on some onsets (a weak "And", speech under kitchen noise), and it
scores DTMF tones and some noises as speech. Two features, both on the same 256-sample window the
VAD sees, settle those cases:

* ``voicing``: the peak of the normalised autocorrelation in the pitch range (62-400 Hz). Voiced
  speech reaches 0.6-0.98 within a window or two of its onset; coughs, clicks, keyboard and door
  slams stay under 0.55.
* ``dtmf``: the share of the window's energy at one DTMF low-group plus one high-group
  frequency, when the two are within ``MAX_TWIST_DB`` of each other (0 otherwise). A keypress
  puts 80-95% there; speech almost never more than 40%. The twist rule is what tells a key from
  a vowel: a first formant at 700-940 Hz can put 60%+ of a window in one low-group band alone
  (32 of the dev voices' 760 voiced windows, all at Silero 0.89-1.00, read as key tones and were
  vetoed as "not the caller", which cost the turn detector its pitch at pauses: docs/turns.md),
  while a key is always both tones, at near-equal levels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from audio import TELEPHONY_RATE

__all__ = ["WindowFeatures", "features_batch", "hann_power", "window_features"]

_N = 256
_RATE = TELEPHONY_RATE
_HANN = np.hanning(_N)
_LOW = (697.0, 770.0, 852.0, 941.0)
_HIGH = (1209.0, 1336.0, 1477.0, 1633.0)
_MIN_LAG, _MAX_LAG = 20, 128  # 400 Hz .. 62.5 Hz
MAX_TWIST_DB = 10.0
"""Largest level difference between a key's two tones that still reads as a key: ITU-T Q.24
lets a receiver accept up to 8 dB of twist; 2 dB more for the handset and the codec."""
_TWIST = 10.0 ** (-MAX_TWIST_DB / 10.0)


def _band_bins(freqs: tuple[float, ...]) -> list[np.ndarray]:
    out = []
    for f in freqs:
        c = int(round(f * _N / _RATE))
        out.append(np.arange(c - 1, c + 2))
    return out


_LOW_BINS = _band_bins(_LOW)
_HIGH_BINS = _band_bins(_HIGH)


def hann_power(windows: np.ndarray) -> np.ndarray:
    """Power spectra of 256-sample windows (rows), Hann-windowed: what the DTMF feature reads,
    and the echo gate's band floor (the engine computes it once for both)."""
    w = np.asarray(windows, dtype=np.float64)
    return np.abs(np.fft.rfft(w * _HANN[: w.shape[1]], _N, axis=1)) ** 2


@dataclass(frozen=True, slots=True)
class WindowFeatures:
    voicing: float
    dtmf: float


def window_features(window: np.ndarray, previous: np.ndarray | None = None) -> WindowFeatures:
    """Features of one 256-sample window; ``previous`` (up to 128 earlier samples) lengthens the
    autocorrelation so low voices are caught."""
    w = np.asarray(window, dtype=np.float64)
    prev = np.zeros(0) if previous is None else np.asarray(previous, dtype=np.float64)
    return features_batch(w[None, :], prev[None, :])[0]


def features_batch(windows: np.ndarray, previous: np.ndarray,
                   spectrum: np.ndarray | None = None) -> list[WindowFeatures]:
    """:func:`window_features` of many windows at once (rows of ``windows``, each with the row
    of ``previous`` before it): the same arithmetic as numpy operations over the whole batch, so
    the cost per window falls with the batch (the gateway scores a VAD batch in one call)."""
    w = np.asarray(windows, dtype=np.float64)
    prev = np.asarray(previous, dtype=np.float64)
    b = w.shape[0]
    if b == 0:
        return []
    x = np.concatenate([prev, w], axis=1) if prev.shape[1] else w
    x = x - x.mean(axis=1, keepdims=True)
    n = x.shape[1]
    # Lags up to _MAX_LAG only: a transform of n + _MAX_LAG points has no circular wrap there
    # (512 for the usual 384 samples, a power of two).
    nfft = 1 << (n + _MAX_LAG - 1).bit_length()
    spec = np.fft.rfft(x, nfft, axis=1)
    ac = np.fft.irfft(spec.real**2 + spec.imag**2, nfft, axis=1)[:, :n]
    voicing = np.zeros(b)
    if n > _MAX_LAG:
        lags = np.arange(_MIN_LAG, _MAX_LAG + 1)
        ok = ac[:, 0] > 1e-9
        if ok.any():
            a0 = ac[ok, :1]
            voicing[ok] = np.max(ac[ok][:, lags] / a0 * (n / (n - lags)), axis=1)
    p = hann_power(w[:, :_N]) if spectrum is None else np.asarray(spectrum, dtype=np.float64)
    total = p.sum(axis=1)
    lo = np.max(np.stack([p[:, bins].sum(axis=1) for bins in _LOW_BINS]), axis=0)
    hi = np.max(np.stack([p[:, bins].sum(axis=1) for bins in _HIGH_BINS]), axis=0)
    both = np.minimum(lo, hi) >= _TWIST * np.maximum(lo, hi)  # two tones, not one formant
    dtmf = np.where((total > 1e-12) & both, (lo + hi) / np.maximum(total, 1e-300), 0.0)
    return [WindowFeatures(v, d) for v, d in zip(np.minimum(voicing, 1.0).tolist(), dtmf.tolist(),
                                                 strict=True)]
