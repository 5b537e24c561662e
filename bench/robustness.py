"""Barge-in robustness on simulated phone lines: a grid of conditions, N calls each, every call
replayed in process through the real call controller (``gateway.replay``) under each named
decision variant, and scored with the evaluator's rules (``linesim.scoring``).

    python -m bench.robustness --split train --grid small --calls-per-point 8 --seed 1
    python -m bench.robustness --split check --variant 'strict:echo.echo_margin_db=12'

Variants are named overrides of the call's settings (``gateway.call.CallSettings``): a key is a
field of ``CallSettings`` (``chunk_ms``), of its ``barge_in`` (``barge_in.p_on``) or of its
``echo`` gate (``echo.echo_margin_db``). Built in (:data:`VARIANTS`):

* ``plain_silero``: Silero alone, no gate: p >= 0.5 for two 32 ms windows stops the bot and every
  stop is an interrupt (the strong-energy, voiced and band paths are off, the echo/noise gate
  passes everything, no resume on backchannel). Rules that live outside the settings (in
  ``gateway/call.py``, e.g. DTMF handling) still apply;
* ``configured``: the decision as the code and ``config/`` configure it today (the defaults);
* ``no_resume``: the same with ``resume_on_backchannel`` off (every pause commits).

More can be added to :data:`VARIANTS` or given with ``--variant NAME:KEY=VALUE,KEY=VALUE``
(values are JSON, or plain strings).

How it runs: one :class:`vad.VadEngine` shared by all calls; ``--concurrency`` calls replay at
once (each lock-step on its own media clock, yielding between frames), so their VAD windows
batch as live calls' do. A call is generated once and replayed under every variant. Speed is
reported as calls (and audio seconds) per CPU second of this process.

The JSON output has every call's verdicts; the markdown has one row per grid point (small grids)
and one per value of each axis.

:func:`window_features` is the hook for fitting a decision: for a list of recordings it returns
every VAD window's readings as the decision saw them (Silero's probability, the gate's reading,
the window features) beside the labels' truth for that window.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus import protocol as bp
from linesim import (GRIDS, Condition, ConditionError, SimCall, VoiceLibrary, grid, iter_calls,
                     scoring)

__all__ = [
    "VARIANTS",
    "Variant",
    "VariantError",
    "call_settings",
    "main",
    "parse_variant",
    "report_markdown",
    "run_bench",
    "window_features",
]


class VariantError(ValueError):
    """A variant that names no setting, or a value the setting does not take."""


@dataclass(frozen=True, slots=True)
class Variant:
    """A named decision: overrides of the call settings (``barge_in.p_on``, ``echo.x``, ``x``)."""

    name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""


VARIANTS: dict[str, Variant] = {
    "plain_silero": Variant(
        "plain_silero",
        {
            "barge_in.strong_noise_db": 1000.0,  # the strong-energy path: off
            "barge_in.voiced_min": 2.0,  # the clearly-voiced path: off (voicing <= 1)
            "barge_in.band_snr_db": 1000.0,  # the echo-free band path: off
            "barge_in.instant_margin_db": 1000.0,  # one-window starts: off
            "barge_in.resume_on_backchannel": False,  # every stop is an interrupt
            "echo.echo_margin_db": -1000.0,  # the gate passes every window
            "echo.noise_margin_db": -1000.0,
            "echo.min_level_dbfs": -1000.0,
            "echo_canceller": "off",  # no AEC3 in front either (vad/_aec.py)
            # Nor the policy's paths and floors past Silero: the envelope path (with its
            # voicing alternative it hears windows Silero is under p_on on) and the background
            # floor (it holds windows Silero calls speech).
            "barge_in.explain_share_db": None,
            "barge_in.background_db": None,
        },
        "Silero p >= 0.5 for 2 windows stops the bot; no gate; no resume",
    ),
    "configured": Variant("configured", {}, "today's decision (the settings' defaults)"),
    "no_resume": Variant("no_resume", {"barge_in.resume_on_backchannel": False},
                         "today's decision, but every pause commits (no resume)"),
}


def _coerce(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def call_settings(variant: Variant, base: Any = None) -> Any:
    """``base`` (default ``CallSettings()``) with the variant's overrides applied."""
    from gateway.call import CallSettings

    settings = base or CallSettings()
    groups: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in variant.overrides.items():
        group, _, name = key.rpartition(".")
        if group:
            groups.setdefault(group, {})[name] = _coerce(value)
        else:
            top[name] = _coerce(value)
    names = {f.name for f in dataclasses.fields(settings)}
    for group, values in groups.items():
        if group not in names or not dataclasses.is_dataclass(getattr(settings, group)):
            raise VariantError(f"variant {variant.name}: {group!r} is not a settings group "
                               f"(one of: barge_in, echo)")
        sub = getattr(settings, group)
        known = {f.name for f in dataclasses.fields(sub)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise VariantError(f"variant {variant.name}: {group} has no setting "
                               f"{', '.join(unknown)}")
        top[group] = dataclasses.replace(sub, **values)
    unknown = sorted(set(top) - names)
    if unknown:
        raise VariantError(f"variant {variant.name}: no call setting {', '.join(unknown)}")
    return dataclasses.replace(settings, **top)


def parse_variant(text: str) -> Variant:
    """A registered name, or ``NAME:KEY=VALUE,KEY=VALUE``."""
    if ":" not in text:
        if text in VARIANTS:
            return VARIANTS[text]
        raise VariantError(f"unknown variant {text!r} (built in: {', '.join(VARIANTS)}; or "
                           f"NAME:KEY=VALUE,...)")
    name, _, spec = text.partition(":")
    overrides: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise VariantError(f"variant {name}: {item!r} is not KEY=VALUE")
        overrides[key.strip()] = value.strip()
    variant = Variant(name, overrides, spec)
    call_settings(variant)  # fail now, with the reason, not in the middle of a run
    return variant


# -- replay -------------------------------------------------------------------------------------


def bot_turns(call: SimCall) -> list[Any]:
    """The labelled bot turns, each with its slice of the bot track (as ``load_bot_script``)."""
    from gateway.replay import BotTurn

    out = []
    for i, t in enumerate(call.labels["bot_turns"]):
        a, b = int(float(t["start_ms"]) * 8), int(float(t["end_ms"]) * 8)
        out.append(BotTurn(f"turn-{i}", float(t["start_ms"]), call.bot[a:b],
                           bool(t.get("interruptible", True)), str(t.get("text", ""))))
    return out


async def _replay_one(call: SimCall, path: Path, settings: Any, engine: Any) -> list[dict[str, Any]]:
    from gateway.replay import replay

    timeline, _ = await replay(path, bot_script=bot_turns(call), settings=settings, vad=engine)
    return timeline.events


async def _replay_closed(call: SimCall, settings: Any, engine: Any) -> list[dict[str, Any]]:
    """Replay ``call`` with its echo made from what the gateway actually played.

    The same loop as ``gateway.replay.replay`` (lock-step on the media clock, the bot turns
    spoken at their labelled times, :class:`gateway.twilio_sim.TwilioPlayout` standing in for
    Twilio's queue and marks), except that each inbound frame is built when it is due: the call's
    echo-free track (``SimCall.rest``) plus the echo path's response to the audio Twilio played up
    to the end of that frame. A ``clear`` therefore silences the echo one path delay later, as on
    a real line, where a recording's echo would go on. A second TwilioPlayout fed the same frames
    tells what plays during the frame ahead (nothing the gateway does at the frame's end can
    change that)."""
    from bus import EmbeddedBus, EmbeddedHub
    from gateway import twilio_protocol as tp
    from audio import ulaw_to_float32
    from gateway.call import CallSession
    from gateway.timeline import Timeline
    from gateway.twilio_sim import TwilioPlayout
    from linesim._dsp import encode_ulaw

    assert call.rest is not None and call.echo_path is not None
    echo = call.echo_path.stream(ulaw_to_float32(call.bot).astype(float))
    timeline = Timeline()
    bus = EmbeddedBus(hub=EmbeddedHub())
    outbox: list[str] = []

    async def send(text: str) -> None:
        outbox.append(text)

    turns = bot_turns(call)
    dtmf_after: dict[int, list[str]] = {}
    for ev in call.labels["events"]:
        if ev["kind"] == "dtmf":
            dtmf_after.setdefault((int(round(ev["end_ms"] * 8)) - 1) // 160 + 1, []).append(
                ev["digit"])
    frames = len(call.rest) // 160
    digest = hashlib.sha256(call.name.encode()).hexdigest()
    stream_sid, call_sid = f"MZ{digest[:32]}", f"CA{digest[32:64]}"  # as SimCall.messages()
    await bus.start()
    try:
        session = CallSession(send=send, bus=bus, vad=engine, settings=settings,
                              timeline=timeline, transcribe_inline=True)
        playout = TwilioPlayout(stream_sid=stream_sid)
        shadow = TwilioPlayout(stream_sid=stream_sid, keep_audio=True)
        heard = 0  # bytes of the shadow's played audio placed on the echo's timeline

        async def deliver(echoes: list[str]) -> None:
            queue = list(echoes)
            while queue or outbox:
                while outbox:
                    text = outbox.pop(0)
                    queue.extend(playout.receive(text, at_ms=session.now_ms))
                    shadow.receive(text, at_ms=session.now_ms)
                if queue:
                    await session.handle_text(queue.pop(0))

        await session.handle_text(tp.build_connected())
        await session.handle_text(tp.build_start(sequence_number=1, stream_sid=stream_sid,
                                                 account_sid=call.account_sid, call_sid=call_sid))
        await deliver([])
        seq = 2
        for c in range(1, frames + 1):
            t = (c - 1) * 20
            await deliver(playout.advance(t))
            while turns and turns[0].start_ms <= t + 10:
                turn = turns.pop(0)
                for event in (bp.UtteranceStart(utterance_id=turn.utterance_id, node=turn.node,
                                                interruptible=turn.interruptible, text=turn.text),
                              bp.Audio(utterance_id=turn.utterance_id, payload=turn.audio),
                              bp.UtteranceEnd(utterance_id=turn.utterance_id)):
                    await session.handle_downlink(event)
                await deliver([])
            # What Twilio plays in [t, t + 20): audio only ever starts on a frame boundary (it
            # arrives at the media clock's frame ends), so the frame's new audio starts at t.
            shadow.advance(t + 20)
            played = bytes(shadow.stats.played[heard:])
            heard += len(played)
            echo.play(t * 8, ulaw_to_float32(played).astype(float))
            a, b = (c - 1) * 160, c * 160
            payload = encode_ulaw(call.rest[a:b] + echo.echo(a, b))
            await session.handle_text(tp.build_media(sequence_number=seq, stream_sid=stream_sid,
                                                     chunk=c, timestamp_ms=t, payload=payload))
            seq += 1
            if session.ended:
                break
            await asyncio.sleep(0)  # let the other calls' frames in: VAD batches form
            await deliver([])
            for digit in dtmf_after.get(c, []):
                await session.handle_text(tp.build_dtmf(sequence_number=seq,
                                                        stream_sid=stream_sid, digit=digit))
                seq += 1
                await deliver([])
        await session.handle_text(tp.build_stop(sequence_number=seq, stream_sid=stream_sid,
                                                account_sid=call.account_sid, call_sid=call_sid))
        await session.end("replay_finished")
    finally:
        await bus.aclose()
    return timeline.events


@dataclass
class CallResult:
    condition: str
    variant: str
    echo_only: bool
    verdict: dict[str, Any]
    pauses: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """``(clear_ms, gap_ms)`` of each pause that resumed (``linesim.scoring.pause_gaps``)."""
    onset_ms: float | None = None
    """The labelled barge-in onset (None on calls without one)."""


async def _run(calls: Iterable[SimCall], variants: Sequence[Variant], *, concurrency: int,
               runtime: str, loop: str = "closed") -> tuple[list[CallResult], dict[str, float]]:
    from vad import VadEngine

    settings = {v.name: call_settings(v) for v in variants}
    results: list[CallResult] = []
    it = iter(calls)
    audio_s = 0.0
    n_calls = 0
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    gen_cpu = 0.0  # of which simulating the calls
    with tempfile.TemporaryDirectory(prefix="robustness-") as tmp:
        # (`runtime` is argparse's, limited by its choices to the engine's runtimes.)
        async with VadEngine(runtime=runtime) as engine:  # type: ignore[arg-type]

            async def worker() -> None:
                nonlocal audio_s, n_calls, gen_cpu
                while True:  # one shared iterator: each call is taken by one worker
                    t = time.process_time()
                    call = next(it, None)
                    gen_cpu += time.process_time() - t
                    if call is None:
                        return
                    path = Path(tmp) / f"{call.name}.twilio.jsonl"
                    if loop == "open":
                        path.write_text("\n".join(call.messages()) + "\n")
                    audio_s += call.labels["duration_ms"] / 1000
                    n_calls += 1
                    cond = call.labels["condition"]
                    echo_only = call.labels["condition_params"]["behaviour"] == "echo_only"
                    for v in variants:
                        if loop == "open":
                            events = await _replay_one(call, path, settings[v.name], engine)
                        else:
                            events = await _replay_closed(call, settings[v.name], engine)
                        results.append(CallResult(cond, v.name, echo_only,
                                                  scoring.score(call.labels, events),
                                                  scoring.pause_gaps(events),
                                                  call.labels["expect"].get(
                                                      "barge_in_onset_ms")))
                    path.unlink(missing_ok=True)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            stats = engine.stats
    wall, cpu = time.perf_counter() - t_wall, time.process_time() - t_cpu
    replays = n_calls * len(variants)
    speed = {"calls": n_calls, "replays": replays, "audio_s_per_call": audio_s / max(1, n_calls),
             "wall_s": wall, "cpu_s": cpu, "simulate_cpu_s": gen_cpu,
             "replays_per_cpu_s": replays / (cpu - gen_cpu) if cpu > gen_cpu else 0.0,
             "audio_x_realtime_per_core": (audio_s * len(variants) / (cpu - gen_cpu)
                                           if cpu > gen_cpu else 0.0),
             "concurrency": concurrency,
             "mean_vad_batch": stats.windows / stats.batches if stats.batches else 0.0}
    return results, speed


# -- aggregation --------------------------------------------------------------------------------


def _aggregate(results: Sequence[CallResult]) -> dict[str, Any]:
    verdicts = [r.verdict for r in results]
    gaps = [g for r in results for _, g in r.pauses]
    # A resume of a pause at a real barge-in (from the evaluator's early slack on): the caller's
    # words taken for a backchannel, and the bot back over them.
    false_resumes = sum(any(at >= r.onset_ms - scoring.EARLY_SLACK_MS for at, _ in r.pauses)
                        for r in results if r.onset_ms is not None)
    lat = [v["latency_ms"] for v in verdicts if v["latency_ms"] is not None]
    expected = sum(v["expect_barge_in"] and not v.get("not_applicable") for v in verdicts)
    return {
        "calls": len(verdicts),
        "barge_in_expected": expected,
        "detected": len(lat),
        "detection_rate": len(lat) / expected if expected else None,
        "latency_p50_ms": statistics.median(lat) if lat else None,
        "latency_p95_ms": scoring.pct(lat, 0.95),
        "false_stops": sum(v["false_stop"] for v in verdicts),
        "false_interrupts": sum(v["false_interrupt"] for v in verdicts),
        "dtmf_wrong": sum(v["dtmf_ok"] is False for v in verdicts),
        "resumes": len(gaps),
        "false_resumes": false_resumes,
        "pause_gap_p50_ms": statistics.median(gaps) if gaps else None,
        "pause_gap_p95_ms": scoring.pct(gaps, 0.95),
    }


def summarize(results: Sequence[CallResult], conditions: Sequence[Condition],
              variants: Sequence[Variant]) -> dict[str, Any]:
    by: dict[tuple[str, str], list[CallResult]] = {}
    for r in results:
        by.setdefault((r.variant, r.condition), []).append(r)
    out: dict[str, Any] = {"variants": {}, "points": {}, "axes": {}}
    for v in variants:
        mine = [r for r in results if r.variant == v.name]
        out["variants"][v.name] = {
            "description": v.description, "overrides": dict(v.overrides),
            "all": _aggregate(mine),
            "echo_only": _aggregate([r for r in mine if r.echo_only]),
            "with_caller": _aggregate([r for r in mine if not r.echo_only]),
        }
    for c in conditions:
        out["points"][c.name] = {v.name: _aggregate(by.get((v.name, c.name), []))
                                 for v in variants}
    for axis in ("erl_db", "delay_ms", "change", "nonlinearity", "background", "behaviour"):
        values = sorted({getattr(c, axis) for c in conditions},
                        key=lambda v: (0, v, "") if isinstance(v, float) else (1, 0.0, str(v)))
        if len(values) < 2:
            continue
        out["axes"][axis] = {}
        for value in values:
            names = {c.name for c in conditions if getattr(c, axis) == value}
            out["axes"][axis][str(value)] = {
                v.name: _aggregate([r for r in results if r.variant == v.name
                                    and r.condition in names]) for v in variants}
    return out


def _cell(a: dict[str, Any]) -> str:
    if not a["calls"]:
        return "-"
    parts = []
    if a["barge_in_expected"]:
        p50 = f"{a['latency_p50_ms']:.0f}" if a["latency_p50_ms"] is not None else "-"
        p95 = f"{a['latency_p95_ms']:.0f}" if a["latency_p95_ms"] is not None else "-"
        parts.append(f"{a['detected']}/{a['barge_in_expected']} {p50}/{p95} ms")
    parts.append(f"FS {a['false_stops']} FI {a['false_interrupts']}")
    if a.get("resumes"):
        parts.append(f"gap {a['pause_gap_p50_ms']:.0f}/{a['pause_gap_p95_ms']:.0f} ms "
                     f"({a['resumes']}, FR {a['false_resumes']})")
    return " · ".join(parts)


def report_markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    variants = list(summary["variants"])
    lines = [f"Split `{meta['split']}`, grid `{meta['grid']}`, {meta['calls_per_point']} calls per "
             f"point, seed {meta['seed']}, {meta['speed'].get('loop', 'closed')} loop: "
             f"{meta['speed']['calls']} calls, {meta['speed']['replays']} replays.",
             "",
             "Cells: detected/expected barge-ins, latency p50/p95 ms, FS = calls with a false "
             "stop, FI = calls with a false interrupt (the evaluator's rules); gap = p50/p95 of "
             "the audible gap of the pauses that resumed, from `clear` to the resumed audio "
             "(their number in brackets; FR = barge-in calls whose real barge-in was resumed "
             "over).",
             "",
             "| calls | " + " | ".join(variants) + " |",
             "|---|" + "---|" * len(variants)]
    for key, label in (("all", "all calls"), ("with_caller", "calls with caller speech"),
                       ("echo_only", "echo-only calls")):
        cells = [_cell(summary["variants"][v][key]) for v in variants]
        n = summary["variants"][variants[0]][key]["calls"]
        lines.append(f"| {label} ({n}) | " + " | ".join(cells) + " |")
    if len(summary["points"]) <= 60:
        lines += ["", "| grid point | " + " | ".join(variants) + " |",
                  "|---|" + "---|" * len(variants)]
        for name, row in summary["points"].items():
            lines.append(f"| `{name}` | " + " | ".join(_cell(row[v]) for v in variants) + " |")
    for axis, values in summary["axes"].items():
        lines += ["", f"| {axis} | " + " | ".join(variants) + " |",
                  "|---|" + "---|" * len(variants)]
        for value, row in values.items():
            lines.append(f"| {value} | " + " | ".join(_cell(row[v]) for v in variants) + " |")
    s = meta["speed"]
    lines += ["", f"Speed: {s['replays_per_cpu_s']:.1f} replays per CPU second of replay "
                  f"({s['audio_x_realtime_per_core']:.0f}x real time per core; "
                  f"{s['audio_s_per_call']:.1f} s of audio per call), {s['wall_s']:.0f} s wall, "
                  f"{s['cpu_s']:.0f} s CPU ({s['simulate_cpu_s']:.0f} s of it simulating); "
                  f"{s['concurrency']} calls at once, mean VAD batch "
                  f"{s['mean_vad_batch']:.1f} windows."]
    return "\n".join(lines) + "\n"


def run_bench(*, split: str, conditions: Sequence[Condition], calls_per_point: int, seed: int,
              variants: Sequence[Variant], concurrency: int = 32, runtime: str = "onnx",
              library: VoiceLibrary | None = None, loop: str = "closed") -> dict[str, Any]:
    """Simulate, replay and score; returns the JSON report (summary, per-call verdicts, speed)."""
    count = len(conditions) * calls_per_point
    # (`split` is argparse's, limited by its choices to the simulator's splits.)
    calls = iter_calls(list(conditions), split=split,  # type: ignore[arg-type]
                       seed=seed, count=count, library=library)
    if loop not in ("open", "closed"):
        raise ValueError(f"loop must be open or closed, got {loop!r}")
    results, speed = asyncio.run(_run(calls, variants, concurrency=concurrency, runtime=runtime,
                                      loop=loop))
    speed["loop"] = loop  # type: ignore[assignment]  # a report of numbers, and this one word
    return {"summary": summarize(results, conditions, variants), "speed": speed,
            "calls": [dataclasses.asdict(r) for r in results]}


# -- the fitting hook ---------------------------------------------------------------------------


class _RecordingStream:
    """A VadStream that keeps every window result it hands to the call controller."""

    def __init__(self, stream: Any, sink: list[Any]) -> None:
        object.__setattr__(self, "_stream", stream)
        object.__setattr__(self, "_sink", sink)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._stream, name, value)

    async def process(self, samples: Any) -> Any:
        out = await self._stream.process(samples)
        self._sink.extend(out)
        return out


