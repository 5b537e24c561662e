"""How long the offline recognizer takes after the turn ends: ``python -m bench.stt_stream``.

Every real human utterance of the development recordings (``../shared/recordings``, labelled
``speech`` or ``backchannel`` from a ``real:`` source, each once) is fed to the gateway's
offline transcriber (:class:`speech.PocketsphinxPoolTranscriber`, the one ``callgate serve``
builds) in 20 ms frames paced at 1x media time, from 300 ms before the labelled onset to 300 ms
after the offset, as the call leg feeds it (``--pace 0``: as fast as the decoder keeps up, the
case of a gateway whose decoder has a core to itself, measurable on a busy machine; a decoder
without interim results takes it all at once). Then ``finish()`` is called: the figure is the wall
time from there to the final transcript (what the caller waits for beyond the turn-end
decision), in ms and as a fraction of the turn's audio; and the word error rate against the
labels (``jiwer``), since decoding as the audio arrives gives up batch normalisation.

Only the public stream API is used, so the same file measures another checkout:
``PYTHONPATH=/work/main python bench/stt_stream.py`` gives the figures of that code, which is how
the before/after of issue 17 were taken in one session (``--streamed`` for the streamed mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import jiwer

from audio import TELEPHONY_RATE, read_wav_ulaw, ulaw_to_pcm16
from speech import PocketsphinxPoolTranscriber

RECORDINGS = Path(__file__).resolve().parents[1].parent / "shared" / "recordings"
_FRAME = TELEPHONY_RATE * 2 * 20 // 1000  # 20 ms of 8 kHz PCM16
_MARGIN_MS = 300


def turns(folder: Path) -> list[tuple[str, str, bytes]]:
    """(recording, label text, 8 kHz PCM16) of every distinct real utterance with a text."""
    out: list[tuple[str, str, bytes]] = []
    seen: set[tuple[str, str]] = set()
    for path in sorted(folder.glob("*.json")):
        labels: dict[str, Any] = json.loads(path.read_text())
        ulaw: bytes | None = None
        for event in labels.get("events", []):
            text, source = event.get("text"), str(event.get("source", ""))
            if event.get("kind") not in ("speech", "backchannel") or not text:
                continue
            if not source.startswith("real:") or (source, text) in seen:
                continue
            seen.add((source, text))
            if ulaw is None:
                ulaw = read_wav_ulaw(path.with_suffix(".wav"))
            start = max(0, int((event["start_ms"] - _MARGIN_MS) * 8))
            end = int((event["end_ms"] + _MARGIN_MS) * 8)
            out.append((labels["name"], str(text), ulaw_to_pcm16(ulaw[start:end])))
    return out


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z' ]", " ", text.lower()).split())


async def run(folder: Path, *, pace: float, streamed: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"as_audio_arrives": True} if streamed else {}  # the old code has no such option
    transcriber = PocketsphinxPoolTranscriber(workers=2, **options)
    await transcriber.warm_up()
    rows: list[dict[str, Any]] = []
    try:
        for name, truth, pcm in turns(folder):
            stream = transcriber.open_stream(sample_rate=TELEPHONY_RATE)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for i, at in enumerate(range(0, len(pcm), _FRAME)):
                stream.feed(pcm[at : at + _FRAME])
                if pace <= 0:
                    if i % 10 == 9:  # every 200 ms: wait until the decoder has it all
                        await stream.partial()
                    continue
                delay = t0 + (i + 1) * 0.020 / pace - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)  # media pacing, the caller's clock
            started = time.perf_counter()
            result = await stream.finish()
            finish_ms = (time.perf_counter() - started) * 1000
            stream.close()
            audio_ms = len(pcm) / (TELEPHONY_RATE * 2) * 1000
            rows.append({"name": name, "truth": _words(truth), "text": _words(result.text),
                         "audio_ms": round(audio_ms), "finish_ms": round(finish_ms, 1),
                         "keyphrases": list(getattr(result, "keyphrases", ()))})
    finally:
        transcriber.close()
    finish = [r["finish_ms"] for r in rows]
    return {
        "turns": rows,
        "finish_ms_p50": round(statistics.median(finish), 1),
        "finish_ms_max": round(max(finish), 1),
        "finish_over_audio_p50": round(statistics.median(
            r["finish_ms"] / r["audio_ms"] for r in rows), 3),
        "wer": round(jiwer.wer([r["truth"] for r in rows], [r["text"] or "<empty>" for r in rows]),
                     3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recordings", type=Path, default=RECORDINGS)
    parser.add_argument("--pace", type=float, default=1.0,
                        help="media speed (1.0: real time); 0: as fast as the decoder keeps up "
                             "(each 200 ms waits for an interim result: a decoder with a core "
                             "to itself, whatever else the machine runs)")
    parser.add_argument("--streamed", action="store_true",
                        help="decode as the audio arrives (as_audio_arrives=True)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    if not args.recordings.is_dir():
        parser.exit(2, f"error: no recordings folder {args.recordings}\n")
    report = asyncio.run(run(args.recordings, pace=args.pace, streamed=args.streamed))
    for r in report["turns"]:
        print(f"{r['name']:<30} {r['audio_ms']:>6} ms audio  finish {r['finish_ms']:>7.1f} ms"
              f"  {r['text']!r}")
    print(f"finish -> final: p50 {report['finish_ms_p50']} ms, max {report['finish_ms_max']} ms, "
          f"p50 {report['finish_over_audio_p50']} x the turn; word error {report['wer']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
