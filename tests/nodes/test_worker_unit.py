"""Worker helpers: agent loading, Twilio TwiML, the test synthesizers, the export list."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import nodes
from audio import ulaw_to_pcm16
from nodes import (
    AgentLoadError,
    SilenceSynthesizer,
    ToneSynthesizer,
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


async def test_the_tone_is_the_mu_law_of_its_sine() -> None:
    tone = ToneSynthesizer(10, frequency=440.0, level=0.5)
    short = b"".join([p async for p in tone.synthesize("abcd")])  # 40 ms
    ulaw = b"".join([p async for p in tone.synthesize("abcdefgh")])  # 80 ms, the kept tone grown
    assert ulaw[: len(short)] == short
    want = 0.5 * 32767 * np.sin(2 * np.pi * 440.0 * np.arange(len(ulaw)) / 8000)
    got = np.frombuffer(ulaw_to_pcm16(ulaw), dtype=np.int16)
    # G.711 mu-law keeps each sample to within half a step: ~3% of its size, 4 LSB near zero.
    assert np.all(np.abs(got - want) <= 0.035 * np.abs(want) + 8)


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
