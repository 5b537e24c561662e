"""``callgate call``: be Twilio for a running gateway, over a real WebSocket.

Plays a recording (``.twilio.jsonl`` or WAV) into ``/twilio/media`` as Twilio would: the
recording's messages paced at 1x on their media timestamps, the gateway's audio played out on
the same clock, marks echoed when their audio has played, every pending mark echoed at once on
``clear``. Meanwhile it watches the call's ops stream (``/ops/calls/{sid}/events``,
:mod:`gateway.ops`) and prints the conversation as it happens (:class:`ConversationPrinter`):
what the caller said, what the bot said (node, interruptible), barge-ins with their latency,
resumes, suppressed interrupts, DTMF, and who ended the call. ``--json``: the raw events.

The call is placed like a console call (``POST /console/call``: a fresh CallSid and a real call
token for the agent or number chosen with ``--agent``/``--to``); on a gateway without the
console it announces the agent and number in ``start`` as Twilio's ``<Parameter>`` would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from audio import FRAME_BYTES, TELEPHONY_RATE, ULAW_SILENCE

from . import twilio_protocol as tp
from .replay import ReplayError, recording_messages
from .twilio_sim import PlayoutStats, TwilioPlayout

__all__ = ["CallReport", "ConversationPrinter", "PlacedCall", "place_call", "play_call",
           "run_call"]

@dataclass(slots=True)
class CallReport:
    stats: PlayoutStats
    frames_sent: int
    closed_by_gateway: bool
    events: list[dict[str, Any]] = field(default_factory=list)
    """The call's ops events (timeline events and latencies), when its stream was watched."""

    @property
    def ended_reason(self) -> str | None:
        ended = [e for e in self.events if e.get("type") == "call_ended"]
        return str(ended[-1]["reason"]) if ended else None

    def summary(self) -> str:
        s = self.stats
        return (
            f"sent {self.frames_sent} frames; received {s.media_messages} media messages "
            f"({s.audio_bytes / TELEPHONY_RATE:.2f} s of audio, {s.played_bytes / TELEPHONY_RATE:.2f} s played), "
            f"{s.marks_received} marks, {s.clears} clears; echoed {s.marks_echoed} marks "
            f"({s.marks_echoed_on_clear} on clear)"
            + ("; the gateway closed the call" if self.closed_by_gateway else "")
        )


def _ms(t: Any) -> str:
    return f"{float(t) / 1000:6.2f} s"


_ENDED_BY = {
    "stop": "the caller hung up (Twilio's stop: the end of the recording)",
    "hangup": "the bot hung up",
    "socket_closed": "the media socket closed",
}


class ConversationPrinter:
    """Ops events of a call -> lines a person reads (no I/O: feed events, get lines)."""

    def __init__(self) -> None:
        self._onset_latency: dict[str, float] = {}
        self._heard: dict[str, str] = {}
        self._said: dict[str, str] = {}
        self._turn: dict[str, float] = {}

    def feed(self, e: dict[str, Any]) -> list[str]:
        if e.get("kind") == "latency":
            self._turn[str(e["what"])] = float(e["ms"])
            if e["what"] == "stop_to_bot_audio":
                to_text = self._turn.get("stop_to_transcript")
                self._turn.clear()
                text = f"transcript +{to_text:.0f} ms, " if to_text is not None else ""
                return [f"{_ms(e['t_ms'])}  turn latency from the end of the caller's speech: "
                        f"{text}first bot audio +{float(e['ms']):.0f} ms"]
            return []
        kind, t = e.get("type"), _ms(e.get("t_ms", 0))
        uid = str(e.get("utterance_id", ""))
        if kind == "call_started":
            return [f"{t}  call {e['call_sid']} started (agent {e['agent']})"]
        if kind == "bot_utterance_started":
            flag = "interruptible" if e.get("interruptible", True) else "NOT interruptible"
            self._said[uid] = str(e.get("text", ""))
            return [f"{t}  bot [{e.get('node') or '?'}, {flag}]: \"{e.get('text', '')}\""]
        if kind == "clear_sent" and e.get("onset_ms") is not None:
            self._onset_latency[uid] = float(e["t_ms"]) - float(e["onset_ms"])
            return []
        if kind == "bot_utterance_paused":
            latency = self._onset_latency.pop(uid, None)
            after = f" {latency:.0f} ms after the caller started" if latency is not None else ""
            return [f"{t}  barge-in: bot paused{after} (heard {float(e['heard_ms']) / 1000:.2f} s:"
                    f" \"{e.get('heard_text', '')}\")"]
        if kind == "bot_utterance_resumed":
            return [f"{t}  bot resumes from {float(e['heard_ms']) / 1000:.2f} s "
                    f"(the caller's sound was no turn: a backchannel or noise)"]
        if kind == "bot_utterance_interrupted":
            self._heard[uid] = str(e.get("heard_text", ""))
            return []
        if kind == "bot_utterance_finished":
            text = str(e.get("text", ""))
            if text and text != self._said.get(uid):
                return [f"{t}  bot [{e.get('node') or '?'}] finished: \"{text}\""]
            return []
        if kind == "barge_in":
            heard = self._heard.pop(uid, "")
            return [f"{t}  barge-in ({e.get('reason')}): the bot stops [{e.get('node') or '?'}]; "
                    f"the caller heard {float(e['heard_ms']) / 1000:.2f} s: \"{heard}\""]
        if kind == "interrupt_suppressed":
            return [f"{t}  caller speaks over a non-interruptible utterance: interrupt "
                    f"suppressed (policy {e.get('policy')})"]
        if kind == "transcript" and e.get("final", True):  # partials: the console shows them
            dropped = e.get("dropped")
            note = f" ({dropped}: not sent to the agent)" if dropped else ""
            return [f"{t}  caller: \"{e.get('text', '')}\"{note}"]
        if kind == "dtmf":
            return [f"{t}  caller pressed {e['digit']}"]
        if kind == "call_ended":
            reason = str(e.get("reason"))
            return [f"{t}  call ended: {_ENDED_BY.get(reason, reason)}"]
        return []


