"""bench.robustness on a tiny grid: it replays, scores, tables; variants and the fitting hook."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.robustness import (
    VARIANTS,
    Variant,
    VariantError,
    call_settings,
    main,
    parse_variant,
    report_markdown,
    run_bench,
    window_features,
)
from linesim import Condition, VoiceLibrary, simulate_call

TINY = [Condition(erl_db=20, delay_ms=150), Condition(erl_db=6, delay_ms=150,
                                                      behaviour="echo_only")]


def test_bench_runs_a_tiny_grid_and_tables_it(library: VoiceLibrary) -> None:
    variants = [VARIANTS["plain_silero"], VARIANTS["configured"]]
    report = run_bench(split="train", conditions=TINY, calls_per_point=2, seed=3,
                       variants=variants, concurrency=4, library=library)
    assert report["speed"]["calls"] == 4 and report["speed"]["replays"] == 8
    assert len(report["calls"]) == 8
    summary = report["summary"]
    for v in ("plain_silero", "configured"):
        agg = summary["variants"][v]
        assert agg["all"]["calls"] == 4
        assert agg["echo_only"]["calls"] == 2 and agg["echo_only"]["barge_in_expected"] == 0
        assert agg["with_caller"]["barge_in_expected"] == 2
        point = summary["points"][TINY[0].name][v]
        assert point["calls"] == 2
        assert point["detected"] + sum(c["verdict"]["missed"] for c in report["calls"]
                                       if c["variant"] == v and c["condition"] == TINY[0].name) == 2
    # Plain Silero hears the 6 dB echo as speech: every echo-only call is falsely stopped.
    assert summary["variants"]["plain_silero"]["echo_only"]["false_stops"] == 2
    meta = {"split": "train", "grid": "custom", "calls_per_point": 2, "seed": 3,
            "speed": report["speed"]}
    md = report_markdown(summary, meta)
    assert "| calls | plain_silero | configured |" in md
    assert f"| `{TINY[0].name}` |" in md and f"| `{TINY[1].name}` |" in md
    assert "| echo-only calls (2) |" in md and "replays per CPU second" in md


def test_same_seed_same_verdicts(library: VoiceLibrary) -> None:
    runs = [run_bench(split="check", conditions=TINY[:1], calls_per_point=2, seed=1,
                      variants=[VARIANTS["configured"]], concurrency=2, library=library)
            for _ in range(2)]
    key = sorted((c["verdict"]["name"], json.dumps(c["verdict"], sort_keys=True))
                 for c in runs[0]["calls"])
    assert key == sorted((c["verdict"]["name"], json.dumps(c["verdict"], sort_keys=True))
                         for c in runs[1]["calls"])


def test_variants_override_settings_and_bad_ones_say_why() -> None:
    s = call_settings(parse_variant("strict:echo.echo_margin_db=12,barge_in.p_on=0.7,"
                                    "barge_in.dtmf_interrupts=false,chunk_ms=80"))
    assert s.echo.echo_margin_db == 12 and s.barge_in.p_on == 0.7
    assert s.barge_in.dtmf_interrupts is False and s.chunk_ms == 80
    plain = call_settings(VARIANTS["plain_silero"])
    assert plain.barge_in.resume_on_backchannel is False and plain.echo.echo_margin_db < -100
    with pytest.raises(VariantError, match="barge_in has no setting p_onn"):
        parse_variant("x:barge_in.p_onn=1")
    with pytest.raises(VariantError, match="not a settings group"):
        call_settings(Variant("y", {"nope.x": 1}))
    with pytest.raises(VariantError, match="unknown variant"):
        parse_variant("fancy")


def test_command_line_mistakes_are_one_line(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    rc = main(["--variant", "x:barge_in.nope=1", "--out-json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("bench.robustness: ")
    rc = main(["--condition", "erl5-d9000-none-none-quiet-barge_in"])
    err = capsys.readouterr().err
    assert rc == 2 and "delay_ms must be in" in err and not (tmp_path / "r.json").exists()


def test_window_features_carry_readings_and_truth(library: VoiceLibrary, tmp_path: Path) -> None:
    call = simulate_call(Condition(erl_db=12, delay_ms=150), split="train", seed=2, index=0,
                         library=library)
    call.write(tmp_path)
    rows = window_features([call])
    assert len(rows) == call.labels["duration_ms"] // 32
    assert [r["window"] for r in rows] == list(range(len(rows)))
    row = rows[0]
    for key in ("prob", "gate_level_db", "gate_echo_db", "gate_passes", "feat_voicing",
                "caller_speech", "echo", "bot_playing"):
        assert key in row
    speech = [r for r in rows if r["caller_speech"]]
    quiet = [r for r in rows if not r["caller_speech"] and not r["echo"]]
    assert speech and quiet
    assert sum(r["prob"] for r in speech) / len(speech) > sum(r["prob"] for r in quiet) / len(quiet)
    # The files on disk replay as the open loop does.
    again = window_features([tmp_path / f"{call.name}.json"])
    assert [r["prob"] for r in again] == [r["prob"] for r in window_features([call], loop="open")]


def test_closed_loop_echo_stops_when_the_bot_is_cut_off(library: VoiceLibrary) -> None:
    """Plain Silero stops the bot on this 6 dB echo within its first second and never resumes.
    In the closed loop the echo then dies away; replaying the recording as written it goes on
    (the recording cannot react)."""
    call = simulate_call(Condition(erl_db=6, delay_ms=150, behaviour="echo_only"),
                         split="train", seed=4, index=0, library=library)
    turn = call.labels["bot_turns"][0]
    closed, opened = (window_features([call], variant=VARIANTS["plain_silero"], loop=loop)
                      for loop in ("closed", "open"))

    def level(rows: list[dict[str, object]]) -> float:
        late = [float(r["gate_level_db"]) for r in rows  # type: ignore[arg-type]
                if turn["start_ms"] + 2500 <= float(r["t_ms"]) <= turn["end_ms"]]  # type: ignore[arg-type]
        assert late
        return sum(late) / len(late)

    assert level(opened) - level(closed) >= 10
    # Before the stop both loops hear the same echo.
    first = [(a["gate_level_db"], b["gate_level_db"]) for a, b in zip(closed, opened)
             if turn["start_ms"] + 200 <= a["t_ms"] <= turn["start_ms"] + 400]
    diffs = [abs(a - b) for a, b in first]  # type: ignore[operator]
    assert diffs and sum(diffs) / len(diffs) <= 1.0 and max(diffs) <= 4.0


def test_a_caller_reading_on_through_a_pause_is_not_resumed_over(library: VoiceLibrary) -> None:
    """``pause_hold_windows`` on a closed-loop replay (session 13): a caller talks on over a
    6 dB echo; in the pause the dips between their words fail a noise floor the echo raised
    while Silero still hears them. Without the hold the bot resumed over them (train seed 1,
    call 2: five times); with it, not once, and the barge-in is detected either way."""
    hold, nohold = VARIANTS["configured"], parse_variant("nohold:barge_in.pause_hold_windows=null")
    report = run_bench(split="train", conditions=[Condition(erl_db=6, delay_ms=150)],
                       calls_per_point=3, seed=1, variants=[hold, nohold], concurrency=3,
                       library=library)
    calls = {(c["verdict"]["name"], c["variant"]): c for c in report["calls"]}
    name = next(n for n, _ in calls if n.startswith("sim_train_s1_00002_"))

    def resumed_over(variant: str) -> int:
        c = calls[(name, variant)]
        assert c["verdict"]["latency_ms"] is not None  # detected
        return sum(at >= c["onset_ms"] - 50 for at, _ in c["pauses"])

    assert resumed_over("nohold") >= 2
    assert resumed_over("configured") == 0
    agg = report["summary"]["variants"]
    assert agg["configured"]["all"]["false_resumes"] <= agg["nohold"]["all"]["false_resumes"]


def test_a_false_pause_on_a_line_that_cannot_react_is_not_committed(
        library: VoiceLibrary) -> None:
    """``pause_echo_corr`` on open-loop replays, as ``eval_bargein.py`` replays a recording
    (session 14): the echo path gets 12 dB louder mid-call and its echo pauses the bot; the
    recording's echo goes on after the clear. Without the rule that echo counted as the caller
    and pauses were committed (false interrupts on 6 of the first 8 train calls in session 14;
    with session 16's classifier, which pauses less, 4 of 16), at a first pause or at a later
    one, after a first had resumed and the gateway's playout had fallen behind the recording's;
    with it some of those pauses resume. Since session 17 the simulator renders each text in a
    fresh eSpeak state, so these calls are the same in any process and any test order: 5 of
    the 16 are committed without the rule and 2 of them resume with it. Asserted over the calls:
    the rule commits fewer, and each call it keeps is the same false pause, resumed."""
    on, off = VARIANTS["configured"], parse_variant("off:barge_in.pause_echo_corr=null")
    report = run_bench(split="train", conditions=[Condition(change="level",
                                                            behaviour="echo_only")],
                       calls_per_point=16, seed=1, variants=[on, off], concurrency=8,
                       library=library, loop="open")
    runs: dict[str, dict[str, Any]] = {}
    for c in report["calls"]:
        runs.setdefault(c["verdict"]["name"], {})[c["variant"]] = c
    committed = [n for n, r in runs.items() if r["off"]["verdict"]["false_interrupt"]]
    assert len(committed) >= 2
    kept = [n for n in committed if not runs[n]["configured"]["verdict"]["false_interrupt"]]
    assert len(kept) >= 2
    # With the rule, fewer of the calls commit the echo than without it.
    assert (sum(r["configured"]["verdict"]["false_interrupt"] for r in runs.values())
            < len(committed))
    for n in kept:  # the same false pause, resumed
        assert runs[n]["configured"]["verdict"]["first_stop_ms"] == \
            runs[n]["off"]["verdict"]["first_stop_ms"]
        assert runs[n]["configured"]["pauses"]
