"""The ops event streams: the live calls, and each call's timeline as it happens.

Routes (behind the ops token when one is configured, see :class:`OpsSettings`):

* ``GET /ops/calls``: JSON ``{"calls": [...], "ended": [...]}``, the calls in progress and the
  latest ended ones (``call_sid``, ``agent``, ``media_ms``, ``started_at``).
* ``GET /ops/live`` (WebSocket): the same list, pushed on every change.
* ``GET /ops/calls/{call_sid}/events`` (WebSocket): one JSON object per message. First the
  call's history so far, then live: ``{"kind": "event", ...}`` for every timeline event (the
  replay contract of docs/architecture.md), ``{"kind": "latency", ...}`` per turn,
  ``{"kind": "sample", ...}`` for the readings of every 32 ms inbound window (``dir: "in"``:
  level, Silero probability, the echo/noise gate's reading, the policy's state) and every
  outbound chunk (``dir: "out"``: its level), and ``{"kind": "end"}`` once the call is over.
  A call that has not started yet can be watched: its stream waits for it (how ``callgate
  call`` and the console see a call from its first event).

Samples are built only while someone watches the call (:attr:`Timeline.sampling`): they cost
the watched call ~0.45 ms of CPU per call-second on its media path (4 us per inbound window,
13 us per outbound chunk with its level, measured with timeit on this 2-core machine class),
against ~3 ms per call-second for the whole call logic (bench.call_cpu); an unwatched call pays
one attribute test per window (bench.call_cpu, 25 and 100 calls, 3 interleaved runs each: call
logic 1.60 / 1.69 ms per call-second before this module, 1.69 / 1.53 after, within the runs'
spread). A watcher that cannot keep up is cut off (its queue is bounded); the call never waits
for a watcher.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web

from audio import ulaw_to_float32

from .timeline import Timeline

__all__ = ["CallFeed", "FeedState", "OpsHub", "OpsSettings", "TurnLatencies", "authorized",
           "ops_routes"]

log = logging.getLogger("callgate.ops")

HISTORY_EVENTS = 2000
"""Events (and latencies) a call keeps for watchers that join late; a call has ~10 per turn."""
HISTORY_SAMPLES = 1000
"""Samples kept likewise: the last ~30 s of windows."""
WATCHER_QUEUE = 4096
"""Messages queued for one watcher before it is cut off (~2 min of a call's samples)."""
PENDING_TTL_S = 60.0
"""How long a stream for a call that has not started yet waits for it."""


@dataclass(frozen=True, slots=True)
class OpsSettings:
    """The console and ops streams of one gateway (``console:`` in the YAML)."""

    enabled: bool = False
    """Serve ``/console`` and ``/ops``."""
    token: str | None = None
    """The ops token; None: open (only where Twilio signatures are not validated)."""
    agents: Callable[[], list[str]] = lambda: ["default"]
    """The agents a console call may choose from (read per request: reloads apply)."""
    numbers: Callable[[], dict[str, str]] = dict
    """Number -> agent, for a console call placed to a number."""


def authorized(settings: OpsSettings, request: web.Request) -> bool:
    """The request carries the ops token (``Authorization: Bearer`` or ``?token=``), or none
    is configured."""
    if settings.token is None:
        return True
    header = request.headers.get("Authorization", "")
    given = header[7:] if header.startswith("Bearer ") else request.query.get("token", "")
    return hmac.compare_digest(given.encode(), settings.token.encode())


def _db(x: np.ndarray) -> float:
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if x.size else 0.0
    return round(20 * math.log10(rms), 1) if rms > 1e-5 else -100.0


class TurnLatencies:
    """Per-turn latencies from a call's timeline events (no I/O: feed events, get records).

    * ``onset_to_clear``: the caller's speech onset (the policy's estimate) to the ``clear``
      that paused the bot: how fast a barge-in stops the bot.
    * ``stop_to_transcript``: end of the caller's speech to its transcript.
    * ``transcript_to_bot_audio`` and ``stop_to_bot_audio``: to the first audio of the next
      bot utterance on the line (its ``play_at_ms``).
    """

    def __init__(self) -> None:
        self._stopped_ms: float | None = None
        self._transcript_ms: float | None = None

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        kind, t = event["type"], float(event["t_ms"])
        out: list[dict[str, Any]] = []
        if kind == "clear_sent" and event.get("onset_ms") is not None:
            out.append(self._record(t, "onset_to_clear", t - float(event["onset_ms"])))
        elif kind == "speech_stopped":
            self._stopped_ms, self._transcript_ms = t, None
        elif (kind == "transcript" and self._stopped_ms is not None and not event.get("dropped")
              and event.get("final", True)):
            self._transcript_ms = t
            out.append(self._record(t, "stop_to_transcript", t - self._stopped_ms))
        elif kind == "bot_utterance_started" and self._transcript_ms is not None:
            at = float(event.get("play_at_ms", t))
            assert self._stopped_ms is not None
            out.append(self._record(t, "transcript_to_bot_audio", at - self._transcript_ms))
            out.append(self._record(t, "stop_to_bot_audio", at - self._stopped_ms))
            self._stopped_ms = self._transcript_ms = None
        elif kind == "speech_started":
            self._stopped_ms = self._transcript_ms = None
        return out

    @staticmethod
    def _record(t_ms: float, what: str, ms: float) -> dict[str, Any]:
        return {"kind": "latency", "t_ms": t_ms, "what": what, "ms": round(ms, 1)}


def _sample_message(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["kind"] == "in":
        g = sample["gate"]
        return {"kind": "sample", "dir": "in", "t_ms": sample["t_ms"],
                "prob": round(float(sample["prob"]), 3), "level_db": round(g.level_db, 1),
                "echo_db": round(g.echo_db, 1), "noise_db": round(g.noise_db, 1),
                "passes": bool(g.passes), "echo_locked": bool(g.echo_locked),
                "state": sample["state"]}
    return {"kind": "sample", "dir": "out", "t_ms": sample["t_ms"],
            "level_db": _db(ulaw_to_float32(sample["payload"])),
            "ms": len(sample["payload"]) / 8, "utterance_id": sample.get("utterance_id")}


class FeedState(enum.Enum):
    PENDING = "pending"  # watched before its call started (the SID is known, not the call)
    LIVE = "live"  # the call is in progress
    ENDED = "ended"  # call_ended seen; the feed is out of the hub


@dataclass(slots=True)
class CallFeed:
    """One call's stream: its history and the queues of those watching it."""

    call_sid: str
    agent: str = ""
    started_at: float = 0.0
    media_ms: float = 0.0
    state: FeedState = FeedState.PENDING
    created: float = field(default_factory=time.monotonic)
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY_EVENTS))
    samples: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY_SAMPLES))
    watchers: set[asyncio.Queue[dict[str, Any] | None]] = field(default_factory=set)
    timeline: Timeline | None = None
    latencies: TurnLatencies = field(default_factory=TurnLatencies)

    def summary(self) -> dict[str, Any]:
        return {"call_sid": self.call_sid, "agent": self.agent, "media_ms": self.media_ms,
                "started_at": self.started_at, "ended": self.state is FeedState.ENDED}

    def push(self, message: dict[str, Any] | None) -> None:
        for q in list(self.watchers):
            try:
                q.put_nowait(message)
            except asyncio.QueueFull:
                log.warning("ops watcher of call %s fell behind; cut off", self.call_sid)
                self.watchers.discard(q)
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(None)  # its stream ends

    def on_sample(self, sample: dict[str, Any]) -> None:
        message = _sample_message(sample)
        self.samples.append(message)
        self.push(message)


