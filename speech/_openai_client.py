"""The AsyncOpenAI client both OpenAI speech providers build when none is passed in."""

from __future__ import annotations

import os

from openai import AsyncOpenAI

from ._errors import ConfigurationError

__all__ = ["openai_client"]


def openai_client(
    *, api_key: str | None, base_url: str | None, max_retries: int, timeout: float
) -> AsyncOpenAI:
    """A client for ``base_url`` (any OpenAI-compatible server); the key falls back to
    ``OPENAI_API_KEY``.

    Raises:
        ConfigurationError: No key given and none in the environment.
    """
    key = api_key or os.environ.get("OPENAI_API_KEY")
    if not key:
        raise ConfigurationError("no API key: pass api_key= or set OPENAI_API_KEY")
    return AsyncOpenAI(api_key=key, base_url=base_url, max_retries=max_retries, timeout=timeout)
