"""What each sync rank has of its own that Python and torch keep process-wide: random generators, module hooks.

In W processes every rank has its own torch generators, Python ``random`` and NumPy
global generator. Rank threads of one process share them, so "seed, then build the model"
builds a different model on each rank whenever the threads interleave. Sync ranks take
turns (see ``_turns``), and this module gives each its own generators:

- torch's CPU generator (and each CUDA device's, once CUDA is initialised) cannot be
  made per thread: the rank that takes its turn swaps its state in (about 2 us, only
  when another rank ran meanwhile; ``_TorchStates`` says how states are kept);
- Python's ``random`` and NumPy's global ``RandomState`` are reached through module
  functions (``random.random``, ``np.random.seed``...): while a world with per-rank
  generators runs, those functions are replaced by ones that draw from the calling
  rank's own instance (saving and restoring their states at each turn would cost 10 and
  60 us). Code outside any rank still reaches the process's instances.

torch.nn's global module hooks (``register_module_forward_hook`` and the like, which
``CommDebugMode`` and ``ModTracker`` use) are module globals too, and so is torch's
default dtype (``torch.set_default_dtype``): the rank that takes its turn puts its own
in force (a few attribute writes), so that each rank's hooks see its modules only
and its new tensors get its dtype.

Under ``spawn`` every rank starts with a copy of the states of the thread that called it
(as a forked process would); that thread gets its own states back when the world ends.
Worlds that stand for processes started fresh (``aiocoll run``, ``mp.spawn`` in it, the
process-harness drop-in) give each rank a seed of its own instead (``Seeds``), as torch,
``random`` and NumPy seed themselves anew in each fresh process.

>>> import random, torch, aiocoll
>>> def worker(comm):
...     torch.manual_seed(0)
...     random.seed(comm.rank)
...     return torch.randn(3).tolist(), random.random()
>>> out = aiocoll.spawn(worker, world=4)
>>> all(t == out[0][0] for t, _ in out), [r for _, r in out] == [random.Random(r).random() for r in range(4)]
(True, True)
"""

from __future__ import annotations

import hashlib
import importlib
import random
import secrets
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from .. import _current, _patches, _torch

__all__ = ["NUMPY_RANDOM", "RANDOM", "RankLocals", "Seeds"]


