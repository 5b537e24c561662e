"""The end-of-turn decision: when may the bot start? One per call, stepped window by window.

Barge-in (``_policy``) decides when the bot must stop; this core decides when the caller's turn is
over. A silence timer ends every turn after the same silence, so it either talks into a thinking
caller's pauses (short timer) or leaves every answer hanging (long timer). :class:`TurnDetector`
waits for a silence whose length depends on how *finished* the last voiced stretch sounded:

* **prosody** of the end of the last voiced stretch (per 32 ms speech window: pitch from the
  autocorrelation peak): a final pitch low in the speaker's own range and falling says "done";
  a pitch held up or rising says "more to come". A short turn ("yes", "no", a digit string)
  counts as done.
* **text**, where a partial transcript streams in (:meth:`TurnDetector.set_transcript`): a turn
  whose words end on a continuation ("and", "um", "the", "my", ...) waits the longest; one
  that is a complete short answer ("yes", "no", a digit string) ends after ``answer_wait_ms``;
  one that ends on any other word (a sentence can end there) raises ``p_end`` (fitted: with
  session 9's fit: ROC AUC with it 0.79 train / 0.84 held out, against the prosody's 0.71 /
  0.87, on the pauses cut between two words; it is chosen by the delay at the heard false-end
  limit, not the AUC: docs/turns.md). The word lists
  are English: ``text_cues: off`` (callers in another language) leaves the text out.

From these an end-of-turn estimate ``p_end`` in [0, 1] (a logistic model whose weights were fitted
on one split of voices and checked on another: docs/turns.md) sets the silence to wait for::

    wait = patience * (min_wait_ms + (max_wait_ms - min_wait_ms) * (1 - p_end))

measured from the end of the last caller window (not from ``speech_stopped``, which the barge-in
policy reports ``stop_windows`` later). Speech before the wait is over continues the same turn.
``mode: silence`` gives the plain timer (``silence_ms``) for comparison and for agents that
want it.

The core does no I/O: the call controller feeds it audio (:meth:`TurnDetector.feed`) and one
``step`` per VAD window with the policy's verdict on that window, and acts on the
:class:`TurnDecision` it returns.
"""

from __future__ import annotations

import enum
import math
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from audio import TELEPHONY_RATE

__all__ = [
    "COMPLETE_ANSWERS",
    "CONTINUATION_WORDS",
    "EndEstimate",
    "ProsodyWeights",
    "TurnDecision",
    "TurnDetector",
    "TurnSettings",
    "TurnState",
    "window_pitch",
]

WINDOW_SAMPLES = 256
WINDOW_MS = 32.0
_RATE = TELEPHONY_RATE
_MIN_LAG, _MAX_LAG = 20, 128  # 400 Hz .. 62.5 Hz
_HISTORY = 128  # samples before a window that lengthen its autocorrelation (low voices)
_RING = 1024  # kept samples: a window, its history and the rest of the frame that completed it

CONTINUATION_WORDS: frozenset[str] = frozenset(
    """and or but so because um uh er erm hmm the a an my your our their his her its to of for
    with in on at from by about if than that which who whose when while then like is are was
    were be i i'm we you they it's it was there's uh-huh""".split()
)
"""A partial transcript ending on one of these is an unfinished phrase: the turn waits longest.
("please" is not one: "my balance please" is done.)"""

COMPLETE_ANSWERS: frozenset[str] = frozenset(
    """yes yeah yep yup no nope nah okay ok sure correct right thanks zero oh one two three
    four five six seven eight nine""".split()
)
"""A partial transcript made only of these (or digits), at most ``_ANSWER_WORDS`` words, is a
complete short answer ("yes", "no", "four one two seven"): the turn ends after
``answer_wait_ms``."""
_ANSWER_WORDS = 12


