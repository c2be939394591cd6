"""torch's core: the grad mode and foreach copy aiocoll's ops use, and the lazy
process-wide set-ups (autograd's device threads, the no-op CUDA guard) that crash when
rank threads race to them (torch 2.10-2.15)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ._compat import _need

__all__ = ["foreach_copy_", "prepare_for_rank_threads", "set_grad_enabled", "version_of"]


# -- plain private helpers (all releases) ---------------------------------------------

# Setting grad mode directly costs 0.2 us against 1.3 for torch.no_grad() (per op).
set_grad_enabled: Callable[[bool], None] = _need(torch._C, "_set_grad_enabled", "torch._C._set_grad_enabled")
# One kernel launch for many copies (the public loop of copy_ is 3x slower at W=64).
foreach_copy_: Callable[..., None] = _need(torch, "_foreach_copy_", "torch._foreach_copy_")


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter (``Tensor._version``), which every in-place write to it bumps:
    how a staged copy tells whether an op wrote to it (all releases)."""
    return t._version


# -- process-wide lazy set-ups that must not first happen in rank threads -----------

_prepared = False


def prepare_for_rank_threads() -> None:
    """Do, once per process and from the calling thread, what crashes when rank threads race to it.

    - The autograd engine starts its device threads on the first backward, whatever
      the thread. On torch 2.10, when that was a rank thread after a DTensor world had
      run, the interpreter crashed (segmentation fault in ``Engine::start_device_threads``).
      A tiny backward here starts them.
    - ``FakeTensorMode`` (DTensor's sharding propagation, from ``parallelize_module``)
      installs a no-op CUDA device guard on its first use where CUDA is unavailable
      (``torch._C._ensureCUDADeviceGuardSet``). On torch 2.10's CUDA build without a GPU,
      rank threads doing that at once crashed in ``c10::impl::ensureCUDADeviceGuardSet``;
      done here first, their calls find it set. (See ``_install_cuda_guard`` for which
      thread installs it.)

    Costs about 0.1 ms, once, whatever the caller's grad mode.
    """
    global _prepared
    if _prepared:
        return
    # whatever grad mode the caller is in (torch.no_grad(), inference mode)
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.ones(1, requires_grad=True)
        torch.autograd.backward((x * 2).sum())
    ensure_guard = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure_guard is not None and not torch.cuda.is_available():
        _install_cuda_guard(ensure_guard)
    _prepared = True


def _install_cuda_guard(ensure_guard: Callable[[], None]) -> None:
    """Install the no-op CUDA guard from a thread that lives as long as the process.

    torch 2.10 keeps the guard it installs in a ``thread_local`` of the installing
    thread (pytorch#178950): installed from a thread that then ends (a world run from a
    helper thread, as the pytest plugin and the process harness do), it is freed while
    torch still points at it, and the next ``FakeTensorMode`` crashes. The main thread
    installs it itself; any other caller hands it to a thread that never ends.
    """
    if threading.current_thread() is threading.main_thread():
        ensure_guard()
        return
    installed = threading.Event()

    def keeper() -> None:
        try:
            ensure_guard()
        finally:
            installed.set()
        threading.Event().wait()  # never set: the guard lives as long as the process

    threading.Thread(target=keeper, name="aiocoll CUDA guard keeper", daemon=True).start()
    installed.wait()
