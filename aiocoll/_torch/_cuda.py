"""CUDA devices per rank: ``DeviceMesh`` sets a rank thread's device as it would a
process's, and a rank's own choice is noted (torch 2.10-2.15)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from .. import _current
from .._patches import Attr

__all__ = ["rank_devices"]


# whether the calling thread chose its CUDA device, as a process does once (a rank's thread is its own)
_DEVICE_CHOSEN = _current.Facet("CUDA device chosen", False, carried=False)


class _RankCuda:
    """``torch.cuda`` as ``DeviceMesh`` sees it from a sync rank's thread.

    DeviceMesh sets the process's CUDA device (to ``LOCAL_RANK``, else the rank modulo
    the GPUs) only "if the user has not set it", which it reads as
    ``torch.cuda.is_initialized()`` (2.10-2.15: ``_setup_world_group_and_device``): a
    fact of the process. In one process the first rank to touch CUDA initialises it for
    all, and every other rank would stay on cuda:0. CUDA's current device is per thread,
    as it is per process under torchrun, so the question goes to the rank: it has set its
    device if it chose one (``set_device``) or is on a device other than 0.
    """

    __slots__ = ("_cuda",)

    def __init__(self, cuda: ModuleType) -> None:
        self._cuda = cuda

    def __getattr__(self, name: str) -> object:
        return getattr(self._cuda, name)

    def is_initialized(self) -> bool:
        cuda = self._cuda
        # (current_device() would initialise CUDA: asked only once it is)
        return bool(cuda.is_initialized()) and (_DEVICE_CHOSEN.get() or cuda.current_device() != 0)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self._cuda.__name__}>"


def rank_devices(own_device: Callable[[], bool]) -> list[Attr]:
    """The changes that let ``DeviceMesh`` set each sync rank's CUDA device as it would a process's.

    ``own_device()`` says whether the caller is a rank with a thread of its own (whose
    current CUDA device is its own). See ``_RankCuda``; choices are noted through
    ``torch.cuda.set_device`` and ``torch.accelerator.set_device_index`` while in force.
    """
    from torch.distributed import device_mesh

    out: list[Attr] = []
    real_handle = getattr(device_mesh, "_get_device_handle", None)  # (absent without torch.distributed)
    if real_handle is not None:

        @functools.wraps(real_handle)
        def device_handle(device_type: str = "cuda") -> object:
            handle = real_handle(device_type)
            return _RankCuda(handle) if handle is torch.cuda and own_device() else handle

        out.append(Attr(device_mesh, "_get_device_handle", device_handle))

    def noting(real: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(real)
        def choose(*args: object, **kwargs: object) -> None:
            real(*args, **kwargs)
            _DEVICE_CHOSEN.set(True)

        return choose

    for module, name in ((torch.cuda, "set_device"), (getattr(torch, "accelerator", None), "set_device_index")):
        real = getattr(module, name, None)
        if real is not None:
            out.append(Attr(module, name, noting(real)))
    return out
