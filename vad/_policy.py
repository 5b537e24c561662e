"""The barge-in decision: one per call, one place, stepped window by window.

Every 32 ms VAD window brings Silero's speech probability, the echo/noise gate reading and two
cheap acoustic features. From them :class:`BargeInPolicy` decides, in this order:

1. **Is this window the caller?** Either Silero says speech (``p >= p_on``) *and* the window is
   louder than the predicted echo and the noise floor by their margins, or the window is *far*
   louder than echo and noise (``strong_*_db``), is not a DTMF tone, and is voiced or at least
   half-believed by Silero. The second path catches onsets Silero is slow on (weak first words,
   speech in kitchen noise) without letting coughs, clicks or the bot's echo through. A third
   path hears a voice under noise loud enough to mask it broadband (Silero deaf, the gate
   closed): on a line where the bot's echo is known not to come back, a clearly voiced window
   whose upper speech band (1.5-3.4 kHz) stands ``band_snr_db`` over that band's noise floor.
   A fourth hears what the raw gate holds with an echo canceller in front: while the bot talks,
   a window Silero calls speech on the *echo-cancelled* audio (``clean_on``) needs only small
   margins over the predicted echo and the noise floor (``clean_echo_db``, ``clean_noise_db``).
   A fifth needs neither a locked delay nor a converged canceller: while the bot
   talks, a window Silero calls speech whose energy the bot's own delayed envelope leaves all but
   unexplained (``explain_share_db``, ``GateReading.unexplained_db``). Whichever path hears it,
   while the bot talks a window must stand ``background_db`` over the loudest of what was on
   the line in the last 31 windows (about a second) without bot audio in the echo's lag range
   before it came in (a TV or babble was there first; the voiced-band path keeps its own
   per-bin floor), a background never taken over ``background_caller_db`` under the caller's
   own level once a real turn has taught it. And with an echo canceller in front, while the
   caller is silent, the window that would begin their run must stand ``prior_margin_db`` over
   the echo the line's 160 ms before it predict for it, at whatever delay and loss they show (an
   echo path that has just changed, which the locked delay and AEC3 have not followed yet).
   With an echo canceller in front, and where the settings ask for it (on by default since
   session 12; YAML ``classifier: off``), a small fitted network (:class:`CallerClassifier`)
   has the last word: a window it scores ``classifier_on`` is the caller whatever the paths
   say, one the paths take that it scores under ``classifier_veto`` is not (under
   ``classifier_drained_veto`` in a pause once the bot's audio has left the lag range).
2. **Has the caller started talking?** ``start_windows`` caller windows in a row (64 ms by
   default) start a speech turn; ``stop_windows`` windows without speech end it.
3. **What happens to the bot?** If an *interruptible* utterance is on the line when the caller
   starts, the bot is **paused** at once (Twilio ``clear``); this is the low-latency stop. The
   interrupt is **committed** (the agent is told to drop its reply) only once the caller has
   talked for ``commit_ms``. If the caller stops sooner, it was a backchannel ("uh-huh", "yes") or
   a noise, and playback **resumes** from what the caller actually heard. In a pause, with none
   of the bot's audio left in the echo's lag range, a window Silero still calls speech is no
   stop (``pause_hold_windows``): the dip between two of the caller's words. Nor is a window
   that follows what the bot would have played had it not been paused (``pause_echo_corr``:
   a line that goes on playing it, as a recording replayed open loop does), nor, after a
   resume, while the bot plays on behind such a line, a window that follows what it plays
   (``deaf_echo_corr``). A
   *non-interruptible* utterance is never paused: speech over it is reported once as
   suppressed.

4. **What becomes of the caller's words?** Speech that ended in a resume was a backchannel and
   speech over a non-interruptible utterance is dropped when ``speech_over_uninterruptible`` is
   ``drop``: their words are never a turn for the agent (:class:`SpeechStopped` ``dropped``).
   A key press (Twilio's ``dtmf``) stops an interruptible prompt that is playing or paused.

The policy does no I/O. It sees the bot's side as a :class:`BotView` (what is audible, and the
head utterance's id and state) and returns :data:`Effect` records, each already checked against
that view: a :class:`Pause` names the utterance it clears, a :class:`Resume` the one it paused.
The call controller (``gateway/call.py``) only carries them out.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from ._echo import GateReading
from ._features import WindowFeatures

__all__ = [
    "BAND_CANDIDATE_DB",
    "CLEAN_CANDIDATE_DB",
    "EXPLAIN_CANDIDATE_DB",
    "BargeInPolicy",
    "BargeInSettings",
    "BotState",
    "CallerClassifier",
    "CallerFeatures",
    "BotView",
    "Decision",
    "DropReason",
    "Effect",
    "Interrupt",
    "InterruptReason",
    "OverUninterruptible",
    "Pause",
    "PolicyState",
    "Resume",
    "SpeechStarted",
    "SpeechStopped",
    "Suppressed",
    "wants_features",
]

CLASSIFIER_FILE = Path(__file__).with_name("bargein_classifier.json")
"""The caller classifier's weights, written by ``python -m bench.fit_classifier``."""

WINDOW_MS = 32.0

BAND_CANDIDATE_DB = 6.0
"""The engine computes features for windows that fail the gate only on echo-free lines and only
where the upper band stands at least this far over its floor (``GateReading.band_snr_db``):
a policy's ``band_snr_db`` below this acts as this (:func:`wants_features`)."""


_NO_ECHO_DB = -99.0  # GateReading.ref_db is -100 where no bot audio is in the lag range


def _percentile(values: Collection[float], pct: float) -> float:
    """The ``pct`` percentile of ``values`` (not empty), as the nearest value at or above it."""
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(pct / 100 * len(ordered)))])

CLEAN_CANDIDATE_DB = 0.0
"""The engine also computes features for windows at least this far over the predicted echo
(and over the gate's floor) where the bot can be echoing: the echo-cancelled path of
:meth:`BargeInPolicy.is_caller` reads their DTMF-likeness (AEC3 leaves a key tone in)."""


EXPLAIN_CANDIDATE_DB = 6.0
"""... and for windows whose energy the bot's lagged envelope leaves at most this far
unexplained (``GateReading.unexplained_db`` within this of the level): the unexplained-energy
path reads their DTMF-likeness (a key tone is no more the bot's envelope than a caller is)."""


def wants_features(gate: GateReading, min_level_dbfs: float) -> bool:
    """Does the decision read this window's features (voicing, DTMF)? Only where
    :meth:`BargeInPolicy.is_caller` can use them: windows the gate passes, voiced-band
    candidates on echo-free lines over the gate's floor ``min_level_dbfs``, and, while bot audio
    is in the echo's lag range, windows over that floor and at least ``CLEAN_CANDIDATE_DB`` over
    the predicted echo (the echo-cancelled path's candidates). The engine computes
    features for these windows alone (zeros elsewhere): skipping the rest saves most of their
    cost on a quiet or echo-only line."""
    if gate.passes:
        return True
    if gate.level_db < min_level_dbfs:
        return False
    return (gate.echo_free and gate.band_snr_db >= BAND_CANDIDATE_DB
            or gate.ref_db > _NO_ECHO_DB and (
                gate.level_db - gate.echo_db >= CLEAN_CANDIDATE_DB
                or gate.level_db - gate.unexplained_db <= EXPLAIN_CANDIDATE_DB))


def _clip(value: float, lo: float, hi: float) -> float:
    """``value`` (dB) held to ``lo``..``hi``, in tens of dB (the classifier's input scale)."""
    return min(hi, max(lo, value)) / 10.0


