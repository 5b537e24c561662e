"""Two gateways behind one webhook, on one Redis (issue 13, item 4, across processes' state): a
stream token spent on one gateway is refused on the other, on the signed stream URL (the
upgrade: 403) and on the bare URL (its ``start``: 1008), while a token not yet spent still opens
its stream on either. Real redis-server, real loopback sockets, Twilio's signatures."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from twilio.request_validator import RequestValidator

from bus import RedisBus
from gateway import twilio_protocol as tp
from gateway.server import GATEWAY_KEY, GatewaySettings, build_app
from tests.redis_server import RedisServer, redis_server  # noqa: F401 - the fixture
from vad import VadEngine

AUTH = "test-auth-token-0123456789abcdef"
PUBLIC = "https://gw.example.test"  # both behind one name, as behind a load balancer
MEDIA_URL = "wss://gw.example.test/twilio/media"
ACCOUNT = "AC" + "3" * 32
SECRET = b"shared-token-secret-0123456789ab"


def sign(url: str, params: dict[str, str]) -> str:
    return RequestValidator(AUTH).compute_signature(url, params)


def form(k: int) -> dict[str, str]:
    return {"CallSid": f"CA{k:032d}", "AccountSid": ACCOUNT, "From": "+14155550100",
            "To": "+14155550199", "CallStatus": "ringing"}


@pytest.fixture
async def gateways(redis_server: RedisServer) -> AsyncIterator[list[TestServer]]:  # noqa: F811
    servers = []
    buses = [RedisBus(redis_server.url, bus_id=f"gw{i}") for i in range(2)]
    try:
        for bus in buses:
            settings = GatewaySettings(public_url=PUBLIC, auth_token=AUTH,
                                       validate_signatures=True, token_secret=SECRET)
            srv = TestServer(build_app(settings, bus=bus, vad=VadEngine(runtime="onnx")))
            await srv.start_server()
            servers.append(srv)
        yield servers
    finally:
        for srv in servers:
            await srv.close()
        for bus in buses:
            await bus.aclose()


async def webhook(http: aiohttp.ClientSession, srv: TestServer, k: int) -> tuple[str, str]:
    """The stream URL's path token and the ``token`` parameter of the TwiML."""
    f = form(k)
    r = await http.post(srv.make_url("/twilio/voice"), data=f,
                        headers={"X-Twilio-Signature": sign(f"{PUBLIC}/twilio/voice", f)})
    assert r.status == 200
    twiml = await r.text()
    path = re.search(r'url="wss://gw\.example\.test/twilio/media/([^"]+)"', twiml)
    param = re.search(r'name="token" value="([^"]+)"', twiml)
    assert path is not None and param is not None, twiml
    return path.group(1), param.group(1)


async def keyed_upgrade(http: aiohttp.ClientSession, srv: TestServer, key: str) -> int:
    """Twilio's upgrade of the TwiML's stream URL: its HTTP status (101 when accepted)."""
    try:
        ws = await http.ws_connect(srv.make_url(f"/twilio/media/{key}"),
                                   headers={"X-Twilio-Signature": sign(f"{MEDIA_URL}/{key}", {})})
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status
    await ws.close()
    return 101


async def bare_start(http: aiohttp.ClientSession, srv: TestServer, k: int,
                     token: str) -> aiohttp.ClientWebSocketResponse:
    ws = await http.ws_connect(srv.make_url("/twilio/media"),
                               headers={"X-Twilio-Signature": sign(MEDIA_URL, {})})
    await ws.send_str(tp.build_connected())
    await ws.send_str(tp.build_start(stream_sid=f"MZ{k:032d}", account_sid=ACCOUNT,
                                     call_sid=form(k)["CallSid"],
                                     custom_parameters={"token": token}))
    return ws


@pytest.mark.redis
async def test_a_token_spent_on_one_gateway_is_refused_on_the_other(
    gateways: list[TestServer],
) -> None:
    a, b = gateways
    async with aiohttp.ClientSession() as http:
        # The signed stream URL: spent by its upgrade on A; the same upgrade replayed on B.
        key, _ = await webhook(http, a, 1)
        assert await keyed_upgrade(http, a, key) == 101
        assert await keyed_upgrade(http, b, key) == 403
        assert await keyed_upgrade(http, a, key) == 403  # and on A itself, as before

        # The webhook on A and its stream on B is how a load balancer splits a call: fine.
        key2, _ = await webhook(http, a, 2)
        assert await keyed_upgrade(http, b, key2) == 101
        assert await keyed_upgrade(http, a, key2) == 403

        # The bare URL: the `start`'s token spent on A, the same `start` on B closed 1008.
        _, token = await webhook(http, a, 3)
        first = await bare_start(http, a, 3, token)
        sid = form(3)["CallSid"]
        gw_a = a.app[GATEWAY_KEY]
        deadline = asyncio.get_running_loop().time() + 10
        while sid not in gw_a.calls:  # the server's handler task starts it: poll, bounded
            assert asyncio.get_running_loop().time() < deadline, "the call never started on A"
            await asyncio.sleep(0.005)
        copy = await bare_start(http, b, 3, token)
        closing = await copy.receive(timeout=10)
        assert closing.type is aiohttp.WSMsgType.CLOSE and copy.close_code == 1008, closing
        assert sid not in b.app[GATEWAY_KEY].calls
        await first.close()

        metrics = await (await http.get(b.make_url("/metrics"))).text()
        assert 'callgate_calls_refused_total{reason="stream_key"} 1.0' in metrics
        assert 'callgate_calls_refused_total{reason="token"} 1.0' in metrics


@pytest.mark.redis
async def test_with_redis_down_a_token_is_still_spent_on_its_gateway(
    gateways: list[TestServer], redis_server: RedisServer, caplog: pytest.LogCaptureFixture,  # noqa: F811
) -> None:
    """The shared record unreachable: the stream opens (refusing every new call during an
    outage would be worse), the token is spent on that gateway, and the log says so."""
    a, _ = gateways
    async with aiohttp.ClientSession() as http:
        key, _ = await webhook(http, a, 4)
        redis_server.kill()
        with caplog.at_level(logging.WARNING, logger="gateway.security"):
            assert await keyed_upgrade(http, a, key) == 101
        assert await keyed_upgrade(http, a, key) == 403
    assert any("spent in this gateway only" in r.getMessage() for r in caplog.records)
