"""Admission and abuse over real loopback sockets: max_calls counted from the webhook, the socket
cap, single-use tokens and one stream per live call, sockets that never send a valid ``start``,
and logs that a flood of bad frames cannot blow up (issue 13, items 2, 4 and 6)."""

from __future__ import annotations

import asyncio
import base64
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from twilio.request_validator import RequestValidator

from bus import EmbeddedBus, Event
from gateway import call as call_module
from gateway import twilio_protocol as tp
from gateway.logs import RateLimitedLog
from gateway.server import GATEWAY_KEY, GatewayApp, GatewaySettings, build_app
from tests.bus_agents import say, serve
from vad import VadEngine

AUTH = "test-auth-token-0123456789abcdef"
PUBLIC = "https://gw.example.test"
VOICE_URL = f"{PUBLIC}/twilio/voice"
MEDIA_URL = "wss://gw.example.test/twilio/media"
ACCOUNT = "AC" + "2" * 32


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def sign(url: str, params: dict[str, str]) -> str:
    return RequestValidator(AUTH).compute_signature(url, params)


def form(k: int) -> dict[str, str]:
    return {"CallSid": f"CA{k:032d}", "AccountSid": ACCOUNT, "From": "+14155550100",
            "To": "+14155550199", "CallStatus": "ringing"}


def start_message(call_sid: str, token: str | None, stream: int = 3) -> str:
    params = {"token": token} if token is not None else {}
    return tp.build_start(stream_sid="MZ" + str(stream) * 32, account_sid=ACCOUNT,
                          call_sid=call_sid, custom_parameters=params)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for server state the test cannot await directly (it changes in the server's
    handler task), bounded by a deadline."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


Server = tuple[TestServer, GatewayApp, Clock]


def make_server(**overrides: Any) -> Callable[[], Any]:
    async def fixture() -> AsyncIterator[Server]:
        clock = Clock()
        options = dict(overrides)
        signed = options.pop("signed", True)
        settings = GatewaySettings(public_url=PUBLIC, auth_token=AUTH if signed else None,
                                   validate_signatures=signed, **options)
        app = build_app(settings, bus=EmbeddedBus(), vad=VadEngine(runtime="onnx"), clock=clock)
        async with TestServer(app) as srv:
            yield srv, app[GATEWAY_KEY], clock
    return fixture


async def webhook(http: aiohttp.ClientSession, srv: TestServer, k: int) -> str:
    f = form(k)
    r = await http.post(srv.make_url("/twilio/voice"), data=f,
                        headers={"X-Twilio-Signature": sign(VOICE_URL, f)})
    assert r.status == 200
    return await r.text()


def token_of(twiml: str) -> str:
    m = re.search(r'name="token" value="([^"]+)"', twiml)
    assert m is not None, twiml
    return m.group(1)


async def upgrade(http: aiohttp.ClientSession, srv: TestServer) -> aiohttp.ClientWebSocketResponse:
    return await http.ws_connect(srv.make_url("/twilio/media"),
                                 headers={"X-Twilio-Signature": sign(MEDIA_URL, {})})


# -- item 2: max_calls counted from the webhook ----------------------------------------------

capacity = pytest.fixture(name="capacity")(make_server(max_calls=20, max_pending_sockets=100))


async def test_webhooks_arriving_together_cannot_overshoot_max_calls(capacity: Server) -> None:
    """40 webhooks in one instant with max_calls 20: 20 get the stream, 20 the busy answer;
    the 20 streams then all start, and a webhook while they run is refused."""
    srv, gw, _ = capacity
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(*(webhook(http, srv, k) for k in range(40)))
        admitted = [k for k, a in enumerate(answers) if "<Connect>" in a]
        assert len(admitted) == 20
        assert sum("all our lines are busy" in a for a in answers) == 20
        ready = await http.get(srv.make_url("/readyz"))  # full of reservations
        assert ready.status == 503 and (await ready.json())["reserved"] == 20
        metrics = await (await http.get(srv.make_url("/metrics"))).text()
        assert "callgate_calls_reserved 20.0" in metrics
        sockets = []
        for k in admitted:
            ws = await upgrade(http, srv)
            await ws.send_str(start_message(f"CA{k:032d}", token_of(answers[k])))
            sockets.append(ws)
        await until(lambda: len(gw.calls) == 20)
        assert gw.occupancy() == 20 and gw.reserved == 0  # reservations taken, not added to
        assert "all our lines are busy" in await webhook(http, srv, 99)
        metrics = await (await http.get(srv.make_url("/metrics"))).text()
        assert 'callgate_calls_refused_total{reason="at_capacity"} 21.0' in metrics
        for ws in sockets:
            await ws.close()
        await until(lambda: not gw.calls)
        assert "<Connect>" in await webhook(http, srv, 100)


