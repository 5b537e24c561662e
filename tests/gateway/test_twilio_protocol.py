"""Tests for gateway.twilio_protocol: golden wire lines, round trips, errors and fuzzing."""

from __future__ import annotations

import base64
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gateway.twilio_protocol as tp
from gateway.twilio_protocol import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MULAW_8K,
    Connected,
    Dtmf,
    InvalidMessage,
    MalformedFrame,
    Mark,
    Media,
    MediaFormat,
    OutboundClear,
    OutboundMark,
    OutboundMedia,
    PayloadTooLarge,
    ProtocolError,
    Start,
    Stop,
    UnknownEvent,
    UnsupportedMediaFormat,
    build_connected,
    build_dtmf,
    build_mark,
    build_media,
    build_start,
    build_stop,
    clear_message,
    encode_message,
    encode_outbound,
    mark_message,
    media_message,
    parse_message,
    parse_outbound,
)

from ..common import SHARED_RECORDINGS as RECORDINGS
from ..common import assert_exports_complete
from ..common import needs_shared_recordings as needs_recordings

# Copied verbatim from ../shared/recordings so the suite stands on its own.
SID = "MZe72b5b8d159072e94b0db809ba700613"
ACCOUNT = "AC738f49fd34e1cc280e5a43c8eadc540c"
CALL = "CA3062378f6d0862be2908223f581cd592"
GOLDEN_CONNECTED = '{"event":"connected","protocol":"Call","version":"1.0.0"}'
GOLDEN_START = (
    '{"event":"start","sequenceNumber":"1","start":{"accountSid":"AC738f49fd34e1cc280e5a43c8eadc540c",'
    '"streamSid":"MZe72b5b8d159072e94b0db809ba700613","callSid":"CA3062378f6d0862be2908223f581cd592",'
    '"tracks":["inbound"],"mediaFormat":{"encoding":"audio/x-mulaw","sampleRate":8000,"channels":1},'
    '"customParameters":{}},"streamSid":"MZe72b5b8d159072e94b0db809ba700613"}'
)
GOLDEN_MEDIA_PAYLOAD = (
    "/33//v9///9//v58ff79+/9/f3z+/X1+/3z//H5//33//H19+n9+/n3///58ff7//H18fn37/X/9fv79fn76fnl9ff79"
    "/35+/v9+/v39/X99fv79fnp9/fz+ff78/n5/f3t9/f7//v79fHv6/nj9fnn8+/1+fvl+/vp6en5+fn5/fH39+/h+fP5+"
    "fnx/+/3+/359e//8fn5/fX/9fn1+/A=="
)
GOLDEN_MEDIA = (
    '{"event":"media","sequenceNumber":"2","media":{"track":"inbound","chunk":"1","timestamp":"0",'
    f'"payload":"{GOLDEN_MEDIA_PAYLOAD}"}},"streamSid":"MZe72b5b8d159072e94b0db809ba700613"}}'
)
GOLDEN_STOP = (
    '{"event":"stop","sequenceNumber":"386","stop":{"accountSid":"AC738f49fd34e1cc280e5a43c8eadc540c",'
    '"callSid":"CA3062378f6d0862be2908223f581cd592"},"streamSid":"MZe72b5b8d159072e94b0db809ba700613"}'
)
GOLDEN_DTMF = (
    '{"event":"dtmf","streamSid":"MZ5d368bea6b042d85454d7c4d11fa1df6","sequenceNumber":"513",'
    '"dtmf":{"track":"inbound_track","digit":"4"}}'
)
# Twilio's documented example, compacted (the recordings have no bot, so no marks).
GOLDEN_MARK = (
    '{"event":"mark","sequenceNumber":"4","streamSid":"MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX",'
    '"mark":{"name":"my label"}}'
)
GOLDEN_LINES = [GOLDEN_CONNECTED, GOLDEN_START, GOLDEN_MEDIA, GOLDEN_DTMF, GOLDEN_MARK, GOLDEN_STOP]


def test_exports_are_complete() -> None:
    assert_exports_complete(tp)


# --- golden lines -------------------------------------------------------------------------------


def test_golden_connected() -> None:
    msg = parse_message(GOLDEN_CONNECTED)
    assert msg == Connected(protocol="Call", version="1.0.0")
    assert msg.event == "connected"
    assert build_connected() == GOLDEN_CONNECTED


