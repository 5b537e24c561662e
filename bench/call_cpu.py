"""What the call logic itself costs, without sockets: ``python -m bench.call_cpu``.

``bench.load`` measures the whole gateway and ``bench.ws_floor`` the WebSocket traffic alone;
this measures the rest, in process: N :class:`gateway.call.CallSession` objects on one
:class:`vad.VadEngine` (``callgate serve``'s defaults: ``auto`` runtime, 5 ms batching
wait), fed Twilio's frame texts directly, lock-step on the
media clock (every 20 ms frame of every call, then the next), so every VAD batch holds all N calls
(up to the engine's largest batch) and the batch size is N, not a matter of timing. Each caller
loops a labelled recording of tests/recordings; the bot talks all the time (10 s utterances of the
recording's own bot audio, in 200 ms pieces as the bench worker sends them); marks are echoed
once their audio has played, as Twilio does. No metrics, no bus server (the embedded bus), no
speech to text; the bot's events are handed over as records, so decoding them (``bus.protocol``:
since protocol 1.1, with the audio binary, ~6 us per 200 ms piece against ~14 us for 1.0's
base64 in JSON, ``python -m bench.frame_cost``) is not counted.

For each N it prints the CPU per call-second (``time.process_time``, this process pinned to one
CPU), and how much of it is Silero, the echo/noise gate with the window features, and the rest of
the engine's batch; what is left is the call controller (parsing, policy, playback, building
outbound messages) plus this driver's own small share (formatting frames, the mark queue).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import gc
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, ParamSpec, TypeVar

from bus import protocol as bp

from ._loadgen import MARK, MEDIA, LeanPlayout, _b64_len
from .load import RECORDINGS, recording_names

_P = ParamSpec("_P")
_R = TypeVar("_R")

__all__ = ["main", "measure"]

FRAME_MS = 20
UTTERANCE_S = 10
PIECE_MS = 200


class _Timed(Generic[_P, _R]):
    """Adds the CPU time of calls to ``fn`` to ``self.seconds`` (not re-entrant: fine here)."""

    def __init__(self, fn: Callable[_P, _R]) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        t = time.process_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.process_time() - t


async def measure(n: int, seconds: float, recordings: Path = RECORDINGS, *,
                  runtime: str = "auto", max_wait_ms: float = 5.0,
                  echo_canceller: str | None = None, bot_silent: bool = False,
                  classifier: str | None = None) -> dict[str, Any]:
    """N calls for ``seconds`` of media time; CPU figures per call-second. ``runtime`` and
    ``max_wait_ms``: the engine's, as ``callgate serve`` sets them by default.
    ``echo_canceller``: ``aec3`` or ``off`` (barge_in.echo_canceller); None: the default.
    ``classifier``: ``fitted`` or ``off`` (barge_in.classifier); None: the default.
    ``bot_silent``: the bot never talks (what an echo canceller costs a call it cannot help)."""
    from bus import EmbeddedBus
    from gateway import twilio_protocol as tp
    from audio import FRAME_BYTES, TELEPHONY_RATE, ULAW_BYTES_PER_MS, ULAW_SILENCE, read_wav_ulaw
    from gateway.call import CallSession
    from vad import VadEngine

    names = recording_names(recordings)
    frames_of: dict[str, list[str]] = {}
    bot_of: dict[str, list[bytes]] = {}
    for name in names:
        ulaw = read_wav_ulaw(recordings / f"{name}.wav")
        frames_of[name] = [base64.b64encode(ulaw[i : i + FRAME_BYTES]).decode()
                           for i in range(0, len(ulaw) - FRAME_BYTES + 1, FRAME_BYTES)]
        bot_path = recordings / f"{name}.bot.wav"
        bot = read_wav_ulaw(bot_path) if bot_path.exists() else ULAW_SILENCE * TELEPHONY_RATE
        size = UTTERANCE_S * TELEPHONY_RATE
        bot = (bot * (size // max(1, len(bot)) + 1))[:size]
        step = PIECE_MS * ULAW_BYTES_PER_MS
        bot_of[name] = [bot[i : i + step] for i in range(0, len(bot), step)]

    # (`runtime` is argparse's, limited by its choices to the engine's runtimes.)
    engine = VadEngine(runtime=runtime, max_wait_ms=max_wait_ms)  # type: ignore[arg-type]
    await engine.start()
    bus = EmbeddedBus()
    await bus.start()
    model = engine.runtime
    # The timers are patched onto this engine's methods: that is the measurement.
    infer = _Timed(model.infer)
    model.infer = infer  # type: ignore[method-assign]
    hear = _Timed(engine._hear)
    engine._hear = hear  # type: ignore[method-assign]
    run_batch = _Timed(engine._run_batch)
    engine._run_batch = run_batch  # type: ignore[method-assign]

    from gateway.call import CallSettings
    from vad import AecMode

    settings = (CallSettings() if echo_canceller is None
                else CallSettings(echo_canceller=AecMode(echo_canceller)))
    if classifier is not None:
        settings = dataclasses.replace(settings, barge_in=(
            settings.barge_in.with_fitted_classifier() if classifier == "fitted"
            else settings.barge_in.without_classifier()))
    calls = []
    for i in range(n):
        name = names[i % len(names)]
        sid = f"MZ{i:032d}"
        playout = LeanPlayout()
        now = [0.0]
        cleared: list[str] = []  # marks a clear released, echoed with the next frame

        async def send(text: str, playout: LeanPlayout = playout, now: list[float] = now,
                       cleared: list[str] = cleared) -> None:
            obj = json.loads(text)
            kind = obj["event"]
            if kind == "media":
                playout.media(_b64_len(obj["media"]["payload"]), now[0])
            elif kind == "mark":
                playout.mark(obj["mark"]["name"], now[0])
            elif kind == "clear":
                cleared.extend(playout.clear(now[0]))

        session = CallSession(send=send, bus=bus, vad=engine, settings=settings)
        await session.handle_text(tp.build_start(
            sequence_number=1, stream_sid=sid, account_sid="AC" + "0" * 32,
            call_sid=f"CA{i:032d}", tracks=["inbound"], custom_parameters={}))
        calls.append((session, sid, frames_of[name], bot_of[name], playout, now, cleared))

    async def frame(k: int, session: CallSession, sid: str, rec: list[str], playout: LeanPlayout,
                    now: list[float], cleared: list[str]) -> None:
        now[0] = (k + 1) * FRAME_MS
        await session.handle_text(MEDIA % (k + 2, k + 1, k * FRAME_MS, rec[k % len(rec)], sid))
        echoes = playout.advance(now[0])
        if cleared:
            echoes, cleared[:] = cleared + echoes, []
        for name in echoes:
            await session.handle_text(MARK % (10**6 + k, sid, json.dumps(name)))

    total = int(seconds * 1000 / FRAME_MS)
    per_utterance = UTTERANCE_S * 1000 // FRAME_MS
    gc.collect()
    gc.freeze()
    cpu0 = time.process_time()
    for k in range(total):
        if k % per_utterance == 0 and not bot_silent:
            for j, (session, _sid, _rec, pieces, *_rest) in enumerate(calls):
                uid = f"u{k}-{j}"
                await session.handle_downlink(bp.UtteranceStart(utterance_id=uid, node="bench",
                                                                interruptible=True))
                for piece in pieces:  # records, as the downlink task hands them over
                    await session.handle_downlink(bp.Audio(utterance_id=uid, payload=piece))
                await session.handle_downlink(bp.UtteranceEnd(utterance_id=uid))
        await asyncio.gather(*(frame(k, *c[:3], *c[4:]) for c in calls))
    cpu = time.process_time() - cpu0
    stats = engine.stats
    for session, *_ in calls:
        await session.end("bench")
    await engine.aclose()
    await bus.aclose()
    call_s = n * seconds
    ms = 1000 / call_s
    return {
        "calls": n, "seconds": seconds, "mean_batch": stats.windows / max(1, stats.batches),
        "ms_per_call_second": cpu * ms, "silero_ms": infer.seconds * ms,
        "gate_features_ms": hear.seconds * ms,
        "engine_rest_ms": (run_batch.seconds - infer.seconds - hear.seconds) * ms,
        "call_logic_ms": (cpu - run_batch.seconds) * ms,
        "clears": sum(c[4].clears for c in calls),
        "bot_audio_s": sum(c[4].audio_bytes for c in calls) / 8000,
        "marks_echoed": sum(c[4].marks_echoed for c in calls),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.call_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--calls", default="8,25,50,100",
                   type=lambda s: [int(x) for x in s.split(",") if x.strip()])
    p.add_argument("--seconds", type=float, default=30.0, help="media time per call")
    p.add_argument("--runtime", choices=("auto", "torchscript", "onnx"), default="auto")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--echo-canceller", default=None,
                   help="comma-separated barge_in.echo_canceller values to compare in one run "
                        "(off,aec3); default: the configured one")
    p.add_argument("--classifier", default=None,
                   help="comma-separated barge_in.classifier values to compare in one run "
                        "(off,fitted); default: the configured one")
    p.add_argument("--bot-silent", action="store_true", help="the bot never talks")
    args = p.parse_args(argv)
    echo_modes = (args.echo_canceller.split(",") if args.echo_canceller else [None])
    if any(m not in (None, "off", "aec3") for m in echo_modes):
        p.error(f"--echo-canceller takes off and/or aec3, got {args.echo_canceller!r}")
    classifiers = (args.classifier.split(",") if args.classifier else [None])
    if any(c not in (None, "off", "fitted") for c in classifiers):
        p.error(f"--classifier takes off and/or fitted, got {args.classifier!r}")
    modes = [(m, c) for m in echo_modes for c in classifiers]
    if hasattr(os, "sched_getaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rows = []
    print("calls | VAD batch (N up to 128) | ms CPU per call-second | x first N | Silero | gate+features "
          "| engine rest | call logic + driver")
    for (mode, cls), n in ((m, n) for m in modes for n in args.calls):
        r = asyncio.run(measure(n, args.seconds, runtime=args.runtime, echo_canceller=mode,
                                bot_silent=args.bot_silent, classifier=cls))
        r["echo_canceller"] = mode or "default"
        r["classifier"] = cls or "default"
        rows.append(r)
        r["x_first"] = r["ms_per_call_second"] / rows[0]["ms_per_call_second"]
        if len(modes) > 1:
            print(f"echo_canceller={mode or 'default'} classifier={cls or 'default'}: ", end="")
        print(f"{n:5d} | {r['mean_batch']:23.1f} | {r['ms_per_call_second']:22.2f} | "
              f"{r['x_first']:8.2f}x | "
              f"{r['silero_ms']:6.2f} | {r['gate_features_ms']:13.2f} | {r['engine_rest_ms']:11.2f} "
              f"| {r['call_logic_ms']:19.2f}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
