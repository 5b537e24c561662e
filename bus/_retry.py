"""Riding out a lost bus server: backoff, and the bounded ordered buffer of pending writes.

Every write a bus makes (an uplink event, a downlink event, an ack, a context save, a call's
announcement or end) becomes an :class:`Op` in one :class:`OutboundBuffer`, written in order by a
single writer task. While the server is away the ops wait there, and they are flushed in order
when it is back, so ``publish()`` never waits on the network.

Overflow policy (``max_ops`` reached, i.e. a long outage at full traffic): the **oldest
droppable** op is dropped, and each drop is counted and logged. Droppable means a plain event
whose type is not in :data:`CRITICAL_TYPES`: audio, playback progress, partial transcripts,
speech start/stop. Critical ops are never dropped (``interrupt``, ``call_ended``, DTMF,
utterance boundaries, hang-up, every ack, context save, call announcement and call end): when
the buffer holds nothing else it grows past ``max_ops`` for them, which is bounded by how fast a
call can produce critical events (a few per second).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff, ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

# The buffer, ops and retry factories are the Redis bus's internals; the policy is public.
__all__ = ["CRITICAL_TYPES", "is_critical"]

#: Event types a bus never drops, however long its server is away.
CRITICAL_TYPES: frozenset[str] = frozenset(
    {
        "call_started",
        "call_ended",
        "interrupt",
        "interrupt_suppressed",
        "dtmf",
        "utterance_start",
        "utterance_end",
        "hangup",
        "transfer",
    }
)


def is_critical(event: dict[str, Any]) -> bool:
    """True when the buffer must keep ``event`` through any outage. A final transcript is
    critical; a partial one (``final`` false) is not."""
    kind = event.get("type")
    if kind in CRITICAL_TYPES:
        return True
    return kind == "transcript" and bool(event.get("final", True))


class _CappedJitterBackoff(ExponentialWithJitterBackoff):
    """redis-py's exponential backoff with full jitter, with the exponent bounded.

    redis-py computes ``random() * base * 2**failures`` in floats, which raises OverflowError
    from 1,024 consecutive failures on: with the bus's 1 s cap that is a ~17 minute outage, after
    which the writer task died of it and nothing buffered was ever written, even once the server
    was back. ``2**64`` times any sane base is far past any cap, so counting failures up to 64
    changes no delay."""

    def compute(self, failures: int) -> float:
        return super().compute(min(failures, _MAX_EXPONENT))


_MAX_EXPONENT = 64


def make_backoff(base_s: float, cap_s: float) -> AbstractBackoff:
    """Exponential backoff with full jitter: ``random() * base * 2**failures``, at most ``cap``
    (any number of failures)."""
    return _CappedJitterBackoff(cap=cap_s, base=base_s)


def make_retry(retries: int, base_s: float, cap_s: float) -> Retry:
    """A redis-py ``Retry`` for one-off reads: connection errors and timeouts only."""
    return Retry(
        make_backoff(base_s, cap_s),
        retries,
        # redis-py before 8 types supported_errors as RedisError subclasses (8 as any exception
        # class) but catches any class given; OSError is the socket's own error, raised before
        # redis-py wraps it. The cast type-checks under both (redis is not pinned).
        supported_errors=cast("tuple[type[RedisError], ...]",
                              (RedisConnectionError, RedisTimeoutError, OSError)),
    )


_QUEUED, _INFLIGHT, _WRITTEN, _DROPPED = range(4)


@dataclass(slots=True, eq=False)
class Op:
    """One write: the commands to run, in order, in a pipeline.

    Attributes:
        kind: what it is, for logs (``publish``, ``ack``...).
        call_sid: the call it belongs to ("" for pool-wide ops).
        commands: raw command tuples, e.g. ``("XADD", key, "*", "e", payload)``.
        critical: never dropped on overflow.
        seq: position in the bus's write order (set by the buffer).
        fence: (worker id, fencing token) when the commands are fenced scripts (each replies 0
            when the lease is no longer that worker's); None for plain writes.
        context: the JSON a ``save_context`` op stores (read-your-writes before it lands).
    """

    kind: str
    call_sid: str
    commands: Sequence[tuple[Any, ...]]
    critical: bool = True
    seq: int = 0
    fence: tuple[str, str] | None = None
    context: str | None = None
    state: int = field(default=_QUEUED, repr=False)


class OutboundBuffer:
    """The ordered, bounded queue of ops waiting for the writer.

    ``take()`` hands the writer a batch from the head; ``commit()`` says it is written;
    ``requeue()`` puts a failed batch back at the head, where the next ``take()`` finds it
    first (so a retry writes the same ops in the same order) and where its non-critical ops
    can be dropped again if the outage lasts.
    """

    def __init__(self, max_ops: int) -> None:
        if max_ops < 1:
            raise ValueError("max_ops must be at least 1")
        self.max_ops = max_ops
        self._queue: deque[Op] = deque()
        self._droppable: deque[Op] = deque()  # non-critical ops, oldest first (lazily pruned)
        self._inflight: list[Op] = []
        self._live = 0  # queued ops not dropped
        self._next_seq = 1
        self.dropped_total = 0

    def __len__(self) -> int:
        return self._live + len(self._inflight)

    @property
    def last_seq(self) -> int:
        """The seq of the newest op pushed (0 when none)."""
        return self._next_seq - 1

    @property
    def committed_seq(self) -> int:
        """Every op with a seq up to this one is written (or dropped)."""
        if self._inflight:
            return self._inflight[0].seq - 1
        while self._queue and self._queue[0].state == _DROPPED:
            self._queue.popleft()
        return self._queue[0].seq - 1 if self._queue else self.last_seq

    def push(self, op: Op) -> list[Op]:
        """Append ``op``; returns the ops dropped to make room, oldest first (``op`` itself
        last, when nothing older could go and it is droppable)."""
        op.seq = self._next_seq
        self._next_seq += 1
        victims: list[Op] = []
        while len(self) >= self.max_ops:
            victim = self._pop_droppable()
            if victim is None:
                break
            victims.append(victim)
        if len(self) >= self.max_ops and not op.critical:
            op.state = _DROPPED
            self.dropped_total += 1
            victims.append(op)
            return victims
        op.state = _QUEUED
        self._queue.append(op)
        self._live += 1
        if not op.critical:
            self._droppable.append(op)
        return victims

    def _pop_droppable(self) -> Op | None:
        droppable = self._droppable
        while droppable and droppable[0].state in (_WRITTEN, _DROPPED):
            droppable.popleft()
        # In-flight ops (a batch being written) are the oldest, so they sit at the left; skip
        # them without forgetting them: a failed batch comes back droppable.
        for index, op in enumerate(droppable):
            if op.state == _QUEUED:
                del droppable[index]
                op.state = _DROPPED
                self._live -= 1
                self.dropped_total += 1
                return op
        return None

    def take(self, max_ops: int) -> list[Op]:
        """Move up to ``max_ops`` ops from the head into flight; returns the whole flight."""
        while self._queue and len(self._inflight) < max_ops:
            op = self._queue.popleft()
            if op.state == _DROPPED:
                continue
            op.state = _INFLIGHT
            self._live -= 1
            self._inflight.append(op)
        return list(self._inflight)

    def requeue(self) -> None:
        """The in-flight batch failed: back to the head of the queue, in order."""
        for op in reversed(self._inflight):
            op.state = _QUEUED
            self._queue.appendleft(op)
        self._live += len(self._inflight)
        self._inflight = []

    def commit(self) -> list[Op]:
        """The in-flight batch is written; returns it."""
        done, self._inflight = self._inflight, []
        for op in done:
            op.state = _WRITTEN
        while self._droppable and self._droppable[0].state != _QUEUED:
            self._droppable.popleft()
        return done

    def pending(self) -> Iterable[Op]:
        """The ops not yet written, in order (for read-your-writes lookups)."""
        yield from self._inflight
        yield from (op for op in self._queue if op.state == _QUEUED)
