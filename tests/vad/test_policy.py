"""The barge-in decision on hand-made readings: each path of ``is_caller`` and its guards."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vad import (
    BargeInPolicy,
    BargeInSettings,
    BotState,
    BotView,
    CallerClassifier,
    Decision,
    DropReason,
    EchoGateBank,
    Effect,
    GateReading,
    Interrupt,
    InterruptReason,
    OverUninterruptible,
    Pause,
    PolicyState,
    Resume,
    SpeechStarted,
    SpeechStopped,
    Suppressed,
    WindowFeatures,
    wants_features,
)

QUIET_LINE = GateReading(level_db=-30.0, echo_db=-100.0, noise_db=-40.0, echo_locked=False,
                         passes=False)
# A voice under loud kitchen noise: 5 dB over the broadband floor (the gate stays shut), its
# harmonics 15 dB over the floor in 1.5-3.4 kHz, on a line where the bot's echo is not heard.
MASKED_VOICE = GateReading(level_db=-30.0, echo_db=-36.0, noise_db=-35.0, echo_locked=False,
                           passes=False, echo_free=True, band_snr_db=15.0)
VOICED = WindowFeatures(voicing=0.75, dtmf=0.05)
# The hand-set paths alone, for tests of their guards: the classifier (fitted on simulated
# calls) reads these hand-made windows its own way.
HAND = BargeInSettings(classifier_on=None, classifier_veto=None)


def kinds(effects: list[Effect]) -> list[Decision]:
    return [e.kind for e in effects]


def test_band_path_hears_a_voice_the_gate_cannot() -> None:
    policy = BargeInPolicy()
    assert policy.is_caller(0.05, MASKED_VOICE, VOICED)
    assert not policy.is_caller(0.05, QUIET_LINE, VOICED)


@pytest.mark.parametrize(("gate", "feat"), [
    (replace(MASKED_VOICE, echo_free=False), VOICED),  # the bot's echo may be on this line
    (replace(MASKED_VOICE, band_snr_db=9.0), VOICED),  # not far enough over the band floor
    (replace(MASKED_VOICE, level_db=-60.0), VOICED),  # under the absolute floor
    (MASKED_VOICE, WindowFeatures(voicing=0.55, dtmf=0.05)),  # a cough or babble, not a voice
    (MASKED_VOICE, WindowFeatures(voicing=0.75, dtmf=0.8)),  # a key tone
])
def test_band_path_guards(gate: GateReading, feat: WindowFeatures) -> None:
    assert not BargeInPolicy().is_caller(0.05, gate, feat)


def test_band_path_pauses_the_bot_after_two_windows() -> None:
    policy = BargeInPolicy()
    assert policy.step(0.05, MASKED_VOICE, VOICED, BotState.INTERRUPTIBLE) == []
    assert kinds(policy.step(0.05, MASKED_VOICE, VOICED, BotState.INTERRUPTIBLE)) == [
        Decision.SPEECH_STARTED, Decision.PAUSE]


def test_band_floor_tracks_noise_and_holds_while_the_caller_talks() -> None:
    """band_snr_db: a steady noise settles near 0 dB; a harmonic voice in 1.5-3.4 kHz stands
    well over it; with adapt False the floor does not learn the voice."""
    rng = np.random.default_rng(3)
    bank = EchoGateBank()
    row = np.array([bank.open_row()])
    t = np.arange(256) / 8000

    def window(voice: bool) -> np.ndarray:
        w = rng.normal(0, 0.02, 256)
        if voice:
            w += sum(0.05 * np.sin(2 * np.pi * f * t) for f in (1600, 1800, 2000, 2200))
        return w[None, :]

    noise = [bank.process(row, window(False), np.array([True]))[0] for _ in range(200)]
    assert abs(np.mean([r.band_snr_db for r in noise[-50:]])) < 3.0
    held = [bank.process(row, window(True), np.array([False]))[0] for _ in range(40)]
    assert min(r.band_snr_db for r in held) > 10.0  # the floor did not move towards the voice
    learnt = [bank.process(row, window(True), np.array([True]))[0] for _ in range(200)]
    assert learnt[-1].band_snr_db < 3.0  # left to adapt, it takes a steady tone for the floor


# -- the echo veto (an echo canceller in front: Silero's probability on the cancelled window) ---
# A window the raw reading takes for the caller: Silero sure, the gate open, 8 dB over the
# gate's predicted echo, the echo path locked (but maybe wrong: a path that just changed).
RAW_CALLER = GateReading(level_db=-26.0, echo_db=-34.0, noise_db=-60.0, echo_locked=True,
                         passes=True)


def test_echo_veto_holds_what_the_canceller_removed() -> None:
    policy = BargeInPolicy()
    assert policy.is_caller(0.98, RAW_CALLER, VOICED)  # no canceller: the caller
    assert not policy.is_caller(0.98, RAW_CALLER, VOICED, clean_prob=0.02)  # it was echo
    assert policy.is_caller(0.98, RAW_CALLER, VOICED, clean_prob=0.9)  # still speech: caller
    for _ in range(10):  # echo-only windows never start speech nor pause the bot
        assert policy.step(0.98, RAW_CALLER, VOICED, BotState.INTERRUPTIBLE,
                           clean_prob=0.02) == []


@pytest.mark.parametrize("gate", [
    replace(RAW_CALLER, echo_free=True),  # no echo on this line: AEC3 holds down the caller
    replace(RAW_CALLER, level_db=-18.0),  # 16 dB over even the predicted echo
])
def test_echo_veto_stands_aside_where_the_gate_knows(gate: GateReading) -> None:
    assert BargeInPolicy().is_caller(0.98, gate, VOICED, clean_prob=0.02)


def test_echo_veto_on_locked_lines_is_a_setting() -> None:
    policy = BargeInPolicy(BargeInSettings(clean_veto_locked=False))
    assert policy.is_caller(0.98, RAW_CALLER, VOICED, clean_prob=0.02)
    assert not policy.is_caller(0.98, replace(RAW_CALLER, echo_locked=False), VOICED,
                                clean_prob=0.02)


# A cough into the phone while the bot talks: 40 dB over the predicted echo, bot audio in the
# lag range, Silero on the raw window still hearing the bot's speech under it.
BURST = GateReading(level_db=-14.0, echo_db=-54.0, noise_db=-62.0, echo_locked=True,
                    passes=True, ref_db=-16.0, erl_db=35.0, unexplained_db=-14.5)
UNVOICED = WindowFeatures(voicing=0.2, dtmf=0.05)


def test_a_loud_unvoiced_burst_the_canceller_does_not_hear_is_not_the_caller() -> None:
    policy = BargeInPolicy(replace(HAND, impulse_voicing=0.35, impulse_db=15.0))
    assert not policy.is_caller(0.98, BURST, UNVOICED, clean_prob=0.02)
    for _ in range(10):  # a long burst neither starts speech nor pauses the bot
        assert policy.step(0.98, BURST, UNVOICED, BotState.INTERRUPTIBLE, clean_prob=0.02) == []
    assert not policy.in_speech


@pytest.mark.parametrize(("gate", "feat", "clean"), [
    (BURST, VOICED, 0.02),  # voiced: a caller's first vowel
    (BURST, UNVOICED, 0.6),  # the cancelled window is speech
    (BURST, UNVOICED, None),  # no canceller in front
    (replace(BURST, echo_free=True), UNVOICED, 0.02),  # no echo on this line
    (replace(BURST, ref_db=-100.0), UNVOICED, 0.02),  # no bot audio in the lag range
], ids=["voiced", "cancelled-speech", "no-canceller", "echo-free", "bot-silent"])
def test_the_burst_veto_stands_aside(gate: GateReading, feat: WindowFeatures,
                                     clean: float | None) -> None:
    assert BargeInPolicy(replace(HAND, impulse_voicing=0.35)).is_caller(0.98, gate, feat,
                                                                       clean_prob=clean)


def test_the_burst_veto_looks_only_far_over_the_echo_and_only_when_set() -> None:
    under = replace(BURST, level_db=-42.0, unexplained_db=-42.5)  # 12 dB over the echo
    assert BargeInPolicy(replace(HAND, impulse_voicing=0.35, impulse_db=10.0)).is_caller(
        0.98, replace(under, echo_locked=False), VOICED, clean_prob=0.5)
    assert not BargeInPolicy(replace(HAND, impulse_voicing=0.35, impulse_db=10.0)).is_caller(
        0.98, under, UNVOICED, clean_prob=0.02)
    assert BargeInPolicy(replace(HAND, impulse_voicing=None)).is_caller(
        0.98, BURST, UNVOICED, clean_prob=0.02)


def test_a_key_tone_never_opens_a_caller_turn() -> None:
    """Silero calls a DTMF tone speech (p ~1) and it passes the gate; it still opens no turn,
    stops no bot, and a burst of keys between words does not keep a turn open."""
    tone = WindowFeatures(voicing=0.9, dtmf=0.9)
    loud = GateReading(level_db=-15.0, echo_db=-100.0, noise_db=-30.0, echo_locked=False,
                       passes=True)
    policy = BargeInPolicy()
    for _ in range(20):
        assert policy.step(1.0, loud, tone, BotState.INTERRUPTIBLE) == []
    assert policy.step(1.0, loud, VOICED, BotState.INTERRUPTIBLE) == []
    assert kinds(policy.step(1.0, loud, VOICED, BotState.INTERRUPTIBLE)) == [
        Decision.SPEECH_STARTED, Decision.PAUSE]
    out = kinds([d for _ in range(5)
                 for d in policy.step(1.0, loud, tone, BotState.INTERRUPTIBLE)])
    assert Decision.RESUME in out and Decision.SPEECH_STOPPED in out  # tones end the turn


# -- the state machine: pause, commit, resume, suppressed, and keys ---------------------------
CALLER = GateReading(level_db=-20.0, echo_db=-100.0, noise_db=-35.0, echo_locked=False,
                     passes=True)
SILENCE = GateReading(level_db=-60.0, echo_db=-100.0, noise_db=-60.0, echo_locked=False,
                      passes=False)
NOTHING = WindowFeatures(voicing=0.1, dtmf=0.0)
# The controller's views: an interruptible greeting playing, the same held by our pause, a
# disclosure that must be heard in full, and nothing on the line.
PLAYING = BotView(BotState.INTERRUPTIBLE, utterance_id="u1", interruptible=True, playing=True)
HELD = BotView(BotState.SILENT, utterance_id="u1", interruptible=True, paused=True)
DISCLOSURE = BotView(BotState.NON_INTERRUPTIBLE, utterance_id="d1", playing=True)
NONE = BotView(BotState.SILENT)


def _talk(policy: BargeInPolicy, windows: int, bot: BotView | BotState) -> list[Effect]:
    return [d for _ in range(windows) for d in policy.step(0.95, CALLER, VOICED, bot)]


def _quiet(policy: BargeInPolicy, windows: int, bot: BotView | BotState) -> list[Effect]:
    return [d for _ in range(windows) for d in policy.step(0.01, SILENCE, NOTHING, bot)]


def test_steps_pause_then_commit() -> None:
    policy = BargeInPolicy()
    assert _talk(policy, 1, PLAYING) == []
    assert _talk(policy, 1, PLAYING) == [
        SpeechStarted(over_uninterruptible=False, drop_reply=False), Pause("u1", 0.0)]
    assert policy.state is PolicyState.PAUSED
    assert not policy.gate_may_adapt and policy.in_speech
    # 640 ms of speech in all (20 windows) commits; the two that paused count.
    assert _talk(policy, 17, HELD) == []
    assert _talk(policy, 1, HELD) == [Interrupt(InterruptReason.SPEECH)]
    assert policy.state is PolicyState.INTERRUPTED
    assert _quiet(policy, 4, NONE) == []
    assert _quiet(policy, 1, NONE) == [SpeechStopped(over_uninterruptible=False, dropped=None)]
    assert policy.state is PolicyState.IDLE and policy.gate_may_adapt


def test_steps_pause_then_resume_on_a_backchannel() -> None:
    policy = BargeInPolicy()
    _quiet(policy, 3, PLAYING)  # the onset is measured from the first caller window
    assert kinds(_talk(policy, 6, PLAYING)) == [Decision.SPEECH_STARTED, Decision.PAUSE]
    assert policy.caller_onset_ms == 3 * 32.0
    assert _quiet(policy, 4, HELD) == []
    # It resumes the utterance it paused, and the words were a backchannel, no turn.
    assert _quiet(policy, 1, HELD) == [
        Resume("u1"), SpeechStopped(over_uninterruptible=False, dropped=DropReason.BACKCHANNEL)]
    assert policy.state is PolicyState.IDLE
    # The next turn is a turn again: the backchannel mark does not stay.
    _talk(policy, 2, NONE)
    assert _quiet(policy, 5, NONE) == [SpeechStopped(over_uninterruptible=False, dropped=None)]


def test_no_pause_where_there_is_nothing_to_clear_and_no_resume_after() -> None:
    """The bot was audible by the line's clock, but the head utterance is not playing (its
    audio all sent, the controller's view says so): the policy pauses nothing, and the short
    speech that follows resumes nothing and is a turn of its own."""
    policy = BargeInPolicy()
    sent = BotView(BotState.INTERRUPTIBLE, utterance_id="u1", interruptible=True)
    assert kinds(_talk(policy, 2, sent)) == [Decision.SPEECH_STARTED]
    assert policy.state is PolicyState.PAUSED
    assert _quiet(policy, 5, NONE) == [SpeechStopped(over_uninterruptible=False, dropped=None)]


def test_speech_before_the_reply_is_heard_drops_the_reply_and_pauses_nothing() -> None:
    policy = BargeInPolicy()
    reply = replace(PLAYING, reply_unheard=True)
    assert _talk(policy, 2, reply) == [SpeechStarted(over_uninterruptible=False,
                                                     drop_reply=True)]
    # A reply that must be heard in full is not dropped.
    held = BargeInPolicy()
    must = replace(DISCLOSURE, reply_unheard=True)
    assert _talk(held, 2, must)[0] == SpeechStarted(over_uninterruptible=True, drop_reply=False)


def test_steps_speech_over_a_non_interruptible_utterance_is_suppressed_once() -> None:
    policy = BargeInPolicy()
    assert _talk(policy, 2, DISCLOSURE) == [
        SpeechStarted(over_uninterruptible=True, drop_reply=False),
        Suppressed("d1", OverUninterruptible.KEEP)]
    assert policy.state is PolicyState.SPEAKING
    assert _talk(policy, 30, DISCLOSURE) == []  # never paused, told once
    assert _quiet(policy, 5, DISCLOSURE) == [SpeechStopped(over_uninterruptible=True,
                                                           dropped=None)]


def test_speech_over_a_non_interruptible_utterance_dropped_by_setting() -> None:
    policy = BargeInPolicy(BargeInSettings(
        speech_over_uninterruptible=OverUninterruptible.DROP))
    assert _talk(policy, 2, DISCLOSURE)[1] == Suppressed("d1", OverUninterruptible.DROP)
    assert _quiet(policy, 5, NONE) == [SpeechStopped(
        over_uninterruptible=True, dropped=DropReason.OVER_UNINTERRUPTIBLE)]
    # Speech after the disclosure is a turn, kept.
    _talk(policy, 2, NONE)
    assert _quiet(policy, 5, NONE) == [SpeechStopped(over_uninterruptible=False, dropped=None)]


def test_without_resume_on_backchannel_every_pause_commits() -> None:
    policy = BargeInPolicy(BargeInSettings(resume_on_backchannel=False))
    assert kinds(_talk(policy, 2, PLAYING)) == [Decision.SPEECH_STARTED, Decision.PAUSE,
                                                Decision.COMMIT]
    assert _quiet(policy, 5, NONE) == [SpeechStopped(over_uninterruptible=False, dropped=None)]


def test_a_key_stops_an_interruptible_prompt_with_its_own_decision() -> None:
    policy = BargeInPolicy()
    assert policy.on_dtmf(PLAYING) == [Interrupt(InterruptReason.DTMF)]
    assert kinds(policy.on_dtmf(PLAYING)) == [Decision.DTMF_INTERRUPT]
    assert policy.on_dtmf(DISCLOSURE) == []
    assert policy.on_dtmf(NONE) == []
    queued = BotView(BotState.SILENT, utterance_id="u2", interruptible=True)
    assert policy.on_dtmf(queued) == []  # nothing of it is on the line yet
    # A key while paused for speech ends the pause: the caller has taken the turn.
    _talk(policy, 2, PLAYING)
    assert policy.on_dtmf(HELD) == [Interrupt(InterruptReason.DTMF)]
    assert policy.state is PolicyState.INTERRUPTED
    assert _quiet(policy, 5, NONE) == [SpeechStopped(over_uninterruptible=False, dropped=None)]
    off = BargeInPolicy(replace(policy.settings, dtmf_interrupts=False))
    assert off.on_dtmf(PLAYING) == []


def test_a_voice_15_db_under_the_callers_own_is_not_them() -> None:
    """With caller_margin_db, a real turn teaches the caller's level; a TV 15 dB under it then
    starts nothing, the caller at their own level still does. A backchannel teaches nothing."""
    policy = BargeInPolicy(BargeInSettings(caller_margin_db=12.0))
    tv = replace(CALLER, level_db=-35.0)  # 15 dB under the caller's -20 dBFS
    assert kinds(_talk(policy, 3, BotState.SILENT))[:1] == [Decision.SPEECH_STARTED]
    _quiet(policy, 5, BotState.SILENT)
    assert policy.caller_db is None  # 96 ms: a backchannel, not a turn
    _talk(policy, 25, BotState.SILENT)
    _quiet(policy, 5, BotState.SILENT)
    assert policy.caller_db == -20.0
    assert [d for _ in range(10)
            for d in policy.step(0.95, tv, VOICED, BotState.INTERRUPTIBLE)] == []
    assert kinds(_talk(policy, 2, BotState.INTERRUPTIBLE)) == [Decision.SPEECH_STARTED,
                                                               Decision.PAUSE]
    off = BargeInPolicy()  # the default: off
    _talk(off, 25, BotState.SILENT)
    _quiet(off, 5, BotState.SILENT)
    assert off.step(0.95, tv, VOICED, BotState.INTERRUPTIBLE) == []
    assert kinds(off.step(0.95, tv, VOICED, BotState.INTERRUPTIBLE)) == [
        Decision.SPEECH_STARTED, Decision.PAUSE]


def test_resume_windows_shortens_the_wait_that_ends_a_pause() -> None:
    """``resume_windows`` ends a pause in a resume after that many quiet windows; a caller who
    is not paused still needs ``stop_windows`` to end their turn."""
    policy = BargeInPolicy(BargeInSettings(resume_windows=2))
    _talk(policy, 4, PLAYING)
    assert _quiet(policy, 1, HELD) == []
    assert kinds(_quiet(policy, 1, HELD)) == [Decision.RESUME, Decision.SPEECH_STOPPED]
    _talk(policy, 4, NONE)
    assert _quiet(policy, 4, NONE) == []
    assert kinds(_quiet(policy, 1, NONE)) == [Decision.SPEECH_STOPPED]


def test_carry_ms_counts_a_pause_after_a_quick_resume_as_the_same_barge_in() -> None:
    """With ``carry_ms``, speech that pauses the bot again soon after a resume adds to the
    speech the resumed pause had counted, so a caller pausing between words commits."""
    def run(policy: BargeInPolicy, extra_quiet: int = 0) -> list[Decision]:
        out = _talk(policy, 10, PLAYING) + _quiet(policy, 5, HELD)  # 320 ms, then resumed
        out += _quiet(policy, extra_quiet, PLAYING)
        out += _talk(policy, 10, PLAYING)  # 320 ms more: 640 ms with the first phrase
        return kinds(out)

    assert Decision.COMMIT not in run(BargeInPolicy())  # each phrase resumed over
    carried = run(BargeInPolicy(BargeInSettings(carry_ms=500.0)))
    assert carried.count(Decision.RESUME) == 1 and carried[-1] is Decision.COMMIT
    # Speech again 14 windows (448 ms) after the resume, past a 300 ms carry: from zero.
    assert Decision.COMMIT not in run(BargeInPolicy(BargeInSettings(carry_ms=300.0)), 12)


# Session 13. The caller reading on while the bot is paused, between two words: the bot's audio
# is out of the echo's lag range, Silero hears speech on both streams, and the gate's floor
# (learnt from the echo while the bot talked) fails the window.
DIP = GateReading(level_db=-46.0, echo_db=-100.0, noise_db=-44.0, echo_locked=True,
                  passes=False, ref_db=-100.0)


def _dip(policy: BargeInPolicy, windows: int, gate: GateReading = DIP) -> list[Effect]:
    return [d for _ in range(windows)
            for d in policy.step(0.99, gate, VOICED, HELD, clean_prob=0.99)]


def test_a_pause_is_held_over_the_dip_between_two_words() -> None:
    """``pause_hold_windows``: in a pause, windows Silero still calls speech with nothing of the
    bot's audio in the lag range do not count towards the resume, so the caller's next word
    goes on counting towards the commit; at most that many since the last speech window, and
    not while the bot's audio can still echo."""
    policy = BargeInPolicy(HAND)
    assert kinds(_talk(policy, 2, PLAYING)) == [Decision.SPEECH_STARTED, Decision.PAUSE]
    assert _talk(policy, 8, HELD) + _dip(policy, 8) == []  # 160 ms of dip: no resume
    assert kinds(_talk(policy, 10, HELD)) == [Decision.COMMIT]  # 640 ms of speech
    off = BargeInPolicy(replace(HAND, pause_hold_windows=None))
    _talk(off, 10, PLAYING)
    assert kinds(_dip(off, 5)) == [Decision.RESUME, Decision.SPEECH_STOPPED]
    # A background Silero hears holds a false pause 10 windows longer, never for good.
    capped = BargeInPolicy(HAND)
    _talk(capped, 2, PLAYING)
    assert _dip(capped, 14) == []
    assert kinds(_dip(capped, 1)) == [Decision.RESUME, Decision.SPEECH_STOPPED]
    # The bot's audio still in the lag range: that may be its echo's tail, no hold.
    echoing = BargeInPolicy(HAND)
    _talk(echoing, 2, PLAYING)
    assert kinds(_dip(echoing, 5, replace(DIP, ref_db=-20.0, erl_db=20.0))) == [
        Decision.RESUME, Decision.SPEECH_STOPPED]


