"""The Redis Streams bus: gateways and session workers as separate processes and machines.

Key layout (``cg`` is the ``prefix``; every key of one call shares the ``{call_sid}`` hash tag,
so one call lives in one Redis Cluster slot)::

    cg:{CA..}:up       uplink stream (gateway -> worker); consumer group "workers"
    cg:{CA..}:down     downlink stream (worker -> gateway); read with XREAD from the last id seen
    cg:{CA..}:ctx      hash: ctx (JSON context), through (last uplink id it covers), info (CallInfo)
    cg:{CA..}:owner    owning worker id, PX lease renewed by its heartbeat; "!closed" once ended
    cg:{CA..}:fence    the call's fencing token: a counter INCRed by every new owner
    cg:{CA..}:once:<n> ``record_once`` (a spent stream token), SET NX, PX its remaining lifetime
    cg:calls           pool-wide new-calls stream; consumer group "workers"
    cg:worker:<id>     worker liveness, PX worker_ttl, refreshed every heartbeat
    cg:gateway:<inc>   gateway liveness (one per gateway process), PX gateway_ttl
    cg:wake:<bus>:...  tiny per-bus streams that wake this bus's blocking readers

Streams are trimmed on every XADD (``MAXLEN ~ stream_maxlen``); a call's keys get ``EXPIRE
max_call_s`` when opened and ``EXPIRE call_ttl_s`` when closed. ``cg:calls`` keeps an entry
pending for every live call (see claiming) and is trimmed to its oldest pending entry
(``XTRIM MINID``) by the claim loops, with ``MAXLEN ~ calls_maxlen`` as a backstop.

Claiming. A worker reads ``cg:calls`` with XREADGROUP and takes a call by setting its owner key
(Lua: SET when free). It does not ack the entry while the call lasts: the entry stays in the
group's pending list as the registry of live calls, and the owner's heartbeat touches it
(XCLAIM to itself, JUSTID) along with renewing the owner lease (Lua: PEXPIRE if still ours). When a worker dies both stop:
its lease expires after ``worker_ttl_s`` and its entries go idle; every worker's claim loop
XAUTOCLAIMs entries idle for ``claim_idle_ms`` (lease + one heartbeat, so the lease is surely
gone), takes the orphaned call with the same Lua, and yields it. Its ``uplink()`` then moves the
call's pending uplink messages to itself (XAUTOCLAIM on the call's group) and yields them first,
skipping those the saved context covers. Worst case from kill to takeover: worker_ttl +
heartbeat + claim_interval (3 s with the defaults). An entry whose stream entry vanished
(trimmed, or Redis lost its data) is re-announced by its owner's heartbeat.

Fencing. Taking a call (a new claim or a takeover) INCRs its ``fence`` key; the worker keeps
that token, and everything it does to the call afterwards is checked against the lease in the
same Lua script that does it: claiming uplink messages (XREADGROUP), acks, downlink writes and
context saves are refused once another worker owns the call or the token moved on, and the
refusal drops the call here (``uplink()`` raises ``OwnershipLostError``, later writes are
dropped locally). Readers never block in XREADGROUP: a server answers a blocking read while the
reading process is frozen (SIGSTOP, a long pause), and the frozen worker would act on what it was
given when it woke, after a takeover. They block in a plain XREAD from each stream's last
delivered id and then claim, fenced. A takeover moves the call's pending uplink messages to the
new owner (XAUTOCLAIM, fenced too), so nothing stays pending under a stale worker. The heartbeat
renews leases before it touches the registry entries, so a worker that wakes from a freeze
learns it lost its calls before it could take their entries back.

Gateway liveness. A gateway bus (one that opened a call) keeps ``cg:gateway:<incarnation>``
alive (PX ``gateway_ttl_s``, renewed every heartbeat interval; deleted by ``aclose``); each
call records its gateway's incarnation (a random id per bus instance, so a restarted gateway is
a new one). The owning worker's heartbeat checks the gateways of its calls; a gateway missing
for ``gateway_grace_s`` on consecutive successful beats (so a Redis restart, which drops or
expires the key until the gateway is back, ends nothing) is dead: the worker appends
``call_ended {reason: gateway_lost}`` and the end markers to the call, tombstones it and sets
its keys to expire in ``dead_call_ttl_s``. Its agent takes the usual ``call_ended`` path; the
lease ends with the tombstone. Worst case from kill to ``call_ended``: gateway_ttl + grace +
heartbeat (5.5 s with the defaults).

Redis Cluster (``redis+cluster://host:port,host:port``). A multi-key command (a shard's XREAD
over many calls, a script renewing many leases) must stay in one hash slot, and one slot per
call would mean one blocking connection per call. So on a Cluster a call's keys carry the tag
of its slot group, ``cg:{g<n>}:CA..:up`` (n = crc32(sid) mod ``slot_groups``): every script
still touches one slot, a reader shard watches the calls of one group (its wake stream in the
same slot) over a connection to that slot's primary, and renewals are batched per group, all
groups in one pipeline. The calls registry is split over ``calls_shards`` streams
``cg:calls:{c<k>}``, each read by a pump task of every claim loop. A failover (redirections,
CLUSTERDOWN, UNBLOCKED on a blocked read) is handled as an outage: back off, re-resolve the
slot's primary, resync. Redis >= 7.0 (EXPIRE NX, XAUTOCLAIM's deleted-ids reply).

Reading many calls. Each bus runs one uplink reader per worker id and one downlink reader. A
reader spreads its calls over shards of ``streams_per_read`` (64) streams; a shard is a task
with its own connection blocking in one XREAD over all its streams, so a worker with 1,000
calls holds 16 reading connections, not 1,000, and an event costs one re-issued read of 64
streams, not of 1,000. An uplink shard then claims what arrived with one fenced XREADGROUP
script per stream that has news, in the same round trip (see Fencing): one more round trip per
event than a blocking XREADGROUP, the price of never being delivered a message while frozen. A
shard learns about a new call through its wake stream, which is part of the same blocking read.

Outages. Every write (publish, send, ack, save_context, open/close) is an op in one ordered,
bounded buffer (``bus._retry``) drained by one writer task in pipelined batches; when Redis is
away the writer backs off (exponential, jittered) and retries the same batch, so writes land in
order once it is back, and ``publish()`` never waits on the network. A retried batch may land
twice in part; consumers drop the copies by eid. Readers resume from the last id they saw;
after a reconnect the uplink reader re-reads its pending entries, since a reply lost with the
connection may have delivered some. A Redis that restarts empty (no persistence) loses what
it held; the bus recreates its groups and leases, and whatever was buffered lands afterwards.
The bus is back (one log line, ``redis_down`` 0) once the server answers and what was buffered
up to then is written, however many newer writes are queued by then (see ``_Outage``).
redis-py's pool running out of connections (``MaxConnectionsError``) is no outage: the command
is retried with backoff, counted (``pool_exhausted``) and logged, rate-limited, and the bus stays
up (``_Outage._pool_exhausted``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import itertools
import json
import logging
import math
import os
import socket
import time
import uuid
import warnings
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AskError, ClusterDownError, MasterDownError, MovedError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError, SlotNotCoveredError, TryAgainError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT, FieldT, KeyT, StreamIdT

from . import protocol
from ._base import Bus, BusMessage, CallInfo, Event, SeenWindow, check_name, parse_stream_id
from ._base import _Accepted
from ._errors import (
    BusClosedError,
    BusUnavailableError,
    CallOwnershipError,
    OwnershipLostError,
)
from ._retry import Op, OutboundBuffer, is_critical, make_backoff, make_retry
from .protocol import CallEnded, encode

__all__ = ["RedisBus"]

log = logging.getLogger("callgate.bus")

T = TypeVar("T")

GROUP = "workers"
TOMBSTONE = "!closed"
# A Redis Cluster mid-failover answers with redirections and "down" errors: for the bus they are
# an outage like a lost connection (back off, retry the same batch, re-resolve the node).
_CLUSTER_ERRORS: tuple[type[BaseException], ...] = (
    ClusterDownError,
    TryAgainError,
    MasterDownError,
    SlotNotCoveredError,
    MovedError,
    AskError,
    ReadOnlyError,
)
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    *_CLUSTER_ERRORS,
)
_CONNECTION_OR_TIMEOUT: tuple[type[BaseException], ...] = (*_CONNECTION_ERRORS, asyncio.TimeoutError)
_CONNECTION_OR_REPLY: tuple[type[BaseException], ...] = (*_CONNECTION_ERRORS, ResponseError)
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def _is_reroute(exc: BaseException) -> bool:
    """A reply that says the key's node changed: a redirection, or a blocked read that a
    failover released (``UNBLOCKED``, sent when a primary turns replica)."""
    return isinstance(exc, _CLUSTER_ERRORS) or _err_code(exc) in ("UNBLOCKED", "LOADING")

# Fencing. A call's lease is two keys: ``owner`` (the worker id, PX lease) and ``fence`` (a
# counter INCRed by every new owner: the fencing token). A worker keeps the token it took the call
# with, and every claim of uplink messages, every ack, downlink write and context save it makes for
# the call is a script that first checks the lease: refused (0) when another worker owns the call
# or the token moved on. A lapsed lease that nobody took (owner gone, token unchanged) still
# counts as ours; so does a call whose keys are all gone (Redis lost its data: nobody can have
# taken it since). The tombstone of an ended call passes the owner check (its last acks and the
# final save land), not the token check.
_HOLDS = """
local function holds(owner, fence, worker, token)
  local cur = redis.call('GET', owner)
  if cur and cur ~= worker and cur ~= '!closed' then return false end
  local f = redis.call('GET', fence)
  if f and f ~= token then return false end
  return true
end
"""

# KEYS: owner, up, fence. ARGV: worker, lease_ms, tombstone, require_stream, key_ttl_s, held.
# ``held``: the token of a lease we believe we hold ("" to take the call anew).
# -> {1, me, token} ours | {2, me, token} taken (token INCRed) | {0, other, ""} owned
#    | {-1, "", ""} closed | {-2, "", ""} gone
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
local fence = redis.call('GET', KEYS[3])
if cur == ARGV[3] then return {-1, '', ''} end
if ARGV[6] ~= '' then
  if (cur == ARGV[1] or not cur) and (fence == ARGV[6] or not fence) then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    if not fence then redis.call('SET', KEYS[3], ARGV[6], 'EX', ARGV[5]) end
    return {1, ARGV[1], ARGV[6]}
  end
  return {0, cur or '', ''}
end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, cur, fence or ''}
end
if cur then return {0, cur, ''} end
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then return {-2, '', ''} end
local token = redis.call('INCR', KEYS[3])
redis.call('EXPIRE', KEYS[3], ARGV[5], 'NX')
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {2, ARGV[1], tostring(token)}
"""

# KEYS: owner_1, fence_1, owner_2, fence_2, ... ARGV: worker, lease_ms, tombstone, key_ttl_s,
# token_1, token_2, ...
# -> per call: 1 renewed | 2 re-taken (it had lapsed, nobody took it) | 0 lost | -1 closed
# One script renews a batch: on Redis Cluster the batch would have to be split by hash slot.
_RENEW = """
local out = {}
for i = 1, #KEYS / 2 do
  local owner, fence, token = KEYS[2 * i - 1], KEYS[2 * i], ARGV[4 + i]
  local cur = redis.call('GET', owner)
  local f = redis.call('GET', fence)
  if cur == ARGV[3] then
    out[i] = -1
  elseif (f and f ~= token) or (cur and cur ~= ARGV[1]) then
    out[i] = 0
  else
    redis.call('SET', owner, ARGV[1], 'PX', ARGV[2])
    if not f then redis.call('SET', fence, token, 'EX', ARGV[4]) end
    if cur then out[i] = 1 else out[i] = 2 end
  end
end
return out
"""
_RENEW_BATCH = 256

# KEYS: owner, fence, target. ARGV: worker, token, op, op's arguments. -> 1 done | 0 refused
#   xack <id>...                 XACK target workers <id>...
#   xadd <maxlen> <f> <v>...     XADD target MAXLEN ~ <maxlen> * <f> <v>...
#   hset <ttl_s> <f> <v>...      HSET target <f> <v>...; EXPIRE target <ttl_s> NX
_FENCED = _HOLDS + """
if not holds(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) then return 0 end
local op = ARGV[3]
if op == 'xack' then
  redis.call('XACK', KEYS[3], 'workers', unpack(ARGV, 4))
elseif op == 'xadd' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 5))
elseif op == 'hset' then
  redis.call('HSET', KEYS[3], unpack(ARGV, 5))
  redis.call('EXPIRE', KEYS[3], ARGV[4], 'NX')
else
  return redis.error_reply('ERR unknown fenced op ' .. op)
end
return 1
"""

