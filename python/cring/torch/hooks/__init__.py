"""cring.torch.hooks: communication hooks for
DistributedOptimizer(comm_hook=..., comm_state=...) and
CRingStrategy(comm_hook=..., comm_state=...), with torch DDP's hook API
(hook(state, bucket) -> what to wait on; docs/hooks.md):

    from cring.torch import hooks
    state = hooks.PowerSGDState(matrix_approximation_rank=4, start_powerSGD_iter=1000)
    opt = hvd.DistributedOptimizer(opt, model.named_parameters(),
                                   comm_hook=hooks.powerSGD_hook, comm_state=state)

allreduce_hook (a plain average), fp16_compress and bf16_compress (16-bit
on the wire; torch's fp16_compress_hook / bf16_compress_hook names work too),
powerSGD_hook with PowerSGDState (torch's algorithm), int8_hook with
Int8State (8-bit blocks, error feedback). The state of a hook with one is an
object with state_dict()/load_state_dict().
"""

from .._comm_hook import GradBucket
from ._default import allreduce_hook, bf16_compress, fp16_compress
from ._int8 import Int8State, int8_hook
from ._powersgd import PowerSGDState, powerSGD_hook

fp16_compress_hook = fp16_compress  # torch's names
bf16_compress_hook = bf16_compress

__all__ = [
    "GradBucket",
    "Int8State",
    "PowerSGDState",
    "allreduce_hook",
    "bf16_compress",
    "bf16_compress_hook",
    "fp16_compress",
    "fp16_compress_hook",
    "int8_hook",
    "powerSGD_hook",
]
