"""A real `callgate serve` on the shipped config (embedded bus and worker, offline speech, the
console on), on a free loopback port, for the command-line and browser tests. Its one change:
the agent records its calls (``recording:``) into a temporary folder."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READY_LINE = "callgate gateway on http://"


@dataclass(frozen=True, slots=True)
class Served:
    base: str
    """http://127.0.0.1:PORT"""
    log: list[str]
    """The gateway's log lines so far."""
    recordings: Path
    """Where the agent's calls are recorded."""

    @property
    def media_url(self) -> str:
        return self.base.replace("http://", "ws://") + "/twilio/media"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def recording_config(tmp: Path) -> tuple[Path, Path]:
    """The shipped config with the agent's calls recorded under ``tmp/recordings``."""
    text = (ROOT / "config" / "agents.yaml").read_text()
    anchor = "\n  support:\n"
    assert text.count(anchor) == 1
    folder = tmp / "recordings"
    text = text.replace(anchor, anchor + f"    recording:\n      folder: {folder}\n"
                                         "      keep_calls: 20\n")
    path = tmp / "agents.yaml"
    path.write_text(text)
    return path, folder


OPS_TOKEN = "ops-token-for-the-console-tests"


@contextlib.contextmanager
def _serve(config: Path, recordings: Path, extra_env: dict[str, str]) -> Iterator[Served]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALLGATE_")}
    env.update(extra_env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--config", str(config)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    log: list[str] = []
    ready: queue.Queue[bool] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line.rstrip("\n"))
            if READY_LINE in line:
                ready.put(True)
        ready.put(False)  # the process ended

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # Waits for the gateway's own "listening" line (it loads Silero and pocketsphinx first).
        assert ready.get(timeout=120), "callgate serve exited:\n" + "\n".join(log)
        yield Served(f"http://127.0.0.1:{port}", log, recordings)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The shipped config as on a laptop: signatures not checked, the console open."""
    config, recordings = recording_config(tmp_path_factory.mktemp("served"))
    with _serve(config, recordings, {}) as s:
        yield s


@pytest.fixture(scope="session")
def served_production(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The shipped config as in production: Twilio signatures checked, the console behind the
    ops token."""
    config, recordings = recording_config(tmp_path_factory.mktemp("served_production"))
    with _serve(config, recordings, {"CALLGATE_VALIDATE_SIGNATURES": "true",
                                     "TWILIO_AUTH_TOKEN": "twilio-auth-token-0123456789",
                                     "CALLGATE_OPS_TOKEN": OPS_TOKEN}) as s:
        yield s
