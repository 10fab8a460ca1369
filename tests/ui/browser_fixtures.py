"""Headless Chromium as the browser tests launch it: Debian's ``chromium`` with the flags a
container needs (no sandbox, no GPU, no background traffic).

Example:
    >>> from browser_fixtures import CHROME_ARGS, CHROMIUM
    >>> CHROMIUM
    '/usr/bin/chromium'
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from repo_paths import ARTIFACTS

CHROMIUM = "/usr/bin/chromium"
BROWSER_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
CHROME_ARGS = BROWSER_FLAGS  # the launch arguments of a test that adds none of its own


@contextlib.contextmanager
def demo_in_chromium(demo: Any, *, height: int = 900, timeout_ms: int = 120_000,
                     args: list[str] | None = None) -> Iterator[Any]:
    """``demo`` (a Gradio app) launched on a free loopback port and open at ``/`` in headless
    Chromium: the Playwright page; the browser and the demo are closed after. Skips where Chromium
    or Playwright is missing.

    Example:
        >>> with demo_in_chromium(create_demo(llm, sd)) as pg:  # doctest: +SKIP
        ...     pg.wait_for_selector("#ms-chat-input textarea")
    """
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    sync_api = pytest.importorskip("playwright.sync_api")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=args or CHROME_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": height})
                page.set_default_timeout(timeout_ms)
                page.goto(f"http://127.0.0.1:{port}/")
                yield page
            finally:
                browser.close()
    finally:
        demo.close()
