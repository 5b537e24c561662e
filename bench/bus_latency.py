"""Interrupt delivery latency through the bus: ``python -m bench.bus_latency``.

Measures the time from a gateway's ``publish()`` call to the worker's handler running with the
event, for 1, 100 and 1,000 concurrent calls, on the embedded bus and on Redis (its own
redis-server on a free loopback port, or ``REDIS_URL`` when no binary is on PATH), in one run.
The gateway bus and the worker bus are separate instances in one process (one event loop), so
the numbers include both sides' Python work; the worker multiplexes every call's uplink over
one blocking XREADGROUP, as in production.

Load is open-loop: ``--rate`` interrupts per second in total, spread over the calls at random,
for ``--seconds`` per configuration, so every configuration sees the same event rate and only
the number of live calls changes. Results are quoted as ratios against the embedded bus run in
the same process (the baseline), never as absolute pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from dataclasses import dataclass

from bus import Bus, CallInfo, EmbeddedBus, EmbeddedHub, RedisBus
from bus import protocol as bp

if TYPE_CHECKING:
    from tests.redis_server import RedisServer

__all__ = ["Result", "main", "measure"]


@dataclass(frozen=True)
class Result:
    bus: str
    calls: int
    samples: int
    p50_ms: float
    p99_ms: float
    max_ms: float


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


async def measure(
    make: Callable[[str], Bus], kind: str, calls: int, rate: float, seconds: float, seed: int = 1
) -> Result:
    """One configuration: ``calls`` live calls, ``rate`` interrupts/s over ``seconds``."""
    gw, wk = make("gw"), make("wk")
    await gw.start()
    await wk.start()
    latencies: list[float] = []
    ready: set[str] = set()
    handlers: list[asyncio.Task[None]] = []
    seen: set[str] = set()
    duplicates = 0

    async def handle(sid: str) -> None:
        nonlocal duplicates
        async for msg in wk.uplink(sid, "w1"):
            event = msg.event
            if event["eid"] in seen:
                duplicates += 1
            seen.add(event["eid"])
            if "t0" not in event:
                ready.add(sid)
            elif event["measured"]:
                latencies.append(time.perf_counter() - event["t0"])
            await wk.ack(sid, msg.id)

    async def claim() -> None:
        async for call in wk.claim_calls("w1"):
            handlers.append(asyncio.create_task(handle(call.call_sid)))

    claimer = asyncio.create_task(claim())
    sids = [f"CA{kind[0]}{calls}x{i:05d}" for i in range(calls)]
    try:
        for sid in sids:
            await gw.open_call(CallInfo(sid))
            await gw.publish(sid, bp.encode(bp.CallStarted()))
        deadline = time.monotonic() + 60
        while len(ready) < calls:  # every call claimed and its uplink live
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(ready)}/{calls} calls came up")
            await asyncio.sleep(0.01)
        await _drive(gw, sids, rate, min(1.0, seconds / 4), random.Random(seed), False)  # warm-up
        sent = await _drive(gw, sids, rate, seconds, random.Random(seed + 1), True)
        deadline = time.monotonic() + 30
        while len(latencies) < sent and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for sid in sids:
            await gw.close_call(sid)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 30)
    finally:
        claimer.cancel()
        await asyncio.gather(claimer, return_exceptions=True)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await gw.aclose()
        await wk.aclose()
    if duplicates or len(latencies) != sent:
        raise RuntimeError(f"{kind}/{calls}: {len(latencies)} of {sent} delivered, {duplicates} twice")
    values = sorted(v * 1000 for v in latencies)
    return Result(kind, calls, len(values), _percentile(values, 0.5), _percentile(values, 0.99),
                  values[-1] if values else float("nan"))  # fmt: skip


async def _drive(
    gw: Bus, sids: list[str], rate: float, seconds: float, rng: random.Random, measured: bool
) -> int:
    """Publish interrupts to random calls at ``rate`` per second (open loop)."""
    interval = 1.0 / rate
    start = time.perf_counter()
    n = 0
    while True:
        due = start + n * interval
        if due - start >= seconds:
            return n
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sid = sids[rng.randrange(len(sids))]
        # The probe's own fields ride along as a newer minor version's would (ignored by decode).
        await gw.publish(sid, {**bp.encode(bp.Interrupt(utterance_id="u", heard_ms=n)),
                               "measured": measured, "t0": time.perf_counter()})  # fmt: skip
        n += 1


def _print(results: list[Result]) -> None:
    print(f"{'bus':<9} {'calls':>6} {'samples':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for r in results:
        print(f"{r.bus:<9} {r.calls:>6} {r.samples:>8} {r.p50_ms:>8.3f} {r.p99_ms:>8.3f} {r.max_ms:>8.3f}")
    base = {r.calls: r for r in results if r.bus == "embedded"}
    print("\nratios against the embedded bus (same process, same load):")
    print(f"{'bus':<9} {'calls':>6} {'p50 x':>8} {'p99 x':>8}")
    for r in results:
        b = base.get(r.calls)
        if r.bus == "embedded" or b is None:
            continue
        print(f"{r.bus:<9} {r.calls:>6} {r.p50_ms / b.p50_ms:>8.1f} {r.p99_ms / b.p99_ms:>8.1f}")
    red = {r.calls: r for r in results if r.bus == "redis"}
    if 100 in red:
        verdict = "meets" if red[100].p99_ms < 5.0 else "MISSES"
        print(f"\nredis p99 at 100 calls: {red[100].p99_ms:.3f} ms ({verdict} the 5 ms target)")
    if 1 in red and len(red) > 1:
        top = max(red)
        print(f"redis p99 at {top} calls vs 1 call: {red[top].p99_ms / red[1].p99_ms:.1f}x")


async def _run(args: argparse.Namespace) -> list[Result]:
    results: list[Result] = []
    counts = [int(c) for c in args.calls.split(",")]
    for calls in counts:
        hub = EmbeddedHub()
        results.append(await measure(lambda name: EmbeddedBus(hub=hub, bus_id=name),
                                     "embedded", calls, args.rate, args.seconds))  # fmt: skip
        print(f"  embedded, {calls} calls: done", file=sys.stderr)
    url, server = _redis()
    if url is None:
        print("redis: skipped (no redis-server on PATH and REDIS_URL unset)", file=sys.stderr)
        return results
    try:
        for calls in counts:
            prefix = f"bench{os.getpid()}c{calls}"
            results.append(await measure(lambda name: RedisBus(url, prefix=prefix, bus_id=name),
                                         "redis", calls, args.rate, args.seconds))  # fmt: skip
            print(f"  redis, {calls} calls: done", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.directory, ignore_errors=True)
    return results


def _redis() -> tuple[str | None, RedisServer | None]:
    if shutil.which("redis-server"):
        from tests.redis_server import RedisServer  # the one helper that runs redis-server

        server = RedisServer(tempfile.mkdtemp(prefix="callgate-bench-redis-"))
        server.start()
        return server.url, server
    return os.environ.get("REDIS_URL"), None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bus_latency", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", default="1,100,1000", help="concurrent call counts (comma-separated)")
    parser.add_argument("--rate", type=float, default=500.0, help="interrupts per second, all calls together")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per configuration")
    args = parser.parse_args(argv)
    started = time.monotonic()
    results = asyncio.run(_run(args))
    print(f"\ninterrupt latency, publish() -> worker handler; {args.rate:.0f} events/s for "
          f"{args.seconds:.0f} s per row; {os.cpu_count()} CPUs; {time.monotonic() - started:.0f} s total\n")  # fmt: skip
    _print(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
