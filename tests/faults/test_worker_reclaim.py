"""A call a worker lost and then claims back while its old session is still stopping is handled
again once the old session is done, never dropped (it would stay owned and unhandled)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from bus import CallInfo, EmbeddedBus
from nodes import SessionWorker


class _TwiceBus(EmbeddedBus):
    """Claims the same call twice, the second time while the first session still runs."""

    def __init__(self, second: asyncio.Event) -> None:
        super().__init__()
        self.second = second
        self.taken = asyncio.Event()

    async def claim_calls(self, worker_id: str) -> AsyncIterator[CallInfo]:
        yield CallInfo("CA1")
        await self.second.wait()
        yield CallInfo("CA1")
        self.taken.set()  # the worker came back for more: it has taken the second claim
        await asyncio.Event().wait()  # then nothing more, until cancelled


async def test_a_call_claimed_again_runs_after_its_old_session() -> None:
    second = asyncio.Event()
    release = asyncio.Event()
    order: list[str] = []

    bus = _TwiceBus(second)
    worker = SessionWorker(bus, agent_factory=lambda call: _never)

    async def handle_call(call: CallInfo) -> None:
        n = sum(1 for o in order if o.startswith("start")) + 1
        order.append(f"start {n}")
        if n == 1:
            second.set()  # claimed again while this session runs
            await release.wait()
        order.append(f"end {n}")

    worker.handle_call = handle_call  # type: ignore[method-assign]
    async with bus:
        runner = asyncio.create_task(worker.run())
        async with asyncio.timeout(10):
            await bus.taken.wait()
            for _ in range(3):
                await asyncio.sleep(0)  # give a second session every chance to start early
            assert order == ["start 1"]  # the second waits for the first
            release.set()
            await worker.join("CA1")
        assert order == ["start 1", "end 1", "start 2", "end 2"]
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await worker.aclose()


async def _never(session: object) -> None:  # pragma: no cover - handle_call is replaced
    raise AssertionError("not called")
