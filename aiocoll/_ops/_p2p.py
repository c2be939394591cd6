"""Point-to-point: a send and the recv it matches, and the copy between them."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ._base import (
    P2PRecord,
    _Base,
    _fmt,
    _no_grad,
    _shape,
)

__all__ = ["Recv", "Send", "check_transfer", "transfer"]


@dataclass(slots=True)
class Send(_Base):
    name: ClassVar[str] = "send"
    tensor: torch.Tensor
    dst: int
    tag: int

    def describe(self) -> str:
        return str(self.record_info())

    def record_info(self) -> P2PRecord:
        """This call as records show it (p2p calls are recorded one by one, not by signature)."""
        return P2PRecord(self.name, self.tensor.dtype, _shape(self.tensor), self.dst, self.tag)

    def signature(self) -> Hashable:
        return (self.name, self.dst, self.tag)


@dataclass(slots=True)
class Recv(_Base):
    name: ClassVar[str] = "recv"
    tensor: torch.Tensor
    src: int | None
    tag: int

    def describe(self) -> str:
        return str(self.record_info())

    def record_info(self) -> P2PRecord:
        """This call as records show it (p2p calls are recorded one by one, not by signature)."""
        return P2PRecord(self.name, self.tensor.dtype, _shape(self.tensor), self.src, self.tag)

    def signature(self) -> Hashable:
        return (self.name, self.src, self.tag)


def check_transfer(send: Send, recv: Recv) -> str | None:
    """Why a matched send and recv cannot transfer, or None.

    The dtypes and element counts must agree; shapes may differ, as with gloo and NCCL,
    which move the elements in order (torch 2.10's pipelining sends a 0-d loss into a
    receive buffer of shape [1]).
    """
    if send.tensor.dtype != recv.tensor.dtype or send.tensor.numel() != recv.tensor.numel():
        return f"send of {_fmt(send.tensor)} matched a recv into {_fmt(recv.tensor)}"
    return None


@_no_grad
def transfer(send: Send, recv: Recv) -> None:
    """Move a matched send's data into its recv (elements in order, whatever the shapes)."""
    recv.tensor.copy_(send.tensor.reshape(recv.tensor.shape))
