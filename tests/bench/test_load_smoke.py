"""``python -m bench.load`` works: its quick mode, run as a real subprocess, measures a step.

The smoke run starts everything the full benchmark does (its own redis-server, a pinned
``callgate serve --redis ... --no-worker``, the bench worker, a load generator over real
WebSockets) for 5 calls of 5 s. It checks the bench produces figures, not how fast the gateway is.
The helpers the figures rest on (histogram quantiles, the generator's lean Twilio stand-ins) are
checked against their references here too.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench import _loadgen
from bench.load import bench_config, buckets, combine_runs, histogram_quantile, parse_metrics
from gateway import twilio_protocol as tp
from gateway.twilio_sim import TwilioPlayout
from tests.redis_server import require_redis_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.redis
def test_quick_run_reports_frame_lag_and_barge_in(tmp_path: Path) -> None:
    require_redis_server()
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.load", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 1
    row = result["rows"][0]
    assert row["calls"] == 5 and row["calls_ok"] == 5, row["failures"]
    assert row["frames_per_s"] > 0
    for key in ("lag_p50_ms", "lag_p99_ms", "proc_p50_ms", "proc_p99_ms", "cpu_s_per_call_min",
                "gateway_cpu_util", "generator_cpu_util"):
        assert row[key] is not None and row[key] >= 0, key
    # None only where the kernel keeps no /proc/PID/schedstat (bench.load reads it if it can).
    schedstat = Path(f"/proc/{os.getpid()}/schedstat").exists()
    assert (row["gateway_loop_waited"] is not None) == schedstat
    assert row["gateway_loop_waited"] is None or row["gateway_loop_waited"] >= 0
    assert row["lag_p50_ms"] <= row["lag_p99_ms"]
    assert row["barge_in_measured"] >= 1
    assert row["barge_in_client_p50_ms"] is not None
    assert "lag p99" in proc.stdout
    assert "largest N" in proc.stdout or "no N met" in proc.stdout


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    lines = ["# TYPE x histogram", 'x_bucket{le="0.01"} 50.0', 'x_bucket{le="0.02"} 90.0',
             'x_bucket{le="0.05"} 100.0', 'x_bucket{le="+Inf"} 100.0', "x_count 100.0"]
    text = "\n".join(lines)
    b = buckets(parse_metrics(text), "x")
    assert b[-1] == (math.inf, 100.0)
    assert histogram_quantile(b, 0.5) == pytest.approx(0.01)
    assert histogram_quantile(b, 0.7) == pytest.approx(0.015)  # halfway through (0.01, 0.02]
    assert histogram_quantile(b, 0.99) == pytest.approx(0.047)
    assert histogram_quantile(b, 0.25) == pytest.approx(0.005)  # first bucket from 0
    assert histogram_quantile([(0.01, 0.0), (math.inf, 0.0)], 0.5) is None
    assert histogram_quantile([(0.01, 0.0), (math.inf, 3.0)], 0.5) == 0.01  # beyond the last bound


def test_generator_frames_are_what_twilio_protocol_builds() -> None:
    payload = bytes(range(160))
    import base64

    b64 = base64.b64encode(payload).decode()
    assert _loadgen.MEDIA % (7, 6, 100, b64, "MZ1") == tp.build_media(
        sequence_number=7, stream_sid="MZ1", chunk=6, timestamp_ms=100, payload=payload)
    assert _loadgen.MARK % (9, "MZ1", json.dumps("u1#3")) == tp.build_mark(
        sequence_number=9, stream_sid="MZ1", name="u1#3")


def test_lean_playout_echoes_marks_as_twilio_playout_does() -> None:
    rng = random.Random(3)
    lean, ref = _loadgen.LeanPlayout(), TwilioPlayout(stream_sid="MZ1")
    now = 0.0
    for i in range(400):
        now += rng.choice((0.0, 5.0, 20.0))
        r = rng.random()
        if r < 0.45:
            n = rng.choice((160, 80, 1600))
            lean.media(n, now)
            ref.receive(tp.media_message("MZ1", b"\xff" * n), at_ms=now)
        elif r < 0.9:
            lean.mark(f"m{i}", now)
            ref.receive(tp.mark_message("MZ1", f"m{i}"), at_ms=now)
        elif r < 0.95:
            got = lean.clear(now)
            # TwilioPlayout plays due marks first (the replay already echoed them), then echoes
            # the rest at once; together they are the marks the lean one echoes now.
            due = [json.loads(x)["mark"]["name"] for x in ref.advance(now)]
            rest = [json.loads(x)["mark"]["name"] for x in ref.receive(tp.clear_message("MZ1"), at_ms=now)]
            assert got == due + rest
        else:
            assert lean.advance(now) == [json.loads(x)["mark"]["name"] for x in ref.advance(now)]


def test_bench_config_is_valid(tmp_path: Path) -> None:
    from config import load_config

    for port in (None, 12345):
        path = tmp_path / f"agents-{port}.yaml"
        path.write_text(bench_config(port))
        cfg = load_config(path, env={"CALLGATE_BENCH_STT_KEY": "k"})
        assert cfg.server.max_calls >= 10_000
        for agent in cfg.agents.values():
            assert agent.stt.provider == ("pocketsphinx" if port is None else "openai")
    for mode in ("off", "aec3"):  # bench.load --echo-canceller
        path = tmp_path / f"agents-{mode}.yaml"
        path.write_text(bench_config(None, echo_canceller=mode))
        cfg = load_config(path)
        assert {a.barge_in.echo_canceller for a in cfg.agents.values()} == {mode}


@pytest.mark.parametrize("silent", [False, True])
def test_transport_floor_measures_the_bare_server(tmp_path: Path, silent: bool) -> None:
    out = tmp_path / "floor.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ws_floor", "--calls", "3", "--seconds", "4",
         "--stagger", "0.5", "--json", str(out)] + (["--silent"] if silent else []),
        cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["calls"] == 3 and row["ok"] == 3
    assert row["server_cpu_share"] >= 0 and row["ms_per_call_second"] >= 0
    assert row["kernel_share"] is None or 0 <= row["kernel_share"] <= 1
    if silent:
        assert row["bot_audio_s"] == 0 and row["marks_echoed"] == 0
    else:  # the bare server answered with audio, and its marks came back
        assert row["bot_audio_s"] > 1.0 and row["marks_echoed"] > 10
    assert "budget is 3.33 ms per call-second" in proc.stdout


def test_transport_floor_splits_cpu_time_without_rounding_past_one() -> None:
    """A run whose server used no user time: all of it is the kernel's, exactly (the share
    taken against the readings' summed difference was 1.0000000000000013 here)."""
    from bench.ws_floor import cpu_used

    assert cpu_used((7.52, 2.52), (7.52, 2.88)) == (pytest.approx(0.36), 1.0)
    used, kernel = cpu_used((1.0, 1.0), (1.5, 1.25))
    assert used == pytest.approx(0.75) and kernel == pytest.approx(1 / 3)
    assert cpu_used((1.0, 1.0), (1.0, 1.0)) == (0.0, None)


