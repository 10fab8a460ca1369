"""The README's examples, run as a newcomer runs them: in a fresh venv made with the README's first
set-up only (``./scripts/setup.sh``, no ``--test``), so an import the test tools bring in by chance
cannot hide a missing dependency.

What it runs, in order (each step is timed and listed at the end):

1. ``python -m venv`` (pip's wheel cache is reused as pip always does), then the README's first bash
   line as it stands: ``./scripts/setup.sh && multistream text "Write a haiku about rivers"``;
2. every ```python block of the README in one namespace, in order (as a reader pastes them into one
   session), then the python blocks of ``docs/*.md`` in that namespace too;
3. every ``multistream ...`` command of the README's bash blocks: ``serve`` until ``/readyz`` is 200,
   then one SSE text stream, one SSE image stream, the web client at ``/`` and the Gradio demo page
   at ``/demo/``; ``demo`` until its page is served; ``text`` as it is;
4. the image command under the README's picture (``--strip``, into a scratch folder) and the
   ``--out DIR`` form the Images section shows; ``video`` lines in a scratch folder, checking the
   files their ``--out``, ``--sheet`` and ``--previews`` name.

A block preceded by ``<!-- readme-check: skip (why) -->`` is not run (and is listed as skipped). A bash
line this script does not know how to run fails it, so a new command in the README gets a check.

Usage:
    python scripts/check_readme.py                 # a temporary venv, removed at the end
    python scripts/check_readme.py --venv DIR      # build (or reuse) DIR; kept
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"<!--\s*readme-check:\s*skip\b(.*?)-->")


@dataclass
class Block:
    source: str  # "README.md:32"
    lang: str
    code: str
    skip: str | None = None


@dataclass
class Report:
    steps: list[tuple[str, float, str]] = field(default_factory=list)

    def add(self, name: str, started: float, result: str = "ok") -> None:
        self.steps.append((name, time.monotonic() - started, result))
        print(f"[check_readme] {result:>7}  {time.monotonic() - started:6.1f}s  {name}", flush=True)


def blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        before = "\n".join(lines[max(0, start - 2):start])
        skip = SKIP.search(before)
        yield Block(f"{path.relative_to(ROOT)}:{start + 1}", lang, "\n".join(lines[start + 1:j]) + "\n",
                    (skip.group(1).strip(" ()") or "marked") if skip else None)
        i = j + 1


def caption_commands(path: Path) -> list[str]:
    """`multistream image ...` spans in the README's prose that are complete commands (no placeholders)."""
    text = " ".join(path.read_text(encoding="utf-8").split())
    return [c for c in re.findall(r"`(multistream image [^`]+)`", text) if "DIR" not in c]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Runner:
    def __init__(self, venv: Path, work: Path, report: Report, fresh_cache: bool = False) -> None:
        self.venv, self.work, self.report = venv, work, report
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.env.update(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(venv),
                        PYTHONUNBUFFERED="1")
        if fresh_cache:  # a newcomer's first run converts the embedded model (minutes on 2 cores)
            self.env["MULTISTREAM_CACHE"] = str(work / "cache")
        self.python = str(venv / "bin" / "python")

    def sh(self, command: str, *, cwd: Path, timeout: float) -> str:
        proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise SystemExit(f"check_readme: `{command}` exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
        return proc.stdout + proc.stderr

    # -- the steps --------------------------------------------------------------------------------

    def setup(self, line: str) -> None:
        started = time.monotonic()
        out = self.sh(line, cwd=ROOT, timeout=900)
        haiku = out.strip()
        if not haiku:
            raise SystemExit(f"check_readme: `{line}` printed nothing")
        where = subprocess.run([self.python, "-c", "import multistream; print(multistream.__file__)"], cwd=self.work,
                               env=self.env, capture_output=True, text=True, timeout=120).stdout.strip()
        if not where.startswith(str(ROOT)):
            raise SystemExit(f"check_readme: the venv imports multistream from {where!r}, not from {ROOT}")
        self.report.add(line, started)

    def python_blocks(self, found: list[Block]) -> None:
        runnable = [b for b in found if b.skip is None]
        for b in found:
            if b.skip is not None:
                self.report.steps.append((f"python block {b.source}", 0.0, "skipped"))
                print(f"[check_readme] skipped  {b.source}: {b.skip}", flush=True)
        script = self.work / "readme_blocks.py"
        script.write_text(
            "import sys, time\nns = {'__name__': '__main__'}\n"
            f"blocks = {[(b.source, b.code) for b in runnable]!r}\n"
            "for source, code in blocks:\n"
            "    t0 = time.monotonic()\n"
            "    print(f'--- {source}', flush=True)\n"
            "    exec(compile(code, source, 'exec'), ns)\n"
            "    print(f'\\n[block ok] {time.monotonic() - t0:.1f}s {source}', flush=True)\n", encoding="utf-8")
        started = time.monotonic()
        cwd = self.work / "blocks"
        cwd.mkdir(exist_ok=True)
        out = self.sh(f"{shlex.quote(self.python)} {shlex.quote(str(script))}", cwd=cwd, timeout=600)
        for b in runnable:
            if "[block ok]" not in out or f"--- {b.source}" not in out:
                raise SystemExit(f"check_readme: block {b.source} did not run\n{out[-3000:]}")
        if not (cwd / "final.png").is_file():
            raise SystemExit("check_readme: the 30 seconds block did not save final.png")
        self.report.add(f"{len(runnable)} python blocks in one session: " + ", ".join(b.source for b in runnable),
                        started)

    def image_command(self, command: str) -> None:
        started = time.monotonic()
        args = shlex.split(command)
        if "--strip" in args:
            at = args.index("--strip") + 1
            target = self.work / "strip" / Path(args[at]).name
            target.parent.mkdir(exist_ok=True)
            args[at] = str(target)
        elif "--out" in args:
            at = args.index("--out") + 1
            target = self.work / "out"
            args[at] = str(target)
        else:
            raise SystemExit(f"check_readme: an image command without --strip or --out: {command}")
        self.sh(shlex.join(args), cwd=self.work, timeout=300)
        if "--strip" in args and not target.is_file():
            raise SystemExit(f"check_readme: `{command}` wrote no {target}")
        if "--out" in args and not (target / "final.png").is_file():
            raise SystemExit(f"check_readme: `{command}` wrote no final.png in {target}")
        self.report.add(command, started)

    def video_command(self, command: str) -> None:
        """A ``multistream video`` line: run in a scratch folder; each file it names must be written
        (the clip decodes to frames, the sheet and the preview folder exist)."""
        started = time.monotonic()
        args = shlex.split(command)
        scratch = self.work / "video"
        scratch.mkdir(exist_ok=True)
        self.sh(shlex.join(args), cwd=scratch, timeout=600)
        for flag in ("--out", "--sheet", "--previews"):
            if flag in args:
                target = scratch / args[args.index(flag) + 1]
                if not (target.is_dir() and any(target.iterdir())) and not (target.is_file() and target.stat().st_size):
                    raise SystemExit(f"check_readme: `{command}` wrote nothing at {flag} {target}")
        self.report.add(command, started)

    def serve(self, command: str) -> None:
        started = time.monotonic()
        port = free_port()
        args = shlex.split(command)
        if "--port" in args:
            args[args.index("--port") + 1] = str(port)
        else:
            args += ["--port", str(port)]
        url = f"http://127.0.0.1:{port}"
        with self.background(args) as proc:
            self.wait_for(url + "/readyz", proc, timeout=300)
            text = sse(url + "/v1/text", {"prompt": "Write a haiku about rivers", "max_new_tokens": 16})
            if not text[-1].get("is_final") or text[-1]["type"] != "text" or not text[-1]["text"]:
                raise SystemExit(f"check_readme: the SSE text stream did not end with a final text: {text[-1]}")
            image = sse(url + "/v1/image", {"prompt": "a red circle on a blue background", "steps": 4, "seed": 0})
            if not image[-1].get("is_final") or image[-1]["type"] != "image" or len(image) < 2:
                raise SystemExit(f"check_readme: the SSE image stream had no previews and final: {image[-1]}")
            for path, needle in (("/", "<html"), ("/demo/", "gradio")):
                body = get(url + path)
                if needle not in body.lower():
                    raise SystemExit(f"check_readme: {path} of `{command}` is not the page ({body[:200]!r})")
        self.report.add(f"{command} (ready, 1 SSE text stream of {len(text)} events, 1 SSE image stream of "
                        f"{len(image)} events, / and /demo/ served)", started)

    def demo(self, command: str) -> None:
        started = time.monotonic()
        port = free_port()
        args = shlex.split(command) + ["--port", str(port)]
        with self.background(args) as proc:
            url = f"http://127.0.0.1:{port}/"
            self.wait_for(url, proc, timeout=300)
            if "gradio" not in get(url).lower():
                raise SystemExit(f"check_readme: `{command}` does not serve the Gradio page")
        self.report.add(f"{command} (page served)", started)

    def text(self, command: str) -> None:
        started = time.monotonic()
        if not self.sh(command, cwd=self.work, timeout=300).strip():
            raise SystemExit(f"check_readme: `{command}` printed nothing")
        self.report.add(command, started)

    # -- helpers ----------------------------------------------------------------------------------

    class _Background:
        def __init__(self, runner: Runner, args: list[str]) -> None:
            self.log = open(runner.work / f"{args[1]}-{time.monotonic_ns()}.log", "w+b")  # noqa: SIM115
            self.proc = subprocess.Popen(args, cwd=runner.work, env=runner.env, stdout=self.log,
                                         stderr=subprocess.STDOUT)

        def __enter__(self) -> subprocess.Popen[bytes]:
            return self.proc

        def __exit__(self, *exc: Any) -> None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            if exc[0] is not None:
                self.log.seek(0)
                print(self.log.read().decode(errors="replace")[-4000:], file=sys.stderr)
            self.log.close()

    def background(self, args: list[str]) -> Runner._Background:
        return Runner._Background(self, args)

    def wait_for(self, url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"check_readme: the process for {url} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"check_readme: {url} did not answer 200 within {timeout:.0f}s")
            time.sleep(0.5)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode(errors="replace")


def sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    events = []
    with urllib.request.urlopen(request, timeout=300) as r:
        for raw in r:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("data:"):
                events.append(json.loads(line[5:].strip()))
    if not events:
        raise SystemExit(f"check_readme: {url} streamed no events")
    return events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=None, help="the venv to build or reuse (default: a temporary one)")
    parser.add_argument("--fresh-cache", action="store_true",
                        help="an empty MULTISTREAM_CACHE (the embedded model converted again; default: the user's "
                        "cache, which the test suite has filled)")
    parser.add_argument("--skip-setup", action="store_true",
                        help="with --venv: do not run the set-up line again (only its `multistream text`)")
    args = parser.parse_args(argv)
    report = Report()
    total = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="multistream-readme-") as tmp:
        work = Path(tmp)
        venv = args.venv.resolve() if args.venv else work / "venv"
        started = time.monotonic()
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        report.add(f"python -m venv {venv if args.venv else '<tmp>/venv'}", started)
        runner = Runner(venv, work, report, fresh_cache=args.fresh_cache)

        readme = list(blocks(ROOT / "README.md"))
        docs = [b for p in sorted((ROOT / "docs").glob("*.md")) for b in blocks(p)]
        commands: list[tuple[str, str]] = []
        setup_line = None
        for b in readme:
            if b.lang != "bash" or b.skip is not None:
                continue
            for line in b.code.splitlines():
                line = line.split("  #", 1)[0].strip()
                if not line:
                    continue
                if line.startswith("./scripts/setup.sh --test"):
                    continue  # the README's test command: what .ci/run runs around this script
                if line.startswith("./scripts/setup.sh && "):
                    setup_line = line
                elif line.startswith("multistream "):
                    commands.append((line.split()[1], line))
                else:
                    raise SystemExit(f"check_readme: {b.source}: no check for `{line}`; add one")
        if setup_line is None:
            raise SystemExit("check_readme: the README's first set-up line (./scripts/setup.sh && ...) is gone")
        if args.skip_setup and args.venv:
            setup_line = setup_line.split("&&", 1)[1].strip()
        runner.setup(setup_line)
        runner.python_blocks([b for b in readme + docs if b.lang == "python"])
        checks = {"serve": runner.serve, "demo": runner.demo, "text": runner.text, "image": runner.image_command,
                  "video": runner.video_command}
        for kind, command in commands:
            if kind not in checks:
                raise SystemExit(f"check_readme: no check for `{command}`; add one")
            checks[kind](command)
        for command in caption_commands(ROOT / "README.md"):
            runner.image_command(command)
        runner.image_command('multistream image "a red circle on a blue background" --steps 8 --seed 0 --out DIR')
    report.add("total", total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
