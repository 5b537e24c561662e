"""Voice to voice: end of the caller's speech to the first bot audio played at the caller, through
the real gateway and worker, against a local OpenAI-protocol server with hosted-like latencies.

Run: ``python -m bench.turns`` (about a minute: every call is replayed at 1x, all recordings of
a method at once); ``--stt-ms/--llm-ms/--tts-ms`` set the provider latencies (defaults: final
transcript 150 ms after the upload, first LLM token 350 ms, first TTS byte 200 ms).

Each development recording whose caller turns are clean (bench.turn_end's selection) is played
into ``gateway.replay.replay(realtime=True)`` as Twilio would (marks echoed as their audio
plays), with an in-process worker running an agent whose LLM, speech to text and text to speech
are ``openai`` providers pointed at ``bench._openai_stub``. Per caller turn (labelled end of its
speech -> the first ``bot_utterance_started`` after it, at its ``play_at_ms``):

* ``v2v``: voice to voice;
* ``decide``: labelled end of speech -> ``turn_end`` (the VAD's tail plus the turn wait);
* ``own``: what is neither waiting for the turn's end nor waiting for the providers: first
  audio - max(turn_end, transcript sent + stt + llm + tts), where the transcript is sent at
  ``turn_likely`` (callgate starts the reply early and holds it until ``turn_end``) or at
  ``turn_end`` (gateway, bus, worker, HTTP on loopback, resampling, pacing).

The stub's realtime speech to text streams each recording's own words (``caller_speech``: the
forced alignment in ``bench/data/turn_words.json``, as bench.turn_end uses it), each word's
partial ``--lag-ms`` (250) after the word's end in the audio it has received, so the text
cues act on what the caller said; the two speech events with no text anywhere (speechbrain's
spk1_snt6, in turn_gap_then_barge_in and barge_in_two_sentences_spk1) get no partials and the
fixed sentence as their final. Each row says how many sessions were found in the recordings.

Methods in the same run: callgate's turn taking (the agent's defaults; ``--patience P...`` adds
rows with ``turn.patience`` P; ``--text-cues-off`` a row with ``turn.text_cues: off``, the
partials unread; ``--speculate`` each of them again with ``turn.speculate``) with speech to
text streamed over the realtime protocol (``--stt realtime``, the default: the stub's
transcription completes ``stt_ms`` after the commit) or uploaded at the turn's end (``--stt
upload``), and plain silence timers (``--baseline-ms MS...``, 700 by default) that upload the
turn at its end. A second table gives the
gateway's own ``turn_latency`` events per stage (gateway/timeline.py ``TurnClock``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._openai_stub import CallerSpeech, Latencies, OpenAIStub, RealtimeSession, Word

RECORDINGS = Path(__file__).resolve().parent.parent / "tests" / "recordings"
DEFAULT_RECORDINGS = ("long_turn_librivox", "turn_gap_then_barge_in", "barge_in_timit",
                      "barge_in_two_sentences_spk1", "barge_in_early_librivox",
                      "barge_in_command_goforward", "barge_in_mid_jfk")
KEY_VAR = "CALLGATE_BENCH_KEY"


def _config_text(base_url: str, turn: dict[str, Any], transport: str = "upload") -> str:
    key = "${" + KEY_VAR + "}"
    turn_yaml = ", ".join(f"{k}: {v}" for k, v in turn.items())
    return f"""
server: {{public_url: "http://localhost:8080"}}
twilio: {{validate_signatures: false}}
default_agent: bench
agents:
  bench:
    llm: {{provider: openai, model: stub-llm, base_url: "{base_url}", api_key: "{key}"}}
    stt: {{provider: openai, model: whisper-1, base_url: "{base_url}", api_key: "{key}",
          transport: {transport}}}
    tts: {{provider: openai, model: tts-1, voice: alloy, base_url: "{base_url}", api_key: "{key}"}}
    turn: {{{turn_yaml}}}
"""


@dataclass(frozen=True, slots=True)
class TurnLatency:
    recording: str
    speech_end_ms: float
    v2v_ms: float
    decide_ms: float
    own_ms: float
    stages: dict[str, float | None]
    """The gateway's own ``turn_latency`` event of the reply (gateway/timeline.py), its stages
    after the detector's end of speech; empty if the reply was never heard."""
    partials: list[str]
    """The partial transcripts the stub streamed in the turn (its realtime sessions that began
    from 1 s before the turn's first word to its last), in order: the detector's text."""
    text_done: bool
    """The gateway's ``turn_end`` said the detector read a finished text (``text_done``)."""


def _turn_spans(name: str) -> list[tuple[float, float]]:
    from .turn_end import _turn_groups

    labels = json.loads((RECORDINGS / f"{name}.json").read_text())
    return [(float(g[0]["start_ms"]), float(g[-1]["end_ms"])) for g in _turn_groups(labels)]


