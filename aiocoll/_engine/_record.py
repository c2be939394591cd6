"""The flight recorder: what every rank called, when, and how long it waited.

The engine keeps one ``Stamp`` per operation (per collective, or per p2p call): what
was called, each rank's arrival time and call site, when the last rank arrived and
when it completed. Each rank's ring holds the stamps of its last ``capacity``
operations (or all of them, when a trace file is wanted). Per rank per op that is a
clock read and a few stores into lists the stamp already holds: no object is made per
rank, so the garbage collector, which would otherwise scan every entry kept alive,
does not slow big worlds down. It stays on by default.

When a run fails, ``report()`` renders the last entries of every rank side by side,
aligned by group and sequence number, so it shows where the ranks diverged. ``trace()``
renders everything as a Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any

import torch

from .._ops import P2PRecord
from .._work import Site
from ._faults import Fault, OpInfo

__all__ = [
    "DEFAULT_RECORD",
    "Probe",
    "ProcessRecorder",
    "Recorder",
    "Stamp",
    "format_signature",
    "summarize_trace",
]

DEFAULT_RECORD = 64
"""Operations per rank the flight recorder keeps for failure reports."""


class Stamp:
    """The record of one operation, shared by the rings of the ranks that took part.

    Per group-rank: ``arrived`` (clock), ``files``/``lines`` (call site) and, when they
    differ from ``sig`` (a mismatch), ``sigs``. ``last``: when the last rank arrived;
    ``done``: when it completed or failed; ``outcome``: None while pending, "ok", or
    the error's type name. ``index`` maps a global rank to its group-rank.
    """

    __slots__ = ("arrived", "done", "files", "group", "index", "last", "lines", "outcome", "seq", "sig", "sigs")

    def __init__(self, group: str, index: dict[int, int], seq: int | None, sig: Hashable, size: int) -> None:
        self.group = group
        self.index = index
        self.seq = seq  # None for p2p
        self.sig = sig
        self.sigs: dict[int, Hashable] | None = None
        self.arrived = [0.0] * size
        self.files = [""] * size
        self.lines = [0] * size
        self.last: float | None = None
        self.done: float | None = None
        self.outcome: str | None = None

    def sig_of(self, grank: int) -> Hashable:
        return self.sig if self.sigs is None else self.sigs.get(grank, self.sig)

    # What the engine and the issuer tell the recorder; only these methods write a stamp.

    def arrive(self, grank: int, site: tuple[str, int] | None, at: float | None = None) -> None:
        """Group-rank ``grank`` called the op now (or ``at``), at ``site`` (file, line) if known."""
        self.arrived[grank] = time.perf_counter() if at is None else at
        if site is not None:
            self.files[grank], self.lines[grank] = site

    def differs(self, grank: int, sig: Hashable) -> None:
        """Group-rank ``grank`` called it with ``sig``, which is not the first caller's (a mismatch)."""
        if self.sigs is None:
            self.sigs = {}
        self.sigs[grank] = sig

    def all_here(self) -> None:
        """The last rank it waits for arrived now."""
        self.last = time.perf_counter()

    def ok(self) -> None:
        """It completed now."""
        self.done = time.perf_counter()
        self.outcome = "ok"

    def failed(self, exc: BaseException) -> None:
        """It failed now with ``exc``, unless it had ended already (the first end counts)."""
        if self.done is None:
            self.done = time.perf_counter()
            self.outcome = type(exc).__name__

    def told(self, outcome: str | None) -> None:
        """Its outcome as another process's record tells it (no time: its clock is not ours)."""
        self.outcome = outcome


Entry = tuple[Stamp, int]  # a stamp and the group-rank whose view it is


