"""The live view shared by ms.show and the demo: folding events, the throttle."""

from __future__ import annotations

from multistream.events import TextEvent
from multistream.ui import LiveView, Throttle, demo, notebook, show, throttled_views


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


def test_confidence_in_a_chat_bubble_shows_every_token_exactly_and_keeps_its_alternatives() -> None:
    # The demo puts the coloured tokens in the chat bubble, which renders Markdown and drops data
    # attributes: the text must come out as written, and each alternative still say where it goes.
    import html as html_lib
    import re

    from multistream.ui.view import confidence_html, markdown_safe_escape

    tricky = ["# Title", "\n\n", "1. *x* _y_", " `code` ", "$5 [a](b) <b>", "'quote'"]
    for text in tricky:
        escaped = markdown_safe_escape(text)
        bare = re.sub(r"&#?[0-9a-zA-Z]+;", "", escaped)  # what is left besides entities
        assert not re.search(r"[\n*_`#\[\]$<>']", bare), escaped  # nothing Markdown or HTML would read
        assert html_lib.unescape(escaped) == text
    view = LiveView()
    view.apply(TextEvent(stream_id="s", seq=0, t=0.1, delta="**Hi**", token_ids=[7], index=0, offset=0,
                         logprobs=[{"token_id": 7, "token": "**Hi**", "bytes": list(b"**Hi**"), "logprob": -0.1,
                                    "top_logprobs": [{"token_id": 7, "token": "**Hi**", "logprob": -0.1},
                                                     {"token_id": 9, "token": "Yo", "logprob": -2.5}]}]))
    markup = confidence_html(view, markdown_safe=True)
    assert "**" not in markup and "&#42;&#42;Hi&#42;&#42;" in markup
    assert 'class="ms-alt ms-o0 ms-t9"' in markup  # the offset and token id survive as classes


async def test_throttled_views_say_where_a_queued_stream_stands_until_it_runs() -> None:
    import threading
    import time

    from multistream.stream import Stream

    go = threading.Event()
    box: list[Stream] = []

    def producer(w) -> None:  # type: ignore[no-untyped-def]
        go.wait(5)
        for place in [(2, 2), (1, 1)]:
            box[0].queue_position = place  # type: ignore[attr-defined]
            time.sleep(0.6)
        box[0].queue_position = None  # type: ignore[attr-defined]
        w.text("hi", [1], 0)
        w.finish_text("", [], 1, finish_reason="stop", text="hi", usage={"prompt_tokens": 1, "completion_tokens": 1},
                      metrics={})

    stream = Stream(producer, kind="text")
    stream.queue_position = None  # type: ignore[attr-defined]
    box.append(stream)
    go.set()
    notes = [view.queue_note() async for view in throttled_views(stream, max_fps=30)]
    assert notes[:2] == ["waiting: 1 ahead", "waiting: next in line"], notes
    assert notes[-1] == ""  # it ran: no queue any more
