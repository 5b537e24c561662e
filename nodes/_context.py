"""The conversation an output node keeps: OpenAI-format message dicts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["ContextManager"]


class ContextManager:
    """An ordered list of chat messages (``{"role": ..., "content": ...}`` dicts).

    ``messages`` is the live list: pass it straight to an LLM client.
    """

    def __init__(self, messages: Iterable[dict[str, Any]] = ()) -> None:
        self._messages: list[dict[str, Any]] = list(messages)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The messages, oldest first."""
        return self._messages

    def add_message(self, message_dict: dict[str, Any]) -> None:
        """Append one message."""
        self._messages.append(message_dict)

    def add_messages(self, messages: Iterable[dict[str, Any]]) -> None:
        """Append several messages in order."""
        self._messages.extend(messages)

    def remove_message(self, message_dict: dict[str, Any]) -> bool:
        """Remove this very message object (compared by identity); False if absent."""
        for i, m in enumerate(self._messages):
            if m is message_dict:
                del self._messages[i]
                return True
        return False

    def replace_messages(self, messages: Iterable[dict[str, Any]]) -> None:
        """Replace the whole conversation (used when a call is resumed from a snapshot)."""
        self._messages[:] = list(messages)

    def __len__(self) -> int:
        return len(self._messages)

    def __repr__(self) -> str:
        return f"<ContextManager: {len(self._messages)} messages>"
