"""bench.turns end to end on one recording: the real gateway and worker against the bench's own
OpenAI-protocol stub, at 1x. What must hold whatever the machine's speed: a reply is never
played before the turn's end was decided (the early reply is held), never sooner than the
providers allow after the transcript went out, and both methods measure the caller's turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import turns


@pytest.mark.slow
def test_bench_turns_measures_both_methods(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "turns.json"
    assert turns.main(["--recordings", "turn_gap_then_barge_in", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    callgate = "callgate turn taking (defaults), realtime stt"
    timer_name = "silence timer 700 ms, upload stt"
    assert f"| {callgate} | 2 |" in printed
    assert f"| {timer_name} | 2 |" in printed
    report = json.loads(out.read_text())
    providers = 150 + 350 + 200
    for method, rows in report.items():
        assert len(rows) == 2, method
        for r in rows:
            assert r["v2v_ms"] >= r["decide_ms"]  # nothing plays before the turn end
            assert r["own_ms"] >= 0  # nor before the providers could have answered
            assert r["v2v_ms"] >= providers  # callgate cannot beat the providers' own latency
            # The gateway's own turn_latency event, its stages in order on the media clock.
            st = r["stages"]
            assert st["transcript_ms"] <= st["llm_first_text_ms"] <= st["tts_first_audio_ms"]
            assert max(st["tts_first_audio_ms"], st["turn_end_ms"]) <= st["first_audio_ms"]
            assert st["first_audio_ms"] <= st["heard_ms"]
            assert st["stt_ms"] >= 0 and st["hold_ms"] >= 0
            # (No bound from the stub's latencies: under load the replay's media clock, which
            # stamps these, runs behind the stub's wall-clock sleeps.)
    timer = report[timer_name]
    assert all(r["decide_ms"] >= 700 - 160 for r in timer)  # the timer counts from the last window


def test_a_missing_recording_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert turns.main(["--recordings", "no_such_call"]) == 2
    assert capsys.readouterr().err.strip() == "error: no such recording: no_such_call"
