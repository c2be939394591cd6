"""aiocoll: collective communication for PyTorch inside asyncio.

Run ``async def fn(comm)`` on many ranks of one event loop; every collective is an
awaitable rendezvous, and mismatches, deadlocks and failed ranks are reported at once::

    import torch, aiocoll

    async def worker(comm):
        t = torch.ones(3) * comm.rank
        await comm.all_reduce(t)
        return t

    results = aiocoll.spawn(worker, world=4)
"""

from importlib.metadata import PackageNotFoundError, version

from . import _collector, _patches

# (the collector paused while aiocoll, and torch with it, imports: see _collector)
with _patches.lease(_collector.PAUSED):
    from ._bridge._pg import from_process_group
    from ._c10d._backend import register, settle
    from ._comm import Comm
    from ._diagnostics._frdump import dump_flight_recorder
    from ._engine._engine_comm import rank_generator
    from ._engine._faults import Fault, InjectedFault, OpInfo
    from ._errors import (
        AiocollError,
        BlockingCallError,
        CollectiveMismatchError,
        CollectiveTimeoutError,
        DeadlockError,
        GroupTimeoutError,
        InvalidArgumentError,
        RankExitedError,
        TorchCompatError,
        WorldAbortedError,
    )
    from ._lifecycle._config import DEFAULT_RECORD, DEFAULT_TIMEOUT
    from ._spawn import SeedFailure, find_failing_seed, spawn, spawn_async
    from ._stats import RankStatistics, Statistics
    from ._work import Work

register()  # the torch.distributed backend "aiocoll"

try:
    __version__ = version("aiocoll")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_RECORD",
    "DEFAULT_TIMEOUT",
    "AiocollError",
    "BlockingCallError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Comm",
    "DeadlockError",
    "Fault",
    "GroupTimeoutError",
    "InjectedFault",
    "InvalidArgumentError",
    "OpInfo",
    "RankExitedError",
    "RankStatistics",
    "SeedFailure",
    "Statistics",
    "TorchCompatError",
    "Work",
    "WorldAbortedError",
    "__version__",
    "dump_flight_recorder",
    "find_failing_seed",
    "from_process_group",
    "rank_generator",
    "settle",
    "spawn",
    "spawn_async",
]
