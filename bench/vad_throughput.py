"""Concurrent real-time calls per CPU core: per-call Silero vs the batched VadEngine.

Run: ``python -m bench.vad_throughput`` (under a minute on a quiet machine; ``--quick`` for a
smoke run).

Everything runs in this one process, pinned to one core with one inference thread, on the same
recorded calls, for both runtimes. CPU time is ``time.process_time``; a call produces one
256-sample window every 32 ms, so ``calls/core = audio seconds scored / CPU seconds``.

(a) per-call: one batch-1 inference per call per window, the way Pipecat and LiveKit run Silero.
    (a1) one model shared by all calls (LiveKit: one model per process), model only: no framing,
    no asyncio; the most favourable per-call baseline and the one ratios are quoted against.
    (a2) one ORT session per call (Pipecat). (a3) silero_vad's ``OnnxWrapper`` (torch tensors
    around ORT). (a4) the engine itself with ``max_batch=1``. (a) scores the first quarter of the
    excerpts the other parts use, to keep the run short.
(b) the batched engine: every call pushes 20 ms frames from its own asyncio task and awaits its
    windows; ``max_batch`` 16/64/128. (b0) is the model alone on batches of 128.
(c) the whole media path per 20 ms frame: Twilio ``media`` JSON parse, base64 decode, mu-law
    LUT, and the engine's VAD. (c2) the same with the bot talking: the echo/noise gate (fed
    the recording's bot audio 240 ms ahead in 40 ms chunks, as the gateway sends it) and the
    window features, one call at a time (``EchoGate`` + ``window_features`` per window, as the
    gateway did before) against batched in the engine (``open_stream(echo=...)``).
(d) paced like real traffic: each call's frames arrive on the wall clock at its own random phase,
    so batches fill only as far as ``max_wait_ms`` and the load let them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from gateway.call import CallSettings
from audio import read_wav_ulaw, ulaw_to_float32
from vad._engine import VadEngine
from vad._silero import (
    INPUT_SAMPLES,
    WINDOW_SAMPLES,
    OnnxSilero,
    RuntimeName,
    SileroRuntime,
    initial_state,
    load_runtime,
    model_path,
)

__all__ = ["main"]

Audio = npt.NDArray[np.float32]
WINDOW_S = WINDOW_SAMPLES / 8000  # 32 ms of one call's audio per window
FRAME = 160  # samples (and mu-law bytes) in one 20 ms Twilio media frame

_REPO = Path(__file__).resolve().parents[1]
_CANDIDATES = (_REPO / "tests" / "recordings",)


def _recordings_dir() -> Path:
    for folder in _CANDIDATES:
        if any(folder.glob("*.wav")):
            return folder
    raise SystemExit(f"no recordings found in {', '.join(map(str, _CANDIDATES))}")


def _caller_wavs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.wav") if not p.name.endswith(".bot.wav"))


def _pin_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        cpu = max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to CPU {cpu}"
    return "not pinned (no sched_setaffinity)"


def _signals(folder: Path, calls: int, seconds: float) -> list[Audio]:
    """``calls`` different excerpts: every recording at several offsets."""
    audio = [ulaw_to_float32(read_wav_ulaw(p)) for p in _caller_wavs(folder)]
    length = int(seconds * 8000)
    out = []
    for i in range(calls):
        a = audio[i % len(audio)]
        offset = ((i // len(audio)) * 8000 + 37 * i) % max(1, len(a) - length)
        out.append(np.ascontiguousarray(a[offset : offset + length]))
    return out


def _bot_audio(folder: Path, calls: int, frames: int) -> list[Audio]:
    """Each call's bot audio (``NAME.bot.wav``) over the span :func:`_media_messages` takes, plus
    the playback lead: what the gateway would send while those frames come in."""
    audio = [ulaw_to_float32(read_wav_ulaw(p.with_name(p.stem + ".bot.wav")))
             for p in _caller_wavs(folder)]
    caller = [len(read_wav_ulaw(p)) for p in _caller_wavs(folder)]
    out = []
    for i in range(calls):
        data, total = audio[i % len(audio)], caller[i % len(audio)] // FRAME
        first = ((i // len(audio)) * 7) % max(1, total - frames)
        out.append(np.ascontiguousarray(data[first * FRAME : (first + frames) * FRAME + _LEAD]))
    return out


_LEAD = int(CallSettings().playback_lead_ms) * 8  # the gateway sends bot audio this far ahead
_CHUNK = CallSettings().chunk_ms * 8  # in media messages this long


def _media_messages(folder: Path, calls: int, frames: int) -> list[list[str]]:
    """Each call's inbound ``media`` messages as Twilio sends them, built from the WAV data.

    Compact JSON in the field order of Twilio's docs, 160 mu-law bytes per payload: for
    barge_in_timit these lines equal its ``.twilio.jsonl`` capture except for the stream SID.
    """
    audio = [read_wav_ulaw(p) for p in _caller_wavs(folder)]
    out = []
    for i in range(calls):
        data = audio[i % len(audio)]
        total = len(data) // FRAME
        first = ((i // len(audio)) * 7) % max(1, total - frames)
        lines = []
        for c in range(first, min(total, first + frames)):
            media = {
                "track": "inbound",
                "chunk": str(c + 1),
                "timestamp": str(c * 20),
                "payload": base64.b64encode(data[c * FRAME : (c + 1) * FRAME]).decode("ascii"),
            }
            message = {
                "event": "media",
                "sequenceNumber": str(c + 2),
                "media": media,
                "streamSid": f"MZ{i:032x}",
            }
            lines.append(json.dumps(message, separators=(",", ":")))
        out.append(lines)
    return out


@dataclass
class Row:
    runtime: str
    mode: str
    batch: str
    windows: int
    cpu_s: float
    mean_batch: float | None = None

    @property
    def us_per_window(self) -> float:
        return self.cpu_s / self.windows * 1e6

    @property
    def calls_per_core(self) -> float:
        return self.windows * WINDOW_S / self.cpu_s


def _cpu(fn: Callable[[], int], repeat: int) -> tuple[int, float]:
    """Median CPU seconds of ``repeat`` runs of ``fn`` (which returns the windows it scored)."""
    fn()  # warm-up: first-call allocations, ORT/oneDNN kernel selection, TorchScript profiling
    times, windows = [], 0
    for _ in range(repeat):
        t = time.process_time()
        windows = fn()
        times.append(time.process_time() - t)
    return windows, statistics.median(times)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# -- (a) per-call -------------------------------------------------------------------------------
def _per_call_model(runtime: SileroRuntime | list[SileroRuntime], signals: list[Audio]) -> int:
    """One batch-1 inference per call per window, each call with its own state and context.

    ``runtime`` is one model shared by every call, or a list with one model per call.
    """
    models = runtime if isinstance(runtime, list) else [runtime] * len(signals)
    n = min(len(s) for s in signals) // WINDOW_SAMPLES
    states = [initial_state(1) for _ in signals]
    rows = [np.zeros((1, INPUT_SAMPLES), dtype=np.float32) for _ in signals]
    for k in range(n):
        lo, hi = k * WINDOW_SAMPLES, (k + 1) * WINDOW_SAMPLES
        for c, signal in enumerate(signals):
            x = rows[c]
            x[0, 32:] = signal[lo:hi]
            _, states[c] = models[c].infer(x, states[c])
            x[0, :32] = x[0, -32:]
    return n * len(signals)


def _upstream_wrapper(signals: list[Audio]) -> Callable[[], int]:
    """silero_vad's OnnxWrapper, one per call (torch tensors around ORT)."""
    import torch
    from silero_vad.utils_vad import OnnxWrapper

    path = str(model_path("silero_vad.onnx"))
    wrappers = [OnnxWrapper(path, force_onnx_cpu=True) for _ in signals]
    n = min(len(s) for s in signals) // WINDOW_SAMPLES
    tensors = [torch.from_numpy(s) for s in signals]

    def run() -> int:
        with torch.no_grad():
            for w in wrappers:
                w.reset_states()
            for k in range(n):
                for w, t in zip(wrappers, tensors, strict=True):
                    w(t[k * WINDOW_SAMPLES : (k + 1) * WINDOW_SAMPLES], 8000)
        return n * len(signals)

    return run


