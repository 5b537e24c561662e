"""Twilio Media Streams wire format: text in, typed record out; typed record in, text out.

Twilio's "Media Streams - WebSocket Messages" page
(https://www.twilio.com/docs/voice/media-streams/websocket-messages) defines two directions:

* Twilio -> us: ``connected``, ``start``, ``media``, ``dtmf``, ``mark``, ``stop``.
  Parsed by :func:`parse_message` into :data:`InboundMessage`; built (for the test client and
  the replay's Twilio stand-in) by the ``build_*`` functions, byte for byte as Twilio sends them.
* us -> Twilio (bidirectional ``<Connect><Stream>`` only): ``media``, ``mark``, ``clear``.
  Built by :func:`media_message`, :func:`mark_message`, :func:`clear_message`; parsed by
  :func:`parse_outbound`, which the stand-in uses to read what the gateway sends.

Wire details worth knowing (all as documented and as in ``recordings/*.twilio.jsonl``):

* ``sequenceNumber``, ``media.chunk`` and ``media.timestamp`` are decimal *strings*;
  ``mediaFormat.sampleRate`` and ``channels`` are JSON numbers.
* ``connected`` has no ``sequenceNumber`` and no ``streamSid``.
* ``start`` carries the stream SID twice: ``start.streamSid`` and a top-level ``streamSid``.
* ``dtmf.track`` is ``"inbound_track"`` while ``media.track`` is ``"inbound"``.
* Each event orders its keys differently (``dtmf`` puts ``streamSid`` before
  ``sequenceNumber``; ``mark`` puts ``sequenceNumber`` first; the rest put ``streamSid`` last).
  The builders keep Twilio's order so recordings can be reproduced exactly.
* Outbound ``media`` payloads may be of any length; inbound ones are 20 ms in practice, but
  nothing here assumes it.

The codec never touches a socket, a clock or the REST API; the aiohttp handler owns those.
A frame that fails to parse raises a :class:`ProtocolError`, which the handler logs and skips
without ending the call. For any input whatsoever, nothing else is raised.

Errors::

    CodecError (ValueError)
    ├── ProtocolError               text that is not a valid message (has .reason)
    │   ├── MalformedFrame          not JSON, not an object, a field missing or of the wrong type,
    │   │                           bad base64, a bad number or DTMF digit
    │   ├── UnknownEvent            well-formed, but an ``event`` this side does not expect
    │   ├── UnsupportedMediaFormat  ``start`` announces something other than 8 kHz mono mu-law
    │   └── PayloadTooLarge         a media payload (or the frame) over the configured cap
    └── InvalidMessage              a builder was asked for a message Twilio would not accept
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NoReturn, TypeAlias, TypeGuard

from audio import TELEPHONY_RATE

from bus.protocol import json_kind as _kind

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DTMF_DIGITS",
    "MULAW_8K",
    "CodecError",
    "Connected",
    "Dtmf",
    "InboundMessage",
    "InvalidMessage",
    "MalformedFrame",
    "Mark",
    "Media",
    "MediaFormat",
    "OutboundClear",
    "OutboundMark",
    "OutboundMedia",
    "OutboundMessage",
    "PayloadTooLarge",
    "ProtocolError",
    "Start",
    "Stop",
    "UnknownEvent",
    "UnsupportedMediaFormat",
    "build_connected",
    "build_dtmf",
    "build_mark",
    "build_media",
    "build_start",
    "build_stop",
    "clear_message",
    "encode_message",
    "encode_outbound",
    "mark_message",
    "media_message",
    "parse_message",
    "parse_outbound",
]

DEFAULT_MAX_PAYLOAD_BYTES: Final = 64 * 1024
"""Default cap on one decoded media payload. 64 KiB is 8 s of 8 kHz mu-law: far above Twilio's
20 ms frames, far below what would let one peer balloon the gateway's memory."""

DTMF_DIGITS: Final = frozenset("0123456789*#ABCD")
"""Keys a DTMF message may carry: the 16 tones of ITU-T Q.23."""

