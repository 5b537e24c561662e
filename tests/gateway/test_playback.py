"""Playback truth from Twilio marks: what was echoed before a `clear` is heard, nothing after."""

from __future__ import annotations

from gateway.playback import Playback, UtteranceState
from gateway.twilio_sim import TwilioPlayout

SID = "MZ" + "a" * 32


def _run(pb: Playback, tw: TwilioPlayout, t0: float, t1: float) -> None:
    """Advance the media clock from t0 to t1 in 20 ms steps, as the call controller does."""
    t = t0
    while t < t1:
        for name in _names(tw.advance(t)):
            _deliver(pb, tw, pb.on_mark(name, t), t)
        _deliver(pb, tw, pb.pump(t), t)
        t += 20


def _names(frames: list[str]) -> list[str]:
    from gateway import twilio_protocol as tp

    out = []
    for f in frames:
        m = tp.parse_message(f)
        assert isinstance(m, tp.Mark)
        out.append(m.name)
    return out


def _deliver(pb: Playback, tw: TwilioPlayout, out: object, t: float) -> list[str]:
    from gateway import twilio_protocol as tp

    echoes: list[str] = []
    if getattr(out, "clear", False):
        echoes += tw.receive(tp.clear_message(SID), at_ms=t)
    for c in getattr(out, "chunks", []):
        tw.receive(tp.media_message(SID, c.payload), at_ms=t)
        tw.receive(tp.mark_message(SID, c.mark), at_ms=t)
    return echoes


def test_only_marks_echoed_before_clear_count_as_heard() -> None:
    pb = Playback(chunk_ms=20, lead_ms=240)
    tw = TwilioPlayout(stream_sid=SID)
    pb.start("u1", node="n", interruptible=True)
    pb.add_audio("u1", b"\x7f" * 8000)  # 1 s
    pb.end("u1")
    _run(pb, tw, 0, 500)
    u1 = pb.get("u1")
    assert u1 is not None and u1.state is UtteranceState.PLAYING
    heard_before = u1.heard
    assert 0 < heard_before < 8000
    # The caller barges in: clear; Twilio echoes every pending mark at once.
    u, out = pb.interrupt(500)
    assert u is u1 and out.clear
    clear_echoes = _deliver(pb, tw, out, 500)
    assert clear_echoes, "Twilio echoes the pending marks on clear"
    for name in _names(clear_echoes):
        pb.on_mark(name, 500)
    assert u1.heard == heard_before  # the clear's echoes proved nothing
    assert u1.state is UtteranceState.INTERRUPTED
    # The next reply (after the barge-in) plays fully, and its marks count.
    pb.start("u2", node="n", interruptible=True)
    pb.add_audio("u2", b"\x7f" * 8000)
    pb.end("u2")
    _run(pb, tw, 520, 2000)
    u2 = pb.get("u2")
    assert u2 is not None and u2.state is UtteranceState.FINISHED and u2.heard == 8000
    assert tw.stats.marks_echoed_on_clear == len(clear_echoes)


def test_pause_and_resume_continue_from_the_heard_point() -> None:
    pb = Playback(chunk_ms=20, lead_ms=200)
    tw = TwilioPlayout(stream_sid=SID, keep_audio=True)
    audio = bytes(range(256)) * 32  # 8192 bytes, recognisable positions
    pb.start("u", node="n", interruptible=True)
    pb.add_audio("u", audio)
    pb.end("u")
    _run(pb, tw, 0, 400)
    u = pb.get("u")
    assert u is not None
    heard = u.heard
    out = pb.pause(400)
    for name in _names(_deliver(pb, tw, out, 400)):
        pb.on_mark(name, 400)
    assert u.state is UtteranceState.PAUSED and u.heard == heard and u.sent == heard
    _run(pb, tw, 420, 600)  # paused: nothing is sent
    assert u.sent == heard
    res = pb.resume(600)
    assert [e["type"] for e in res.events] == ["bot_utterance_resumed"]
    _deliver(pb, tw, res, 600)
    _run(pb, tw, 620, 2400)
    assert u.state is UtteranceState.FINISHED
    # The caller heard a prefix, then everything from the heard point on: nothing skipped.
    played = bytes(tw.stats.played)
    assert played.endswith(audio[heard:])


