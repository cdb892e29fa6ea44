"""The plain hooks: allreduce_hook (an average, what no hook does) and the
16-bit ones, fp16_compress and bf16_compress: float32 buckets travel as
16-bit through cring's wire compression (the engine converts while packing,
as Compression.fp16/bf16 do), other floating buckets are cast here. Each
divides by the number of ranks before the sum, as torch's do, so a 16-bit
sum cannot overflow where the average would not."""

from __future__ import annotations

from typing import Any

import torch

import cring

from ._state import bucket_process_set, resolve_process_set


def allreduce_hook(state: Any, bucket: Any) -> Any:
    """Average the bucket over the ranks (state: a cring.ProcessSet, or None
    for the optimizer's): the same result as no hook, as torch's allreduce_hook."""
    ps = bucket_process_set(resolve_process_set(state, None, "allreduce_hook"), bucket)
    return cring.allreduce_async_(
        bucket.buffer(), op=cring.Average, name=f"{bucket.name()}.allreduce", process_set=ps
    )


def _cast_hook(dtype: torch.dtype, wire: Any, label: str, state: Any, bucket: Any) -> Any:
    ps = bucket_process_set(resolve_process_set(state, None, f"{label}_compress"), bucket)
    buf = bucket.buffer()
    name = f"{bucket.name()}.{label}"
    scale = 1.0 / ps.size()
    if buf.dtype == torch.float32:  # the engine casts on the way: no copy here
        return cring.allreduce_async_(
            buf, op=cring.Sum, name=name, compression=wire, prescale_factor=scale, process_set=ps
        )
    if buf.dtype == dtype or not buf.dtype.is_floating_point:
        return cring.allreduce_async_(buf, op=cring.Average, name=name, process_set=ps)
    return _cast_stages(buf.to(dtype).mul_(scale), name, ps)


def _cast_stages(wire: torch.Tensor, name: str, ps: Any) -> Any:
    out = yield cring.allreduce_async_(wire, op=cring.Sum, name=name, process_set=ps)
    return out  # the runner copies (and casts) it into the bucket


def fp16_compress(state: Any, bucket: Any) -> Any:
    """Average the bucket in float16 (half the bytes of float32); state: a
    cring.ProcessSet or None. torch's fp16_compress_hook."""
    return _cast_hook(torch.float16, cring.Compression.fp16, "fp16", state, bucket)


def bf16_compress(state: Any, bucket: Any) -> Any:
    """Average the bucket in bfloat16 (float32's range, 8 bits of mantissa);
    state: a cring.ProcessSet or None. torch's bf16_compress_hook."""
    return _cast_hook(torch.bfloat16, cring.Compression.bf16, "bf16", state, bucket)
