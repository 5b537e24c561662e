"""``python -m bench.fleet`` works: its quick mode, run as a real subprocess, on a single Redis.

The smoke run starts what the full benchmark does (its own redis-server, two real gateways with
real WebSocket calls and a bench worker for the media step; the synthetic gateway side and bench
workers for the synthetic steps) at tiny sizes. It checks the report has its figures, not what
they are; the sizing and cross-check arithmetic is checked on given rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fleet import cross_check, sizing
from tests.redis_server import require_redis_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.redis
@pytest.mark.slow
def test_quick_run_reports_every_tier_and_a_sizing_table(tmp_path: Path) -> None:
    require_redis_server()
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fleet", "--quick", "--backends", "single", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    kinds = [(r["kind"], r["calls"]) for r in result["rows"]]
    assert kinds == [("media", 4), ("synthetic", 4), ("synthetic", 8)]
    media, *synthetic = result["rows"]
    assert media["calls_failed"] == 0 and media["gateways"] == 2
    assert media["ms_per_call_s"]["gateways"] > 0 and media["ms_per_call_s"]["redis"] > 0
    for row in synthetic:
        assert row["calls_failed"] == 0
        assert row["bot_audio_s_per_call_s"] > 0.5, "the bot's audio crossed the bus"
        assert row["ms_per_call_s"]["worker"] > 0 and row["ms_per_call_s"]["redis"] > 0
        assert row["redis_shards"] == 1
        assert row["all_speaking"] and row["first_utterance_p50_ms"] is not None
        assert set(row["runqueue_wait"]) == {"gateway_bus_side", "worker", "redis"}
        assert row["ms_per_talking_call_s"]["redis"] > 0
    assert [s["calls"] for s in result["sizing"]] == [100, 1000, 10000]
    assert all(s["gateway_cores"] >= 1 and s["redis_shards"] >= 1 for s in result["sizing"])
    assert {c["role"] for c in result["cross_check"]} == {"redis", "worker", "gateway_bus_side"}
    assert "sizing" in proc.stdout and "cross-check" in proc.stdout
    assert "synthetic" in proc.stdout  # the report says which media were simulated


def _row(kind: str, backend: str, calls: int, **ms: float) -> dict[str, object]:
    return {"kind": kind, "backend": backend, "calls": calls, "ms_per_call_s": ms,
            "cpu_util": {k: v * calls / 1000 for k, v in ms.items()},
            "redis_shards": 3 if backend == "cluster" else 1,
            "redis_busiest_shard_util": 0.2 if backend == "cluster" else None}


def test_sizing_uses_the_measured_costs_and_the_calls_per_core_cap() -> None:
    rows = [_row("media", "single", 40, gateways=12.0, worker=1.0, redis=0.5),
            _row("synthetic", "single", 100, gateway_bus_side=1.0, worker=2.0, redis=0.4),
            _row("synthetic", "single", 1000, gateway_bus_side=1.0, worker=1.5, redis=0.3)]
    utils = {"gateway": 0.6, "worker": 0.5, "redis": 0.5}
    (s,) = sizing(rows, [1000], utils, calls_per_gateway_core=50)
    assert s["gateway_cores"] == 20  # 1000 x 12 ms / 0.6 = 20 cores; the cap says 20 as well
    assert s["worker_cores"] == 3  # 1000 x 1.5 ms / 0.5
    assert s["redis_shards"] == 1  # 1000 x 0.3 ms / 0.5 = 0.6
    (capped,) = sizing(rows, [1000], utils, calls_per_gateway_core=25)
    assert capped["gateway_cores"] == 40
    rows.append(_row("synthetic", "cluster", 1000, gateway_bus_side=1.0, worker=1.5, redis=0.3))
    (c,) = sizing(rows, [1000], utils)
    # The busiest shard used 20% of a core for its third of 1,000 calls: 0.6 ms per call.
    assert c["redis_shards"] == 2 and c["from_ms_per_call_s"]["redis_shard"] == pytest.approx(0.6)


def test_cross_check_predicts_the_larger_step_from_the_smaller() -> None:
    rows = [_row("synthetic", "single", 100, gateway_bus_side=1.0, worker=2.0, redis=0.4),
            _row("synthetic", "single", 300, gateway_bus_side=1.0, worker=1.0, redis=0.4)]
    checks = {c["role"]: c for c in cross_check(rows)}
    assert checks["worker"]["predicted_util"] == pytest.approx(0.6)
    assert checks["worker"]["measured_util"] == pytest.approx(0.3)
    assert checks["worker"]["measured_over_predicted"] == pytest.approx(0.5)
    assert checks["redis"]["measured_over_predicted"] == pytest.approx(1.0)
