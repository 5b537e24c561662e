"""The seed's snippets, verbatim, as YAML-declared nodes in replayed calls.

Each agent below is a ``kind: python`` node of a YAML config naming a seed class; ``run_worker``
runs it behind the gateway replaying ``turn_gap_then_barge_in`` (the caller answers in a gap,
pocketsphinx transcribes it, the node answers at length through the local OpenAI-compatible
server, and the caller talks over that answer at 8.4 s). The YAML gives the node what the seed's
code uses: ``self.llm`` (the agent's ``llm``), ``self.tool_registry`` and ``self.tool_schemas``
(``tools``: Python functions by ``module:function``, schema from signature and docstring). The
seed's ``MyAgent`` and ``PaymentAgent`` define no ``generate_response``: they answer with that LLM.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bus import Bus
from config import ConfigHolder, parse_config
from gateway.replay import replay
from nodes import ToneSynthesizer, check_agents, run_worker
from speech import make_transcriber
from tests import recordings_index as rec
from tests.common import uninterruptible_utterance
from tests.openai_server import OpenAIServer, Text, ToolCallStep

from . import seed_first
from .test_seed_snippets import SEED

MS_PER_CHAR = 40
PROMPT = "You are the shop's phone assistant."
REPLY = (
    "Thanks, I have found your order. It left our warehouse this morning and should reach you "
    "within two business days. You will get a text message with the tracking link."
)
HERE = "tests.nodes.test_seed_yaml"
TOOL_RUNS: list[str] = []


def order_status(order_id: str) -> str:
    """Where an order is.

    Args:
        order_id: The order's number, as on the receipt.
    """
    TOOL_RUNS.append(order_id)
    return f"order {order_id}: shipped"


def _yaml(server: OpenAIServer, node: str) -> str:
    return f"""
default_agent: shop
agents:
  shop:
    llm:
      provider: openai
      model: gpt-test
      base_url: "{server.base_url}"
      api_key: ${{SHOP_LLM_KEY}}
      prompt: "{PROMPT}"
    nodes:
      - {node}
"""


async def _call(tmp_path: Path, server: OpenAIServer, node: str) -> list[dict[str, Any]]:
    path = tmp_path / "agents.yaml"
    path.write_text(_yaml(server, node))
    holder = ConfigHolder(path, env={"SHOP_LLM_KEY": "test-key"})

    async def agent(bus: Bus, stop: asyncio.Event) -> None:
        await run_worker(holder, bus, worker_id="w-seed-yaml", stop=stop, drain_timeout_s=20,
                         synthesizer_factory=lambda agent: ToneSynthesizer(MS_PER_CHAR))

    transcriber = make_transcriber("pocketsphinx")
    await transcriber.warm_up(1)
    timeline, _ = await replay(rec.source("turn_gap_then_barge_in"), agent=agent,
                               transcriber_for=lambda call: transcriber)
    return timeline.events


async def _answered_call(
    tmp_path: Path, node: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The replayed call to an agent of the one ``node`` whose LLM says REPLY to every turn:
    the call's timeline events and the bodies of the LLM requests."""
    async with OpenAIServer() as server:
        for _ in range(3):
            server.respond(*_words(REPLY))
        events = await _call(tmp_path, server, node)
        requests = [r.body for r in server.requests]
    return events, requests


def _words(text: str) -> list[Text]:
    return [Text(w + " ") for w in text.split(" ")]


def _turns(events: list[dict[str, Any]]) -> list[str]:
    return [e["text"] for e in events if e["type"] == "transcript" and not e.get("dropped")
            and e["text"]]


def test_first_snippet_is_verbatim() -> None:
    if not SEED.exists():
        pytest.skip(f"seed document not found at {SEED}")
    seed_code = SEED.read_text().split("```python\n", 1)[1]
    source = Path(seed_first.__file__).read_text()
    here = source.split("# ---- seed code, verbatim ----\n", 1)[1].split("# ---- end", 1)[0]
    assert seed_code.startswith(here)


