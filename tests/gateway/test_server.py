"""The HTTP side over real loopback sockets: webhook TwiML, signatures, tokens, a whole call."""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from twilio.request_validator import RequestValidator

from bus import EmbeddedBus, Event
from gateway.call import CallSettings
from gateway.client import play_call
from gateway.server import GATEWAY_KEY, GatewayApp, GatewaySettings, build_app
from tests import recordings_index as rec
from tests.bus_agents import say, serve
from vad import VadEngine

AUTH = "test-auth-token-0123456789abcdef"
PUBLIC = "https://gw.example.test"
VOICE_URL = f"{PUBLIC}/twilio/voice"
MEDIA_URL = "wss://gw.example.test/twilio/media"
CALL_SID = "CA" + "1" * 32
FORM = {"CallSid": CALL_SID, "AccountSid": "AC" + "2" * 32, "From": "+14155550100",
        "To": "+14155550199", "CallStatus": "ringing"}


def sign(url: str, params: dict[str, str]) -> str:
    return RequestValidator(AUTH).compute_signature(url, params)


@pytest.fixture
async def server() -> AsyncIterator[tuple[TestServer, GatewayApp]]:
    settings = GatewaySettings(public_url=PUBLIC, auth_token=AUTH, validate_signatures=True,
                               agent_for_number=lambda to: "support" if to else "default")
    app = build_app(settings, bus=EmbeddedBus(), vad=VadEngine())
    async with TestServer(app) as srv:
        yield srv, app[GATEWAY_KEY]


async def test_webhook_answers_twiml_with_stream_and_token(server: Any) -> None:
    srv, gw = server
    async with aiohttp.ClientSession() as http:
        r = await http.post(srv.make_url("/twilio/voice"), data=FORM,
                            headers={"X-Twilio-Signature": sign(VOICE_URL, FORM)})
        body = await r.text()
    assert r.status == 200
    assert r.content_type == "application/xml"
    token = re.search(r'<Parameter name="token" value="([^"]+)"', body)
    assert token is not None
    # The stream URL carries the token in its path: Twilio signs the upgrade over it.
    assert f'<Stream url="{MEDIA_URL}/{token.group(1)}">' in body
    claims = gw.tokens.verify(token.group(1), call_sid=CALL_SID)
    assert claims.agent == "support"


@pytest.mark.parametrize(
    "signature",
    [None, "forged", sign("https://elsewhere.test/twilio/voice", FORM),
     sign(VOICE_URL, {**FORM, "To": "+10000000000"})],
    ids=["missing", "forged", "other-url", "other-params"],
)
async def test_webhook_refuses_bad_signatures(server: Any, signature: str | None) -> None:
    srv, _ = server
    headers = {"X-Twilio-Signature": signature} if signature else {}
    async with aiohttp.ClientSession() as http:
        r = await http.post(srv.make_url("/twilio/voice"), data=FORM, headers=headers)
    assert r.status == 403


@pytest.mark.parametrize(
    "signature",
    [None, "forged", sign("wss://elsewhere.test/twilio/media", {}), sign(VOICE_URL, {})],
    ids=["missing", "forged", "other-url", "webhook-url"],
)
async def test_media_upgrade_refuses_bad_signatures(server: Any, signature: str | None) -> None:
    srv, _ = server
    headers = {"X-Twilio-Signature": signature} if signature else {}
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as exc:
            await http.ws_connect(srv.make_url("/twilio/media"), headers=headers)
    assert exc.value.status == 403


async def _token(srv: TestServer) -> str:
    async with aiohttp.ClientSession() as http:
        r = await http.post(srv.make_url("/twilio/voice"), data=FORM,
                            headers={"X-Twilio-Signature": sign(VOICE_URL, FORM)})
        m = re.search(r'name="token" value="([^"]+)"', await r.text())
    assert m is not None
    return m.group(1)


def _start(call_sid: str, token: str | None) -> str:
    from gateway import twilio_protocol as tp

    params = {"token": token} if token is not None else {}
    return tp.build_start(stream_sid="MZ" + "3" * 32, account_sid="AC" + "2" * 32,
                          call_sid=call_sid, custom_parameters=params)


@pytest.mark.parametrize("case", ["missing", "garbage", "other-call"])
async def test_start_without_a_valid_token_is_refused(server: Any, case: str) -> None:
    srv, gw = server
    good = await _token(srv)
    start = {"missing": _start(CALL_SID, None), "garbage": _start(CALL_SID, "x.y.z"),
             "other-call": _start("CA" + "9" * 32, good)}[case]
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(srv.make_url("/twilio/media"),
                                   headers={"X-Twilio-Signature": sign(MEDIA_URL, {})})
        await ws.send_str('{"event":"connected","protocol":"Call","version":"1.0.0"}')
        await ws.send_str(start)
        msg = await ws.receive()
        assert msg.type is aiohttp.WSMsgType.CLOSE
        assert ws.close_code == 1008
    assert gw.calls == {}


async def _until(condition: Any, timeout: float = 10.0) -> None:
    """Wait for state that changes in the server's handler task, bounded by a deadline."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def _keyed_upgrade(http: aiohttp.ClientSession, srv: TestServer,
                         token: str) -> aiohttp.ClientWebSocketResponse:
    """Upgrade as Twilio does for the TwiML's URL (the token in its path), signed over it."""
    return await http.ws_connect(srv.make_url(f"/twilio/media/{token}"),
                                 headers={"X-Twilio-Signature": sign(f"{MEDIA_URL}/{token}", {})})


