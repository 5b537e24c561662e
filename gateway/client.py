"""``callgate call``: be Twilio for a running gateway, over a real WebSocket.

Plays a recording (``.twilio.jsonl`` or WAV) into ``/twilio/media`` as Twilio would: the
recording's messages paced at 1x on their media timestamps, the gateway's audio played out on
the same clock, marks echoed when their audio has played, every pending mark echoed at once on
``clear``. Prints what came back, so a person can try a gateway without a Twilio account.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from . import twilio_protocol as tp
from .replay import ReplayError, recording_messages
from .twilio_sim import PlayoutStats, TwilioPlayout

__all__ = ["CallReport", "play_call", "run_call"]


@dataclass(slots=True)
class CallReport:
    stats: PlayoutStats
    frames_sent: int
    closed_by_gateway: bool

    def summary(self) -> str:
        s = self.stats
        return (
            f"sent {self.frames_sent} frames; received {s.media_messages} media messages "
            f"({s.audio_bytes / 8000:.2f} s of audio, {s.played_bytes / 8000:.2f} s played), "
            f"{s.marks_received} marks, {s.clears} clears; echoed {s.marks_echoed} marks "
            f"({s.marks_echoed_on_clear} on clear)"
            + ("; the gateway closed the call" if self.closed_by_gateway else "")
        )


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
) -> CallReport:
    """Play ``recording`` into the gateway at ``url``; returns what happened.

    ``realtime`` paces the frames on their media timestamps, ``speed`` times faster than 1x.
    """
    messages = list(recording_messages(recording))
    playout: TwilioPlayout | None = None
    frames = 0
    closed_by_gateway = False
    async with aiohttp.ClientSession() as http, http.ws_connect(url, headers=headers) as ws:
        inbox: asyncio.Queue[str] = asyncio.Queue()

        async def receive() -> None:
            nonlocal closed_by_gateway
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.TEXT:
                    await inbox.put(msg.data)
            closed_by_gateway = True

        reader = asyncio.create_task(receive())
        t0 = time.monotonic()
        playout_end = 0.0
        try:
            for line in messages:
                obj = json.loads(line)
                if obj.get("event") == "media" and playout is not None:
                    t = float(obj["media"]["timestamp"])
                    playout_end = t + 20
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
                if obj.get("event") == "start":
                    line = _with_token(line, token, params or {}, call_sid)
                    playout = TwilioPlayout(stream_sid=str(obj.get("streamSid", "")))
                if ws.closed:
                    break
                await ws.send_str(line)
                frames += 1
            await ws.close()
        finally:
            await asyncio.wait_for(reader, timeout=5)
        if playout is not None:
            while not inbox.empty():
                playout.receive(inbox.get_nowait(), at_ms=playout_end)
    return CallReport(playout.stats if playout else PlayoutStats(), frames, closed_by_gateway)


def run_call(args: argparse.Namespace) -> int:
    try:
        report = asyncio.run(play_call(args.recording, args.url, token=args.token,
                                       realtime=not args.fast, call_sid=args.call_sid))
    except (ReplayError, aiohttp.ClientError, OSError) as exc:
        print(f"callgate call: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0
