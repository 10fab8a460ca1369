"""How many preview updates per second reach the browser, and how large each frame is.

Starts the demo in-process, opens the Image tab in headless Chromium, watches the preview <img>
with a MutationObserver and counts each different frame it shows during a 20-step image.

    python benchmarks/demo_frames.py                 # the default image model (or a scripted one)
    python benchmarks/demo_frames.py --scripted --delay 0.01 --steps 100   # a fast producer
    python benchmarks/demo_frames.py --max-fps 1000   # no throttle, to see what it protects
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

OBSERVE = """(sel) => {
  window.__frames = [];
  const root = document.querySelector(sel);
  let last = null;
  const look = () => {
    const img = root.querySelector('img.ms-frame');
    if (img && img.src !== last) {
      last = img.src;
      const b64 = img.src.slice(img.src.indexOf(',') + 1);
      window.__frames.push({t: performance.now(), bytes: Math.floor(b64.length * 3 / 4), png: img.src.startsWith('data:image/png')});
    }
  };
  if (window.__obs) window.__obs.disconnect();
  window.__obs = new MutationObserver(look);
  window.__obs.observe(root, {subtree: true, childList: true, attributes: true});
}"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-fps", type=float, default=15.0, help="the demo's throttle")
    ap.add_argument("--quality", type=int, default=75)
    ap.add_argument("--scripted", action="store_true", help="use the scripted image model")
    ap.add_argument("--delay", type=float, default=0.05, help="scripted model: seconds per step")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    from multistream.ui.demo import create_demo
    from multistream.testing import ScriptedImageModel, ScriptedTextModel

    model = None
    if not args.scripted:
        try:
            import multistream as ms

            model = ms.load_image_model()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001
            print(f"(default image model unavailable: {exc}; using the scripted one)")
    if model is None:
        model = ScriptedImageModel(steps=args.steps, size=64, delay_s=args.delay)
    print(f"image model: {getattr(model, 'name', model)}; steps={args.steps}; max_fps={args.max_fps}")
    demo = create_demo(ScriptedTextModel(), model, max_fps=args.max_fps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path="/usr/bin/chromium", headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
            )
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.set_default_timeout(120_000)
            page.goto(f"http://127.0.0.1:{port}/")
            page.get_by_role("tab", name="Image").click()
            page.wait_for_selector("#ms-image-go")
            box = page.locator("#ms-image-steps input[type=number]")
            box.fill(str(args.steps))
            box.press("Enter")
            page.get_by_text("Preview frames", exact=True).click()
            for run in range(args.runs):
                page.evaluate(OBSERVE, "#ms-image-preview")
                t0 = time.perf_counter()
                page.click("#ms-image-go")
                while page.inner_text("#ms-image-preview .ms-step").startswith("stop"):
                    time.sleep(0.005)  # the previous run's final is still shown
                while not page.inner_text("#ms-image-preview .ms-step").startswith("stop"):
                    time.sleep(0.01)
                wall = time.perf_counter() - t0
                page.wait_for_timeout(200)
                frames = page.evaluate("window.__frames")
                previews = [f for f in frames if not f["png"]]
                finals = [f for f in frames if f["png"]]
                span = (previews[-1]["t"] - previews[0]["t"]) / 1000 if len(previews) > 1 else 0.0
                fps = (len(previews) - 1) / span if span > 0 else float("nan")
                print(
                    f"run {run}: {len(previews)} preview frames reached the page for {args.steps} steps in "
                    f"{wall:.2f} s (click to final) -> {fps:.1f} preview updates/s while previewing; "
                    f"preview bytes/frame median {statistics.median(f['bytes'] for f in previews) if previews else 0:.0f} "
                    f"(max {max((f['bytes'] for f in previews), default=0)}); final PNG {finals[-1]['bytes'] if finals else 0} bytes"
                )
            browser.close()
    finally:
        demo.close()


if __name__ == "__main__":
    main()