def test_a_pause_knows_what_a_line_deaf_to_the_clear_would_play() -> None:
    """``Playback.would_play`` (the barge-in policy's ``pause_echo_corr`` and
    ``deaf_echo_corr``): from an utterance's first pause on, the bot as a line that ignored
    every clear plays it: on at 1x from the last byte sent before that pause (the sent audio
    ran to ``line_busy_until_ms``), what was played before that; through a resume and a second
    pause still that first schedule, not the gateway's later one; the next utterance from when
    its audio arrived or the first ended there, whichever is later; one dropped before any of
    it was sent on no line; none after one that may still grow. Nothing before any pause, and
    nothing once the gateway has played every utterance of that line."""
    pb = Playback(chunk_ms=20, lead_ms=200)
    tw = TwilioPlayout(stream_sid=SID)
    audio = bytes(range(256)) * 32  # 8192 bytes (1024 ms), recognisable positions
    pb.start("u", node="n", interruptible=True)
    pb.add_audio("u", audio, 0)
    pb.end("u")
    assert pb.would_play(0, 100) is None
    _run(pb, tw, 0, 400)
    u = pb.get("u")
    assert u is not None
    sent, busy = u.sent, pb.line_busy_until_ms
    assert busy > 400  # audio is queued ahead of the clock
    _deliver(pb, tw, pb.pause(400), 400)
    assert pb.would_play(busy, busy + 100) == [(busy, audio[sent : sent + 800])]
    assert pb.would_play(busy - 50, busy) == [(busy - 50, audio[sent - 400 : sent])]
    _deliver(pb, tw, pb.resume(600), 600)
    first = sent + int((600 - busy) * 8)  # the deaf line went on at 1x, resumed or not
    assert pb.would_play(600, 700) == [(600, audio[first : first + 800])]
    _run(pb, tw, 620, 800)
    _deliver(pb, tw, pb.pause(800), 800)  # the gateway played on from the heard point ...
    first = sent + int((800 - busy) * 8)  # ... the deaf line from the first pause at 1x
    assert pb.would_play(800, 900) == [(800, audio[first : first + 800])]
    # The next utterance arrives at 900 ms; the deaf line ends "u" at 1024 ms and plays it on.
    nxt = bytes(range(255, -1, -1)) * 8  # 2048 bytes (256 ms)
    pb.start("v", node="n", interruptible=True)
    pb.add_audio("v", nxt, 900)
    pb.end("v")
    end_u = busy - sent / 8 + len(audio) / 8
    assert end_u == 1024.0
    assert pb.would_play(1000, 1100) == [(1000, audio[-192:]), (end_u, nxt[: 8 * 76])]
    # One dropped before any of it was sent is on no line, and the next plays where it was.
    pb.start("x", node="n", interruptible=True)
    pb.drop("x")
    pb.start("w", node="n", interruptible=True)
    pb.add_audio("w", nxt, 1000)
    end_v = end_u + len(nxt) / 8
    assert pb.would_play(end_v - 10, end_v + 10) == [(end_v - 10, nxt[-80:]),
                                                     (end_v, nxt[:80])]
    # While "w" may still grow, where the one after it starts is not known: not played yet.
    pb.start("y", node="n", interruptible=True)
    pb.add_audio("y", audio[:800], 1000)
    pb.end("y")
    end_w = end_v + len(nxt) / 8
    assert pb.would_play(end_w - 10, end_w + 10) == [(end_w - 10, nxt[-80:])]
    pb.end("w")
    assert pb.would_play(end_w - 10, end_w + 10) == [(end_w - 10, nxt[-80:]),
                                                     (end_w, audio[:80])]
    _deliver(pb, tw, pb.resume(1100), 1100)
    _run(pb, tw, 1100, 2800)  # the gateway plays them all to the end
    assert all(pb.get(k).state is UtteranceState.FINISHED for k in "uvwy")  # type: ignore[union-attr]
    assert pb.would_play(2800, 2900) is None


