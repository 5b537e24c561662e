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


def drop_last_user_turn(nodes: Iterable[OutputAgentNode], content: str | None = None) -> int:
    """Remove the last user message (the last with this ``content``, when given) and every
    message after it from each node's context. Returns how many messages were removed in all.

    With ``content``: a worker answering again a turn whose answer its last owner did not get
    out takes that turn out (the saved context may hold part of the old answer) and puts it
    in again, as if it came now."""
    removed = 0
    for node in nodes:
        messages = node.context.messages
        last = next((i for i in range(len(messages) - 1, -1, -1)
                     if messages[i].get("role") == "user"
                     and (content is None or messages[i].get("content") == content)), None)
        if last is None:
            continue
        removed += len(messages) - last
        del messages[last:]
    return removed
