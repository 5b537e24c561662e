"""Pocketsphinx in worker processes: whole turns (the default), or each turn as its audio
arrives."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from audio import read_wav_ulaw, ulaw_to_pcm16
from speech import (
    PocketsphinxPoolTranscriber,
    StreamClosedError,
    StreamFinishedError,
    StreamState,
    Transcriber,
    TranscriptionStream,
)
from tests import recordings_index as rec

FRAME = 320  # 20 ms of 8 kHz PCM16, as the gateway feeds it


@pytest.fixture
def transcriber():  # type: ignore[no-untyped-def]
    t = PocketsphinxPoolTranscriber(workers=1, as_audio_arrives=True)
    yield t
    t.close()


def _turn(name: str) -> bytes:
    labels = json.loads((rec.RECORDINGS / f"{name}.json").read_text())
    speech = next(e for e in labels["events"] if e["kind"] in ("speech", "backchannel"))
    ulaw = read_wav_ulaw(rec.RECORDINGS / f"{name}.wav")
    return ulaw_to_pcm16(ulaw[int((speech["start_ms"] - 300) * 8): int((speech["end_ms"] + 300) * 8)])


def _feed(stream: TranscriptionStream, pcm: bytes, chunk: int = FRAME) -> None:
    for i in range(0, len(pcm), chunk):
        stream.feed(pcm[i : i + chunk])


async def _transcribe(t: PocketsphinxPoolTranscriber, pcm: bytes, chunk: int = FRAME) -> str:
    stream = t.open_stream()
    try:
        _feed(stream, pcm, chunk)
        result = await stream.finish()
    finally:
        stream.close()
    assert result.final
    return result.text


def test_is_a_transcriber(transcriber) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(transcriber, Transcriber)
    stream = transcriber.open_stream()
    assert isinstance(stream, TranscriptionStream)
    stream.close()


async def test_a_turn_is_decoded_while_it_is_spoken(transcriber) -> None:  # type: ignore[no-untyped-def]
    await transcriber.warm_up()
    pcm = _turn("barge_in_command_goforward")
    half = len(pcm) // 2 & ~1
    stream = transcriber.open_stream()
    _feed(stream, pcm[:half])
    interim = await stream.partial()  # the worker has decoded what came so far
    assert interim is not None and not interim.final
    assert interim.text.split()[:2] == ["go", "forward"], interim.text
    _feed(stream, pcm[half:])
    result = await stream.finish()
    stream.close()
    assert result.final
    # Live normalisation: "go forward and the ears" (the whole turn at once gets "ten meters").
    assert result.text.split()[:2] == ["go", "forward"], result.text
    with pytest.raises(StreamClosedError):
        stream.feed(b"\x00\x00")


async def test_the_result_does_not_depend_on_chunking(transcriber) -> None:  # type: ignore[no-untyped-def]
    pcm = _turn("barge_in_command_goforward")
    framed = await _transcribe(transcriber, pcm)
    odd = await _transcribe(transcriber, pcm, 333)  # splits samples across chunks
    assert odd == framed
    assert "forward" in framed.split()


async def test_concurrent_turns_on_one_worker_keep_apart(transcriber) -> None:  # type: ignore[no-untyped-def]
    a, b = _turn("barge_in_command_goforward"), _turn("barge_in_timit")
    alone_a = await _transcribe(transcriber, a)
    alone_b = await _transcribe(transcriber, b)
    sa, sb = transcriber.open_stream(), transcriber.open_stream()
    for i in range(0, max(len(a), len(b)), FRAME):  # interleaved, as two calls feed them
        if i < len(a):
            sa.feed(a[i : i + FRAME])
        if i < len(b):
            sb.feed(b[i : i + FRAME])
        await asyncio.sleep(0)
    both = await asyncio.gather(sa.finish(), sb.finish())
    sa.close()
    sb.close()
    assert [r.text for r in both] == [alone_a, alone_b]
    assert alone_a != alone_b


async def test_a_turn_closed_midway_leaves_the_worker_clean(transcriber) -> None:  # type: ignore[no-untyped-def]
    pcm = _turn("barge_in_command_goforward")
    before = await _transcribe(transcriber, pcm)
    stream = transcriber.open_stream()
    _feed(stream, _turn("barge_in_timit"))
    assert (await stream.partial()) is not None
    await stream.aclose()  # the caller hung up mid-turn
    assert stream.state is StreamState.CLOSED
    assert await _transcribe(transcriber, pcm) == before


async def test_lifecycle_is_checked(transcriber) -> None:  # type: ignore[no-untyped-def]
    stream = transcriber.open_stream()
    _feed(stream, _turn("barge_in_command_goforward"))
    waiting = asyncio.ensure_future(stream.finish())
    await asyncio.sleep(0)
    with pytest.raises(StreamFinishedError):
        stream.feed(b"\x00\x00")
    stream.close()  # while the worker decodes: the waiter fails, the worker is left clean
    with pytest.raises(StreamClosedError):
        await waiting
    assert "forward" in (await _transcribe(transcriber, _turn("barge_in_command_goforward")))


async def test_an_empty_turn_needs_no_worker(transcriber) -> None:  # type: ignore[no-untyped-def]
    stream = transcriber.open_stream()
    assert (await stream.finish()).text == ""
    assert transcriber.worker_pids() == []


async def test_a_worker_killed_mid_turn_is_replaced_and_gets_the_whole_turn(
    transcriber,  # type: ignore[no-untyped-def]
) -> None:
    pcm = _turn("barge_in_command_goforward")
    expected = await _transcribe(transcriber, pcm)
    half = len(pcm) // 2 & ~1
    stream = transcriber.open_stream()
    _feed(stream, pcm[:half])
    assert (await stream.partial()) is not None  # the first half is in the worker
    (pid,) = transcriber.worker_pids()
    os.kill(pid, signal.SIGKILL)
    while pid in transcriber.worker_pids():
        await asyncio.sleep(0.02)
    _feed(stream, pcm[half:])
    result = await stream.finish()
    stream.close()
    assert result.text == expected
    assert transcriber.rebuilds == 1
    assert transcriber.worker_pids() and pid not in transcriber.worker_pids()


async def test_by_default_a_whole_turn_is_decoded_at_its_end() -> None:
    t = PocketsphinxPoolTranscriber(workers=1)
    try:
        stream = t.open_stream()
        _feed(stream, _turn("barge_in_command_goforward"))
        assert await stream.partial() is None  # nothing decoded before the end
        assert t.worker_pids() == []
        result = await stream.finish()
        stream.close()
        assert "go forward ten" in result.text  # batch normalisation: "go forward ten meters"
    finally:
        t.close()


def test_workers_must_be_positive() -> None:
    from speech import ConfigurationError

    with pytest.raises(ConfigurationError, match="workers"):
        PocketsphinxPoolTranscriber(workers=0)


# -- keyphrases beside the transcript (real human speech: the only phrases of the scripted agent
# -- that any recording here holds are "yes"; "go forward" stands in for a command phrase) -----
async def test_keyphrases_are_spotted_beside_the_open_transcript() -> None:
    t = PocketsphinxPoolTranscriber(workers=1, keyphrases=["Go  forward", "yes", "balance"],
                                    as_audio_arrives=True)
    try:
        assert t.keyphrases == ("go forward", "yes", "balance")
        stream = t.open_stream()
        _feed(stream, _turn("barge_in_command_goforward"))
        result = await stream.finish()
        stream.close()
        assert result.keyphrases == ("go forward",)
        assert result.text.split()[:2] == ["go", "forward"]  # the open transcript is kept
        stream = t.open_stream()
        _feed(stream, _turn("backchannel_real_yes"))
        assert (await stream.finish()).keyphrases == ("yes",)
        stream.close()
        stream = t.open_stream()
        _feed(stream, _turn("barge_in_timit"))  # "She had your dark suit in greasy wash water"
        assert (await stream.finish()).keyphrases == ()
        stream.close()
    finally:
        t.close()


def test_keyphrases_are_checked_against_the_dictionary() -> None:
    from speech import ConfigurationError

    with pytest.raises(ConfigurationError, match="qwzxv"):
        PocketsphinxPoolTranscriber(keyphrases=["my balance", "qwzxv"])


def test_one_phone_keyphrases_are_left_out_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    t = PocketsphinxPoolTranscriber(keyphrases=["owe", "pay my bill", "oh"])
    assert t.keyphrases == ("pay my bill",)
    assert "['owe', 'oh']" in caplog.text
