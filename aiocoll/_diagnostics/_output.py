"""Per-rank output: what a rank prints or logs, prefixed with ``[rank N]`` (opt-in).

``spawn(..., prefix_output=True)`` swaps ``sys.stdout``/``sys.stderr`` for streams that
prefix each line written by a rank (found through the rank context variable, so it
works for tasks and threads alike) and installs a log-record factory that does the same
for log messages. Output from outside any rank passes through unchanged. Both are
restored when the world ends.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from .. import _patches
from .._engine._rank import current_rank_state

__all__ = ["prefixed_output"]


class _PrefixingStream(io.TextIOBase):
    """A text stream that starts every line a rank writes with ``[rank N] ``."""

    def __init__(self, inner: TextIO) -> None:
        super().__init__()
        self._inner = inner
        self._mid_line: dict[int, bool] = {}  # per rank: the last write did not end a line
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        st = current_rank_state()
        if st is None or not s:
            return self._inner.write(s)
        prefix = f"[rank {st.rank}] "
        with self._lock:
            out = []
            mid = self._mid_line.get(st.rank, False)
            for line in s.splitlines(keepends=True):
                if not mid and not line.startswith(prefix):  # a logging handler may have prefixed it
                    out.append(prefix)
                out.append(line)
                mid = not line.endswith("\n")
            self._mid_line[st.rank] = mid
            self._inner.write("".join(out))
        return len(s)

    def flush(self) -> None:
        self._inner.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._inner.isatty()

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._inner.encoding


def _record_factory() -> Callable[[], None]:
    old_factory = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = old_factory(*args, **kwargs)
        st = current_rank_state()
        if st is not None:
            record.msg = f"[rank {st.rank}] {record.msg}"
            record.aiocoll_rank = st.rank
        return record

    logging.setLogRecordFactory(factory)
    return lambda: logging.setLogRecordFactory(old_factory)


PREFIXES = _patches.PatchSet(
    "rank prefixes",
    "what a rank prints or logs starts with [rank N] (spawn(..., prefix_output=True))",
    lambda key: [
        _patches.Attr(sys, "stdout", _PrefixingStream(sys.stdout)),
        _patches.Attr(sys, "stderr", _PrefixingStream(sys.stderr)),
        _patches.Step("logging.setLogRecordFactory", _record_factory),
    ],
    ["sys.stdout", "sys.stderr", "logging.setLogRecordFactory"],
)


def prefixed_output() -> contextlib.AbstractContextManager[None]:
    """Prefix the ranks' prints and log messages with ``[rank N]`` while in effect (worlds share one install)."""
    return _patches.lease(PREFIXES)
