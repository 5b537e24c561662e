"""A recorded line replayed open loop (as ``eval_bargein.py`` replays one) after a resume: its
echo of the bot runs ahead of what the gateway plays on (``BargeInSettings.deaf_echo_corr``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench.robustness import bot_turns, call_settings, parse_variant
from gateway.replay import replay
from linesim import VoiceLibrary, call_name, grid, simulate_call
from vad import VadEngine


async def test_after_a_backchannels_resume_the_recordings_echo_pauses_nothing(
        library: VoiceLibrary, tmp_path: Path) -> None:
    """A train call (seed 3, call 90: a 20 dB, 150 ms echo, a backchannel in each of two bot
    turns). Each backchannel pauses the bot, which resumes from what the caller heard; the
    recording's echo goes on from where the bot was, ahead of it. With the gate's copy kept on
    that deaf line through the resume, the bot is paused for the two backchannels and nothing
    else; without the rule the echo running ahead paused it five more times (measured)."""
    cond = next(c for c in grid("small") if c.name == "erl20-d150-none-none-quiet-backchannel")
    call = simulate_call(cond, split="train", seed=3, index=90, library=library,
                         name=call_name("train", 3, 90, cond))
    words = [(e["start_ms"], e["end_ms"]) for e in call.labels["events"]
             if e["kind"] == "backchannel"]
    assert len(words) == 2
    path = tmp_path / f"{call.name}.twilio.jsonl"
    path.write_text("\n".join(call.messages()) + "\n")
    base = call_settings(parse_variant("configured"))

    async def clears(settings: object) -> list[float]:
        async with VadEngine() as engine:
            timeline, _ = await replay(path, bot_script=bot_turns(call), settings=settings,
                                       vad=engine)
        events = timeline.events
        assert not any(e["type"] == "barge_in" for e in events)  # never an interrupt
        return [float(e["t_ms"]) for e in events if e["type"] == "clear_sent"]

    on = await clears(base)
    assert len(on) == 2
    for t, (a, b) in zip(on, words, strict=True):
        assert a <= t <= b + 200  # each pause is a backchannel's
    off = await clears(replace(base, barge_in=replace(base.barge_in, deaf_echo_corr=None)))
    assert len(off) > len(on) + 2
