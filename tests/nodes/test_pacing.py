"""The worker pulls a response's next chunk only when the caller is about to hear the last one.

A fake gateway (the test) reports ``playback {state: playing, heard_ms}`` by hand; the node notes,
each time its generator runs on, which reports had been sent by then.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bus import Bus
from nodes import AgentSession, OutputAgentNode, SessionWorker, ToneSynthesizer

from .conftest import Line, open_line, running

MS_PER_CHAR = 10
CHUNK = "x" * 30 + " "  # 310 ms of audio
LOOKAHEAD_MS = 100.0


class Counter(OutputAgentNode):
    def __init__(self, reported: list[float]) -> None:
        super().__init__(name="counter")
        self.reported = reported
        self.pulled_at: list[list[float]] = []

    async def generate_response(self) -> AsyncIterator[str]:
        for _ in range(3):
            self.pulled_at.append(list(self.reported))
            yield CHUNK
        self.pulled_at.append(list(self.reported))


@contextlib.asynccontextmanager
async def counting(
    bus: Bus, **options: Any
) -> AsyncIterator[tuple[SessionWorker, list[Counter], list[float]]]:
    """A worker whose every call is one ``Counter``: yields it, the counters made and the list
    of ``heard_ms`` reports the test sent (which the counters read)."""
    reported: list[float] = []
    nodes: list[Counter] = []

    async def setup(session: AgentSession) -> None:
        node = Counter(reported)
        nodes.append(node)
        session.add_node(node)
        await session.start()
        await session.wait_until_complete()

    async with running(bus, lambda call: setup, **options) as worker:
        yield worker, nodes, reported


async def _audio_until(line: Line, uid: str, audio_ms: float) -> None:
    while True:
        event = await line.next("audio", utterance_id=uid)
        if event["audio_ms"] >= audio_ms:
            return


async def test_next_chunk_waits_for_the_caller_to_be_within_the_lookahead(bus: Bus) -> None:
    async with counting(bus, worker_id="w-pace", synthesizer=ToneSynthesizer(MS_PER_CHAR),
                        lookahead_ms=LOOKAHEAD_MS) as (worker, nodes, reported):
        line = await open_line(bus, "CA7001")
        await line.publish({"type": "call_started"})
        await line.publish({"type": "transcript", "text": "tell me", "final": True})
        start = await line.next("utterance_start")
        uid = start["utterance_id"]
        chunk_ms = len(CHUNK) * MS_PER_CHAR

        async def heard(ms: float) -> None:
            reported.append(ms)
            await line.publish({"type": "playback", "state": "playing", "utterance_id": uid,
                                "heard_ms": ms})

        await _audio_until(line, uid, chunk_ms)
        # 310 ms sent, 150 heard: 160 ms ahead, more than the lookahead; 220 heard: 90 ms.
        await heard(150.0)
        await heard(chunk_ms - 90)
        await _audio_until(line, uid, 2 * chunk_ms)
        await heard(2 * chunk_ms - LOOKAHEAD_MS)  # exactly the lookahead
        await _audio_until(line, uid, 3 * chunk_ms)
        await heard(3 * chunk_ms - 10)
        end = await line.next("utterance_end", utterance_id=uid)
        assert end["interrupted"] is False and end["text"] == CHUNK * 3
        (node,) = nodes
        assert node.pulled_at == [
            [],
            [150.0, chunk_ms - 90],
            [150.0, chunk_ms - 90, 2 * chunk_ms - LOOKAHEAD_MS],
            [150.0, chunk_ms - 90, 2 * chunk_ms - LOOKAHEAD_MS, 3 * chunk_ms - 10],
        ]
        await line.end(worker)


async def test_without_a_lookahead_chunks_are_pulled_as_synthesized(bus: Bus) -> None:
    async with counting(bus, worker_id="w-nopace",
                        synthesizer=ToneSynthesizer(MS_PER_CHAR)) as (worker, nodes, _):
        line = await open_line(bus, "CA7002")
        await line.publish({"type": "transcript", "text": "tell me", "final": True})
        end = await line.next("utterance_end")
        assert end["text"] == CHUNK * 3  # no playback report was needed
        assert nodes[0].pulled_at == [[], [], [], []]
        await line.end(worker)


async def test_a_gateway_that_reports_nothing_stalls_the_node_only_for_a_while(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway that never reports progress (too old, or its reports lost): each next chunk
    comes anyway, a grace after the unheard audio would have played, with a warning."""
    async with counting(bus, worker_id="w-stall", synthesizer=ToneSynthesizer(1),
                        lookahead_ms=0.0) as (worker, _, _):
        line = await open_line(bus, "CA7003")
        await line.publish({"type": "transcript", "text": "tell me", "final": True})
        end = await line.next("utterance_end")
        assert end["text"] == CHUNK * 3
        stalls = [m for m in caplog.messages if "no playback progress from the gateway" in m]
        assert len(stalls) == 3  # before chunks 2 and 3, and before the generator's end
        await line.end(worker)
