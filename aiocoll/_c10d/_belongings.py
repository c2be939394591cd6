"""What a world made that holds C++ resources, released when the world ends.

In processes, a rank's objects die with its process. In one process, an object a world
made lives as long as anything refers to it: torch's process-wide caches (DTensor's
redistribution plans and mesh topologies, keyed by meshes), and reference cycles
(a ``DeviceMesh`` and its groups, modules and their hooks) that only Python's cyclic
garbage collector frees, whenever it next runs, in whatever thread triggers it. A C++
destructor then runs in that thread, for a world long gone: a ``FileStore``'s reads its
file, and blocks for ever holding the GIL if the file has been rewritten since (seen in
a later test's rank thread, which stopped the whole test process).

So a world's ranks record (weakly) the process groups, stores and meshes they make,
and when the world ends ``release()`` drops what torch's caches keep for its meshes,
then, only if one of those objects is still alive, collects the young generations
(about 1 ms), then, if some still live, every generation, so that their destructors run
then, in the thread that ends the world. That last collection is skipped when every
object still alive is reached from what the world returned (DTensors keep their
meshes): it would free nothing. What still lives after that is referenced from outside
the world (a result, an exception kept): ``release`` names it.

A full collection looks at every object of the process: about 0.2 s with torch loaded,
which doubled suites that start a world per test (torch's DTensor tests). A world runs
inside ``world_scope()``, which sets the objects older than the world aside
(``gc.freeze()``, which moves them as a whole, not one by one) until it ends: the full
collection at its end then looks only at what was made while it ran, the world's own
objects among them (6-7 ms for a world of FSDP2, TP and DCP), and frees what it made as
before. Objects set aside are not collected meanwhile, and garbage made between two
worlds would be set aside by the next world, and the next: in a loop of worlds it piled
up (80 MB over 250 worlds of that program), most of it the ended worlds' own engines
(reference cycles holding the world's closed uvloop loop of 256 KB), which die only once
their caller lets them go, after the world's end. So the callers that hold a world
(``spawn``, ``spawn_async``, and the harness's worlds, which the process-harness drop-in
and ``aiocoll run`` run on) enter the scope themselves, with ``collect``, and let the
world go before it ends: its end collects once more, still looking only at what was made
since it began (milliseconds), and the engine dies then. What piles up still (garbage
made between worlds; an engine a caller keeps) a world's start collects, every
generation, once the process's memory (RSS, and CUDA's allocated memory) grew by
``GROWTH_MB`` since the last such collection, or since the first world ended (what
that one grew by is first-use set-ups: imports, torch's caches), more while such
collections find little (caches grow too), or once ``ENGINES`` ended worlds' engines
are still alive: a cost shared by many worlds, none where nothing piles up.
Before that reading, a world's start gives the C allocator's free pages back to the
system (glibc's ``malloc_trim``, 1-2 ms) once the resident set grew by ``TRIM_MB``
since it last did: what a world frees in C++ (threads, tensors, torch's objects) stays
in glibc's arenas otherwise, in pieces too small for the next world's allocations, and
the resident set grew 40-70 KB a world with nothing kept (torch 2.10, the pytest
plugin), which also set off full collections that found nothing.
A world that runs longer than ``FREEZE_SECONDS`` gives the objects back then, and its
end costs a full collection: it is long enough that this is a small part of it.
The scope sets nothing aside when some other code froze objects already
(``gc.get_freeze_count()``), as its end would unfreeze them too: a world's end then costs
a full collection, as before. Worlds side by side (threads, nested worlds) share one
scope: the first freezes, the last to end unfreezes.

>>> import torch.distributed as dist
>>> b = Belongings()
>>> store = dist.HashStore()
>>> b.add("store", store)
>>> [what.split()[0] for what in b.release()]    # still referenced here: kept, and named
['store']
>>> del store
>>> b.release()
[]
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from types import CodeType, FrameType, FunctionType, ModuleType, TracebackType
from typing import Literal

import torch

from .. import _collector, _patches, _torch

__all__ = ["Belongings", "Kind", "world_scope"]

Kind = Literal["group", "native group", "store", "mesh"]
"""aiocoll's process groups, those of torch's backends (gloo, ...), stores, meshes."""

_REACH_LIMIT = 100_000  # objects looked at from a world's results, at most (about 10 ms)
# not followed from a result: what leads to a module's globals (so, everything) rather than to it
_NOT_FOLLOWED = (type, ModuleType, FunctionType, CodeType, FrameType, TracebackType)


class Belongings:
    """The process groups, stores and meshes one world's ranks made (weak references)."""

    __slots__ = ("_meshes", "_refs")

    def __init__(self) -> None:
        # appended to by rank threads at once: list.append is atomic, no lock needed
        self._refs: list[tuple[Kind, weakref.ref[object]]] = []
        self._meshes: list[weakref.ref[object]] = []

    def add(self, kind: Kind, obj: object) -> None:
        """Record ``obj``, made by one of the world's ranks."""
        ref = weakref.ref(obj)
        self._refs.append((kind, ref))
        if kind == "mesh":
            self._meshes.append(ref)

    def _all_reached_from(self, results: object) -> bool:
        """Whether every recorded object still alive is reached from ``results`` (looking at a bounded part)."""
        wanted = {id(obj) for _, obj in self.alive()}
        seen: set[int] = set()
        todo = deque([results])
        while todo and wanted and len(seen) < _REACH_LIMIT:
            obj = todo.popleft()  # breadth first: a result's mesh is a few steps away
            # type(), not isinstance(): some of torch's objects warn when asked for __class__
            if id(obj) in seen or issubclass(type(obj), _NOT_FOLLOWED):
                continue
            seen.add(id(obj))
            wanted.discard(id(obj))
            todo += gc.get_referents(obj)
        return not wanted

    def _count_alive(self) -> int:
        return sum(1 for _, ref in self._refs if ref() is not None)

    def alive(self) -> list[tuple[Kind, object]]:
        """The recorded objects still alive."""
        return [(kind, obj) for kind, ref in self._refs if (obj := ref()) is not None]

    def release(self, results: object = None) -> list[str]:
        """Free what the world made (see the module); the objects still alive after that, described.

        ``results``: what the world returned, which may keep some of them alive.
        """
        # (no `m := ref()` in a comprehension: `m` would be a name of this frame, keeping
        # the last mesh alive through the collections below, which then never free it)
        meshes = [ref() for ref in self._meshes]
        if any(m is not None for m in meshes):
            _torch.drop_mesh_caches([m for m in meshes if m is not None])
        del meshes
        if self._count_alive():
            gc.collect(1)
            if self._count_alive() and not self._all_reached_from(results):
                gc.collect()
        self._refs = [(kind, ref) for kind, ref in self._refs if ref() is not None]
        self._meshes = [ref for ref in self._meshes if ref() is not None]
        return [f"{kind} {obj!r}" for kind, obj in self.alive()]

    def __repr__(self) -> str:
        return f"<Belongings {len(self._refs)} recorded, {len(self.alive())} alive>"