class _RecordingEngine:
    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.windows: list[Any] = []

    def open_stream(self, **kwargs: Any) -> Any:
        stream = self._engine.open_stream(**kwargs)
        if kwargs.get("echo") is None:  # the call's echo-cancelled stream (vad/_aec.py): no gate
            return stream
        return _RecordingStream(stream, self.windows)


def _truth(labels: dict[str, Any], t0: float, t1: float) -> dict[str, Any]:
    def over(kind: str) -> bool:
        for e in labels["events"]:
            if e["kind"] != kind:
                continue
            spans = e.get("segments_ms") or [[e["start_ms"], e["end_ms"]]]
            if any(a < t1 and b > t0 for a, b in spans):
                return True
        return False

    return {"caller_speech": over("speech"), "backchannel": over("backchannel"),
            "echo": over("echo"), "dtmf": over("dtmf"),
            "bot_playing": any(b["start_ms"] < t1 and b["end_ms"] > t0
                               for b in labels["bot_turns"])}


def window_features(recordings: Iterable[SimCall | Path], *, variant: Variant | None = None,
                    runtime: str = "onnx", loop: str = "closed") -> list[dict[str, Any]]:
    """Every VAD window of every recording as the decision saw it, with the truth beside it.

    ``recordings``: simulated calls, or label files (``NAME.json`` beside ``NAME.twilio.jsonl``
    and ``NAME.bot.wav``). Each row: ``recording``, ``condition``, ``window``, ``t_ms`` (the
    window's end), ``prob``, the gate's fields (``gate_level_db``, ``gate_echo_db``, ...), the
    features (``feat_voicing``, ``feat_dtmf``) and the labels' truth over the window
    (``caller_speech``, ``backchannel``, ``echo``, ``dtmf``, ``bot_playing``); in a pause, the
    gate's reading against the audio the pause held back as ``ghost_*``. The readings
    depend on what the bot played, so they are those of a call run under ``variant`` (default:
    the configured decision); a fitted decision that stops the bot elsewhere changes them.
    ``loop``: ``closed`` (simulated calls only: the echo follows what was played) or ``open``
    (the recording as written; label files are always replayed so).
    """
    from gateway.replay import load_bot_script, replay
    from vad import VadEngine

    settings = call_settings(variant or VARIANTS["configured"])
    rows: list[dict[str, Any]] = []

    async def run() -> None:
        # (`runtime` is argparse's, limited by its choices to the engine's runtimes.)
        async with VadEngine(runtime=runtime) as engine:  # type: ignore[arg-type]
            with tempfile.TemporaryDirectory(prefix="features-") as tmp:
                for rec in recordings:
                    if isinstance(rec, SimCall):
                        labels, turns = rec.labels, bot_turns(rec)
                        path = Path(tmp) / f"{rec.name}.twilio.jsonl"
                        if loop == "open":
                            path.write_text("\n".join(rec.messages()) + "\n")
                    else:
                        labels = json.loads(Path(rec).read_text())
                        turns = load_bot_script(Path(rec))
                        path = Path(rec).with_suffix(".twilio.jsonl")
                    spy = _RecordingEngine(engine)
                    if isinstance(rec, SimCall) and loop == "closed":
                        await _replay_closed(rec, settings, spy)
                    else:
                        await replay(path, bot_script=turns, settings=settings, vad=spy)
                    for w in spy.windows:
                        t1 = w.end_sample / 8
                        row: dict[str, Any] = {"recording": labels["name"],
                                               "condition": labels.get("condition", ""),
                                               "window": w.index, "t_ms": t1, "prob": w.prob}
                        if w.gate is not None:
                            row.update({f"gate_{k}": v for k, v in
                                        dataclasses.asdict(w.gate).items()})
                        if w.features is not None:
                            row.update({f"feat_{k}": v for k, v in
                                        dataclasses.asdict(w.features).items()})
                        if w.ghost is not None:  # in a pause: against the unplayed audio
                            row.update({f"ghost_{k}": v for k, v in
                                        dataclasses.asdict(w.ghost).items()})
                        row.update(_truth(labels, t1 - 32.0, t1))
                        rows.append(row)

    asyncio.run(run())
    return rows


