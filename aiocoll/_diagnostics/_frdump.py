"""Flight Recorder dumps: aiocoll's recordings in the format torch's Flight Recorder writes.

One pickle per rank, named ``<prefix><rank>`` as torch names them, so torch's analyzer
reads a directory of them and points at the first collective the ranks disagree on::

    python -m torch.distributed.flight_recorder.fr_trace DIR

A dump is built only on failure or on demand, from what the recorders keep anyway (the
``Stamp``s of ``aiocoll._engine._record``): nothing here runs per operation. The files hold plain
dicts, lists and strings only, so the analyzer needs no aiocoll to read them.

What the analyzer matches on, and how aiocoll's recording maps to it:

- ``profiling_name`` "<library>:<op>": the op is the analyzer's name for it (a barrier
  is NCCL's "all_reduce_barrier", ``all_to_all_single`` is "all_to_all", the object
  collectives are the tensor collectives torch runs them as, ``new_group``/``split``
  are written as barriers). The library is "nccl" for in-process ranks (the name every
  release's analyzer knows), the group's backend for real groups where the analyzer
  knows it.
- ``collective_seq_id``: aiocoll's sequence number in the group, the "call #N" of its
  own messages. Sizes the signature does not fix (``all_gather``'s list, ``all_to_all``
  splits, object payloads) are written as 0, which every size check accepts.
- only sends and recvs that did not complete are written (the analyzer expects every
  member of the group at one, and would flag a completed one as missing the others);
  they carry ``collective_seq_id`` -1 and ``p2p_seq_id`` -n (the rank's n-th
  p2p op in the group): the analyzer groups consecutive entries that share one of these
  numbers as a coalesced batch, which lone aiocoll p2p ops are not.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from .. import _torch
from .._engine._record import DEFAULT_RECORD, ProcessRecorder, Stamp, format_signature
from .._errors import AiocollError
from .._ops import OpRecord, P2PRecord, Shape, record_of

if TYPE_CHECKING:
    from .._comm import Comm
    from .._engine._world import World

__all__ = ["ENV", "GroupInfo", "dump_flight_recorder", "dump_process", "dump_world", "on_failure", "process_recorder"]

ENV = "TORCH_FR_DUMP_TEMP_FILE"
"""torch's variable: the prefix of the dump files (file = prefix + rank)."""

DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"  # torch's default for TORCH_FR_DUMP_TEMP_FILE
DIR_PREFIX = "aiocoll_trace_rank_"  # the file names in a directory given as the prefix


class GroupInfo(NamedTuple):
    """What a dump says of a group: its name, description and members (global ranks, group-rank order)."""

    name: str
    desc: str
    ranks: tuple[int, ...]


# c10's names for dtypes, which torch's recorder writes
_DTYPES = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
}


def _dtype_name(dt: object) -> str:
    if isinstance(dt, torch.dtype):
        return _DTYPES.get(dt, str(dt).removeprefix("torch."))
    return "Byte"  # no tensor (object collectives): bytes, as torch sends them


# An op as the analyzer sees it: its name, input and output sizes, dtype.
_Shape = list[list[int]]
_Op = tuple[str, _Shape, _Shape, str]


def _sizes(shape: Shape | None) -> _Shape:
    return [[0]] if shape is None else [list(shape)]  # 0: a size the records leave open


# aiocoll's op names that torch's analyzer knows by another (objects move as bytes)
_ANALYZER_NAMES = {
    "all_gather_into_tensor": "_all_gather_base",
    "reduce_scatter_tensor": "_reduce_scatter_base",
    "all_to_all_single": "all_to_all",
    "broadcast_object": "broadcast",
    "all_gather_object": "all_gather",
    "gather_object": "gather",
    "scatter_object": "scatter",
}
_BARRIERS = ("barrier", "new_group", "split")  # written as NCCL writes a barrier


def _collective(rec: OpRecord) -> _Op:
    """The analyzer's view of a collective."""
    if rec.op in _BARRIERS:
        return "all_reduce_barrier", [[1]], [[1]], "Float"
    return _ANALYZER_NAMES.get(rec.op, rec.op), _sizes(rec.inputs), _sizes(rec.outputs), _dtype_name(rec.dtype)


def _p2p(rec: P2PRecord, me: int) -> tuple[str, _Shape, str]:
    """(the op as the analyzer names it, e.g. "send 0->1", its sizes, its dtype)."""
    peer = "?" if rec.peer is None else rec.peer
    name = f"send {me}->{peer}" if rec.op == "send" else f"recv {me}<-{peer}"
    return name, _sizes(rec.shape), _dtype_name(rec.dtype)


