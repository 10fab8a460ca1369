from __future__ import annotations

import pytest

from multistream.text._stop_strings import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out, stopped = "", False
    for p in pieces:
        safe, stopped = m.feed(p)
        out += safe
        if stopped:
            break
    if not stopped:
        out += m.flush()
    return out, stopped


@pytest.mark.parametrize(
    "pieces",
    [["Hello\n\nUser: x"], ["Hello\n", "\nUs", "er", ": x"], list("Hello\n\nUser: x"), ["Hello\n\nU", "ser:"]],
)
def test_stop_split_across_pieces_is_never_emitted(pieces):
    m = StopMatcher(["\n\nUser:"])
    emitted = []
    for p in pieces:
        safe, stopped = m.feed(p)
        emitted.append(safe)
        if stopped:
            break
    assert stopped
    assert "".join(emitted) == "Hello"
    # Not even a prefix of the stop string leaked out before it was decided.
    assert all("\n" not in e for e in emitted)


def test_false_start_is_released():
    assert run(["END"], ["the E", "N", "ding"]) == ("the ENding", False)


def test_held_text_is_flushed_at_the_end():
    assert run(["END"], ["the EN"]) == ("the EN", False)


def test_earliest_of_several_stops_wins():
    assert run(["b", "abc"], ["xxab", "c"]) == ("xxa", True)


def test_no_stops_passes_through():
    assert run([], ["a", "b"]) == ("ab", False)
