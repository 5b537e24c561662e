"""The gateways' side of the bus for ``bench.fleet``'s synthetic steps, without media.

``python -m bench._bus_gateway PLAN.json RESULT.json``. It prints ``ready``, reads the start time
(``time.monotonic()``) from stdin, and for every planned call does on the bus what a gateway's
call session does while the bot talks the whole call: ``open_call`` and ``call_started``; it
reads the call's downlink (the worker's utterances and their audio) and plays that audio out at
1x of the wall clock, publishing ``playback {state: playing, heard_ms}`` every 200 ms of audio
heard and ``playback {state: finished}`` at an utterance's end (the worker then speaks again);
when told to stop (``stop`` on stdin), ``call_ended`` and ``close_call``. No WebSocket, no Twilio frames and no
VAD: what is synthetic is the media, so one process can hold more simulated calls than this
machine could pace as real calls; the bus traffic per call-second is the talking bot's (the
result says how much bot audio crossed the bus per call-second, ~1 s when it kept up).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus import CallInfo, RedisBus
from bus import protocol as bp

__all__ = ["main"]

PROGRESS_MS = 200.0  # gateway.call.CallSettings.progress_interval_ms
TICK_S = 0.1  # 1,000 calls: 10^4 wake-ups a second, ~10% of a core


@dataclass
class _Utterance:
    uid: str
    bytes: int = 0
    ended: bool = False
    started_at: float | None = None  # when its first audio began playing (monotonic)
    reported_ms: float = 0.0
    played_ms: float = 0.0


@dataclass
class _Call:
    sid: str
    queue: list[_Utterance] = field(default_factory=list)
    ends_at: float = 0.0
    done: bool = False
    opened_at: float = 0.0
    finished_at: float | None = None  # when the last ``finished`` went out, for the round trip
    first_audio_at: float | None = None


class BusGateway:
    def __init__(self, bus: RedisBus, plan: dict[str, Any]) -> None:
        self.bus = bus
        self.plan = plan
        self.calls: dict[str, _Call] = {}
        self.round_trips: list[float] = []
        """Seconds from a ``finished`` published to the worker's next ``utterance_start``."""
        self.counts: dict[str, int] = {"audio_bytes": 0, "played_ms": 0, "downlink": 0,
                                       "uplink": 0, "calls": 0, "errors": 0}

    async def _read(self, call: _Call) -> None:
        async for msg in self.bus.downlink(call.sid):
            event = bp.decode_downlink(msg.event)
            self.counts["downlink"] += 1
            if isinstance(event, bp.UtteranceStart):
                call.queue.append(_Utterance(event.utterance_id))
                if call.finished_at is not None:
                    self.round_trips.append(time.monotonic() - call.finished_at)
                    call.finished_at = None
                if call.first_audio_at is None:
                    call.first_audio_at = time.monotonic()
            elif isinstance(event, bp.Audio) and call.queue:
                n = len(event.payload)
                call.queue[-1].bytes += n
                self.counts["audio_bytes"] += n
            elif isinstance(event, bp.UtteranceEnd) and call.queue:
                call.queue[-1].ended = True

    async def _publish(self, sid: str, event: bp.UplinkEvent) -> None:
        self.counts["uplink"] += 1
        await self.bus.publish(sid, bp.encode(event))

    async def _play(self, call: _Call, now: float, t0: float) -> None:
        """Advance the call's playout to ``now``: progress and end of the utterance playing."""
        t_ms = (now - t0) * 1000
        while call.queue:
            u = call.queue[0]
            if u.started_at is None:
                if not u.bytes:
                    return
                u.started_at = now
            heard = min(u.bytes / 8, (now - u.started_at) * 1000)
            self.counts["played_ms"] += int(heard - u.played_ms)
            u.played_ms = float(int(heard))
            if u.ended and heard >= u.bytes / 8:
                call.queue.pop(0)
                call.finished_at = now
                await self._publish(call.sid, bp.Playback(
                    state="finished", utterance_id=u.uid, heard_ms=heard, t_ms=t_ms))
                continue
            if heard - u.reported_ms >= PROGRESS_MS:
                u.reported_ms = heard
                await self._publish(call.sid, bp.Playback(
                    state="playing", utterance_id=u.uid, heard_ms=heard, t_ms=t_ms))
            return

    async def _call(self, spec: dict[str, Any], start_at: float, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, start_at + spec["offset_s"] - time.monotonic()))
        sid = spec["call_sid"]
        call = _Call(sid)
        await self.bus.open_call(CallInfo(call_sid=sid, stream_sid=spec["stream_sid"],
                                          agent="default", params={"bench": "fleet"}))
        t0 = call.opened_at = time.monotonic()
        await self._publish(sid, bp.CallStarted(agent="default", t_ms=0.0))
        self.calls[sid] = call
        self.counts["calls"] += 1
        reader = loop.create_task(self._read(call))
        try:
            while not stop.is_set():
                await self._play(call, time.monotonic(), t0)
                await asyncio.sleep(TICK_S)  # the media clock's pace, not a synchronisation
            await self._publish(sid, bp.CallEnded(reason="caller_hangup",
                                                  t_ms=(time.monotonic() - t0) * 1000))
            await self.bus.close_call(sid)
        except Exception as exc:  # noqa: BLE001 (one call failing must not stop the bench)
            self.counts["errors"] += 1
            print(f"bus gateway: call {sid}: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            call.done = True

    def _first_utterances(self) -> dict[str, int]:
        """From each call's start to the worker's first utterance (its claim, then speech)."""
        waits = sorted(c.first_audio_at - c.opened_at for c in self.calls.values()
                       if c.first_audio_at is not None)
        out = {"spoken": len(waits)}
        trips = sorted(self.round_trips)
        if trips:
            out |= {"round_trip_p50_ms": int(1000 * trips[len(trips) // 2]),
                    "round_trip_p99_ms": int(1000 * trips[int(len(trips) * 0.99)])}
        if waits:
            out |= {"first_utterance_p50_ms": int(1000 * waits[len(waits) // 2]),
                    "first_utterance_max_ms": int(1000 * waits[-1])}
        return out

    async def run(self, start_at: float) -> None:
        """Play every call until stdin says ``stop``; ``mark`` prints the counts so far (one
        JSON line); ``speaking`` is printed once every call has heard the bot."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        calls = [loop.create_task(self._call(c, start_at, stop)) for c in self.plan["calls"]]

        async def announce() -> None:
            while sum(c.first_audio_at is not None for c in self.calls.values()) < len(calls):
                await asyncio.sleep(0.1)  # a report for the driver, not a synchronisation
            print("speaking", flush=True)

        announcer = loop.create_task(announce())
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if line == "mark":
                print(json.dumps({**self.counts, **self._first_utterances(),
                                  "t": time.monotonic()}), flush=True)
            elif line in ("stop", ""):
                break
        stop.set()
        announcer.cancel()
        await asyncio.gather(*calls, announcer, return_exceptions=True)
        await self.bus.flush(10.0)
        self.counts |= self._first_utterances()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    plan_path, result_path = Path(args[0]), Path(args[1])
    plan = json.loads(plan_path.read_text())

    async def go(start_at: float) -> dict[str, int]:
        bus = RedisBus(plan["redis"], bus_id=plan.get("bus_id", "benchgw"))
        await bus.start()
        try:
            gw = BusGateway(bus, plan)
            await gw.run(start_at)
            return gw.counts
        finally:
            await bus.aclose()

    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 1
    result_path.write_text(json.dumps(asyncio.run(go(float(line)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