# -- what a world's end collects: what was made while it ran ------------------------------

ENGINES = 32  # ended worlds whose engines still live (cycles): a full collection at a world's start
# (the plugin's and the threaded harness's engines; spawn's and the harness's die at the end)
GROWTH_MB = 8.0  # or the memory grown since the last one (RSS, and CUDA's allocated memory),
# times _growth_factor: doubled (up to MAX_FACTOR) each time such a collection finds fewer
# than LITTLE unreachable objects, the growth having been caches, not garbage (torch's
# DTensor tests grow 8 MB every 20-40 tests and such a collection found 200-8,000 objects,
# 0.2 s each: a fifth of the drop-in's time on them); back to 1 when one finds a pile
MAX_FACTOR = 32
LITTLE = 20_000
_growth_factor = 1

# A world that runs longer gives the objects it set aside back before its end, which
# then costs a full collection (0.2 s: a tenth of such a world at most). While objects
# are set aside, gc.get_referrers() and gc.get_objects() do not see them (hypothesis's
# register_random, for one, then warns of a generator no one keeps), and a world whose
# rank is stuck (left running by a test's timeout) would keep them aside for good.
FREEZE_SECONDS = 2.0

_scope_lock = threading.Lock()
_collect_last = False  # whether the last scope to end collects before giving the objects back
_froze = False  # whether the first of them set the older objects aside (gc.freeze)
_epoch = 0  # counts the times they were set aside (a late thaw must not give back a later world's)
_thaw_pending = False  # whether a world's loop will give them back after FREEZE_SECONDS
_ended: list[weakref.ref[object]] = []  # the engines of worlds that ended since that collection
_memory_then: float | None = None  # the memory after it, MB
TRIM_MB = 4.0  # the resident set grown since the allocator's free pages were last given back, MB
_trimmed_at: float | None = None  # the resident set then, MB


