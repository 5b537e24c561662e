"""The worker's side of ``bus.protocol``: an uplink event that does not decode is logged with
the field at fault and skipped, and the call goes on."""

from __future__ import annotations

import logging

import pytest

from bus import Bus
from bus import protocol as bp

from ..openai_server import OpenAIServer, Text
from . import test_seed_snippets as seed
from .conftest import open_line, setup_with
from .test_worker_functional import Worker, seed_llm  # noqa: F401 (the fixture)

pytestmark = pytest.mark.usefixtures("seed_llm")


async def test_undecodable_uplink_events_are_logged_and_skipped(
    bus: Bus, openai_server: OpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="nodes._worker")

    openai_server.respond(Text("Hello there."))
    async with Worker(bus, setup_with(seed.MyAgent)) as worker:
        line = await open_line(bus, "CA7100")
        await line.publish({"type": "interrupt", "utterance_id": "u", "heard_ms": "soon"})
        await line.publish({**bp.encode(bp.Transcript(text="from a newer fleet")), "v": "2.0"})
        await line.publish(bp.encode(bp.SpeechStarted(t_ms=10.0)) | {"words": 3, "v": "1.4"})
        await line.publish(bp.encode(bp.Transcript(text="Hello", t_ms=20.0)))
        start = await line.next("utterance_start")
        await line.next("utterance_end", utterance_id=start["utterance_id"])
        await line.end(worker)
    # Only the valid transcript reached the agent (the 1.4 event is valid: a minor version).
    assert len(openai_server.requests) == 1
    users = [m["content"] for m in openai_server.requests[0].body["messages"]
             if m["role"] == "user"]
    assert users == ["Hello"]
    skipped = [m for m in caplog.messages if "uplink event skipped" in m]
    assert len(skipped) == 2, caplog.messages
    assert "interrupt.heard_ms must be a number, got a string" in skipped[0]
    assert "version 2.0" in skipped[1] and "speaks 1.2" in skipped[1]
