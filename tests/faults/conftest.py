"""Fault tests from outside: real redis-servers, real `callgate` processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bus.conftest import eventually
from tests.redis_server import make_redis_server, redis_server

__all__ = ["REPO", "Processes", "eventually", "make_redis_server", "processes", "redis_server"]

REPO = Path(__file__).resolve().parents[2]
CALLGATE = Path(sys.executable).parent / "callgate"  # the console script of this virtualenv


class Processes:
    """`callgate` subprocesses of one test, each logging to its own file; all ended after it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.root / f"{name}.log").open("ab")
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen([str(CALLGATE), *args], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:  # its own process group (start_new_session): its children too
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()