def test_golden_start() -> None:
    msg = parse_message(GOLDEN_START)
    assert isinstance(msg, Start) and msg.event == "start"
    assert (msg.sequence_number, msg.stream_sid, msg.account_sid, msg.call_sid) == (
        1,
        SID,
        ACCOUNT,
        CALL,
    )
    assert msg.tracks == ("inbound",)
    assert msg.media_format == MediaFormat("audio/x-mulaw", 8000, 1) == MULAW_8K
    assert dict(msg.custom_parameters) == {}
    assert build_start(stream_sid=SID, account_sid=ACCOUNT, call_sid=CALL) == GOLDEN_START


def test_golden_media() -> None:
    msg = parse_message(GOLDEN_MEDIA)
    assert isinstance(msg, Media) and msg.event == "media"
    assert (msg.sequence_number, msg.chunk, msg.timestamp_ms, msg.track) == (2, 1, 0, "inbound")
    assert msg.payload == base64.b64decode(GOLDEN_MEDIA_PAYLOAD) and len(msg.payload) == 160
    built = build_media(
        sequence_number=2, stream_sid=SID, chunk=1, timestamp_ms=0, payload=msg.payload
    )
    assert built == GOLDEN_MEDIA


def test_golden_dtmf() -> None:
    msg = parse_message(GOLDEN_DTMF)
    assert msg == Dtmf(
        sequence_number=513,
        stream_sid="MZ5d368bea6b042d85454d7c4d11fa1df6",
        track="inbound_track",
        digit="4",
    )
    built = build_dtmf(sequence_number=513, stream_sid=msg.stream_sid, digit="4")
    assert built == GOLDEN_DTMF


def test_golden_mark() -> None:
    msg = parse_message(GOLDEN_MARK)
    assert msg == Mark(
        sequence_number=4, stream_sid="MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX", name="my label"
    )
    assert build_mark(sequence_number=4, stream_sid=msg.stream_sid, name="my label") == GOLDEN_MARK


def test_golden_stop() -> None:
    msg = parse_message(GOLDEN_STOP)
    assert msg == Stop(sequence_number=386, stream_sid=SID, account_sid=ACCOUNT, call_sid=CALL)
    built = build_stop(sequence_number=386, stream_sid=SID, account_sid=ACCOUNT, call_sid=CALL)
    assert built == GOLDEN_STOP


@pytest.mark.parametrize("line", GOLDEN_LINES)
def test_golden_lines_round_trip_byte_for_byte(line: str) -> None:
    assert encode_message(parse_message(line)) == line
    assert parse_message(line.encode("utf-8")) == parse_message(line)


def test_events_narrow_on_tag() -> None:
    tags = [parse_message(line).event for line in GOLDEN_LINES]
    assert tags == ["connected", "start", "media", "dtmf", "mark", "stop"]


def _check_recording(path: Path) -> None:
    from audio import read_wav_ulaw

    lines = path.read_text(encoding="utf-8").splitlines()
    messages = [parse_message(line) for line in lines]
    for line, msg in zip(lines, messages, strict=True):
        assert encode_message(msg) == line  # builders reproduce Twilio's bytes exactly
    assert isinstance(messages[0], Connected)
    assert isinstance(messages[1], Start) and isinstance(messages[-1], Stop)
    seqs = [m.sequence_number for m in messages[1:] if not isinstance(m, Connected)]
    assert seqs == list(range(1, len(seqs) + 1))
    media = [m for m in messages if isinstance(m, Media)]
    assert [m.chunk for m in media] == list(range(1, len(media) + 1))
    assert all(m.timestamp_ms == 20 * (m.chunk - 1) for m in media)
    wav = path.with_name(path.name.replace(".twilio.jsonl", ".wav"))
    assert b"".join(m.payload for m in media) == read_wav_ulaw(wav)


@needs_recordings
def test_recording_barge_in_timit_parses_and_rebuilds_exactly() -> None:
    _check_recording(RECORDINGS / "barge_in_timit.twilio.jsonl")


@needs_recordings
def test_recording_dtmf_pin_after_prompt_parses_and_rebuilds_exactly() -> None:
    path = RECORDINGS / "dtmf_pin_after_prompt.twilio.jsonl"
    _check_recording(path)
    digits = "".join(
        m.digit
        for m in map(parse_message, path.read_text(encoding="utf-8").splitlines())
        if isinstance(m, Dtmf)
    )
    labels = json.loads((RECORDINGS / "dtmf_pin_after_prompt.json").read_text(encoding="utf-8"))
    assert digits == labels["expect"]["dtmf"] == "4729#"


