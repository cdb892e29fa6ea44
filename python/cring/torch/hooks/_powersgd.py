"""PowerSGD (Vogels et al., 2019) as a communication hook, torch DDP's
algorithm and state (PowerSGDState, powerSGD_hook): each gradient matrix M
(n x m) of a bucket is sent as two thin matrices P = M Q (n x r) and
Q = M^T P (m x r), averaged over the ranks, and rebuilt as P Q^T, with error
feedback (what compression lost is added to the next step's gradient) and
warm start (Q carried over between steps). Vectors and matrices too small to
gain are averaged uncompressed. Costs and savings: docs/hooks.md.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

import cring

from ._state import (
    ErrorOwner,
    bucket_process_set,
    check_length,
    moved,
    resolve_process_set,
)

logger = logging.getLogger("cring.torch.hooks")

_SEED_BOUND = 1_000_000_000  # the bound of each step's seed draw (torch's)


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Make the columns of each matrix of a (batch, rows, cols) stack
    orthonormal, in place: Gram-Schmidt for at most two columns or 16-bit
    dtypes, else a QR factorisation's Q."""
    cols = matrices.shape[2]
    if cols <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(cols):
            col = matrices[:, :, i : i + 1]
            norm = torch.norm(col, dim=1, keepdim=True)
            col /= norm if epsilon == 0 else norm + epsilon
            if i + 1 < cols:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
        return matrices
    r = torch.empty(matrices.shape[0], cols, cols, device=matrices.device, dtype=matrices.dtype)
    torch.linalg.qr(matrices, out=(matrices, r))
    return matrices


class PowerSGDState:
    """PowerSGD's settings and what it carries between steps (torch's
    PowerSGDState, with a cring.ProcessSet in place of the process group).

    Arguments (torch's names and defaults):
        process_set: the ranks to average over; None: the optimizer's (or
            strategy's). process_group= is accepted as its alias.
        matrix_approximation_rank: r, the columns of P and Q; 1-4 usually.
        start_powerSGD_iter: steps of plain averaging first (>= 2 with error
            feedback or warm start, as in torch).
        min_compression_rate: a matrix is compressed only if (n + m) r times
            this is below n m; others, and every vector, go uncompressed.
        use_error_feedback, warm_start: see the module's docstring.
        orthogonalization_epsilon: added to each column norm (0: none).
        random_seed: seeds the draws of each bucket's first Q (the same on
            every rank).
        batch_tensors_with_same_shape: compress same-shaped matrices of a
            bucket as one batch.

    state_dict()/load_state_dict() carry the step count, the random
    generator, P and Q, and this rank's error feedback (kept only by the
    rank that made it: see docs/hooks.md), for checkpoints and
    cring.torch.elastic.TorchState."""

    def __init__(
        self,
        process_set: Any = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
        *,
        process_group: Any = None,
    ) -> None:
        self.process_set = resolve_process_set(process_set, process_group, "PowerSGDState")
        if int(matrix_approximation_rank) < 1:
            raise ValueError(
                f"matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}"
            )
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "start_powerSGD_iter must be > 1 with use_error_feedback or warm_start "
                f"(got {start_powerSGD_iter}): the first steps are plain averages"
            )
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict = {}  # bucket index -> this rank's residual (flat, bucket-sized)
        self.p_memory_dict: dict = {}  # bucket index -> every P of the bucket, end to end
        self.q_memory_dict: dict = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, int(compression_stats_logging_frequency))
        self.next_stats_report = 0
        self._owner = ErrorOwner()

    def maybe_increase_iter(self, bucket: Any) -> None:
        """One step more once the last bucket of a step comes through."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("PowerSGD compression starts after %d steps", self.iter)

    def compression_stats(self) -> tuple:
        """(rate, elements before compression, elements after), since the start."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "iter": self.iter,
            "rng": _rng_state(self.rng),
            "p_memory": dict(self.p_memory_dict),
            "q_memory": dict(self.q_memory_dict),
            "error": dict(self.error_dict),
            "error_owner": self._owner.stamp(),
            "total_numel_before_compression": self.total_numel_before_compression,
            "total_numel_after_compression": self.total_numel_after_compression,
            "next_stats_report": self.next_stats_report,
        }

    def load_state_dict(self, state: dict) -> None:
        self.iter = int(state["iter"])
        _set_rng_state(self.rng, state["rng"])
        self.p_memory_dict = dict(state["p_memory"])
        self.q_memory_dict = dict(state["q_memory"])
        keep = self._owner.take(state.get("error_owner"))
        self.error_dict = dict(state["error"]) if keep else {}
        self.total_numel_before_compression = state["total_numel_before_compression"]
        self.total_numel_after_compression = state["total_numel_after_compression"]
        self.next_stats_report = state["next_stats_report"]

    def __repr__(self) -> str:
        return (
            f"PowerSGDState(rank={self.matrix_approximation_rank}, "
            f"start_powerSGD_iter={self.start_powerSGD_iter}, iter={self.iter})"
        )


