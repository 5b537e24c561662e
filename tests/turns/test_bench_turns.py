"""bench.turns end to end on one recording: the real gateway and worker against the bench's own
OpenAI-protocol stub, at 1x. What must hold whatever the machine's speed: a reply is never
played before the turn's end was decided (the early reply is held), never sooner than the
providers allow after the transcript went out, and both methods measure the caller's turns.
The stub's recogniser streams each recording's own words (checked here without the gateway)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from audio import (
    FRAME_BYTES,
    FRAME_MS,
    UlawEncoder,
    pcm16_to_ulaw,
    read_wav_ulaw,
    ulaw_to_pcm16,
)
from bench import turn_end, turns
from bench._openai_stub import Latencies, OpenAIStub


@pytest.mark.slow
def test_bench_turns_measures_both_methods(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "turns.json"
    assert turns.main(["--recordings", "turn_gap_then_barge_in", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    callgate = "callgate turn taking (defaults), realtime stt"
    timer_name = "silence timer 700 ms, upload stt"
    assert f"| {callgate} | 2 |" in printed
    assert f"| {timer_name} | 2 |" in printed
    report = json.loads(out.read_text())
    providers = 150 + 350 + 200
    for method, rows in report.items():
        assert len(rows) == 2, method
        for r in rows:
            assert r["v2v_ms"] >= r["decide_ms"]  # nothing plays before the turn end
            assert r["own_ms"] >= 0  # nor before the providers could have answered
            assert r["v2v_ms"] >= providers  # callgate cannot beat the providers' own latency
            # The gateway's own turn_latency event, its stages in order on the media clock.
            st = r["stages"]
            assert st["transcript_ms"] <= st["llm_first_text_ms"] <= st["tts_first_audio_ms"]
            assert max(st["tts_first_audio_ms"], st["turn_end_ms"]) <= st["first_audio_ms"]
            assert st["first_audio_ms"] <= st["heard_ms"]
            assert st["stt_ms"] >= 0 and st["hold_ms"] >= 0
            # (No bound from the stub's latencies: under load the replay's media clock, which
            # stamps these, runs behind the stub's wall-clock sleeps.)
    timer = report[timer_name]
    assert all(r["decide_ms"] >= 700 - 160 for r in timer)  # the timer counts from the last window
    # The stub streamed the caller's own words: none in the turn without a text (spk1_snt6),
    # TIMIT's sentence word by word in the other; every realtime session was placed; and the
    # gateway's detector read a finished text there (its turn_end says text_done).
    said = [w for w, _, _ in json.loads(turn_end.WORDS_FILE.read_text())[
        "turn_gap_then_barge_in@8420"]]
    unlabelled, timit = report[callgate]
    assert unlabelled["partials"] == []
    assert timit["partials"] == [" ".join(said[:k + 1]) for k in range(len(said))]
    assert timit["text_done"] is True
    row = next(line for line in printed.splitlines() if line.startswith(f"| {callgate} |"))
    found, sessions = row.rstrip(" |").rsplit("|", 1)[1].split(" / ")
    assert int(found) == int(sessions) >= 2


def test_a_missing_recording_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert turns.main(["--recordings", "no_such_call"]) == 2
    assert capsys.readouterr().err.strip() == "error: no such recording: no_such_call"


async def _transcribe(stub: OpenAIStub, ulaw: bytes) -> str:
    """One realtime session on a real WebSocket: ``ulaw`` appended a 20 ms frame at a time,
    then the commit; the final transcript."""
    url = stub.base_url.replace("http://", "ws://") + "/realtime?intent=transcription"
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        for i in range(0, len(ulaw), FRAME_BYTES):
            await ws.send_json({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(ulaw[i:i + FRAME_BYTES]).decode()})
        await ws.send_json({"type": "input_audio_buffer.commit"})
        async for msg in ws:
            event = json.loads(msg.data)
            if event["type"] == "conversation.item.input_audio_transcription.completed":
                return str(event["transcript"])
    raise AssertionError("the session ended without a final transcript")


async def test_the_stubs_partials_are_the_recordings_words() -> None:
    """bench.turns' stub recogniser finds a session's audio in its recording and streams the
    caller's own words there (the forced alignment bench.turn_end uses), each word's partial
    at the first frame that takes the audio received ``partial_lag_ms`` past its end, and the
    words as its final; a turn with no text anywhere gets no partials and the fixed sentence,
    room tone an empty final, audio from no recording the fixed sentence (and is counted)."""
    name = "turn_gap_then_barge_in"
    caller = turns.caller_speech(name)
    raw = read_wav_ulaw(turns.RECORDINGS / f"{name}.wav")
    # The bytes the gateway's realtime stream sends for the recording's (speech/_openai_stt.py).
    assert UlawEncoder(8000).push(ulaw_to_pcm16(raw)) == caller.audio
    words = json.loads(turn_end.WORDS_FILE.read_text())[f"{name}@8420"]
    said = [w for w, _, _ in words]
    assert said[0] == "she" and said[-1] == "year"
    start = 8420 - 500  # the gateway's stream starts with its preroll, before the onset
    lag = Latencies().partial_lag_ms
    assert lag == turn_end.FIT_LAG_MS
    async with OpenAIStub(Latencies(stt_ms=0), {name: caller}) as stub:
        final = await _transcribe(stub, caller.audio[start * 8:(11156 + 300) * 8])
        unlabelled = await _transcribe(stub, caller.audio[2500 * 8:5300 * 8])  # spk1_snt6
        room_tone = await _transcribe(stub, caller.audio[200 * 8:1500 * 8])
        tone = np.sin(2 * np.pi * 440 * np.arange(8000) / 8000) * 8000
        elsewhere = await _transcribe(stub, pcm16_to_ulaw(tone.astype(np.int16).tobytes()))
    voiced, none, quiet, lost = stub.sessions
    assert (voiced.recording, voiced.offset_ms) == (name, start)
    assert [text for _, text in voiced.partials] == [" ".join(said[:k + 1])
                                                    for k in range(len(said))]
    assert final == voiced.final == " ".join(said)
    for (received, _), (_, _, end) in zip(voiced.partials, words, strict=True):
        due = end + lag - start
        assert due <= received < due + FRAME_MS, (received, due)
    assert (none.recording, none.partials, unlabelled) == (name, [], OpenAIStub.TRANSCRIPT)
    assert (quiet.recording, quiet.partials, room_tone) == (name, [], "")
    assert (lost.recording, elsewhere) == (None, OpenAIStub.TRANSCRIPT)