# Session 14. In a pause, the bot's echo going on as if no clear had been sent (a recorded line
# cannot react): loud, Silero-certain, passing the gate, with none of the bot's real audio in
# the lag range; the gate's ghost copy, fed what the bot would have played, sees it follow that
# audio at the locked delay.
GOING_ON = GateReading(level_db=-30.0, echo_db=-100.0, noise_db=-60.0, echo_locked=True,
                       passes=True, ref_db=-100.0)
WOULD_BE = GateReading(level_db=-30.0, echo_db=-42.0, noise_db=-60.0, echo_locked=True,
                       passes=True, ref_db=-10.0, erl_db=20.0, follow_corr=0.95)


def _going_on(policy: BargeInPolicy, windows: int, ghost: GateReading | None = WOULD_BE,
              gate: GateReading = GOING_ON) -> list[Effect]:
    return [d for _ in range(windows)
            for d in policy.step(0.99, gate, VOICED, HELD, clean_prob=0.99, ghost=ghost)]


def test_a_pause_over_the_bots_own_audio_going_on_resumes() -> None:
    """``pause_echo_corr``: in a pause, a window whose recent past follows what the bot would
    have played is no speech and no held dip: the pause resumes, where the same windows
    counted as the caller commit it. A window that does not follow it is the caller's, and one
    while the bot's real audio is still in the lag range is judged as before."""
    policy = BargeInPolicy(HAND)
    assert kinds(_talk(policy, 2, PLAYING)) == [Decision.SPEECH_STARTED, Decision.PAUSE]
    assert _going_on(policy, 4) == []
    assert kinds(_going_on(policy, 1)) == [Decision.RESUME, Decision.SPEECH_STOPPED]
    assert not policy.in_speech

    def committed(p: BargeInPolicy, ghost: GateReading | None,
                  gate: GateReading = GOING_ON) -> bool:
        _talk(p, 2, PLAYING)
        return kinds(_going_on(p, 18, ghost, gate)) == [Decision.COMMIT]

    assert committed(BargeInPolicy(HAND), replace(WOULD_BE, follow_corr=0.3))  # a caller
    assert committed(BargeInPolicy(HAND), None)  # no copy kept
    assert committed(BargeInPolicy(replace(HAND, pause_echo_corr=None)), WOULD_BE)  # off
    # The bot's real audio still in the lag range: judged as with the rule off.
    tail = replace(GOING_ON, ref_db=-20.0, echo_db=-40.0, erl_db=20.0)
    on, off = BargeInPolicy(HAND), BargeInPolicy(replace(HAND, pause_echo_corr=None))
    for p in (on, off):
        _talk(p, 2, PLAYING)
    assert _going_on(on, 18, gate=tail) == _going_on(off, 18, gate=tail)
    # Outside a pause, with ``deaf_echo_corr`` off, the copy has no say: the same windows start
    # a turn and pause the bot.
    idle = BargeInPolicy(replace(HAND, deaf_echo_corr=None))
    assert kinds([d for _ in range(2)
                  for d in idle.step(0.99, GOING_ON, VOICED, PLAYING, ghost=WOULD_BE)]) == [
        Decision.SPEECH_STARTED, Decision.PAUSE]


