"""Twilio's side of the outbound audio, simulated on a media clock.

Used wherever callgate must stand in for Twilio: ``callgate replay`` (in process, lock-step) and
``callgate call`` (over a real WebSocket, paced at 1x). It behaves as Twilio documents for
bidirectional Media Streams:

* ``media`` from the gateway is queued and played at 1x from the moment it arrives;
* a ``mark`` is echoed back once all audio queued before it has played;
* ``clear`` empties the queue and echoes every pending mark at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from audio import ULAW_BYTES_PER_MS

from . import twilio_protocol as tp

__all__ = ["PlayoutStats", "TwilioPlayout"]


@dataclass(slots=True)
class PlayoutStats:
    media_messages: int = 0
    audio_bytes: int = 0
    played_bytes: int = 0
    marks_received: int = 0
    marks_echoed: int = 0
    marks_echoed_on_clear: int = 0
    clears: int = 0
    bad_frames: int = 0
    played: bytearray = field(default_factory=bytearray)


@dataclass(slots=True)
class _QueuedAudio:
    start_ms: float
    payload: bytes
    played_bytes: int = 0


@dataclass(frozen=True, slots=True)
class _QueuedMark:
    due_ms: float
    name: str


class TwilioPlayout:
    """The queue of bot audio Twilio plays to the caller, on the caller's media clock.

    Each frame from the gateway arrives at a media time (``at_ms``); audio plays from
    ``max(arrival, end of the audio queued before it)``, and a mark is due when the audio queued
    before it has played.
    """

    def __init__(self, *, stream_sid: str, keep_audio: bool = False) -> None:
        self.stream_sid = stream_sid
        self.stats = PlayoutStats()
        self._keep = keep_audio
        self._queue: deque[_QueuedAudio | _QueuedMark] = deque()
        self._tail_ms = 0.0
        self._seq = 1_000_000  # sequence numbers for echoed marks (distinct from inbound ones)

    def receive(self, text: str, *, at_ms: float) -> list[str]:
        """A frame from the gateway arriving at media time ``at_ms``; returns the frames Twilio
        sends back at once (the mark echoes of a ``clear``)."""
        try:
            msg = tp.parse_outbound(text)
        except tp.ProtocolError:
            self.stats.bad_frames += 1
            return []
        tail = max(self._tail_ms, at_ms)
        if isinstance(msg, tp.OutboundMedia):
            self.stats.media_messages += 1
            self.stats.audio_bytes += len(msg.payload)
            self._queue.append(_QueuedAudio(tail, msg.payload))
            self._tail_ms = tail + len(msg.payload) / ULAW_BYTES_PER_MS
            return []
        if isinstance(msg, tp.OutboundMark):
            self.stats.marks_received += 1
            self._queue.append(_QueuedMark(tail, msg.name))
            self._tail_ms = tail
            return []
        # clear: drop the queue, echo every pending mark now
        self.advance(at_ms)
        self.stats.clears += 1
        names = [x.name for x in self._queue if isinstance(x, _QueuedMark)]
        self._queue.clear()
        self._tail_ms = at_ms
        self.stats.marks_echoed_on_clear += len(names)
        return [self._echo(n) for n in names]

    def advance(self, to_ms: float) -> list[str]:
        """Play audio up to media time ``to_ms``; returns the marks that became due."""
        out: list[str] = []
        while self._queue:
            head = self._queue[0]
            if isinstance(head, _QueuedMark):
                if head.due_ms > to_ms:
                    break
                self._queue.popleft()
                out.append(self._echo(head.name))
                continue
            payload, done = head.payload, head.played_bytes
            upto = min(len(payload), max(0, int(round((to_ms - head.start_ms) * ULAW_BYTES_PER_MS))))
            if upto > done:
                if self._keep:
                    self.stats.played.extend(payload[done:upto])
                self.stats.played_bytes += upto - done
                head.played_bytes = upto
            if upto < len(payload):
                break
            self._queue.popleft()
        return out

    def _echo(self, name: str) -> str:
        self.stats.marks_echoed += 1
        self._seq += 1
        return tp.build_mark(sequence_number=self._seq, stream_sid=self.stream_sid, name=name)
