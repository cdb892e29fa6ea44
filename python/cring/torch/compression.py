"""horovod.torch.compression's module path on cring: the Compressor interface
and Compression.none/fp16/bf16, defined in cring.torch.mpi_ops._compression
(the same objects)."""

from .mpi_ops._compression import (
    BF16Compressor,
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
