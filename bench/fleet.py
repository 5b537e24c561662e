"""What a fleet costs, per call: ``python -m bench.fleet`` (issue 16, item 3).

For each Redis kind (``--backends``: a single ``redis-server``, and a 3-master Redis Cluster
started from redis-server as the tests do) it runs two kinds of step and reads the CPU time of
every process from ``/proc/PID/stat`` (redis-servers included) at both ends of each step's steady
window (all calls up, ``--warmup`` s after the last one started):

* **media** (real, paced at 1x): ``--media-calls`` Twilio calls over real WebSockets
  (``bench._loadgen``, two generators) spread over **two** real gateways (``callgate serve
  --redis URL --no-worker``), the bot talking the whole call (``bench._bench_worker``: one long
  utterance after another, its audio over the bus), speech to text a stub remote service. Gives
  the gateway's CPU per call-second, and Redis's and the worker's in the real mix.
* **synthetic** (the media simulated): ``--calls`` (100, 300, 1,000) calls whose gateway side is
  ``bench._bus_gateway``: on the bus exactly what a gateway's call does while the bot talks
  (``call_started``, the worker's utterances read from the downlink and played out at 1x of the
  wall clock, ``playback`` progress every 200 ms heard and ``finished`` at each end, then
  ``call_ended``), with no WebSocket, Twilio frame or VAD: this 2-core machine cannot pace 300 or
  1,000 real calls (one gateway core holds ~60, README), so beyond the media step the media is
  synthetic and only the bus traffic is real. ``--workers`` bench workers serve the calls.
  Gives Redis's CPU per call-second (per shard on the cluster) and the worker's, at scale.

The bench worker is the bus side of a worker (claims, acks, the bot's audio written to the
downlink), not an agent: a real ``callgate worker`` adds its agent's work (the LLM and TTS
clients, tool calls) on top of the worker figure here.

Then a sizing table for ``--size`` concurrent calls (100, 1,000, 10,000): gateway cores, worker
cores and Redis shards, from the measured per-call costs at the stated utilisation targets
(``--gateway-util``, ``--worker-util``, ``--redis-util``), and a cross-check: the 300-call
synthetic step's CPU predicted from the 100-call step's per-call costs, against what it
measured. ``--quick`` is a smoke run (tiny sizes); ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .load import STT_KEY_VAR, _free_port, _plan_calls, bench_config, cpu_seconds, recording_names

__all__ = ["main", "sizing"]

_REPO = Path(__file__).resolve().parents[1]
RECORDINGS = _REPO / "tests" / "recordings"
MEDIA_RECORDINGS = ("barge_in_timit", "barge_in_mid_jfk", "barge_in_early_librivox")


# -- processes ---------------------------------------------------------------------------------
@dataclass
class _Procs:
    """Every process a run starts, ended by ``close`` (on error too)."""

    root: Path
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def start(self, name: str, argv: list[str], *, pipe: bool = False,
              env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        log = (self.root / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, cwd=_REPO, env=env, stdout=subprocess.PIPE if pipe else log,
                                stdin=subprocess.PIPE if pipe else subprocess.DEVNULL,
                                stderr=log, text=pipe)
        log.close()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class _Redis:
    kind: str
    url: str
    pids: list[int]
    stop: Any


def start_redis(kind: str, root: Path) -> _Redis:
    from tests.redis_cluster import start_cluster
    from tests.redis_server import RedisServer

    if not shutil.which("redis-server"):
        raise SystemExit("bench.fleet needs a redis-server binary on PATH")
    if kind == "single":
        server = RedisServer(root / "redis")
        server.start()
        return _Redis(kind, server.url, [int(server.pid or 0)], server.stop)
    servers: list[RedisServer] = []

    def stop() -> None:
        for s in servers:
            s.stop()

    try:
        cluster = start_cluster(root / "cluster", servers, replicas=False)
    except BaseException:
        stop()
        raise
    return _Redis(kind, cluster.url, [int(s.pid or 0) for s in cluster.primaries], stop)


def _cpu(pids: list[int]) -> list[float]:
    return [cpu_seconds(p) or 0.0 for p in pids]


def _waited(pids: list[int]) -> float:
    """Seconds the processes' threads have waited, runnable, for a CPU (/proc/PID/schedstat of
    the main thread): a process that wants more CPU than a loaded machine gives it waits here."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    return total


