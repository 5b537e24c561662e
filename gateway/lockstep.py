"""Waiting for the work a replay started, so that its timeline depends on the media clock only.

A replay with an agent feeds the recording frame by frame. Each frame may start work that takes
wall time: the session worker reacting to an uplink event (its graph, its LLM, text to speech in
a thread), the gateway playing what the worker sent. If the replay moved on to the next frame
while that work was still running, the bot would answer at a media time that depends on how busy
the machine is: on a loaded machine a reply (or a transcript) could come after the recording had
ended. So after each frame the replay waits until the process has *settled*: nothing the event
loop could run, and no thread work in flight.

* Thread work: while a :class:`Lockstep` exists the loop's default executor (what
  ``asyncio.to_thread`` and ``run_in_executor(None, ...)`` use: eSpeak NG renders there) counts
  the calls in flight. Each call's future is completed *on the loop*, in the same step that
  lowers the count, so the task waiting for it is runnable before the count reads zero: there is
  no moment at which "nothing in flight" and "nothing runnable" are both true while a result is
  on its way.
* The loop: asyncio has no public "is anything runnable" query; CPython's event loop keeps its
  runnable handles in ``_ready`` (so since 3.4). The process has settled once that queue was
  empty on ``_QUIET_ROUNDS`` passes in a row; each pass also polls the sockets, so a reply from
  a server on loopback in this process (a local OpenAI-compatible server in tests) is seen. A
  loop without ``_ready`` (uvloop) gets ``_BLIND_ROUNDS`` passes instead.

Not waited for: timers (a task sleeping for wall time is waiting, not working) and services in
other processes (an LLM across the network answers in wall time: replay those with
``--realtime``). Speech to text is awaited by the replay itself (``transcribe_inline``).

* The agent's timers: a lock-step replay runs slower or faster than the wall clock, so a timer
  the agent sets (an ``asyncio.timeout``, ``asyncio.sleep``, ``call_later``) would fire at a media
  time that depends on the machine's load. The worker's pacing is one: it pulls a response's
  next chunk once the gateway's ``playback`` reports say the caller is near the end of the audio
  sent, or anyway after a stall guard (``nodes._worker._pace``: twice the unheard audio plus 2 s);
  on a loaded machine the guard ran out in wall time before the media clock had played that
  audio, and the chunk was pulled early. A :class:`MediaClock` (one per replay,
  :meth:`Lockstep.media_clock`) runs every timer set by the tasks started in its
  :meth:`~MediaClock.context` (the agent and every task it starts) on the replay's media clock
  instead: the replay advances it frame by frame, the timers due run then, and the replay waits
  for what they started as for everything else. So the worker's pacing wakes only on the
  gateway's reports or on media time, never on wall time. The gateway's own timers (the VAD
  engine's batching deadline, the replay's hang guard) stay on the wall clock. Once the replay's
  frames are done (:meth:`~MediaClock.close`) the timers still pending go back to the wall clock
  with the media time they had left, so the agent stops as it would live.

One ``Lockstep`` per event loop, shared by every replay on it: the loop is quiet only when all
of them are, so concurrent replays advance together instead of each seeing the others' work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import heapq
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Lockstep", "MediaClock"]

_T = TypeVar("_T")

# Passes of the loop with nothing runnable before the process counts as settled. Two would do
# (the second pass polls the sockets written to in the first); three leave a margin.
_QUIET_ROUNDS = 3
# Without a view of the runnable queue, passes in a row regardless. In the shipped agent's call
# (tests/test_e2e_offline.py: greeting, barge-in, transcript, scripted answer in eSpeak NG) one
# frame's work kept the loop busy for at most 21 passes (481 settles; thread waits not counted).
_BLIND_ROUNDS = 200


class _CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that knows how many calls are in flight (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(thread_name_prefix="callgate-lockstep")
        # Weak: the loop owns this executor; a strong reference back would keep every closed
        # loop (one per test) alive through ``Lockstep._by_loop``.
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self.in_flight = 0
        self._idle: list[asyncio.Future[None]] = []

    def submit(
        self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[_T]:
        outer: concurrent.futures.Future[_T] = concurrent.futures.Future()
        with self._lock:
            self.in_flight += 1
        try:
            inner = super().submit(fn, *args, **kwargs)
        except BaseException:
            with self._lock:
                self.in_flight -= 1
            raise
        outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)
        inner.add_done_callback(lambda f: self._relay(f, outer))
        return outer

    def _relay(
        self, inner: concurrent.futures.Future[Any], outer: concurrent.futures.Future[Any]
    ) -> None:
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("event loop is gone")
            loop.call_soon_threadsafe(self._finish, inner, outer)
        except RuntimeError:  # the loop closed while the thread ran: nobody waits any more
            with self._lock:
                self.in_flight -= 1

    def _finish(
        self, inner: concurrent.futures.Future[Any], outer: concurrent.futures.Future[Any]
    ) -> None:
        # On the loop: completing ``outer`` queues the waiting task's wake-up right here.
        if not outer.done():
            if inner.cancelled():
                outer.cancel()
            elif inner.exception() is not None:
                outer.set_exception(inner.exception())
            else:
                outer.set_result(inner.result())
        with self._lock:
            self.in_flight -= 1
            idle = self.in_flight == 0
        if idle:
            waiters, self._idle = self._idle, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def idle(self) -> None:
        """Return once no call is in flight."""
        if self.in_flight:
            waiter = asyncio.get_running_loop().create_future()
            self._idle.append(waiter)
            await waiter


# The media clock of the replay whose agent set the current context (None: the wall clock).
_CLOCK: contextvars.ContextVar[MediaClock | None] = contextvars.ContextVar(
    "callgate_media_clock", default=None
)

_Entry = tuple[float, int, asyncio.TimerHandle, Callable[..., object], tuple[Any, ...],
               contextvars.Context]


def _fire(handle: asyncio.TimerHandle, callback: Callable[..., object], *args: Any) -> None:
    # Run in the timer's own context (call_soon/call_at were given it). A handle cancelled
    # after it was released (an ``asyncio.timeout`` left just then) does nothing, as live.
    if not handle.cancelled():
        callback(*args)


class MediaClock:
    """One replay's media clock, on which the timers of the tasks in :meth:`context` run.

    A timer set at media time ``m`` for ``d`` seconds is due at media time ``m + d``; it runs
    in the first :meth:`advance` that reaches it. The handle its caller gets cancels it as a
    loop timer's would. See the module docstring.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop_ref = weakref.ref(loop)
        self.now_s = 0.0
        """Media time reached, in seconds (what :meth:`advance` was last given)."""
        self.closed = False
        self._heap: list[_Entry] = []
        self._order = itertools.count()  # equal due times run in the order they were set

    def context(self) -> contextvars.Context:
        """A copy of the current context in which timers run on this clock: start the agent's
        task in it (``asyncio.create_task(..., context=clock.context())``); the tasks it starts
        inherit it."""
        ctx = contextvars.copy_context()
        ctx.run(_CLOCK.set, self)
        return ctx

    @property
    def pending(self) -> int:
        """Timers set on this clock and neither run nor cancelled."""
        return sum(1 for entry in self._heap if not entry[2].cancelled())

    def _call_at(self, loop: asyncio.AbstractEventLoop, when: float,
                 callback: Callable[..., object], args: tuple[Any, ...],
                 context: contextvars.Context | None) -> asyncio.TimerHandle:
        due = self.now_s + max(0.0, when - loop.time())
        ctx = context if context is not None else contextvars.copy_context()
        handle = asyncio.TimerHandle(when, callback, args, loop, ctx)
        heapq.heappush(self._heap, (due, next(self._order), handle, callback, args, ctx))
        return handle

    def advance(self, now_s: float) -> int:
        """Media time ``now_s`` has come: queue the timers due by then (to run in the loop's
        next pass, in due order); returns how many."""
        loop = self._loop_ref()
        self.now_s = max(self.now_s, now_s)
        released = 0
        while self._heap and self._heap[0][0] <= self.now_s:
            _, _, handle, callback, args, ctx = heapq.heappop(self._heap)
            if handle.cancelled() or loop is None:
                continue
            loop.call_soon(_fire, handle, callback, *args, context=ctx)
            released += 1
        return released

    def close(self) -> None:
        """The replay's frames are over: the pending timers (and any set from now on) go to the
        wall clock, each with the media time it had left. Idempotent."""
        if self.closed:
            return
        self.closed = True
        loop = self._loop_ref()
        heap, self._heap = self._heap, []
        if loop is None:
            return
        for due, _, handle, callback, args, ctx in sorted(heap):
            if not handle.cancelled():
                type(loop).call_at(loop, loop.time() + max(0.0, due - self.now_s), _fire,
                                   handle, callback, *args, context=ctx)


