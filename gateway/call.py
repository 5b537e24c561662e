"""One call on the gateway: Twilio frames in, bot audio out, barge-in decided locally.

:class:`CallSession` is the call controller. It owns no socket: it gets Twilio's text frames from
whoever holds the WebSocket (the aiohttp handler, or the replay's Twilio stand-in), sends through
an injected ``send`` coroutine, and talks to the session worker only through the bus.

Per inbound ``media`` frame it decodes the mu-law payload and runs the call's stream on the shared
VAD engine, which scores every 32 ms window of all calls in batches: Silero, the call's echo/noise
gate (fed with the bot audio the call sends) and the window's features. For each window it then
steps :class:`vad.BargeInPolicy`, which holds the whole decision, and carries out the effects it
returns *at once*, without a round trip to the worker: ``clear`` to Twilio and the utterance's audio held back (pause), then,
once the caller has clearly taken the turn, the utterance dropped and ``interrupt`` published with
what the caller heard (from echoed marks). Utterances of non-interruptible nodes are never
cleared; speech over them is published as ``interrupt_suppressed``.

Frames that do not parse are logged with the reason and skipped; nothing a caller or a broken
proxy sends can end the call except ``stop`` or the socket closing.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from audio import TELEPHONY_RATE, ulaw_to_float32, ulaw_to_pcm16
from bus import Bus, CallInfo, EventDecodeError
from bus import protocol as bp
from vad import (
    AecMode,
    BargeInPolicy,
    BargeInSettings,
    BotState,
    BotView,
    DropReason,
    EchoCanceller,
    EchoCancellerSettings,
    EchoGateSettings,
    Effect,
    Interrupt,
    Pause,
    PolicyState,
    Resume,
    SpeechStarted,
    SpeechStopped,
    Suppressed,
    VadEngine,
    VadStream,
)

from vad._turn import TurnDecision, TurnDetector, TurnSettings

from . import twilio_protocol as tp
from .logs import RateLimitedLog
from .playback import Chunk, Outcome, Playback, PlaybackError, Utterance, UtteranceState
from .timeline import Timeline, TurnClock

__all__ = ["CallPhase", "CallRejected", "CallSession", "CallSettings"]

log = logging.getLogger("callgate.call")

# One line per 10 s for the whole process, with the count: a peer may send thousands a second.
SKIPPED_FRAMES = RateLimitedLog(log, "skipped Twilio frames", interval_s=10.0)
SKIPPED_DOWNLINK = RateLimitedLog(log, "skipped downlink events", interval_s=10.0)
# The playback steps the worker hears of (as ``playback {state}``), by their timeline event.
_PLAYBACK_STATES: dict[str, bp.PlaybackState] = {
    "bot_utterance_finished": "finished",
    "bot_utterance_interrupted": "interrupted",
    "bot_utterance_resumed": "resumed",
}
_NO_SAMPLES = np.zeros(0, dtype=np.float32)
PREROLL_FRAMES = 25  # inbound frames (20 ms) kept to give speech to text the speech's onset
# Cancelled turns remembered per call (a stale reply answers one of the last few; a resume is
# a pause of the caller's, so a call has a handful).
_KEPT_CANCELLED = 64


class CallRejected(Exception):
    """The ``start`` message failed authorisation (bad or missing call token)."""


class CallPhase(enum.Enum):
    CONNECTED = "connected"  # socket open, waiting for Twilio's `start`
    STREAMING = "streaming"  # `start` accepted: audio flows both ways
    ENDED = "ended"  # `stop` received, socket closed or the bot hung up


@dataclass(frozen=True, slots=True)
class CallSettings:
    """Everything about a call's behaviour that ops may tune per agent."""

    barge_in: BargeInSettings = field(default_factory=BargeInSettings)
    echo: EchoGateSettings = field(default_factory=EchoGateSettings)
    echo_canceller: AecMode = AecMode.AEC3
    """The echo canceller in front of the VAD (``vad/_aec.py``); ``OFF`` is the echo gate alone,
    the decision before issue #12 (kept selectable so both can be measured in one run)."""
    aec: EchoCancellerSettings = field(default_factory=EchoCancellerSettings)
    playback_lead_ms: float = 240.0
    """How much bot audio may sit in Twilio's buffer (what a `clear` throws away)."""
    chunk_ms: int = 40
    """Outbound audio per media message (one mark each): what a clear can lose and the
    precision of heard_ms; 40 ms halves the messages per call against 20 ms (bench/load.py)."""
    max_payload_bytes: int = tp.DEFAULT_MAX_PAYLOAD_BYTES
    turn: TurnSettings = field(default_factory=TurnSettings)
    """When the caller's turn is over (vad/_turn.py): its transcript is published then, not at
    the first ``speech_stopped``; speech inside the wait continues the same turn."""
    progress_interval_ms: float = 200.0
    """``playback {state: playing, heard_ms}`` is published at most once per this much bot audio
    heard (and when the caller has heard all audio received so far): the worker pulls a node's
    next chunk on it, so the report lag adds to what its lookahead must cover."""


Authorize = Callable[[tp.Start], Awaitable[CallInfo]]


def _words(text: str) -> list[str]:
    """Lower-case words, punctuation dropped: a speculative transcript and its final compare."""
    return "".join(c if c.isalnum() or c in "' " else " " for c in text.lower()).split()


def _beyond(published: str, words: str) -> str | None:
    """The words of ``words`` after those of ``published`` (the partial a speculative
    transcript sent, and its final): all of ``words`` when they do not begin with them."""
    said = _words(published)
    if _words(words)[: len(said)] != said:
        return words or None
    # A token can hold several of _words' words ("well-known", "3.5", "9:30") or none (a
    # lone dash): count them token by token and keep the tokens after the last one said.
    tokens, count = words.split(), 0
    for i, token in enumerate(tokens):
        if count >= len(said):
            return " ".join(tokens[i:]) or None
        count += len(_words(token))
    return None


