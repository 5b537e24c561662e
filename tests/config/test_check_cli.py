"""``callgate config check`` from outside (a subprocess): configs whose agents cannot be built are
refused with file:line:col: field, one line per problem, exit status 1 (issue #13, item 8b).

Each of these passed the schema before, and then every call ended in 0.1 s: the worker built the
agent when the call started. The check now builds every agent graph, without network calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# User code the YAML refers to, importable by the subprocess from the test's folder.
MODULE = '''
from nodes import Node, OutputAgentNode


class Talker(OutputAgentNode):
    def __init__(self, prefix: str = "") -> None:
        super().__init__(name="talker")
        self.prefix = prefix

    async def generate_response(self):
        yield self.prefix


class Quiet(Node):
    """Speaks never: not an OutputAgentNode."""


class NeedsDatabase(OutputAgentNode):
    def __init__(self) -> None:
        raise RuntimeError("no database at db.internal")


async def setup(session, colour: str = "red") -> None:
    await session.start()
    await session.wait_until_complete()


NOT_A_NODE = dict
'''


def check(tmp_path: Path, yaml_text: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "usernodes.py").write_text(MODULE)
    (tmp_path / "agents.yaml").write_text(textwrap.dedent(yaml_text))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    for name in ("CALLGATE_CONFIG", "OPENAI_API_KEY"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "gateway", "config", "check", "agents.yaml"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def marked_line(text: str) -> int:
    lines = textwrap.dedent(text).splitlines()
    return next(i for i, line in enumerate(lines, 1) if "# <-" in line)


CASES = {
    "args the class does not take": (
        """\
        default_agent: a
        agents:
          a:
            nodes:
              - kind: python
                name: talk
                ref: usernodes:Talker
                args: {colour: red}   # <-
        """,
        "agents.a.nodes[0].args",
        "does not take these args: got an unexpected keyword argument 'colour'",
    ),
    "a setup function among several nodes": (
        """\
        default_agent: a
        agents:
          a:
            llm: {provider: scripted}
            nodes:
              - {kind: llm, name: main}
              - kind: python
                name: setup
                ref: usernodes:setup   # <-
        """,
        "agents.a.nodes[1].ref",
        "a setup function must be the agent's only node",
    ),
    "a ref to something that is not a Node": (
        """\
        default_agent: a
        agents:
          a:
            llm: {provider: scripted}
            nodes:
              - {kind: llm, name: main}
              - {kind: python, name: table, ref: "usernodes:NOT_A_NODE"}   # <-
        """,
        "agents.a.nodes[1].ref",
        "dict is not a nodes.Node subclass",
    ),
    "goto to a node that cannot speak": (
        """\
        default_agent: a
        agents:
          a:
            llm: {provider: scripted}
            nodes:
              - {kind: llm, name: main}
              - {kind: python, name: quiet, ref: "usernodes:Quiet"}
            script:
              - keywords: [help]
                goto: quiet   # <-
        """,
        "agents.a.script[0].goto",
        "goto 'quiet' names a node that does not speak; output nodes: main",
    ),
    "interruptible on a setup function": (
        """\
        default_agent: a
        agents:
          a:
            nodes:
              - kind: python
                name: only
                ref: usernodes:setup
                interruptible: false   # <-
        """,
        "agents.a.nodes[0].interruptible",
        "`interruptible` applies to a Node class",
    ),
    "an unknown TTS voice": (
        """\
        default_agent: a
        agents:
          a:
            llm: {provider: scripted}
            tts:
              provider: espeak
              voice: en-nowhere   # <-
        """,
        "agents.a.tts.voice",
        "eSpeak NG has no voice 'en-nowhere'",
    ),
    "a node class whose constructor fails": (
        """\
        default_agent: a
        agents:
          a:
            nodes:
              - {kind: python, name: db, ref: "usernodes:NeedsDatabase"}   # <-
        """,
        "agents.a.nodes[0].ref",
        "building it raised RuntimeError: no database at db.internal",
    ),
    "an openai node without an API key": (
        """\
        default_agent: a
        agents:
          a:
            llm:   # <-
              provider: openai
              model: gpt-4o-mini
        """,
        "agents.a.llm.api_key",
        "provider 'openai' needs an API key",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_config_check_refuses_an_agent_that_cannot_be_built(tmp_path: Path, case: str) -> None:
    text, field, message = CASES[case]
    result = check(tmp_path, text)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one problem, one line, no traceback
    where, _, rest = lines[0].partition(f": {field}: ")
    assert rest, lines[0]
    file, line, col = where.split(":")
    assert (file, int(line)) == ("agents.yaml", marked_line(text)), lines[0]
    assert int(col) >= 1
    assert message in rest


def test_config_check_reports_every_problem_of_every_agent(tmp_path: Path) -> None:
    text = """\
    default_agent: a
    agents:
      a:
        llm: {provider: scripted}
        tts: {provider: espeak, voice: en-nowhere}
        nodes:
          - {kind: python, name: talk, ref: "usernodes:Talker", args: {colour: red}}
          - {kind: python, name: table, ref: "usernodes:NOT_A_NODE"}
      b:
        nodes:
          - {kind: python, name: only, ref: "usernodes:setup", interruptible: true}
    """
    result = check(tmp_path, text)
    assert result.returncode == 1
    fields = [line.split(": ")[1] for line in result.stderr.strip().splitlines()]
    assert fields == [
        "agents.a.tts.voice",
        "agents.a.nodes[0].args",
        "agents.a.nodes[1].ref",
        "agents.b.nodes[0].interruptible",
    ], result.stderr


def test_config_check_passes_agents_that_build(tmp_path: Path) -> None:
    text = """\
    default_agent: a
    agents:
      a:
        llm: {provider: scripted}
        tts: {provider: espeak, voice: en-us}
        nodes:
          - {kind: llm, name: main}
          - {kind: python, name: talk, ref: "usernodes:Talker", args: {prefix: "You said: "}}
        script:
          - {keywords: [talk], goto: talk}
      b:
        nodes:
          - {kind: python, name: only, ref: "usernodes:setup", args: {colour: blue}}
    """
    result = check(tmp_path, text)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "a" in result.stdout and "b" in result.stdout


def test_config_check_names_the_field_of_a_yaml_syntax_error(tmp_path: Path) -> None:
    text = """\
    default_agent: a
    agents:
      a:
        llm: {provider: scripted}
        nodes:
          - {kind: llm, name: main}
          - kind: llm
            name: "payment   # <-
            interruptible: false
    """
    result = check(tmp_path, text)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"agents.yaml:{marked_line(text)}:")
    assert ": agents.a.nodes[1].name: invalid YAML: " in line


def test_the_shipped_config_passes_the_check(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CALLGATE_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "config", "check", str(ROOT / "config" / "agents.yaml")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