def test_transport_floor_reports_a_run_below_the_cpu_clock_tick(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A few silent calls can use no measurable CPU between the two /proc readings (its clock
    # ticks every 10 ms): the row says "?" for the ratio instead of dividing by zero (CI, stop 20).
    import bench.ws_floor as ws_floor

    def run_floor(n: int, **_: object) -> dict[str, object]:
        share = 0.0 if n == 3 else 0.02
        return {"calls": n, "ok": n, "silent": True, "server_cpu_share": share,
                "kernel_share": 0.5, "ms_per_call_second": 1000 * share / n,
                "calls_per_core": n / share if share else None, "gen_late_p99_ms": 0.4,
                "bot_audio_s": 0.0, "marks_echoed": 0}

    monkeypatch.setattr(ws_floor, "run_floor", run_floor)
    monkeypatch.setattr(ws_floor, "pick_cpus", lambda: (None, None))
    assert ws_floor.main(["--calls", "3,6", "--silent"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.lstrip()[:1].isdigit()]
    assert len(rows) == 2 and [row[5].strip() for row in rows] == ["?", "?"]  # "x first N"


async def test_call_cpu_splits_the_call_logic_cost() -> None:
    from bench.call_cpu import measure

    row = await measure(3, 4.0)
    # Two VAD rows per call with AEC3 in front (the raw window and the echo-cancelled one).
    assert row["calls"] == 3 and row["mean_batch"] == pytest.approx(6.0, abs=1.0)
    parts = (row["silero_ms"], row["gate_features_ms"], row["engine_rest_ms"], row["call_logic_ms"])
    assert all(0 < p < row["ms_per_call_second"] for p in parts)
    assert row["bot_audio_s"] > 3 * 3.0 and row["marks_echoed"] > 3 * 50  # the bot talked


def test_repeated_runs_keep_the_median_run_and_a_majority_goal() -> None:
    def run(p99: float | None, cpu: float) -> dict[str, object]:
        return {"lag_p99_ms": p99, "cpu_s_per_call_min": cpu, "goal_met": p99 is not None and p99 < 20,
                "why": "" if p99 is not None and p99 < 20 else "p99 lag"}

    runs = [run(90.5, 0.80), run(15.0, 0.70), run(19.2, 0.75)]
    row = combine_runs(runs)
    assert row["lag_p99_ms"] == 19.2 and row["cpu_s_per_call_min"] == 0.75  # the median run
    assert row["goal_met"] and (row["runs"], row["runs_met"]) == (3, 2)
    assert row["lag_p99_runs_ms"] == [90.5, 15.0, 19.2]
    row = combine_runs([run(26.9, 0.8), run(15.0, 0.7), run(None, 0.9), run(40.0, 0.8)])
    assert row["lag_p99_ms"] == 26.9 and not row["goal_met"]  # lower median; 1 of 4 met
    assert row["why"] == "met in 1 of 4 runs"
    assert combine_runs([runs[0]]) is runs[0]
