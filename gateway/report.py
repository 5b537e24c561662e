"""``callgate replay ... --html report.html``: a call's timeline as one static page.

The page needs nothing but a browser (inline SVG, no script, no network): the caller's and the
bot's waveforms on the media clock, Silero's probability per 32 ms window with the windows the
echo/noise gate passed shaded, every decision (pause, commit, resume, suppressed, DTMF) as a
mark, the bot's utterances (node, interruptible, text, what was heard), the transcripts, the
per-turn latencies (:class:`gateway.ops.TurnLatencies`) and the event table. For a failing
test or a bug report.

:class:`ReportCollector` listens to the replay's :class:`Timeline` (events and samples); the
rendering (:func:`render_report`) does no I/O.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from audio import ulaw_to_float32

from .ops import TurnLatencies
from .timeline import Timeline

__all__ = ["ReportCollector", "inbound_audio", "render_report"]

WIDTH = 1200
LEFT = 70
MARKS = {
    "bot_utterance_paused": ("#e08a00", "pause"),
    "barge_in": ("#b3261e", "commit"),
    "bot_utterance_resumed": ("#1f8a4c", "resume"),
    "interrupt_suppressed": ("#7b3fb3", "suppressed"),
    "dtmf": ("#444444", "dtmf"),
}


@dataclass(slots=True)
class ReportCollector:
    """What a replay's timeline shows, kept for the report."""

    events: list[dict[str, Any]] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    bot: list[tuple[float, bytes]] = field(default_factory=list)

    def timeline(self, sink: IO[str] | None = None) -> Timeline:
        """A timeline for the replay (writing to ``sink`` as usual) that feeds this report."""
        t = Timeline(sink=sink)
        t.add_listener(self.events.append)
        t.add_sampler(self._sample)
        return t

    def _sample(self, s: dict[str, Any]) -> None:
        if s["kind"] == "in":
            g = s["gate"]
            self.windows.append({"t_ms": s["t_ms"], "prob": float(s["prob"]),
                                 "passes": bool(g.passes), "level_db": float(g.level_db)})
        else:
            self.bot.append((float(s["t_ms"]), bytes(s["payload"])))

    def write(self, path: Path | str, *, title: str, inbound: bytes) -> None:
        Path(path).write_text(render_report(title=title, inbound=inbound, events=self.events,
                                            windows=self.windows, bot=self.bot))


def inbound_audio(recording: Path | str) -> bytes:
    """The caller's track of a recording (a WAV, a ``.twilio.jsonl`` or a recorded call's
    folder) as mu-law on the media clock (gaps as silence)."""
    from . import twilio_protocol as tp
    from .replay import recording_messages

    p = Path(recording)
    if p.is_dir():
        found = sorted(p.glob("*.twilio.jsonl"))
        if not found:
            return b""
        p = found[0]
    buf = bytearray()
    for line in recording_messages(p):
        try:
            msg = tp.parse_message(line)
        except tp.ProtocolError:
            continue
        if isinstance(msg, tp.Media) and msg.track in ("inbound", "inbound_track"):
            at = int(msg.timestamp_ms * 8)
            if at > len(buf):
                buf.extend(b"\xff" * (at - len(buf)))
            buf[at:at + len(msg.payload)] = msg.payload
    return bytes(buf)


def _bot_track(bot: list[tuple[float, bytes]], events: list[dict[str, Any]],
               n: int) -> np.ndarray:
    """The bot's audio as sent, on the inbound timeline, cut where a clear stopped it."""
    out = np.zeros(n, dtype=np.float32)
    clears = sorted(float(e["t_ms"]) for e in events if e["type"] == "clear_sent")
    for t, payload in bot:
        at = int(round(t * 8))
        x = ulaw_to_float32(payload)
        cut = next((c for c in clears if c > t and c < t + len(x) / 8), None)
        # a chunk sent before a clear but due to play after it never played
        if cut is not None:
            x = x[: int((cut - t) * 8)]
        end = min(n, at + len(x))
        if end > at:
            out[at:end] = x[: end - at]
    return out


