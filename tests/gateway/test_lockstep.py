"""gateway.lockstep: ``settled()`` returns only once the work in flight is done (chains of tasks,
thread work, replies over loopback sockets), and does not wait for timers."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from gateway.lockstep import Lockstep

HOPS = 500  # far more passes of the loop than the settler's quiet rounds


def _cpu_work(n: int) -> int:
    return sum(i * i for i in range(n))


async def test_settled_waits_for_a_long_chain_of_tasks() -> None:
    lockstep = Lockstep.of()
    done: list[int] = []

    async def hop(left: int) -> None:
        if left == 0:
            done.append(1)
            return
        await asyncio.sleep(0)
        asyncio.get_running_loop().create_task(hop(left - 1))

    asyncio.get_running_loop().create_task(hop(HOPS))
    await lockstep.settled()
    assert done == [1]


async def test_settled_waits_for_thread_work_and_what_follows_it() -> None:
    lockstep = Lockstep.of()
    results: list[int] = []
    release = threading.Event()

    async def job() -> None:
        value = await asyncio.to_thread(lambda: release.wait() and _cpu_work(200_000))
        for _ in range(HOPS):
            await asyncio.sleep(0)
        results.append(value)

    task = asyncio.create_task(job())
    await asyncio.sleep(0)  # the job submits its thread work
    assert lockstep.in_flight == 1
    settled = asyncio.create_task(lockstep.settled())
    for _ in range(HOPS):
        await asyncio.sleep(0)
    assert not settled.done()  # the thread is still blocked: not settled
    release.set()
    await settled
    assert results == [_cpu_work(200_000)]
    assert lockstep.in_flight == 0
    await task


async def test_thread_errors_reach_the_awaiting_task() -> None:
    Lockstep.of()

    def fail() -> None:
        raise ValueError("from the thread")

    with pytest.raises(ValueError, match="from the thread"):
        await asyncio.to_thread(fail)


async def test_settled_waits_for_a_reply_over_loopback() -> None:
    lockstep = Lockstep.of()
    replies: list[bytes] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.readline()
        writer.write(data.upper())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def ask() -> None:
            writer.write(b"hello\n")
            await writer.drain()
            replies.append(await reader.readline())

        task = asyncio.create_task(ask())
        await lockstep.settled()
        assert replies == [b"HELLO\n"]
        await task
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


async def test_settled_does_not_wait_for_timers() -> None:
    lockstep = Lockstep.of()
    sleeper = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    await lockstep.settled()  # a task waiting for wall time is not work in flight
    assert not sleeper.done()
    sleeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeper


async def test_one_lockstep_per_loop() -> None:
    assert Lockstep.of() is Lockstep.of()


def test_a_closed_loop_is_not_kept_alive() -> None:
    loop = asyncio.new_event_loop()

    async def use() -> None:
        await asyncio.to_thread(_cpu_work, 1000)
        await Lockstep.of().settled()

    loop.run_until_complete(use())
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()
    ref = weakref.ref(loop)
    del loop
    gc.collect()
    assert ref() is None
