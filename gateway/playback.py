"""What the bot is saying, what Twilio has queued, and what the caller has actually heard.

The gateway sends the bot's audio to Twilio as ``media`` messages, each followed by a ``mark``.
Twilio echoes a mark back once the audio before it has played, so echoed marks are the only
proof of what the caller heard. Two rules keep that proof honest:

* Audio is *paced*: at most ``lead_ms`` of it sits in Twilio's buffer. A ``clear`` then throws
  away little, the gateway still holds the rest, and a pause can resume from the heard point.
* On ``clear`` Twilio echoes every pending mark at once. Those echoes prove nothing, so every
  mark pending when ``clear`` is sent is retired first and its echo ignored.

The playout clock is the media clock of the inbound track (``now_ms``): Twilio plays what it has
queued at 1x, starting when it arrives, so the gateway predicts when each chunk is on the line.
That prediction feeds the echo gate and the barge-in decision ("is the bot audible now?").

This module does no I/O: it returns the Twilio messages to send and the timeline events to emit.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from audio import ULAW_BYTES_PER_MS

__all__ = [
    "Chunk",
    "Outcome",
    "Playback",
    "PlaybackError",
    "Utterance",
    "UtteranceState",
]

class PlaybackError(Exception):
    """A downlink event that does not fit the utterance's lifecycle."""


class UtteranceState(enum.Enum):
    QUEUED = "queued"  # announced, nothing sent yet
    PLAYING = "playing"  # audio being sent / on the line
    PAUSED = "paused"  # cleared for a possible barge-in; may resume
    FINISHED = "finished"  # all audio played (last mark echoed)
    INTERRUPTED = "interrupted"  # cut off by the caller; remaining audio dropped


@dataclass(slots=True)
class Utterance:
    id: str
    node: str
    interruptible: bool
    text: str = ""
    audio: bytearray = field(default_factory=bytearray)
    ended: bool = False  # the worker sent utterance_end: no more audio will come
    sent: int = 0  # bytes handed to Twilio (this playout)
    heard: int = 0  # bytes confirmed played by echoed marks
    state: UtteranceState = UtteranceState.QUEUED
    spans: list[list[int]] = field(default_factory=list)
    """[audio start, audio end (bytes), text start, text end] per text span, from the
    downlink's ``audio`` events: which words which audio speaks."""
    reply_to: str | None = None
    """The eid of the uplink event it answers (``utterance_start.reply_to``); None when the
    worker named none."""
    arrived_ms: float | None = None
    """When its first audio reached the gateway (``Playback.add_audio``'s ``now_ms``)."""

    @property
    def heard_ms(self) -> float:
        return self.heard / ULAW_BYTES_PER_MS

    def add_text(self, text: str, start: int, end: int | None, audio_bytes: int) -> None:
        """The last ``audio_bytes`` of audio added speak ``text`` at ``[start, end)`` of the
        utterance's text (the worker streams the text with the audio: ``utterance_start``
        carries it only for a ``speak``, where it is known up front)."""
        end = start + len(text) if end is None else end
        if start <= len(self.text) and end >= start:
            self.text = self.text[:start] + text[: end - start] + self.text[end:]
        last = self.spans[-1] if self.spans else None
        if last is not None and last[2] == start and last[3] == end:
            last[1] = len(self.audio)  # another piece of the same span
        else:
            self.spans.append([len(self.audio) - audio_bytes, len(self.audio), start, end])

    def heard_text(self) -> str:
        """What the caller heard of ``text``: spans played in full and, of the span playing,
        its share of characters by audio played, cut back to a word boundary (as the worker
        cuts its context, ``nodes._alignment``)."""
        if not self.spans:
            return self.text if self.audio and self.heard >= len(self.audio) else ""
        cut = 0
        for a0, a1, t0, t1 in self.spans:
            if self.heard >= a1:
                cut = t1
                continue
            if self.heard > a0:
                part = t0 + int((t1 - t0) * (self.heard - a0) / max(1, a1 - a0))
                if part < len(self.text) and not self.text[part].isspace():
                    part = self.text.rfind(" ", t0, part + 1)
                cut = max(cut, part)
            break
        return self.text[:cut].rstrip()

    def describe(self) -> dict[str, Any]:
        return {"utterance_id": self.id, "node": self.node, "interruptible": self.interruptible}


