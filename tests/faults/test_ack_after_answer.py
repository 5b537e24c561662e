"""A worker killed between handling a key press and writing its answer (issue 13), from outside:
a real redis-server, two real `callgate worker` processes, SIGKILL, and a text to speech server
(the OpenAI protocol on loopback) that holds its answers until the test lets them go.

The key press's answer is an utterance: ``utterance_start`` goes out at once, its audio only once
text to speech has answered. The owner is killed while it waits for that audio. The key press
must still be unacked then (it was acked as soon as the node had handled it, and the answer was
lost: the next owner saw it done), so the next owner answers it; its re-sent ``utterance_start``
carries the same ``eid`` as the dead owner's, and the gateway's downlink drops the copy: the
caller gets the answer exactly once, whole."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from redis.asyncio import Redis

from bus import CallInfo, Event, RedisBus
from tests.redis_server import RedisServer

from ._speech import HeldSpeech, dtmf_echo_config
from .conftest import Processes, eventually

SID = "CA00000000000000000000000000000113"


async def _raw_starts(raw: Redis) -> list[str]:
    """The ``utterance_start`` texts on the call's downlink stream, every copy."""
    out = []
    for _, fields in await raw.xrange(f"cg:{{{SID}}}:down"):
        event = json.loads(fields[b"e"]) if b"e" in fields else {}
        if event.get("type") == "utterance_start":
            out.append(event.get("text", ""))
    return out


@dataclass
class _Call:
    """One call of a test: the gateway's bus, the owner w1 (w2 up beside it), what the gateway's
    downlink played (copies dropped by eid) and the speech server."""

    gw: RedisBus
    w1: subprocess.Popen[bytes]
    tts: HeldSpeech
    heard: list[Event] = field(default_factory=list)
    follower: asyncio.Task[None] | None = None


@contextlib.asynccontextmanager
async def _call_on_w1(redis_server: RedisServer, processes: Processes, tmp_path: Path,
                      raw: Redis) -> AsyncIterator[_Call]:
    """A call started and owned by w1, with w2 up to take it over."""
    async with HeldSpeech() as tts:
        config = tmp_path / "agents.yaml"
        config.write_text(dtmf_echo_config(tts.base_url))
        env = {"CG_TEST_TTS_KEY": "test-key"}
        worker = ("--log-level", "INFO", "worker", "--redis", redis_server.url,
                  "--config", str(config))
        async with RedisBus(redis_server.url, bus_id="gw") as gw:
            w1 = processes.start("w1", *worker, "--worker-id", "w1", env=env)
            await eventually(lambda: raw.exists("cg:worker:w1"), 60, "w1 up")
            await gw.open_call(CallInfo(SID, agent="dtmf"))
            call = _Call(gw, w1, tts)

            async def follow() -> None:
                async for message in gw.downlink(SID):
                    call.heard.append(message.event)

            call.follower = asyncio.create_task(follow())
            await gw.publish(SID, {"type": "call_started", "agent": "dtmf", "t_ms": 0})
            await eventually(lambda: _owner_is(raw, b"w1"), 20, "w1 owning the call")
            processes.start("w2", *worker, "--worker-id", "w2", env=env)
            await eventually(lambda: raw.exists("cg:worker:w2"), 60, "w2 up")
            yield call

async def _kill_w1(call: _Call, raw: Redis) -> None:
    """SIGKILL w1 (inside the window the test waited for), let the speech server answer, and
    wait for w2 to own the call."""
    os.killpg(call.w1.pid, signal.SIGKILL)
    call.w1.wait(10)
    call.tts.released.set()
    await eventually(lambda: _owner_is(raw, b"w2"), 20, "w2 taking the call over")


async def _end(call: _Call, raw: Redis, answers: list[str], t_ms: int) -> None:
    """End the call once the ``answers`` were heard whole and every uplink message acked."""
    await eventually(lambda: _whole(call.heard) == answers, 20, f"{answers} heard whole")
    await eventually(lambda: _all_acked(raw), 20, "every uplink message acked")
    await call.gw.publish(SID, {"type": "call_ended", "reason": "stop", "t_ms": t_ms})
    await call.gw.close_call(SID)
    assert call.follower is not None
    await asyncio.wait_for(call.follower, 20)