def test_after_a_resume_the_bots_audio_running_ahead_pauses_nothing() -> None:
    """``deaf_echo_corr``: after a resume the gateway plays behind a line deaf to the clear,
    whose echo runs ahead (a recording replayed open loop). While the bot plays, windows whose
    recent past follow that line's audio and that the copy's gate explains start no turn; ones
    that do not follow it, or that the copy's gate passes (a caller over that echo), or with no
    copy kept, or the rule off, start one and pause the bot. A bot that is silent
    is not asked about: the rule is for the bot's own audio while it plays."""
    on = replace(HAND, deaf_echo_corr=0.85)

    def started(settings: BargeInSettings, ghost: GateReading | None,
                bot: BotView = PLAYING, windows: int = 2) -> list[Decision]:
        p = BargeInPolicy(settings)
        return kinds([d for _ in range(windows)
                      for d in p.step(0.99, GOING_ON, VOICED, bot, ghost=ghost)])

    explained = replace(WOULD_BE, passes=False)  # the copy's gate: its own echo, nothing over
    assert started(on, explained, windows=30) == []
    # A caller over that echo: the copy's gate passes the window; it starts a turn.
    assert started(on, WOULD_BE) == [Decision.SPEECH_STARTED, Decision.PAUSE]
    assert started(on, replace(explained, follow_corr=0.84)) == [Decision.SPEECH_STARTED,
                                                                 Decision.PAUSE]
    assert started(on, None) == [Decision.SPEECH_STARTED, Decision.PAUSE]
    assert started(replace(on, deaf_echo_corr=None), explained) == [Decision.SPEECH_STARTED,
                                                                    Decision.PAUSE]
    quiet = BotView(BotState.SILENT)
    assert started(on, explained, quiet) == [Decision.SPEECH_STARTED]
    # One window that follows it breaks the run: the caller needs two in a row again (windows
    # too near the floor to start a turn alone).
    p = BargeInPolicy(on)
    soft = replace(GOING_ON, level_db=-55.0)
    seq = [None, explained, None, None]
    got = [kinds(p.step(0.99, soft, VOICED, PLAYING, ghost=g)) for g in seq]
    assert got == [[], [], [], [Decision.SPEECH_STARTED, Decision.PAUSE]]


