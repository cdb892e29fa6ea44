"""What the built-in hooks' states share: the process set a hook averages
over, and the rule for error-feedback buffers in a state_dict (they are this
rank's own residuals, so only the process or rank that made them takes them
back). Runs no collective."""

from __future__ import annotations

import uuid
from typing import Any

import torch

import cring


def resolve_process_set(process_set: Any, process_group: Any, what: str) -> Any:
    """The process set given as process_set= or as torch's process_group=
    (None: the optimizer's or strategy's, which the bucket carries)."""
    if process_group is not None:
        if process_set is not None:
            raise ValueError(f"{what}: give process_set or process_group, not both")
        process_set = process_group
    if process_set is not None and not isinstance(process_set, cring.ProcessSet):
        raise TypeError(
            f"{what}: process_set must be a cring.ProcessSet or None (the optimizer's), got "
            f"{type(process_set).__name__}; torch process groups do not apply to cring"
        )
    return process_set


def bucket_process_set(process_set: Any, bucket: Any) -> Any:
    """The set to reduce over: the state's, else the bucket's, else the global one."""
    if process_set is not None:
        return process_set
    return getattr(bucket, "process_set", None) or cring.global_process_set


def moved(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` on `like`'s device and dtype (a state loaded from a checkpoint may sit on the CPU)."""
    if t.device != like.device or t.dtype != like.dtype:
        return t.to(device=like.device, dtype=like.dtype)
    return t


def check_length(t: torch.Tensor, n: int, what: str, index: int) -> None:
    if t.numel() != n:
        raise ValueError(
            f"{what} for bucket {index} holds {t.numel()} elements but the bucket now needs {n}: "
            "the state was made for another model or bucket layout (CRING_BUCKET_BYTES)"
        )


class ErrorOwner:
    """Stamps error-feedback buffers with who made them. A state_dict loaded
    back into the same state object (an elastic restore), or into the same
    rank of a job of the same size (a checkpoint resumed), keeps them; one
    from another rank (an elastic sync from rank 0, rank 0's checkpoint on
    the other ranks) starts them afresh at zero."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.rank_size: tuple = (None, None)  # where the buffers were last written

    def wrote(self) -> None:
        """A hook wrote this rank's buffers (called while cring runs)."""
        self.rank_size = (cring.rank(), cring.size())

    def stamp(self) -> dict:
        rank, size = self.rank_size
        return {"token": self.token, "rank": rank, "size": size}

    def keeps(self, stamp: Any) -> bool:
        if not isinstance(stamp, dict):
            return False
        if stamp.get("token") == self.token:
            return True
        if not cring.is_initialized() or stamp.get("rank") is None:
            return False
        return (stamp.get("rank"), stamp.get("size")) == (cring.rank(), cring.size())

    def take(self, stamp: Any) -> bool:
        """keeps(stamp), remembering where kept buffers came from."""
        if not self.keeps(stamp):
            return False
        self.rank_size = (stamp.get("rank"), stamp.get("size"))
        return True
