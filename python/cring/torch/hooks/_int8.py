"""An 8-bit communication hook with error feedback (Int8State, int8_hook).

Each bucket is cut into blocks of `block_size` elements, each sent as int8
with its own float32 scale (the block's largest magnitude / 127). Summing
int8 on the wire would overflow (or, with the range cut to 127 / ranks,
lose log2(ranks) bits), so the average is done in two exchanges that never
add int8 values together:

  1. an alltoall: rank j receives every rank's int8 blocks of the j-th
     slice of the bucket, dequantises and averages them in float32;
  2. an allgather of each rank's averaged slice, quantised again.

Each rank sends (P-1)/P of the bucket's blocks in each exchange, as a ring
allreduce of int8 would: about a quarter of float32's bytes at any number of
ranks. Error feedback covers both quantisations: what step 1 lost on this
rank's gradient, and what step 2 lost on the slice this rank averaged, are
added back the next step.
"""

from __future__ import annotations

from typing import Any

import torch

import cring

from ._state import ErrorOwner, bucket_process_set, check_length, moved, resolve_process_set

_QMAX = 127.0
_SCALE_BYTES = 4  # a float32 scale after each block's values


class Int8State:
    """Settings and error feedback of int8_hook.

    Arguments:
        process_set: the ranks to average over; None: the optimizer's (or
            strategy's). process_group= is accepted as its alias.
        block_size: elements per scale (each block costs block_size + 4
            bytes on the wire); smaller follows the gradients' magnitudes
            more closely.
        use_error_feedback: carry what quantisation lost into the next step.
        start_iter: steps of plain (float) averaging first.

    state_dict()/load_state_dict(): the step count and this rank's error
    feedback (kept only by the rank that made it: see docs/hooks.md)."""

    def __init__(
        self,
        process_set: Any = None,
        block_size: int = 1024,
        use_error_feedback: bool = True,
        start_iter: int = 0,
        *,
        process_group: Any = None,
    ) -> None:
        self.process_set = resolve_process_set(process_set, process_group, "Int8State")
        if int(block_size) < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = int(block_size)
        self.use_error_feedback = bool(use_error_feedback)
        self.start_iter = int(start_iter)
        self.iter = 0
        self.error_dict: dict = {}  # bucket index -> this rank's residual of step 1
        self.slice_error_dict: dict = {}  # bucket index -> residual of step 2 on our slice
        self._owner = ErrorOwner()

    def state_dict(self) -> dict:
        return {
            "iter": self.iter,
            "error": dict(self.error_dict),
            "slice_error": dict(self.slice_error_dict),
            "error_owner": self._owner.stamp(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.iter = int(state["iter"])
        keep = self._owner.take(state.get("error_owner"))
        self.error_dict = dict(state["error"]) if keep else {}
        self.slice_error_dict = dict(state["slice_error"]) if keep else {}

    def __repr__(self) -> str:
        return f"Int8State(block_size={self.block_size}, iter={self.iter})"


def quantize(blocks: torch.Tensor) -> torch.Tensor:
    """(k, B) float32 -> (k, B + 4) int8 rows: the values scaled to
    [-127, 127] and rounded, then the block's scale's four bytes. A block
    holding inf or NaN gets a non-finite scale, so it dequantises to
    non-finite values (a gradient scaler still sees the overflow)."""
    k, size = blocks.shape
    peak = torch.maximum(blocks.amax(dim=1, keepdim=True), blocks.amin(dim=1, keepdim=True).neg_())
    scale = peak.div_(_QMAX).masked_fill_(peak == 0, 1.0)
    rows = torch.empty(k, size + _SCALE_BYTES, dtype=torch.int8, device=blocks.device)
    rows[:, :size] = torch.div(blocks, scale).round_().clamp_(-_QMAX, _QMAX)
    rows[:, size:] = scale.view(torch.int8)
    return rows


def dequantize(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """(k, B + 4) int8 rows -> (k, B) float32."""
    scale = rows[:, block_size:].contiguous().view(torch.float32)
    return torch.mul(rows[:, :block_size], scale)


def _blocks_per_rank(blocks: int, world: int) -> list:
    return [blocks // world + (1 if j < blocks % world else 0) for j in range(world)]


def int8_hook(state: Int8State, bucket: Any) -> Any:
    """Average the bucket as int8 blocks with error feedback (two exchanges:
    see the module's docstring); plain averaging for state.start_iter steps."""
    ps = bucket_process_set(state.process_set, bucket)
    if state.iter < state.start_iter:
        if bucket.is_last():
            state.iter += 1
        return cring.allreduce_async_(
            bucket.buffer(), op=cring.Average, name=f"{bucket.name()}.allreduce", process_set=ps
        )
    return _int8_stages(state, bucket, ps)


def _int8_stages(state: Int8State, bucket: Any, ps: Any) -> Any:
    world, rank = ps.size(), ps.rank()
    index, buf, name = bucket.index(), bucket.buffer(), bucket.name()
    n, size = buf.numel(), state.block_size
    blocks = -(-n // size)
    if n == blocks * size:  # whole blocks: work in the bucket (its result overwrites it)
        x = buf if buf.dtype == torch.float32 else buf.float()
    else:
        x = torch.empty(blocks * size, device=buf.device, dtype=torch.float32)
        x[:n] = buf
        x[n:] = 0
    if state.use_error_feedback:
        error = state.error_dict.get(index)
        if error is not None:
            check_length(error, n, "Int8State's error feedback", index)
            x[:n] += moved(error, x)
    rows = quantize(x.view(blocks, size))
    if state.use_error_feedback:
        state.error_dict[index] = (x - dequantize(rows, size).view(-1))[:n]

    # 1: slice j of every rank's blocks to rank j, averaged there in float32
    counts = _blocks_per_rank(blocks, world)
    received, _ = yield cring.alltoall_async(
        rows, splits=counts, name=f"{name}.int8.scatter", process_set=ps
    )
    mine = counts[rank]
    average = dequantize(received, size).view(world, mine, size).sum(dim=0).div_(world)
    if state.use_error_feedback:
        slice_error = state.slice_error_dict.get(index)
        if slice_error is not None:
            check_length(slice_error, mine * size, "Int8State's slice error feedback", index)
            average += moved(slice_error, average).view(mine, size)
    slice_rows = quantize(average)
    if state.use_error_feedback:
        state.slice_error_dict[index] = (average - dequantize(slice_rows, size)).view(-1)
        state._owner.wrote()

    # 2: every rank's averaged slice to every rank
    gathered = yield cring.allgather_async(slice_rows, name=f"{name}.int8.gather", process_set=ps)
    buf.copy_(dequantize(gathered, size).view(-1)[:n])
    return None