# The claim of new uplink messages: XREADGROUP only while we hold the lease, so a worker that
# froze and came back cannot take one more message of a call it lost.
# KEYS: owner, fence, up. ARGV: worker, token, count, position ('1': also the group's
# last-delivered id, where a reader starts watching the stream).
# -> {0} refused | {1, entries, last-delivered id or ''}
_CLAIM_UP = _HOLDS + """
if ARGV[2] ~= '' and not holds(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) then return {0} end
local reply = redis.call('XREADGROUP', 'GROUP', 'workers', ARGV[1], 'COUNT', ARGV[3],
                         'STREAMS', KEYS[3], '>')
local entries = {}
if reply then entries = reply[1][2] end
local last = ''
if ARGV[4] == '1' then
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[3])) do
    local g = {}
    for i = 1, #group, 2 do g[group[i]] = group[i + 1] end
    if g['name'] == 'workers' then last = g['last-delivered-id'] end
  end
end
return {1, entries, last}
"""

# A takeover moves every pending uplink message of the call to the new owner, under its lease.
# KEYS: owner, fence, up. ARGV: worker, token, cursor, count.
# -> {0} refused | {1, next cursor, entries, deleted ids}
_TAKE_PENDING = _HOLDS + """
if ARGV[2] ~= '' and not holds(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) then return {0} end
local reply = redis.call('XAUTOCLAIM', KEYS[3], 'workers', ARGV[1], 0, ARGV[3], 'COUNT', ARGV[4])
return {1, reply[1], reply[2], reply[3] or {}}
"""

# An ended call: ack what is still pending under us (the end marker behind ``call_ended``,
# claimed but never read once the worker stopped at call_ended). KEYS: up. ARGV: worker.
_ACK_MINE = """
local pending = redis.call('XPENDING', KEYS[1], 'workers', '-', '+', 1000, ARGV[1])
for _, entry in ipairs(pending) do redis.call('XACK', KEYS[1], 'workers', entry[1]) end
return #pending
"""

# KEYS: owner. ARGV: worker. Delete the lease only if it is still ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_FENCED_SHA = hashlib.sha1(_FENCED.encode()).hexdigest()  # noqa: S324 - Redis's script id
_CLAIM_UP_SHA = hashlib.sha1(_CLAIM_UP.encode()).hexdigest()  # noqa: S324

# The unfenced form of each fenced op, for a bus writing to a call it does not own (tests, tools).
_PLAIN: dict[str, Callable[..., list[tuple[Any, ...]]]] = {
    "xack": lambda key, *ids: [("XACK", key, GROUP, *ids)],
    "xadd": lambda key, maxlen, *pairs: [("XADD", key, "MAXLEN", "~", maxlen, "*", *pairs)],
    "hset": lambda key, ttl, *pairs: [("HSET", key, *pairs), ("EXPIRE", key, ttl, "NX")],
}

_LOST = object()  # uplink queue sentinel: another worker took the call
_CLOSED = object()  # queue sentinel: the bus is closing

# A stream entry of an event: field ``e``, the JSON text of ``protocol.pack``, and one field
# ``b:<name>`` per bytes field (``Audio.payload``: ``b:payload``) holding the raw bytes. A 1.0
# entry has ``e`` only, its bytes fields base64 text inside it (``protocol.decode`` reads both).
_BINARY = b"b:"


def _entry_fields(text: str, binaries: protocol.Binaries) -> tuple[str | bytes, ...]:
    """The field/value arguments of XADD for an event."""
    if not binaries:
        return ("e", text)
    return ("e", text, *(x for name, value in binaries for x in ("b:" + name, value)))


_MALFORMED = itertools.count(1)