_MAX_NUMBER_DIGITS: Final = 18  # fits int64; keeps int() far from CPython's 4300-digit limit
_FRAME_OVERHEAD_CHARS: Final = 64 * 1024  # room for JSON around the payload, custom params...
_SEPARATORS: Final = (",", ":")


# --- errors -------------------------------------------------------------------------------------


class CodecError(ValueError):
    """Base class of every error this module raises."""


class ProtocolError(CodecError):
    """Text that is not a valid Media Streams message.

    Attributes:
        reason: what is wrong, in words, for the log line that records the skipped frame.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MalformedFrame(ProtocolError):
    """Not JSON, not an object, or a field missing, of the wrong type or out of range."""


class UnknownEvent(ProtocolError):
    """A well-formed frame whose ``event`` this side of the protocol does not expect.

    Kept apart from :class:`MalformedFrame` so a handler can skip events Twilio adds in future
    quietly while still flagging real corruption.

    Attributes:
        event: the ``event`` value received.
    """

    def __init__(self, event: str) -> None:
        super().__init__(f"unknown event {_clip(event)!r}")
        self.event = event
        self.args = (event,)  # what __init__ takes, so the error pickles

    def __str__(self) -> str:
        return self.reason


class UnsupportedMediaFormat(ProtocolError):
    """A ``start`` announcing audio other than 8 kHz mono ``audio/x-mulaw``.

    Twilio documents those values as fixed; anything else would be fed to a VAD expecting
    8 kHz mu-law and produce nonsense, so it is refused up front.
    """


class PayloadTooLarge(ProtocolError):
    """A media payload over the cap (or a frame too long to hold one within the cap)."""


class InvalidMessage(CodecError):
    """A builder was asked for a message Twilio would not accept (empty audio, bad digit...)."""


# --- records ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MediaFormat:
    """``start.mediaFormat``: how the ``media`` payloads are encoded."""

    encoding: str = "audio/x-mulaw"
    sample_rate: int = TELEPHONY_RATE
    channels: int = 1


MULAW_8K: Final = MediaFormat()
"""The only media format Twilio sends, and the only one :func:`parse_message` accepts."""


@dataclass(frozen=True, slots=True)
class Connected:
    """First message on every stream; says which protocol the rest will follow."""

    protocol: str
    version: str
    event: Literal["connected"] = field(default="connected", init=False)


@dataclass(frozen=True, slots=True)
class Start:
    """Stream metadata, sent once right after ``connected``.

    ``custom_parameters`` holds the ``<Parameter>`` values from the TwiML, the only way to pass
    per-call data into the stream (Twilio refuses query strings on ``<Stream url>``).
    """

    sequence_number: int
    stream_sid: str
    account_sid: str
    call_sid: str
    tracks: tuple[str, ...]
    media_format: MediaFormat
    custom_parameters: Mapping[str, str]
    event: Literal["start"] = field(default="start", init=False)


@dataclass(frozen=True, slots=True)
class Media:
    """A stretch of audio: ``payload`` is the decoded mu-law bytes.

    ``chunk`` counts media messages from 1; ``timestamp_ms`` is the presentation time of the
    first sample, in ms since the stream started.
    """

    sequence_number: int
    stream_sid: str
    track: str
    chunk: int
    timestamp_ms: int
    payload: bytes
    event: Literal["media"] = field(default="media", init=False)


@dataclass(frozen=True, slots=True)
class Dtmf:
    """A key press detected on the caller's side (bidirectional streams only)."""

    sequence_number: int
    stream_sid: str
    track: str
    digit: str
    event: Literal["dtmf"] = field(default="dtmf", init=False)


@dataclass(frozen=True, slots=True)
class Mark:
    """The echo of a mark we sent: the audio queued before it has played, *or was cleared*.

    After a ``clear``, Twilio echoes every pending mark at once, so an echo alone does not
    prove the caller heard the audio.
    """

    sequence_number: int
    stream_sid: str
    name: str
    event: Literal["mark"] = field(default="mark", init=False)


