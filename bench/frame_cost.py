"""What the gateway's own per-message code costs, in process: ``python -m bench.frame_cost``.

The pieces of a talking call's traffic that callgate's Python does for every message, timed
alone (best of several repeats, so the figures are the code's and not the shared machine's
spikes; read them as ratios within one run):

* Twilio inbound: ``parse_message`` of a 20 ms ``media`` frame (50 a second per call) and of a
  ``mark`` echo (25 a second while the bot talks), against ``json.loads`` of the same text (what
  any server must do).
* Twilio outbound: ``media_message`` + ``mark_message`` of a 40 ms chunk (25 a second).
* The bus: one 200 ms ``Audio`` piece (5 a second per talking call, as the bench worker sends
  them), the sender's ``encode`` + what the bus stores, and the reader's way back to the record,
  in protocol 1.1's form (payload binary beside the JSON, ``bus.protocol.pack``/``unpack``)
  against 1.0's (base64 inside the JSON, ``json.dumps`` / ``json.loads``); and the bytes stored.

The per call-second column multiplies each by its rate.
"""

from __future__ import annotations

import argparse
import base64
import json
import timeit
from collections.abc import Callable
from typing import Any

from bus import protocol as bp
from gateway import twilio_protocol as tp

__all__ = ["main", "measure"]

_SID = "MZ18ad3ab5a668481ce02b83e7395059f0"


def _best_us(fn: Callable[[], Any], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def _base64_form(piece: bp.Audio) -> dict[str, Any]:
    """Protocol 1.0's wire object of ``piece``: ``encode(text=True)`` (what 1.0's encode was)."""
    return bp.encode(piece, text=True, eid="w-1")


def measure(*, number: int = 20_000, repeat: int = 7) -> list[dict[str, Any]]:
    """Rows of (what, us per message, messages per call-second, us per call-second)."""
    frame = tp.build_media(stream_sid=_SID, payload=bytes(range(160)), sequence_number=1234,
                           chunk=1233, timestamp_ms=24_660)
    mark = tp.build_mark(stream_sid=_SID, name="u1:12", sequence_number=99)
    chunk = bytes(320)
    piece = bp.Audio(utterance_id="u-123", payload=bytes(range(256)) * 6 + bytes(64), text="Hi",
                     audio_ms=200.0, duration_ms=200.0)
    text, binaries = bp.pack(bp.encode(piece, eid="w-1"))
    old_text = json.dumps(_base64_form(piece), separators=(",", ":"))
    stored_new = len(text.encode()) + sum(len(v) + len(k) + 2 for k, v in binaries)
    stored_old = len(old_text.encode())
    cases: list[tuple[str, Callable[[], Any], float]] = [
        ("twilio in: json.loads of a media frame", lambda: json.loads(frame), 50),
        ("twilio in: parse_message media", lambda: tp.parse_message(frame), 50),
        ("twilio in: parse_message mark", lambda: tp.parse_message(mark), 25),
        ("twilio out: media_message + mark_message (40 ms)",
         lambda: (tp.media_message(_SID, chunk), tp.mark_message(_SID, "u1:12")), 25),
        ("bus send 1.1: encode + pack", lambda: bp.pack(bp.encode(piece, eid="w-1")), 5),
        ("bus send 1.0: encode(base64) + json.dumps",
         lambda: json.dumps(_base64_form(piece), separators=(",", ":"), allow_nan=False), 5),
        ("bus read 1.1: unpack + decode", lambda: bp.decode(bp.unpack(text.encode(), binaries)), 5),
        ("bus read 1.0: json.loads + decode(base64)",
         lambda: bp.decode(json.loads(old_text.encode())), 5),
    ]
    rows = []
    for what, fn, rate in cases:
        us = _best_us(fn, number, repeat)
        rows.append({"what": what, "us": us, "per_call_second": rate, "us_per_call_second": us * rate})
    rows.append({"what": "bus bytes stored per 200 ms piece, 1.1 / 1.0", "bytes_new": stored_new,
                 "bytes_old": stored_old})
    assert bp.decode(bp.unpack(text, binaries)) == piece == bp.decode(old_text)
    assert base64.b64decode(json.loads(old_text)["payload"]) == piece.payload
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.frame_cost", description=__doc__.split("\n")[0])
    p.add_argument("--number", type=int, default=20_000, help="calls per repeat")
    p.add_argument("--repeat", type=int, default=7, help="repeats (the best is kept)")
    args = p.parse_args(argv)
    for row in measure(number=args.number, repeat=args.repeat):
        if "us" in row:
            print(f"{row['what']:50s} {row['us']:7.2f} us  x{row['per_call_second']:>3g}/s = "
                  f"{row['us_per_call_second']:6.1f} us per call-second")
        else:
            print(f"{row['what']:50s} {row['bytes_new']} / {row['bytes_old']} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
