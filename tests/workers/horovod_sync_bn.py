"""One rank of test_torch_horovod_parity.py's SyncBatchNorm check: Horovod's
test_horovod_sync_batch_norm (test/parallel/test_torch.py) on CPU tensors:
each rank normalises its one sample of [4, 2] and [4, 1] values, compared
with torch's BatchNorm1d over every rank's samples (outputs, running
statistics, gradients). Where BatchNorm1d refuses the batch (one value per
channel in all, as at world size 1 with [4, 1]), records whether
SyncBatchNorm refuses it the same way (what Horovod's does: at one rank it is
F.batch_norm). Writes <outdir>/rank<R>.json. argv: outdir."""

import json
import sys
from pathlib import Path

import torch

import cring.torch as hvd


def main() -> None:
    outdir = Path(sys.argv[1])
    hvd.init()
    r, p = hvd.rank(), hvd.size()
    ts_list = [
        torch.stack(
            [
                torch.tensor(
                    [[q, q + 1], [q * 2, q * 2 + 1], [q * 3, q * 3 + 1], [q * 4, q * 4 + 1]]
                )
                for q in range(p)
            ]
        ),
        torch.stack(
            [torch.tensor([[q + 1], [q * 2 + 1], [q * 3 + 1], [q * 4 + 1]]) for q in range(p)]
        ),
    ]
    cases = []
    for k, ts in enumerate(ts_list):
        sync_bn = hvd.SyncBatchNorm(num_features=4)
        bn = torch.nn.BatchNorm1d(num_features=4)
        ts = ts.float()
        ts1 = ts.clone().requires_grad_()
        ts2 = ts.clone().requires_grad_()
        try:
            bn_out = bn(ts2)
        except ValueError as e:
            try:
                sync_bn(ts1[r].unsqueeze(0))
                cases.append({"case": k, "refused": str(e), "sync_refused": None})
            except ValueError as e2:
                cases.append({"case": k, "refused": str(e), "sync_refused": str(e2)})
            continue
        sync_out = sync_bn(ts1[r].unsqueeze(0))
        sync_out.sum().backward()
        bn_out.mean(dim=0).sum().backward()
        checks = {
            "out": torch.allclose(sync_out, bn_out[r].unsqueeze(0), atol=1e-6),
            "running_mean": torch.allclose(sync_bn.running_mean, bn.running_mean, atol=1e-6),
            "running_var": torch.allclose(sync_bn.running_var, bn.running_var, atol=1e-6),
            "weight_grad": torch.allclose(
                hvd.allreduce(sync_bn.weight.grad, name=f"w{k}"), bn.weight.grad, atol=1e-6
            ),
            "bias_grad": torch.allclose(
                hvd.allreduce(sync_bn.bias.grad, name=f"b{k}"), bn.bias.grad, atol=1e-6
            ),
            "input_grad": torch.allclose(
                hvd.allreduce(ts1.grad, name=f"x{k}"), ts2.grad, atol=1e-6
            ),
        }
        cases.append({"case": k, "checks": checks})
    hvd.shutdown()
    (outdir / f"rank{r}.json").write_text(json.dumps({"rank": r, "size": p, "cases": cases}))


if __name__ == "__main__":
    main()
