"""The AsyncOpenAI client both OpenAI speech providers build when none is passed in, and the
ownership rules they share (a client passed in is borrowed: never closed by them)."""

from __future__ import annotations

import os
from typing import Self

from openai import AsyncOpenAI

from ._errors import ConfigurationError

__all__ = ["OpenAIClientOwner", "openai_client"]


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


class OpenAIClientOwner:
    """Base of the OpenAI providers: holds the client, built here or borrowed, and closes it
    only when built here (``aclose``, ``async with``)."""

    _client: AsyncOpenAI
    _owns_client: bool

    def _init_client(self, client: AsyncOpenAI | None, *, api_key: str | None,
                     base_url: str | None, max_retries: int, timeout: float) -> None:
        self._owns_client = client is None
        self._client = client if client is not None else openai_client(
            api_key=api_key, base_url=base_url, max_retries=max_retries, timeout=timeout
        )

    async def aclose(self) -> None:
        """Close the HTTP client (when this object built it)."""
        if self._owns_client:
            await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