@dataclass(frozen=True, slots=True)
class PlacedCall:
    """A call the gateway issued (``POST /console/call``), or one made up for a gateway
    without the console (no token: only a gateway that skips token checks takes it)."""

    call_sid: str | None
    token: str | None
    media_url: str
    params: dict[str, str]


def _http_base(url: str) -> tuple[str, str]:
    """(http base, ws base) of a ``ws(s)://host/twilio/media`` URL."""
    parts = urlsplit(url)
    http = "https" if parts.scheme == "wss" else "http"
    return (urlunsplit((http, parts.netloc, "", "", "")),
            urlunsplit((parts.scheme, parts.netloc, "", "", "")))


async def place_call(http: aiohttp.ClientSession, url: str, *, agent: str | None,
                     to: str | None, ops_token: str | None) -> PlacedCall:
    """Ask the gateway for a console call; without a console, announce agent and number."""
    base, ws_base = _http_base(url)
    headers = {"Authorization": f"Bearer {ops_token}"} if ops_token else {}
    params = {k: v for k, v in (("agent", agent), ("to", to)) if v}
    async with http.post(f"{base}/console/call", json=params, headers=headers) as r:
        if r.status == 200:
            body = await r.json()
            return PlacedCall(body["call_sid"], body["token"], ws_base + body["media_path"],
                              {"agent": body["agent"], "to": body.get("to", ""),
                               "from": "callgate-call"})
        text = (await r.text()).strip()
        if r.status == 400:
            raise ReplayError(f"the gateway refused the call: {text}")
        if r.status == 401:
            raise ReplayError("the gateway wants the ops token (--ops-token or "
                              "CALLGATE_OPS_TOKEN)")
    return PlacedCall("CA" + secrets.token_hex(16), None, url, params)


def _with_token(line: str, token: str | None, params: dict[str, str],
                call_sid: str | None = None) -> str:
    if not token and not params and not call_sid:
        return line
    msg = tp.parse_message(line)
    if not isinstance(msg, tp.Start):
        return line
    custom = dict(msg.custom_parameters)
    custom.update(params)
    if token:
        custom["token"] = token
    return tp.build_start(
        sequence_number=msg.sequence_number, stream_sid=msg.stream_sid,
        account_sid=msg.account_sid, call_sid=call_sid or msg.call_sid, tracks=list(msg.tracks),
        custom_parameters=custom,
    )


def _start_call_sid(messages: list[str]) -> str | None:
    for line in messages:
        obj = json.loads(line)
        if obj.get("event") == "start":
            return str(obj.get("start", {}).get("callSid", ""))
    return None


