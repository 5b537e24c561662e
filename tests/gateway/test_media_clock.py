"""gateway.lockstep.MediaClock: the timers of the tasks started in a replay's clock context run
on its media clock (advanced frame by frame), never on the wall clock; cancelled ones never run;
once closed, what is left goes back to the wall clock with the media time it had left."""

from __future__ import annotations

import asyncio

import pytest

from gateway.lockstep import Lockstep


async def test_a_sleep_in_the_clock_context_ends_on_media_time_only() -> None:
    clock = Lockstep.of().media_clock()
    woke: list[float] = []

    async def agent() -> None:
        await asyncio.sleep(0.05)  # 50 ms of media
        woke.append(clock.now_s)

    task = asyncio.create_task(agent(), context=clock.context())
    await Lockstep.of().settled()
    assert clock.pending == 1 and not woke
    for frame in range(1, 6):  # 20 ms frames: due at the third
        assert clock.advance(frame * 0.02) == (1 if frame == 3 else 0)
        await Lockstep.of().settled()
        assert woke == ([] if frame < 3 else [pytest.approx(0.06)])
    await task


async def test_a_timeout_in_the_clock_context_counts_media_time() -> None:
    clock = Lockstep.of().media_clock()
    ready = asyncio.Event()
    outcome: list[str] = []

    async def pacer() -> None:
        try:
            async with asyncio.timeout(0.1):
                await ready.wait()
            outcome.append("progress")
        except TimeoutError:
            outcome.append(f"stalled at {clock.now_s:.2f}")

    first = asyncio.create_task(pacer(), context=clock.context())
    await Lockstep.of().settled()
    clock.advance(0.08)
    await Lockstep.of().settled()
    ready.set()  # the report comes before 100 ms of media: no stall, and the timer is gone
    await first
    assert outcome == ["progress"] and clock.pending == 0
    assert clock.advance(1.0) == 0

    ready.clear()
    second = asyncio.create_task(pacer(), context=clock.context())
    await Lockstep.of().settled()
    clock.advance(1.06)
    await Lockstep.of().settled()
    assert not second.done()
    clock.advance(1.10)
    await second
    assert outcome == ["progress", "stalled at 1.10"]


async def test_timers_outside_the_clock_context_stay_on_the_wall_clock() -> None:
    clock = Lockstep.of().media_clock()
    await asyncio.wait_for(asyncio.sleep(0.01), 5)  # the replay's own: the wall clock
    assert clock.pending == 0


async def test_close_hands_pending_timers_to_the_wall_clock_with_their_media_time_left() -> None:
    clock = Lockstep.of().media_clock()
    done = asyncio.Event()

    async def agent() -> None:
        await asyncio.sleep(0.03)
        done.set()

    task = asyncio.create_task(agent(), context=clock.context())
    await Lockstep.of().settled()
    clock.advance(0.02)  # 10 ms of media left
    clock.close()
    assert clock.pending == 0
    await asyncio.wait_for(done.wait(), 30)
    await task
    # And timers set after the close go to the wall clock directly.
    later = asyncio.create_task(asyncio.sleep(0.01), context=clock.context())
    await asyncio.wait_for(later, 30)


async def test_two_clocks_on_one_loop_keep_their_own_time() -> None:
    a, b = Lockstep.of().media_clock(), Lockstep.of().media_clock()
    woke: list[str] = []

    async def sleeper(name: str) -> None:
        await asyncio.sleep(0.02)
        woke.append(name)

    tasks = [asyncio.create_task(sleeper("a"), context=a.context()),
             asyncio.create_task(sleeper("b"), context=b.context())]
    await Lockstep.of().settled()
    a.advance(0.02)
    await Lockstep.of().settled()
    assert woke == ["a"]
    b.advance(0.02)
    await asyncio.gather(*tasks)
    assert woke == ["a", "b"]
