"""Keyphrase spotting on real human speech: ``python -m bench.keyphrases``.

The offline transcriber can spot phrases beside its open-vocabulary transcript
(:class:`speech.PocketsphinxPoolTranscriber` with ``keyphrases``). This measures how well, on
every distinct real human utterance of the development recordings (``../shared/recordings``,
``speech`` and ``backchannel`` events from ``real:`` sources), for each ``--threshold``:

* the phrase list is the shipped scripted agent's (every keyword of ``config/agents.yaml``'s
  script rules, its nodes' too, plus the digits and yes/no) and ``PROBES``: words that the
  recordings do hold, of one to four syllables like the agent's keywords. No recording here
  says any of the agent's phrases but "yes" (and nothing may be downloaded), so recall is
  measured on the probes and "yes";
* recall: phrases spoken (the label text holds them as whole words) and spotted;
* false detections: phrases spotted in an utterance whose label does not hold them. Homophones
  count as false ("for" spotted as "four", "to" as "two"): the agent would act on them.

Speech is fed as fast as the worker takes it; the figures do not depend on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
from pathlib import Path
from typing import Any

from bench.stt_stream import RECORDINGS, turns
from config import load_config
from audio import TELEPHONY_RATE
from speech import KEYPHRASE_THRESHOLD, PocketsphinxPoolTranscriber

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ("zero", "oh", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PROBES = ("forward", "meters", "americans", "country", "child", "small dog", "dark suit",
          "water", "married", "respectable", "disposed", "selfish", "leisure", "typography",
          "surpassed", "printed")
"""Words of the recordings' own speech (one or two per utterance), spotted as keyphrases."""


def agent_phrases(config_path: Path) -> list[str]:
    """Every keyword of every agent's script rules (and their nodes'), digits, yes and no."""
    config = load_config(config_path)
    phrases: list[str] = []
    for agent in config.agents.values():
        rules = list(agent.script)
        for node in agent.nodes:
            rules += getattr(node, "script", [])
        phrases += [keyword for rule in rules for keyword in rule.keywords]
    return [*phrases, *DIGITS, "yes", "no"]


def _words(text: str) -> str:
    return " " + " ".join(re.sub(r"[^a-z' ]", " ", text.lower()).split()) + " "


async def measure(folder: Path, phrases: list[str], threshold: float) -> dict[str, Any]:
    transcriber = PocketsphinxPoolTranscriber(workers=1, keyphrases=phrases,
                                              keyphrase_threshold=threshold)
    spotted_by_clip: list[dict[str, Any]] = []
    try:
        for name, truth, pcm in turns(folder):
            stream = transcriber.open_stream(sample_rate=TELEPHONY_RATE)
            stream.feed(pcm)
            result = await stream.finish()
            stream.close()
            present = {p for p in transcriber.keyphrases if f" {p} " in _words(truth)}
            spotted = set(result.keyphrases)
            spotted_by_clip.append({"name": name, "truth": truth, "present": sorted(present),
                                    "found": sorted(spotted & present),
                                    "false": sorted(spotted - present)})
    finally:
        transcriber.close()
    n_present = sum(len(c["present"]) for c in spotted_by_clip)
    n_found = sum(len(c["found"]) for c in spotted_by_clip)
    false = collections.Counter(p for c in spotted_by_clip for p in c["false"])
    agent = set(transcriber.keyphrases) - set(PROBES)
    return {"threshold": threshold, "phrases": list(transcriber.keyphrases),
            "recall": [n_found, n_present], "false": sum(false.values()),
            "false_agent_phrases": sum(n for p, n in false.items() if p in agent),
            "clips_with_a_false_agent_phrase": sum(
                1 for c in spotted_by_clip if set(c["false"]) & agent),
            "false_by_phrase": dict(false.most_common()), "clips": spotted_by_clip}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recordings", type=Path, default=RECORDINGS)
    parser.add_argument("--config", type=Path, default=ROOT / "config" / "agents.yaml")
    parser.add_argument("--threshold", type=float, action="append",
                        help=f"repeatable (default: 1e-20, 1e-5, {KEYPHRASE_THRESHOLD:g}, 10)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    if not args.recordings.is_dir():
        parser.exit(2, f"error: no recordings folder {args.recordings}\n")
    phrases = agent_phrases(args.config) + list(PROBES)
    reports = []
    for threshold in args.threshold or [1e-20, 1e-5, KEYPHRASE_THRESHOLD, 10.0]:
        report = asyncio.run(measure(args.recordings, phrases, threshold))
        reports.append(report)
        found, present = report["recall"]
        print(f"threshold {threshold:g}: recall {found}/{present}, false detections "
              f"{report['false']} ({report['false_agent_phrases']} of the agent's phrases, in "
              f"{report['clips_with_a_false_agent_phrase']} of {len(report['clips'])} "
              f"utterances): {report['false_by_phrase']}")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
