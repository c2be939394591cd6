"""``logging``'s configuration per rank (``_logstate``), driven by hand: threads bound as ranks are."""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import logging.config
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aiocoll import _patches
from aiocoll._process import _procstate
from aiocoll._process._procstate import RankEnviron


@pytest.fixture
def installed() -> Iterator[None]:
    with _patches.lease(_procstate.RANK_PROCESSES):
        yield
    assert "handlers" not in vars(logging.Logger)  # put back as it was
    assert isinstance(vars(logging.Manager)["disable"], property)


def as_rank(rank: int, fn: Callable[[], object]) -> object:
    """``fn()`` in a thread bound to ``rank``, ending as a rank ends (its exit handlers run)."""
    out: list[object] = []

    def body() -> None:
        _procstate.bind(rank, RankEnviron({}), lambda s: None, contextlib.nullcontext)
        try:
            out.append(fn())
        finally:
            _procstate.run_exit_handlers()
            _procstate.unbind()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out[0] if out else None


def test_basic_config_and_levels_are_each_rank_s(installed: None) -> None:
    root, log = logging.getLogger(), logging.getLogger("aiocoll.test.logstate")
    before = (list(root.handlers), root.level, log.level)

    def configure(rank: int) -> Callable[[], object]:
        def fn() -> object:
            stream = io.StringIO()
            logging.basicConfig(level=logging.INFO, format=f"r{rank} %(message)s", stream=stream)
            log.setLevel(logging.DEBUG if rank else logging.INFO)
            log.debug("debug")
            log.info("info")
            return stream.getvalue(), len(root.handlers), root.level

        return fn

    assert as_rank(0, configure(0)) == ("r0 info\n", 1, logging.INFO)
    assert as_rank(1, configure(1)) == ("r1 debug\nr1 info\n", 1, logging.INFO)  # rank 0's handler is not its
    assert (list(root.handlers), root.level, log.level) == before


def test_logging_disable_is_each_rank_s(installed: None) -> None:
    def disabled() -> object:
        logging.disable(logging.CRITICAL)
        return logging.getLogger("aiocoll.test.logstate").isEnabledFor(logging.ERROR)

    assert as_rank(0, disabled) is False
    assert as_rank(1, lambda: logging.getLogger("aiocoll.test.logstate").isEnabledFor(logging.ERROR)) is True
    assert logging.root.manager.disable == 0


def test_dict_config_disables_existing_loggers_for_that_rank_only(installed: None) -> None:
    log = logging.getLogger("aiocoll.test.logstate.existing")

    def configure() -> object:
        logging.config.dictConfig({"version": 1})  # (disable_existing_loggers defaults to True)
        return log.disabled

    assert as_rank(0, configure) is True
    assert as_rank(1, lambda: log.disabled) is False
    assert log.disabled is False


def test_a_logger_made_in_a_rank_is_whole_afterwards(installed: None) -> None:
    name = "aiocoll.test.logstate.made-in-a-rank"
    assert name not in logging.Logger.manager.loggerDict
    as_rank(0, lambda: logging.getLogger(name).addHandler(logging.NullHandler()))
    made = logging.getLogger(name)
    assert (made.handlers, made.level, made.propagate, made.disabled) == ([], logging.NOTSET, True, False)


def test_a_rank_s_file_handler_is_flushed_and_closed_when_it_ends(installed: None, tmp_path: Path) -> None:
    handlers: list[logging.FileHandler] = []

    def fn() -> None:
        handlers.append(logging.FileHandler(tmp_path / "rank.log", delay=False))
        logging.getLogger().addHandler(handlers[0])
        logging.getLogger().warning("written")

    as_rank(0, fn)
    assert (tmp_path / "rank.log").read_text() == "written\n"
    assert handlers[0].stream is None  # closed, as logging.shutdown closes it at a process's exit


def test_what_an_import_configures_is_the_process_s(
    installed: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library's import-time NullHandler: every process would have added it at its own import."""
    (tmp_path / "aiocoll_test_importee.py").write_text(
        "import logging\nlogging.getLogger('aiocoll.test.importee').addHandler(logging.NullHandler())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "aiocoll_test_importee", raising=False)
    as_rank(0, lambda: importlib.import_module("aiocoll_test_importee"))
    seen = as_rank(1, lambda: [type(h) for h in logging.getLogger("aiocoll.test.importee").handlers])
    assert seen == [logging.NullHandler]
    assert [type(h) for h in logging.getLogger("aiocoll.test.importee").handlers] == [logging.NullHandler]


def test_outside_ranks_logging_is_the_process_s(installed: None) -> None:
    log = logging.getLogger("aiocoll.test.logstate.outside")
    log.setLevel(logging.ERROR)
    try:
        assert vars(log)["level"] == logging.ERROR
        assert as_rank(0, lambda: log.level) == logging.ERROR  # inherited, as by a process
    finally:
        log.setLevel(logging.NOTSET)
