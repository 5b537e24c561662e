"""linesim.scoring gives the evaluator's verdicts (../shared/tools/eval_bargein.py), on
simulated recordings replayed through the gateway and on timelines made to hit each rule."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench.robustness import VARIANTS, call_settings
from gateway.replay import load_bot_script, replay
from linesim import Condition, VoiceLibrary, generate, scoring
from vad import VadEngine

_ROOT = Path(__file__).resolve().parents[2]
EVAL = next((p for p in (_ROOT.parent / "shared" / "tools" / "eval_bargein.py",
                         _ROOT / "shared" / "tools" / "eval_bargein.py") if p.is_file()),
            _ROOT.parent / "shared" / "tools" / "eval_bargein.py")
needs_eval = pytest.mark.skipif(not EVAL.is_file(), reason="../shared/tools/eval_bargein.py absent")

CONDITIONS = [
    Condition(erl_db=20, delay_ms=150),
    Condition(erl_db=6, delay_ms=450, behaviour="echo_only"),
    Condition(erl_db=12, delay_ms=150, background="dtmf", behaviour="echo_only"),
    Condition(erl_db=20, delay_ms=150, behaviour="backchannel"),
    Condition(erl_db=9, delay_ms=150, nonlinearity="clip", behaviour="early"),
    Condition(erl_db=20, delay_ms=150, background="babble", behaviour="second_turn"),
]


def _evaluator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("eval_bargein", EVAL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Six simulated calls, written to disk, replayed from their files under plain Silero and
    under the configured decision (events in OUT/<variant>/NAME.events.jsonl)."""
    folder = tmp_path_factory.mktemp("sim")
    labels = generate(folder / "rec", split="train", seed=5, count=len(CONDITIONS),
                      conditions=CONDITIONS, library=VoiceLibrary())

    async def run() -> None:
        async with VadEngine(runtime="onnx") as engine:
            for variant in ("plain_silero", "configured"):
                out = folder / variant
                out.mkdir()
                for lf in labels:
                    name = lf.stem
                    with (out / f"{name}.events.jsonl").open("w") as sink:
                        await replay(folder / "rec" / f"{name}.twilio.jsonl",
                                     bot_script=load_bot_script(lf), events_out=sink,
                                     settings=call_settings(VARIANTS[variant]), vad=engine)

    asyncio.run(run())
    return folder, {lf.stem: json.loads(lf.read_text()) for lf in labels}


