"""Fixtures for every test."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs a command in process (``gateway.cli.main`` calls ``setup_logging``)
    points the root logger at the ``sys.stderr`` of that moment: pytest's capture, closed when
    the test ends. A later line from any thread then printed ``--- Logging error ---`` into the
    run's output (livekit's FFI callback logging the refused request of a closed canceller in
    tests/vad/test_aec.py, after tests/linesim/test_simulator.py). Each test leaves the root
    logger as it found it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
