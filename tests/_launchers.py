"""The launchers the conformance tests compare: torchrun (this torch's) and ``aiocoll run``, both modes."""

from __future__ import annotations

import sys

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "aiocoll": [sys.executable, "-m", "aiocoll", "run"],
}
PROCESSES = [sys.executable, "-m", "aiocoll", "run", "--processes"]  # (its processes mode, forked ranks)
