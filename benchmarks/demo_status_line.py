"""The demo's chat status line, as a user sees it in a browser: one answer per mode, screenshots.

Starts the Gradio demo (``create_demo``) on the embedded text model loaded with each
``--quantize`` mode in turn, asks the same question in headless Chromium, and prints the status
line the page shows (TTFT, tokens/s); the page is saved as ``artifacts/demo_status_<mode>.png``.
The browser shares the machine's cores with the model, as it does for a user on a laptop.

    python benchmarks/demo_status_line.py [--modes auto none] [--tokens 96]
"""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import multistream as ms
from multistream.testing import ScriptedImageModel
from multistream.ui.demo import create_demo

CHROMIUM = "/usr/bin/chromium"
CHROME_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
QUESTION = "Write a long, detailed story about a lighthouse keeper and the sea."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status_line(mode: str, tokens: int) -> str:
    from playwright.sync_api import sync_playwright

    llm = ms.load_text_model(quantize=mode)
    demo = create_demo(llm, ScriptedImageModel(steps=2, size=32), prompt_style="shapes")
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, headless=True)
            pg = browser.new_page(viewport={"width": 1280, "height": 860})
            pg.set_default_timeout(120_000)
            pg.goto(f"http://127.0.0.1:{port}/")
            pg.wait_for_selector("#ms-chat-input textarea")
            pg.get_by_text("Sampling").click()
            for elem_id, value in (("ms-chat-max-tokens", tokens), ("ms-chat-temperature", 0)):
                box = pg.locator(f"#{elem_id} input[type=number]")
                box.fill(str(value))
                box.press("Enter")
            pg.fill("#ms-chat-input textarea", QUESTION)
            pg.click("#ms-chat-send")
            deadline = time.monotonic() + 300
            line = ""
            while time.monotonic() < deadline:
                line = str(pg.inner_text("#ms-chat-stats"))
                if line.startswith(("stop", "length")):
                    break
                time.sleep(0.1)
            ARTIFACTS.mkdir(exist_ok=True)
            pg.screenshot(path=str(ARTIFACTS / f"demo_status_{mode}.png"))
            browser.close()
    finally:
        demo.close()
        llm.close()
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="*", default=["auto", "none"], help="quantize= values (auto: the default)")
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    for mode in args.modes:
        print(f"quantize={mode!r}: {status_line(mode, args.tokens)}", flush=True)


if __name__ == "__main__":
    main()
