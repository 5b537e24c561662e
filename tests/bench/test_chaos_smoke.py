"""``python -m bench.chaos`` works: a tiny run (2 calls, a few seconds of faults, one of each
kind: a worker frozen, a worker killed, Redis killed and restarted, a gateway killed and
restarted), as a real subprocess. It checks the bench counts what it says it counts and ends
every process it started; the numbers of a full run are the README's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos import schedule
from tests.redis_server import require_redis_server

ROOT = Path(__file__).resolve().parents[2]


def _processes_under(workdir: Path) -> list[int]:
    """Processes whose command line names the run's folder (its config and its redis dir)."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(workdir) in cmdline.read_bytes().decode(errors="replace"):
                out.append(int(cmdline.parent.name))
        except OSError:
            continue
    return [pid for pid in out if pid != os.getpid()]


@pytest.mark.slow
@pytest.mark.redis
def test_a_tiny_chaos_run_counts_every_key_press_and_cleans_up(tmp_path: Path) -> None:
    require_redis_server()
    out, workdir = tmp_path / "chaos.json", tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--calls", "2", "--seconds", "24",
         "--call-seconds", "8", "--dtmf-every", "1", "--fault-every", "8", "--first-fault", "3",
         "--freeze", "3", "--redis-down", "1", "--gateway-down", "1",
         "--workdir", str(workdir), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170, check=False,
    )
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode in (0, 1), log  # 1: it found a loss, a duplicate or a stray cut
    r = json.loads(out.read_text())
    kinds = [f["fault"] for f in r["faults"]]
    for what in ("worker frozen", "worker resumed", "worker killed", "worker restarted",
                 "redis killed", "redis restarted", "gateway killed", "gateway restarted"):
        assert what in kinds, (what, kinds)
    assert kinds.count("redis killed") == 2
    assert r["calls_started"] >= 2 and r["calls_completed"] >= 1, log
    assert r["key_presses"] > 0
    assert r["calls_cut"] == r["calls_cut_on_killed_gateway"] + r["calls_cut_elsewhere"]
    assert (proc.returncode == 1) == bool(r["events_lost"] or r["events_duplicated"]
                                          or r["calls_cut_elsewhere"])
    assert "uplink events lost" in proc.stdout and "worst takeover" in proc.stdout
    assert 0 <= r["answers_cut_before_audio"] <= r["key_presses"]
    assert "answers cut by a barge-in before any audio" in proc.stdout
    assert _processes_under(workdir) == [], "bench.chaos left processes behind"


def test_the_schedule_has_every_fault_and_keeps_them_apart() -> None:
    faults = schedule(20 * 60, 90, 30)
    kinds = [f.kind for f in faults]
    assert kinds.count("redis_kill") == 2 and kinds.count("gateway_kill") == 1
    worker = [f.at_s for f in faults if f.kind.startswith("worker")]
    assert worker == [30 + 90 * i for i in range(len(worker))] and len(worker) == 13
    others = [f.at_s for f in faults if not f.kind.startswith("worker")]
    assert all(abs(o - w) >= 90 / 4 for o in others for w in worker)
    assert all(0 < f.at_s <= 20 * 60 - 30 for f in faults)
    assert [f.kind for f in faults if f.kind.startswith("worker")][:3] == [
        "worker_freeze", "worker_kill", "worker_freeze"]
