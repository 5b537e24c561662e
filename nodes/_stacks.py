"""What a task is waiting on: its await chain, through coroutines and async generators.

``Task.print_stack`` shows only the task's outermost coroutine frame; a call task that does not
stop is usually deep inside an async generator (the bus's ``uplink``) or a library's await, and
that is the line worth logging when a worker's shutdown runs past its grace.
"""

from __future__ import annotations

import asyncio
import gc
from types import FrameType
from typing import Any

__all__ = ["await_chain"]

_MAX_DEPTH = 64


def _frame(obj: Any) -> FrameType | None:
    for name in ("cr_frame", "ag_frame", "gi_frame"):
        frame = getattr(obj, name, None)
        if isinstance(frame, FrameType):
            return frame
    return None


def _awaited(obj: Any) -> Any:
    for name in ("cr_await", "ag_await", "gi_yieldfrom"):
        inner = getattr(obj, name, None)
        if inner is not None:
            return inner
    if type(obj).__name__ in ("async_generator_asend", "async_generator_athrow"):
        # These wrappers do not expose their generator; the garbage collector knows it.
        return next((r for r in gc.get_referents(obj) if type(r).__name__ == "async_generator"),
                    None)  # fmt: skip
    return None


def await_chain(task: asyncio.Task[Any]) -> str:
    """``func (file:line) > func (file:line) > ... > <what the innermost awaits>``."""
    parts: list[str] = []
    obj: Any = task.get_coro()
    for _ in range(_MAX_DEPTH):
        if obj is None:
            break
        frame = _frame(obj)
        if frame is not None:
            code = frame.f_code
            parts.append(f"{code.co_name} ({code.co_filename}:{frame.f_lineno})")
        elif not type(obj).__name__.startswith("async_generator_a"):
            parts.append(type(obj).__name__)
        obj = _awaited(obj)
    return " > ".join(parts) or repr(task)
