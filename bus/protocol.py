"""The events that cross the bus: typed record in, wire object out; wire object in, record out.

Every event a gateway publishes (uplink) or a worker sends (downlink) is one of the frozen,
slotted records below, tagged by its ``type``; :func:`encode` turns one into the JSON-able
object a :class:`bus.Bus` carries, :func:`decode` turns what a bus delivers (that object, or its
JSON text, as ``NAME.downlink.jsonl`` keeps it) back into the record. Nothing else builds or
reads an event's fields (``tests/bus/test_protocol.py`` greps the tree for hand-built ones).

* **uplink** (gateway -> worker), every one with ``t_ms``, the media time it happened at:
  :class:`CallStarted`, :class:`SpeechStarted`, :class:`SpeechStopped`, :class:`Transcript`,
  :class:`Interrupt`, :class:`InterruptSuppressed`, :class:`Dtmf`, :class:`Playback`,
  :class:`CallEnded`.
* **downlink** (worker -> gateway): :class:`UtteranceStart`, :class:`Audio`,
  :class:`UtteranceEnd`, :class:`Hangup`, :class:`Transfer`.

The wire object is ``{"type": ..., "v": "1.2", <fields>}``, fields by their record names; a
field that is None is left out (a pre-versioned reader tests ``"text" in event``). The bus adds
``eid`` (its envelope, see ``bus._base``); :func:`decode` ignores it.

Binary fields. ``Audio.payload`` (8 kHz mu-law bytes) is a ``bytes`` value in the wire object:
a bus carries it as it is, beside the JSON text of the other fields (:func:`pack` /
:func:`unpack`: the Redis bus stores it as its own stream field, the embedded bus hands the
bytes over untouched), so no side base64-encodes the bot's audio for the bus. Where only JSON
will do (``NAME.downlink.jsonl``, a tool), ``encode(event, text=True)`` writes it as base64 text,
which is also how protocol 1.0 carried it on the bus; :func:`decode` reads either form.

Versions. ``v`` is ``"MAJOR.MINOR"`` (:data:`PROTOCOL_VERSION`). A minor version may only add:
optional fields (with defaults) and event types a reader may skip. Anything else (a field
renamed, removed, retyped or made required, a meaning changed) is a new major version. So a
reader accepts every event of its own major version: fields it does not know are ignored, a type
it does not know raises :class:`~bus.UnknownEventError` (skip it); an event of another major
version raises :class:`~bus.VersionMismatchError`, naming both versions. An event without ``v``
was sent before the protocol was versioned and reads as 1.0, which it is. A gateway and a worker
of different minor versions in one fleet interoperate; of different major versions, every event
fails with that error in the receiver's log, so roll majors out side by side (a second pool).

1.1 (from 1.0): ``Audio.payload`` travels as binary on the bus. A 1.1 reader reads 1.0's entries
(base64 text) as before. A 1.0 reader does not interoperate on audio: it reads only the JSON
text of a 1.1 audio entry, where the payload is not, and refuses every such event with
``EventDecodeError: audio.payload is missing`` in its log (its other events read as before).
Only gateways read audio, so roll gateways to 1.1 before workers.

1.2 (from 1.1): ``UtteranceStart.reply_to``, optional: the ``eid`` of the uplink event the
utterance answers. A gateway that cancelled the reply to a turn (``interrupt {reason: resumed}``
or ``{reason: revised}``) drops every interruptible utterance that still arrives for that turn's
transcript: audio the worker made before it read the interrupt. It tells the worker with
``playback {state: interrupted, heard_ms: 0}`` alone (no ``interrupt`` follows), and a 1.2
worker cuts the utterance on it: stops its audio, takes its text out of the context and stops
its generation. A 1.1 worker leaves the field out and its utterances play as before (the race
stays open for it); a 1.1 gateway ignores it.

The timeline events (``events.jsonl``, ``gateway.timeline``) are another vocabulary: the
gateway's own record of what it did, never read by the other side of the bus, open by contract
(DESIGN.md: names and ``t_ms`` fixed, "extra fields are welcome") and read by
``tools/eval_bargein.py``; their names are declared once, in ``gateway.timeline.EVENT_TYPES``.

Errors (from ``bus._errors``)::

    EventError (ValueError)
    └── EventDecodeError        not an object, no or a bad ``type`` or ``v``, a field missing or
        │                       of the wrong type (has .field and .reason)
        ├── UnknownEventError   well-formed, but a ``type`` this version does not define
        └── VersionMismatchError  another major version (has .version)

For any input whatsoever :func:`decode` raises nothing but :class:`~bus.EventDecodeError`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NoReturn, TypeAlias

from ._errors import EventDecodeError, UnknownEventError, VersionMismatchError

__all__ = [
    "DOWNLINK_TYPES",
    "PROTOCOL_VERSION",
    "UPLINK_TYPES",
    "Audio",
    "BusEvent",
    "CallEnded",
    "CallStarted",
    "DownlinkEvent",
    "Dtmf",
    "Hangup",
    "Interrupt",
    "InterruptReason",
    "InterruptSuppressed",
    "Playback",
    "PlaybackState",
    "SpeechStarted",
    "SpeechStopped",
    "Transcript",
    "Transfer",
    "UplinkEvent",
    "UtteranceEnd",
    "UtteranceStart",
    "decode",
    "decode_downlink",
    "decode_uplink",
    "encode",
    "json_kind",
    "pack",
    "unpack",
]

PROTOCOL_VERSION: Final = (1, 2)
"""The version this side writes and reads (any ``1.x``): ``"1.2"`` on the wire."""

_VERSION_TEXT: Final = f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}"
_FRAME: Final = ("type", "v", "eid")  # the envelope: never a record's field

InterruptReason: TypeAlias = Literal["speech", "dtmf", "resumed", "revised"]
"""Why the gateway stopped the bot: the caller spoke over it, keyed a digit, or resumed a turn
before hearing any of its reply, or a streaming transcript's final revised the partial its reply
was started on (``turn.speculate``)."""

PlaybackState: TypeAlias = Literal["playing", "finished", "interrupted", "resumed"]
"""Where an utterance's playback is: ``playing`` (progress), then ``finished`` or
``interrupted``; ``resumed`` after a pause (a backchannel) that did not become a barge-in."""


# --- uplink: gateway -> worker ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Uplink:
    """What every uplink record has."""

    t_ms: float = 0.0
    """Media time (ms since the stream started) the gateway published it at; 0 from a sender
    that has no media clock (a test, a tool)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CallStarted(_Uplink):
    """The call is streaming: the agent may greet (``system.user.joined``)."""

    agent: str = ""
    from_number: str = ""
    to_number: str = ""
    type: Literal["call_started"] = field(default="call_started", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechStarted(_Uplink):
    """The caller started speaking (the barge-in policy's onset)."""

    over_uninterruptible: bool = False
    """The bot was playing a non-interruptible utterance when it happened."""
    type: Literal["speech_started"] = field(default="speech_started", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechStopped(_Uplink):
    """The caller stopped speaking."""

    over_uninterruptible: bool = False
    dropped: bool = False
    """The speech was over a non-interruptible utterance and the agent drops such speech
    (``speech_over_uninterruptible: drop``): no transcript follows."""
    type: Literal["speech_stopped"] = field(default="speech_stopped", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Transcript(_Uplink):
    """What the caller said in a turn; a final one is a user message and asks for a reply."""

    text: str
    final: bool = True
    replaces_previous: bool = False
    """The caller resumed the turn before hearing the reply: this text is the whole turn and
    replaces the last user message."""
    type: Literal["transcript"] = field(default="transcript", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Interrupt(_Uplink):
    """The gateway stopped an interruptible utterance for good (it has sent ``clear``)."""

    utterance_id: str | None = None
    """The utterance stopped; None when the reply had not started playing (``resumed``)."""
    heard_ms: float | None = None
    """How much of it the caller heard, from marks echoed before the clear."""
    heard_text: str | None = None
    """What the caller heard of its text by the gateway's reckoning (``Utterance.heard_text``,
    the rule of ``nodes._alignment`` on the text spans of the ``audio`` events); the worker
    cuts by ``heard_ms`` against its own alignment and reads this only without it."""
    node: str | None = None
    reason: InterruptReason = "speech"
    type: Literal["interrupt"] = field(default="interrupt", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class InterruptSuppressed(_Uplink):
    """The caller spoke over a non-interruptible utterance; it plays on."""

    utterance_id: str | None = None
    policy: str = ""
    """The agent's ``speech_over_uninterruptible`` (``keep`` or ``drop``)."""
    type: Literal["interrupt_suppressed"] = field(default="interrupt_suppressed", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Dtmf(_Uplink):
    """The caller keyed a digit (one of 0-9 * # A-D, as Twilio reports it)."""

    digit: str
    type: Literal["dtmf"] = field(default="dtmf", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Playback(_Uplink):
    """What the caller has heard of an utterance, from Twilio's echoed marks.

    ``playing`` comes at the first mark, then at most every ``progress_interval_ms`` of audio
    heard, and when the caller has heard all the audio sent so far (the worker paces on it).
    ``interrupted`` with ``heard_ms`` 0 and no ``interrupt`` after it (1.2): the gateway
    dropped the utterance unheard as the reply to a turn whose reply it had cancelled; the
    worker must cut it as for a barge-in (no more audio, its text out of the context, its
    generation stopped), as no interrupt will come for it.
    """

    state: PlaybackState
    utterance_id: str
    heard_ms: float
    type: Literal["playback"] = field(default="playback", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class CallEnded(_Uplink):
    """The call is over (``stop``, the socket closed, a hang-up; ``gateway_lost`` from the bus)."""

    reason: str = ""
    type: Literal["call_ended"] = field(default="call_ended", init=False)


# --- downlink: worker -> gateway ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class UtteranceStart:
    """A new utterance of ``node``; the gateway queues it behind the one playing."""

    utterance_id: str
    node: str = ""
    interruptible: bool = True
    """False for a node with ``is_interruptible=False``: the caller hears it in full."""
    text: str | None = None
    """The whole text when it is known up front (``speak``); else it comes with the audio."""
    reply_to: str | None = None
    """The ``eid`` of the uplink event it answers (the final transcript of the turn, the key
    press, ``call_started`` for a greeting); None when no uplink event caused it (1.2). The
    gateway drops an interruptible utterance that answers a transcript whose reply it cancelled
    (``interrupt`` ``resumed`` / ``revised``): the worker made it before it read the interrupt."""
    type: Literal["utterance_start"] = field(default="utterance_start", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Audio:
    """A piece of an utterance's audio, and the text it speaks."""

    utterance_id: str
    payload: bytes
    """8 kHz mu-law, no header; binary on the bus (base64 text in JSON, see the module)."""
    text: str | None = None
    """The chunk of the utterance's text this audio speaks (None: audio without text)."""
    text_start: int | None = None
    """Where ``text`` starts in the utterance's text (None: at its current end)."""
    text_end: int | None = None
    audio_ms: float | None = None
    """The utterance's audio so far, this piece included."""
    duration_ms: float | None = None
    """This piece's share of it."""
    type: Literal["audio"] = field(default="audio", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class UtteranceEnd:
    """The utterance has all its audio; it finishes once that has played."""

    utterance_id: str
    interrupted: bool = False
    text: str | None = None
    """Everything synthesized for it."""
    type: Literal["utterance_end"] = field(default="utterance_end", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hangup:
    """End the call once the audio queued has played."""

    type: Literal["hangup"] = field(default="hangup", init=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """The agent transferred the call to ``to`` (the worker redirects it through Twilio)."""

    to: str
    type: Literal["transfer"] = field(default="transfer", init=False)


UplinkEvent: TypeAlias = (CallStarted | SpeechStarted | SpeechStopped | Transcript | Interrupt
                          | InterruptSuppressed | Dtmf | Playback | CallEnded)
"""What a gateway publishes; narrow with ``match`` or ``isinstance``."""

DownlinkEvent: TypeAlias = UtteranceStart | Audio | UtteranceEnd | Hangup | Transfer
"""What a worker sends."""

BusEvent: TypeAlias = UplinkEvent | DownlinkEvent
"""Any event on the bus: what :func:`decode` returns."""

_UPLINK: Final = (CallStarted, SpeechStarted, SpeechStopped, Transcript, Interrupt,
                  InterruptSuppressed, Dtmf, Playback, CallEnded)
_DOWNLINK: Final = (UtteranceStart, Audio, UtteranceEnd, Hangup, Transfer)


def _tag(cls: type) -> str:
    return str(next(f for f in dataclasses.fields(cls) if f.name == "type").default)


UPLINK_TYPES: Final = tuple(_tag(c) for c in _UPLINK)
"""The uplink ``type`` strings, in the order a call meets them."""

DOWNLINK_TYPES: Final = tuple(_tag(c) for c in _DOWNLINK)
"""The downlink ``type`` strings."""


# --- field readers: built once per record from its annotations ----------------------------------

_Reader: TypeAlias = Callable[[object, str], Any]  # (value, "type.field") -> field value
_MISSING: Final = object()


def _fail(where: str, reason: str) -> NoReturn:
    raise EventDecodeError(f"{where} {reason}", field=where)


def json_kind(value: object) -> str:
    """How an error message names the kind of a JSON value (``"a string"``, ``"null"``...);
    ``gateway.twilio_protocol`` words its errors with it too."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _read_str(value: object, where: str) -> str:
    if not isinstance(value, str):
        _fail(where, f"must be a string, got {json_kind(value)}")
    return value


def _read_bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        _fail(where, f"must be a boolean, got {json_kind(value)}")
    return value


def _read_int(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(where, f"must be an integer, got {json_kind(value)}")
    return value


def _read_float(value: object, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        _fail(where, f"must be a number, got {json_kind(value)}")
    try:
        number = float(value)
    except OverflowError:
        _fail(where, "must be a finite number, got one too large")
    if not math.isfinite(number):
        _fail(where, f"must be a finite number, got {number}")
    return number


def _read_bytes(value: object, where: str) -> bytes:
    if type(value) is bytes:  # 1.1 on a bus: as it was sent
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if not isinstance(value, str):
        _fail(where, f"must be bytes or base64 text, got {json_kind(value)}")
    try:  # 1.0's form on the bus, and JSON text's
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        _fail(where, f"is not valid base64: {exc}")


def _literal(allowed: tuple[str, ...]) -> _Reader:
    def read(value: object, where: str) -> str:
        if value not in allowed:
            text = repr(value) if isinstance(value, str) else json_kind(value)
            _fail(where, f"must be one of {', '.join(allowed)}; got {text:.80}")
        return value
    return read


def _optional(inner: _Reader) -> _Reader:
    def read(value: object, where: str) -> Any:
        return None if value is None else inner(value, where)
    return read


_READERS: Final[dict[object, _Reader]] = {
    str: _read_str, bool: _read_bool, int: _read_int, float: _read_float, bytes: _read_bytes,
}


def _reader(hint: Any) -> _Reader:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return _literal(typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1 and len(typing.get_args(hint)) == 2:
            return _optional(_reader(rest[0]))
    if hint in _READERS:
        return _READERS[hint]
    raise TypeError(f"no wire reader for {hint!r}")  # a record declared with a new field type


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    read: _Reader
    default: Any  # _MISSING when required
    is_bytes: bool


def _spec(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(
        _Field(f.name, _reader(hints[f.name]),
               _MISSING if f.default is dataclasses.MISSING else f.default,
               hints[f.name] is bytes)
        for f in dataclasses.fields(cls) if f.init
    )


_BY_TYPE: Final[dict[str, tuple[type, tuple[_Field, ...]]]] = {
    _tag(c): (c, _spec(c)) for c in (*_UPLINK, *_DOWNLINK)
}


# --- encode / decode ----------------------------------------------------------------------------


def encode(event: BusEvent, *, eid: str | None = None, text: bool = False) -> dict[str, Any]:
    """The wire object of ``event``, for ``Bus.publish`` / ``Bus.send``.

    Args:
        event: one of this module's records.
        eid: a deterministic event id (a re-send the other side must drop as a copy); None
            lets the bus assign one.
        text: bytes fields as base64 text, so that the object is JSON-able as it is (files,
            tools); by default they stay bytes, for a bus (:func:`pack`).

    Raises:
        TypeError: ``event`` is not one of this module's records (a programming error).
    """
    entry = _BY_TYPE.get(getattr(event, "type", ""))
    if entry is None or type(event) is not entry[0]:
        raise TypeError(f"not a bus event record: {type(event).__name__}")
    wire: dict[str, Any] = {"type": event.type, "v": _VERSION_TEXT}
    for f in entry[1]:
        value = getattr(event, f.name)
        if value is None:
            continue
        wire[f.name] = base64.b64encode(value).decode("ascii") if text and f.is_bytes else value
    if eid is not None:
        wire["eid"] = eid
    return wire


Binaries: TypeAlias = tuple[tuple[str, bytes], ...]
"""A wire object's bytes fields, (name, value) in its order: what :func:`pack` splits off."""


def pack(wire: Mapping[str, Any]) -> tuple[str, Binaries]:
    """How a bus stores a wire object: the compact JSON text of its fields but the bytes ones,
    and those (top-level ``bytes`` values, as :func:`encode` leaves them) beside it.

    Raises:
        TypeError, ValueError: something else in it is not JSON (``json.dumps``'s errors).
    """
    binaries = tuple((k, v) for k, v in wire.items() if type(v) is bytes)
    rest = {k: v for k, v in wire.items() if type(v) is not bytes} if binaries else wire
    return _COMPACT.encode(rest), binaries


# ``json.dumps`` with options builds an encoder per call; a bus packs every event.
_COMPACT: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def unpack(text: str | bytes, binaries: Binaries = ()) -> dict[str, Any]:
    """The wire object :func:`pack` made ``(text, binaries)`` of, for :func:`decode`.

    Raises:
        ValueError: ``text`` is not JSON (``json.loads``'s errors).
    """
    wire: dict[str, Any] = json.loads(text)
    for name, value in binaries:
        wire[name] = value
    return wire


def _version(obj: Mapping[str, Any], kind: str) -> None:
    v = obj.get("v", _MISSING)
    if v is _MISSING:
        return  # sent before the protocol was versioned: 1.0
    major, dot, minor = v.partition(".") if isinstance(v, str) else ("", "", "")
    if not (dot and major.isascii() and major.isdigit() and minor.isascii() and minor.isdigit()
            and len(v) <= 16):
        text = repr(v) if isinstance(v, str) else json_kind(v)
        _fail(f"{kind}.v", f"must be a version \"MAJOR.MINOR\", got {text:.40}")
    if int(major) != PROTOCOL_VERSION[0]:
        raise VersionMismatchError(
            f"event {kind!r} is bus protocol version {v}; this side speaks {_VERSION_TEXT} and"
            f" reads {PROTOCOL_VERSION[0]}.x only (run gateways and workers of one major version"
            " together)",
            version=v,
        )


def decode(raw: Mapping[str, Any] | str | bytes) -> BusEvent:
    """The record of one event as a bus delivers it (``BusMessage.event``) or as JSON text.

    Fields this version does not define are ignored (a newer minor version's), and so are the
    envelope's ``v`` and ``eid``.

    Raises:
        EventDecodeError: not a valid event of this major version (see the subclasses); the
            message names the field. Nothing else is raised, whatever the input.
    """
    obj: object = raw
    if isinstance(raw, str | bytes | bytearray):
        try:
            obj = json.loads(raw)
        except RecursionError as exc:
            raise EventDecodeError("event is nested too deeply", field="") from exc
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, huge ints
            raise EventDecodeError(f"event is not JSON: {str(exc):.120}", field="") from exc
    if not isinstance(obj, Mapping):
        raise EventDecodeError(f"an event is a JSON object, not {json_kind(obj)}", field="")
    kind = obj.get("type", _MISSING)
    if not isinstance(kind, str) or not kind:
        if kind is _MISSING:
            _fail("type", "is missing")
        _fail("type", f"must be a non-empty string, got {json_kind(kind)}")
    _version(obj, kind)
    entry = _BY_TYPE.get(kind)
    if entry is None:
        raise UnknownEventError(f"unknown event type {kind[:64]!r}", field="type")
    cls, spec = entry
    values: dict[str, Any] = {}
    for f in spec:
        value = obj.get(f.name, _MISSING)
        if value is _MISSING:
            if f.default is _MISSING:
                _fail(f"{kind}.{f.name}", "is missing")
            continue
        values[f.name] = f.read(value, f"{kind}.{f.name}")
    return typing.cast(BusEvent, cls(**values))


def decode_downlink(raw: Mapping[str, Any] | str | bytes) -> DownlinkEvent:
    """:func:`decode` for what a gateway reads from a call's downlink: an uplink event there
    (a worker or a tool writing to the wrong stream) is refused like an unknown one.

    Raises:
        EventDecodeError: as :func:`decode`; :class:`UnknownEventError` for an uplink event.
    """
    return typing.cast(DownlinkEvent, _one_way(raw, _DOWNLINK, "an uplink event, not one a worker sends"))


def decode_uplink(raw: Mapping[str, Any] | str | bytes) -> UplinkEvent:
    """:func:`decode` for what a worker reads from a call's uplink: a downlink event there is
    refused like an unknown one.

    Raises:
        EventDecodeError: as :func:`decode`; :class:`UnknownEventError` for a downlink event.
    """
    return typing.cast(UplinkEvent, _one_way(raw, _UPLINK, "a downlink event, not one a gateway sends"))


def _one_way(raw: Mapping[str, Any] | str | bytes, kinds: tuple[type, ...], other: str) -> BusEvent:
    event = decode(raw)
    if not isinstance(event, kinds):
        raise UnknownEventError(f"{event.type!r} is {other}", field="type")
    return event