def _ready(proc: subprocess.Popen[str], what: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"bench.fleet: {what} did not start ({line!r})")


def _wait_healthy(port: int, proc: subprocess.Popen[Any], log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"bench.fleet: a gateway exited with {proc.returncode}:\n"
                             + log.read_text(errors="replace")[-3000:])
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        if time.monotonic() > deadline:
            raise SystemExit(f"bench.fleet: a gateway did not come up in {timeout:.0f} s")
        time.sleep(0.1)  # polling another process's health, bounded by the deadline


# -- one step ------------------------------------------------------------------------------------
def _line_within(proc: subprocess.Popen[str], timeout: float) -> str:
    """The next line ``proc`` prints, or "" when none comes within ``timeout`` seconds."""
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, timeout))
    return proc.stdout.readline().strip() if ready else ""


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)  # the step's schedule on the shared clock


def _measure(pids: dict[str, list[int]], args: argparse.Namespace, start_at: float
             ) -> tuple[float, dict[str, float], list[float]]:
    """CPU seconds of each role over the steady window (all calls up, ``--warmup`` after the
    last start, until just before the first ends): (window s, role -> CPU s, per redis-server)."""
    _sleep_until(start_at + args.stagger + args.warmup)
    c0 = {k: _cpu(v) for k, v in pids.items()}
    t0 = time.monotonic()
    _sleep_until(start_at + args.call_seconds - 0.1)
    c1 = {k: _cpu(v) for k, v in pids.items()}
    dt = time.monotonic() - t0
    cpu = {k: sum(c1[k]) - sum(c0[k]) for k in pids}
    return dt, cpu, [b - a for a, b in zip(c0["redis"], c1["redis"], strict=True)]


def _row(kind: str, backend: str, n: int, dt: float, cpu: dict[str, float], shards: list[float],
         extra: dict[str, Any]) -> dict[str, Any]:
    call_s = n * dt
    per = {k: 1000 * v / call_s for k, v in cpu.items()}  # ms of CPU per call-second
    row = {"kind": kind, "backend": backend, "calls": n, "window_s": round(dt, 2),
           "cpu_util": {k: round(v / dt, 3) for k, v in cpu.items()},
           "ms_per_call_s": {k: round(v, 3) for k, v in per.items()},
           "redis_shards": len(shards),
           "redis_busiest_shard_util": round(max(shards) / dt, 3) if shards else None,
           **extra}
    return row


