"""The registry of every change aiocoll makes to the process (``aiocoll._patches``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aiocoll import _patches
from aiocoll._patches import Attr, Item, PatchSet, Step

TESTS = Path(__file__).resolve().parents[1]  # tests/: _every_entry.py, and the repository above


def _box() -> types.SimpleNamespace:
    return types.SimpleNamespace(a=1, b="b")


def test_the_first_lease_installs_and_the_last_undoes() -> None:
    box = _box()
    s = PatchSet("t: counted", "a test's", lambda key: [Attr(box, "a", 2)], ["*"])
    _patches.acquire(s)
    _patches.acquire(s)
    assert box.a == 2
    assert [(i.name, i.leases) for i in _patches.installed() if i.name == s.name] == [(s.name, 2)]
    _patches.release(s)
    assert box.a == 2  # one lease still holds it
    _patches.release(s)
    assert box.a == 1
    assert all(i.name != s.name for i in _patches.installed())


def _stepper(order: list[str]) -> Callable[[str], Step]:
    """Makes steps that write their doing and undoing into ``order``."""

    def step(name: str) -> Step:
        def do() -> Any:
            order.append(f"do {name}")
            return lambda: order.append(f"undo {name}")

        return Step(name, do)

    return step


def test_changes_are_undone_in_reverse_order_and_a_missing_attribute_goes_again() -> None:
    box, order = _box(), []
    step = _stepper(order)

    s = PatchSet("t: order", "a test's", lambda key: [step("x"), Attr(box, "new", 3), step("y")], ["*"])
    with _patches.lease(s):
        assert box.new == 3
    assert not hasattr(box, "new")
    assert order == ["do x", "do y", "undo y", "undo x"]


def test_one_set_per_key_and_items_of_a_mapping() -> None:
    table: dict[str, object] = {"k": "theirs"}
    s = PatchSet("t: keyed", "a test's", lambda key: [Item(table, "k", key, "table")], ["table['k']"], per="run")
    with _patches.lease(s, "one"):
        assert table["k"] == "one"
        with _patches.lease(s, "two"):  # (another key: its own install, over the first)
            inner = table["k"]
        outer = table["k"]
    assert (inner, outer) == ("two", "one")
    assert table == {"k": "theirs"}


def test_a_replacement_someone_patched_over_is_left_in_place_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    box = types.SimpleNamespace(over=1, b="b")
    s = PatchSet("t: theirs over ours", "a test's", lambda key: [Attr(box, "over", 2), Attr(box, "b", "ours")], ["*"])
    with caplog.at_level(logging.WARNING, logger="aiocoll"):
        for _ in range(2):
            with _patches.lease(s):
                box.over = 99  # someone else's, over aiocoll's
            assert box.over == 99  # theirs stays
            assert box.b == "b"  # what was still aiocoll's goes back
            box.over = 1
    said = [r.getMessage() for r in caplog.records if "<SimpleNamespace>.over" in r.getMessage()]
    assert len(said) == 1, said
    assert "replaced by 99 while aiocoll's was in force; left in place" in said[0]


def test_a_set_leases_what_it_needs_first_and_releases_it_after() -> None:
    box, order = _box(), []
    step = _stepper(order)

    base = PatchSet("t: base", "a test's", lambda key: [step("base")], ["*"])
    top = PatchSet("t: top", "a test's", lambda key: [step("top"), Attr(box, "a", 2)], ["*"], needs=(base,))
    with _patches.lease(base), _patches.lease(top):
        leases = {i.name: i.leases for i in _patches.installed() if i.name.startswith("t: ")}
    assert leases == {"t: base": 2, "t: top": 1}
    assert order == ["do base", "do top", "undo top", "undo base"]
    assert box.a == 1

    def broken() -> Any:
        raise OSError("no")

    failing = PatchSet("t: failing", "a test's", lambda key: [Step("broken", broken)], ["*"], needs=(base,))
    with pytest.raises(OSError, match="no"):
        _patches.acquire(failing)
    assert all(i.name != "t: base" for i in _patches.installed())  # what it needed is released again


def test_a_kept_value_comes_back_whatever_it_became() -> None:
    box = _box()
    s = PatchSet("t: kept", "a test's", lambda key: [Attr.kept(box, "a"), Attr.kept(box, "absent")], ["*"])
    with _patches.lease(s):
        box.a = 5
        box.absent = 6
    assert box.a == 1
    assert not hasattr(box, "absent")


def test_a_failing_install_undoes_what_it_did_and_installs_nothing() -> None:
    box = _box()

    def broken() -> Any:
        raise OSError("no")

    s = PatchSet("t: broken", "a test's", lambda key: [Attr(box, "a", 2), Step("broken", broken)], ["*"])
    with pytest.raises(OSError, match="no"):
        _patches.acquire(s)
    assert box.a == 1
    assert all(i.name != s.name for i in _patches.installed())


def test_a_change_the_set_does_not_declare_is_refused() -> None:
    box = _box()
    s = PatchSet("t: undeclared", "a test's", lambda key: [Attr(box, "a", 2)], ["elsewhere.*"])
    with pytest.raises(RuntimeError, match=r"would change <SimpleNamespace>\.a, which it does not declare"):
        _patches.acquire(s)
    assert box.a == 1


def test_every_set_aiocoll_declares_is_named_once_and_explained() -> None:
    import aiocoll._cli._run
    import aiocoll.testing  # noqa: F401  (the modules that declare the rest)

    sets = _patches.declared()
    names = [s.name for s in sets]
    assert len(names) == len(set(names)), names
    assert len(sets) >= 15
    for s in sets:
        assert s.module.startswith("aiocoll."), s
        assert s.why, s
        assert s.targets, s
        assert s.per in ("process", "loop", "run"), s


def test_the_design_page_lists_every_patch_set() -> None:
    import aiocoll._cli._run
    import aiocoll.testing  # noqa: F401

    page = (TESTS.parent / "docs" / "design.md").read_text()
    start, end = "<!-- patch sets: generated -->\n", "\n<!-- patch sets: end -->"
    listed = page[page.index(start) + len(start) : page.index(end)]
    regenerate = "python -c 'import aiocoll._cli._run, aiocoll.testing, aiocoll._patches as p; print(p.table())'"
    assert listed == _patches.table(), f"the table is out of date; regenerate it: {regenerate}"


def _every_entry(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "left.json"
    done = subprocess.run(
        [sys.executable, str(TESTS / "_every_entry.py"), str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


EXPECTED = {
    "spawn sync": "returned",
    "spawn sync, failing": "raised ValueError",
    "spawn async": "returned",
    "spawn async, failing": "raised ValueError",
    "hybrid": "returned",
    "hybrid, failing": "raised ValueError",
    "threaded harness test_passes": "passed",
    "threaded harness test_fails": "failed",
    "process harness test_passes": "passed",
    "process harness test_fails": "failed",
    "plugin": "exit 1",  # (one of its two tests fails)
    "aiocoll run (mp.spawn inside)": "exit 0",
    "aiocoll run (mp.spawn inside), failing": "exit 1",
}


def test_every_entry_point_leaves_nothing_installed_and_every_original_back(tmp_path: Path) -> None:
    result = _every_entry(tmp_path)
    assert result["outcomes"] == EXPECTED
    assert result["installed"] == []
    assert result["not_original"] == []
    assert result["originals"] >= 50  # (what was replaced, and is back: torch's, os's, logging's...)
    assert result["stdout"] is True


def test_the_check_sees_a_patch_left_behind(tmp_path: Path) -> None:
    result = _every_entry(tmp_path, "--leak")
    assert result["installed"] == ["threaded harness (1 lease(s))"]
    assert any("ProcessLocalGroup'>.reset is" in line for line in result["not_original"]), result["not_original"]
