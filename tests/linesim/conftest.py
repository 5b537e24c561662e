from __future__ import annotations

import pytest

from linesim import VoiceLibrary


@pytest.fixture(scope="session")
def library() -> VoiceLibrary:
    """The real voices, cut once per session out of tests/recordings."""
    return VoiceLibrary()
