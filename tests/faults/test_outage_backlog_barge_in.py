"""Key presses buffered across a Redis outage, then a barge-in (issue #13: bench.chaos lost 23 key
presses of 23,529 in session 6, every one on a call live across a Redis outage), from outside:
a real redis-server (AOF, ``appendfsync always``, as bench.chaos runs it) SIGKILLed and started
again, a real ``callgate worker``, a text to speech server (the OpenAI protocol on loopback) that
holds its answers until the test lets them go, and the gateway's side played by a ``RedisBus``
in this process (its writes are buffered while Redis is away).

After the outage the backlog lands at once: the worker starts the answer to the first key press
(its audio waits for text to speech) and the node has already answered the second, its answer
queued behind in the session's output. The caller then talks over the bot (``interrupt``).
Live, the answer to the second key would have been on the downlink by then, queued behind the
audio the caller talked over, and the barge-in would have cut it to nothing; after the outage it
was still in the worker's output, stale (the node's epoch moved on), and the worker dropped it
without a trace: nothing on the downlink, nothing logged. The caller hears the same either way;
the difference must not be silence in the records. The answer goes on the downlink as an
interrupted utterance (``utterance_start`` with its text, ``utterance_end`` with
``interrupted``, no audio) and the worker logs it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from bus import CallInfo, RedisBus
from tests.redis_server import RedisServer

from ._speech import HeldSpeech, dtmf_echo_config
from ._workers import key
from .conftest import Processes, eventually

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SID = "CA0000000000000000000000000013b1"
ANSWER = "You pressed "


async def _downlink(raw: Redis) -> list[dict[str, object]]:
    """The call's downlink events, one copy per eid (a retried write is not a second one)."""
    seen: set[str] = set()
    out = []
    for _, fields in await raw.xrange(key(SID, "down")):
        event = json.loads(fields[b"e"]) if b"e" in fields else {}
        if str(event.get("eid")) not in seen:
            seen.add(str(event.get("eid")))
            out.append(event)
    return out


def _answers(down: list[dict[str, object]]) -> str:
    """The digits answered (an ``utterance_start`` of "You pressed N"), in order."""
    return "".join(str(e.get("text") or "").removeprefix(ANSWER) for e in down
                   if e.get("type") == "utterance_start"
                   and str(e.get("text") or "").startswith(ANSWER))


def _utterance_of(down: list[dict[str, object]], digit: str) -> str:
    [uid] = [str(e["utterance_id"]) for e in down if e.get("type") == "utterance_start"
             and e.get("text") == ANSWER + digit]
    return uid


async def test_an_answer_cut_by_a_barge_in_after_an_outage_is_on_the_downlink_as_interrupted(
    make_redis_server, processes: Processes, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    server: RedisServer = make_redis_server("--appendonly", "yes", "--appendfsync", "always")
    raw = Redis.from_url(server.url, socket_timeout=5, retry=Retry(ExponentialBackoff(), 8),
                         retry_on_error=[RedisConnectionError])  # fmt: skip
    try:
        async with HeldSpeech() as tts, RedisBus(server.url, bus_id="gw") as gw:
            config = tmp_path / "agents.yaml"
            config.write_text(dtmf_echo_config(tts.base_url, dtmf_interrupts=False))
            processes.start("w1", "--log-level", "INFO", "worker", "--redis", server.url,
                            "--config", str(config), "--worker-id", "w1",
                            env={"CG_TEST_TTS_KEY": "test-key"})  # fmt: skip
            await eventually(lambda: raw.exists("cg:worker:w1"), 120, "w1 up")
            await gw.open_call(CallInfo(SID, agent="dtmf"))
            await gw.publish(SID, {"type": "call_started", "agent": "dtmf", "t_ms": 0})
            tts.released.set()
            await gw.publish(SID, {"type": "dtmf", "digit": "0", "t_ms": 1000})

            async def answered(digits: str) -> bool:
                return _answers(await _downlink(raw)) == digits

            async def zero_whole() -> bool:  # its audio out: text to speech is idle
                down = await _downlink(raw)
                if _answers(down) != "0":
                    return False
                uid = _utterance_of(down, "0")
                return any(e.get("type") == "utterance_end" and e["utterance_id"] == uid
                           for e in down)

            await eventually(zero_whole, 60, "the answer to 0, whole")
            playing = _utterance_of(await _downlink(raw), "0")

            tts.released.clear()  # text to speech slow from here: the worker's output backs up
            server.kill()
            for t_ms, digit in ((2000, "1"), (2500, "2")):  # buffered by the gateway's bus
                await gw.publish(SID, {"type": "dtmf", "digit": digit, "t_ms": t_ms})
            await asyncio.to_thread(server.start)

            async def backlog_in_the_worker() -> bool:
                # The answer to 1 started (its audio awaits text to speech); the node has long
                # answered 2 by then (one loop pass after 1), that answer queued behind it.
                return (await answered("01")) and ANSWER + "1" in tts.asked

            await eventually(backlog_in_the_worker, 60, "the backlog in the worker")
            # The caller talks over "You pressed 0", still in Twilio's buffer: the answers
            # queued behind it are cut (heard nothing), as they would have been live.
            await gw.publish(SID, {"type": "interrupt", "utterance_id": playing,
                                   "heard_ms": 50.0, "t_ms": 3000})
            await gw.flush()

            [(interrupt_id, _)] = await raw.xrevrange(key(SID, "up"), count=1)

            async def interrupt_handled() -> bool:  # delivered and acked (answers still held)
                [group] = await raw.xinfo_groups(key(SID, "up"))
                if group["last-delivered-id"] != interrupt_id:
                    return False
                pending = await raw.xpending_range(key(SID, "up"), "workers", "-", "+", 100)
                return interrupt_id not in [p["message_id"] for p in pending]

            await eventually(interrupt_handled, 30, "the interrupt handled")
            tts.released.set()
            await gw.publish(SID, {"type": "dtmf", "digit": "3", "t_ms": 4000})

            async def three_answered() -> bool:
                return _answers(await _downlink(raw)).endswith("3")

            await eventually(three_answered, 30, "the answer to 3")
            await gw.publish(SID, {"type": "call_ended", "reason": "stop", "t_ms": 5000})
            await gw.close_call(SID)
            down = await _downlink(raw)
    finally:
        await raw.aclose()

    # Every key press is on the downlink exactly once, in order: the worker handled each one.
    assert _answers(down) == "0123", "an answer dropped without a trace"
    two = _utterance_of(down, "2")
    [end] = [e for e in down if e.get("type") == "utterance_end" and e["utterance_id"] == two]
    assert end["interrupted"] is True
    assert not [e for e in down if e.get("type") == "audio" and e["utterance_id"] == two]
    assert "cut by a barge-in before it played" in processes.log("w1")

