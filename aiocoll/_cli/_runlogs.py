"""Where ``aiocoll run``'s ranks print: torchrun's ``--redirects``, ``--tee``, ``--log-dir``, ``--local-ranks-filter``.

torchrun gives each worker process its own stdout and stderr; here the ranks share the
process's, so ``sys.stdout`` and ``sys.stderr`` become routers that send what a rank
writes where torchrun would send that worker's stream:

- not redirected: to the console as it is (nothing added), unless ``--local-ranks-filter``
  leaves the rank out;
- redirected (``--redirects``): to ``<log dir>/<run id>_<random>/attempt_<n>/<rank>/stdout.log``
  (``stderr.log``) only;
- tee'd (``--tee``): to that file, and to the console with torchrun's prefix ``[default0]:``
  (``[<role><local rank>]:``) at the start of each line, unless filtered out.

What is written outside any rank (aiocoll's own reports) goes to the console unchanged.
``Std`` values are torchrun's: 0 none, 1 stdout, 2 stderr, 3 both, or per rank as ``0:3,1:1``.
"""

from __future__ import annotations

import codecs
import contextlib
import enum
import io
import os
import re
import socket
import string
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from .. import _current, _patches

__all__ = ["OUTPUT_RANK", "LogsSpec", "Std", "routed_output"]


class Std(enum.IntFlag):
    """Which of a worker's streams an option applies to (torchrun's values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @staticmethod
    def parse(value: str, option: str) -> Std | dict[int, Std]:
        """``"3"`` or ``"0:3,1:1"``, as torchrun reads them; ``ValueError`` naming ``option`` otherwise."""
        if re.fullmatch(r"[0123]", value):
            return Std(int(value))
        if re.fullmatch(r"(\d+:[0123],)*\d+:[0123]", value):
            return {int(r): Std(int(v)) for r, v in (m.split(":") for m in value.split(","))}
        raise ValueError(f"{option} {value!r}: give 0, 1, 2 or 3 (none, stdout, stderr, both), or per rank: 0:3,1:1")

    @staticmethod
    def of(value: Std | dict[int, Std], rank: int) -> Std:
        return value if isinstance(value, Std) else value.get(rank, Std.NONE)


@dataclass(frozen=True)
class LogsSpec:
    """The run's output options, as torchrun's ``DefaultLogsSpecs`` takes them."""

    log_dir: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    local_ranks_filter: frozenset[int] = frozenset()
    role: str = "default"
    prefix_template: str = ""  # torchrun's --log-line-prefix-template: ${role_name}, ${rank}, ${local_rank}, ...
    # --duplicate-stdout-filters / --duplicate-stderr-filters: a tee'd line holding any of these
    # is also written to the attempt's filtered_stdout.log / filtered_stderr.log (every rank's)
    duplicated: Mapping[Std, tuple[str, ...]] = field(default_factory=dict)

    def prefix(self, rank: int) -> str:
        """The console prefix of a tee'd line of ``rank`` (one node: its local rank is its rank)."""
        if not self.prefix_template:
            return f"[{self.role}{rank}]:"
        fields = {"role_name": self.role, "rank": rank, "local_rank": rank, "hostname": socket.gethostname()}
        return string.Template(self.prefix_template).safe_substitute(fields)

    def routes_output(self) -> bool:
        """Whether any rank's output goes elsewhere than the console, as it is."""
        return bool(self.redirects or self.tee or self.local_ranks_filter or any(self.duplicated.values()))

    def make_run_dir(self, run_id: str) -> str:
        """The run's log directory, as torchrun names it (``<log dir>/<run id>_<random>``)."""
        base = self.log_dir or tempfile.mkdtemp(prefix="aiocoll_run_")
        if os.path.isfile(base):
            raise NotADirectoryError(f"--log-dir {base}: is a file")
        os.makedirs(base, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)


OUTPUT_RANK: _current.Facet[int | None] = _current.Facet("output", None, carried=True)
"""The run's rank whose output this thread writes (set in each rank's thread; None: not a rank's).

Carried: what the threads a rank starts print goes where the rank's output goes, as in its process."""


class _Sink:
    """One destination of a rank's stream, with the prefix its lines get there."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream = stream
        self.prefix = prefix
        self.mid_line = False  # the last write did not end a line

    def close(self) -> None:
        """The rank's stream ends (nothing more to write)."""

    def write(self, s: str) -> None:
        if self.prefix:
            out = []
            for line in s.splitlines(keepends=True):
                if not self.mid_line:
                    out.append(self.prefix)
                out.append(line)
                self.mid_line = not line.endswith("\n")
            s = "".join(out)
        self.stream.write(s)


class _FilteredSink(_Sink):
    """The lines of a rank's stream that hold one of ``needles``, prefixed (torchrun's duplicate filters)."""

    def __init__(self, stream: TextIO, prefix: str, needles: tuple[str, ...]) -> None:
        super().__init__(stream, prefix)
        self.needles = needles
        self.pending = ""  # the start of a line not ended yet: judged once whole

    def write(self, s: str) -> None:
        *lines, self.pending = (self.pending + s).split("\n")
        for line in lines:
            self._line(line + "\n")

    def close(self) -> None:
        if self.pending:  # (torchrun's reader takes a last line without its end too)
            self._line(self.pending)
            self.pending = ""

    def _line(self, line: str) -> None:
        if any(needle in line for needle in self.needles):
            self.stream.write(self.prefix + line)