class CallerFeatures:
    """The caller classifier's input for each window, stepped once per window in order (causal:
    the window and the two before it). Every reading is a margin in tens of dB, clipped, or a
    probability or flag; the voicing and DTMF readings only where the engine computes them
    (:func:`wants_features`, zeros elsewhere, as the engine gives them)."""

    HISTORY = 2
    """Windows before this one whose readings the input carries."""
    # prob, clean, echo/noise margins, explained, level, voicing, echo_match
    _CARRIED = (0, 1, 2, 3, 4, 13, 14, 20)

    def __init__(self) -> None:
        self._prev: deque[list[float]] = deque(maxlen=self.HISTORY)
        self._echo_windows = 0

    def step(self, prob: float, gate: GateReading, feat: WindowFeatures, clean_prob: float,
             background_db: float | None, min_level_dbfs: float) -> npt.NDArray[np.float64]:
        """This window's input vector; ``background_db`` is the line's background while bot
        audio is in the echo's lag range (:meth:`BargeInPolicy.classifier_background`)."""
        echoing = gate.ref_db > _NO_ECHO_DB
        self._echo_windows = self._echo_windows + 1 if echoing else 0
        known = wants_features(gate, min_level_dbfs)
        level = gate.level_db
        base = [
            prob, clean_prob,
            _clip(level - gate.echo_db, -20.0, 40.0), _clip(level - gate.noise_db, -20.0, 40.0),
            _clip(level - gate.unexplained_db, 0.0, 20.0) if echoing else 0.0,
            _clip(level - gate.prior_echo_db, -20.0, 40.0) if echoing else 4.0,
            gate.prior_fit if echoing else 0.0,
            float(gate.echo_locked), float(gate.echo_free), _clip(gate.band_snr_db, -10.0, 30.0),
            float(echoing),
            _clip(level - gate.ref_db + gate.erl_db, -20.0, 40.0) if echoing else 4.0,
            gate.echo_corr,
            _clip(level + 60.0, 0.0, 60.0),
            feat.voicing if known else 0.0, feat.dtmf if known else 0.0, float(known),
            float(gate.passes),
            min(self._echo_windows * WINDOW_MS, 2000.0) / 1000.0,
            _clip(level - background_db, -20.0, 40.0) if background_db is not None else 4.0,
            gate.echo_match,
        ]
        x = list(base)
        for back in range(self.HISTORY):
            prev = self._prev[-1 - back] if len(self._prev) > back else base
            x += [prev[i] for i in self._CARRIED]
        self._prev.append(base)
        return np.asarray(x, dtype=np.float64)


@lru_cache(maxsize=1)
def _fitted_thresholds() -> dict[str, Any]:
    """The classifier's fitted thresholds in :data:`CLASSIFIER_FILE`, as BargeInSettings'
    keywords; read once per process (a gateway maps an agent's settings at every call)."""
    params = json.loads(CLASSIFIER_FILE.read_text())["params"]
    return {k.split(".", 1)[1]: v for k, v in params.items()}


@dataclass(frozen=True)
class CallerClassifier:
    """"Is the caller talking in this window?": a one-hidden-layer tanh network over
    :class:`CallerFeatures`, fitted on the simulator's train split (``python -m
    bench.fit_classifier``, shipped as :data:`CLASSIFIER_FILE`). A forward pass is two small
    matrix products (17.7 us, and 11.3 us for its input, on this 2-core machine under load)."""

    mean: npt.NDArray[np.float64]
    """The inputs' train mean ..."""
    scale: npt.NDArray[np.float64]
    """... and spread (inputs are standardised with them)."""
    w1: npt.NDArray[np.float64]
    b1: npt.NDArray[np.float64]
    w2: npt.NDArray[np.float64]
    b2: float

    def scores(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """The probability that the caller talks, for each row of ``x`` (or one vector)."""
        h = np.tanh(((x - self.mean) / self.scale) @ self.w1 + self.b1)
        z = np.clip(h @ self.w2 + self.b2, -30.0, 30.0)
        out: npt.NDArray[np.float64] = 1.0 / (1.0 + np.exp(-z))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"mean": self.mean.tolist(), "scale": self.scale.tolist(), "w1": self.w1.tolist(),
                "b1": self.b1.tolist(), "w2": self.w2.tolist(), "b2": self.b2}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CallerClassifier:
        def arr(key: str) -> npt.NDArray[np.float64]:
            return np.asarray(d[key], dtype=np.float64)

        return cls(arr("mean"), arr("scale"), arr("w1"), arr("b1"), arr("w2"), float(d["b2"]))

    @staticmethod
    @lru_cache(maxsize=1)
    def shipped() -> CallerClassifier:
        """The weights the package ships (:data:`CLASSIFIER_FILE`), read once per process."""
        return CallerClassifier.from_json(json.loads(CLASSIFIER_FILE.read_text())["model"])


class OverUninterruptible(enum.Enum):
    """What becomes of the caller's words spoken over a non-interruptible utterance."""

    KEEP = "keep"  # handed to the agent as the next turn once the utterance is over
    DROP = "drop"  # discarded (published flagged ``dropped``)