@dataclass(frozen=True, slots=True)
class ProsodyWeights:
    """The end-of-turn model: ``p_end = sigmoid(bias + sum(weight * feature))``. ``bias``,
    ``pitch_position`` and ``pitch_slope`` were fitted by ``python -m bench.turn_end --fit`` on
    the train voices (a logistic regression, ends and pauses weighted equally, as the start;
    then chosen with the waits by the waits' own criterion, the audible false ends on pauses of
    at most 1 s, then the median delay: a coordinate search, docs/turns.md), on the verdicts
    of today's VAD chain: the fit and its inputs' hash are in
    ``vad/turn_fit.json`` (tests/turns/test_turn_fit.py: these defaults are the file's, the file
    is what the fit gives, and the VAD chain still gives the verdicts it was fitted on). ROC AUC
    0.71 on train, 0.87 on the held-out voices, on the cases with the hesitation pauses between
    two words (session 9: the logistic start had 0.73 / 0.89 and answered ~250 ms later on train
    without a transcript, ~300 ms with one, at the same heard false ends; with the pauses at the quietest 40 ms, mostly inside a word,
    the fit before had 0.68 / 0.74, and 0.68 / 0.62 while the DTMF feature read a vowel's first formant as a
    key tone: docs/turns.md). The level's decay into the pause was
    tried and dropped: AUC 0.56 on train, 0.12 (inverted) on the held-out voices."""

    bias: float = 0.76
    """Log-odds of a turn end with every feature at zero."""
    pitch_position: float = -1.305
    """Per unit of the final pitch (median of the last 3 voiced windows, ~100 ms) within the
    speaker's range in this turn (0 = its 10th percentile, 1 = its 90th): ending low says done."""
    pitch_slope: float = -0.0199
    """Per semitone/s of the pitch slope over the last 8 voiced windows (~250 ms, clipped to
    +-60): falling says done."""
    text_done: float = 0.5
    """Added when the partial transcript ends on a word a sentence can end on (neither a
    continuation word nor a complete short answer). Chosen on the train voices by the same
    criterion with the partials 250 ms late, the other weights and the waits held (bench.turn_end
    --fit; the aligned words, docs/turns.md)."""
    short_turn: float = 1.5
    """Added when the turn so far has at most ``short_turn_ms`` of speech ("yes", "no", a
    digit string are complete answers). A prior, not fitted: the data has 4 short answers."""


@dataclass(frozen=True, slots=True)
class TurnSettings:
    """Per-agent turn taking (YAML ``turn:``). Waits are silence after the last caller window."""

    mode: Literal["prosody", "silence"] = "prosody"
    """``prosody``: the wait depends on the end-of-turn estimate; ``silence``: a fixed timer."""
    patience: float = 1.0
    """Scales every wait: 0.7 answers sooner (quick agents), 1.5 lets slow talkers think."""
    min_wait_ms: float = 800.0
    """The wait after a turn that sounds clearly finished (``p_end`` = 1). With ``max_wait_ms``
    fitted on the train voices (bench.turn_end --fit): the shortest median delay whose replies
    would be heard in at most 2% of pauses up to 1 s, with the early start (without a transcript
    train 2.3%, 4/176, the search's floor; held-out voices 0/55: vad/turn_fit.json)."""
    max_wait_ms: float = 2400.0
    """The wait after a turn that sounds clearly unfinished (``p_end`` = 0)."""
    text_wait_ms: float = 1500.0
    """The least wait when the partial transcript ends on a continuation word."""
    answer_wait_ms: float = 300.0
    """The most wait when the partial transcript is a complete short answer (yes, no, a digit
    string; ``COMPLETE_ANSWERS``). Only a streaming recogniser gives partials during the turn;
    bench.turn_end has 4 short answers (3 eSpeak): close to a prior."""
    silence_ms: float = 700.0
    """The fixed wait of ``mode: silence``."""
    early_ms: float = 200.0
    """Silence after which the turn is *likely* over (``TURN_LIKELY``): the gateway sends the
    transcript then, so the agent's reply is being made during the rest of the wait, and holds
    the reply until the turn end is confirmed. 0 (or a wait shorter than this): off."""
    speculate: bool = False
    """At ``TURN_LIKELY``, with a streaming recogniser, send its partial transcript at once as
    the turn's text (the reply starts without waiting for the final, still held until the turn
    end); if the final then differs, the reply is dropped and made again from the final."""
    short_turn_ms: float = 700.0
    """A turn with at most this much speech counts as a short answer (see ProsodyWeights)."""
    text_cues: Literal["english", "off"] = "english"
    """Which word lists read the partial transcripts (``CONTINUATION_WORDS``,
    ``COMPLETE_ANSWERS`` and, for any other last word, ``ProsodyWeights.text_done``):
    ``english``, the only lists there are; ``off``: no transcript is read (neither partials
    nor a final back during the wait), and the turn end is the prosody model's alone. ``off``
    for callers in any other language: to the English lists nearly every last word of theirs
    ("... und", "... que") is a word a sentence can end on, so every partial would shorten the
    wait."""
    weights: ProsodyWeights = field(default_factory=ProsodyWeights)
    """The end-of-turn model's weights (fitted; change only with a new fit)."""

    def __post_init__(self) -> None:
        if self.patience <= 0:
            raise ValueError("turn.patience must be > 0")
        if not 0 <= self.min_wait_ms <= self.max_wait_ms:
            raise ValueError("turn: need 0 <= min_wait_ms <= max_wait_ms")
        if self.text_cues not in ("english", "off"):
            raise ValueError(f"turn.text_cues must be 'english' or 'off', got {self.text_cues!r}")


