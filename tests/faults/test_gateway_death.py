"""A gateway killed mid-call (issue 13, item 3), from outside: a real redis-server, a real
`callgate serve --redis ... --no-worker` killed with SIGKILL while a caller is on the line, and a
real `callgate worker` owning the call.

The worker must end the call within seconds (its agent takes the ``call_ended`` path), stop
renewing it, and let its keys go; the gateway's speech-to-text processes must die with it; and a
gateway started again on the same Redis must not bring the dead call back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from gateway.client import play_call
from tests import recordings_index as rec
from tests.redis_server import RedisServer

from .conftest import Processes, eventually
from .test_stt_pool_signals import _alive

NAME = "dtmf_pin_after_prompt"  # 12.6 s of caller audio: long enough to be mid-call


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call_sid() -> str:
    for line in rec.source(NAME).read_text().splitlines():
        msg = json.loads(line)
        if msg["event"] == "start":
            return str(msg["start"]["callSid"])
    raise AssertionError("no start message")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.parent.name))
    return out


async def _healthy(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


@pytest.mark.redis
async def test_a_killed_gateway_s_call_is_ended_by_its_worker(
    redis_server: RedisServer, processes: Processes
) -> None:
    sid = _call_sid()
    port = _free_port()
    env = {"CALLGATE_VALIDATE_SIGNATURES": "false", "CALLGATE_REDIS_URL": "", "CALLGATE_HOST": "127.0.0.1",
           "CALLGATE_PORT": str(port)}  # fmt: skip
    serve = ("serve", "--redis", redis_server.url, "--no-worker", "--vad-runtime", "onnx")
    base = f"http://127.0.0.1:{port}"
    raw = Redis.from_url(redis_server.url)
    keys = [f"cg:{{{sid}}}:{part}" for part in ("up", "down", "ctx", "owner", "fence")]

    async def worker_calls() -> int:
        info = await raw.get("cg:worker:w1")
        return int(json.loads(info)["calls"]) if info else -1

    try:
        processes.start("w1", "worker", "--redis", redis_server.url, "--worker-id", "w1")
        gw = processes.start("gw", *serve, env=env)
        async with aiohttp.ClientSession() as http:
            await eventually(lambda: _healthy(http, f"{base}/healthz"), 120, "the gateway up")
            await eventually(lambda: raw.exists("cg:worker:w1"), 60, "the worker up")
            stt = _children(gw.pid)
            assert stt, "the gateway runs its speech to text in child processes"
            call = asyncio.create_task(play_call(rec.source(NAME), f"ws://127.0.0.1:{port}/twilio/media"))
            try:
                await eventually(lambda: _is(raw, keys[3], b"w1"), 30, "the worker owning the call")
                await eventually(lambda: _equals(worker_calls, 1), 10, "the worker's beat counting it")
                os.kill(gw.pid, signal.SIGKILL)
                killed = time.monotonic()
                gw.wait(10)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(call, 30)  # the caller's socket drops with the gateway
            finally:
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)

            await eventually(lambda: _is(raw, keys[3], b"!closed"), 30, "the worker ending the call")
            took = time.monotonic() - killed
            entries = await raw.xrange(keys[0])
            ended = [(i, json.loads(f[b"e"])) for i, f in entries if b"e" in f]
            assert ended[-1][1]["type"] == "call_ended" and ended[-1][1]["reason"] == "gateway_lost"
            await eventually(lambda: _acked(raw, keys[0], ended[-1][0]), 10, "call_ended handled and acked")
            await eventually(lambda: _no_pending(raw, keys[0]), 10, "the end marker acked too")
            await eventually(lambda: _equals(worker_calls, 0), 10, "the worker no longer holding it")
            ttls = [await raw.ttl(k) for k in keys]
            assert all(0 < t <= 10 for t in ttls), ttls  # not the 24 h of max_call_s
            await eventually(lambda: _no_keys(raw, keys), 30, "the call's keys gone")
            await asyncio.to_thread(_wait_gone, stt, 10.0)
            # A gateway started again on the same Redis does not bring the call back.
            processes.start("gw-again", *serve, env=env)
            await eventually(lambda: _healthy(http, f"{base}/healthz"), 120, "the gateway up again")
            assert await _no_keys(raw, keys) and await worker_calls() == 0
        w1 = processes.log("w1")
        assert "ending the call (call_ended, reason gateway_lost)" in w1, w1[-3000:]
        assert took < 15, f"the call ended {took:.1f}s after the gateway died"
    finally:
        await raw.aclose()


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"STT processes outlived their gateway: {pids}"
        time.sleep(0.02)


async def _is(raw: Redis, key: str, value: bytes) -> bool:
    return await raw.get(key) == value


async def _equals(read, value: int) -> bool:  # type: ignore[no-untyped-def]
    return bool(await read() == value)


async def _acked(raw: Redis, up: str, message_id: bytes) -> bool:
    pending = await raw.xpending_range(up, "workers", "-", "+", 100)
    return all(p["message_id"] != message_id for p in pending)


async def _no_pending(raw: Redis, up: str) -> bool:
    return int((await raw.xpending(up, "workers"))["pending"]) == 0


async def _no_keys(raw: Redis, keys: list[str]) -> bool:
    return int(await raw.exists(*keys)) == 0
