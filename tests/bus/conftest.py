"""Fixtures for the bus tests: one contract suite over both buses, real redis-servers."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import pytest

from bus import Bus, EmbeddedBus, EmbeddedHub, RedisBus
from tests.redis_cluster import redis_cluster, redis_cluster_url, shared_redis_cluster_url
from tests.redis_server import make_redis_server, redis_server, shared_redis_url

__all__ = [
    "STEADY_REDIS",
    "BusFactory",
    "eventually",
    "make_redis_server",
    "redis_cluster",
    "redis_cluster_url",
    "redis_server",
    "shared_redis_cluster_url",
    "shared_redis_url",
]

# Fast liveness for tests that exercise takeover; production defaults are tested in the fault
# suite (a SIGKILLed worker's call must move within 5 s with them).
FAST_REDIS = {
    "heartbeat_interval_s": 0.1,
    "worker_ttl_s": 0.4,
    "claim_interval_s": 0.1,
    "backoff_cap_s": 0.2,
    "close_timeout_s": 2.0,
}


# Production liveness (RedisBus's own defaults for the same settings), for tests in which no
# worker dies: a loop busy with hundreds of calls on a loaded machine renews FAST_REDIS's 0.4 s
# leases late now and then, and the other workers then rightly take calls over.
STEADY_REDIS = {name: inspect.signature(RedisBus).parameters[name].default for name in FAST_REDIS}


class BusFactory(Protocol):
    kind: str

    async def __call__(self, **options: Any) -> Bus: ...


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = ""
) -> None:
    """Poll ``predicate`` until true, failing after ``timeout`` (no sleep stands in for sync)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(0.01)


class _Factory:
    def __init__(self, kind: str, url: str | None) -> None:
        self.kind = kind
        self._url = url
        self._hub = EmbeddedHub()
        self._prefix = f"t{uuid.uuid4().hex[:10]}"
        self._n = itertools.count(1)
        self.buses: list[Bus] = []

    async def __call__(self, **options: Any) -> Bus:
        name = f"b{next(self._n)}"
        bus: Bus
        if self.kind == "embedded":
            bus = EmbeddedBus(hub=self._hub, bus_id=name)
        else:
            assert self._url is not None
            settings = {**FAST_REDIS, **options}
            bus = RedisBus(self._url, prefix=self._prefix, bus_id=name, **settings)
        await bus.start()
        self.buses.append(bus)
        return bus

    async def close(self) -> None:
        for bus in self.buses:
            await bus.aclose()


@pytest.fixture(
    params=[
        "embedded",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.redis),
    ]
)
async def make_bus(request: pytest.FixtureRequest) -> AsyncIterator[_Factory]:
    """Builds buses over one backend (a shared hub, one Redis, or a 3-primary Redis Cluster,
    with a per-test prefix)."""
    url = None
    if request.param == "redis":
        url = request.getfixturevalue("shared_redis_url")
    elif request.param == "cluster":
        url = request.getfixturevalue("shared_redis_cluster_url")
    factory = _Factory(request.param, url)
    try:
        yield factory
    finally:
        await factory.close()
