"""Fixtures of the speech tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ..openai_audio_server import AudioServer


@pytest.fixture
async def server() -> AsyncIterator[AudioServer]:
    """A local server speaking OpenAI's audio APIs, scripted by the test."""
    async with AudioServer() as server:
        yield server
