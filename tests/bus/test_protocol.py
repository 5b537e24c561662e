"""The bus protocol (``bus.protocol``): every event round-trips, bad ones fail with one error
that names the field, versions interoperate by the documented rule, and both buses carry it."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus import (
    CRITICAL_TYPES,
    CallInfo,
    EventDecodeError,
    EventError,
    UnknownEventError,
    VersionMismatchError,
)
from bus import protocol as bp

from .test_contract import take

RECORDS: tuple[type, ...] = (*typing.get_args(bp.UplinkEvent), *typing.get_args(bp.DownlinkEvent))
UPLINK: tuple[type, ...] = typing.get_args(bp.UplinkEvent)


def _strategy(hint: Any) -> st.SearchStrategy[Any]:
    """Any value of a record field's type that JSON can carry (finite floats)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return st.sampled_from(typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_strategy(a) for a in typing.get_args(hint)))
    return {
        str: st.text(), bool: st.booleans(), int: st.integers(), bytes: st.binary(),
        float: st.floats(allow_nan=False, allow_infinity=False), type(None): st.none(),
    }[hint]


def records(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: _strategy(hints[f.name]) for f in dataclasses.fields(cls) if f.init}
    return st.builds(cls, **fields)


def test_the_vocabulary_is_the_records() -> None:
    assert [_tag(c) for c in RECORDS] == [*bp.UPLINK_TYPES, *bp.DOWNLINK_TYPES]
    assert len(set(bp.UPLINK_TYPES + bp.DOWNLINK_TYPES)) == len(RECORDS)
    # The bus never drops these in an outage; each must be an event that exists.
    assert CRITICAL_TYPES <= set(bp.UPLINK_TYPES + bp.DOWNLINK_TYPES)
    for cls in RECORDS:
        assert cls.__dataclass_params__.frozen and "__slots__" in vars(cls), cls  # type: ignore[attr-defined]
    for cls in UPLINK:
        assert "t_ms" in {f.name for f in dataclasses.fields(cls)}, cls


def _tag(cls: type) -> str:
    return next(f.default for f in dataclasses.fields(cls) if f.name == "type")


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_event_round_trips_through_json(cls: type, data: st.DataObject) -> None:
    event = data.draw(records(cls))
    wire = bp.encode(event, text=True)
    assert wire["type"] == event.type and wire["v"] == "1.2"
    text = json.dumps(wire, allow_nan=False)  # a file's line, or protocol 1.0's bus entry
    assert bp.decode(json.loads(text)) == event
    assert bp.decode(text) == event
    assert bp.decode(text.encode()) == event


def test_wire_format_is_the_documented_one() -> None:
    """Golden objects: fields by name, audio as bytes (base64 in the text form), None left out,
    the bus's eid kept."""
    assert bp.encode(bp.Interrupt(utterance_id="u1", heard_ms=480.0, heard_text="Thanks for",
                                  node="main", reason="speech", t_ms=5200.0)) == {
        "type": "interrupt", "v": "1.2", "utterance_id": "u1", "heard_ms": 480.0,
        "heard_text": "Thanks for", "node": "main", "reason": "speech", "t_ms": 5200.0}
    assert bp.encode(bp.Audio(utterance_id="u1", payload=b"\xff\x7f")) == {
        "type": "audio", "v": "1.2", "utterance_id": "u1", "payload": b"\xff\x7f"}
    assert bp.encode(bp.Audio(utterance_id="u1", payload=b"\xff\x7f"), text=True) == {
        "type": "audio", "v": "1.2", "utterance_id": "u1", "payload": "/38="}
    assert bp.encode(bp.Interrupt(reason="resumed", t_ms=1.0)) == {
        "type": "interrupt", "v": "1.2", "reason": "resumed", "t_ms": 1.0}
    assert bp.encode(bp.Hangup(), eid="CA1-gateway-lost") == {
        "type": "hangup", "v": "1.2", "eid": "CA1-gateway-lost"}