@pytest.mark.redis
async def test_a_key_press_whose_answer_was_half_written_is_answered_once(
    redis_server: RedisServer, processes: Processes, tmp_path: Path
) -> None:
    raw = Redis.from_url(redis_server.url)
    try:
        async with _call_on_w1(redis_server, processes, tmp_path, raw) as call:
            await call.gw.publish(SID, {"type": "dtmf", "digit": "1", "t_ms": 1000})

            async def half_written() -> bool:
                return ("You pressed 1" in call.tts.asked
                        and await _raw_starts(raw) == ["You pressed 1"])

            await eventually(half_written, 20, "w1 started the answer, waiting for its audio")
            await _kill_w1(call, raw)  # inside the window: started, audio pending
            await eventually(lambda: _whole(call.heard) == ["You pressed 1"], 20,
                             "the answer to 1 heard whole")
            await call.gw.publish(SID, {"type": "dtmf", "digit": "2", "t_ms": 2000})
            await _end(call, raw, ["You pressed 1", "You pressed 2"], 3000)
    finally:
        await raw.aclose()

    # The dead owner's utterance_start and the new owner's copy of it are both on the stream;
    # the gateway heard one: the same utterance, the same eid.
    heard = call.heard
    starts = [e for e in heard if e["type"] == "utterance_start"]
    assert [e["text"] for e in starts] == ["You pressed 1", "You pressed 2"]
    assert call.tts.asked.count("You pressed 1") == 2  # by the dead owner, then by the new one
    assert [e["type"] for e in heard if e.get("utterance_id") == starts[0]["utterance_id"]][-1] \
        == "utterance_end"
    assert "session stopped here" not in processes.log("w2")


def _whole(heard: list[Event]) -> list[str]:
    """Utterances heard from start to end with audio in between, by their text."""
    started: set[str] = set()
    audio: dict[str, int] = {}
    done = []
    for e in heard:
        uid = e.get("utterance_id", "")
        if e["type"] == "utterance_start":
            started.add(uid)
        elif e["type"] == "audio":
            audio[uid] = audio.get(uid, 0) + 1
        elif e["type"] == "utterance_end" and uid in started and audio.get(uid):
            done.append(e.get("text", ""))
    return done


async def _owner_is(raw: Redis, worker: bytes) -> bool:
    return await raw.get(f"cg:{{{SID}}}:owner") == worker


async def _all_acked(raw: Redis) -> bool:
    summary = await raw.xpending(f"cg:{{{SID}}}:up", "workers")
    return int(summary["pending"]) == 0


@pytest.mark.redis
async def test_a_turn_whose_answer_was_half_written_is_answered_once(
    redis_server: RedisServer, processes: Processes, tmp_path: Path
) -> None:
    """The same for the caller's turn: its user message was in the context (and saved) when
    the owner died with the answer half-written; the next owner answers it once, without
    adding the user message again."""
    raw = Redis.from_url(redis_server.url)
    try:
        async with _call_on_w1(redis_server, processes, tmp_path, raw) as call:
            await call.gw.publish(SID, {"type": "transcript", "text": "hello", "final": True,
                                        "t_ms": 1000})

            async def half_written() -> bool:
                saved = await _saved_messages(raw)
                return ("Press a key." in call.tts.asked and await _raw_count(raw) == 1
                        and saved[:1] == [{"role": "user", "content": "hello"}])

            await eventually(half_written, 20, "w1 saved the turn and started its answer")
            await _kill_w1(call, raw)
            await _end(call, raw, ["Press a key."], 3000)
            saved = await _saved_messages(raw)
    finally:
        await raw.aclose()

    heard = call.heard
    assert [e["type"] for e in heard].count("utterance_start") == 1
    assert call.tts.asked.count("Press a key.") == 2
    assert saved == [{"role": "user", "content": "hello"},
                     {"role": "assistant", "content": "Press a key."}]


async def _raw_count(raw: Redis) -> int:
    """``utterance_start`` entries on the downlink stream, every copy."""
    n = 0
    for _, fields in await raw.xrange(f"cg:{{{SID}}}:down"):
        if b"e" in fields and json.loads(fields[b"e"]).get("type") == "utterance_start":
            n += 1
    return n


async def _saved_messages(raw: Redis) -> list[dict[str, str]]:
    ctx = await raw.hget(f"cg:{{{SID}}}:ctx", "ctx")
    return list(json.loads(ctx)["nodes"]["echo"]) if ctx else []