@pytest.mark.slow
async def test_my_agent_answers_with_its_yaml_llm_and_is_interruptible(tmp_path: Path) -> None:
    events, requests = await _answered_call(
        tmp_path, '{kind: python, name: my-agent, ref: "tests.nodes.seed_first:MyAgent"}')
    turns = _turns(events)
    assert turns, events
    # It answered the caller's turn with the agent's LLM: prompt, then the conversation.
    assert requests[0]["model"] == "gpt-test" and requests[0]["stream"] is True
    assert requests[0]["messages"] == [{"role": "system", "content": PROMPT},
                                       {"role": "user", "content": turns[0]}]
    started = [e for e in events if e["type"] == "bot_utterance_started"
               and e["node"] == "my-agent"]
    assert started and started[0]["interruptible"] is True  # "Default"
    barge = [e for e in events if e["type"] == "barge_in"]
    assert barge and barge[0]["utterance_id"] == started[0]["utterance_id"]
    # The caller's next turn: the LLM sees the answer cut to what the caller heard.
    assert len(requests) >= 2 and len(turns) >= 2, (requests, turns)
    said = requests[1]["messages"][2]
    assert said["role"] == "assistant"
    assert REPLY.startswith(said["content"]) and 0 < len(said["content"]) < len(REPLY)
    assert requests[1]["messages"][3] == {"role": "user", "content": turns[1]}


@pytest.mark.slow
async def test_payment_agent_answers_with_its_yaml_llm_in_full(tmp_path: Path) -> None:
    events, requests = await _answered_call(
        tmp_path, '{kind: python, name: payment-agent, ref: "tests.nodes.seed_first:PaymentAgent"}')
    turns = _turns(events)
    assert requests and requests[0]["messages"][-1] == {"role": "user", "content": turns[0]}
    # "User must hear the full message": speech over it is no barge-in, and it plays to the end.
    uid = uninterruptible_utterance(events, "payment-agent")
    finished = [e for e in events if e["type"] == "bot_utterance_finished"
                and e["utterance_id"] == uid]
    assert finished and finished[0]["text"].strip() == REPLY


@pytest.mark.slow
async def test_tool_agent_calls_its_yaml_tools_after_streaming(tmp_path: Path) -> None:
    TOOL_RUNS.clear()
    async with OpenAIServer() as server:
        server.respond(Text("Let me check that order. "),
                       ToolCallStep("call_1", "order_status", '{"order_id": "A17"}'))
        for _ in range(2):
            server.respond(*_words(REPLY))
        node = ('{kind: python, name: tools, ref: "tests.nodes.test_seed_snippets:ToolAgent", '
                f'tools: ["{HERE}:order_status"]}}')
        events = await _call(tmp_path, server, node)
        requests = [r.body for r in server.requests]
    # self.tool_schemas: the function's schema from its signature and docstring.
    (schema,) = requests[0]["tools"]
    assert schema == {
        "type": "function",
        "function": {
            "name": "order_status",
            "description": "Where an order is.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string",
                                            "description": "The order's number, as on the receipt."}},
                "required": ["order_id"],
            },
        },
    }
    said = [e for e in events if e["type"] == "bot_utterance_started" and e["node"] == "tools"]
    assert said
    # "Tool execution happens after streaming completes": self.tool_registry ran it once ...
    assert TOOL_RUNS == ["A17"]
    # ... and the next turn's request carries the call and its result (self.context).
    assert len(requests) >= 2, requests
    messages = requests[1]["messages"]
    call = next(m for m in messages if m.get("tool_calls"))
    assert call["tool_calls"][0]["function"] == {"name": "order_status",
                                                 "arguments": '{"order_id": "A17"}'}
    result = messages[messages.index(call) + 1]
    assert result == {"role": "tool", "tool_call_id": "call_1", "content": "order A17: shipped"}


def test_a_node_without_generate_response_or_llm_is_refused_at_check() -> None:
    def tone(agent: Any) -> ToneSynthesizer:
        return ToneSynthesizer(MS_PER_CHAR)

    no_llm = parse_config("""
default_agent: a
agents:
  a:
    nodes: [{kind: python, name: pay, ref: "tests.nodes.seed_first:PaymentAgent"}]
""", env={})
    (problem,) = check_agents(no_llm, synthesizer_factory=tone)
    assert problem.path == ("agents", "a", "nodes", 0, "ref")
    assert "PaymentAgent defines no generate_response" in problem.message
    with_llm = parse_config("""
default_agent: a
agents:
  a:
    nodes:
      - {kind: python, name: pay, ref: "tests.nodes.seed_first:PaymentAgent",
         llm: {provider: scripted}}
""", env={})
    assert check_agents(with_llm, synthesizer_factory=tone) == []