# -- (b) batched --------------------------------------------------------------------------------
def _batched_model(runtime: SileroRuntime, signals: list[Audio], batch: int) -> int:
    """The model alone on batches of ``batch`` calls: the floor the engine adds to."""
    n = min(len(s) for s in signals) // WINDOW_SAMPLES
    for g in range(0, len(signals), batch):
        group = signals[g : g + batch]
        state = initial_state(len(group))
        x = np.zeros((len(group), INPUT_SAMPLES), dtype=np.float32)
        for k in range(n):
            for r, signal in enumerate(group):
                x[r, 32:] = signal[k * WINDOW_SAMPLES : (k + 1) * WINDOW_SAMPLES]
            _, state = runtime.infer(x, state)
            x[:, :32] = x[:, -32:]
    return n * len(signals)


async def _drive_engine(engine: VadEngine, signals: list[Audio]) -> int:
    """Every call pushes its 20 ms frames from its own task and awaits its windows."""
    streams = [engine.open_stream() for _ in signals]

    async def call(i: int) -> int:
        stream, signal = streams[i], signals[i]
        scored = 0
        for start in range(0, len(signal), FRAME):
            scored += len(await stream.process(signal[start : start + FRAME]))
        stream.close()
        return scored

    return sum(await asyncio.gather(*(call(i) for i in range(len(signals)))))