@needs_recordings
def test_every_recording_parses_and_rebuilds_exactly() -> None:
    paths = sorted(RECORDINGS.glob("*.twilio.jsonl"))
    assert paths
    for path in paths:
        _check_recording(path)


# --- inbound details ----------------------------------------------------------------------------


def test_start_with_custom_parameters_and_two_tracks() -> None:
    text = build_start(
        sequence_number=1,
        stream_sid="MZ1",
        account_sid="AC1",
        call_sid="CA1",
        tracks=["inbound", "outbound"],
        custom_parameters={"token": "abc.def", "agent": "sales", "name": "Zoë"},
    )
    msg = parse_message(text)
    assert isinstance(msg, Start)
    assert msg.tracks == ("inbound", "outbound")
    assert msg.custom_parameters == {"token": "abc.def", "agent": "sales", "name": "Zoë"}
    assert encode_message(msg) == text


def test_media_payload_of_any_length_up_to_the_cap() -> None:
    for n in (1, 7, 160, 161, 4000, DEFAULT_MAX_PAYLOAD_BYTES):
        text = build_media(
            sequence_number=3, stream_sid="MZ1", chunk=2, timestamp_ms=20, payload=b"\x7f" * n
        )
        msg = parse_message(text)
        assert isinstance(msg, Media) and msg.payload == b"\x7f" * n
    too_big = build_media(
        sequence_number=3,
        stream_sid="MZ1",
        chunk=2,
        timestamp_ms=20,
        payload=b"\x7f" * (DEFAULT_MAX_PAYLOAD_BYTES + 1),
    )
    with pytest.raises(PayloadTooLarge):
        parse_message(too_big)
    raised_cap = 2 * DEFAULT_MAX_PAYLOAD_BYTES
    assert isinstance(parse_message(too_big, max_payload_bytes=raised_cap), Media)


def test_payload_cap_is_configurable() -> None:
    text = build_media(sequence_number=1, stream_sid="S", chunk=1, timestamp_ms=0, payload=b"ab")
    with pytest.raises(PayloadTooLarge):
        parse_message(text, max_payload_bytes=1)
    with pytest.raises(ValueError):
        parse_message(text, max_payload_bytes=0)


def test_numbers_may_also_arrive_as_json_integers() -> None:
    obj = json.loads(GOLDEN_MEDIA)
    obj["sequenceNumber"], obj["media"]["chunk"], obj["media"]["timestamp"] = 2, 1, 0
    assert parse_message(json.dumps(obj)) == parse_message(GOLDEN_MEDIA)


@pytest.mark.parametrize("digit", sorted(tp.DTMF_DIGITS))
def test_every_dtmf_digit(digit: str) -> None:
    msg = parse_message(build_dtmf(sequence_number=9, stream_sid="MZ1", digit=digit))
    assert isinstance(msg, Dtmf) and msg.digit == digit


def _mutate(line: str, path: list[str], value: Any) -> str:
    obj = json.loads(line)
    target = obj
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(obj)


_DELETE = object()


