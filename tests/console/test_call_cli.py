"""`callgate call` on the README's example prints the conversation as it happens."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests import recordings_index as rec
from tests.console.conftest import ROOT, Served

README_EXAMPLE = "barge_in_command_goforward"  # the caller says "go forward ten meters"
GREETING = "Thanks for calling Acme."


def _call(served: Served, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "call", str(rec.source(README_EXAMPLE)),
         "--url", served.media_url, *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.slow
def test_call_prints_the_conversation(served: Served) -> None:
    done = _call(served)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    text = "\n".join(lines)
    assert re.match(r"\s+0\.\d\d s  call CA[0-9a-f]{32} started \(agent support\)$", lines[0])
    assert re.search(rf'bot \[main, interruptible\]: "{re.escape(GREETING)}', text), text
    paused = re.search(r"barge-in: bot paused (\d+) ms after the caller started \(heard "
                       r'(\d+\.\d\d) s: "Thanks for calling', text)
    assert paused, text
    assert 0 < int(paused.group(1)) < 1000 and float(paused.group(2)) > 1
    assert re.search(r"barge-in \(speech\): the bot stops \[main\]", text), text
    assert re.search(r'caller: "go forward', text), text
    # The agent answers (the shipped script's fallback), in full before the caller hangs up.
    answers = re.findall(r'bot \[main\](?:, interruptible\]:| finished:) "([^"]*)"', text)
    assert any(a.startswith("Sorry, I can help") and a.endswith("?") for a in answers), text
    assert re.search(r"turn latency from the end of the caller's speech: transcript \+\d+ "
                     r"ms, first bot audio \+\d+ ms", text), text
    assert "call ended: the caller hung up" in lines[-2]
    assert lines[-1].startswith("sent ") and "the gateway closed the call" not in lines[-1]


@pytest.mark.slow
def test_call_json_prints_the_raw_events(served: Served) -> None:
    done = _call(served, "--json", "--hold", "0", "--agent", "support")
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    types = [e.get("type") for e in events if e["kind"] == "event"]
    assert types[0] == "call_started" and types[-1] == "call_ended"
    assert "barge_in" in types and "clear_sent" in types
    assert all("t_ms" in e for e in events)


def test_serve_says_where_the_console_is(served: Served) -> None:
    assert any(line.endswith(f"console: {served.base}/console") for line in served.log)


def test_call_mistakes_are_one_clear_line(served: Served) -> None:
    done = _call(served, "--agent", "nobody", "--fast")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "callgate call: the gateway refused the call: unknown agent 'nobody'; agents: support"]


def test_call_to_no_gateway_is_one_clear_line() -> None:
    from tests.console.conftest import _free_port

    done = subprocess.run(
        [sys.executable, "-m", "gateway", "call", str(rec.source(README_EXAMPLE)),
         "--url", f"ws://127.0.0.1:{_free_port()}/twilio/media"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("callgate call: Cannot connect"), lines