@needs_eval
@pytest.mark.parametrize("variant", ["plain_silero", "configured"])
def test_verdicts_match_the_evaluator_on_simulated_calls(
        variant: str, replayed: tuple[Path, dict[str, Any]]) -> None:
    folder, labels = replayed
    ev = _evaluator()
    mine, theirs = [], []
    for name, lab in labels.items():
        events = ev.load_events(folder / variant / f"{name}.events.jsonl")
        for non_interruptible in (False, True):
            a = scoring.score(lab, events, non_interruptible)
            b = ev.score(lab, events, non_interruptible)
            assert a == b, name
        mine.append(scoring.score(lab, events))
        theirs.append(ev.score(lab, events, False))
    # The evaluator's own summary line, from the script run on the folder as users run it.
    proc = subprocess.run([sys.executable, str(EVAL), str(folder / "rec"), "--events-dir",
                           str(folder / variant), "--json"], capture_output=True, text=True,
                          check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == scoring.summarize(mine)
    # Not a vacuous agreement: these calls give both stops and misses or detections.
    assert any(r["false_stop"] for r in mine) and any(r["latency_ms"] is not None or r["missed"]
                                                      for r in mine)


def _labels(**kw: Any) -> dict[str, Any]:
    base = {"name": "t", "scenario": "barge_in", "bot_turns": [{"start_ms": 500, "end_ms": 5000}],
            "events": [], "expect": {"barge_in": True, "barge_in_onset_ms": 2000, "dtmf": ""}}
    base.update(kw)
    return base


TIMELINES: list[tuple[dict[str, Any], list[dict[str, Any]]]] = [
    (_labels(), [{"t_ms": 2100, "type": "clear_sent"}, {"t_ms": 2700, "type": "barge_in"}]),
    (_labels(), [{"t_ms": 1000, "type": "clear_sent"}, {"t_ms": 2100, "type": "clear_sent"}]),
    (_labels(), [{"t_ms": 1000, "type": "barge_in"}]),
    (_labels(), [{"t_ms": 1960, "type": "clear_sent"}]),
    (_labels(), [{"t_ms": 3600, "type": "clear_sent"}]),
    (_labels(expect={"barge_in": False, "barge_in_onset_ms": None, "dtmf": "5"},
             events=[{"kind": "dtmf", "digit": "5", "start_ms": 1500, "end_ms": 1600}]),
     [{"t_ms": 1580, "type": "clear_sent", "reason": "dtmf"},
      {"t_ms": 1700, "type": "dtmf", "digit": "5"}]),
    (_labels(expect={"barge_in": False, "barge_in_onset_ms": None, "dtmf": "5"}),
     [{"t_ms": 1700, "type": "dtmf", "digit": "6"}, {"t_ms": 1800, "type": "barge_in"}]),
    (_labels(), [{"t_ms": 1200, "type": "dtmf", "digit": "1"},
                 {"t_ms": 1250, "type": "clear_sent"}]),
    (_labels(), [{"t_ms": 5150, "type": "clear_sent"}, {"t_ms": 1900, "type": "interrupt_suppressed"}]),
]


@needs_eval
@pytest.mark.parametrize("case", range(len(TIMELINES)))
def test_each_rule_matches_the_evaluator(case: int) -> None:
    ev = _evaluator()
    labels, events = TIMELINES[case]
    events = sorted(events, key=lambda e: float(e["t_ms"]))
    for non_interruptible in (False, True):
        assert scoring.score(labels, events, non_interruptible) == \
            ev.score(labels, events, non_interruptible)


def test_rules_on_hand_made_timelines() -> None:
    """The rules themselves, without the evaluator: a latency, an early stop, the DTMF grace."""
    ok = scoring.score(*TIMELINES[0])
    assert ok["latency_ms"] == 100 and not ok["false_stop"] and not ok["missed"]
    early = scoring.score(*TIMELINES[1])
    assert early["false_stop"] and not early["false_interrupt"] and early["latency_ms"] == 100
    assert scoring.score(*TIMELINES[2])["false_interrupt"]
    assert scoring.score(*TIMELINES[4])["missed"]
    assert not scoring.score(*TIMELINES[5])["false_stop"]
    assert scoring.score(*TIMELINES[7])["not_applicable"]
    assert scoring.pct([1.0, 2.0, 3.0, 4.0], 0.95) == 4.0


def test_pause_gaps_run_from_the_clear_to_the_resumed_audio() -> None:
    """A pause that resumed leaves a gap; one that ended in an interrupt leaves none; a clear
    for another reason (an interrupt's own) opens no gap."""
    events = [
        {"t_ms": 1000.0, "type": "clear_sent", "reason": "barge_in", "utterance_id": "u1"},
        {"t_ms": 1000.0, "type": "bot_utterance_paused", "utterance_id": "u1"},
        {"t_ms": 1420.0, "type": "bot_utterance_resumed", "utterance_id": "u1"},
        {"t_ms": 2000.0, "type": "clear_sent", "reason": "barge_in", "utterance_id": "u1"},
        {"t_ms": 2640.0, "type": "bot_utterance_interrupted", "utterance_id": "u1"},
        {"t_ms": 2640.0, "type": "barge_in", "utterance_id": "u1"},
        {"t_ms": 3000.0, "type": "clear_sent", "reason": "dtmf", "utterance_id": "u2"},
        {"t_ms": 3500.0, "type": "bot_utterance_resumed", "utterance_id": "u2"},
    ]
    assert scoring.pause_gaps(events) == [(1000.0, 420.0)]
