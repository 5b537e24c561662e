"""Echo and noise gating: is the inbound audio louder than what the bot's own echo and the line's
background noise would explain?

Why not an echo canceller: Silero is nearly level-blind, so even a well-converged linear AEC leaves
a residual that Silero still scores as speech (measured with speexdsp, see docs/bargein.md). The
gateway knows exactly which audio it played and when, so instead of subtracting the echo we
*predict its level* and ask whether the inbound level exceeds the prediction by a margin.

How the prediction works, per 8 ms hop (64 samples at 8 kHz):

* ``ref`` is the energy of the bot audio that was on the line at that hop (the playback timeline
  the gateway keeps from what it sent), ``inb`` the inbound energy.
* The echo path delay is found by correlating log energies of ``inb`` with ``ref`` delayed by every
  lag from 0 to ``max_lag_ms`` (exponentially forgetting sums, updated only while the bot talks).
  A clear peak (Pearson r >= ``lock_corr``) locks the delay; echo recordings here lock at r 0.9+,
  calls with no echo stay under 0.2.
* The echo gain (ERL) is tracked as a running median of ``inb - ref(lag)`` in dB, moving in small
  steps so the caller's speech, which is far above the median, cannot drag it up quickly.
* Until the delay locks, the prediction is the loudest ``ref`` hop in the whole lag range with a
  conservative default ERL; that keeps the first second of a call safe from echo.

A second, independent gate tracks the noise floor (a low percentile of the last two seconds of
inbound hop energies), so steady babble or kitchen noise that Silero half-believes is speech must
be exceeded by a margin too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EchoGate", "EchoGateSettings", "GateReading"]

HOP = 64  # samples per hop (8 ms at 8 kHz)
_FLOOR_DB = -100.0
_UP, _DOWN = 0.25, 0.06  # dB per hop for the echo-gain median trackers
_MAX_HOPS = 64  # hops one process() call may carry


def _db(energy: np.ndarray | float) -> np.ndarray | float:
    return 10.0 * np.log10(np.maximum(energy, 1e-10))


@dataclass(frozen=True, slots=True)
class EchoGateSettings:
    """Tuning of the echo and noise gates (see the module docstring)."""

    max_lag_ms: int = 520
    """Longest echo path delay considered (network + handset + line)."""
    lock_corr: float = 0.55
    """Correlation of inbound and delayed reference envelopes that locks the echo delay."""
    min_lock_hops: int = 40
    """Reference-active hops needed before a delay may lock (~0.3 s of bot speech)."""
    forget_s: float = 4.0
    """Time constant of the correlation sums."""
    default_erl_db: float = 12.0
    """Echo return loss assumed before the delay locks (conservative: real lines give 15-35)."""
    echo_margin_db: float = 8.0
    """Inbound must exceed the predicted echo by this much to count as the caller."""
    noise_margin_db: float = 6.0
    """Inbound must exceed the tracked noise floor by this much."""
    noise_window_s: float = 2.0
    noise_percentile: float = 50.0
    min_level_dbfs: float = -55.0
    """Absolute floor: quieter windows are never the caller barging in."""
    ref_active_dbfs: float = -45.0
    """Reference hops quieter than this carry no echo worth predicting."""
    tail_decay: float = 0.5
    """Per-hop decay of the reverberant tail added to the predicted echo."""


@dataclass(frozen=True, slots=True)
class GateReading:
    """What the gates say about one VAD window."""

    level_db: float
    """Inbound level of the window (dBFS, full-scale square wave = 0)."""
    echo_db: float
    """Predicted echo level (dBFS); -100 when the bot is silent."""
    noise_db: float
    """Tracked noise floor (dBFS)."""
    echo_locked: bool
    """The echo delay is known (aligned prediction) rather than assumed."""
    passes: bool
    """Loud enough over echo, noise and the absolute floor to be the caller."""

    @property
    def over_echo_db(self) -> float:
        return self.level_db - self.echo_db


class EchoGate:
    """Per-call echo and noise gate on the inbound track. Not thread-safe; one per call."""

    def __init__(self, settings: EchoGateSettings | None = None, *, sample_rate: int = 8000) -> None:
        self.settings = s = settings or EchoGateSettings()
        self._hop_s = HOP / sample_rate
        self._nlag = max(1, int(round(s.max_lag_ms / 1000 / self._hop_s)) + 1)
        self._lam = float(np.exp(-self._hop_s / s.forget_s))
        # Reference energy per hop: hops still to come in a dict (the gateway may send a whole
        # utterance ahead of playback), hops already passed in a ring as long as the lag range.
        self._future: dict[int, float] = {}
        self._past = np.zeros(self._nlag + _MAX_HOPS)
        self._past_db = np.full(self._nlag + _MAX_HOPS, _FLOOR_DB)
        self._active_e = 10 ** (s.ref_active_dbfs / 10)
        self._last_active = -(10**9)  # last hop whose reference was active
        self._windows = 0
        self._lags = np.arange(self._nlag)
        self._k = np.arange(_MAX_HOPS)
        self._hop = 0  # next inbound hop index
        self._tail = 0.0
        # Correlation sums per lag of log inbound (x) vs log delayed reference (y).
        n = self._nlag
        self._sw = np.zeros(n)
        self._sx = np.zeros(n)
        self._sy = np.zeros(n)
        self._sxx = np.zeros(n)
        self._syy = np.zeros(n)
        self._sxy = np.zeros(n)
        self._active_hops = 0
        self.lag_hops: int | None = None
        self.lag_corr = 0.0
        self.erl_db = s.default_erl_db  # echo gain in dB below the reference, aligned
        self._erl_max_db = s.default_erl_db  # same, against the max over all lags
        nwin = max(8, int(s.noise_window_s / self._hop_s))
        self._noise = np.zeros(nwin)
        self._noise_i = 0
        self._noise_at = 0
        self.noise_db = -70.0
        self._pending = np.zeros(0, dtype=np.float32)

    # -- the reference: what the bot played ------------------------------------------------
    def add_reference(self, start_sample: int, samples: np.ndarray) -> None:
        """Record bot audio that plays from inbound sample ``start_sample`` on."""
        n = len(samples)
        if n == 0:
            return
        sq = np.asarray(samples, dtype=np.float64) ** 2
        first = start_sample // HOP
        # Energy per hop: cumulative sums cut at the hop boundaries the chunk crosses.
        edges = np.arange(first, (start_sample + n - 1) // HOP + 2) * HOP - start_sample
        cs = np.concatenate(([0.0], np.cumsum(sq)))
        parts = np.diff(cs[np.clip(edges, 0, n)]) / HOP
        for i, e in enumerate(parts):
            h = first + i
            if h >= self._hop:
                self._future[h] = self._future.get(h, 0.0) + float(e)
            elif h > self._hop - self._nlag:
                slot = h % len(self._past)
                self._past[slot] += float(e)
                self._past_db[slot] = float(_db(self._past[slot]))
                if self._past[slot] > self._active_e:
                    self._last_active = max(self._last_active, h)

    def clear_reference_from(self, sample: int) -> None:
        """The bot's audio from ``sample`` on was cancelled (a Twilio ``clear``)."""
        h0 = -(-sample // HOP)
        for h in [h for h in self._future if h >= h0]:
            del self._future[h]

    # -- the inbound track ------------------------------------------------------------------
    def process(self, samples: np.ndarray, *, adapt: bool = True) -> GateReading:
        """Feed one VAD window of inbound audio (a multiple of the 64-sample hop, at most 64
        hops) and read the gates.

        ``adapt=False`` while the caller is known to be talking: the echo gain and noise floor
        then hold still, so the caller's own voice cannot teach the gate to ignore it.

        The window's hops are handled together (numpy over hops x lags): this runs for every
        window of every call, so it is kept to a few dozen array operations.
        """
        s = self.settings
        x = np.asarray(samples, dtype=np.float64)
        nh = min(len(x) // HOP, _MAX_HOPS)
        if nh == 0:
            return GateReading(_FLOOR_DB, _FLOOR_DB, self.noise_db, self.lag_hops is not None,
                               False)
        e_in = (x[: nh * HOP].reshape(nh, HOP) ** 2).mean(axis=1)
        x_db = _db(e_in)
        h0 = self._hop
        ring = len(self._past)
        fresh = np.array([self._future.pop(h0 + k, 0.0) for k in range(nh)])
        slots = (h0 + self._k[:nh]) % ring
        self._past[slots] = fresh
        self._past_db[slots] = _db(fresh)
        idx = (h0 + self._k[:nh, None] - self._lags[None, :]) % ring  # (hops, lags): ref[h - L]
        refs = self._past[idx]  # slots of hops before the call started hold zeros
        if self._last_active >= h0 - self._nlag:
            ref_db = self._past_db[idx]
            active = ref_db > s.ref_active_dbfs
            if fresh.max() > self._active_e:
                self._last_active = h0 + nh - 1
            # Correlation sums with forgetting, per lag, only where the delayed reference is
            # active (all hops of the window at once; their order inside 32 ms is immaterial).
            w = active.astype(np.float64)
            cnt = w.sum(axis=0)
            decay = self._lam**cnt
            wx = w * x_db[:, None]
            wy = w * ref_db
            self._sw = self._sw * decay + cnt
            self._sx = self._sx * decay + wx.sum(axis=0)
            self._sy = self._sy * decay + wy.sum(axis=0)
            self._sxx = self._sxx * decay + (wx * x_db[:, None]).sum(axis=0)
            self._syy = self._syy * decay + (wy * ref_db).sum(axis=0)
            self._sxy = self._sxy * decay + (wx * ref_db).sum(axis=0)
            self._active_hops += int(active.any(axis=1).sum())
            self._windows += 1
            if self._windows % 2 == 0:
                self._update_lag()
        elif fresh.max() > self._active_e:
            self._last_active = h0 + nh - 1

        # Reverberant tail: the aligned prediction decays instead of dropping to zero.
        pred_aligned = np.zeros(nh)
        if self.lag_hops is not None:
            tail = self._tail
            for k, aligned in enumerate(refs[:, self.lag_hops]):
                tail = max(float(aligned), tail * s.tail_decay)
                pred_aligned[k] = tail
            self._tail = tail
        pred_max = refs.max(axis=1)

        if adapt:
            self._adapt(x_db, pred_aligned, pred_max)
        self._hop = h0 + nh

        level = float(_db(e_in.mean()))
        locked = self.lag_hops is not None
        if locked:
            echo_e = float(pred_aligned.mean()) * 10 ** (-self.erl_db / 10)
        else:
            echo_e = float(pred_max.mean()) * 10 ** (-self._erl_max_db / 10)
        echo_db = float(_db(echo_e)) if echo_e > 0 else _FLOOR_DB
        passes = (
            level >= s.min_level_dbfs
            and level >= self.noise_db + s.noise_margin_db
            and level >= echo_db + s.echo_margin_db
        )
        return GateReading(level, echo_db, self.noise_db, locked, passes)

    def _adapt(self, x_db: np.ndarray, pred_aligned: np.ndarray, pred_max: np.ndarray) -> None:
        """Echo gain trackers and noise floor, from this window's hops.

        The echo gains are running medians in dB, one step per active hop, so hops far above
        the prediction (the caller) move them by one step only. They move towards "more echo"
        four times slower than towards "less echo": a caller who talks a lot must not teach the
        gate that the line is all echo.
        """
        thr = 10 ** (self.settings.ref_active_dbfs / 10)
        if self.lag_hops is not None:
            m = pred_aligned > thr
            if m.any():
                obs = _db(pred_aligned[m]) - x_db[m]  # observed ERL
                up = int((obs > self.erl_db).sum())
                self.erl_db += _UP * up - _DOWN * (int(m.sum()) - up)
        m = pred_max > thr
        if m.any():
            obs = _db(pred_max[m]) - x_db[m]
            up = int((obs > self._erl_max_db).sum())
            self._erl_max_db += _UP * up - _DOWN * (int(m.sum()) - up)
        # Noise floor: a percentile of recent hops. Echo raises it, which only makes the gate
        # more careful while the bot talks.
        n = len(self._noise)
        for v in x_db:
            self._noise[self._noise_i % n] = v
            self._noise_i += 1
        if self._noise_i - self._noise_at >= 16:
            self._noise_at = self._noise_i
            vals = self._noise[: min(self._noise_i, n)]
            if len(vals) >= 8:
                k = int(round(self.settings.noise_percentile / 100 * (len(vals) - 1)))
                self.noise_db = float(np.partition(vals, k)[k])

    def _update_lag(self) -> None:
        s = self.settings
        if self._active_hops < s.min_lock_hops:
            return
        n = np.maximum(self._sw, 1e-9)
        mx = self._sx / n
        my = self._sy / n
        vx = self._sxx / n - mx * mx
        vy = self._syy / n - my * my
        cov = self._sxy / n - mx * my
        ok = (self._sw >= s.min_lock_hops * 0.5) & (vx > 1e-6) & (vy > 1e-6)
        if not ok.any():
            return
        r = np.where(ok, cov / np.sqrt(np.maximum(vx * vy, 1e-12)), -1.0)
        best = int(np.argmax(r))
        self.lag_corr = float(r[best])
        if self.lag_corr >= s.lock_corr:
            if self.lag_hops is None:
                # Start the aligned gain from the observed median so far: the pre-lock estimate.
                self.erl_db = max(self._erl_max_db, 6.0)
            self.lag_hops = best
        elif self.lag_corr < s.lock_corr * 0.6:
            self.lag_hops = None
