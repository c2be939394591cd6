"""``Presence.gone`` on one process: peers on this host judged by ``/proc``, others by heartbeat.

A ``Presence`` of rank 0 over a ``HashStore``; rank 1's keys are written by hand, naming a
child process (``sleep``) as rank 1 on this host, or "elsewhere" for a peer on another
host. The cross-process behaviour is in test_process_checks.py and test_hybrid_gone.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from aiocoll._bridge import _presence
from aiocoll._bridge._presence import Presence, _stat

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


@pytest.fixture
def presence() -> Iterator[Presence]:
    p = Presence(dist.HashStore(), 0, object())  # type: ignore[arg-type]
    assert p.host is not None  # Linux: this host is known
    yield p
    p.stop()
    assert not p._thread.is_alive()  # stopped means gone: it does not outlive its job


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def _as_rank_1(presence: Presence, pid: int, start: int | None = None, beat: int = 1) -> None:
    """Write rank 1's keys as its own Presence would: process ``pid`` on this host."""
    stat = _stat(pid)
    assert stat is not None
    presence.store.set(presence._key("who", 1), f"{presence.host}|{pid}|{stat[1] if start is None else start}")
    presence.store.add(presence._key("beat", 1), beat)


def _wait_state(pid: int, state: str) -> None:
    """Until process ``pid`` is in ``state`` (a signal is delivered some time after it is sent)."""
    deadline = time.monotonic() + 5
    while (_stat(pid) or ("",))[0] != state:
        assert time.monotonic() < deadline, (pid, _stat(pid))
        time.sleep(0.01)


def _gone(presence: Presence) -> tuple[list[tuple[int, str]], float]:
    t0 = time.perf_counter()
    got = asyncio.run(presence.gone([1]))
    return got, time.perf_counter() - t0


def test_a_running_peer_on_this_host_is_never_named(presence: Presence, child: Any) -> None:
    _as_rank_1(presence, child.pid)  # its heartbeat never moves
    got, seconds = _gone(presence)
    assert got == []
    assert seconds < Presence.STOPPED  # /proc answered: nothing to wait for


def test_a_peer_whose_process_is_gone_is_named_at_once(presence: Presence, child: Any) -> None:
    _as_rank_1(presence, child.pid)
    child.kill()
    child.wait()  # reaped: no such process
    got, seconds = _gone(presence)
    assert got == [(1, f"died (pid {child.pid} on this host is gone)")]
    assert seconds < 0.5


def test_a_killed_peer_not_yet_reaped_is_named(presence: Presence, child: Any) -> None:
    _as_rank_1(presence, child.pid)
    child.send_signal(signal.SIGKILL)
    _wait_state(child.pid, "X")  # exiting, then a zombie (parse_stat says "X" for both)
    got, _ = _gone(presence)  # a zombie until its parent (this test) waits
    assert got == [(1, f"died (pid {child.pid} on this host is gone)")]


def test_a_reused_pid_is_a_process_gone(presence: Presence, child: Any) -> None:
    _as_rank_1(presence, child.pid, start=1)  # that pid now belongs to a later process
    got, _ = _gone(presence)
    assert got == [(1, f"died (pid {child.pid} on this host is gone)")]


def test_a_stopped_peer_is_named_once_it_stayed_stopped(presence: Presence, child: Any) -> None:
    _as_rank_1(presence, child.pid)
    child.send_signal(signal.SIGSTOP)
    _wait_state(child.pid, "T")
    got, seconds = _gone(presence)
    assert got == [(1, f"is stopped (pid {child.pid} on this host, by SIGSTOP or Ctrl-Z)")]
    assert Presence.STOPPED <= seconds < Presence.STOPPED + 0.5


def test_a_peer_resumed_in_time_is_not_named(presence: Presence, child: Any) -> None:
    _as_rank_1(presence, child.pid)
    child.send_signal(signal.SIGSTOP)
    _wait_state(child.pid, "T")

    async def look_and_resume() -> list[tuple[int, str]]:
        look = asyncio.ensure_future(presence.gone([1]))
        await asyncio.sleep(Presence.STOPPED / 3)
        child.send_signal(signal.SIGCONT)
        return await look

    assert asyncio.run(look_and_resume()) == []


