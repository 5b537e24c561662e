"""A reload builds every agent graph before it switches (issue #13, item 8b): a file whose agents
cannot be built is refused and the old config stays in force, in process (``ConfigHolder`` with
``nodes.check_agents`` as its validator) and in a real ``callgate serve`` sent SIGHUP."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from config import Config, ConfigError, ConfigHolder
from nodes import OutputAgentNode, check_agents

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests.config.test_reload_builds_agents"
# Hang guard for a process the test waits on; reaching it is a failure.
GUARD_S = 90.0


class Talker(OutputAgentNode):
    def __init__(self, prefix: str = "") -> None:
        super().__init__(name="talker")
        self.prefix = prefix

    async def generate_response(self):  # type: ignore[no-untyped-def]
        yield self.prefix


GOOD = f"""\
twilio: {{{{validate_signatures: false}}}}
default_agent: a
agents:
  a:
    greeting: {{greeting}}
    llm: {{{{provider: scripted}}}}
    nodes:
      - {{{{kind: llm, name: main}}}}
      - kind: python
        name: talk
        ref: {HERE}:Talker
        args: {{{{prefix: "heard: "}}}}
"""
BAD_ARGS = GOOD.replace('prefix: "heard: "', "colour: red")


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def test_holder_refuses_a_reload_whose_agent_cannot_be_built(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "agents.yaml"
    write(path, GOOD.format(greeting="one"))
    holder = ConfigHolder(path, env={}, validate=check_agents)
    seen: list[Config] = []
    holder.on_change(seen.append)
    write(path, BAD_ARGS.format(greeting="two"))
    with caplog.at_level(logging.ERROR, logger="callgate.config"):
        assert holder.reload() is False
    assert holder.current.agents["a"].greeting == "one"
    assert seen == []
    line = BAD_ARGS.splitlines().index("        args: {{colour: red}}") + 1
    assert f"agents.yaml:{line}:9: agents.a.nodes[1].args: does not take these args" in caplog.text
    # Without the validator the same file loads (the schema alone cannot tell).
    assert ConfigHolder(path, env={}).current.agents["a"].greeting == "two"
    write(path, GOOD.format(greeting="three"))
    assert holder.reload() is True
    assert seen == [holder.current]


def test_holder_refuses_such_a_file_at_start(tmp_path: Path) -> None:
    path = tmp_path / "agents.yaml"
    write(path, BAD_ARGS.format(greeting="one"))
    with pytest.raises(ConfigError) as caught:
        ConfigHolder(path, env={}, validate=check_agents)
    assert [item.field for item in caught.value.errors] == ["agents.a.nodes[1].args"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _healthy(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)  # polling another process; bounded by GUARD_S


async def _line_with(stream: asyncio.StreamReader, text: str, seen: list[str]) -> str:
    while True:
        raw = await stream.readline()
        if not raw:
            raise AssertionError(f"the gateway exited before logging {text!r}:\n" + "".join(seen))
        line = raw.decode(errors="replace")
        seen.append(line)
        if text in line:
            return line


@pytest.mark.slow
async def test_serve_refuses_on_sighup_a_config_whose_agent_cannot_be_built(
    tmp_path: Path,
) -> None:
    path = tmp_path / "agents.yaml"
    write(path, GOOD.format(greeting="one"))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--no-worker", "--vad-runtime", "onnx",
        "--config", str(path), "--host", "127.0.0.1", "--port", str(port),
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(GUARD_S):
            await _line_with(proc.stdout, "callgate gateway on", seen)
            await _healthy(f"http://127.0.0.1:{port}/healthz")
            write(path, BAD_ARGS.format(greeting="two"))
            proc.send_signal(signal.SIGHUP)
            line = await _line_with(proc.stdout, "agents.a.nodes[1].args", seen)
            assert "does not take these args" in line
            await _healthy(f"http://127.0.0.1:{port}/healthz")  # still serving
            assert proc.returncode is None
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(GUARD_S):
                await proc.communicate()