class Probe:
    """What the engine and the process-group issuer tell a recorder or an injector, and nothing else.

    They hold one (or None: a single ``is not None`` check per site) and call it when an
    op is issued and when it starts: ``issuing`` may pick a fault for the op instead;
    ``collective``/``p2p`` make the op's ``Stamp``, which then hears the op's own events
    (``arrive``... ``ok``/``failed``); ``arrived`` adds a rank's arrival and keeps the
    stamp where this recorder keeps it. Subclasses: the world's flight recorder (a trace
    is the same, keeping everything), the process recorder, and fault injection
    (``aiocoll._engine._inject.FaultProbe``, which tells a recorder the rest).
    """

    __slots__ = ()

    def issuing(self, rank: int, op: str, group: str) -> tuple[Fault, OpInfo] | None:
        """Global ``rank`` issues ``op`` on ``group`` (in its own task or thread, before the
        op enters the engine): the fault to apply to it instead, if this probe injects one."""
        return None

    def collective(self, group: str, index: dict[int, int], seq: int, sig: Hashable, size: int) -> Stamp:
        """The stamp of collective #``seq`` of ``group`` (``size`` members), made as its first rank arrives."""
        return Stamp(group, index, seq, sig, size)

    def p2p(self, group: str, rank: int, rec: P2PRecord) -> Stamp:
        """The stamp of one rank's send or recv: its own, as both sides may end at other times."""
        return Stamp(group, {rank: 0}, None, rec, 1)

    def arrived(self, stamp: Stamp, grank: int, rank: int, site: Site | None, at: float | None = None) -> None:
        """Global ``rank`` (group-rank ``grank``) called ``stamp``'s op now (or ``at``), at ``site``."""
        raise NotImplementedError


class Recorder(Probe):
    """Per-rank rings of entries; ``capacity=None`` keeps everything (for a trace)."""

    __slots__ = ("capacity", "ranks", "t0")

    def __init__(self, size: int, capacity: int | None) -> None:
        self.capacity = capacity
        self.ranks: list[deque[Stamp]] = [deque(maxlen=capacity) for _ in range(size)]
        self.t0 = time.perf_counter()

    def __repr__(self) -> str:
        n = sum(len(r) for r in self.ranks)
        return f"<Recorder ranks={len(self.ranks)} capacity={self.capacity} entries={n}>"

    def arrived(self, stamp: Stamp, grank: int, rank: int, site: Site | None, at: float | None = None) -> None:
        stamp.arrive(grank, site, at)
        self.ranks[rank].append(stamp)

    # -- reports --------------------------------------------------------------------------

    def report(self, last: int = 8, max_ranks: int = 8) -> str:
        """The last ``last`` entries of every rank, aligned by (group, sequence number).

        Beyond ``max_ranks`` ranks, the columns are the ranks whose last entry did not
        complete (the interesting ones), then the lowest ranks.
        """
        shown = self._columns(max_ranks)
        rows: dict[tuple[str, int | None, int], dict[int, Entry]] = {}
        p2p_index = 0
        for rank in shown:
            ring = self.ranks[rank]
            for stamp in list(ring)[-last:]:
                key: tuple[str, int | None, int]
                if stamp.seq is None:  # p2p: no common sequence, one row each
                    p2p_index += 1
                    key = (stamp.group, None, p2p_index)
                else:
                    key = (stamp.group, stamp.seq, 0)
                rows.setdefault(key, {})[rank] = (stamp, stamp.index[rank])
        if not rows:
            return "aiocoll: flight recorder: no operation was recorded"
        order = sorted(rows, key=lambda k: min(s.arrived[g] for s, g in rows[k].values()))
        texts = {k: {r: _cell(e) for r, e in rows[k].items()} for k in order}
        width = max([len(t) for cells in texts.values() for t in cells.values()] + [6]) + 2
        of = "" if len(shown) == len(self.ranks) else f", {len(shown)} of {len(self.ranks)} ranks"
        lines = [
            f"aiocoll: flight recorder, the last {last} operations of each rank (oldest first{of}):",
            ("  " + "call".ljust(16) + "".join(f"rank {r}".ljust(width) for r in shown)).rstrip(),
        ]
        for key in order:
            label = f"{key[0]} #{key[1]}" if key[1] is not None else f"{key[0]} p2p"
            line = "  " + label[:15].ljust(16) + "".join(texts[key].get(r, "-").ljust(width) for r in shown)
            lines.append(line.rstrip())
        return "\n".join(lines)

    def _columns(self, max_ranks: int) -> list[int]:
        n = len(self.ranks)
        if n <= max_ranks:
            return list(range(n))
        unfinished = [r for r, ring in enumerate(self.ranks) if ring and ring[-1].outcome != "ok"]
        picked = unfinished[:max_ranks]
        picked += [r for r in range(n) if r not in picked][: max_ranks - len(picked)]
        return sorted(picked)

    def snapshot(self) -> list[list[dict[str, Any]]]:
        """Every recorded entry, per rank, as plain data (times in seconds from the start)."""
        return [[_entry_dict((s, s.index[r]), self.t0) for s in ring] for r, ring in enumerate(self.ranks)]

    def trace(self) -> dict[str, Any]:
        """The recording as a Chrome trace: a track per rank, a slice per op (its wait nested)."""
        events: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
            for r in range(len(self.ranks))
        ]
        for rank, ring in enumerate(self.ranks):
            for stamp in ring:
                d = _entry_dict((stamp, stamp.index[rank]), self.t0)
                start = d["arrived"]
                end = d["done"] if d["done"] is not None else d["arrived"]
                events.append(
                    {
                        "name": d["op"],
                        "cat": "p2p" if d["seq"] is None else "collective",
                        "ph": "X",
                        "pid": 0,
                        "tid": rank,
                        "ts": start * 1e6,
                        "dur": max(0.0, end - start) * 1e6,
                        "args": d,
                    }
                )
                if d["last"] is not None and d["last"] > start:
                    events.append(
                        {
                            "name": "waiting for peers",
                            "cat": "wait",
                            "ph": "X",
                            "pid": 0,
                            "tid": rank,
                            "ts": start * 1e6,
                            "dur": (d["last"] - start) * 1e6,
                        }
                    )
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"producer": "aiocoll"}}

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.trace(), f)