async def test_a_replayed_upgrade_is_refused_before_it_holds_a_socket(server: Any) -> None:
    """Each call's stream URL differs (its token), so does the upgrade's signature; the token
    is spent by the upgrade. The same upgrade again (headers and all) gets 403, while the call
    lives and after; so does one whose URL's token is not ours, or is for another call."""
    srv, gw = server
    token = await _token(srv)
    async with aiohttp.ClientSession() as http:
        ws = await _keyed_upgrade(http, srv, token)
        await ws.send_str(_start(CALL_SID, None))  # the URL's token is the credential
        await _until(lambda: CALL_SID in gw.calls)
        with pytest.raises(aiohttp.WSServerHandshakeError) as exc:  # while the call lives
            await _keyed_upgrade(http, srv, token)
        assert exc.value.status == 403 and gw.sockets_open == 1
        await ws.close()
        await _until(lambda: not gw.calls)
        with pytest.raises(aiohttp.WSServerHandshakeError) as exc:  # and after
            await _keyed_upgrade(http, srv, token)
        assert exc.value.status == 403
        # A token we did not issue, signed over its own URL (as by someone with the auth
        # token, or a URL Twilio never had): refused as well.
        forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
        with pytest.raises(aiohttp.WSServerHandshakeError) as exc:
            await _keyed_upgrade(http, srv, forged)
        assert exc.value.status == 403
        # The URL of one call, and a `start` for another: closed 1008.
        other = await _token(srv)
        ws = await _keyed_upgrade(http, srv, other)
        await ws.send_str(_start("CA" + "9" * 32, None))
        assert (await ws.receive(timeout=10)).type is aiohttp.WSMsgType.CLOSE
        assert ws.close_code == 1008
        metrics = await (await http.get(srv.make_url("/metrics"))).text()
    assert 'callgate_calls_refused_total{reason="stream_key"} 3.0' in metrics
    assert 'callgate_calls_refused_total{reason="token"} 1.0' in metrics


async def _speaking_worker(text_ms: int, ready: asyncio.Event) -> dict[str, Any]:
    """A minimal worker on the embedded bus: says one utterance when the call starts."""
    seen: dict[str, Any] = {"types": []}
    audio = b"\xff" * (8 * text_ms)

    async def react(sid: str, event: Event) -> None:
        seen["types"].append(event["type"])
        if event["type"] == "call_started":
            await say(bus, sid, {"payload": base64.b64encode(audio).decode()})

    async with EmbeddedBus() as bus:
        ready.set()
        await serve(bus, "w1", react)
    return seen


async def test_a_whole_call_over_the_websocket(server: Any) -> None:
    """`callgate call`'s client plays a recording as Twilio would; the bot's audio comes back
    paced, its marks are echoed, and DTMF reaches the worker."""
    srv, gw = server
    token = await _token(srv)
    ready = asyncio.Event()
    worker = asyncio.create_task(_speaking_worker(1000, ready))
    await ready.wait()
    # The stream URL of the TwiML, as Twilio opens it: the token in its path, signed over it.
    report = await play_call(rec.source("dtmf_pin_after_prompt"),
                             str(srv.make_url(f"/twilio/media/{token}")), token=token, speed=20.0,
                             headers={"X-Twilio-Signature": sign(f"{MEDIA_URL}/{token}", {})},
                             call_sid=CALL_SID)
    seen = await asyncio.wait_for(worker, 10)
    assert report.stats.audio_bytes == 8000  # the whole utterance, 1 s of mu-law
    chunks = 1000 // CallSettings().chunk_ms  # one media message and one mark per chunk
    assert report.stats.media_messages == chunks
    assert report.stats.marks_received == chunks
    assert report.stats.marks_echoed == chunks
    assert report.stats.clears == 0
    assert seen["types"][0] == "call_started"
    assert "".join(t for t in seen["types"] if t == "dtmf") == "dtmf" * 5
    assert seen["types"][-1] == "call_ended"
    done = gw.completed[-1]
    assert done["call_sid"] == CALL_SID
    assert done["dtmf"] == "4729#"
    assert done["frames_skipped"] == 0


async def test_healthz_and_readyz(server: Any) -> None:
    srv, gw = server
    async with aiohttp.ClientSession() as http:
        assert (await http.get(srv.make_url("/healthz"))).status == 200
        assert (await http.get(srv.make_url("/readyz"))).status == 200
        gw.draining = True
        assert (await http.get(srv.make_url("/readyz"))).status == 503


class _BrokenDownlinkBus(EmbeddedBus):
    """A bus whose downlink fails as soon as it is read (a bus bug, a poisoned stream)."""

    async def downlink(self, call_sid: str) -> AsyncIterator[Any]:  # type: ignore[override]
        raise RuntimeError("the downlink broke")
        yield  # an async generator, as the real one


async def test_a_failed_downlink_ends_the_call_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """Not a mute bot on a live call with nothing logged: the socket is closed (1011) and the
    call ends."""
    settings = GatewaySettings(public_url=PUBLIC, auth_token=AUTH, validate_signatures=True,
                               agent_for_number=lambda to: "default")
    app = build_app(settings, bus=_BrokenDownlinkBus(), vad=VadEngine())
    async with TestServer(app) as srv:
        gw = app[GATEWAY_KEY]
        token = await _token(srv)
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(srv.make_url("/twilio/media"),
                                       headers={"X-Twilio-Signature": sign(MEDIA_URL, {})})
            await ws.send_str('{"event":"connected","protocol":"Call","version":"1.0.0"}')
            await ws.send_str(_start(CALL_SID, token))
            async with asyncio.timeout(10):
                while (await ws.receive()).type is not aiohttp.WSMsgType.CLOSE:
                    pass
            assert ws.close_code == 1011
        await _until(lambda: gw.calls == {})
    assert any("downlink failed" in r.getMessage() and CALL_SID in r.getMessage()
               for r in caplog.records)
