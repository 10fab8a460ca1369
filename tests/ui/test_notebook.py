"""ms.show(): live rendering in Jupyter (display handle updates) and plain printing elsewhere."""

from __future__ import annotations

import io
import time

import pytest

import multistream as ms
from multistream.events import ImageEvent, TextEvent
from multistream.testing import ScriptedImageModel, ScriptedTextModel
from multistream.ui.view import LiveView


def test_show_text_in_jupyter_grows_then_shows_metrics(fake_jupyter: list[str]) -> None:
    llm = ScriptedTextModel(["Hello", ",", " <world>"], delay_s=0.05)
    final = ms.show(llm.stream("hi"), max_fps=1000)
    assert isinstance(final, TextEvent) and final.is_final and final.text == "Hello, <world>"
    assert len(fake_jupyter) >= 4  # the first display, a few updates, the final
    assert "Hello" in fake_jupyter[2] and "&lt;world&gt;" in fake_jupyter[-1]  # HTML-escaped
    assert "tokens/s" in fake_jupyter[-1] and "streaming" not in fake_jupyter[-1]


def test_show_image_replaces_frames_and_ends_with_final(fake_jupyter: list[str]) -> None:
    sd = ScriptedImageModel(steps=6, size=16, delay_s=0.03)
    final = ms.show(sd.stream("a red circle"), max_fps=1000)
    assert isinstance(final, ImageEvent) and final.mime == "image/png"
    previews = [h for h in fake_jupyter if "data:image/jpeg;base64," in h]
    assert len(previews) >= 3
    assert all(h.count("<img") == 1 for h in fake_jupyter[1:])  # replaced in place, not appended
    assert "data:image/png;base64," in fake_jupyter[-1] and "6/6 steps" in fake_jupyter[-1]


def test_show_throttles_updates_but_always_shows_final(fake_jupyter: list[str]) -> None:
    llm = ScriptedTextModel([f"t{i} " for i in range(200)], delay_s=0.002)
    final = ms.show(llm.stream("hi", max_new_tokens=200), max_fps=5)
    # ~0.4 s or more of streaming at 5 updates/s: far fewer updates than the 200 tokens.
    assert len(fake_jupyter) < 60
    assert final.text in fake_jupyter[-1].replace("&#x27;", "'")


def test_show_composed_stream_in_jupyter(fake_jupyter: list[str]) -> None:
    llm, sd = ScriptedTextModel(["a red circle"]), ScriptedImageModel(steps=3, size=16, delay_s=0.02)
    final = ms.show(ms.chain(llm.stream("x"), lambda f: sd.stream(f.text, steps=3)), max_fps=1000)
    assert isinstance(final, ImageEvent) and final.is_final
    assert "a red circle" in fake_jupyter[-1] and "data:image/png" in fake_jupyter[-1]


def test_show_prints_outside_jupyter() -> None:
    out = io.StringIO()
    llm, sd = ScriptedTextModel(["a", "b", "c"]), ScriptedImageModel(steps=3, size=16)
    final = ms.show(ms.chain(llm.stream("x"), lambda f: sd.stream("p", steps=3)), file=out)
    text = out.getvalue()
    assert text.startswith("abc\n[done") and "[image 0: done · 16x16 · 3/3 steps" in text
    assert final.is_final


def test_show_error_is_returned_and_printed() -> None:
    out = io.StringIO()
    final = ms.show(ScriptedTextModel(["a", "b"], fail_after=1).stream("x"), file=out)
    assert final.type == "error" and "scripted failure" in out.getvalue()


def test_show_interrupt_cancels_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = ScriptedTextModel(delay_s=0.01)
    stream = llm.stream("x", max_new_tokens=10_000)

    class Boom(io.StringIO):
        def write(self, s: str) -> int:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ms.show(stream, file=Boom())
    deadline = time.monotonic() + 10
    while llm.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.finish_reasons == ["cancelled"]


def test_show_bad_arguments() -> None:
    with pytest.raises(ms.InvalidArgumentError, match="max_fps"):
        ms.show(ScriptedTextModel().stream("x"), max_fps=0)
    with pytest.raises(ms.InvalidArgumentError, match="Stream"):
        ms.show(42)  # type: ignore[arg-type]


def _text_events(*items: tuple[str, int, int], final_text: str) -> list[TextEvent]:
    evs = [TextEvent(stream_id="s", seq=i, t=0.01 * i, delta=d, token_ids=[], index=i, offset=o, revision=r)
           for i, (d, o, r) in enumerate(items)]
    n = len(evs)
    evs.append(TextEvent(stream_id="s", seq=n, t=0.01 * n, delta="", token_ids=[], index=n, offset=len(final_text),
                         revision=items[-1][2], is_final=True, finish_reason="stop", text=final_text,
                         usage={"prompt_tokens": 1, "completion_tokens": n},
                         revisions=[{"kind": "rewind", "step": 2, "offset": 6, "instruction": None}]))
    return evs


REWOUND = _text_events(("Hello ", 0, 0), ("world😀", 6, 0), ("there", 6, 1), ("!", 11, 1), final_text="Hello there!")


def test_show_redraws_a_rewind_in_place(fake_jupyter: list[str]) -> None:
    final = ms.show(iter(REWOUND), max_fps=1e9)
    assert final.text == "Hello there!"
    assert any("Hello world😀" in h for h in fake_jupyter[:-1]) and "world" not in fake_jupyter[-1]
    assert "Hello there!" in fake_jupyter[-1] and "revision 1" in fake_jupyter[-1]
    live = [h for h in fake_jupyter[:-1] if "there" in h]
    assert live and all("revision 1" in h for h in live)  # the live view says it is on revision 1 too


def test_view_follows_offsets_across_composed_parts() -> None:
    view = LiveView()
    for ev in REWOUND:
        view.apply(ev)
    assert view.text(0) == "Hello there!" and view.revision == 1
    # A second text part (a composed stream): its offsets count over the whole stream.
    view.apply(TextEvent(stream_id="s", seq=9, t=1.0, delta="ab", token_ids=[], index=0, offset=12))
    view.apply(TextEvent(stream_id="s", seq=10, t=1.1, delta="c", token_ids=[], index=0, offset=13, revision=2))
    assert view.text(0) == "Hello there!" and view.text(1) == "ac"


def test_show_prints_a_rewind_outside_jupyter() -> None:
    out = io.StringIO()
    ms.show(iter(REWOUND), file=out, max_fps=1e9)
    printed = out.getvalue()
    assert printed.startswith("Hello world😀")
    assert "[revision 1: from character 6]\nthere!" in printed


def test_show_scripted_rewind_ends_with_the_final_text(fake_jupyter: list[str]) -> None:
    llm = ScriptedTextModel(["ab", "cd", "ef", "gh"], delay_s=0.05)
    s = llm.stream("x")
    seen: list[TextEvent] = []

    def events():  # rewind after the second event, as a user would mid-stream
        for ev in s:
            seen.append(ev)
            if len(seen) == 2:
                s.rewind(1)
            yield ev

    final = ms.show(events(), max_fps=1000)
    assert final.text.startswith("a") and final.revision == 1
    assert html_text(fake_jupyter[-1]).startswith(final.text)


def html_text(block: str) -> str:
    import re

    body = re.search(r"<pre[^>]*>(.*?)</pre>", block, re.S)
    assert body is not None
    return body.group(1)