@dataclass(frozen=True, slots=True)
class BargeInSettings:
    """Per-agent barge-in tuning; defaults work on phone lines."""

    p_on: float = 0.5
    """Silero probability that makes a gated window speech."""
    p_off: float = 0.3
    """Below this (and not a strong window) a window counts towards the end of speech."""
    p_weak: float = 0.15
    """Silero floor for the strong-energy path when the window is not clearly voiced."""
    strong_noise_db: float = 12.0
    strong_echo_db: float = 10.0
    voicing_min: float = 0.6
    voiced_min: float = 0.8
    """Clearly voiced windows that pass the gates need only ``p_weak`` from Silero (speech in
    loud noise, where Silero stays low for half a second)."""
    dtmf_max: float = 0.6
    band_snr_db: float = 10.0
    """Upper-band SNR that makes a voiced window the caller on an echo-free line, whatever the
    broadband gate says (values under vad._features.BAND_CANDIDATE_DB act as it)."""
    band_voicing_min: float = 0.6
    """Voicing that path needs: coughs and door slams reach 0.52 here, babble 0.58."""
    band_min_level_dbfs: float = -55.0
    """... and the absolute level (the gate's floor)."""
    instant_margin_db: float = 25.0
    """A window this far over noise and echo, voiced and Silero-confirmed, starts speech alone."""
    start_windows: int = 2
    """Caller windows in a row that start speech (and pause an interruptible bot)."""
    stop_windows: int = 5
    """Non-speech windows in a row that end speech."""
    prior_margin_db: float | None = 6.0
    """While bot audio is in the echo's lag range and the caller is silent, the window that would
    begin a run of caller windows must stand this far over the echo the line's 160 ms before
    it predict for it (``GateReading.prior_echo_db``: the bot's audio fitted at every delay and a
    loss down to 6 dB on the hops before the window). After an echo path change (a new delay or
    a louder path) the gate's locked lag and its slow echo-gain median under-predict the echo for
    seconds, and AEC3 re-converges in 0.5-1.4 s: on train those are 16 of the 33 first-stop
    false stops on echo-only calls, all heard by the raw gate (fitted: train first stops 77/80,
    FS 44, 120/409 ms -> 78/80, FS 35, 124/419 ms). A caller's first window is not in
    the history that fit learns from. Acts with an echo canceller in front only (the decision
    with ``echo_canceller: off`` is the echo gate's, as before). None: no such test."""
    prior_fit_min: float = 0.9
    """... and only where that fit explains at least this share of the history's squared band
    energies (``GateReading.prior_fit``): the 160 ms before the window were the bot's echo, not
    a caller's weak first syllables (which the fit, free to assume a loss down to 6 dB, would take for a
    louder echo and predict the next window from)."""
    prior_explained_db: float | None = None
    """... and only where the bot's lagged envelope (the fit of ``GateReading.unexplained_db``,
    window included) explains at least this much of the window (``level_db`` less
    ``unexplained_db``): a changed path's echo still follows the bot's envelope, a caller's
    voice does not. The test is not limited to a run's first window (a held window leaves the
    run at 0, so the window after it is tested with the held one in the history), and without
    this the fit, free in four band gains, any lag and a loss to 6 dB, predicts a caller from
    their own voice (prior_fit 0.83-0.95; train closed loop with the first version: s1_00020
    quiet_caller +224 ms, s1_00056 clip +256 ms against prior_margin_db None). Fitted on train
    (None/1/2/3/4.5/6 dB): 3 dB, first stops 78/80 FS 35 124/419 -> 124/409 ms; refitted in
    session 12 with the ``impacts`` calls logged too: 1 dB (216 calls: FS 48 -> 47, the same
    latencies). None: no such requirement."""
    commit_ms: float = 640.0
    """Speech needed after a pause before the interrupt is committed to the agent."""
    max_pause_ms: float = 2500.0
    """A pause never lasts longer than this without a decision (then: commit if speech)."""
    resume_on_backchannel: bool = True
    """False: every pause commits (no resume); for agents that prefer to stop on any speech."""
    resume_windows: int | None = None
    """Non-speech windows in a row that end a *pause* in a resume (the audible gap a
    backchannel leaves is the rest of the backchannel plus this wait). None: ``stop_windows``."""
    pause_hold_windows: int | None = 10
    """While the bot is paused for the caller and none of its audio is in the echo's lag range
    (nothing on the line can be its echo), a window Silero still hears as speech (``p_on``, on
    the echo-cancelled audio too) that the gate fails, over ``band_min_level_dbfs``, does not
    count towards the resume: the dip between two words, which the gate's floor (learnt from the
    echo while the bot talked: -44 dBFS over a -60 dBFS room) fails. At most this many such
    windows since the last speech window (then they count as quiet: a TV or babble that Silero
    hears holds a false pause this much longer, never for good). They hold the pause only, they
    are no speech towards ``commit_ms``: counted, babble's false pauses were committed (check
    split: 3 of 8 babble barge-in calls given a false interrupt). Without it the check split's
    barge-ins were resumed over on 40 of 80 calls, the bot talking on between a caller's words
    (session 13, docs/bargein.md). None: off, every gated-out window counts."""
    pause_echo_corr: float | None = 0.85
    """A pause clears the bot's audio from Twilio's buffer, but nothing proves that the line
    went quiet of it: a recorded line replayed as ``eval_bargein.py`` replays one cannot react,
    so its echo goes on as if the bot had never stopped (and so would any buffer past Twilio
    that ignored the clear). With none of that audio in the gate's reference once the echo's lag
    range has drained, the echo is a loud, Silero-certain "caller", and 640 ms of it committed
    the pause: open-loop replays of the check split gave false interrupts on 17 of 184 calls (12
    echo-only) against 0 closed loop (session 14, docs/bargein.md). So the gateway keeps a copy
    of the gate that still hears what a line deaf to every clear would play
    (``VadStream.fork_ghost``, ``Playback.would_play``), and in a pause, once none of the
    bot's real audio is in the lag range, a window whose last 320 ms (from one delay after the
    clear on) follow that would-be audio at the copy's delay (the gate's lock at the first
    pause, as ``EchoGateSettings.follow_locked_hops`` refines it; Pearson r of their 8 ms log
    energies, ``GateReading.follow_corr``) by at least this much is the bot, not the caller:
    neither speech towards the commit nor a held window. A caller's voice follows the bot's envelope at a fixed delay only by chance. Chosen on
    train (0.8/0.85/0.9, open loop: false interrupts 4/3/11 of 184) with a probe of a line that
    obeys the clear beside it (120 real barge-ins: 0.8 resumed one more than off, 0.85 none);
    check split, open loop: false interrupts 17 -> 5, closed loop unchanged. None: off (and,
    with ``deaf_echo_corr`` off too, no copy is kept)."""
    deaf_echo_corr: float | None = 0.85
    """After a resume the gateway plays on from what the caller heard, behind a line deaf to
    the clear (a recording replayed open loop), whose echo of the bot runs ahead of it by the
    pauses: neither the gate's reference nor its lock explains it, and it paused the bot again
    and again until one pause was committed. While the bot plays, a window whose last 320 ms
    follow what that deaf line plays (the same gate copy as ``pause_echo_corr``'s, kept through
    the resumes until the gateway's line is the deaf one) by at least this much, and that the
    copy's gate explains (its echo at the copy's delay and gain: no caller over it), is the bot,
    not the caller: it starts no caller run, nor keeps one going. Train split, small grid, seed 3, open loop (session 21): resumed pauses 226
    -> 191, detection, latency, false stops and interrupts the same as before the deaf line
    (80/80, 137/419 ms, FS 35, FI 1); without the copy's gate a caller talking over that echo
    was held back too (p95 496 ms). None: off."""
    deaf_not_free_corr: float | None = 0.5
    """A line whose inbound follows what a line deaf to the clear plays (the gate copy's
    ``follow_corr`` at least this) is not echo-free, whatever the gate's own lock says: its
    echo follows the deaf line, not the gateway's reference, so the gate loses its lock after
    a pause and, 2 s of lock short of ``echo_line_s``, reads the line as echo-free; the
    voiced-band path (echo-free lines only) then takes a TV or the echo itself for the caller,
    and the echo and classifier vetoes stand aside. Chosen on train's ``mixed`` grid, open
    loop (0.7 / 0.5: false interrupts 21 -> 21 / 20, resumed pauses 623 -> 571 / 569; `small`
    grid p95 407 -> 367 ms at both, every other verdict the same), checked on check's
    (session 23, docs/bargein.md). None: the gate's ``echo_free`` alone."""
    carry_ms: float | None = None
    """A pause that starts within this long of the last resume goes on counting that pause's
    speech towards ``commit_ms``: a caller pausing between words is one barge-in, not a row of
    backchannels each resumed over (without it, replays show the bot resumed 2-5 times over
    one caller's sentence). None: every pause counts from zero."""
    # The echo veto's thresholds below were fitted on the simulator's train split by
    # ``python -m bench.fit_bargein`` (vad/bargein_fit.json; tests/vad/test_fit.py checks they
    # are the file's), not tuned by hand. They act only with an echo canceller in front.
    caller_margin_db: float | None = None
    """Background voices: once the caller has talked a real turn (``caller_turn_ms``), a window
    more than this under their median level is not them (a TV, a person in the room 15 dB or
    more quieter). None: off (not yet fitted; the simulator's grid has no such condition)."""
    caller_turn_ms: float = 640.0
    """Caller speech a turn needs before its level is learnt (backchannels do not teach it)."""
    dtmf_interrupts: bool = True
    """A key press (Twilio's ``dtmf`` message) stops an interruptible prompt, as IVR menus
    expect (:meth:`BargeInPolicy.on_dtmf`)."""
    speech_over_uninterruptible: OverUninterruptible = OverUninterruptible.KEEP
    """What the caller said over a non-interruptible utterance: kept as their next turn, or
    dropped (:class:`SpeechStopped` ``dropped``)."""
    clean_p_min: float = 0.3
    """With an echo canceller in front (``clean_prob`` given to :meth:`BargeInPolicy.step`): a
    window Silero scores under this once the bot's echo is removed is the bot's echo, whatever
    the raw window looked like, unless the line is known to be echo-free (AEC3 then attenuates
    the caller instead: its suppressor stays conservative on a line with no echo to learn)."""
    clean_veto_db: float = 15.0
    """... and unless the window stands this far over the gate's predicted echo."""
    worst_erl_db: float | None = None
    """... and over the worst plausible echo: the loudest bot audio of the last 520 ms less
    this echo return loss (the gate's own prediction can be far too low before its echo path
    locks, or after the path changes). None: no such floor (it costs onset latency where the
    caller is quieter than the bot: dev set p50 84 -> 98 ms, worst 232 -> 395 ms at 6 dB)."""
    any_lag_margin_db: float | None = None
    """... and this far over the echo the gate's echo return loss predicts at *any* delay up to
    520 ms (the loudest bot audio there less the ERL): a delay that changed mid-call puts the
    echo where the locked lag does not look. None: no such floor."""
    any_lag_floor_db: float | None = None
    """With a canceller in front: a window under that any-delay echo plus this margin is never
    the caller, whatever the cancelled audio sounds like (AEC3 re-converging after a delay
    change leaves a residual Silero calls speech). None: no such floor."""
    no_echo_corr: float | None = None
    """The veto stands aside on a line whose echo path is not locked and whose best envelope
    correlation with the bot's audio (after ~0.3 s of it) is under this. None: it never does."""
    impulse_voicing: float | None = 0.3
    """With an echo canceller in front, while bot audio is in the echo's lag range: a window
    that stands ``impulse_db`` over the predicted echo, that Silero scores under
    ``clean_p_min`` once the echo is removed, and whose voicing is under this, is not the
    caller, whatever path took it. A cough, a knock or a door stands 10-60 dB over a weak echo
    while Silero, hearing the bot's speech under it, scores the raw window as speech (and the
    gate's lock keeps the echo veto out); its voicing reads 0.1-0.3, where most of a caller's
    first windows read 0.45-0.9. Fitted on train with the ``impacts`` grid's calls logged
    beside the small grid's (None, 0.25-0.45; 10-25 dB): 0.25 at 10 dB, first stops of 216
    calls 88/96, calls with a false stop 54 (38 echo-only) -> 47 (31), p50/p95 120/409 ->
    120/420 ms. None: no such veto."""
    impulse_db: float = 10.0
    """... the margin over the predicted echo from which that veto looks."""
    clean_veto_locked: bool = True
    """Apply that veto on a line whose echo delay the gate has locked too (path changes that
    the gate has not noticed yet; costs onset latency where the caller talks over echo)."""
    clean_on: float | None = 0.5
    """With an echo canceller in front: a window Silero scores at least this on the
    echo-cancelled audio is the caller even where the raw gate's margins fail it, if it stands
    ``clean_echo_db`` over the predicted echo and ``clean_noise_db`` over the noise floor (the
    gate's 8 dB echo margin holds a caller as loud as a strong echo for 300-600 ms, while AEC3
    has removed the echo and Silero hears them on the cleaned window). None: off."""
    clean_echo_db: float = 4.0
    """... the margin over the predicted echo that path needs (values under
    ``CLEAN_CANDIDATE_DB`` act as it: the engine computes no features under it)."""
    clean_noise_db: float = 4.5
    """... and over the noise floor (on a strong echo line the floor learns the echo)."""
    clean_after_ms: float = 1280.0
    """... and only once the bot's audio has been in the echo's lag range this long without a
    break: AEC3 lets the first few hundred ms of echo through when a bot turn starts after a
    silence, and Silero hears that on the cancelled window too."""
    explain_share_db: float | None = 2.0
    """The unexplained-energy path: while bot audio is in the echo's lag range, a window Silero
    calls speech (``p_on``) whose energy no delayed, attenuated copy of the bot's audio
    explains to within this (``GateReading.unexplained_db`` at most this under the window's
    level) is the caller, whatever the raw gate's echo margin or the echo veto say: it needs
    no locked delay and no converged canceller, so it hears a barge-in in the bot's first
    turn (fitted on train; check split p95 534 -> 442 ms, with ``explain_background_db``).
    None: off."""
    explain_noise_db: float = 9.0
    """... if that unexplained energy stands this far over the noise floor."""
    explain_voicing_min: float = 0.6
    """... or, where Silero is under ``p_on``, if the window is voiced this clearly (Silero
    stays at 0.1-0.3 for the first 100-300 ms of a caller talking over the bot's first words,
    while their vowels are voiced 0.6-0.9). Over 1: Silero alone. Hold music is voiced too:
    without ``background_db`` closed-loop train replays stopped the bot for it in its first turn
    (seed 3, 1-2 of 4 calls); with it none was interrupted (seeds 1 and 3; one music false
    stop on seed 3 either way), and barge-ins in the bot's first 200 ms came sooner (train
    seed 1: 290/747 -> 187/353 ms p50/p95)."""
    explain_background_db: float | None = 6.0
    """... and this far over the line's background as it was just before the bot's audio came
    into the echo's lag range (the ``background_pct`` percentile of the levels of the last
    second of windows without it): a TV, babble or hold music is on the line before the bot
    talks, a barge-in in its first words is not (without it the path let babble and hold
    music stop the bot in its first turn: check false interrupts 6 -> 9, with it 6). None: no
    such floor."""
    explain_until_ms: float | None = None
    """... and only until the bot's audio has been in the echo's lag range this long on the
    call in all (the first turn, before AEC3 converges and the gate locks the delay; later the
    raw gate and the echo veto know the line better). None: for the whole call."""
    explain_veto_db: float | None = 25.0
    """A window the other paths call the caller is the bot's echo after all where all but this
    much of its energy is explained by the bot's lagged envelope (``unexplained_db`` more than
    this under the level) and the line is not known to be echo-free. None: no such veto."""
    explain_floor_pct: float | None = None
    """The noise floor the unexplained-energy path's ``explain_noise_db`` measures against: this
    percentile of ``GateReading.unexplained_db`` over the last 2 s of windows where nobody
    talked, where it is under the gate's floor (a median of the inbound itself, which on a
    strong echo line learns the echo: 6 dB ERL, floor -30 dBFS over a -61 dBFS room tone). What
    the bot's envelope explains is no noise; a background (a TV, babble) is not explained and is
    learnt as before. None: the gate's floor."""
    background_pct: float = 100.0
    """The percentile of the last second's levels before the bot's audio came into the echo's
    lag range that is the line's background (``explain_background_db``, ``background_db``):
    100 is its loudest window (a TV's or babble's syllables, not their median)."""
    background_db: float | None = 9.0
    """Every path but the voiced-band one (which has its own per-bin floor) needs a window this
    far over that background while bot audio is in the echo's lag range: a TV or babble passes
    the raw gate's 6 dB over the noise median with its louder syllables, and AEC3 leaves it in;
    it was on the line before the bot talked, a caller's barge-in was not. None: off."""
    background_caller_db: float | None = 18.0
    """... and that background is never taken over this far under the caller's own level
    (``caller_db``, once they have talked a real turn). None: no such cap.

    Two known limits, both measured (docs/bargein.md, "After review"): a short turn (a "yes",
    under ``caller_turn_ms``) teaches no cap, so an answer that is the loudest of the second
    before the prompt is its background (a barge-in must be 9 dB over it); and a bot whose
    audio comes in while the caller is already talking takes their voice as the background and
    talks on over them, not paused. Capping from any turn, or from the turn in progress, also
    learns a TV's and babble's own "turns": train first stops FS 42 -> 49 (the floor off) and
    42 -> 46; the check split with the second, 80/80 FI 1 -> 77/80 FI 5 (babble 8/8 -> 5/8)."""
    background_in_pause: bool = True
    """Whether ``background_db`` also holds while the bot is paused for the caller, after its
    audio has left the echo's lag range: a TV or babble goes on under a pause as it did under
    the bot. Such a window is then neither the caller's speech nor the Silero-heard sound that
    keeps a pause from ending. Without it a TV's words in the pause counted as the caller's
    and committed it, or held it to ``max_pause_ms``, which commits it too (check split,
    ``erl35-d0-none-none-tv-short_word``: a TV paused the bot and committed it a second later,
    in both loops). On the ``mixed`` grid (192 calls a split, session 22): train open loop
    false interrupts 23 -> 21, one barge-in more detected; check 27 -> 26 open loop and 3 -> 2
    closed, one more detected in each; the cost, a real barge-in under that floor resumed over
    before it is heard (barge-in calls with one, open loop: check 62 -> 67 of 129, train 74 ->
    78 of 127). False: the floor only while bot audio is in the lag range (sessions 8-21)."""
    classifier_on: float | None = 0.7
    """The classifier's fast path (with an echo canceller in front): a window that
    :class:`CallerClassifier` scores at least this for ``classifier_windows`` windows in a row is
    the caller whatever the hand-set paths and vetoes say, if the engine computed its features
    and it is not a DTMF tone. Fitted with ``classifier_windows`` and ``classifier_veto`` by
    ``python -m bench.fit_classifier`` on the small and ``impacts`` grids' train calls (first
    stops of 216 calls, out of fold: 88/96 FS 47 120/420 ms -> 89/96 FS 35 124/420 ms;
    docs/bargein.md): 0.95, 1 window, veto 0.1. On by default since session 12 (reserved check
    split, same run: false interrupts 1 -> 0 of 184 calls and 7 -> 0 of the 32 ``impacts``
    calls, p50/p95 166/426 -> 168/448 ms; the dev set's gate holds). Session 16 retrained it
    with the gate's ``echo_match`` among its inputs, on train windows logged afresh: 0.9, 1
    window, veto 0.2 (first stops out of fold 89/96 FS 47 112/420 ms -> 91/96 FS 32 112/405
    ms). Session 18 retrained it on twice the train calls (seeds 1, 3, 5 and 7): 0.9, 1
    window, veto 0.3 (out of fold, 432 calls: 177/192 FS 103 112/450 ms -> 178/192 FS 61
    110/402 ms). Session 19 retrained it with nine more real voices among the train callers
    (linesim/voices): 0.7, 1 window, veto 0.5 (out of fold, 432 calls: 172/192 FS 107 120/813
    ms -> 167/192 FS 69 124/458 ms). None: off (YAML ``classifier: off``)."""
    classifier_windows: int = 1
    """... windows in a row (this one included) the score must hold for; at least 1."""
    classifier_noise_db: float | None = 6.0
    """The fast path takes a window only this far over the line's noise floor (dB): a babble
    that the classifier takes for the caller stands a few dB over the floor it sets itself
    (``bench.fit_classifier``'s SEARCH says why 6). None: no such floor."""
    classifier_veto: float | None = 0.5
    """A window the other paths call the caller is not, where the classifier scores it under
    this (and the line is not known to be echo-free). None: no such veto."""
    classifier_drained_veto: float | None = 0.7
    """The veto's threshold in a pause once none of the bot's audio is left in the echo's lag
    range (where ``classifier_veto`` is set; None: ``classifier_veto``). The network was
    trained on windows of a decision that never stops the bot, so a pause whose lag range has
    drained is a regime it never saw: there, on train ``mixed`` open loop, a veto at 0.5 kept
    38 % of the callers' windows and 49 % of the rest (a recording's echo going on after the
    clear, babble, a TV), which then added up to ``commit_ms``. A stricter veto there commits
    fewer of those pauses; a caller it holds back still holds the pause (the window is still
    speech to the resume count) and is committed at ``max_pause_ms``. Chosen on train `mixed`
    s1 (0.2 / 0.3 / 0.5 / 0.7 / 0.85, open loop: false interrupts 12 / 12 / 10 / 6 / 3,
    detected 117 / 117 / 116 / 117 / 118 of 127; closed 1 / 1 / 1 / 0 / 0; bot resumed over a
    barge-in on 80 / 82 / 83 / 89 / 96 calls open, 90 / 90 / 93 / 101 / 109 closed): 0.7,
    the smaller step, as 0.85 doubled the resumes over real callers; checked on check
    ``mixed`` s5 (session 26, docs/bargein.md). None: ``classifier_veto`` there too."""
    classifier_drained_noise_db: float | None = 20.0
    """... only on windows less than this far over the line's noise floor (dB): a caller that
    far over it counts at ``classifier_veto``, as before. At 0.7 everywhere in a drained pause
    a loud caller the network scored 0.5-0.8 (-19 to -24 dBFS, 30 dB over the floor, Silero
    0.9-0.99, closed loop) was held back until the late limit had passed (check ``impacts``
    s2 call 25, traced); on train the same rule gave back the one ``impacts`` barge-in 0.7
    lost (s1 open: 15 -> 16 of 16, the run otherwise as 0.5's) and on ``mixed`` kept 0.7's
    false interrupts (open 6, closed 0) with fewer resumes over callers (89 -> 88 open, 101
    -> 96 closed). None: on every window."""

    def __post_init__(self) -> None:
        # 0 would open the fast path on every window whose features were computed, with only
        # the veto set (the run counter starts at 0).
        if self.classifier_windows < 1:
            raise ValueError(f"classifier_windows must be >= 1, got {self.classifier_windows}")

    @property
    def reads_ghost(self) -> bool:
        """Whether a rule reads the gate's copy on a line deaf to the clear
        (``pause_echo_corr``, ``deaf_echo_corr``, ``deaf_not_free_corr``): the call keeps one
        from a pause on only then."""
        return (self.pause_echo_corr is not None or self.deaf_echo_corr is not None
                or self.deaf_not_free_corr is not None)

    def with_fitted_classifier(self) -> BargeInSettings:
        """These settings with the caller classifier on at its fitted thresholds (the
        ``params`` of :data:`CLASSIFIER_FILE`, from ``python -m bench.fit_classifier``; the
        defaults are those)."""
        return dataclasses.replace(self, **_fitted_thresholds())

    def without_classifier(self) -> BargeInSettings:
        """These settings with the caller classifier off: the hand-set paths alone."""
        return dataclasses.replace(self, classifier_on=None, classifier_veto=None)


