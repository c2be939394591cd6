"""CUDA's device model on a machine without a GPU, for the tests of where ranks' devices go.

What it stands in for, as CUDA and torch keep it: a fixed number of devices; the current
device is per host thread (0 in a thread that never chose one: ``cudaSetDevice`` is per
thread); initialisation is per process, and both choosing a device and asking for the
current one initialise (``torch.cuda.current_device`` runs ``_lazy_init``). Nothing runs on
a device: tensors stay on the CPU.

In-process (the test's monkeypatch undoes it)::

    FakeDevices(4).install(monkeypatch.setattr)

In subprocesses (``torchrun``'s workers, ``aiocoll run``): ``sitecustomize_dir(tmp, 4)``
gives a folder to put first on ``PYTHONPATH``, whose ``sitecustomize`` installs it at
start-up, before the launcher or the script imports anything else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["FakeDevices", "sitecustomize_dir"]


class FakeDevices:
    """``count`` CUDA devices: current device per thread, initialisation per process."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.initialized = False
        self._thread = threading.local()

    def __repr__(self) -> str:
        return f"FakeDevices(count={self.count}, initialized={self.initialized})"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def is_initialized(self) -> bool:
        return self.initialized

    def current_device(self) -> int:
        self.initialized = True
        return int(getattr(self._thread, "device", 0))

    def set_device(self, device: int | str | torch.device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index is None or not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({device!r} of {self.count} devices)")
        self.initialized = True
        self._thread.device = index

    def memory_allocated(self, device: int | str | torch.device | None = None) -> int:
        # (nothing runs on a fake device; and on a machine with fewer real GPUs than the
        # fake's count, torch's own answer for a fake index raises "Invalid device argument")
        return 0

    def install(self, setattr_: Callable[[object, str, object], None] = setattr) -> None:
        """Put the model in place of torch's (``setattr_``: e.g. a monkeypatch's, to undo it)."""
        for name in (
            "is_available",
            "device_count",
            "is_initialized",
            "current_device",
            "set_device",
            "memory_allocated",
        ):
            setattr_(torch.cuda, name, getattr(self, name))
        setattr_(torch.accelerator, "set_device_index", self.set_device)


_SITECUSTOMIZE = """\
import sys
sys.path.insert(0, {tests!r})
import _fake_devices
_fake_devices.FakeDevices({count}).install()
del sys.path[0]
"""


def sitecustomize_dir(where: Path, count: int) -> Path:
    """A folder whose ``sitecustomize`` installs ``FakeDevices(count)`` in each Python with it on ``PYTHONPATH``."""
    folder = where / "fake_devices"
    folder.mkdir(exist_ok=True)
    text = _SITECUSTOMIZE.format(tests=str(Path(__file__).resolve().parent), count=count)
    (folder / "sitecustomize.py").write_text(text, encoding="utf-8")
    return folder
