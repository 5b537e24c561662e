"""The line simulator: deterministic, in the corpus's format, split by source, and its echo path,
DTMF and caller placement do what the labels say."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from audio import read_wav_ulaw
from gateway import twilio_protocol as tp
from gateway.cli import main as callgate
from linesim import (
    ESPEAK_VOICES,
    REAL_VOICE_SPLIT,
    Condition,
    ConditionError,
    SourceError,
    VoiceLibrary,
    generate,
    full_grid,
    grid,
    impacts_grid,
    mixed_grid,
    simulate_call,
    small_grid,
    synthetic_split,
)
from linesim._dsp import active_level_dbfs, band_limit, decode_ulaw, onset_offset, speech_end
from linesim._sources import default_corpus_dir
from linesim._noise import DTMF_FREQS

ECHO_ONLY = Condition(erl_db=12, delay_ms=230, behaviour="echo_only")


def test_same_seed_same_bytes_other_seed_other_bytes(library: VoiceLibrary, tmp_path: Path) -> None:
    conds = [Condition(background="babble"), Condition(background="dtmf", behaviour="echo_only")]
    a = generate(tmp_path / "a", split="train", seed=7, count=2, conditions=conds, library=library)
    generate(tmp_path / "b", split="train", seed=7, count=2, conditions=conds, library=library)
    c = generate(tmp_path / "c", split="train", seed=8, count=2, conditions=conds, library=library)
    files_a = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files_a == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert len(files_a) == 8
    for name in files_a:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert [p.name.replace("_s8_", "_s7_") for p in c] == [p.name for p in a]
    assert (tmp_path / "c" / c[0].name.replace(".json", ".wav")).read_bytes() != \
        (tmp_path / "a" / a[0].name.replace(".json", ".wav")).read_bytes()


def _check_wav(path: Path, n_samples: int) -> None:
    data = path.read_bytes()
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE" and data[12:16] == b"fmt "
    assert struct.unpack("<I", data[16:20])[0] == 18
    tag, ch, rate, bps, align, bits, cb = struct.unpack("<HHIIHHH", data[20:38])
    assert (tag, ch, rate, bps, align, bits, cb) == (7, 1, 8000, 8000, 1, 8, 0)
    assert data[38:42] == b"fact" and struct.unpack("<II", data[42:50]) == (4, n_samples)
    assert data[50:54] == b"data" and struct.unpack("<I", data[54:58])[0] == n_samples


@pytest.mark.parametrize("cond", small_grid()[::3] + impacts_grid()[1:2], ids=lambda c: c.name)
def test_files_follow_the_corpus_format(cond: Condition, library: VoiceLibrary,
                                        tmp_path: Path) -> None:
    call = simulate_call(cond, split="check", seed=3, index=1, library=library, name="rec")
    call.write(tmp_path)
    labels: dict[str, Any] = json.loads((tmp_path / "rec.json").read_text())
    dur = labels["duration_ms"]
    assert dur % 20 == 0 and len(call.inbound) == dur * 8 == len(call.bot)
    _check_wav(tmp_path / "rec.wav", dur * 8)
    _check_wav(tmp_path / "rec.bot.wav", dur * 8)
    assert labels["bot_wav"] == "rec.bot.wav" and labels["set"] == "check"
    assert labels["name"] == "rec" and labels["condition"] == cond.name
    for key in ("scenario", "description", "bot_turns", "events", "expect", "line_noise_dbfs"):
        assert key in labels
    assert labels["bot_turns"] and all(0 <= t["start_ms"] < t["end_ms"] <= dur
                                       for t in labels["bot_turns"])
    starts = [e["start_ms"] for e in labels["events"]]
    assert starts == sorted(starts)
    for e in labels["events"]:
        assert {"kind", "start_ms", "end_ms", "source"} <= set(e), e
        assert e["kind"] in ("speech", "backchannel", "noise", "echo", "dtmf")
        assert e["source"].split(":")[0] in ("real", "espeak-ng", "synthetic"), e
        if e["kind"] in ("speech", "backchannel"):
            assert {"core_onset_ms", "voice", "level_dbfs"} <= set(e)
        if e["kind"] == "noise":
            assert "noise_type" in e
        if e["kind"] == "echo":
            assert e["erl_db"] == cond.erl_db and e["delay_ms"] == cond.delay_ms
    speech = [e for e in labels["events"] if e["kind"] == "speech"]
    expect = labels["expect"]
    in_turn = [e["start_ms"] for e in speech
               if any(t["start_ms"] <= e["start_ms"] < t["end_ms"] for t in labels["bot_turns"])]
    assert expect["barge_in"] == bool(in_turn)
    assert expect["barge_in_onset_ms"] == (min(in_turn) if in_turn else None)
    assert expect["barge_in"] == (cond.behaviour not in ("echo_only", "backchannel"))
    # The Twilio messages: the README's order and numbering; payloads = the WAV's data.
    lines = (tmp_path / "rec.twilio.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"event": "connected", "protocol": "Call", "version": "1.0.0"}
    msgs = [tp.parse_message(line) for line in lines]
    assert isinstance(msgs[1], tp.Start) and isinstance(msgs[-1], tp.Stop)
    seqs = [int(json.loads(line)["sequenceNumber"]) for line in lines[1:]]
    assert seqs == list(range(1, len(lines)))
    media = [m for m in msgs if isinstance(m, tp.Media)]
    assert [m.chunk for m in media] == list(range(1, len(media) + 1))
    assert all(m.timestamp_ms == (m.chunk - 1) * 20 for m in media)
    assert b"".join(m.payload for m in media) == read_wav_ulaw(tmp_path / "rec.wav")
    digits = "".join(m.digit for m in msgs if isinstance(m, tp.Dtmf))
    assert digits == expect["dtmf"]


def test_corpus_voices_are_train_only_and_labelled_by_the_onset_rule(library: VoiceLibrary
                                                                     ) -> None:
    manifest = json.loads((default_corpus_dir() / "manifest.json").read_text())["clips"]
    assert len({e["voice"] for e in manifest}) == 9
    corpus = [c for c in library.speech["train"] if c.cut_from.endswith(".wav")
              and not c.cut_from.count("@")]
    assert [c.cut_from for c in corpus] == [e["file"] for e in manifest]
    for clip, e in zip(corpus, manifest, strict=True):
        assert REAL_VOICE_SPLIT[clip.voice] == "train" and clip.split == "train"
        assert clip.bed is not None and len(clip.bed) == 2 * 8000
        # The labels are what the corpus rule finds in the stored audio, to the ms.
        y = band_limit(clip.samples)
        assert abs(onset_offset(y) - clip.onset) <= 8, e["file"]
        assert abs(speech_end(y) - clip.end) <= 8, e["file"]
        assert clip.onset <= clip.core_onset < clip.end <= len(clip.samples)
        assert active_level_dbfs(y[clip.onset : clip.end]) == pytest.approx(e["level_dbfs"],
                                                                          abs=0.05)
    assert not {c.voice for c in library.speech["check"]} & {c.voice for c in corpus}


def test_corpus_leaves_the_check_split_unchanged(tmp_path: Path, library: VoiceLibrary) -> None:
    (tmp_path / "manifest.json").write_text('{"clips": []}')
    bare = VoiceLibrary(corpus=tmp_path)
    assert len(bare.speech["train"]) < len(library.speech["train"])
    conds = small_grid()[::9]
    for i, cond in enumerate(conds):
        a = simulate_call(cond, split="check", seed=5, index=i, library=bare)
        b = simulate_call(cond, split="check", seed=5, index=i, library=library)
        assert a.labels == b.labels and a.inbound == b.inbound
    # ... and does change the train split's callers.
    train_voices = {e.get("voice") for i, cond in enumerate(small_grid())
                    for e in simulate_call(cond, split="train", seed=5, index=i,
                                           library=library).labels["events"]}
    assert train_voices & {c.voice for c in library.speech["train"]
                           if c.voice.startswith(("fsdd_", "librispeech_"))}


def test_a_broken_corpus_names_its_manifest(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text('{"clips": [{"voice": "nobody", "file": "x.wav"}]}')
    with pytest.raises(SourceError, match=r"manifest\.json.*nobody"):
        VoiceLibrary(corpus=tmp_path)
    with pytest.raises(SourceError, match="manifest.json"):
        VoiceLibrary(corpus=tmp_path / "missing")


def test_split_is_disjoint_by_source(library: VoiceLibrary) -> None:
    train = {c.voice for c in library.speech["train"] + library.backchannel["train"]}
    check = {c.voice for c in library.speech["check"] + library.backchannel["check"]}
    assert train and check and not train & check
    assert all(REAL_VOICE_SPLIT[v] == "train" for v in train)
    assert {(r, s) for r, s in ESPEAK_VOICES.values()} == {
        (r, s) for r in ("bot", "caller", "babble") for s in ("train", "check")}
    assert {synthetic_split(v) for v in range(16)} == {"train", "check"}
    # Every source a call uses belongs to the call's split.
    sources: dict[str, set[str]] = {"train": set(), "check": set()}
    for split in ("train", "check"):
        for i, cond in enumerate(small_grid()):
            labels = simulate_call(cond, split=split, seed=11, index=i,  # type: ignore[arg-type]
                                   library=library).labels
            bot_voice = labels["simulator"]["bot_voice"].removeprefix("espeak-ng:")
            assert ESPEAK_VOICES[bot_voice][1] == split
            for e in labels["events"]:
                for part in e["source"].removeprefix("espeak-ng:").split(","):
                    sources[split].add(part)
                    if part in ESPEAK_VOICES:
                        assert ESPEAK_VOICES[part][1] == split, e
                    if part.startswith("synthetic:") and "#" in part:
                        assert synthetic_split(int(part.split("#")[1])) == split, e
                if e.get("voice") in REAL_VOICE_SPLIT:
                    assert REAL_VOICE_SPLIT[e["voice"]] == split, e
    assert not (sources["train"] & sources["check"]) - {"synthetic"}


def _measure(call: Any) -> tuple[float, float]:
    """Echo delay (cross-correlation peak, ms) and ERL (bot level over inbound level, dB)."""
    x, b = decode_ulaw(call.inbound), decode_ulaw(call.bot)
    size = 1 << int(np.ceil(np.log2(2 * len(x))))
    r = np.fft.irfft(np.fft.rfft(x, size) * np.conj(np.fft.rfft(b, size)), size)
    lag = int(np.argmax(r[: 520 * 8]))
    return lag / 8, active_level_dbfs(band_limit(b)) - active_level_dbfs(x)


@pytest.mark.parametrize(("erl", "delay"), [(6, 0), (12, 230), (30, 480)])
def test_echo_path_has_the_erl_and_delay_it_says(erl: float, delay: float,
                                                 library: VoiceLibrary) -> None:
    call = simulate_call(Condition(erl_db=erl, delay_ms=delay, behaviour="echo_only"),
                         split="train", seed=2, index=0, library=library)
    lag_ms, erl_db = _measure(call)
    assert abs(lag_ms - delay) <= 1
    assert abs(erl_db - erl) <= 2.5  # room tone and hiss add to the inbound level
    echo = [e for e in call.labels["events"] if e["kind"] == "echo"]
    assert [e["start_ms"] - t["start_ms"] for e, t in zip(echo, call.labels["bot_turns"])] == \
        pytest.approx([delay] * len(echo))


def test_a_level_change_moves_the_echo_level_where_the_label_says(library: VoiceLibrary) -> None:
    call = simulate_call(Condition(erl_db=20, delay_ms=100, change="level", behaviour="echo_only"),
                         split="train", seed=4, index=0, library=library)
    change = next(e["path_change"] for e in call.labels["events"] if e["kind"] == "echo")
    assert change["erl_db"] == 8.0
    x, b = decode_ulaw(call.inbound), decode_ulaw(call.bot)
    t = int(change["t_ms"] * 8)
    d = 100 * 8
    before = active_level_dbfs(band_limit(b[: t - 1600])) - active_level_dbfs(x[d : t - 1600 + d])
    after = active_level_dbfs(band_limit(b[t + 1600 :])) - active_level_dbfs(x[t + 1600 + d :])
    assert abs(before - 20) <= 2.5 and abs(after - 8) <= 2.5


def test_dtmf_tones_are_in_band_and_their_messages_follow_them(library: VoiceLibrary) -> None:
    for index in range(6):
        call = simulate_call(Condition(background="dtmf", behaviour="echo_only"), split="check",
                             seed=9, index=index, library=library)
        tones = [e for e in call.labels["events"] if e["kind"] == "dtmf"]
        assert tones and call.labels["expect"]["dtmf"] == "".join(e["digit"] for e in tones)
        x = decode_ulaw(call.inbound)
        msgs = call.messages()
        for e in tones:
            seg = x[int(e["start_ms"] * 8) : int(e["end_ms"] * 8)]
            spec = np.abs(np.fft.rfft(seg * np.hanning(len(seg)), 8000))
            lo, hi = DTMF_FREQS[e["digit"]]
            assert spec[int(lo)] > 10 * np.median(spec) and spec[int(hi)] > 10 * np.median(spec)
            # Right after the media message whose chunk holds the tone's last sample.
            chunk = (int(e["end_ms"] * 8) - 1) // 160 + 1
            at = next(i for i, m in enumerate(msgs) if f'"chunk":"{chunk}"' in m)
            follow = msgs[at + 1 : at + 1 + len(tones)]
            assert any(json.loads(m).get("dtmf", {}).get("digit") == e["digit"] for m in follow)
            first = json.loads(next(m for m in msgs if '"event":"dtmf"' in m))
            assert list(first) == ["event", "streamSid", "sequenceNumber", "dtmf"]
            assert first["dtmf"]["track"] == "inbound_track"


def test_caller_onset_and_level_are_placed_as_labelled(library: VoiceLibrary) -> None:
    for behaviour, level in (("barge_in", None), ("quiet_caller", -35.0), ("early", None)):
        call = simulate_call(Condition(erl_db=35, delay_ms=0, behaviour=behaviour),  # type: ignore[arg-type]
                             split="train", seed=1, index=3, library=library)
        ev = next(e for e in call.labels["events"] if e["kind"] == "speech")
        turn = call.labels["bot_turns"][0]
        if behaviour == "early":
            assert 0 <= ev["start_ms"] - turn["start_ms"] <= 200
        if level is not None:
            assert ev["level_dbfs"] == pytest.approx(level, abs=0.2)
        # Nothing but the echo, 35 dB down, and room tone before the onset; the caller after.
        x = decode_ulaw(call.inbound)
        on = int(ev["start_ms"] * 8)
        pre = active_level_dbfs(x[on - 800 : on - 80])
        post = active_level_dbfs(x[on : on + 1600])
        assert post - pre >= 8, (behaviour, pre, post)


def test_impacts_are_loud_bursts_in_every_bot_turn(library: VoiceLibrary) -> None:
    """``impacts``: 1-3 bursts in each bot turn (knocks among them), each labelled where the
    inbound audio holds it, at most 4 dB louder than ``transients``."""
    kinds: set[str] = set()
    for index in range(4):
        call = simulate_call(Condition(erl_db=35, delay_ms=0, background="impacts",
                                       behaviour="echo_only"),
                             split="train", seed=1, index=index, library=library)
        bursts = [e for e in call.labels["events"] if e["kind"] == "noise"
                  and e["noise_type"] not in ("caller_room_tone", "room")]
        x = decode_ulaw(call.inbound)
        for turn in call.labels["bot_turns"]:
            inside = [e for e in bursts if turn["start_ms"] <= e["start_ms"] < turn["end_ms"]]
            assert 1 <= len(inside) <= 3, (index, turn, bursts)
        for e in bursts:
            kinds.add(e["noise_type"])
            a, b = int(e["start_ms"] * 8), int(e["end_ms"] * 8)
            peak = 20 * np.log10(np.max(np.abs(x[a:b])) + 1e-9)
            # a -40 dBFS breath peaks over -34; a -20 dBFS cough or click under about 0
            assert -34.0 <= peak <= e["peak_dbfs"] + 1.0 and e["peak_dbfs"] <= 0.0, e
    assert "knock" in kinds and kinds <= {"cough", "laugh", "knock", "click", "breath"}


def test_the_second_turn_behaviour_barges_into_a_later_turn(library: VoiceLibrary) -> None:
    for index in range(3):
        labels = simulate_call(Condition(behaviour="second_turn"), split="train", seed=1,
                               index=index, library=library).labels
        onset = labels["expect"]["barge_in_onset_ms"]
        turns = labels["bot_turns"]
        assert len(turns) >= 2 and any(t["start_ms"] <= onset < t["end_ms"] for t in turns[1:])


def test_the_mixed_grid_combines_every_axis_and_is_the_same_each_time() -> None:
    points = mixed_grid()
    assert [c.name for c in points] == [c.name for c in grid("mixed")]  # fixed, not per run
    assert len({c.name for c in points}) == len(points) == 96
    full = {c.name for c in full_grid()}
    assert all(c.name in full for c in points)
    for axis in ("erl_db", "delay_ms", "change", "nonlinearity", "background", "behaviour"):
        assert {getattr(c, axis) for c in points} == {getattr(c, axis) for c in full_grid()}, axis
    # Not the small grid's one axis at a time: most points move three or more from the base.
    base = small_grid()[0]
    moved = [sum(getattr(c, a) != getattr(base, a) for a in ("erl_db", "delay_ms", "change",
                                                             "nonlinearity", "background"))
             for c in points]
    assert sum(m >= 3 for m in moved) > len(points) // 2


def test_condition_names_round_trip_and_bad_ones_say_why() -> None:
    for cond in small_grid() + impacts_grid():
        assert Condition.parse(cond.name) == cond
    with pytest.raises(ConditionError, match="background must be one of"):
        Condition.parse("erl20-d150-none-none-disco-barge_in")
    with pytest.raises(ConditionError, match="delay_ms must be in"):
        Condition(delay_ms=900)
    with pytest.raises(ConditionError, match="expected erl"):
        Condition.parse("loud")


def test_simulate_command_writes_calls_and_refuses_bad_input_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = callgate(["simulate", str(tmp_path / "out"), "--split", "train", "--seed", "1",
                   "--count", "2", "--condition", "erl9-d300-none-clip-quiet-short_word"])
    assert rc == 0
    labels = sorted((tmp_path / "out").glob("*.json"))
    assert len(labels) == 2
    assert json.loads(labels[0].read_text())["condition"] == "erl9-d300-none-clip-quiet-short_word"
    capsys.readouterr()
    rc = callgate(["simulate", str(tmp_path / "bad"), "--split", "check",
                   "--condition", "erl9-d300-none-clip-quiet-yodel"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "behaviour must be one of" in err
    rc = callgate(["simulate", str(tmp_path / "bad"), "--split", "check", "--voices",
                   str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no labelled recordings" in err
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


def test_payload_of_a_media_message_is_160_bytes(library: VoiceLibrary) -> None:
    call = simulate_call(ECHO_ONLY, split="train", seed=0, index=0, library=library)
    media = [json.loads(m) for m in call.messages() if '"event":"media"' in m]
    assert {len(base64.b64decode(m["media"]["payload"])) for m in media} == {160}


def test_public_names_resolve() -> None:
    import linesim
    import linesim.scoring

    for module in (linesim, linesim.scoring):
        assert len(module.__all__) == len(set(module.__all__))
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name!r}"