# A caller as loud as a strong echo: 4 dB over the predicted echo and the noise floor (the raw
# gate's 8/6 dB margins fail it), while the bot talks; AEC3 has removed the echo.
OVER_ECHO = GateReading(level_db=-26.0, echo_db=-30.0, noise_db=-30.0, echo_locked=True,
                        passes=False, ref_db=-10.0, erl_db=20.0, echo_corr=0.9)
CLEAN = BargeInSettings(clean_on=0.5, clean_echo_db=3.0, clean_noise_db=3.0,
                        clean_after_ms=320.0)


def _bot_talked(policy: BargeInPolicy, ms: float) -> None:
    quiet = replace(OVER_ECHO, level_db=-45.0)  # the bot's echo alone, cancelled
    for _ in range(int(ms // 32)):
        assert policy.step(0.9, quiet, VOICED, BotState.INTERRUPTIBLE, clean_prob=0.02) == []


def test_clean_path_hears_the_caller_the_raw_gate_holds() -> None:
    policy = BargeInPolicy(CLEAN)
    _bot_talked(policy, 352.0)
    assert not BargeInPolicy().is_caller(0.98, OVER_ECHO, VOICED, clean_prob=0.9)  # off
    assert policy.is_caller(0.98, OVER_ECHO, VOICED, clean_prob=0.9)
    assert policy.step(0.98, OVER_ECHO, VOICED, BotState.INTERRUPTIBLE, clean_prob=0.9) == []
    assert kinds(policy.step(0.98, OVER_ECHO, VOICED, BotState.INTERRUPTIBLE,
                             clean_prob=0.9)) == [Decision.SPEECH_STARTED, Decision.PAUSE]


@pytest.mark.parametrize(("gate", "feat", "clean"), [
    (OVER_ECHO, VOICED, 0.3),  # Silero does not hear speech once the echo is removed
    (OVER_ECHO, VOICED, None),  # no canceller in front
    (replace(OVER_ECHO, level_db=-28.0), VOICED, 0.9),  # 2 dB over the echo: under the margin
    (replace(OVER_ECHO, noise_db=-27.0), VOICED, 0.9),  # babble: 1 dB over the noise floor
    (replace(OVER_ECHO, ref_db=-100.0, echo_db=-100.0), VOICED, 0.9),  # the bot is silent
    (OVER_ECHO, WindowFeatures(voicing=0.75, dtmf=0.8), 0.9),  # a key tone AEC3 leaves in
])
def test_clean_path_guards(gate: GateReading, feat: WindowFeatures, clean: float | None) -> None:
    policy = BargeInPolicy(CLEAN)
    _bot_talked(policy, 352.0)
    assert not policy.is_caller(0.98, gate, feat, clean_prob=clean)


def test_clean_path_waits_for_the_bot_turn_to_settle() -> None:
    """AEC3 lets the first few hundred ms of a bot turn's echo through after a silence."""
    policy = BargeInPolicy(CLEAN)
    _bot_talked(policy, 160.0)
    assert not policy.is_caller(0.98, OVER_ECHO, VOICED, clean_prob=0.9)
    _bot_talked(policy, 192.0)
    assert policy.is_caller(0.98, OVER_ECHO, VOICED, clean_prob=0.9)
    silent = replace(QUIET_LINE, level_db=-60.0)
    policy.step(0.01, silent, VOICED, BotState.SILENT, clean_prob=0.01)  # a gap: count again
    assert not policy.is_caller(0.98, OVER_ECHO, VOICED, clean_prob=0.9)


def test_the_engine_computes_features_for_clean_path_candidates() -> None:
    assert wants_features(OVER_ECHO, -55.0)  # the clean path reads its DTMF-likeness
    assert not wants_features(replace(OVER_ECHO, level_db=-31.0), -55.0)  # under the echo
    assert not wants_features(replace(OVER_ECHO, ref_db=-100.0), -55.0)  # no bot audio


# A caller in the bot's first 200 ms: 4 dB over the raw gate's pre-lock prediction (its 8 dB
# margin fails it), AEC3 not converged (the cancelled window scores 0.05: the echo veto would
# hold it), Silero slow on the raw window; but the bot's lagged envelope explains none of it.
FIRST_TURN_CALLER = GateReading(level_db=-22.0, echo_db=-26.0, noise_db=-40.0,
                                echo_locked=False, passes=False, ref_db=-14.0, erl_db=12.0,
                                echo_corr=1.0, unexplained_db=-22.5)
EXPLAIN = replace(HAND, explain_share_db=2.0, explain_noise_db=9.0, explain_voicing_min=0.6,
                          explain_until_ms=960.0, explain_background_db=None,
                          explain_floor_pct=None, background_db=None, background_pct=75.0)


def test_unexplained_path_hears_a_caller_in_the_bots_first_words() -> None:
    off = BargeInPolicy(BargeInSettings(explain_share_db=None))
    assert not off.is_caller(0.98, FIRST_TURN_CALLER, VOICED, clean_prob=0.05)
    policy = BargeInPolicy(EXPLAIN)
    assert policy.is_caller(0.98, FIRST_TURN_CALLER, VOICED, clean_prob=0.05)
    assert policy.is_caller(0.2, FIRST_TURN_CALLER, VOICED, clean_prob=0.05)  # voiced 0.75
    assert policy.step(0.3, FIRST_TURN_CALLER, VOICED, BotState.INTERRUPTIBLE,
                       clean_prob=0.05) == []
    assert kinds(policy.step(0.98, FIRST_TURN_CALLER, VOICED, BotState.INTERRUPTIBLE,
                             clean_prob=0.05)) == [Decision.SPEECH_STARTED, Decision.PAUSE]


@pytest.mark.parametrize(("prob", "gate", "feat"), [
    (0.98, replace(FIRST_TURN_CALLER, unexplained_db=-30.0), VOICED),  # 8 dB of it is echo
    (0.98, replace(FIRST_TURN_CALLER, noise_db=-28.0), VOICED),  # 5.5 dB over the noise
    (0.98, replace(FIRST_TURN_CALLER, ref_db=-100.0, echo_db=-100.0), VOICED),  # bot silent
    (0.98, FIRST_TURN_CALLER, WindowFeatures(voicing=0.75, dtmf=0.8)),  # a key tone
    (0.3, FIRST_TURN_CALLER, WindowFeatures(voicing=0.4, dtmf=0.0)),  # a cough: not speech
    (0.98, replace(FIRST_TURN_CALLER, level_db=-58.0, unexplained_db=-58.0, noise_db=-70.0),
     VOICED),  # under the gate's absolute floor
])
def test_unexplained_path_guards(prob: float, gate: GateReading, feat: WindowFeatures) -> None:
    assert not BargeInPolicy(EXPLAIN).is_caller(prob, gate, feat, clean_prob=0.05)


def test_unexplained_path_is_for_the_first_turn_only() -> None:
    """``explain_until_ms``: once the bot has been audible that long on the call, AEC3 and the
    gate's locked delay know the line; the path stands aside."""
    policy = BargeInPolicy(EXPLAIN)
    echo = replace(FIRST_TURN_CALLER, level_db=-45.0, unexplained_db=-70.0)
    for _ in range(30):  # 960 ms of the bot's echo alone
        assert policy.step(0.9, echo, VOICED, BotState.INTERRUPTIBLE, clean_prob=0.02) == []
    assert policy.is_caller(0.98, FIRST_TURN_CALLER, VOICED, clean_prob=0.05)
    policy.step(0.9, echo, VOICED, BotState.INTERRUPTIBLE, clean_prob=0.02)
    assert not policy.is_caller(0.98, FIRST_TURN_CALLER, VOICED, clean_prob=0.05)


def test_explained_veto_holds_a_window_the_bots_envelope_explains() -> None:
    loud = replace(FIRST_TURN_CALLER, passes=True, echo_db=-32.0, unexplained_db=-50.0)
    assert BargeInPolicy(BargeInSettings(explain_veto_db=None)).is_caller(0.98, loud, VOICED)
    assert not BargeInPolicy(BargeInSettings(explain_veto_db=20.0)).is_caller(0.98, loud, VOICED)
    free = replace(loud, echo_free=True)  # on an echo-free line the fit explains noise only
    assert BargeInPolicy(BargeInSettings(explain_veto_db=20.0)).is_caller(0.98, free, VOICED)


def test_the_engine_computes_features_for_unexplained_path_candidates() -> None:
    assert wants_features(FIRST_TURN_CALLER, -55.0)
    assert not wants_features(replace(FIRST_TURN_CALLER, echo_db=-20.0, unexplained_db=-40.0),
                              -55.0)


def _before_the_bot(policy: BargeInPolicy, level_db: float) -> None:
    """A second of the line with the bot silent (``level_db``: its background), then the bot's
    first window of audio in the echo's lag range."""
    silent = replace(QUIET_LINE, level_db=level_db, noise_db=level_db - 3.0)
    for _ in range(31):
        assert policy.step(0.1, silent, VOICED, BotState.SILENT) == []
    echo = replace(FIRST_TURN_CALLER, level_db=-45.0, unexplained_db=-70.0)
    assert policy.step(0.1, echo, VOICED, BotState.INTERRUPTIBLE, clean_prob=0.02) == []


def test_unexplained_path_stands_aside_for_a_background_there_before_the_bot() -> None:
    """``explain_background_db``: a TV at -30 dBFS was on the line before the bot talked; its
    voice is no more the bot's envelope than a caller is, so only what stands 6 dB over it is."""
    settings = replace(EXPLAIN, explain_background_db=6.0)
    tv = replace(FIRST_TURN_CALLER, level_db=-28.0, unexplained_db=-28.5, noise_db=-45.0)
    policy = BargeInPolicy(settings)
    _before_the_bot(policy, -30.0)
    assert not policy.is_caller(0.98, tv, VOICED, clean_prob=0.05)
    assert policy.is_caller(0.98, FIRST_TURN_CALLER, VOICED, clean_prob=0.05)  # 7.5 dB over
    quiet = BargeInPolicy(settings)
    _before_the_bot(quiet, -62.0)  # a quiet line: the same window is a barge-in
    assert quiet.is_caller(0.98, tv, VOICED, clean_prob=0.05)
    unfloored = BargeInPolicy(EXPLAIN)
    _before_the_bot(unfloored, -30.0)
    assert unfloored.is_caller(0.98, tv, VOICED, clean_prob=0.05)


# Session 8. A TV 15-25 dB under the caller, on the line before the bot talked: its loudest
# window of that second was -30 dBFS. While the bot talks, one of its louder syllables passes the
# raw gate (11 dB over the noise median, far over the predicted echo) and Silero calls it speech.
TV_SYLLABLE = GateReading(level_db=-24.0, echo_db=-45.0, noise_db=-35.0, echo_locked=True,
                          passes=True, ref_db=-25.0, erl_db=20.0, echo_corr=0.9,
                          unexplained_db=-25.0)


def _line_before_the_bot(policy: BargeInPolicy, levels: list[float]) -> None:
    """The bot silent while the line carries ``levels`` (a window each), then the bot's first
    window of audio in the echo's lag range (quiet: nothing the caller said)."""
    for level in levels:
        silent = replace(QUIET_LINE, level_db=level, noise_db=-40.0)
        assert policy.step(0.1, silent, NOTHING, BotState.SILENT) == []
    echo = replace(TV_SYLLABLE, level_db=-50.0, passes=False, unexplained_db=-70.0)
    assert policy.step(0.1, echo, NOTHING, BotState.INTERRUPTIBLE, clean_prob=0.9) == []


def test_every_path_stands_aside_for_a_background_there_before_the_bot() -> None:
    """``background_db``: while the bot talks, a window must stand that far over the loudest
    window of the second before it came in (``background_pct`` 100), whichever path heard it:
    here the raw gate, which a TV's syllable passes. The caller 9 dB over it is heard; so is the
    same syllable on a line that was quiet before the bot, and with the floor off."""
    settings = replace(HAND, background_db=9.0, background_pct=100.0)
    tv_line = [-40.0] * 20 + [-30.0] + [-36.0] * 10
    policy = BargeInPolicy(settings)
    _line_before_the_bot(policy, tv_line)
    assert not policy.is_caller(0.98, TV_SYLLABLE, VOICED, clean_prob=0.9)
    assert [d for _ in range(10)
            for d in policy.step(0.98, TV_SYLLABLE, VOICED, PLAYING, clean_prob=0.9)] == []
    caller = replace(TV_SYLLABLE, level_db=-21.0, unexplained_db=-21.5)
    assert policy.is_caller(0.98, caller, VOICED, clean_prob=0.9)
    quiet = BargeInPolicy(settings)
    _line_before_the_bot(quiet, [-62.0] * 31)
    assert quiet.is_caller(0.98, TV_SYLLABLE, VOICED, clean_prob=0.9)
    off = BargeInPolicy(replace(settings, background_db=None))
    _line_before_the_bot(off, tv_line)
    assert off.is_caller(0.98, TV_SYLLABLE, VOICED, clean_prob=0.9)
    # With the bot's audio out of the lag range the floor does not apply (nothing to pause).
    silent_bot = replace(TV_SYLLABLE, ref_db=-100.0, echo_db=-100.0)
    assert policy.is_caller(0.98, silent_bot, VOICED)


def test_the_background_is_never_the_callers_own_voice() -> None:
    """``background_caller_db``: a caller who answered in the bot's silence left their own level
    in that second; once their turn has taught the policy their level, the background is taken
    no higher than that far under it, so their barge-in on the next prompt is heard."""
    settings = replace(HAND, background_db=9.0, background_pct=100.0,
                               background_caller_db=18.0)
    policy = BargeInPolicy(settings)
    assert kinds(_talk(policy, 25, BotState.SILENT))[:1] == [Decision.SPEECH_STARTED]
    _quiet(policy, 5, BotState.SILENT)
    assert policy.caller_db == -20.0  # CALLER's level, and the loudest of the last second
    _line_before_the_bot(policy, [-60.0])
    barge = replace(TV_SYLLABLE, level_db=-19.0, unexplained_db=-19.5)
    assert policy.is_caller(0.98, barge, VOICED, clean_prob=0.9)
    uncapped = BargeInPolicy(replace(settings, background_caller_db=None))
    _talk(uncapped, 25, BotState.SILENT)
    _quiet(uncapped, 5, BotState.SILENT)
    _line_before_the_bot(uncapped, [-60.0])
    assert not uncapped.is_caller(0.98, barge, VOICED, clean_prob=0.9)


def test_a_short_turn_before_the_prompt_does_not_teach_the_cap() -> None:
    """The known limit ``background_caller_db`` says: a "yes" (10 windows: no real turn, so no
    ``caller_db``) just before the prompt is the loudest window of that second, and a short
    turn teaches no cap (on train the TV's and babble's own short "turns" would cancel the
    floor): a barge-in at the answer's level is held, one 9 dB over it is heard."""
    settings = replace(HAND, background_db=9.0, background_pct=100.0,
                               background_caller_db=18.0)
    policy = BargeInPolicy(settings)
    assert kinds(_talk(policy, 10, BotState.SILENT))[:1] == [Decision.SPEECH_STARTED]
    _quiet(policy, 15, BotState.SILENT)
    assert policy.state is PolicyState.IDLE and policy.caller_db is None
    _line_before_the_bot(policy, [-60.0])
    at_their_level = replace(TV_SYLLABLE, level_db=-19.0, unexplained_db=-19.5)
    assert not policy.is_caller(0.98, at_their_level, VOICED, clean_prob=0.9)
    louder = replace(TV_SYLLABLE, level_db=-10.0, unexplained_db=-10.5)
    assert policy.is_caller(0.98, louder, VOICED, clean_prob=0.9)


def test_a_background_under_a_pause_neither_commits_it_nor_holds_it() -> None:
    """``background_in_pause``: the TV that was on the line before the bot goes on once a
    caller's "yes" paused it and the bot's audio left the lag range. Its syllables, under
    the floor, end the pause in a resume; without the setting they count as the caller and
    commit it. A caller who goes on 9 dB over that background still commits it."""
    tv_line = [-40.0] * 20 + [-30.0] + [-36.0] * 10
    caller = replace(TV_SYLLABLE, level_db=-18.0, unexplained_db=-18.5)
    tv_in_pause = replace(TV_SYLLABLE, ref_db=-100.0, echo_db=-100.0)
    caller_in_pause = replace(caller, ref_db=-100.0, echo_db=-100.0)
    for on, windows, expected in ((True, tv_in_pause, [Decision.RESUME, Decision.SPEECH_STOPPED]),
                                  (False, tv_in_pause, [Decision.COMMIT]),
                                  (True, caller_in_pause, [Decision.COMMIT])):
        policy = BargeInPolicy(replace(HAND, background_db=9.0, background_pct=100.0,
                                       background_in_pause=on))
        _line_before_the_bot(policy, tv_line)
        paused = [d for _ in range(2)
                  for d in policy.step(0.98, caller, VOICED, PLAYING, clean_prob=0.9)]
        assert kinds(paused) == [Decision.SPEECH_STARTED, Decision.PAUSE]
        for _ in range(25):  # up to the pause's first decision
            after = kinds(policy.step(0.98, windows, VOICED, HELD, clean_prob=0.9))
            if after:
                break
        assert after == expected, (on, windows.level_db)


def test_a_voice_already_talking_when_the_bot_comes_in_is_its_background() -> None:
    """The other known limit of ``background_caller_db``: a voice that is talking when the bot's
    audio comes into the lag range is the second before it, so it is the background and the bot
    talks on over it. For a babble's or a TV's "turn" that is the point (capping the background
    under the turn in progress cost the check split's babble point 8/8 -> 5/8); a caller who
    began in a gap of 520 ms or more between two utterances is talked over too. Without the
    floor (main before session 8) the same steps pause and commit."""
    talking_over = replace(CALLER, ref_db=-25.0, echo_db=-45.0, unexplained_db=-20.5)
    floored = BargeInPolicy(HAND)
    unfloored = BargeInPolicy(replace(HAND, background_db=None))
    for policy, expected in ((floored, []), (unfloored, [Decision.PAUSE, Decision.COMMIT])):
        assert kinds(_talk(policy, 10, BotState.SILENT)) == [Decision.SPEECH_STARTED]
        over = [d for _ in range(20)
                for d in policy.step(0.95, talking_over, VOICED, PLAYING, clean_prob=0.9)]
        assert kinds(over) == expected
    assert floored.state is PolicyState.SPEAKING


def test_the_band_path_keeps_its_own_floor_under_a_background() -> None:
    """The voiced-band path (echo-free lines) stands beside ``background_db``: a voice 5 dB over
    a kitchen's clatter is under the clatter's loudest window, and its band floor hears it."""
    policy = BargeInPolicy(replace(HAND, background_db=9.0, background_pct=100.0))
    _line_before_the_bot(policy, [-38.0] * 30 + [-28.0])
    voice = replace(MASKED_VOICE, ref_db=-20.0)
    assert policy.is_caller(0.05, voice, VOICED)
    assert not policy.is_caller(0.98, replace(voice, echo_free=False, passes=True), VOICED)


# A caller on a 6 dB ERL line: the gate's noise floor (a median of the inbound) has learnt the
# bot's echo (-30 dBFS), while what the bot's envelope leaves unexplained of the line is its room
# tone (-60 dBFS). The caller's window is all but unexplained, 1.5 dB over that "noise".
STRONG_ECHO_CALLER = GateReading(level_db=-28.0, echo_db=-31.0, noise_db=-29.5, echo_locked=True,
                                 passes=False, ref_db=-10.0, erl_db=6.0, echo_corr=0.9,
                                 unexplained_db=-29.0)


def test_the_unexplained_path_measures_against_what_the_echo_does_not_explain() -> None:
    """``explain_floor_pct``: the unexplained-energy path's noise floor is a percentile of the
    unexplained energy of the last 2 s of windows where nobody talked, not the gate's median of
    the inbound (which holds the echo): the caller on a strong echo line is heard."""
    settings = replace(EXPLAIN, explain_until_ms=None, explain_floor_pct=75.0)
    echo = replace(STRONG_ECHO_CALLER, level_db=-30.0, unexplained_db=-60.0)
    policy = BargeInPolicy(settings)
    off = BargeInPolicy(replace(settings, explain_floor_pct=None))
    for p in (policy, off):
        for _ in range(40):
            assert p.step(0.9, echo, NOTHING, PLAYING, clean_prob=0.01) == []
    assert policy.is_caller(0.98, STRONG_ECHO_CALLER, VOICED, clean_prob=0.01)
    assert not off.is_caller(0.98, STRONG_ECHO_CALLER, VOICED, clean_prob=0.01)
    # A background that the bot's envelope does not explain either is learnt by that floor.
    tv = replace(echo, unexplained_db=-31.0)
    masked = BargeInPolicy(settings)
    for _ in range(40):
        masked.step(0.2, tv, NOTHING, PLAYING, clean_prob=0.01)
    assert not masked.is_caller(0.98, STRONG_ECHO_CALLER, VOICED, clean_prob=0.01)


# An echo path that just got louder (or moved): the gate's locked lag and its slow echo-gain
# median predict the echo 15 dB under the window, and AEC3 has not re-converged (the cancelled
# window still scores 0.6), so the raw gate calls the bot's own voice the caller. The line's
# 160 ms before it, fitted at every delay, predict the window to within 1 dB.
CHANGED_PATH_ECHO = GateReading(level_db=-24.0, echo_db=-39.0, noise_db=-45.0, echo_locked=True,
                                passes=True, ref_db=-10.0, erl_db=25.0, echo_corr=0.9,
                                unexplained_db=-34.0, prior_echo_db=-25.0, prior_fit=0.9)


def test_an_echo_the_line_just_before_predicts_never_begins_a_turn() -> None:
    """``prior_margin_db``: the window that would begin a caller run while the bot talks must
    stand that far over the echo the line's recent past predicts; the shipped decision without
    it pauses for the changed path's echo."""
    guarded = BargeInPolicy(replace(HAND, prior_margin_db=3.0))
    unguarded = BargeInPolicy(replace(HAND, prior_margin_db=None))
    echo = [d for _ in range(20)
            for d in guarded.step(0.99, CHANGED_PATH_ECHO, VOICED, PLAYING, clean_prob=0.6)]
    assert echo == []
    # Where the fit explains little of the history (a voice in it), it predicts nothing.
    loose = BargeInPolicy(replace(HAND, prior_margin_db=3.0))
    assert loose.is_caller(0.99, replace(CHANGED_PATH_ECHO, prior_fit=0.3), VOICED,
                           clean_prob=0.6)
    assert kinds([d for _ in range(2) for d in unguarded.step(
        0.99, CHANGED_PATH_ECHO, VOICED, PLAYING, clean_prob=0.6)]) == [
        Decision.SPEECH_STARTED, Decision.PAUSE]


def test_a_caller_over_the_predicted_echo_begins_a_turn_and_is_not_held_after() -> None:
    """The caller's first window stands over what the echo's past predicts; once their run has
    begun, the windows after it are not held by the prediction (their own first window is in
    the history it is fitted on by then)."""
    policy = BargeInPolicy(replace(HAND, prior_margin_db=3.0))
    first = replace(CHANGED_PATH_ECHO, level_db=-18.0, unexplained_db=-19.0)
    second = replace(first, prior_echo_db=-19.0)  # the fit has learnt the caller's first window
    assert policy.step(0.99, first, VOICED, PLAYING, clean_prob=0.9) == []
    assert kinds(policy.step(0.99, second, VOICED, PLAYING, clean_prob=0.9)) == [
        Decision.SPEECH_STARTED, Decision.PAUSE]


def test_a_held_window_does_not_hold_the_caller_the_fit_then_learns() -> None:
    """``prior_explained_db``: a held window leaves the run at 0, so the window after it is
    tested too, with the held one in the history; where that is the caller's onset the fit
    learns their voice and predicts the next window at its own level. The gate's lagged
    envelope explains a changed path's echo but not a caller: with the requirement that
    window begins the run; without it (h12's first version) it is held again."""
    onset = replace(CHANGED_PATH_ECHO, level_db=-22.0)  # held: 3 dB over a well-fitted echo
    caller = replace(CHANGED_PATH_ECHO, level_db=-18.0, unexplained_db=-19.0,
                     prior_echo_db=-18.0)  # the fit's prediction: the caller's own level
    fixed = BargeInPolicy(replace(HAND, prior_margin_db=4.5, prior_explained_db=3.0))
    first = BargeInPolicy(replace(HAND, prior_margin_db=4.5, prior_explained_db=None))
    for policy in (fixed, first):
        assert not policy.is_caller(0.99, onset, VOICED, clean_prob=0.9)
        assert policy.step(0.99, onset, VOICED, PLAYING, clean_prob=0.9) == []
    assert fixed.is_caller(0.99, caller, VOICED, clean_prob=0.9)
    assert not first.is_caller(0.99, caller, VOICED, clean_prob=0.9)
    assert fixed.step(0.99, caller, VOICED, PLAYING, clean_prob=0.9) == []
    assert kinds(fixed.step(0.99, caller, VOICED, PLAYING, clean_prob=0.9)) == [
        Decision.SPEECH_STARTED, Decision.PAUSE]


# -- the caller classifier's fast path (classifier_on) ---------------------------------------
def _sure(score: float) -> CallerClassifier:
    """A network that gives every window ``score``, whatever it reads."""
    n = 37  # CallerFeatures' inputs
    logit = float(np.log(score / (1.0 - score)))
    return CallerClassifier(np.zeros(n), np.ones(n), np.zeros((n, 2)), np.zeros(2),
                            np.zeros(2), logit)


FAST = BargeInSettings(classifier_on=0.5, classifier_windows=2)
# A window no hand-set path takes for the caller (Silero low, the gate shut), while the bot
# talks, over the floors and in the clean path's feature candidates (features computed):
HELD_BY_PATHS = replace(OVER_ECHO, echo_locked=False, noise_db=-40.0)


def _fast(policy: BargeInPolicy, windows: int, bot: BotView, feat: WindowFeatures = VOICED,
          gate: GateReading = HELD_BY_PATHS, clean: float | None = 0.1) -> list[Effect]:
    return [d for _ in range(windows)
            for d in policy.step(0.05, gate, feat, bot, clean_prob=clean)]


def test_the_classifier_fast_path_pauses_after_its_windows() -> None:
    assert wants_features(HELD_BY_PATHS, -55.0)
    assert _fast(BargeInPolicy(replace(FAST, classifier_on=None), _sure(0.99)), 10,
                 PLAYING) == []  # off: the paths alone hold these windows
    assert _fast(BargeInPolicy(FAST, _sure(0.4)), 10, PLAYING) == []  # under classifier_on
    policy = BargeInPolicy(FAST, _sure(0.99))
    assert _fast(policy, 2, PLAYING) == []  # a run begins at its second fast window ...
    assert kinds(_fast(policy, 1, PLAYING)) == [Decision.SPEECH_STARTED, Decision.PAUSE]
    assert policy.score == pytest.approx(0.99)


def test_the_classifier_never_stops_a_non_interruptible_utterance() -> None:
    policy = BargeInPolicy(FAST, _sure(0.99))
    out = _fast(policy, 40, DISCLOSURE)
    assert kinds(out) == [Decision.SPEECH_STARTED, Decision.SUPPRESSED]
    assert out[0] == SpeechStarted(over_uninterruptible=True, drop_reply=False)


@pytest.mark.parametrize(("gate", "feat", "clean"), [
    (HELD_BY_PATHS, WindowFeatures(voicing=0.9, dtmf=0.9), 0.1),  # a key tone
    (HELD_BY_PATHS, VOICED, None),  # no canceller in front: the classifier is not run
    (replace(HELD_BY_PATHS, level_db=-58.0, noise_db=-70.0, echo_db=-70.0), VOICED, 0.1),
    (replace(HELD_BY_PATHS, level_db=-40.0), VOICED, 0.1),  # no features computed for it
    # 4 dB over the line's noise floor, under classifier_noise_db (a babble's own floor)
    (replace(HELD_BY_PATHS, noise_db=-30.0), VOICED, 0.1),
])
def test_the_classifier_fast_path_guards(gate: GateReading, feat: WindowFeatures,
                                         clean: float | None) -> None:
    policy = BargeInPolicy(FAST, _sure(0.99))
    assert _fast(policy, 20, PLAYING, feat, gate, clean) == []
    assert policy.score == (0.0 if clean is None else pytest.approx(0.99))


def test_the_classifier_veto_holds_a_window_the_paths_take() -> None:
    # bot audio in range; the caller's energy is not the bot's envelope (explain_veto_db)
    echoing = replace(CALLER, ref_db=-16.0, erl_db=30.0, echo_db=-46.0, unexplained_db=-20.0)

    def run(score: float, gate: GateReading = echoing) -> list[Decision]:
        policy = BargeInPolicy(BargeInSettings(classifier_veto=0.1), _sure(score))
        return kinds([d for _ in range(3)
                      for d in policy.step(0.95, gate, VOICED, PLAYING, clean_prob=0.9)])

    assert run(0.05) == []
    assert run(0.5) == [Decision.SPEECH_STARTED, Decision.PAUSE]
    # With no bot audio in the echo's lag range the classifier has no say (the turn detector
    # reads these runs): the paths alone decide.
    assert run(0.05, CALLER) == [Decision.SPEECH_STARTED, Decision.PAUSE]


def test_the_veto_is_stricter_in_a_pause_whose_lag_range_has_drained() -> None:
    """``classifier_drained_veto``: once none of the bot's audio is in the echo's lag range, a
    paused window the classifier scores under it is no speech towards ``commit_ms``, though it
    still holds the pause (``max_pause_ms`` commits it in the end); with bot audio in range,
    or ``classifier_drained_noise_db`` over the noise floor, ``classifier_veto`` alone
    applies."""
    echoing = replace(CALLER, ref_db=-16.0, erl_db=30.0, echo_db=-46.0, unexplained_db=-20.0)
    assert CALLER.ref_db <= -99.0  # nothing of the bot's in the lag range

    def pause(drained: float | None, score: float, gate: GateReading,
              windows: int) -> list[Decision]:
        policy = BargeInPolicy(BargeInSettings(classifier_veto=0.5,
                                               classifier_drained_veto=drained), _sure(score))
        out = [d for _ in range(2)
               for d in policy.step(0.95, echoing, VOICED, PLAYING, clean_prob=0.9)]
        out += [d for _ in range(windows)
                for d in policy.step(0.95, gate, VOICED, HELD, clean_prob=0.9)]
        return kinds(out)

    started = [Decision.SPEECH_STARTED, Decision.PAUSE]
    assert pause(0.7, 0.6, CALLER, 30) == started  # held back, the pause held: no resume
    assert pause(0.7, 0.8, CALLER, 30) == started + [Decision.COMMIT]
    assert pause(None, 0.6, CALLER, 30) == started + [Decision.COMMIT]  # classifier_veto's
    assert pause(0.7, 0.6, echoing, 30) == started + [Decision.COMMIT]  # bot audio in range
    assert pause(0.7, 0.6, CALLER, 2600 // 32) == started + [Decision.COMMIT]  # max_pause_ms
    # classifier_drained_noise_db (20 dB): CALLER stands 15 dB over the floor; 25 dB over it
    # the window counts at classifier_veto.
    assert CALLER.level_db - CALLER.noise_db < 20.0
    loud = replace(CALLER, noise_db=-45.0)
    assert pause(0.7, 0.6, loud, 30) == started + [Decision.COMMIT]


def test_the_classifier_fast_path_waits_for_bot_audio_in_the_lag_range() -> None:
    silent = replace(HELD_BY_PATHS, ref_db=-100.0, passes=True)  # features computed, no path
    assert wants_features(silent, -55.0)
    assert not BargeInPolicy(HAND).is_caller(0.05, silent, VOICED, clean_prob=0.1)
    policy = BargeInPolicy(FAST, _sure(0.99))
    assert _fast(policy, 10, PLAYING, gate=silent) == []
    assert policy.score == pytest.approx(0.99)  # stepped all the same


def test_classifier_windows_below_one_is_refused() -> None:
    # 0 would open the fast path on every window with features (the run counter starts at 0).
    with pytest.raises(ValueError, match="classifier_windows"):
        BargeInSettings(classifier_windows=0)


def test_a_line_that_follows_the_deaf_line_is_not_echo_free() -> None:
    """``deaf_not_free_corr``: after a resume behind a line deaf to the clear, the line's echo
    runs ahead of what the gateway plays, the gate loses its lock and reads the line as
    echo-free, which opens the voiced-band path (echo-free lines only) to that echo. Where the
    gate copy hears the line follow what the deaf line plays, the line is not echo-free: a
    window only the band path takes for the caller starts no pause. Without the copy's say,
    or with a copy the line does not follow, it does."""
    voice = replace(MASKED_VOICE, ref_db=-20.0)  # echo-free by the gate, the band path's
    follows = replace(voice, follow_corr=0.8)
    for ghost, limit, expected in ((follows, 0.5, []),
                                   (follows, None, [Decision.SPEECH_STARTED, Decision.PAUSE]),
                                   (replace(follows, follow_corr=0.3), 0.5,
                                    [Decision.SPEECH_STARTED, Decision.PAUSE]),
                                   (None, 0.5, [Decision.SPEECH_STARTED, Decision.PAUSE])):
        policy = BargeInPolicy(replace(HAND, deaf_not_free_corr=limit))
        effects = [d for _ in range(2)
                   for d in policy.step(0.05, voice, VOICED, PLAYING, ghost=ghost)]
        assert kinds(effects) == expected, (ghost, limit)
