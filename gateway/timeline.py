"""The call's event timeline: what the gateway did and when, on the media clock.

Every event is a dict with ``t_ms`` (the end of the latest inbound audio the gateway had received
when it emitted the event, in ms since the stream started) and ``type``; the names are the replay
contract of docs/architecture.md, which ``tools/eval_bargein.py`` reads. Live calls log them;
``callgate replay`` writes them to ``--events-out``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from bus import protocol as bp

__all__ = ["EVENT_TYPES", "TURN_STAGES", "Timeline", "TurnClock"]

EVENT_TYPES = frozenset(
    {
        "call_started",
        "speech_started",
        "speech_stopped",
        "barge_in",
        "interrupt_suppressed",
        "clear_sent",
        "bot_utterance_started",
        "bot_utterance_finished",
        "bot_utterance_interrupted",
        "bot_utterance_paused",
        "bot_utterance_resumed",
        "bot_utterance_heard",
        "turn_latency",
        "dtmf",
        "transcript",
        "stt_error",
        "turn_likely",
        "turn_end",
        "turn_resumed",
        "turn_resume_undone",
        "call_ended",
    }
)

log = logging.getLogger("callgate.timeline")


class Timeline:
    """Collects events; optionally streams them as JSON lines and to listeners."""

    def __init__(self, *, sink: IO[str] | None = None, keep: bool = True) -> None:
        self.events: list[dict[str, Any]] = []
        self._sink = sink
        self._keep = keep
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._samplers: list[Callable[[dict[str, Any]], None]] = []
        self._downlink: list[Callable[[float, bp.DownlinkEvent], None]] = []

    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.append(fn)

    def add_sampler(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Also hear the per-window readings (:meth:`sample`): the ops stream's levels and
        probabilities. They are not events: never kept, never written to the sink."""
        self._samplers.append(fn)

    def add_downlink_listener(self, fn: Callable[[float, bp.DownlinkEvent], None]) -> None:
        """Also hear each downlink event (from the worker) as the call handles it, with the
        media time: the recorder keeps them to replay the bot exactly."""
        self._downlink.append(fn)

    def downlink(self, t_ms: float, event: bp.DownlinkEvent) -> None:
        for fn in self._downlink:
            fn(t_ms, event)

    def remove_sampler(self, fn: Callable[[dict[str, Any]], None]) -> None:
        if fn in self._samplers:
            self._samplers.remove(fn)

    @property
    def sampling(self) -> bool:
        """Someone listens to samples; the call builds them only then (a dict per 32 ms
        window per call is not free on the media path)."""
        return bool(self._samplers)

    def sample(self, t_ms: float, kind: str, **fields: Any) -> None:
        """A reading at media time ``t_ms``: ``kind`` ``in`` (an inbound VAD window: Silero's
        probability, the echo/noise gate's reading, the policy's state) or ``out`` (a chunk of
        bot audio as sent, playing from ``t_ms``)."""
        sample = {"t_ms": round(float(t_ms), 3), "kind": kind, **fields}
        for fn in self._samplers:
            fn(sample)

    def emit(self, t_ms: float, type_: str, **fields: Any) -> dict[str, Any]:
        if type_ not in EVENT_TYPES:
            raise ValueError(f"unknown timeline event type {type_!r}")
        event = {"t_ms": round(float(t_ms), 3), "type": type_, **fields}
        if self._keep:
            self.events.append(event)
        if self._sink is not None:
            self._sink.write(json.dumps(event, separators=(",", ":")) + "\n")
        for fn in self._listeners:
            fn(event)
        log.debug("event %s", event)
        return event

    def of_type(self, *types: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] in types]


TURN_STAGES = ("turn_end", "transcript", "llm_first_text", "tts_first_audio", "first_audio",
               "heard")
"""The stages of a ``turn_latency`` event, each ``<stage>_ms`` after the end of the caller's
speech: the turn end decided, the final transcript published, the reply's first text at the
gateway (``utterance_start``: the worker had the LLM's first chunk), its first audio at the
gateway (the TTS's first bytes, synthesized), its first audio on the line (``play_at_ms``:
voice to voice), and first heard (from the first echoed mark: when its first chunk began
playing at the caller)."""


@dataclass(slots=True)
class _Turn:
    speech_end_ms: float | None = None
    commit_ms: float | None = None  # the transcript was asked for (turn_likely or turn_end)
    turn_end_ms: float | None = None
    transcript_ms: float | None = None
    utterance_id: str | None = None
    llm_first_text_ms: float | None = None
    tts_first_audio_ms: float | None = None
    first_audio_ms: float | None = None