def _engine_run(
    runtime: SileroRuntime, signals: list[Audio], max_batch: int, max_wait_ms: float
) -> tuple[Callable[[], int], Callable[[], float]]:
    """A runnable for ``_cpu`` and a getter for the mean batch size of its last run."""
    mean_batches: list[float] = []

    async def once() -> int:
        engine = VadEngine(runtime=runtime, max_batch=max_batch, max_wait_ms=max_wait_ms)
        async with engine:
            scored = await _drive_engine(engine, signals)
            stats = engine.stats
            mean_batches.append(stats.windows / max(1, stats.batches))
            return scored

    return (lambda: asyncio.run(once())), (lambda: mean_batches[-1])


# -- (c) media path -----------------------------------------------------------------------------
def _decode(line: str) -> Audio | None:
    """Twilio message -> float32 samples (None if not ``media``): JSON, base64, mu-law LUT."""
    msg = json.loads(line)
    if msg.get("event") != "media":
        return None
    payload = base64.b64decode(msg["media"]["payload"])
    return ulaw_to_float32(payload)


def _decode_only(messages: list[list[str]]) -> int:
    return sum(1 for lines in messages for line in lines if _decode(line) is not None)


async def _media_path(engine: VadEngine, messages: list[list[str]]) -> int:
    streams = [engine.open_stream() for _ in messages]

    async def call(i: int) -> int:
        frames = 0
        for line in messages[i]:
            samples = _decode(line)
            if samples is not None:
                await streams[i].process(samples)
                frames += 1
        streams[i].close()
        return frames

    return sum(await asyncio.gather(*(call(i) for i in range(len(messages)))))


async def _media_path_gated(engine: VadEngine, messages: list[list[str]], bots: list[Audio],
                            batched: bool) -> int:
    """(c2): the media path with the bot's audio on the line: gate and features per window,
    batched in the engine or one call at a time."""
    from vad import EchoGate, EchoGateSettings, window_features

    settings = EchoGateSettings()
    streams = [engine.open_stream(echo=settings if batched else None) for _ in messages]

    async def call(i: int) -> int:
        stream, bot = streams[i], bots[i]
        gate = None if batched else EchoGate(settings)
        frames = sent = 0
        pending = np.zeros(0, dtype=np.float32)
        previous = np.zeros(128, dtype=np.float32)
        for line in messages[i]:
            samples = _decode(line)
            if samples is None:
                continue
            now = (frames + 1) * FRAME
            while sent < min(len(bot), now + _LEAD):
                chunk = bot[sent : sent + _CHUNK]
                if gate is None:
                    stream.add_reference(sent, chunk)
                else:
                    gate.add_reference(sent, chunk)
                sent += _CHUNK
            results = await stream.process(samples)
            if gate is not None:
                pending = np.concatenate([pending, samples])
                for _ in results:
                    window, pending = pending[:WINDOW_SAMPLES], pending[WINDOW_SAMPLES:]
                    if gate.process(window).passes:
                        window_features(window, previous)
                    previous = window[-128:]
            frames += 1
        stream.close()
        return frames

    return sum(await asyncio.gather(*(call(i) for i in range(len(messages)))))


