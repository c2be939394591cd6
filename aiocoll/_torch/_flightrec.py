"""torch's Flight Recorder: the dump format its analyzer reads (``aiocoll._diagnostics._frdump``
writes dumps for it), and which entries it parses (torch 2.10-2.15)."""

from __future__ import annotations

import functools

from ._compat import _C

__all__ = ["fr_accepts", "fr_format_version"]


@functools.cache
def fr_format_version() -> str:
    """The dump format version this torch's own Flight Recorder writes ("2.10" on 2.10-2.15).

    ``_dump_fr_trace`` (2.10-2.15) returns a pickled, empty dump when nothing is recorded;
    the analyzer checks that every rank's file carries the same version string.
    """
    import pickle

    try:
        dump = pickle.loads(_C._dump_fr_trace(includeCollectives=False, includeStackTraces=False, onlyActive=True))
        version = dump["version"]
    except (AttributeError, RuntimeError, TypeError, KeyError, pickle.UnpicklingError):
        return "2.10"
    return str(version)


@functools.cache
def fr_accepts(profiling_name: str) -> bool:
    """Whether this torch's ``fr_trace`` parses an entry named ``profiling_name``.

    Its ``Op`` class (2.10-2.15) names what it reads: 2.10 knows the "nccl" and "xccl"
    libraries only and no "barrier"; a recv from any source ("recv 1<-?") parses from
    2.15 on. An entry it cannot parse would stop the whole analysis, so aiocoll asks first.
    """
    try:
        from torch.distributed.flight_recorder.components.types import Op
    except ImportError:
        return profiling_name.startswith("nccl:")
    event = {
        "profiling_name": profiling_name,
        "state": "scheduled",
        "process_group": ("0", "undefined"),
        "input_sizes": [[1]],
        "output_sizes": [[1]],
        "input_dtypes": ["Float"],
        "output_dtypes": ["Float"],
        "collective_seq_id": 0,
        "p2p_seq_id": 0,
        "time_created_ns": 0,
    }
    try:
        Op(event, {"0": {0, 1}}, "0")
    except (AssertionError, ValueError, IndexError, KeyError):
        return False
    return True