async def _accept_any(start: tp.Start) -> CallInfo:
    return CallInfo(
        call_sid=start.call_sid,
        stream_sid=start.stream_sid,
        agent=start.custom_parameters.get("agent", "default"),
        params=dict(start.custom_parameters),
    )


class CallSession:
    """The controller of one call. Feed it with :meth:`handle_text` and :meth:`handle_downlink`."""

    def __init__(
        self,
        *,
        send: Callable[[str], Awaitable[None]],
        bus: Bus,
        vad: VadEngine,
        settings: CallSettings | None = None,
        timeline: Timeline | None = None,
        authorize: Authorize | None = None,
        on_end: Callable[[CallSession], Awaitable[None]] | None = None,
        settings_for: Callable[[CallInfo], CallSettings] | None = None,
        transcriber_for: Callable[[CallInfo], Any] | None = None,
        transcribe_inline: bool = False,
    ) -> None:
        self.settings = settings or CallSettings()
        self.timeline = timeline or Timeline(keep=False)
        self.phase = CallPhase.CONNECTED
        self.info: CallInfo | None = None
        self.stream_sid = ""
        self._settings_for = settings_for
        self._configure()
        self.frames_skipped = 0
        self.frames_processed = 0
        self.dtmf_digits = ""
        self._send = send
        self._bus = bus
        self._vad = vad
        self._authorize = authorize or _accept_any
        self._on_end = on_end
        self._stream: VadStream | None = None
        self._aec: EchoCanceller | None = None
        self._cancelled: VadStream | None = None  # the VAD of the echo-cancelled audio
        self._media_end_ms = 0.0
        self._progress_reported: tuple[str, float] = ("", 0.0)  # utterance, heard_ms published
        self._hangup_requested = False
        self._closed = asyncio.Event()
        # Speech to text: the caller's turns, from a little before speech_started to
        # speech_stopped (``speech`` package protocols: Transcriber / TranscriptionStream).
        self._transcriber_for = transcriber_for
        self._transcriber: Any = None
        self._transcribe_inline = transcribe_inline
        self._stt_stream: Any = None
        # The stream of the turn whose end the detector is still waiting on (its transcription
        # was finished at turn_likely): its late partials and its final still reach the
        # detector, which decides the turn end ~0.6-2 s later. Without it the detector kept the
        # partial of turn_likely, one word behind a 250 ms-late recogniser ("... check my").
        self._turn_text_stream: Any = None
        self._preroll: deque[bytes] = deque(maxlen=PREROLL_FRAMES)  # mu-law, converted if used
        self._stt_tasks: set[asyncio.Task[None]] = set()
        self._heard_utterance: str | None = None
        # How far the gate's copy on the deaf line has been fed (_fork_ghost).
        self._ghost_fed_ms = 0.0
        TurnClock(self.timeline)  # per-turn latencies: turn_latency events
        self._log = logging.LoggerAdapter(log, {"call_sid": "", "stream_sid": ""})

    def _configure(self) -> None:
        self.playback = Playback(chunk_ms=self.settings.chunk_ms,
                                 lead_ms=self.settings.playback_lead_ms)
        self.policy = BargeInPolicy(self.settings.barge_in)
        self.turn = TurnDetector(self.settings.turn)
        self._turn_open = False  # a caller turn whose transcript is not published yet
        self._turn_ended_early = False  # the wait ran out before the policy's speech_stopped
        # Never talk over a caller who resumed: the last turn's text while its reply is not yet
        # heard, and the text a resumed turn carries into its successor.
        self._unanswered: str | None = None
        self._turn_end_ms = 0.0
        # Words the next transcript starts with: the turn the caller resumed (published, its
        # reply cancelled: the next transcript replaces it, ``replaces_previous``), as (its bus
        # eid, its words, the words published: a speculation's partial when its final came
        # since); then words never published (an early transcript that came back after the
        # caller went on).
        self._resumed: tuple[str | None, str, str] | None = None
        self._merge_text: str | None = None
        self._turn_tentative = False  # transcript sent early (TURN_LIKELY); reply held
        # The stream of the early transcript (TURN_LIKELY) the caller went on before it came
        # back: its final is the start of a longer turn. The stream, not a flag: a flag was
        # cleared only by a final that was no speculation's, so after a speculated turn it
        # stayed set and the next turn's final was held back as those words.
        self._carry_stream: Any = None
        # turn.speculate: per stream whose partial was sent, (the stream, text sent, merged
        # prefix, its bus eid) while its final is on its way; the eid, not the text, is the turn
        # (a caller may say "yes" twice). Several at once: the caller may resume a turn and end
        # the whole one before the first final is back; with one kept, that final was
        # published as a turn of its own.
        self._speculated: dict[int, tuple[Any, str, str | None, str | None]] = {}
        self._turn_over_uninterruptible = False  # the last turn was spoken over such a reply
        # The bus eid of the last final transcript published while its reply is owed (the turn
        # the next reply answers; None once that reply is heard), and the turns whose reply was
        # cancelled (eid -> why): an interruptible utterance answering one of them
        # (``utterance_start.reply_to``) was made before the worker read the interrupt, and is
        # dropped unheard when it comes (_stale_reply).
        self._reply_eid: str | None = None
        self._cancelled_turns: dict[str, bp.InterruptReason] = {}

    # -- the media clock -------------------------------------------------------------------
    @property
    def now_ms(self) -> float:
        """The end of the latest inbound audio received: the clock of every event."""
        return self._media_end_ms

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        return self.timeline.emit(self.now_ms, type_, **fields)

    async def publish(self, event: bp.UplinkEvent) -> str | None:
        """Put ``event`` on the call's uplink; returns its bus ``eid`` (None before ``start``)."""
        if self.info is None:
            return None
        return await self._bus.publish(self.info.call_sid, bp.encode(event))

    # -- Twilio side -----------------------------------------------------------------------
    async def handle_text(self, text: str | bytes) -> None:
        """One frame from Twilio. Malformed or out-of-place frames are logged and skipped."""
        if self.phase is CallPhase.ENDED:
            return
        try:
            msg = tp.parse_message(text, max_payload_bytes=self.settings.max_payload_bytes)
        except tp.ProtocolError as exc:
            self._skip(f"unparseable frame: {exc.reason}")
            return
        if isinstance(msg, tp.Connected):
            return
        if isinstance(msg, tp.Start):
            await self._on_start(msg)
            return
        if self.phase is not CallPhase.STREAMING:
            self._skip(f"{msg.event} frame before start")
            return
        if msg.stream_sid != self.stream_sid:
            self._skip(f"{msg.event} frame for another stream {msg.stream_sid!r}")
            return
        self.frames_processed += 1
        if isinstance(msg, tp.Media):
            await self._on_media(msg)
        elif isinstance(msg, tp.Dtmf):
            await self._on_dtmf(msg)
        elif isinstance(msg, tp.Mark):
            # A mark that counts is the head's (the next utterance is sent only once the head
            # is all heard, and a clear retires what was pending). Read before on_mark, it is
            # the utterance heard even when this mark finished it: read after, the head is the
            # next one, and an utterance of one chunk was never heard.
            head = self.playback.current
            await self._apply(self.playback.on_mark(msg.name, self.now_ms))
            if head is not None and head.heard_ms > 0 and head.id != self._heard_utterance:
                self._heard_utterance = head.id  # its first chunk has played at the caller
                self.emit("bot_utterance_heard", utterance_id=head.id,
                          played_from_ms=round(self.now_ms - head.heard_ms, 1))
            if head is not None and head.heard_ms > 0 and self._answers_turn(head):
                self._unanswered = None  # the caller has heard the reply begin: turn closed
                self._reply_eid = None
            await self._report_progress()
        elif isinstance(msg, tp.Stop):
            await self.end("stop")

    def _answers_turn(self, u: Utterance) -> bool:
        """``u`` is the reply to the turn still owed one (its transcript, or the revision that
        replaced it, is ``_reply_eid``): only hearing that closes the turn. A greeting, a key
        press's answer or the tail of an earlier reply answer other eids: a caller who speaks
        after hearing one of those still resumes the turn. An utterance that names nothing
        (``reply_to`` None) closes it too: a 1.1 worker names nothing for its replies, and a
        prompt of the worker's own (no uplink event caused it) is the bot speaking after the
        turn, so the caller's next words answer it; left open, a reply the caller heard would
        be cancelled and its turn replaced (the worker takes the turn and that answer out of
        the context: the caller heard an answer the agent no longer has)."""
        return self._unanswered is not None and u.reply_to in (None, self._reply_eid)

    def _skip(self, reason: str) -> None:
        self.frames_skipped += 1
        SKIPPED_FRAMES.warning("skipped Twilio frame: %s", reason, extra=self._log.extra)

    async def _on_start(self, msg: tp.Start) -> None:
        if self.phase is not CallPhase.CONNECTED:
            self._skip("second start on one stream")
            return
        info = await self._authorize(msg)  # raises CallRejected
        self.info = info
        if self._settings_for is not None:
            # The agent is known only now: its barge-in tuning applies from the first frame.
            self.settings = self._settings_for(info)
            self._configure()
        self.stream_sid = msg.stream_sid
        self._log = logging.LoggerAdapter(
            log, {"call_sid": info.call_sid, "stream_sid": msg.stream_sid}
        )
        self._stream = self._vad.open_stream(echo=self.settings.echo)
        if AecMode(self.settings.echo_canceller) is AecMode.AEC3:  # "aec3" from a variant too
            self._aec = EchoCanceller(self.settings.aec)
            self._cancelled = self._vad.open_stream()
        if self._transcriber_for is not None:
            self._transcriber = self._transcriber_for(info)
        self.phase = CallPhase.STREAMING
        await self._bus.open_call(info)
        self.emit("call_started", call_sid=info.call_sid, stream_sid=msg.stream_sid,
                  agent=info.agent)
        await self.publish(bp.CallStarted(agent=info.agent, from_number=info.from_number,
                                          to_number=info.to_number, t_ms=self.now_ms))
        self._log.info("call started (agent %s)", info.agent)

    async def _on_media(self, msg: tp.Media) -> None:
        if msg.track not in ("inbound", "inbound_track"):
            return
        samples = ulaw_to_float32(msg.payload)
        if self._transcriber is not None:
            if self._stt_stream is not None:
                self._stt_stream.feed(ulaw_to_pcm16(msg.payload))
            else:
                self._preroll.append(msg.payload)
        # Twilio's timestamp tells where this audio sits, gaps (lost packets) included.
        self._media_end_ms = max(self._media_end_ms + len(samples) / 8,
                                 msg.timestamp_ms + len(samples) / 8)
        stream = self._stream
        assert stream is not None
        # A frame completes at most one window, so this is the state after the previous window.
        stream.gate_adapt = self.policy.gate_may_adapt
        self.turn.feed(samples)
        cancelled = self._cancelled
        if cancelled is not None and self._aec is not None:
            # Silero also hears the frame with the bot's echo removed (a second stream on the
            # same engine, scored in the same batch): the policy's echo veto (vad/_policy.py).
            end = int(round(self._media_end_ms * TELEPHONY_RATE / 1000))
            cancelled.push(self._aec.process(end - len(samples), samples))
        if stream.haunted:
            self._haunt(stream)
        results = await stream.process(samples)
        clean = await cancelled.process(_NO_SAMPLES) if cancelled is not None else []
        for k, r in enumerate(results):
            assert r.gate is not None and r.features is not None
            p_clean = clean[k].prob if k < len(clean) else None
            for effect in self.policy.step(r.prob, r.gate, r.features, self._bot_view(),
                                           clean_prob=p_clean, ghost=r.ghost):
                await self._carry_out(effect)
            await self._turn_step(self.policy.in_speech, r.end_sample)
            if self.timeline.sampling:  # the ops stream's readings (gateway/ops.py)
                self.timeline.sample(r.end_sample / 8, "in", prob=r.prob, gate=r.gate,
                                     state=self.policy.state.value)
        await self._pump()

    def _fork_ghost(self, stream: VadStream, busy_ms: float) -> None:
        """At a pause, before its clear: a copy of the gate that goes on hearing the bot as a
        line deaf to the clear would play it (``Playback.would_play``;
        ``BargeInSettings.pause_echo_corr``): the gate as it stands (the audio sent, to
        ``busy_ms``, included), fed from there by ``_haunt``. One copy follows the deaf line
        through later pauses and resumes, until the gateway plays what it plays."""
        if not stream.haunted:
            stream.fork_ghost()
            self._ghost_fed_ms = max(busy_ms, self.now_ms)

    def _haunt(self, stream: VadStream) -> None:
        """Feed the gate's ghost copy what the deaf line would be playing up to the playback
        lead ahead (``_fork_ghost``); drop the copy once that line is the gateway's."""
        got = self.playback.would_play(self._ghost_fed_ms,
                                       self._media_end_ms + self.playback.lead_ms)
        if got is None:
            stream.end_ghost()
            return
        for at_ms, audio in got:
            stream.add_ghost_reference(int(round(at_ms * TELEPHONY_RATE / 1000)),
                                       ulaw_to_float32(audio))
            self._ghost_fed_ms = at_ms + len(audio) / (TELEPHONY_RATE / 1000)

    def _bot_view(self) -> BotView:
        """The bot's side of the line, for the policy: what is audible now, and the head
        utterance's id and state."""
        u = self.playback.audible(self.now_ms)
        audible = (BotState.SILENT if u is None else
                   BotState.INTERRUPTIBLE if u.interruptible else BotState.NON_INTERRUPTIBLE)
        head = self.playback.current
        unheard = self._unanswered is not None and not self._over_other(u)
        if head is None:
            return BotView(audible, reply_unheard=unheard)
        return BotView(audible, utterance_id=head.id, interruptible=head.interruptible,
                       playing=head.state is UtteranceState.PLAYING,
                       paused=head.state is UtteranceState.PAUSED, reply_unheard=unheard)

    def _over_other(self, audible: Utterance | None) -> bool:
        """The caller hears an utterance that answers another eid than the turn owed a reply (a
        greeting, a key press's answer): words now are a barge-in on it (pause, then resume or
        interrupt), not the turn resumed. Reported as resumed, the policy's ``drop_reply`` cut
        it as the reply (``interrupt {reason: resumed}`` with heard_ms > 0, no pause to
        resume). The turn stays owed (``_carry_out``): a backchannel resumes that utterance and
        the turn's reply plays after it (heard, it closes the turn); an interrupt cuts it and
        the interruptible utterances queued behind it, the reply among them, and the worker
        cancels every interruptible generation (the reply's too: the turn is cancelled, and
        any of the reply still in flight is dropped), so the caller's words are a turn of
        their own and the agent answers it with the unanswered turn before it in the context
        (the turn is closed then: ``_carry_out``); a non-interruptible reply queued there, or
        arriving, plays."""
        return audible is not None and not self._answers_turn(audible)

    async def _carry_out(self, effect: Effect) -> None:
        """Do what the policy decided (vad/_policy.py); every check is the policy's."""
        now = self.now_ms
        if isinstance(effect, SpeechStarted):
            tentative = self._turn_text_stream  # before a new stream takes its place
            # Decided on the line the policy stepped: read after the publish below, a downlink
            # event meanwhile (the head's utterance_end) flipped it from the policy's view.
            over_other = self._over_other(self.playback.audible(now))
            self._start_transcription()
            self.emit("speech_started")
            await self.publish(bp.SpeechStarted(
                over_uninterruptible=effect.over_uninterruptible, t_ms=now))
            if self._turn_tentative:
                self._turn_tentative = False
                if self._unanswered is None:
                    self._carry_stream = tentative  # its transcript is still on its way
            if (self._unanswered is not None and not effect.over_uninterruptible
                    and not over_other):
                text, self._unanswered = self._unanswered, None  # the caller went on
                if effect.drop_reply:
                    await self._hold_reply(text)
        elif isinstance(effect, SpeechStopped):
            if effect.dropped is not None:
                # Not a turn for the agent: its words are settled here and now.
                self.turn.end_turn()
                self._turn_open = False
                await self._finish_transcription(effect.dropped)
            elif self._turn_ended_early:  # a wait shorter than the policy's stop_windows
                self._turn_ended_early = False
                self.emit("turn_end", speech_end_ms=self.turn.last_speech_end_ms, wait_ms=None,
                          p_end=None, text_hold=False)
                await self._finish_transcription()
            else:
                self._turn_open = True  # the transcript waits for the turn's end (_turn_step)
            self.emit("speech_stopped")
            self._turn_over_uninterruptible = effect.over_uninterruptible
            await self.publish(bp.SpeechStopped(
                over_uninterruptible=effect.over_uninterruptible,
                dropped=effect.dropped is DropReason.OVER_UNINTERRUPTIBLE, t_ms=now))
        elif isinstance(effect, Pause):
            u = self.playback.current
            if u is None or u.id != effect.utterance_id or u.state is not UtteranceState.PLAYING:
                # Stale: the line changed while an earlier effect was awaited (a downlink event
                # finished the utterance). The policy's Resume finds nothing paused then.
                return
            busy = self.playback.line_busy_until_ms
            out = self.playback.pause(now)
            if self._stream is not None and self.settings.barge_in.reads_ghost:
                self._fork_ghost(self._stream, busy)  # before the clear takes it off the gate
            await self._clear(reason="barge_in", utterance_id=u.id, onset_ms=effect.onset_ms)
            self.emit("bot_utterance_paused", **u.describe(), heard_ms=u.heard_ms,
                      text=u.text, heard_text=u.heard_text())
            await self._apply(out)
        elif isinstance(effect, Interrupt):
            if self._unanswered is not None:
                # Cut over another eid's utterance with the turn still owed (_over_other): the
                # worker cancels every interruptible generation, the turn's reply among them,
                # so what of it was made before it read the interrupt is stale (_stale_reply).
                # The turn is closed with it: after a key press no transcript replaces it, and
                # left owed, the caller's next words were glued onto it as the turn resumed.
                self._cancel_reply(effect.reason.value)
                self._unanswered = self._reply_eid = None
            await self._interrupt(reason=effect.reason.value)
        elif isinstance(effect, Resume):
            await self._apply(self.playback.resume(now))
        elif isinstance(effect, Suppressed):
            self.emit("interrupt_suppressed", utterance_id=effect.utterance_id,
                      policy=effect.policy.value)
            await self.publish(bp.InterruptSuppressed(
                utterance_id=effect.utterance_id, policy=effect.policy.value, t_ms=now))

    # -- turn taking ------------------------------------------------------------------------
    async def _turn_step(self, speech: bool, end_sample: int) -> None:
        """One window for the end-of-turn decision; at the turn's end the transcript goes out."""
        decision = self.turn.step(speech, end_sample)
        if (decision is TurnDecision.TURN_LIKELY and self._turn_open
                and self._stt_stream is not None):  # no transcript, no reply to hold
            # Likely over: the agent starts now; its reply waits for the turn end (_pump).
            self._turn_open = False
            self._turn_tentative = True
            self.emit("turn_likely", speech_end_ms=self.turn.last_speech_end_ms,
                      silence_ms=self.turn.silence_ms)
            if self.settings.turn.speculate:
                await self._speculate()
            self._turn_text_stream = self._stt_stream
            await self._finish_transcription()
            return
        if decision is not TurnDecision.TURN_END:
            return
        est = self.turn.estimate
        self.turn.new_turn()
        self._turn_text_stream = None
        if self._turn_tentative:
            self._turn_tentative = False
            self.emit("turn_end", speech_end_ms=self.turn.last_speech_end_ms,
                      wait_ms=round(est.wait_ms, 1) if est else None,
                      p_end=round(est.p_end, 3) if est else None,
                      text_hold=est.text_hold if est else False,
                      text_done=est.text_done if est else False)
            await self._pump()  # the held reply goes out
            return
        if not self._turn_open:
            # The policy has not closed its speech turn yet: it will, and acts then.
            self._turn_ended_early = self.policy.state is not PolicyState.IDLE
            return
        self._turn_open = False
        self.emit("turn_end", speech_end_ms=self.turn.last_speech_end_ms,
                  wait_ms=round(est.wait_ms, 1) if est else None,
                  p_end=round(est.p_end, 3) if est else None,
                  text_hold=est.text_hold if est else False,
                  text_done=est.text_done if est else False)
        await self._finish_transcription()

    async def _speculate(self) -> None:
        """Send a streaming recogniser's partial as the turn's text now (``turn.speculate``):
        the agent starts on it; its final, when it comes, confirms or revises it."""
        stream = self._stt_stream
        # A backchannel's or a dropped turn's stream is settled at its SpeechStopped (None here);
        # words over a non-interruptible reply wait for their final.
        if (stream is None or not hasattr(stream, "partials")
                or self._turn_over_uninterruptible):
            return
        partial = await stream.partial()
        text = partial.text.strip() if partial is not None else ""
        if not text:
            return
        prefix, replaces = self._take_merge()
        whole = f"{prefix} {text}".strip() if prefix else text
        extra: dict[str, Any] = {"replaces_previous": True} if replaces else {}
        self.emit("transcript", text=whole, final=True, speculative=True, **extra)
        self._reply_eid = await self.publish(bp.Transcript(
            text=whole, final=True, replaces_previous=replaces, t_ms=self.now_ms))
        self._unanswered = whole
        self._turn_end_ms = self.now_ms
        self._speculated[id(stream)] = (stream, whole, prefix, self._reply_eid)

    async def _settle_speculation(self, said: str, prefix: str | None, eid: str | None,
                                  text: str) -> None:
        """The final transcript of a turn whose partial ``said`` went out as ``eid``
        (``_speculate``). The turn is found by that eid: by its words, the caller's next turn
        saying the same ("yes", "yes") was taken for it, resumed or revised."""
        whole = f"{prefix} {text}".strip() if prefix else text
        resumed = self._resumed
        if resumed is not None and resumed[0] == eid:
            # The caller went on meanwhile: the final's words replace the partial's.
            self._resumed = (resumed[0], whole, resumed[2])
            self.emit("transcript", text=whole, final=True, dropped="resumed")
            return
        if _words(whole) == _words(said):
            self.emit("transcript", text=whole, final=True, dropped="confirmed")
            return
        # The reply at the head or queued behind another eid's head (a key press's answer the
        # caller is hearing, which plays on). Looked for at the head only, one queued behind
        # played in full and the revision was answered too (two answers).
        replies = [x for x in self.playback.queue if self._answers_turn(x)]
        if (self._unanswered is None or self._reply_eid != eid
                or any(not x.interruptible for x in replies)):
            # The reply is heard already, or queued and must be heard in full (a
            # non-interruptible one), or a later turn is out: too late to make it again.
            self.emit("transcript", text=whole, final=True, dropped="late")
            return
        self._cancel_reply("revised")
        if replies and replies[0] is self.playback.current:
            await self._interrupt(reason="revised")
        elif replies:
            # Dropped unheard, the head untouched: the worker cuts each (``playback
            # {interrupted, heard_ms: 0}``) and cancels its generation.
            for x in replies:
                await self._apply(self.playback.drop(x.id, reason="revised", reply_to=eid))
        else:
            # Not queued yet (a head answering another eid plays on): the worker cancels it
            # (unknown utterance), and any of it that comes answers a cancelled turn and is
            # dropped (_stale_reply).
            await self.publish(bp.Interrupt(utterance_id=None, heard_ms=0.0, heard_text="",
                                            reason="revised", t_ms=self.now_ms))
        self.emit("transcript", text=whole, final=True, replaces_previous=True, revises=True)
        self._reply_eid = await self.publish(bp.Transcript(
            text=whole, final=True, replaces_previous=True, t_ms=self.now_ms))
        self._unanswered = whole

    async def _hold_reply(self, text: str) -> None:
        """The caller spoke again after a turn end, before hearing any of the reply: drop the
        reply (queued audio and the generation behind it) and carry the turn's words (``text``)
        into the next transcript, which replaces the last one (``replaces_previous``). A reply
        that must be heard in full plays (the policy's ``drop_reply`` is False for it)."""
        u = self.playback.current
        self._resumed = (self._reply_eid, text, text)
        self._cancel_reply("resumed")
        self.emit("turn_resumed", utterance_id=u.id if u is not None else None,
                  after_ms=round(self.now_ms - self._turn_end_ms, 1))
        if u is not None:
            await self._interrupt(reason="resumed")
        else:
            # The reply is still being generated: the worker cancels it (unknown utterance).
            await self.publish(bp.Interrupt(utterance_id=None, heard_ms=0.0, heard_text="",
                                            reason="resumed", t_ms=self.now_ms))

    def _take_merge(self) -> tuple[str | None, bool]:
        """What the next transcript starts with (None: nothing), and whether it replaces a
        published turn (the caller resumed it); both are used up."""
        parts = [self._resumed[1]] if self._resumed is not None else []
        if self._merge_text is not None:
            parts.append(self._merge_text)
        replaces = self._resumed is not None
        self._resumed = self._merge_text = None
        return (" ".join(p for p in parts if p) if parts else None), replaces

    def _cancel_reply(self, reason: bp.InterruptReason) -> None:
        """The reply to the last turn published is cancelled: whatever still comes for it is
        audio made before the worker read the interrupt (a real bus has it in flight)."""
        if self._reply_eid is None:
            return
        self._cancelled_turns[self._reply_eid] = reason
        if len(self._cancelled_turns) > _KEPT_CANCELLED:
            del self._cancelled_turns[next(iter(self._cancelled_turns))]

    async def _stale_reply(self, event: bp.UtteranceStart) -> None:
        """``event`` answers a turn whose reply was cancelled: it was made before the worker
        read the interrupt. An interruptible one is dropped before any of it is sent (timeline
        ``bot_utterance_interrupted {before_audio, dropped: cancelled_turn}``; the worker hears
        ``playback {state: interrupted, heard_ms: 0}`` and cuts it). A non-interruptible one is
        never held: it plays, so the turn was answered after all, and the caller's new words
        are a turn of their own: the resumed turn's words leave the next transcript, which no
        longer replaces it (timeline ``turn_resume_undone``). That holds while the next
        transcript is not out yet; once it is (the stale reply came after the whole turn was
        published), it stands: docs/turns.md, "Never talk over a caller who resumed"."""
        reason = self._cancelled_turns.get(event.reply_to) if event.reply_to else None
        if reason is None:
            return
        if event.interruptible:
            await self._apply(self.playback.drop(
                event.utterance_id, dropped="cancelled_turn", reason=reason,
                reply_to=event.reply_to))
            return
        resumed = self._resumed
        if resumed is not None and resumed[0] == event.reply_to:
            # What the agent answers is what was published; a final that said more (a settled
            # speculation) keeps its extra words, as the start of the caller's next turn.
            self._resumed = None
            rest = _beyond(resumed[2], resumed[1])
            if rest is not None:
                self._merge_text = f"{rest} {self._merge_text or ''}".strip()
            self.emit("turn_resume_undone", utterance_id=event.utterance_id,
                      reply_to=event.reply_to, text=resumed[2], kept=rest, reason=reason)

    # -- speech to text ---------------------------------------------------------------------
    def _start_transcription(self) -> None:
        if self._transcriber is None or self._stt_stream is not None:
            return
        self._turn_text_stream = None  # the caller spoke again: this stream's words count now
        self._stt_stream = self._transcriber.open_stream(sample_rate=TELEPHONY_RATE)
        for ulaw in self._preroll:
            self._stt_stream.feed(ulaw_to_pcm16(ulaw))
        self._preroll.clear()
        if hasattr(self._stt_stream, "partials"):  # a streaming recogniser: partials are events
            task = asyncio.create_task(self._partials(self._stt_stream))
            self._stt_tasks.add(task)
            task.add_done_callback(self._stt_tasks.discard)

    async def _partials(self, stream: Any) -> None:
        """The turn's interim transcripts (``transcript {final: false}``) as they come; the
        end-of-turn estimate reads their text (a trailing "and" waits)."""
        try:
            async for partial in stream.partials():
                if self.phase is CallPhase.ENDED:
                    return
                if stream is self._stt_stream or stream is self._turn_text_stream:
                    self.turn.set_transcript(partial.text)
                self.emit("transcript", text=partial.text, final=False)
                await self.publish(bp.Transcript(text=partial.text, final=False,
                                                 t_ms=self.now_ms))
        except Exception as exc:  # the stream still answers finish() (its fallback)
            self._stt_error(exc, during="turn")

    def _stt_error(self, exc: BaseException, *, during: str, fallback: str | None = None) -> None:
        self._log.warning("speech to text failed (%s): %s", during, exc)
        self.emit("stt_error", error=str(exc), during=during, fallback=fallback)

    async def _finish_transcription(self, dropped: DropReason | None = None) -> None:
        """The turn's words go to speech to text's final answer; ``dropped``: why they are no
        turn for the agent (the policy's :class:`vad.SpeechStopped`)."""
        stream, self._stt_stream = self._stt_stream, None
        if stream is None:
            return
        reason = dropped.value if dropped is not None else None
        if self._transcribe_inline:
            await self._transcribed(stream, dropped is not None, reason)
        else:
            task = asyncio.create_task(self._transcribed(stream, dropped is not None, reason))
            self._stt_tasks.add(task)
            task.add_done_callback(self._stt_tasks.discard)

    async def _transcribed(self, stream: Any, dropped: bool, reason: str | None) -> None:
        try:
            result = await stream.finish()
        except Exception as exc:  # a speech provider failing must not end the call
            self._stt_error(exc, during="final")
            return
        finally:
            stream.close()
            speculated = self._speculated.pop(id(stream), None)  # settled now, or never
            carry = stream is self._carry_stream
            if carry:
                self._carry_stream = None
        degraded = getattr(stream, "degraded", None)
        if degraded is not None:  # the streaming session failed; the upload answered
            self._stt_error(degraded, during="final", fallback="upload")
        text = str(getattr(result, "text", "")).strip()
        if self.phase is CallPhase.ENDED and not self._transcribe_inline:
            return
        if stream is self._turn_text_stream and text:
            self.turn.set_transcript(text)  # the turn end is still to come: its words, whole
        if speculated is not None and not dropped:  # its words went out: nothing to carry
            _, said, prefix, eid = speculated
            await self._settle_speculation(said, prefix, eid, text)
            return
        extra: dict[str, Any] = {"dropped": reason} if dropped else {}
        if carry:
            # The caller went on before this came back: it is the start of a longer turn.
            self._merge_text = f"{self._merge_text or ''} {text}".strip()
            self.emit("transcript", text=text, final=True, dropped="resumed")
            return
        if (self._resumed is not None or self._merge_text is not None) and not dropped:
            # One user message for the whole turn: the words before the caller resumed, then these.
            prefix, replaces = self._take_merge()
            text = f"{prefix or ''} {text}".strip()
            if replaces:
                extra["replaces_previous"] = True
        self.emit("transcript", text=text, final=True, **extra)
        if text and not dropped:
            self._reply_eid = await self.publish(bp.Transcript(
                text=text, final=True, t_ms=self.now_ms,
                replaces_previous="replaces_previous" in extra))
            self._unanswered = text
            self._turn_end_ms = self.now_ms

    async def _clear(self, **fields: Any) -> None:
        await self._send(tp.clear_message(self.stream_sid))
        at = int(self.now_ms * TELEPHONY_RATE / 1000)
        if self._stream is not None:
            self._stream.clear_reference_from(at)
        if self._aec is not None:
            self._aec.clear_reference_from(at)
        self.emit("clear_sent", **fields)

    async def _interrupt(self, *, reason: bp.InterruptReason) -> None:
        """The caller took the turn: stop the current interruptible utterance for good."""
        u, out = self.playback.interrupt(self.now_ms)
        if u is None:
            return
        if out.clear:
            await self._clear(reason=reason, utterance_id=u.id)
        await self._apply(out)
        self.emit("barge_in", utterance_id=u.id, heard_ms=u.heard_ms, node=u.node, reason=reason)
        await self.publish(bp.Interrupt(utterance_id=u.id, heard_ms=u.heard_ms,
                                        heard_text=u.heard_text(), node=u.node, reason=reason,
                                        t_ms=self.now_ms))

    async def _report_progress(self) -> None:
        """``playback {state: playing}``: what the caller has heard of the utterance playing,
        from the marks echoed so far (the worker paces a node's next chunk on it)."""
        u = self.playback.current
        if u is None or u.state is not UtteranceState.PLAYING:
            return
        heard = u.heard_ms
        last_id, last_ms = self._progress_reported
        if last_id == u.id:
            starved = u.heard >= len(u.audio) and heard > last_ms  # all it has: worker waits?
            if heard - last_ms < self.settings.progress_interval_ms and not starved:
                return
        elif heard <= 0:
            return
        self._progress_reported = (u.id, heard)
        await self.publish(bp.Playback(state="playing", utterance_id=u.id, heard_ms=heard,
                                       t_ms=self.now_ms))

    async def _on_dtmf(self, msg: tp.Dtmf) -> None:
        self.dtmf_digits += msg.digit
        self.emit("dtmf", digit=msg.digit)
        await self.publish(bp.Dtmf(digit=msg.digit, t_ms=self.now_ms))
        for effect in self.policy.on_dtmf(self._bot_view()):
            await self._carry_out(effect)

    # -- worker side -----------------------------------------------------------------------
    async def handle_downlink(self, event: bp.DownlinkEvent) -> None:
        """One event from the session worker (utterance start / audio / end, hangup)."""
        if self.phase is CallPhase.ENDED:
            return
        self.timeline.downlink(self.now_ms, event)  # the recorder's hook (gateway/recorder.py)
        try:
            match event:
                case bp.UtteranceStart():
                    self.playback.start(event.utterance_id, node=event.node,
                                        interruptible=event.interruptible, text=event.text or "",
                                        reply_to=event.reply_to)
                    await self._stale_reply(event)
                case bp.Audio():
                    added = self.playback.add_audio(event.utterance_id, event.payload,
                                                    self.now_ms)
                    if added and event.text is not None:
                        u = self.playback.get(event.utterance_id)
                        assert u is not None
                        start = len(u.text) if event.text_start is None else event.text_start
                        u.add_text(event.text, start, event.text_end, len(event.payload))
                case bp.UtteranceEnd():
                    await self._apply(self.playback.end(event.utterance_id,
                                                        interrupted=event.interrupted))
                case bp.Hangup():
                    self._hangup_requested = True
                case bp.Transfer():
                    self._log.info("worker transferred the call to %s", event.to)
        except (ValueError, PlaybackError) as exc:
            self._log.warning("ignored bad downlink event %r: %s", event.type, exc)
            return
        await self._pump()

    async def run_downlink(self) -> None:
        """Consume the call's downlink from the bus until the call ends (a task per call);
        events that do not decode (``bus.protocol``) are logged, rate-limited, and skipped."""
        assert self.info is not None
        async for message in self._bus.downlink(self.info.call_sid):
            try:
                event = bp.decode_downlink(message.event)
            except EventDecodeError as exc:
                SKIPPED_DOWNLINK.warning("skipped downlink event: %s", exc, extra=self._log.extra)
                continue
            await self.handle_downlink(event)
            if self.phase is CallPhase.ENDED:
                break
            # A worker may queue a whole utterance at once; yield between its events so other
            # calls' frames are not held up behind it.
            await asyncio.sleep(0)

    # -- output ----------------------------------------------------------------------------
    async def _pump(self) -> None:
        u = self.playback.current
        if self._turn_tentative and u is not None and u.state is UtteranceState.QUEUED:
            return  # a reply to a turn that may not be over: held until turn_end
        out = self.playback.pump(self.now_ms)
        if not out.empty:  # most frames: nothing due (a chunk goes every 40 ms)
            await self._apply(out)
        if self._hangup_requested and self.playback.current is None:
            await self.end("hangup")

    async def _apply(self, out: Outcome) -> None:
        """Events and chunks of a playback step. A step that empties Twilio's buffer (pause,
        interrupt) comes from a decision that sends its own ``clear``, with its reason."""
        for ev in out.events:
            fields = {k: v for k, v in ev.items() if k != "type"}
            u = self.playback.get(str(ev.get("utterance_id", "")))
            if u is not None and ev["type"] != "bot_utterance_started":
                fields.update(text=u.text, heard_text=u.heard_text())  # what was said, heard
            self.emit(ev["type"], **fields)
            state = _PLAYBACK_STATES.get(ev["type"])
            if state is not None:
                await self.publish(bp.Playback(state=state, utterance_id=ev["utterance_id"],
                                               heard_ms=ev["heard_ms"], t_ms=self.now_ms))
        for chunk in out.chunks:
            await self._send_chunk(chunk)

    async def _send_chunk(self, chunk: Chunk) -> None:
        await self._send(tp.media_message(self.stream_sid, chunk.payload))
        await self._send(tp.mark_message(self.stream_sid, chunk.mark))
        if self.timeline.sampling:
            self.timeline.sample(chunk.play_at_ms, "out", payload=chunk.payload,
                                 utterance_id=chunk.utterance_id)
        if self._stream is not None:
            start = int(round(chunk.play_at_ms * TELEPHONY_RATE / 1000))
            played = ulaw_to_float32(chunk.payload)
            self._stream.add_reference(start, played)
            if self._aec is not None:
                self._aec.add_reference(start, played)

    # -- lifecycle -------------------------------------------------------------------------
    async def end(self, reason: str) -> None:
        """End the call (idempotent): Twilio said stop, the socket closed, or the bot hung up."""
        if self.phase is CallPhase.ENDED:
            return
        was_streaming = self.phase is CallPhase.STREAMING
        self.phase = CallPhase.ENDED
        self.playback.stop_all()
        if self._stream is not None:
            self._stream.close()
        if self._aec is not None:
            self._aec.close()
        if self._cancelled is not None:
            self._cancelled.close()
        if self._stt_stream is not None:
            self._stt_stream.close()
            self._stt_stream = None
        # Cancelled now (none of them publishes once the phase is ENDED), awaited last: this
        # end() may run in the downlink task (a bot hang-up), which the socket handler cancels
        # as soon as it sees the call ended, so nothing that must happen may come after a wait.
        stt = [t for t in self._stt_tasks if t is not asyncio.current_task()]
        for task in stt:
            task.cancel()
        if was_streaming and self.info is not None:
            self.emit("call_ended", reason=reason)
            await self.publish(bp.CallEnded(reason=reason, t_ms=self.now_ms))
            await self._bus.close_call(self.info.call_sid)
            self._log.info("call ended (%s) after %.1f s", reason, self.now_ms / 1000)
        self._closed.set()
        if self._on_end is not None:
            await self._on_end(self)
        if stt:
            # Once the call has ended no transcription of it is running (its recogniser process
            # or provider socket let go). One that ignores its cancel for 2 s is left, and said.
            _, late = await asyncio.wait(stt, timeout=2.0)
            if late:
                self._log.warning("%d speech-to-text task(s) still running 2 s after the call "
                                  "ended; left to finish", len(late))

    @property
    def ended(self) -> bool:
        return self.phase is CallPhase.ENDED

    async def wait_ended(self) -> None:
        await self._closed.wait()
