"""Worker helpers: agent loading, Twilio TwiML, the test synthesizers, the export list."""

from __future__ import annotations

import asyncio
import struct
import warnings

import pytest

import nodes
from nodes import (
    AgentLoadError,
    SilenceSynthesizer,
    ToneSynthesizer,
    linear_to_mulaw,
    load_agent,
    transfer_twiml,
)


def test_load_agent() -> None:
    from . import test_seed_snippets

    assert load_agent("tests.nodes.test_seed_snippets:setup") is test_seed_snippets.setup
    assert load_agent("tests.nodes.test_seed_snippets:MyAgent.generate_response")
    with pytest.raises(AgentLoadError, match="expected 'module:function'"):
        load_agent("no_colon")
    with pytest.raises(AgentLoadError, match="cannot import"):
        load_agent("no.such.module:setup")
    with pytest.raises(AgentLoadError, match="has no 'nothing'"):
        load_agent("tests.nodes.test_seed_snippets:nothing")
    with pytest.raises(AgentLoadError, match="not callable"):
        load_agent("tests.nodes.test_seed_snippets:SEED.name")


def test_transfer_twiml() -> None:
    assert transfer_twiml("+15557654321") == (
        '<?xml version="1.0" encoding="UTF-8"?><Response><Dial>+15557654321</Dial></Response>'
    )


async def test_synthesizers_make_n_ms_per_character() -> None:
    tone = ToneSynthesizer(25, frame_ms=20)
    pieces = [p async for p in tone.synthesize("hello")]  # 125 ms
    assert [len(p) for p in pieces] == [160] * 6 + [40]
    assert tone.duration_ms("hello") == 125
    assert len(set(b"".join(pieces))) > 2  # a tone, not silence
    silence = [p async for p in SilenceSynthesizer(10).synthesize("abc")]
    assert b"".join(silence) == b"\xff" * 240
    assert [p async for p in ToneSynthesizer().synthesize("")] == []
    with pytest.raises(ValueError):
        ToneSynthesizer(0)


def test_mulaw_matches_g711() -> None:
    assert [linear_to_mulaw(s) for s in (0, 32767, -32768)] == [0xFF, 0x80, 0x00]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    samples = range(-32768, 32768, 3)
    pcm = struct.pack(f"<{len(samples)}h", *samples)
    assert bytes(linear_to_mulaw(s) for s in samples) == audioop.lin2ulaw(pcm, 2)


def test_export_list_is_complete() -> None:
    modules = [
        nodes._alignment,
        nodes._call_control,
        nodes._context,
        nodes._errors,
        nodes._events,
        nodes._llm,
        nodes._node,
        nodes._output_agent,
        nodes._session,
        nodes._tools,
        nodes._tts,
        nodes._worker,
    ]
    exported = set(nodes.__all__)
    for module in modules:
        missing = set(module.__all__) - exported
        assert not missing, f"{module.__name__} exports {missing} but nodes does not"
    for name in nodes.__all__:
        assert getattr(nodes, name) is not None
    assert len(nodes.__all__) == len(exported)


def test_no_event_loop_needed_to_build_an_agent() -> None:
    # agents are built in setup(), but a user may build one at import time too
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    assert nodes.OutputAgentNode("plain").name == "plain"
