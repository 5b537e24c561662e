"""Real ``callgate worker`` processes on one Redis, with the fault tests' DtmfEcho agent, and the
keys a test reads to see what they did (the gateway's side is a ``RedisBus`` in the test)."""

from __future__ import annotations

import json
from pathlib import Path

from redis.asyncio import Redis

from ._agents import DTMF_AGENTS_YAML
from .conftest import Processes, eventually

__all__ = ["ANSWER", "DTMF_CONFIG", "answers", "key", "owners", "start_workers"]

ANSWER = "You pressed "

DTMF_CONFIG = DTMF_AGENTS_YAML


def key(sid: str, part: str) -> str:
    """A call's key on a single Redis server with the default prefix."""
    return f"cg:{{{sid}}}:{part}"


async def start_workers(processes: Processes, raw: Redis, redis_url: str, tmp_path: Path,
                        worker_ids: list[str]) -> None:
    """Start the workers (drain timeout 0) and wait until each one's liveness key is there."""
    config = tmp_path / "agents.yaml"
    if not config.exists():
        config.write_text(DTMF_CONFIG)
    for wid in worker_ids:
        processes.start(wid, "--log-level", "INFO", "worker", "--redis", redis_url, "--config",
                        str(config), "--worker-id", wid, "--drain-timeout", "0")  # fmt: skip
    for wid in worker_ids:
        await eventually(lambda wid=wid: raw.exists(f"cg:worker:{wid}"), 120, f"{wid} up")


async def answers(raw: Redis, sid: str) -> str:
    """The digits answered on the call's downlink, in order, once per event id."""
    seen: set[str] = set()
    digits = []
    for _, fields in await raw.xrange(key(sid, "down")):
        event = json.loads(fields[b"e"]) if b"e" in fields else {}
        text = str(event.get("text") or "")
        if event.get("type") == "utterance_start" and text.startswith(ANSWER):
            if str(event.get("eid")) not in seen:
                seen.add(str(event.get("eid")))
                digits.append(text.removeprefix(ANSWER))
    return "".join(digits)


async def owners(raw: Redis, sids: list[str]) -> dict[str, str]:
    """Each call's owning worker ('' for none)."""
    return {sid: (await raw.get(key(sid, "owner")) or b"").decode() for sid in sids}