class BotState(enum.Enum):
    """What is on the line from the bot's side at this window."""

    SILENT = "silent"  # nothing playing
    INTERRUPTIBLE = "interruptible"  # an utterance that may be cut off is playing
    NON_INTERRUPTIBLE = "non_interruptible"  # an utterance that must be heard in full


@dataclass(frozen=True, slots=True)
class BotView:
    """The bot's side of the line as the call controller sees it when it steps the policy."""

    audible: BotState
    """What the caller hears at this window."""
    utterance_id: str | None = None
    """The head of the playout queue (playing, paused or about to play), if any."""
    interruptible: bool = False
    """... whether it may be cut off."""
    playing: bool = False
    """... whether it is being sent (a pause has something to clear)."""
    paused: bool = False
    """... whether it is held by our pause."""
    reply_unheard: bool = False
    """The caller's last turn is answered by a reply they have not heard a word of yet: speech
    now continues that turn, and the reply is dropped (turn taking, docs/turns.md)."""

    @classmethod
    def of(cls, audible: BotState) -> BotView:
        """The view that ``audible`` alone implies (an audible interruptible utterance is the
        head of the queue, playing)."""
        on = audible is BotState.INTERRUPTIBLE
        return cls(audible, interruptible=on, playing=on or audible is BotState.NON_INTERRUPTIBLE)