@pytest.mark.parametrize(
    ("text", "error", "reason"),
    [
        ("not json", MalformedFrame, "not JSON"),
        ("", MalformedFrame, "not JSON"),
        (b"\xff\xfe", MalformedFrame, "not UTF-8"),
        ("[1, 2]", MalformedFrame, "JSON object"),
        ('"media"', MalformedFrame, "JSON object"),
        ("{}", MalformedFrame, "event is missing"),
        ('{"event": 5}', MalformedFrame, "event must be a string"),
        ('{"event": "bogus"}', UnknownEvent, "unknown event 'bogus'"),
        ('{"event": "clear", "streamSid": "MZ1"}', UnknownEvent, "clear"),
        ("[" * 50000, MalformedFrame, ""),
        ('{"event":"media","n":' + "9" * 5000 + "}", MalformedFrame, "not JSON"),
        (_mutate(GOLDEN_MEDIA, ["media", "payload"], "!!!notbase64"), MalformedFrame, "base64"),
        (_mutate(GOLDEN_MEDIA, ["media", "payload"], "AAA"), MalformedFrame, "base64"),
        (_mutate(GOLDEN_MEDIA, ["media", "payload"], ""), MalformedFrame, "empty"),
        (_mutate(GOLDEN_MEDIA, ["media", "payload"], "Zm9v\u00e9"), MalformedFrame, "base64"),
        (_mutate(GOLDEN_MEDIA, ["media", "payload"], None), MalformedFrame, "got null"),
        (_mutate(GOLDEN_MEDIA, ["media", "payload"], _DELETE), MalformedFrame, "missing"),
        (_mutate(GOLDEN_MEDIA, ["media"], [1]), MalformedFrame, "media must be an object"),
        (_mutate(GOLDEN_MEDIA, ["streamSid"], 7), MalformedFrame, "streamSid must be a string"),
        (_mutate(GOLDEN_MEDIA, ["sequenceNumber"], "-1"), MalformedFrame, "non-negative"),
        (_mutate(GOLDEN_MEDIA, ["sequenceNumber"], -1), MalformedFrame, "non-negative"),
        (_mutate(GOLDEN_MEDIA, ["sequenceNumber"], "1.5"), MalformedFrame, "decimal integer"),
        (_mutate(GOLDEN_MEDIA, ["sequenceNumber"], "\uff11"), MalformedFrame, "decimal integer"),
        (_mutate(GOLDEN_MEDIA, ["sequenceNumber"], "9" * 40), MalformedFrame, "decimal integer"),
        (_mutate(GOLDEN_MEDIA, ["sequenceNumber"], True), MalformedFrame, "a boolean"),
        (_mutate(GOLDEN_MEDIA, ["sequenceNumber"], 2.0), MalformedFrame, "a number"),
        (_mutate(GOLDEN_MEDIA, ["media", "chunk"], "x"), MalformedFrame, "media.chunk"),
        (_mutate(GOLDEN_MEDIA, ["media", "timestamp"], _DELETE), MalformedFrame, "timestamp"),
        (_mutate(GOLDEN_DTMF, ["dtmf", "digit"], "E"), MalformedFrame, "0-9 * # A-D"),
        (_mutate(GOLDEN_DTMF, ["dtmf", "digit"], "12"), MalformedFrame, "0-9 * # A-D"),
        (_mutate(GOLDEN_DTMF, ["dtmf", "digit"], "a"), MalformedFrame, "0-9 * # A-D"),
        (_mutate(GOLDEN_MARK, ["mark", "name"], 3), MalformedFrame, "mark.name"),
        (_mutate(GOLDEN_STOP, ["stop", "callSid"], _DELETE), MalformedFrame, "stop.callSid"),
        (_mutate(GOLDEN_CONNECTED, ["protocol"], _DELETE), MalformedFrame, "protocol"),
        (_mutate(GOLDEN_START, ["start", "tracks"], "inbound"), MalformedFrame, "tracks"),
        (_mutate(GOLDEN_START, ["start", "tracks"], [1]), MalformedFrame, "tracks"),
        (_mutate(GOLDEN_START, ["streamSid"], "MZother"), MalformedFrame, "differ"),
        (
            _mutate(GOLDEN_START, ["start", "customParameters"], {"a": 1}),
            MalformedFrame,
            "customParameters",
        ),
        (
            _mutate(GOLDEN_START, ["start", "mediaFormat", "encoding"], "audio/l16"),
            UnsupportedMediaFormat,
            "audio/l16",
        ),
        (
            _mutate(GOLDEN_START, ["start", "mediaFormat", "sampleRate"], 16000),
            UnsupportedMediaFormat,
            "16000 Hz",
        ),
        (
            _mutate(GOLDEN_START, ["start", "mediaFormat", "channels"], 2),
            UnsupportedMediaFormat,
            "2 channel",
        ),
        (
            _mutate(GOLDEN_START, ["start", "mediaFormat", "sampleRate"], "8k"),
            MalformedFrame,
            "sampleRate",
        ),
    ],
)
def test_bad_frames_raise_the_right_protocol_error(
    text: str | bytes, error: type[ProtocolError], reason: str
) -> None:
    with pytest.raises(error) as info:
        parse_message(text)
    assert reason in info.value.reason
    assert isinstance(info.value, ProtocolError) and isinstance(info.value, ValueError)