def test_an_utterance_says_which_uplink_event_it_answers() -> None:
    """1.2's ``reply_to``: on the wire when set, left out when not; a 1.1 worker's
    ``utterance_start`` (no such field) reads as one that answers nothing known."""
    start = bp.UtteranceStart(utterance_id="utt-g-7-0", node="main", reply_to="g-7")
    assert bp.encode(start) == {"type": "utterance_start", "v": "1.2", "utterance_id": "utt-g-7-0",
                                "node": "main", "interruptible": True, "reply_to": "g-7"}
    assert bp.decode(bp.encode(start)) == start
    assert "reply_to" not in bp.encode(bp.UtteranceStart(utterance_id="u"))
    older = {"type": "utterance_start", "v": "1.1", "utterance_id": "u", "node": "main"}
    assert bp.decode(older) == bp.UtteranceStart(utterance_id="u", node="main")
    assert bp.decode(older).reply_to is None  # type: ignore[union-attr]


def test_events_of_senders_before_the_protocol_was_versioned_still_read() -> None:
    """No ``v``: version 1.0; the fields a sender left out take their defaults."""
    assert bp.decode({"type": "transcript", "text": "hi", "eid": "g-1"}) == bp.Transcript(text="hi")
    assert bp.decode({"type": "interrupt", "utterance_id": "u", "heard_ms": 175}) == bp.Interrupt(
        utterance_id="u", heard_ms=175.0)
    assert bp.decode({"type": "utterance_start", "utterance_id": "u"}) == bp.UtteranceStart(
        utterance_id="u", node="", interruptible=True)


MALFORMED = [
    ("not json", EventDecodeError, "", "not JSON"),
    ("[1, 2]", EventDecodeError, "", "JSON object, not an array"),
    ({"text": "hi"}, EventDecodeError, "type", "type is missing"),
    ({"type": 7}, EventDecodeError, "type", "type must be a non-empty string, got a number"),
    ({"type": "teleport"}, UnknownEventError, "type", "unknown event type 'teleport'"),
    ({"type": "transcript"}, EventDecodeError, "transcript.text", "transcript.text is missing"),
    ({"type": "transcript", "text": None}, EventDecodeError, "transcript.text",
     "transcript.text must be a string, got null"),
    ({"type": "interrupt", "heard_ms": "480"}, EventDecodeError, "interrupt.heard_ms",
     "interrupt.heard_ms must be a number, got a string"),
    ({"type": "interrupt", "heard_ms": True}, EventDecodeError, "interrupt.heard_ms",
     "must be a number, got a boolean"),
    ({"type": "interrupt", "heard_ms": 10**400}, EventDecodeError, "interrupt.heard_ms",
     "must be a finite number"),
    ({"type": "interrupt", "reason": "bored"}, EventDecodeError, "interrupt.reason",
     "interrupt.reason must be one of speech, dtmf, resumed, revised; got 'bored'"),
    ({"type": "playback", "state": "playing", "utterance_id": "u"}, EventDecodeError,
     "playback.heard_ms", "playback.heard_ms is missing"),
    ({"type": "utterance_start", "utterance_id": "u", "interruptible": "no"}, EventDecodeError,
     "utterance_start.interruptible", "must be a boolean, got a string"),
    ({"type": "utterance_start", "utterance_id": "u", "reply_to": 17}, EventDecodeError,
     "utterance_start.reply_to", "utterance_start.reply_to must be a string, got a number"),
    ({"type": "utterance_start", "utterance_id": "u", "reply_to": ["g-1"]}, EventDecodeError,
     "utterance_start.reply_to", "must be a string, got an array"),
    ({"type": "audio", "utterance_id": "u", "payload": "%%%"}, EventDecodeError, "audio.payload",
     "audio.payload is not valid base64"),
    ({"type": "audio", "utterance_id": "u", "payload": 7}, EventDecodeError, "audio.payload",
     "audio.payload must be bytes or base64 text, got a number"),
    ({"type": "audio", "utterance_id": "u", "payload": "AA==", "text_start": 1.5},
     EventDecodeError, "audio.text_start", "must be an integer, got a number"),
    ({"type": "dtmf", "digit": "1", "v": 1}, EventDecodeError, "dtmf.v",
     'dtmf.v must be a version "MAJOR.MINOR", got a number'),
    ({"type": "dtmf", "digit": "1", "v": "one"}, EventDecodeError, "dtmf.v", "got 'one'"),
]


