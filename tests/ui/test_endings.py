"""How a finished stream is worded for people: the demo, the notebook and the web client say the same."""

from __future__ import annotations

import re

from multistream.events import AUDIO_FINISH_REASONS, IMAGE_FINISH_REASONS, TEXT_FINISH_REASONS, VIDEO_FINISH_REASONS
from multistream.ui.view import ending_words

from repo_paths import ROOT

REASONS = set(TEXT_FINISH_REASONS) | set(IMAGE_FINISH_REASONS) | set(AUDIO_FINISH_REASONS) | set(VIDEO_FINISH_REASONS)


def _web_client_endings() -> dict[str, str]:
    script = (ROOT / "multistream" / "static" / "app.js").read_text()
    table = re.search(r"const ENDINGS = \{(.*?)\};", script, re.S)
    assert table, "app.js has no ENDINGS table"
    return dict(re.findall(r'(\w+): "([^"]*)"', table.group(1)))


def test_every_finish_reason_has_words_and_a_finished_run_reads_done() -> None:
    # A bare "stop" in a status line read as "stopped" for a clip that had finished (the demo's Video tab).
    assert ending_words("stop") == "done"
    assert ending_words("cancelled") == "cancelled"
    assert all(ending_words(r) != r or r == "cancelled" for r in REASONS), {r: ending_words(r) for r in REASONS}


def test_the_web_client_uses_the_same_words() -> None:
    web = _web_client_endings()
    assert set(web) == REASONS
    assert {r: ending_words(r) for r in REASONS} == web