def caller_speech(name: str) -> CallerSpeech:
    """A recording's caller for the stub's realtime transcription: its audio as the gateway's
    stream sends it, the words of its speech events (the forced alignment of
    ``bench/data/turn_words.json`` where there is one, else the labelled text spread evenly
    over the event) and the events with no text."""
    from audio import pcm16_to_ulaw, read_wav_ulaw, ulaw_to_pcm16

    from .turn_end import _event_key, _event_text, _load_words

    labels = json.loads((RECORDINGS / f"{name}.json").read_text())
    aligned = _load_words()
    words: list[Word] = []
    unlabelled = []
    for e in labels["events"]:
        if e["kind"] not in ("speech", "backchannel"):
            continue
        start, end = float(e["start_ms"]), float(e["end_ms"])
        text = _event_text(e)
        if _event_key(labels, e) in aligned:
            words += [(w, float(a), float(b)) for w, a, b in aligned[_event_key(labels, e)]]
        elif text:
            said = text.split()
            step = (end - start) / len(said)
            words += [(w, start + k * step, start + (k + 1) * step) for k, w in enumerate(said)]
        else:
            unlabelled.append((start, end))
    audio = pcm16_to_ulaw(ulaw_to_pcm16(read_wav_ulaw(RECORDINGS / f"{name}.wav")))
    return CallerSpeech(audio, sorted(words, key=lambda w: w[1]), tuple(unlabelled))


def _measure(name: str, events: list[dict[str, Any]], providers_ms: float,
             sessions: Sequence[RealtimeSession] = ()) -> list[TurnLatency]:
    out = []
    spans = _turn_spans(name)
    ends = [end for _, end in spans]
    for i, (start, end) in enumerate(spans):
        nxt = ends[i + 1] if i + 1 < len(ends) else float("inf")
        turn_end = next((e for e in events if e["type"] == "turn_end" and e["t_ms"] >= end - 100
                         and e["t_ms"] < nxt), None)
        started = next((e for e in events if e["type"] == "bot_utterance_started"
                        and float(e.get("play_at_ms", e["t_ms"])) > end), None)
        if turn_end is None or started is None:
            continue
        first = float(started.get("play_at_ms", started["t_ms"]))
        if first > nxt:
            continue  # the caller spoke again first (held, answered later)
        t_end = float(turn_end["t_ms"])
        likely = [float(e["t_ms"]) for e in events if e["type"] == "turn_likely"
                  and end - 100 <= float(e["t_ms"]) <= t_end]
        sent = likely[-1] if likely else t_end
        floor = max(t_end, sent + providers_ms)
        clock = next((e for e in events if e["type"] == "turn_latency"
                      and e.get("utterance_id") == started.get("utterance_id")), {})
        stages = {k: v for k, v in clock.items() if k.endswith("_ms") and k != "t_ms"}
        partials = [text for ss in sessions if ss.recording == name
                    and start - 1000 <= ss.offset_ms < end for _, text in ss.partials]
        out.append(TurnLatency(name, end, first - end, t_end - end, first - floor, stages,
                               partials, bool(turn_end.get("text_done", False))))
    return out


async def _run_method(names: Sequence[str], stub: OpenAIStub, turn: dict[str, Any],
                      transport: str = "upload") -> list[TurnLatency]:
    from config import ConfigHolder
    from gateway.replay import replay
    from gateway.server import TranscriberCache, call_settings_from
    from gateway.timeline import Timeline
    from nodes import run_worker

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "agents.yaml"
        path.write_text(_config_text(stub.base_url, turn, transport))
        holder = ConfigHolder(path)
        agent = holder.current.agents["bench"]
        settings = call_settings_from(agent.barge_in, agent.turn)
        transcribers = TranscriberCache(holder)
        await transcribers.warm_up()
        try:
            async def one(name: str) -> list[dict[str, Any]]:
                timeline = Timeline()
                await replay(RECORDINGS / f"{name}.wav", realtime=True, settings=settings,
                             agent=lambda bus, stop: run_worker(holder, bus, stop=stop),
                             transcriber_for=lambda info: transcribers(info.agent),
                             timeline=timeline)
                return timeline.events

            results = await asyncio.gather(*(one(n) for n in names))
        finally:
            transcribers.close()
    lat = stub.latencies
    providers = lat.stt_ms + lat.llm_ms + lat.tts_ms
    return [t for n, ev in zip(names, results, strict=True)
            for t in _measure(n, ev, providers, stub.sessions)]


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = max(0, min(len(v) - 1, round(q / 100 * (len(v) - 1))))
    return v[k]


STAGE_COLUMNS = ("turn_end_ms", "stt_ms", "transcript_ms", "llm_first_text_ms",
                 "tts_first_audio_ms", "first_audio_ms", "heard_ms", "hold_ms")


def _stage_row(name: str, turns: Sequence[TurnLatency]) -> str:
    cells = []
    for col in STAGE_COLUMNS:
        v = [x for t in turns if (x := t.stages.get(col)) is not None]
        cells.append(f"{_pct(v, 50):.0f} / {_pct(v, 95):.0f}")
    return f"| {name} | " + " | ".join(cells) + " |"