def _state(stamp: Stamp) -> str:
    # torch's states: queued, running, done. A failed op never completed; one that every
    # rank reached was running (it is written alike on every rank of one stamp)
    if stamp.outcome == "ok":
        return "completed"
    return "started" if stamp.last is not None and stamp.outcome is None else "scheduled"


class _Clock:
    """perf_counter readings as the wall-clock nanoseconds torch writes."""

    def __init__(self) -> None:
        self.offset = time.time_ns() - int(time.perf_counter() * 1e9)

    def ns(self, t: float | None) -> int | None:
        return None if t is None else int(t * 1e9) + self.offset


class _Groups:
    """The groups a rank's dump names (``pg_config``) and how far each got (``pg_status``)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.config: dict[str, dict[str, str]] = {}
        self.status: dict[str, dict[str, int]] = {}

    def saw(self, info: GroupInfo, seq: int | None, state: str) -> int:
        """An entry of ``info``'s (collective ``seq``, None for p2p) in ``state``; the group's id."""
        pg_id = self.ids.get(info.name)
        if pg_id is None:
            pg_id = self.ids[info.name] = len(self.ids)
            self.config[info.name] = {"name": info.name, "desc": info.desc, "ranks": str(list(info.ranks))}
            self.status[str(pg_id)] = dict.fromkeys(
                ("last_enqueued_collective", "last_started_collective", "last_completed_collective"), -1
            )
        if seq is not None:
            status = self.status[str(pg_id)]
            status["last_enqueued_collective"] = seq
            if state != "scheduled":
                status["last_started_collective"] = seq
            if state == "completed":
                status["last_completed_collective"] = seq
        return pg_id


def rank_dump(
    rank: int,
    stamps: Iterable[Stamp],
    group_of: Callable[[Stamp], GroupInfo],
    *,
    lib: str,
    first_record_id: int = 0,
    floors: Mapping[str, int] | None = None,
    timeout_ms: int = 0,
    clock: _Clock | None = None,
) -> dict[str, object]:
    """One rank's dump: torch's keys (``version``, ``pg_config``, ``pg_status``, ``entries``).

    ``group_of`` names a stamp's group; ``floors``: per group, the first sequence number
    to write (older ones are missing from some rank's ring, see ``dump_world``).
    """
    clock = clock or _Clock()
    groups = _Groups()
    p2p_counts: dict[str, int] = {}
    entries: list[dict[str, object]] = []
    for stamp in stamps:
        info = group_of(stamp)
        me = info.ranks.index(rank)
        if stamp.seq is not None and stamp.seq < (floors or {}).get(info.name, 0):
            continue
        g = stamp.index[rank]  # the stamp's own column of this rank
        sig = stamp.sig_of(g)
        rec = record_of(sig)
        if stamp.seq is None:
            if not isinstance(rec, P2PRecord):
                continue
            p2p = _p2p(rec, me)
            if stamp.outcome == "ok" or not _torch.fr_accepts(f"{lib}:{p2p[0]}"):
                # The analyzer wants every member of the group at a send or recv: a done
                # one would be flagged, so only those still pending (or failed) are
                # written; and not a recv from any source before torch 2.15, whose
                # analyzer cannot read one.
                continue
            name, sizes, dtype = p2p
            out_sizes = sizes
            p2p_counts[info.name] = n = p2p_counts.get(info.name, 0) + 1
            coll_seq, p2p_seq = -1, -n
        else:
            if not isinstance(rec, OpRecord):
                continue  # not a signature of aiocoll's ops
            name, sizes, out_sizes, dtype = _collective(rec)
            coll_seq, p2p_seq = stamp.seq, 0
        state = _state(stamp)
        pg_id = groups.saw(info, stamp.seq, state)
        site = [{"name": format_signature(sig), "filename": stamp.files[g], "line": stamp.lines[g]}]
        entries.append(
            {
                "record_id": first_record_id + len(entries),
                "pg_id": pg_id,
                "process_group": (info.name, info.desc),
                "collective_seq_id": coll_seq,
                "p2p_seq_id": p2p_seq,
                "op_id": first_record_id + len(entries),
                "profiling_name": f"{lib}:{name}",
                "time_created_ns": clock.ns(stamp.arrived[g]),
                "input_sizes": sizes,
                "input_dtypes": [dtype],
                "output_sizes": out_sizes,
                "output_dtypes": [dtype],
                "state": state,
                "time_discovered_started_ns": clock.ns(stamp.last),
                "time_discovered_completed_ns": clock.ns(stamp.done) if state == "completed" else None,
                "retired": stamp.done is not None,
                "timeout_ms": timeout_ms,
                "is_p2p": stamp.seq is None,
                "frames": site if stamp.files[g] else [],
                "thread_id": "0",
                "thread_name": f"aiocoll rank {rank}",
            }
        )
    return {
        "version": _torch.fr_format_version(),
        "comm_lib_version": "aiocoll",
        "pg_config": groups.config,
        "pg_status": groups.status,
        "entries": entries,
    }


def resolve_prefix(prefix: str | os.PathLike[str] | None) -> str:
    """The file-name prefix: ``prefix``, else ``$TORCH_FR_DUMP_TEMP_FILE``, else torch's default.

    A directory (existing, or named with a trailing separator) gets files
    ``aiocoll_trace_rank_<rank>`` inside it.
    """
    p = os.fspath(prefix) if prefix is not None else os.environ.get(ENV) or DEFAULT_PREFIX
    if p.endswith(os.sep) or os.path.isdir(p):
        p = os.path.join(p, DIR_PREFIX)
    return p


def write(prefix: str, dumps: Mapping[int, dict[str, object]]) -> list[str]:
    """Write each rank's dump to ``<prefix><rank>``; return the paths."""
    parent = os.path.dirname(prefix)
    if parent:
        os.makedirs(parent, exist_ok=True)
    paths = []
    for rank, dump in sorted(dumps.items()):
        path = f"{prefix}{rank}"
        tmp = f"{path}.tmp"  # (not named <prefix><digits>: the analyzer skips it)
        with open(tmp, "wb") as f:
            pickle.dump(dump, f)
        os.replace(tmp, path)  # a reader never sees half a file
        paths.append(path)
    return paths


# -- in-process and hybrid worlds -------------------------------------------------------------------


def dump_world(world: World, prefix: str | os.PathLike[str] | None = None) -> list[str]:
    """Write the dumps of the world's ranks that run in this process (all but a hybrid world's others)."""
    from .._stats import Phase

    w = world
    rec = w.recorder
    if rec is None:
        raise AiocollError("dump_flight_recorder(): the flight recorder is off in this world (spawn(..., record=0))")
    groups: dict[tuple[str, int], GroupInfo] = {}
    for g in w.groups.all():
        info = GroupInfo(g.name, "default_pg" if g.is_world else "undefined", g.ranks)
        for r in g.ranks:
            groups[(g.name, r)] = info
    local = [st.rank for st in w.ranks if st.phase is not Phase.REMOTE]
    rings = {r: list(rec.ranks[r]) for r in local}
    floors = _floors(rings, rec.capacity)
    timeout_ms = int((w.timeout or 0) * 1000)
    clock = _Clock()
    dumps = {}
    for r, ring in rings.items():

        def group_of(stamp: Stamp, r: int = r) -> GroupInfo:
            info = groups.get((stamp.group, r))
            if info is None:  # a group gone from the registry: its stamp still knows the members
                info = GroupInfo(stamp.group, "undefined", tuple(sorted(stamp.index, key=stamp.index.__getitem__)))
            return info

        dumps[r] = rank_dump(r, ring, group_of, lib="nccl", floors=floors, timeout_ms=timeout_ms, clock=clock)
        if w.rank_seeds is not None:  # (a key of aiocoll's own: torch's analyzer reads only its own)
            dumps[r]["aiocoll_rank_seed"] = w.rank_seeds[r]
    return write(resolve_prefix(prefix), dumps)


def _floors(rings: Mapping[int, Sequence[Stamp]], capacity: int | None) -> dict[str, int]:
    """Per group, the oldest sequence number every full ring still holds.

    A ring that is not full holds its rank's whole history, which starts at call #0 of
    each of its groups; a full one has dropped its oldest ops. Ops older than what some
    member still holds would look, to the analyzer, as if that member never joined them.
    """
    floors: dict[str, int] = {}
    if capacity is None:
        return floors
    for ring in rings.values():
        if len(ring) < capacity:
            continue
        first: dict[str, int] = {}
        for s in ring:
            if s.seq is not None and s.group not in first:
                first[s.group] = s.seq
        for name, seq in first.items():
            floors[name] = max(floors.get(name, 0), seq)
    return floors


# -- real process groups ---------------------------------------------------------------------------

_process: ProcessRecorder | None = None
# the seed this process's generators started from, when aiocoll run chose it (a key of the dumps)
_process_seed: int | None = None


def note_process_seed(seed: int) -> None:
    """Say in this process's dumps that its generators started from ``seed`` (``aiocoll run``'s processes)."""
    global _process_seed
    _process_seed = seed


def process_recorder() -> ProcessRecorder:
    """This process's recorder of process-group ops (``from_process_group``), made at first use."""
    global _process
    if _process is None:
        _process = ProcessRecorder(DEFAULT_RECORD)
    return _process


def dump_process(prefix: str | os.PathLike[str] | None = None, lib: str = "nccl") -> list[str]:
    """Write this process's dump of its process-group ops: one file, ``<prefix><global rank>``."""
    rec = _process
    if rec is None or not rec.groups:
        raise AiocollError(
            "dump_flight_recorder(): nothing to dump: call it inside a rank of aiocoll.spawn, "
            "or after using a Comm of aiocoll.from_process_group()"
        )
    infos = {name: GroupInfo(name, desc, ranks) for name, (desc, ranks, _) in rec.groups.items()}
    _, ranks, me = next(iter(rec.groups.values()))
    rank = ranks[me]
    ring = list(rec.ring)
    dump = rank_dump(
        rank,
        ring,
        lambda s: infos[s.group],
        lib=lib if _torch.fr_accepts(f"{lib}:all_reduce") else "nccl",
        first_record_id=rec.count - len(ring),
    )
    if _process_seed is not None:  # (a key of aiocoll's own, as in one process's dumps)
        dump["aiocoll_rank_seed"] = _process_seed
    return write(resolve_prefix(prefix), {rank: dump})


# -- when to dump --------------------------------------------------------------------------------------


def on_failure(dump: Callable[[str], list[str]]) -> str | None:
    """Dump if ``$TORCH_FR_DUMP_TEMP_FILE`` is set; return a note for the error, or None.

    Called only when a run or an op fails. A dump that cannot be written is said in the
    note: it must not hide the failure it was meant to explain.
    """
    prefix = os.environ.get(ENV)
    if not prefix:
        return None
    try:
        paths = dump(prefix)
    except (OSError, AiocollError) as e:
        return f"aiocoll: could not write the flight recorder dump to {prefix!r}: {e}"
    if not paths:
        return None
    where = os.path.dirname(paths[0]) or "."
    return (
        f"aiocoll: flight recorder dumped to {paths[0]}"
        + (f" ... ({len(paths)} files)" if len(paths) > 1 else "")
        + f"; analyse with: python -m torch.distributed.flight_recorder.fr_trace {where}"
    )


def dump_flight_recorder(prefix: str | os.PathLike[str] | None = None, *, comm: Comm | None = None) -> list[str]:
    """Write the flight recorder as torch's Flight Recorder dumps, one file per rank; return their paths.

    Files are named ``<prefix><rank>``, as torch names its own. ``prefix`` defaults to
    ``$TORCH_FR_DUMP_TEMP_FILE``, then to torch's ``/tmp/nccl_trace_rank_``; a directory
    gets files ``aiocoll_trace_rank_<rank>`` in it. Inside a rank of ``aiocoll.spawn``
    (or given its ``comm``) it writes every rank of the world this process runs; given a
    ``comm`` of ``from_process_group`` (or outside any world), this process's ops on
    its process groups, to ``<prefix><global rank>``. Read them with torch's analyzer::

        async def worker(comm):
            await comm.all_reduce(torch.ones(2))
            if comm.rank == 0:
                aiocoll.dump_flight_recorder("/tmp/fr/")   # /tmp/fr/aiocoll_trace_rank_{0..3}

        aiocoll.spawn(worker, world=4)
        # $ python -m torch.distributed.flight_recorder.fr_trace /tmp/fr

    The same dumps are written when a run fails and ``TORCH_FR_DUMP_TEMP_FILE`` is set.
    """
    from .._engine._engine_comm import EngineComm
    from .._engine._rank import current_rank_state

    if isinstance(comm, EngineComm):
        return dump_world(comm.world, prefix)
    if comm is not None:
        return dump_process(prefix, getattr(comm, "backend", "nccl"))
    st = current_rank_state()
    if st is not None:
        return dump_world(st.world, prefix)
    return dump_process(prefix, _backend())


def _backend() -> str:
    """The backend of this process's default group, if torch.distributed is initialised."""
    import torch.distributed as dist

    try:
        return str(dist.get_backend()) if dist.is_initialized() else "nccl"
    except (RuntimeError, ValueError):
        return "nccl"
