"""Signal helpers of the line simulator: levels, onsets, the telephone band, mu-law, resampling.

Levels follow the corpus README (../shared/recordings/README.md): dBFS where a full-scale square
wave is 0 dBFS (so RMS 1.0 is 0 dBFS and a full-scale sine is -3 dBFS). Everything here works on
float64 numpy arrays at 8 kHz and does no I/O.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from audio import FRAME_BYTES, TELEPHONY_RATE

__all__ = [
    "RATE",
    "Floats",
    "active_level_dbfs",
    "band_limit",
    "db",
    "decode_ulaw",
    "encode_ulaw",
    "fit_to_frames",
    "onset_offset",
    "resample",
    "set_level",
    "speech_end",
]

RATE = TELEPHONY_RATE
Floats = npt.NDArray[np.float64]


def db(x: float) -> float:
    return float(10.0 * np.log10(max(x, 1e-20)))


def _frame_energy(x: Floats, win: int, hop: int) -> Floats:
    if len(x) < win:
        return np.array([float(np.mean(x**2)) if len(x) else 0.0])
    c = np.concatenate([[0.0], np.cumsum(x**2)])
    starts = np.arange(0, len(x) - win + 1, hop)
    return np.asarray((c[starts + win] - c[starts]) / win, dtype=np.float64)


def active_level_dbfs(x: Floats) -> float:
    """Active-speech RMS (dBFS): the RMS over the 20 ms frames within 25 dB of the loudest one,
    so pauses and the noise floor between words do not lower a voice's level."""
    e = _frame_energy(x, 160, 160)
    if not len(e) or float(np.max(e)) <= 0:
        return -100.0
    keep = e >= np.max(e) * 10 ** (-25 / 10)
    return db(float(np.mean(e[keep])))


def set_level(x: Floats, level_dbfs: float) -> Floats:
    """``x`` scaled so its :func:`active_level_dbfs` is ``level_dbfs``."""
    now = active_level_dbfs(x)
    if now <= -100.0:
        return x.copy()
    return np.asarray(x * 10 ** ((level_dbfs - now) / 20), dtype=np.float64)


def onset_offset(x: Floats) -> int:
    """Sample index of the speech onset, by the corpus rule in short: 5 ms energy windows every
    1 ms; the first window 12 dB over the clip's floor (and within 50 dB of the peak) from which
    the energy reaches within 25 dB of the peak without falling back under that threshold."""
    e = _frame_energy(x, 40, 8)
    if not len(e) or float(np.max(e)) <= 0:
        return 0
    peak = float(np.max(e))
    floor = float(np.percentile(e, 10))
    thr = max(floor * 10 ** 1.2, peak * 1e-5)
    loud = peak * 10 ** (-2.5)
    above = e >= thr
    i = 0
    while i < len(e):
        if above[i]:
            j = i
            while j < len(e) and above[j] and e[j] < loud:
                j += 1
            if j < len(e) and above[j]:
                return i * 8
            i = j
        i += 1
    return 0


def speech_end(x: Floats) -> int:
    """Sample index just after the last stretch within 40 dB of the peak (the offset)."""
    e = _frame_energy(x, 40, 8)
    if not len(e) or float(np.max(e)) <= 0:
        return len(x)
    thr = max(float(np.max(e)) * 1e-4, float(np.percentile(e, 10)) * 10 ** 1.2)
    idx = np.flatnonzero(e >= thr)
    return int(min(len(x), idx[-1] * 8 + 40)) if len(idx) else len(x)


def band_limit(x: Floats, lo_hz: float = 300.0, hi_hz: float = 3400.0, order: int = 4) -> Floats:
    """The telephone band: Butterworth high-pass ``lo_hz`` and low-pass ``hi_hz`` magnitudes,
    applied forward and backward (zero phase, so onsets do not move), in the frequency domain."""
    n = len(x)
    if n == 0:
        return x.copy()
    size = 1 << int(np.ceil(np.log2(n + 1024)))
    f = np.fft.rfftfreq(size, 1 / RATE)
    f[0] = 1e-3
    half = order // 2
    mag2 = 1.0 / (1.0 + (lo_hz / f) ** (2 * half)) / (1.0 + (f / hi_hz) ** (2 * half))
    y = np.fft.irfft(np.fft.rfft(x, size) * mag2, size)[:n]
    return np.asarray(y, dtype=np.float64)


def encode_ulaw(x: Floats) -> bytes:
    """Hard-limit to full scale, then G.711 mu-law (audioop's encoder, as the gateway uses)."""
    from audio import float32_to_pcm16, pcm16_to_ulaw

    return pcm16_to_ulaw(float32_to_pcm16(np.clip(x, -1.0, 32767 / 32768)))


def decode_ulaw(data: bytes) -> Floats:
    from audio import ulaw_to_float32

    return ulaw_to_float32(data).astype(np.float64)


def resample(x: Floats, from_rate: int, to_rate: int = RATE) -> Floats:
    """Band-limited resampling in the frequency domain (the clips here are a few seconds)."""
    if from_rate == to_rate or not len(x):
        return np.asarray(x, dtype=np.float64)
    n_out = int(round(len(x) * to_rate / from_rate))
    spec = np.fft.rfft(x)
    keep = n_out // 2 + 1
    out_spec = np.zeros(keep, dtype=complex)
    m = min(keep, len(spec))
    out_spec[:m] = spec[:m]
    # Cut the top 5 % of the new band smoothly so nothing folds at the new Nyquist.
    taper = np.ones(keep)
    edge = int(keep * 0.95)
    taper[edge:] = np.linspace(1.0, 0.0, keep - edge)
    y = np.fft.irfft(out_spec * taper, n_out) * (n_out / len(x))
    return np.asarray(y, dtype=np.float64)


def fit_to_frames(n_samples: int) -> int:
    """``n_samples`` rounded up to whole 20 ms frames (160 samples)."""
    return -(-n_samples // FRAME_BYTES) * FRAME_BYTES