# -- command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.robustness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=("train", "check"), default="train")
    ap.add_argument("--grid", choices=tuple(GRIDS), default="small")
    ap.add_argument("--condition", action="append", metavar="NAME",
                    help="only these grid points (condition names); repeatable")
    ap.add_argument("--calls-per-point", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", action="append", metavar="NAME[:KEY=VALUE,...]",
                    help="decision variants to compare (default: plain_silero and configured)")
    ap.add_argument("--loop", choices=("closed", "open"), default="closed",
                    help="closed: the echo follows what the gateway played (a clear silences "
                         "it); open: replay the recordings as written, as eval_bargein.py does")
    ap.add_argument("--concurrency", type=int, default=32, help="calls replayed at once")
    ap.add_argument("--vad-runtime", choices=("onnx", "torchscript"), default="onnx")
    ap.add_argument("--out-json", type=Path, default=Path("robustness.json"))
    ap.add_argument("--out-md", type=Path, default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    try:
        if args.calls_per_point < 1 or args.concurrency < 1:
            raise VariantError("--calls-per-point and --concurrency must be at least 1")
        variants = [parse_variant(v) for v in (args.variant or ["plain_silero", "configured"])]
        if len({v.name for v in variants}) != len(variants):
            raise VariantError("two variants with one name")
        conditions = ([Condition.parse(n) for n in args.condition] if args.condition
                      else grid(args.grid))
        report = run_bench(split=args.split, conditions=conditions,
                           calls_per_point=args.calls_per_point, seed=args.seed,
                           variants=variants, concurrency=args.concurrency,
                           runtime=args.vad_runtime, loop=args.loop)
    except (VariantError, ConditionError, ValueError, OSError) as exc:
        print(f"bench.robustness: {exc}", file=sys.stderr)
        return 2
    meta = {"split": args.split, "grid": "custom" if args.condition else args.grid,
            "calls_per_point": args.calls_per_point, "seed": args.seed, "speed": report["speed"],
            "command": "python -m bench.robustness " + " ".join(argv or sys.argv[1:])}
    report["meta"] = meta
    md = report_markdown(report["summary"], meta)
    args.out_json.write_text(json.dumps(report, indent=1) + "\n")
    if args.out_md:
        args.out_md.write_text(md)
    print(md, end="")
    print(f"JSON: {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
