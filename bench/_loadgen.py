"""The load generator of ``bench.load``: many Twilio calls over real WebSockets, one process.

Run by ``bench.load`` as ``python -m bench._loadgen PLAN.json RESULT.json``; it prints ``ready``
once its recordings are loaded, reads the start time (``time.monotonic()``, shared by every
process on the machine) from stdin, plays its calls and writes what it measured.

Each call behaves as Twilio does for a bidirectional Media Streams call:

* it opens ``/twilio/media``, sends ``connected`` and ``start`` (its own CallSid and StreamSid,
  ``customParameters.recording`` naming the recording for the bench worker), then one 20 ms
  ``media`` frame per 20 ms of wall clock, looping the recording until ``call_seconds``, then
  ``stop``;
* media frame ``[t, t+20)`` leaves when its audio is complete, at ``t0 + (t + 20) ms`` (``t0``:
  the call's media time 0), so the caller's media clock at wall time ``T`` is ``T - t0``;
* the gateway's audio is played at 1x from its arrival; a ``mark`` is echoed once the audio
  queued before it has played, and on ``clear`` every pending mark is echoed at once (the same
  rules as :class:`gateway.twilio_sim.TwilioPlayout`, re-implemented lean: this process holds
  hundreds of calls, and parsing every outbound frame fully would make it the bottleneck).

Marks are echoed at frame ticks (as ``gateway.client.play_call`` does): those due by the end of
frame ``k`` go out right after frame ``k``, at the same instant. Not before it: the gateway's
``callgate_frame_lag_seconds`` is observed for every inbound message, marks included, against
the media time of the latest *media* frame, so an echo sent just before frame ``k`` would be
counted ~20 ms "behind" (its media clock still at the end of frame ``k-1``) while no work waits.

Pacing: one ticker task for all calls, on a 2 ms grid. Call start offsets are whole grid steps,
so every frame is due exactly on a tick and the only send jitter is the ticker's own lateness,
which is measured (``lateness``) to show whether the generator kept up.

Barge-in latency, client side: the caller's media time at which the first ``clear`` at or after
the labelled onset (``expect.barge_in_onset_ms``, first pass through the recording only) reached
this process, minus that onset.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

__all__ = ["MARK", "MEDIA", "LeanPlayout", "Recording", "load_recording", "main", "percentile"]

FRAME_MS = 20
TICK_S = 0.002
SLOTS = round(FRAME_MS / 1000 / TICK_S)  # ticks per frame period
BARGE_WINDOW_MS = (-100.0, 3000.0)  # a clear in [onset-100, onset+3000] is the barge-in's

# The exact text gateway.twilio_protocol.build_media / build_mark produce (tests check it).
MEDIA = ('{"event":"media","sequenceNumber":"%d","media":{"track":"inbound","chunk":"%d",'
         '"timestamp":"%d","payload":"%s"},"streamSid":"%s"}')
MARK = '{"event":"mark","sequenceNumber":"%d","streamSid":"%s","mark":{"name":%s}}'


@dataclass(slots=True)
class Recording:
    name: str
    payloads: list[str]  # base64 of each 20 ms frame
    onset_ms: float | None  # labelled barge-in onset, for barge-in recordings

    @property
    def duration_ms(self) -> int:
        return len(self.payloads) * FRAME_MS


def load_recording(folder: Path, name: str) -> Recording:
    from audio import FRAME_BYTES, read_wav_ulaw

    ulaw = read_wav_ulaw(folder / f"{name}.wav")
    payloads = [base64.b64encode(ulaw[i : i + FRAME_BYTES]).decode("ascii")
                for i in range(0, len(ulaw) - FRAME_BYTES + 1, FRAME_BYTES)]
    onset = None
    labels = folder / f"{name}.json"
    if labels.exists():
        expect = json.loads(labels.read_text()).get("expect") or {}
        if expect.get("barge_in") and expect.get("barge_in_onset_ms") is not None:
            onset = float(expect["barge_in_onset_ms"])
    return Recording(name, payloads, onset)


class LeanPlayout:
    """Twilio's outbound audio queue on the caller's media clock (TwilioPlayout's rules)."""

    __slots__ = ("audio_bytes", "clears", "marks_echoed", "queue", "tail")

    def __init__(self) -> None:
        # (True, start_ms, end_ms) audio | (False, due_ms, name) mark
        self.queue: deque[tuple[bool, float, Any]] = deque()
        self.tail = 0.0
        self.audio_bytes = 0
        self.marks_echoed = 0
        self.clears = 0

    def media(self, n_bytes: int, at_ms: float) -> None:
        start = max(at_ms, self.tail)
        self.tail = start + n_bytes / 8
        self.queue.append((True, start, self.tail))
        self.audio_bytes += n_bytes

    def mark(self, name: str, at_ms: float) -> None:
        self.tail = max(self.tail, at_ms)
        self.queue.append((False, self.tail, name))

    def advance(self, to_ms: float) -> list[str]:
        """Marks whose audio has played by ``to_ms``."""
        out = []
        q = self.queue
        while q:
            is_audio, t, x = q[0]
            if is_audio:
                if x > to_ms:
                    break
            elif t > to_ms:
                break
            else:
                out.append(x)
            q.popleft()
        self.marks_echoed += len(out)
        return out

    def clear(self, at_ms: float) -> list[str]:
        """``clear``: every pending mark is echoed now, the queue emptied."""
        names = self.advance(at_ms)
        pending = [x for is_audio, _, x in self.queue if not is_audio]
        self.marks_echoed += len(pending)
        self.queue.clear()
        self.tail = at_ms
        self.clears += 1
        return names + pending


def _b64_len(payload: str) -> int:
    n = len(payload) * 3 // 4
    if payload.endswith("=="):
        return n - 2
    if payload.endswith("="):
        return n - 1
    return n


@dataclass(eq=False, slots=True)
class _Call:
    index: int
    rec: Recording
    call_sid: str
    stream_sid: str
    t0: float  # wall (monotonic) time of media 0
    slot: int  # grid slot of t0
    frames: int  # media frames to send
    ws: aiohttp.ClientWebSocketResponse | None = None
    k: int = 0  # next frame
    seq: int = 3
    echo_seq: int = 1_000_000
    sending: bool = False
    finished: bool = False
    closed_early: bool = False
    error: str | None = None
    playout: LeanPlayout = field(default_factory=LeanPlayout)
    clears_ms: list[float] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def next_due(self) -> float:
        return self.t0 + (self.k + 1) * FRAME_MS / 1000

    def echo(self, name: str) -> str:
        self.echo_seq += 1
        return MARK % (self.echo_seq, self.stream_sid, json.dumps(name))


class Generator:
    def __init__(self, plan: dict[str, Any], recordings: dict[str, Recording]) -> None:
        self.plan = plan
        self.recordings = recordings
        self.url = plan["url"]
        self.window = (0.0, 0.0)
        self.lateness: list[float] = []  # seconds, frames due inside the window
        self.late_all_max = 0.0
        self.calls: list[_Call] = []
        self.slots: list[list[_Call]] = [[] for _ in range(SLOTS)]

    async def run(self, start_at: float) -> None:
        p = self.plan
        self.window = (start_at + p["window"][0], start_at + p["window"][1])
        n_frames = round(p["call_seconds"] * 1000 / FRAME_MS)
        for c in p["calls"]:
            slot = round(c["offset_s"] / TICK_S)
            call = _Call(c["index"], self.recordings[c["recording"]], c["call_sid"],
                         c["stream_sid"], start_at + slot * TICK_S, slot, n_frames)
            self.calls.append(call)
            self.slots[slot % SLOTS].append(call)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, connect=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            tasks = [asyncio.create_task(self._call(http, c)) for c in self.calls]
            ticker = asyncio.create_task(self._ticker(start_at))
            await asyncio.gather(*tasks, return_exceptions=True)
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)

    async def _call(self, http: aiohttp.ClientSession, call: _Call) -> None:
        delay = call.t0 - 0.05 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            ws = await http.ws_connect(self.url, autoping=True, max_msg_size=1 << 20)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            call.error = f"connect: {type(exc).__name__}: {exc}"
            call.finished = True
            return
        call.ws = ws
        try:
            from gateway import twilio_protocol as tp

            await ws.send_str(tp.build_connected())
            await ws.send_str(tp.build_start(
                sequence_number=1, stream_sid=call.stream_sid, account_sid="AC" + "0" * 32,
                call_sid=call.call_sid, tracks=["inbound"],
                custom_parameters={"recording": call.rec.name, "bench": "load"}))
            call.sending = True
            reader = asyncio.create_task(self._read(call))
            await call.done.wait()
            await ws.send_str(tp.build_stop(sequence_number=call.seq, stream_sid=call.stream_sid,
                                            account_sid="AC" + "0" * 32, call_sid=call.call_sid))
            await ws.close()
            await asyncio.wait_for(reader, timeout=60)
        except (TimeoutError, aiohttp.ClientError, OSError, ConnectionError) as exc:
            call.error = f"{type(exc).__name__}: {exc}"
        finally:
            call.sending = False
            call.finished = True
            if not ws.closed:
                await ws.close()

    async def _read(self, call: _Call) -> None:
        ws = call.ws
        assert ws is not None
        t0 = call.t0
        p = call.playout
        loads = json.loads
        async for msg in ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            at = (time.monotonic() - t0) * 1000
            try:
                obj = loads(msg.data)
                kind = obj["event"]
                if kind == "media":
                    p.media(_b64_len(obj["media"]["payload"]), at)
                elif kind == "mark":
                    p.mark(obj["mark"]["name"], at)
                elif kind == "clear":
                    call.clears_ms.append(at)
                    for name in p.clear(at):
                        await ws.send_str(call.echo(name))
            except (ValueError, KeyError, TypeError):
                continue
        if not call.done.is_set():
            call.closed_early = True
            call.done.set()

    async def _ticker(self, start_at: float) -> None:
        j = 0
        lateness = self.lateness
        w0, w1 = self.window
        while True:
            target = start_at + j * TICK_S
            delay = target - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.monotonic()
            for call in self.slots[j % SLOTS]:
                if not call.sending or call.done.is_set():
                    continue
                ws = call.ws
                assert ws is not None
                while call.k < call.frames and (due := call.next_due) <= now + 1e-4:
                    late = now - due
                    if w0 <= due < w1:
                        lateness.append(late)
                    self.late_all_max = max(self.late_all_max, late)
                    k = call.k
                    rec = call.rec.payloads
                    await ws.send_str(MEDIA % (call.seq, k + 1, k * FRAME_MS, rec[k % len(rec)],
                                               call.stream_sid))
                    call.seq += 1
                    call.k += 1
                    # Marks due by the end of this frame, echoed right after it (same instant):
                    # see the module docstring on why not before it.
                    for name in call.playout.advance((k + 1) * FRAME_MS):
                        await ws.send_str(call.echo(name))
                if call.k >= call.frames:
                    call.done.set()
            j += 1

    def results(self) -> dict[str, Any]:
        calls = []
        for c in self.calls:
            latency = None
            if c.rec.onset_ms is not None:
                lo, hi = c.rec.onset_ms + BARGE_WINDOW_MS[0], c.rec.onset_ms + BARGE_WINDOW_MS[1]
                hits = [t for t in c.clears_ms if lo <= t <= min(hi, c.rec.duration_ms)]
                if hits:
                    latency = hits[0] - c.rec.onset_ms
            calls.append({
                "index": c.index, "recording": c.rec.name, "call_sid": c.call_sid,
                "frames_sent": c.k, "frames_planned": c.frames, "error": c.error,
                "closed_early": c.closed_early, "clears_ms": [round(t, 1) for t in c.clears_ms],
                "barge_in_expected": c.rec.onset_ms is not None
                and c.rec.onset_ms + 1000 < min(c.rec.duration_ms, c.frames * FRAME_MS),
                "barge_in_latency_ms": latency,
                "bot_audio_s": c.playout.audio_bytes / 8000, "marks_echoed": c.playout.marks_echoed,
            })
        late = sorted(self.lateness)
        return {"calls": calls, "lateness_s": _summary(late), "lateness_max_all_s": self.late_all_max,
                "cpu_s": time.process_time()}


def percentile(ordered: list[float], q: float) -> float | None:
    """The ``q`` quantile of already sorted values, nearest rank (None when empty)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _summary(values: list[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "p50": percentile(values, 0.5), "p99": percentile(values, 0.99),
            "max": values[-1] if values else None}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    plan_path, result_path = Path(args[0]), Path(args[1])
    plan = json.loads(plan_path.read_text())
    if plan.get("cpu") is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(plan["cpu"])})
    folder = Path(plan["recordings_dir"])
    recordings = {n: load_recording(folder, n) for n in {c["recording"] for c in plan["calls"]}}
    import gateway.twilio_protocol  # noqa: F401  (imported before the clock starts)

    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 1
    start_at = float(line)

    async def go() -> dict[str, Any]:
        gen = Generator(plan, recordings)
        await gen.run(start_at)
        return gen.results()

    result = asyncio.run(go())
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