def _rng_state(rng: np.random.RandomState) -> dict:
    """The generator's state as tensors and numbers (what torch.load(weights_only=True),
    Lightning's default, reads back)."""
    kind, keys, pos, has_gauss, cached = rng.get_state()
    return {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _set_rng_state(rng: np.random.RandomState, state: dict) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    rng.set_state((state["kind"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"]))


def powerSGD_hook(state: PowerSGDState, bucket: Any) -> Any:
    """Average the bucket with PowerSGD once state.iter reaches
    start_powerSGD_iter (plain averaging before). Three collectives per
    bucket: the uncompressed tensors and the Ps together, then the Qs."""
    ps = bucket_process_set(state.process_set, bucket)
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return cring.allreduce_async_(
            bucket.buffer(), op=cring.Average, name=f"{bucket.name()}.allreduce", process_set=ps
        )
    return _powersgd_stages(state, bucket, ps)


def _report(state: PowerSGDState, bucket: Any) -> None:
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info(
            "PowerSGD step %d: %d elements before compression, %d after (rate %.1f)",
            state.iter,
            before,
            after,
            rate,
        )
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _split(state: PowerSGDState, tensors: list) -> tuple:
    """(matrices to compress, tensors to send as they are, P length, Q length)."""
    matrices, plain = [], []
    p_len = q_len = 0
    for t in tensors:
        if t.dim() == 0:
            plain.append(t)
            state.total_numel_before_compression += 1
            state.total_numel_after_compression += 1
            continue
        m = t.view(t.shape[0], -1)
        rows, cols = m.shape
        r = min(rows, cols, state.matrix_approximation_rank)
        before, after = rows * cols, (rows + cols) * r
        state.total_numel_before_compression += before
        if after * state.min_compression_rate < before:
            matrices.append(m)
            p_len += rows * r
            q_len += cols * r
            state.total_numel_after_compression += after
        else:
            plain.append(t)
            state.total_numel_after_compression += before
    return matrices, plain, p_len, q_len


def _batches(state: PowerSGDState, matrices: list) -> tuple:
    """Same-shaped matrices grouped (in order of first appearance): the
    (batch, n, m) stacks to compress, and the groups they came from."""
    by_shape: dict = {}
    for m in matrices:
        by_shape.setdefault(tuple(m.shape), []).append(m)
    stacks, groups = [], []
    for group in by_shape.values():
        if state.batch_tensors_with_same_shape:
            stacks.append(group[0].unsqueeze(0) if len(group) == 1 else torch.stack(group))
            groups.append(group)
        else:
            for m in group:
                stacks.append(m.unsqueeze(0))
                groups.append([m])
    return stacks, groups


def _powersgd_stages(state: PowerSGDState, bucket: Any, ps: Any) -> Any:
    """The compressed average of one bucket, as stages (a generator the
    runner drives: each yield waits for collectives)."""
    world = ps.size()
    index, buf, name = bucket.index(), bucket.buffer(), bucket.name()
    device, dtype = buf.device, buf.dtype
    residual_base: Optional[torch.Tensor] = None
    if state.use_error_feedback:
        error = state.error_dict.get(index)
        if error is None:
            state.error_dict[index] = torch.zeros(buf.numel(), device=device, dtype=dtype)
        else:
            check_length(error, buf.numel(), "PowerSGDState's error feedback", index)
            buf.add_(moved(error, buf))
        residual_base = buf.detach().clone()

    matrices, plain, p_len, q_len = _split(state, bucket.gradients())
    _report(state, bucket)
    plain_flat = (
        torch.cat([t.reshape(-1) for t in plain])
        if plain
        else torch.empty(0, device=device, dtype=dtype)
    )

    fresh = not state.warm_start or index not in state.p_memory_dict
    if fresh:
        p_memory = torch.empty(p_len, device=device, dtype=dtype)
        q_memory = torch.empty(q_len, device=device, dtype=dtype)
    else:
        p_memory = moved(state.p_memory_dict[index], buf)
        q_memory = moved(state.q_memory_dict[index], buf)
        check_length(p_memory, p_len, "PowerSGDState's P", index)
        check_length(q_memory, q_len, "PowerSGDState's Q", index)
    state.p_memory_dict[index], state.q_memory_dict[index] = p_memory, q_memory

    stacks, groups = _batches(state, matrices)
    ps_, qs_ = [], []
    p_at = q_at = 0
    for stack in stacks:
        batch, n, m = stack.shape
        r = min(n, m, state.matrix_approximation_rank)
        ps_.append(p_memory[p_at : p_at + batch * n * r].view(batch, n, r))
        qs_.append(q_memory[q_at : q_at + batch * m * r].view(batch, m, r))
        p_at += batch * n * r
        q_at += batch * m * r

    if fresh:  # a new Q: the same draws on every rank, one seed per bucket and start
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(_SEED_BOUND))
            for q in qs_:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype))
                orthogonalize(q, state.orthogonalization_epsilon)
    else:
        for q in qs_:
            orthogonalize(q, state.orthogonalization_epsilon)

    for stack, q, p in zip(stacks, qs_, ps_):
        torch.bmm(stack, q, out=p)

    # stage 1: the uncompressed tensors and every P, summed
    p_handle = cring.allreduce_async_(
        p_memory, op=cring.Sum, name=f"{name}.powersgd.p", process_set=ps
    )
    if plain_flat.numel():
        plain_handle = cring.allreduce_async_(
            plain_flat, op=cring.Sum, name=f"{name}.powersgd.u", process_set=ps
        )
        yield (plain_handle, p_handle)
        plain_flat.div_(world)
        at = 0
        for t in plain:
            t.copy_(plain_flat[at : at + t.numel()].view_as(t))
            at += t.numel()
    else:
        yield p_handle

    # stage 2: Q = M^T P from the orthonormalised sum of the Ps, averaged
    for p in ps_:
        orthogonalize(p, state.orthogonalization_epsilon)
    for stack, p, q in zip(stacks, ps_, qs_):
        torch.bmm(stack.transpose(1, 2), p, out=q)
    yield cring.allreduce_async_(q_memory, op=cring.Sum, name=f"{name}.powersgd.q", process_set=ps)
    q_memory.div_(world)

    # M ~ P Q^T, written into the bucket
    for p, q, stack in zip(ps_, qs_, stacks):
        torch.bmm(p, q.transpose(1, 2), out=stack)
    for stack, group in zip(stacks, groups):
        if stack.shape[0] > 1:  # a stacked copy: back into each matrix
            for i, m in enumerate(group):
                m.copy_(stack[i])

    if residual_base is not None:
        state.error_dict[index] = residual_base - buf
        state._owner.wrote()
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    return None
