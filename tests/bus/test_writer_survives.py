"""The Redis bus has one writer task; a write that cannot even be sent (a command the client
cannot pack: not a connection error) used to end it, after which every ack, save and downlink
write queued forever while the calls seemed to go on. Now the bad op is found (the batch is
written one op at a time), dropped alone with an error line, and the writer goes on."""

from __future__ import annotations

import json
import logging

import pytest
from redis.asyncio import Redis

from bus import CallInfo
from bus._retry import Op
from tests.redis_server import RedisServer

from .test_fencing import _bus

pytestmark = pytest.mark.redis


async def test_one_unsendable_write_is_dropped_alone_and_the_writer_goes_on(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    gw = _bus(redis_server, "gw")
    raw = Redis.from_url(redis_server.url)
    async with gw:
        try:
            await gw.open_call(CallInfo("CA1"))
            await gw.publish("CA1", {"type": "dtmf", "digit": "1"})
            with caplog.at_level(logging.ERROR, logger="callgate.bus"):
                # The client refuses to pack None (redis-py's DataError), before any I/O.
                gw._enqueue(Op("publish", "CA1", [("XADD", "cgf:{CA1}:up", "*", "e", None)]))
                await gw.publish("CA1", {"type": "dtmf", "digit": "2"})
                await gw.publish("CA1", {"type": "dtmf", "digit": "3"})
                assert await gw.flush(10)
            entries = await raw.xrange("cgf:{CA1}:up")
            digits = [json.loads(f[b"e"])["digit"] for _, f in entries if b"e" in f]
            assert digits == ["1", "2", "3"]  # before and after the bad one, in order
            assert gw._writer is not None and not gw._writer.done()
            dropped = [r for r in caplog.records if "could not be sent" in r.getMessage()]
            assert len(dropped) == 1 and "CA1" in dropped[0].getMessage()
        finally:
            await raw.aclose()
