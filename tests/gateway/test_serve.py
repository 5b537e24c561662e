"""`callgate` as a real process: bad command lines are one clear line, `serve` binds first and
fails at start when its worker cannot be built, writes its own port into the TwiML, and a SIGHUP
reloads the security settings (issue 13, items 5, 8a, 8d, 8e). In process: a worker that dies
later fails readiness; a reload applies the gateway's settings or is refused whole."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestServer
from twilio.request_validator import RequestValidator

from bus import EmbeddedBus
from config import DEFAULT_CONFIG, ConfigHolder
from gateway.launch import StartupError, start_worker
from gateway.server import GATEWAY_KEY, build_app, follow_reloads, settings_from_config
from vad import VadEngine

ROOT = Path(__file__).resolve().parents[2]
AUTH = "serve-test-auth-token-0123456789"
FORM = {"CallSid": "CA" + "5" * 32, "AccountSid": "AC" + "2" * 32, "From": "+14155550100",
        "To": "+14155550199", "CallStatus": "ringing"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CALLGATE_", "TWILIO_"))}
    return {**env, "CALLGATE_HOST": "127.0.0.1", **extra}


def _callgate(*args: str, env: dict[str, str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)


def _one_clear_line(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("callgate")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _shipped(**changes: Any) -> dict[str, Any]:
    cfg = yaml.safe_load(Path(DEFAULT_CONFIG).read_text())
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        cfg[section] = {**cfg[section], key: value}
    return cfg


# -- item 8d: bad command lines ----------------------------------------------------------------


def test_a_port_in_use_fails_at_once_before_loading_models() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _callgate("serve", "--no-worker", "--port", str(port))
    line = _one_clear_line(result, f"127.0.0.1:{port}", "in use")
    assert line.startswith("callgate serve: cannot listen")
    # Failed before the models were loaded: nothing of the start-up ran (it logs the signature
    # warning while building the app, after the bind).
    assert "signature validation is OFF" not in result.stderr


def test_bad_command_lines_are_one_clear_line(tmp_path: Path) -> None:
    text = tmp_path / "notes.wav"
    text.write_text("this is not audio\n")
    labels = str(ROOT / "tests/recordings/barge_in_timit.json")
    wav = str(ROOT / "tests/recordings/barge_in_timit.wav")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    cases = [
        (("replay", str(text), "--bot-script", labels), ("callgate replay", "not a RIFF/WAVE")),
        (("call", str(text), "--url", "ws://127.0.0.1:9/twilio/media"),
         ("callgate call", "not a RIFF/WAVE")),
        (("replay", wav, "--bot-script", labels, "--events-out", str(tmp_path / "no/such/x")),
         ("--events-out", "No such file or directory")),
        (("--log-level", "LOUD", "config", "check"), ("--log-level", "'LOUD'", "INFO")),
        (("serve", "--no-worker", "--port", "0", "--redis", "http://127.0.0.1:6379"),
         ("callgate serve", "unknown bus URL", "http://")),
        (("serve", "--no-worker", "--port", "0", "--redis", "redis+cluster://127.0.0.1"),
         ("callgate serve", "host:port")),
        (("worker", "--redis", "http://127.0.0.1:6379"), ("callgate worker", "unknown bus URL")),
    ]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((("replay", wav, "--bot-script", labels, "--events-out",
                       str(locked / "x.jsonl")), ("--events-out", "Permission denied")))
    for args, needles in cases:
        _one_clear_line(_callgate(*args), *needles)


# -- item 8a: a worker that cannot start ------------------------------------------------------


def test_serve_fails_at_start_when_its_worker_cannot_be_built(tmp_path: Path) -> None:
    """An agent whose TTS voice does not exist: serve exits non-zero with the reason (it used
    to report ready, and every call got silence)."""
    cfg = _shipped()
    cfg["agents"]["support"]["tts"] = {**cfg["agents"]["support"]["tts"], "voice": "xx-nowhere"}
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = _callgate("serve", "--port", str(_free_port()), "--config", str(path),
                       "--vad-runtime", "onnx")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    # Named in the worker's start-up failure, or earlier by the config check if that builds
    # the agents' speech (then as a config error naming file, line and field).
    assert "xx-nowhere" in result.stderr, result.stderr
    assert re.search(r"callgate serve: (the in-process worker failed to start|bad config)",
                     result.stderr), result.stderr


async def test_a_worker_that_dies_later_fails_readiness() -> None:
    app = build_app(settings_from_config(ConfigHolder(env={})), bus=EmbeddedBus(),
                    vad=VadEngine(runtime="onnx"))
    gw = app[GATEWAY_KEY]
    die = asyncio.Event()

    async def worker(started: asyncio.Event) -> None:
        started.set()
        await die.wait()
        raise RuntimeError("lost its agent")

    async def broken(started: asyncio.Event) -> None:
        raise RuntimeError("cannot build")

    async with TestServer(app) as srv, aiohttp.ClientSession() as http:
        with pytest.raises(StartupError, match="failed to start: RuntimeError: cannot build"):
            await start_worker(gw, broken, asyncio.Event())
        task = await start_worker(gw, worker, asyncio.Event())
        assert (await http.get(srv.make_url("/readyz"))).status == 200
        die.set()
        await asyncio.gather(task, return_exceptions=True)  # after the gateway's callback
        r = await http.get(srv.make_url("/readyz"))
        body = await r.json()
        assert r.status == 503 and body["reason"] == "unhealthy"
        assert "lost its agent" in body["problems"]["worker"]
        twiml = await (await http.post(srv.make_url("/twilio/voice"), data=FORM)).text()
        assert "all our lines are busy" in twiml


# -- items 5 and 8e: the real process, its TwiML and a SIGHUP ----------------------------------


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    port = _free_port()
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump(_shipped(twilio__validate_signatures=False)))
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--no-worker", "--vad-runtime", "onnx",
         "--port", str(port), "--config", str(path)],
        cwd=ROOT, env=_env(TWILIO_AUTH_TOKEN=AUTH), stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc, port, path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


async def _until_up(http: aiohttp.ClientSession, base: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + 120
    while loop.time() < end:
        try:
            async with http.get(f"{base}/healthz") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)  # polling another process, bounded by the deadline
    raise AssertionError("the gateway never came up")


async def _webhook(http: aiohttp.ClientSession, base: str, sid: str, *,
                   signed: bool) -> tuple[int, str]:
    data = {**FORM, "CallSid": sid}
    headers = {"X-Twilio-Signature": RequestValidator(AUTH).compute_signature(
        f"{base}/twilio/voice", data)} if signed else {}
    async with http.post(f"{base}/twilio/voice", data=data, headers=headers) as r:
        return r.status, await r.text()


async def test_serve_writes_its_port_and_reloads_security_on_sighup(serving: Any) -> None:
    proc, port, path = serving
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        await _until_up(http, base)
        status, twiml = await _webhook(http, base, "CA" + "1" * 32, signed=False)
        assert status == 200
        # No public URL configured: the stream URL is where this gateway listens.
        assert f'<Stream url="ws://127.0.0.1:{port}/twilio/media/' in twiml
        cfg = _shipped(twilio__validate_signatures=True, server__max_calls=2,
                       server__port=port + 1, twilio__auth_token="${TWILIO_AUTH_TOKEN}")
        path.write_text(yaml.safe_dump(cfg))
        proc.send_signal(signal.SIGHUP)
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        # (The same call's webhook each time: those answered before the reload reserve a place.)
        while (await _webhook(http, base, "CA" + "1" * 32, signed=False))[0] != 403:
            assert loop.time() < end, "unsigned webhooks still accepted after the reload"
            await asyncio.sleep(0.05)  # the reload runs in the other process
        # max_calls 2 reloaded: the first call (Twilio retrying its webhook, now signed) and one
        # more get a stream, the third is refused.
        for sid, answer in (("1", "<Connect>"), ("3", "<Connect>"), ("4", "lines are busy")):
            status, twiml = await _webhook(http, base, "CA" + sid * 32, signed=True)
            assert status == 200 and answer in twiml, (sid, twiml)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    out = (path.parent / "serve.log").read_text()
    assert "take effect only after a restart: server.port" in out, out
    assert re.search(r"gateway settings reloaded: .*validate_signatures", out), out


# -- item 5 in process: what a reload applies, and what it refuses ----------------------------


@pytest.fixture
async def reloadable(tmp_path: Path) -> AsyncIterator[tuple[TestServer, Any, ConfigHolder, Path]]:
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump(_shipped(twilio__validate_signatures=False)))
    holder = ConfigHolder(path, env={"TWILIO_AUTH_TOKEN": AUTH})
    app = build_app(settings_from_config(holder), bus=EmbeddedBus(), vad=VadEngine(runtime="onnx"))
    gw = app[GATEWAY_KEY]
    unfollow = follow_reloads(holder, gw)
    async with TestServer(app) as srv:
        yield srv, gw, holder, path
    unfollow()


async def test_a_reload_applies_every_gateway_setting_or_is_refused_whole(reloadable: Any) -> None:
    srv, gw, holder, path = reloadable
    base = str(srv.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        assert (await _webhook(http, base, "CA" + "1" * 32, signed=False))[0] == 200
        # Validation on without a token to validate with: refused, nothing changes.
        path.write_text(yaml.safe_dump(_shipped(twilio__validate_signatures=True,
                                                twilio__auth_token="${NO_SUCH_TOKEN:-}",
                                                server__max_calls=7)))
        result = holder.reload_report()
        assert not result.changed and "no Twilio auth token" in (result.error or "")
        assert holder.current.server.max_calls == 200 and gw.settings.max_calls == 200
        assert (await _webhook(http, base, "CA" + "2" * 32, signed=False))[0] == 200
        # With the token: every gateway setting takes effect; the port says it cannot.
        path.write_text(yaml.safe_dump(_shipped(
            twilio__validate_signatures=True, twilio__auth_token="${TWILIO_AUTH_TOKEN}",
            server__max_calls=7, server__overload_lag_ms=80, server__port=9999,
            server__public_url=base)))
        result = holder.reload_report()
        assert result.changed and result.error is None
        assert result.restart_required == ("server.port",)
        assert holder.last_reload == result
        assert gw.settings.max_calls == 7 and gw.overload.limit_ms == 80
        assert gw.settings.public_url == base
        assert (await _webhook(http, base, "CA" + "3" * 32, signed=False))[0] == 403
        assert (await _webhook(http, base, "CA" + "4" * 32, signed=True))[0] == 200