def _entry_event(fields: dict[bytes, bytes], where: str) -> dict[str, Any] | None:
    """The wire object of a stream entry written by :func:`_entry_fields` (or by 1.0); None,
    logged, for an entry no bus wrote (no ``e`` field, not a JSON object: a foreign producer, a
    hand-made XADD). Such an entry is skipped and acked: raising here would end the iterator
    on every owner in turn, leaving the call served by nobody."""
    try:
        text = fields[b"e"]
        if len(fields) == 1:
            event = protocol.unpack(text)
        else:
            event = protocol.unpack(text, tuple((k[2:].decode(), v) for k, v in fields.items()
                                               if k.startswith(_BINARY)))
        if isinstance(event, dict):
            return event
        problem = f"a JSON {type(event).__name__}, not an object"
    except (KeyError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are these
        problem = "no 'e' field" if isinstance(exc, KeyError) else f"not JSON ({exc})"
    n = next(_MALFORMED)
    if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood of them logs a line per doubling
        log.warning("bus: skipped a malformed stream entry on %s (%s); %d skipped in all",
                    where, problem, n)
    return None


def _sid(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _err_code(exc: BaseException) -> str:
    return str(exc).split(" ", 1)[0]


class _State(enum.Enum):
    NEW = "new"  # built; no connection yet (start() or the first call opens it)
    OPEN = "open"  # serving
    CLOSING = "closing"  # aclose() is flushing and handing calls back
    CLOSED = "closed"  # done; every method raises BusClosedError


@dataclass(eq=False)
class _Owned:
    """A call this bus holds the lease on, for one worker id."""

    call_sid: str
    worker_id: str
    info: CallInfo | None
    token: str  # the fencing token of our lease
    gateway: str | None = None  # the liveness key's id of the gateway that opened the call
    entry_ids: set[str] = field(default_factory=set)  # its pending entries in cg:calls
    queue: asyncio.Queue[Any] | None = None  # the running uplink() iterator's queue
    announced: str | None = None  # our re-announcement's entry, until we see it pending

    def entries(self) -> list[str]:
        """Every cg:calls entry that announces this call, for acking when it ends."""
        return sorted({*self.entry_ids, *([self.announced] if self.announced else [])})


class _Sub:
    """One iterator's inbox, filled by a reader task."""

    __slots__ = ("queue", "last", "call_sid", "token")

    def __init__(self, call_sid: str = "") -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.last: tuple[int, int] = (0, 0)  # highest id put in the queue
        self.call_sid = call_sid
        self.token = ""
        """The claim token the inbox's uplink was opened under ("": a reader that owns nothing,
        e.g. a tool). Kept here, not looked up per read: a call dropped from the bus's owned set
        must not read on with the empty token, which _CLAIM_UP takes as "unfenced"."""


RECORD_ONCE_TIMEOUT_S = 0.5
"""The longest ``record_once`` waits for Redis before it says the server cannot answer."""

STEP_FLUSH_S = 1.0
"""The longest a worker's next message waits for its previous step's writes (then it goes
on; the writes stay queued in order)."""


_POOL_LOG_EVERY_S = 10.0
"""At most one "connection pool exhausted" line this often (a burst hits it once per command)."""


def _pool_limit(client: Any) -> object:
    pool = getattr(client, "connection_pool", None)
    return getattr(pool, "max_connections", "?")


class _Outage:
    """The bus's view of its server: one log line when it goes, one when it is back.

    Back means: the server answers again and every write buffered up to that moment is written.
    Not "the buffer is empty": a busy bus queues new writes during every round trip, so its
    buffer is rarely empty at the instant a batch lands. With that test the gateways of
    bench.chaos (20 calls each, 2 cores at load 13-15) said "is back after" 46.8, 22.0, 279 and
    414 s after 8 s outages, and reported ``redis_down`` all that time, while their writes were
    flowing (every call on them had its key presses answered); a worker skipped its per-step
    flush that long (``_step_written``). One gateway bus at 40 calls x 50 events/s (quiet machine,
    load 1.7), Redis SIGKILLed for 8.2 s: the old test said back 4.9 s after the restart, this one
    0.7 s after, once the 8.7k writes buffered were written. tests/bus/test_redis_reconnect.py
    keeps the buffer busy for good: before this the bus said back only when the traffic stopped.
    """

    def __init__(self, bus: RedisBus) -> None:
        self._bus = bus
        self.since: float | None = None
        # The buffer's last seq when the server first answered again: back once it is written.
        self._backlog: int | None = None
        self.last_failure = -math.inf  # monotonic time of the latest failed command, any task
        self._pool_logged_at = -math.inf
        self._pool_unlogged = 0

    def lost(self, exc: BaseException) -> None:
        if isinstance(exc, MaxConnectionsError):
            self._pool_exhausted(exc)
            return
        self.last_failure = time.monotonic()
        self._backlog = None  # failed again mid-flush: back only after the server answers anew
        if self.since is not None:
            return
        self.since = time.monotonic()
        self._bus.counters["outages"] += 1
        buf = self._bus._buf
        log.warning(
            "bus %s: lost Redis at %s (%s: %s); buffering writes in order (%d pending, "
            "limit %d, oldest non-critical dropped beyond) and retrying with backoff",
            self._bus.bus_id, self._bus._where, type(exc).__name__, exc, len(buf), buf.max_ops,
        )  # fmt: skip

    def _pool_exhausted(self, exc: MaxConnectionsError) -> None:
        """redis-py's connection pool had no connection left for a command (its default limit
        is 100; seen at 300 calls): this process is busy, the server is fine. The command is
        retried with backoff like any failed one, but the bus does not go into an outage (that
        logs "lost Redis", reports ``redis_down``, answers ``record_once`` with "unreachable"
        at once, skips the per-step flush and holds back every claim of orphaned calls after
        it "comes back"). Counted (``pool_exhausted`` in ``stats()``), logged at most once per
        ``_POOL_LOG_EVERY_S`` with how many were not."""
        bus = self._bus
        bus.pool_exhausted += 1
        now = time.monotonic()
        if now - self._pool_logged_at < _POOL_LOG_EVERY_S:
            self._pool_unlogged += 1
            return
        log.warning(
            "bus %s: the Redis connection pool is exhausted (%s; pool limit %s); the command is "
            "retried with backoff; not an outage (%d more since the last such line)",
            bus.bus_id, exc, _pool_limit(bus._redis), self._pool_unlogged,
        )  # fmt: skip
        self._pool_logged_at = now
        self._pool_unlogged = 0

    def ok(self) -> None:
        """The server answered a command (the writer calls it after every written batch)."""
        if self.since is None:
            return
        buf = self._bus._buf
        if self._backlog is None:
            self._backlog = buf.last_seq
        if buf.committed_seq < self._backlog:
            return  # the writer says it when the outage's backlog is written
        log.warning(
            "bus %s: Redis at %s is back after %.1fs; buffered writes flushed in order "
            "(%d dropped on overflow so far)",
            self._bus.bus_id, self._bus._where, time.monotonic() - self.since, buf.dropped_total,
        )  # fmt: skip
        self.since = None
        self._backlog = None
        self._bus.counters["reconnects"] += 1


class RedisBus(Bus):
    """Redis Streams implementation of :class:`~bus.Bus` (redis-py asyncio).

    Args:
        url: ``redis://`` or ``rediss://`` URL of one Redis (a primary), or
            ``redis+cluster://host:port,host:port,...`` (``rediss+cluster://`` for TLS) naming
            some nodes of a Redis Cluster (the client discovers the rest).
        prefix: first part of every key, to share one Redis between deployments or tests.
        bus_id: this instance's name (eid prefix, wake keys); random by default.
        stream_maxlen: approximate cap of each uplink/downlink stream (XADD MAXLEN ~).
        calls_maxlen: approximate cap of the pool-wide calls stream (a backstop; see module).
        call_ttl_s: how long a call's keys outlive ``close_call``.
        max_call_s: TTL set on a call's keys when opened, so a gateway that dies mid-call
            leaves nothing behind forever.
        heartbeat_interval_s: how often a worker renews its liveness key and call leases.
        worker_ttl_s: liveness key and lease TTL: a dead worker's calls are free after this.
        claim_idle_ms: idle time after which a call entry is considered orphaned; default
            ``worker_ttl_s + heartbeat_interval_s``.
        claim_interval_s: how often a claim loop scans for orphaned calls.
        claim_batch: new calls one claim read may take.
        block_ms: the longest a reader blocks before it re-issues its read.
        streams_per_read: the most call streams one blocking read (one connection) covers.
        buffer_max: writes kept while Redis is away before dropping non-critical ones.
        batch_max: writes sent in one pipeline.
        backoff_base_s, backoff_cap_s: reconnect backoff (exponential with full jitter).
        socket_timeout_s, connect_timeout_s: per-command and connect timeouts.
        read_retries: retries of a one-off read (``load_context``) before BusUnavailableError.
        close_timeout_s: how long ``aclose`` waits to flush buffered writes.
        trim_interval_s: how often a claim loop trims the calls stream.
        gateway_ttl_s: TTL of a gateway's liveness key (renewed every ``heartbeat_interval_s``
            once it has opened a call); default ``worker_ttl_s``.
        gateway_grace_s: how long a worker must see a gateway's liveness key missing, on
            consecutive successful heartbeats, before it ends that gateway's calls. It covers
            a live gateway re-setting its key after Redis came back (reconnect backoff, at most
            ``backoff_cap_s``, plus one beat).
        dead_call_ttl_s: TTL of the keys of a call ended because its gateway died.
        slot_groups: Redis Cluster only: the hash tags calls are spread over. A call's keys
            share the tag ``{g<n>}`` (n from the call sid), so one blocking read can watch every
            call of a group (a multi-key command must stay in one slot): a reader holds at most
            one connection per group it has calls in, rather than one per call. More groups
            spread calls more evenly over the primaries, for more reading connections.
        calls_shards: how many streams the calls registry is split over (``<prefix>:calls``
            when 1; ``<prefix>:calls:{c<k>}`` otherwise, a call's entries always in one). Default
            1 on one server, 8 on a Cluster, so that no single key (one primary) carries every call.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "cg",
        bus_id: str | None = None,
        stream_maxlen: int = 10_000,
        calls_maxlen: int = 100_000,
        call_ttl_s: float = 3600.0,
        max_call_s: float = 24 * 3600.0,
        heartbeat_interval_s: float = 0.5,
        worker_ttl_s: float = 2.0,
        claim_idle_ms: int | None = None,
        claim_interval_s: float = 0.5,
        claim_batch: int = 4,
        block_ms: int = 5000,
        streams_per_read: int = 64,
        buffer_max: int = 10_000,
        batch_max: int = 512,
        backoff_base_s: float = 0.05,
        backoff_cap_s: float = 1.0,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        read_retries: int = 5,
        close_timeout_s: float = 5.0,
        trim_interval_s: float = 30.0,
        gateway_ttl_s: float | None = None,
        gateway_grace_s: float = 3.0,
        dead_call_ttl_s: float = 10.0,
        slot_groups: int = 64,
        calls_shards: int | None = None,
    ) -> None:
        super().__init__(bus_id=bus_id)
        check_name(prefix, "prefix")
        if worker_ttl_s <= heartbeat_interval_s:
            raise ValueError("worker_ttl_s must exceed heartbeat_interval_s")
        self._url = url
        self._prefix = prefix
        self._cluster = url.startswith(CLUSTER_SCHEMES)
        self._nodes: list[tuple[str, int]] = []
        self._auth: dict[str, Any] = {}
        if self._cluster:
            self._nodes, self._auth = _parse_cluster_url(url)
        if slot_groups < 1:
            raise ValueError("slot_groups must be at least 1")
        self._slot_groups = int(slot_groups)
        shards = (8 if self._cluster else 1) if calls_shards is None else int(calls_shards)
        if shards < 1:
            raise ValueError("calls_shards must be at least 1")
        self._calls_keys = (
            [f"{prefix}:calls"] if shards == 1 else [f"{prefix}:calls:{{c{k}}}" for k in range(shards)]
        )
        self._stream_maxlen = int(stream_maxlen)
        self._calls_maxlen = int(calls_maxlen)
        self._call_ttl = max(1, int(call_ttl_s))
        self._max_call = max(1, int(max_call_s))
        self._hb_interval = heartbeat_interval_s
        self._lease_ms = max(1, int(worker_ttl_s * 1000))
        self._claim_idle_ms = (
            int(claim_idle_ms)
            if claim_idle_ms is not None
            else int((worker_ttl_s + heartbeat_interval_s) * 1000)
        )
        # Entries handed back are marked this long idle, so the next claim scan anywhere
        # takes them at once.
        self._handed_back_idle_ms = 10 * self._claim_idle_ms + 86_400_000
        self._claim_interval = claim_interval_s
        self._claim_batch = claim_batch
        self._block_ms = int(block_ms)
        self._streams_per_read = max(1, int(streams_per_read))
        self._batch_max = batch_max
        self._backoff = make_backoff(backoff_base_s, backoff_cap_s)
        self._socket_timeout = socket_timeout_s
        self._connect_timeout = connect_timeout_s
        self._read_retry = make_retry(read_retries, backoff_base_s, backoff_cap_s)
        self._close_timeout = close_timeout_s
        self._trim_interval = trim_interval_s
        gateway_ttl = worker_ttl_s if gateway_ttl_s is None else gateway_ttl_s
        if gateway_ttl <= heartbeat_interval_s:
            raise ValueError("gateway_ttl_s must exceed heartbeat_interval_s")
        self._gateway_ttl_ms = max(1, int(gateway_ttl * 1000))
        self._gateway_grace = float(gateway_grace_s)
        self._dead_call_ttl = max(1, int(dead_call_ttl_s))
        # This process's liveness as a gateway: random per bus, so a gateway restarted after
        # kill -9 (even with the same bus_id) never vouches for its predecessor's calls.
        self.incarnation: str = uuid.uuid4().hex[:16]
        """The id of this bus's gateway liveness key (``<prefix>:gateway:<incarnation>``)."""

        self._state = _State.NEW
        self._buf = OutboundBuffer(buffer_max)
        self._outage = _Outage(self)
        self.pool_exhausted = 0
        """Commands that found redis-py's connection pool exhausted (retried; not an outage)."""
        self._redis: Any = None  # Redis, or RedisCluster
        self._topology: Any = None  # a Cluster: the client that finds each slot's primary
        self._closing: asyncio.Future[None] | None = None
        self._wake_writer: asyncio.Event | None = None
        self._flush_waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writer: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._workers: set[str] = set()
        self._owned: dict[str, _Owned] = {}
        self._up_readers: dict[str, _Reader] = {}
        self._down_reader: _Reader | None = None
        self._up_seen: dict[str, SeenWindow] = {}
        self._closed_calls: dict[str, None] = {}  # calls this bus closed (bounded, newest last)
        self._lost: dict[str, None] = {}  # calls our workers lost to another (bounded, newest last)
        self._gateway_task: asyncio.Task[None] | None = None
        self._gateway_missing: dict[str, float] = {}  # gateway -> first beat that saw it gone
        self._scripts_ready = False  # the writer's connection has loaded _FENCED
        self._where = url.split("@")[-1]  # never log credentials
        self._host = socket.gethostname()

    def stats(self) -> dict[str, float]:
        """The counters, plus: writes waiting for the server (``buffered_writes``), writes
        dropped on buffer overflow so far (``writes_dropped``), 1 while the server is away
        (``redis_down``), commands that found the connection pool exhausted
        (``pool_exhausted``, not an outage) and the calls this bus's workers own
        (``calls_owned``)."""
        return {**self.counters, "buffered_writes": len(self._buf),
                "writes_dropped": self._buf.dropped_total,
                "redis_down": 0 if self._outage.since is None else 1,
                "pool_exhausted": self.pool_exhausted,
                "calls_owned": len(self._owned)}

    # -- keys -----------------------------------------------------------------------------
    def _group(self, call_sid: str) -> int | None:
        """The call's slot group on a Cluster (see ``slot_groups``); None on one server."""
        if not self._cluster:
            return None
        return zlib.crc32(call_sid.encode()) % self._slot_groups

    def _key(self, call_sid: str, part: str) -> str:
        if self._cluster:
            return f"{self._prefix}:{{g{self._group(call_sid)}}}:{call_sid}:{part}"
        return f"{self._prefix}:{{{call_sid}}}:{part}"

    def _calls_key_for(self, call_sid: str) -> str:
        """The registry shard that holds every entry announcing ``call_sid``."""
        keys = self._calls_keys
        if len(keys) == 1:
            return keys[0]
        return keys[zlib.crc32(b"calls:" + call_sid.encode()) % len(keys)]

    def _worker_key(self, worker_id: str) -> str:
        return f"{self._prefix}:worker:{worker_id}"

    def _wake_key(self, role: str, group: int | None = None) -> str:
        if group is not None:  # in the slot of the calls its reader watches
            return f"{self._prefix}:{{g{group}}}:wake:{self.bus_id}:{role}"
        return f"{self._prefix}:wake:{self.bus_id}:{role}"

    def _gateway_key(self, incarnation: str) -> str:
        return f"{self._prefix}:gateway:{incarnation}"

    # -- lifecycle ------------------------------------------------------------------------
    def _client(self, *, blocking: bool = False) -> Any:
        timeout = self._socket_timeout + (self._block_ms / 1000 if blocking else 0.0)
        if self._cluster:
            return RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in self._nodes],
                retry=Retry(NoBackoff(), 1),  # one retry after a MOVED/refresh; the bus backs off itself
                socket_timeout=timeout,
                socket_connect_timeout=self._connect_timeout,
                client_name=f"callgate-bus-{self.bus_id}",
                driver_info=None,
                **self._auth,
            )
        client: Redis = Redis.from_url(
            self._url,
            retry=Retry(NoBackoff(), 0),  # the bus retries itself, with its own backoff
            socket_timeout=timeout,
            socket_connect_timeout=self._connect_timeout,
            single_connection_client=blocking,
            client_name=f"callgate-bus-{self.bus_id}",
            driver_info=None,  # skip CLIENT SETINFO on every (re)connect
        )
        return client

    async def _node_client(self, key: str, *, refresh: bool) -> Redis:
        """A Cluster only: a one-connection client to the primary that serves ``key``'s slot,
        for a reader's blocking reads (a Cluster client cannot lend a raw connection).
        ``refresh``: re-read the topology first (after a failure: a failover moved the slot).
        Lookups go through a client of their own: re-reading the topology of the client the
        writer uses would swap its nodes under its in-flight pipeline."""
        if self._topology is None:
            self._topology = self._client()
        cluster = self._topology
        if refresh:
            await cluster.nodes_manager.initialize()
        else:
            await cluster.initialize()
        node = cluster.get_node_from_key(key)
        return Redis(
            host=node.host,
            port=node.port,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=self._socket_timeout + self._block_ms / 1000,
            socket_connect_timeout=self._connect_timeout,
            single_connection_client=True,
            client_name=f"callgate-bus-{self.bus_id}",
            driver_info=None,
            **self._auth,
        )

    async def start(self) -> None:
        if self._state is _State.OPEN:
            return
        if self._state is not _State.NEW:
            raise BusClosedError("this bus is closed; build a new one")
        loop = asyncio.get_running_loop()
        self._redis = self._client()
        self._acquire_script = self._redis.register_script(_ACQUIRE)
        self._closing = loop.create_future()
        self._wake_writer = asyncio.Event()
        self._state = _State.OPEN
        self._writer = self._spawn(self._writer_loop(), "writer")

    def _spawn(self, coro: Awaitable[T], name: str) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        task.set_name(f"callgate-bus-{self.bus_id}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("bus %s: task %s died", self.bus_id, task.get_name(), exc_info=task.exception())

    async def _open(self) -> Redis:
        if self._state is _State.NEW:
            await self.start()
        if self._state is not _State.OPEN:
            raise BusClosedError("the bus is closed")
        assert self._redis is not None
        return cast(Redis, self._redis)  # or a RedisCluster: typed by the commands they share

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise BusClosedError("the bus is closed")

    async def _sleep(self, delay: float) -> None:
        """Sleep, but raise BusClosedError as soon as the bus starts closing."""
        assert self._closing is not None
        # asyncio.wait, not wait_for: on Python 3.11 wait_for swallows a cancellation that
        # lands as the awaited future completes (see _flush_until).
        await asyncio.wait({self._closing}, timeout=delay)
        self._check_open()

    async def _until_closed(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless the bus starts closing first (then cancel it, BusClosedError)."""
        assert self._closing is not None
        task = asyncio.ensure_future(aw)
        try:
            waiters: set[asyncio.Future[Any]] = {task, self._closing}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await _cancel(task)  # before the caller closes the connection it runs on
            raise
        if not task.done():
            await _cancel(task)
            raise BusClosedError("the bus is closed")
        return task.result()

    async def _until_ok(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` until it gets through to Redis, backing off; only closing stops it."""
        failures = 0
        while True:
            self._check_open()
            try:
                result = await self._until_closed(fn())
            except _CONNECTION_ERRORS as exc:
                failures += 1
                self._outage.lost(exc)
                await self._sleep(self._backoff.compute(failures))
                continue
            self._outage.ok()
            return result

    async def aclose(self) -> None:
        if self._state in (_State.CLOSING, _State.CLOSED):
            return
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            return
        self._state = _State.CLOSING
        assert self._closing is not None and self._redis is not None
        self._closing.set_result(None)
        for reader in [*self._up_readers.values(), self._down_reader]:
            if reader is not None:
                reader.close()
        for owned in self._owned.values():
            if owned.queue is not None:
                owned.queue.put_nowait(_CLOSED)
        if self._heartbeat is not None:
            await _cancel(self._heartbeat)  # no renewal may race the hand-back below
        if self._gateway_task is not None:
            await _cancel(self._gateway_task)
        if not await self._flush_until(self._close_timeout):
            log.error(
                "bus %s: closing with %d writes not stored (Redis at %s unreachable)",
                self.bus_id, len(self._buf), self._where,
            )  # fmt: skip
        await self._hand_back_calls()
        self._state = _State.CLOSED
        for task in list(self._tasks):
            await _cancel(task)
        wakes = [k for r in (*self._up_readers.values(), self._down_reader) if r for k in r.wake_keys]
        if self._gateway_task is not None:
            # A gateway that closes serves none of its calls any more: workers end those left.
            wakes.append(self._gateway_key(self.incarnation))
        if wakes:
            with contextlib.suppress(*_CONNECTION_ERRORS):
                await self._redis.delete(*wakes)
        await self._redis.aclose()
        if self._topology is not None:
            await self._topology.aclose()

    async def _hand_back_calls(self) -> None:
        """Give the calls this bus still owns to the pool at once (no waiting for the lease)."""
        if not self._owned or self._redis is None:
            return
        pipe = self._redis.pipeline(transaction=False)
        for owned in self._owned.values():
            pipe.eval(_RELEASE, 1, self._key(owned.call_sid, "owner"), owned.worker_id)
            if owned.entries():
                # Mark the entries long idle so the next claim scan anywhere takes them.
                pipe.xclaim(
                    self._calls_key_for(owned.call_sid), GROUP, owned.worker_id, 0, owned.entries(),
                    idle=self._handed_back_idle_ms, justid=True,
                )  # fmt: skip
        try:
            await asyncio.wait_for(pipe.execute(raise_on_error=False), self._socket_timeout)
        except _CONNECTION_OR_TIMEOUT as exc:
            log.warning("bus %s: could not hand back %d calls: %s", self.bus_id, len(self._owned), exc)
        self._owned.clear()

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        if getattr(self, "_state", None) in (_State.OPEN, _State.CLOSING):
            _warn(f"unclosed RedisBus {self.bus_id}", ResourceWarning, source=self, stacklevel=1)

    # -- the writer -----------------------------------------------------------------------
    def _enqueue(self, op: Op) -> None:
        for victim in self._buf.push(op):
            dropped = self._buf.dropped_total
            if dropped == 1 or dropped % 1000 == 0:
                log.error(
                    "bus %s: write buffer full (%d): dropped %d non-critical events so far "
                    "(latest: %s for call %s)",
                    self.bus_id, self._buf.max_ops, dropped, victim.kind, victim.call_sid,
                )  # fmt: skip
        assert self._wake_writer is not None
        self._wake_writer.set()

    async def _writer_loop(self) -> None:
        assert self._wake_writer is not None
        redis = self._redis
        assert redis is not None
        failures = 0
        isolate = 0  # after a batch failed not for the connection: ops to write one at a time
        while True:
            batch = self._buf.take(1 if isolate else self._batch_max)
            isolate = max(0, isolate - 1)
            if not batch:
                self._wake_writer.clear()
                await self._wake_writer.wait()
                continue
            pipe = redis.pipeline(transaction=False)
            loading = not self._scripts_ready
            if loading and not self._cluster:
                pipe.execute_command("SCRIPT", "LOAD", _FENCED)
            for op in batch:
                for command in op.commands:
                    pipe.execute_command(*command)
            try:
                if loading and self._cluster:
                    await redis.script_load(_FENCED)  # a Cluster client sends it to every primary
                results = await pipe.execute(raise_on_error=False)
            except _CONNECTION_ERRORS as exc:
                self._buf.requeue()
                self._scripts_ready = False  # a new connection may be a new (empty) server
                failures += 1
                self._outage.lost(exc)
                await asyncio.sleep(self._backoff.compute(failures))
                continue
            except asyncio.CancelledError:
                self._buf.requeue()
                raise
            except Exception as exc:  # noqa: BLE001 - a command that cannot be sent, not the link
                # One bad op must not end the only writer (every later ack, save and downlink
                # write would queue forever while calls seemed to go on): find it by writing the
                # batch one op at a time, and drop it alone, loudly.
                if len(batch) > 1:
                    self._buf.requeue()
                    isolate = len(batch)
                    continue
                self._buf.commit()
                log.error("bus %s: dropped a %s write for call %s that could not be sent: %r",
                          self.bus_id, batch[0].kind, batch[0].call_sid, exc)
                self._wake_flush_waiters()
                continue
            if loading:
                if not self._cluster:
                    results = results[1:]
                self._scripts_ready = True
            if any(isinstance(r, NoScriptError) for r in results):
                # The server forgot the script (SCRIPT FLUSH, or a restart between two batches):
                # load it and write the batch again; the copies that land twice drop by eid.
                log.warning("bus %s: Redis lost the fencing script; loading it again", self.bus_id)
                self._buf.requeue()
                self._scripts_ready = False
                continue
            failures = 0
            self._buf.commit()
            self._outage.ok()
            self._report(batch, results)
            self._wake_flush_waiters()

    def _wake_flush_waiters(self) -> None:
        waiters, self._flush_waiters = self._flush_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _report(self, batch: list[Op], results: list[Any]) -> None:
        at = 0
        for op in batch:
            for command, result in zip(op.commands, results[at : at + len(op.commands)], strict=True):
                if isinstance(result, ResponseError) and _err_code(result) not in ("BUSYGROUP", "NOGROUP"):
                    log.error("bus %s: %s %s for call %s failed: %s",
                              self.bus_id, op.kind, command[0], op.call_sid or "-", result)  # fmt: skip
                elif op.fence is not None and command[0] == "EVALSHA" and result == 0:
                    self._fenced_out(op.call_sid, *op.fence, op.kind)
            at += len(op.commands)

    # -- fencing ----------------------------------------------------------------------------
    def _fenced(
        self, kind: str, call_sid: str, key: str, op: str, *args: Any, critical: bool = True
    ) -> Op | None:
        """The op that writes ``key`` of a call under this bus's lease on it (see _FENCED);
        a plain op when this bus does not own the call; None (nothing to write) when one of
        its workers lost the call to another: a stale worker acts on nothing."""
        owned = self._owned.get(call_sid)
        if owned is None:
            if call_sid in self._lost:
                log.debug("bus %s: %s for call %s dropped: the call was taken over",
                          self.bus_id, kind, call_sid)  # fmt: skip
                return None
            return Op(kind, call_sid, _PLAIN[op](key, *args), critical=critical)
        command = ("EVALSHA", _FENCED_SHA, 3, self._key(call_sid, "owner"), self._key(call_sid, "fence"),
                   key, owned.worker_id, owned.token, op, *args)  # fmt: skip
        return Op(kind, call_sid, [command], critical=critical, fence=(owned.worker_id, owned.token))

    def _fenced_out(self, call_sid: str, worker_id: str, token: str, what: str) -> None:
        """Redis refused a write (or claim) of ours: another worker owns the call now."""
        owned = self._owned.get(call_sid)
        if owned is not None and owned.worker_id == worker_id and owned.token == token:
            log.warning(
                "bus %s: worker %s lost call %s (fencing token %s is stale: another worker took "
                "it over while this one was not renewing its lease); %s refused, and every later "
                "write for the call is dropped here", self.bus_id, worker_id, call_sid, token, what,
            )  # fmt: skip
            self._drop_owned(owned, _LOST)
        elif call_sid not in self._lost:
            self._mark_lost(call_sid)

    def _mark_lost(self, call_sid: str) -> None:
        self._lost[call_sid] = None
        if len(self._lost) > 100_000:
            del self._lost[next(iter(self._lost))]

    async def holds(self, call_sid: str) -> bool:
        owned = self._owned.get(call_sid)
        if owned is None:
            return call_sid not in self._lost
        try:
            code, _, _ = await self._acquire(call_sid, owned.worker_id, orphan=False, held=owned.token)
        except _CONNECTION_ERRORS as exc:
            self._outage.lost(exc)
            return True  # cannot tell: the fences still guard every write to the call
        if code == 0:
            self._fenced_out(call_sid, owned.worker_id, owned.token, "checking the lease")
        return code != 0

    async def _step_written(self) -> None:
        """Before the next uplink message is handed out, wait (up to STEP_FLUSH_S) until what
        the handler's step queued (its ack, save and downlink) is written.

        Messages already in hand (a claim's pending history, a read's batch in the queue) come
        without any await that suspends, and the writer is write-behind: a worker handling a
        batch of 60 ran ahead of its writes by the whole batch, so a worker killed in the middle
        had written nothing of its last 20-60 steps and the one taking over did them all again
        (tests/bus/test_redis_faults.py: 3 of 5 runs on a loaded machine). With this a step
        waits one round trip (~0.3 ms on loopback) and a kill replays at most the step in
        hand. While Redis is down the buffer carries the writes and the call goes on."""
        if self._outage.since is not None:
            await asyncio.sleep(0)  # still let the writer retry
            return
        await self._flush_until(STEP_FLUSH_S)

    async def _flush_until(self, timeout: float | None) -> bool:
        target = self._buf.last_seq
        deadline = None if timeout is None else time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        while self._buf.committed_seq < target:
            if self._writer is None or self._writer.done():
                return False
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            waiter: asyncio.Future[None] = loop.create_future()
            self._flush_waiters.append(waiter)
            # asyncio.wait, not wait_for: on Python 3.11 wait_for returns the result of a
            # future that completed as the caller was cancelled, and swallows the cancellation.
            # A worker's call task waits here after every uplink step; a SIGTERM landing as the
            # writer released the waiters was lost, and the call went on reading its uplink:
            # the worker never exited (tests/faults/test_worker_stops.py).
            await asyncio.wait({waiter}, timeout=remaining)
            if not waiter.done():
                waiter.cancel()
                return self._buf.committed_seq >= target
        return True

    async def flush(self, timeout: float | None = None) -> bool:
        if self._state is _State.NEW:
            return True
        self._check_open()
        return await self._flush_until(timeout)

    # -- gateway side ---------------------------------------------------------------------
    async def open_call(self, call: CallInfo) -> None:
        sid = check_name(call.call_sid, "call_sid")
        await self._open()
        info = json.dumps(call.to_dict(), separators=(",", ":"))
        up, down, ctx = self._key(sid, "up"), self._key(sid, "down"), self._key(sid, "ctx")
        if self._gateway_task is None:
            self._gateway_task = self._spawn(self._gateway_loop(), "gateway-liveness")
        self._enqueue(
            Op("open_call", sid, [
                # Our liveness lease first, so no worker ever sees the call without it.
                ("SET", self._gateway_key(self.incarnation), self._gateway_info(), "PX", self._gateway_ttl_ms),
                ("XGROUP", "CREATE", up, GROUP, "0", "MKSTREAM"),
                ("XGROUP", "CREATE", down, GROUP, "0", "MKSTREAM"),
                ("HSET", ctx, "info", info, "gw", self.incarnation),
                ("EXPIRE", up, self._max_call, "NX"),
                ("EXPIRE", down, self._max_call, "NX"),
                ("EXPIRE", ctx, self._max_call, "NX"),
                ("XADD", self._calls_key_for(sid), "MAXLEN", "~", self._calls_maxlen, "*", "call", info,
                 "gw", self.incarnation),
            ])
        )  # fmt: skip

    def _gateway_info(self) -> str:
        return json.dumps({"bus": self.bus_id, "host": self._host, "pid": os.getpid()})

    async def _gateway_loop(self) -> None:
        """Renew this gateway's liveness lease while the bus is open (see ``_watch_gateways``)."""
        assert self._redis is not None
        key, info = self._gateway_key(self.incarnation), self._gateway_info()
        failures = 0
        while self._state is _State.OPEN:
            try:
                await self._redis.set(key, info, px=self._gateway_ttl_ms)
            except _CONNECTION_ERRORS as exc:
                failures += 1
                self._outage.lost(exc)
                await asyncio.sleep(self._backoff.compute(failures))
                continue
            except Exception:
                # A dead loop would have every worker end this gateway's calls: log, go on.
                failures += 1
                log.exception("bus %s: renewing the gateway liveness key failed", self.bus_id)
                await asyncio.sleep(self._backoff.compute(failures))
                continue
            failures = 0
            self._outage.ok()
            await asyncio.sleep(self._hb_interval)

    async def publish(self, call_sid: str, event: Event) -> str:
        return await self._append(call_sid, event, "up", "publish")

    async def send(self, call_sid: str, event: Event) -> str:
        return await self._append(call_sid, event, "down", "send")

    async def _append(self, call_sid: str, event: Event, part: str, kind: str) -> str:
        check_name(call_sid, "call_sid")
        if self._state is not _State.OPEN:
            await self._open()
        stamped, eid, (text, binaries) = self._stamp(event)
        fields = _entry_fields(text, binaries)
        if call_sid in self._closed_calls:
            log.debug("bus %s: %s %s to closed call %s dropped", self.bus_id, kind, stamped["type"], call_sid)
            return eid
        key = self._key(call_sid, part)
        if part == "down":  # a worker's write: under its lease
            op = self._fenced(kind, call_sid, key, "xadd", self._stream_maxlen, *fields,
                              critical=is_critical(stamped))  # fmt: skip
            if op is not None:
                self._enqueue(op)
            return eid
        self._enqueue(
            Op(kind, call_sid,
               [("XADD", key, "MAXLEN", "~", self._stream_maxlen, "*", *fields)],
               critical=is_critical(stamped))
        )  # fmt: skip
        return eid

    async def close_call(self, call_sid: str) -> None:
        check_name(call_sid, "call_sid")
        await self._open()
        if call_sid in self._closed_calls:
            return
        self._remember_closed(call_sid)
        up, down = self._key(call_sid, "up"), self._key(call_sid, "down")
        ttl = self._call_ttl
        self._enqueue(
            Op("close_call", call_sid, [
                ("XADD", up, "MAXLEN", "~", self._stream_maxlen, "*", "c", "end"),
                ("XADD", down, "MAXLEN", "~", self._stream_maxlen, "*", "c", "end"),
                ("SET", self._key(call_sid, "owner"), TOMBSTONE, "EX", ttl),
                ("EXPIRE", up, ttl),
                ("EXPIRE", down, ttl),
                ("EXPIRE", self._key(call_sid, "ctx"), ttl),
                ("EXPIRE", self._key(call_sid, "fence"), ttl),
            ])
        )  # fmt: skip

    def _remember_closed(self, call_sid: str) -> None:
        self._closed_calls[call_sid] = None
        if len(self._closed_calls) > 100_000:
            del self._closed_calls[next(iter(self._closed_calls))]

    async def downlink(self, call_sid: str) -> AsyncIterator[BusMessage]:
        check_name(call_sid, "call_sid")
        await self._open()
        if self._down_reader is None:
            self._down_reader = _Reader(self, "down", None, self._streams_per_read)
        reader = self._down_reader
        key = self._key(call_sid, "down").encode()
        sub = _Sub()
        await reader.add(key, sub, self._group(call_sid))
        seen = SeenWindow()
        try:
            while True:
                item = await sub.queue.get()
                if item is _CLOSED:
                    raise BusClosedError("the bus is closed")
                message_id, fields = item
                if not fields:
                    continue
                if b"c" in fields:
                    return
                event = _entry_event(fields, f"the downlink of {call_sid}")
                if event is None:
                    continue
                id_key = parse_stream_id(_sid(message_id))
                eid = event.get("eid")
                if seen.seen(id_key, eid):
                    continue
                seen.add(id_key, eid)
                yield BusMessage(_sid(message_id), event)
        finally:
            reader.remove(key, sub)

    # -- worker side ----------------------------------------------------------------------
    def _register_worker(self, worker_id: str) -> None:
        self._workers.add(worker_id)
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = self._spawn(self._heartbeat_loop(), "heartbeat")

    async def _acquire(
        self, call_sid: str, worker_id: str, *, orphan: bool, held: str = ""
    ) -> tuple[int, str, str]:
        """(code, owner, fencing token) from _ACQUIRE; ``held``: the token we hold, to check
        that the lease is still ours rather than take the call anew."""
        code, owner, token = await self._acquire_script(
            keys=[self._key(call_sid, "owner"), self._key(call_sid, "up"), self._key(call_sid, "fence")],
            args=[worker_id, self._lease_ms, TOMBSTONE, "1" if orphan else "0", self._max_call, held],
        )
        if int(code) == 2:
            self._lost.pop(call_sid, None)  # ours again, under a new token
        return int(code), _sid(owner), _sid(token)

    async def claim_calls(self, worker_id: str) -> AsyncIterator[CallInfo]:
        check_name(worker_id, "worker_id")
        redis = await self._open()
        self._register_worker(worker_id)
        shards = self._calls_keys
        # One server: one blocking XREADGROUP over every registry shard. A Cluster: a multi-key
        # read must stay in one slot, so one pump task per shard reads it into ``inbox`` (bounded:
        # a loop whose caller is busy reads ahead at most a few entries per shard).
        client = None if self._cluster else self._client(blocking=True)
        # A Cluster: the pumps block on a client of their own. Sharing the writer's, its pipelines
        # waited behind the blocked reads: a worker's saves lagged 50+ events behind its handler
        # (SIGKILL test, 100 events/s), 6-7 with their own client.
        pump_client = self._client(blocking=True) if self._cluster else None
        inbox: asyncio.Queue[tuple[str, str, Any]] = asyncio.Queue(maxsize=self._claim_batch)
        pumps: list[asyncio.Task[None]] = []
        taken: list[CallInfo] = []  # owned by us, not yet handed to the caller
        unread: list[tuple[str, str, Any]] = []  # (shard, id, fields) delivered to us, not yet considered
        try:
            await self._until_ok(lambda: self._create_groups(redis, shards))
            if self._cluster:
                pumps = [self._spawn(self._pump_calls(pump_client, shard, worker_id, inbox), f"claim-{worker_id}-{shard}")
                         for shard in shards]  # fmt: skip
            scanning = 0  # the shard the orphan scan is in
            cursor = "0-0"
            next_scan = 0.0
            next_trim = time.monotonic() + self._trim_interval
            failures = 0
            while True:
                self._check_open()
                while taken:
                    self.counters["calls_claimed"] += 1
                    yield taken.pop(0)
                try:
                    # What the pumps have read is ours to consider before any orphan scan: an
                    # entry left in the inbox idles in our PEL, and a scan on a loaded machine
                    # took our own new call back as an orphan (contract suite, on a cluster).
                    while not inbox.empty():
                        unread.append(inbox.get_nowait())
                    if unread:
                        shard, entry_id, fields = unread[0]
                        info = await self._until_closed(
                            self._consider(shard, entry_id, fields, worker_id, orphan=False)
                        )
                        unread.pop(0)
                        if info is not None:
                            taken.append(info)
                        continue
                    now = time.monotonic()
                    if now >= next_scan and now < self._scan_hold_until():
                        next_scan = self._scan_hold_until()
                        log.info("bus %s: worker %s takes over no call until %.1f s from now: "
                                 "Redis was away, and its owners renew their lapsed leases first",
                                 self.bus_id, worker_id, next_scan - now)  # fmt: skip
                        continue
                    if now >= next_scan:
                        cursor = await self._until_closed(
                            self._scan_orphans(worker_id, shards[scanning], cursor, taken)
                        )
                        if cursor == "0-0":
                            scanning = (scanning + 1) % len(shards)
                            if scanning == 0:
                                next_scan = now + self._claim_interval
                        continue
                    if now >= next_trim:
                        next_trim = now + self._trim_interval
                        await self._until_closed(self._trim_calls())
                    block = max(1, int((next_scan - now) * 1000))
                    if client is None:
                        try:
                            unread.append(await self._until_closed(asyncio.wait_for(inbox.get(), block / 1000)))
                        except asyncio.TimeoutError:
                            continue
                        while not inbox.empty():
                            unread.append(inbox.get_nowait())
                        continue
                    reply = await self._until_closed(
                        client.xreadgroup(GROUP, worker_id, dict.fromkeys(shards, ">"), count=self._claim_batch,
                                          block=block)
                    )  # fmt: skip
                    failures = 0
                    self._outage.ok()
                    for shard, entries in reply or []:
                        unread.extend((_sid(shard), _sid(entry_id), fields) for entry_id, fields in entries)
                except _CONNECTION_ERRORS as exc:
                    failures += 1
                    self._outage.lost(exc)
                    await self._sleep(self._backoff.compute(failures))
                except ResponseError as exc:
                    if _err_code(exc) != "NOGROUP":
                        raise
                    await self._until_ok(lambda: self._create_groups(redis, shards))
        finally:
            for pump in pumps:
                await _cancel(pump)
            while not inbox.empty():
                unread.append(inbox.get_nowait())
            if client is not None:
                await client.aclose()
            if pump_client is not None:
                await asyncio.shield(pump_client.aclose())
            self._give_back(taken, [(shard, entry_id) for shard, entry_id, _ in unread], worker_id)

    def _scan_hold_until(self) -> float:
        """No orphan scan before this (monotonic): one claim-idle period after this bus last
        saw Redis fail. An outage longer than the lease lapses every lease and idles every
        registry entry at once; when Redis is back the owners' heartbeats take their leases
        back (``_RENEW``: lapsed, nobody took it) and touch their entries, and only what is
        still idle after that is orphaned. Without the hold every claim loop raced the owners'
        renewals and live calls moved between live workers at once (bench.chaos: 3 calls w3 ->
        w2 after one 5 s outage). A worker that died during the outage is taken over one
        claim-idle period later than otherwise."""
        return self._outage.last_failure + self._claim_idle_ms / 1000

    async def _pump_calls(
        self, redis: Any, shard: str, worker_id: str, inbox: asyncio.Queue[tuple[str, str, Any]]
    ) -> None:
        """A Cluster's claim loop: read new entries of one registry shard into ``inbox``."""
        failures = 0
        # Blocks well inside the socket timeout; a read costs one round trip per second per shard.
        block = max(1, min(self._block_ms, 1000))
        while self._state is _State.OPEN:
            try:
                reply = await redis.xreadgroup(GROUP, worker_id, {shard: ">"}, count=self._claim_batch, block=block)
            except _CONNECTION_OR_REPLY as exc:
                if isinstance(exc, ResponseError) and _err_code(exc) == "NOGROUP":
                    with contextlib.suppress(*_CONNECTION_ERRORS):
                        await self._create_groups(redis, [shard])
                    continue
                failures += 1
                if isinstance(exc, _CONNECTION_ERRORS) or _is_reroute(exc):
                    self._outage.lost(exc)  # a failover unblocks the read (UNBLOCKED): read again
                else:
                    # A dead pump would leave this shard's new calls to other workers: go on.
                    log.error("bus %s: reading the calls registry %s failed: %s", self.bus_id, shard, exc)
                await asyncio.sleep(self._backoff.compute(failures))
                continue
            except Exception:  # noqa: BLE001 - the client's own failure, not the server's answer
                # redis-py's cluster client can fail a command on a connection that a failover's
                # topology refresh closed under it (AttributeError: its writer is None); this
                # pump died of that and its shard's new calls waited for the other workers
                # (tests/bus/test_cluster.py::test_failover_mid_call_loses_nothing, 1 in ~7 runs).
                failures += 1
                log.exception("bus %s: reading the calls registry %s failed", self.bus_id, shard)
                await asyncio.sleep(self._backoff.compute(failures))
                continue
            failures = 0
            self._outage.ok()
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    await inbox.put((shard, _sid(entry_id), fields))

    def _give_back(self, taken: list[CallInfo], unread: list[tuple[str, str]], worker_id: str) -> None:
        """A claim loop stopped holding calls it took, or entries it read, that its caller never
        got: hand them to the pool at once (ordered behind our other writes). When the bus is
        closing, ``aclose`` hands back every call it owns instead."""
        if self._state is not _State.OPEN:
            return
        entries: dict[str, list[str]] = {}  # registry shard -> entry ids
        for shard, entry_id in unread:
            entries.setdefault(shard, []).append(entry_id)
        for info in taken:
            owned = self._owned.pop(info.call_sid, None)
            if owned is None:
                continue
            entries.setdefault(self._calls_key_for(info.call_sid), []).extend(owned.entries())
            self._enqueue(Op("give_back", info.call_sid,
                             [("EVAL", _RELEASE, 1, self._key(info.call_sid, "owner"), worker_id)]))  # fmt: skip
        for shard, ids in entries.items():
            if ids:
                self._enqueue(Op("give_back", "", [("XCLAIM", shard, GROUP, worker_id, 0, *ids,
                                                    "IDLE", self._handed_back_idle_ms, "JUSTID")]))  # fmt: skip

    async def _scan_orphans(self, worker_id: str, shard: str, cursor: str, taken: list[CallInfo]) -> str:
        """One XAUTOCLAIM page of idle call entries of one registry shard; calls taken go to
        ``taken``. Returns the next cursor. Entries not considered when it fails stay in our
        PEL, found by a later scan (ours or another worker's)."""
        assert self._redis is not None
        reply = await self._redis.xautoclaim(shard, GROUP, worker_id, self._claim_idle_ms, cursor, count=64)
        next_cursor, entries = _sid(reply[0]), reply[1]
        for entry_id, fields in entries:
            info = await self._consider(shard, _sid(entry_id), fields, worker_id, orphan=True)
            if info is not None:
                taken.append(info)
        return next_cursor

    async def _consider(
        self, shard: str, entry_id: str, fields: dict[bytes, bytes] | None, worker_id: str, *, orphan: bool
    ) -> CallInfo | None:
        """Try to take the call an entry of the registry shard ``shard`` announces."""
        assert self._redis is not None
        raw = (fields or {}).get(b"call")
        if raw is None:
            await self._redis.xack(shard, GROUP, entry_id)
            return None
        info = CallInfo.from_dict(json.loads(raw))
        sid = info.call_sid
        gateway = (fields or {}).get(b"gw")
        mine = self._owned.get(sid)
        if mine is not None and orphan:
            # Our own entry went idle: our heartbeat has stalled. Check the lease (and its token)
            # rather than assume it; if another worker has taken the call, let go of it.
            code, owner, _ = await self._acquire(sid, mine.worker_id, orphan=True, held=mine.token)
            if code <= 0:
                self._drop_owned(mine, _LOST if code == 0 else None)
                if code < 0:
                    await self._redis.xack(shard, GROUP, entry_id)
                return None
        if mine is not None:
            # A re-announcement of a call this bus holds: keep it pending, under its worker.
            mine.entry_ids.add(entry_id)
            if mine.announced == entry_id:
                mine.announced = None
            if mine.worker_id != worker_id:
                await self._redis.xclaim(shard, GROUP, mine.worker_id, 0, [entry_id], justid=True)
            return None
        code, owner, token = await self._acquire(sid, worker_id, orphan=orphan)
        if code in (1, 2):
            self._owned[sid] = _Owned(sid, worker_id, info, token, _sid(gateway) if gateway else None,
                                      {entry_id})  # fmt: skip
            # Fencing token 1: no worker ever held the call. The scan found a new call that no
            # read had reached yet (on a loaded machine our own pump may hold it, read but not
            # yet handed over, past the claim idle time): a claim, not a takeover.
            if orphan and token != "1":
                self.counters["orphans_claimed"] += 1
                log.warning("bus %s: worker %s took over call %s with fencing token %s (its worker "
                            "stopped renewing)", self.bus_id, worker_id, sid, token)  # fmt: skip
            return info
        if code < 0:  # ended (or expired): nothing to resume
            await self._redis.xack(shard, GROUP, entry_id)
        # code 0: a live worker owns it; the entry now idles in our PEL until its heartbeat
        # takes it back (XCLAIM), or until it dies and a scan finds it again.
        return None

    async def _trim_calls(self) -> None:
        """Trim each registry shard below its oldest pending entry: older ones are acked."""
        for shard in self._calls_keys:
            await self._trim_shard(shard)

    async def _trim_shard(self, calls: str) -> None:
        assert self._redis is not None
        pending = await self._redis.xpending(calls, GROUP)
        groups = await self._redis.xinfo_groups(calls)
        last = next((g["last-delivered-id"] for g in groups if _sid(g["name"]) == GROUP), None)
        if last is None:
            return
        bound = parse_stream_id(_sid(last))
        if pending.get("pending") and pending.get("min"):
            bound = min(bound, parse_stream_id(_sid(pending["min"])))
        await self._redis.xtrim(calls, minid=f"{bound[0]}-{bound[1]}", approximate=False)

    async def _create_groups(self, redis: Redis, keys: list[str], start: str = "0") -> None:
        pipe = redis.pipeline(transaction=False)
        for key in keys:
            pipe.execute_command("XGROUP", "CREATE", key, GROUP, start, "MKSTREAM")
        for result in await pipe.execute(raise_on_error=False):
            if isinstance(result, ResponseError) and _err_code(result) != "BUSYGROUP":
                raise result

    async def uplink(self, call_sid: str, worker_id: str) -> AsyncIterator[BusMessage]:
        check_name(call_sid, "call_sid")
        check_name(worker_id, "worker_id")
        redis = await self._open()
        self._register_worker(worker_id)
        owned = self._owned.get(call_sid)
        if owned is None or owned.worker_id != worker_id:
            code, owner, token = await self._until_ok(lambda: self._acquire(call_sid, worker_id, orphan=False))
            if code == 0:
                raise CallOwnershipError(call_sid, owner)
            owned = None
            if code > 0:
                owned = self._owned[call_sid] = _Owned(call_sid, worker_id, None, token)
        sub = _Sub(call_sid)
        if owned is not None:
            owned.queue = sub.queue
        seen = self._up_seen.setdefault(call_sid, SeenWindow())
        up = self._key(call_sid, "up")
        token = sub.token = owned.token if owned is not None else ""
        through_raw, gateway, history = await self._until_ok(
            lambda: self._history(redis, call_sid, worker_id, token)
        )
        if history is None:
            assert owned is not None
            self._fenced_out(call_sid, worker_id, token, "taking its pending messages")
            raise OwnershipLostError(call_sid, "?", f"call {call_sid}: another worker took it over")
        if owned is not None and owned.gateway is None and gateway:
            owned.gateway = gateway
        through = parse_stream_id(through_raw) if through_raw else None
        reader = self._up_readers.get(worker_id)
        if reader is None:
            reader = self._up_readers[worker_id] = _Reader(self, f"up:{worker_id}", worker_id, self._streams_per_read)
        key = up.encode()
        ended = False
        try:
            await reader.add(key, sub, self._group(call_sid))
            for message_id, fields in history:
                message = self._accept(call_sid, message_id, fields, seen, through, True)
                if message is _Accepted.END:
                    ended = True
                    return
                if message is not None:
                    yield message
                    await self._step_written()
            while True:
                item = await sub.queue.get()
                if item is _CLOSED:
                    raise BusClosedError("the bus is closed")
                if item is _LOST:
                    raise OwnershipLostError(call_sid, "?", f"call {call_sid}: another worker took it over")
                message = self._accept(call_sid, item[0], item[1], seen, through, False)
                if message is _Accepted.END:
                    ended = True
                    return
                if message is not None:
                    yield message
                    await self._step_written()
        finally:
            reader.remove(key, sub)
            current = self._owned.get(call_sid)
            if current is not None and current.queue is sub.queue:
                current.queue = None
            if ended:
                self._finish(call_sid)

    async def _history(
        self, redis: Redis, call_sid: str, worker_id: str, token: str
    ) -> tuple[str | None, str | None, list[tuple[bytes, dict[bytes, bytes] | None]] | None]:
        """The context's ``through`` mark, the call's gateway, and every pending uplink message
        of the call (an earlier owner's or ours), moved to ``worker_id`` under its lease
        (``token``), in id order; None for the messages when the lease is no longer ours."""
        up = self._key(call_sid, "up")
        through, gateway = await redis.hmget(self._key(call_sid, "ctx"), ["through", "gw"])
        entries: list[tuple[bytes, dict[bytes, bytes] | None]] = []  # None: a deleted entry
        cursor: str = "0-0"
        keys = [self._key(call_sid, "owner"), self._key(call_sid, "fence"), up]
        while True:
            try:
                reply = await _run_script(redis, _TAKE_PENDING, keys, [worker_id, token, cursor, 500])
            except ResponseError as exc:
                if _err_code(exc) != "NOGROUP":
                    raise
                await self._create_groups(redis, [up])
                continue
            if int(reply[0]) == 0:
                return None, None, None
            entries.extend((entry_id, _flat_fields(flat)) for entry_id, flat in reply[2])
            if reply[3]:
                log.error("bus %s: call %s lost %d uplink messages trimmed before being handled",
                          self.bus_id, call_sid, len(reply[3]))  # fmt: skip
            cursor = _sid(reply[1])
            if cursor == "0-0":
                break
        return (_sid(through) if through else None), (_sid(gateway) if gateway else None), entries

    def _accept(
        self,
        call_sid: str,
        raw_id: bytes | str,
        fields: dict[bytes, bytes] | None,
        seen: SeenWindow,
        through: tuple[int, int] | None,
        redelivered: bool,
    ) -> BusMessage | _Accepted | None:
        """Turn one uplink entry into a message, or None to skip it, or ``_Accepted.END``."""
        message_id = _sid(raw_id)
        if not fields:
            return None
        if b"c" in fields:
            self._ack_op(call_sid, message_id)
            return _Accepted.END
        id_key = parse_stream_id(message_id)
        event = _entry_event(fields, f"the uplink of {call_sid}")
        if event is None:
            self._ack_op(call_sid, message_id)
            return None
        eid = event.get("eid")
        if through is not None and id_key <= through:
            self._ack_op(call_sid, message_id)
            return None
        if seen.seen(id_key, eid):
            if id_key > seen.high:  # a copy of an eid handled before
                self._ack_op(call_sid, message_id)
            return None
        seen.add(id_key, eid)
        return BusMessage(message_id, event, redelivered)

    def _finish(self, call_sid: str) -> None:
        """The call's uplink ended: ack its announcement, stop renewing, forget dedup state."""
        owned = self._owned.pop(call_sid, None)
        self._up_seen.pop(call_sid, None)
        if owned is not None and owned.entries():
            self._enqueue(Op("end_claim", call_sid, [("XACK", self._calls_key_for(call_sid), GROUP, *owned.entries())]))

    def _ack_op(self, call_sid: str, message_id: str) -> None:
        op = self._fenced("ack", call_sid, self._key(call_sid, "up"), "xack", message_id)
        if op is not None:
            self._enqueue(op)

    async def ack(self, call_sid: str, message_id: str) -> None:
        check_name(call_sid, "call_sid")
        await self._open()
        parse_stream_id(message_id)
        self._ack_op(call_sid, message_id)

    async def save_context(
        self, call_sid: str, context: dict[str, Any], *, through: str | None = None
    ) -> None:
        check_name(call_sid, "call_sid")
        await self._open()
        if through is not None:
            parse_stream_id(through)
        payload = self._encode_context(call_sid, context)
        ctx = self._key(call_sid, "ctx")
        fields: list[Any] = ["ctx", payload, "by", self.bus_id]
        if through is not None:
            fields += ["through", through]
        op = self._fenced("save_context", call_sid, ctx, "hset", self._max_call, *fields)
        if op is not None:
            op.context = payload
            self._enqueue(op)

    async def load_context(self, call_sid: str) -> dict[str, Any] | None:
        check_name(call_sid, "call_sid")
        redis = await self._open()
        for op in reversed(list(self._buf.pending())):  # read our own unflushed save first
            if op.kind == "save_context" and op.call_sid == call_sid and op.context is not None:
                result: dict[str, Any] = json.loads(op.context)
                return result
        try:
            raw = await self._read_retry.call_with_retry(
                lambda: redis.hget(self._key(call_sid, "ctx"), "ctx"), self._noop
            )
        except _CONNECTION_ERRORS as exc:
            self._outage.lost(exc)
            raise BusUnavailableError(f"could not load the context of {call_sid}: {exc}") from exc
        if raw is None:
            return None
        loaded: dict[str, Any] = json.loads(raw)
        return loaded

    async def record_once(self, call_sid: str, name: str, ttl_s: float) -> bool:
        check_name(call_sid, "call_sid")
        check_name(name, "name")
        redis = await self._open()
        key = self._key(call_sid, f"once:{name}")  # the call's slot: one round trip, any node
        px = max(1, math.ceil(ttl_s * 1000))
        if self._outage.since is not None:  # known down: answer now, the caller has a fallback
            raise BusUnavailableError(f"could not record {name} for {call_sid}: Redis is unreachable")
        try:
            # One bounded try, not the read retries: a gateway spends a stream's token while
            # Twilio waits on the upgrade, and those retries held it 3-15 s in an outage.
            async with asyncio.timeout(RECORD_ONCE_TIMEOUT_S):
                created = await redis.set(key, b"1", nx=True, px=px)
        except _CONNECTION_OR_TIMEOUT as exc:
            self._outage.lost(exc)
            raise BusUnavailableError(f"could not record {name} for {call_sid}: {exc}") from exc
        return bool(created)

    @staticmethod
    async def _noop(_exc: BaseException) -> None:
        return None

    # -- heartbeat ------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        failures = 0
        while self._state is _State.OPEN:
            started = time.monotonic()
            try:
                await self._heartbeat_once()
            except _CONNECTION_ERRORS as exc:
                failures += 1
                self._gateway_missing.clear()  # only beats that reached Redis count as seeing
                self._outage.lost(exc)
            except Exception as exc:  # noqa: BLE001
                # A dead heartbeat silently hands every call of this worker to others, while
                # this worker goes on handling them: log and beat again instead.
                log.exception("bus %s: heartbeat failed: %r", self.bus_id, exc)
            else:
                failures = 0
                self._outage.ok()
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(0.0, self._hb_interval - elapsed))

    async def _heartbeat_once(self) -> None:
        redis = self._redis
        assert redis is not None
        workers = sorted(self._workers)
        # Leases first, in batches, one round trip each, so that a worker with many calls does
        # not hold the event loop for one long pack-and-parse (audio paths share the loop). A
        # worker that was frozen learns here that it lost its calls before it touches their
        # registry entries below (which would move them back from their new owner).
        renewing = list(self._owned.values())
        checked: list[_Owned] = []
        renewed: list[int] = []
        jobs: list[tuple[list[_Owned], list[str], list[Any]]] = []  # (batch, keys, args)
        for worker_id in workers:
            mine = [o for o in renewing if o.worker_id == worker_id]
            # One script may touch one slot only on a Cluster: there, a batch is one slot group.
            by_group: dict[int | None, list[_Owned]] = {}
            for o in mine:
                by_group.setdefault(self._group(o.call_sid), []).append(o)
            for group in by_group.values():
                for at in range(0, len(group), _RENEW_BATCH):
                    batch = group[at : at + _RENEW_BATCH]
                    keys = [k for o in batch for k in (self._key(o.call_sid, "owner"), self._key(o.call_sid, "fence"))]
                    args = [worker_id, self._lease_ms, TOMBSTONE, self._max_call, *(o.token for o in batch)]
                    jobs.append((batch, keys, args))
        if self._cluster:
            # Up to one batch per slot group: one pipeline, sent to every primary at once (one
            # script per round trip took 64 round trips per beat and let leases lapse).
            replies = await self._renew_pipelined(redis, jobs)
        else:
            replies = []
            for _, keys, args in jobs:
                try:
                    replies.append(await _run_script(redis, _RENEW, keys, args))
                except ResponseError as exc:
                    replies.append(exc)
        for (batch, _, _), reply in zip(jobs, replies, strict=True):
            if isinstance(reply, ResponseError):
                log.error("bus %s: lease renewal failed: %s", self.bus_id, reply)
                continue
            checked.extend(batch)
            renewed.extend(int(code) for code in reply)
        owned: list[_Owned] = []
        lapsed: list[str] = []
        for o, result in zip(checked, renewed, strict=True):
            if self._owned.get(o.call_sid) is not o:
                continue  # finished meanwhile
            if result == 0:
                log.warning("bus %s: worker %s lost call %s to another worker (lease lapsed; its "
                            "fencing token %s is stale)", self.bus_id, o.worker_id, o.call_sid, o.token)  # fmt: skip
                self._drop_owned(o, _LOST)
            elif result == -1:
                self._drop_owned(o, None)  # closed: its uplink ends at the end marker
                commands: list[tuple[Any, ...]] = [("EVAL", _ACK_MINE, 1, self._key(o.call_sid, "up"), o.worker_id)]
                if o.entries():
                    commands.append(("XACK", self._calls_key_for(o.call_sid), GROUP, *o.entries()))
                self._enqueue(Op("end_claim", o.call_sid, commands))
            else:
                if result == 2:
                    lapsed.append(o.call_sid)
                owned.append(o)
        if lapsed:
            log.warning("bus %s: leases on %d calls had lapsed (Redis away or lost its data); "
                        "taken back: %s", self.bus_id, len(lapsed), " ".join(lapsed[:10]))  # fmt: skip
        pipe = redis.pipeline(transaction=False)
        for worker_id in workers:
            n = sum(1 for o in owned if o.worker_id == worker_id)
            info = json.dumps({"bus": self.bus_id, "host": self._host, "pid": os.getpid(), "calls": n})
            pipe.set(self._worker_key(worker_id), info, px=self._lease_ms)
        touched: list[str] = []  # the registry shard of each XCLAIM
        for worker_id in workers:
            per_shard: dict[str, set[str]] = {}
            for o in owned:
                if o.worker_id == worker_id:
                    per_shard.setdefault(self._calls_key_for(o.call_sid), set()).update(
                        e for e in (*o.entry_ids, o.announced) if e
                    )
            for shard, ids in per_shard.items():
                if ids:
                    touched.append(shard)
                    pipe.xclaim(shard, GROUP, worker_id, 0, sorted(ids), justid=True)
        waiting = [o for o in owned if o.announced]
        waiting_shards = sorted({self._calls_key_for(o.call_sid) for o in waiting})
        for shard in waiting_shards:
            pipe.xinfo_groups(shard)  # last-delivered-id: is a re-announcement read yet?
        gateways = sorted({o.gateway for o in owned if o.gateway})
        for gateway in gateways:
            pipe.exists(self._gateway_key(gateway))
        results = await pipe.execute(raise_on_error=False)
        at = len(workers)
        claimed = results[at : at + len(touched)]
        at += len(touched)
        undelivered: set[str | None] = set()
        for shard, groups in zip(waiting_shards, results[at : at + len(waiting_shards)], strict=True):
            if isinstance(groups, list):
                last = next((g["last-delivered-id"] for g in groups if _sid(g["name"]) == GROUP), b"0-0")
                delivered = parse_stream_id(_sid(last))
                undelivered |= {o.announced for o in waiting if o.announced and self._calls_key_for(o.call_sid) == shard
                                and parse_stream_id(o.announced) > delivered}  # fmt: skip
        at += len(waiting_shards)
        alive = dict(zip(gateways, results[at:], strict=True))
        still_pending: set[tuple[str, str]] = set()  # (shard, entry id)
        for shard, result in zip(touched, claimed, strict=True):
            if isinstance(result, list):
                still_pending.update((shard, _sid(i)) for i in result)
            elif isinstance(result, ResponseError) and _err_code(result) == "NOGROUP":
                await self._create_groups(redis, [shard])
        for o in owned:
            if self._owned.get(o.call_sid) is not o:
                continue
            shard = self._calls_key_for(o.call_sid)
            if o.announced and (shard, o.announced) in still_pending:
                o.entry_ids.add(o.announced)
                o.announced = None
            o.entry_ids = {e for e in o.entry_ids if (shard, e) in still_pending}
            if not o.entry_ids and o.info is not None and o.announced not in undelivered:
                # Our registry entry vanished (trimmed, or Redis lost its data): without it
                # nobody would find the call if we died. The new entry waits, undelivered,
                # until some claim loop reads it: alive, we get it back; dead, it is taken
                # over. Calls taken with uplink() alone, never claimed, are not registered.
                await self._announce(redis, o)
        self._watch_gateways(owned, alive)

    async def _renew_pipelined(self, redis: Any, jobs: list[tuple[list[_Owned], list[str], list[Any]]]) -> list[Any]:
        """The _RENEW script for every job in one (Cluster) pipeline; a reply or a ResponseError
        per job. Connection and failover errors propagate (the beat failed)."""
        if not jobs:
            return []
        sha = hashlib.sha1(_RENEW.encode()).hexdigest()  # noqa: S324 - Redis's script id
        for attempt in range(2):
            pipe = redis.pipeline(transaction=False)
            for _, keys, args in jobs:
                # The retry sends the script itself: right after a failover the promoted replica
                # may not know it, while the client's topology still names the old primary, so a
                # SCRIPT LOAD to "every primary" missed it and the retry failed again ("lease
                # renewal failed: No matching script", 1 clean-clone run of test_cluster's
                # failover under load). EVAL runs wherever the slot now lives, and caches it.
                if attempt == 0:
                    pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
                else:
                    pipe.execute_command("EVAL", _RENEW, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
            # raise_on_error=False hands back a node's lost connection as a reply too (seen in 1
            # of 12 failovers: "'ConnectionError' object is not iterable" killed the beat).
            lost = next((r for r in results if isinstance(r, _CONNECTION_ERRORS)), None)
            if lost is not None:
                raise lost
            if not any(isinstance(r, NoScriptError) for r in results):
                return list(results)
        return list(results)

    def _watch_gateways(self, owned: list[_Owned], alive: dict[str, Any]) -> None:
        """End the calls whose gateway stopped renewing its liveness key (it died: kill -9, a
        lost machine). Only absence seen on consecutive successful beats for ``gateway_grace_s``
        counts, so a Redis restart (which drops or expires the key until the gateway is back)
        ends nothing."""
        now = time.monotonic()
        for gateway, exists in alive.items():
            if isinstance(exists, int) and exists:
                self._gateway_missing.pop(gateway, None)
            elif isinstance(exists, int):
                self._gateway_missing.setdefault(gateway, now)
        for gateway in [g for g in self._gateway_missing if g not in alive]:
            del self._gateway_missing[gateway]  # none of our calls depends on it any more
        dead = {g for g, since in self._gateway_missing.items() if now - since >= self._gateway_grace}
        for o in owned:
            if o.gateway in dead and self._owned.get(o.call_sid) is o and o.call_sid not in self._closed_calls:
                self._end_dead_call(o, now - self._gateway_missing[o.gateway])

    def _end_dead_call(self, owned: _Owned, missing_s: float) -> None:
        """The call's gateway is gone: end it as the gateway would have (``call_ended`` then the
        end markers), so the agent takes its normal stop path, and let its keys go soon. Our
        lease ends with it (the tombstone), so the next beat stops renewing it."""
        sid = owned.call_sid
        log.warning("bus %s: the gateway of call %s (liveness key %s) has been gone for %.1fs; "
                    "ending the call (call_ended, reason gateway_lost)",
                    self.bus_id, sid, owned.gateway, missing_s)  # fmt: skip
        self._remember_closed(sid)
        event = json.dumps(encode(CallEnded(reason="gateway_lost"), eid=f"{sid}-gateway-lost"),
                           separators=(",", ":"))  # fmt: skip
        up, down, ttl = self._key(sid, "up"), self._key(sid, "down"), self._dead_call_ttl
        self._enqueue(
            Op("end_dead_call", sid, [
                ("XADD", up, "MAXLEN", "~", self._stream_maxlen, "*", "e", event),
                ("XADD", up, "MAXLEN", "~", self._stream_maxlen, "*", "c", "end"),
                ("XADD", down, "MAXLEN", "~", self._stream_maxlen, "*", "c", "end"),
                ("SET", self._key(sid, "owner"), TOMBSTONE, "EX", ttl),
                *(("EXPIRE", self._key(sid, part), ttl) for part in ("up", "down", "ctx", "fence")),
            ])
        )  # fmt: skip
        self.counters["calls_ended_gateway_lost"] += 1

    def _drop_owned(self, owned: _Owned, sentinel: object | None) -> None:
        self._owned.pop(owned.call_sid, None)
        if sentinel is _LOST:
            self.counters["calls_lost"] += 1
            self._mark_lost(owned.call_sid)
        if sentinel is not None and owned.queue is not None:
            owned.queue.put_nowait(sentinel)
        self._up_seen.pop(owned.call_sid, None)

    async def _announce(self, redis: Redis, owned: _Owned) -> None:
        """Put a call we hold back into cg:calls, so that if we die it is found. A claim loop
        (ours, or another worker's that sees us alive and leaves the entry pending) reads it,
        and our next heartbeat's XCLAIM finds it pending again."""
        assert owned.info is not None
        info = json.dumps(owned.info.to_dict(), separators=(",", ":"))
        fields: dict[FieldT, EncodableT] = {"call": info, "owner": owned.worker_id}
        if owned.gateway:
            fields["gw"] = owned.gateway
        entry_id = await redis.xadd(self._calls_key_for(owned.call_sid), fields,
                                    maxlen=self._calls_maxlen, approximate=True)
        # Not pending anywhere until a claim loop reads it; our XCLAIM then finds it.
        owned.announced = _sid(entry_id)


class _Reader:
    """Blocking reads over many streams for one bus: the uplinks of one worker id (XREADGROUP,
    ``group`` mode) or the downlinks of the gateway (XREAD from each inbox's last id).

    Streams are spread over shards of at most ``per_shard`` streams, each shard one task with
    its own connection blocking in one read over all its streams plus its wake stream. A read
    costs Redis and the client in proportion to the streams it names, and every event re-issues
    the read of its shard, so shards keep that cost flat as calls grow, for one connection per
    ``per_shard`` calls rather than one per call.
    """

    def __init__(self, bus: RedisBus, role: str, consumer: str | None, per_shard: int) -> None:
        self.bus = bus
        self.role = role
        self.consumer = consumer  # the XREADGROUP consumer (worker id); None: plain XREAD
        self.per_shard = per_shard
        self.shards: list[_Shard] = []
        self._where: dict[bytes, _Shard] = {}

    async def add(self, key: bytes, sub: _Sub, group: int | None = None) -> None:
        """Watch ``key`` for ``sub``; ``group``: the call's slot group on a Cluster, where one
        shard reads the streams of one group only (one slot, so one blocking read)."""
        shard = self._where.get(key)
        if shard is None:
            shard = next((s for s in self.shards if s.group == group and len(s.subs) < self.per_shard), None)
            if shard is None:
                shard = _Shard(self, len(self.shards), group)
                self.shards.append(shard)
            self._where[key] = shard
        await shard.add(key, sub)

    def remove(self, key: bytes, sub: _Sub) -> None:
        shard = self._where.get(key)
        if shard is not None and shard.remove(key, sub):
            del self._where[key]

    def close(self) -> None:
        for shard in self.shards:
            for subs in shard.subs.values():
                for sub in subs:
                    sub.queue.put_nowait(_CLOSED)

    @property
    def wake_keys(self) -> list[str]:
        return [shard.wake for shard in self.shards]


class _Shard:
    def __init__(self, reader: _Reader, index: int, group: int | None = None) -> None:
        self.reader = reader
        self.bus = reader.bus
        self.group = group
        self.wake = self.bus._wake_key(f"{reader.role}:{index}", group)
        self._wake_b = self.wake.encode()
        self._wake_last = "0-0"
        self.subs: dict[bytes, list[_Sub]] = {}
        self.task: asyncio.Task[None] | None = None
        self._pos: dict[bytes, str] = {}  # uplink mode: each stream's last delivered id
        self._pos_arg: dict[bytes, bytes] = {}  # ... packed as a RESP bulk string
        self._xread_head: tuple[tuple[bytes, ...], bytes] | None = None  # (streams, packed head)

    async def add(self, key: bytes, sub: _Sub) -> None:
        self.subs.setdefault(key, []).append(sub)
        if self.task is None or self.task.done():
            self.task = self.bus._spawn(self._run(), self.wake)
        else:
            await _wake(self.bus, self.wake)

    def remove(self, key: bytes, sub: _Sub) -> bool:
        """Drop ``sub``; True when ``key`` has no inbox left in this shard."""
        subs = self.subs.get(key)
        if subs and sub in subs:
            subs.remove(sub)
        if subs is not None and not subs:
            del self.subs[key]
            self._pos.pop(key, None)
            self._pos_arg.pop(key, None)
            return True
        return False

    async def _run(self) -> None:
        bus = self.bus
        consumer = self.reader.consumer
        client: Redis | None = None if bus._cluster else bus._client(blocking=True)
        failures = 0
        resync = False
        need_groups = consumer is not None
        try:
            while bus._state is _State.OPEN:
                keys = list(self.subs)
                try:
                    if client is None:  # a Cluster: the primary serving this shard's slot, now
                        client = await bus._node_client(self.wake, refresh=failures > 0)
                    if consumer is None:
                        streams: dict[Any, Any] = {self._wake_b: self._wake_last}
                        for key in keys:
                            low = min(s.last for s in self.subs[key])
                            streams[key] = f"{low[0]}-{low[1]}"
                        reply = _stream_reply(await client.xread(streams, count=256, block=bus._block_ms))
                    else:
                        if need_groups:
                            # First run, or Redis lost its data: (re)create the groups we read.
                            await bus._create_groups(client, [k.decode() for k in keys])
                            self._pos.clear()
                            self._pos_arg.clear()
                            need_groups = False
                        if resync:
                            await self._resync(client, consumer, keys)
                            resync = False
                        reply = await self._read_new(client, consumer, keys)
                except _CONNECTION_OR_REPLY as exc:
                    if isinstance(exc, ResponseError) and not _is_reroute(exc):
                        if _err_code(exc) != "NOGROUP":
                            raise
                        need_groups = True
                        continue
                    failures += 1
                    bus._outage.lost(exc)
                    resync = True
                    if bus._cluster and client is not None:
                        # The slot may have moved (failover): find its primary again next round.
                        with contextlib.suppress(Exception):
                            await client.aclose()
                        client = None
                    await asyncio.sleep(bus._backoff.compute(failures))
                    continue
                failures = 0
                bus._outage.ok()
                self._dispatch(reply or [])
        finally:
            if client is not None:
                # Shielded: aclose() cancels its tasks again and again until they end, and a
                # cancel landing in here would leave the connection open (a Cluster bus has a
                # shard per slot group, so many of them close at once).
                await asyncio.shield(client.aclose())

    async def _read_new(self, client: Redis, consumer: str, keys: list[bytes]) -> list[Any]:
        """New uplink messages of the shard's calls, claimed under each call's lease.

        A blocking XREADGROUP would deliver messages to a worker even while it is frozen (the
        server answers the read; the reply waits in the socket), and the worker would act on
        them when it wakes, after another worker took the call over. So the shard blocks in a
        plain XREAD (it claims nothing) from each stream's last delivered id, and claims what
        arrived with _CLAIM_UP, which checks the lease and reads with XREADGROUP in one script.
        A stream new to the shard is claimed from at once, which also tells its position."""
        fresh = [k for k in keys if k not in self._pos]
        arrived: dict[bytes, str] = {}  # the last id the XREAD saw, per stream
        if client.connection is None:
            await client.initialize()
        conn = client.connection
        assert conn is not None
        if not fresh:
            await conn.send_packed_command(self._xread_command(keys))
            raw = await conn.read_response() or ()
            for key, entries in raw.items() if isinstance(raw, dict) else raw:  # RESP3 or RESP2
                if key == self._wake_b:
                    if entries:
                        self._wake_last = _sid(entries[-1][0])
                elif entries and key in self._pos:
                    arrived[key] = _sid(entries[-1][0])
        if not fresh and not arrived:
            return []
        bus = self.bus
        calls = []
        for key in (*fresh, *arrived):
            subs = self.subs.get(key)
            if not subs:
                continue  # left the shard since the keys were taken
            # The token the uplink was opened under, even once the bus dropped the call from its
            # owned set (a lost lease): with the empty token the script would read unfenced and
            # move the new owner's messages into this worker's pending list, where nobody reads
            # them (a worker resumed from SIGSTOP after a takeover did exactly that).
            sid, token = subs[0].call_sid, subs[0].token
            calls.append((key, sid, token))
        if not calls:
            return []
        commands = [
            ("EVALSHA", _CLAIM_UP_SHA, 3, bus._key(sid, "owner"), bus._key(sid, "fence"), key,
             consumer, token, 256, "0" if key in arrived else "1")
            for key, sid, token in calls
        ]  # fmt: skip
        await conn.send_packed_command(conn.pack_commands(commands))
        results: list[Any] = []
        for _ in commands:  # read every reply, errors included, to keep the connection in step
            try:
                results.append(await conn.read_response())
            except ResponseError as exc:
                results.append(exc)
        if any(isinstance(r, NoScriptError) for r in results):
            await client.script_load(_CLAIM_UP)
            return []  # claimed nothing: the next round claims again, with the script loaded
        out = []
        for (key, sid, token), result in zip(calls, results, strict=True):
            if isinstance(result, ResponseError):
                if _err_code(result) == "NOGROUP":
                    raise result
                log.error("bus %s: claiming uplink messages of call %s failed: %s", bus.bus_id, sid, result)
                continue
            # The call may have left the shard while its claim was in flight (its session
            # stopped on a lost lease, or it ended): it then has no position to move on, and
            # setting one would bring it back (bench.chaos: a worker resumed from SIGSTOP lost
            # 12 calls at once and this reader task died of the KeyError, with the uplinks of
            # every call left in the shard).
            gone = key not in self.subs
            if int(result[0]) == 0:
                bus._fenced_out(sid, consumer, token, "claiming its uplink messages")
                if key in arrived and not gone:  # not ours to read: look past them
                    self._set_pos(key, _max_id(self._pos[key], arrived[key]))
                continue
            entries = [(entry_id, _flat_fields(flat)) for entry_id, flat in result[1]]
            at = _sid(result[2]) if result[2] else self._pos.get(key, "0-0")
            if entries:
                at = _max_id(at, _sid(entries[-1][0]))
                out.append((key, entries))
            if key in arrived:
                at = _max_id(at, arrived[key])
            if not gone:
                self._set_pos(key, at)
        return out

    def _set_pos(self, key: bytes, position: str) -> None:
        self._pos[key] = position
        self._pos_arg[key] = _bulk(position.encode())

    def _xread_command(self, keys: list[bytes]) -> bytes:
        """``XREAD COUNT 256 BLOCK <ms> STREAMS <wake> <keys...> <ids...>``, packed. The keys
        change only when calls come and go, so that part is packed once per change; the ids
        are packed once per change of each: packing ~130 arguments through the client on every
        event would be most of its work per event."""
        names = (self._wake_b, *keys)
        if self._xread_head is None or self._xread_head[0] != names:
            fixed = (b"XREAD", b"COUNT", b"256", b"BLOCK", str(self.bus._block_ms).encode(), b"STREAMS")
            head = b"*%d\r\n" % (len(fixed) + 2 * len(names)) + b"".join(_bulk(a) for a in (*fixed, *names))
            self._xread_head = (names, head)
        pos = self._pos_arg
        return b"".join((self._xread_head[1], _bulk(self._wake_last.encode()), *(pos[k] for k in keys)))

    def _dispatch(self, reply: list[Any]) -> None:
        for key, entries in reply:
            if key == self._wake_b:
                if entries:
                    self._wake_last = _sid(entries[-1][0])
                continue
            subs = self.subs.get(key)
            if not subs:
                continue  # its iterator went away; uplink entries stay pending for the next one
            for entry_id, fields in entries:
                id_key = parse_stream_id(_sid(entry_id))
                for sub in subs:
                    if id_key > sub.last:
                        sub.last = id_key
                        sub.queue.put_nowait((entry_id, fields))

    async def _resync(self, client: Redis, consumer: str, keys: list[bytes]) -> None:
        """After a reconnect: re-read our pending entries past what each inbox got, because a
        reply lost with the connection may have delivered (and so hidden) some."""
        positions: dict[KeyT, StreamIdT] = {}
        for key in keys:
            low = min(s.last for s in self.subs[key])
            positions[key] = f"{low[0]}-{low[1]}"
        while positions:
            try:
                reply = _stream_reply(await client.xreadgroup(GROUP, consumer, dict(positions), count=256))
            except ResponseError as exc:
                if _err_code(exc) != "NOGROUP":
                    raise
                return  # the groups are gone (Redis lost its data): nothing pending to re-read
            progressed: dict[KeyT, StreamIdT] = {}
            for key, entries in reply:
                if entries and key in positions:
                    progressed[key] = _sid(entries[-1][0])
            self._dispatch(reply)
            positions = {k: v for k, v in progressed.items() if k in self.subs}


def _bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _max_id(a: str, b: str) -> str:
    return a if parse_stream_id(a) >= parse_stream_id(b) else b


def _flat_fields(flat: Any) -> dict[bytes, bytes] | None:
    """A stream entry's fields as a Lua script returns them (a flat list) -> a dict."""
    if not flat:
        return None
    it = iter(flat)
    return dict(zip(it, it, strict=True))


async def _run_script(client: Redis, script: str, keys: list[Any], args: list[Any]) -> Any:
    """EVALSHA, loading the script on the server when it does not know it yet."""
    sha = _SHAS.get(script)
    if sha is None:
        sha = _SHAS[script] = hashlib.sha1(script.encode()).hexdigest()  # noqa: S324
    try:
        return await client.evalsha(sha, len(keys), *keys, *args)
    except NoScriptError:
        await client.script_load(script)
        return await client.evalsha(sha, len(keys), *keys, *args)


_SHAS: dict[str, str] = {}


def _stream_reply(raw: Any) -> list[Any]:
    """A raw XREAD/XREADGROUP reply (RESP2 list or RESP3 map) as [(key, [(id, fields)])]."""
    if raw is None:
        return []
    pairs = raw.items() if isinstance(raw, dict) else raw
    out: list[tuple[Any, list[tuple[Any, dict[Any, Any] | None]]]] = []
    for key, entries in pairs:
        parsed: list[tuple[Any, dict[Any, Any] | None]] = []
        for entry_id, flat in entries:
            if flat is None:
                parsed.append((entry_id, None))
            elif isinstance(flat, dict):
                parsed.append((entry_id, flat))
            else:
                it = iter(flat)
                parsed.append((entry_id, dict(zip(it, it, strict=True))))
        out.append((key, parsed))
    return out


async def _cancel(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has finished, whatever it raises.

    Cancels again until it takes: on Python 3.11 ``asyncio.wait_for`` (which redis-py uses
    around socket writes) can swallow a cancellation that lands as its inner await completes,
    and the task would then sit in a blocking XREAD for the whole ``block_ms``.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    if not task.cancelled():
        task.exception()  # retrieved: its failure is moot now


async def _wake(bus: RedisBus, key: str) -> None:
    """Wake a reader blocked on its wake stream, so its next read covers a new stream. If Redis
    is away the reader is retrying anyway and will include the stream then."""
    redis = bus._redis
    if redis is None:
        return
    pipe = redis.pipeline(transaction=False)
    pipe.xadd(key, {"w": "1"}, maxlen=16, approximate=True)
    pipe.pexpire(key, 86_400_000)
    with contextlib.suppress(*_CONNECTION_ERRORS):
        await pipe.execute(raise_on_error=False)


def _parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """``redis+cluster://[user:password@]host:port,host:port,...`` -> the startup nodes and the
    client's credentials and TLS options. Raises ValueError naming what is wrong."""
    parts = urlsplit(url)
    auth: dict[str, Any] = {}
    netloc = parts.netloc
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, password = cred.partition(":")
        if user:
            auth["username"] = unquote(user)
        if password:
            auth["password"] = unquote(password)
    if parts.scheme == "rediss+cluster":
        auth["ssl"] = True
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"{url.split('@')[-1]!r}: a Redis Cluster has only database 0")
    nodes = []
    for item in netloc.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{url.split('@')[-1]!r}: each cluster node must be host:port, not {item!r}")
        nodes.append((host.strip("[]"), int(port)))
    return nodes, auth