def media_step(redis: _Redis, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Two real gateways, real WebSocket calls at 1x, the bot talking: the gateway's cost."""
    procs = _Procs(workdir)
    try:
        stt_port = _free_port()
        config = workdir / "agents.yaml"
        config.write_text(bench_config(stt_port))
        env = {**os.environ, "CALLGATE_VALIDATE_SIGNATURES": "false", "PYTHONUNBUFFERED": "1",
               STT_KEY_VAR: "bench", "CALLGATE_REDIS_URL": ""}
        env.pop("CALLGATE_CONFIG", None)
        ports = [_free_port(), _free_port()]
        gateways = [procs.start(f"gw{i + 1}", [sys.executable, "-m", "gateway", "--log-level",
                                               "WARNING", "serve", "--config", str(config),
                                               "--redis", redis.url, "--no-worker", "--host",
                                               "127.0.0.1", "--port", str(port)], env=env)
                    for i, port in enumerate(ports)]
        worker = procs.start("worker", [sys.executable, "-m", "bench._bench_worker", "--redis",
                                        redis.url, "--recordings", str(RECORDINGS),
                                        "--stt-port", str(stt_port)], pipe=True)
        _ready(worker, "the bench worker")
        for i, (port, gw) in enumerate(zip(ports, gateways, strict=True)):
            _wait_healthy(port, gw, workdir / f"gw{i + 1}.log")
        rng = random.Random(args.seed)
        names = [n for n in MEDIA_RECORDINGS if n in recording_names(RECORDINGS)]
        calls = _plan_calls(args.media_calls, 1, names, args.stagger, rng, f"f{redis.kind[0]}")
        gens = []
        for i, port in enumerate(ports):
            plan = {"url": f"ws://127.0.0.1:{port}/twilio/media", "recordings_dir": str(RECORDINGS),
                    "call_seconds": args.call_seconds, "window": [0, args.call_seconds],
                    "calls": calls[i::2], "cpu": None}
            path = workdir / f"plan{i}.json"
            path.write_text(json.dumps(plan))
            gens.append(procs.start(f"gen{i}", [sys.executable, "-m", "bench._loadgen", str(path),
                                                str(workdir / f"result{i}.json")], pipe=True))
        for g in gens:
            _ready(g, "a load generator")
        start_at = time.monotonic() + 0.5
        for g in gens:
            assert g.stdin is not None
            g.stdin.write(f"{start_at!r}\n")
            g.stdin.flush()
        pids = {"gateways": [g.pid for g in gateways], "worker": [worker.pid],
                "load": [g.pid for g in gens], "redis": redis.pids}
        dt, cpu, shards = _measure(pids, args, start_at)
        for g in gens:
            g.wait(args.call_seconds + 120)
        results = [json.loads((workdir / f"result{i}.json").read_text()) for i in range(2)]
        done = [c for r in results for c in r["calls"]]
        failed = [c for c in done if c["error"] or c["closed_early"]]
        late = max((r["lateness_s"]["p99"] or 0.0) for r in results) * 1000
        return _row("media", redis.kind, args.media_calls, dt, cpu, shards,
                    {"gateways": 2, "calls_failed": len(failed) + args.media_calls - len(done),
                     "generator_late_p99_ms": round(late, 1)})
    finally:
        procs.close()


def synthetic_step(redis: _Redis, n: int, args: argparse.Namespace, workdir: Path
                   ) -> dict[str, Any]:
    """``n`` calls with synthetic media: the bus side of the gateways, real bench workers."""
    procs = _Procs(workdir)
    try:
        workers = [procs.start(f"worker{i}", [sys.executable, "-m", "bench._bench_worker",
                                              "--redis", redis.url, "--recordings", str(RECORDINGS)],
                               pipe=True)
                   for i in range(args.workers)]
        for w in workers:
            _ready(w, "a bench worker")
        rng = random.Random(args.seed + n)
        # No recording: each utterance is the bench worker's 8 s buzz, spoken again as it ends.
        calls = [dict(c, recording="") for c in
                 _plan_calls(n, 2, [""], args.stagger, rng, f"s{redis.kind[0]}{n:x}")]
        plan = {"redis": redis.url, "calls": calls}
        path, result = workdir / "plan.json", workdir / "result.json"
        path.write_text(json.dumps(plan))
        gw = procs.start("busgw", [sys.executable, "-m", "bench._bus_gateway", str(path),
                                   str(result)], pipe=True)
        _ready(gw, "the bus gateway")
        assert gw.stdin is not None and gw.stdout is not None
        start_at = time.monotonic() + 0.5
        gw.stdin.write(f"{start_at!r}\n")
        gw.stdin.flush()
        # The window opens once every call has heard the bot (the workers' claims take seconds
        # at hundreds of calls: bench.fleet reports how long) and --warmup more.
        speaking = _line_within(gw, start_at + args.claim_timeout - time.monotonic())
        pids = {"gateway_bus_side": [gw.pid], "worker": [w.pid for w in workers],
                "redis": redis.pids}

        def mark() -> dict[str, Any]:
            assert gw.stdin is not None
            gw.stdin.write("mark\n")
            gw.stdin.flush()
            line = _line_within(gw, 30)
            while line == "speaking":  # late, after the claim timeout
                line = _line_within(gw, 30)
            return dict(json.loads(line))

        time.sleep(args.warmup)  # the steady state's start, on the shared clock
        m0 = mark()
        c0 = {k: _cpu(v) for k, v in pids.items()}
        q0 = {k: _waited(v) for k, v in pids.items()}
        time.sleep(args.window)
        c1 = {k: _cpu(v) for k, v in pids.items()}
        q1 = {k: _waited(v) for k, v in pids.items()}
        m1 = mark()
        dt = m1["t"] - m0["t"]
        gw.stdin.write("stop\n")
        gw.stdin.flush()
        gw.wait(120)
        counts = json.loads(result.read_text())
        cpu = {k: sum(c1[k]) - sum(c0[k]) for k in pids}
        shards = [b - a for a, b in zip(c0["redis"], c1["redis"], strict=True)]
        call_s = n * dt
        talked_s = (m1["played_ms"] - m0["played_ms"]) / 1000  # the bot's audio played out
        row = _row("synthetic", redis.kind, n, dt, cpu, shards,
                    {"workers": args.workers, "calls_failed": counts["errors"] + n - counts["calls"],
                     "all_speaking": speaking == "speaking",
                     # Per process, the share of the window it waited runnable for a CPU.
                     "runqueue_wait": {k: round((q1[k] - q0[k]) / dt / len(v), 3)
                                       for k, v in pids.items()},
                     "first_utterance_p50_ms": m0.get("first_utterance_p50_ms"),
                     "first_utterance_max_ms": m0.get("first_utterance_max_ms"),
                     "round_trip_p50_ms": m1.get("round_trip_p50_ms"),
                     "round_trip_p99_ms": m1.get("round_trip_p99_ms"),
                     "bot_audio_s_per_call_s": round((m1["played_ms"] - m0["played_ms"])
                                                     / 1000 / call_s, 2),
                     "bus_messages_per_call_s": round((m1["downlink"] + m1["uplink"] - m0["downlink"]
                                                       - m0["uplink"]) / call_s, 1)})
        # Where the bus carried less than 1 s of bot audio per call-second, the traffic of a
        # call talking at 1x is what the bus carried per second of bot audio: the cost to size on.
        row["ms_per_talking_call_s"] = {k: round(1000 * v / talked_s, 3) if talked_s else None
                                        for k, v in cpu.items()}
        return row
    finally:
        procs.close()


# -- sizing --------------------------------------------------------------------------------------
def sizing(rows: list[dict[str, Any]], sizes: list[int], utils: dict[str, float],
           calls_per_gateway_core: int = 50) -> list[dict[str, Any]]:
    """Cores and shards for each N from the per-call costs: the gateway's from the media step
    (single Redis), the worker's and Redis's from the largest synthetic step (per shard: the
    cluster's busiest shard, as its share of calls; else the single server)."""
    media = [r for r in rows if r["kind"] == "media"]
    synth = [r for r in rows if r["kind"] == "synthetic"]
    if not media or not synth:
        return []
    gw_ms = media[0]["ms_per_call_s"]["gateways"]
    big = max(synth, key=lambda r: (r["calls"], r["backend"] == "single"))
    worker_ms = _talking(big, "worker")
    cluster = [r for r in synth if r["backend"] == "cluster" and r["calls"] == big["calls"]]
    if cluster:
        c = cluster[0]  # the busiest shard, as if it carried the mean shard's share
        busiest = c["redis_busiest_shard_util"] * c["redis_shards"] / max(c["cpu_util"]["redis"], 1e-9)
        redis_ms = _talking(c, "redis") * busiest
    else:
        redis_ms = _talking(big, "redis")
    out = []
    for n in sizes:
        out.append({
            "calls": n,
            # The frame-lag goal binds before the CPU does (bench.load: p99 < 20 ms at 50 calls
            # per core in every run, at ~70% CPU): never more calls per core than that.
            "gateway_cores": max(math.ceil(n * gw_ms / 1000 / utils["gateway"]),
                                 math.ceil(n / calls_per_gateway_core)),
            "worker_cores": math.ceil(n * worker_ms / 1000 / utils["worker"]),
            "redis_shards": math.ceil(n * redis_ms / 1000 / utils["redis"]),
            "from_ms_per_call_s": {"gateway": round(gw_ms, 3), "worker": round(worker_ms, 3),
                                   "redis_shard": round(redis_ms, 3)},
        })
    return out


def _talking(row: dict[str, Any], role: str) -> float:
    """ms of CPU per call-second of a call whose bot talks at 1x (the synthetic steps' figure per
    second of bot audio carried; the plain per call-second figure where there is none)."""
    talking = row.get("ms_per_talking_call_s", {}).get(role)
    return float(talking if talking is not None else row["ms_per_call_s"][role])


def cross_check(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per backend: the 300-call synthetic step's CPU utilisation predicted from the 100-call
    step's per-call costs (linear in calls), against what it measured."""
    out = []
    for backend in sorted({r["backend"] for r in rows}):
        by_n = {r["calls"]: r for r in rows if r["kind"] == "synthetic" and r["backend"] == backend}
        ns = sorted(by_n)
        if len(ns) < 2:
            continue
        lo, hi = by_n[ns[0]], by_n[ns[1]]
        hi_talk = hi.get("bot_audio_s_per_call_s") or 1.0
        for role in ("redis", "worker", "gateway_bus_side"):
            # Linear in the calls and in the bot audio each carried (the same at 1x).
            predicted = _talking(lo, role) * hi["calls"] * hi_talk / 1000
            measured = hi["cpu_util"][role]
            out.append({"backend": backend, "role": role, "from_calls": lo["calls"],
                        "to_calls": hi["calls"], "predicted_util": round(predicted, 3),
                        "measured_util": round(measured, 3),
                        "measured_over_predicted": round(measured / predicted, 2) if predicted else None})
    return out


# -- report --------------------------------------------------------------------------------------
def print_report(result: dict[str, Any], out: Any = sys.stdout) -> None:
    def p(*a: object) -> None:
        print(*a, file=out)

    p("\nbench.fleet: CPU per call-second of each tier (ms of CPU per second of one call), "
      "steady window; the machine may be shared: read the ratios, not the absolutes")
    p("media: real calls over WebSockets at 1x, two gateways; synthetic: the media simulated "
      "(no WebSocket, frames or VAD), the bus traffic of a talking bot real")
    p("synthetic rows: CPU per second of bot audio played out (= per call-second of a call "
      "talking at 1x); 'bot audio' says how much played per call-second (1.0: the bus kept up)")
    p(f"{'kind':9} {'redis':7} {'calls':>5} {'gateway':>8} {'gw bus':>7} {'worker':>7} "
      f"{'redis':>7} {'shard max':>9} {'bot audio':>9} {'round trip':>10} {'cpu wait':>8} "
      f"{'failed':>6}")
    nan = float("nan")
    for r in result["rows"]:
        ms = r.get("ms_per_talking_call_s") or r["ms_per_call_s"]
        shard = r["redis_busiest_shard_util"]
        trip = r.get("round_trip_p50_ms")
        p(f"{r['kind']:9} {r['backend']:7} {r['calls']:>5} "
          f"{ms.get('gateways') or nan:>8.2f} {ms.get('gateway_bus_side') or nan:>7.2f} "
          f"{ms['worker'] or nan:>7.2f} {ms['redis'] or nan:>7.3f} "
          f"{(shard if shard is not None else nan):>8.0%} "
          f"{r.get('bot_audio_s_per_call_s', nan):>9.2f} "
          f"{(f'{trip} ms' if trip is not None else '-'):>10} "
          f"{max((r.get('runqueue_wait') or {'-': nan}).values()):>8.0%} {r['calls_failed']:>6}")
    p("(ms of CPU per call-second; gateway: the two gateways' CPU per call; gw bus: the synthetic "
      "gateway side's bus work; shard max: the busiest redis-server's CPU use; round trip: p50 "
      "from a playback 'finished' published to the worker's next utterance arriving; cpu wait: "
      "the largest share of the window a process waited, runnable, for a CPU: a loaded machine)")
    if result["cross_check"]:
        p("\ncross-check: the larger synthetic step's CPU predicted from the smaller's per-call cost")
        for c in result["cross_check"]:
            p(f"  {c['backend']:7} {c['role']:16} {c['from_calls']} -> {c['to_calls']} calls: "
              f"predicted {c['predicted_util']:.1%} of a core, measured {c['measured_util']:.1%} "
              f"({c['measured_over_predicted']}x)")
    if result["sizing"]:
        u = result["utilisation"]
        p(f"\nsizing (cores planned at {u['gateway']:.0%} gateway / {u['worker']:.0%} worker / "
          f"{u['redis']:.0%} Redis of the measured cost; at most "
          f"{result['gateway_calls_per_core']} calls per gateway core):")
        p(f"  {'calls':>7} {'gateway cores':>14} {'worker cores':>13} {'redis shards':>13}")
        for s in result["sizing"]:
            p(f"  {s['calls']:>7} {s['gateway_cores']:>14} {s['worker_cores']:>13} "
              f"{s['redis_shards']:>13}")


def _counts(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected positive integers, comma-separated") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError("expected positive integers, comma-separated")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="single,cluster",
                   help="single, cluster or both (default), comma-separated")
    p.add_argument("--calls", type=_counts, default=None,
                   help="synthetic steps' calls (default 100,300,1000)")
    p.add_argument("--media-calls", type=int, default=None,
                   help="real calls of the media step, over both gateways (default 40)")
    p.add_argument("--workers", type=int, default=2, help="bench workers in synthetic steps")
    p.add_argument("--call-seconds", type=float, default=None, help="each call's length (25)")
    p.add_argument("--stagger", type=float, default=None, help="calls start over this (3 s)")
    p.add_argument("--warmup", type=float, default=None, help="after the last start (2 s)")
    p.add_argument("--window", type=float, default=None,
                   help="synthetic steps: seconds measured once every call hears the bot (15)")
    p.add_argument("--claim-timeout", type=float, default=120.0,
                   help="synthetic steps: longest wait for every call to hear the bot")
    p.add_argument("--size", type=_counts, default=[100, 1000, 10000],
                   help="concurrent calls to size for")
    p.add_argument("--gateway-util", type=float, default=0.6)
    p.add_argument("--gateway-calls-per-core", type=int, default=50,
                   help="at most this many calls per gateway core (bench.load: 50 met the p99 "
                        "frame-lag goal in every run)")
    p.add_argument("--worker-util", type=float, default=0.6)
    p.add_argument("--redis-util", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, short calls")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("single", "cluster") for b in backends):
        print(f"bench.fleet: --backends takes single and/or cluster, not {args.backends!r}",
              file=sys.stderr)
        return 2
    q = args.quick
    args.calls = args.calls or ([4, 8] if q else [100, 300, 1000])
    args.media_calls = args.media_calls or (4 if q else 40)
    args.call_seconds = args.call_seconds or (6.0 if q else 25.0)
    args.stagger = args.stagger if args.stagger is not None else (0.5 if q else 3.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if q else 2.0)
    args.window = args.window or (3.0 if q else 15.0)
    if args.call_seconds - 0.1 - args.stagger - args.warmup < 1.0:
        print("bench.fleet: --call-seconds must exceed --stagger + --warmup by 1.1 s or more",
              file=sys.stderr)
        return 2
    utils = {"gateway": args.gateway_util, "worker": args.worker_util, "redis": args.redis_util}
    if any(not 0 < u <= 1 for u in utils.values()):
        print("bench.fleet: utilisation targets must be in (0, 1]", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        for backend in backends:
            root = Path(tmp) / backend
            root.mkdir()
            redis = start_redis(backend, root)
            try:
                step = root / "media"
                step.mkdir()
                rows.append(media_step(redis, args, step))
                print(f"  {backend}: media step, {args.media_calls} calls: done", flush=True)
                for n in args.calls:
                    step = root / f"synthetic{n}"
                    step.mkdir()
                    rows.append(synthetic_step(redis, n, args, step))
                    print(f"  {backend}: synthetic step, {n} calls: done", flush=True)
            finally:
                redis.stop()
    result = {"rows": rows, "cross_check": cross_check(rows), "utilisation": utils,
              "sizing": sizing(rows, args.size, utils, args.gateway_calls_per_core),
              "gateway_calls_per_core": args.gateway_calls_per_core,
              "machine_cpus": os.cpu_count(),
              "media_synthetic_above": args.media_calls}
    print_report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