def test_huge_frame_is_refused_before_parsing() -> None:
    with pytest.raises(PayloadTooLarge):
        parse_message('{"event":"media","x":"' + "A" * 200_000 + '"}')


def test_non_text_input_is_a_protocol_error() -> None:
    for value in (None, 42, ["x"], object()):
        with pytest.raises(MalformedFrame):
            parse_message(value)  # type: ignore[arg-type]


def test_unknown_event_carries_the_event() -> None:
    with pytest.raises(UnknownEvent) as info:
        parse_message('{"event":"' + "z" * 500 + '"}')
    assert info.value.event == "z" * 500
    assert len(info.value.reason) < 100


def test_start_without_custom_parameters_defaults_to_empty() -> None:
    msg = parse_message(_mutate(GOLDEN_START, ["start", "customParameters"], _DELETE))
    assert isinstance(msg, Start) and dict(msg.custom_parameters) == {}


def test_records_are_immutable() -> None:
    msg = parse_message(GOLDEN_DTMF)
    assert isinstance(msg, Dtmf)
    with pytest.raises(AttributeError):
        msg.digit = "5"  # type: ignore[misc]


# --- builders refuse what Twilio would refuse ---------------------------------------------------


def test_builders_refuse_bad_arguments() -> None:
    with pytest.raises(InvalidMessage):
        build_dtmf(sequence_number=1, stream_sid="MZ1", digit="x")
    with pytest.raises(InvalidMessage):
        build_media(sequence_number=1, stream_sid="MZ1", chunk=1, timestamp_ms=0, payload=b"")
    with pytest.raises(InvalidMessage):
        build_media(sequence_number=-1, stream_sid="MZ1", chunk=1, timestamp_ms=0, payload=b"x")
    with pytest.raises(InvalidMessage):
        build_stop(sequence_number=True, stream_sid="S", account_sid="A", call_sid="C")
    with pytest.raises(InvalidMessage):
        media_message("MZ1", b"")


# --- outbound -----------------------------------------------------------------------------------


def test_outbound_golden_forms() -> None:
    assert media_message("MZ1", b"\xff\x7f") == (
        '{"event":"media","streamSid":"MZ1","media":{"payload":"/38="}}'
    )
    assert mark_message("MZ1", "utt-3:end") == (
        '{"event":"mark","streamSid":"MZ1","mark":{"name":"utt-3:end"}}'
    )
    assert clear_message("MZ1") == '{"event":"clear","streamSid":"MZ1"}'


@given(st.text(max_size=40), st.text(max_size=40), st.binary(min_size=1, max_size=64))
def test_outbound_builders_write_what_json_writes(sid: str, name: str, payload: bytes) -> None:
    """The formatted builders give the same text as serializing the message's dict."""
    def dumps(obj: dict[str, object]) -> str:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)

    b64 = base64.b64encode(payload).decode()
    assert media_message(sid, payload) == dumps(
        {"event": "media", "streamSid": sid, "media": {"payload": b64}})
    assert mark_message(sid, name) == dumps({"event": "mark", "streamSid": sid, "mark": {"name": name}})
    assert parse_outbound(mark_message(sid, name)) == OutboundMark(stream_sid=sid, name=name)