def test_a_peer_that_left_is_named_whatever_its_state(presence: Presence) -> None:
    _as_rank_1(presence, os.getpid())  # running, but it said it leaves
    presence.store.add(presence._key("left", 1), 1)
    assert _gone(presence)[0] == [(1, "exited")]


def test_a_peer_elsewhere_is_named_when_its_heartbeat_stands_still(
    presence: Presence, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Presence, "STALE", 0.3)
    presence.store.set(presence._key("who", 1), "elsewhere")
    presence.store.add(presence._key("beat", 1), 1)
    got, seconds = _gone(presence)
    assert got == [(1, "stopped responding (no heartbeat for 0.3s)")]
    assert 0.3 <= seconds < 0.8


def test_a_peer_elsewhere_that_beats_is_not_named(presence: Presence, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Presence, "STALE", 0.3)
    presence.store.set(presence._key("who", 1), "elsewhere")

    async def look_while_beating() -> list[tuple[int, str]]:
        look = asyncio.ensure_future(presence.gone([1]))
        while not look.done():
            presence.store.add(presence._key("beat", 1), 1)
            await asyncio.sleep(0.05)
        return await look

    assert asyncio.run(look_while_beating()) == []


def test_a_peer_that_never_beat_is_not_named(presence: Presence) -> None:
    got, seconds = _gone(presence)  # no keys of rank 1 at all: it has not started
    assert got == []
    assert seconds < 0.5


def test_this_host_lookups_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Presence, "ON_THIS_HOST", False)
    p = Presence(dist.HashStore(), 0, object())  # type: ignore[arg-type]
    try:
        assert p.host is None
        assert bytes(p.store.get(p._key("who", 0))) == b"elsewhere"
    finally:
        p.stop()


def test_a_peer_hidden_from_proc_is_judged_by_its_heartbeat(
    presence: Presence, child: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # /proc mounted with hidepid: another user's process has no entry, yet it exists
    _as_rank_1(presence, child.pid)
    hidden = f"/proc/{child.pid}/stat"
    read = _presence.Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if str(self) == hidden:
            raise FileNotFoundError(hidden)
        return read(self, *args, **kwargs)

    monkeypatch.setattr(_presence.Path, "read_text", read_text)
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)  # exists, but not ours to signal
    monkeypatch.setattr(Presence, "STALE", 0.3)
    got, seconds = _gone(presence)
    assert got == [(1, "stopped responding (no heartbeat for 0.3s)")]
    assert seconds >= 0.3


def test_after_a_transport_failure_running_peers_are_looked_at_a_while(presence: Presence, child: Any) -> None:
    _as_rank_1(presence, child.pid)

    async def look_and_kill() -> tuple[list[tuple[int, str]], float]:
        t0 = time.perf_counter()
        look = asyncio.ensure_future(presence.gone([1], settle=2.0))
        await asyncio.sleep(0.3)
        assert not look.done()  # it runs, but the look goes on
        child.kill()
        return await look, time.perf_counter() - t0

    got, seconds = asyncio.run(look_and_kill())
    assert got == [(1, f"died (pid {child.pid} on this host is gone)")]
    assert seconds < 1.0


def test_a_settled_look_at_running_peers_ends_empty(presence: Presence, child: Any) -> None:
    _as_rank_1(presence, child.pid)
    t0 = time.perf_counter()
    assert asyncio.run(presence.gone([1], settle=0.3)) == []
    assert time.perf_counter() - t0 >= 0.3


def test_a_forked_child_that_exits_does_not_say_its_parent_left(
    presence: Presence, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a child made by fork inherits the atexit hook that says "left"
    monkeypatch.setattr(os, "getpid", lambda: presence._own_pid + 1)
    presence.leave()
    assert presence._read("left", 0) == 0
    monkeypatch.undo()
    presence.leave()  # the process itself, at its exit
    assert presence._read("left", 0) == 1