class PolicyState(enum.Enum):
    IDLE = "idle"  # caller silent
    SPEAKING = "speaking"  # caller talking, bot not paused by us
    PAUSED = "paused"  # caller talking over an interruptible utterance; bot paused, undecided
    INTERRUPTED = "interrupted"  # interrupt committed; caller's turn


class Decision(enum.Enum):
    """The kind of an :data:`Effect`."""

    SPEECH_STARTED = "speech_started"
    SPEECH_STOPPED = "speech_stopped"
    PAUSE = "pause"  # send `clear` now, keep the utterance to resume
    COMMIT = "commit"  # publish the interrupt: the utterance is over
    RESUME = "resume"  # the speech was a backchannel/noise: play on from the heard point
    SUPPRESSED = "suppressed"  # speech over a non-interruptible utterance
    DTMF_INTERRUPT = "dtmf_interrupt"  # a key stops the prompt (reason ``dtmf``)


class DropReason(enum.Enum):
    """Why a speech turn's words are not a turn for the agent."""

    BACKCHANNEL = "backchannel"  # the bot resumed over it
    OVER_UNINTERRUPTIBLE = "over_uninterruptible"  # ``speech_over_uninterruptible: drop``


class InterruptReason(enum.Enum):
    SPEECH = "speech"  # the caller talked for ``commit_ms``
    DTMF = "dtmf"  # a key press


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    """The caller started talking (open speech to text)."""

    kind: ClassVar[Decision] = Decision.SPEECH_STARTED
    over_uninterruptible: bool
    """... over a non-interruptible utterance."""
    drop_reply: bool
    """... before hearing the reply to their last turn, which is dropped (the controller's
    ``_hold_reply``); no pause follows (there is nothing left to pause)."""


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    """The caller stopped talking."""

    kind: ClassVar[Decision] = Decision.SPEECH_STOPPED
    over_uninterruptible: bool
    dropped: DropReason | None
    """Why the words are not a turn for the agent (settle them now); None: they are one."""


@dataclass(frozen=True, slots=True)
class Pause:
    """Send ``clear`` and hold ``utterance_id`` to resume from what the caller heard."""

    kind: ClassVar[Decision] = Decision.PAUSE
    utterance_id: str | None
    onset_ms: float
    """Where the caller's speech began (stream time): barge-in latency is measured from it."""


@dataclass(frozen=True, slots=True)
class Interrupt:
    """Stop the current interruptible utterance for good and tell the agent."""

    reason: InterruptReason

    @property
    def kind(self) -> Decision:
        return Decision.COMMIT if self.reason is InterruptReason.SPEECH else (
            Decision.DTMF_INTERRUPT)


@dataclass(frozen=True, slots=True)
class Resume:
    """Play the paused ``utterance_id`` on from what the caller heard."""

    kind: ClassVar[Decision] = Decision.RESUME
    utterance_id: str | None


@dataclass(frozen=True, slots=True)
class Suppressed:
    """The caller talked over a non-interruptible utterance (reported once per turn)."""

    kind: ClassVar[Decision] = Decision.SUPPRESSED
    utterance_id: str | None
    policy: OverUninterruptible


Effect = SpeechStarted | SpeechStopped | Pause | Interrupt | Resume | Suppressed
"""What the call controller carries out, in order."""