_field_values = st.one_of(
    st.text(alphabet="0123456789", min_size=0, max_size=20), st.text(max_size=8),
    st.integers(min_value=-5, max_value=10**20), st.booleans(), st.none(), st.floats(),
    st.builds(lambda b: base64.b64encode(b).decode(), st.binary(max_size=40)),
    st.just("AQI"), st.just("AQ=="), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@given(
    st.dictionaries(st.sampled_from(["sequenceNumber", "streamSid", "media"]),
                    st.one_of(_field_values, st.dictionaries(
                        st.sampled_from(["track", "chunk", "timestamp", "payload"]), _field_values)))
)
@settings(max_examples=400)
def test_media_fast_path_agrees_with_the_checked_parse(obj: dict[str, object]) -> None:
    """Twilio's common case is parsed without the field-by-field checks; for any object at all
    it gives the checked parser's result, or its exact error."""
    def outcome(parse: object) -> object:
        try:
            return parse(obj, 24)  # type: ignore[operator]
        except ProtocolError as exc:
            return (type(exc), str(exc))

    assert outcome(tp._parse_media) == outcome(tp._parse_media_checked)


_VALID_MEDIA = {"sequenceNumber": "7", "streamSid": "MZ1",
                "media": {"track": "inbound", "chunk": "6", "timestamp": "100", "payload": "AQID"}}


@given(st.sampled_from(["sequenceNumber", "streamSid", "track", "chunk", "timestamp", "payload"]),
       st.one_of(st.just(tp._MISSING), _field_values))
@settings(max_examples=300)
def test_media_fast_path_agrees_one_field_off(key: str, value: object) -> None:
    """From a valid frame with one field changed or missing: the same result or error."""
    obj = json.loads(json.dumps(_VALID_MEDIA))
    target = obj if key in obj else obj["media"]
    if value is tp._MISSING:
        del target[key]
    else:
        target[key] = value
    results = []
    for parse in (tp._parse_media, tp._parse_media_checked):
        try:
            results.append(parse(obj, 24))
        except ProtocolError as exc:
            results.append((type(exc), str(exc)))
    assert results[0] == results[1]


def test_media_fast_path_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    def checked(*args: object) -> None:
        raise AssertionError("the checked parser ran on a frame as Twilio writes it")

    monkeypatch.setattr(tp, "_parse_media_checked", checked)
    msg = tp._parse_media(_VALID_MEDIA, 24)
    assert (msg.sequence_number, msg.stream_sid, msg.track, msg.chunk, msg.timestamp_ms,
            msg.payload) == (7, "MZ1", "inbound", 6, 100, b"\x01\x02\x03")


def test_outbound_round_trip() -> None:
    for msg in (
        OutboundMedia(stream_sid="MZ1", payload=bytes(range(256)) * 3),
        OutboundMark(stream_sid="MZ1", name="utt-1"),
        OutboundClear(stream_sid="MZ1"),
    ):
        text = encode_outbound(msg)
        assert parse_outbound(text) == msg
        assert parse_outbound(text.encode()) == msg
    assert [
        parse_outbound(t).event
        for t in (media_message("S", b"x"), mark_message("S", "m"), clear_message("S"))
    ] == ["media", "mark", "clear"]


def test_outbound_payload_may_be_any_length() -> None:
    big = b"\xff" * 48000  # 6 s of audio in one message is fine for Twilio
    msg = parse_outbound(media_message("MZ1", big))
    assert isinstance(msg, OutboundMedia) and msg.payload == big


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{", MalformedFrame),
        ('{"event":"stop"}', UnknownEvent),
        (GOLDEN_CONNECTED, UnknownEvent),
        ('{"event":"clear"}', MalformedFrame),
        ('{"event":"mark","streamSid":"S"}', MalformedFrame),
        ('{"event":"mark","streamSid":"S","mark":{}}', MalformedFrame),
        ('{"event":"media","streamSid":"S","media":{"payload":"@@"}}', MalformedFrame),
        ('{"event":"media","streamSid":"S","media":{"payload":""}}', MalformedFrame),
    ],
)
def test_bad_outbound_frames(text: str, error: type[ProtocolError]) -> None:
    with pytest.raises(error):
        parse_outbound(text)


def test_inbound_parser_refuses_outbound_media_and_vice_versa() -> None:
    with pytest.raises(MalformedFrame):
        parse_message(media_message("MZ1", b"abc"))  # no sequenceNumber, no track
    parsed = parse_outbound(GOLDEN_MEDIA)  # Twilio's media has the outbound fields and more
    assert isinstance(parsed, OutboundMedia)


# --- property tests -----------------------------------------------------------------------------

sids = st.text(min_size=1, max_size=40)
numbers = st.integers(min_value=0, max_value=10**12)
names = st.text(max_size=30)

inbound_messages = st.one_of(
    st.builds(Connected, protocol=names, version=names),
    st.builds(
        Start,
        sequence_number=numbers,
        stream_sid=sids,
        account_sid=sids,
        call_sid=sids,
        tracks=st.lists(names, max_size=3).map(tuple),
        media_format=st.just(MULAW_8K),
        custom_parameters=st.dictionaries(names, names, max_size=4),
    ),
    st.builds(
        Media,
        sequence_number=numbers,
        stream_sid=sids,
        track=names,
        chunk=numbers,
        timestamp_ms=numbers,
        payload=st.binary(min_size=1, max_size=400),
    ),
    st.builds(
        Dtmf,
        sequence_number=numbers,
        stream_sid=sids,
        track=names,
        digit=st.sampled_from(sorted(tp.DTMF_DIGITS)),
    ),
    st.builds(Mark, sequence_number=numbers, stream_sid=sids, name=names),
    st.builds(Stop, sequence_number=numbers, stream_sid=sids, account_sid=sids, call_sid=sids),
)