# -- (d) paced ----------------------------------------------------------------------------------
async def _paced(
    engine: VadEngine, signals: list[Audio], seconds: float, seed: int
) -> tuple[float, float, int]:
    """Push each call's frames every 20 ms of wall clock, each call at its own phase.

    One pacer task pushes every frame that is due (as the gateway's socket handlers would, one
    frame per message); windows run whenever the engine's flush rules fire. The pacer's CPU is
    counted too: it stands in for the gateway. Returns (CPU s, wall s, windows scored).
    """
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    streams = [engine.open_stream() for _ in signals]
    phases = [rng.random() * 0.020 for _ in signals]
    n_frames = int(seconds / 0.020)
    schedule = sorted((p + 0.020 * k, c) for c, p in enumerate(phases) for k in range(n_frames))
    start_wall, start_cpu = loop.time(), time.process_time()
    sent = [0] * len(signals)
    i = 0
    while i < len(schedule):
        now = loop.time() - start_wall
        while i < len(schedule) and schedule[i][0] <= now:
            c = schedule[i][1]
            k = sent[c]
            streams[c].push(signals[c][k * FRAME : (k + 1) * FRAME])
            sent[c] = k + 1
            i += 1
        if i < len(schedule):
            await asyncio.sleep(max(0.0, schedule[i][0] - (loop.time() - start_wall)))
    for stream in streams:  # let the last windows run and collect them
        await stream.process(np.empty(0, dtype=np.float32))
    cpu, wall = time.process_time() - start_cpu, loop.time() - start_wall
    for stream in streams:
        stream.close()
    return cpu, wall, engine.stats.windows


def _run_paced(
    runtime: SileroRuntime, signals: list[Audio], seconds: float, max_batch: int, wait_ms: float
) -> tuple[float, float, int, float]:
    async def once() -> tuple[float, float, int, float]:
        async with VadEngine(runtime=runtime, max_batch=max_batch, max_wait_ms=wait_ms) as engine:
            cpu, wall, scored = await _paced(engine, signals, seconds, seed=1)
            stats = engine.stats
            return cpu, wall, scored, stats.windows / max(1, stats.batches)

    return asyncio.run(once())


# -- report -------------------------------------------------------------------------------------
def _per_frame_us(calls_per_core: float) -> float:
    """VAD CPU per 20 ms frame of a setup that serves ``calls_per_core`` calls per core."""
    return WINDOW_S * 1e6 / calls_per_core * FRAME / WINDOW_SAMPLES


def _table(rows: list[Row], baseline: dict[str, float]) -> Iterator[str]:
    yield (
        f"{'runtime':<12} {'mode':<48} {'batch':>5} {'mean B':>6} {'us/window':>9} "
        f"{'calls/core':>10} {'vs (a1)':>8}"
    )
    for r in rows:
        mean_b = f"{r.mean_batch:.1f}" if r.mean_batch is not None else ""
        ratio = r.calls_per_core / baseline[r.runtime]
        yield (
            f"{r.runtime:<12} {r.mode:<48} {r.batch:>5} {mean_b:>6} {r.us_per_window:>9.1f} "
            f"{r.calls_per_core:>10.0f} {ratio:>7.2f}x"
        )