def _install_media_timers(loop: asyncio.AbstractEventLoop) -> None:
    """Route ``loop.call_at`` (``call_later``, ``asyncio.sleep`` and ``asyncio.timeout`` use
    it) to the media clock of the calling context, if it has one of this loop."""
    wall_call_at = type(loop).call_at
    loop_ref = weakref.ref(loop)  # the loop holds this function: no strong cycle back

    def call_at(when: float, callback: Callable[..., object], *args: Any,
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        the_loop = loop_ref()
        assert the_loop is not None
        clock = _CLOCK.get()
        if clock is None or clock.closed or clock._loop_ref() is not the_loop:
            return wall_call_at(the_loop, when, callback, *args, context=context)
        return clock._call_at(the_loop, when, callback, args, context)

    # Patching this loop object's call_at is the point (its timers run on the media clock);
    # mypy refuses any assignment to a method.
    loop.call_at = call_at  # type: ignore[method-assign, assignment]


class Lockstep:
    """Tells a replay when the work it started has finished; one per event loop (:meth:`of`).

    Creating it makes a counting thread pool the loop's default executor (the one replaced is
    left to finish what it runs), and lets timers run on a replay's :class:`MediaClock`
    (``loop.call_at`` looks at the calling context first; without a media clock in it, the
    loop's own timers, unchanged).
    """

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Lockstep] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop_ref = weakref.ref(loop)  # weak, as in _CountingExecutor
        self._executor = _CountingExecutor(loop)
        loop.set_default_executor(self._executor)
        self._waiters: list[asyncio.Future[None]] = []
        self._poller: asyncio.Task[None] | None = None
        _install_media_timers(loop)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop | None = None) -> Lockstep:
        """The lockstep of ``loop`` (default: the running loop), made on first use."""
        loop = loop or asyncio.get_running_loop()
        lockstep = cls._by_loop.get(loop)
        if lockstep is None:
            lockstep = cls._by_loop[loop] = cls(loop)
        return lockstep

    def media_clock(self) -> MediaClock:
        """A new media clock for one replay on this loop (see the module docstring)."""
        loop = self._loop_ref()
        assert loop is not None
        return MediaClock(loop)

    @property
    def in_flight(self) -> int:
        """Calls running in the default executor now."""
        return self._executor.in_flight

    async def settled(self) -> None:
        """Return once nothing in this process can run and no thread work is in flight."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop_ref():
            raise RuntimeError("Lockstep.settled() awaited on another event loop than its own")
        waiter = loop.create_future()
        self._waiters.append(waiter)
        if self._poller is None or self._poller.done():
            self._poller = loop.create_task(self._poll(), name="callgate-lockstep")
        await waiter

    async def _poll(self) -> None:
        try:
            await self._release_when_quiet()
        finally:
            self._poller = None  # a finished task still refers to its loop

    async def _release_when_quiet(self) -> None:
        ready = getattr(asyncio.get_running_loop(), "_ready", None)
        needed = _QUIET_ROUNDS if ready is not None else _BLIND_ROUNDS
        quiet = 0
        while True:
            self._waiters = [w for w in self._waiters if not w.done()]
            if not self._waiters:
                return
            if self._executor.in_flight:
                quiet = 0
                await self._executor.idle()
                continue
            await asyncio.sleep(0)
            # Our own wake-up has been taken off the queue: what is left is someone else's.
            quiet = quiet + 1 if not ready else 0
            if quiet >= needed and not self._executor.in_flight:
                quiet = 0
                waiters, self._waiters = self._waiters, []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)