class OpsHub:
    """The gateway's live calls, for watchers. Fed by each call's :class:`Timeline`."""

    def __init__(self, *, keep_ended: int = 50) -> None:
        self.feeds: dict[str, CallFeed] = {}
        self.ended: deque[dict[str, Any]] = deque(maxlen=keep_ended)
        self._changed: set[asyncio.Queue[None]] = set()

    def watch(self, timeline: Timeline) -> None:
        """Follow a call's timeline from its first event (before its SID is known)."""
        holder: list[CallFeed] = []

        def listener(event: dict[str, Any]) -> None:
            if not holder:
                if event["type"] != "call_started":
                    return
                feed = self._feed(str(event["call_sid"]))
                feed.state, feed.agent = FeedState.LIVE, str(event.get("agent", ""))
                feed.started_at = time.time()
                feed.timeline = timeline
                if feed.watchers:
                    timeline.add_sampler(feed.on_sample)
                holder.append(feed)
                self._notify()
            feed = holder[0]
            feed.media_ms = float(event["t_ms"])
            message = {"kind": "event", **event}
            feed.events.append(message)
            feed.push(message)
            for record in feed.latencies.feed(event):
                feed.events.append(record)
                feed.push(record)
            if event["type"] == "call_ended":
                self._finish(feed)

        timeline.add_listener(listener)

    def _feed(self, call_sid: str) -> CallFeed:
        feed = self.feeds.get(call_sid)
        if feed is None or feed.state is FeedState.ENDED:
            feed = self.feeds[call_sid] = CallFeed(call_sid)
        return feed

    def _finish(self, feed: CallFeed) -> None:
        feed.state = FeedState.ENDED
        if feed.timeline is not None:
            feed.timeline.remove_sampler(feed.on_sample)
        feed.push({"kind": "end", "call_sid": feed.call_sid})
        feed.push(None)
        self.feeds.pop(feed.call_sid, None)
        self.ended.appendleft(feed.summary())
        self._notify()

    def _notify(self) -> None:
        for q in list(self._changed):
            if q.empty():
                q.put_nowait(None)

    def live(self) -> list[dict[str, Any]]:
        return [f.summary() for f in self.feeds.values() if f.state is FeedState.LIVE]

    def listing(self) -> dict[str, Any]:
        return {"calls": self.live(), "ended": list(self.ended)}

    def subscribe(self, call_sid: str) -> tuple[CallFeed, asyncio.Queue[dict[str, Any] | None]]:
        """Watch ``call_sid`` (started or not yet): its history is queued first."""
        self._expire_pending()
        feed = self._feed(call_sid)
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(WATCHER_QUEUE)
        for message in [*feed.samples, *feed.events]:
            if q.qsize() < WATCHER_QUEUE // 2:
                q.put_nowait(message)
        if not feed.watchers and feed.timeline is not None:
            feed.timeline.add_sampler(feed.on_sample)
        feed.watchers.add(q)
        return feed, q

    def unsubscribe(self, feed: CallFeed, q: asyncio.Queue[dict[str, Any] | None]) -> None:
        feed.watchers.discard(q)
        if not feed.watchers:
            if feed.timeline is not None:
                feed.timeline.remove_sampler(feed.on_sample)
            if feed.state is FeedState.PENDING and self.feeds.get(feed.call_sid) is feed:
                del self.feeds[feed.call_sid]

    def _expire_pending(self) -> None:
        now = time.monotonic()
        for sid, feed in list(self.feeds.items()):
            if feed.state is FeedState.PENDING and now - feed.created > PENDING_TTL_S:
                for q in feed.watchers:
                    if not q.full():
                        q.put_nowait(None)
                del self.feeds[sid]

    def changes(self) -> asyncio.Queue[None]:
        q: asyncio.Queue[None] = asyncio.Queue(1)
        self._changed.add(q)
        return q

    def drop_changes(self, q: asyncio.Queue[None]) -> None:
        self._changed.discard(q)


