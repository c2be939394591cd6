"""The garbage collector while aiocoll imports: paused, and what the imports made put with the old.

With torch loaded, each full collection walks torch's half a million objects (50-80 ms
on a 2-core machine), and finds next to nothing: importing torch sets off two, and the
objects aiocoll's own import makes a third, which is why ``aiocoll run`` took 0.2 s
more than ``python -c "import torch.distributed"``, and ``import aiocoll`` that much
more than its modules' own code. So ``import aiocoll`` (torch's import with it, when it
comes first) and ``aiocoll run``'s reading of torchrun's parser run with the collector
paused (``PAUSED``), and at the end what they made joins the oldest generation at once
(``gc.freeze()`` then ``gc.unfreeze()``: whole lists moved, no object walked), as if it
had survived the young collections, which then never walk it again. Garbage among it
(little: imports keep what they make) waits for the next full collection. That one is
put off, not saved: the interpreter's count of old objects is not told of the move, so
a program that goes on allocating makes its first full collection sooner than it
otherwise would (0.1-0.15 s, then as before); a short run (``aiocoll run`` of a small
script) ends before it, 0.1-0.15 s sooner.

Where some other code froze objects (its own ``gc.freeze()``, or a world's, which sets
older objects aside while it runs), nothing is moved, as ``gc.unfreeze()`` would give
theirs back too: the collector only resumes.

>>> import gc
>>> with _patches.lease(PAUSED):
...     paused = not gc.isenabled()
>>> paused, gc.isenabled()
(True, True)
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

from . import _patches

__all__ = ["PAUSED", "STARTUP_FROZEN", "none_frozen"]

# What the interpreter itself froze as it started: CPython 3.12 keeps the immortal base and
# MRO tuples of its static types there (375 on 3.12.1; none on 3.11 and 3.13). Those are
# no one's to keep frozen (immortal, never collected): unfreezing them is harmless, and
# a count of exactly that many is no sign of another user of gc.freeze(). (Read on 3.12
# alone: elsewhere a count at import is a program's own gc.freeze(), to be left alone.)
STARTUP_FROZEN = gc.get_freeze_count() if sys.version_info[:2] == (3, 12) else 0


def none_frozen() -> bool:
    """Whether no code froze objects (``gc.freeze()``): the interpreter's own at start-up aside.

    A walk of the permanent generation.
    """
    return gc.get_freeze_count() in (0, STARTUP_FROZEN)


def _pause() -> Callable[[], None]:
    if not gc.isenabled():  # (paused already: by whoever paused it, to resume)
        return lambda: None
    gc.disable()
    return _resume


def _resume() -> None:
    # (a world that set objects aside between the count and the unfreeze, from another thread,
    # gets them back early, as a long world does (_belongings._thaw): slower, never wrong)
    if none_frozen():
        gc.freeze()
        gc.unfreeze()  # into the oldest generation, as a whole
    gc.enable()


PAUSED = _patches.PatchSet(
    "collector paused",
    "the garbage collector off while aiocoll (and torch, if not yet) imports and while aiocoll run reads "
    "torchrun's parser, what they made then put with the oldest objects: with torch loaded each full "
    "collection walks torch's objects (50-80 ms) and finds next to nothing",
    lambda key: [_patches.Step("gc.disable", _pause)],
    ["gc.disable"],
)
