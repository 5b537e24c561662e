"""Pocketsphinx in worker processes: whole turns decoded off the gateway's interpreter."""

from __future__ import annotations

import json

import pytest

from audio import read_wav_ulaw, ulaw_to_pcm16
from speech import PocketsphinxPoolTranscriber, StreamFinishedError
from tests import recordings_index as rec


@pytest.fixture
def transcriber():  # type: ignore[no-untyped-def]
    t = PocketsphinxPoolTranscriber(workers=1)
    yield t
    t.close()


def _turn(name: str) -> bytes:
    labels = json.loads((rec.RECORDINGS / f"{name}.json").read_text())
    speech = next(e for e in labels["events"] if e["kind"] == "speech")
    ulaw = read_wav_ulaw(rec.RECORDINGS / f"{name}.wav")
    return ulaw_to_pcm16(ulaw[int((speech["start_ms"] - 300) * 8): int((speech["end_ms"] + 300) * 8)])


async def test_a_whole_turn_is_transcribed_in_a_worker(transcriber) -> None:  # type: ignore[no-untyped-def]
    await transcriber.warm_up()
    stream = transcriber.open_stream()
    pcm = _turn("barge_in_command_goforward")
    for i in range(0, len(pcm), 320):  # 20 ms frames, as the gateway feeds them
        stream.feed(pcm[i : i + 320])
    result = await stream.finish()
    assert result.final
    assert "go forward ten" in result.text
    with pytest.raises(StreamFinishedError):
        stream.feed(b"\x00\x00")


async def test_an_empty_turn_needs_no_worker(transcriber) -> None:  # type: ignore[no-untyped-def]
    stream = transcriber.open_stream()
    assert (await stream.finish()).text == ""