class TurnState(enum.Enum):
    IDLE = "idle"  # no caller turn open
    SPEAKING = "speaking"  # the caller is talking
    PAUSED = "paused"  # the caller stopped; waiting to see whether the turn is over


class TurnDecision(enum.Enum):
    TURN_END = "turn_end"  # the caller's turn is over: answer now
    TURN_CONTINUED = "turn_continued"  # speech again inside the wait: still the same turn
    TURN_LIKELY = "turn_likely"  # early_ms of silence: start the reply, hold it until TURN_END


@dataclass(frozen=True, slots=True)
class EndEstimate:
    """How finished the last voiced stretch sounded, and the wait it gives."""

    p_end: float
    wait_ms: float
    pitch_position: float  # final pitch in the speaker's range (0 = low, 1 = high)
    pitch_slope: float  # semitones/s over the last ~250 ms voiced
    speech_ms: float  # speech in the turn so far
    text_hold: bool  # the partial transcript ended on a continuation word
    text_answer: bool = False  # the partial transcript is a complete short answer
    text_done: bool = False  # it ends on a word a sentence can end on (ProsodyWeights.text_done)


def window_pitch(x: npt.NDArray[np.float64]) -> tuple[float, float]:
    """(voicing, f0 in Hz) of one window (with up to 128 samples before it): the normalised
    autocorrelation peak in 62-400 Hz and its lag, refined by parabolic interpolation."""
    x = x - x.mean()
    n = x.shape[0]
    nfft = 1 << (n + _MAX_LAG - 1).bit_length()
    spec = np.fft.rfft(x, nfft)
    ac = np.fft.irfft(spec.real**2 + spec.imag**2, nfft)[:n]
    if ac[0] <= 1e-9 or n <= _MAX_LAG + 1:
        return 0.0, 0.0
    lags = np.arange(_MIN_LAG, _MAX_LAG + 1)
    r = ac[lags] / ac[0] * (n / (n - lags))
    i = int(np.argmax(r))
    lag = float(lags[i])
    if 0 < i < len(r) - 1:
        a, b, c = r[i - 1], r[i], r[i + 1]
        den = a - 2 * b + c
        if den < 0:
            lag += 0.5 * (a - c) / den
    return float(min(r[i], 1.0)), _RATE / lag


def _semitones(f0: float) -> float:
    return 12.0 * math.log2(f0 / 100.0)


_WORD = re.compile(r"[a-z']+(?:-[a-z']+)?")


def _ends_unfinished(text: str) -> bool:
    words = _WORD.findall(text.lower())
    return bool(words) and words[-1] in CONTINUATION_WORDS


def _complete_answer(text: str) -> bool:
    words = _WORD.findall(text.lower())
    return 0 < len(words) <= _ANSWER_WORDS and all(
        w in COMPLETE_ANSWERS or w.isdigit() for w in words)