def _rss_mb() -> float:
    """The process's resident set, MB (Linux; else 0)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _memory_mb() -> float:
    """The process's memory, MB: its resident set and CUDA's allocated memory (if in use)."""
    mb = _rss_mb()
    # (never initialises CUDA, nor asks the driver for devices at every world's start:
    # only a process that uses CUDA, so has it initialised, has its memory to count)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        mb += sum(torch.cuda.memory_allocated(d) for d in range(torch.cuda.device_count())) / 2**20
    return mb


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # (TypeError: Windows, which has no CDLL(None))
        return None
    return trim


_TRIM = _malloc_trim()


def _give_free_pages_back(*, grown_by: float = TRIM_MB) -> None:
    """The allocator's free pages back to the system, once the resident set grew by ``grown_by`` MB (see the module)."""
    global _trimmed_at
    if _TRIM is None:
        return
    now = _rss_mb()
    if _trimmed_at is None or now - _trimmed_at >= grown_by:
        _TRIM(0)
        _trimmed_at = _rss_mb()


def _collect_between_worlds() -> None:
    """Before the older objects are set aside: collect them all, when engines or memory piled up (see the module)."""
    global _ended, _memory_then, _growth_factor
    _ended = [ref for ref in _ended if ref() is not None]
    engines = len(_ended) >= ENGINES
    # (the measure starts once the first world ended: what it grew by is first-use set-ups, imports and
    # torch's caches, which a collection at the second world's start walked all objects to find not garbage)
    if engines or (_memory_then is not None and _memory_mb() - _memory_then > GROWTH_MB * _growth_factor):
        found = gc.collect()
        if not engines:
            _growth_factor = min(_growth_factor * 2, MAX_FACTOR) if found < LITTLE else 1
        _ended = []  # (an engine still alive now is its caller's: it is no garbage to wait for)
        _give_free_pages_back(grown_by=0)  # (what that collection freed, too)
        _memory_then = _memory_mb()


@contextlib.contextmanager
def world_scope(
    loop: asyncio.AbstractEventLoop | None = None, *, collect: bool = False
) -> Iterator[Callable[[object], None]]:
    """Around a world's run: a full collection looks only at what was made since it started.

    See the module. Enter it before the world's first object is made; leave it after
    ``release()`` ran. It gives ``watch(engine)``: the world's engine, whose life after
    the world decides when a later start collects. On ``loop`` (the world's), the
    objects set aside are given back after ``FREEZE_SECONDS`` if the world still runs.

    ``collect``: for the caller that holds the world (``spawn``, the harness's world) and
    lets it go before the scope ends: the last scope to end then collects what was made
    since the first began, the older objects still set aside (milliseconds), so that the
    world's engine, its reference cycles and what only they keep die then, as a process's
    would, instead of piling up until a collection between worlds.
    """
    global _thaw_pending, _collect_last, _memory_then
    engines: list[object] = []
    thaw: asyncio.TimerHandle | None = None
    with _scope_lock:
        _give_free_pages_back()  # (first: what the worlds before freed is no growth)
        _patches.acquire(SET_ASIDE)  # (the first scope sets the older objects aside)
        if _froze and loop is not None and not _thaw_pending:
            # (the first scope with a loop: spawn's own begins before its loop exists)
            thaw = loop.call_later(FREEZE_SECONDS, _thaw, _epoch)
            _thaw_pending = True
    try:
        yield engines.append
    finally:
        if thaw is not None:
            thaw.cancel()  # (on the loop's thread: a world's scope ends on its loop)
        with _scope_lock:
            if thaw is not None:
                _thaw_pending = False
            _ended.extend(weakref.ref(e) for e in engines)
            del engines[:]
            _collect_last = collect  # (what the last scope to end asks for is what its release does)
            _patches.release(SET_ASIDE)
            if _memory_then is None:
                _memory_then = _memory_mb()


def _set_aside() -> Callable[[], None]:
    """The first scope: the older objects set aside, unless someone else froze objects already."""
    global _froze, _epoch, _thaw_pending
    # someone else's frozen objects: gc.unfreeze() at the end would release them too
    _froze = _collector.none_frozen()
    if _froze:
        _collect_between_worlds()
        gc.freeze()
        _epoch += 1
        _thaw_pending = False
    return _give_back


def _give_back() -> None:
    """The last scope ended: collect what was made meanwhile (if it asks), then give the older objects back."""
    global _froze
    if _froze:
        if _collect_last:
            gc.collect()
        _froze = False
        gc.unfreeze()  # back into the oldest generation, as a whole


SET_ASIDE = _patches.PatchSet(
    "older objects set aside",
    "while worlds run, the objects older than the first are frozen (gc.freeze), so that a world's end "
    "collects only what was made since (milliseconds, not a full collection)",
    lambda key: [_patches.Step("gc.freeze", _set_aside)],
    ["gc.freeze"],
)


def _thaw(epoch: int) -> None:
    """The world that set the older objects aside ``epoch`` still runs: give them back now."""
    global _froze
    with _scope_lock:
        if _froze and epoch == _epoch:
            _froze = False
            gc.unfreeze()