@pytest.mark.parametrize(("raw", "error", "field", "message"), MALFORMED,
                         ids=[str(m[3])[:40] for m in MALFORMED])
def test_a_malformed_event_fails_with_one_error_naming_the_field(
    raw: Any, error: type[Exception], field: str, message: str
) -> None:
    with pytest.raises(error) as info:
        bp.decode(raw)
    assert isinstance(info.value, EventDecodeError) and isinstance(info.value, EventError)
    assert info.value.field == field
    assert message in str(info.value)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
TYPES = st.sampled_from([*bp.UPLINK_TYPES, *bp.DOWNLINK_TYPES, "", "other"])
FIELDS = st.sampled_from(sorted({f.name for c in RECORDS for f in dataclasses.fields(c)} | {"v"}))


@settings(max_examples=400, deadline=None)
@given(st.one_of(
    JSON,
    st.dictionaries(FIELDS, JSON).flatmap(
        lambda d: TYPES.map(lambda t: {**d, "type": t})),
    st.text(), st.binary(),
))
def test_decode_raises_nothing_else_whatever_the_input(raw: Any) -> None:
    try:
        event = bp.decode(raw)
    except EventDecodeError:
        return
    assert bp.decode(bp.encode(event)) == event  # what it accepted is a real event


def test_a_newer_major_version_fails_naming_both_versions() -> None:
    with pytest.raises(VersionMismatchError) as info:
        bp.decode({"type": "interrupt", "v": "2.0", "utterance_id": "u", "heard_ms": 1})
    assert info.value.version == "2.0" and info.value.field == "v"
    assert "version 2.0" in str(info.value) and "speaks 1.2" in str(info.value)
    with pytest.raises(VersionMismatchError, match="version 0.9"):
        bp.decode({"type": "hangup", "v": "0.9"})


def test_a_newer_minor_version_interoperates() -> None:
    """1.7 may add optional fields (ignored here) and event types (skipped as unknown)."""
    sent = {"type": "interrupt", "v": "1.7", "utterance_id": "u", "heard_ms": 120.5,
            "reason": "dtmf", "confidence": 0.9, "words": ["a", "b"], "eid": "gw-9"}
    assert bp.decode(sent) == bp.Interrupt(utterance_id="u", heard_ms=120.5, reason="dtmf")
    with pytest.raises(UnknownEventError):
        bp.decode({"type": "sentiment", "v": "1.7", "score": 1})


def test_encode_refuses_what_is_not_a_record() -> None:
    with pytest.raises(TypeError, match="not a bus event record: dict"):
        bp.encode({"type": "hangup"})  # type: ignore[arg-type]


async def test_both_buses_carry_every_event(make_bus: Any) -> None:
    """Each record, encoded, published or sent and read back on the other side, decodes equal."""
    gw, wk = await make_bus(), await make_bus()
    await gw.open_call(CallInfo("CA1"))
    up = [bp.CallStarted(agent="support", from_number="+1555", t_ms=0.0),
          bp.SpeechStarted(over_uninterruptible=True, t_ms=20.0),
          bp.SpeechStopped(dropped=True, t_ms=40.5),
          bp.Transcript(text="héllo", final=True, replaces_previous=True, t_ms=60.0),
          bp.Interrupt(utterance_id="u1", heard_ms=80.0, heard_text="Thanks", node="main",
                       reason="speech", t_ms=80.0),
          bp.InterruptSuppressed(utterance_id="u1", policy="keep", t_ms=81.0),
          bp.Dtmf(digit="#", t_ms=90.0),
          bp.Playback(state="interrupted", utterance_id="u1", heard_ms=80.0, t_ms=95.0),
          bp.CallEnded(reason="stop", t_ms=100.0)]
    down = [bp.UtteranceStart(utterance_id="u1", node="main", interruptible=False, text="Hi"),
            bp.Audio(utterance_id="u1", payload=bytes(range(256)) * 2, text="Hi", text_start=0,
                     text_end=2, audio_ms=64.0, duration_ms=64.0),
            bp.UtteranceEnd(utterance_id="u1", interrupted=True, text="Hi"),
            bp.Transfer(to="+15557654321"), bp.Hangup()]
    assert {e.type for e in up} == set(bp.UPLINK_TYPES)
    assert {e.type for e in down} == set(bp.DOWNLINK_TYPES)
    for event in up:
        await gw.publish("CA1", bp.encode(event))
    for event in down:
        await wk.send("CA1", bp.encode(event))
    got_up = await take(wk.uplink("CA1", "w1"), len(up))
    got_down = await take(gw.downlink("CA1"), len(down))
    assert [bp.decode(m.event) for m in got_up] == up
    assert [bp.decode(m.event) for m in got_down] == down
    await gw.close_call("CA1")


