"""cring.torch.SyncBatchNorm: batch normalisation whose statistics cover the
whole global batch (every rank's slice), a drop-in for hvd.SyncBatchNorm and
torch.nn.SyncBatchNorm. One fused allreduce per direction; it never touches
torch.distributed and holds no state besides the module's own buffers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from . import mpi_ops

__all__ = ["SyncBatchNorm"]


def _reduce_dims(x: torch.Tensor) -> list:
    """Every dimension but the channel dimension (1)."""
    return [0, *range(2, x.dim())]


def _channel_shape(x: torch.Tensor) -> list:
    """Shape that broadcasts a per-channel vector against x: [1, C, 1, ...]."""
    return [1, x.shape[1], *([1] * (x.dim() - 2))]


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over the global batch.

    Forward: each rank computes its per-channel count n_i, mean m_i and biased
    variance v_i (torch.var_mean, numerically stable), then ONE float64
    allreduce (Sum) of [n_i*m_i (C), n_i*(v_i + m_i^2) (C), n_i (1)] gives the
    global count N, mean M = sum(n_i m_i) / N and biased variance
    sum(n_i (v_i + m_i^2)) / N - M^2 (the cancellation happens in float64 on
    per-channel scalars). Ranks with uneven or empty batches weigh exactly by
    their count.

    Backward: with x_hat = (x - M) * invstd and dy the output gradient, ONE
    allreduce (Sum) of [sum(dy), sum(dy * x_hat)] (2C) gives
    dx = w * invstd * (dy - sum(dy)/N - x_hat * sum(dy * x_hat)/N).
    The weight and bias gradients stay local (sum(dy * x_hat), sum(dy)) as in
    torch and Horovod: the optimizer's allreduce combines them.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        running_mean: Optional[torch.Tensor],
        running_var: Optional[torch.Tensor],
        eps: float,
        momentum: float,
        process_set: Any,
    ) -> torch.Tensor:
        x = x.contiguous()
        channels = x.shape[1]
        dims = _reduce_dims(x)
        local_count = x.numel() // channels if channels else 0
        stats_dtype = torch.float64
        if local_count > 0:
            var, mean = torch.var_mean(x, dim=dims, unbiased=False)
            mean64, var64 = mean.to(stats_dtype), var.to(stats_dtype)
        else:
            mean64 = var64 = torch.zeros(channels, dtype=stats_dtype, device=x.device)
        packed = torch.cat(
            [
                mean64 * local_count,
                (var64 + mean64 * mean64) * local_count,
                torch.tensor([float(local_count)], dtype=stats_dtype, device=x.device),
            ]
        )
        total = mpi_ops.allreduce(
            packed, op=mpi_ops.Sum, name="sync_batch_norm.forward", process_set=process_set
        )
        count = float(total[-1].item())
        if count <= 1:
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel when training over "
                f"all ranks, got {int(count)} (input size {list(x.shape)} on this rank)"
            )
        global_mean = total[:channels] / count
        global_var = (total[channels : 2 * channels] / count - global_mean * global_mean).clamp_(
            min=0
        )
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                unbiased = global_var * (count / (count - 1))
                running_mean.mul_(1 - momentum).add_(
                    global_mean.to(running_mean.dtype), alpha=momentum
                )
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        compute = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        mean_c = global_mean.to(compute)
        invstd_c = torch.rsqrt(global_var + eps).to(compute)
        shape = _channel_shape(x)
        x_hat = (x.to(compute) - mean_c.view(shape)) * invstd_c.view(shape)
        y = x_hat
        if weight is not None:
            y = y * weight.to(compute).view(shape)
        if bias is not None:
            y = y + bias.to(compute).view(shape)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.count = count
        ctx.process_set = process_set
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:  # type: ignore[override]
        x, weight, mean_c, invstd_c = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        compute = mean_c.dtype
        shape = _channel_shape(x)
        dims = _reduce_dims(x)
        dy_c = dy.contiguous().to(compute)
        x_hat = (x.to(compute) - mean_c.view(shape)) * invstd_c.view(shape)
        channels = x.shape[1]
        if x.numel():
            sum_dy = dy_c.sum(dim=dims)
            sum_dy_xhat = (dy_c * x_hat).sum(dim=dims)
        else:
            sum_dy = sum_dy_xhat = torch.zeros(channels, dtype=compute, device=x.device)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and need_weight else None
        grad_bias = sum_dy.to(dy.dtype) if ctx.has_bias and need_bias else None
        grad_input = None
        if need_input:
            total = mpi_ops.allreduce(
                torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64),
                op=mpi_ops.Sum,
                name="sync_batch_norm.backward",
                process_set=ctx.process_set,
            ).to(compute)
            mean_dy = (total[:channels] / ctx.count).view(shape)
            mean_dy_xhat = (total[channels:] / ctx.count).view(shape)
            scale = invstd_c.view(shape)
            if weight is not None:
                scale = scale * weight.to(compute).view(shape)
            grad_input = (scale * (dy_c - mean_dy - x_hat * mean_dy_xhat)).to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over the global batch: in training, every rank
    normalises with the mean and variance of all ranks' inputs together, and
    the input gradient accounts for every rank's outputs, exactly as one
    process running BatchNorm on the concatenated batch (uneven per-rank batch
    sizes are weighted by their counts). Use it when each rank holds only a
    few samples.

        model = cring.torch.SyncBatchNorm.convert_sync_batchnorm(model)

    Arguments are torch.nn.SyncBatchNorm's (and hvd.SyncBatchNorm's):
    num_features (C of an (N, C, ...) input), eps, momentum (None: the
    cumulative average), affine, track_running_stats, device, dtype.
    process_group must be None (cring does not use torch.distributed);
    process_set (a cring.torch ProcessSet) picks the ranks that share
    statistics, all of them by default.

    Per training step it runs one allreduce of 2C+1 float64 values in forward
    and one of 2C in backward (only when the input needs a gradient); every
    rank in the set must call forward (and backward) the same number of
    times. In eval mode with running statistics (the default) it uses them
    and communicates nothing; running_var is updated with the unbiased
    variance of the global batch, as in torch. With one rank it is plain
    batch norm. The weight and bias gradients are this rank's own (reduce
    them with DistributedOptimizer, as for every parameter). Any device torch
    supports; inputs of at least 2 dimensions.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
        process_set: Any = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        if process_group is not None:
            raise ValueError(
                "cring.torch.SyncBatchNorm does not take a torch.distributed process_group; "
                "pass process_set= (a cring.torch ProcessSet) to sync over some ranks"
            )
        self.process_set = process_set  # None: the global set (resolved per call: copies keep it)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _averaging_factor(self) -> float:
        """torch's momentum rule: `momentum`, or 1/steps when it is None."""
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else float(self.momentum)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm: input has {input.shape[1]} channels (dimension 1), "
                f"expected num_features={self.num_features}"
            )
        factor = self._averaging_factor()
        use_batch_stats = self.training or self.running_mean is None
        process_set = mpi_ops.global_process_set if self.process_set is None else self.process_set
        sync = self.training and mpi_ops.is_initialized() and process_set.size() > 1
        if not sync:
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight,
                self.bias,
                use_batch_stats,
                factor,
                self.eps,
            )
        return _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps,
            factor,
            process_set,
        )

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: Any = None, process_set: Any = None
    ) -> torch.nn.Module:
        """`module` with every BatchNorm1d/2d/3d (any torch _BatchNorm, a
        torch.nn.SyncBatchNorm too) replaced, recursively, by a cring
        SyncBatchNorm sharing its weight, bias and running-statistics tensors
        and keeping its training flag. Returns the new root when `module`
        itself is a batch norm; otherwise converts `module` in place and
        returns it."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group=process_group,
                process_set=process_set,
            )
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(
                name, cls.convert_sync_batchnorm(child, process_group, process_set)
            )
        return converted
