"""heard_ms -> heard text (nodes._alignment)."""

from __future__ import annotations

import pytest

from nodes import UtteranceAlignment


def aligned(*chunks: tuple[str, float]) -> UtteranceAlignment:
    alignment = UtteranceAlignment()
    for text, ms in chunks:
        alignment.add(text, ms)
    return alignment


def per_char(*texts: str, ms: float = 40) -> UtteranceAlignment:
    return aligned(*((t, len(t) * ms) for t in texts))


@pytest.mark.parametrize(
    ("heard_ms", "expected"),
    [
        (0, ""),
        (-5, ""),
        (39, ""),  # less than one character
        (160, "Your"),  # exactly the first word
        (200, "Your"),  # "Your " -> trailing space stripped
        (239, "Your"),  # one character into "balance"
        (500, "Your balance"),  # docstring example: 12.5 characters
        (580, "Your balance"),  # docstring example: inside "is"
        (640, "Your balance is"),
        (1239, "Your balance is twelve"),  # 30.98 chars: "dollars." unfinished
        (1240, "Your balance is twelve dollars."),  # all of it
        (99_999, "Your balance is twelve dollars."),
    ],
)
def test_single_chunk(heard_ms: float, expected: str) -> None:
    assert per_char("Your balance is twelve dollars.").heard_text(heard_ms) == expected


def test_whole_earlier_chunks_and_part_of_the_current_one() -> None:
    alignment = per_char("Our opening hours are", " nine to five", ms=10)
    assert alignment.audio_ms == 340
    assert alignment.heard_text(210) == "Our opening hours are"
    assert alignment.heard_text(285) == "Our opening hours are nine"
    assert alignment.heard_text(300) == "Our opening hours are nine to"


def test_proportional_within_a_chunk_of_its_own_duration() -> None:
    # a slow chunk: 9 characters over 1000 ms, after a fast one (5 characters in 50 ms)
    alignment = aligned(("Okay,", 50), (" one two.", 1000))
    assert alignment.heard_text(50) == "Okay,"
    assert alignment.heard_text(50 + 444) == "Okay,"  # 3.996 characters: " on"
    assert alignment.heard_text(50 + 450) == "Okay, one"  # 4.05 characters: " one"
    assert alignment.heard_text(50 + 555) == "Okay, one"  # 4.99 -> 4, " one" then space
    assert alignment.heard_text(50 + 700) == "Okay, one"  # inside "two."


def test_words_split_across_chunks_are_cut_whole() -> None:
    alignment = per_char("Hel", "lo world", ms=10)
    assert alignment.heard_text(25) == ""
    assert alignment.heard_text(45) == ""  # "Hell" is not a word
    assert alignment.heard_text(50) == "Hello"
    assert alignment.heard_text(60) == "Hello"


def test_empty_utterance_and_zero_length_chunks() -> None:
    assert UtteranceAlignment().heard_text(100) == ""
    alignment = aligned(("Hi.", 30), ("", 0), (" Bye.", 50))
    assert alignment.heard_text(30) == "Hi."
    assert alignment.heard_text(80) == "Hi. Bye."


def test_chunk_spans() -> None:
    alignment = per_char("ab", "cde", ms=10)
    first, second = alignment.chunks
    assert (first.text_start, first.text_end, first.start_ms, first.end_ms) == (0, 2, 0, 20)
    assert (second.text_start, second.text_end, second.start_ms, second.end_ms) == (2, 5, 20, 50)
    assert alignment.text == "abcde"