async def test_a_reservation_whose_stream_never_comes_expires(capacity: Server) -> None:
    srv, gw, clock = capacity
    async with aiohttp.ClientSession() as http:
        for k in range(20):
            assert "<Connect>" in await webhook(http, srv, k)
        assert "busy" in await webhook(http, srv, 20)
        assert "<Connect>" in await webhook(http, srv, 0)  # Twilio retrying a webhook it holds
        clock.t += gw.settings.reservation_s  # the callers hung up before their streams
        assert gw.occupancy() == 0
        assert "<Connect>" in await webhook(http, srv, 21)


async def test_every_open_socket_counts_against_the_socket_cap(capacity: Server) -> None:
    """Sockets that skipped the webhook: 110 % of max_calls (22) may be open, started or not;
    the next upgrade gets 503."""
    srv, gw, _ = capacity
    async with aiohttp.ClientSession() as http:
        sockets = [await upgrade(http, srv) for _ in range(22)]
        await until(lambda: gw.sockets_open == 22)
        with pytest.raises(aiohttp.WSServerHandshakeError) as exc:
            await upgrade(http, srv)
        assert exc.value.status == 503
        await sockets[0].close()
        await until(lambda: gw.sockets_open == 21)
        again = await upgrade(http, srv)  # a place again
        assert not again.closed
        for ws in [*sockets[1:], again]:
            await ws.close()


# -- item 4: single-use tokens, one stream per live call ---------------------------------------

signed = pytest.fixture(name="signed")(make_server())


async def _greeting_worker(ready: asyncio.Event, seen: list[str]) -> None:
    """A worker on the embedded bus that greets every call it gets with 1 s of audio."""
    async def react(sid: str, event: Event) -> None:
        seen.append(event["type"])
        if event["type"] == "call_started":
            await say(bus, sid, {"payload": base64.b64encode(b"\xff" * 8000).decode()})

    async with EmbeddedBus() as bus:
        ready.set()
        await serve(bus, "w1", react, until_call_ended=False)


def media(k: int, stream: int = 3) -> str:
    return tp.build_media(sequence_number=k + 2, stream_sid="MZ" + str(stream) * 32, chunk=k + 1,
                          timestamp_ms=20 * k, payload=b"\xff" * 160)


@pytest.mark.parametrize("reuse", ["same-token", "no-token"])
async def test_a_second_stream_for_a_live_call_is_refused(signed: Server, reuse: str) -> None:
    """A copy of a live call's stream (same call SID, its token or none) is closed 1008 at its
    `start`: it gets no bot audio, the agent does not greet again, and its `stop` cannot end
    the real call. Once the real call is over its token stays spent."""
    srv, gw, _ = signed
    seen: list[str] = []
    ready = asyncio.Event()
    worker = asyncio.create_task(_greeting_worker(ready, seen))
    await ready.wait()
    try:
        async with aiohttp.ClientSession() as http:
            token = token_of(await webhook(http, srv, 1))
            sid = form(1)["CallSid"]
            real = await upgrade(http, srv)
            await real.send_str(tp.build_connected())
            await real.send_str(start_message(sid, token))
            first = await real.receive(timeout=10)  # the greeting starts
            assert first.type is aiohttp.WSMsgType.TEXT and '"event":"media"' in first.data
            copy = await upgrade(http, srv)
            await copy.send_str(tp.build_connected())
            await copy.send_str(start_message(sid, token if reuse == "same-token" else None, 4))
            await copy.send_str(tp.build_stop(sequence_number=9, stream_sid="MZ" + "4" * 32,
                                              account_sid=ACCOUNT, call_sid=sid))
            closing = await copy.receive(timeout=10)
            assert closing.type is aiohttp.WSMsgType.CLOSE, closing  # not one byte of audio
            assert copy.close_code == 1008
            for k in range(5):  # the real call goes on
                await real.send_str(media(k))
            await until(lambda: sid in gw.calls and gw.calls[sid].now_ms >= 100)
            assert seen.count("call_started") == 1 and "call_ended" not in seen
            await webhook(http, srv, 1)  # Twilio retrying the live call's webhook ...
            assert gw.reserved == 0 and gw.occupancy() == 1  # ... takes no second place
            await real.close()
            await until(lambda: "call_ended" in seen)
            assert seen.count("call_started") == 1
            # The token is spent: a third stream with it is refused although no call is live.
            late = await upgrade(http, srv)
            await late.send_str(start_message(sid, token, 5))
            assert (await late.receive(timeout=10)).type is aiohttp.WSMsgType.CLOSE
            assert late.close_code == 1008
            metrics = await (await http.get(srv.make_url("/metrics"))).text()
            assert 'callgate_calls_refused_total{reason="duplicate_stream"} 1.0' in metrics
            assert 'callgate_calls_refused_total{reason="token"} 1.0' in metrics
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)


