"""One user message per caller turn, when the caller resumed before hearing the reply.

The gateway ends a caller's turn, publishes its transcript and the agent starts answering; if
the caller speaks again before any of the answer is heard, the gateway drops the answer (an
``interrupt`` with reason ``resumed``, nothing heard) and, at the end of the resumed turn,
publishes a transcript of the *whole* turn with ``replaces_previous: true``. The worker then
takes the previous user message, and whatever followed it, out of every output node's
conversation before the whole turn goes in as one message.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._output_agent import OutputAgentNode

__all__ = ["drop_last_user_turn"]


def drop_last_user_turn(nodes: Iterable[OutputAgentNode]) -> int:
    """Remove the last user message and every message after it from each node's context.
    Returns how many messages were removed in all."""
    removed = 0
    for node in nodes:
        messages = node.context.messages
        last = next((i for i in range(len(messages) - 1, -1, -1)
                     if messages[i].get("role") == "user"), None)
        if last is None:
            continue
        removed += len(messages) - last
        del messages[last:]
    return removed
