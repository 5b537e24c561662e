"""The seed document's first snippet (shared/seed/interruption-handling.clean.md), verbatim.

``test_seed_snippets`` holds the whole seed code, where the second ``MyAgent`` shadows this one;
the YAML of ``test_seed_yaml`` refers to these two by ``tests.nodes.seed_first:MyAgent`` and
``:PaymentAgent``. Neither defines ``generate_response``: they answer with their YAML ``llm``.
"""

from nodes import OutputAgentNode

# ---- seed code, verbatim ----
class MyAgent(OutputAgentNode):
    def __init__(self):
        super().__init__(
            name="my-agent",
            is_interruptible=True  # Default
        )

class PaymentAgent(OutputAgentNode):
    def __init__(self):
        super().__init__(
            name="payment-agent",
            is_interruptible=False  # User must hear the full message
        )
# ---- end of seed code ----