unsigned = pytest.fixture(name="unsigned")(make_server(signed=False))


async def test_without_signatures_a_live_call_still_has_one_stream(unsigned: Server) -> None:
    srv, gw, _ = unsigned
    async with aiohttp.ClientSession() as http:
        sid = "CA" + "6" * 32
        real = await http.ws_connect(srv.make_url("/twilio/media"))
        await real.send_str(start_message(sid, None))
        await until(lambda: sid in gw.calls)
        copy = await http.ws_connect(srv.make_url("/twilio/media"))
        await copy.send_str(start_message(sid, None, 4))
        assert (await copy.receive(timeout=10)).type is aiohttp.WSMsgType.CLOSE
        assert copy.close_code == 1008
        assert sid in gw.calls and not gw.calls[sid].ended
        await real.close()


# -- item 6: sockets without a valid start -------------------------------------------------

idle = pytest.fixture(name="idle")(make_server(start_timeout_s=0.3, max_pending_sockets=3))


async def test_a_socket_without_a_valid_start_is_closed_and_counted(idle: Server) -> None:
    """A replayed upgrade (the signature is the same for every call) that sends nothing, or
    only `connected` and bad frames, is closed 1008 when start_timeout_s is up; at most
    max_pending_sockets such sockets at once, the next upgrade gets 503."""
    srv, gw, _ = idle
    async with aiohttp.ClientSession() as http:
        quiet = [await upgrade(http, srv) for _ in range(3)]
        await quiet[1].send_str(tp.build_connected())
        await quiet[2].send_str("not json")
        await until(lambda: gw.sockets_pending == 3)
        with pytest.raises(aiohttp.WSServerHandshakeError) as exc:
            await upgrade(http, srv)
        assert exc.value.status == 503
        for ws in quiet:  # each closed by the server, without the client doing anything
            msg = await ws.receive(timeout=30)
            assert msg.type is aiohttp.WSMsgType.CLOSE
            assert ws.close_code == 1008
        await until(lambda: gw.sockets_pending == 0 and gw.sockets_open == 0)
        metrics = await (await http.get(srv.make_url("/metrics"))).text()
        assert 'callgate_calls_refused_total{reason="start_timeout"} 3.0' in metrics
        assert 'callgate_calls_refused_total{reason="pending_sockets"} 1.0' in metrics
        # A stream that starts in time is not affected by the timeout.
        token = token_of(await webhook(http, srv, 7))
        ok = await upgrade(http, srv)
        await ok.send_str(start_message(form(7)["CallSid"], token))
        await until(lambda: form(7)["CallSid"] in gw.calls)
        assert gw.sockets_pending == 0
        for k in range(3):
            await ok.send_str(media(k))
        await until(lambda: gw.calls[form(7)["CallSid"]].frames_processed == 3)
        assert not ok.closed
        await ok.close()


async def test_a_flood_of_bad_frames_is_logged_once_per_interval(
    unsigned: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """3,000 malformed frames on a live call: all counted as skipped, the call goes on, and
    the log gets at most one line for them per 10 s, not one per frame."""
    srv, gw, _ = unsigned
    caplog.set_level(logging.WARNING, logger="callgate.call")
    before = call_module.SKIPPED_FRAMES.total
    sid = "CA" + "8" * 32
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(srv.make_url("/twilio/media"))
        await ws.send_str(start_message(sid, None))
        await until(lambda: sid in gw.calls)
        for k in range(3000):
            await ws.send_str('{"event":"media","streamSid":' if k % 2 else f"garbage {k}")
        await ws.send_str(media(0))
        await until(lambda: gw.calls[sid].frames_processed == 1)
        assert gw.calls[sid].frames_skipped == 3000
        await ws.close()
    assert call_module.SKIPPED_FRAMES.total - before == 3000
    lines = [r for r in caplog.records if "skipped Twilio frame" in r.getMessage()]
    assert len(lines) <= 1, [r.getMessage() for r in lines]


def test_the_rate_limited_log_counts_what_it_leaves_out(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    logger = logging.getLogger("callgate.test.ratelimit")
    caplog.set_level(logging.WARNING, logger=logger.name)
    limited = RateLimitedLog(logger, "bad frames", interval_s=10.0, clock=clock)
    assert limited.warning("bad frame: %s", "first") is True
    for _ in range(2999):
        assert limited.warning("bad frame: %s", "again") is False
    clock.t += 10
    assert limited.warning("bad frame: %s", "later") is True
    limited.warning("bad frame: %s", "left out")
    limited.flush()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "bad frame: first",
        "bad frame: later (and 2999 more bad frames not logged in the last 10 s)",
        "1 more bad frames not logged in the last 10 s",
    ]
    assert limited.total == 3002
    with pytest.raises(ValueError, match="interval_s"):
        RateLimitedLog(logger, "x", interval_s=0)
