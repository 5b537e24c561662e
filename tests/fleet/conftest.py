"""One fleet per Redis kind for the whole module: two gateways and three workers on a single
redis-server, then on a 3-master Redis Cluster (``redis+cluster://``). Starting a gateway costs
tens of seconds on a loaded machine (torch, Silero, the STT pool), so the tests share the fleet
and each leaves it as it found it: two gateways ready, three workers up (what a test killed or
drained it replaces, as a deployment would)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
import pytest_asyncio

from tests.faults.conftest import Processes
from tests.redis_cluster import start_cluster
from tests.redis_server import RedisServer, redis_server_factory

from ._fleet import Fleet, connect_redis, fleet_config

DRAIN_TIMEOUT_S = 60.0  # the gateways' server.drain_timeout_s: far above what a drain here takes


@pytest.fixture(scope="module", params=["single", "cluster"])
def fleet_redis_url(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp(f"fleet-redis-{request.param}")
    if request.param == "single":
        make, cleanup = redis_server_factory(root)
        try:
            yield make().url
        finally:
            cleanup()
        return
    servers: list[RedisServer] = []
    try:
        yield start_cluster(root, servers, replicas=False).url
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def fleet(fleet_redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    config = root / "agents.yaml"
    config.write_text(fleet_config(DRAIN_TIMEOUT_S))
    procs = Processes(root)
    f = Fleet(fleet_redis_url, procs, config)
    try:
        for _ in range(2):
            f.start_gateway()
        for _ in range(3):
            f.start_worker()
        yield f
    finally:
        procs.stop_all()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest_asyncio.fixture
async def raw(fleet: Fleet) -> AsyncIterator[object]:
    client = connect_redis(fleet.redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest_asyncio.fixture
async def ready_fleet(fleet: Fleet, http: aiohttp.ClientSession, raw: object) -> Fleet:
    """The fleet with two gateways ready and three workers up."""
    while len(fleet.gateways) < 2:
        fleet.start_gateway()
    while len(fleet.workers) < 3:
        fleet.start_worker()
    await fleet.wait_up(http, raw)  # type: ignore[arg-type]
    return fleet