def _envelope(x: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray]:
    if x.size == 0:
        return np.zeros(columns), np.zeros(columns)
    edges = np.linspace(0, x.size, columns + 1).astype(int)
    lo = np.array([x[a:b].min() if b > a else 0.0 for a, b in zip(edges[:-1], edges[1:])])
    hi = np.array([x[a:b].max() if b > a else 0.0 for a, b in zip(edges[:-1], edges[1:])])
    return lo, hi


def _wave_path(x: np.ndarray, y0: float, h: float, columns: int) -> str:
    lo, hi = _envelope(x, columns)
    scale = h / 2 / max(0.05, float(np.max(np.abs(x))) if x.size else 1.0)
    mid = y0 + h / 2
    top = [f"{LEFT + i:.0f},{mid - v * scale:.1f}" for i, v in enumerate(hi)]
    bottom = [f"{LEFT + i:.0f},{mid - v * scale:.1f}" for i, v in reversed(list(enumerate(lo)))]
    return "M" + " L".join(top + bottom) + " Z"


def _detail(e: dict[str, Any]) -> str:
    skip = {"t_ms", "type", "kind"}
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in e.items() if k not in skip)


def render_report(*, title: str, inbound: bytes, events: list[dict[str, Any]],
                  windows: list[dict[str, Any]], bot: list[tuple[float, bytes]]) -> str:
    """The page (HTML with inline SVG) of one replayed call."""
    caller = ulaw_to_float32(inbound)
    end_ms = max([len(caller) / 8] + [float(e["t_ms"]) for e in events]) or 1.0
    n = int(end_ms * 8)
    bot_x = _bot_track(bot, events, n)
    cols = WIDTH - LEFT - 10

    def x(t: float) -> float:
        return LEFT + float(t) / end_ms * cols

    h_wave, h_prob = 90, 70
    y_caller, y_prob, y_bot, y_ev = 20, 20 + h_wave + 10, 20 + h_wave + h_prob + 20, 0
    y_ev = y_bot + h_wave + 10
    height = y_ev + 130
    svg: list[str] = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
                      f'height="{height}" font-family="sans-serif" font-size="11">']
    svg.append(f'<rect width="{WIDTH}" height="{height}" fill="#fbfcfd"/>')
    for label, y in (("caller", y_caller), ("Silero p", y_prob), ("bot", y_bot),
                     ("events", y_ev)):
        svg.append(f'<text x="4" y="{y + 14}" fill="#67717c">{label}</text>')
    for s in range(0, int(end_ms // 1000) + 1):
        svg.append(f'<line x1="{x(s * 1000):.1f}" x2="{x(s * 1000):.1f}" y1="10" '
                   f'y2="{height - 20}" stroke="#e3e7eb"/>'
                   f'<text x="{x(s * 1000) + 2:.1f}" y="{height - 6}" fill="#67717c">{s}s</text>')
    # utterances behind the bot waveform
    started: dict[str, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "bot_utterance_started":
            started[str(e["utterance_id"])] = e
        elif e["type"] in ("bot_utterance_finished", "bot_utterance_interrupted"):
            s0 = started.get(str(e["utterance_id"]))
            if s0 is None:
                continue
            t0 = float(s0.get("play_at_ms", s0["t_ms"]))
            fill = "#e6eefa" if s0.get("interruptible", True) else "#efe6f7"
            tip = (f"{s0.get('node')} ({'interruptible' if s0.get('interruptible', True) else 'not interruptible'}): "
                   f"{e.get('text') or s0.get('text', '')} | heard: {e.get('heard_text', '')}")
            svg.append(f'<rect x="{x(t0):.1f}" y="{y_bot}" width="{max(1, x(e["t_ms"]) - x(t0)):.1f}" '
                       f'height="{h_wave}" fill="{fill}"><title>{html.escape(tip)}</title></rect>')
            label = f"{s0.get('node')}{'' if s0.get('interruptible', True) else ' (not interruptible)'}"
            svg.append(f'<text x="{x(t0) + 2:.1f}" y="{y_bot + h_wave - 4}" fill="#1b5fae">'
                       f'{html.escape(label)}: {html.escape(str(e.get("text") or s0.get("text", ""))[:80])}'
                       '</text>')
    svg.append(f'<path d="{_wave_path(caller, y_caller, h_wave, cols)}" fill="#1f8a4c"/>')
    svg.append(f'<path d="{_wave_path(bot_x, y_bot, h_wave, cols)}" fill="#1b5fae"/>')
    for w in windows:
        if w["passes"]:
            svg.append(f'<rect x="{x(w["t_ms"] - 32):.1f}" y="{y_prob}" '
                       f'width="{max(0.5, x(w["t_ms"]) - x(w["t_ms"] - 32)):.1f}" '
                       f'height="{h_prob}" fill="#1f8a4c" fill-opacity="0.12"/>')
    if windows:
        pts = " ".join(f'{x(w["t_ms"]):.1f},{y_prob + h_prob - w["prob"] * h_prob:.1f}'
                       for w in windows)
        svg.append(f'<polyline points="{pts}" fill="none" stroke="#000" stroke-width="1"/>')
    svg.append(f'<rect x="{LEFT}" y="{y_prob}" width="{cols}" height="{h_prob}" fill="none" '
               f'stroke="#dde2e7"/>')
    row = 0
    onset: dict[str, float] = {}
    for e in events:
        if e["type"] == "clear_sent" and e.get("onset_ms") is not None:
            onset[str(e.get("utterance_id"))] = float(e["t_ms"]) - float(e["onset_ms"])
        mark = MARKS.get(e["type"])
        if mark is not None:
            color, label = mark
            if e["type"] == "bot_utterance_paused" and str(e["utterance_id"]) in onset:
                label += f" {onset.pop(str(e['utterance_id'])):.0f} ms after onset"
            svg.append(f'<line x1="{x(e["t_ms"]):.1f}" x2="{x(e["t_ms"]):.1f}" y1="{y_caller}" '
                       f'y2="{y_ev + 20}" stroke="{color}" stroke-width="1.5"/>'
                       f'<text x="{x(e["t_ms"]) + 2:.1f}" y="{y_ev + 14 + 12 * (row % 3)}" '
                       f'fill="{color}"><title>{html.escape(_detail(e))}</title>{label}</text>')
            row += 1
        elif e["type"] == "transcript" and e.get("final", True):
            svg.append(f'<text x="{x(e["t_ms"]):.1f}" y="{y_ev + 60 + 14 * (row % 4)}" '
                       f'fill="#1b5fae">"{html.escape(str(e.get("text", "")))}"'
                       f'{" (" + html.escape(str(e["dropped"])) + ")" if e.get("dropped") else ""}'
                       '</text>')
            row += 1
    svg.append("</svg>")
    latencies = TurnLatencies()
    rows: list[str] = []
    for e in events:
        rows.append(f'<tr class="{html.escape(e["type"])}"><td>{float(e["t_ms"]) / 1000:.3f}</td>'
                    f'<td>{html.escape(e["type"])}</td><td>{html.escape(_detail(e))}</td></tr>')
        for rec in latencies.feed(e):
            rows.append(f'<tr class="latency"><td>{rec["t_ms"] / 1000:.3f}</td>'
                        f'<td>latency {rec["what"]}</td><td>{rec["ms"]:.0f} ms</td></tr>')
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #1d232a; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 2px 8px; text-align: left;
  border-bottom: 1px solid #eef1f4; vertical-align: top; }}
tr.latency td {{ color: #67717c; }} tr.barge_in td, tr.clear_sent td {{ color: #b3261e; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>Caller (green) and bot (blue) audio on the media clock; Silero's speech probability per
32 ms window, shaded where the echo/noise gate passed the window; decisions as marks (hover
for details); bot utterances shaded behind the bot's audio (hover: node, text, heard).</p>
{"".join(svg)}
<h2>Events</h2>
<table><thead><tr><th>t (s)</th><th>event</th><th>detail</th></tr></thead><tbody>
{"".join(rows)}
</tbody></table>
</body></html>
"""