# --- one module: nothing else builds a bus event by hand ----------------------------------------

ROOT = Path(__file__).resolve().parents[2]
BUS_TYPES = frozenset(bp.UPLINK_TYPES + bp.DOWNLINK_TYPES)
_CARRIERS = frozenset({"publish", "send", "handle_downlink"})  # what takes a bus event


def hand_built_events(source: str) -> list[tuple[int, str]]:
    """(line, why) for each bus event built as a dict: a literal (or ``dict(type=...)``) whose
    ``type`` is a bus event's, or any dict with a ``type`` handed to publish/send/handle_downlink."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (isinstance(key, ast.Constant) and key.value == "type"
                        and isinstance(value, ast.Constant) and value.value in BUS_TYPES):
                    found.append((node.lineno, f"a {value.value!r} event as a dict literal"))
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
                node.func, "id", "")
            if name == "dict":
                for kw in node.keywords:
                    if (kw.arg == "type" and isinstance(kw.value, ast.Constant)
                            and kw.value.value in BUS_TYPES):
                        found.append((node.lineno, f"a {kw.value.value!r} event as dict(...)"))
            if name in _CARRIERS:
                for arg in node.args:
                    if isinstance(arg, ast.Dict) and any(
                            isinstance(k, ast.Constant) and k.value == "type" for k in arg.keys):
                        found.append((node.lineno, f"a dict with a type handed to {name}()"))
    return sorted(set(found))


def test_the_checker_finds_hand_built_events() -> None:
    source = '''
bus.publish(sid, {"type": "interrupt", "utterance_id": "u"})
x = dict(type="audio", payload="")
await self._bus.publish(sid, {"type": type_, "t_ms": now})
timeline.emit({"type": "barge_in"})  # a timeline event: another vocabulary
bus.publish(sid, bp.encode(bp.Dtmf(digit="1")))
'''
    assert sorted({line for line, _ in hand_built_events(source)}) == [2, 3, 4]


def test_no_bus_event_is_built_by_hand_outside_the_protocol_module() -> None:
    """Production code (everything but tests/) builds bus events only as ``bus.protocol`` records."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert "bus/protocol.py" in files
    offenders = [f"{path}:{line}: {why}"
                 for path in files if not path.startswith("tests/") and path != "bus/protocol.py"
                 for line, why in hand_built_events((ROOT / path).read_text())]
    assert offenders == []


def test_the_architecture_table_is_the_records() -> None:
    """docs/architecture.md lists every event, one line each: the record's name, its way and
    the first line of its docstring."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (up|down) \| `(\w+)` \| (.+) \|$", text, re.MULTILINE)
    expected = [(_tag(cls), way, cls.__name__,
                 (cls.__doc__ or "").strip().splitlines()[0].replace("``", "`"))
                for way, alias in (("up", bp.UplinkEvent), ("down", bp.DownlinkEvent))
                for cls in typing.get_args(alias)]
    assert rows == expected


def test_each_direction_refuses_the_other_sides_events() -> None:
    up = bp.encode(bp.Dtmf(digit="1"))
    down = bp.encode(bp.Hangup())
    assert bp.decode_uplink(up) == bp.Dtmf(digit="1")
    assert bp.decode_downlink(down) == bp.Hangup()
    with pytest.raises(UnknownEventError, match="uplink event") as err:
        bp.decode_downlink(up)
    assert err.value.field == "type"
    with pytest.raises(UnknownEventError, match="downlink event"):
        bp.decode_uplink(down)
