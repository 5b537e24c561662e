from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.replay import load_bot_script, replay
from tests import recordings_index as rec
from vad import VadEngine


def _script(name: str, non_interruptible: bool) -> list[Any]:
    labels = rec.labels(name)
    labels["bot_wav"] = str(rec.RECORDINGS / labels["bot_wav"])
    if non_interruptible:
        for turn in labels["bot_turns"]:
            turn["interruptible"] = False
    return load_bot_script(labels)


async def _replay_all(non_interruptible: bool) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    async with VadEngine(runtime="onnx") as engine:
        for name in rec.names():
            timeline, _ = await replay(rec.source(name), bot_script=_script(name, non_interruptible),
                                       vad=engine)
            out[name] = timeline.events
    return out


@pytest.fixture(scope="session")
def replayed() -> dict[str, list[dict[str, Any]]]:
    """Timelines of every recording replayed with its labelled bot turns (interruptible)."""
    return asyncio.run(_replay_all(False))


@pytest.fixture(scope="session")
def replayed_non_interruptible() -> dict[str, list[dict[str, Any]]]:
    """The same with every bot turn marked ``interruptible: false``."""
    return asyncio.run(_replay_all(True))