@dataclass(frozen=True)
class Seeds:
    """Where a world's per-rank seeds come from: ``base`` (given, or drawn afresh) and ``salt`` (which world).

    Each rank's seed is a hash of the three, 63 bits: the same ``base`` gives the same
    seeds again, which replays what the ranks drew.

    >>> Seeds(7, "attempt 0").of(3) == Seeds(7, "attempt 0").of(3)
    True
    >>> len(set(Seeds(7, "attempt 0").of(4)) | set(Seeds(7, "attempt 1").of(4)))
    8
    """

    base: int
    salt: str = ""
    given: bool = True  # the user chose ``base`` (``--seed``), rather than the system's entropy

    @classmethod
    def fresh(cls, salt: str = "") -> Seeds:
        """Seeds from the system's entropy, as a fresh process's generators get theirs."""
        return cls(secrets.randbits(63), salt, given=False)

    def of(self, size: int) -> tuple[int, ...]:
        """One seed per rank."""
        return tuple(self.seed(rank) for rank in range(size))

    def seed(self, rank: int) -> int:
        digest = hashlib.blake2b(f"{self.base}/{self.salt}/{rank}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 1

    def attempt(self, restart: int) -> Seeds:
        """The seeds of a run's attempt ``restart`` (0: the first), in one process and in processes alike."""
        return self.then(f"attempt {restart}")

    def then(self, salt: str) -> Seeds:
        """The seeds of another world of the same run (an mp.spawn inside it, the next attempt)."""
        return Seeds(self.base, f"{self.salt}/{salt}", self.given)


def seeded_states(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's CPU generator state, and each initialised CUDA device's, as ``torch.manual_seed(seed)`` makes them."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    return cpu, [torch.Generator(device=g.device).manual_seed(seed).get_state() for g in _cuda_generators()]


def numpy_seed(seed: int) -> list[int]:
    """The words NumPy's ``RandomState``/``seed`` take, from a rank's seed (another key than ``random``'s:
    both are Mersenne Twisters seeded by an array of words, and would draw the same numbers)."""
    digest = hashlib.blake2b(f"numpy/{seed}".encode(), digest_size=8).digest()
    return [int.from_bytes(digest[:4], "big"), int.from_bytes(digest[4:], "big")]


def _cuda_generators() -> list[torch.Generator]:
    """Each CUDA device's default generator, once CUDA is initialised (never initialises it)."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return []
    return list(torch.cuda.default_generators)


class _TorchStates:
    """torch's process-wide generators, one saved state per rank; the current owner's are loaded.

    The CPU generator's state comes out of torch as a fresh 5 KB tensor (``get_state``),
    and torch allocates tensors with ``posix_memalign``. glibc before 2.39 (bug 30723)
    puts the spare bytes of each aligned allocation in the calling thread's cache of
    small free blocks, where they keep the 5 KB, once freed, from being reused, for up
    to about seven allocations per thread. Taken in every rank thread at every hand-over,
    the states cost 45 KB per rank (45 MB at W=1024, peak RSS). So a rank's state is saved
    as a copy of the generator (``clone_state``: a plain allocation, no tensor), and
    the copies are turned into the tensors ``set_state`` loads in one thread, the
    keeper's: the first rank to take a turn does it for every rank's copy as it takes
    its own turn (a rank whose copy the keeper has not reached turns its own).
    """

    __slots__ = ("_cpu", "_cuda", "_ended", "_fresh_cuda", "_keeper", "_pending", "_seeds")

    def __init__(
        self, size: int, cpu: torch.Tensor, cuda: list[torch.Tensor], seeds: Sequence[int] | None = None
    ) -> None:
        self._seeds = seeds
        if seeds is None:
            # every rank starts from the states of the thread that called spawn: one tensor
            # for all, as set_state only reads it (and nothing here updates a state in place)
            self._cpu = [cpu] * size
            self._cuda: list[list[torch.Tensor] | None] = [list(cuda) for _ in range(size)]
        else:
            states = [seeded_states(s) for s in seeds]
            self._cpu = [c for c, _ in states]
            self._cuda = [g for _, g in states]
        self._fresh_cuda: list[torch.Tensor] | None = None
        self._pending: dict[int, torch.Generator] = {}  # saved states not yet turned into tensors
        self._keeper: int | None = None  # the rank whose thread turns them into tensors
        self._ended = [False] * size  # ranks whose threads have ended: their states are not kept

    def switch(self, old: int | None, new: int) -> None:
        """Save rank ``old``'s states (None: nobody's are loaded), then load rank ``new``'s."""
        gens = _cuda_generators()
        if old is not None and not self._ended[old]:
            self._pending[old] = torch.default_generator.clone_state()  # no tensor: see the class
            if gens:
                self._cuda[old] = [g.get_state() for g in gens]  # (16 bytes each)
        if self._keeper is None:
            self._keeper = new
        if new == self._keeper:
            pending, ended = self._pending, self._ended
            for rank, gen in pending.items():
                if not ended[rank]:
                    self._to_tensor(rank, gen)
            pending.clear()
        else:
            own = self._pending.pop(new, None)
            if own is not None:  # the keeper did not run since this rank's last turn
                self._to_tensor(new, own)
        self._load(new, gens)

    def _to_tensor(self, rank: int, gen: torch.Generator) -> None:
        self._cpu[rank] = gen.get_state()

    def ended(self, rank: int) -> None:
        """Rank ``rank``'s thread ends: its states are dropped; if it was the keeper, the next to take a turn is.

        Only marks: a rank that ends while others run at once (after an abort, or
        detached) must not change ``_pending`` under a switch going through it.
        """
        self._ended[rank] = True
        if rank == self._keeper:
            self._keeper = None

    def _load(self, rank: int, gens: list[torch.Generator]) -> None:
        torch.default_generator.set_state(self._cpu[rank])
        if gens:
            states = self._cuda[rank]
            if not states or len(states) != len(gens):
                # CUDA was initialised after this rank last ran: it starts as a new
                # process would, at torch's default seed (or the rank's own)
                states = self._fresh(gens) if self._seeds is None else seeded_states(self._seeds[rank])[1]
            for g, s in zip(gens, states, strict=True):
                g.set_state(s)

    def _fresh(self, gens: list[torch.Generator]) -> list[torch.Tensor]:
        if self._fresh_cuda is None or len(self._fresh_cuda) != len(gens):
            self._fresh_cuda = [torch.Generator(device=g.device).get_state() for g in gens]
        return self._fresh_cuda


# -- module-level random functions that draw from the calling rank's own instance ----------


def _bound_to(module: ModuleType, instance: object) -> list[str]:
    """The names of ``module``'s functions that are methods bound to ``instance``."""
    return [n for n, v in vars(module).items() if getattr(v, "__self__", None) is instance]


def _dispatchers(module: ModuleType, instance: object, extra: dict[str, str], key: str) -> list[_patches.Attr]:
    """The changes that make ``module``'s functions bound to its global instance draw from the calling rank's.

    ``key``: which instances of a ``RankLocals`` they read. Functions that are not bound
    methods but reach the global instance inside (numpy's ``seed``) are in ``extra``,
    dispatched to the method of the same role.
    """
    names = {n: n for n in _bound_to(module, instance)} | extra
    return [
        _patches.Attr(module, name, _dispatcher(getattr(module, name), name, method, key))
        for name, method in names.items()
    ]


def _dispatcher(fallback: Callable[..., object], name: str, method: str, key: str) -> Callable[..., object]:
    def dispatch(*args: object, **kwargs: object) -> object:
        bound = _GENERATORS.get()
        if bound is None:  # not a rank thread of a world with per-rank generators
            return fallback(*args, **kwargs)
        instances = getattr(bound[0], key)
        if not instances:  # numpy imported since the rank last took its turn
            return fallback(*args, **kwargs)
        inst = instances[bound[1]]
        if inst is None:  # made on the rank's first use: a world starts without W of them
            inst = bound[0].make(key, bound[1])
        return getattr(inst, method)(*args, **kwargs)

    dispatch.__name__ = dispatch.__qualname__ = name
    dispatch.__doc__ = getattr(fallback, "__doc__", None)
    dispatch.__wrapped__ = fallback  # type: ignore[attr-defined]
    return dispatch


# which (RankLocals, rank) the calling thread draws from, set by bind() in each rank thread;
# the threads a rank starts draw from its generators too, as threads share their process's
# (torch's generators are the rank's only while it holds the turn: they are swapped as
# ranks take turns, and a thread does not take turns)
_GENERATORS: _current.Facet[tuple[RankLocals, int] | None] = _current.Facet("generators", None, carried=True)


RANDOM = _patches.PatchSet(
    "random per rank",
    "random's module functions draw from the calling sync rank's own random.Random",
    lambda key: _dispatchers(random, random._inst, {}, "python"),
    ["random.*"],
)


def _numpy_dispatchers(key: object) -> list[_patches.Attr]:
    nr = _numpy_random()
    if nr is None:
        return []
    extra = {"seed": "seed", "ranf": "random_sample", "sample": "random_sample"}
    return _dispatchers(nr, nr.mtrand._rand, {k: v for k, v in extra.items() if hasattr(nr, k)}, "numpy")


NUMPY_RANDOM = _patches.PatchSet(
    "numpy.random per rank",
    "numpy.random's module functions draw from the calling sync rank's own RandomState (once numpy is imported)",
    _numpy_dispatchers,
    ["numpy.random.*"],
)


def _numpy_random() -> ModuleType | None:
    """``numpy.random`` if numpy is imported (aiocoll never imports it)."""
    return sys.modules.get("numpy.random")


class RankLocals:
    """The random generators of a world's sync ranks; swapped in as ranks take turns.

    Made on the thread that calls ``spawn``, whose states every rank starts from. Only
    the rank that holds the turn calls ``switch``; ``close`` gives the caller its states
    back.
    """

    __slots__ = (
        "_caller",
        "_caller_cuda",
        "_caller_dtype",
        "_caller_hooks",
        "_closed",
        "_dtypes",
        "_hooks",
        "_initial",
        "_loaded",
        "_numpy_installed",
        "_torch",
        "numpy",
        "python",
        "seeds",
        "size",
    )

    def __init__(self, size: int, seeds: Sequence[int] | None = None) -> None:
        self.size = size
        self.seeds = None if seeds is None else tuple(seeds)  # each rank's own (None: a copy of the caller's)
        self._caller = torch.default_generator.get_state()
        self._caller_cuda = [g.get_state() for g in _cuda_generators()]
        self._torch = _TorchStates(size, self._caller, self._caller_cuda, self.seeds)
        self._loaded: int | None = None  # whose torch states the generators (and hooks) hold now
        self._caller_hooks = _torch.module_hooks.read()
        self._hooks: list[dict[str, object] | None] = [None] * size  # each rank's, from its first turn
        self._caller_dtype = torch.get_default_dtype()
        self._dtypes = [self._caller_dtype] * size
        # each rank's instances start from these states, made on its first draw
        self._initial: dict[str, tuple[object, ...]] = {"python": random.getstate()}
        self.python: list[random.Random | None] = [None] * size
        self.numpy: list[object] = []  # (numpy's RandomState or None; numpy is no dependency)
        self._numpy_installed = False
        self._closed = False
        _patches.acquire(RANDOM)
        if self.seeds is not None and "numpy" in sys.modules:
            # (torch imports numpy, not its lazy numpy.random: a rank's first draw would
            # come from the process's generator, before the next turn tracks it; by name:
            # numpy is never aiocoll's dependency, only used where torch loaded it)
            importlib.import_module("numpy.random")
        self._track_numpy()

    def _track_numpy(self) -> None:
        """Give each rank its own NumPy global generator, once numpy is imported."""
        nr = _numpy_random()
        if nr is None or self._numpy_installed:
            return
        glob = nr.mtrand._rand
        self._initial["numpy"] = glob.get_state()
        self.numpy = [None] * self.size
        _patches.acquire(NUMPY_RANDOM)
        self._numpy_installed = True

    def make(self, key: str, rank: int) -> object:
        """Rank ``rank``'s own ``random.Random`` (key "python") or NumPy ``RandomState`` ("numpy")."""
        seed = None if self.seeds is None else self.seeds[rank]
        if key == "python":
            py = random.Random(seed)
            if seed is None:
                py.setstate(self._initial[key])
            inst: object = py
        else:
            nr = _numpy_random()
            assert nr is not None
            np_inst = nr.RandomState(None if seed is None else numpy_seed(seed))
            if seed is None:
                np_inst.set_state(self._initial[key])
            inst = np_inst
        getattr(self, key)[rank] = inst
        return inst

    def bind(self, rank: int) -> None:
        """In rank ``rank``'s thread, before its code runs: module functions draw from its instances."""
        _GENERATORS.set((self, rank))

    def unbind(self, rank: int) -> None:
        """In rank ``rank``'s thread, as it ends (holding its turn, unless the world was aborted)."""
        _GENERATORS.set(None)
        self._torch.ended(rank)

    def switch(self, rank: int) -> None:
        """Rank ``rank`` takes its turn: load its generator states (after saving the last owner's)."""
        if self._loaded != rank:
            self._torch.switch(self._loaded, rank)
            hooks = _torch.module_hooks
            dtype = torch.get_default_dtype()
            if self._loaded is not None:
                self._hooks[self._loaded] = hooks.read()
                self._dtypes[self._loaded] = dtype
            if dtype is not self._dtypes[rank]:
                torch.set_default_dtype(self._dtypes[rank])
            mine = self._hooks[rank]
            if mine is None:
                mine = self._hooks[rank] = hooks.copy(self._caller_hooks)
            hooks.write(mine)
            self._loaded = rank
        if not self._numpy_installed and "numpy.random" in sys.modules:
            self._track_numpy()

    def close(self) -> None:
        """The world ended: the calling thread gets its states back; the module functions too."""
        if self._closed:
            return
        self._closed = True
        torch.default_generator.set_state(self._caller)
        _torch.module_hooks.write(self._caller_hooks)
        self._hooks = [None] * self.size
        torch.set_default_dtype(self._caller_dtype)
        gens = _cuda_generators()
        if self._caller_cuda and len(gens) == len(self._caller_cuda):
            for g, st in zip(gens, self._caller_cuda, strict=True):
                g.set_state(st)
        if self._numpy_installed:
            _patches.release(NUMPY_RANDOM)
        _patches.release(RANDOM)

    def __repr__(self) -> str:
        seeded = "copied" if self.seeds is None else "seeded"
        return f"<RankLocals size={self.size} {seeded} loaded={self._loaded} numpy={self._numpy_installed}>"
