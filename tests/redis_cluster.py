"""A real Redis Cluster for tests: redis-servers with ``--cluster-enabled yes`` on free loopback
ports, joined by hand (CLUSTER ADDSLOTSRANGE / MEET / REPLICATE, as ``redis-cli --cluster create``
does), so nothing beyond ``redis-server`` is needed. Three primaries, each with one replica, so
that a test can fail a primary over (``CLUSTER FAILOVER`` on its replica) mid-call.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import ResponseError
from redis.crc import key_slot

from tests.redis_server import RedisServer, require_redis_server

__all__ = ["RedisClusterServers", "redis_cluster", "redis_cluster_url", "shared_redis_cluster_url", "start_cluster"]

_SLOTS = 16384
# Node timeout: how long a primary may be silent before its replica may take over. Short, so a
# killed primary is failed over quickly in tests; every wait below is on the cluster's state.
_NODE_TIMEOUT_MS = 1000


@dataclass
class RedisClusterServers:
    """The servers of one test cluster: ``primaries[i]`` replicated by ``replicas[i]`` at start."""

    primaries: list[RedisServer]
    replicas: list[RedisServer]

    @property
    def servers(self) -> list[RedisServer]:
        return [*self.primaries, *self.replicas]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.primaries)

    def client(self, server: RedisServer) -> Redis:
        return Redis(host="127.0.0.1", port=server.port, socket_timeout=5)

    def primary_of(self, key: str) -> RedisServer:
        """The server that serves ``key``'s slot as primary now (the others answer MOVED)."""
        for server in self.servers:
            if not server.running:
                continue
            with self.client(server) as c:
                if c.execute_command("ROLE")[0] != b"master":
                    continue
                try:
                    c.execute_command("EXISTS", key)
                except ResponseError:
                    continue
                return server
        raise AssertionError(f"no primary serves slot {key_slot(key.encode())} of {key}")

    def replica_of(self, primary: RedisServer) -> RedisServer:
        with self.client(primary) as c:
            me = _node_id(c)
        for server in self.servers:
            if server is primary or not server.running:
                continue
            with self.client(server) as c:
                role = c.execute_command("ROLE")
                if role[0] == b"slave" and int(role[2]) == primary.port:
                    return server
        raise AssertionError(f"no replica of {me}")

    def failover(self, primary: RedisServer, timeout: float = 20.0) -> RedisServer:
        """Promote ``primary``'s replica (``CLUSTER FAILOVER``: the replica first catches up with
        every write the primary took, so nothing acknowledged is lost) and wait until the whole
        cluster agrees. Returns the new primary."""
        replica = self.replica_of(primary)
        with self.client(replica) as c:
            c.execute_command("CLUSTER", "FAILOVER")
        wait_for(lambda: self._role(replica) == b"master" and self._role(primary) == b"slave", timeout,
                 "the replica to take over")  # fmt: skip
        wait_for(self._all_ok, timeout, "every node to see the new primary")
        return replica

    def _role(self, server: RedisServer) -> bytes:
        with self.client(server) as c:
            return bytes(c.execute_command("ROLE")[0])

    def _all_ok(self) -> bool:
        for server in self.servers:
            if not server.running:
                continue
            with self.client(server) as c:
                info = c.execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info:
                    return False
                masters = [line for line in c.execute_command("CLUSTER", "NODES").decode().splitlines()
                           if "master" in line.split()[2] and "fail" not in line.split()[2]]  # fmt: skip
                if len(masters) != len(self.primaries):
                    return False
        return True


def _node_id(c: Redis) -> str:
    return bytes(c.execute_command("CLUSTER", "MYID")).decode()  # type: ignore[no-untyped-call]  # redis-py leaves execute_command unannotated


def wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():  # type: ignore[operator]
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"redis cluster: timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a, \
                socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b:  # fmt: skip
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            if port + 10000 > 65535:
                continue
            try:
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


def start_cluster(root: Path, servers_out: list[RedisServer], primaries: int = 3, replicas: bool = True) -> RedisClusterServers:
    """Start and join a cluster under ``root``, ready to serve; every server started is
    appended to ``servers_out`` (stop them all afterwards, also when this fails)."""
    require_redis_server()
    args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(_NODE_TIMEOUT_MS))  # fmt: skip

    def make(i: int) -> RedisServer:
        server = RedisServer(root / f"node{i}", port=_cluster_port(), extra_args=args)
        servers_out.append(server)
        server.start()
        return server

    mains = [make(i) for i in range(primaries)]
    reps = [make(primaries + i) for i in range(primaries)] if replicas else []
    cluster = RedisClusterServers(mains, reps)
    servers = cluster.servers
    for epoch, server in enumerate(servers, 1):
        with cluster.client(server) as c:
            c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
    per = _SLOTS // primaries
    for i, server in enumerate(mains):
        first, last = i * per, (_SLOTS - 1 if i == primaries - 1 else (i + 1) * per - 1)
        with cluster.client(server) as c:
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
    with cluster.client(mains[0]) as c:
        for server in servers[1:]:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", server.port)

    def everyone_met() -> bool:
        for server in servers:
            with cluster.client(server) as c:
                lines = c.execute_command("CLUSTER", "NODES").decode().splitlines()
                if len(lines) != len(servers) or any("handshake" in line or "noaddr" in line for line in lines):
                    return False
        return True

    wait_for(everyone_met, 20, "every node to meet the others")
    for main, rep in zip(mains, reps, strict=False):
        with cluster.client(main) as c:
            main_id = _node_id(c)
        with cluster.client(rep) as c:
            c.execute_command("CLUSTER", "REPLICATE", main_id)

    def ready() -> bool:
        for rep in reps:
            with cluster.client(rep) as c:
                role = c.execute_command("ROLE")
                if role[0] != b"slave" or role[3] != b"connected":
                    return False
        return cluster._all_ok()

    wait_for(ready, 30, "the cluster to be ok with every replica in sync")
    return cluster


@pytest.fixture(scope="session")
def shared_redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A cluster for tests that only need *a* cluster (they namespace their keys; none fails it
    over): three primaries, no replicas, for the whole session."""
    servers: list[RedisServer] = []
    try:
        yield start_cluster(tmp_path_factory.mktemp("redis-cluster"), servers, replicas=False).url
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """A cluster of its own for one test (three primaries, three replicas): it may fail over."""
    servers: list[RedisServer] = []
    try:
        yield start_cluster(tmp_path, servers)
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_cluster_url(tmp_path: Path) -> Iterator[str]:
    """The URL of a cluster of its own for one test (three primaries, no replicas)."""
    servers: list[RedisServer] = []
    try:
        yield start_cluster(tmp_path, servers, replicas=False).url
    finally:
        for server in servers:
            server.stop()
