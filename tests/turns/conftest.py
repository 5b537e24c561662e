"""The worker fixtures of tests/nodes (a real bus, the local OpenAI-protocol server)."""

from tests.nodes.conftest import bus, llm, make_bus, openai_server  # noqa: F401
