"""A fleet for tests, from outside: real ``callgate serve --redis URL --no-worker`` gateways and
real ``callgate worker`` processes on one Redis (a single server or a 3-master cluster), and
callers that speak Twilio Media Streams to them over real WebSockets.

The agent is ``tests.faults._agents:DtmfEcho``: every key press is answered with one utterance
"You pressed N", written by the worker on the call's downlink stream. That stream is the
worker's own evidence of what it handled: one answer per key press, in the order pressed, is
"each uplink event reached the agent once and in order"; a missing one is a lost event, an extra
one a duplicate (answers are counted once per event id, as the gateway dedups a retried write).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import textwrap
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from bus import RedisBus
from gateway import twilio_protocol as tp
from gateway.twilio_sim import TwilioPlayout
from tests.bus.conftest import eventually
from tests.faults._agents import DTMF_AGENTS_YAML
from tests.faults.conftest import Processes
from tests.redis_server import _free_port

__all__ = ["ANSWER", "Caller", "Fleet", "connect_redis", "fleet_config", "status_is"]

ANSWER = "You pressed "
ACCOUNT = "AC" + "0" * 32
SILENCE = b"\xff" * 160  # one 20 ms frame of mu-law silence: no speech, so no STT work
FRAME_S = 0.02
START_S = 180.0  # a gateway loads torch, Silero and its STT pool: slow on a loaded machine


def fleet_config(drain_timeout_s: float) -> str:
    """The fleet's agent: DtmfEcho, key presses not interrupting the bot (tests.faults._agents);
    no overload guard."""
    return textwrap.dedent(
        f"""\
        server:
          max_calls: 1000
          # No overload guard: it refuses calls while the gateway's loop lags over 50 ms, which
          # a loaded test machine causes by itself (a call refused "busy" failed the spread test
          # at load ~10); the fleet tests count calls, the guard is tests/gateway/test_overload's.
          overload_lag_ms: null
          drain_timeout_s: {drain_timeout_s}
        twilio:
          validate_signatures: false  # the callers here are the tests, not Twilio
        """
    ) + DTMF_AGENTS_YAML


def connect_redis(url: str) -> Redis | RedisCluster:
    """A client for reading the fleet's keys (one key per command, so both kinds serve)."""
    if url.startswith("redis+cluster://"):
        first = url.removeprefix("redis+cluster://").split(",")[0]
        host, port = first.rsplit(":", 1)
        return RedisCluster(host=host, port=int(port), socket_timeout=5)
    return Redis.from_url(url, socket_timeout=5)


@dataclass
class Gateway:
    name: str
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Fleet:
    """Gateways and workers on one Redis, every process in ``procs`` (ended after the tests)."""

    redis_url: str
    procs: Processes
    config: Path
    keys: RedisBus = field(init=False)
    """Never opened: the key layout of the fleet's Redis (one server or a cluster's slots)."""
    gateways: list[Gateway] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    _n: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keys = RedisBus(self.redis_url)

    def _next(self, prefix: str) -> str:
        self._n[prefix] = self._n.get(prefix, 0) + 1
        return f"{prefix}{self._n[prefix]}"

    def start_gateway(self) -> Gateway:
        gw = Gateway(self._next("gw"), _free_port())
        env = {"CALLGATE_VALIDATE_SIGNATURES": "false", "CALLGATE_REDIS_URL": ""}
        self.procs.start(gw.name, "--log-level", "INFO", "serve", "--config", str(self.config),
                         "--redis", self.redis_url, "--no-worker", "--host", "127.0.0.1",
                         "--port", str(gw.port), "--vad-runtime", "onnx", env=env)
        self.gateways.append(gw)
        return gw

    def start_worker(self, *, drain_timeout_s: float = 0.0) -> str:
        """A ``callgate worker``; on SIGTERM it hands its calls back after ``drain_timeout_s``
        (0 here: the handback itself is what the rolling restart tests, not the wait)."""
        wid = self._next("w")
        self.procs.start(wid, "--log-level", "INFO", "worker", "--redis", self.redis_url,
                         "--config", str(self.config), "--worker-id", wid,
                         "--drain-timeout", str(drain_timeout_s))
        self.workers.append(wid)
        return wid

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.procs.procs[name].pid, sig)

    def exited(self, name: str) -> int | None:
        return self.procs.procs[name].poll()

    def retire(self, name: str) -> None:
        """Take a process out of the fleet's lists (it was killed or drained)."""
        self.gateways = [g for g in self.gateways if g.name != name]
        self.workers = [w for w in self.workers if w != name]

    async def wait_up(self, http: aiohttp.ClientSession, raw: Redis | RedisCluster) -> None:
        """Every gateway ready and every worker's liveness key in Redis."""
        for gw in self.gateways:
            await eventually(lambda gw=gw: status_is(http, f"{gw.base}/readyz", 200), START_S,
                             f"{gw.name} ready")
        for wid in self.workers:
            await eventually(lambda wid=wid: _exists(raw, f"cg:worker:{wid}"), START_S, f"{wid} up")

    def log(self, name: str) -> str:
        return self.procs.log(name)


async def status_is(http: aiohttp.ClientSession, url: str, status: int) -> bool:
    try:
        async with http.get(url) as r:
            return r.status == status
    except aiohttp.ClientError:
        return False


async def _exists(raw: Redis | RedisCluster, key: str) -> bool:
    return bool(await raw.exists(key))