@dataclass(frozen=True, slots=True)
class Stop:
    """Last message: the stream ended (for bidirectional streams, the call ended)."""

    sequence_number: int
    stream_sid: str
    account_sid: str
    call_sid: str
    event: Literal["stop"] = field(default="stop", init=False)


@dataclass(frozen=True, slots=True)
class OutboundMedia:
    """Audio for Twilio to queue for playback: 8 kHz mu-law, any length, no file header."""

    stream_sid: str
    payload: bytes
    event: Literal["media"] = field(default="media", init=False)


@dataclass(frozen=True, slots=True)
class OutboundMark:
    """Ask Twilio to echo ``name`` once the audio queued so far has played (or been cleared)."""

    stream_sid: str
    name: str
    event: Literal["mark"] = field(default="mark", init=False)


@dataclass(frozen=True, slots=True)
class OutboundClear:
    """Drop all queued audio at once (barge-in); Twilio then echoes every pending mark."""

    stream_sid: str
    event: Literal["clear"] = field(default="clear", init=False)


InboundMessage: TypeAlias = Connected | Start | Media | Dtmf | Mark | Stop
"""What Twilio sends; narrow on ``.event``."""

OutboundMessage: TypeAlias = OutboundMedia | OutboundMark | OutboundClear
"""What the gateway sends to Twilio; narrow on ``.event``."""


# --- field readers ------------------------------------------------------------------------------


def _clip(value: str, limit: int = 64) -> str:
    return value if len(value) <= limit else value[:limit] + "..."


def _fail(reason: str) -> NoReturn:
    raise MalformedFrame(reason)


_MISSING: Final = object()


def _bad(where: str, key: str, expected: str, value: object) -> NoReturn:
    if value is _MISSING:
        _fail(f"{where}{key} is missing")
    _fail(f"{where}{key} must be {expected}, got {_kind(value)}")