class TurnDetector:
    """End-of-turn decision for one call. :meth:`feed` every inbound sample, then :meth:`step`
    once per 256-sample VAD window, in order, with whether the window was the caller."""

    VOICED_MIN = 0.55  # voicing above which a window's pitch is read (coughs stay under 0.55)

    def __init__(self, settings: TurnSettings | None = None) -> None:
        self.settings = settings or TurnSettings()
        self.state = TurnState.IDLE
        self._ring = np.zeros(_RING)
        self._fed = 0  # samples fed in all
        self._pitch: deque[float] = deque(maxlen=64)  # semitones of voiced windows, ~2 s
        self._speech_ms = 0.0
        self._silence_ms = 0.0
        self._likely = False  # TURN_LIKELY given in this pause
        self._text = ""
        self.estimate: EndEstimate | None = None
        self.last_speech_end_ms = 0.0
        """Stream time (ms) of the end of the last caller window: the caller's speech end."""

    # -- input ------------------------------------------------------------------------------
    def feed(self, samples: npt.ArrayLike) -> None:
        """Inbound audio (float, 8 kHz), before the windows it completes are stepped."""
        x = np.asarray(samples, dtype=np.float64).ravel()
        n = len(self._ring)
        if len(x) >= n:
            self._ring[:] = x[-n:]
        else:
            self._ring[:-len(x) or None] = self._ring[len(x):]
            self._ring[-len(x):] = x
        self._fed += len(x)

    def set_transcript(self, text: str) -> None:
        """The turn's words so far (a streaming partial); an unfinished phrase waits longer."""
        self._text = text
        if self.state is TurnState.PAUSED and self.estimate is not None:
            self.estimate = self._estimate()

    def _window(self, end_sample: int) -> npt.NDArray[np.float64]:
        back = self._fed - end_sample  # samples fed after the window's end
        back = min(max(back, 0), _RING - WINDOW_SAMPLES - _HISTORY)
        stop = len(self._ring) - back
        return self._ring[max(0, stop - WINDOW_SAMPLES - _HISTORY):stop]

    # -- the decision -----------------------------------------------------------------------
    def step(self, speech: bool, end_sample: int | None = None) -> TurnDecision | None:
        """One VAD window: ``speech`` is the barge-in policy's verdict on it (``is_caller``);
        ``end_sample`` is where the window ends in the stream (default: at the end of the
        audio fed so far)."""
        end = self._fed if end_sample is None else end_sample
        if speech:
            self._on_speech(end)
            if self.state is TurnState.PAUSED:
                self.state = TurnState.SPEAKING
                self._silence_ms = 0.0
                self.estimate = None
                return TurnDecision.TURN_CONTINUED
            self.state = TurnState.SPEAKING
            return None
        if self.state is TurnState.IDLE:
            return None
        if self.state is TurnState.SPEAKING:
            self.state = TurnState.PAUSED
            self._silence_ms = 0.0
            self._likely = False
            self.estimate = self._estimate()
        self._silence_ms += WINDOW_MS
        assert self.estimate is not None
        if self._silence_ms >= self.estimate.wait_ms:
            self.state = TurnState.IDLE
            return TurnDecision.TURN_END
        early = self.settings.early_ms
        if 0 < early <= self._silence_ms and not self._likely:
            self._likely = True
            return TurnDecision.TURN_LIKELY
        return None

    def end_turn(self) -> None:
        """Forget the turn (the gateway ended it by other means: a backchannel, a hang-up)."""
        self.state = TurnState.IDLE
        self._reset_turn()

    def new_turn(self) -> None:
        """After a TURN_END has been acted on: the next speech starts a fresh turn."""
        self._reset_turn()

    def _reset_turn(self) -> None:
        self._pitch.clear()
        self._speech_ms = 0.0
        self._silence_ms = 0.0
        self._text = ""
        self.estimate = None

    @property
    def silence_ms(self) -> float:
        """Silence since the last caller window of the open turn."""
        return self._silence_ms

    def _on_speech(self, end: int) -> None:
        if self.state is TurnState.IDLE:
            self._reset_turn()
        self._speech_ms += WINDOW_MS
        self.last_speech_end_ms = end / (_RATE / 1000)
        semitones = self._window_semitones(end)
        if semitones is not None:
            self._pitch.append(semitones)

    def _window_semitones(self, end: int) -> float | None:
        """The pitch of the caller window ending at sample ``end`` in semitones, or None where
        it is not voiced enough. It reads only the audio fed so far (the weight search in
        bench/turn_end.py replays it from a table)."""
        voicing, f0 = window_pitch(self._window(end))
        return _semitones(f0) if voicing >= self.VOICED_MIN and f0 > 0 else None

    def _estimate(self) -> EndEstimate:
        s = self.settings
        position, slope = self._prosody()
        w = s.weights
        short = self._speech_ms <= s.short_turn_ms
        z = w.bias + w.pitch_position * position + w.pitch_slope * slope
        z += w.short_turn if short else 0.0
        text = self._text if s.text_cues == "english" else ""
        hold = _ends_unfinished(text)
        answer = _complete_answer(text)
        done = not hold and not answer and _WORD.search(text.lower()) is not None
        z += w.text_done if done else 0.0
        p_end = 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))
        if s.mode == "silence":
            wait = s.silence_ms
        else:
            wait = s.min_wait_ms + (s.max_wait_ms - s.min_wait_ms) * (1.0 - p_end)
            if hold:
                wait = max(wait, s.text_wait_ms)
            elif answer:
                wait = min(wait, s.answer_wait_ms)
            wait *= s.patience
        return EndEstimate(p_end=p_end, wait_ms=wait, pitch_position=position,
                           pitch_slope=slope, speech_ms=self._speech_ms, text_hold=hold,
                           text_answer=answer, text_done=done)

    def _prosody(self) -> tuple[float, float]:
        """(final pitch position in the speaker's range, pitch slope in semitones/s); neutral
        (0.5, 0) with fewer than 4 voiced windows in the turn."""
        pitch = np.asarray(self._pitch)
        if len(pitch) < 4:
            return 0.5, 0.0
        lo, hi = np.percentile(pitch, (10, 90))
        position = float((np.median(pitch[-3:]) - lo) / (hi - lo + 1.0))
        tail = pitch[-8:]
        slope = float(np.polyfit(np.arange(len(tail)) * (WINDOW_MS / 1000), tail, 1)[0])
        return position, max(-60.0, min(60.0, slope))

    def features(self) -> tuple[float, float, float]:
        """The model's inputs now (pitch position, slope, short turn): for fitting."""
        position, slope = self._prosody()
        return position, slope, 1.0 if self._speech_ms <= self.settings.short_turn_ms else 0.0