class Caller:
    """One phone call as Twilio places it: the voice webhook on a gateway, then the media stream
    the TwiML names, silence paced at 1x, the bot's audio played out on the caller's clock with
    its marks echoed (gateway.twilio_sim), key presses on demand, ``stop`` to hang up."""

    def __init__(self, n: int, gateway: Gateway, keys: RedisBus) -> None:
        """``keys``: a (never opened) bus on the fleet's URL, for the key layout of a call."""
        self.sid = f"CA{n:032x}"
        self._keys = keys
        self.stream_sid = f"MZ{n:032x}"
        self.gateway = gateway
        self.sent: list[str] = []
        self.outcome = "new"  # live | completed | cut
        self._seq = 1
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._stream_url = ""
        self._params: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._playout = TwilioPlayout(stream_sid=self.stream_sid)

    @property
    def down_key(self) -> str:
        return self._keys._key(self.sid, "down")

    async def start(self, http: aiohttp.ClientSession) -> None:
        await self.webhook(http)
        await self.stream(http)

    async def webhook(self, http: aiohttp.ClientSession) -> None:
        """Twilio's voice webhook: the gateway answers ``<Connect><Stream>`` (and reserves a
        place for the stream)."""
        form = {"CallSid": self.sid, "AccountSid": ACCOUNT, "From": "+15550001111",
                "To": "+15550002222", "CallStatus": "ringing"}
        async with http.post(f"{self.gateway.base}/twilio/voice", data=form) as r:
            assert r.status == 200, await r.text()
            twiml = await r.text()
        stream = ET.fromstring(twiml).find("./Connect/Stream")
        assert stream is not None, f"{self.gateway.name} refused {self.sid}: {twiml}"
        self._stream_url = stream.get("url", "")
        self._params = {p.get("name", ""): p.get("value", "") for p in stream.findall("Parameter")}

    async def stream(self, http: aiohttp.ClientSession) -> None:
        """The media stream the webhook's TwiML named: ``connected``, ``start``, then media."""
        self._ws = await http.ws_connect(self._stream_url, max_msg_size=1 << 22)
        await self._ws.send_str(tp.build_connected())
        await self._ws.send_str(tp.build_start(sequence_number=self._next_seq(),
                                               stream_sid=self.stream_sid, account_sid=ACCOUNT,
                                               call_sid=self.sid, custom_parameters=self._params))
        self.outcome = "live"
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.sid)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    async def _run(self) -> None:
        ws = self._ws
        assert ws is not None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reader = loop.create_task(self._read(t0))
        k = 0
        try:
            while not reader.done():
                # Frame k leaves once its 20 ms are complete (pacing, not synchronisation).
                await asyncio.sleep(max(0.0, t0 + (k + 1) * FRAME_S - loop.time()))
                if reader.done():
                    break
                await ws.send_str(tp.build_media(sequence_number=self._next_seq(),
                                                 stream_sid=self.stream_sid, chunk=k + 1,
                                                 timestamp_ms=k * 20, payload=SILENCE))
                k += 1
                for mark in self._playout.advance(k * 20.0):
                    await ws.send_str(mark)
        except (ConnectionError, aiohttp.ClientError):
            pass
        finally:
            if self.outcome == "live":  # the gateway ended it, not our ``stop``
                self.outcome = "cut"
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, t0: float) -> None:
        ws = self._ws
        assert ws is not None
        loop = asyncio.get_running_loop()
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT:
                for echo in self._playout.receive(msg.data, at_ms=(loop.time() - t0) * 1000):
                    await ws.send_str(echo)

    async def press(self, digit: str) -> None:
        assert self._ws is not None and self.outcome == "live", (self.sid, self.outcome)
        await self._ws.send_str(tp.build_dtmf(sequence_number=self._next_seq(),
                                              stream_sid=self.stream_sid, digit=digit))
        self.sent.append(digit)

    async def hang_up(self) -> None:
        assert self._ws is not None and self._task is not None
        if self.outcome == "live":
            self.outcome = "completed"
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                await self._ws.send_str(tp.build_stop(sequence_number=self._next_seq(),
                                                      stream_sid=self.stream_sid,
                                                      account_sid=ACCOUNT, call_sid=self.sid))
        await self._ws.close()
        await asyncio.gather(self._task, return_exceptions=True)

    async def answers(self, raw: Redis | RedisCluster) -> list[str]:
        """The digits the worker(s) answered on this call's downlink, in order, one per event id."""
        seen: set[str] = set()
        out = []
        for _, fields in await raw.xrange(self.down_key):
            if b"e" not in fields:
                continue
            event: dict[str, Any] = json.loads(fields[b"e"])
            text = event.get("text") or ""
            if event.get("type") != "utterance_start" or not text.startswith(ANSWER):
                continue
            eid = str(event.get("eid"))
            if eid not in seen:
                seen.add(eid)
                out.append(text.removeprefix(ANSWER))
        return out

    async def owner(self, raw: Redis | RedisCluster) -> str | None:
        value = await raw.get(self._keys._key(self.sid, "owner"))
        return value.decode() if value else None


async def all_answered(callers: list[Caller], raw: Redis | RedisCluster) -> bool:
    """Every caller has as many answers as key presses (compare them after, in full)."""
    for c in callers:
        if len(await c.answers(raw)) < len(c.sent):
            return False
    return True
