"""Op semantics: pure data movement over the calls of every rank of one collective.

Each collective is a small class whose instance is one rank's call (its arguments).
The engine collects the calls of all ranks of a group in group-rank order, checks that
their ``signature()`` agree, then calls ``check(calls)`` (cross-rank consistency) and
``run(calls)`` (the data movement, returning each rank's result). Nothing here knows
about event loops, so every op can be tested by calling ``run`` directly::

    >>> import torch
    >>> a, b = torch.tensor([1.0]), torch.tensor([2.0])
    >>> AllReduce.run([AllReduce(a, Reduction.of("sum")), AllReduce(b, Reduction.of("sum"))])
    [None, None]
    >>> a, b
    (tensor([3.]), tensor([3.]))

Every ``run`` reads all inputs into fresh tensors before it writes any output, so an
output that aliases an input (in-place all_gather, reduce_scatter into a chunk of the
input) gets the right answer.

The ops live in modules by kind (``_tensors``, ``_objects``, ``_p2p``), on a shared base
(``_base``); this face names them all, and keeps the registry of collectives by name.
"""

from __future__ import annotations

from collections.abc import Hashable

from ._base import Call, OpRecord, P2PRecord, Shape, Sig, _Base
from ._objects import (
    AllGatherObject,
    BroadcastObject,
    GatherObject,
    NewGroup,
    Partition,
    ScatterObject,
    Split,
    dumps,
)
from ._p2p import Recv, Send, check_transfer, transfer
from ._reduce import Reduction, checked_reduction, reduce_tensors
from ._tensors import (
    AllGather,
    AllGatherIntoTensor,
    AllReduce,
    AllToAll,
    AllToAllSingle,
    Barrier,
    Broadcast,
    Gather,
    Reduce,
    ReduceScatter,
    ReduceScatterTensor,
    Scatter,
)

__all__ = [
    "OPS",
    "AllGather",
    "AllGatherIntoTensor",
    "AllGatherObject",
    "AllReduce",
    "AllToAll",
    "AllToAllSingle",
    "Barrier",
    "Broadcast",
    "BroadcastObject",
    "Call",
    "Gather",
    "GatherObject",
    "NewGroup",
    "OpRecord",
    "P2PRecord",
    "Partition",
    "Recv",
    "Reduce",
    "ReduceScatter",
    "ReduceScatterTensor",
    "Reduction",
    "Scatter",
    "ScatterObject",
    "Send",
    "Shape",
    "Sig",
    "Split",
    "check_transfer",
    "checked_reduction",
    "dumps",
    "record_of",
    "reduce_tensors",
    "transfer",
]


OPS: tuple[type[_Base], ...] = (
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    AllGatherIntoTensor,
    Gather,
    Scatter,
    ReduceScatter,
    ReduceScatterTensor,
    AllToAll,
    AllToAllSingle,
    Barrier,
    BroadcastObject,
    AllGatherObject,
    GatherObject,
    ScatterObject,
    NewGroup,
    Split,
)

_OPS_BY_NAME: dict[str, type[_Base]] = {op.name: op for op in OPS}


def record_of(sig: Hashable) -> OpRecord | P2PRecord | None:
    """How records show a call of signature ``sig``; None if no op made it.

    ``sig`` is a collective's ``signature()`` (maybe another process's: signatures travel
    in cross-process reports) or a p2p call's ``record_info()``.
    """
    if isinstance(sig, P2PRecord):
        return sig
    if isinstance(sig, str):
        sig = (sig,)
    if not (isinstance(sig, tuple) and sig and isinstance(sig[0], str)):
        return None
    op = _OPS_BY_NAME.get(sig[0])
    return None if op is None else op.record(sig)
