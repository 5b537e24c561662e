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

One ``Lockstep`` per event loop, shared by every replay on it: the loop is quiet only when all
of them are, so concurrent replays advance together instead of each seeing the others' work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Lockstep"]

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


class Lockstep:
    """Tells a replay when the work it started has finished; one per event loop (:meth:`of`).

    Creating it makes a counting thread pool the loop's default executor (the one replaced is
    left to finish what it runs).
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

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop | None = None) -> Lockstep:
        """The lockstep of ``loop`` (default: the running loop), made on first use."""
        loop = loop or asyncio.get_running_loop()
        lockstep = cls._by_loop.get(loop)
        if lockstep is None:
            lockstep = cls._by_loop[loop] = cls(loop)
        return lockstep

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
