"""split_sentences: where eSpeak's per-sentence streaming cuts the text."""

from __future__ import annotations

import pytest

from speech import split_sentences


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        ("Hello. How are you?  Fine!", ["Hello.", "How are you?", "Fine!"]),
        ("I am Dr. Smith, e.g. a doctor.", ["I am Dr. Smith, e.g. a doctor."]),
        ("J. R. R. Tolkien wrote. Yes.", ["J. R. R. Tolkien wrote.", "Yes."]),
        ("It costs 3.5 dollars at 9:30. Okay", ["It costs 3.5 dollars at 9:30.", "Okay"]),
        ('He said "hi." Then left', ['He said "hi."', "Then left"]),
        ("The answer is no. Anything else?", ["The answer is no.", "Anything else?"]),
        ("Options:\n- one\n- two", ["Options:", "- one", "- two"]),
        ("Para one\n\nPara two.", ["Para one", "Para two."]),
        ("no punctuation at all", ["no punctuation at all"]),
        ("", []),
        (" \n\t ", []),
    ],
)
def test_split(text: str, sentences: list[str]) -> None:
    assert split_sentences(text) == sentences
