"""Protocol 1.1's binary audio: ``Audio.payload`` crosses the bus as bytes, not base64 in JSON.

Every record packs to (JSON text, bytes fields) and back; on Redis the payload is its own stream
field holding the raw bytes; protocol 1.0's entries (base64 inside the JSON) still read; and a
1.0 reader refuses a 1.1 audio entry with a clear error (the documented rule of
``bus.protocol``), while it reads every other 1.1 event."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from bus import CallInfo, EventDecodeError, RedisBus
from bus import protocol as bp
from tests.redis_server import RedisServer

from .conftest import FAST_REDIS, eventually
from .test_contract import take
from .test_protocol import RECORDS, records

AUDIO = bp.Audio(utterance_id="u1", payload=bytes(range(256)) * 7, text="Hi", text_start=0,
                 text_end=2, audio_ms=224.0, duration_ms=224.0)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_event_round_trips_through_pack(cls: type, data: st.DataObject) -> None:
    event = data.draw(records(cls))
    text, binaries = bp.pack(bp.encode(event, eid="g-1"))
    stored = json.loads(text)
    assert stored["v"] == "1.2" and stored["eid"] == "g-1"
    if isinstance(event, bp.Audio):  # the payload beside the text, as it is
        assert binaries == (("payload", event.payload),) and "payload" not in stored
    else:
        assert binaries == ()
    assert bp.decode(bp.unpack(text, binaries)) == event
    assert bp.decode(bp.unpack(text.encode(), binaries)) == event  # as Redis returns it


def test_pack_refuses_what_json_cannot_carry() -> None:
    with pytest.raises(TypeError):
        bp.pack({"type": "x", "nested": {"payload": b"\x00"}})  # only top-level bytes travel
    with pytest.raises(ValueError):
        bp.pack({"type": "x", "n": float("nan")})


def _bus(server: RedisServer, name: str) -> RedisBus:
    return RedisBus(server.url, prefix="cgb", bus_id=name, **FAST_REDIS)


async def _entries(raw: Redis, sid: str, part: str) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in await raw.xrange(f"cgb:{{{sid}}}:{part}") if b"c" not in fields]


@pytest.mark.redis
async def test_redis_stores_the_payload_as_raw_bytes_fenced_or_not(redis_server: RedisServer) -> None:
    """A worker's audio, sent under its lease (the fenced Lua write) and without one (a tool's
    plain XADD), is stored as ``e`` (JSON, no payload) plus ``b:payload`` (the bytes); the
    gateway's downlink reads both back to the record."""
    gw, wk, tool = _bus(redis_server, "gw"), _bus(redis_server, "wk"), _bus(redis_server, "tool")
    raw = Redis.from_url(redis_server.url)

    async def worker() -> None:
        async for call in wk.claim_calls("w1"):
            async for msg in wk.uplink(call.call_sid, "w1"):
                await wk.send(call.call_sid, bp.encode(AUDIO, eid="wk-audio"))
                await wk.ack(call.call_sid, msg.id)

    async with gw, wk, tool:
        task = asyncio.create_task(worker())
        try:
            await gw.open_call(CallInfo("CA1"))
            await gw.publish("CA1", bp.encode(bp.Dtmf(digit="1")))
            await eventually(lambda: _count(raw, "CA1", "down", 1), 10, "the worker's audio stored")
            assert "CA1" in wk._owned  # it went through the fenced write
            await tool.send("CA1", bp.encode(AUDIO, eid="tool-audio"))  # not the owner: plain
            assert await tool.flush(5)
            stored = await _entries(raw, "CA1", "down")
            assert [json.loads(f[b"e"])["eid"] for f in stored] == ["wk-audio", "tool-audio"]
            for fields in stored:
                assert set(fields) == {b"e", b"b:payload"}
                assert fields[b"b:payload"] == AUDIO.payload
                assert "payload" not in json.loads(fields[b"e"])
            got = await take(gw.downlink("CA1"), 2)
            assert [bp.decode_downlink(m.event) for m in got] == [AUDIO, AUDIO]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await raw.aclose()


async def _count(raw: Redis, sid: str, part: str, n: int) -> bool:
    return len(await _entries(raw, sid, part)) >= n


@pytest.mark.redis
async def test_protocol_1_0_entries_still_read(redis_server: RedisServer) -> None:
    """A 1.0 worker's audio entry (one field ``e``, the payload base64 inside it) reads as the
    record on a 1.1 gateway."""
    gw = _bus(redis_server, "gw")
    raw = Redis.from_url(redis_server.url)
    old = {**bp.encode(AUDIO, text=True), "v": "1.0", "eid": "old-1"}
    async with gw:
        try:
            await gw.open_call(CallInfo("CA2"))
            await raw.xadd("cgb:{CA2}:down", {"e": json.dumps(old)})
            [msg] = await take(gw.downlink("CA2"), 1)
            assert bp.decode_downlink(msg.event) == AUDIO
        finally:
            await raw.aclose()


def _read_like_1_0(fields: dict[bytes, bytes]) -> Any:
    """What a 1.0 RedisBus and decoder make of an entry: the JSON of field ``e`` only (1.0 reads
    no other field), decoded with ``payload`` required, as in 1.0 (and 1.1)."""
    return bp.decode(json.loads(fields[b"e"]))


@pytest.mark.redis
async def test_a_1_0_reader_refuses_1_1_audio_clearly_and_reads_the_rest(
        redis_server: RedisServer) -> None:
    gw = _bus(redis_server, "gw")
    raw = Redis.from_url(redis_server.url)
    async with gw:
        try:
            await gw.open_call(CallInfo("CA3"))
            start = bp.UtteranceStart(utterance_id="u1", text="Hi")
            for event in (start, AUDIO, bp.UtteranceEnd(utterance_id="u1")):
                await gw.send("CA3", bp.encode(event))
            assert await gw.flush(5)
            stored = await _entries(raw, "CA3", "down")
            assert len(stored) == 3
            assert _read_like_1_0(stored[0]) == start
            with pytest.raises(EventDecodeError, match="audio.payload is missing") as info:
                _read_like_1_0(stored[1])
            assert info.value.field == "audio.payload"
            assert _read_like_1_0(stored[2]) == bp.UtteranceEnd(utterance_id="u1")
            # ... and the bytes it would have needed are the record's, unencoded.
            assert stored[1][b"b:payload"] == AUDIO.payload != base64.b64encode(AUDIO.payload)
        finally:
            await raw.aclose()