def _row(name: str, turns: Sequence[TurnLatency], sessions: Sequence[RealtimeSession]) -> str:
    v = [t.v2v_ms for t in turns]
    d = [t.decide_ms for t in turns]
    o = [t.own_ms for t in turns]
    found = sum(1 for ss in sessions if ss.recording is not None)
    return (f"| {name} | {len(turns)} | {_pct(v, 50):.0f} / {_pct(v, 95):.0f} ms | "
            f"{_pct(d, 50):.0f} / {_pct(d, 95):.0f} ms | "
            f"{_pct(o, 50):.0f} / {_pct(o, 95):.0f} ms | {found} / {len(sessions)} |")


async def _main(args: argparse.Namespace) -> int:
    lat = Latencies(stt_ms=args.stt_ms, llm_ms=args.llm_ms, tts_ms=args.tts_ms,
                    partial_lag_ms=args.lag_ms)
    callers = {n: caller_speech(n) for n in args.recordings}
    os.environ.setdefault(KEY_VAR, "sk-bench")
    methods = [(f"callgate turn taking (defaults), {args.stt} stt", {}, args.stt),
               *[(f"callgate, patience {p:g}, {args.stt} stt", {"patience": p}, args.stt)
                 for p in args.patience]]
    if args.text_cues_off:
        methods.append((f"callgate, text_cues off, {args.stt} stt", {"text_cues": "off"},
                        args.stt))
    if args.speculate:
        methods += [(f"{name}, speculative", {**turn, "speculate": "true"}, stt)
                    for name, turn, stt in methods]
    methods += [(f"silence timer {ms:.0f} ms, upload stt",
                 {"mode": "silence", "silence_ms": ms, "early_ms": 0}, "upload")
                for ms in args.baseline_ms]
    print(f"# providers: stt {lat.stt_ms:.0f} ms, first LLM token {lat.llm_ms:.0f} ms, first TTS "
          f"byte {lat.tts_ms:.0f} ms; partials {lat.partial_lag_ms:.0f} ms after each word; "
          f"recordings: {', '.join(args.recordings)}")
    print("\n| method | turns | voice to voice p50 / p95 | decided (end of speech -> turn end) "
          "p50 / p95 | callgate's own p50 / p95 | realtime sessions found in the recordings "
          "|\n|---|---|---|---|---|---|")
    report = {}
    stage_rows = []
    for name, turn, transport in methods:
        async with OpenAIStub(lat, callers) as stub:
            turns = await _run_method(args.recordings, stub, turn, transport)
        print(_row(name, turns, stub.sessions), flush=True)
        stage_rows.append(_stage_row(name, turns))
        report[name] = [{f: getattr(t, f) for f in t.__dataclass_fields__} for t in turns]
    print("\nThe gateway's turn_latency events (ms after the detector's end of speech, p50 / p95;"
          " stt: after the commit; hold: the gateway's own wait once audio and turn end were in):"
          "\n\n| method | " + " | ".join(c.removesuffix("_ms") for c in STAGE_COLUMNS)
          + " |\n|---|" + "---|" * len(STAGE_COLUMNS))
    for row in stage_rows:
        print(row)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from .turn_end import FIT_LAG_MS

    ap = argparse.ArgumentParser(prog="python -m bench.turns",
                                 description="voice-to-voice latency through gateway and worker")
    ap.add_argument("--stt-ms", type=float, default=150.0)
    ap.add_argument("--llm-ms", type=float, default=350.0)
    ap.add_argument("--tts-ms", type=float, default=200.0)
    ap.add_argument("--lag-ms", type=float, default=FIT_LAG_MS,
                    help="the stub's partials: each word this long after its end in the audio "
                         f"received (default {FIT_LAG_MS:g}, as bench.turn_end's)")
    ap.add_argument("--baseline-ms", type=float, nargs="+", default=[700.0],
                    help="the silence timers measured alongside (ms)")
    ap.add_argument("--stt", choices=("realtime", "upload"), default="realtime",
                    help="callgate's speech to text: streamed over the realtime protocol, or "
                         "uploaded at the turn's end (the timer baseline always uploads)")
    ap.add_argument("--patience", type=float, nargs="*", default=[],
                    help="also measure callgate with these turn.patience values")
    ap.add_argument("--text-cues-off", action="store_true",
                    help="also measure callgate with turn.text_cues: off (partials unread)")
    ap.add_argument("--speculate", action="store_true",
                    help="also measure each callgate row with turn.speculate (the partial "
                         "transcript sent at turn_likely)")
    ap.add_argument("--recordings", nargs="+", default=list(DEFAULT_RECORDINGS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    missing = [n for n in args.recordings if not (RECORDINGS / f"{n}.wav").exists()]
    if missing:
        print(f"error: no such recording: {', '.join(missing)}", file=sys.stderr)
        return 2
    return asyncio.run(_main(args))


if __name__ == "__main__":
    raise SystemExit(main())
