"""The cyclic garbage collector held off while a model loads (`multistream._gc`), and the command
line's exit without the shutdown's walk over every object (`multistream.cli.entry`).

A warm ``load_text_model()`` spent about 1.0 s of 4.8 in some 1,100 collections of objects that
all live on; ``multistream text`` spent 1.1 s after its summary line in the interpreter's last
collections. The figures are in benchmarks/startup.py; these tests pin the mechanisms.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import tomllib

import multistream.cli as cli
from multistream._gc import paused_collector, pauses_collector

from repo_paths import ROOT


def _collections_during(block: Any) -> list[int]:
    seen: list[int] = []

    def count(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(count)
    try:
        block()
    finally:
        gc.callbacks.remove(count)
    return seen


def test_the_collector_is_off_during_the_block_and_back_after_it_even_on_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(OSError), paused_collector():
        assert not gc.isenabled()
        raise OSError("a load that failed")
    assert gc.isenabled()


def test_a_collector_the_caller_had_switched_off_stays_off() -> None:
    gc.disable()
    try:
        with paused_collector():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_loads_in_two_threads_share_one_pause_until_the_last_ends() -> None:
    first_in, second_done, states = threading.Event(), threading.Event(), []

    @pauses_collector
    def long_load() -> None:
        first_in.set()
        second_done.wait(10)
        states.append(("long, after the short one ended", gc.isenabled()))

    @pauses_collector
    def short_load() -> None:
        states.append(("short", gc.isenabled()))

    thread = threading.Thread(target=long_load)
    thread.start()
    first_in.wait(10)
    short_load()
    states.append(("between", gc.isenabled()))  # the long load still runs: still off
    second_done.set()
    thread.join(10)
    assert states == [("short", False), ("between", False), ("long, after the short one ended", False)]
    assert gc.isenabled()


@pytest.mark.model
def test_a_second_load_of_the_embedded_text_model_walks_no_heap() -> None:
    import multistream as ms

    ms.load_text_model()  # warm: its caches written, its libraries imported
    seen = _collections_during(ms.load_text_model)
    # On the old code: 104 collections, one of them a full walk of the heap (0.3 s and more in a
    # notebook). Now none during the load; it built little, so no full walk at its end either (a
    # first load in a fresh process leaves some 450,000 objects and gets its one full walk).
    assert len(seen) <= 2 and 2 not in seen, seen


def test_the_command_freezes_the_collector_before_the_process_exits_and_main_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    frozen_before = gc.get_freeze_count()
    assert cli.main([]) == 2 and gc.get_freeze_count() == frozen_before  # no command: the help, nothing frozen
    told: list[bool] = []
    monkeypatch.setattr(cli, "main", lambda argv=None, own_process=False: told.append(own_process) or 0)
    try:
        assert cli.entry() == 0 and told == [True]  # its commands may end their load's pause with a freeze
        assert gc.get_freeze_count() > frozen_before
    finally:
        gc.unfreeze()  # this test process goes on: its objects are collectable again
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["multistream"] == "multistream.cli:entry"
    for module in ("multistream/__main__.py", "multistream/cli/__main__.py"):
        assert "sys.exit(entry())" in (ROOT / module).read_text(), module


def test_the_servers_model_loads_share_one_pause_and_the_collector_is_back_once_they_settled() -> None:
    from multistream.testing import ScriptedImageModel, ScriptedTextModel

    from server_fixtures import make_server, wait_until

    seen: dict[str, bool] = {}

    def text_factory() -> Any:  # loaded first (the server loads one model at a time)
        seen["text load"] = gc.isenabled()
        return ScriptedTextModel(["a"])

    def image_factory() -> Any:
        seen["image load"] = gc.isenabled()  # the text load has ended: the pause goes on for this one
        return ScriptedImageModel()

    with make_server(text_factory, image_factory) as srv:
        import httpx

        wait_until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, what="the models to load")
        wait_until(gc.isenabled, what="the collector to come back")
    assert seen == {"text load": False, "image load": False}


def test_a_commands_model_load_ends_its_pause_with_a_freeze_only_when_the_command_is_the_process() -> None:
    from multistream._gc import BACKLOG
    from multistream.cli import _console

    frozen = gc.get_freeze_count()
    built: list[Any] = []
    # main() called from Python: the caller's collector, walked once
    with _console.model_loading("a model", own_process=False, libraries=("transformers",)):
        assert not gc.isenabled()
        built.extend([i] for i in range(BACKLOG + 1000))  # what a load builds
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    try:
        with _console.model_loading("a model", own_process=True, libraries=("transformers",)):  # cli.entry
            assert not gc.isenabled()
            built.extend([i] for i in range(BACKLOG + 1000))
        assert gc.isenabled() and gc.get_freeze_count() > frozen  # set aside, never walked
    finally:
        gc.unfreeze()


def test_a_pause_that_built_little_ends_without_a_collection_and_a_big_one_with_one() -> None:
    from multistream import _gc

    gc.collect()
    kept: list[Any] = []

    def small() -> None:  # a model object passed in, an argument refused: no full walk of a big heap
        with paused_collector():
            kept.extend([i] for i in range(1000))

    def big() -> None:
        with paused_collector():
            kept.extend([i] for i in range(_gc.BACKLOG + 1000))

    assert 2 not in _collections_during(small)  # the young objects only, as the collector would anyway
    assert _collections_during(big)[:1] == [2]  # one full walk first, not a young one of the whole backlog
    kept.clear()


def test_the_servers_shared_pause_ends_at_its_limit_when_a_load_never_settles() -> None:
    from multistream._gc import paused, paused_until

    from server_fixtures import wait_until

    never = threading.Event()
    paused_until([never], limit_s=0.2)  # a stalled download, a factory that never returns
    assert paused() and not gc.isenabled()
    wait_until(lambda: not paused(), timeout=10, what="the pause to end at its limit")
    assert gc.isenabled()


def test_serve_leaves_logging_someone_configured_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from multistream.server import runner

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's own handlers sit on the root
    assert not runner._logging_configured()
    with runner._multistream_log_like_uvicorns("info"):
        assert len(logging.getLogger("multistream").handlers) == 1
        with runner._multistream_log_like_uvicorns("info"):  # a second server in the process shares it
            assert len(logging.getLogger("multistream").handlers) == 1
        assert len(logging.getLogger("multistream").handlers) == 1  # the first server still runs
    assert logging.getLogger("multistream").handlers == []
    child = logging.getLogger("multistream.server")
    monkeypatch.setattr(child, "handlers", [logging.NullHandler()])  # the operator's own handler
    assert runner._logging_configured()
    with runner._multistream_log_like_uvicorns("info"):
        assert logging.getLogger("multistream").handlers == []  # no second copy of each line
