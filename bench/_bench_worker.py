"""The session worker of ``bench.load``: one process, every call, over the Redis bus.

``python -m bench._bench_worker --redis URL --recordings DIR``. It claims every call the gateway
announces (``RedisBus.claim_calls``: one process multiplexes hundreds of calls over a few
connections) and keeps the bot talking, as a worst case for the gateway's per-frame path (the
echo gate and playback work hardest while bot audio is on the line):

* ``call_started``: speak one long interruptible utterance, the call's recording's
  ``NAME.bot.wav`` (the bot's audio on the recording's own timeline, so the echo in the inbound
  track matches what the gateway plays), or a buzz when there is none;
* ``playback`` finished: speak it again; ``playback`` interrupted (a barge-in was committed): wait
  for the caller's ``speech_stopped``, then speak again;
* every uplink event is acked; the call's uplink ends after ``call_ended`` (the gateway closes
  the call), which ends the call here.

``--bot once`` speaks only the first utterance, ``--bot never`` keeps the bot silent (the
gateway's cheapest case: no outbound audio, no echo reference).

An utterance is ``UtteranceStart`` / ``Audio`` (mu-law 8 kHz, in ``--piece-ms`` pieces,
sent at once, as a streaming TTS faster than real time would) / ``UtteranceEnd`` (``bus.protocol``).

With ``--stt-port`` it also serves a stub OpenAI transcription endpoint (answers at once), for a
gateway configured with hosted speech to text.

Prints ``ready`` once connected; on SIGTERM or SIGINT it prints one JSON line of counters and
exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections import Counter
from pathlib import Path

from bus import CallInfo, EventDecodeError, RedisBus
from bus import protocol as bp

__all__ = ["main"]


class BenchWorker:
    def __init__(self, bus: RedisBus, recordings: Path, *, piece_ms: int = 200,
                 max_audio_s: float = 30.0, worker_id: str = "bench-worker",
                 bot: str = "always") -> None:
        self.bus = bus
        self.bot = bot  # always: keep talking; once: one utterance per call; never: silent
        self.recordings = recordings
        self.piece_ms = piece_ms
        self.max_bytes = int(max_audio_s * 8000)
        self.worker_id = worker_id
        self.counts: Counter[str] = Counter()
        self._audio: dict[str, list[bytes]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def pieces(self, name: str) -> list[bytes]:
        """Pieces of the recording's bot audio (cached)."""
        cached = self._audio.get(name)
        if cached is not None:
            return cached
        from audio import chunk_audio, read_wav_ulaw

        path = self.recordings / f"{name}.bot.wav"
        if name and "/" not in name and path.exists():
            ulaw = read_wav_ulaw(path)[: self.max_bytes]
        else:
            from gateway.replay import _tone

            ulaw = _tone(8000.0)
        out = list(chunk_audio(ulaw, chunk_ms=self.piece_ms))
        self._audio[name] = out
        return out

    async def speak(self, call_sid: str, utterance_id: str, name: str) -> None:
        send = self.bus.send
        await send(call_sid, bp.encode(bp.UtteranceStart(utterance_id=utterance_id, node="bench",
                                                         interruptible=True, text="")))
        for payload in self.pieces(name):
            await send(call_sid, bp.encode(bp.Audio(utterance_id=utterance_id, payload=payload)))
        await send(call_sid, bp.encode(bp.UtteranceEnd(utterance_id=utterance_id)))
        self.counts["utterances"] += 1

    async def handle(self, call: CallInfo) -> None:
        sid = call.call_sid
        name = call.params.get("recording", "")
        spoken = 0
        waiting_for_caller = False
        self.counts["calls"] += 1
        try:
            async for msg in self.bus.uplink(sid, self.worker_id):
                try:
                    event = bp.decode(msg.event)
                except EventDecodeError as exc:
                    self.counts["up:undecodable"] += 1
                    print(f"bench worker: call {sid}: {exc}", file=sys.stderr)
                    await self.bus.ack(sid, msg.id)
                    continue
                self.counts[f"up:{event.type}"] += 1
                state = event.state if isinstance(event, bp.Playback) else None
                speak = False
                if state == "interrupted":
                    waiting_for_caller = True
                elif isinstance(event, bp.SpeechStopped) and waiting_for_caller:
                    waiting_for_caller = False
                    speak = True
                else:
                    speak = isinstance(event, bp.CallStarted) or state == "finished"
                if speak and (self.bot == "always" or (self.bot == "once" and not spoken)):
                    spoken += 1
                    await self.speak(sid, f"u{spoken}", name)
                await self.bus.ack(sid, msg.id)
            self.counts["calls_ended"] += 1
        except Exception as exc:  # noqa: BLE001 (a bench call failing must not take the worker down)
            self.counts[f"error:{type(exc).__name__}"] += 1
            print(f"bench worker: call {sid}: {type(exc).__name__}: {exc}", file=sys.stderr)

    async def run(self, stop: asyncio.Event) -> None:
        async def claim() -> None:
            async for call in self.bus.claim_calls(self.worker_id):
                task = asyncio.create_task(self.handle(call))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        claimer = asyncio.create_task(claim())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({claimer, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for task in (claimer, stopper, *self._tasks):
            task.cancel()
        await asyncio.gather(claimer, stopper, *self._tasks, return_exceptions=True)


async def _stt_stub(port: int, counts: Counter[str]) -> object:
    """An OpenAI-compatible ``POST /v1/audio/transcriptions`` that answers at once: the hosted
    speech to text a production gateway would upload each caller turn to."""
    from aiohttp import web

    async def transcribe(request: web.Request) -> web.Response:
        body = await request.read()
        counts["stt_requests"] += 1
        counts["stt_bytes"] += len(body)
        return web.json_response({"text": "bench transcript"})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/audio/transcriptions", transcribe)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _main(args: argparse.Namespace) -> dict[str, int]:
    bus = RedisBus(args.redis, prefix=args.prefix, bus_id="benchwk")
    await bus.start()
    worker = BenchWorker(bus, Path(args.recordings), piece_ms=args.piece_ms, bot=args.bot)
    stt = await _stt_stub(args.stt_port, worker.counts) if args.stt_port else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    try:
        await worker.run(stop)
    finally:
        await bus.aclose()
        if stt is not None:
            await stt.cleanup()  # type: ignore[attr-defined]  # the stub's, not the protocol's
    return dict(worker.counts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._bench_worker", description=__doc__.split("\n")[0])
    p.add_argument("--redis", required=True)
    p.add_argument("--prefix", default="cg", help="RedisBus key prefix (the gateway's: cg)")
    p.add_argument("--recordings", required=True, help="folder of NAME.bot.wav")
    p.add_argument("--piece-ms", type=int, default=200)
    p.add_argument("--bot", choices=("always", "once", "never"), default="always",
                   help="keep the bot talking (default), speak once per call, or stay silent")
    p.add_argument("--cpu", type=int, default=None, help="pin to this CPU")
    p.add_argument("--stt-port", type=int, default=None,
                   help="also serve a stub OpenAI transcription endpoint on this port")
    args = p.parse_args(argv)
    if args.cpu is not None:
        import os

        os.sched_setaffinity(0, {args.cpu})
    counts = asyncio.run(_main(args))
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