@dataclass(frozen=True, slots=True)
class Chunk:
    """Audio to send now: ``media`` then ``mark`` named ``mark``; plays from ``play_at_ms``."""

    utterance_id: str
    payload: bytes
    mark: str
    play_at_ms: float


@dataclass(slots=True)
class Outcome:
    """What a playback step asks the call controller to do."""

    chunks: list[Chunk] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    clear: bool = False

    @property
    def empty(self) -> bool:
        """Nothing to send, tell or clear."""
        return not (self.chunks or self.events or self.clear)


@dataclass(frozen=True, slots=True)
class _PendingMark:
    utterance_id: str
    end: int  # byte offset in the utterance once this mark's audio has played


class Playback:
    """Per-call playout of bot utterances, in order, one at a time.

    ``chunk_ms`` (audio per media message, one mark each) and ``lead_ms`` (audio allowed ahead of
    the play-out point) have no defaults here: ``CallSettings.chunk_ms`` and
    ``CallSettings.playback_lead_ms`` own them (a default of 20 here against 40 there was a
    second declaration that had already drifted).
    """

    def __init__(self, *, chunk_ms: int, lead_ms: float) -> None:
        self.chunk_bytes = chunk_ms * ULAW_BYTES_PER_MS
        self.lead_ms = lead_ms
        self._queue: deque[Utterance] = deque()
        self._by_id: dict[str, Utterance] = {}
        self._pending: dict[str, _PendingMark] = {}
        self._retired: set[str] = set()
        self._seq = itertools.count(1)
        self.line_busy_until_ms = 0.0
        # A line deaf to every clear (``would_play``), from an utterance's first pause on: that
        # utterance with when its first byte played, then the ones after it, each to play from
        # when its audio arrived or the one before it ended there, whichever is later.
        self._deaf: list[Utterance] = []
        self._deaf_start_ms = 0.0

    # -- queries -----------------------------------------------------------------------------
    @property
    def current(self) -> Utterance | None:
        """The utterance at the head of the queue (playing, paused or about to play)."""
        return self._queue[0] if self._queue else None

    def get(self, utterance_id: str) -> Utterance | None:
        return self._by_id.get(utterance_id)

    @property
    def queue(self) -> tuple[Utterance, ...]:
        """The utterances neither finished nor cut, in play order: the head first."""
        return tuple(self._queue)

    def audible(self, now_ms: float) -> Utterance | None:
        """The utterance the caller hears at ``now_ms``, if any (paused ones are silent)."""
        u = self.current
        if u is None or u.state is not UtteranceState.PLAYING:
            return None
        if now_ms < self.line_busy_until_ms or u.sent < len(u.audio) or not u.ended:
            return u
        return None

    # -- downlink ----------------------------------------------------------------------------
    def start(self, utterance_id: str, *, node: str, interruptible: bool, text: str = "",
              reply_to: str | None = None) -> None:
        if utterance_id in self._by_id:
            return  # at-least-once delivery: a repeated start is a no-op
        u = Utterance(utterance_id, node, interruptible, text, reply_to=reply_to)
        self._by_id[utterance_id] = u
        self._queue.append(u)
        if self._deaf_line():
            self._deaf.append(u)

    def add_audio(self, utterance_id: str, audio: bytes, now_ms: float = 0.0) -> bool:
        """Append audio (arrived at ``now_ms``); False when the utterance is unknown or already
        over (dropped)."""
        u = self._by_id.get(utterance_id)
        if u is None:
            raise PlaybackError(f"audio for unknown utterance {utterance_id!r}")
        if u.state in (UtteranceState.INTERRUPTED, UtteranceState.FINISHED) or u.ended:
            return False
        if u.arrived_ms is None and audio:
            u.arrived_ms = now_ms
        u.audio.extend(audio)
        return True

    def end(self, utterance_id: str, *, interrupted: bool = False) -> Outcome:
        """No more audio will come. ``interrupted``: the worker cut it (a barge-in reached the
        agent first); one that has not started playing is dropped unheard."""
        u = self._by_id.get(utterance_id)
        if u is None:
            raise PlaybackError(f"end of unknown utterance {utterance_id!r}")
        u.ended = True
        out = Outcome()
        if interrupted and u.interruptible and u.state is UtteranceState.QUEUED:
            self._drop_unplayed(u, out)
        return out

    # -- the media clock ---------------------------------------------------------------------
    def pump(self, now_ms: float) -> Outcome:
        """Top up Twilio's buffer to ``lead_ms`` ahead of ``now_ms``; finish utterances whose
        audio is all out and heard."""
        out = Outcome()
        self.line_busy_until_ms = max(self.line_busy_until_ms, now_ms)
        while self._queue:
            u = self._queue[0]
            if u.state is UtteranceState.PAUSED:
                break
            if u.state is UtteranceState.QUEUED:
                if not u.audio and not u.ended:
                    break  # nothing to play yet
                u.state = UtteranceState.PLAYING
                out.events.append({"type": "bot_utterance_started", **u.describe(),
                                   "text": u.text, "play_at_ms": self.line_busy_until_ms})
            while u.sent < len(u.audio) and self.line_busy_until_ms - now_ms < self.lead_ms:
                payload = bytes(u.audio[u.sent : u.sent + self.chunk_bytes])
                if len(payload) < self.chunk_bytes and not u.ended:
                    break  # wait for the rest of the chunk
                u.sent += len(payload)
                name = f"{u.id}#{next(self._seq)}"
                self._pending[name] = _PendingMark(u.id, u.sent)
                out.chunks.append(Chunk(u.id, payload, name, self.line_busy_until_ms))
                self.line_busy_until_ms += len(payload) / ULAW_BYTES_PER_MS
            if self._all_heard(u):
                self._finish(u, out, now_ms)
                continue
            break
        return out

    def on_mark(self, name: str, now_ms: float) -> Outcome:
        """Twilio echoed ``name``: its audio has played (unless retired by a clear)."""
        out = Outcome()
        if name in self._retired:
            self._retired.discard(name)
            return out
        m = self._pending.pop(name, None)
        if m is None:
            return out
        u = self._by_id.get(m.utterance_id)
        if u is None:
            return out
        u.heard = max(u.heard, m.end)
        if u.state is UtteranceState.PLAYING and self._all_heard(u):
            self._finish(u, out, now_ms)
            more = self.pump(now_ms)  # the next queued utterance may start now
            out.chunks.extend(more.chunks)
            out.events.extend(more.events)
        return out

    def _all_heard(self, u: Utterance) -> bool:
        """All of ``u`` is out and every mark sent for it has come back."""
        return (u.ended and u.sent >= len(u.audio)
                and not any(m.utterance_id == u.id for m in self._pending.values()))

    def _finish(self, u: Utterance, out: Outcome, now_ms: float) -> None:
        u.state = UtteranceState.FINISHED
        u.heard = len(u.audio)
        if self._queue and self._queue[0] is u:
            self._queue.popleft()
        out.events.append({"type": "bot_utterance_finished", **u.describe(),
                           "heard_ms": u.heard_ms})

    # -- barge-in ----------------------------------------------------------------------------
    def _retire_pending(self) -> None:
        self._retired.update(self._pending)
        self._pending.clear()

    def pause(self, now_ms: float) -> Outcome:
        """Stop playback now (``clear``) but keep the utterance to resume from the heard point."""
        out = Outcome(clear=True)
        u = self.current
        self._retire_pending()
        if u is not None and u.state is UtteranceState.PLAYING:
            if not any(x is u for x in self._deaf_line()):
                # Its first pause: the deaf line has played what was sent, at 1x, to here.
                busy = max(self.line_busy_until_ms, now_ms)
                self._deaf = list(self._queue)
                self._deaf_start_ms = busy - u.sent / ULAW_BYTES_PER_MS
            u.state = UtteranceState.PAUSED
            u.sent = u.heard
        self.line_busy_until_ms = now_ms
        return out

    def _deaf_line(self) -> list[Utterance]:
        """The deaf line's utterances (``would_play``); none once none of them is queued any
        more (played, cut or dropped: the deaf line has played them too, or is playing what
        the gateway plays)."""
        if self._deaf and not any(x is q for x in self._deaf for q in self._queue):
            self._deaf = []
        return self._deaf

    def would_play(self, from_ms: float, to_ms: float) -> list[tuple[float, bytes]] | None:
        """What a line deaf to every ``clear`` would play from ``from_ms`` to ``to_ms``: pieces
        of audio, each with when its first byte would play. Such a line plays an utterance on
        at 1x from the last audio sent before its *first* pause (before that, what was played),
        whatever pauses and resumes came since, and each utterance after it from when its audio
        arrived or the one before it ended there, whichever is later: a recorded line replayed
        as ``eval_bargein.py`` replays one does exactly that (an utterance dropped before any
        of it was sent is on no line). None when none of the deaf line's utterances is queued
        any more, or no pause began one (the deaf line is the line). The barge-in policy asks
        whether the line still carries the bot that way (``BargeInSettings.pause_echo_corr``,
        ``deaf_echo_corr``)."""
        line = self._deaf_line()
        if not line:
            return None
        out: list[tuple[float, bytes]] = []
        start = self._deaf_start_ms
        for k, u in enumerate(line):
            if k:
                if u.arrived_ms is None:
                    break  # no audio yet: it and the ones after it play later
                start = max(start, u.arrived_ms)
            a = max(0, int(round((from_ms - start) * ULAW_BYTES_PER_MS)))
            z = min(len(u.audio), int(round((to_ms - start) * ULAW_BYTES_PER_MS)))
            if z > a:
                out.append((start + a / ULAW_BYTES_PER_MS, bytes(u.audio[a:z])))
            start += len(u.audio) / ULAW_BYTES_PER_MS
            if start >= to_ms or not u.ended:
                break  # (where one still grows, the next one's start is not known yet)
        return out

    def resume(self, now_ms: float) -> Outcome:
        """Play the paused utterance on from what the caller heard."""
        u = self.current
        out = Outcome()
        if u is not None and u.state is UtteranceState.PAUSED:
            u.state = UtteranceState.PLAYING
            out.events.append({"type": "bot_utterance_resumed", **u.describe(),
                               "heard_ms": u.heard_ms})
        more = self.pump(now_ms)
        out.chunks.extend(more.chunks)
        out.events.extend(more.events)
        return out

    def interrupt(self, now_ms: float) -> tuple[Utterance | None, Outcome]:
        """The caller took the turn: drop the current interruptible utterance and the audio
        still queued for it. Returns the utterance (with ``heard``) for the interrupt event."""
        u = self.current
        out = Outcome()
        if u is None or not u.interruptible:
            return None, out
        if u.state is UtteranceState.PLAYING:
            out.clear = True
            self._retire_pending()
            self.line_busy_until_ms = now_ms
        u.state = UtteranceState.INTERRUPTED
        self._queue.popleft()
        out.events.append({"type": "bot_utterance_interrupted", **u.describe(),
                           "heard_ms": u.heard_ms})
        # The caller took the turn: the interruptible utterances queued behind it go too,
        # unheard (the worker cuts them from the context the same way, nodes/_worker.py). Kept,
        # the next one started the instant the first was cut: the bot talked on over the
        # caller. A non-interruptible one queued there still plays.
        for later in [x for x in self._queue if x.interruptible]:
            self._drop_unplayed(later, out)
        return u, out

    def drop(self, utterance_id: str, **why: Any) -> Outcome:
        """Drop a queued utterance before any of its audio is sent (the reply to a turn the call
        had cancelled, arriving after the cancel): ``bot_utterance_interrupted`` with
        ``before_audio`` and ``why``; its audio is refused from now on. Nothing happens to one
        that is unknown or already past ``QUEUED``."""
        u = self._by_id.get(utterance_id)
        out = Outcome()
        if u is not None and u.state is UtteranceState.QUEUED:
            self._drop_unplayed(u, out)
            out.events[-1].update(why)
        return out

    def _drop_unplayed(self, u: Utterance, out: Outcome) -> None:
        u.state = UtteranceState.INTERRUPTED
        self._queue.remove(u)
        self._deaf = [x for x in self._deaf if x is not u]  # no line ever plays it
        out.events.append({"type": "bot_utterance_interrupted", **u.describe(), "heard_ms": 0.0,
                           "before_audio": True})

    def stop_all(self) -> list[Utterance]:
        """The call is over: every utterance not finished is dropped; returns them."""
        left = [u for u in self._queue if u.state is not UtteranceState.FINISHED]
        self._queue.clear()
        self._retire_pending()
        return left