def test_non_interruptible_utterance_cannot_be_interrupted() -> None:
    pb = Playback(chunk_ms=20, lead_ms=240.0)
    pb.start("pay", node="payment", interruptible=False)
    pb.add_audio("pay", b"\x7f" * 1600)
    pb.end("pay")
    pb.pump(0)
    u, out = pb.interrupt(40)
    assert u is None and not out.clear
    assert pb.get("pay").state is UtteranceState.PLAYING  # type: ignore[union-attr]


def test_next_utterance_starts_when_the_last_mark_of_the_one_before_comes_back() -> None:
    """Two utterances queued at once: the mark echo that finishes the first starts the second,
    and both events are reported (started, finished, started, in that order)."""
    pb = Playback(chunk_ms=40, lead_ms=240.0)
    for uid in ("a", "b"):
        pb.start(uid, node="n", interruptible=True)
        pb.add_audio(uid, b"\x7f" * 320)  # one 40 ms chunk each
        pb.end(uid)
    first = pb.pump(0.0)
    assert [e["type"] for e in first.events] == ["bot_utterance_started"]
    assert len(first.chunks) == 1  # b waits until a is heard
    out = pb.on_mark(first.chunks[0].mark, 40.0)
    assert [(e["type"], e["utterance_id"]) for e in out.events] == [
        ("bot_utterance_finished", "a"), ("bot_utterance_started", "b")]
    assert [c.utterance_id for c in out.chunks] == ["b"]


def _queued(pb: Playback, uid: str, *, interruptible: bool = True, audio: bool = True) -> None:
    pb.start(uid, node="n", interruptible=interruptible, text=uid)
    if audio:
        pb.add_audio(uid, b"\x10" * 8000)  # 1 s
    pb.end(uid)


def test_a_barge_in_drops_the_interruptible_replies_queued_behind_and_keeps_the_others() -> None:
    """The caller took the turn: the bot must not start its next queued reply the instant the
    first is cut (it did: the next one began playing over the caller). A non-interruptible one
    queued there (a disclosure) still plays."""
    pb, tw = Playback(chunk_ms=40, lead_ms=200), TwilioPlayout(stream_sid=SID)
    for uid, interruptible in (("u1", True), ("u2", True), ("u3", False), ("u4", True)):
        _queued(pb, uid, interruptible=interruptible)
    _run(pb, tw, 0, 400)
    u, out = pb.interrupt(400)
    assert u is not None and u.id == "u1" and out.clear
    dropped = [e for e in out.events if e.get("before_audio")]
    assert [(e["utterance_id"], e["heard_ms"]) for e in dropped] == [("u2", 0.0), ("u4", 0.0)]
    assert pb.get("u2").state is pb.get("u4").state is UtteranceState.INTERRUPTED
    started = pb.pump(400).events
    assert [e["utterance_id"] for e in started if e["type"] == "bot_utterance_started"] == ["u3"]


def test_an_answer_the_worker_cut_before_it_played_is_never_started() -> None:
    """``utterance_end {interrupted: true}`` for an answer a barge-in cut in the worker before
    any audio (nodes/_worker.py): dropped unheard, not shown as said (it was shown as started
    and finished)."""
    pb = Playback(chunk_ms=40, lead_ms=200)
    pb.start("u1", node="n", interruptible=True, text="You pressed 2")
    out = pb.end("u1", interrupted=True)
    assert [(e["type"], e["before_audio"]) for e in out.events] == [
        ("bot_utterance_interrupted", True)]
    assert pb.current is None and pb.pump(0).events == []
    # Without the flag the same audio-less utterance "plays": started, then finished.
    pb.start("u2", node="n", interruptible=True, text="hello")
    assert pb.end("u2").events == []
    assert [e["type"] for e in pb.pump(0).events] == ["bot_utterance_started",
                                                      "bot_utterance_finished"]