def _paced_verdict(cpu: float, wall: float, seconds: float) -> str:
    if wall <= seconds * 1.05 + 0.05:
        return "kept up"
    if cpu / wall > 0.9:
        return f"FELL BEHIND, CPU-bound ({wall:.2f} s wall)"
    # Late without using the core: another process had it. Says nothing about the engine.
    return f"late ({wall:.2f} s wall) on a busy machine: got {100 * cpu / wall:.0f}% of the core"


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print the tables."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=128, help="concurrent calls in (a)-(c)")
    parser.add_argument("--seconds", type=float, default=2.56, help="audio per call in (b)-(c)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement (median)")
    parser.add_argument("--paced-seconds", type=float, default=1.5, help="wall s per (d) run")
    parser.add_argument("--runtimes", default="onnx,torchscript")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = parser.parse_args(argv)
    # (calls, max_batch, max_wait_ms)
    paced_configs = [(150, 1, 0.0), (150, 128, 2.0), (150, 128, 10.0), (600, 128, 2.0)]
    if args.quick:
        args.calls, args.seconds, args.repeat, args.paced_seconds = 16, 0.64, 1, 0.3
        paced_configs = [(20, 1, 0.0), (20, 128, 2.0)]
    runtimes: list[RuntimeName] = []
    for name in args.runtimes.split(","):
        if name == "onnx" or name == "torchscript":
            runtimes.append(name)
        else:
            raise SystemExit(f"unknown runtime {name!r}")

    pinned = _pin_one_core()
    folder = _recordings_dir()
    signals = _signals(folder, args.calls, args.seconds)
    short = [s[: max(WINDOW_SAMPLES, len(s) // 4)] for s in signals]
    messages = _media_messages(folder, args.calls, int(args.seconds / 0.020))
    bots = _bot_audio(folder, args.calls, int(args.seconds / 0.020))
    print(f"# vad_throughput: {args.calls} calls x {args.seconds:.2f} s ((a): first quarter),")
    print(f"# {pinned}, 1 inference thread, median of {args.repeat} runs, recordings: {folder}")
    print("# calls/core = audio seconds scored / CPU seconds (time.process_time)")
    t0 = time.perf_counter()

    rows: list[Row] = []
    baseline: dict[str, float] = {}
    notes: list[str] = []
    media: list[str] = []
    paced: list[str] = []
    for name in runtimes:
        runtime = load_runtime(name)
        windows, cpu = _cpu(lambda: _per_call_model(runtime, short), args.repeat)  # noqa: B023
        rows.append(Row(name, "(a1) per-call, one shared model (LiveKit)", "1", windows, cpu))
        baseline[name] = rows[-1].calls_per_core
        if name == "onnx":
            before = _rss_mb()
            sessions: list[SileroRuntime] = [OnnxSilero() for _ in short]
            notes.append(f"(a2): {(_rss_mb() - before) / len(sessions):.1f} MB RSS per session")
            windows, cpu = _cpu(lambda: _per_call_model(sessions, short), args.repeat)  # noqa: B023
            mode = "(a2) per-call, one ORT session/call (Pipecat)"
            rows.append(Row(name, mode, "1", windows, cpu))
            del sessions
            windows, cpu = _cpu(_upstream_wrapper(short[: max(1, len(short) // 4)]), args.repeat)
            rows.append(Row(name, "(a3) per-call, silero_vad OnnxWrapper", "1", windows, cpu))
        run, mean = _engine_run(runtime, short, 1, 0.0)
        windows, cpu = _cpu(run, args.repeat)
        mode = "(a4) per-call, the engine at max_batch=1"
        rows.append(Row(name, mode, "1", windows, cpu, mean()))
        run_b0 = lambda: _batched_model(runtime, signals, 128)  # noqa: B023, E731
        windows, cpu = _cpu(run_b0, args.repeat)
        rows.append(Row(name, "(b0) model only, batched, no engine", "128", windows, cpu))
        for batch in (16, 64, 128):
            run, mean = _engine_run(runtime, signals, batch, 2.0)
            windows, cpu = _cpu(run, args.repeat)
            mode = "(b) batched engine, 20 ms frames, asyncio"
            rows.append(Row(name, mode, str(batch), windows, cpu, mean()))
        batched = rows[-1]

        # (c) media path: every call's Twilio messages through the engine at max_batch=128
        frames, cpu_decode = _cpu(lambda: _decode_only(messages), args.repeat)  # noqa: B023

        async def media_once() -> int:
            async with VadEngine(runtime=runtime, max_batch=128) as engine:  # noqa: B023
                return await _media_path(engine, messages)  # noqa: B023

        frames_path, cpu_path = _cpu(lambda: asyncio.run(media_once()), args.repeat)
        us_decode = cpu_decode / frames * 1e6
        us_path = cpu_path / frames_path * 1e6

        us_vad = batched.us_per_window * FRAME / WINDOW_SAMPLES
        per_call = 20000 / (us_decode + _per_frame_us(baseline[name]))
        media.append(
            f"{name:<12} JSON+base64+LUT {us_decode:5.1f} | VAD share (b, 128) {us_vad:5.1f} | "
            f"whole path {us_path:5.1f} us/frame -> {20000 / us_path:4.0f} calls/core "
            f"(decode + per-call (a1): {per_call:4.0f})"
        )

        gated_us = {}
        for batched_gate in (False, True):
            async def gated_once() -> int:
                async with VadEngine(runtime=runtime, max_batch=128) as engine:  # noqa: B023
                    return await _media_path_gated(engine, messages, bots, batched_gate)  # noqa: B023

            n_gated, cpu_gated = _cpu(lambda: asyncio.run(gated_once()), args.repeat)  # noqa: B023
            gated_us[batched_gate] = cpu_gated / n_gated * 1e6
        # Per window (a frame is 160 of a window's 256 samples): what the gate and features add.
        extra = {k: (v - us_path) * WINDOW_SAMPLES / FRAME for k, v in gated_us.items()}
        media.append(
            f"{name:<12} bot talking (c2): gate+features one call at a time "
            f"{gated_us[False]:5.1f} us/frame ({extra[False]:5.1f} us/window over (c)), batched "
            f"{gated_us[True]:5.1f} us/frame ({extra[True]:5.1f} us/window) -> "
            f"{20000 / gated_us[True]:4.0f} vs {20000 / gated_us[False]:4.0f} calls/core, "
            f"{gated_us[False] / gated_us[True]:.2f}x"
        )

        # (d) paced at real time
        for calls, max_batch, wait in paced_configs:
            paced_signals = _signals(folder, calls, args.paced_seconds + 0.1)
            cpu, wall, scored, mean_b = _run_paced(
                runtime, paced_signals, args.paced_seconds, max_batch, wait
            )
            paced.append(
                f"{name:<12} {calls:4d} calls, max_batch={max_batch:<3} max_wait_ms={wait:<4}: "
                f"CPU {100 * cpu / wall:5.1f}% of a core, mean batch {mean_b:5.1f}, "
                f"{scored * WINDOW_S / cpu:5.0f} calls/core, "
                + _paced_verdict(cpu, wall, args.paced_seconds)
            )

    print()
    for line in _table(rows, baseline):
        print(line)
    for line in notes:
        print("# " + line)
    print()
    for name in runtimes:
        mine = [r for r in rows if r.runtime == name and r.mode.startswith("(b)")]
        ratios = ", ".join(f"B={r.batch}: {r.calls_per_core / baseline[name]:.1f}x" for r in mine)
        print(f"batched engine / per-call (a1), {name}: {ratios}")
    if "onnx" in baseline:
        b128 = [r for r in rows if r.mode.startswith("(b)") and r.batch == "128"]
        refs = [("(a1) ONNX shared model", baseline["onnx"])] + [
            ("(a2) ONNX session per call", r.calls_per_core)
            for r in rows
            if r.mode.startswith("(a2)")
        ]
        for label, ref in refs:
            ratios = ", ".join(f"{r.runtime} {r.calls_per_core / ref:.1f}x" for r in b128)
            print(f"batched engine B=128 / {label}: {ratios}")
    print(f"\n(c) media path per 20 ms frame, {args.calls} calls, engine max_batch=128, us/frame:")
    for line in media:
        print("  " + line)
    print(f"\n(d) paced at real time, frames at random phases, {args.paced_seconds:.1f} s each:")
    for line in paced:
        print("  " + line)
    print(f"\n# total {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