class ProcessRecorder(Probe):
    """This process's operations on real process groups (``from_process_group``), oldest first.

    One ring for every group, as torch's own recorder keeps: an op costs a ``Stamp``, a
    clock read and an append (the issuer stamps its end). ``count`` numbers the ops ever
    recorded, so ``ring[i]`` is op ``count - len(ring) + i`` of the process. ``groups``
    holds what a dump says of each group: its description, its members' global ranks
    in group-rank order, and this process's group-rank.
    """

    __slots__ = ("count", "groups", "ring")

    def __init__(self, capacity: int) -> None:
        self.ring: deque[Stamp] = deque(maxlen=capacity)
        self.count = 0
        self.groups: dict[str, tuple[str, tuple[int, ...], int]] = {}

    def __repr__(self) -> str:
        return f"<ProcessRecorder groups={len(self.groups)} entries={len(self.ring)} recorded={self.count}>"

    def arrived(self, stamp: Stamp, grank: int, rank: int, site: Site | None, at: float | None = None) -> None:
        """This process issued ``stamp``'s op now (one rank a process: one column); its issuer ends the stamp."""
        stamp.arrive(grank, site, at)
        self.ring.append(stamp)
        self.count += 1


def _entry_dict(e: Entry, t0: float) -> dict[str, Any]:
    stamp, g = e
    return {
        "group": stamp.group,
        "seq": stamp.seq,
        "op": format_signature(stamp.sig_of(g)),
        "site": f"{stamp.files[g]}:{stamp.lines[g]}" if stamp.files[g] else None,
        "arrived": stamp.arrived[g] - t0,
        "last": None if stamp.last is None else stamp.last - t0,
        "done": None if stamp.done is None else stamp.done - t0,
        "outcome": stamp.outcome or "pending",
    }


