"""A real ``redis-server`` for tests: one subprocess per server, on a free loopback port.

Other test packages import this module; it is the one place that knows how to start, stop, kill
and restart a server. A restart keeps the port, so clients that cached the URL reconnect to it.

The server runs without persistence (``--save "" --appendonly no``) unless ``extra_args`` asks for
it, so a restart is also a total loss of the data set, as a crashed cache without AOF would be.

When ``redis-server`` is not on PATH, ``REDIS_URL`` (if set) names an external server that tests
may use but cannot stop or restart; with neither, redis tests are skipped with a loud reason, or
fail when ``CALLGATE_REQUIRE_REDIS=1`` (CI sets it, so a missing binary never passes silently).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

__all__ = [
    "RedisServer",
    "make_redis_server",
    "RedisServerError",
    "redis_server",
    "redis_server_factory",
    "redis_url_or_skip",
    "require_redis_server",
    "shared_redis_url",
]

_START_TIMEOUT_S = 10.0


class RedisServerError(RuntimeError):
    """The server did not start, or exited on its own."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int, timeout: float = 0.2) -> bool:
    """True when a server on ``port`` answers PING (raw RESP, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _missing_reason() -> str | None:
    if shutil.which("redis-server") or os.environ.get("REDIS_URL"):
        return None
    return (
        "REDIS TESTS SKIPPED: no `redis-server` on PATH and REDIS_URL unset "
        "(install redis-server, e.g. `apt-get install redis-server`; "
        "set CALLGATE_REQUIRE_REDIS=1 to make this a failure)"
    )


def require_redis_server() -> None:
    """Skip (or fail under ``CALLGATE_REQUIRE_REDIS=1``) when no redis-server binary is on PATH."""
    if shutil.which("redis-server"):
        return
    reason = "no `redis-server` on PATH: this test must start and restart its own server"
    if os.environ.get("CALLGATE_REQUIRE_REDIS") == "1":
        pytest.fail(reason + " (CALLGATE_REQUIRE_REDIS=1)")
    pytest.skip("REDIS TESTS SKIPPED: " + reason)


def redis_url_or_skip() -> None:
    """Skip (or fail) when neither a redis-server binary nor REDIS_URL is available."""
    reason = _missing_reason()
    if reason is None:
        return
    if os.environ.get("CALLGATE_REQUIRE_REDIS") == "1":
        pytest.fail(reason.replace("SKIPPED", "MISSING"))
    pytest.skip(reason)


class RedisServer:
    """One ``redis-server`` subprocess bound to 127.0.0.1 on a fixed port.

    Args:
        directory: working directory for the server (its log goes there).
        port: the port; a free one when None. Kept across ``restart``.
        extra_args: more ``redis-server`` arguments, e.g. ``("--appendonly", "yes")``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else _free_port()
        self.extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = self.directory / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _argv(self) -> list[str]:
        return [
            "redis-server",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", str(self._log),
            "--daemonize", "no",
            *self.extra_args,
        ]  # fmt: skip

    def _spawn(self) -> None:
        if self.running:
            raise RedisServerError(f"redis-server already running on port {self.port}")
        self._proc = subprocess.Popen(
            self._argv(),
            cwd=self.directory,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def _check_alive(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            log = self._log.read_text(errors="replace")[-2000:] if self._log.exists() else ""
            raise RedisServerError(
                f"redis-server on port {self.port} exited with {proc.returncode}: {err}{log}"
            )

    def start(self, timeout: float = _START_TIMEOUT_S) -> None:
        """Start the server and return once it answers PING."""
        self._spawn()
        deadline = time.monotonic() + timeout
        while not _ping(self.port):
            self._check_alive()
            if time.monotonic() > deadline:
                self.kill()
                raise RedisServerError(f"redis-server on port {self.port} not ready in {timeout}s")
            time.sleep(0.005)

    async def astart(self, timeout: float = _START_TIMEOUT_S) -> None:
        """``start`` without blocking the event loop while the server boots."""
        self._spawn()
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(_ping, self.port):
            self._check_alive()
            if time.monotonic() > deadline:
                self.kill()
                raise RedisServerError(f"redis-server on port {self.port} not ready in {timeout}s")
            await asyncio.sleep(0.005)

    def _signal_and_wait(self, sig: int, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        if proc.stderr is not None:
            proc.stderr.close()
        self._proc = None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait for exit (SIGKILL if it hangs). The port is free afterwards."""
        self._signal_and_wait(signal.SIGTERM, timeout)

    async def astop(self, timeout: float = 10.0) -> None:
        await asyncio.to_thread(self.stop, timeout)

    def kill(self) -> None:
        """SIGKILL: the server dies without closing its clients' connections gracefully."""
        self._signal_and_wait(signal.SIGKILL, 10.0)

    def restart(self) -> None:
        """Stop and start again on the same port (data is lost without persistence)."""
        self.stop()
        self.start()

    async def arestart(self) -> None:
        await self.astop()
        await self.astart()

    def ping(self) -> bool:
        return _ping(self.port)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _start_with_free_port(directory: Path, extra_args: tuple[str, ...]) -> RedisServer:
    # Another process may take the port between _free_port() and bind: try a few ports.
    last: Exception | None = None
    for _ in range(5):
        server = RedisServer(directory, extra_args=extra_args)
        try:
            server.start()
        except RedisServerError as exc:
            last = exc
            continue
        return server
    raise RedisServerError(f"could not start redis-server: {last}")


def redis_server_factory(
    base_dir: Path | None = None,
) -> tuple[Callable[..., RedisServer], Callable[[], None]]:
    """A ``(make, cleanup)`` pair: ``make(*extra_args)`` starts a server in its own folder
    under ``base_dir`` (a temporary folder when None); ``cleanup()`` stops them all.

    Fixtures wrap it, e.g.::

        @pytest.fixture
        def redis_server(tmp_path):
            make, cleanup = redis_server_factory(tmp_path)
            yield make()
            cleanup()
    """
    require_redis_server()
    own_tmp = base_dir is None
    root = Path(base_dir) if base_dir is not None else Path(tempfile.mkdtemp(prefix="callgate-redis-"))
    servers: list[RedisServer] = []

    def make(*extra_args: str) -> RedisServer:
        server = _start_with_free_port(Path(tempfile.mkdtemp(dir=root, prefix="redis-")), tuple(extra_args))
        servers.append(server)
        return server

    def cleanup() -> None:
        for server in servers:
            server.stop()
        servers.clear()
        if own_tmp:
            shutil.rmtree(root, ignore_errors=True)

    return make, cleanup


@pytest.fixture
def make_redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """A factory: ``make_redis_server(*extra_args)`` starts another server (all stopped after
    the test), e.g. ``make_redis_server("--appendonly", "yes")``."""
    make, cleanup = redis_server_factory(tmp_path)
    try:
        yield make
    finally:
        cleanup()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh server for one test (it may stop, kill or restart it)."""
    make, cleanup = redis_server_factory(tmp_path)
    try:
        yield make()
    finally:
        cleanup()


@pytest.fixture(scope="session")
def shared_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A URL for tests that only need *a* server: their own redis-server for the whole session,
    or ``REDIS_URL`` when no binary is on PATH. Tests must namespace their keys."""
    if shutil.which("redis-server"):
        make, cleanup = redis_server_factory(tmp_path_factory.mktemp("redis"))
        try:
            yield make().url
        finally:
            cleanup()
        return
    redis_url_or_skip()
    yield os.environ["REDIS_URL"]