def ops_routes(hub: OpsHub, settings: OpsSettings) -> list[web.RouteDef]:
    """``/ops/calls``, ``/ops/live`` and ``/ops/calls/{call_sid}/events``."""

    def check(request: web.Request) -> None:
        if not authorized(settings, request):
            raise web.HTTPUnauthorized(text="ops token required (Authorization: Bearer, or "
                                            "?token=)")

    async def calls(request: web.Request) -> web.Response:
        check(request)
        return web.json_response(hub.listing())

    async def live(request: web.Request) -> web.WebSocketResponse:
        check(request)
        ws = web.WebSocketResponse(heartbeat=30.0)
        await ws.prepare(request)
        changes = hub.changes()
        closer = asyncio.create_task(_drain_incoming(ws))
        try:
            await ws.send_json({"kind": "calls", **hub.listing()})
            while not ws.closed:
                waiter = asyncio.create_task(changes.get())
                done, _ = await asyncio.wait({waiter, closer},
                                             return_when=asyncio.FIRST_COMPLETED)
                if closer in done:
                    waiter.cancel()
                    break
                await ws.send_json({"kind": "calls", **hub.listing()})
        finally:
            hub.drop_changes(changes)
            closer.cancel()
        return ws

    async def events(request: web.Request) -> web.WebSocketResponse:
        check(request)
        call_sid = request.match_info["call_sid"]
        ws = web.WebSocketResponse(heartbeat=30.0)
        await ws.prepare(request)
        feed, q = hub.subscribe(call_sid)
        closer = asyncio.create_task(_drain_incoming(ws))
        try:
            while not ws.closed:
                getter = asyncio.create_task(q.get())
                # A call that does not start within PENDING_TTL_S is not coming.
                wait_s = PENDING_TTL_S if feed.state is FeedState.PENDING else None
                done, _ = await asyncio.wait({getter, closer}, timeout=wait_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if closer in done or not done:
                    getter.cancel()
                    break
                message = getter.result()
                if message is None:
                    break
                await ws.send_json(message)
        finally:
            hub.unsubscribe(feed, q)
            closer.cancel()
            await ws.close()
        return ws

    return [web.get("/ops/calls", calls), web.get("/ops/live", live),
            web.get("/ops/calls/{call_sid}/events", events)]


async def _drain_incoming(ws: web.WebSocketResponse) -> None:
    """Read (and ignore) what a watcher sends, until it closes."""
    async for msg in ws:
        if msg.type is WSMsgType.ERROR:
            break
