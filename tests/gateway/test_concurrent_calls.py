"""50 calls at once through one VAD engine decide exactly as each call does alone."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.replay import replay
from tests import recordings_index as rec
from tests.gateway.conftest import _script
from vad import VadEngine

N_CALLS = 50


async def _together() -> tuple[list[list[dict[str, Any]]], Any]:
    names = [rec.names()[i % 24] for i in range(N_CALLS)]
    async with VadEngine(runtime="onnx", max_batch=128, max_wait_ms=2.0) as engine:
        results = await asyncio.gather(*[
            replay(rec.source(n), bot_script=_script(n, False), vad=engine) for n in names
        ])
        stats = engine.stats
    return [timeline.events for timeline, _ in results], (names, stats)


def test_fifty_calls_batched_decide_as_alone(replayed: dict[str, list[dict[str, Any]]]) -> None:
    timelines, (names, stats) = asyncio.run(_together())
    assert stats.batches < stats.windows / 5  # the windows really were batched
    for name, events in zip(names, timelines, strict=True):
        solo = [e for e in replayed[name] if e["type"] != "call_started"]
        together = [e for e in events if e["type"] != "call_started"]
        assert together == solo, name
