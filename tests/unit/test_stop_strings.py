"""Stop strings of the built-in models: where an answer ends, and what a stream may show yet."""

from __future__ import annotations

import orjson
import pytest

from services.inference.stop_strings import BadStop, first_stop, safe_length, stops_of


def test_the_earliest_stop_string_wins() -> None:
    assert first_stop("one two. three\n", ("\n", ".")) == (7, ".")
    assert first_stop("no stop here", ("\n",)) is None


def test_a_tail_that_may_become_a_stop_string_is_held_back() -> None:
    assert safe_length("Hello wor", ("world!",)) == len("Hello ")
    assert safe_length("Hello", ("END",)) == 5
    assert safe_length("line\r", ("\r\n", "\n")) == 4


def test_stops_are_read_from_either_api_and_checked() -> None:
    assert stops_of("openai.chat", orjson.dumps({"stop": "\n"})) == ("\n",)
    assert stops_of("openai.chat", orjson.dumps({"stop": ["a", "b"]})) == ("a", "b")
    assert stops_of("anthropic.messages", orjson.dumps({"stop_sequences": ["END"]})) == ("END",)
    assert stops_of("", b"") == ()
    with pytest.raises(BadStop, match="stop_sequences"):
        stops_of("anthropic.messages", orjson.dumps({"stop_sequences": "END"}))
    with pytest.raises(BadStop, match="stop"):
        stops_of("openai.chat", orjson.dumps({"stop": [""]}))
