"""Horovod's compression for cring.torch: the Compressor interface, its
none/fp16/bf16 classes and the planning that sends float32 tensors to cring's
wire compression instead of casting them in Python. Runs no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import cring


class Compressor:
    """Horovod's compression interface: compress(tensor) -> (tensor, ctx)
    before the allreduce, decompress(tensor, ctx) -> tensor after it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Floating-point tensors travel as `_dtype` and are cast back after.
    In allreduce, float32 tensors are not cast here: they go to cring as they
    are and travel as `_dtype` on the wire (`_wire`), which saves a copy."""

    _dtype: torch.dtype
    _wire: Any

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple:
        if tensor.dtype.is_floating_point and tensor.dtype != cls._dtype:
            return tensor.type(cls._dtype), tensor.dtype
        return tensor, tensor.dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.type(ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16."""

    _dtype = torch.float16
    _wire = cring.Compression.fp16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16."""

    _dtype = torch.bfloat16
    _wire = cring.Compression.bf16


class Compression:
    """Choices for `compression=` (as in horovod.torch): Compression.none,
    .fp16, .bf16, or any class with Horovod's compress/decompress."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


_WIRE_COMPRESSORS = (FP16Compressor, BF16Compressor)


def _plan_compression(compression: Any, tensors: Sequence[torch.Tensor]) -> tuple:
    """(compressor to run in Python or None, cring wire compression or None)."""
    if (
        compression is None
        or compression is NoneCompressor
        or compression is cring.Compression.none
    ):
        return None, None
    if isinstance(compression, cring.Compressor):  # cring's own: float32 on the wire
        return None, compression
    if compression in _WIRE_COMPRESSORS and all(t.dtype == torch.float32 for t in tensors):
        return None, compression._wire
    return compression, None


def _python_compressor(compression: Any) -> Any:
    """The compressor to run in Python for collectives without wire compression."""
    if (
        compression is None
        or compression is NoneCompressor
        or compression is cring.Compression.none
    ):
        return None
    if isinstance(compression, cring.Compressor):
        return {"float16": FP16Compressor, "bfloat16": BF16Compressor}[compression.wire_dtype]
    return compression


def _compress_all(compressor: Any, tensors: list) -> tuple:
    pairs = [compressor.compress(t) for t in tensors]
    return [p[0] for p in pairs], [p[1] for p in pairs]
