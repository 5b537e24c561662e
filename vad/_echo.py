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

Two more readings serve speech that is loud enough to hear but not to pass those broadband
margins (a voice at 5 dB SNR under kitchen noise):

* ``band_snr_db``: the window's power in the upper speech band (1.5-3.4 kHz, where voiced speech
  keeps harmonics and much line noise is weak) against a per-bin noise floor, a running median
  in dB that moves 0.6 dB per window and, like the other floors, only while nobody talks;
* ``echo_free``: the bot has talked for a while (``echo_free_hops``) and its echo shows no
  correlation on this line (no lag locked, best r < ``echo_free_corr``). The broadband echo
  margin then only guards against an echo that is not there; the policy may do without it.

One more reading is for the caller classifier (``vad._policy.CallerClassifier``):

* ``echo_match``: how closely the window's spectro-temporal patch (four 32 ms frames, one per
  hop, in 16 bands) follows the bot's at the best lag in range. An echo is a filtered copy of
  the bot's audio, so it follows from the first syllable, at any loss and with no lock; a
  caller over it does not. Alone it separates nothing well enough to decide on (a caller 10 dB
  over the echo still reads 0.26-0.70, p10-p90); as an input it takes a share of the
  classifier's false stops (docs/bargein.md, session 16).

Why a bank: the gate runs on every 32 ms window of every call. Done one call at a time it is a few
dozen small numpy operations, 70-110 us per window, which at a few hundred calls is most of a core.
:class:`EchoGateBank` keeps every call's gate state in rows of shared arrays (like the VAD engine's
slot table) and reads the gates of a whole VAD batch with the same few dozen operations, so the
cost per window falls with the batch. :class:`EchoGate` is one call's gate on a bank of its own
(the same arithmetic, row for row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from audio import TELEPHONY_RATE

from ._features import hann_power

__all__ = ["EchoGate", "EchoGateBank", "EchoGateSettings", "GateReading"]

HOP = 64  # samples per hop (8 ms at 8 kHz)
_FLOOR_DB = -100.0
_UP, _DOWN = 0.25, 0.06  # dB per hop for the echo-gain median trackers
_MAX_HOPS = 64  # hops one window may carry
_RING = 512  # reference hops kept per row (4 s): the lag range behind, what was sent ahead
_INB = 128  # inbound hops kept per row (the envelope fit's history; a power of two)
# follow_corr: the inbound hops it reads (320 ms: over 160 ms a caller's envelope matched the
# would-be audio by chance for 5-8 windows running at 4 of 32 pause times), how many of them
# must be active, and how long after the real echo's delay its tail may still be on the line.
_FOLLOW_HOPS = 40
_FOLLOW_MIN_HOPS = 20
_DRAIN_HOPS = 10
# follow_locked_hops: the copy's delay is read on the echo before the caller's onset (a pause
# comes 64-200 ms after it); a lock the echo follows there is kept (the peak of an echo with a
# long tail is broad: on 6 dB train lines the best of nine lags was 2-3 hops off one that
# followed at 0.87-0.91, and read in the pause under 0.85 where the lock read 0.9), another
# delay is taken only where that echo followed the bot at all.
_REFINE_BACK_HOPS = 16
_LOCK_FOLLOWS = 0.8
_REFINE_MIN_CORR = 0.5
# The envelope fit's bands (Hz): a filtered echo path scales each band by its own gain, so a
# broadband envelope is no copy of the bot's (measured: at the true lag of a 6 dB ERL line the
# inbound-to-bot energy ratio swings 12 dB in 100 ms as the bot's spectrum moves).
_EXPLAIN_BANDS = ((250.0, 700.0), (700.0, 1300.0), (1300.0, 2200.0), (2200.0, 3500.0))
# echo_match: 32 ms Hann frames, one per 8 ms hop, read in 16 log-spaced bands; each stream's
# band levels less their running mean (weight 0.01 per loud hop: ~0.8 s), compared as a patch of
# the last four frames (the window's hops) with the bot's at every lag in range. The frame size,
# the bands, the centring and the patch were chosen offline on the train split's windows (the
# classifier's held-out log-loss, two halves: 0.101/0.124 without the reading; 0.084/0.101 with
# uncentred levels; 0.084/0.105 with 8 ms frames in 12 bands; 0.079/0.094 as here).
_MATCH_N = 256
_MATCH_HOPS = 4
_MATCH_BANDS = 16
_MATCH_ALPHA = 0.01
_MATCH_LOUD_DB = -50.0  # frames louder than this move their stream's running mean
_MATCH_RANGE_DB = 30.0  # lags whose bot frame is this far under the loudest in range: not read
_MATCH_MIN_DB = -55.0  # no bot frame in range this loud: no reading (0)
_MASK = _RING - 1  # a power of two: ``h & _MASK`` is ``h % _RING``, negative hops included
_INITIAL_ROWS = 16

Floats = npt.NDArray[np.float64]


def _band_masks(freqs: npt.NDArray[np.floating[Any]], bands: list[tuple[float, float]]) -> Floats:
    """(bins, bands): 1 where a spectrum's bin at ``freqs`` falls in a band [lo, hi), else 0."""
    return np.stack([((freqs >= lo) & (freqs < hi)).astype(np.float64) for lo, hi in bands],
                    axis=1)


def _db(energy: Floats) -> Floats:
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
    echo_free_corr: float = 0.4
    """Best lag correlation below which a line that never locked an echo delay counts as
    carrying no echo of the bot ..."""
    echo_free_hops: int = 150
    """... once this many bot-active hops have been heard (1.2 s of bot speech). Echo lines
    here lock at r 0.6-0.97 within ~0.3 s of bot audio; echo-free lines stay under 0.35."""
    echo_line_s: float = 2.0
    """An echo delay held this long (in all) marks the line as carrying echo for the call."""
    band_lo_hz: float = 1500.0
    band_hi_hz: float = 3400.0
    """The band of ``band_snr_db``."""
    band_step_db: float = 0.6
    """How far the band's per-bin noise floor moves per window (a running median in dB)."""
    explain_ms: int = 192
    """History over which ``unexplained_db`` fits the bot's lagged envelope to the inbound one
    (the window itself included): long enough for a syllable or two of the bot's speech to pin
    a lag, short enough that a caller's first words are most of it."""
    explain_erl_db: float = 6.0
    """The strongest echo that fit may assume (the issue's worst plausible path: loss 6 dB)."""
    follow_unlocked_hops: int | None = 2
    """A ghost copy (a paused utterance's would-be audio) whose delay never locked finds its
    own: it reads ``follow_corr`` at every lag of the range this many hops apart and reports it
    at the lag that followed best over its windows so far. A pause early in the bot's first
    turn, before any delay could lock, then still tells a line that goes on playing the bot
    (``BargeInSettings.pause_echo_corr``). Check split, two seeds, both grids (session 20,
    docs/bargein.md): on a line that obeys the clear (closed loop) every call the same; replayed
    open loop, one echo-only false interrupt fewer (a first-turn echo at 6 dB committed 1.5 s
    after its pause), every other verdict the same, the pauses of six calls moved. None: such a
    copy reads none (``follow_corr`` 0)."""
    follow_locked_hops: int | None = 4
    """A ghost copy forked from a row whose delay locked, where the inbound's envelope did not
    follow the bot's at the lock over the stretch before the caller's onset (ending 128 ms
    before the pause, as far back as the reference is kept: ~400 ms at a 150 ms delay; r <
    0.8), takes the delay within this many hops of the lock where it followed best (if r >=
    0.5 there). The gate's lock can sit a few hops off the echo's delay (check
    split: 16 hops for an echo at 19; train, 174 first pauses: 2 hops off on 13, 4 on one), and
    ``follow_corr`` reads 8 ms hops: three or four hops off, an echo going on follows on 0-11 %
    of its windows against all of them at the right delay (tests/vad/test_gate.py). A lock
    that did follow is kept: on 6 dB train lines the best of the nine lags was 2-3 hops off a
    lock that followed at 0.87-0.91, and in the pause it read under 0.85 where the lock read
    0.9 (two echo-only false interrupts, session 21). None or 0: the lock as it is."""
    follow_search_locked: bool = True
    """A copy forked from a row whose delay locked also searches the lag range as one with no
    lock does (``follow_unlocked_hops``) and reads the better of the two. The echo path can
    move at the caller's onset (the simulator's delay changes: 450 -> 200 ms, 0 -> 250 ms), or
    between two turns, after the lock was last read, and the copy then reads ``follow_corr``
    at a delay the echo going on no longer has: an echo replayed through a pause counted as the
    caller (session 24, docs/bargein.md: open loop, train `mixed` false interrupts 20 -> 10,
    check `mixed` 22 -> 13, echo-only 8 -> 5; on a line that obeys the clear every detection
    the same, and 0-3 more barge-ins resumed over a cell, where a caller's envelope follows
    some lag of the range by chance). False: the lock alone."""


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
    echo_free: bool = False
    """The bot has talked long enough to tell, and its echo is not heard on this line."""
    band_snr_db: float = 0.0
    """Power in the upper speech band over that band's noise floor (dB; 0 until known)."""
    ref_db: float = -100.0
    """The loudest bot audio played in the window's lag range (0 to ``max_lag_ms`` back), per
    hop, averaged over the window (dBFS): the worst-case echo before any loss is assumed."""
    erl_db: float = 0.0
    """The echo return loss the prediction used (dB): the locked path's, else the pre-lock one."""
    echo_corr: float = 1.0
    """The best lag correlation of inbound and bot audio envelopes so far; 1 (assume echo)
    until ``min_lock_hops`` of bot audio have been heard."""
    unexplained_db: float = -100.0
    """The part of the window's inbound energy that no delayed copy of the bot's audio explains
    (dBFS): per 8 ms hop, the inbound energy over ``explain_ms`` is fitted, at every lag in
    range, by the bot's energy there times a gain (least squares, loss at least
    ``explain_erl_db``); at the best lag, what is left over in this window's hops. The echo is
    a delayed, attenuated copy of what the bot played, so it is explained from the first
    window, before any delay lock or canceller convergence; a caller's envelope is not. Equals
    ``level_db`` where no bot audio is in the lag range."""
    prior_echo_db: float = -100.0
    """The window's echo as the line's 160 ms before it predict it (dBFS; the ``explain_ms``
    span that ends with the window, less the window's own 32 ms): the same per-band fit as
    ``unexplained_db``, on the hops before the window only, at the lag that fits them best,
    applied to the bot's audio at the window. It follows a path that has changed (a new delay
    or loss: the fit looks at every lag and learns the loss from those 160 ms), which the
    locked lag and the slow echo-gain median do not for seconds; a caller's first window is not
    in the history it is fitted on. -100 where no bot audio is in range, or none in the
    history's reach."""
    prior_fit: float = 0.0
    """How well that fit explains the hops it was fitted on: the share of their squared band
    energies it accounts for (0-1). Near 1 when the line's last 160 ms were the bot's echo
    alone, at whatever delay and loss; low when a caller (or a background) is in them."""
    follow_corr: float = 0.0
    """Read on a ghost copy only (``EchoGateBank.fork_row``: the bot's audio as if a pause had
    not cleared it): how the inbound follows that audio at the copy's locked delay,
    as the Pearson correlation of their 8 ms log energies over the last 320 ms, on the hops
    where the reference is active and the echo of what the bot did play has drained (one delay
    and 80 ms after the fork); 0 with fewer than 20 such hops (160 ms), or no lock.
    Near 1 when the line still carries the bot; a caller's voice does not follow it."""
    echo_match: float = 0.0
    """How much the window sounds like the bot's audio at some lag in range: the Pearson
    correlation of their spectro-temporal patches (the four 32 ms frames that end at the
    window's four hops, 56 ms of audio, in 16 log-spaced bands from 250 Hz to 3.4 kHz, each
    stream's band levels less their running mean), the best over every lag whose bot frame
    (the patch's newest) is within 30 dB of the loudest in range. An echo is a filtered copy of
    the bot, so its patch follows the bot's at the echo's delay at any loss, from the first
    syllable and with no lock (train split: 0.81/0.91/0.96 at p10/p50/p90 of echo-dominated
    windows); a caller as loud as the echo pulls it down (0.46/0.69/0.85), one 10 dB over it
    further (0.26/0.48/0.70). 0 where no bot frame in range reaches -55 dB on the frames' own
    scale (about 1.25 dB under their mean square), or no hop in range is active bot audio
    (``ref_active_dbfs``). Where the bot starts after a quiet stretch, the lags whose patch
    begins before its first hop read those older frames as level with the mean (zero), not as
    the ring's last lap left them (session 16's review found that; fixed in session 17)."""

    @property
    def over_echo_db(self) -> float:
        return self.level_db - self.echo_db


class EchoGateBank:
    """The echo and noise gates of many calls with the same settings, one row per call.

    Rows are handed out by :meth:`open_row` and returned by :meth:`close_row`; :meth:`process`
    reads the gates of any set of distinct rows, one window each, in one pass. Reference audio
    (what the bot played) is kept as energy per hop in a ring of ``_RING`` hops per row: the lag
    range behind the inbound clock and up to ~3.4 s ahead of it (the gateway sends at most its
    playback lead, 240 ms, ahead). Not thread-safe.
    """

    # Per-row state, one row per call (allocated and reset from _row_state).
    _ref: Floats
    _ref_db: Floats
    _hop: npt.NDArray[np.int64]
    _last_active: npt.NDArray[np.int64]
    _windows: npt.NDArray[np.int64]
    _active_hops: npt.NDArray[np.int64]
    _sums: Floats
    _lag: npt.NDArray[np.int64]
    _locked_hops: npt.NDArray[np.int64]
    _lag_corr: Floats
    _erl: Floats
    _erl_max: Floats
    _tail: Floats
    _noise: Floats
    _noise_i: npt.NDArray[np.int64]
    _noise_at: npt.NDArray[np.int64]
    _noise_db: Floats
    _floor: Floats
    _floor_set: npt.NDArray[np.bool_]
    _refb: Floats
    _inbb: Floats
    _ghost: npt.NDArray[np.bool_]
    _ghost_from: npt.NDArray[np.int64]
    _ghost_lagsum: Floats
    _refw: npt.NDArray[np.float32]
    _refm: Floats
    _refm_db: Floats
    _inbw: Floats
    _inbm: Floats
    _mean_in: Floats
    _mean_ref: Floats
    _mean_in_set: npt.NDArray[np.bool_]
    _mean_ref_set: npt.NDArray[np.bool_]

    def __init__(self, settings: EchoGateSettings | None = None, *, sample_rate: int = TELEPHONY_RATE) -> None:
        self.settings = s = settings or EchoGateSettings()
        self._hop_s = HOP / sample_rate
        self._nlag = max(1, int(round(s.max_lag_ms / 1000 / self._hop_s)) + 1)
        self._kx = max(1, int(round(s.explain_ms / 1000 / self._hop_s)))  # fit history, hops
        if self._kx + _MAX_HOPS > _INB:
            raise ValueError(f"explain_ms {s.explain_ms} is too long for the inbound ring")
        self._gmax = 10 ** (-s.explain_erl_db / 10)
        self._xoffsets: dict[int, npt.NDArray[np.int64]] = {}
        hop_freqs = np.fft.rfftfreq(HOP, 1 / sample_rate)
        # (bins, bands): band energies of a hop's spectrum, in mean-square units (one-sided
        # interior bins count twice: Parseval over the 64-sample hop).
        self._bandsum = _band_masks(hop_freqs, list(_EXPLAIN_BANDS)) * (2.0 / HOP**2)
        if self._nlag + self._kx + 2 * _MAX_HOPS >= _RING:
            raise ValueError(f"max_lag_ms {s.max_lag_ms} is too long for the reference ring")
        self._lam = float(np.exp(-self._hop_s / s.forget_s))
        self._active_e = 10 ** (s.ref_active_dbfs / 10)
        self._lags = np.arange(self._nlag)
        self._offsets: dict[int, npt.NDArray[np.int64]] = {}  # nh -> (nh, nlag) hop offsets
        self._nwin = max(8, int(s.noise_window_s / self._hop_s))
        self._echo_line_hops = int(round(s.echo_line_s / self._hop_s))
        freqs = np.fft.rfftfreq(256, 1 / sample_rate)
        edges = np.geomspace(250.0, 3400.0, _MATCH_BANDS + 1).tolist()
        self._match_bands = _band_masks(freqs, list(zip(edges[:-1], edges[1:], strict=True)))
        self._match_hann = np.hanning(_MATCH_N)
        self._band = np.flatnonzero((freqs >= s.band_lo_hz) & (freqs <= s.band_hi_hz))
        self._free: list[int] = []
        self._rows = 0
        self._alloc(_INITIAL_ROWS)

    # -- rows --------------------------------------------------------------------------------
    def _row_state(self) -> list[tuple[str, tuple[int, ...], float, type]]:
        """Every per-row array: (attribute, shape of a row, a new call's value, dtype)."""
        s, f64, i64 = self.settings, np.float64, np.int64
        return [
            ("_ref", (_RING,), 0.0, f64),  # reference energy per hop
            # ... and in dB, kept in step with _ref: the correlation reads it every window, and
            # a log per hop per lag per window was the gate's dearest operation.
            ("_ref_db", (_RING,), _FLOOR_DB, f64),
            ("_hop", (), 0, i64),  # next inbound hop
            ("_last_active", (), -(10**9), i64),
            ("_windows", (), 0, i64),
            ("_active_hops", (), 0, i64),
            ("_sums", (6, self._nlag), 0.0, f64),  # w, x, y, xx, yy, xy per lag
            ("_lag", (), -1, i64),  # locked lag in hops, -1: none
            ("_locked_hops", (), 0, i64),  # hops heard while locked
            ("_lag_corr", (), 0.0, f64),
            ("_erl", (), s.default_erl_db, f64),
            ("_erl_max", (), s.default_erl_db, f64),
            ("_tail", (), 0.0, f64),
            ("_noise", (self._nwin,), 0.0, f64),
            ("_noise_i", (), 0, i64),
            ("_noise_at", (), 0, i64),
            ("_noise_db", (), -70.0, f64),
            ("_floor", (len(self._band),), 0.0, f64),  # the band's floor per bin, dB
            ("_floor_set", (), False, np.bool_),
            ("_refb", (_RING, len(_EXPLAIN_BANDS)), 0.0, f64),  # reference energy per hop, band
            ("_inbb", (_INB, len(_EXPLAIN_BANDS)), 0.0, f64),  # inbound energy per hop, band
            # A copy read through a pause (fork_row): its delay lock stands still, and it
            # reports how the inbound follows its reference at that delay (follow_corr).
            ("_ghost", (), False, np.bool_),
            ("_ghost_from", (), 0, i64),  # the first inbound hop follow_corr reads
            ("_ghost_lagsum", (self._nlag,), 0.0, f64),  # follow_corr per lag, summed
            # echo_match: the bot's waveform per hop (its frames straddle hops and chunks), its
            # centred band levels and frame level per hop, the inbound's last three hops and
            # centred levels of its last frames, and each stream's running mean per band.
            ("_refw", (_RING, HOP), 0.0, np.float32),
            ("_refm", (_RING, _MATCH_BANDS), 0.0, f64),
            ("_refm_db", (_RING,), _FLOOR_DB, f64),
            ("_inbw", (_MATCH_N - HOP,), 0.0, f64),
            ("_inbm", (_MATCH_HOPS, _MATCH_BANDS), 0.0, f64),
            ("_mean_in", (_MATCH_BANDS,), 0.0, f64),
            ("_mean_ref", (_MATCH_BANDS,), 0.0, f64),
            ("_mean_in_set", (), False, np.bool_),
            ("_mean_ref_set", (), False, np.bool_),
        ]

    def _alloc(self, rows: int) -> None:
        old = self._rows
        for name, shape, fill, dtype in self._row_state():
            grown: npt.NDArray[np.generic] = np.full((rows, *shape), fill, dtype=dtype)
            if old:
                grown[:old] = getattr(self, name)
            setattr(self, name, grown)
        self._free.extend(range(rows - 1, old - 1, -1))
        self._rows = rows

    def _reset(self, row: int) -> None:
        for name, _, fill, _ in self._row_state():
            getattr(self, name)[row] = fill

    def open_row(self) -> int:
        """A fresh row (a new call's gate)."""
        if not self._free:
            self._alloc(self._rows * 2)
        row = self._free.pop()
        self._reset(row)
        return row

    def fork_row(self, row: int, *, lag_hops: int | None = None) -> int:
        """A new row that starts as a copy of ``row``: its reference, inbound history, delay
        lock, echo gain and floors. The gateway reads the bot's audio as a line deaf to the
        clear plays it on such a copy from a pause on (``VadStream.fork_ghost``). Its delay
        lock is ``row``'s as ``follow_locked_hops`` refines it, or ``lag_hops`` if given (-1:
        none). Its ``follow_corr`` reads only inbound hops from one delay and the echo's tail
        after the fork on: the ones before may still hold the echo of what the bot did play,
        which the copy's reference holds too."""
        if not self._free:
            self._alloc(self._rows * 2)
        new = self._free.pop()
        for name, *_ in self._row_state():
            array = getattr(self, name)
            array[new] = array[row]
        self._ghost[new] = True
        if lag_hops is not None:
            self._lag[new] = lag_hops
        elif self._lag[new] >= 0 and self.settings.follow_locked_hops:
            self._lag[new] = self._refined_lag(new)
        self._ghost_from[new] = self._hop[new] + max(int(self._lag[new]), 0) + _DRAIN_HOPS
        return new

    def _refined_lag(self, row: int) -> int:
        """``follow_locked_hops``: ``row``'s lock, unless over the inbound hops before the
        caller's onset (to ``_REFINE_BACK_HOPS`` before now, as far back as every candidate's
        reference is still kept: ~400 ms at a 150 ms delay) the inbound did not follow the
        bot's audio there (r < ``_LOCK_FOLLOWS``): then the delay near it where it followed
        best, if it followed there at all (r >= ``_REFINE_MIN_CORR``). Where the lock cannot be
        read (too few hops of bot audio: a long delay, the bot's first words), the lock."""
        near = self.settings.follow_locked_hops or 0
        lock = int(self._lag[row])
        at = np.clip(lock + np.arange(-near, near + 1), 0, self._nlag - 1)
        # Reference hops behind the lag range and the fit's history are zeroed (``process``):
        # every candidate reads the same inbound hops, all of whose reference is kept.
        k = min(_INB, self._nlag - 1 + self._kx - int(at.max())) - _REFINE_BACK_HOPS
        if k < _FOLLOW_MIN_HOPS:
            return lock
        rows = np.array([row])
        r = self._follow(rows, self._hop[rows] - _REFINE_BACK_HOPS, at[None, :], k,
                         every_hop=True)[0]
        best = int(np.argmax(r))
        if r[near] == 0.0 or r[near] >= _LOCK_FOLLOWS or r[best] < _REFINE_MIN_CORR:
            return lock  # unreadable there, or it followed, or nothing near it did
        return int(at[best])

    def close_row(self, row: int) -> None:
        self._free.append(row)

    @property
    def open_rows(self) -> int:
        return self._rows - len(self._free)

    # -- per-row views (for logs and tests) ---------------------------------------------------
    def lag_hops(self, row: int) -> int | None:
        lag = int(self._lag[row])
        return None if lag < 0 else lag

    def lag_corr(self, row: int) -> float:
        return float(self._lag_corr[row])

    def erl_db(self, row: int) -> float:
        return float(self._erl[row])

    def noise_db(self, row: int) -> float:
        return float(self._noise_db[row])

    # -- the reference: what the bot played ------------------------------------------------
    def add_reference(self, row: int, start_sample: int, samples: np.ndarray) -> None:
        """Record bot audio that plays on ``row``'s line from inbound sample ``start_sample`` on.

        Audio older than the lag range is of no use and ignored; audio more than the ring ahead
        of the inbound clock is cut off there (a caller of the gateway never sends that far)."""
        n = len(samples)
        if n == 0:
            return
        # Energy per hop: the squares laid out from the first hop boundary, summed per hop.
        first = start_sample // HOP
        off = start_sample - first * HOP
        nparts = (off + n + HOP - 1) // HOP
        sq = np.zeros(nparts * HOP)
        x = np.asarray(samples, dtype=np.float64)
        np.multiply(x, x, out=sq[off : off + n])
        parts = sq.reshape(nparts, HOP).sum(axis=1) / HOP
        if off == 0 and n == nparts * HOP:  # whole hops (most 40 ms chunks): no padding
            laid = x
        else:
            laid = np.zeros(nparts * HOP)
            laid[off : off + n] = x
        bands = self._hop_bands(laid.reshape(nparts, HOP))  # (nparts, bands)
        hop = int(self._hop[row])
        lo = max(first, hop - self._nlag + 1)  # older hops can no longer be read
        hi = min(first + nparts, hop + _RING - self._nlag - self._kx - _MAX_HOPS)
        if hi <= lo:
            return
        parts = parts[lo - first : hi - first]
        bands = bands[lo - first : hi - first]
        self._refw[row, np.arange(lo, hi) & _MASK] += laid.reshape(nparts, HOP)[lo - first : hi - first]
        ref, ref_db, refb = self._ref[row], self._ref_db[row], self._refb[row]
        a, b = lo & _MASK, hi & _MASK
        if a < b:
            refb[a:b] += bands
            ref[a:b] += parts
            ref_db[a:b] = _db(ref[a:b])
        else:  # the span wraps around the ring's end
            refb[a:] += bands[: _RING - a]
            refb[:b] += bands[_RING - a :]
            ref[a:] += parts[: _RING - a]
            ref[:b] += parts[_RING - a :]
            ref_db[a:] = _db(ref[a:])
            ref_db[:b] = _db(ref[:b])
        if lo < hop:  # late audio for hops already passed: they count as active from now on
            pos = np.arange(lo, hop) & _MASK
            active = np.flatnonzero(ref[pos] > self._active_e)
            if len(active):
                self._last_active[row] = max(int(self._last_active[row]), lo + int(active[-1]))

    def clear_reference_from(self, row: int, sample: int) -> None:
        """The bot's audio from ``sample`` on was cancelled (a Twilio ``clear``)."""
        hop = int(self._hop[row])
        h0 = max(-(-sample // HOP), hop)
        hi = hop + _RING - self._nlag - self._kx - _MAX_HOPS
        if h0 < hi:
            pos = np.arange(h0, hi) & _MASK
            self._ref[row, pos] = 0.0
            self._ref_db[row, pos] = _FLOOR_DB
            self._refb[row, pos] = 0.0
            self._refw[row, pos] = 0.0

    # -- the inbound track ------------------------------------------------------------------
    def process(self, rows: npt.NDArray[np.intp], windows: np.ndarray,
                adapt: npt.NDArray[np.bool_], spectrum: Floats | None = None) -> list[GateReading]:
        """Read the gates of distinct ``rows``, one window each (``windows``: rows x samples, a
        multiple of the 64-sample hop, at most 64 hops).

        ``adapt[i]`` False while row i's caller is known to be talking: its echo gain and noise
        floors then hold still, so the caller's own voice cannot teach the gate to ignore it.
        ``spectrum``: :func:`hann_power` of ``windows`` if the caller has it already.
        """
        s = self.settings
        b = len(rows)
        x = np.asarray(windows, dtype=np.float64)
        nh = min(x.shape[1] // HOP, _MAX_HOPS)
        if b == 0:
            return []
        if nh == 0:
            return [GateReading(_FLOOR_DB, _FLOOR_DB, float(self._noise_db[r]),
                                bool(self._lag[r] >= 0), False) for r in rows]
        nlag = self._nlag
        e_in = (x[:, : nh * HOP].reshape(b, nh, HOP) ** 2).mean(axis=2)  # (b, nh)
        x_db = _db(e_in)
        h0 = self._hop[rows]  # (b,)
        offsets = self._offsets.get(nh)
        if offsets is None:
            offsets = self._offsets[nh] = np.arange(nh)[:, None] - self._lags[None, :]
        # refs[i, j, L]: reference energy of hop h0 + j - L of row i (flat ring indices).
        idx = ((h0 & _MASK)[:, None, None] + offsets) & _MASK
        idx += (rows * _RING)[:, None, None]
        refs = self._ref.reshape(-1).take(idx)  # (b, nh, nlag)
        fresh = refs[:, :, 0]  # (b, nh): this window's own hops
        fresh_active = fresh.max(axis=1) > self._active_e  # (b,)

        corr = self._last_active[rows] >= h0 - nlag  # rows whose lag range holds bot audio
        if corr.any():
            c = np.flatnonzero(corr)
            cr = rows[c]
            ref_db = self._ref_db.reshape(-1).take(idx[c])  # (c, nh, nlag), = _db(refs[c])
            active = ref_db > s.ref_active_dbfs
            # Correlation sums with forgetting, per lag, only where the delayed reference is
            # active (all hops of the window at once; their order inside 32 ms is immaterial).
            w = active.astype(np.float64)  # (c, nh, nlag)
            wy = w * ref_db
            # The window's hops summed per lag as small matrix products (one call each):
            # [1, x, x^2] @ w -> count, sum x, sum x^2;  [1, x] @ w*y -> sum y, sum x*y.
            xd = x_db[c]  # (c, nh)
            ones = np.ones_like(xd)
            m1 = np.matmul(np.stack([ones, xd, xd * xd], axis=1), w)  # (c, 3, nlag)
            m2 = np.matmul(np.stack([ones, xd], axis=1), wy)  # (c, 2, nlag)
            cnt = m1[:, 0]
            decay = self._lam**cnt
            add = np.stack([cnt, m1[:, 1], m2[:, 0], m1[:, 2], (wy * ref_db).sum(axis=1),
                            m2[:, 1]], axis=1)  # w, x, y, xx, yy, xy: the layout of _sums
            self._sums[cr] = self._sums[cr] * decay[:, None, :] + add
            self._active_hops[cr] += active.any(axis=2).sum(axis=1)
            self._windows[cr] += 1
            due = (self._windows[cr] % 2 == 0) & ~self._ghost[cr]
            if due.any():
                self._update_lag(cr[due])
        self._last_active[rows] = np.where(fresh_active, h0 + nh - 1, self._last_active[rows])

        # Reverberant tail: the aligned prediction decays instead of dropping to zero.
        lag = self._lag[rows]
        locked = lag >= 0
        pred_aligned = np.zeros((b, nh))
        if locked.any():
            li = np.flatnonzero(locked)
            aligned = refs[li, :, lag[li]]  # (l, nh), a copy: the tails are written over it
            tail = self._tail[rows[li]]
            for j in range(nh):
                tail = aligned[:, j] = np.maximum(aligned[:, j], tail * s.tail_decay)
            pred_aligned[li] = aligned
            self._tail[rows[li]] = tail
        pred_max = refs.max(axis=2)  # (b, nh)

        if adapt.any():
            self._adapt(rows, np.flatnonzero(adapt), x_db, pred_aligned, pred_max, locked)
        self._hop[rows] = h0 + nh
        # The envelope fit (``unexplained_db``) reads this window's inbound hops with the ones
        # before it, and the reference up to ``_kx`` hops further back than the lag range.
        inb_pos = (((h0[:, None] + np.arange(nh)[None, :]) & (_INB - 1))
                   + (rows * _INB)[:, None])
        self._inbb.reshape(-1, len(_EXPLAIN_BANDS))[inb_pos] = self._hop_bands(
            x[:, : nh * HOP].reshape(b * nh, HOP)).reshape(b, nh, -1)
        unexplained = e_in.mean(axis=1)  # no bot audio in range: nothing of it is explained
        prior, prior_fit = np.zeros(b), np.zeros(b)
        if corr.any():
            c = np.flatnonzero(corr)
            unexplained[c], prior[c], prior_fit[c] = self._unexplained(rows[c], h0[c], nh)
        match = self._match(rows, x, h0, nh, corr | fresh_active)
        follow = np.zeros(b)
        ghost = self._ghost[rows]
        haunted = np.flatnonzero(ghost & locked)
        if len(haunted):
            follow[haunted] = self._follow(rows[haunted], h0[haunted] + nh, lag[haunted])
        step = self.settings.follow_unlocked_hops
        # A locked copy searches too (follow_search_locked): the path may have moved since.
        searched = np.flatnonzero(ghost & (~locked | self.settings.follow_search_locked))
        if step is not None and len(searched):
            at = np.arange(0, self._nlag, step)
            r = self._follow(rows[searched], h0[searched] + nh, np.tile(at, (len(searched), 1)))
            # Read at the lag the windows before this one followed best, summed since the fork:
            # the best lag of each window alone finds some lag that a caller's envelope
            # follows by chance on 30 % of their windows (r >= 0.85; 2 % read so, as at a
            # locked delay), the echo going on at its own lag on 95-100 % either way.
            seen = self._ghost_lagsum[rows[searched][:, None], at[None, :]]
            pick = np.argmax(seen, axis=1)
            picked = np.where(seen.max(axis=1) > 0.0, r[np.arange(len(searched)), pick], 0.0)
            at_lock = follow[searched]  # a locked copy's reading at its lock (0 with none)
            follow[searched] = np.where(locked[searched], np.maximum(at_lock, picked), picked)
            self._ghost_lagsum[rows[searched][:, None], at[None, :]] = seen + r
        # Hops now behind the lag range and the fit's history: zero them for the ring's next lap.
        gone = (((h0[:, None] + np.arange(nh)[None, :] - (nlag - 1) - self._kx) & _MASK)
                + (rows * _RING)[:, None])
        self._ref.reshape(-1)[gone] = 0.0
        self._ref_db.reshape(-1)[gone] = _FLOOR_DB
        self._refb.reshape(-1, len(_EXPLAIN_BANDS))[gone] = 0.0
        self._refw.reshape(-1, HOP)[gone] = 0.0

        band_snr = self._band_snr(rows, x, adapt, spectrum)
        # A line that held an echo delay for echo_line_s carries echo for good: the lock can
        # lapse while the caller talks over the bot, the echo path does not. (Spurious locks
        # on echo-free lines here last 0.06-1.3 s; echo lines hold theirs until the caller talks.)
        self._locked_hops[rows] += np.where(locked, nh, 0)
        echo_free = ((lag < 0) & (self._locked_hops[rows] < self._echo_line_hops)
                     & (self._lag_corr[rows] < s.echo_free_corr)
                     & (self._active_hops[rows] >= s.echo_free_hops))
        level = _db(e_in.mean(axis=1))
        erl = np.where(locked, self._erl[rows], self._erl_max[rows])
        pred = np.where(locked, pred_aligned.mean(axis=1), pred_max.mean(axis=1))
        echo_e = pred * 10 ** (-erl / 10)
        echo_db = np.where(echo_e > 0, _db(echo_e), _FLOOR_DB)
        noise_db = self._noise_db[rows]
        passes = (
            (level >= s.min_level_dbfs)
            & (level >= noise_db + s.noise_margin_db)
            & (level >= echo_db + s.echo_margin_db)
        )
        corr_known = self._active_hops[rows] >= s.min_lock_hops
        echo_corr = np.where(corr_known, self._lag_corr[rows], 1.0)
        pmax = pred_max.mean(axis=1)
        ref_db = np.where(pmax > 0, _db(pmax), _FLOOR_DB)
        unexplained_db = np.where(unexplained > 0, _db(unexplained), _FLOOR_DB)
        prior_db = np.where(prior > 0, _db(prior), _FLOOR_DB)
        return [GateReading(*t) for t in zip(level.tolist(), echo_db.tolist(), noise_db.tolist(),
                                             locked.tolist(), passes.tolist(),
                                             echo_free.tolist(), band_snr.tolist(),
                                             ref_db.tolist(), erl.tolist(),
                                             echo_corr.tolist(), unexplained_db.tolist(),
                                             prior_db.tolist(), prior_fit.tolist(),
                                             follow.tolist(), match.tolist(), strict=True)]

    def _match_levels(self, frames: Floats, mean: Floats,
                      known: npt.NDArray[np.bool_]) -> tuple[Floats, Floats]:
        """Centred band levels and frame levels (dB) of ``frames`` (rows, frames, 256), oldest
        first; ``mean`` and ``known`` (rows' running means per band, and whether set) are
        updated in place, frame by frame, where the frame is loud enough."""
        spec = np.fft.rfft(frames * self._match_hann, axis=2)
        power: Floats = spec.real**2 + spec.imag**2
        bands = _db(power @ self._match_bands)  # (r, f, bands)
        level = _db(power.sum(axis=2) / (_MATCH_N * _MATCH_N / 4))  # (r, f)
        centred = np.empty_like(bands)
        for j in range(frames.shape[1]):
            loud = level[:, j] > _MATCH_LOUD_DB
            moved = np.where(known[:, None], (1.0 - _MATCH_ALPHA) * mean + _MATCH_ALPHA * bands[:, j],
                             bands[:, j])
            mean[:] = np.where(loud[:, None], moved, mean)
            known |= loud
            centred[:, j] = bands[:, j] - np.where(
                known[:, None], mean, bands[:, j].mean(axis=1, keepdims=True))
        return centred, level

    def _match(self, rows: npt.NDArray[np.intp], x: Floats, h0: npt.NDArray[np.int64], nh: int,
               bot: npt.NDArray[np.bool_]) -> Floats:
        """``GateReading.echo_match`` of ``rows`` for this window (``x``, ``nh`` hops from
        ``h0``); ``bot``: the rows with bot audio in the lag range or in this window."""
        b = len(rows)
        wave = np.concatenate([self._inbw[rows], x[:, : nh * HOP]], axis=1)
        self._inbw[rows] = wave[:, nh * HOP :]
        frames = np.lib.stride_tricks.sliding_window_view(wave, _MATCH_N, axis=1)[:, ::HOP]
        mean, known = self._mean_in[rows], self._mean_in_set[rows]
        centred, _ = self._match_levels(frames, mean, known)
        self._mean_in[rows], self._mean_in_set[rows] = mean, known
        inb = np.concatenate([self._inbm[rows], centred], axis=1)[:, -_MATCH_HOPS:]
        self._inbm[rows] = inb
        hops = h0[:, None] + np.arange(nh)[None, :]  # (b, nh): the window's hops
        out = np.zeros(b)
        quiet = np.flatnonzero(~bot)
        if len(quiet):  # no bot audio: no bot frame to read here (a ring lap ago's is stale)
            stale = (rows[quiet, None], hops[quiet] & _MASK)
            self._refm_db[stale] = _FLOOR_DB
            self._refm[stale] = 0.0
        c = np.flatnonzero(bot)
        if len(c) == 0:
            return out
        cr = rows[c]
        # The bot's frame of each hop: its waveform from three hops before to the hop.
        at = (hops[c][:, :, None] + np.arange(-(_MATCH_HOPS - 1), 1)[None, None, :]) & _MASK
        ref_frames = self._refw[cr[:, None, None], at].reshape(len(c), nh, _MATCH_N)
        mean, known = self._mean_ref[cr], self._mean_ref_set[cr]
        centred, level = self._match_levels(ref_frames.astype(np.float64), mean, known)
        self._mean_ref[cr], self._mean_ref_set[cr] = mean, known
        self._refm[cr[:, None], hops[c] & _MASK] = centred
        self._refm_db[cr[:, None], hops[c] & _MASK] = level
        # The bot's patch at every lag: its frames from lag + 3 hops before the window's last
        # hop to lag hops before it.
        last = hops[c][:, -1]
        back = self._lags[:, None] + np.arange(_MATCH_HOPS - 1, -1, -1)[None, :]  # (lags, 4)
        pos = (last[:, None, None] - back[None]) & _MASK
        ref = self._refm[cr[:, None, None], pos].reshape(len(c), self._nlag, -1)
        ref = ref - ref.mean(axis=2, keepdims=True)
        a = inb[c].reshape(len(c), -1)
        a = a - a.mean(axis=1, keepdims=True)
        r = np.einsum("clk,ck->cl", ref, a) / (
            np.linalg.norm(ref, axis=2) * np.linalg.norm(a, axis=1)[:, None] + 1e-9)
        lev = self._refm_db[cr[:, None], (last[:, None] - self._lags[None, :]) & _MASK]
        top = lev.max(axis=1)
        r = np.where(lev >= top[:, None] - _MATCH_RANGE_DB, r, -1.0)
        out[c] = np.where(top >= _MATCH_MIN_DB, r.max(axis=1), 0.0)
        return out

    def _follow(self, rows: npt.NDArray[np.intp], end: npt.NDArray[np.int64],
                lag: npt.NDArray[np.int64], k: int = _FOLLOW_HOPS,
                every_hop: bool = False) -> Floats:
        """``GateReading.follow_corr`` of ghost ``rows`` whose inbound hops end before ``end``,
        at each row's ``lag`` (shape (r,)), or at each of its lags (shape (r, m): an (r, m)
        result), over ``k`` hops: from each row's ``_ghost_from`` on, or all ``k`` with
        ``every_hop``. (Reference hops older than the lag range and the fit's history are
        zeroed: at delays over ~360 ms fewer of the window's hops can count.)"""
        s = self.settings
        lags = lag.reshape(len(rows), -1)  # (r, m)
        hops = end[:, None] - k + np.arange(k)[None, :]  # (r, k): the last k inbound hops
        inb = self._inbb[rows[:, None], hops & (_INB - 1)].sum(axis=2)
        ref_db = self._ref_db[rows[:, None, None], (hops[:, None, :] - lags[:, :, None]) & _MASK]
        w = ((ref_db > s.ref_active_dbfs)
             & (every_hop | (hops >= self._ghost_from[rows][:, None]))[:, None, :]
             ).astype(np.float64)
        n = w.sum(axis=2)
        x = _db(np.maximum(inb, 1e-12))[:, None, :]
        nn = np.maximum(n, 1.0)
        mx = (w * x).sum(axis=2) / nn
        my = (w * ref_db).sum(axis=2) / nn
        dx, dy = (x - mx[:, :, None]) * w, (ref_db - my[:, :, None]) * w
        den = np.sqrt((dx * dx).sum(axis=2) * (dy * dy).sum(axis=2))
        r = np.where(den > 1e-9, (dx * dy).sum(axis=2) / np.maximum(den, 1e-9), 0.0)
        out: Floats = np.where(n >= _FOLLOW_MIN_HOPS, r, 0.0).reshape(lag.shape)
        return out

    def _hop_bands(self, hops: Floats) -> Floats:
        """Energy per hop (rows of 64 samples) in each of the envelope fit's bands."""
        spec = np.fft.rfft(hops, axis=1)
        power: Floats = spec.real**2 + spec.imag**2
        bands: Floats = power @ self._bandsum
        return bands

    def _unexplained(self, rows: np.ndarray, h0: npt.NDArray[np.int64],
                     nh: int) -> tuple[Floats, Floats, Floats]:
        """Mean energy per hop of this window's inbound that the bot's audio does not explain,
        (``prior_echo_db``) of the echo the fit on the hops before the window predicts, and
        (``prior_fit``) the share of those hops' squared energies that fit explains.

        Over the last ``_kx`` hops (at least the window), at each lag L in range, each band's
        inbound energies are fitted by a gain times the bot's energies in that band L hops
        earlier (with the gate's reverberant tail: a hop's echo lingers into the next two),
        0 <= gain <= that of ``explain_erl_db``; at the lag with the least squared error over
        all bands, what the window's own hops hold over the fit, summed over the bands."""
        k = max(self._kx, nh)
        nb, nlag = len(_EXPLAIN_BANDS), self._nlag
        # The reference hops any lag of the history reads, oldest first: span[:, j] is hop
        # h0 + nh - k - (nlag - 1) + j, so hop t - L of history hop t is a sliding window of it
        # (no copy of the (history, lag) grid: at 50 calls a batch that copy was most of the cost).
        offsets = self._xoffsets.get(nh)
        if offsets is None:
            offsets = self._xoffsets[nh] = np.arange(nh - k - (nlag - 1), nh)
        idx = (((h0 & _MASK)[:, None] + offsets) & _MASK) + (rows * _RING)[:, None]
        span = self._refb.reshape(-1, nb)[idx]  # (c, k + nlag - 1, bands)
        d = self.settings.tail_decay
        span[:, 1:] = np.maximum(span[:, 1:], d * span[:, :-1])
        span[:, 2:] = np.maximum(span[:, 2:], d * d * span[:, :-2])
        # r[c, t, L, b] = span[c, t + nlag - 1 - L, b]
        r = np.lib.stride_tricks.sliding_window_view(span, nlag, axis=1)[:, :, :, ::-1]
        r = np.moveaxis(r, 3, 2)  # (c, k, nlag, bands), a view
        yi = (((h0[:, None] + np.arange(nh - k, nh)[None, :]) & (_INB - 1))
              + (rows * _INB)[:, None])
        y = self._inbb.reshape(-1, nb)[yi]  # (c, k, bands)
        # The fit's inbound-by-bot sums per lag and band: the history's (the hops before the
        # window, for the fit on the line as it was before it), then the window's hops added to
        # them one at a time, oldest first. numpy's einsum adds the reduced axis in order, so
        # this is what one einsum over all k hops gave, bit for bit (tests/vad/test_gate.py),
        # for one pass over the history instead of two: this method at 50 calls, 2.9-3.7 ->
        # 2.5 ms a batch (timeit, best of 7, two alternated runs on the shared machine).
        kp = k - nh
        sry_p: Floats = np.einsum("ckb,cklb->clb", y[:, :kp], r[:, :kp])
        sry: Floats = sry_p.copy()
        for j in range(kp, k):
            sry += y[:, j, None, :] * r[:, j]
        sq = np.concatenate([np.zeros((len(rows), 1, nb)), np.cumsum(span * span, axis=1)],
                            axis=1)  # running sums of span^2
        hi = k + nlag - 1 - self._lags  # one past the span index of lag L's newest hop
        srr: Floats = sq[:, hi] - sq[:, hi - k]  # (c, nlag, bands)
        g: Floats = np.clip(sry / np.maximum(srr, 1e-30), 0.0, self._gmax)
        err = (g * (g * srr - 2.0 * sry)).sum(axis=2)  # squared error less sum(y^2)
        sel = np.arange(len(rows))
        yw = y[:, k - nh:].sum(axis=1)  # (c, bands)
        # (c, nlag, bands): the window's hops, summed per lag
        cs = np.concatenate([np.zeros((len(rows), 1, nb)), np.cumsum(span, axis=1)], axis=1)
        rw = cs[:, hi] - cs[:, hi - nh]

        def left(lag: npt.NDArray[np.int64]) -> Floats:
            fit = g[sel, lag] * rw[sel, lag]
            rest: Floats = np.maximum(yw - fit, 0.0).sum(axis=1) / nh
            return rest

        # The same fit on the history before the window: the window's own hops taken out of
        # the sums (the gains and the lag from the line as it was before this window).
        # Both sums over the history's hops directly (not the whole sums less the window's: a
        # loud window over a quiet history would leave rounding error as the history's sums).
        srr_p: Floats = sq[:, hi - nh] - sq[:, hi - k]
        # A band (or a whole history) with no bot energy, or no inbound energy, to speak of
        # (relative to the span's own: the cumulative sums round at about 1e-16 of it) fits
        # nothing: silence at a call's start predicts no echo (-100) and explains nothing (0).
        eps = 1e-12
        tiny_r = srr_p <= eps * np.maximum(sq[:, -1:], 1e-300)
        g_p = np.where(tiny_r, 0.0,
                       np.clip(sry_p / np.maximum(srr_p, 1e-300), 0.0, self._gmax))
        err_p = (g_p * (g_p * srr_p - 2.0 * sry_p)).sum(axis=2)  # squared error less sum(y^2)
        lag_p = np.argmin(err_p, axis=1)
        prior: Floats = (g_p[sel, lag_p] * rw[sel, lag_p]).sum(axis=1) / nh
        y2 = y * y
        yy_p = y2[:, :kp].sum(axis=(1, 2))
        yy_all = y2.sum(axis=(1, 2))
        fit_p: Floats = np.where(
            yy_p <= eps * np.maximum(yy_all, 1e-300), 0.0,
            np.clip(-err_p[sel, lag_p] / np.maximum(yy_p, 1e-300), 0.0, 1.0))
        if k == nh:  # no history before the window: nothing predicts it
            prior, fit_p = np.zeros(len(rows)), np.zeros(len(rows))
        out = left(np.argmin(err, axis=1))
        # Where the gate has locked the echo delay, that lag (+-1 hop) is the echo's: with four
        # free gains per lag the fit can prefer a lag that suits the history but not the window
        # (measured: locked echo-only windows read as fully unexplained without this).
        lag = self._lag[rows]
        locked = lag >= 0
        if locked.any():  # (none locked: each np.where below would give ``out`` back)
            for dl in (-1, 0, 1):
                at = np.clip(lag + dl, 0, self._nlag - 1)
                out = np.where(locked, np.minimum(out, left(at)), out)
        return out, prior, fit_p

    def _band_snr(self, rows: np.ndarray, x: Floats, adapt: npt.NDArray[np.bool_],
                  spectrum: Floats | None) -> Floats:
        """Upper-band power over its per-bin floor (as the floor stood before this window), then
        the floor's update: a sign step of ``band_step_db`` per bin, only where ``adapt``. A
        row's first window sets its floor and reads 0 dB."""
        if x.shape[1] != 256:
            return np.zeros(len(rows))
        p = (hann_power(x) if spectrum is None else spectrum)[:, self._band]
        level = 10.0 * np.log10(np.maximum(p, 1e-12))
        floor = self._floor[rows]
        known = self._floor_set[rows]
        snr = np.zeros(len(rows))
        if known.any():
            snr[known] = 10.0 * np.log10(np.maximum(p[known].sum(axis=1), 1e-30)
                                         / (10.0 ** (floor[known] / 10.0)).sum(axis=1))
        step = self.settings.band_step_db
        moved = floor + np.where(level > floor, step, -step)
        floor = np.where((adapt & known)[:, None], moved, np.where(known[:, None], floor, level))
        self._floor[rows] = floor
        self._floor_set[rows] = True
        return snr

    def _adapt(self, rows: np.ndarray, sel: np.ndarray, x_db: Floats, pred_aligned: Floats,
               pred_max: Floats, locked: npt.NDArray[np.bool_]) -> None:
        """Echo gain trackers and noise floor of rows ``rows[sel]``, from this window's hops.

        The echo gains are running medians in dB, one step per active hop, so hops far above
        the prediction (the caller) move them by one step only. They move towards "more echo"
        four times slower than towards "less echo": a caller who talks a lot must not teach the
        gate that the line is all echo.
        """
        r = rows[sel]
        xd = x_db[sel]
        for erl, pred, counts in ((self._erl, pred_aligned[sel], locked[sel][:, None]),
                                  (self._erl_max, pred_max[sel], True)):
            m = (pred > self._active_e) & counts  # hops whose prediction carries echo
            now = erl[r]
            up = (m & (_db(pred) - xd > now[:, None])).sum(axis=1)
            erl[r] = now + (_UP * up - _DOWN * (m.sum(axis=1) - up))
        # Noise floor: a percentile of recent hops. Echo raises it, which only makes the gate
        # more careful while the bot talks.
        n = self._nwin
        nh = xd.shape[1]
        ni = self._noise_i[r]
        self._noise[r[:, None], (ni[:, None] + np.arange(nh)[None, :]) % n] = xd
        ni = ni + nh
        self._noise_i[r] = ni
        due = ni - self._noise_at[r] >= 16
        if not due.any():
            return
        dr = r[due]
        self._noise_at[dr] = ni[due]
        full = ni[due] >= n
        pct = self.settings.noise_percentile / 100
        if full.any():
            fr = dr[full]
            kk = int(round(pct * (n - 1)))
            self._noise_db[fr] = np.partition(self._noise[fr], kk, axis=1)[:, kk]
        for row in dr[~full]:  # the first seconds of a call: a shorter history
            count = int(self._noise_i[row])
            if count >= 8:
                kk = int(round(pct * (count - 1)))
                self._noise_db[row] = np.partition(self._noise[row, :count], kk)[kk]

    def _update_lag(self, rows: np.ndarray) -> None:
        s = self.settings
        rows = rows[self._active_hops[rows] >= s.min_lock_hops]
        if len(rows) == 0:
            return
        sw, sx, sy, sxx, syy, sxy = np.moveaxis(self._sums[rows], 1, 0)
        n = np.maximum(sw, 1e-9)
        mx = sx / n
        my = sy / n
        vx = sxx / n - mx * mx
        vy = syy / n - my * my
        cov = sxy / n - mx * my
        ok = (sw >= s.min_lock_hops * 0.5) & (vx > 1e-6) & (vy > 1e-6)
        any_ok = ok.any(axis=1)
        if not any_ok.any():
            return
        rows, ok, cov, vx, vy = rows[any_ok], ok[any_ok], cov[any_ok], vx[any_ok], vy[any_ok]
        r = np.where(ok, cov / np.sqrt(np.maximum(vx * vy, 1e-12)), -1.0)
        best = np.argmax(r, axis=1)
        corr = r[np.arange(len(rows)), best]
        self._lag_corr[rows] = corr
        lag = self._lag[rows]
        lock = corr >= s.lock_corr
        # Start the aligned gain from the observed median so far: the pre-lock estimate.
        newly = lock & (lag < 0)
        self._erl[rows[newly]] = np.maximum(self._erl_max[rows[newly]], 6.0)
        lag = np.where(lock, best, np.where(corr < s.lock_corr * 0.6, -1, lag))
        self._lag[rows] = lag


class EchoGate:
    """One call's echo and noise gate on the inbound track (a bank of one). Not thread-safe."""

    def __init__(self, settings: EchoGateSettings | None = None, *, sample_rate: int = TELEPHONY_RATE) -> None:
        self._bank = EchoGateBank(settings, sample_rate=sample_rate)
        self._row = self._bank.open_row()
        self._rows = np.array([self._row], dtype=np.intp)

    @property
    def settings(self) -> EchoGateSettings:
        return self._bank.settings

    @property
    def lag_hops(self) -> int | None:
        return self._bank.lag_hops(self._row)

    @property
    def lag_corr(self) -> float:
        return self._bank.lag_corr(self._row)

    @property
    def erl_db(self) -> float:
        return self._bank.erl_db(self._row)

    @property
    def noise_db(self) -> float:
        return self._bank.noise_db(self._row)

    def add_reference(self, start_sample: int, samples: np.ndarray) -> None:
        """Record bot audio that plays from inbound sample ``start_sample`` on."""
        self._bank.add_reference(self._row, start_sample, samples)

    def clear_reference_from(self, sample: int) -> None:
        """The bot's audio from ``sample`` on was cancelled (a Twilio ``clear``)."""
        self._bank.clear_reference_from(self._row, sample)

    def process(self, samples: np.ndarray, *, adapt: bool = True) -> GateReading:
        """Feed one VAD window of inbound audio (a multiple of the 64-sample hop, at most 64
        hops) and read the gates. ``adapt=False`` while the caller is known to be talking."""
        x = np.asarray(samples, dtype=np.float64)[None, :]
        return self._bank.process(self._rows, x, np.array([adapt]))[0]