def _obj(parent: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = parent.get(key, _MISSING)
    if not isinstance(value, dict):
        _bad(where, key, "an object", value)
    return value


def _str(parent: Mapping[str, Any], key: str, where: str = "") -> str:
    value = parent.get(key, _MISSING)
    if not isinstance(value, str):
        _bad(where, key, "a string", value)
    return value


def _is_uint_text(value: object) -> TypeGuard[str]:
    """A decimal string :func:`_uint` accepts (the media fast path checks with it too)."""
    return (isinstance(value, str) and 0 < len(value) <= _MAX_NUMBER_DIGITS and value.isascii()
            and value.isdigit())


def _uint(parent: Mapping[str, Any], key: str, where: str = "") -> int:
    """A non-negative integer sent as a decimal string (Twilio's way) or a JSON integer.

    Plain integers are accepted too: the value is unambiguous, and refusing it would drop a
    caller's audio over a representation detail. Builders always write strings.
    """
    value = parent.get(key, _MISSING)
    if isinstance(value, str):
        if not _is_uint_text(value):
            _fail(f"{where}{key} must be a non-negative decimal integer, got {_clip(value)!r}")
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < 10**_MAX_NUMBER_DIGITS:
            _fail(f"{where}{key} must be a non-negative integer, got {value}")
        return value
    _bad(where, key, "a decimal string", value)


def _payload(media: Mapping[str, Any], max_payload_bytes: int) -> bytes:
    text = _str(media, "payload", "media.")
    if len(text) > 4 * -(-max_payload_bytes // 3):  # base64 length of the cap, rounded up
        raise PayloadTooLarge(
            f"media.payload is {len(text)} base64 characters, over the {max_payload_bytes}-byte cap"
        )
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MalformedFrame(f"media.payload is not valid base64: {exc}") from exc
    if not raw:
        _fail("media.payload is empty")
    if len(raw) > max_payload_bytes:
        raise PayloadTooLarge(
            f"media.payload is {len(raw)} bytes, over the {max_payload_bytes}-byte cap"
        )
    return raw


def _load(text: object, max_payload_bytes: int) -> tuple[Mapping[str, Any], str]:
    """JSON text -> (object, event). Every failure becomes a ProtocolError."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedFrame(f"frame is not UTF-8: {exc}") from exc
    if not isinstance(text, str):
        _fail(f"frame must be text, got {type(text).__name__}")
    limit = 4 * -(-max_payload_bytes // 3) + _FRAME_OVERHEAD_CHARS
    if len(text) > limit:
        raise PayloadTooLarge(f"frame is {len(text)} characters, over the {limit} limit")
    try:
        obj = json.loads(text)
    except RecursionError as exc:  # pathologically nested arrays/objects
        raise MalformedFrame("frame is nested too deeply") from exc
    except ValueError as exc:  # JSONDecodeError, and ints past CPython's digit limit
        raise MalformedFrame(f"frame is not JSON: {_clip(str(exc), 120)}") from exc
    if not isinstance(obj, dict):
        _fail(f"frame must be a JSON object, got {_kind(obj)}")
    event = obj.get("event", _MISSING)
    if not isinstance(event, str):
        _bad("", "event", "a string", event)
    return obj, event


def _check_cap(max_payload_bytes: int) -> None:
    if (
        isinstance(max_payload_bytes, bool)
        or not isinstance(max_payload_bytes, int)
        or (max_payload_bytes < 1)
    ):
        raise ValueError(f"max_payload_bytes must be a positive integer, got {max_payload_bytes!r}")


# --- inbound: parse -----------------------------------------------------------------------------


def _parse_start(obj: Mapping[str, Any]) -> Start:
    start = _obj(obj, "start", "")
    stream_sid = _str(start, "streamSid", "start.")
    top_sid = obj.get("streamSid", stream_sid)
    if top_sid != stream_sid:
        _fail("streamSid and start.streamSid differ")
    tracks = start.get("tracks", _MISSING)
    if not isinstance(tracks, list) or not all(isinstance(t, str) for t in tracks):
        _bad("start.", "tracks", "an array of strings", tracks)
    fmt = _obj(start, "mediaFormat", "start.")
    media_format = MediaFormat(
        encoding=_str(fmt, "encoding", "start.mediaFormat."),
        sample_rate=_uint(fmt, "sampleRate", "start.mediaFormat."),
        channels=_uint(fmt, "channels", "start.mediaFormat."),
    )
    if media_format != MULAW_8K:
        raise UnsupportedMediaFormat(
            f"start.mediaFormat is {_clip(media_format.encoding)} at {media_format.sample_rate} Hz"
            f" with {media_format.channels} channel(s); only audio/x-mulaw, 8000 Hz, mono is"
            " supported"
        )
    params = start.get("customParameters", {})
    if not isinstance(params, dict) or not all(isinstance(v, str) for v in params.values()):
        _fail("start.customParameters must be an object of strings")
    return Start(
        sequence_number=_uint(obj, "sequenceNumber"),
        stream_sid=stream_sid,
        account_sid=_str(start, "accountSid", "start."),
        call_sid=_str(start, "callSid", "start."),
        tracks=tuple(tracks),
        media_format=media_format,
        custom_parameters=dict(params),
    )


def _parse_media(obj: Mapping[str, Any], max_payload_bytes: int) -> Media:
    # The common case, 50 times a second per call: every field as Twilio writes it. Only returns
    # what the checked path below would; anything else (including every error) goes that way.
    # The payload is checked last by both paths, so its errors are the same either way.
    media = obj.get("media")
    if type(media) is dict:
        seq, sid = obj.get("sequenceNumber"), obj.get("streamSid")
        track, chunk, ts = media.get("track"), media.get("chunk"), media.get("timestamp")
        if (type(sid) is str and type(track) is str
                and _is_uint_text(seq) and _is_uint_text(chunk) and _is_uint_text(ts)):
            return Media(sequence_number=int(seq), stream_sid=sid, track=track,
                         chunk=int(chunk), timestamp_ms=int(ts),
                         payload=_payload(media, max_payload_bytes))
    return _parse_media_checked(obj, max_payload_bytes)


def _parse_media_checked(obj: Mapping[str, Any], max_payload_bytes: int) -> Media:
    """Every field checked in turn, with a precise error for the first that is wrong."""
    media = _obj(obj, "media", "")
    return Media(
        sequence_number=_uint(obj, "sequenceNumber"),
        stream_sid=_str(obj, "streamSid"),
        track=_str(media, "track", "media."),
        chunk=_uint(media, "chunk", "media."),
        timestamp_ms=_uint(media, "timestamp", "media."),
        payload=_payload(media, max_payload_bytes),
    )


def _digit(value: str, where: str) -> str:
    if value not in DTMF_DIGITS:
        _fail(f"{where} must be one of 0-9 * # A-D, got {_clip(value)!r}")
    return value


def _parse_dtmf(obj: Mapping[str, Any]) -> Dtmf:
    dtmf = _obj(obj, "dtmf", "")
    return Dtmf(
        sequence_number=_uint(obj, "sequenceNumber"),
        stream_sid=_str(obj, "streamSid"),
        track=_str(dtmf, "track", "dtmf."),
        digit=_digit(_str(dtmf, "digit", "dtmf."), "dtmf.digit"),
    )


def _parse_mark(obj: Mapping[str, Any]) -> Mark:
    return Mark(
        sequence_number=_uint(obj, "sequenceNumber"),
        stream_sid=_str(obj, "streamSid"),
        name=_str(_obj(obj, "mark", ""), "name", "mark."),
    )


def _parse_stop(obj: Mapping[str, Any]) -> Stop:
    stop = _obj(obj, "stop", "")
    return Stop(
        sequence_number=_uint(obj, "sequenceNumber"),
        stream_sid=_str(obj, "streamSid"),
        account_sid=_str(stop, "accountSid", "stop."),
        call_sid=_str(stop, "callSid", "stop."),
    )


def parse_message(
    text: str | bytes, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> InboundMessage:
    """Parse one WebSocket text frame from Twilio.

    Args:
        text: the frame, as ``str`` or UTF-8 ``bytes``.
        max_payload_bytes: largest decoded media payload accepted. Any length from 1 byte up
            to this cap is fine; 20 ms frames are not assumed.

    Returns:
        The typed message; narrow on ``.event``.

    Raises:
        ProtocolError: the frame is not a valid Twilio message (see the subclasses). Nothing
            else is raised, whatever the input.
        ValueError: ``max_payload_bytes`` is not a positive integer (a programming error).
    """
    _check_cap(max_payload_bytes)
    obj, event = _load(text, max_payload_bytes)
    if event == "media":  # first: 50 of these a second per call
        return _parse_media(obj, max_payload_bytes)
    if event == "connected":
        return Connected(protocol=_str(obj, "protocol"), version=_str(obj, "version"))
    if event == "start":
        return _parse_start(obj)
    if event == "dtmf":
        return _parse_dtmf(obj)
    if event == "mark":
        return _parse_mark(obj)
    if event == "stop":
        return _parse_stop(obj)
    raise UnknownEvent(event)


# --- inbound: build (the Twilio side) -----------------------------------------------------------


# One encoder for every message built: ``json.dumps`` with options makes a new one per call.
_ENCODER: Final = json.JSONEncoder(separators=_SEPARATORS, ensure_ascii=False)


def _dumps(obj: Mapping[str, Any]) -> str:
    return _ENCODER.encode(obj)


def _num(value: int, name: str) -> str:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (0 <= value < 10**_MAX_NUMBER_DIGITS)
    ):
        raise InvalidMessage(f"{name} must be a non-negative integer, got {value!r}")
    return str(value)


def _b64(payload: bytes) -> str:
    if not payload:
        raise InvalidMessage("media payload must not be empty")
    return base64.b64encode(payload).decode("ascii")


def build_connected(*, protocol: str = "Call", version: str = "1.0.0") -> str:
    """``connected`` as Twilio sends it (no sequence number, no stream SID)."""
    return _dumps({"event": "connected", "protocol": protocol, "version": version})


def build_start(
    *,
    sequence_number: int = 1,
    stream_sid: str,
    account_sid: str,
    call_sid: str,
    tracks: Iterable[str] = ("inbound",),
    media_format: MediaFormat = MULAW_8K,
    custom_parameters: Mapping[str, str] | None = None,
) -> str:
    """``start`` as Twilio sends it, with the stream SID both inside and at the top level."""
    return _dumps(
        {
            "event": "start",
            "sequenceNumber": _num(sequence_number, "sequence_number"),
            "start": {
                "accountSid": account_sid,
                "streamSid": stream_sid,
                "callSid": call_sid,
                "tracks": list(tracks),
                "mediaFormat": {
                    "encoding": media_format.encoding,
                    "sampleRate": media_format.sample_rate,
                    "channels": media_format.channels,
                },
                "customParameters": dict(custom_parameters or {}),
            },
            "streamSid": stream_sid,
        }
    )


def build_media(
    *,
    sequence_number: int,
    stream_sid: str,
    chunk: int,
    timestamp_ms: int,
    payload: bytes,
    track: str = "inbound",
) -> str:
    """``media`` as Twilio sends it: numbers as strings, ``streamSid`` last.

    Raises:
        InvalidMessage: empty payload or a negative number.
    """
    return _dumps(
        {
            "event": "media",
            "sequenceNumber": _num(sequence_number, "sequence_number"),
            "media": {
                "track": track,
                "chunk": _num(chunk, "chunk"),
                "timestamp": _num(timestamp_ms, "timestamp_ms"),
                "payload": _b64(payload),
            },
            "streamSid": stream_sid,
        }
    )


def build_dtmf(
    *, sequence_number: int, stream_sid: str, digit: str, track: str = "inbound_track"
) -> str:
    """``dtmf`` as Twilio sends it: ``streamSid`` *before* ``sequenceNumber``.

    Raises:
        InvalidMessage: ``digit`` is not one of 0-9 * # A-D.
    """
    if digit not in DTMF_DIGITS:
        raise InvalidMessage(f"DTMF digit must be one of 0-9 * # A-D, got {digit!r}")
    return _dumps(
        {
            "event": "dtmf",
            "streamSid": stream_sid,
            "sequenceNumber": _num(sequence_number, "sequence_number"),
            "dtmf": {"track": track, "digit": digit},
        }
    )


def build_mark(*, sequence_number: int, stream_sid: str, name: str) -> str:
    """A ``mark`` echo as Twilio sends it: ``sequenceNumber`` first, then ``streamSid``."""
    return _dumps(
        {
            "event": "mark",
            "sequenceNumber": _num(sequence_number, "sequence_number"),
            "streamSid": stream_sid,
            "mark": {"name": name},
        }
    )


def build_stop(*, sequence_number: int, stream_sid: str, account_sid: str, call_sid: str) -> str:
    """``stop`` as Twilio sends it."""
    return _dumps(
        {
            "event": "stop",
            "sequenceNumber": _num(sequence_number, "sequence_number"),
            "stop": {"accountSid": account_sid, "callSid": call_sid},
            "streamSid": stream_sid,
        }
    )


def encode_message(message: InboundMessage) -> str:
    """Serialize a parsed inbound record back to Twilio's exact wire text.

    ``encode_message(parse_message(line)) == line`` for every line Twilio (or a recording)
    sends, which lets the replay re-time or filter recorded frames without hand-built JSON.
    """
    match message:
        case Connected():
            return build_connected(protocol=message.protocol, version=message.version)
        case Start():
            return build_start(
                sequence_number=message.sequence_number,
                stream_sid=message.stream_sid,
                account_sid=message.account_sid,
                call_sid=message.call_sid,
                tracks=message.tracks,
                media_format=message.media_format,
                custom_parameters=message.custom_parameters,
            )
        case Media():
            return build_media(
                sequence_number=message.sequence_number,
                stream_sid=message.stream_sid,
                chunk=message.chunk,
                timestamp_ms=message.timestamp_ms,
                payload=message.payload,
                track=message.track,
            )
        case Dtmf():
            return build_dtmf(
                sequence_number=message.sequence_number,
                stream_sid=message.stream_sid,
                digit=message.digit,
                track=message.track,
            )
        case Mark():
            return build_mark(
                sequence_number=message.sequence_number,
                stream_sid=message.stream_sid,
                name=message.name,
            )
        case Stop():
            return build_stop(
                sequence_number=message.sequence_number,
                stream_sid=message.stream_sid,
                account_sid=message.account_sid,
                call_sid=message.call_sid,
            )


# --- outbound: build (the gateway side) ---------------------------------------------------------


def _quoted(text: str) -> str:
    """``text`` as a JSON string literal, escaped as :func:`_dumps` escapes it (the encoder's
    own string escaper, without building an encoder per call as ``json.dumps`` would)."""
    return _quote(text)


_quote: Final = json.encoder.encode_basestring  # what JSONEncoder(ensure_ascii=False) uses


# The gateway sends these two for every playback chunk (25 a second per talking call): built by
# formatting, the same text as ``_dumps`` of the dict (tests check it) at a third of the cost.
_MEDIA_OUT = '{"event":"media","streamSid":%s,"media":{"payload":"%s"}}'
_MARK_OUT = '{"event":"mark","streamSid":%s,"mark":{"name":%s}}'


def media_message(stream_sid: str, payload: bytes) -> str:
    """``media`` to send to Twilio: 8 kHz mu-law of any length, base64-encoded.

    Raises:
        InvalidMessage: ``payload`` is empty.
    """
    return _MEDIA_OUT % (_quoted(stream_sid), _b64(payload))


def mark_message(stream_sid: str, name: str) -> str:
    """``mark`` to send to Twilio after some ``media``; Twilio echoes ``name`` when it plays."""
    return _MARK_OUT % (_quoted(stream_sid), _quoted(name))


def clear_message(stream_sid: str) -> str:
    """``clear`` to send to Twilio: drop all queued audio now (and echo pending marks)."""
    return _dumps({"event": "clear", "streamSid": stream_sid})


def encode_outbound(message: OutboundMessage) -> str:
    """Serialize an outbound record; the inverse of :func:`parse_outbound`."""
    match message:
        case OutboundMedia():
            return media_message(message.stream_sid, message.payload)
        case OutboundMark():
            return mark_message(message.stream_sid, message.name)
        case OutboundClear():
            return clear_message(message.stream_sid)


# --- outbound: parse (the Twilio stand-in side) -------------------------------------------------


def parse_outbound(
    text: str | bytes, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> OutboundMessage:
    """Parse a frame the gateway sent to Twilio, as Twilio (or a stand-in) would read it.

    Args:
        text: the frame, as ``str`` or UTF-8 ``bytes``.
        max_payload_bytes: largest decoded media payload accepted.

    Raises:
        ProtocolError: not a valid ``media``, ``mark`` or ``clear`` message. Nothing else is
            raised, whatever the input.
        ValueError: ``max_payload_bytes`` is not a positive integer (a programming error).
    """
    _check_cap(max_payload_bytes)
    obj, event = _load(text, max_payload_bytes)
    if event == "media":
        return OutboundMedia(
            stream_sid=_str(obj, "streamSid"),
            payload=_payload(_obj(obj, "media", ""), max_payload_bytes),
        )
    if event == "mark":
        return OutboundMark(
            stream_sid=_str(obj, "streamSid"), name=_str(_obj(obj, "mark", ""), "name", "mark.")
        )
    if event == "clear":
        return OutboundClear(stream_sid=_str(obj, "streamSid"))
    raise UnknownEvent(event)
