"""What every module of ``aiocoll._torch`` shares: the tested range, the error a broken
assumption raises, and torch.distributed's private modules (all releases tested)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.distributed_c10d

from .._errors import TorchCompatError

__all__ = ["TESTED"]

TESTED = ("2.10", "2.15")
"""The oldest and newest torch releases aiocoll is tested on (CI runs both, and 2.13)."""

# typed as Any: their stubs differ from release to release, and every use is checked here
_c10d: Any = torch.distributed.distributed_c10d
_C: Any = torch._C._distributed_c10d


def _broken(what: str) -> TorchCompatError:
    return TorchCompatError(
        f"aiocoll relies on {what}, which torch {torch.__version__} does not provide; "
        f"aiocoll is tested on torch {TESTED[0]} to {TESTED[1]}"
    )


def _need(obj: object, name: str, what: str) -> Any:
    """``getattr(obj, name)``, or a TorchCompatError naming the assumption."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _broken(what) from None
