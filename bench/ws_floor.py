"""The transport floor: what Twilio's message traffic alone costs one core, ``python -m bench.ws_floor``.

``bench.load`` measures the gateway; this measures the part of it no gateway logic can remove.
A bare aiohttp server (``bench._floor_server``: parse each frame's JSON, decode each payload,
answer 40 ms of caller audio with one 40 ms media message and its mark) is pinned to the first
CPU, and the same load generator as ``bench.load`` (``bench._loadgen``: N Twilio calls over real
WebSockets at 1x, marks echoed as Twilio does) runs on the second. For each N it reports the
server's CPU in the steady window, as a share of its core and as milliseconds per call-second,
and the calls one core could carry at that rate (N / CPU share, the transport alone).

Why it matters: the issue's goal (300 real-time calls on one core) leaves 1000 / 300 = 3.33 ms
of CPU per call-second for *everything*: WebSocket traffic, Silero, echo gate, policy, playback,
bus. The rows here say how much of that the traffic takes before any of the rest runs.
``--silent`` drops the outbound audio (the bot never talks): inbound frames only.

Read the rows with the server's load in mind: at low N the bare server is mostly idle, and each
message also pays for waking it (that is much of the kernel share then); a busy gateway pays less
of that per message. The row where the server is nearly busy is the fair floor.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .load import RECORDINGS, _free_port, _plan_calls, cpu_times, pick_cpus, recording_names

__all__ = ["main", "run_floor"]

_REPO = Path(__file__).resolve().parents[1]
GOAL_CALLS = 300


def cpu_used(before: tuple[float, float],
             after: tuple[float, float]) -> tuple[float, float | None]:
    """CPU seconds used between two (utime, stime) readings, and the kernel's share of them
    (None if none was used). Both come from the same two differences: the share taken against
    ``sum(after) - sum(before)``, which rounds differently, read 1.000000000000002 on a run with
    no user tick at all (CI under load)."""
    user, system = after[0] - before[0], after[1] - before[1]
    used = user + system
    return used, (system / used if used > 0 else None)


def run_floor(n: int, *, seconds: float, stagger: float, silent: bool, seed: int,
              cpus: tuple[int | None, int | None], recordings: Path = RECORDINGS
              ) -> dict[str, Any]:
    """One step: a fresh floor server, ``n`` calls, the server's CPU over the steady window.
    ``cpus``: (the server's CPU, the load generator's CPU), from :func:`bench.load.pick_cpus`."""
    server_cpu, load_cpu = cpus
    port = _free_port()
    cmd = [sys.executable, "-m", "bench._floor_server", str(port)] + (["--silent"] if silent else [])
    if server_cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(server_cpu), *cmd]
    workdir = Path(tempfile.mkdtemp(prefix="callgate-floor-"))
    server = subprocess.Popen(cmd, cwd=_REPO, stdout=subprocess.PIPE, text=True)
    gen = None
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "up":
            raise SystemExit("the floor server did not start")
        calls = _plan_calls(n, 1, recording_names(recordings), stagger, random.Random(seed),
                            "f100r")
        window = (stagger + 2.0, seconds - 0.5)
        plan = {"url": f"ws://127.0.0.1:{port}/twilio/media", "recordings_dir": str(recordings),
                "call_seconds": seconds, "window": window, "calls": calls, "cpu": load_cpu}
        (workdir / "plan.json").write_text(json.dumps(plan))
        gen = subprocess.Popen([sys.executable, "-m", "bench._loadgen", str(workdir / "plan.json"),
                                str(workdir / "result.json")],
                               cwd=_REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert gen.stdout is not None and gen.stdin is not None
        if gen.stdout.readline().strip() != "ready":
            raise SystemExit("the load generator did not start")
        start_at = time.monotonic() + 0.3
        gen.stdin.write(f"{start_at!r}\n")
        gen.stdin.flush()
        marks = []
        for offset in window:
            time.sleep(max(0.0, start_at + offset - time.monotonic()))
            marks.append((time.monotonic(), cpu_times(server.pid)))
        gen.wait(timeout=seconds + stagger + 120)
        result = json.loads((workdir / "result.json").read_text())
    finally:
        server.kill()
        server.wait()
        if gen is not None and gen.poll() is None:
            gen.kill()
            gen.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    (t0, us0), (t1, us1) = marks
    if us0 is None or us1 is None:
        raise SystemExit("bench.ws_floor reads the server's CPU time from /proc (Linux only)")
    used, kernel = cpu_used(us0, us1)
    share = used / (t1 - t0)
    ok = sum(1 for c in result["calls"] if c["error"] is None and not c["closed_early"]
             and c["frames_sent"] == c["frames_planned"])
    late = result["lateness_s"]["p99"]
    return {"calls": n, "ok": ok, "silent": silent, "server_cpu_share": share,
            "kernel_share": kernel,
            "ms_per_call_second": 1000 * share / n, "calls_per_core": n / share if share else None,
            "gen_late_p99_ms": None if late is None else 1000 * late,
            "bot_audio_s": sum(c["bot_audio_s"] for c in result["calls"]),
            "marks_echoed": sum(c["marks_echoed"] for c in result["calls"])}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ws_floor", description=__doc__.split("\n")[0])
    p.add_argument("--calls", default="100,200,300",
                   type=lambda s: [int(x) for x in s.split(",") if x.strip()])
    p.add_argument("--seconds", type=float, default=15.0, help="length of each call")
    p.add_argument("--stagger", type=float, default=3.0, help="calls start over this many seconds")
    p.add_argument("--silent", action="store_true", help="no outbound audio: inbound frames only")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cpus = pick_cpus()  # before this process pins itself to the load CPU
    load_cpu = cpus[1]
    if load_cpu is not None:
        os.sched_setaffinity(0, {load_cpu})
    rows = []
    print("calls |    ok | server CPU | of it kernel | ms CPU per call-second | x first N "
          "| calls per core (transport alone) | gen late p99")
    for n in args.calls:
        r = run_floor(n, seconds=args.seconds, stagger=args.stagger, silent=args.silent,
                      seed=args.seed, cpus=cpus)
        rows.append(r)
        # A few silent calls can use less CPU than /proc's clock tick (10 ms) in the window:
        # then there is no ratio to report, not a division by zero.
        first = rows[0]["ms_per_call_second"]
        r["x_first"] = r["ms_per_call_second"] / first if first > 0 else None
        kernel = "?" if r["kernel_share"] is None else f"{100 * r['kernel_share']:.0f}%"
        print(f"{n:5d} | {r['ok']:2d}/{n:<3d}| {100 * r['server_cpu_share']:9.0f}% | {kernel:>12} | "
              f"{r['ms_per_call_second']:22.2f} | "
              f"{'?' if r['x_first'] is None else format(r['x_first'], '8.2f') + 'x':>9} | "
              f"{r['calls_per_core'] or 0:32.0f} | "
              f"{r['gen_late_p99_ms'] or 0:9.1f} ms", flush=True)
    budget = 1000 / GOAL_CALLS
    last = rows[-1]
    print(f"\n{'inbound frames only' if args.silent else 'inbound frames + 40 ms bot audio and marks'}"
          f"; the goal's budget is {budget:.2f} ms per call-second for everything; at "
          f"{last['calls']} calls the transport alone takes {last['ms_per_call_second']:.2f} "
          f"({100 * last['ms_per_call_second'] / budget:.0f}% of it)")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
