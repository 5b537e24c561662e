"""Helpers that tests of more than one package share: the shared recordings corpus, the check
that a module's ``__all__`` lists what it defines, and checks on a call's timeline."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# The corpus lives in ../shared next to the checkout, or in shared/ inside it.
_ROOT = Path(__file__).resolve().parents[1]
SHARED_RECORDINGS = next(
    (
        p
        for p in (_ROOT.parent / "shared" / "recordings", _ROOT / "shared" / "recordings")
        if p.is_dir()
    ),
    _ROOT.parent / "shared" / "recordings",
)
needs_shared_recordings = pytest.mark.skipif(
    not SHARED_RECORDINGS.is_dir(), reason="../shared/recordings is not present"
)


def assert_exports_complete(module: ModuleType) -> None:
    """Every public name ``module`` defines is in its ``__all__``, and every name there exists."""
    defined = {
        name
        for name, obj in vars(module).items()
        if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__
    }
    assert defined <= set(module.__all__)
    assert all(hasattr(module, name) for name in module.__all__)


def uninterruptible_utterance(events: list[dict[str, Any]], node: str) -> str:
    """The first utterance of ``node`` in a call's timeline ``events``, checked to be
    uninterruptible and to have played untouched: no barge-in, no clear, the caller's speech
    over it suppressed. Its id."""
    started = [e for e in events if e["type"] == "bot_utterance_started" and e["node"] == node]
    assert started and started[0]["interruptible"] is False
    uid: str = started[0]["utterance_id"]
    assert not [e for e in events if e["type"] in ("barge_in", "clear_sent")]
    assert any(e["type"] == "interrupt_suppressed" and e["utterance_id"] == uid for e in events)
    return uid