_OUTCOMES = {
    "CollectiveMismatchError": "MISMATCH",
    "DeadlockError": "DEADLOCK",
    "CollectiveTimeoutError": "TIMEOUT",
    "WorldAbortedError": "aborted",
}


def _cell(e: Entry) -> str:
    stamp, g = e
    if stamp.outcome is None:
        state = "PENDING"
    elif stamp.outcome == "ok":
        wait = (stamp.last or stamp.arrived[g]) - stamp.arrived[g]
        state = f"ok +{_ms(wait)}" if wait >= 1e-3 else "ok"
    else:
        state = _OUTCOMES.get(stamp.outcome, stamp.outcome)
    return f"{format_signature(stamp.sig_of(g))} {state}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f}us"


_SHORT_DTYPES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.complex64: "c64",
    torch.complex128: "c128",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}


def _fmt_value(v: object) -> str:
    if isinstance(v, torch.dtype):
        return _SHORT_DTYPES.get(v, str(v).removeprefix("torch."))
    if isinstance(v, tuple):
        return "[" + ",".join(_fmt_value(x) for x in v) + "]"
    name = getattr(v, "name", None)
    if isinstance(name, str) and type(v).__name__ == "RedOpType":
        return name
    return repr(v) if isinstance(v, str) else str(v)


def format_signature(sig: Hashable) -> str:
    """A short text for a call signature, e.g. ``all_reduce SUM f32[3]``."""
    if isinstance(sig, str | P2PRecord):
        return str(sig)  # a p2p call's record reads as the call
    if not (isinstance(sig, tuple) and sig and isinstance(sig[0], str)):
        return str(sig)
    parts: list[str] = [sig[0]]
    for v in sig[1:]:
        if isinstance(v, tuple) and parts and parts[-1] in _SHORT_DTYPES.values():
            parts[-1] += _fmt_value(v)  # a dtype and the shape after it: f32[3]
        else:
            parts.append(_fmt_value(v))
    return " ".join(parts)


def summarize_trace(trace: dict[str, Any]) -> str:
    """Per op kind: count, total and max wait; and the slowest rank (``python -m aiocoll trace``)."""
    slices = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") != "wait"]
    if not slices:
        return "no operations in this trace"
    kinds: dict[str, list[float]] = {}
    for e in slices:
        a = e["args"]
        wait = (a["last"] - a["arrived"]) if a.get("last") is not None else 0.0
        kinds.setdefault(a["op"].split(" ", 1)[0], []).append(max(0.0, wait))
    lines = [f"{'op':<24}{'count':>8}{'total wait':>14}{'max wait':>12}"]
    for kind, waits in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{kind:<24}{len(waits):>8}{_ms(sum(waits)):>14}{_ms(max(waits)):>12}")
    lines.append("")
    lines.append(_slowest(slices))
    return "\n".join(lines)


def _slowest(slices: Iterable[dict[str, Any]]) -> str:
    """The rank that most often arrived last at collectives, and by how much in total."""
    by_call: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for e in slices:
        a = e["args"]
        if a.get("seq") is not None:
            by_call.setdefault((a["group"], a["seq"]), []).append((a["arrived"], e["tid"]))
    late: dict[int, list[float]] = {}
    for arrivals in by_call.values():
        if len(arrivals) < 2:
            continue
        arrivals.sort()
        first, (t_last, rank) = arrivals[0][0], arrivals[-1]
        late.setdefault(rank, []).append(t_last - first)
    if not late:
        return "slowest rank: none (no collective with two or more ranks)"
    rank, gaps = max(late.items(), key=lambda kv: (sum(kv[1]), len(kv[1])))
    return (
        f"slowest rank: {rank} (last to arrive at {len(gaps)} of {len(by_call)} collectives, "
        f"{_ms(sum(gaps))} behind the first arrival in total)"
    )
