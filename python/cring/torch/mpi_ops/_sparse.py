"""Horovod's sparse_allreduce_async: a sparse (COO) tensor reduced over the
ranks by allgathering its indices and values (duplicate indices then sum,
as torch's COO tensors do). Built on _collectives' allgather; it starts no
collective of its own kind and imports nothing above _collectives.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._basics import Average, ReduceOp, Sum, global_process_set
from ._collectives import allgather_async, synchronize


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: Any, process_set: Any = global_process_set
) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO `tensor` (same shape on every rank; any
    number of non-zeros, 0 included) and return a function that waits and
    returns the result: a sparse tensor (not coalesced) holding every rank's
    entries, values divided by the set's size for op=Average. Only Average
    and Sum are defined for sparse tensors (ValueError otherwise). Two
    allgathers, named "<name>.indices" and "<name>.values"; call the
    returned function once."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError(
            f"sparse_allreduce_async: expected a sparse COO tensor, got "
            f"{type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else tensor.layout}"
        )
    op = ReduceOp(int(op))
    if op not in (Average, Sum):
        raise ValueError(
            f"sparse_allreduce_async: op must be Average or Sum for sparse tensors, got {op.name}"
        )
    # allgather concatenates along dimension 0: gather indices as [nnz, sparse_dims]
    indices = tensor._indices().transpose(0, 1).contiguous()
    values = tensor._values().contiguous()
    indices_handle = allgather_async(indices, name=f"{name}.indices", process_set=process_set)
    values_handle = allgather_async(values, name=f"{name}.values", process_set=process_set)
    shape = tensor.shape

    def wait() -> torch.Tensor:
        gathered_values = synchronize(values_handle)
        gathered_indices = synchronize(indices_handle)
        if op == Average:
            gathered_values = gathered_values / process_set.size()
        return torch.sparse_coo_tensor(
            gathered_indices.transpose(0, 1), gathered_values, shape, check_invariants=False
        )

    return wait