async def play_call(
    recording: Path | str,
    url: str,
    *,
    token: str | None = None,
    params: dict[str, str] | None = None,
    realtime: bool = True,
    speed: float = 1.0,
    headers: dict[str, str] | None = None,
    call_sid: str | None = None,
    events_url: str | None = None,
    ops_headers: dict[str, str] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    hold_s: float = 0.0,
) -> CallReport:
    """Play ``recording`` into the gateway at ``url``; returns what happened.

    ``realtime`` paces the frames on their media timestamps, ``speed`` times faster than 1x.
    ``events_url``: the call's ops stream, watched from before ``start``; each event and
    latency goes to ``on_event`` as it comes (``on_note`` hears why, if it cannot be watched).
    ``hold_s``: at the end of the recording, stay on the line (silence) for up to this long
    while the bot answers or speaks, as a caller waits for the answer (needs the ops stream).
    """
    messages = list(recording_messages(recording))
    playout: TwilioPlayout | None = None
    frames = 0
    closed_by_gateway = False
    closing = False
    events: list[dict[str, Any]] = []
    reached_ms = 0.0  # the inbound media time the gateway has reported having processed
    async with aiohttp.ClientSession() as http:
        ops_ws: aiohttp.ClientWebSocketResponse | None = None
        if events_url is not None:
            try:
                ops_ws = await http.ws_connect(events_url, headers=ops_headers)
            except aiohttp.WSServerHandshakeError as exc:
                if on_note is not None:
                    on_note(f"no ops stream for this call ({exc.status} {exc.message}): "
                            "printing the summary only")

        async def watch() -> None:
            nonlocal reached_ms
            assert ops_ws is not None
            async for msg in ops_ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    continue
                obj = json.loads(msg.data)
                if obj.get("kind") == "end":
                    break
                if obj.get("kind") == "sample" and obj.get("dir") == "in":
                    reached_ms = max(reached_ms, float(obj["t_ms"]))
                if obj.get("kind") in ("event", "latency"):
                    events.append(obj)
                    if on_event is not None:
                        on_event(obj)

        watcher = asyncio.create_task(watch()) if ops_ws is not None else None
        async with http.ws_connect(url, headers=headers) as ws:
            inbox: asyncio.Queue[str] = asyncio.Queue()

            async def receive() -> None:
                nonlocal closed_by_gateway
                async for msg in ws:
                    if msg.type is aiohttp.WSMsgType.TEXT:
                        await inbox.put(msg.data)
                closed_by_gateway = not closing

            reader = asyncio.create_task(receive())
            t0 = time.monotonic()
            playout_end = 0.0
            last_media: dict[str, Any] | None = None

            async def at_media_time(t: float) -> None:
                """Wait for media time ``t`` (realtime), then play the gateway's audio up to it
                and echo its marks, as Twilio would."""
                assert playout is not None
                if realtime:
                    delay = t0 + t / 1000 / speed - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                echoes: list[str] = []
                while not inbox.empty():
                    echoes.extend(playout.receive(inbox.get_nowait(), at_ms=t))
                echoes.extend(playout.advance(t))
                for e in echoes:
                    await ws.send_str(e)

            async def hold(last: dict[str, Any], events: list[dict[str, Any]]) -> None:
                """Silence after the recording while the bot still has something to say. The
                ``hold_s`` count starts once the gateway has reported on all of the recording
                (its readings of the last window, the caller's last turn transcribed): on a
                busy machine that takes seconds of wall time, which are not the bot's."""
                nonlocal playout_end, frames
                assert playout is not None
                m = last["media"]
                seq, chunk = int(last["sequenceNumber"]), int(m["chunk"])
                t = float(m["timestamp"])
                recording_end = t + 20
                until = t + hold_s * 1000
                while not ws.closed:
                    behind = (watcher is not None and not watcher.done()
                              and reached_ms < recording_end - _WINDOW_MS)
                    if behind or _transcript_owed(events):
                        until = t + hold_s * 1000
                    elif not (t < until and _bot_busy(events)):
                        break
                    t += 20
                    seq, chunk = seq + 1, chunk + 1
                    await at_media_time(t)
                    await ws.send_str(tp.build_media(
                        sequence_number=seq, stream_sid=str(last["streamSid"]), chunk=chunk,
                        timestamp_ms=int(t), payload=ULAW_SILENCE * FRAME_BYTES,
                        track=str(m.get("track", "inbound"))))
                    frames += 1
                    playout_end = t + 20
            try:
                for line in messages:
                    obj = json.loads(line)
                    if obj.get("event") == "media" and playout is not None:
                        last_media = obj
                        t = float(obj["media"]["timestamp"])
                        playout_end = t + 20
                        await at_media_time(t)
                    if obj.get("event") == "start":
                        line = _with_token(line, token, params or {}, call_sid)
                        playout = TwilioPlayout(stream_sid=str(obj.get("streamSid", "")))
                    if ws.closed:
                        break
                    if obj.get("event") == "stop":
                        if watcher is not None and hold_s > 0 and last_media is not None:
                            await hold(last_media, events)
                        closing = True  # the caller hangs up; the gateway closes after it
                    await ws.send_str(line)
                    frames += 1
                if watcher is not None and not ws.closed:
                    # The call's last events (its end) come on the ops stream; the socket
                    # closes once they are in, as Twilio closes it after `stop`.
                    await asyncio.wait({watcher, reader}, timeout=5,
                                       return_when=asyncio.FIRST_COMPLETED)
                closing = True
                await ws.close()
            finally:
                await asyncio.wait_for(reader, timeout=5)
        if watcher is not None:
            assert ops_ws is not None
            try:
                await asyncio.wait_for(watcher, timeout=5)
            except TimeoutError:
                if on_note is not None:
                    on_note("the ops stream did not report the end of the call")
            await ops_ws.close()
        if playout is not None:
            while not inbox.empty():
                playout.receive(inbox.get_nowait(), at_ms=playout_end)
    return CallReport(playout.stats if playout else PlayoutStats(), frames, closed_by_gateway,
                      events)