class TurnClock:
    """Per-turn latencies of a call, from its timeline and its downlink (no I/O: it listens, and
    emits one ``turn_latency`` event into the timeline when the reply to a turn is first heard).

    ``turn_latency {utterance_id, speech_end_ms, <stage>_ms..., stt_ms, hold_ms}``, the stages
    of :data:`TURN_STAGES` in ms after ``speech_end_ms`` (the detector's end of the caller's
    last voiced window), on the media clock; ``stt_ms``: the final transcript after it was
    asked for (a streaming recogniser's commit, or the upload); ``hold_ms``: the reply's first
    audio on the line after both its audio had come and the turn's end was decided (what the
    gateway itself adds: pacing behind a chunk, a held reply played at once is 0). A reply that
    is dropped unheard (the caller resumed) has none; a turn answered without a transcript
    (a keypress) neither.
    """

    def __init__(self, timeline: Timeline) -> None:
        self._timeline = timeline
        self._turn = _Turn()
        timeline.add_listener(self._on_event)
        timeline.add_downlink_listener(self._on_downlink)

    def _on_event(self, e: dict[str, Any]) -> None:
        kind, t = e["type"], float(e["t_ms"])
        turn = self._turn
        if kind == "turn_likely":
            self._turn = _Turn(speech_end_ms=e.get("speech_end_ms"), commit_ms=t)
        elif kind == "turn_end":
            if turn.commit_ms is None or turn.turn_end_ms is not None:  # no early start
                turn = self._turn = _Turn(commit_ms=t)
            turn.speech_end_ms = e.get("speech_end_ms", turn.speech_end_ms)
            turn.turn_end_ms = t
        elif kind == "turn_resumed":
            self._turn = _Turn()  # the reply is dropped; the whole turn gets a new one
        elif kind == "transcript" and e.get("final", True) and not e.get("dropped"):
            if e.get("revises"):  # a speculative reply dropped: the final's reply counts
                turn.utterance_id = turn.llm_first_text_ms = turn.tts_first_audio_ms = None
                turn.first_audio_ms = None
                turn.transcript_ms = t
            elif turn.commit_ms is not None and turn.transcript_ms is None:
                turn.transcript_ms = t
        elif (kind == "bot_utterance_interrupted" and e.get("dropped") == "cancelled_turn"
              and e.get("utterance_id") == turn.utterance_id):
            # The reply to a turn whose reply the gateway had cancelled, dropped before a sound
            # of it was sent: this turn's reply is the next utterance. (Only that drop: one cut
            # unheard by a barge-in or by the worker is the turn's reply, and it has none.)
            turn.utterance_id = turn.llm_first_text_ms = turn.tts_first_audio_ms = None
        elif kind == "bot_utterance_started" and e.get("utterance_id") == turn.utterance_id:
            turn.first_audio_ms = float(e.get("play_at_ms", t))
        elif kind == "bot_utterance_heard" and e.get("utterance_id") == turn.utterance_id:
            self._emit(turn, float(e.get("played_from_ms", t)), t)

    def _on_downlink(self, t_ms: float, event: bp.DownlinkEvent) -> None:
        turn = self._turn
        if turn.transcript_ms is None:
            return
        if isinstance(event, bp.UtteranceStart) and turn.utterance_id is None:
            turn.utterance_id = event.utterance_id
            turn.llm_first_text_ms = t_ms
        elif (isinstance(event, bp.Audio) and turn.tts_first_audio_ms is None
              and event.utterance_id == turn.utterance_id):
            turn.tts_first_audio_ms = t_ms

    def _emit(self, turn: _Turn, heard_ms: float, now_ms: float) -> None:
        self._turn = _Turn()
        if turn.speech_end_ms is None or turn.turn_end_ms is None or turn.first_audio_ms is None:
            return
        end = float(turn.speech_end_ms)
        stages = {"turn_end": turn.turn_end_ms, "transcript": turn.transcript_ms,
                  "llm_first_text": turn.llm_first_text_ms,
                  "tts_first_audio": turn.tts_first_audio_ms,
                  "first_audio": turn.first_audio_ms, "heard": heard_ms}
        fields: dict[str, Any] = {f"{k}_ms": None if v is None else round(v - end, 1)
                                  for k, v in stages.items()}
        assert turn.transcript_ms is not None and turn.commit_ms is not None
        fields["stt_ms"] = round(turn.transcript_ms - turn.commit_ms, 1)
        ready = max(turn.turn_end_ms, turn.tts_first_audio_ms or turn.first_audio_ms)
        fields["hold_ms"] = round(max(0.0, turn.first_audio_ms - ready), 1)
        self._timeline.emit(now_ms, "turn_latency",
                            utterance_id=turn.utterance_id, speech_end_ms=round(end, 1), **fields)
