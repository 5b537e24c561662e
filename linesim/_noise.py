"""Synthetic background sounds and in-band DTMF, each a deterministic function of its name.

A synthetic clip is named ``synthetic:<kind>#<variant>``; its samples come from a generator seeded
by that name alone, so the same variant is the same sound in every call and every run, and the
split of a variant (``_sources.synthetic_split``) is the split of a fixed sound.

Kinds: ``room`` (coloured stationary noise with a slow hum), ``music`` (hold music: chords of
harmonic tones on a beat), ``cough``, ``laugh``, ``breath``, ``click``, ``knock`` (a door slammed or a
knock on a table: a few low, fast-decaying thumps). These are shaped noise and tones, not
recordings; the labels say ``synthetic``.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ._dsp import RATE, Floats, active_level_dbfs

__all__ = ["DTMF_FREQS", "burst_extent", "dtmf_tone", "synthetic"]

DTMF_FREQS: dict[str, tuple[float, float]] = {}
for _r, _row in enumerate(("123A", "456B", "789C", "*0#D")):
    for _c, _d in enumerate(_row):
        DTMF_FREQS[_d] = ((697.0, 770.0, 852.0, 941.0)[_r], (1209.0, 1336.0, 1477.0, 1633.0)[_c])


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big"))


def _coloured(rng: np.random.Generator, n: int, slope: float) -> Floats:
    """Noise whose power falls ``slope`` dB per octave (0 white, 3 pink, 6 brown)."""
    spec = np.fft.rfft(rng.standard_normal(n))
    f = np.maximum(np.fft.rfftfreq(n, 1 / RATE), 20.0)
    spec *= (f / 20.0) ** (-slope / 3.0103 / 2)  # power ~ f^-(slope/3.01): amplitude half
    return np.asarray(np.fft.irfft(spec, n), dtype=np.float64)


def _env(n: int, attack: int, decay: float) -> Floats:
    t = np.arange(n, dtype=np.float64)
    a = np.minimum(1.0, t / max(1, attack))
    return np.asarray(a * np.exp(-np.maximum(0.0, t - attack) / max(1.0, decay)), np.float64)


def synthetic(kind: str, variant: int, duration_ms: float = 4000.0) -> Floats:
    """Variant ``variant`` of a synthetic sound at about -20 dBFS active level (the caller sets
    the level). Stationary kinds (room, music) last ``duration_ms``; bursts have their own length."""
    rng = _rng(f"synthetic:{kind}#{variant}")
    n = int(duration_ms * 8)
    if kind == "room":
        x = _coloured(rng, n, slope=rng.uniform(2.0, 6.0))
        hum_f = rng.choice([50.0, 60.0]) * rng.integers(2, 5)
        t = np.arange(n) / RATE
        x = x / (np.std(x) + 1e-12) + rng.uniform(0.0, 0.5) * np.sin(2 * np.pi * hum_f * t)
    elif kind == "music":
        t = np.arange(n) / RATE
        beat = rng.uniform(0.35, 0.6)  # seconds per chord
        roots = 220.0 * 2 ** (rng.integers(-5, 7, size=int(duration_ms / 1000 / beat) + 2) / 12)
        x = np.zeros(n)
        for k, root in enumerate(roots):
            a, b = int(k * beat * RATE), min(n, int((k + 1) * beat * RATE))
            if a >= n:
                break
            tt = t[a:b] - t[a]
            chord = np.zeros(b - a)
            for ratio in (1.0, 1.26, 1.5):
                for h in (1, 2, 3):
                    chord += np.sin(2 * np.pi * root * ratio * h * tt) / h**1.5
            x[a:b] = chord * _env(b - a, 80, 0.4 * RATE)
    elif kind == "cough":
        m = int(rng.uniform(0.25, 0.45) * RATE)
        x = _coloured(rng, m, 2.0) * _env(m, int(0.01 * RATE), rng.uniform(0.04, 0.09) * RATE)
        if rng.random() < 0.6:  # a second, weaker bark
            k = int(rng.uniform(0.12, 0.2) * RATE)
            x[k:] += 0.6 * _coloured(rng, m - k, 2.0) * _env(m - k, 60, 0.05 * RATE)
    elif kind == "laugh":
        pulses = int(rng.integers(3, 7))
        f0 = rng.uniform(180.0, 320.0)
        period = rng.uniform(0.16, 0.24)
        m = int((pulses * period + 0.2) * RATE)
        x = np.zeros(m)
        for k in range(pulses):
            a = int(k * period * RATE)
            seg = int(0.12 * RATE)
            tt = np.arange(seg) / RATE
            voiced = sum(np.sin(2 * np.pi * f0 * h * tt) / h for h in range(1, 6))
            breathy = 0.5 * _coloured(rng, seg, 1.0) / 3
            x[a : a + seg] += (voiced + breathy) * np.hanning(seg) * (0.8 ** k)
    elif kind == "breath":
        m = int(rng.uniform(0.5, 0.9) * RATE)
        x = _coloured(rng, m, 1.0) * np.hanning(m) ** 2
    elif kind == "click":
        m = int(0.03 * RATE)
        x = np.zeros(m)
        x[4] = 1.0
        x[5:9] = -0.6
        x += 0.2 * rng.standard_normal(m) * _env(m, 1, 30)
    elif kind == "knock":
        hits = int(rng.integers(1, 4))
        gap = rng.uniform(0.12, 0.3)
        m = int((hits * gap + 0.35) * RATE)
        x = np.zeros(m)
        t = np.arange(int(0.35 * RATE)) / RATE
        for k in range(hits):
            a = int(k * gap * RATE)
            f0 = rng.uniform(60.0, 180.0)  # the panel's or the table's resonance
            thump = np.sin(2 * np.pi * f0 * t) * np.exp(-t / rng.uniform(0.02, 0.08))
            rattle = _coloured(rng, len(t), 1.5) / 4 * np.exp(-t / rng.uniform(0.01, 0.05))
            x[a : a + len(t)] += (thump + rattle) * (0.7 ** k)
    else:
        raise ValueError(f"unknown synthetic sound kind {kind!r}")
    level = active_level_dbfs(x)
    return np.asarray(x * 10 ** ((-20.0 - level) / 20), dtype=np.float64)


def burst_extent(x: Floats) -> tuple[int, int]:
    """Where a burst's envelope (5 ms RMS) is within 40 dB of its peak: ``[start, end)``."""
    win = 40
    e = np.convolve(x**2, np.ones(win) / win, mode="same")
    idx = np.flatnonzero(e >= float(np.max(e)) * 1e-4)
    return (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, len(x))


def dtmf_tone(digit: str, duration_ms: float = 100.0) -> Floats:
    """An ITU dual tone: low group at -8 dBm0, high group 2 dB louder (0 dBm0 = -3.14 dBFS RMS
    sine in G.711 mu-law), 5 ms raised-cosine edges."""
    lo, hi = DTMF_FREQS[digit]
    n = int(duration_ms * 8)
    t = np.arange(n) / RATE
    amp_lo = np.sqrt(2) * 10 ** ((-8.0 - 3.14) / 20)
    amp_hi = amp_lo * 10 ** (2 / 20)
    x = amp_lo * np.sin(2 * np.pi * lo * t) + amp_hi * np.sin(2 * np.pi * hi * t)
    edge = 40
    ramp = 0.5 - 0.5 * np.cos(np.pi * np.arange(edge) / edge)
    x[:edge] *= ramp
    x[-edge:] *= ramp[::-1]
    return np.asarray(x, dtype=np.float64)