_WINDOW_MS = 32.0  # the gateway's VAD window: its readings come once per window (gateway.ops)


def _transcript_owed(events: list[dict[str, Any]]) -> bool:
    """The caller's last turn ended and the gateway is transcribing it: a final transcript (or
    an ``stt_error``) is on its way. Known only where the gateway showed it transcribes (a
    ``turn_likely``, sent with a transcription under way, or an earlier transcript)."""
    transcribes = False
    owed = False
    for e in events:
        kind = e.get("type")
        if kind in ("transcript", "stt_error"):
            transcribes = True
            if kind == "stt_error" or e.get("final", True):
                owed = False
        elif kind == "speech_stopped":
            owed = not e.get("dropped") and not e.get("over_uninterruptible")
        elif kind == "turn_likely":
            transcribes = True
    return owed and transcribes


def _bot_busy(events: list[dict[str, Any]]) -> bool:
    """The bot is speaking, owes an answer to the caller's last words, or the caller's last
    turn has not been transcribed yet (on a busy machine that can take seconds; the hold must
    wait for it, not for a fixed time)."""
    open_: set[str] = set()
    owes = False
    transcribing = False
    for e in events:
        kind = e.get("type")
        if kind == "bot_utterance_started":
            open_.add(str(e["utterance_id"]))
            owes = False
        elif kind in ("bot_utterance_finished", "bot_utterance_interrupted"):
            open_.discard(str(e["utterance_id"]))
        elif kind == "speech_stopped":
            transcribing = not e.get("dropped") and not e.get("over_uninterruptible")
        elif kind == "transcript" and e.get("final", True):
            transcribing = False
            if e.get("text") and not e.get("dropped"):
                owes = True
    return bool(open_) or owes or transcribing


async def _run(args: argparse.Namespace) -> int:
    ops_token = args.ops_token or os.environ.get("CALLGATE_OPS_TOKEN") or None
    ops_headers = {"Authorization": f"Bearer {ops_token}"} if ops_token else None
    messages = list(recording_messages(args.recording))  # a bad recording fails first
    if args.token:
        placed = PlacedCall(args.call_sid or _start_call_sid(messages), args.token, args.url,
                            {k: v for k, v in (("agent", args.agent), ("to", args.to)) if v})
    else:
        async with aiohttp.ClientSession() as http:
            placed = await place_call(http, args.url, agent=args.agent, to=args.to,
                                      ops_token=ops_token)
    _, ws_base = _http_base(args.url)
    events_url = f"{ws_base}/ops/calls/{placed.call_sid}/events" if placed.call_sid else None
    printer = ConversationPrinter()

    def show(event: dict[str, Any]) -> None:
        lines = ([json.dumps(event, separators=(",", ":"))] if args.json
                 else printer.feed(event))
        for line in lines:
            print(line, flush=True)

    def note(text: str) -> None:
        print(f"callgate call: {text}", file=sys.stderr, flush=True)

    report = await play_call(args.recording, placed.media_url, token=placed.token,
                             params=placed.params, realtime=not args.fast,
                             call_sid=placed.call_sid, events_url=events_url,
                             ops_headers=ops_headers, on_event=show, on_note=note,
                             hold_s=args.hold)
    if not args.json:
        print(report.summary())
    return 0


def run_call(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except (ReplayError, aiohttp.ClientError, OSError) as exc:
        print(f"callgate call: {exc}", file=sys.stderr)
        return 2
