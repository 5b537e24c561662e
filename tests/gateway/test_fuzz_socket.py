"""Malformed and mutated Twilio frames into a live WebSocket session (hypothesis).

The server must never crash or close the call, must answer nothing, and must still process every
valid frame around the bad ones (media advances the clock, DTMF digits arrive in order).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import EmbeddedBus
from gateway import twilio_protocol as tp
from gateway.server import GATEWAY_KEY, GatewayApp, GatewaySettings, build_app
from vad import VadEngine

SID = "MZ" + "4" * 32
ACC = "AC" + "5" * 32
SENT = {"malformed": 0}
CALLS = itertools.count(1)


class LiveServer:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.gateway: GatewayApp | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        settings_ = GatewaySettings(validate_signatures=False)
        app = build_app(settings_, bus=EmbeddedBus(), vad=VadEngine())
        self.gateway = app[GATEWAY_KEY]
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(30)

    def stop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        fut.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    srv = LiveServer()
    srv.start()
    yield srv
    srv.stop()


def _is_invalid(text: str) -> bool:
    try:
        tp.parse_message(text)
    except tp.ProtocolError:
        return True
    return False


VALID_MEDIA = tp.build_media(sequence_number=3, stream_sid=SID, track="inbound", chunk=1,
                             timestamp_ms=0, payload=b"\xff" * 160)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=8,
)


@st.composite
def mutated_frame(draw: st.DrawFn) -> str:
    base = json.loads(draw(st.sampled_from([
        VALID_MEDIA,
        tp.build_dtmf(sequence_number=4, stream_sid=SID, digit="5"),
        tp.build_mark(sequence_number=5, stream_sid=SID, name="x"),
        tp.build_stop(sequence_number=6, stream_sid=SID, account_sid=ACC, call_sid="CA" + "6" * 32),
    ])))
    how = draw(st.sampled_from(["drop", "replace", "inner", "event"]))
    if how == "drop":
        base.pop(draw(st.sampled_from(sorted(base))))
    elif how == "replace":
        base[draw(st.sampled_from(sorted(base)))] = draw(json_values)
    elif how == "event":
        base["event"] = draw(st.text(max_size=12))
    else:
        inner_key = next((k for k in ("media", "dtmf", "mark", "stop") if k in base), None)
        if inner_key is None:
            base["event"] = draw(json_values)
        else:
            inner = base[inner_key]
            inner[draw(st.sampled_from(sorted(inner)))] = draw(json_values)
    return json.dumps(base)


@st.composite
def odd_payload(draw: st.DrawFn) -> str:
    payload = draw(st.one_of(
        st.text(alphabet="ABCD+/=-_!* \n", min_size=1, max_size=300),
        st.just(base64.b64encode(b"\x00" * 70_000).decode()),  # over the 64 KiB cap
        st.just(""),
    ))
    obj = json.loads(VALID_MEDIA)
    obj["media"]["payload"] = payload
    return json.dumps(obj)


malformed = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
    json_values.map(json.dumps),
    mutated_frame(),
    odd_payload(),
    st.builds(lambda e: json.dumps({"event": e, "streamSid": SID}),
              st.text(min_size=1, max_size=10)),
).filter(_is_invalid)


@st.composite
def session_plan(draw: st.DrawFn) -> list[tuple[str, str]]:
    """(kind, frame) pairs after `start`: valid media/dtmf interleaved with malformed frames."""
    n = draw(st.integers(min_value=45, max_value=70))
    plan: list[tuple[str, str]] = []
    seq, chunk = 3, 1
    for _ in range(n):
        kind = draw(st.sampled_from(["bad", "bad", "media", "dtmf", "binary"]))
        if kind == "bad":
            plan.append(("bad", draw(malformed)))
        elif kind == "binary":
            plan.append(("binary", draw(st.text(max_size=40))))
        elif kind == "media":
            plan.append(("media", tp.build_media(sequence_number=seq, stream_sid=SID,
                                                 track="inbound", chunk=chunk,
                                                 timestamp_ms=(chunk - 1) * 20,
                                                 payload=b"\xff" * 160)))
            chunk += 1
        else:
            digit = draw(st.sampled_from(list("0123456789*#")))
            plan.append(("dtmf:" + digit, tp.build_dtmf(sequence_number=seq, stream_sid=SID,
                                                        digit=digit)))
        seq += 1
    return plan


async def _play(port: int, call_sid: str, before: list[str],
                plan: list[tuple[str, str]]) -> list[str]:
    received: list[str] = []
    async with aiohttp.ClientSession() as http, http.ws_connect(
        f"http://127.0.0.1:{port}/twilio/media"
    ) as ws:
        for frame in before:
            await ws.send_str(frame)
        await ws.send_str(tp.build_connected())
        await ws.send_str(tp.build_start(stream_sid=SID, account_sid=ACC, call_sid=call_sid))
        for kind, frame in plan:
            if kind == "binary":
                await ws.send_bytes(frame.encode())
            else:
                await ws.send_str(frame)
        await ws.send_str(tp.build_stop(sequence_number=999, stream_sid=SID, account_sid=ACC,
                                        call_sid=call_sid))
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT:
                received.append(msg.data)
    return received


@settings(max_examples=32, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(before=st.lists(malformed, max_size=5), plan=session_plan())
def test_malformed_frames_never_hurt_the_call(live: LiveServer, before: list[str],
                                              plan: list[tuple[str, str]]) -> None:
    call_sid = f"CA{next(CALLS):032d}"
    received = asyncio.run(_play(live.port, call_sid, before, plan))
    assert received == []  # no bot, so nothing to answer; errors are never echoed
    gw = live.gateway
    assert gw is not None
    deadline = time.monotonic() + 10
    done: dict[str, Any] | None = None
    while done is None and time.monotonic() < deadline:
        done = next((c for c in list(gw.completed) if c["call_sid"] == call_sid), None)
        if done is None:
            time.sleep(0.01)  # polling the server thread's record, bounded by the deadline
    assert done is not None, "the call was not recorded as ended"
    media = sum(1 for k, _ in plan if k == "media")
    digits = "".join(k.split(":")[1] for k, _ in plan if k.startswith("dtmf:"))
    bad_after_start = sum(1 for k, _ in plan if k == "bad")
    assert done["media_ms"] == media * 20
    assert done["dtmf"] == digits
    assert done["frames_skipped"] == len(before) + bad_after_start
    SENT["malformed"] += len(before) + bad_after_start + sum(1 for k, _ in plan if k == "binary")


def test_at_least_a_thousand_bad_frames_were_sent() -> None:
    assert SENT["malformed"] >= 1000, SENT
