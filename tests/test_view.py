"""The live view shared by ms.show and the demo: folding events, the throttle."""

from __future__ import annotations

from multistream.events import TextEvent
from multistream.ui import LiveView, Throttle, show, throttled_views
from multistream.ui import demo, notebook


def _text(seq: int, delta: str, offset: int, **kw: object) -> TextEvent:
    return TextEvent(stream_id="s", seq=seq, t=0.1 * seq, delta=delta, token_ids=[seq], index=seq, offset=offset, **kw)  # type: ignore[arg-type]


def test_throttle_says_when_the_next_update_is_due() -> None:
    throttle = Throttle(max_fps=4)
    assert throttle.due(0.0) and throttle.remaining(0.0) == 0.0
    throttle.mark(10.0)
    assert not throttle.due(10.1) and abs(throttle.remaining(10.1) - 0.15) < 1e-9
    assert throttle.due(10.25) and throttle.remaining(11.0) == 0.0


def test_starting_with_is_a_view_that_already_shows_the_kept_text() -> None:
    view = LiveView.starting_with("Hello ")
    assert (view.text(0), view.length, view.events, view.first_text_t) == ("Hello ", 6, 0, None)
    view.apply(_text(1, "world", 6))
    view.apply(_text(2, "there", 6, revision=1))  # a rewind to the end of the kept part
    assert view.text(0) == "Hello there" and view.first_text_t is not None and view.revision == 1
    assert LiveView.starting_with("").texts == [[]]


def test_the_notebook_and_the_demo_share_one_view() -> None:
    assert notebook.LiveView is LiveView and notebook.Throttle is Throttle and notebook.show is show
    assert demo.throttled_views is throttled_views