class BargeInPolicy:
    """Stateful decision for one call. Feed :meth:`step` once per VAD window, in order."""

    def __init__(self, settings: BargeInSettings | None = None,
                 classifier: CallerClassifier | None = None) -> None:
        """``classifier``: the caller classifier to use where the settings ask for one (the
        shipped one by default)."""
        self.settings = settings or BargeInSettings()
        uses = self.settings.classifier_on is not None or self.settings.classifier_veto is not None
        self._classifier = (classifier or CallerClassifier.shipped()) if uses else None
        self._features = CallerFeatures()
        self.score = 0.0
        """The classifier's score of the last window stepped (0 where it is not run)."""
        self._score_run = 0  # windows in a row the score held classifier_on
        self.state = PolicyState.IDLE
        self._run = 0  # consecutive caller windows
        self._quiet = 0  # consecutive non-speech windows while speaking
        self._speech_ms = 0.0  # speech since the pause
        self._paused_ms = 0.0
        self._held_run = 0  # windows held by Silero alone since the last speech one (a pause's)
        self._suppressed_this_turn = False
        self._window = 0  # index of the window being stepped
        self._turn_levels: list[float] = []  # levels of this turn's caller windows
        self.caller_db: float | None = None
        """The caller's own level (median of their last real turn's windows), once known."""
        self._run_start = 0  # index of the first window of the current caller run
        self._holding = False  # our Pause cleared an utterance that a Resume may play on
        self._held_id: str | None = None
        self._backchannel = False  # this speech turn ended in a resume
        self._over_uninterruptible = False  # this speech turn began over such an utterance
        self._caller_window = False  # the last window stepped was the caller's
        self._resumed_window: int | None = None  # window of the last resume
        self._resumed_speech_ms = 0.0  # the speech that pause had counted
        self._echo_windows = 0  # windows in a row with bot audio in the echo's lag range
        self._echo_total = 0  # windows with bot audio in the echo's lag range, on the call
        self._silent_levels: deque[float] = deque(maxlen=31)  # levels, no bot audio in range
        self._background_db: float | None = None  # their background_pct, when the bot came in
        self._unexplained_idle: deque[float] = deque(maxlen=62)  # unexplained_db, nobody talking
        self._floor_db: float | None = None  # their percentile (explain_floor_pct), until the next

    @property
    def gate_may_adapt(self) -> bool:
        """The echo/noise gate learns the line (echo gain, noise floor) only while nobody talks."""
        return self.state is PolicyState.IDLE

    @property
    def in_speech(self) -> bool:
        """The last window stepped was the caller's, inside a speech turn: what the end-of-turn
        detector hears as speech (vad/_turn.py)."""
        return self._caller_window and self.state is not PolicyState.IDLE

    @property
    def caller_onset_ms(self) -> float:
        """Where the current (or last) run of caller windows began, in ms of stream time: the
        onset estimate that barge-in latency metrics are measured from."""
        return self._run_start * WINDOW_MS

    def is_caller(self, prob: float, gate: GateReading, feat: WindowFeatures,
                  clean_prob: float | None = None) -> bool:
        """Step 1 of the module docstring: does this window sound like the caller talking?"""
        if not self._any_path(prob, gate, feat, clean_prob):
            return False
        if clean_prob is not None and self._predicted_by_prior(gate):
            return False
        return not self._under_background(gate, feat)

    def classifier_background(self, gate: GateReading) -> float | None:
        """The line's background as the classifier reads it: the floor of ``background_db``
        while bot audio is in the echo's lag range, else None."""
        if self._background_db is None or gate.ref_db <= _NO_ECHO_DB:
            return None
        return self._background_floor()

    def _classified(self, caller: bool, prob: float, gate: GateReading, feat: WindowFeatures,
                    clean_prob: float | None) -> bool:
        """The classifier's say on the window the paths judged ``caller``: its fast path
        (``classifier_on``) and its veto (``classifier_veto``; ``classifier_drained_veto`` in a
        pause whose lag range has drained, under ``classifier_drained_noise_db`` over the
        noise floor). Only with an echo canceller in
        front, as the echo veto (``echo_canceller: off`` stays the echo gate's decision), and
        only while bot audio is in the echo's lag range or the bot is paused for the caller:
        with the bot silent otherwise there is nothing to tell the caller from, and the veto
        broke up the caller runs the turn detector reads (tests/turns: turns ended early,
        speculations lost); in a pause it is what keeps a laugh or a cough from being
        committed (check split, ``impacts`` grid: false interrupts 0 with it, 5 of 32 calls
        without). The input is stepped on every window all the same (its history and counts
        are what it was trained on)."""
        s = self.settings
        if self._classifier is None or clean_prob is None:
            return caller
        x = self._features.step(prob, gate, feat, clean_prob, self.classifier_background(gate),
                                s.band_min_level_dbfs)
        self.score = float(self._classifier.scores(x))
        on = s.classifier_on is not None and self.score >= s.classifier_on
        self._score_run = self._score_run + 1 if on else 0
        if gate.ref_db <= _NO_ECHO_DB and self.state is not PolicyState.PAUSED:
            return caller
        if caller:
            veto = s.classifier_veto
            if (veto is not None and s.classifier_drained_veto is not None
                    and gate.ref_db <= _NO_ECHO_DB
                    and (s.classifier_drained_noise_db is None
                         or gate.level_db - gate.noise_db < s.classifier_drained_noise_db)):
                veto = s.classifier_drained_veto
            return veto is None or gate.echo_free or self.score >= veto
        return (self._score_run >= s.classifier_windows and feat.dtmf < s.dtmf_max
                and gate.level_db >= s.band_min_level_dbfs
                and (s.classifier_noise_db is None
                     or gate.level_db - gate.noise_db >= s.classifier_noise_db)
                and wants_features(gate, s.band_min_level_dbfs))

    def _predicted_by_prior(self, gate: GateReading) -> bool:
        """``prior_margin_db``: the caller is silent, this window would begin a run, and the
        echo the line's recent past predicts for it is within the margin of its level. Only with
        an echo canceller in front (``is_caller``), as the echo veto: ``echo_canceller: off``
        stays the echo gate's decision (``tests/gateway/test_replay.py`` contrasts the two)."""
        margin = self.settings.prior_margin_db
        return (margin is not None and self.state is PolicyState.IDLE and self._run == 0
                and gate.ref_db > _NO_ECHO_DB and not gate.echo_free
                and gate.prior_fit >= self.settings.prior_fit_min
                and gate.level_db < gate.prior_echo_db + margin
                and (self.settings.prior_explained_db is None
                     or gate.level_db - gate.unexplained_db >= self.settings.prior_explained_db))

    def _under_background(self, gate: GateReading, feat: WindowFeatures) -> bool:
        """``background_db``: while bot audio is in the echo's lag range (or the bot is paused,
        ``background_in_pause``), the window is not that far over what was on the line before
        it came in (a TV, babble: they were there first), and it is not the voiced-band path's
        (which has its own per-bin floor)."""
        s = self.settings
        margin = s.background_db
        return (margin is not None and self._background_db is not None
                and (gate.ref_db > _NO_ECHO_DB
                     or s.background_in_pause and self.state is PolicyState.PAUSED)
                and gate.level_db < self._background_floor() + margin
                and not self._band_caller(gate, feat))

    def _any_path(self, prob: float, gate: GateReading, feat: WindowFeatures,
                  clean_prob: float | None) -> bool:
        if self._impulse(gate, feat, clean_prob):
            return False
        if self._unexplained_caller(prob, gate, feat):
            return True
        if not self._is_caller(prob, gate, feat):
            return self._clean_caller(prob, gate, feat, clean_prob)
        veto = self.settings.explain_veto_db
        if (veto is not None and gate.ref_db > _NO_ECHO_DB and not gate.echo_free
                and gate.unexplained_db < gate.level_db - veto):
            return False  # the bot's own envelope, delayed and attenuated, explains the window
        if self._under_caller_margin(gate):
            return False  # far under the caller's own voice: someone else in the room
        if clean_prob is None:
            return True
        floor = self.settings.any_lag_floor_db
        if floor is not None and gate.level_db < gate.ref_db - gate.erl_db + floor:
            # Under the echo the line's ERL gives at some delay in range: a path whose delay
            # just changed is not where the lock looks, and AEC3 takes ~1.4 s to follow it.
            return False
        return not self.echo_veto(clean_prob, gate)

    def _impulse(self, gate: GateReading, feat: WindowFeatures, clean_prob: float | None) -> bool:
        """``impulse_voicing``: a loud, unvoiced burst over the bot's echo that the canceller's
        output does not hear as speech (a cough, a knock, a door)."""
        s = self.settings
        return (s.impulse_voicing is not None and clean_prob is not None
                and gate.ref_db > _NO_ECHO_DB and not gate.echo_free
                and clean_prob < s.clean_p_min and feat.voicing < s.impulse_voicing
                and gate.level_db - gate.echo_db >= s.impulse_db)

    def _unexplained_caller(self, prob: float, gate: GateReading, feat: WindowFeatures) -> bool:
        """The unexplained-energy path: Silero hears speech, and most of the window's energy is
        not the bot's echo by its envelope (``explain_share_db``) and is over the noise floor."""
        s = self.settings
        if s.explain_share_db is None or gate.ref_db <= _NO_ECHO_DB:
            return False
        if s.explain_until_ms is not None and self._echo_total * WINDOW_MS > s.explain_until_ms:
            return False
        if (s.explain_background_db is not None and self._background_db is not None
                and gate.unexplained_db < self._background_db + s.explain_background_db):
            return False
        if prob < s.p_on and feat.voicing < s.explain_voicing_min:
            return False
        if feat.dtmf >= s.dtmf_max or gate.level_db < s.band_min_level_dbfs:
            return False
        if gate.level_db - gate.unexplained_db > min(s.explain_share_db, EXPLAIN_CANDIDATE_DB):
            return False
        if gate.unexplained_db - self._explain_floor(gate) < s.explain_noise_db:
            return False
        return not self._under_caller_margin(gate)

    def _background_floor(self) -> float:
        """The line's background for ``background_db``: what was on the line before the bot's
        audio came in, but never over ``background_caller_db`` under the caller's own level
        (a caller who answered in the bot's silence is no background)."""
        assert self._background_db is not None
        cap = self.settings.background_caller_db
        if cap is None or self.caller_db is None:
            return self._background_db
        return min(self._background_db, self.caller_db - cap)

    def _explain_floor(self, gate: GateReading) -> float:
        """The noise floor of the unexplained-energy path (``explain_floor_pct``)."""
        pct = self.settings.explain_floor_pct
        if pct is None or len(self._unexplained_idle) < 8:
            return gate.noise_db
        if self._floor_db is None:
            self._floor_db = _percentile(self._unexplained_idle, pct)
        return min(gate.noise_db, self._floor_db)

    def _under_caller_margin(self, gate: GateReading) -> bool:
        """The window is ``caller_margin_db`` or more under the level the caller was heard at."""
        margin = self.settings.caller_margin_db
        return (margin is not None and self.caller_db is not None
                and gate.level_db < self.caller_db - margin)

    def _clean_caller(self, prob: float, gate: GateReading, feat: WindowFeatures,
                      clean_prob: float | None) -> bool:
        """The echo-cancelled path: the raw gate failed the window, but Silero hears speech once
        the bot's echo is removed and the window is not under the echo or noise it predicts."""
        s = self.settings
        if s.clean_on is None or clean_prob is None or clean_prob < s.clean_on:
            return False
        if gate.ref_db <= _NO_ECHO_DB or self._echo_windows * WINDOW_MS < s.clean_after_ms:
            return False  # no (or just restarted) bot audio in the lag range: the raw gate
        if prob < s.p_weak or feat.dtmf >= s.dtmf_max or gate.level_db < s.band_min_level_dbfs:
            return False
        if gate.level_db - gate.echo_db < max(s.clean_echo_db, CLEAN_CANDIDATE_DB):
            return False
        if gate.level_db - gate.noise_db < s.clean_noise_db:
            return False
        return not self._under_caller_margin(gate)

    def echo_veto(self, clean_prob: float, gate: GateReading) -> bool:
        """With an echo canceller in front: is this window, which the raw reading took for the
        caller, the bot's echo after all? Only where the gate cannot tell by itself: its echo
        path not (or no longer) locked, the line not known to be echo-free, and the window
        not far above the worst-case echo the gate predicts. Elsewhere the gate decides alone:
        AEC3's suppressor also holds down the first 100-150 ms of a caller talking over the
        echo (-26 dBFS in, -63..-36 out on ``echo_plus_barge_in``), and on a line with no echo
        it never converges and keeps 30-40 dB off the caller while the bot talks."""
        s = self.settings
        if gate.echo_free or clean_prob >= s.clean_p_min:
            return False
        if (s.no_echo_corr is not None and not gate.echo_locked
                and gate.echo_corr < s.no_echo_corr):
            # The bot has talked long enough to correlate, and nothing of it comes back: on such
            # a line AEC3 holds down the caller, not an echo (a first turn, before echo_free).
            return False
        if gate.echo_locked and not s.clean_veto_locked:
            return False
        return (gate.level_db - gate.echo_db < s.clean_veto_db
                or s.worst_erl_db is not None and gate.level_db < gate.ref_db - s.worst_erl_db
                or s.any_lag_margin_db is not None
                and gate.level_db < gate.ref_db - gate.erl_db + s.any_lag_margin_db)

    def _is_caller(self, prob: float, gate: GateReading, feat: WindowFeatures) -> bool:
        s = self.settings
        if feat.dtmf >= s.dtmf_max:
            # An in-band key tone is never the caller talking, whatever Silero says of it
            # (Silero scores DTMF as speech): the key reaches the call as Twilio's `dtmf`.
            return False
        if gate.passes:
            if prob >= s.p_on:
                return True
            strong = (
                gate.level_db - gate.noise_db >= s.strong_noise_db
                and gate.level_db - gate.echo_db >= s.strong_echo_db
                and feat.dtmf < s.dtmf_max
            )
            if strong and (feat.voicing >= s.voicing_min or prob >= s.p_weak):
                return True
            if feat.voicing >= s.voiced_min and prob >= s.p_weak and feat.dtmf < s.dtmf_max:
                return True
        return self._band_caller(gate, feat)

    def _band_caller(self, gate: GateReading, feat: WindowFeatures) -> bool:
        """The voiced-band path: on an echo-free line, a voiced window whose upper speech band
        stands ``band_snr_db`` over that band's own per-bin noise floor."""
        s = self.settings
        return (
            gate.echo_free
            and gate.level_db >= s.band_min_level_dbfs
            and gate.band_snr_db >= s.band_snr_db
            and feat.voicing >= s.band_voicing_min
            and feat.dtmf < s.dtmf_max
        )

    def is_instant(self, prob: float, gate: GateReading, feat: WindowFeatures) -> bool:
        """A window so clearly the caller that it needs no second one."""
        s = self.settings
        return (
            gate.passes
            and prob >= s.p_on
            and feat.voicing >= s.voicing_min
            and feat.dtmf < s.dtmf_max
            and gate.level_db - gate.noise_db >= s.instant_margin_db
            and gate.level_db - gate.echo_db >= s.instant_margin_db
        )

    def step(
        self, prob: float, gate: GateReading, feat: WindowFeatures, bot: BotView | BotState,
        *, clean_prob: float | None = None, ghost: GateReading | None = None,
    ) -> list[Effect]:
        """One window: Silero's ``prob``, the gate, the features, the bot's side of the line,
        (with an echo canceller in front) Silero's probability on the echo-cancelled window,
        and (from a pause on, while a line deaf to the clear may be playing the bot) the gate
        copy's reading against what that line plays (``pause_echo_corr``,
        ``deaf_echo_corr``, ``deaf_not_free_corr``). Returns the effects to carry out, in
        order."""
        s = self.settings
        if (gate.echo_free and ghost is not None and s.deaf_not_free_corr is not None
                and ghost.follow_corr >= s.deaf_not_free_corr):
            gate = dataclasses.replace(gate, echo_free=False)
        view = bot if isinstance(bot, BotView) else BotView.of(bot)
        echoing = gate.ref_db > _NO_ECHO_DB
        self._echo_windows = self._echo_windows + 1 if echoing else 0
        self._echo_total += echoing
        if echoing and self._echo_windows == 1 and self._silent_levels:
            self._background_db = _percentile(self._silent_levels, s.background_pct)
        caller = self._classified(self.is_caller(prob, gate, feat, clean_prob), prob, gate, feat,
                                  clean_prob)
        unplayed = self._unplayed_echo(gate, ghost, view)
        if unplayed:
            caller = False  # the bot's own audio, still on the line after the clear
        if not echoing:
            self._silent_levels.append(gate.level_db)
        self._caller_window = caller
        if self.state is PolicyState.IDLE and not caller and s.explain_floor_pct is not None:
            self._unexplained_idle.append(gate.unexplained_db)
            self._floor_db = None
        speechy = caller or (not unplayed and prob >= s.p_off and gate.passes
                             and feat.dtmf < s.dtmf_max
                             and not (s.background_in_pause and self.state is PolicyState.PAUSED
                                      and self._under_background(gate, feat)))
        out: list[Effect] = []
        self._run = self._run + 1 if caller else 0
        if caller:
            self._turn_levels.append(gate.level_db)
        elif self.state is PolicyState.IDLE and self._run == 0:
            self._turn_levels.clear()  # a run that never started a turn teaches nothing
        if self._run == 1:
            self._run_start = self._window
        self._window += 1
        if caller and self._run < s.start_windows and self.is_instant(prob, gate, feat):
            self._run = s.start_windows

        if self.state is PolicyState.IDLE:
            if self._run >= s.start_windows:
                over = view.audible is BotState.NON_INTERRUPTIBLE
                # Speech before the caller heard a word of the reply to their last turn goes on
                # with that turn: the reply (the head utterance, unless one that must be heard
                # in full) is dropped, so there is nothing left to pause.
                drop_reply = view.reply_unheard and not over and (
                    view.utterance_id is None or view.interruptible)
                out.append(SpeechStarted(over_uninterruptible=over, drop_reply=drop_reply))
                self._quiet = 0
                self._suppressed_this_turn = False
                self._backchannel = False
                self._over_uninterruptible = over
                if view.audible is BotState.INTERRUPTIBLE:
                    self._pause(out, view, blocked=drop_reply)
                    if not s.resume_on_backchannel:
                        self._commit(out, InterruptReason.SPEECH)
                else:
                    self.state = PolicyState.SPEAKING
                    if over:
                        self._suppressed_this_turn = True
                        out.append(Suppressed(view.utterance_id, s.speech_over_uninterruptible))
            return out

        # The caller is talking (SPEAKING, PAUSED or INTERRUPTED).
        held = (not speechy and not unplayed and self.state is PolicyState.PAUSED
                and self._held_by_silero(prob, gate, feat, clean_prob))
        if speechy:
            self._quiet = self._held_run = 0
        elif held:
            self._held_run += 1  # the quiet count stands still
        else:
            self._quiet += 1
        if self.state is PolicyState.SPEAKING:
            if (view.audible is BotState.NON_INTERRUPTIBLE and not self._suppressed_this_turn
                    and caller):
                self._suppressed_this_turn = True
                out.append(Suppressed(view.utterance_id, s.speech_over_uninterruptible))
            elif view.audible is BotState.INTERRUPTIBLE and self._run >= s.start_windows:
                # The bot started (or came back) while the caller was already talking.
                self._pause(out, view, blocked=False)
        elif self.state is PolicyState.PAUSED:
            self._paused_ms += WINDOW_MS
            if caller:  # a held window is no speech (pause_hold_windows)
                self._speech_ms += WINDOW_MS
            if self._speech_ms >= s.commit_ms or (
                self._paused_ms >= s.max_pause_ms and self._quiet < s.stop_windows
            ):
                self._commit(out, InterruptReason.SPEECH)
            elif self._quiet >= (s.stop_windows if s.resume_windows is None
                                 else s.resume_windows):
                if self._holding:
                    # A backchannel or a noise: play on; its words are no turn for the agent.
                    out.append(Resume(self._held_id))
                    self._backchannel = True
                    self._resumed_window, self._resumed_speech_ms = self._window, self._speech_ms
                self._stopped(out)
                return out

        if self._quiet >= s.stop_windows:
            self._stopped(out)
        return out

    def _unplayed_echo(self, gate: GateReading, ghost: GateReading | None,
                       view: BotView) -> bool:
        """The window's recent past follows what a line deaf to the clear plays (the gate's
        ghost copy): in a pause once none of the bot's real audio is left in the echo's lag
        range (``pause_echo_corr``), or while the bot plays on after a resume, where the copy's
        gate explains the window (``deaf_echo_corr``)."""
        if ghost is None:
            return False
        if self.state is PolicyState.PAUSED:
            limit = self.settings.pause_echo_corr
            return limit is not None and gate.ref_db <= _NO_ECHO_DB and ghost.follow_corr >= limit
        limit = self.settings.deaf_echo_corr
        return (limit is not None and view.playing and not ghost.passes
                and ghost.follow_corr >= limit)

    def _held_by_silero(self, prob: float, gate: GateReading, feat: WindowFeatures,
                        clean_prob: float | None) -> bool:
        """``pause_hold_windows``: Silero still hears the caller, with none of the bot's audio in
        the echo's lag range, on a window the gate failed (the caller between two words); at
        most that many since the last speech window."""
        s = self.settings
        return (s.pause_hold_windows is not None and self._held_run < s.pause_hold_windows
                and gate.ref_db <= _NO_ECHO_DB and prob >= s.p_on
                and (clean_prob is None or clean_prob >= s.p_on)
                and gate.level_db >= s.band_min_level_dbfs and feat.dtmf < s.dtmf_max)

    def on_dtmf(self, bot: BotView) -> list[Effect]:
        """A key press arrived (Twilio's ``dtmf`` message): with ``dtmf_interrupts`` it stops the
        head utterance if it is interruptible and playing, or paused for the caller's speech.
        The in-band tone itself never counts as speech (:meth:`is_caller`)."""
        if not self.settings.dtmf_interrupts:
            return []
        if bot.interruptible and (bot.playing or bot.paused):
            out: list[Effect] = []
            if self.state is PolicyState.PAUSED:
                self._commit(out, InterruptReason.DTMF)
            else:
                self._holding, self._held_id = False, None
                out.append(Interrupt(InterruptReason.DTMF))
            return out
        return []

    def _pause(self, out: list[Effect], view: BotView, *, blocked: bool) -> None:
        """Hold the bot (``clear``) with the caller's run so far counted as speech. The state is
        PAUSED either way; the :class:`Pause` goes out only if the head utterance is one to
        clear (interruptible, playing) and is not being dropped already (``blocked``)."""
        self.state = PolicyState.PAUSED
        self._speech_ms = self._run * WINDOW_MS
        carry = self.settings.carry_ms
        if (carry is not None and self._resumed_window is not None
                and (self._window - self._resumed_window) * WINDOW_MS <= carry):
            self._speech_ms += self._resumed_speech_ms
        self._paused_ms = 0.0
        if view.interruptible and view.playing and not blocked:
            self._holding, self._held_id = True, view.utterance_id
            out.append(Pause(view.utterance_id, self.caller_onset_ms))

    def _commit(self, out: list[Effect], reason: InterruptReason) -> None:
        self.state = PolicyState.INTERRUPTED
        self._holding, self._held_id = False, None
        out.append(Interrupt(reason))

    def _stopped(self, out: list[Effect]) -> None:
        s = self.settings
        if self._backchannel:
            dropped: DropReason | None = DropReason.BACKCHANNEL
        elif self._over_uninterruptible and (
                s.speech_over_uninterruptible is OverUninterruptible.DROP):
            dropped = DropReason.OVER_UNINTERRUPTIBLE
        else:
            dropped = None
        out.append(SpeechStopped(over_uninterruptible=self._over_uninterruptible,
                                 dropped=dropped))
        self._reset_idle()

    def _reset_idle(self) -> None:
        """The caller's turn ended: learn their level from it if it was a real turn."""
        levels = self._turn_levels
        if len(levels) * WINDOW_MS >= self.settings.caller_turn_ms:
            self.caller_db = _percentile(levels, 50.0)
        self._turn_levels = []
        self.state = PolicyState.IDLE
        self._run = 0
        self._quiet = 0
        self._speech_ms = 0.0
        self._paused_ms = 0.0
        self._held_run = 0
        self._holding, self._held_id = False, None
        self._over_uninterruptible = False
