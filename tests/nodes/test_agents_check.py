"""nodes.check_agents: every agent of a config is built as a call would build it, offline, and
each reason it cannot be is reported at its field (issue #13, item 8b). From the command line:
tests/config/test_check_cli.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from config import (
    DEFAULT_CONFIG,
    AgentConfig,
    ConfigError,
    ConfigProblem,
    load_config,
    parse_config,
)
from nodes import (
    AgentLoadError,
    LLMError,
    OutputAgentNode,
    ToneSynthesizer,
    check_agents,
    setup_from_config,
)

HERE = "tests.nodes.test_agents_check"


class Greeter(OutputAgentNode):
    built = 0

    def __init__(self, greeting: str = "hello") -> None:
        super().__init__(name="greeter")
        self.greeting = greeting
        Greeter.built += 1

    async def generate_response(self) -> AsyncIterator[str]:
        yield self.greeting


def config(agents: str) -> Any:
    return parse_config(f"default_agent: a\nagents:\n{agents}", env={})


def tone(agent: AgentConfig) -> ToneSynthesizer:
    return ToneSynthesizer()


def test_the_shipped_config_builds() -> None:
    assert check_agents(load_config(DEFAULT_CONFIG, env={})) == []


def test_each_node_class_is_built_with_its_args() -> None:
    before = Greeter.built
    cfg = config(f"""\
  a:
    nodes: [{{kind: python, name: g, ref: "{HERE}:Greeter", args: {{greeting: hi}}}}]
""")
    assert check_agents(cfg, synthesizer_factory=tone) == []
    assert Greeter.built == before + 1


def test_problems_carry_the_path_of_their_field() -> None:
    cfg = config(f"""\
  a:
    llm: {{provider: scripted}}
    nodes:
      - {{kind: llm, name: main}}
      - {{kind: python, name: g, ref: "{HERE}:Greeter", args: {{colour: red}}}}
      - {{kind: python, name: fn, ref: "{HERE}:setup"}}
    script: [{{keywords: [x], goto: main}}]
""")
    problems = check_agents(cfg, synthesizer_factory=tone)
    assert [p.path for p in problems] == [
        ("agents", "a", "nodes", 1, "args"),
        ("agents", "a", "nodes", 2, "ref"),
    ]
    assert all(isinstance(p, ConfigProblem) for p in problems)


def test_an_llm_that_cannot_be_made_is_a_problem_of_its_node() -> None:
    def no_llm(agent: AgentConfig, node: Any) -> Any:
        raise LLMError("no API key: pass api_key= or set OPENAI_API_KEY")

    cfg = config("""\
  a:
    llm: {provider: scripted}
    nodes: [{kind: llm, name: main}, {kind: llm, name: other}]
""")
    (problem,) = check_agents(cfg, synthesizer_factory=tone, llm_factory=no_llm)
    assert problem.path == ("agents", "a", "nodes", 0)
    assert problem.message == (
        "building it raised LLMError: no API key: pass api_key= or set OPENAI_API_KEY"
    )


def test_an_openai_agent_with_a_key_is_checked_without_a_connection() -> None:
    # Nothing listens on port 9: building the real client would not fail, calling it would.
    cfg = parse_config("""\
default_agent: a
agents:
  a:
    llm: {provider: openai, model: gpt-test, base_url: "http://127.0.0.1:9/v1",
          api_key: "${KEY}"}
""", env={"KEY": "sk-test"})  # fmt: skip
    assert check_agents(cfg, synthesizer_factory=tone) == []


def test_a_synthesizer_that_refuses_points_at_the_tts_field_it_names() -> None:
    def refuse(agent: AgentConfig) -> Any:
        raise ValueError(f"speed {agent.tts.speed} is too fast for this voice")

    cfg = config("""\
  a:
    llm: {provider: scripted}
    tts: {provider: espeak, speed: 3.5}
""")
    (problem,) = check_agents(cfg, synthesizer_factory=refuse)
    assert problem.path == ("agents", "a", "tts", "speed")
    assert "too fast" in problem.message


def test_load_config_with_the_check_names_file_line_and_field(tmp_path: Any) -> None:
    path = tmp_path / "agents.yaml"
    path.write_text(f"""\
default_agent: a
agents:
  a:
    nodes:
      - kind: python
        name: g
        ref: {HERE}:Greeter
        args: {{colour: red}}
""")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={}, validate=lambda c: check_agents(c, synthesizer_factory=tone))
    (item,) = caught.value.errors
    assert (item.line, item.col, item.field) == (8, 9, "agents.a.nodes[0].args")
    assert item.message.startswith("does not take these args")


def test_setup_from_config_reports_every_problem_at_once() -> None:
    cfg = config(f"""\
  a:
    llm: {{provider: scripted}}
    nodes:
      - {{kind: python, name: g, ref: "{HERE}:Greeter", args: {{colour: red}}}}
      - {{kind: python, name: fn, ref: "{HERE}:setup"}}
""")
    with pytest.raises(AgentLoadError) as caught:
        setup_from_config(cfg.agents["a"])
    lines = str(caught.value).splitlines()
    assert lines[0].startswith(f"agent 'a', node 'g' ({HERE}:Greeter): does not take these args")
    assert lines[1].startswith(f"agent 'a', node 'fn' ({HERE}:setup): a setup function must be")


async def setup(session: Any) -> None:
    """A setup function (an agent of its own)."""