class _Router(io.TextIOBase):
    """``sys.stdout`` (or ``sys.stderr``) while a run routes output: each rank's lines to its sinks."""

    def __init__(self, console: TextIO, sinks: dict[int, list[_Sink]]) -> None:
        super().__init__()
        self._console = console
        self._sinks = sinks
        self._lock = threading.Lock()
        self._buffer: _BinaryRouter | None = None

    def write(self, s: str) -> int:
        rank = OUTPUT_RANK.get()
        sinks = self._sinks.get(rank) if rank is not None else None
        if sinks is None:
            return self._console.write(s)
        with self._lock:
            for sink in sinks:
                sink.write(s)
        return len(s)

    def close_sinks(self) -> None:
        """The ranks' streams end: what a sink holds back (a filtered line's start) goes out."""
        with self._lock:
            for sinks in self._sinks.values():
                for sink in sinks:
                    sink.close()

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
        super().close()

    def flush(self) -> None:
        with self._lock:
            self._console.flush()
            for sinks in self._sinks.values():
                for sink in sinks:
                    sink.stream.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._console.isatty()

    def fileno(self) -> int:
        return self._console.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._console.encoding

    @property
    def buffer(self) -> _BinaryRouter:
        """The binary layer (``sys.stdout.buffer.write(b"...")``): bytes decoded, then routed as text.

        One for the router's life, as a stream's: its decoders keep a character split across writes.
        """
        if self._buffer is None:
            self._buffer = _BinaryRouter(self)
        return self._buffer

    def reconfigure(self, **options: Any) -> None:
        """``TextIOWrapper.reconfigure`` (training scripts ask for ``line_buffering=True``): the console's.

        The rank's log files are line-buffered already; the console is the process's, as
        the stream each worker of torchrun reconfigures is its own.
        """
        reconfigure = getattr(self._console, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(**options)

    def __repr__(self) -> str:
        return f"<aiocoll run output router over {self._console!r}, {len(self._sinks)} ranks>"


class _BinaryRouter(io.RawIOBase):
    """``_Router.buffer``: each rank's bytes decoded incrementally (a character split across writes stays whole)."""

    def __init__(self, text: _Router) -> None:
        super().__init__()
        self._text = text
        self._decoders: dict[int | None, codecs.IncrementalDecoder] = {}

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        rank = OUTPUT_RANK.get()
        decoder = self._decoders.get(rank)
        if decoder is None:
            decoder = self._decoders[rank] = codecs.getincrementaldecoder(self._text.encoding)(errors="replace")
        self._text.write(decoder.decode(data))
        return len(data)

    def flush(self) -> None:
        self._text.flush()

    def __repr__(self) -> str:
        return f"<binary layer of {self._text!r}>"


@contextlib.contextmanager
def routed_output(spec: LogsSpec, run_dir: str, attempt: int, size: int) -> Iterator[str]:
    """Route the ranks' output for one attempt; yields its directory (``<rank>/``: each rank's files)."""
    attempt_dir = os.path.join(run_dir, f"attempt_{attempt}")
    dirs = {r: os.path.join(attempt_dir, str(r)) for r in range(size)}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    if not spec.routes_output():
        yield attempt_dir
        return
    with contextlib.ExitStack() as files:
        routers = []
        for flag, name, console in ((Std.OUT, "stdout", sys.stdout), (Std.ERR, "stderr", sys.stderr)):
            sinks: dict[int, list[_Sink]] = {}
            needles = spec.duplicated.get(flag, ())
            filtered = None
            if needles:  # (made even when no rank is tee'd, as torchrun makes it)
                path = os.path.join(attempt_dir, f"filtered_{name}.log")
                filtered = files.enter_context(open(path, "w", buffering=1, encoding="utf-8", errors="replace"))
            for r in range(size):
                tee = bool(Std.of(spec.tee, r) & flag)
                to_file = tee or bool(Std.of(spec.redirects, r) & flag)
                shown = not spec.local_ranks_filter or r in spec.local_ranks_filter
                sinks[r] = []
                if to_file:
                    path = os.path.join(dirs[r], f"{name}.log")
                    sinks[r].append(_Sink(files.enter_context(open(path, "w", buffering=1, encoding="utf-8")), ""))
                if shown and (tee or not to_file):
                    sinks[r].append(_Sink(console, spec.prefix(r) if tee else ""))
                if filtered is not None and tee and shown:  # (torchrun duplicates the console's lines)
                    sinks[r].append(_FilteredSink(filtered, spec.prefix(r), needles))
            routers.append(_Router(console, sinks))
            files.callback(routers[-1].close_sinks)
        try:
            with _patches.lease(ROUTED, (routers[0], routers[1])):
                yield attempt_dir
        finally:
            for router in routers:  # (flushed now, while the rank files are open: its finalizer would later)
                router.close()


ROUTED = _patches.PatchSet(
    "aiocoll run's output",
    "what each rank prints goes where --redirects, --tee and --local-ranks-filter send it",
    lambda routers: [_patches.Attr(sys, "stdout", routers[0]), _patches.Attr(sys, "stderr", routers[1])],  # type: ignore[index]
    ["sys.stdout", "sys.stderr"],
    per="run",
)
