"""deploy/redis.conf: the settings the bus relies on, and a real redis-server accepts the file."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.redis_server import _free_port, _ping, require_redis_server

from ._support import REDIS_CONF, parse_redis_conf


def test_persistence_and_no_eviction() -> None:
    conf = parse_redis_conf(REDIS_CONF)
    assert conf["appendonly"] == ["yes"]
    assert conf["appendfsync"] == ["everysec"]
    # Streams, consumer groups and call leases must never be evicted.
    assert conf["maxmemory-policy"] == ["noeviction"]
    assert "maxmemory" in conf
    assert "dir" not in conf, "the image's WORKDIR (/data) is where the volume is mounted"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[redis.Redis]:
    require_redis_server()
    port = _free_port()
    # The file first, as in the containers; then this test's port, loopback and folder
    # (command-line options override the file's).
    proc = subprocess.Popen(
        ["redis-server", str(REDIS_CONF), "--port", str(port), "--bind", "127.0.0.1",
         "--daemonize", "no", "--logfile", str(tmp_path / "redis.log")],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        for _ in range(400):
            if _ping(port):
                break
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                pytest.fail(f"redis-server refused deploy/redis.conf: {err}")
            time.sleep(0.025)
        else:
            pytest.fail("redis-server did not answer within 10 s")
        client = redis.Redis(port=port, decode_responses=True)
        yield client
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.redis
def test_redis_server_runs_with_the_file(server: redis.Redis) -> None:
    conf = {str(k): str(v) for k, v in server.config_get("*").items()}
    assert conf["appendonly"] == "yes"
    assert conf["appendfsync"] == "everysec"
    assert conf["maxmemory-policy"] == "noeviction"
    assert int(conf["maxmemory"]) == 640 * 1024 * 1024
    assert conf["save"] == ""
