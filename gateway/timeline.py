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
from typing import IO, Any

__all__ = ["EVENT_TYPES", "Timeline"]

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
        "dtmf",
        "transcript",
        "stt_error",
        "turn_likely",
        "turn_end",
        "turn_resumed",
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
        self._downlink: list[Callable[[float, dict[str, Any]], None]] = []

    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.append(fn)

    def add_sampler(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Also hear the per-window readings (:meth:`sample`): the ops stream's levels and
        probabilities. They are not events: never kept, never written to the sink."""
        self._samplers.append(fn)

    def add_downlink_listener(self, fn: Callable[[float, dict[str, Any]], None]) -> None:
        """Also hear each downlink event (from the worker) as the call handles it, with the
        media time: the recorder keeps them to replay the bot exactly."""
        self._downlink.append(fn)

    def downlink(self, t_ms: float, event: dict[str, Any]) -> None:
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
