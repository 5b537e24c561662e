"""The worker process entry: ``run_worker`` until ``stop`` (draining or handing calls back), and
``synthesizer_for`` (the agent's TTS from the speech package, test tones without it).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import types
from typing import Any

import pytest

from config import DEFAULT_CONFIG, AgentConfig, ConfigHolder, parse_config
from nodes import (
    ConfiguredLLMNode,
    SessionWorker,
    Synthesizer,
    ToneSynthesizer,
    agent_factory_from_config,
    run_worker,
    synthesizer_for,
)

from .conftest import BusFactory, Line, guard, open_line

MS_PER_CHAR = 3


@pytest.fixture
def holder() -> ConfigHolder:
    return ConfigHolder(DEFAULT_CONFIG, env={})


class Synths:
    """A synthesizer factory that records the agents it was asked for."""

    def __init__(self) -> None:
        self.agents: list[str] = []

    def __call__(self, agent: AgentConfig) -> Synthesizer:
        self.agents.append(agent.name)
        return ToneSynthesizer(MS_PER_CHAR)


async def reply_to(line: Line, text: str) -> str:
    await line.publish({"type": "transcript", "text": text, "final": True})
    start = await line.next("utterance_start")
    end = await line.next("utterance_end", utterance_id=start["utterance_id"])
    return str(end["text"])


async def test_stop_lets_calls_in_progress_finish(
    make_bus: BusFactory, holder: ConfigHolder
) -> None:
    gateway, worker_bus = make_bus(), make_bus()
    synths, stop = Synths(), asyncio.Event()
    task = asyncio.create_task(
        run_worker(holder, worker_bus, worker_id="w-drain", synthesizer_factory=synths,
                   stop=stop, drain_timeout_s=None)  # fmt: skip
    )
    line = await open_line(gateway, "CA4001", agent="support")
    await line.publish({"type": "call_started"})
    greeting = await line.next("utterance_start")
    await line.next("utterance_end", utterance_id=greeting["utterance_id"])
    support = holder.current.agents["support"]
    assert greeting["text"] == support.greeting
    # the worker speaks with the default agent's TTS
    assert synths.agents == ["support"]
    audio = [e for e in line.of("audio") if e["utterance_id"] == greeting["utterance_id"]]
    assert sum(e["duration_ms"] for e in audio) == len(support.greeting or "") * MS_PER_CHAR

    stop.set()
    # the call goes on while the worker drains ...
    assert await reply_to(line, "what do I owe") == support.script[0].reply
    assert not task.done()
    # ... and run_worker returns once it has ended
    await line.publish({"type": "call_ended"})
    await guard(task)
    await gateway.close_call("CA4001")


async def test_stop_hands_unfinished_calls_to_another_worker(
    make_bus: BusFactory, holder: ConfigHolder
) -> None:
    gateway, first_bus, second_bus = make_bus(), make_bus(), make_bus()
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_worker(holder, first_bus, worker_id="w-first", synthesizer_factory=Synths(),
                   stop=stop, drain_timeout_s=0)  # fmt: skip
    )
    line = await open_line(gateway, "CA4002", agent="support")
    await line.publish({"type": "call_started"})
    support = holder.current.agents["support"]
    assert (await line.next("utterance_start"))["text"] == support.greeting
    assert await reply_to(line, "balance") == support.script[0].reply
    stop.set()
    await guard(task)
    await first_bus.aclose()  # hands the call back to the pool

    second = SessionWorker(
        second_bus,
        agent_factory=agent_factory_from_config(holder),
        worker_id="w-second",
        synthesizer=ToneSynthesizer(MS_PER_CHAR),
    )
    claiming = asyncio.create_task(second.run())
    try:
        assert await reply_to(line, "I'd like to pay") == support.script[1].reply
        payment = await line.next("utterance_start")
        assert (payment["node"], payment["interruptible"]) == ("payment", False)
        # the conversation went with the call, and the greeting was not said again
        main = second.sessions["CA4002"].get_node("main")
        assert isinstance(main, ConfiguredLLMNode)
        assert [m["content"] for m in main.context.messages if m["role"] == "user"] == [
            "balance", "I'd like to pay"]  # fmt: skip
        events = await line.end(second)
        starts = [e for e in events if e["type"] == "utterance_start"]
        assert [e.get("text") for e in starts].count(support.greeting) == 1
    finally:
        claiming.cancel()
        await asyncio.wait({claiming})
        await second.aclose()


async def test_cancelling_run_worker_leaves_no_call_running(
    make_bus: BusFactory, holder: ConfigHolder
) -> None:
    gateway, worker_bus = make_bus(), make_bus()
    task = asyncio.create_task(
        run_worker(holder, worker_bus, worker_id="w-cancel", synthesizer_factory=Synths())
    )
    line = await open_line(gateway, "CA4003", agent="support")
    await line.publish({"type": "call_started"})
    await line.next("utterance_end")
    task.cancel()
    await asyncio.wait({task})
    assert task.cancelled()
    left = [t.get_name() for t in asyncio.all_tasks() if not t.done()]
    assert not [name for name in left if "CA4003" in name or name.startswith("worker:")]


# -- synthesizer_for ---------------------------------------------------------------------------

TTS_AGENTS = """
default_agent: plain
agents:
  plain:
    llm: {provider: scripted}
  fancy:
    llm: {provider: scripted}
    tts: {provider: openai, voice: alloy, model: tts-1, speed: 1.5, api_key: "${TTS_KEY}"}
  slow:
    llm: {provider: scripted}
    tts: {provider: espeak, voice: en-gb, speed: 0.8, model: unused}
  fast:
    llm: {provider: scripted}
    tts: {provider: espeak, speed: 4}
"""


@pytest.fixture
def fake_speech(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    made: list[tuple[str, dict[str, Any]]] = []

    def make_synthesizer(provider: str, **options: Any) -> Synthesizer:
        made.append((provider, options))
        return ToneSynthesizer(MS_PER_CHAR)

    module = types.ModuleType("speech")
    module.make_synthesizer = make_synthesizer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "speech", module)
    return made


def test_synthesizer_for_passes_the_options_the_yaml_sets(
    fake_speech: list[tuple[str, dict[str, Any]]], holder: ConfigHolder
) -> None:
    agents = parse_config(TTS_AGENTS, env={"TTS_KEY": "sk-tts"}).agents
    assert isinstance(synthesizer_for(agents["plain"]), ToneSynthesizer)
    for name in ("fancy", "slow", "fast"):
        synthesizer_for(agents[name])
    synthesizer_for(holder.current.agents["support"])
    assert fake_speech == [
        ("espeak", {}),
        ("openai", {"voice": "alloy", "model": "tts-1", "api_key": "sk-tts", "speed": 1.5}),
        ("espeak", {"voice": "en-gb", "rate_wpm": 132}),  # model: espeak has none
        ("espeak", {"rate_wpm": 450}),  # 4 x 165, within what eSpeak takes
        ("espeak", {"voice": "en-us"}),
    ]


@pytest.mark.parametrize("speech", [None, types.ModuleType("speech")], ids=["missing", "empty"])
def test_without_a_speech_package_the_agent_speaks_tones(
    speech: types.ModuleType | None,
    holder: ConfigHolder,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "speech", speech)  # None: the import fails
    caplog.set_level(logging.WARNING, logger="nodes._runner")
    synth = synthesizer_for(holder.current.agents["support"])
    assert type(synth) is ToneSynthesizer
    assert any("speaking test tones instead of espeak TTS" in m for m in caplog.messages)