@given(inbound_messages)
@settings(max_examples=500, database=None)
def test_inbound_round_trip(msg: tp.InboundMessage) -> None:
    text = encode_message(msg)
    assert parse_message(text) == msg
    assert encode_message(parse_message(text)) == text


@given(
    st.one_of(
        st.builds(OutboundMedia, stream_sid=sids, payload=st.binary(min_size=1, max_size=400)),
        st.builds(OutboundMark, stream_sid=sids, name=names),
        st.builds(OutboundClear, stream_sid=sids),
    )
)
@settings(max_examples=300, database=None)
def test_outbound_round_trip_property(msg: tp.OutboundMessage) -> None:
    assert parse_outbound(encode_outbound(msg)) == msg


def _only_protocol_errors(text: Any) -> None:
    """Parse both ways; any exception other than ProtocolError fails the test."""
    for parse in (parse_message, parse_outbound):
        with contextlib.suppress(ProtocolError):
            parse(text)


@given(st.text(max_size=500))
@settings(max_examples=500, database=None)
def test_arbitrary_text_raises_only_protocol_errors(text: str) -> None:
    _only_protocol_errors(text)


@given(st.binary(max_size=500))
@settings(max_examples=500, database=None)
def test_arbitrary_bytes_raise_only_protocol_errors(data: bytes) -> None:
    _only_protocol_errors(data)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=15,
)


@given(json_values)
@settings(max_examples=500, database=None)
def test_arbitrary_json_raises_only_protocol_errors(value: Any) -> None:
    _only_protocol_errors(json.dumps(value))
    if isinstance(value, dict):
        _only_protocol_errors(json.dumps({**value, "event": "media"}))


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    if isinstance(node, dict):
        for key, child in node.items():
            out.append((*prefix, key))
            out.extend(_paths(child, (*prefix, key)))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            out.append((*prefix, i))
            out.extend(_paths(child, (*prefix, i)))
    return out


SMALL_CAP = 600
odd_values = st.one_of(
    json_values,
    st.sampled_from(["", "-1", "1.5", "0x10", " 1", "1 ", "\uff11", "9" * 30, "NaN", "inbound"]),
    st.sampled_from(["====", "A", "AB=", "AB==C", "A\nB=", "Zm9v\u00e9", "Zm9v!!", "Zg"]),
    st.integers(SMALL_CAP - 2, SMALL_CAP + 3).map(lambda n: base64.b64encode(b"\x00" * n).decode()),
    st.sampled_from(["connected", "start", "media", "dtmf", "mark", "stop", "clear", "Media"]),
)
valid_frames = st.sampled_from(
    [json.loads(line) for line in GOLDEN_LINES]
    + [
        json.loads(media_message("MZ1", b"\x01\x02")),
        json.loads(mark_message("MZ1", "m")),
        json.loads(clear_message("MZ1")),
    ]
)


@given(valid_frames, st.data())
@settings(
    max_examples=1500,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
def test_mutated_valid_frames_raise_only_protocol_errors(frame: Any, data: st.DataObject) -> None:
    frame = json.loads(json.dumps(frame))  # private copy
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = _paths(frame)
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label="path")
        parent = frame
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans(), label="delete"):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(odd_values, label="value")
    text = json.dumps(frame)
    # Whatever parses must survive a round trip through the builders.
    for parse, encode in ((parse_message, encode_message), (parse_outbound, encode_outbound)):
        try:
            parsed = parse(text, max_payload_bytes=SMALL_CAP)
        except ProtocolError as exc:
            event(f"{parse.__name__}: {type(exc).__name__}")
        else:
            event(f"{parse.__name__}: parsed {parsed.event}")
            assert parse(encode(parsed), max_payload_bytes=SMALL_CAP) == parsed


def test_errors_pickle() -> None:
    import pickle

    for err in (UnknownEvent("bogus"), MalformedFrame("event is missing"), PayloadTooLarge("x")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and back.reason == err.reason and str(back) == str(err)
    assert pickle.loads(pickle.dumps(UnknownEvent("bogus"))).event == "bogus"
