"""SIGTERM with a call in progress: the call finishes, a new call is refused politely, the
process exits 0. The gateway runs as a real `callgate serve` process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp

from gateway.client import play_call
from tests import recordings_index as rec

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_for(http: aiohttp.ClientSession, url: str, predicate, deadline_s: float = 60):  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while loop.time() < end:
        try:
            async with http.get(url) as r:
                body = await r.json()
                if predicate(r.status, body):
                    return body
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)  # polling a separate process, bounded by the deadline
    raise AssertionError(f"{url} never satisfied the condition")


async def test_sigterm_drains_then_exits_zero(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "CALLGATE_VALIDATE_SIGNATURES": "false", "CALLGATE_REDIS_URL": "",
           "CALLGATE_PORT": str(port), "CALLGATE_HOST": "127.0.0.1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--no-worker", "--vad-runtime", "onnx"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await _wait_for(http, f"{base}/healthz", lambda st, b: st == 200)
            call = asyncio.create_task(play_call(rec.source("barge_in_timit"),
                                                 f"ws://127.0.0.1:{port}/twilio/media", speed=3.0))
            await _wait_for(http, f"{base}/healthz", lambda st, b: b["calls"] == 1)
            proc.send_signal(signal.SIGTERM)
            await _wait_for(http, f"{base}/readyz", lambda st, b: st == 503 and b["draining"])
            async with http.post(f"{base}/twilio/voice", data={"CallSid": "CA" + "7" * 32,
                                                               "To": "+14155550100"}) as r:
                twiml = await r.text()
            assert r.status == 200
            assert "<Say>" in twiml and "<Hangup" in twiml and "<Stream" not in twiml
            report = await asyncio.wait_for(call, 60)
        messages = len(rec.source("barge_in_timit").read_text().splitlines())
        assert report.frames_sent == messages  # the call in progress ran to its end
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60)
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out = proc.stdout.read().decode() if proc.stdout else ""
        proc.stdout and proc.stdout.close()
    assert "drained: no call in progress" in out, out


def test_worker_drain_timeout_is_checked_on_the_command_line() -> None:
    from gateway.cli import build_parser

    assert build_parser().parse_args(["worker", "--redis", "redis://h"]).drain_timeout == 10.0
    assert build_parser().parse_args(["worker", "--redis", "redis://h", "--drain-timeout", "0"]
                                     ).drain_timeout == 0.0
    for bad in ("-1", "soon", "inf"):
        proc = subprocess.run([sys.executable, "-m", "gateway", "worker", "--redis", "redis://h",
                               "--drain-timeout", bad], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "--drain-timeout" in proc.stderr.splitlines()[-1], proc.stderr
