"""Headless Chromium as the browser tests launch it: Debian's ``chromium`` with the flags a
container needs (no sandbox, no GPU, no background traffic).

Example:
    >>> from browser_fixtures import CHROME_ARGS, CHROMIUM
    >>> CHROMIUM
    '/usr/bin/chromium'
"""

from __future__ import annotations

CHROMIUM = "/usr/bin/chromium"
BROWSER_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
CHROME_ARGS = BROWSER_FLAGS  # the launch arguments of a test that adds none of its own
