"""Thread-local bindings that a rank's threads carry over, set and restored in one place.

The modules that keep per-rank state in a ``threading.local`` (environment, logging,
``__main__``, ``random``, output) each hand the threads a rank starts a context factory
made here; ``_procstate.RankThreads`` enters them in the new thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

__all__ = ["carry"]


def carry(local: threading.local, **values: object) -> Callable[[], AbstractContextManager[None]]:
    """A context factory that binds ``local``'s attributes to ``values`` in its block, then restores them.

    Restores rather than clears: a pool thread runs one rank's task after another's.

    >>> local = threading.local()
    >>> with carry(local, rank=3)():
    ...     local.rank
    3
    >>> getattr(local, "rank", None) is None
    True
    """

    @contextlib.contextmanager
    def bound() -> Iterator[None]:
        before = {name: getattr(local, name, None) for name in values}
        for name, value in values.items():
            setattr(local, name, value)
        try:
            yield
        finally:
            for name, value in before.items():
                setattr(local, name, value)

    return bound
